"""Streaming reader of libFM / libSVM-with-fields and libFFM text files (preprocessed CTR dumps).

The public Criteo / Avazu / ... dumps of AutoInt (arXiv 1810.11921), FuxiCTR / BARS and
xDeepFM come in two line forms, told apart by the first pair of the first line:
  - libFM, positional: `label idx:val idx:val ...` with exactly one pair per field in a fixed
    field order, so the j-th pair of a line is field j. The number of fields F is the number
    of pairs on the first line of the first file; every line must have F pairs.
  - libFFM: `label field:idx:val ...`, fields numbered from 0, a field may be left out (its
    id is 0, the "missing" row, weight 1) and appears at most once (one-hot). F is one more
    than the largest field index in the first `SNIFF_LINES` lines of the first file, or given.
Tokens are separated by spaces or tabs. Decoding:
  - label: 1 or +1 -> 1, 0 or -1 -> 0; anything else is a bad line
  - idx (a non-negative integer of at most 18 digits): id = 1 + idx % (rows - 1), row 0 being
    "missing" as in the Criteo reader. Plain mod rather than a hash: these dumps number each
    field's values with a contiguous range of global indices, which mod maps without
    collisions while the field has fewer values than rows - 1.
  - val (a finite number): the id's weight (`SparseBatch.weights`, [B, F, 1]), which the
    embedding bag multiplies its row by. That is how FM / AutoInt use it: categorical pairs
    carry val 1, and a numeric field is one fixed idx whose val is the (normalized) number,
    so its embedding is scaled by the value. `values="ignore"` drops them (weights None).
  - there are no dense features: dense is [B, 0].
Features are named f0 .. f{F-1}. Bad lines raise ValueError naming file:line, the field and
what was expected, or are skipped and counted with `bad_lines="skip"` (see `stream`).

Letters: N lines in a chunk, V valid lines, T tokens, P pairs, F fields.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from typing import Sequence

import numpy as np

from rec.data import stream
from rec.data.batch import DataSpec, SparseBatch

LIBFM, LIBFFM = "libfm", "libffm"
LINE_FORMS = (LIBFM, LIBFFM)
VALUE_MODES = ("weight", "ignore")
DEFAULT_ROWS = 100_000
SNIFF_LINES = 1000        # lines of the first file that set F in the libFFM form
MAX_INT_DIGITS = 18       # always fits int64
MAX_FIELD_DIGITS = 9
MAX_VAL_BYTES = 64        # longer values are bad; keeps the fixed-width byte arrays small

_IDX_EXPECTED = f"idx a non-negative integer of at most {MAX_INT_DIGITS} digits"
_VAL_EXPECTED = f"val a finite number of at most {MAX_VAL_BYTES} characters"
_LABELS = {b"1": 1.0, b"+1": 1.0, b"0": 0.0, b"-1": 0.0}
_SPACES = re.compile(rb" {2,}")
_PAD = b"\0" * 24   # so that "the 24 bytes before a token's end" always exist
_U64 = np.uint64


def feature_names(num_fields: int) -> tuple[str, ...]:
  return tuple(f"f{j}" for j in range(num_fields))


def _pair_text(form: str) -> str:
  return "idx:val" if form == LIBFM else "field:idx:val"


def _count_text(form: str, num_fields: int, fields_from: str) -> str:
  if form == LIBFM:
    return f"a label and {num_fields} idx:val pairs" + (f" ({fields_from})" if fields_from else "")
  return "a label and field:idx:val pairs"


def decode_line(line: bytes, rows_per_feature: Sequence[int], form: str, num_fields: int,
                fields_from: str = "") -> tuple[float, list[int], list[float]] | str:
  """One line decoded token by token in plain Python: (label, ids [F], weights [F]), or what
  is wrong with it (its first bad token). The reference for `parse_lines`, which calls it
  for the messages about bad lines."""
  F = num_fields
  text = stream.strip_newline(line)
  toks = [t for t in text.replace(b"\t", b" ").split(b" ") if t]
  if not toks or (form == LIBFM and len(toks) != F + 1):
    got = "an empty line" if not toks else f"a label and {len(toks) - 1} idx:val pairs"
    return f"{got}; expected {_count_text(form, F, fields_from)}"
  label = _LABELS.get(toks[0])
  if label is None:
    return f"label = {stream.field_text(toks[0])}; expected 1, +1, 0 or -1"
  ids, weights = [0] * F, [1.0] * F
  seen = set()
  for k, tok in enumerate(toks[1:]):
    where = f"{f'field f{k}' if form == LIBFM else f'pair {k + 1}'} = {stream.field_text(tok)}"
    parts = tok.split(b":")
    if len(parts) != (2 if form == LIBFM else 3):
      return f"{where}; expected {_pair_text(form)}"
    field = k
    if form == LIBFM:
      idx, val = parts
    else:
      field_s, idx, val = parts
      if not (field_s.isdigit() and len(field_s) <= MAX_FIELD_DIGITS and int(field_s) < F):
        return (f"{where}; expected field:idx:val with field an integer in [0, {F})"
                + (f" ({fields_from})" if fields_from else ""))
      field = int(field_s)
    if not (idx.isdigit() and len(idx) <= MAX_INT_DIGITS):
      return f"{where}; expected {_pair_text(form)} with {_IDX_EXPECTED}"
    try:
      weight = float(val) if len(val) <= MAX_VAL_BYTES else math.nan
    except ValueError:
      weight = math.nan
    if not math.isfinite(weight):
      return f"{where}; expected {_pair_text(form)} with {_VAL_EXPECTED}"
    if field in seen:
      return (f"{where}: field {field} already appeared in this line; expected at most one "
              "pair per field (one-hot)")
    seen.add(field)
    ids[field] = 1 + int(idx) % (int(rows_per_feature[field]) - 1)
    weights[field] = weight
  return label, ids, weights


def _normalize_blanks(buf: bytes) -> bytes:
  """Runs of spaces and tabs -> one space; none at the start or end of a line."""
  if b"\t" in buf:
    buf = buf.replace(b"\t", b" ")
  if b"  " in buf:
    buf = _SPACES.sub(b" ", buf)
  if b" \n" in buf:
    buf = buf.replace(b" \n", b"\n")
  if b"\n " in buf:
    buf = buf.replace(b"\n ", b"\n")
  return buf[1:] if buf.startswith(b" ") else buf


def _eight_digits(words: np.ndarray, ends: np.ndarray,
                  keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(value, ok) of the last `keep` (<= 8) bytes before `ends`, ok where all are ASCII digits.

  SWAR: the 8 bytes (right-aligned, '0'-filled) are one little-endian uint64 whose lowest
  byte is the leading digit; three multiply-shift steps combine pairs, quads and halves.
  """
  w = stream.last_bytes_zero_padded(words, ends, keep).view(np.uint64)[..., 0]
  ok = ((w & _U64(0xF0F0F0F0F0F0F0F0)) == _U64(0x3030303030303030)) & (
      ((w + _U64(0x0606060606060606)) & _U64(0xF0F0F0F0F0F0F0F0)) == _U64(0x3030303030303030))
  v = w - _U64(0x3030303030303030)
  v = v * _U64(10) + (v >> _U64(8))                 # byte pairs -> 2-digit values
  v = ((v & _U64(0x000000FF000000FF)) * _U64(100 + (1000000 << 32))
       + ((v >> _U64(16)) & _U64(0x000000FF000000FF)) * _U64(1 + (10000 << 32))) >> _U64(32)
  return (v & _U64(0xFFFFFFFF)).astype(np.int64), ok


def _decimal(words: np.ndarray, starts: np.ndarray, ends: np.ndarray,
             max_digits: int) -> tuple[np.ndarray, np.ndarray]:
  """(values, ok) of the bytes [starts, ends): ok where they are 1..max_digits (<= 18) ASCII
  digits. Read 8 bytes at a time from the end; needs 24 bytes of padding before the first
  token."""
  lens = ends - starts
  ok = (lens >= 1) & (lens <= max_digits)
  lens = np.where(ok, lens, 0)
  value, good = _eight_digits(words, ends, np.minimum(lens, 8))
  ok &= good
  longer = np.flatnonzero(lens > 8)   # rare: more than 8 digits
  for k in (1, 2):
    part, good = _eight_digits(words, ends[longer] - 8 * k, np.clip(lens[longer] - 8 * k, 0, 8))
    value[longer] += part * 10 ** (8 * k)
    ok[longer] &= good
  return value, ok


def _floats(u8: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(values, ok) of the numbers in u8[starts:starts+lens] (lens <= MAX_VAL_BYTES), parsed
  by numpy as fixed-width byte strings; ok where one parses as a finite number."""
  if not len(starts):
    return np.zeros(0, np.float64), np.zeros(0, bool)
  width = max(int(lens.max()), 1)
  cols = np.arange(width)
  chars = u8[np.minimum(starts[:, None] + cols, len(u8) - 1)]
  inside = cols < lens[:, None]
  has_nul = ((chars == 0) & inside).any(1)   # the bytes dtype would drop a trailing one
  chars = np.where(inside, chars, 0).astype(np.uint8)
  text_S = chars.view(f"S{width}")[:, 0]   # the NUL padding is not part of the string
  values = stream.parse_floats(text_S)
  return values, np.isfinite(values) & ~has_nul


def _labels(u8: np.ndarray, ls: np.ndarray, ll: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(valid, positive) of the label tokens starting at `ls` with lengths `ll`: 1, +1, 0, -1."""
  a, b = u8[ls], u8[np.minimum(ls + 1, len(u8) - 1)]
  sign = ((a == ord("+")) | (a == ord("-"))) & (b == ord("1"))
  label_ok = ((ll == 1) & ((a == ord("0")) | (a == ord("1")))) | ((ll == 2) & sign)
  labels = ((ll == 1) & (a == ord("1"))) | ((ll == 2) & (a == ord("+")))
  return label_ok, labels


def parse_lines(lines: list[bytes], rows_per_feature: Sequence[int], form: str,
                num_fields: int, fields_from: str = "") -> stream.Parsed:
  """Decodes libFM (positional) or libFFM lines into ids, weights and labels.

  Returns the valid lines' rows in order (ids [V, F] int32, labels [V] f32, and the per-id
  weights [V, F] f32 in `dense`, where `LibFMSource` picks them up) and, for each bad line,
  (its index in `lines`, what `decode_line` says is wrong with it). `fields_from` says where
  F came from, for the messages about a wrong pair count or an out-of-range libFFM field.
  The chunk is decoded at once on its bytes: token and colon positions, then digits and
  numbers gathered by position.
  """
  F = num_fields
  rows = np.asarray(rows_per_feature, np.int64)
  n = len(lines)
  if n == 0:
    return stream.Parsed(np.zeros((0, F), np.float32), np.zeros((0, F), np.int32),
                         np.zeros(0, np.float32), [])
  buf = _PAD + _normalize_blanks(stream.join_lines(lines))
  u8 = np.frombuffer(buf, np.uint8)
  words = stream.byte_words(buf)

  # tokens: every space or newline ends one (an empty line is one empty token)
  tend_T = np.flatnonzero((u8 == 32) | (u8 == 10))
  is_nl = u8[tend_T] == 10
  assert int(is_nl.sum()) == n, (int(is_nl.sum()), n)
  tstart_T = np.empty_like(tend_T)
  tstart_T[0] = len(_PAD)
  tstart_T[1:] = tend_T[:-1] + 1
  tlen_T = tend_T - tstart_T
  line_T = np.searchsorted(tend_T[is_nl], tend_T)
  ntok_N = np.bincount(line_T, minlength=n)
  first_N = np.cumsum(ntok_N) - ntok_N          # each line's label token

  # colons: how many in each token, and where the first two are
  cpos = np.flatnonzero(u8 == 58)
  ctok = np.searchsorted(tend_T, cpos)
  ncol_T = np.bincount(ctok, minlength=len(tend_T))
  c1_T = tend_T.copy()                          # no colon: the token's end
  c1_T[ctok[::-1]] = cpos[::-1]
  c2_T = c1_T.copy()
  two = np.flatnonzero(ncol_T >= 2)
  c2_T[two] = cpos[np.searchsorted(cpos, c1_T[two]) + 1]

  # labels: 1, +1, 0, -1
  label_ok, labels = _labels(u8, tstart_T[first_N], tlen_T[first_N])

  # pairs: every token but the labels
  is_pair = np.ones(len(tend_T), bool)
  is_pair[first_N] = False
  pt = np.flatnonzero(is_pair)
  row_P = line_T[pt]
  if form == LIBFM:
    field_P = pt - first_N[row_P] - 1
    ok_P = (ncol_T[pt] == 1) & (field_P < F)
    field_P = np.where(ok_P, field_P, 0)
    idx_a, idx_b = tstart_T[pt], c1_T[pt]
  else:
    field_P, field_ok = _decimal(words, tstart_T[pt], c1_T[pt], MAX_FIELD_DIGITS)
    ok_P = (ncol_T[pt] == 2) & field_ok & (field_P < F)
    field_P = np.where(ok_P, field_P, 0)
    idx_a, idx_b = c1_T[pt] + 1, c2_T[pt]
  idx_P, idx_ok = _decimal(words, idx_a, idx_b, MAX_INT_DIGITS)
  ok_P &= idx_ok
  val_a = idx_b + 1
  val_len = tend_T[pt] - val_a
  ok_P &= (val_len >= 1) & (val_len <= MAX_VAL_BYTES)
  weight_P = np.ones(len(pt), np.float64)
  is_one = (val_len == 1) & (u8[np.minimum(val_a, len(u8) - 1)] == ord("1"))  # no parsing
  parse = np.flatnonzero(ok_P & ~is_one)
  weight_P[parse], val_ok = _floats(u8, val_a[parse], val_len[parse])
  ok_P[parse] &= val_ok
  id_P = (1 + idx_P % (rows[field_P] - 1)).astype(np.int32)
  if form == LIBFFM:   # a second pair of the same field in a line is bad (bags are one-hot)
    good_P = np.flatnonzero(ok_P)
    key = row_P[good_P] * F + field_P[good_P]
    order = np.argsort(key, kind="stable")
    ok_P[good_P[order[1:][key[order[1:]] == key[order[:-1]]]]] = False

  row_ok = label_ok & (np.bincount(row_P[~ok_P], minlength=n) == 0)
  if form == LIBFM:
    row_ok &= ntok_N == F + 1
  keep_P = row_ok[row_P]
  if form == LIBFM:
    ids = id_P[keep_P].reshape(-1, F)
    weights = weight_P[keep_P].astype(np.float32).reshape(-1, F)
  else:
    rank = np.cumsum(row_ok) - 1               # row of each valid line in the output
    ids = np.zeros((int(row_ok.sum()), F), np.int32)
    weights = np.ones(ids.shape, np.float32)
    ids[rank[row_P[keep_P]], field_P[keep_P]] = id_P[keep_P]
    weights[rank[row_P[keep_P]], field_P[keep_P]] = weight_P[keep_P]

  bad = []
  for i in np.flatnonzero(~row_ok):
    what = decode_line(lines[i], rows, form, F, fields_from)
    bad.append((int(i), what if isinstance(what, str) else f"malformed {form} line"))
  return stream.Parsed(dense=weights, ids=ids, labels=labels[row_ok].astype(np.float32), bad=bad)


def sniff_fields(path: str, sniff_lines: int = SNIFF_LINES) -> tuple[str, int, str]:
  """(line form, number of fields, where that number came from) of a libFM / libFFM file."""
  with stream.open_binary(path) as f:
    head = list(itertools.islice(f, sniff_lines))
  if not head:
    raise ValueError(f"{path}: empty file, expected a first line `label idx:val ...` to read "
                     "the fields from")
  toks = head[0].split()
  colons = toks[1].count(b":") if len(toks) > 1 else 0
  if colons not in (1, 2):
    raise ValueError(f"{path}:1: expected `label idx:val ...` (libFM) or `label field:idx:val "
                     f"...` (libFFM) to read the fields from, got {stream.field_text(head[0])}")
  if colons == 1:
    return LIBFM, len(toks) - 1, f"pairs on the first line of {path}"
  top = -1
  for line in head:
    for tok in line.split()[1:]:
      field = tok.split(b":", 1)[0]
      if field.isdigit() and len(field) <= MAX_FIELD_DIGITS:
        top = max(top, int(field))
  return LIBFFM, top + 1, (f"the largest field in the first {len(head)} lines of {path}, "
                           "plus one; pass num_fields for more")


def libfm_spec(num_fields: int, rows_per_feature: int | Sequence[int] = DEFAULT_ROWS) -> DataSpec:
  """DataSpec of libFM batches: no dense, `num_fields` one-hot sparse features f0 .. f{F-1}."""
  names = feature_names(num_fields)
  rows = stream.check_rows_per_feature(rows_per_feature, names, "libFM")
  return DataSpec(num_dense=0, sparse_features=names, rows_per_feature=rows, max_ids_per_bag=1)


class LibFMSource(stream.LineSource):
  """Batches of libFM / libFFM lines from plain or gzip files; one shard of their lines.

  The line form and F come from the first file unless given (eval sources get the train
  source's, so both agree). See `stream.LineSource` for batching, repeat, resume, sharding
  and bad lines; padded eval rows get weight 0.
  """

  def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int,
               rows_per_feature: int | Sequence[int] = DEFAULT_ROWS, *,
               num_fields: int | None = None, form: str | None = None, values: str = "weight",
               fields_from: str = "given num_fields",
               bad_lines: str = "error", drop_remainder: bool = True, shard_index: int = 0,
               num_shards: int = 1, repeat: bool = True, chunk_bytes: int = 1 << 20):
    super().__init__(files, batch_size, bad_lines=bad_lines, drop_remainder=drop_remainder,
                     shard_index=shard_index, num_shards=num_shards, repeat=repeat,
                     chunk_bytes=chunk_bytes)
    if values not in VALUE_MODES:
      raise ValueError(f"LibFMSource: values={values!r}, expected one of {VALUE_MODES}")
    if form is not None and form not in LINE_FORMS:
      raise ValueError(f"LibFMSource: form={form!r}, expected one of {LINE_FORMS} or None")
    if num_fields is not None and (isinstance(num_fields, bool) or
                                   not isinstance(num_fields, (int, np.integer)) or num_fields < 1):
      raise ValueError(f"LibFMSource: num_fields={num_fields!r}, expected an int >= 1 or None")
    if num_fields is None:
      sniffed_form, num_fields, fields_from = sniff_fields(self.files[0])
      if form is not None and form != sniffed_form:
        raise ValueError(f"{self.files[0]}:1: form={form!r} was given, but the first line is "
                         f"in the {sniffed_form} form")
      form = sniffed_form
      if num_fields < 1:
        raise ValueError(f"{self.files[0]}: no valid field index in the first lines, "
                         "expected field:idx:val pairs with field a non-negative integer")
    elif form is None:
      form = sniff_fields(self.files[0])[0]
    self.form = form
    self.num_fields = int(num_fields)
    self.values = values
    self.fields_from = fields_from
    self.spec = libfm_spec(self.num_fields, rows_per_feature)

  def describe(self) -> str:
    """One line on how the files are read: the form, F and its origin, what val means."""
    F = self.num_fields
    return (f"{'libFM positional' if self.form == LIBFM else 'libFFM'} lines "
            f"`label {_pair_text(self.form)} ...`, {F} fields f0..f{F - 1} "
            f"({self.fields_from}); val is "
            + ("each id's weight" if self.values == "weight" else "ignored"))

  def _parse(self, lines: list[bytes]) -> stream.Parsed:
    parsed = parse_lines(lines, self.spec.rows_per_feature, self.form, self.num_fields,
                         self.fields_from)
    if self.values == "ignore":
      parsed.dense = np.zeros((len(parsed.labels), 0), np.float32)
    return parsed

  def _batch(self, parsed: stream.Parsed, rows: slice, B: int) -> SparseBatch:
    # The weights ride through LineSource's row slicing, concatenation and padding (zeros)
    # as `dense` columns; here they move to where the embedding bags read them.
    batch = super()._batch(parsed, rows, B)
    if self.values == "ignore":
      return batch
    return dataclasses.replace(batch, dense=np.zeros((B, 0), np.float32),
                               weights=np.ascontiguousarray(batch.dense[:, :, None]))
