"""Line streaming shared by the line readers (Criteo, Avazu, libFM, CSV): files, shards, batches.

A `LineSource` reads one record per line from a list of plain or gzip (`.gz` suffix) text
files, or of `Part`s of them (a range of a file's data lines: the DLRM day split of Criteo's
one train.txt, a day of Avazu's train.gz), keeps the records of its shard
(`record % num_shards == shard_index`, records numbered from 0 over the concatenated parts
with header lines left out), decodes them a chunk at a time with its subclass's `_parse`,
and cuts the decoded rows into SparseBatches. The subclass only knows its line format;
everything about files, shards, bad lines, epochs, remainders and resuming lives here.
A part of a plain file that starts at a known byte offset is read from there (a seek);
parts of .gz files are reached by decompressing the lines before them. Opening files (.gz
with errors that name the file), reading .gz files through before a run and line indexes are
`rec.data.textfiles`, whose names this module also gives.

Errors name the file and line, what was found and what was expected
(`<file>:<line>: <found>; expected <what>`, `core.errors.UserError`).

Letters: B batch, N lines in a chunk, V valid lines in a chunk, Dn dense features,
F sparse features.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
from typing import Iterator, Sequence

from absl import logging
import numpy as np

from core.errors import UserError
from rec.data.batch import DataSpec, SparseBatch
# re-exported: the line readers open, index and verify files through this module
from rec.data.textfiles import (BLOCK, LineIndex, gzip_error, index_lines, open_binary,
                               verify_gzip)

BAD_LINE_MODES = ("error", "skip")
# Ids are int32 row numbers in [0, rows): a table holds at most 2^31 rows.
MAX_ROWS = 2**31
# A table a run trains: its ids and its padding id (num_rows) stay below int32's maximum
# (rec.embedding.storage.check_size), so --num_rows is at most 2^31 - 2.
MAX_TABLE_ROWS = 2**31 - 2


@dataclasses.dataclass(frozen=True)
class Part:
  """Data lines [start, stop) of a file (0-based, header line excluded; stop None: to the
  end). `offset` / `stop_offset`: the byte offsets of data lines `start` / `stop` when known
  (plain files), so that a reader seeks there instead of reading the lines before it."""

  path: str
  start: int = 0
  stop: int | None = None
  offset: int | None = None
  stop_offset: int | None = None   # byte offset of data line `stop` (plain files)

  def describe(self) -> str:
    if self.start == 0 and self.stop is None:
      return os.path.basename(self.path)
    stop = "end" if self.stop is None else f"{self.stop:,}"
    return f"{os.path.basename(self.path)}[lines {self.start + 1:,}..{stop}]"


@dataclasses.dataclass(frozen=True)
class Layout:
  """The splits of a data directory: train / valid / test (labeled) and, when present,
  predict (unlabeled rows, e.g. Kaggle's test.txt), each a tuple of `Part`s."""

  kind: str                                   # kaggle | custom | terabyte | avazu ...
  splits: dict[str, tuple[Part, ...]]
  note: str                                   # one line: how the splits were made
  # splits by day: {split: (first, last) day} its rows must carry (Avazu's YYMMDD)
  days: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

  def eval_parts(self) -> tuple[Part, ...]:
    """What a training run evaluates on: validation then test."""
    return self.splits.get("valid", ()) + self.splits.get("test", ())


def as_parts(files) -> tuple[Part, ...]:
  """A path, a Part, or a sequence of them -> a tuple of Parts."""
  if isinstance(files, (str, os.PathLike, Part)):
    files = [files]
  return tuple(f if isinstance(f, Part) else Part(os.fspath(f)) for f in files)


def check_rows_per_feature(rows: int | Sequence[int], names: Sequence[str],
                           what: str) -> tuple[int, ...]:
  """Expands `rows` (one count, or one per feature) to a tuple and checks every count >= 2.

  Row 0 of each table is reserved for "missing", so a table needs at least one more row.
  """
  if isinstance(rows, (int, np.integer)) and not isinstance(rows, bool):
    rows = [int(rows)] * len(names)
  rows = list(rows)
  if len(rows) != len(names):
    raise UserError(
        f"{what}: rows_per_feature has {len(rows)} entries, expected one int or "
        f"{len(names)} (one per feature {names[0]}..{names[-1]})")
  for name, r in zip(names, rows):
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 2:
      raise UserError(
          f"{what}: rows_per_feature for {name} = {r!r}, expected an int >= 2 "
          "(row 0 is reserved for missing values)")
    if r > MAX_ROWS:
      raise UserError(
          f"{what}: rows_per_feature for {name} = {r:,}, expected at most 2^31 = {MAX_ROWS:,} "
          "(ids are int32)")
  return tuple(int(r) for r in rows)


def byte_words(buf: bytes) -> np.ndarray:
  """words[p] = the 8 bytes buf[p:p+8] as one uint64 (an overlapping, unaligned view, no copy)."""
  return np.ndarray((max(len(buf) - 7, 0),), np.uint64, buf, 0, (1,))


# _KEEP[k]: a little-endian word mask that keeps its last k bytes (in memory order)
_KEEP = np.array([((1 << (8 * k)) - 1) << (8 * (8 - k)) for k in range(9)], np.uint64)
_ASCII_ZEROS = np.uint64(0x3030303030303030)


def last_bytes_zero_padded(words: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> np.ndarray:
  """The last `keep` (<= 8) bytes before each field's end, right-aligned, '0'-filled in front.

  One 8-byte gather per field. words: `byte_words` of a buffer padded with 8 bytes in front,
  ends: field end offsets (exclusive). Returns uint8 [..., 8], a fresh contiguous array.
  """
  mask = _KEEP[np.clip(keep, 0, 8)]
  w = words[ends - 8]
  w = (w & mask) | (_ASCII_ZEROS & ~mask)
  return w.view(np.uint8).reshape(ends.shape + (8,))


def any_bytes(flags: np.ndarray) -> np.ndarray:
  """flags[..., 8] bool, contiguous -> any over the last axis, by reading each row as a word."""
  return flags.view(np.uint64)[..., 0] != 0


def field_text(value: bytes, limit: int = 40) -> str:
  """A field as it should appear in an error message: decoded, repr-quoted, shortened."""
  text = value.decode("utf-8", "backslashreplace")
  if len(text) > limit:
    text = text[:limit] + "..."
  return repr(text)


@dataclasses.dataclass
class Parsed:
  """Decoded rows of one chunk: arrays for its valid lines, in order, and its bad lines."""

  dense: np.ndarray            # [V, Dn] float32
  ids: np.ndarray              # [V, F] int32
  labels: np.ndarray           # [V] float32
  bad: list[tuple[int, str]]   # (line index in the chunk, what is wrong), sorted by index
  # index of the first bad line that stops the reader even with bad_lines="skip" (its
  # message is in `bad`): the line shows that the way the file is read is wrong, not the line
  stop_at: int | None = None


def split_by_field_count(lines: list[bytes], sep: bytes, num_fields: int,
                         sep_name: str, hints: dict[int, str] | None = None
                         ) -> tuple[np.ndarray, list[tuple[int, str]]]:
  """Which lines have exactly `num_fields` fields, and an error for each that has not;
  `hints` adds a note for a known wrong count (e.g. an unlabeled file's)."""
  counts = np.fromiter(map(bytes.count, lines, [sep] * len(lines)), np.int64, len(lines))
  ok = counts == num_fields - 1
  hints = hints or {}
  bad = [(int(i), f"{counts[i] + 1} {sep_name}-separated fields{hints.get(int(counts[i]) + 1, '')}"
                  f"; expected {num_fields}") for i in np.flatnonzero(~ok)]
  return ok, bad


def strip_newline(line: bytes) -> bytes:
  """A line without its line ending: one '\\n', then one '\\r' (CRLF files; a last line
  without its '\\n' may still end in the '\\r'). Any other '\\r' is part of the line."""
  if line.endswith(b"\n"):
    line = line[:-1]
  return line[:-1] if line.endswith(b"\r") else line


def join_lines(lines: list[bytes]) -> bytes:
  """The lines as one buffer holding `strip_newline` of each line followed by a bare '\\n':
  exactly one '\\n' per line, so a line that is only a line ending (an empty line, a lone
  '\\r') stays a line of its own. Lines hold no '\\n' but their last byte."""
  buf = b"".join(lines)
  last_unterminated = bool(buf) and not buf.endswith(b"\n")
  if buf.count(b"\n") != len(lines) - last_unterminated:  # lines given without their '\n'
    return b"".join(strip_newline(line) + b"\n" for line in lines)
  if b"\r" in buf:
    # Lines come from readlines, so '\n' ends a line and '\r\n' can only be a line ending.
    buf = buf.replace(b"\r\n", b"\n")
    if last_unterminated and buf.endswith(b"\r"):
      buf = buf[:-1]
  if last_unterminated:
    buf += b"\n"
  return buf


def parse_floats(text_S: np.ndarray) -> np.ndarray:
  """float64 of an array of byte strings; NaN where one does not parse (an empty one too).

  numpy parses the whole array at once; only when some value fails does it fall back to one
  by one, to find which.
  """
  try:
    return text_S.astype(np.float64)
  except ValueError:
    out = np.empty(len(text_S), np.float64)
    for i, v in enumerate(text_S.tolist()):
      try:
        out[i] = float(v) if v else np.nan
      except ValueError:
        out[i] = np.nan
    return out


def keep_good_rows(dense, ids, labels, bad_rows, bad_shape: list, bad_fields: list) -> Parsed:
  """The chunk's rows without those at `bad_rows`; its bad lines, both lists merged."""
  if len(bad_rows):
    keep = np.ones(len(labels), bool)
    keep[bad_rows] = False
    dense, ids, labels = dense[keep], ids[keep], labels[keep]
  return Parsed(dense=dense, ids=ids, labels=labels, bad=merge_bad(bad_shape, bad_fields))


def merge_bad(*lists: list[tuple[int, str]]) -> list[tuple[int, str]]:
  """Bad-line lists merged in line order, keeping the first complaint about each line."""
  seen: dict[int, str] = {}
  for i, msg in sorted((x for lst in lists for x in lst), key=lambda x: x[0]):
    seen.setdefault(i, msg)
  return sorted(seen.items())


class LineSource:
  """Base of the line-format readers: a BatchSource over one shard of a list of text files.

  Subclasses set `spec` and implement `_parse` (and `_is_header` when their files may start
  with a header line).

  Semantics:
    - training (`drop_remainder=True, repeat=True`): every epoch reads the shard in file
      order, cuts full batches and drops the last partial one (logged); epochs repeat forever.
    - eval (`drop_remainder=False, repeat=False`): one pass; the last batch is padded to
      full size with mask 0 (padded rows: dense 0, label 0, every feature one id 0, the
      "missing" row, so pooled values stay finite).
    - `batches(start)` yields exactly what a fresh iteration yields from batch `start` on.
      It skips lines without parsing them when it can: always with `bad_lines="error"`, and
      with `bad_lines="skip"` once the bad lines are known (after one full pass, or the
      validation pass that `num_batches` runs in that mode).
    - bad lines: "error" raises ValueError naming file:line, field, value and what was
      expected; "skip" drops them, counts them in `bad_line_count` and logs the first. A
      line a parser marks `stop_at` (a value that contradicts an inferred column role)
      raises in both modes.
    - `num_batches` counts newlines once (no parsing; with "skip" it runs one validation
      pass instead) and caches it. Shards of an eval set may differ by one batch: a
      multi-host eval loop must agree on the largest count and feed mask-0 batches.
    - files are read `chunk_bytes` of lines at a time (about 4,500 Criteo lines per MiB).
  """

  spec: DataSpec

  def __init__(self, files: str | os.PathLike | Part | Sequence[str | os.PathLike | Part],
               batch_size: int, *, bad_lines: str = "error", drop_remainder: bool = True,
               shard_index: int = 0, num_shards: int = 1, repeat: bool = True,
               chunk_bytes: int = 1 << 20):
    self.parts = as_parts(files)
    self.files = tuple(p.path for p in self.parts)
    kind = type(self).__name__
    if not self.files:
      raise UserError(f"{kind}: empty file list, expected at least one file")
    for f in self.files:
      if not os.path.isfile(f):
        raise FileNotFoundError(errno.ENOENT, f"{kind}: data file does not exist", f)
    if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
        or batch_size < 1):
      raise UserError(f"{kind}: batch_size={batch_size!r}, expected an int >= 1")
    if bad_lines not in BAD_LINE_MODES:
      raise UserError(f"{kind}: bad_lines={bad_lines!r}, expected one of {BAD_LINE_MODES}")
    if not (isinstance(num_shards, (int, np.integer)) and num_shards >= 1):
      raise UserError(f"{kind}: num_shards={num_shards!r}, expected an int >= 1")
    if not (isinstance(shard_index, (int, np.integer)) and 0 <= shard_index < num_shards):
      raise UserError(f"{kind}: shard_index={shard_index!r}, expected an int in [0, {num_shards})")
    self.batch_size = int(batch_size)
    self.bad_lines = bad_lines
    self.drop_remainder = bool(drop_remainder)
    self.shard_index = int(shard_index)
    self.num_shards = int(num_shards)
    self.repeat = bool(repeat)
    self.chunk_bytes = int(chunk_bytes)
    self.name = (f"{kind}({', '.join(p.describe() for p in self.parts)}; "
                 f"shard {self.shard_index}/{self.num_shards})")
    self._num_records: int | None = None     # records in this shard, bad ones included
    self._num_valid: int | None = None       # records in this shard that parse
    self._bad: set[int] = set()              # record numbers of the bad lines found so far
    self._first_bad: str | None = None       # "file:line: message" of the first one
    self._bad_complete = bad_lines == "error"  # True once every bad line of the shard is known
    self._total_records: int | None = None   # records of all shards, bad ones included
    # Non-repeating sources: pad the epoch with empty batches (mask 0) up to this many, so
    # that every process of a multi-process eval runs the same number of steps.
    self.pad_to_batches: int | None = None

  # --- what a subclass provides ------------------------------------------------------------

  def _parse(self, lines: list[bytes]) -> Parsed:
    raise NotImplementedError

  def _is_header(self, first_line: bytes) -> bool:
    del first_line
    return False

  # --- public API ----------------------------------------------------------------------------

  @property
  def bad_line_count(self) -> int:
    """Bad lines of this shard found so far (all of them after a full pass or `num_batches`)."""
    return len(self._bad)

  @property
  def num_examples(self) -> int:
    """Valid records in this shard (one epoch); counted once and cached."""
    if self._num_valid is None:
      if self.bad_lines == "error":
        self._num_valid = self._count_records()
      else:
        self._validate_all()
    return self._num_valid

  @property
  def num_batches(self) -> int:
    """Batches per epoch: full batches only when dropping the remainder, else rounded up
    (at least `pad_to_batches` when set)."""
    n = self.num_examples
    nb = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
    return max(nb, self.pad_to_batches or 0)

  def validate(self) -> None:
    """One parsing pass over the shard: a bad line raises here (file:line) with
    bad_lines="error", or is found and counted with "skip"; the valid rows are counted."""
    n = 0
    for parsed in self._records(0):
      n += len(parsed.labels)
    self._num_valid = n

  def max_shard_batches(self) -> int:
    """An upper bound, the same in every shard, on any shard's batches per epoch (padded
    last batch included): ceil(ceil(records / num_shards) / batch_size), bad lines counted."""
    self._count_records()
    per_shard = math.ceil(self._total_records / self.num_shards)
    return math.ceil(per_shard / self.batch_size)

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    """Batch `start`, `start + 1`, ... of this source's sequence (forever when repeating)."""
    if start < 0:
      raise UserError(f"{self.name}: start={start}, expected >= 0")
    if not self.repeat:
      produced = start
      for b in self._epoch(start):
        produced += 1
        yield b
      for _ in range(produced, self.pad_to_batches or 0):
        yield self._empty_batch()
      return
    first = 0
    if start > 0:
      nb = self.num_batches
      if nb == 0:
        raise self._too_small()
      first = start % nb
    while True:
      produced = 0
      for batch in self._epoch(first):
        produced += 1
        yield batch
      if produced == 0 and first == 0:
        raise self._too_small()
      first = 0

  # --- internals -------------------------------------------------------------------------------

  def _too_small(self) -> UserError:
    return UserError(
        f"{self.name}: one epoch holds {self.num_examples} valid examples, fewer than "
        f"batch_size={self.batch_size}, so a repeating source would never yield a batch")

  def _file_lines(self, part: Part) -> Iterator[tuple[int, list[bytes]]]:
    """(1-based line number of the first line, lines) chunks of one part of a file, header
    left out."""
    with open_binary(part.path) as f:
      first = f.readline()
      if not first:
        return
      header = int(self._is_header(first))
      line_no = 1 + header            # file line number of data line 0
      data_line = 0                   # data lines before f's position
      pending = [] if header else [first]
      if part.start and part.offset is not None and not part.path.endswith(".gz"):
        f.seek(part.offset)
        pending, data_line = [], part.start
      todo = None if part.stop is None else part.stop - part.start
      while todo is None or todo > 0:
        lines = pending + f.readlines(self.chunk_bytes)
        pending = []
        if not lines:
          return
        if data_line < part.start:    # lines before the part: counted, not kept
          skip = min(part.start - data_line, len(lines))
          data_line += skip
          lines = lines[skip:]
          if not lines:
            continue
        if todo is not None:
          lines = lines[:todo]
          todo -= len(lines)
        yield line_no + data_line, lines
        data_line += len(lines)

  def _shard_chunks(self, skip: int) -> Iterator[tuple[str, np.ndarray, np.ndarray, list[bytes]]]:
    """(file, line numbers [N], record numbers [N], lines) of this shard after `skip` valid
    records skipped without parsing; needs every bad line of the shard known."""
    k, s = self.num_shards, self.shard_index
    bad_sorted = np.array(sorted(self._bad), np.int64) if skip and self._bad else None
    record0 = 0
    for part in self.parts:
      path = part.path
      for line0, lines in self._file_lines(part):
        off = (s - record0) % k
        n_sel = max(0, (len(lines) - off + k - 1) // k)
        rec0, lno0 = record0 + off, line0 + off
        record0 += len(lines)
        if n_sel == 0:
          continue
        records = rec0 + k * np.arange(n_sel, dtype=np.int64)
        cut = 0
        if skip:
          if bad_sorted is None:
            valid_idx = None
            n_valid = n_sel
          else:
            valid_idx = np.flatnonzero(~np.isin(records, bad_sorted))
            n_valid = len(valid_idx)
          if n_valid <= skip:
            skip -= n_valid
            continue
          cut = skip if valid_idx is None else int(valid_idx[skip])
          skip = 0
        sel = lines[off + k * cut::k] if k > 1 else lines[cut:]
        yield path, lno0 + k * np.arange(cut, n_sel, dtype=np.int64), records[cut:], sel

  def _records(self, skip: int) -> Iterator[Parsed]:
    """Decoded valid rows of one pass over the shard, the first `skip` of them left out."""
    cheap_skip = self._bad_complete
    full_pass = skip == 0 or not cheap_skip  # every line of the pass gets parsed
    pass_bad = 0
    pass_first = None
    n_valid = 0
    for path, line_nos, records, lines in self._shard_chunks(skip if cheap_skip else 0):
      parsed = self._parse(lines)
      if parsed.bad:
        i, msg = parsed.bad[0]
        where = f"{path}:{line_nos[i]}: {msg}"
        if self.bad_lines == "error":
          raise UserError(where)
        if parsed.stop_at is not None:
          i = parsed.stop_at
          raise UserError(f"{path}:{line_nos[i]}: {dict(parsed.bad)[i]}")
        if self._first_bad is None:
          self._first_bad = where
          logging.warning("%s: skipping malformed line %s (bad_lines='skip'; later ones are "
                          "counted in bad_line_count and summed up after each pass)",
                          self.name, where)
        self._bad.update(int(records[i]) for i, _ in parsed.bad)
        pass_bad += len(parsed.bad)
        pass_first = pass_first or where
      n_valid += len(parsed.labels)
      if not cheap_skip and skip:
        if len(parsed.labels) <= skip:
          skip -= len(parsed.labels)
          continue
        parsed = Parsed(parsed.dense[skip:], parsed.ids[skip:], parsed.labels[skip:], [])
        skip = 0
      yield parsed
    if full_pass:
      self._bad_complete = True
      self._num_valid = n_valid
    if pass_bad:
      logging.warning("%s: skipped %d malformed lines in this pass (first: %s); "
                      "bad_line_count=%d", self.name, pass_bad, pass_first, len(self._bad))

  def _epoch(self, first_batch: int) -> Iterator[SparseBatch]:
    """Batches `first_batch`, ... of one epoch."""
    B = self.batch_size
    pending: list[Parsed] = []
    have = 0
    for parsed in self._records(first_batch * B):
      if not len(parsed.labels):
        continue
      pending.append(parsed)
      have += len(parsed.labels)
      if have < B:
        continue
      cat = _concat(pending)
      n_full = have // B
      for b in range(n_full):
        yield self._batch(cat, slice(b * B, (b + 1) * B), B)
      rest = slice(n_full * B, have)
      pending = [Parsed(cat.dense[rest], cat.ids[rest], cat.labels[rest], [])] if have % B else []
      have -= n_full * B
    if not have:
      return
    if self.drop_remainder:
      logging.info("%s: dropped the last %d examples of the epoch (fewer than batch_size=%d)",
                   self.name, have, B)
      return
    yield self._batch(_concat(pending), slice(0, have), B)

  def _empty_batch(self) -> SparseBatch:
    """A batch of padding only (mask 0)."""
    return self._batch(self._parse([]), slice(0, 0), self.batch_size)

  def _batch(self, parsed: Parsed, rows: slice, B: int) -> SparseBatch:
    """Rows of `parsed` as one SparseBatch of size B, padded with mask 0 when short."""
    dense, ids, labels = parsed.dense[rows], parsed.ids[rows], parsed.labels[rows]
    n, F = ids.shape
    mask = np.ones(B, np.float32)
    if n < B:
      pad = B - n
      dense = np.concatenate([dense, np.zeros((pad, dense.shape[1]), np.float32)])
      ids = np.concatenate([ids, np.zeros((pad, F), np.int32)])
      labels = np.concatenate([labels, np.zeros(pad, np.float32)])
      mask[n:] = 0
    return SparseBatch(dense=np.ascontiguousarray(dense),
                       ids=np.ascontiguousarray(ids)[:, :, None],
                       lengths=np.ones((B, F), np.int32),
                       labels=np.ascontiguousarray(labels), mask=mask)

  def _count_records(self) -> int:
    """Records of this shard, bad ones included, by counting newlines (no parsing)."""
    if self._num_records is None:
      total = 0
      for part in self.parts:
        if part.stop is not None:
          total += part.stop - part.start
          continue
        with open_binary(part.path) as f:
          first = f.readline()
          if not first:
            continue
          n = 0 if self._is_header(first) else 1
          tail = b"\n"
          while block := f.read(BLOCK):
            n += block.count(b"\n")
            tail = block[-1:]
          if tail != b"\n":
            n += 1  # a last line without its newline
        total += max(n - part.start, 0)
      self._total_records = total
      self._num_records = len(range(self.shard_index, total, self.num_shards))
    return self._num_records

  def _validate_all(self) -> None:
    """One parsing pass over the shard that finds every bad line (bad_lines='skip')."""
    for _ in self._records(0):
      pass


def first_fields(src: LineSource, sep: bytes = b",") -> Iterator[str]:
  """The first field of every record of a one-shard source, in order (the row ids of a
  prediction file, e.g. Avazu's `id` column)."""
  for part in src.parts:
    for _, lines in src._file_lines(part):
      for line in lines:
        yield line.split(sep, 1)[0].strip().decode("utf-8", "replace")


def _concat(parts: list[Parsed]) -> Parsed:
  if len(parts) == 1:
    return parts[0]
  return Parsed(np.concatenate([p.dense for p in parts]), np.concatenate([p.ids for p in parts]),
                np.concatenate([p.labels for p in parts]), [])
