"""Streaming reader of the Avazu click-through data (`train.csv`, and header-less splits).

Each line: 24 comma-separated fields (no quoting): id, click, hour, C1, banner_pos, site_id,
site_domain, site_category, app_id, app_domain, app_category, device_id, device_ip,
device_model, device_type, device_conn_type, C14..C21. A file whose first field is `id` starts
with a header line, which is left out. Decoding:
  - label: click (0/1)
  - hour (YYMMDDHH) -> two categorical features, hour_of_day (id 1 + HH) and day_of_week
    (id 1 + weekday, Monday = 0); empty -> 0 ("missing")
  - the 21 other columns (C1 .. C21) are categorical: id = 1 + crc32(bytes) % (rows - 1),
    empty -> 0
  - `id` is not a feature. There are no dense features (dense is [B, 0]).
With one int for `rows_per_feature`, hour_of_day and day_of_week get min(rows, 25) and
min(rows, 8) rows (their whole vocabulary and the missing row); a list gives all 23.

Letters: B batch, N lines.
"""

from __future__ import annotations

import os
from typing import Sequence
import zlib

import numpy as np

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


def avazu_rows(rows_per_feature: int | Sequence[int]) -> tuple[int, ...]:
  """Rows of the 23 tables: an int caps hour_of_day / day_of_week at 25 / 8, a list is as given."""
  if isinstance(rows_per_feature, (int, np.integer)) and not isinstance(rows_per_feature, bool):
    r = stream.check_rows_per_feature(rows_per_feature, SPARSE_NAMES, "Avazu")[0]
    return (min(r, HOUR_ROWS), min(r, WEEKDAY_ROWS)) + (r,) * len(HASHED)
  return stream.check_rows_per_feature(rows_per_feature, SPARSE_NAMES, "Avazu")


def _hour_features(hours: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """YYMMDDHH strings -> (hour of day, weekday with Monday 0, empty, bad), each [N]."""
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
  return hh, weekday, empty, bad & ~empty


def parse_lines(lines: list[bytes], rows_per_feature: Sequence[int]) -> stream.Parsed:
  """Decodes Avazu data lines (no header) into ids and labels; dense is [V, 0].

  Returns the valid lines' rows in order and, for each bad line, (its index, what is wrong).
  """
  ok, bad_shape = stream.split_by_field_count(lines, b",", NUM_FIELDS, "comma")
  good_idx = np.flatnonzero(ok)
  n = len(good_idx)
  buf = stream.join_lines(lines if n == len(lines) else [lines[i] for i in good_idx])
  fields = buf.replace(b"\n", b",").split(b",")[:-1]   # [N * 24], row-major
  assert len(fields) == n * NUM_FIELDS, (len(fields), n)

  clicks = np.array(fields[1::NUM_FIELDS], dtype="S2")
  click_bad = (clicks != b"0") & (clicks != b"1")
  labels = (clicks == b"1").astype(np.float32)
  hh, weekday, hour_empty, hour_bad = _hour_features(fields[2::NUM_FIELDS])

  rows = np.asarray(rows_per_feature, np.int64)
  crc = np.fromiter(map(zlib.crc32, fields), np.int64, len(fields)).reshape(n, NUM_FIELDS)[:, 3:]
  lens = np.fromiter(map(len, fields), np.int64, len(fields)).reshape(n, NUM_FIELDS)[:, 3:]
  ids = np.empty((n, len(SPARSE_NAMES)), np.int32)
  ids[:, 0] = np.where(hour_empty, 0, 1 + hh % (rows[0] - 1))
  ids[:, 1] = np.where(hour_empty, 0, 1 + weekday % (rows[1] - 1))
  ids[:, 2:] = np.where(lens == 0, 0, 1 + crc % (rows[2:] - 1))

  bad_fields = []
  for r in np.flatnonzero(click_bad | hour_bad):
    if click_bad[r]:
      what = f"field click = {stream.field_text(fields[r * NUM_FIELDS + 1])}: expected 0 or 1"
    else:
      what = f"field hour = {stream.field_text(fields[r * NUM_FIELDS + 2])}: {_HOUR_EXPECTED}"
    bad_fields.append((int(good_idx[r]), what))
  keep = ~(click_bad | hour_bad)
  if not keep.all():
    ids, labels = ids[keep], labels[keep]
  return stream.Parsed(dense=np.zeros((len(labels), 0), np.float32), ids=ids, labels=labels,
                       bad=stream.merge_bad(bad_shape, bad_fields))


def avazu_spec(rows_per_feature: int | Sequence[int] = DEFAULT_ROWS) -> DataSpec:
  """DataSpec of Avazu batches: no dense, 23 one-hot sparse features."""
  return DataSpec(num_dense=0, sparse_features=SPARSE_NAMES,
                  rows_per_feature=avazu_rows(rows_per_feature), max_ids_per_bag=1)


class AvazuSource(stream.LineSource):
  """Batches of Avazu click logs from plain or gzip CSV files; one shard of their rows.

  See `stream.LineSource` for the batching, repeat, resume, sharding and bad-line rules.
  """

  def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int,
               rows_per_feature: int | Sequence[int] = DEFAULT_ROWS, *, bad_lines: str = "error",
               drop_remainder: bool = True, shard_index: int = 0, num_shards: int = 1,
               repeat: bool = True, chunk_bytes: int = 1 << 20):
    self.spec = avazu_spec(rows_per_feature)
    super().__init__(files, batch_size, bad_lines=bad_lines, drop_remainder=drop_remainder,
                     shard_index=shard_index, num_shards=num_shards, repeat=repeat,
                     chunk_bytes=chunk_bytes)

  def _is_header(self, first_line: bytes) -> bool:
    return first_line.split(b",", 1)[0].strip() == b"id"

  def _parse(self, lines: list[bytes]) -> stream.Parsed:
    return parse_lines(lines, self.spec.rows_per_feature)
