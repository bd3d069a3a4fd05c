r"""Convert Criteo click logs once into memory-mapped numpy shards (`rec.data.criteo_bin`).

  python -m experiments.preprocess_criteo --src=../shared/data/criteo_kaggle_raw \
      --dst=/tmp/criteo_bin                                     # hashed ids, 100,000 rows
  python -m experiments.preprocess_criteo --src=DIR --dst=OUT --ids=vocab --min_count=4
  python -m experiments.preprocess_criteo --src=TB_DIR --dst=OUT --days=0-2   # 3 Terabyte days
  python -m experiments.train_rec --data=criteo_bin:/tmp/criteo_bin --epochs=1

--src holds Criteo Kaggle as downloaded (train.txt, cut into the DLRM reference's 7 days:
1-6 train, day 7's halves test and validation; test.txt, unlabeled, becomes the "predict"
split), a custom train.txt + valid.txt [+ test.txt], or Criteo Terabyte day_N[.gz] (--days
picks any of them; day 23, else the last day given, is split into validation and test
halves as MLPerf does). The vocabulary of --ids=vocab is counted on the train split only.
Units (64 MiB byte ranges of plain files, .gz files whole) convert in --workers processes
with a progress line (GiB, MiB/s, rows/s, ETA; one line per report in a log file); a killed
run resumes where it stopped (counting pass included) when started again with the same
flags, and says so. A finished conversion in --dst from other inputs or settings is
refused unless --overwrite. Bad lines stop the run with file:line unless --bad_lines=skip
(then counted in the manifest and the summary). Writes <dst>/manifest.json last and prints
one JSON line.
"""

from __future__ import annotations

import time

from absl import flags
from core import cli
from core import config
from core import results as results_lib
from core import settings

FLAGS = flags.FLAGS

SRC = config.setting("src", "string", "Directory with the Criteo text files.", none_ok=True)
DST = config.setting("dst", "string", "Output directory.", none_ok=True)
IDS = config.setting("ids", "enum", "hash: 1 + hex % (rows - 1); vocab: frequency-thresholded "
                     "vocabulary of the train split (DLRM / TorchRec).", choices=("hash", "vocab"))
MIN_COUNT = config.setting("min_count", "integer", "--ids=vocab: values seen fewer times map "
                           "to one rare id.", lower=1)
WORKERS = config.setting("workers", "integer", "Worker processes; 0 = one per CPU core.",
                         lower=0)
UNIT_MB = config.setting("unit_mb", "integer", "Plain files are converted in units of about "
                         "this many MiB (one worker task each; a killed run keeps the finished "
                         "units).", lower=1)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  from rec import configs
  config.define_flags(None, SRC, DST, IDS, configs.NUM_ROWS, MIN_COUNT, configs.BAD_LINES,
                      WORKERS, configs.DAYS, UNIT_MB, settings.OVERWRITE,
                      ids="hash", num_rows=100_000, min_count=1, bad_lines="error", workers=0,
                      days="", unit_mb=64, overwrite=False)
  flags.mark_flags_as_required(["src", "dst"])


def main(argv):
  del argv
  from core import workdir as workdir_lib
  from core.errors import UserError
  from rec.data import criteo_bin, stream
  if FLAGS.ids == "hash" and not 2 <= FLAGS.num_rows <= stream.MAX_TABLE_ROWS:
    raise UserError(f"--num_rows={FLAGS.num_rows:,}; expected 2 <= rows <= 2^31 - 2 = "
                    f"{stream.MAX_TABLE_ROWS:,} (row 0 is the missing value; a table's ids "
                    "and its padding id, num_rows, are int32)")
  # Each id scheme ignores the other's setting: given, it is refused, not dropped.
  other = {"hash": "min_count", "vocab": "num_rows"}[FLAGS.ids]
  if FLAGS[other].present:
    raise UserError(f"--{other}={FLAGS[other].value} with --ids={FLAGS.ids}; expected "
                    + ("--min_count only with --ids=vocab (hashed ids have --num_rows rows)"
                       if other == "min_count" else "--num_rows only with --ids=hash (the "
                       "vocabulary's rows are counted: --min_count sets them)"))
  # Before --src is read (a Terabyte day's gzip check alone takes minutes).
  workdir_lib.check_writable(FLAGS.dst, "--dst")
  t0 = time.perf_counter()
  m = criteo_bin.convert(FLAGS.src, FLAGS.dst, ids=FLAGS.ids, num_rows=FLAGS.num_rows,
                         min_count=FLAGS.min_count, bad_lines=FLAGS.bad_lines,
                         workers=FLAGS.workers or None, days=FLAGS.days or None,
                         overwrite=FLAGS.overwrite, unit_bytes=FLAGS.unit_mb << 20)
  secs = time.perf_counter() - t0
  rows = {s: v["rows"] for s, v in m["splits"].items()}
  print(f"{'split':8}{'rows':>14}{'shards':>8}  labeled")
  for s, v in m["splits"].items():
    print(f"{s:8}{v['rows']:>14,}{len(v['shards']):>8}  {'yes' if v['labeled'] else 'no'}")
  print(f"rows per feature: {m['rows_per_feature']}")
  if m["bad_lines_skipped"]:
    print(f"skipped {m['bad_lines_skipped']} malformed lines (--bad_lines=skip)")
  results_lib.print_summary({"dst": FLAGS.dst, "rows": rows, "ids": FLAGS.ids,
                             "layout": m["layout"], "seconds": secs,
                             "bad_lines_skipped": m["bad_lines_skipped"],
                             "fingerprint": criteo_bin.data_fingerprint(m)})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
