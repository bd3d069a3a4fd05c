r"""Convert Criteo click logs once into memory-mapped numpy shards (`rec.data.criteo_bin`).

  python -m experiments.preprocess_criteo --src=../shared/data/criteo_kaggle_sample \
      --dst=/tmp/criteo_bin                                     # hashed ids, 100,000 rows
  python -m experiments.preprocess_criteo --src=DIR --dst=OUT --ids=vocab --min_count=4
  python -m experiments.train_rec --data=criteo_bin:/tmp/criteo_bin --epochs=1

--src holds Criteo Kaggle train.txt + valid.txt + test.txt, or Criteo 1TB day_0 .. day_23
(plain or .gz). Units (64 MiB byte ranges of plain files, whole .gz files) convert in
--workers processes with a progress line (GiB, MiB/s, rows/s, ETA); a killed run resumes
where it stopped when started again with the same flags. Bad lines stop the run with
file:line unless --bad_lines=skip (then counted in the manifest and the summary).
Writes <dst>/manifest.json last and prints one JSON line.
"""

from __future__ import annotations

import json
import time

from absl import flags
from core import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  flags.DEFINE_string("src", None, "Directory with the Criteo text files.", required=True)
  flags.DEFINE_string("dst", None, "Output directory.", required=True)
  flags.DEFINE_enum("ids", "hash", ["hash", "vocab"], "hash: 1 + hex % (rows - 1); vocab: "
                    "frequency-thresholded vocabulary of the train split (DLRM / TorchRec).")
  flags.DEFINE_integer("num_rows", 100_000, "--ids=hash: rows per feature.")
  flags.DEFINE_integer("min_count", 1, "--ids=vocab: values seen fewer times map to one rare id.")
  flags.DEFINE_enum("bad_lines", "error", ["error", "skip"], "Malformed lines: stop, or skip and count.")
  flags.DEFINE_integer("workers", 0, "Worker processes; 0 = one per CPU core.")


def main(argv):
  del argv
  from rec.data import criteo_bin
  t0 = time.perf_counter()
  m = criteo_bin.convert(FLAGS.src, FLAGS.dst, ids=FLAGS.ids, num_rows=FLAGS.num_rows,
                         min_count=FLAGS.min_count, bad_lines=FLAGS.bad_lines,
                         workers=FLAGS.workers or None)
  secs = time.perf_counter() - t0
  rows = {s: v["rows"] for s, v in m["splits"].items()}
  print(f"{'split':8}{'rows':>14}{'shards':>8}")
  for s, v in m["splits"].items():
    print(f"{s:8}{v['rows']:>14,}{len(v['shards']):>8}")
  print(f"rows per feature: {m['rows_per_feature']}")
  if m["bad_lines_skipped"]:
    print(f"skipped {m['bad_lines_skipped']} malformed lines (--bad_lines=skip)")
  print(json.dumps({"dst": FLAGS.dst, "rows": rows, "ids": FLAGS.ids, "seconds": secs,
                    "bad_lines_skipped": m["bad_lines_skipped"]}))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
