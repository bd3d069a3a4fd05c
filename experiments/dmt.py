r"""Disaggregated Multi-Tower (DMT, arXiv 2403.00877): quality of the tower model against
the flat DLRM, and the all-to-all volume of SPTT against the flat model, side by side.

  python -m experiments.dmt                                  # runs/dmt
  python -m experiments.dmt --towers=2,4,8 --steps=1000

1. Train a flat DLRM (rec.models.dlrm, full tables, dense Adagrad) on synthetic Criteo-like
   data (--teacher; 26 one-hot features of --num_rows rows).
2. Partition the features into T towers (rec.dmt.partition): cost rows x dim balanced,
   grouped by |cos| of the flat model's learned pooled embeddings on eval examples; and a
   random equal-count partition as the control.
3. Train DMT models (tower modules: K mixtures + one local-dot vector per tower, then the
   global dot interaction) from scratch on the same data and seeds, per T of --towers.
4. Per model: test AUC / log loss, and the per-step all-to-all bytes (rec.dmt.comm_volume:
   flat table-wise = ids + pooled [B, F, D] globally; SPTT = ids + compressed
   [B, T (K + 1), D] globally, pooled [B, F, D] inside the tower groups) for the global
   batch --comm_batch. SPTT's lookup equals the global lookup (tests/rec/test_dmt.py on
   8 devices), so quality is measured on one device.
Prints the table, writes results.json and dmt.png; last line JSON.

Measured (`python -m experiments.dmt`, 2-core CPU, jax 0.11.2, 2026-11-24, 3.6 min; the
table in BENCHMARKS.md "DMT"): test AUC flat 0.6796; DMT T=2 0.6792 (similarity) / 0.6786
(random); T=4 0.6801 / 0.6808; global all-to-all per step (B = 65,536) 110.5 MiB flat vs
30.5 (T=2, 3.62x less) and 54.5 MiB (T=4, 2.03x less).
"""

from __future__ import annotations

import json
import os
import time

from absl import flags, logging

from core import cli
from core import results as results_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_list("towers", ["2", "4"], "Tower counts T to train.")
  flags.DEFINE_integer("tower_k", 2, "Compressed vectors per tower (+ 1 local-dot vector).")
  flags.DEFINE_integer("steps", 600, "Train steps per model.")
  flags.DEFINE_integer("batch_size", 512, "Train batch size.")
  flags.DEFINE_integer("eval_batches", 8, "Test batches of --batch_size.")
  flags.DEFINE_integer("num_rows", 5000, "Rows per table.")
  flags.DEFINE_integer("dim", 16, "Embedding dim.")
  flags.DEFINE_enum("teacher", "deep", ["linear", "deep"], "Synthetic label model.")
  flags.DEFINE_integer("comm_batch", 65536, "Global batch for the all-to-all volume.")
  flags.DEFINE_integer("seed", 0, "Seed.")
  flags.DEFINE_string("workdir", "runs/dmt", "Output directory.")


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from flax import nnx

  from rec import dmt
  from rec.data.synthetic import SyntheticCriteo
  from rec.models.dlrm import DLRM, DLRMConfig

  t0 = time.perf_counter()
  F, D, R = 26, FLAGS.dim, FLAGS.num_rows
  src = lambda split: SyntheticCriteo(FLAGS.batch_size, R, seed=FLAGS.seed, split=split,
                                      teacher=FLAGS.teacher)
  train, test = src("train"), src("test")
  common = dict(steps=FLAGS.steps, eval_batches=FLAGS.eval_batches, num_rows=R, dim=D,
                seed=FLAGS.seed, log=lambda s: print(s, flush=True))
  bottom, top = (64, D), (64, 1)
  rows = []
  print("== flat DLRM", flush=True)
  flat = dmt.train_eval(DLRM(DLRMConfig(num_dense=13, num_sparse=F, embedding_dim=D,
                                        bottom_mlp=bottom, top_mlp=top,
                                        rows_per_feature=(R,) * F), nnx.Rngs(FLAGS.seed)),
                        train, test, **common)
  vol = dmt.comm_volume(FLAGS.comm_batch, F, D, 1, 0)
  rows.append({"model": "flat DLRM", "towers": None, "auc": flat["auc"],
               "logloss": flat["logloss"], "global_bytes": vol["flat"]["global_total"],
               "intra_group_bytes": 0, "global_reduction": 1.0,
               "train_seconds": flat["train_seconds"]})
  sim = dmt.feature_similarity(flat["eval_emb"])
  costs = [R * D] * F
  for T in (int(t) for t in FLAGS.towers):
    for kind, towers in (("similarity", dmt.partition(sim, costs, T)),
                         ("random", dmt.random_partition(F, T, FLAGS.seed))):
      print(f"== DMT T={T} {kind} towers {towers}", flush=True)
      cfg = dmt.DMTConfig(num_dense=13, embedding_dim=D, towers=towers,
                          tower_k=FLAGS.tower_k, bottom_mlp=bottom, top_mlp=top)
      res = dmt.train_eval(dmt.DMTModel(cfg, nnx.Rngs(FLAGS.seed)), train, test, **common)
      vol = dmt.comm_volume(FLAGS.comm_batch, F, D, T, FLAGS.tower_k)
      within = sum(sim[a, b] for t in towers for a in t for b in t if a != b) / max(
          1, sum(len(t) * (len(t) - 1) for t in towers))
      rows.append({"model": f"DMT T={T} ({kind})", "towers": towers, "auc": res["auc"],
                   "logloss": res["logloss"], "global_bytes": vol["sptt"]["global_total"],
                   "intra_group_bytes": vol["sptt"]["intra_group_embeddings"],
                   "global_reduction": vol["global_reduction"],
                   "within_tower_similarity": within, "train_seconds": res["train_seconds"]})
  print(f"{'model':<26}{'AUC':>8}{'logloss':>9}{'global a2a MB/step':>20}{'x less':>8}"
        f"{'intra-group MB':>16}")
  for r in rows:
    print(f"{r['model']:<26}{r['auc']:>8.4f}{r['logloss']:>9.4f}{r['global_bytes'] / 2**20:>20.1f}"
          f"{r['global_reduction']:>8.2f}{r['intra_group_bytes'] / 2**20:>16.1f}")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  out = {"rows": rows, "comm_batch": FLAGS.comm_batch, "steps": FLAGS.steps,
         "teacher": FLAGS.teacher, "similarity": sim.tolist()}
  out["plot"] = _plot(rows, os.path.join(FLAGS.workdir, "dmt.png"))
  out["wall_seconds"] = time.perf_counter() - t0
  results_lib.write_results(FLAGS.workdir, out)
  print(json.dumps({r["model"]: {"auc": round(r["auc"], 4), "logloss": round(r["logloss"], 4),
                                 "a2a_reduction": round(r["global_reduction"], 2)}
                    for r in rows} | {"wall_seconds": round(out["wall_seconds"], 1)}), flush=True)


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for r in rows:
    ax.scatter(r["global_bytes"] / 2**20, r["auc"], s=40)
    ax.annotate(r["model"], (r["global_bytes"] / 2**20, r["auc"]), fontsize=7)
  ax.set(xlabel="global all-to-all MB per step (forward)", ylabel="test AUC",
         title="DMT vs flat DLRM")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


if __name__ == "__main__":
  define_flags()
  cli.run(main)
