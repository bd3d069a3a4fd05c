r"""Error-bounded lossy compression of DLRM's embedding all-to-all (arXiv 2407.04272):
bytes per step, compression ratio, AUC / log loss against uncompressed training, and the
step-time gain modelled for H100 hosts, beside the paper's 1.38x.

  python -m experiments.a2a_compression                      # runs/a2a_compression
  python -m experiments.a2a_compression --steps=300 --datasets=synthetic \
      --a2a_mode=abs --a2a_error_bound=0.005 --a2a_bits=8 --batch_size=256 --num_rows=20000

--batch_size, --num_rows, --seed, --a2a_mode, --a2a_error_bound, --a2a_grad_error_bound and
--a2a_bits are the shared rec run flags (rec.configs.define_run_flags; train_rec takes the
same, and the adaptive bound's --a2a_table_factors / --a2a_schedule, which this study
derives itself). On every device present (2 or more: an exchange to compress; 8 simulated
CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=8), DLRM with table-wise
sharding trains on each --datasets entry (synthetic data and the Criteo Kaggle sample when
its directory exists) three times from the same seed: uncompressed, with a fixed bound
(--a2a_mode, --a2a_error_bound for the pooled embeddings, --a2a_grad_error_bound for their
gradients, --a2a_bits), and with the dual-level adaptive bound (table-wise factors from each table's
first-order loss sensitivity sum |dL / d emb_t|, measured on the baseline; a linear schedule from
2x to 0.5x of the bound over the run). Reports per run: eval AUC / log loss and their
change, per-device payload bytes of the compiled step (HLO) against the float32 exchange,
the fixed-rate and zstd compression ratios of real exchanged rows, rows that fall back,
and the modelled H100 speedup by exchange fraction of the step (study.py states the
model). Prints the table, writes results.json and a2a_compression.png; last line JSON.
The paper's table-wise sensitivity measure, schedule and compressor are not reproduced
from its text (only its abstract was available): they are this study's choices.

Measured (defaults, 8 simulated devices: XLA_FLAGS="--xla_force_host_platform_device_count=8",
2-core CPU, jax 0.11.2, 58 s; BENCHMARKS.md "Lossy compressed embedding all-to-all"):
payload 45,056 vs float32 131,072 bytes per device per step (2.91x, as over the rows), zstd
13-22x; AUC change +0.0026 to +0.0040 (single seed); H100 model 1.26x at a 40% exchange
share, the paper's 1.38x at a 53% share.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from experiments.common.report import Report

FLAGS = flags.FLAGS
CRITEO_SAMPLE = "criteo:../shared/data/criteo_kaggle_sample"   # beside the checkout
# The study's RecRunConfig settings besides the flags' (the others keep the config's
# defaults; the adaptive variant makes its own --a2a_table_factors / --a2a_schedule).
STUDY = {"model": "dlrm", "sharding": "tw", "eval_batches": 4}


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting
  but --workdir may come from a --config file (configs/ beside this file)."""
  from core import settings  # noqa: F401  (the settings named below)
  from experiments.a2a_compression import study  # noqa: F401
  from rec import configs
  from rec import settings as rec_settings  # noqa: F401
  config.define_flags(None, "datasets", "steps", "criteo_epochs", "probe_batches",
                      in_config=True, flag_values=flag_values,
                      datasets=["synthetic", CRITEO_SAMPLE], steps=300, criteo_epochs=1.0,
                      probe_batches=4)
  config.define_flags(None, "workdir", flag_values=flag_values, workdir="runs/a2a_compression")
  # The fixed variant's bounds are the shared --a2a_* flags (train_rec's); the baseline runs
  # the same config with the exchange in float32.
  configs.define_run_flags("seed", "a2a_bits", flag_values=flag_values, batch_size=256,
                           num_rows=20_000, a2a_mode="abs", a2a_error_bound=0.01,
                           a2a_grad_error_bound=0.001)


def main(argv):
  del argv
  cli.quiet_library_logs()
  from experiments.a2a_compression import study
  from rec import configs

  report = Report(FLAGS.workdir)
  flagged = configs.run_from_flags(**STUDY)
  if flagged.embedding.a2a.a2a_mode == "none":
    raise ValueError("--a2a_mode=none: this study compares a compressed exchange with the "
                     "float32 one; expected --a2a_mode=abs|rel")
  if flagged.embedding.a2a.a2a_grad_error_bound is None:
    # Unset, the gradients go in float32: payload_sizes measures the forward rows only, and
    # "hlo x", "eff x" and the H100 model would price the whole exchange at their ratio.
    raise ValueError("--a2a_grad_error_bound unset (the gradients' exchange in float32): this "
                     "study's ratios and H100 model count both directions compressed; expected "
                     "a bound > 0 for the gradients too")
  fixed = flagged.a2a_spec()
  variants = {"fixed": fixed, "adaptive": "adaptive"}
  log = report.log
  res = {}
  from rec.data import sources
  datasets = []
  for data in FLAGS.datasets:   # every form checked before the first trains
    if data.startswith("criteo:") and not os.path.isdir(data.split(":", 1)[1]):
      log(f"skip {data}: directory absent")
      continue
    try:
      sources.check_form(data)
    except ValueError as e:
      raise ValueError(str(e).replace("--data=", "--datasets entry ", 1)) from None
    datasets.append(data)
  # And earlier runs in --workdir, never replaced, before the first dataset trains.
  from rec import runs
  runs.check_fresh([d for data in datasets for d in study.run_dirs(
      os.path.join(FLAGS.workdir, data.split(":")[0]), variants)], resume_flag=False)
  for data in datasets:
    cfg = configs.replace_run(flagged.without_a2a(), data=data,
                              eval_batch_size=flagged.train.batch_size)
    res[data] = study.run_dataset(cfg, FLAGS.steps, FLAGS.probe_batches, variants,
                                  os.path.join(FLAGS.workdir, data.split(":")[0]), log,
                                  epochs=FLAGS.criteo_epochs if data.startswith("criteo:") else None)
  log("codec cost")
  codec = study.codec_cost(16, fixed.bits)
  rows = study.summarize(res, codec)
  print(f"{'data':10} {'run':9} {'AUC':>7} {'dAUC':>8} {'logloss':>8} {'dLL':>8} "
        f"{'f32 B':>8} {'sent B':>8} {'hlo x':>6} {'fixed x':>7} {'zstd x':>7} {'fallbk':>6} {'eff x':>6} "
        f"{'H100@0.4':>8} {'f for 1.38x':>11}")
  for r in rows:
    extra = ""
    if r["run"] != "baseline":
      need = r["h100"]["comm_fraction_for_paper_speedup"]
      extra = (f"{r['payload_bytes']:8d} {r['hlo_ratio']:6.2f} {r['fixed_ratio']:7.2f} "
               f"{r['zstd_ratio']:7.2f} {r['fallback_share']:6.2f} {r['effective_ratio']:6.2f} "
               f"{r['h100']['by_comm_fraction']['0.4']:8.3f} "
               f"{'never' if need is None else f'{need:.2f}':>11}")
    print(f"{r['data'].split(':')[0]:10} {r['run']:9} {r['auc']:7.4f} {r['d_auc']:+8.4f} "
          f"{r['logloss']:8.4f} {r['d_logloss']:+8.4f} {r['float32_bytes']:8d} {extra}")
  print("f32 B / sent B: per-device bytes of one compiled step's embedding exchange (HLO; "
        "sent = the uint8 payload, forward + backward); fixed x / zstd x: float32 bytes of real "
        "exchanged rows over their fixed-rate payload / its zstd size; fallbk: share of "
        "exchanges that would go float32 (a row beyond its bound at this rate); eff x: float32 "
        "over what is sent on average, fallbacks included (the model's ratio); H100@0.4: "
        "modelled step speedup when the float32 exchange is 40% of the step; f for 1.38x: the "
        f"exchange share the model needs for the paper's speedup. Codec here: "
        f"{codec['codec_in_copies']:.1f} float32 copies of the rows.")
  print(f"paper (arXiv 2407.04272): {study.PAPER_SPEEDUP}x training speedup, "
        "\"minimal accuracy impact\" (abstract)")
  report.plot(study.plot, rows, name="a2a_compression.png")
  out = {"rows": rows, "codec": codec, "raw": res, "paper_speedup": study.PAPER_SPEEDUP,
         "seconds": report.seconds}
  best = max((r for r in rows if r["run"] != "baseline"), key=lambda r: r["fixed_ratio"],
             default=None)
  report.finish(out, {
      "experiment": "a2a_compression", "seconds": round(out["seconds"], 1),
      "best_fixed_ratio": None if best is None else round(best["fixed_ratio"], 3),
      "best_zstd_ratio": None if best is None else round(best["zstd_ratio"], 3),
      "max_abs_d_auc": max((abs(r["d_auc"]) for r in rows), default=None),
      "paper_speedup": study.PAPER_SPEEDUP})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
