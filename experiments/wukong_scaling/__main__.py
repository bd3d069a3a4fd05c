r"""Dense scaling of Wukong vs DLRM and DCN-v2: quality against GFLOPs/example with a power
law per architecture, the shape of Figure 1 of Wukong (arXiv 2403.02545).

  python -m experiments.wukong_scaling      # 3 archs x 4 sizes, ~10-15 min on 2 CPU cores
  python -m experiments.wukong_scaling --sizes=3 --steps=200        # quicker look
  python -m experiments.wukong_scaling --models=wukong:l1_n4_k8_w64,wukong:l4_n32_k48_w1024
  # bigger (an accelerator): the "large" grid (Wukong rungs 0-5 of SCALING_LADDER, DLRM to
  # width 8192, DCN-v2 to 4 cross layers of rank 1024), dim 64, 20x the examples
  python -m experiments.wukong_scaling --grid=large --embedding_dim=64 --batch_size=4096 \
      --steps=4000 --num_rows=200 --eval_batches=64 --seeds=0,1 \
      --workdir=runs/wukong_scaling_large
  # the fits, findings and plot again from an earlier run's results.json (no training)
  python -m experiments.wukong_scaling --from_results=runs/wukong_scaling/results.json \
      --workdir=runs/wukong_scaling_refit
  # 10M examples per size and 3 seeds, resumable (BENCHMARKS.md "10M examples per size")
  python -m experiments.wukong_scaling --models=wukong:l1_n4_k8_w64,wukong:l2_n8_k16_w128,\
wukong:l2_n16_k24_w256,dlrm:w128,dlrm:w256,dlrm:w512 --seeds=0,1,2 --batch_size=4096 \
      --steps=2442 --data=synthetic_deep:gen=device --workdir=runs/wukong_scaling_10m --resume
  # our Wukong and FuxiCTR's WuKong (PyTorch, experiments/peers/README.md) trained side by
  # side on the same examples, sizes, optimizers and budget (fuxictr.py)
  python -m experiments.wukong_scaling --study=fuxictr --models=wukong:l2_n8_k16_w128 \
      --sparse_optimizer=adagrad --seeds=0,1 --workdir=runs/wukong_fuxictr_synth
  python -m experiments.wukong_scaling --study=fuxictr --models=wukong:l2_n8_k16_w128 \
      --sparse_optimizer=adagrad --seeds=0,1 --data=criteo:../shared/data/criteo_kaggle_sample \
      --num_rows=10000 --steps=56 --batch_size=128 --eval_batch_size=1024 --log_every=7 \
      --workdir=runs/wukong_fuxictr_criteo1
  # where a step's time goes: source / step / end to end per model and generator (profile.py)
  python -m experiments.wukong_scaling --study=profile --batch_size=4096 --steps=12 \
      --models=wukong:l1_n4_k8_w64,wukong:l2_n16_k24_w256,dlrm:w128,dlrm:w512 \
      --workdir=runs/wukong_scaling_profile

Data: `--data=synthetic_deep` (rec.data.synthetic with `teacher="deep"`: a random tanh
network of per-row latent vectors plus planted third-order products, logit scale 3.0: the
true logits' AUC is about 0.925), 26 sparse and 13 dense features, `--num_rows=20` rows per
feature. Few rows on purpose: every row is seen thousands of times, so what limits quality
at this budget is the dense part's capacity to represent the planted interactions, not
learning the embeddings (with many more rows, `--num_rows=200`, an unrecorded trial run
saw every size tie far below the ceiling).

Sizes (study.GRIDS, preset patterns of rec.configs): Wukong grows depth l, n_F = n_L,
FM rank k and MLP width together; DLRM its bottom and top MLP widths; DCN-v2 its cross
layers, cross rank and deep MLP widths. Every size trains for the same number of examples
(`--steps` x `--batch_size`) with the same optimizers and learning rates: Adam 1e-3 for
dense parameters and row-wise Adagrad 0.1 for embeddings by default (chosen over the
codebase's Adagrad 0.05 / 0.05 after an unrecorded trial run; pass those flags to compare).

Quality: test NE (primary) and AUC on `--eval_batches` x `--eval_batch_size` held-out
examples, and the same metrics of the true logits on those examples (the floor / ceiling).
Per architecture a power law NE - NE_floor = a * GFLOPs^b is fitted by least squares in log
space (study.fit_power_law; a, b, R^2) to the seed means, and likewise AUC_ceiling - AUC;
with several seeds the NE law is also fitted to each seed's runs alone (study.seed_fits:
b per seed, mean ± std). Prints the
table, the fits and sentences computed from them; writes `<workdir>/results.json` and
`<workdir>/wukong_scaling.png` (NE gap vs GFLOPs on log-log axes with the fitted lines; AUC
vs GFLOPs). The last stdout line is a JSON summary.

Measured 2026-11-21 on the 2-core CPU of BENCHMARKS.md (shared with other jobs), the
defaults: 628 s and 810 s in two runs, the same numbers both times. Test NE / AUC, smallest
-> largest size: Wukong 0.7762 -> 0.7492 / 0.8120 -> 0.8278 (0.00015 to 0.0068
GFLOPs/example), DLRM 0.7168 -> 0.6920 / 0.8461 -> 0.8583 (0.00016 to 0.0029), DCN-v2
0.7522 -> 0.6928 / 0.8259 -> 0.8579 (0.0002 to 0.0043); true logits 0.5237 / 0.9237. NE-gap
exponents b: DCN-v2 -0.105 (R^2 0.96), DLRM -0.047 (0.92), Wukong -0.029 (0.81); Wukong's
last size step gained 0.0004 NE. On this data and budget Wukong trails DLRM and DCN-v2 at
every compute, unlike the paper's Figure 1 (its sizes go to 100+ GFLOPs/example, trained
on billions of examples): this is a small-compute, few-example point, not a replication.

Rerun 2026-11-27 (BENCHMARKS.md, "1M examples per size and 2 seeds"): Wukong 3 sizes and DLRM
3 sizes, seeds 0 and 1, 250 steps of 4096 (1.02M examples), 4,102 s on the loaded 2-core CPU.
NE-gap exponents per seed: Wukong -0.0092 / -0.0002 (mean -0.0047 ± 0.0064), DLRM -0.0600 /
-0.0919 (-0.0759 ± 0.0226); Wukong is flat within its seed spread and, with a third of the
optimizer steps of the run above, lost more NE than DLRM did (step-limited at this budget).
With 10M examples per size (2442 steps of 4096, `--data=synthetic_deep:gen=device`, seeds
0, 1, 2; 6,630 s; BENCHMARKS.md "10M examples per size"): NE Wukong 0.6601 / 0.6338 / 0.6256,
DLRM 0.6194 / 0.6078 / 0.6046; NE-gap exponents per seed Wukong -0.111 ± 0.021, DLRM -0.088 ±
0.012: Wukong gains at every size step with the steeper mean slope, within about one
seed std of DLRM's, and DLRM stays ahead at every compute of this range (0.033 NE at matched
compute). Relative NE change per 4x compute -2.9% (Wukong) and -1.8% (DLRM) against the
paper's about -0.1% for Wukong near 1-100 GFLOP/example: far from the data's floor each 4x
buys more. An interrupted long run continues with `--resume` (finished runs are kept in
their run.json).

Beside FuxiCTR's WuKong with the same weights (experiments/peers/fuxictr_wukong.py) our blocks give the same outputs where the
designs agree, so the gap is not an implementation difference in the FMB, LCB or layer.

Side by side with FuxiCTR's whole WuKong model trained on the same 819,200 synthetic
examples (`--study=fuxictr`, l2_n8_k16_w128, Adam + element-wise Adagrad on both,
2026-11-27, BENCHMARKS.md): ours NE 0.7408 / 0.7307 (seeds 0 / 1), FuxiCTR 0.7866 (seed 0);
on one epoch of the Criteo sample AUC 0.7192 ± 0.0014 against 0.6988 ± 0.0027. FuxiCTR's
implementation does not train better than ours, so it points at no defect of ours.

Profile (`--study=profile`): on this CPU the numpy generator of `synthetic_deep`
(`gen=host`, the default on CPU) is the bottleneck, not the model: for l1_n4_k8_w64 at batch
256 the source alone gives 7,485 ex/s, the step alone 14,095, end to end 4,375 (0.31 of the
step: generation and the step share the 2 cores); `gen=device` (the same hidden model
drawn inside XLA, a different random stream) gives 170,652 / 14,288 / 15,202 (1.06), 3.5x
end to end. Evaluation runs once, at the end, and the loop fetches metrics only every
--log_every steps, so neither is worth cutting. Long runs should pass
`--data=synthetic_deep:gen=device`; the default stays `gen=host` so that the figures above
reproduce example for example.
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from experiments.common.report import Report

FLAGS = flags.FLAGS


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names; `flag_values`: where, default
  absl's FLAGS); every setting but --workdir / --resume / --from_results may come from a
  --config file (configs/ beside this file)."""
  from core import settings  # noqa: F401  (the settings named below)
  from experiments.wukong_scaling import study  # noqa: F401
  from rec import configs
  from rec import settings as rec_settings  # noqa: F401
  configs.define_run_flags("sparse_optimizer", "mesh", flag_values=flag_values,
      data="synthetic_deep", num_rows=20, embedding_dim=16, batch_size=1024,
      eval_batch_size=4096, eval_batches=16, dense_optimizer="adam", learning_rate=0.001,
      embedding_learning_rate=0.1)
  config.define_flags(
      None, "grid", "archs", "sizes", "models", "steps", "seeds", "data_seed", "log_every",
      "study", "profile_data", "fuxictr_python", "fuxictr_src", "fuxictr_batch_norm",
      "fuxictr_max_grad_norm", "fuxictr_threads", in_config=True, flag_values=flag_values,
      grid="cpu", archs=["wukong", "dlrm", "dcnv2"], sizes=0, models=[], steps=800,
      seeds=["0"], data_seed=0, log_every=100, study="scaling",
      profile_data=["synthetic_deep:gen=host", "synthetic_deep:gen=device"],
      fuxictr_python="../peer311/bin/python",
      fuxictr_src="../peer311/fuxictr_model_zoo/WuKong.py", fuxictr_batch_norm=True,
      fuxictr_max_grad_norm=0.0, fuxictr_threads=2)
  config.define_flags(None, "workdir", "resume", "from_results", flag_values=flag_values,
                      workdir="runs/wukong_scaling", resume=False, from_results="")


def check_flags() -> None:
  """The lists and combinations every study reads, checked before anything trains or is
  measured: no empty --archs / --seeds / --profile_data, each --profile_data form and
  --models preset valid (a bad later one would otherwise fail after the first ran), and
  --from_results and --resume only for the scaling study (the others would ignore them)."""
  from core.errors import UserError
  from experiments.wukong_scaling import study
  from rec import configs, runs
  from rec.data import sources
  if FLAGS.from_results:
    if FLAGS.study != "scaling" or FLAGS.resume:
      other = f"--study={FLAGS.study}" if FLAGS.study != "scaling" else "--resume"
      raise UserError(f"--from_results={FLAGS.from_results} with {other}; expected "
                      "--from_results alone (it redoes the scaling study's fits without "
                      "training)")
    return
  if FLAGS.resume and FLAGS.study != "scaling":
    raise UserError(f"--resume with --study={FLAGS.study}; expected --resume only with "
                    "--study=scaling (its finished runs are kept)")
  lists = [("seeds", "a seed")]
  lists += [("archs", "an architecture")] if not FLAGS.models else []
  lists += [("profile_data", "a data form")] if FLAGS.study == "profile" else []
  for flag, one in lists:
    if not FLAGS[flag].value:
      raise UserError(f"--{flag}=: nothing to run; expected at least {one}")
  if FLAGS.study == "profile":
    for data in FLAGS.profile_data:
      try:
        sources.check_form(data)
      except ValueError as e:
        raise UserError(str(e).replace("--data=", "--profile_data entry ", 1)) from None
  if FLAGS.models:
    base = configs.run_from_flags(seed=FLAGS.data_seed)
    for entry, spec in zip(FLAGS.models, runs.parse_models(FLAGS.models)):
      try:
        configs.model_config(runs.for_model(base, spec), runs.CRITEO_SHAPED)
      except ValueError as e:
        raise UserError(f"--models entry {entry!r}: {e}") from None
  else:
    try:
      study.default_specs(FLAGS.grid, FLAGS.archs, FLAGS.sizes)
    except ValueError as e:
      raise UserError(str(e)) from None


def main(argv):
  del argv
  cli.quiet_library_logs()

  from experiments.wukong_scaling import study
  from rec import configs, runs

  check_flags()
  if FLAGS.study == "fuxictr":
    return side_by_side_main()
  if FLAGS.study == "profile":
    return profile_main()
  if FLAGS.from_results:
    import json
    from core.errors import UserError
    try:
      with open(FLAGS.from_results) as f:
        results = json.load(f)
      keep = {k: results[k] for k in ("config", "seeds", "steps", "epochs", "rows", "reference",
                                      "wall_seconds")}
    except (OSError, ValueError, KeyError) as e:
      raise UserError(f"--from_results={FLAGS.from_results!r}: {e}; expected the results.json "
                      "of an earlier experiments.wukong_scaling run") from e
    results = keep
    data, examples = results["config"]["data"], results["rows"][0]["examples"]
  else:
    base = configs.run_from_flags(seed=FLAGS.data_seed)
    specs = (runs.parse_models(FLAGS.models) if FLAGS.models
             else study.default_specs(FLAGS.grid, FLAGS.archs, FLAGS.sizes))
    results = runs.train_models(base, specs, seeds=[int(s) for s in FLAGS.seeds],
                                steps=FLAGS.steps, workdir=FLAGS.workdir,
                                log_every=FLAGS.log_every, reuse_finished=FLAGS.resume)
    data, examples = FLAGS.data, FLAGS.steps * FLAGS.batch_size
  report = Report(FLAGS.workdir)
  fit = study.scaling_fits(results)
  notes = study.findings(results, fit)
  table, fits_text = runs.format_runs(results), study.format_fits(fit)
  print("\n" + table + "\n\n" + fits_text + "\n\n" + "\n".join(notes), flush=True)
  results.update(fit)
  results["primary_metric"] = "ne"
  results["findings"] = notes
  results["table"] = table.splitlines() + [""] + fits_text.splitlines()
  summary = {
      "data": data, "examples_per_model": examples,
      "primary_metric": "ne", "floor": fit["floor"],
      "fits": {a: {"ne": f["ne"], "auc": f["auc"]} for a, f in fit["fits"].items()},
      "seed_fits": fit["seed_fits"], "per_quadrupling": fit["per_quadrupling"],
      "points": [{"model": r["label"], "gflops_per_example": r["gflops_per_example"],
                  "ne": r["ne_mean"], "auc": r["auc_mean"]} for r in results["rows"]],
      "findings": notes, "wall_seconds": results["wall_seconds"]}
  results["summary"] = summary
  report.finish(results, summary,
                plots=[(study.plot_scaling, (results, fit), "wukong_scaling.png")])


def side_by_side_main():
  """--study=fuxictr: fuxictr.side_by_side on the one Wukong of --models."""
  from core.errors import UserError
  from experiments.wukong_scaling import fuxictr
  from rec import configs, runs
  specs = runs.parse_models(FLAGS.models) if FLAGS.models else []
  if len(specs) != 1 or specs[0].model != "wukong":
    raise UserError(f"--models={FLAGS.models} with --study=fuxictr; expected one wukong "
                    "preset, e.g. --models=wukong:l2_n8_k16_w128")
  base = configs.run_from_flags(seed=FLAGS.data_seed, model="wukong", preset=specs[0].preset)
  res = fuxictr.side_by_side(base, [int(s) for s in FLAGS.seeds], FLAGS.workdir,
                             peer_python=FLAGS.fuxictr_python, peer_src=FLAGS.fuxictr_src,
                             steps=FLAGS.steps, log_every=FLAGS.log_every,
                             mlp_batch_norm=FLAGS.fuxictr_batch_norm,
                             max_grad_norm=FLAGS.fuxictr_max_grad_norm,
                             threads=FLAGS.fuxictr_threads)
  report = Report(FLAGS.workdir)
  res["table"] = report.table(fuxictr.format_side_by_side(res), lead="\n")
  summary = {"study": "fuxictr", "data": FLAGS.data, "preset": specs[0].preset,
             "steps": res["steps"], "seeds": res["seeds"], **{
                 side: {k: round(v, 5) for k, v in res["summary"][side].items()}
                 for side in ("ours", "fuxictr")}, "wall_seconds": res["wall_seconds"]}
  res["summary_line"] = summary
  report.finish(res, summary,
                plots=[(fuxictr.plot_curves, (res,), "fuxictr_side_by_side.png")])


def profile_main():
  """--study=profile: profile.profile over the grid (or --models) and --profile_data."""
  from experiments.wukong_scaling import profile, study
  from rec import configs, runs
  base = configs.run_from_flags(seed=FLAGS.data_seed)
  specs = (runs.parse_models(FLAGS.models) if FLAGS.models
           else study.default_specs(FLAGS.grid, FLAGS.archs, FLAGS.sizes))
  rows = profile.profile(base, specs, FLAGS.profile_data, steps=FLAGS.steps)
  report = Report(FLAGS.workdir)
  table = report.table(profile.format_profile(rows, FLAGS.batch_size), lead="\n")
  summary = {"study": "profile", "batch_size": FLAGS.batch_size, "rows": [
      {k: r[k] for k in ("label", "data", "source_examples_per_sec", "step_examples_per_sec",
                         "end_to_end_examples_per_sec", "seconds_per_10m")} for r in rows]}
  report.finish({"study": "profile", "rows": rows, "table": table, "summary": summary},
                summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
