"""Streaming reader of the Avazu click-through data, and the layouts of its directories.

Each line: 24 comma-separated fields (no quoting): id, click, hour, C1, banner_pos, site_id,
site_domain, site_category, app_id, app_domain, app_category, device_id, device_ip,
device_model, device_type, device_conn_type, C14..C21; unlabeled lines (Kaggle's test.gz)
have the 23 without click. A file whose first field is `id` starts with a header line,
which is left out. Decoding:
  - label: click (0/1)
  - hour (YYMMDDHH) -> two categorical features, hour_of_day (id 1 + HH) and day_of_week
    (id 1 + weekday, Monday = 0); empty -> 0 ("missing")
  - the 21 other columns (C1 .. C21) are categorical: id = 1 + crc32(bytes) % (rows - 1),
    empty -> 0
  - `id` is not a feature. There are no dense features (dense is [B, 0]).
With one int for `rows_per_feature`, hour_of_day and day_of_week get min(rows, 25) and
min(rows, 8) rows (their whole vocabulary and the missing row); a list gives all 23.

Layouts (`avazu_layout`):
  - as downloaded from the Kaggle competition: `train.gz` (or `train`, gunzipped; labeled,
    40,428,967 lines of Oct 21-30 2014 in time order) and `test.gz` (or `test`; unlabeled,
    the "predict" split). train is split by day of its hour field: the last day (Oct 30)
    is the test split, the day before (Oct 29) the validation split, every earlier day
    trains. One pass over the file finds the day boundaries (and checks the time order);
    each split then checks that its rows carry its days.
  - a custom split: `train.csv` + `dev.csv` / `valid.csv` and / or `test.csv` (labeled; our
    sample's layout): each file is its split.

Letters: B batch, N lines.
"""

from __future__ import annotations

import os
from typing import Sequence
import zlib

import numpy as np

from core.errors import UserError
from rec.data import stream
from rec.data.batch import DataSpec

COLUMNS = ("id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
           "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
           "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20",
           "C21")
NUM_FIELDS = len(COLUMNS)
HASHED = COLUMNS[3:]
SPARSE_NAMES = ("hour_of_day", "day_of_week") + HASHED
DEFAULT_ROWS = 100_000
HOUR_ROWS, WEEKDAY_ROWS = 25, 8   # 24 hours / 7 days and the missing row
_HOUR_EXPECTED = "expected YYMMDDHH (a valid date, hour 00-23) or empty"
_FIELD_HINTS = {
    True: {NUM_FIELDS - 1: " (an unlabeled line, like Kaggle's test.gz: training and "
                           "evaluation need the click column)"},
    False: {NUM_FIELDS: " (a labeled line; Kaggle's test.gz has no click column)"},
}


def avazu_rows(rows_per_feature: int | Sequence[int]) -> tuple[int, ...]:
  """Rows of the 23 tables: an int caps hour_of_day / day_of_week at 25 / 8, a list is as given."""
  if isinstance(rows_per_feature, (int, np.integer)) and not isinstance(rows_per_feature, bool):
    r = stream.check_rows_per_feature(rows_per_feature, SPARSE_NAMES, "Avazu")[0]
    return (min(r, HOUR_ROWS), min(r, WEEKDAY_ROWS)) + (r,) * len(HASHED)
  return stream.check_rows_per_feature(rows_per_feature, SPARSE_NAMES, "Avazu")


def _hour_features(hours: list[bytes]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """YYMMDDHH strings -> (hour of day, weekday with Monday 0, empty, bad, YYMMDD), each [N]."""
  raw = np.array(hours, dtype="S9")  # a 9th byte set means "too long"
  chars = raw.view(np.uint8).reshape(len(hours), 9).astype(np.int64)
  lens = np.fromiter(map(len, hours), np.int64, len(hours))
  empty = lens == 0
  digits = chars[:, :8] - ord("0")
  bad = (lens != 8) | ((digits < 0) | (digits > 9)).any(1)
  digits = np.where(bad[:, None], 0, digits)
  yy, mm, dd, hh = (digits[:, 2 * k] * 10 + digits[:, 2 * k + 1] for k in range(4))
  bad |= (mm < 1) | (mm > 12) | (dd < 1) | (hh > 23)
  month = (np.asarray(2000 + yy - 1970).astype("datetime64[Y]")
           + np.clip(mm - 1, 0, 11).astype("timedelta64[M]"))
  day = month.astype("datetime64[D]") + np.maximum(dd - 1, 0).astype("timedelta64[D]")
  bad |= day.astype("datetime64[M]") != month   # day 31 of a 30-day month, Feb 29 ...
  weekday = (day.astype(np.int64) + 3) % 7      # 1970-01-01 was a Thursday
  return hh, weekday, empty, bad & ~empty, yy * 10000 + mm * 100 + dd


def parse_lines(lines: list[bytes], rows_per_feature: Sequence[int], labeled: bool = True,
                days: tuple[int, int] | None = None) -> stream.Parsed:
  """Decodes Avazu data lines (no header) into ids and labels; dense is [V, 0].

  Returns the valid lines' rows in order and, for each bad line, (its index, what is wrong).
  `labeled=False`: lines without the click column (labels 0). `days=(first, last)`: rows
  whose YYMMDD lies outside stop the reader (`stop_at`): the file is not in time order.
  """
  nf = NUM_FIELDS - 1 + int(labeled)
  c = int(labeled)                      # the hour field is c + 1
  ok, bad_shape = stream.split_by_field_count(lines, b",", nf, "comma", _FIELD_HINTS[labeled])
  good_idx = np.flatnonzero(ok)
  n = len(good_idx)
  buf = stream.join_lines(lines if n == len(lines) else [lines[i] for i in good_idx])
  fields = buf.replace(b"\n", b",").split(b",")[:-1]   # [N * nf], row-major
  assert len(fields) == n * nf, (len(fields), n)

  if labeled:
    clicks = np.array(fields[1::nf], dtype="S2")
    click_bad = (clicks != b"0") & (clicks != b"1")
    labels = (clicks == b"1").astype(np.float32)
  else:
    click_bad = np.zeros(n, bool)
    labels = np.zeros(n, np.float32)
  hh, weekday, hour_empty, hour_bad, yymmdd = _hour_features(fields[c + 1::nf])
  off_days = np.zeros(n, bool)
  if days is not None:
    off_days = ~hour_bad & ~hour_empty & ((yymmdd < days[0]) | (yymmdd > days[1]))

  rows = np.asarray(rows_per_feature, np.int64)
  crc = np.fromiter(map(zlib.crc32, fields), np.int64, len(fields)).reshape(n, nf)[:, c + 2:]
  lens = np.fromiter(map(len, fields), np.int64, len(fields)).reshape(n, nf)[:, c + 2:]
  ids = np.empty((n, len(SPARSE_NAMES)), np.int32)
  ids[:, 0] = np.where(hour_empty, 0, 1 + hh % (rows[0] - 1))
  ids[:, 1] = np.where(hour_empty, 0, 1 + weekday % (rows[1] - 1))
  ids[:, 2:] = np.where(lens == 0, 0, 1 + crc % (rows[2:] - 1))

  bad_fields = []
  stop_at = None
  for r in np.flatnonzero(click_bad | hour_bad | off_days):
    if click_bad[r]:
      what = f"field click = {stream.field_text(fields[r * nf + 1])}; expected 0 or 1"
    elif hour_bad[r]:
      what = f"field hour = {stream.field_text(fields[r * nf + c + 1])}; {_HOUR_EXPECTED}"
    else:
      what = (f"field hour = {stream.field_text(fields[r * nf + c + 1])}, outside this split's "
              f"days {days[0]:06d}..{days[1]:06d}; expected the file in time order (the "
              "split's day boundaries were found by one pass over it)")
      stop_at = int(good_idx[r]) if stop_at is None else stop_at
    bad_fields.append((int(good_idx[r]), what))
  keep = ~(click_bad | hour_bad | off_days)
  if not keep.all():
    ids, labels = ids[keep], labels[keep]
  return stream.Parsed(dense=np.zeros((len(labels), 0), np.float32), ids=ids, labels=labels,
                       bad=stream.merge_bad(bad_shape, bad_fields), stop_at=stop_at)


def avazu_spec(rows_per_feature: int | Sequence[int] = DEFAULT_ROWS) -> DataSpec:
  """DataSpec of Avazu batches: no dense, 23 one-hot sparse features."""
  return DataSpec(num_dense=0, sparse_features=SPARSE_NAMES,
                  rows_per_feature=avazu_rows(rows_per_feature), max_ids_per_bag=1)


class AvazuSource(stream.LineSource):
  """Batches of Avazu click logs from plain or gzip CSV files (or `stream.Part`s of them);
  one shard of their rows. `labeled=False` reads lines without the click column (labels
  0); `days=(first, last)` YYMMDD bounds every row must fall in (a split by day).

  See `stream.LineSource` for the batching, repeat, resume, sharding and bad-line rules.
  """

  def __init__(self, files, batch_size: int,
               rows_per_feature: int | Sequence[int] = DEFAULT_ROWS, *, bad_lines: str = "error",
               drop_remainder: bool = True, shard_index: int = 0, num_shards: int = 1,
               repeat: bool = True, chunk_bytes: int = 1 << 20, labeled: bool = True,
               days: tuple[int, int] | None = None):
    self.spec = avazu_spec(rows_per_feature)
    self.labeled, self.days = bool(labeled), days
    super().__init__(files, batch_size, bad_lines=bad_lines, drop_remainder=drop_remainder,
                     shard_index=shard_index, num_shards=num_shards, repeat=repeat,
                     chunk_bytes=chunk_bytes)

  def _is_header(self, first_line: bytes) -> bool:
    return first_line.split(b",", 1)[0].strip() == b"id"

  def _parse(self, lines: list[bytes]) -> stream.Parsed:
    return parse_lines(lines, self.spec.rows_per_feature, self.labeled, self.days)


# --- layouts of an Avazu directory -----------------------------------------------------------

def _hour_of(line: bytes) -> int:
  """YYMMDDHH of a labeled data line, -1 when unreadable."""
  parts = line.split(b",", 3)
  try:
    return int(parts[2])
  except (IndexError, ValueError):
    return -1


def scan_days(path: str) -> list[tuple[int, int, int]]:
  """[(YYMMDD, first data line, stop data line)] of a labeled Avazu file in time order, in
  one pass: a chunk is parsed line by line only where its first and last lines are not of
  the current day. A line whose hour is earlier than the one before it (where lines are
  parsed) is an error naming it; a row of another day inside a one-day chunk is caught
  later by the split's own check (`AvazuSource(days=...)`)."""
  days: list[list[int]] = []
  data_line = 0
  prev = -1
  with stream.open_binary(path) as f:
    first = f.readline()
    header = int(first.split(b",", 1)[0].strip() == b"id")
    pending = [] if header else [first]
    while True:
      lines = pending + f.readlines(1 << 22)
      pending = []
      if not lines:
        break
      h0, h1 = _hour_of(lines[0]), _hour_of(lines[-1])
      if days and prev <= h0 <= h1 and h0 // 100 == h1 // 100 == days[-1][0]:
        days[-1][2] += len(lines)
        prev = h1
      else:
        for i, line in enumerate(lines):
          h = _hour_of(line)
          if h < 0 or h < prev:
            fields = line.split(b",", 3)
            found = (f"hour {stream.field_text(fields[2])} after {prev}" if len(fields) > 2
                     else f"line {stream.field_text(line)}")
            raise UserError(f"{path}:{data_line + i + 1 + header}: {found}; expected Avazu's "
                            "labeled train file in time order (YYMMDDHH non-decreasing), as "
                            "downloaded")
          if not days or days[-1][0] != h // 100:
            days.append([h // 100, data_line + i, data_line + i])
          days[-1][2] += 1
          prev = h
      data_line += len(lines)
  return [tuple(x) for x in days]


def _find(d: str, names: Sequence[str]) -> str | None:
  hits = [n for n in names if os.path.isfile(os.path.join(d, n))]
  return os.path.join(d, hits[0]) if hits else None


def avazu_layout(d: str, flag: str = "--data=avazu:DIR") -> stream.Layout:
  """The splits of an Avazu directory; see the module docstring. Errors name `flag`."""
  where = flag.replace("DIR", d)
  if not os.path.isdir(d):
    raise UserError(f"{where}: {d!r} is not a directory; expected Avazu's train.gz (as "
                    "downloaded) or train.csv + dev.csv / test.csv")
  if custom := _find(d, ["train.csv", "train.csv.gz"]):
    evals = {"valid": _find(d, ["dev.csv", "valid.csv", "dev.csv.gz", "valid.csv.gz"]),
             "test": _find(d, ["test.csv", "test.csv.gz"])}
    if not any(evals.values()):
      raise UserError(f"{where}: {d} has {os.path.basename(custom)} but no dev.csv, valid.csv "
                      "or test.csv; expected at least one to evaluate on")
    splits = {"train": (stream.Part(custom),),
              **{k: (stream.Part(v),) for k, v in evals.items() if v}}
    return stream.Layout("custom", splits, "a custom split: "
                         + ", ".join(f"{os.path.basename(v[0].path)} {k}"
                                     for k, v in splits.items()))
  train = _find(d, ["train.gz", "train"])
  if train is None:
    found = ", ".join(sorted(os.listdir(d))) or "nothing"
    raise UserError(f"{where}: {d} holds {found}; expected Avazu's train.gz (or train) as "
                    "downloaded, or train.csv with dev.csv / test.csv")
  days = scan_days(train)
  if len(days) < 3:
    raise UserError(f"{train}: {len(days)} days ({', '.join(str(x[0]) for x in days)}); "
                    "expected at least 3 (training days, a validation day and a test day)")
  plain = not train.endswith(".gz")
  index = stream.index_lines(train) if plain else None
  header = 1 if plain and _first_field(train) == b"id" else 0

  def part(a: int, b: int) -> stream.Part:
    if not plain:
      return stream.Part(train, a, b)
    return stream.Part(train, a, b, index.offset(a + header), index.offset(b + header))

  splits = {"train": (part(0, days[-2][1]),), "valid": (part(days[-2][1], days[-2][2]),),
            "test": (part(days[-1][1], days[-1][2]),)}
  if test := _find(d, ["test.gz", "test"]):
    splits["predict"] = (stream.Part(test),)
  note = (f"Avazu by day: {days[0][0]}..{days[-3][0]} train ({days[-2][1]:,} rows), "
          f"{days[-2][0]} validates ({days[-2][2] - days[-2][1]:,}), {days[-1][0]} tests "
          f"({days[-1][2] - days[-1][1]:,})"
          + (f"; {os.path.basename(test)} (unlabeled) is the predict split" if test else ""))
  return stream.Layout("avazu", splits, note, days={
      "train": (days[0][0], days[-3][0]), "valid": (days[-2][0],) * 2,
      "test": (days[-1][0],) * 2})


def _first_field(path: str) -> bytes:
  with stream.open_binary(path) as f:
    return f.readline().split(b",", 1)[0].strip()
