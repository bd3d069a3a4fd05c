r"""RecD in-batch deduplication (arXiv 2211.05239): lookup and train-step throughput of the
inverse-indexed path against the plain path, by duplication rate.

  python -m experiments.recd                        # runs/recd
  python -m experiments.recd --session_lens=1,4,16 --batch_size=4096

Session data from the library's source (rec.data.sessions.SessionSource, fixed-length
form): --num_user user features (bags of --user_bag Zipf ids, the same for the S
consecutive samples of a session, S one of --session_lens) and --num_item one-id item
features per sample; duplication rate of the user features = 1 - 1/S (up to chance
repeats). Per session length, a DLRM (dim --dim, tables table-wise) times the forward
lookup (gather + pool [+ expand]) and a full train step, plain and dedup side by side
(medians of --repeats repeats of --steps calls, the two paths timed in turns) through one
RecTask whose embedding collection deduplicates the user features (rec/data/dedup.py, the
collection's `dedup` option); the host-side dedup time (numpy, `RecTask.device_batch`, in
the input pipeline as in RecD) is reported apart. Prints the table, writes results.json and
recd.png; last line JSON.

Measured (`nice -n 19 python -m experiments.recd`, 2-core CPU shared (load 2.4-3.9), jax
0.11.2, 2 min 12 s; the full table and a second run in BENCHMARKS.md "RecD"): speedup plain /
dedup of the lookup and the train step at user-feature duplication 0 / 0.75 / 0.875 / 0.97:
lookup 1.12 / 6.62 / 6.44 / 8.76x, step 1.00 / 1.51 / 6.00 / 7.60x (dedup path: 11,097
examples/s at S=1, 76,705 at S=32); single ratios move up to 2x between runs.
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from core import settings
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

SESSION_LENS = config.setting("session_lens", "list", "Samples per session.")
NUM_ITEM = config.setting("num_item", "integer", "Item (per-sample, one-hot) features.",
                          lower=1)


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting
  but --workdir may come from a --config file (configs/ beside this file)."""
  from rec import configs
  config.define_flags(
      None, settings.BATCH_SIZE, configs.NUM_ROWS, SESSION_LENS, rec_settings.NUM_USER,
      NUM_ITEM, rec_settings.USER_BAG, rec_settings.DIM, settings.STEPS, settings.REPEATS,
      settings.MESH, settings.SEED, in_config=True, flag_values=flag_values,
      batch_size=2048, num_rows=100_000, session_lens=["1", "2", "4", "8", "16", "32"],
      num_user=8, num_item=8, user_bag=32, dim=32, steps=5, repeats=5, mesh="-1", seed=0)
  config.define_flags(None, settings.WORKDIR, flag_values=flag_values, workdir="runs/recd")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark
  from experiments.recd import study

  try:
    lens = [int(s) for s in FLAGS.session_lens]
  except ValueError:
    lens = []
  if not lens or any(s < 1 or FLAGS.batch_size % s for s in lens):
    raise ValueError(f"--session_lens={','.join(FLAGS.session_lens)}: expected session lengths "
                     f">= 1 dividing --batch_size={FLAGS.batch_size}")
  report = Report(FLAGS.workdir)
  rows = study.throughput_study(
      lens, FLAGS.batch_size, FLAGS.num_user, FLAGS.num_item,
      FLAGS.user_bag, FLAGS.num_rows, FLAGS.dim, FLAGS.steps, FLAGS.repeats, FLAGS.mesh,
      FLAGS.seed, log=lambda s: print(s, flush=True))
  out = {"machine": benchmark.machine(), "flags": {k: FLAGS[k].value for k in (
      "batch_size", "num_user", "num_item", "user_bag", "num_rows", "dim", "steps", "repeats",
      "mesh")}, "rows": rows}
  out["plot"] = report.plot(study.plot, rows, name="recd.png")
  report.finish(out, {f"s{r['session_len']}": {"dup": round(r["dup_rate_user"], 3),
                                               "lookup_x": round(r["lookup_speedup"], 2),
                                               "step_x": round(r["step_speedup"], 2)}
                      for r in rows}, wall="wall_seconds")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
