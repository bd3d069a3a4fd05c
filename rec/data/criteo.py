"""Streaming reader of Criteo's native click logs (Kaggle `train.txt` / `test.txt`, Terabyte
`day_N[.gz]`), and the layouts of those downloads (`criteo_layout`).

Each line: 40 tab-separated fields, no header: label (0/1), 13 integer counts I1..I13 (may be
empty or negative), 26 categorical C1..C26 (hex hashes of up to 8 digits, may be empty).
Unlabeled lines (Kaggle's test.txt) have the 39 fields without the label.
Decoding (the DLRM preprocessing, with the categorical ids hashed instead of vocab-mapped):
  - dense:  log1p(max(x, 0)) as float32, empty -> 0
  - sparse: id = 1 + int(hex, 16) % (rows - 1), empty -> 0 (row 0 means "missing")
A chunk of lines is decoded at once with numpy on the raw bytes, and every field is checked:
a malformed line raises a UserError with file:line, field, value and what was expected, or
is skipped and counted with `bad_lines="skip"`.

Layouts of a Criteo directory (`criteo_layout`; the splits each name a list of `stream.Part`s):
  - Kaggle as downloaded (dac.tar.gz): `train.txt` (labeled, 45,840,617 lines in time order)
    and `test.txt` (unlabeled). train.txt is cut as the DLRM reference does
    (facebookresearch/dlrm data_utils.getCriteoAdData with days=7 and
    dlrm_data_pytorch.CriteoDataset): seven consecutive parts of
    divmod(lines, 7) lines, the remainder going one line each to the first parts; parts
    1-6 train, and part 7 split in two: its first ceil(n / 2) lines are the test split, the
    rest the validation split. test.txt is the "predict" split (no labels).
  - a custom split: `train.txt` + `valid.txt` (+ `test.txt`), all labeled (our sample's
    layout): each file is its split.
  - Terabyte: `day_0` .. `day_23`, each plain or .gz; `days` picks any subset (all present
    by default). MLPerf's split (TorchRec's InMemoryBinaryCriteoIterDataPipe) when day 23 is
    among them: the other days train, day 23's first ceil(n / 2) lines validate and the rest
    test. Without day 23 the last day given plays its part (first half validation, second
    half test) and the days before it train.

Letters: N lines in a chunk, V valid lines, F fields of a line (40, or 39 unlabeled).
"""

from __future__ import annotations

import math
import os
import re
from typing import Sequence

import numpy as np

from core.errors import UserError
from rec.data import stream
from rec.data.batch import DataSpec

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
FIELD_NAMES = ("label",) + DENSE_NAMES + SPARSE_NAMES
DEFAULT_ROWS = 100_000   # hashed rows per feature when none are given
MAX_HEX_DIGITS = 8
MAX_INT_DIGITS = 18      # always fits int64

# byte -> hex digit value, -1 for anything else (a NUL too: short fields are padded with '0')
_HEX = np.full(256, -1, np.int8)
for _c in b"0123456789":
  _HEX[_c] = _c - ord("0")
for _c in b"abcdef":
  _HEX[_c] = _c - ord("a") + 10
  _HEX[_c - 32] = _c - ord("a") + 10
_POW10 = 10.0 ** np.arange(7, -1, -1)  # place values of 8 right-aligned digits
_INT_RE = re.compile(rb"-?[0-9]+")

_EXPECTED = {
    "label": "expected 0 or 1",
    "int": "expected an integer or empty",
    "int_long": f"expected an integer of at most {MAX_INT_DIGITS} digits or empty",
    "hex": f"expected up to {MAX_HEX_DIGITS} hex digits or empty",
}
_FIELD_HINTS = {
    True: {NUM_FIELDS - 1: " (an unlabeled line, like Kaggle's test.txt: training and "
                           "evaluation need the label first)"},
    False: {NUM_FIELDS: " (a labeled line; Kaggle's test.txt has no label column)"},
}


def parse_lines(lines: list[bytes], rows_per_feature: Sequence[int],
                labeled: bool = True) -> stream.Parsed:
  """Decodes Criteo lines (with or without their newlines) into dense, ids and labels.

  Returns the valid lines' rows in order (dense [V, 13] f32, ids [V, 26] int32, labels [V]
  f32, all 0 when `labeled` is False: lines of 39 fields, no label) and, for each bad line,
  (its index in `lines`, what is wrong with it).
  """
  c0 = int(labeled)                     # the first feature's field
  num_fields = NUM_FIELDS - 1 + c0
  names = FIELD_NAMES[1 - c0:]
  ok, bad_shape = stream.split_by_field_count(lines, b"\t", num_fields, "tab",
                                              _FIELD_HINTS[labeled])
  good_idx = np.flatnonzero(ok)
  n = len(good_idx)
  # 8 NUL bytes in front so that "the 8 bytes before a field's end" always exist
  buf = b"\0" * 8 + stream.join_lines(
      lines if n == len(lines) else [lines[i] for i in good_idx])
  buf_u8 = np.frombuffer(buf, np.uint8)
  words = stream.byte_words(buf)
  seps = np.flatnonzero((buf_u8 == 9) | (buf_u8 == 10))
  assert len(seps) == n * num_fields, (len(seps), n)
  ends_NF = seps.reshape(n, num_fields)
  starts_NF = np.empty_like(ends_NF)
  starts_NF.flat[0:1] = 8
  starts_NF.flat[1:] = seps[:-1] + 1
  lens_NF = ends_NF - starts_NF

  # label: exactly one character, '0' or '1'
  if labeled:
    label_c = buf_u8[starts_NF[:, 0]]
    label_bad = (lens_NF[:, 0] != 1) | ((label_c != ord("0")) & (label_c != ord("1")))
    labels = (label_c == ord("1")).astype(np.float32)
  else:
    label_bad = np.zeros((n, 0), bool)
    labels = np.zeros(n, np.float32)

  # integers of up to 8 characters: an optional '-' then digits. The 8 bytes before a field's
  # end are read as one word; bytes outside the digits become '0' so the place values work.
  dense_cols = slice(c0, c0 + NUM_DENSE)
  i_lens = lens_NF[:, dense_cols]
  negative = buf_u8[starts_NF[:, dense_cols]] == ord("-")
  negative &= i_lens > 0
  n_digits = np.minimum(i_lens, 8) - negative
  digits = stream.last_bytes_zero_padded(words, ends_NF[:, dense_cols], n_digits)
  digits -= np.uint8(ord("0"))
  int_bad = stream.any_bytes(digits > 9) | (negative & (i_lens == 1))
  values = digits @ _POW10
  int_too_long = np.zeros(i_lens.shape, bool)
  for r, f in zip(*np.nonzero(i_lens > 8)):  # rare: check and convert them one by one
    text = buf[starts_NF[r, c0 + f]:ends_NF[r, c0 + f]]
    good = _INT_RE.fullmatch(text) is not None
    int_too_long[r, f] = good and len(text.lstrip(b"-")) > MAX_INT_DIGITS
    int_bad[r, f] = not good or int_too_long[r, f]
    values[r, f] = float(int(text)) if good and not int_too_long[r, f] else 0.0
  dense = np.log1p(np.where(negative, 0.0, values)).astype(np.float32)

  # categoricals: up to 8 hex digits, right-aligned in one word, packed into a big-endian u32
  c_lens = lens_NF[:, c0 + NUM_DENSE:]
  c_chars = stream.last_bytes_zero_padded(words, ends_NF[:, c0 + NUM_DENSE:], c_lens)
  nibbles = _HEX[c_chars]
  hex_bad = stream.any_bytes(nibbles < 0) | (c_lens > MAX_HEX_DIGITS)
  nibbles = nibbles.view(np.uint8)
  packed = (nibbles[..., 0::2] << 4) | nibbles[..., 1::2]
  values = np.ascontiguousarray(packed).view(">u4")[..., 0].astype(np.int64)
  mod = np.asarray(rows_per_feature, np.int64) - 1
  ids = np.where(c_lens == 0, 0, 1 + values % mod).astype(np.int32)

  bad_NF = np.concatenate([label_bad.reshape(n, c0), int_bad, hex_bad], axis=1)
  bad_rows = np.flatnonzero(bad_NF.any(1))
  bad_fields = []
  for r in bad_rows:
    f = int(np.argmax(bad_NF[r]))
    value = buf[starts_NF[r, f]:ends_NF[r, f]]
    if f < c0:
      expected = _EXPECTED["label"]
    elif f < c0 + NUM_DENSE:
      expected = _EXPECTED["int_long" if int_too_long[r, f - c0] else "int"]
    else:
      expected = _EXPECTED["hex"]
    bad_fields.append(
        (int(good_idx[r]), f"field {names[f]} = {stream.field_text(value)}; {expected}"))
  return stream.keep_good_rows(dense, ids, labels, bad_rows, bad_shape, bad_fields)


def criteo_spec(rows_per_feature: int | Sequence[int] = DEFAULT_ROWS) -> DataSpec:
  """DataSpec of Criteo batches: 13 dense, 26 one-hot sparse features C1..C26."""
  rows = stream.check_rows_per_feature(rows_per_feature, SPARSE_NAMES, "Criteo")
  return DataSpec(num_dense=NUM_DENSE, sparse_features=SPARSE_NAMES, rows_per_feature=rows,
                  max_ids_per_bag=1)


class CriteoSource(stream.LineSource):
  """Batches of Criteo click logs from plain or gzip files (or `stream.Part`s of them); one
  shard of their lines. `labeled=False` reads 39-field lines (Kaggle's test.txt): labels 0.

  See `stream.LineSource` for the batching, repeat, resume, sharding and bad-line rules.
  """

  def __init__(self, files, batch_size: int,
               rows_per_feature: int | Sequence[int] = DEFAULT_ROWS, *, bad_lines: str = "error",
               drop_remainder: bool = True, shard_index: int = 0, num_shards: int = 1,
               repeat: bool = True, chunk_bytes: int = 1 << 20, labeled: bool = True):
    self.spec = criteo_spec(rows_per_feature)
    self.labeled = bool(labeled)
    super().__init__(files, batch_size, bad_lines=bad_lines, drop_remainder=drop_remainder,
                     shard_index=shard_index, num_shards=num_shards, repeat=repeat,
                     chunk_bytes=chunk_bytes)

  def _parse(self, lines: list[bytes]) -> stream.Parsed:
    return parse_lines(lines, self.spec.rows_per_feature, self.labeled)


# --- layouts of a Criteo directory ---------------------------------------------------------

KAGGLE_DAYS = 7
KAGGLE_TRAIN_LINES = 45_840_617
KAGGLE_TEST_FIRST_ID = 60_000_000   # Kaggle's ids: test.txt line i is Id 60,000,000 + i
TERABYTE_DAYS = 24
MLPERF_EVAL_DAY = 23
LABELED_SPLITS = ("train", "valid", "test")


def parse_days(text: str | Sequence[int] | None, flag: str = "--days") -> tuple[int, ...] | None:
  """'0-2' / '0,3,5-6' / a list -> sorted distinct day numbers in [0, 23]; '' / None -> None
  (every day present)."""
  if text is None or (isinstance(text, str) and not text.strip()):
    return None
  items = text.split(",") if isinstance(text, str) else list(text)
  days = set()
  for item in items:
    try:
      if isinstance(item, str) and "-" in item.strip()[1:]:
        lo, hi = (int(x) for x in item.split("-"))
        if hi < lo:
          raise ValueError
        days.update(range(lo, hi + 1))
      else:
        days.add(int(item))
    except ValueError:
      raise UserError(f"{flag}={text!r}: {item!r} is not a day or a range of days; expected "
                      "day numbers 0-23 such as 0-2 or 0,3,5-6") from None
  bad = sorted(x for x in days if not 0 <= x < TERABYTE_DAYS)
  if bad:
    raise UserError(f"{flag}={text!r}: day {bad[0]}; expected days in 0..{TERABYTE_DAYS - 1}")
  return tuple(sorted(days))


def _day_file(d: str, day: int) -> str | None:
  for name in (f"day_{day}", f"day_{day}.gz"):
    if os.path.isfile(os.path.join(d, name)):
      return os.path.join(d, name)
  return None


def _halves(path: str, first: str, second: str) -> dict[str, tuple[stream.Part, ...]]:
  """A file's lines cut in two: the first ceil(n / 2) for split `first`, the rest `second`."""
  index = stream.index_lines(path)
  n = index.lines
  if n < 2:
    raise UserError(f"{path}: {n} lines; expected at least 2 to split into {first} and "
                    f"{second} halves")
  h = math.ceil(n / 2)
  off = end = None
  if not path.endswith(".gz"):
    off, end = index.offset(h), index.offset(n)
  return {first: (stream.Part(path, 0, h, 0, off),), second: (stream.Part(path, h, n, off, end),)}


def kaggle_days(n: int) -> list[int]:
  """Lines per day of a Kaggle train.txt of n lines, as the DLRM reference cuts it."""
  q, r = divmod(n, KAGGLE_DAYS)
  return [q + (i < r) for i in range(KAGGLE_DAYS)]


def criteo_layout(d: str, days: str | Sequence[int] | None = None,
                  flag: str = "--data=criteo:DIR", days_flag: str = "--days") -> stream.Layout:
  """The splits of a Criteo directory; see the module docstring. Errors name `flag`."""
  where = f"{flag.replace('DIR', d)}"
  if not os.path.isdir(d):
    raise UserError(f"{where}: {d!r} is not a directory; expected the directory of Criteo's "
                    "train.txt (Kaggle) or day_N[.gz] files (Terabyte)")
  day_list = parse_days(days, days_flag)
  path = lambda name: os.path.join(d, name)
  if os.path.isfile(path("train.txt")):
    if day_list is not None:
      raise UserError(f"{days_flag}={days!r}: {d} holds train.txt (the Kaggle layout); expected "
                      "--days only with the Terabyte layout (day_0 .. day_23)")
    if os.path.isfile(path("valid.txt")):
      splits = {"train": (stream.Part(path("train.txt")),),
                "valid": (stream.Part(path("valid.txt")),)}
      if os.path.isfile(path("test.txt")):
        splits["test"] = (stream.Part(path("test.txt")),)
      return stream.Layout("custom", splits, "a custom split: train.txt trains, valid.txt "
                    + ("and test.txt evaluate" if "test" in splits else "evaluates"))
    index = stream.index_lines(path("train.txt"))
    n = index.lines
    if n < 2 * KAGGLE_DAYS:
      raise UserError(f"{path('train.txt')}: {n} lines; expected at least {2 * KAGGLE_DAYS} to "
                      f"cut into {KAGGLE_DAYS} days and split the last into test and validation")
    sizes = kaggle_days(n)
    b6 = sum(sizes[:-1])
    t = b6 + math.ceil(sizes[-1] / 2)
    at = {k: index.offset(k) for k in (b6, t, n)}
    splits = {"train": (stream.Part(path("train.txt"), 0, b6, 0, at[b6]),),
              "test": (stream.Part(path("train.txt"), b6, t, at[b6], at[t]),),
              "valid": (stream.Part(path("train.txt"), t, n, at[t], at[n]),)}
    if os.path.isfile(path("test.txt")):
      splits["predict"] = (stream.Part(path("test.txt")),)
    return stream.Layout("kaggle", splits,
                  f"Criteo Kaggle: train.txt's {n:,} lines cut into {KAGGLE_DAYS} days as the DLRM "
                  f"reference does; days 1-6 train ({b6:,} lines), day 7's first {t - b6:,} lines "
                  f"test and last {n - t:,} validate"
                  + ("; test.txt (unlabeled) is the predict split" if "predict" in splits else ""))
  present = {i: f for i in range(TERABYTE_DAYS) if (f := _day_file(d, i))}
  if not present:
    raise UserError(f"{where}: {d!r} has neither train.txt (the Criteo Kaggle layout) nor "
                    "day_N[.gz] files (Terabyte); expected one of them")
  chosen = day_list if day_list is not None else tuple(sorted(present))
  missing = [i for i in chosen if i not in present]
  if missing:
    raise UserError(f"{path(f'day_{missing[0]}')}[.gz]: not found; expected every day of "
                    f"{days_flag}={days if isinstance(days, str) else ','.join(map(str, chosen))}"
                    f" (present in {d}: {_ranges(sorted(present))})")
  if len(chosen) < 2:
    raise UserError(f"{days_flag}={days}: one day ({chosen[0]}); expected at least two, days to "
                    "train on and a last day to split into validation and test")
  eval_day = MLPERF_EVAL_DAY if MLPERF_EVAL_DAY in chosen else chosen[-1]
  train_days = [i for i in chosen if i != eval_day]
  splits = {"train": tuple(stream.Part(present[i]) for i in train_days),
            **_halves(present[eval_day], "valid", "test")}
  v, t = splits["valid"][0], splits["test"][0]
  how = ("MLPerf's split" if eval_day == MLPERF_EVAL_DAY else
         "day 23 absent: the last day given is split as MLPerf splits day 23")
  return stream.Layout("terabyte", splits,
                f"Criteo Terabyte: days {_ranges(train_days)} train; day {eval_day}'s first "
                f"{v.stop:,} lines validate and last {t.stop - t.start:,} test ({how})")


def _ranges(days: Sequence[int]) -> str:
  """[0, 1, 2, 5] -> '0-2, 5'."""
  out, i = [], 0
  while i < len(days):
    j = i
    while j + 1 < len(days) and days[j + 1] == days[j] + 1:
      j += 1
    out.append(str(days[i]) if i == j else f"{days[i]}-{days[j]}")
    i = j + 1
  return ", ".join(out)
