"""The `--data` flag: one string -> (train, eval) BatchSources for the recommendation experiments.

Forms:
  synthetic     SyntheticCriteo: train split endless, eval = `eval_batches` batches of the
                test split (same hidden model, different draws).
  criteo:DIR    Kaggle layout (DIR/train.txt): train on train.txt, eval on valid.txt +
                test.txt (labeled splits; the challenge's own unlabeled test.txt has 39
                fields and is rejected line 1). Terabyte layout (DIR/day_0 .. day_23, each
                plain or .gz): train on day_0 .. day_22, eval on day_23.
  avazu:DIR     train on DIR/train.csv, eval on DIR/dev.csv + DIR/test.csv.
File sources train with `drop_remainder=True, repeat=True` and evaluate with
`drop_remainder=False, repeat=False` (last eval batch padded with mask 0); files are read in
order (no shuffling) and `seed` only affects synthetic data. `num_rows=None` means
`DEFAULT_NUM_ROWS` = 100_000 hashed rows per feature for every form (Avazu's hour_of_day /
day_of_week tables are capped at 25 / 8 rows).
"""

from __future__ import annotations

import os

from rec.data import avazu, criteo, synthetic
from rec.data.batch import BatchSource

DEFAULT_NUM_ROWS = 100_000
DEFAULT_EVAL_BATCHES = 20
FORMS = "'synthetic', 'criteo:DIR' or 'avazu:DIR'"
CRITEO_DAYS = 24


def _need(data: str, paths: list[str], layout: str) -> list[str]:
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise ValueError(f"--data={data!r}: the {layout} layout needs {', '.join(paths)}; "
                     f"missing: {', '.join(missing)}")
  return paths


def _day_file(d: str, day: int) -> str | None:
  for name in (f"day_{day}", f"day_{day}.gz"):
    if os.path.isfile(os.path.join(d, name)):
      return os.path.join(d, name)
  return None


def criteo_files(data: str, d: str) -> tuple[list[str], list[str]]:
  """(train files, eval files) of a Criteo directory, Kaggle or Terabyte layout."""
  if os.path.isfile(os.path.join(d, "train.txt")):
    return _need(data, [os.path.join(d, "train.txt")], "Criteo Kaggle"), _need(
        data, [os.path.join(d, "valid.txt"), os.path.join(d, "test.txt")], "Criteo Kaggle")
  days = [_day_file(d, i) for i in range(CRITEO_DAYS)]
  if any(days):
    missing = [f"day_{i}[.gz]" for i, f in enumerate(days) if f is None]
    if missing:
      raise ValueError(f"--data={data!r}: Criteo Terabyte layout needs day_0 .. day_23 "
                       f"(plain or .gz) in {d!r}; missing {', '.join(missing)}")
    return days[:-1], days[-1:]
  raise ValueError(f"--data={data!r}: {d!r} has neither train.txt (Criteo Kaggle layout) nor "
                   "day_0 .. day_23[.gz] (Criteo Terabyte layout)")


def make_sources(data: str, batch_size: int, eval_batch_size: int | None = None,
                 num_rows: int | list[int] | None = None, seed: int = 0, bad_lines: str = "error",
                 shard_index: int = 0, num_shards: int = 1,
                 eval_batches: int = DEFAULT_EVAL_BATCHES) -> tuple[BatchSource, BatchSource]:
  """(train, eval) sources for a `--data` value; see the module docstring for the forms.

  shard_index / num_shards pick this process's disjoint share of the file lines (of the
  synthetic batch streams). eval_batches applies to synthetic only.
  """
  eval_batch_size = eval_batch_size or batch_size
  rows = DEFAULT_NUM_ROWS if num_rows is None else num_rows
  kind, sep, d = data.partition(":")
  if data == "synthetic":
    shards = dict(shard_index=shard_index, num_shards=num_shards)
    train = synthetic.SyntheticCriteo(batch_size, rows, seed=seed, split="train", **shards)
    evals = synthetic.SyntheticCriteo(eval_batch_size, rows, seed=seed, split="test",
                                      num_batches=eval_batches, **shards)
    return train, evals
  if kind not in ("criteo", "avazu") or not sep or not d:
    raise ValueError(f"--data={data!r}: expected {FORMS}")
  if not os.path.isdir(d):
    raise ValueError(f"--data={data!r}: {d!r} is not a directory")
  if kind == "criteo":
    train_files, eval_files = criteo_files(data, d)
    cls = criteo.CriteoSource
  else:
    train_files = _need(data, [os.path.join(d, "train.csv")], "Avazu")
    eval_files = _need(data, [os.path.join(d, "dev.csv"), os.path.join(d, "test.csv")], "Avazu")
    cls = avazu.AvazuSource
  common = dict(bad_lines=bad_lines, shard_index=shard_index, num_shards=num_shards)
  train = cls(train_files, batch_size, rows, drop_remainder=True, repeat=True, **common)
  evals = cls(eval_files, eval_batch_size, rows, drop_remainder=False, repeat=False, **common)
  return train, evals
