"""Streaming reader of Criteo's native click logs (Kaggle `train.txt`, Terabyte `day_N[.gz]`).

Each line: 40 tab-separated fields, no header: label (0/1), 13 integer counts I1..I13 (may be
empty or negative), 26 categorical C1..C26 (hex hashes of up to 8 digits, may be empty).
Decoding (the DLRM preprocessing, with the categorical ids hashed instead of vocab-mapped):
  - dense:  log1p(max(x, 0)) as float32, empty -> 0
  - sparse: id = 1 + int(hex, 16) % (rows - 1), empty -> 0 (row 0 means "missing")
A chunk of lines is decoded at once with numpy on the raw bytes, and every field is checked:
a malformed line raises ValueError with file:line, field, value and what was expected, or
is skipped and counted with `bad_lines="skip"`.

Letters: N lines in a chunk, V valid lines, F fields of a line (40).
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import numpy as np

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


def parse_lines(lines: list[bytes], rows_per_feature: Sequence[int]) -> stream.Parsed:
  """Decodes Criteo lines (with or without their newlines) into dense, ids and labels.

  Returns the valid lines' rows in order (dense [V, 13] f32, ids [V, 26] int32, labels [V]
  f32) and, for each bad line, (its index in `lines`, what is wrong with it).
  """
  ok, bad_shape = stream.split_by_field_count(lines, b"\t", NUM_FIELDS, "tab")
  good_idx = np.flatnonzero(ok)
  n = len(good_idx)
  # 8 NUL bytes in front so that "the 8 bytes before a field's end" always exist
  buf = b"\0" * 8 + stream.join_lines(
      lines if n == len(lines) else [lines[i] for i in good_idx])
  buf_u8 = np.frombuffer(buf, np.uint8)
  words = stream.byte_words(buf)
  seps = np.flatnonzero((buf_u8 == 9) | (buf_u8 == 10))
  assert len(seps) == n * NUM_FIELDS, (len(seps), n)
  ends_NF = seps.reshape(n, NUM_FIELDS)
  starts_NF = np.empty_like(ends_NF)
  starts_NF.flat[0:1] = 8
  starts_NF.flat[1:] = seps[:-1] + 1
  lens_NF = ends_NF - starts_NF

  # label: exactly one character, '0' or '1'
  label_c = buf_u8[starts_NF[:, 0]]
  label_bad = (lens_NF[:, 0] != 1) | ((label_c != ord("0")) & (label_c != ord("1")))
  labels = (label_c == ord("1")).astype(np.float32)

  # integers of up to 8 characters: an optional '-' then digits. The 8 bytes before a field's
  # end are read as one word; bytes outside the digits become '0' so the place values work.
  i_lens = lens_NF[:, 1:1 + NUM_DENSE]
  negative = buf_u8[starts_NF[:, 1:1 + NUM_DENSE]] == ord("-")
  negative &= i_lens > 0
  n_digits = np.minimum(i_lens, 8) - negative
  digits = stream.last_bytes_zero_padded(words, ends_NF[:, 1:1 + NUM_DENSE], n_digits)
  digits -= np.uint8(ord("0"))
  int_bad = stream.any_bytes(digits > 9) | (negative & (i_lens == 1))
  values = digits @ _POW10
  int_too_long = np.zeros(i_lens.shape, bool)
  for r, f in zip(*np.nonzero(i_lens > 8)):  # rare: check and convert them one by one
    text = buf[starts_NF[r, 1 + f]:ends_NF[r, 1 + f]]
    good = _INT_RE.fullmatch(text) is not None
    int_too_long[r, f] = good and len(text.lstrip(b"-")) > MAX_INT_DIGITS
    int_bad[r, f] = not good or int_too_long[r, f]
    values[r, f] = float(int(text)) if good and not int_too_long[r, f] else 0.0
  dense = np.log1p(np.where(negative, 0.0, values)).astype(np.float32)

  # categoricals: up to 8 hex digits, right-aligned in one word, packed into a big-endian u32
  c_lens = lens_NF[:, 1 + NUM_DENSE:]
  c_chars = stream.last_bytes_zero_padded(words, ends_NF[:, 1 + NUM_DENSE:], c_lens)
  nibbles = _HEX[c_chars]
  hex_bad = stream.any_bytes(nibbles < 0) | (c_lens > MAX_HEX_DIGITS)
  nibbles = nibbles.view(np.uint8)
  packed = (nibbles[..., 0::2] << 4) | nibbles[..., 1::2]
  values = np.ascontiguousarray(packed).view(">u4")[..., 0].astype(np.int64)
  mod = np.asarray(rows_per_feature, np.int64) - 1
  ids = np.where(c_lens == 0, 0, 1 + values % mod).astype(np.int32)

  bad_NF = np.concatenate([label_bad[:, None], int_bad, hex_bad], axis=1)
  bad_rows = np.flatnonzero(bad_NF.any(1))
  bad_fields = []
  for r in bad_rows:
    f = int(np.argmax(bad_NF[r]))
    value = buf[starts_NF[r, f]:ends_NF[r, f]]
    if f == 0:
      expected = _EXPECTED["label"]
    elif f <= NUM_DENSE:
      expected = _EXPECTED["int_long" if int_too_long[r, f - 1] else "int"]
    else:
      expected = _EXPECTED["hex"]
    bad_fields.append(
        (int(good_idx[r]), f"field {FIELD_NAMES[f]} = {stream.field_text(value)}: {expected}"))
  return stream.keep_good_rows(dense, ids, labels, bad_rows, bad_shape, bad_fields)


def criteo_spec(rows_per_feature: int | Sequence[int] = DEFAULT_ROWS) -> DataSpec:
  """DataSpec of Criteo batches: 13 dense, 26 one-hot sparse features C1..C26."""
  rows = stream.check_rows_per_feature(rows_per_feature, SPARSE_NAMES, "Criteo")
  return DataSpec(num_dense=NUM_DENSE, sparse_features=SPARSE_NAMES, rows_per_feature=rows,
                  max_ids_per_bag=1)


class CriteoSource(stream.LineSource):
  """Batches of Criteo click logs from plain or gzip files; one shard of their lines.

  See `stream.LineSource` for the batching, repeat, resume, sharding and bad-line rules.
  """

  def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int,
               rows_per_feature: int | Sequence[int] = DEFAULT_ROWS, *, bad_lines: str = "error",
               drop_remainder: bool = True, shard_index: int = 0, num_shards: int = 1,
               repeat: bool = True, chunk_bytes: int = 1 << 20):
    self.spec = criteo_spec(rows_per_feature)
    super().__init__(files, batch_size, bad_lines=bad_lines, drop_remainder=drop_remainder,
                     shard_index=shard_index, num_shards=num_shards, repeat=repeat,
                     chunk_bytes=chunk_bytes)

  def _parse(self, lines: list[bytes]) -> stream.Parsed:
    return parse_lines(lines, self.spec.rows_per_feature)
