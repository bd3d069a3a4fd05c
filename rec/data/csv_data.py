"""Streaming reader of the BARS / FuxiCTR CSV layout (`train.csv`, `valid.csv`, `test.csv`).

Named csv_data so as not to shadow the standard library's csv module.
Each file: a header row, then one example per line, comma-separated without quoting (a
line must have as many fields as the header; a field that starts with a double quote, as
csv / pandas write a value holding a comma or a quote, stops the reader at its file:line
whatever `bad_lines` says). Every file of a source must have the same
header. Columns play one of four roles, given or inferred from the header (`CsvColumns`):
  - label: the given column, else the first named label, click, clicked or y (any case)
  - dense: the given columns, else every column named I<digits> (I1, I2, ...). Inferred by
    name, never by sampled values: a value of an inferred dense column that is not a number
    (anywhere in any file) stops the reader with file:line, whatever `bad_lines` says, and
    asks for the roles to be given (`--csv_dense` / `--csv_categorical`); with the roles
    given, such a value is an ordinary bad line
  - categorical: the given columns, else every other column except one named id (any case;
    a row id is never a feature in the BARS configs)
  - ignored: whatever is left (with both lists given, the columns in neither)
`none` for the dense or categorical list means no such columns. Decoding:
  - label: 0 or 1
  - dense: log1p(max(x, 0)) as float32, the Criteo transform (negatives clip to 0), empty -> 0;
    x must be a finite number (Python float syntax)
  - categorical: id = 1 + crc32(bytes) % (rows - 1), empty -> 0 ("missing"), as in Avazu
Bad lines raise ValueError naming file:line, the column, the value and what was expected, or
are skipped and counted with `bad_lines="skip"` (see `stream`). `CsvColumns.describe` gives
the roles one line each, and says which were inferred and by what rule.

Letters: N lines in a chunk, V valid lines, C columns, Dn dense columns, F categorical.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Sequence
import zlib

import numpy as np

from rec.data import stream
from rec.data.batch import DataSpec

DEFAULT_ROWS = 100_000
LABEL_NAMES = ("label", "click", "clicked", "y")
ID_NAME = "id"
NONE = "none"              # as a column list: no such columns
MAX_DENSE_BYTES = 64       # longer dense values are bad; keeps the fixed-width arrays small
_DENSE_NAME = re.compile(r"I\d+")
_DENSE_EXPECTED = "expected a finite number or empty"
ROLES = ("label", "dense", "categorical")


def read_header(path: str) -> list[str]:
  """The column names on the first line of a CSV file (a UTF-8 byte order mark is dropped)."""
  with stream.open_binary(path) as f:
    first = f.readline()
  if not first.strip():
    raise ValueError(f"{path}:1: expected a header row of comma-separated column names, got "
                     f"{'an empty file' if not first else stream.field_text(first)}")
  text = first.decode("utf-8", "backslashreplace").rstrip("\r\n").lstrip("\ufeff")
  if '"' in text:
    raise ValueError(f"{path}:1: header {text!r} has quotes; quoted CSV fields are not supported")
  names = [c.strip() for c in text.split(",")]
  for i, name in enumerate(names):
    if not name:
      raise ValueError(f"{path}:1: column {i + 1} of the header {text!r} has no name")
  dup = sorted({c for c in names if names.count(c) > 1})
  if dup:
    raise ValueError(f"{path}:1: header names {', '.join(dup)} more than once")
  return names


def _column_list(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
  """A role's column list: None or '' = infer, 'none' = no columns, 'a,b' or a sequence."""
  if value is None:
    return None
  if isinstance(value, str):
    if not value.strip():
      return None
    if value.strip().lower() == NONE:
      return ()
    value = value.split(",")
  return tuple(c.strip() for c in value if c.strip())


@dataclasses.dataclass(frozen=True)
class CsvColumns:
  """Roles of a CSV header's columns. `inferred`: the roles chosen by the module's rules
  rather than given (their values are checked against the role as they are read)."""

  header: tuple[str, ...]
  label: str
  dense: tuple[str, ...]
  categorical: tuple[str, ...]
  inferred: frozenset[str] = frozenset()

  @property
  def ignored(self) -> tuple[str, ...]:
    used = {self.label, *self.dense, *self.categorical}
    return tuple(c for c in self.header if c not in used)

  @property
  def inferred_dense(self) -> tuple[str, ...]:
    """Dense columns chosen by name, whose values must all be numbers."""
    return self.dense if "dense" in self.inferred else ()

  def describe(self) -> str:
    """The roles, one line each: the columns, how values are decoded, given or inferred."""
    def names(cols):
      return ", ".join(cols) if cols else "none"

    def how(role, rule):
      return f"inferred: {rule}" if role in self.inferred else "given"

    has_id = any(c.lower() == ID_NAME for c in self.ignored)
    return "\n".join([
        f"  label: {self.label} ({how('label', 'the first column named ' + '/'.join(LABEL_NAMES))})",
        f"  dense ({len(self.dense)}, log1p(max(x, 0))): {names(self.dense)} ("
        + how("dense", "the columns named I<n>; a value that is not a number stops the run, "
              "give --csv_dense/--csv_categorical if one of them is categorical") + ")",
        f"  categorical ({len(self.categorical)}, crc32 hashed): {names(self.categorical)} ("
        + how("categorical", "the other columns" + (", except id" if has_id else "")) + ")",
        f"  ignored: {names(self.ignored)}"])


def infer_columns(header: Sequence[str], label: str | None = None,
                  dense: str | Sequence[str] | None = None,
                  categorical: str | Sequence[str] | None = None,
                  where: str = "the header") -> CsvColumns:
  """The roles of `header`'s columns: given ones as given, the others by the module rule
  (names only; the values of inferred dense columns are checked as they are read).

  where: the file the header came from, for messages.
  """
  header = tuple(header)
  listed = ", ".join(header)
  given_dense, given_cat = _column_list(dense), _column_list(categorical)
  for role, cols in (("label", [label] if label else []), ("dense", given_dense or ()),
                     ("categorical", given_cat or ())):
    for c in cols:
      if c not in header:
        raise ValueError(f"{role} column {c!r} is not in the header of {where}: {listed}")
  inferred = set()
  if not label:
    found = [c for c in header if c.lower() in LABEL_NAMES]
    if not found:
      raise ValueError(f"no label column in the header of {where} ({listed}): expected one "
                       f"named {', '.join(LABEL_NAMES)} (any case), or give the label column")
    label = found[0]
    inferred.add("label")
  taken = {label} | set(given_cat or ())
  if given_dense is not None:
    dense_cols = given_dense
  else:
    dense_cols = tuple(c for c in header if c not in taken and _DENSE_NAME.fullmatch(c))
    inferred.add("dense")
  if given_cat is not None:
    cat_cols = given_cat
  else:
    skip = {label, *dense_cols}
    cat_cols = tuple(c for c in header if c not in skip and c.lower() != ID_NAME)
    inferred.add("categorical")
  roles = [("label", label)] + [("dense", c) for c in dense_cols] + [
      ("categorical", c) for c in cat_cols]
  seen: dict[str, str] = {}
  for role, c in roles:
    if c in seen:
      raise ValueError(f"column {c!r} of {where} is both {seen[c]} and {role}; expected one role")
    seen[c] = role
  if not cat_cols:
    raise ValueError(f"no categorical column in {where} ({listed}): expected at least one "
                     "(the models embed categorical features)")
  return CsvColumns(header=header, label=label, dense=tuple(dense_cols),
                    categorical=tuple(cat_cols), inferred=frozenset(inferred))


def _floats(values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
  """(float64 values, ok) of byte strings; ok where one is a finite number (or empty -> 0)."""
  lens = np.fromiter(map(len, values), np.int64, len(values))
  too_long = lens > MAX_DENSE_BYTES
  if too_long.any():
    values = [b"" if t else v for v, t in zip(values, too_long)]
  text_S = np.array(values, dtype=bytes)
  # numpy's bytes dtype drops trailing NULs, which would make "1\0" read as 1
  nul = np.char.str_len(text_S) != np.where(too_long, 0, lens)
  empty = lens == 0
  text_S = np.where(empty, b"0", text_S)
  x = stream.parse_floats(text_S)
  ok = np.isfinite(x) & ~too_long & ~nul
  return np.where(ok, x, 0.0), ok


def _quoted_fields(lines: list[bytes], header: Sequence[str]) -> dict[int, str]:
  """{line index: message} of the lines with a field that starts with a double quote (a
  quoted CSV field, which csv / pandas unquote and which may hold commas: this reader would
  hash the quotes, or split at the commas inside)."""
  out = {}
  for i, line in enumerate(lines):
    if b'"' not in line:
      continue
    fields = stream.strip_newline(line).split(b",")
    k = next((k for k, v in enumerate(fields) if v.startswith(b'"')), None)
    if k is None:   # quotes inside a value are part of it, as csv / pandas read them
      continue
    name = f"field {header[k]}" if k < len(header) else f"field {k + 1}"
    out[i] = (f"{name} = {stream.field_text(fields[k])} starts with a quote; expected plain "
              "comma-separated values (quoted CSV fields are not supported: write the file "
              "without quoting, or with values free of commas and quotes)")
  return out


def parse_lines(lines: list[bytes], columns: CsvColumns,
                rows_per_feature: Sequence[int]) -> stream.Parsed:
  """Decodes CSV data lines (no header) into dense, ids and labels.

  Returns the valid lines' rows in order (dense [V, Dn] f32, ids [V, F] int32, labels [V]
  f32) and, for each bad line, (its index in `lines`, what is wrong with it).
  """
  C = len(columns.header)
  col = {c: i for i, c in enumerate(columns.header)}
  ok, bad_shape = stream.split_by_field_count(lines, b",", C, "comma")
  good_idx = np.flatnonzero(ok)
  n = len(good_idx)
  buf = stream.join_lines(lines if n == len(lines) else [lines[i] for i in good_idx])
  # A quoted field stops the reader (whatever bad_lines says): the file is written in a
  # CSV dialect this reader does not read, so its other lines may be read wrong too.
  quoted = {}
  if b'"' in buf or any(b'"' in lines[i] for i, _ in bad_shape):
    quoted = _quoted_fields(lines, columns.header)
    bad_shape = [(i, quoted.get(i, msg)) for i, msg in bad_shape]
  if n == 0:
    return stream.Parsed(np.zeros((0, len(columns.dense)), np.float32),
                         np.zeros((0, len(columns.categorical)), np.int32),
                         np.zeros(0, np.float32), bad_shape, min(quoted, default=None))
  fields = buf.replace(b"\n", b",").split(b",")[:-1]   # [N * C], row-major
  assert len(fields) == n * C, (len(fields), n)

  lab = fields[col[columns.label]::C]
  one = np.fromiter(map(b"1".__eq__, lab), bool, n)
  label_bad = ~(one | np.fromiter(map(b"0".__eq__, lab), bool, n))
  labels = one.astype(np.float32)

  d_idx = [col[c] for c in columns.dense]
  dense_vals = list(itertools.chain.from_iterable(fields[j::C] for j in d_idx))  # column-major
  x, dense_ok = _floats(dense_vals)
  Dn = len(d_idx)
  dense = np.log1p(np.maximum(x.reshape(Dn, n).T, 0.0)).astype(np.float32)
  dense_bad = ~dense_ok.reshape(Dn, n).T

  c_idx = [col[c] for c in columns.categorical]
  cat_vals = list(itertools.chain.from_iterable(fields[j::C] for j in c_idx))
  crc = np.fromiter(map(zlib.crc32, cat_vals), np.int64, len(cat_vals)).reshape(-1, n).T
  empty = np.fromiter(map(len, cat_vals), np.int64, len(cat_vals)).reshape(-1, n).T == 0
  mod = np.asarray(rows_per_feature, np.int64) - 1
  ids = np.where(empty, 0, 1 + crc % mod).astype(np.int32)

  # the first bad column of a line, in header order, is the one named; a non-number in a
  # dense column inferred by name is named first: it says the inferred role may be wrong
  order = np.argsort([col[columns.label]] + d_idx, kind="stable")
  checked = np.concatenate([label_bad[:, None], dense_bad], axis=1)[:, order]
  names = ([columns.label] + list(columns.dense))
  role_k = [1 + j for j, c in enumerate(columns.dense) if c in set(columns.inferred_dense)]
  role_bad = dense_bad[:, [k - 1 for k in role_k]]
  bad_fields = []
  bad_rows = np.flatnonzero(checked.any(1))
  if quoted:
    bad_rows = np.union1d(bad_rows, np.flatnonzero(np.isin(good_idx, list(quoted))))
  stop_at = min(quoted, default=None)
  for r in bad_rows:
    if int(good_idx[r]) in quoted:
      bad_fields.append((int(good_idx[r]), quoted[int(good_idx[r])]))
      continue
    k = int(order[np.argmax(checked[r])])
    if role_bad[r].any():
      k = min((k2 for k2 in role_k if dense_bad[r, k2 - 1]), key=lambda k2: d_idx[k2 - 1])
    name = names[k]
    value = stream.field_text(fields[int(r) * C + col[name]])
    if k == 0:
      what = f"field {name} = {value}; expected 0 or 1"
    elif k in role_k:
      what = (f"field {name} = {value}; {_DENSE_EXPECTED}, as column {name} was inferred "
              "dense (named I<n>); give the column roles explicitly with --csv_dense and "
              "--csv_categorical (CsvSource dense= / categorical=): "
              f"{name} among the categorical columns if it holds categories, or among the "
              "dense ones to make such values bad lines (which --bad_lines=skip skips)")
      stop_at = int(good_idx[r]) if stop_at is None else min(stop_at, int(good_idx[r]))
    else:
      what = f"field {name} = {value}; {_DENSE_EXPECTED}"
    bad_fields.append((int(good_idx[r]), what))
  parsed = stream.keep_good_rows(dense, ids, labels, bad_rows, bad_shape, bad_fields)
  parsed.stop_at = stop_at
  return parsed


def csv_spec(columns: CsvColumns, rows_per_feature: int | Sequence[int] = DEFAULT_ROWS) -> DataSpec:
  """DataSpec of CSV batches: the dense columns, then one one-hot feature per categorical."""
  rows = stream.check_rows_per_feature(rows_per_feature, columns.categorical, "CSV")
  return DataSpec(num_dense=len(columns.dense), sparse_features=columns.categorical,
                  rows_per_feature=rows, max_ids_per_bag=1)


class CsvSource(stream.LineSource):
  """Batches of BARS / FuxiCTR CSV files (plain or gzip); one shard of their data rows.

  `columns` fixes the roles (eval sources get the train source's); without it they are
  inferred from the first file with `label`, `dense` and `categorical` as given ones. See
  `stream.LineSource` for batching, repeat, resume, sharding and bad lines.
  """

  def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int,
               rows_per_feature: int | Sequence[int] = DEFAULT_ROWS, *,
               columns: CsvColumns | None = None, label: str | None = None,
               dense: str | Sequence[str] | None = None,
               categorical: str | Sequence[str] | None = None, bad_lines: str = "error",
               drop_remainder: bool = True, shard_index: int = 0, num_shards: int = 1,
               repeat: bool = True, chunk_bytes: int = 1 << 20):
    super().__init__(files, batch_size, bad_lines=bad_lines, drop_remainder=drop_remainder,
                     shard_index=shard_index, num_shards=num_shards, repeat=repeat,
                     chunk_bytes=chunk_bytes)
    header = read_header(self.files[0])
    for path in self.files[1:]:
      other = read_header(path)
      if other != header:
        raise ValueError(f"{path}:1: header {','.join(other)!r} differs from the header of "
                         f"{self.files[0]}: {','.join(header)!r}")
    if columns is None:
      columns = infer_columns(header, label=label, dense=dense, categorical=categorical,
                              where=self.files[0])
    elif columns.header != tuple(header):
      raise ValueError(f"{self.files[0]}:1: header {','.join(header)!r} differs from the "
                       f"columns given: {','.join(columns.header)!r}")
    self.columns = columns
    self.spec = csv_spec(columns, rows_per_feature)

  def describe(self) -> str:
    """The column roles of `files[0]`, one line each (printed by `sources.make_sources`)."""
    return f"{self.files[0]}: column roles\n{self.columns.describe()}"

  def _is_header(self, first_line: bytes) -> bool:
    del first_line
    return True   # every file starts with the header checked in __init__

  def _parse(self, lines: list[bytes]) -> stream.Parsed:
    return parse_lines(lines, self.columns, self.spec.rows_per_feature)
