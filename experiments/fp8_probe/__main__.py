r"""FP8 for the dense parts of recommendation models (LoKA, "Low-precision Kernel
Applications for Recommendation Models At Scale"): the per-layer Probe on a trained model,
then fp32 / bf16 / FP8 variants trained from scratch, and train-step times.

  python -m experiments.fp8_probe                      # synthetic data, runs/fp8_probe
  python -m experiments.fp8_probe --data=criteo:../shared/data/criteo_kaggle_sample \
      --epochs=3 --batch_size=128 --workdir=runs/fp8_probe_criteo

Per model of --models (DLRM, DCN-v2: the models with FP8 layers, rec/layers/fp8.py):
  1. train the fp32 model (seed --seeds[0]) and probe it (probe.py) on the eval
     batches for each --probe_recipes: every FP8-capable layer alone in FP8 (E4M3 forward,
     E5M2 gradients), then all of them; per layer the output, kernel-gradient and logit
     SQNR against fp32 and the change of eval log loss / AUC; layers whose log loss grows
     by at most --max_logloss_increase (relative) are "safe";
  2. train fp32, bf16 (dense activations and matmuls), FP8 per-tensor, FP8 row-wise,
     FP8 delayed per-tensor on every layer, and FP8 (per-tensor) on the probe's safe
     layers when that is not all of them, from scratch with the same data, seeds and budget;
  3. time one train step per variant (median of --timing_repeats x --timing_steps; the
     variants' repeats taking turns).
Prints the tables, writes results.json and fp8_probe.png; the last stdout line is JSON.

Off a GPU, FP8 is emulated (integer bit arithmetic for the quantizers, float8 dots upcast
by XLA:CPU): CPU step times say nothing about FP8 speed. The same command on an H100
runs float8 x float8 -> float32 dot_generals, which XLA hands to cuBLASLt FP8 GEMMs;
that has not been run here (no GPU): FP8 step time on Hopper is unmeasured.

Measured (2-core CPU shared with other jobs, jax 0.11.2, 2026-11-24; full tables in
BENCHMARKS.md, "FP8 dense layers"):
  --data=criteo:../shared/data/criteo_kaggle_sample --epochs=1 --batch_size=128
  --seeds=0,1,2 --timing_steps=0   (1,723 s wall at load average ~12)
    probe, one layer in FP8 at a time: matmul output SQNR 25-46 dB, kernel-gradient SQNR
    13-29 dB (E5M2), eval log loss within 0.5% (relative) for every layer of DLRM and
    DCN-v2; row-wise output SQNR within 0.3 dB of per-tensor or up to 3.5 dB better.
    Trained (eval AUC, mean +- std of 3 seeds): DLRM fp32 0.7211 +- 0.0076, bf16
    0.7217 +- 0.0087, FP8 tensor 0.7193 +- 0.0130, row 0.7224 +- 0.0122, delayed
    0.7187 +- 0.0110; DCN-v2 fp32 0.7303 +- 0.0040, bf16 0.7301 +- 0.0042,
    FP8 tensor 0.7313 +- 0.0052, row 0.7308 +- 0.0043, delayed 0.7296 +- 0.0038.
  --models=dlrm --steps=300 --seeds=0,1   (synthetic; the DLRM part of a default run
  stopped for time in its DCN-v2 part, ~28 min wall at load average ~12)
    probe: output SQNR 28-43 dB, gradient 25-39 dB, log loss within 0.21%; trained AUC
    fp32 0.7394 +- 0.0143, bf16 0.7429 +- 0.0112, FP8 tensor 0.7403 +- 0.0131, row
    0.7339 +- 0.0188, delayed 0.7450 +- 0.0058.
Every FP8 variant is within the seed spread of fp32 and bf16; the spread (0.004-0.02
AUC) is far above the probe's per-layer effects, so these runs show FP8 trains, not more.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from core import errors
from experiments.common.report import Report

FLAGS = flags.FLAGS
PROBE_RECIPES = ("tensor", "row")   # fp8.RECIPES but delayed (it needs an amax history)


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting but
  --workdir may come from a --config file (configs/ beside this file)."""
  from core import settings  # noqa: F401  (the settings named below)
  from experiments.fp8_probe import probe  # noqa: F401
  from rec import configs
  from rec import settings as rec_settings  # noqa: F401
  configs.define_run_flags("data", "dense_optimizer", "learning_rate",
      "embedding_learning_rate", "mesh", flag_values=flag_values, batch_size=512,
      eval_batch_size=2048, eval_batches=4, embedding_dim=16, num_rows=20_000)
  config.define_flags(
      None, "models", "seeds", "data_seed", "steps", "epochs", "variants", "probe_recipes",
      "probe_batches", "max_logloss_increase", "timing_steps", "timing_repeats", "log_every",
      in_config=True, flag_values=flag_values, models=["dlrm", "dcnv2:small"], seeds=["0"],
      data_seed=0, steps=300, variants=["fp32", "bf16", "fp8_tensor", "fp8_row", "fp8_delayed"],
      probe_recipes=["tensor", "row"], probe_batches=8, max_logloss_increase=1e-3,
      timing_steps=5, timing_repeats=3, log_every=100)
  config.define_flags(None, "workdir", flag_values=flag_values, workdir="runs/fp8_probe")


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax

  from experiments.fp8_probe import probe as fp8_probe
  from rec import configs, runs

  report = Report(FLAGS.workdir)
  base = configs.run_from_flags(seed=FLAGS.data_seed)
  seeds = [int(s) for s in FLAGS.seeds]
  budget = dict(steps=None if FLAGS.epochs else FLAGS.steps, epochs=FLAGS.epochs)
  unknown = [v for v in FLAGS.variants if v not in fp8_probe.VARIANTS]
  if unknown:
    raise ValueError(f"--variants: {unknown} unknown, expected some of "
                     f"{list(fp8_probe.VARIANTS)}")
  # Checked now, not after a reference model has trained: the probe's scalings (current
  # scaling only) and every model's preset.
  bad = [r for r in FLAGS.probe_recipes if r not in PROBE_RECIPES]
  if bad:
    raise errors.expected(f"--probe_recipes={','.join(FLAGS.probe_recipes)}",
                          f"unknown {bad}", f"some of {','.join(PROBE_RECIPES)} (the probe "
                          "loads the fp32 state as it is: current scaling only)")
  specs = runs.parse_models(FLAGS.models)
  for spec in specs:
    try:
      configs.model_config(configs.replace_run(base, model=spec.model, preset=spec.preset),
                           runs.CRITEO_SHAPED)
    except ValueError as e:
      raise errors.UserError(f"--models={','.join(FLAGS.models)}: {spec.label}: {e}") from None
  # And an earlier study's runs in --workdir (never replaced), before a first model trains.
  runs.check_fresh([d for spec in specs for v in dict.fromkeys(["fp32", *FLAGS.variants,
                                                                "fp8_safe"])
                    for d in runs.model_run_dirs(
                        os.path.join(FLAGS.workdir, f"{spec.model}_{spec.preset}", v), spec,
                        seeds)], resume_flag=False)
  out = {"data": FLAGS.data, "seeds": seeds, **budget, "batch_size": FLAGS.batch_size,
         "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
         "models": []}
  for spec in specs:
    cfg = configs.replace_run(base, model=spec.model, preset=spec.preset)
    wd = os.path.join(FLAGS.workdir, f"{spec.model}_{spec.preset}")
    print(f"== {spec.label}: fp32 reference run", flush=True)
    trained = fp8_probe.train_reference(cfg, wd, seed=seeds[0], log_every=FLAGS.log_every,
                                        **budget)
    inputs = fp8_probe.eval_inputs(trained, FLAGS.probe_batches)
    probes = []
    for recipe in FLAGS.probe_recipes:
      print(f"== {spec.label}: probe, {recipe} scaling", flush=True)
      rep = fp8_probe.probe(trained, recipe, inputs=inputs,
                            max_logloss_increase=FLAGS.max_logloss_increase)
      print(fp8_probe.format_probe(rep), flush=True)
      probes.append(rep)
    variants = {v: fp8_probe.VARIANTS[v] for v in FLAGS.variants}
    safe = probes[0]["safe_layers"] if probes else ""
    n_layers = len(trained.model_cfg.fp8_layer_names)
    if safe and len(safe.split(",")) < n_layers:
      variants["fp8_safe"] = {"fp8_layers": safe, "fp8_recipe": probes[0]["recipe"]}
    print(f"== {spec.label}: training variants {list(variants)}", flush=True)
    done = {"fp32": trained.row} if seeds == [seeds[0]] and "fp32" in variants else None
    rows = fp8_probe.train_variants(cfg, variants, wd, seeds, log_every=FLAGS.log_every,
                                    done=done, **budget)
    print(fp8_probe.format_variants(rows), flush=True)
    timing = None
    if FLAGS.timing_steps > 0:
      timing = fp8_probe.step_times(cfg, variants, FLAGS.timing_steps, FLAGS.timing_repeats)
      for name, t in timing["variants"].items():
        print(f"  step time {name:<14} {1e3 * t['median_s']:9.2f} ms ({timing['platform']}"
              f"{', FP8 emulated' if timing['platform'] != 'gpu' and 'fp8' in name else ''})",
              flush=True)
    for r in rows.values():
      r.pop("runs", None)
    out["models"].append({"label": spec.label, "model": spec.model, "preset": spec.preset,
                          "fp8_layer_names": list(trained.model_cfg.fp8_layer_names),
                          "probes": probes, "variants": rows, "step_times": timing,
                          "safe_layers": safe})
  # Drawn after results.json is written: a plot that fails cannot lose the trained rows.
  out["plot"] = report.path("fp8_probe.png")
  report.finish(out, {"data": FLAGS.data, "platform": out["platform"], "models": {
      m["label"]: {"safe_layers": m["safe_layers"],
                   **{f"{v}_auc": round(r["auc_mean"], 5) for v, r in m["variants"].items()},
                   **{f"{v}_logloss": round(r["logloss_mean"], 5)
                      for v, r in m["variants"].items()}}
      for m in out["models"]}}, wall="wall_seconds",
      plots=[(fp8_probe.plot, (out,), "fp8_probe.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
