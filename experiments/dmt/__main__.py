r"""Disaggregated Multi-Tower (DMT, arXiv 2403.00877): quality of the tower model against
the flat DLRM, and the all-to-all volume of SPTT against the flat model, side by side.

  python -m experiments.dmt                                  # runs/dmt
  python -m experiments.dmt --towers=2,4,8 --steps=1000
  python -m experiments.dmt --h100_only                      # the H100 step model alone

1. Train a flat DLRM (rec.models.dlrm) on synthetic Criteo-like data (--teacher; 26 one-hot
   features of --num_rows rows) through RecTask and the train loop (core.train), Adagrad on
   the dense part and on the touched table rows (rec.embedding.optimizers).
2. Partition the features into T towers (rec.embedding.towers.partition): cost rows x dim
   balanced, grouped by |cos| of the flat model's learned pooled embeddings on eval
   examples; and a random equal-count partition as the control.
3. Train DMT models (rec.models.dmt: tower modules of K mixtures + one local-dot vector per
   tower, then the global dot interaction) from the same draws on the same data, per T of
   --towers.
4. Per model: test AUC / log loss, and the per-step all-to-all bytes (study.comm_volume:
   flat table-wise = bags + pooled [B, F, D] globally; SPTT = bags + compressed
   [B, T (K + 1), D] globally, pooled [B, F, D] inside the tower groups; a bag travels as
   ids, weights and its length; F padded as the compiled program sends it: N ceil(F / N)
   table slots flat, T times the largest tower's count for SPTT, on N = 8 T devices) for
   the global batch --comm_batch. Training through SPTT
   (tables placed "sptt", rec.embedding.planner.tower_plan) equals the plain layout,
   forward and backward (tests/rec/test_dmt.py on 8 devices), so quality is measured on one
   device; tests/experiments/dmt checks comm_volume against the compiled program.
5. The step time on H100 hosts (study.h100_step_model): bytes per bag and per pooled value
   read from the compiled flat and SPTT lookups' HLO (study.hlo_unit_bytes, 8 simulated
   devices), scaled to --h100_hosts hosts of 8 GPUs (one tower per host), local batch
   --h100_local_batch, dim --h100_dim, the study's 26 features; compute from the models'
   FLOPs; core.hardware's inter-host All2All and NVLink lines. Flat vs SPTT as built (row-
   wise inside the tower group) and vs SPTT with table-wise hosts, with no and with full
   overlap, beside the paper's up to 1.9x.
Prints the tables, writes results.json, dmt.png and dmt_h100.png; last line JSON.

Measured: BENCHMARKS.md "DMT" (the quality and byte table, and the H100 step model with and
without the all-to-alls' padding).
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from core import settings
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

# One tower per host of the 26 features: a count between 1 and 26.
_COUNT = config.Setting("count", "integer", "A tower or host count.", lower=1, upper=26)
TOWERS = config.setting("towers", "list", "Tower counts T to train (1..26).", item=_COUNT)
TOWER_K = config.setting("tower_k", "integer", "Compressed vectors per tower (+ 1 local-dot "
                         "vector).", lower=1)
TEACHER = config.setting("teacher", "enum", "Synthetic label model.", choices=("linear", "deep"))
COMM_BATCH = config.setting("comm_batch", "integer", "Global batch for the all-to-all volume.",
                            lower=1)
H100_HOSTS = config.setting("h100_hosts", "list", "Host counts of the H100 step model "
                            "(1..26).", item=_COUNT)
H100_LOCAL_BATCH = config.setting("h100_local_batch", "integer", "Examples per GPU in the "
                                  "H100 step model.", lower=1)
H100_DIM = config.setting("h100_dim", "integer", "Embedding dim in the H100 step model.",
                          lower=1)
H100_ONLY = config.setting("h100_only", "bool", "Only the H100 step model (no training).")


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting
  but --workdir may come from a --config file (configs/ beside this file)."""
  from rec import configs
  config.define_flags(
      None, settings.BATCH_SIZE, configs.NUM_ROWS, TOWERS, TOWER_K, settings.STEPS,
      settings.EVAL_BATCHES, rec_settings.DIM, TEACHER, COMM_BATCH, settings.SEED,
      H100_HOSTS, H100_LOCAL_BATCH, H100_DIM, H100_ONLY, in_config=True,
      flag_values=flag_values, batch_size=512, num_rows=5000, towers=["2", "4"], tower_k=2,
      steps=600, eval_batches=8, dim=16, teacher="deep", comm_batch=65536, seed=0,
      h100_hosts=["1", "2", "4", "8", "16"], h100_local_batch=4096, h100_dim=128,
      h100_only=False)
  config.define_flags(None, settings.WORKDIR, flag_values=flag_values, workdir="runs/dmt")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from experiments.dmt import study

  report = Report(FLAGS.workdir)
  hosts = [int(h) for h in FLAGS.h100_hosts]    # (each checked while parsing: 1..26)
  towers = [int(t) for t in FLAGS.towers]
  for flag, counts in (("h100_hosts", hosts), ("towers", towers or FLAGS.h100_only)):
    if not counts:
      from core import errors
      raise errors.UserError(f"--{flag}=: no counts; expected at least one")
  units = study.measured_units()
  h100 = study.h100_table(units, hosts, FLAGS.h100_local_batch, FLAGS.h100_dim,
                          FLAGS.tower_k, seed=FLAGS.seed)
  print(f"H100 step model: {units['bag_bytes']:g} bytes per bag, {units['value_bytes']:g} per "
        f"pooled value (compiled HLO); local batch {FLAGS.h100_local_batch}, dim "
        f"{FLAGS.h100_dim}, 26 features, K = {FLAGS.tower_k}; ms per step of one GPU",
        flush=True)
  report.table(study.format_h100(h100))
  h100_out = {"units": units, "rows": h100, "local_batch": FLAGS.h100_local_batch,
              "dim": FLAGS.h100_dim, "paper_speedup_max": study.PAPER_SPEEDUP,
              "plot": report.plot(study.plot_h100, h100, name="dmt_h100.png")}
  h100_summary = {f"h100_{r['hosts']}_hosts": {
      "x_rw": round(r["speedup_serial"], 2), "x_tw": round(r["speedup_serial_tw"], 2),
      "x_tw_overlap": round(r["speedup_overlap_tw"], 2)} for r in h100}
  if FLAGS.h100_only:
    report.finish({"h100": h100_out}, h100_summary, wall="wall_seconds")
    return
  out = study.run(towers, FLAGS.tower_k, FLAGS.steps, FLAGS.batch_size,
                  FLAGS.eval_batches, FLAGS.num_rows, FLAGS.dim, FLAGS.teacher,
                  FLAGS.comm_batch, FLAGS.seed, FLAGS.workdir,
                  log=lambda s: print(s, flush=True))
  rows = out["rows"]
  report.table(study.format_table(rows))
  out.update(comm_batch=FLAGS.comm_batch, steps=FLAGS.steps, teacher=FLAGS.teacher)
  out["plot"] = report.plot(study.plot, rows, name="dmt.png")
  out["h100"] = h100_out
  report.finish(out, {r["model"]: {"auc": round(r["auc"], 4), "logloss": round(r["logloss"], 4),
                                   "a2a_reduction": round(r["global_reduction"], 2)}
                      for r in rows} | h100_summary, wall="wall_seconds")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
