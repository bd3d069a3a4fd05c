r"""RecD in-batch deduplication (arXiv 2211.05239): lookup and train-step throughput of the
inverse-indexed path against the plain path, by duplication rate.

  python -m experiments.recd                        # runs/recd
  python -m experiments.recd --session_lens=1,4,16 --batch_size=4096

Session-like synthetic data (study.session_batches): --num_user user features (bags of
--user_bag Zipf ids, the same for the --session_len consecutive samples of a session) and
--num_item one-hot item features per sample; duplication rate of the user features =
1 - 1/session_len (up to chance repeats). Per session length, a DLRM (dim --dim, tables
table-wise) times the forward lookup (gather + pool [+ expand]) and a full train step, plain
and dedup side by side (medians of --repeats x --steps) through one RecTask whose embedding
collection deduplicates the user features (rec/data/dedup.py, the collection's `dedup`
option); the host-side dedup time (numpy, `RecTask.device_batch`, in the input pipeline as
in RecD) is reported apart. Prints the table, writes results.json and recd.png; last line
JSON.

Measured (`python -m experiments.recd`, 2-core CPU shared (load ~10), jax 0.11.2, 5.3 min;
the full table in BENCHMARKS.md "RecD"): speedup plain / dedup of the lookup and the train
step at user-feature duplication 0 / 0.75 / 0.875 / 0.97: lookup 1.08 / 4.74 / 6.88 /
21.6x, step 1.05 / 2.08 / 5.46 / 8.88x (dedup path: 3,124 examples/s at S=1, 37,081 at S=32).
"""

from __future__ import annotations

import os
import time

from absl import flags

from core import cli
from core import results as results_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  from rec import configs
  configs.define_rec_run_flags("batch_size", "num_rows")
  flags.DEFINE_list("session_lens", ["1", "2", "4", "8", "16", "32"], "Samples per session.")
  flags.DEFINE_integer("num_user", 8, "User (deduplicated) features.", lower_bound=1)
  flags.DEFINE_integer("num_item", 8, "Item (per-sample, one-hot) features.", lower_bound=1)
  flags.DEFINE_integer("user_bag", 32, "Ids per user-feature bag.", lower_bound=1)
  flags.DEFINE_integer("dim", 32, "Embedding dim.", lower_bound=1)
  flags.DEFINE_integer("steps", 5, "Calls per timing repeat.", lower_bound=1)
  flags.DEFINE_integer("repeats", 5, "Timing repeats (median reported).", lower_bound=1)
  flags.DEFINE_string("mesh", "-1", "Device mesh; -1 = all devices.")
  flags.DEFINE_integer("seed", 0, "Data and init seed.", lower_bound=0)
  flags.DEFINE_string("workdir", "runs/recd", "Output directory.")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark
  from experiments.recd import study

  t0 = time.perf_counter()
  rows = study.throughput_study(
      [int(s) for s in FLAGS.session_lens], FLAGS.batch_size, FLAGS.num_user, FLAGS.num_item,
      FLAGS.user_bag, FLAGS.num_rows, FLAGS.dim, FLAGS.steps, FLAGS.repeats, FLAGS.mesh,
      FLAGS.seed, log=lambda s: print(s, flush=True))
  os.makedirs(FLAGS.workdir, exist_ok=True)
  out = {"machine": benchmark.machine(), "flags": {k: FLAGS[k].value for k in (
      "batch_size", "num_user", "num_item", "user_bag", "num_rows", "dim", "steps", "repeats",
      "mesh")}, "rows": rows}
  out["plot"] = study.plot(rows, os.path.join(FLAGS.workdir, "recd.png"))
  out["wall_seconds"] = time.perf_counter() - t0
  results_lib.write_results(FLAGS.workdir, out)
  results_lib.print_summary({f"s{r['session_len']}": {"dup": round(r["dup_rate_user"], 3),
                                                      "lookup_x": round(r["lookup_speedup"], 2),
                                                      "step_x": round(r["step_speedup"], 2)}
                             for r in rows} | {"wall_seconds": round(out["wall_seconds"], 1)})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
