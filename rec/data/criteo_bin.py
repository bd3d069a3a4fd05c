"""Criteo click logs converted once into memory-mapped numpy shards, and a Grain reader of them.

`convert(src, dst)` turns a Criteo directory in any layout `criteo.criteo_layout` reads
(Kaggle as downloaded: train.txt cut into the DLRM reference's days + the unlabeled
test.txt; a custom train / valid / test split; Terabyte day_N[.gz], any subset of days)
into columns per shard:

  dst/manifest.json                  written last (atomically): format, version, settings,
                                     layout, columns and dtypes, rows per feature, splits ->
                                     shards with row counts and checksums, source files
  dst/<split>/<unit>-<j>.dense.npy   float32 [N, 13], log1p(max(x, 0)) as the text reader
  dst/<split>/<unit>-<j>.sparse.npy  int32 [N, 26], row ids (0 = missing)
  dst/<split>/<unit>-<j>.label.npy   uint8 [N] (0 for the unlabeled "predict" split)
  dst/<split>/<unit>.done            a unit's completion marker (JSON, atomic): its shards,
                                     each with the CRC-32 of its three files

Splits: train, valid, test and, for Kaggle's test.txt, predict (labeled false). A unit is
a byte range of about 64 MiB of a plain file's part, or a .gz file's part (its line range
decompressed); units run in worker processes. A killed conversion resumes: units whose
marker carries the same settings are kept (and said to be), and with `ids="vocab"` so are
the units already counted (vocab/counts/). A finished conversion of other inputs or
settings in `dst` is refused unless `overwrite`. Lines are decoded by `criteo.parse_lines`,
so validation and file:line errors are the text reader's; `bad_lines="skip"` drops and
counts them.

Ids: `ids="hash"` is the text reader's 1 + int(hex, 16) % (rows - 1). `ids="vocab"` is the
DLRM / TorchRec preprocessing: a counting pass over the train split only, then per feature
the values seen at least `min_count` times get ids 2, 3, ... by decreasing count (ties by
value), every other value (and any value first seen in eval data) id 1, missing id 0.
Vocabulary keys are the 32-bit values reduced mod 2^31 - 1, so two values collide only when
they differ by exactly 2^31 - 1.

`CriteoBinSource` reads a split through Grain: a `MapDataset` whose element k is batch k of
this process (so `batches(start)` resumes exactly and Grain's iterator state checkpoints),
global shuffling of `block_rows`-row blocks reseeded every epoch, per-process shares of
every global batch, reads in Grain's thread pool. Opening checks every shard's files, shapes,
dtypes, settings and (`verify=True`, the default) CRC-32 against its marker, so a changed
byte anywhere in any split stops the run before its first step; every batch checks labels,
ids and dense values and names the file, row, column and value of a bad one.

Letters: N rows of a shard, B batch, Dn dense features (13), F sparse features (26).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import multiprocessing
import multiprocessing.pool
import os
import shutil
import sys
import threading
import time
import zlib
from typing import Iterator, Sequence

import numpy as np

from core.errors import UserError
from rec.data import criteo, stream
from rec.data.batch import DataSpec, SparseBatch

FORMAT = "criteo_bin"
VERSION = 2
UNIT_BYTES = 64 << 20
ROWS_PER_SHARD = 2_000_000
COLUMNS = {"dense": ("float32", criteo.NUM_DENSE), "sparse": ("int32", criteo.NUM_SPARSE),
           "label": ("uint8", None)}
_KEY_ROWS = 2**31      # vocab keys: 1 + value % (2^31 - 1), 0 = missing
_CRC_BLOCK = 16 << 20


# --- layout of the source directory -----------------------------------------------------------

def source_layout(src: str, days=None, flag: str = "--src") -> stream.Layout:
  """The splits to convert (`criteo.criteo_layout`); errors name `flag`."""
  return criteo.criteo_layout(src, days, flag=f"{flag}=DIR", days_flag="--days")


@dataclasses.dataclass(frozen=True)
class Unit:
  split: str
  name: str            # <split>/<name>.done, <split>/<name>-<j>.*.npy
  path: str
  start: int           # byte range [start, end) of a plain file; .gz: 0, -1 (whole stream)
  end: int
  first_line: int = 0  # .gz: the data lines [first_line, stop_line) of the stream
  stop_line: int | None = None
  labeled: bool = True


def plan_units(layout: stream.Layout, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
  """Byte ranges of plain files' parts, cut after a newline; .gz parts whole."""
  units = []
  for split, parts in layout.splits.items():
    labeled = split != "predict"
    for part in parts:
      stem = os.path.basename(part.path).replace(".", "_")
      if part.path.endswith(".gz"):
        name = stem if part.start == 0 and part.stop is None else f"{stem}-l{part.start}"
        units.append(Unit(split, name, part.path, 0, -1, part.start, part.stop, labeled))
        continue
      size = os.path.getsize(part.path)
      lo = part.offset if part.offset is not None else 0
      hi = part.stop_offset if part.stop_offset is not None else size
      if part.start and part.offset is None or part.stop is not None and part.stop_offset is None:
        raise ValueError(f"{part}: a line range of a plain file needs its byte offsets")
      cuts = [lo]
      with open(part.path, "rb") as f:
        while cuts[-1] + unit_bytes < hi:
          f.seek(cuts[-1] + unit_bytes)
          f.readline()
          if f.tell() >= hi:
            break
          cuts.append(f.tell())
      cuts.append(hi)
      for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        if b > a:
          units.append(Unit(split, f"{stem}-{i:05d}", part.path, a, b, labeled=labeled))
  return units


def _unit_lines(u: Unit, chunk_bytes: int = 1 << 20) -> Iterator[tuple[int, list[bytes]]]:
  """(byte offset of the chunk's first line in the file's stream, lines) of a unit."""
  with stream.open_binary(u.path) as f:
    if u.end < 0:
      pos = line = 0
      while lines := f.readlines(chunk_bytes):
        n = len(lines)
        if line + n <= u.first_line:          # before the unit's lines
          line += n
          pos += sum(map(len, lines))
          continue
        cut = max(u.first_line - line, 0)
        pos += sum(map(len, lines[:cut]))
        keep = lines[cut:]
        if u.stop_line is not None:
          keep = keep[:max(u.stop_line - line - cut, 0)]
        if keep:
          yield pos, keep
        pos += sum(map(len, lines[cut:]))
        line += n
        if u.stop_line is not None and line >= u.stop_line:
          return
      return
    f.seek(u.start)
    pos = u.start
    while pos < u.end:
      chunk = f.read(min(chunk_bytes, u.end - pos))
      if not chunk:
        return
      if not chunk.endswith(b"\n") and pos + len(chunk) < u.end:
        chunk += f.readline()  # to the end of the line; units end at line starts
      parts = chunk.split(b"\n")  # as readlines: only '\n' ends a line
      yield pos, [x + b"\n" for x in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
      pos += len(chunk)


def _line_number(path: str, offset: int) -> int:
  """1-based number of the line starting at byte `offset` (counts newlines before it)."""
  n = 1
  with stream.open_binary(path) as f:
    left = offset
    while left > 0 and (block := f.read(min(1 << 24, left))):
      n += block.count(b"\n")
      left -= len(block)
  return n


def _parse_unit(u: Unit, rows, bad_lines: str):
  """Yields (parsed chunk, bad lines so far) of a unit; raises on a bad line with "error"."""
  bad = 0
  for pos, lines in _unit_lines(u):
    parsed = criteo.parse_lines(lines, rows, u.labeled)
    if parsed.bad:
      if bad_lines == "error":
        i, msg = parsed.bad[0]
        line_no = _line_number(u.path, pos + sum(map(len, lines[:i])))
        raise UserError(f"{u.path}:{line_no}: {msg}")
      bad += len(parsed.bad)
    yield parsed, bad


# --- conversion ------------------------------------------------------------------------------

def settings_fingerprint(settings: dict) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def data_fingerprint(manifest: dict) -> str:
  """The fingerprint of a converted directory's content: a hash of its manifest, which holds
  the conversion's settings and every shard's row count and checksums."""
  return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def conversion_settings(manifest: dict) -> dict:
  """The settings that decide what the ids mean: {ids, min_count, num_rows, layout, days}."""
  s = manifest.get("settings", {})
  return {"ids": s.get("ids"), "min_count": s.get("min_count"),
          "num_rows": s.get("rows_per_feature") if s.get("ids") == "hash" else None,
          "layout": manifest.get("layout"), "days": s.get("days")}


def _atomic_json(path: str, obj) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def _save_npy(path: str, x: np.ndarray) -> int:
  """Writes `x` atomically; returns the CRC-32 of the file written."""
  tmp = f"{path}.tmp{os.getpid()}.npy"
  np.save(tmp, x)
  crc = file_crc32(tmp)
  os.replace(tmp, path)
  return crc


def file_crc32(path: str) -> int:
  """CRC-32 of a file's bytes (zlib, in blocks that release the GIL)."""
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(_CRC_BLOCK):
      crc = zlib.crc32(block, crc)
  return crc


def _marker(dst: str, u: Unit) -> str:
  return os.path.join(dst, u.split, u.name + ".done")


def _read_marker(dst: str, u: Unit, fingerprint: str) -> dict | None:
  try:
    with open(_marker(dst, u)) as f:
      m = json.load(f)
  except (OSError, ValueError):
    return None
  return m if m.get("fingerprint") == fingerprint and m.get("version") == VERSION else None


def _write_shard(base: str, dense, ids, labels) -> dict:
  return {"crc32": {"dense": _save_npy(base + ".dense.npy", np.asarray(dense, np.float32)),
                    "sparse": _save_npy(base + ".sparse.npy", np.asarray(ids, np.int32)),
                    "label": _save_npy(base + ".label.npy", np.asarray(labels, np.uint8))}}


def _counts_path(vocab_dir: str, u: Unit) -> str:
  return os.path.join(vocab_dir, "counts", f"{u.split}_{u.name}")


def _count_unit(args) -> tuple[Unit, int, int]:
  """Vocabulary counting pass over one unit: per feature (keys, counts), written to
  vocab/counts/<unit>.npz with a marker, so that a killed pass resumes."""
  u, bad_lines, vocab_dir, fingerprint = args
  parts: list[list[np.ndarray]] = [[] for _ in range(criteo.NUM_SPARSE)]
  bad = n = 0
  for parsed, bad in _parse_unit(u, [_KEY_ROWS] * criteo.NUM_SPARSE, bad_lines):
    n += len(parsed.labels)
    for f in range(criteo.NUM_SPARSE):
      parts[f].append(parsed.ids[:, f])
  out = {}
  for f in range(criteo.NUM_SPARSE):
    keys = np.concatenate(parts[f]) if parts[f] else np.zeros(0, np.int32)
    k, c = np.unique(keys[keys > 0], return_counts=True)
    out[f"k{f}"], out[f"c{f}"] = k.astype(np.int32), c.astype(np.int64)
  base = _counts_path(vocab_dir, u)
  tmp = f"{base}.tmp{os.getpid()}.npz"
  np.savez(tmp, **out)
  os.replace(tmp, base + ".npz")
  _atomic_json(base + ".done", {"fingerprint": fingerprint, "rows": n, "bad_lines": bad})
  return u, n, bad


def _convert_unit(args) -> dict:
  u, dst, settings, fingerprint, vocab_dir = args
  rows = settings["rows_per_feature"]
  vocab = None
  if settings["ids"] == "vocab":
    vocab = [np.load(os.path.join(vocab_dir, f"{name}.npz")) for name in criteo.SPARSE_NAMES]
  shards, buf, n_buf, bad, total = [], [], 0, 0, 0

  def flush():
    nonlocal buf, n_buf
    if not n_buf:
      return
    name = f"{u.name}-{len(shards):04d}"
    base = os.path.join(dst, u.split, name)
    crc = _write_shard(base, np.concatenate([b.dense for b in buf]),
                       np.concatenate([b.ids for b in buf]),
                       np.concatenate([b.labels for b in buf]))
    shards.append({"name": name, "rows": n_buf, **crc})
    buf, n_buf = [], 0

  key_rows = [_KEY_ROWS] * criteo.NUM_SPARSE if vocab is not None else rows
  for parsed, bad in _parse_unit(u, key_rows, settings["bad_lines"]):
    if vocab is not None:
      parsed = dataclasses.replace(parsed, ids=_map_vocab(parsed.ids, vocab))
    buf.append(parsed)
    n_buf += len(parsed.labels)
    total += len(parsed.labels)
    if n_buf >= ROWS_PER_SHARD:
      flush()
  flush()
  m = {"version": VERSION, "fingerprint": fingerprint, "unit": dataclasses.asdict(u),
       "shards": shards, "rows": total, "bad_lines": bad}
  _atomic_json(_marker(dst, u), m)
  return m


def _map_vocab(keys_NF: np.ndarray, vocab) -> np.ndarray:
  """Keys -> vocabulary ids: 0 missing, 1 rare or unseen, else the kept key's id."""
  out = np.empty(keys_NF.shape, np.int32)
  for f, v in enumerate(vocab):
    kept, ids = v["keys"], v["ids"]
    k = keys_NF[:, f]
    j = np.minimum(np.searchsorted(kept, k), max(len(kept) - 1, 0))
    hit = (kept[j] == k) if len(kept) else np.zeros(len(k), bool)
    out[:, f] = np.where(k == 0, 0, np.where(hit, ids[j] if len(kept) else 1, 1))
  return out


class _Progress:
  """Progress on stderr: bytes done, rate, units, ETA. On a terminal one line rewritten in
  place ('\\r'); into a file or pipe a line of its own per report, at most every
  `every_s` seconds (and at the end)."""

  def __init__(self, what: str, total_bytes: int, units: int, every_s: float = 10.0):
    self.what, self.total, self.units = what, max(total_bytes, 1), units
    self.done = self.n = self.rows = 0
    self.t0 = self.last = time.perf_counter()
    self.tty = sys.stderr.isatty()
    self.every_s = every_s

  def add(self, nbytes: int, rows: int) -> None:
    self.done += nbytes
    self.rows += rows
    self.n += 1
    now = time.perf_counter()
    if not self.tty and self.n < self.units and now - self.last < self.every_s:
      return
    self.last = now
    dt = max(now - self.t0, 1e-9)
    rate = self.done / dt
    eta = (self.total - self.done) / rate if rate > 0 else float("inf")
    line = (f"{self.what}: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB "
            f"({100 * self.done / self.total:.0f}%) | {rate / 2**20:.0f} MiB/s | "
            f"{self.rows / dt:,.0f} rows/s | units {self.n}/{self.units} | ETA {eta:.0f}s")
    if self.tty:
      print("\r" + line, end="\n" if self.n == self.units else "", file=sys.stderr, flush=True)
    else:
      print(line, file=sys.stderr, flush=True)


def _unit_bytes(u: Unit) -> int:
  return (os.path.getsize(u.path) if u.end < 0 else u.end - u.start)


def _show_sources(sources: list[dict] | None) -> list[str]:
  """['train.txt (65,822 B, modified 2026-11-27 00:39:12)', ...]"""
  def when(x):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(x.get("mtime_ns", 0) / 1e9))
  return [f"{os.path.basename(x['path'])} ({x['bytes']:,} B, modified {when(x)})"
          for x in sources or []]


def _settings_diff(old: dict, new: dict) -> str:
  """'min_count: 4 -> 2; sources: ...' for the settings that differ."""
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if k == "rows_per_feature" and (a is None or b is None):
      continue   # a vocabulary's rows are counted, not set (`ids` shows that change)
    if a != b:
      if k == "sources":
        a, b = _show_sources(a), _show_sources(b)
      elif k == "rows_per_feature" and isinstance(a, list) and isinstance(b, list):
        a, b = a[:3] + ["..."], b[:3] + ["..."]
      out.append(f"{k}: {a} -> {b}")
  return "; ".join(out)


def convert(src: str, dst: str, *, ids: str = "hash", num_rows: int | Sequence[int] = 100_000,
            min_count: int = 1, bad_lines: str = "error", workers: int | None = None,
            unit_bytes: int = UNIT_BYTES, days=None, overwrite: bool = False,
            flag: str = "--src") -> dict:
  """Converts the Criteo files of `src` into shards under `dst`; returns the manifest.

  Resumable: units whose marker carries these settings are kept (and the vocabulary's
  counted units). A finished conversion in `dst` made from other inputs or settings is
  refused unless `overwrite` (then `dst`'s conversion files are deleted first). Errors name
  `flag` for the source directory. See the module docstring.
  """
  if ids not in ("hash", "vocab"):
    raise UserError(f"--ids={ids!r}; expected 'hash' or 'vocab'")
  if bad_lines not in stream.BAD_LINE_MODES:
    raise UserError(f"--bad_lines={bad_lines!r}; expected one of {stream.BAD_LINE_MODES}")
  if ids == "vocab" and min_count < 1:
    raise UserError(f"--min_count={min_count}; expected >= 1")
  layout = source_layout(src, days, flag)
  rows = list(stream.check_rows_per_feature(num_rows, criteo.SPARSE_NAMES, "--num_rows"))
  paths = dict.fromkeys(os.path.abspath(p.path) for parts in layout.splits.values() for p in parts)
  sources_info = [{"path": p, "bytes": os.stat(p).st_size, "mtime_ns": os.stat(p).st_mtime_ns}
                  for p in paths]
  splits_info = {s: [[os.path.basename(p.path), p.start, p.stop] for p in parts]
                 for s, parts in layout.splits.items()}
  settings = {"format": FORMAT, "version": VERSION, "ids": ids, "bad_lines": bad_lines,
              "rows_per_feature": rows if ids == "hash" else None,
              "min_count": min_count if ids == "vocab" else None, "sources": sources_info,
              "layout": layout.kind, "splits": splits_info,
              "days": list(criteo.parse_days(days)) if days else None}
  fingerprint = settings_fingerprint(settings)
  _check_previous(dst, settings, fingerprint, overwrite)
  print(f"{flag}={src}: {layout.note}", flush=True)
  # A truncated .gz would otherwise fail its unit after others finished: work that its
  # fixed copy (another size and mtime, so another fingerprint) could not reuse.
  stream.verify_gzip(list(paths), f"{flag}={src}")
  units = plan_units(layout, unit_bytes)
  made = [d for d in [dst] + [os.path.join(dst, s) for s in layout.splits]
          + [os.path.join(dst, "vocab"), os.path.join(dst, "vocab", "counts")]
          if not os.path.isdir(d)]
  for split in layout.splits:
    os.makedirs(os.path.join(dst, split), exist_ok=True)
  try:
    return _convert(layout, units, dst, settings, fingerprint, ids, bad_lines, min_count,
                    workers, rows)
  except BaseException:
    for d in reversed(made):   # directories this call made that hold nothing (yet)
      try:
        os.rmdir(d)
      except OSError:
        pass
    raise


def _convert(layout: stream.Layout, units: list[Unit], dst: str, settings: dict,
             fingerprint: str, ids: str, bad_lines: str, min_count: int, workers: int | None,
             rows: list[int]) -> dict:
  """`convert` once its split directories exist: the units not yet done, then the manifest."""
  done = {u: m for u in units if (m := _read_marker(dst, u, fingerprint)) is not None}
  todo = [u for u in units if u not in done]
  workers = workers or max(1, min(len(units), os.cpu_count() or 1))
  vocab_dir = os.path.join(dst, "vocab")
  if done:
    print(f"resuming the conversion in {dst}: {len(done)} of {len(units)} units already "
          f"converted with these settings (kept), {len(todo)} to do", flush=True)
  if ids == "vocab":
    vocab_done = _vocab_rows(vocab_dir, fingerprint)
    if vocab_done is None or todo:
      with _pool(workers) as pool:
        rows = vocab_done or _build_vocab(pool, [u for u in units if u.split == "train"],
                                          bad_lines, min_count, vocab_dir, fingerprint)
        settings["rows_per_feature"] = rows
        _convert_units(pool, todo, dst, settings, fingerprint, vocab_dir)
    else:
      rows = vocab_done
      settings["rows_per_feature"] = rows
  elif todo:
    with _pool(workers) as pool:
      _convert_units(pool, todo, dst, settings, fingerprint, vocab_dir)
  markers = [_read_marker(dst, u, fingerprint) for u in units]
  manifest = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "settings": settings, "rows_per_feature": rows, "layout": layout.kind,
              "note": layout.note,
              "columns": {k: {"dtype": d, "width": w} for k, (d, w) in COLUMNS.items()},
              "splits": {}, "sources": settings["sources"],
              "bad_lines_skipped": sum(m["bad_lines"] for m in markers)}
  for split in layout.splits:
    shards = [dict(s, split=split) for u, m in zip(units, markers) if u.split == split
              for s in m["shards"]]
    manifest["splits"][split] = {"rows": sum(s["rows"] for s in shards), "shards": shards,
                                 "labeled": split != "predict"}
  _atomic_json(os.path.join(dst, "manifest.json"), manifest)
  if ids == "vocab":
    shutil.rmtree(os.path.join(vocab_dir, "counts"), ignore_errors=True)
  return manifest


def _die_with_parent(parent: int) -> None:
  """Pool initializer: a worker ends as soon as the converting process `parent` is gone
  (killed), so no orphan goes on converting or waits on a queue lock that a killed sibling
  held. Linux's PR_SET_PDEATHSIG where the kernel honours it, else a thread that watches the
  parent; a worker whose start outlasted its parent ends here (the pid comes from the parent:
  read in the worker it would already be the reaper's)."""
  if sys.platform.startswith("linux"):
    try:
      import ctypes
      import signal
      ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
      pass
  if os.getppid() != parent:
    os._exit(1)

  def watch():
    while os.getppid() == parent:
      time.sleep(0.1)
    os._exit(1)
  threading.Thread(target=watch, daemon=True).start()


class _WorkerProcess(multiprocessing.context.SpawnProcess):
  """A pool worker that ends quietly when the result pipe is gone (its parent was killed):
  no "Broken pipe" traceback for a result nobody can receive."""

  def run(self):
    try:
      super().run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
      pass


class _WorkerContext(type(multiprocessing.get_context("spawn"))):
  Process = _WorkerProcess


def _pool(workers: int):
  return multiprocessing.pool.Pool(workers, initializer=_die_with_parent,
                                   initargs=(os.getpid(),), context=_WorkerContext())


def _convert_units(pool, todo: list[Unit], dst: str, settings: dict, fingerprint: str,
                   vocab_dir: str) -> None:
  progress = _Progress("convert", sum(_unit_bytes(u) for u in todo), len(todo))
  args = [(u, dst, settings, fingerprint, vocab_dir) for u in todo]
  by_name = {(u.split, u.name): u for u in todo}
  for m in pool.imap_unordered(_convert_unit, args):
    progress.add(_unit_bytes(by_name[(m["unit"]["split"], m["unit"]["name"])]), m["rows"])


def _check_previous(dst: str, settings: dict, fingerprint: str, overwrite: bool) -> None:
  """Refuses to overwrite a finished conversion of other inputs or settings; `overwrite`
  deletes whatever conversion (finished or not) `dst` holds."""
  path = os.path.join(dst, "manifest.json")
  if overwrite:
    removed = []
    for name in ("train", "valid", "test", "predict", "vocab", "manifest.json"):
      p = os.path.join(dst, name)
      if os.path.isdir(p):
        shutil.rmtree(p)
        removed.append(name)
      elif os.path.isfile(p):
        os.remove(p)
        removed.append(name)
    if removed:
      print(f"--overwrite: removed {', '.join(removed)} from {dst}", flush=True)
    return
  if not os.path.isfile(path):
    return
  try:
    with open(path) as f:
      old = json.load(f)
  except (OSError, ValueError):
    old = {}
  if old.get("fingerprint") == fingerprint:
    return
  diff = _settings_diff(old.get("settings", {}), settings) or "another format version"
  raise UserError(f"{path}: a finished conversion of other inputs or settings ({diff}); "
                  "expected the same --src and settings to resume it, --overwrite to replace "
                  "it, or another --dst")


def _vocab_rows(vocab_dir: str, fingerprint: str) -> list[int] | None:
  try:
    with open(os.path.join(vocab_dir, "vocab.done")) as f:
      done = json.load(f)
  except (OSError, ValueError):
    return None
  return done["rows_per_feature"] if done.get("fingerprint") == fingerprint else None


def _build_vocab(pool, units: list[Unit], bad_lines: str, min_count: int, vocab_dir: str,
                 fingerprint: str) -> list[int]:
  """The counting pass (resumable: a unit's counts are kept on disk with a marker) and the
  vocabularies (vocab_dir/C<i>.npz: sorted keys, their ids)."""
  os.makedirs(os.path.join(vocab_dir, "counts"), exist_ok=True)

  def counted(u: Unit) -> bool:
    try:
      with open(_counts_path(vocab_dir, u) + ".done") as f:
        return json.load(f).get("fingerprint") == fingerprint
    except (OSError, ValueError):
      return False

  todo = [u for u in units if not counted(u)]
  if len(todo) < len(units):
    print(f"resuming the vocabulary count in {vocab_dir}: {len(units) - len(todo)} of "
          f"{len(units)} train units already counted (kept), {len(todo)} to do", flush=True)
  progress = _Progress("count", sum(_unit_bytes(u) for u in todo), len(todo))
  args = [(u, bad_lines, vocab_dir, fingerprint) for u in todo]
  for u, n, _ in pool.imap_unordered(_count_unit, args):
    progress.add(_unit_bytes(u), n)
  rows = []
  files = [np.load(_counts_path(vocab_dir, u) + ".npz") for u in units]
  for f, name in enumerate(criteo.SPARSE_NAMES):
    keys = np.concatenate([z[f"k{f}"] for z in files] or [np.zeros(0, np.int32)])
    cnts = np.concatenate([z[f"c{f}"] for z in files] or [np.zeros(0, np.int64)])
    uniq, inv = np.unique(keys, return_inverse=True)
    total = np.bincount(inv, cnts, minlength=len(uniq)).astype(np.int64)
    kept = total >= min_count
    order = np.lexsort((uniq[kept], -total[kept]))      # by count down, then key
    ids = np.empty(int(kept.sum()), np.int32)
    ids[order] = 2 + np.arange(len(order), dtype=np.int32)
    np.savez(os.path.join(vocab_dir, f"{name}.npz"), keys=uniq[kept].astype(np.int32), ids=ids)
    rows.append(2 + len(ids))
  _atomic_json(os.path.join(vocab_dir, "vocab.done"),
               {"fingerprint": fingerprint, "rows_per_feature": rows, "min_count": min_count})
  return rows


# --- reading ---------------------------------------------------------------------------------

def load_manifest(d: str) -> dict:
  path = os.path.join(d, "manifest.json")
  if not os.path.isfile(path):
    raise UserError(f"{path}: not found; expected a directory written by `python -m "
                    "experiments.preprocess_criteo --dst=DIR` (a conversion that did not "
                    "finish writes no manifest.json; run it again to resume)")
  with open(path) as f:
    m = json.load(f)
  if m.get("format") != FORMAT or m.get("version") != VERSION:
    raise UserError(f"{path}: format {m.get('format')!r} version {m.get('version')!r}; "
                    f"expected {FORMAT!r} version {VERSION}: convert the data again with this "
                    "code")
  return m


class CriteoBinSource:
  """Batches of one split of a converted directory, read through a Grain MapDataset.

  Train (`shuffle=True, repeat=True`): blocks of `block_rows` consecutive rows (within a
  shard; a shard's last partial block is left out) in a global order that Grain reshuffles
  every epoch; global batch k is blocks [k*n, (k+1)*n) of that order, n = batch_size /
  block_rows, and this process reads its share (num_shards equal slices of those blocks).
  `block_rows=None` takes the largest power of two up to 256 that leaves at least 8 blocks
  in each process's share of a batch: the rows of a batch come from that many random places
  of the data, and the reader copies whole blocks (one Grain index and three slices each),
  which is what lets one process deliver millions of rows per second.
  Eval (`shuffle=False, repeat=False`): rows in file order, the last batch padded with mask 0.
  `verify`: check every shard's CRC-32 when opening (threads; see BENCHMARKS.md for its cost).
  """

  def __init__(self, d: str, split: str | Sequence[str], batch_size: int, *, shuffle: bool = True,
               repeat: bool = True, seed: int = 0, block_rows: int | None = None,
               shard_index: int = 0,
               num_shards: int = 1, num_threads: int = 4, prefetch: int = 8,
               num_workers: int = 0, num_rows: int | Sequence[int] | None = None,
               verify: bool = True):
    import grain
    m = load_manifest(d)
    splits = (split,) if isinstance(split, str) else tuple(split)
    self.dir, self.split, self.manifest = d, splits, m
    for sp in splits:
      if sp not in m["splits"]:
        raise UserError(f"{d}/manifest.json: no split {sp!r}; expected one of "
                        f"{sorted(m['splits'])}")
    rows = tuple(m["rows_per_feature"])
    if num_rows is not None and tuple(stream.check_rows_per_feature(
        num_rows, criteo.SPARSE_NAMES, "criteo_bin")) != rows:
      raise UserError(f"--num_rows={num_rows}: {d} was converted with rows per feature "
                      f"{rows[:3]}...; expected the converted value (or convert again)")
    self.spec = DataSpec(num_dense=criteo.NUM_DENSE, sparse_features=criteo.SPARSE_NAMES,
                         rows_per_feature=rows, max_ids_per_bag=1)
    self._rows_F = np.asarray(rows, np.int64)
    if batch_size % num_shards:
      raise UserError(f"batch_size={batch_size} is not divisible by num_shards={num_shards}")
    self.batch_size, self.local = batch_size, batch_size // num_shards
    if block_rows is None:
      block_rows = 256
      while block_rows > 1 and (self.local % block_rows or self.local // block_rows < 8):
        block_rows //= 2
    self._lengths = np.ones((self.local, criteo.NUM_SPARSE), np.int32)
    self._lengths.flags.writeable = False   # shared by every batch (Criteo bags hold one id)
    self.shard_index, self.num_shards = shard_index, num_shards
    self.shuffle, self.repeat, self.seed, self.block_rows = shuffle, repeat, seed, block_rows
    listed = [(sp, s) for sp in splits for s in m["splits"][sp]["shards"]]
    self.shards = [self._open(sp, s, m["fingerprint"]) for sp, s in listed]
    if verify:
      self._verify(listed)
    self.num_examples = sum(len(s[2]) for s in self.shards)
    if shuffle:
      if self.local % block_rows:
        raise UserError(f"per-process batch {self.local} is not a multiple of block_rows="
                        f"{block_rows}")
      self._block_shard = np.concatenate(
          [np.full(len(s[2]) // block_rows, i, np.int32) for i, s in enumerate(self.shards)])
      self._block_start = np.concatenate(
          [np.arange(len(s[2]) // block_rows, dtype=np.int64) * block_rows for s in self.shards])
      n_blocks = len(self._block_shard)
      per_batch = batch_size // block_rows
      if n_blocks < per_batch:
        raise UserError(f"{d} split {'+'.join(splits)}: {n_blocks} blocks of {block_rows} rows; "
                        f"expected at least one batch of {batch_size}")
      order = grain.MapDataset.range(n_blocks).shuffle(seed=seed)
      if repeat:
        order = order.repeat()
      self._num_batches = n_blocks // per_batch
      ds = order.batch(per_batch, drop_remainder=True).map(self._read_blocks)
    else:
      self._starts = np.cumsum([0] + [len(s[2]) for s in self.shards])
      self._num_batches = math.ceil(self.num_examples / batch_size)
      ds = grain.MapDataset.range(self._num_batches)
      ds = (ds.repeat() if repeat else ds).map(self._read_range)
    self.dataset = ds
    self.read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    self.num_workers = num_workers

  @property
  def num_batches(self) -> int:
    return self._num_batches

  def iterator(self, start: int = 0):
    """Grain iterator from batch `start`; its get_state() / set_state() checkpoint it.
    With `num_workers`, batches are read in that many worker processes (Grain's
    mp_prefetch), in the same order."""
    import grain
    ds = self.dataset[start:] if start else self.dataset
    it = ds.to_iter_dataset(self.read_options)
    if self.num_workers:
      from absl import flags
      if not flags.FLAGS.is_parsed():   # Grain's workers read its absl flags (defaults when
        flags.FLAGS.mark_as_parsed()    # used from a notebook or a test, not an absl app)
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers))
    return it.__iter__()

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    yield from self.iterator(start)

  def batch(self, k: int) -> SparseBatch:
    return self.dataset[k]

  # --- shards ----------------------------------------------------------------------------------

  def _marker_of(self, split: str, s: dict) -> str:
    return os.path.join(self.dir, split, s["name"].rsplit("-", 1)[0] + ".done")

  def _open(self, split: str, s: dict, fingerprint: str):
    base = os.path.join(self.dir, split, s["name"])
    marker = self._marker_of(split, s)
    try:
      with open(marker) as f:
        mk = json.load(f)
    except (OSError, ValueError) as e:
      raise UserError(f"{marker}: unreadable ({e}); expected the marker of the conversion "
                      "that wrote manifest.json") from None
    if mk.get("fingerprint") != fingerprint or mk.get("version") != VERSION:
      raise UserError(f"{marker}: written by another conversion (settings "
                      f"{mk.get('fingerprint')}, version {mk.get('version')}); expected "
                      f"{fingerprint}, version {VERSION} as manifest.json says")
    out = []
    for col, (dtype, width) in COLUMNS.items():
      path = f"{base}.{col}.npy"
      shape = (s["rows"],) if width is None else (s["rows"], width)
      try:
        x = np.load(path, mmap_mode="r")
      except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable or truncated ({e}); expected {dtype} {shape} as "
                        "manifest.json says") from None
      if x.shape != shape or x.dtype != np.dtype(dtype):
        raise UserError(f"{path}: {x.dtype} {x.shape}; expected {dtype} {shape} as "
                        "manifest.json says (a shard from another conversion?)")
      out.append(x.view(np.ndarray))   # slicing a plain view skips memmap's Python hooks
    return (base, *out)

  def _verify(self, listed: list[tuple[str, dict]]) -> None:
    """Every column file's CRC-32 against its unit's marker (a changed id, label or dense
    byte anywhere is found before training; threads, zlib releases the GIL)."""
    jobs = []
    markers: dict[str, dict] = {}
    for split, s in listed:
      path = self._marker_of(split, s)
      if path not in markers:
        with open(path) as f:
          markers[path] = {x["name"]: x for x in json.load(f)["shards"]}
      want = markers[path][s["name"]].get("crc32")
      if want is None:
        raise UserError(f"{path}: shard {s['name']} has no checksum; expected a marker of "
                        f"format version {VERSION}: convert the data again")
      for col in COLUMNS:
        jobs.append((os.path.join(self.dir, split, f"{s['name']}.{col}.npy"), want[col]))
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
      for (path, want), got in zip(jobs, pool.map(lambda j: file_crc32(j[0]), jobs)):
        if got != want:
          raise UserError(f"{path}: CRC-32 {got:08x}; expected {want:08x} as its marker "
                          "records: the file changed after conversion (a corrupt or replaced "
                          "shard); convert the data again")

  def _check(self, b: SparseBatch, where) -> SparseBatch:
    """Labels in {0, 1}, ids in [0, rows), dense finite and >= 0; else names the shard file,
    row, column and value."""
    ids = b.ids[:, :, 0]
    # Whole-batch reductions first (cheap); the per-row search only when one fails. NaN
    # propagates through min, so `not (min >= 0)` also catches NaN dense values.
    if (b.labels.max(initial=0) <= 1 and ids.min(initial=0) >= 0
        and (ids.max(0, initial=0) < self._rows_F).all() and b.dense.min(initial=0) >= 0
        and np.isfinite(b.dense.max(initial=0))):
      return b
    bad_label = b.labels > 1
    bad_ids = (ids >= self._rows_F) | (ids < 0)
    bad_dense = ~np.isfinite(b.dense) | ~(b.dense >= 0)
    bad = bad_label | bad_ids.any(1) | bad_dense.any(1)
    i = int(np.argmax(bad))
    base, row = where(i)
    if bad_label[i]:
      found, want = f"label {b.labels[i]:g}", "0 or 1"
      path = f"{base}.label.npy row {row}"
    elif bad_ids[i].any():
      f = int(np.argmax(bad_ids[i]))
      path = f"{base}.sparse.npy row {row}, column {criteo.SPARSE_NAMES[f]}"
      found, want = f"id {ids[i, f]}", f"an id in [0, {self._rows_F[f]}) (the manifest's rows)"
    else:
      f = int(np.argmax(bad_dense[i]))
      path = f"{base}.dense.npy row {row}, column {criteo.DENSE_NAMES[f]}"
      found, want = f"value {b.dense[i, f]}", "a finite value >= 0 (log1p of a count)"
    raise UserError(f"{path}: {found}; expected {want}: a corrupt shard")

  def _read_blocks(self, blocks: np.ndarray) -> SparseBatch:
    per = len(blocks) // self.num_shards
    mine = blocks[self.shard_index * per:(self.shard_index + 1) * per]
    R, B = self.block_rows, self.local
    dense = np.empty((B, criteo.NUM_DENSE), np.float32)
    ids = np.empty((B, criteo.NUM_SPARSE), np.int32)
    labels = np.empty(B, np.uint8)
    for j, blk in enumerate(mine):
      _, sd, si, sl = self.shards[self._block_shard[blk]]
      a = self._block_start[blk]
      dense[j * R:(j + 1) * R] = sd[a:a + R]
      ids[j * R:(j + 1) * R] = si[a:a + R]
      labels[j * R:(j + 1) * R] = sl[a:a + R]
    b = SparseBatch(dense=dense, ids=ids[:, :, None], lengths=self._lengths,
                    labels=labels.astype(np.float32), mask=np.ones(B, np.float32))
    return self._check(b, lambda i: (self.shards[self._block_shard[mine[i // R]]][0],
                                     int(self._block_start[mine[i // R]]) + i % R))

  def _read_range(self, k: int) -> SparseBatch:
    k = k % self._num_batches
    B = self.local
    lo = k * self.batch_size + self.shard_index * B
    dense = np.zeros((B, criteo.NUM_DENSE), np.float32)
    ids = np.zeros((B, criteo.NUM_SPARSE), np.int32)
    labels = np.zeros(B, np.uint8)
    mask = np.zeros(B, np.float32)
    pos = lo
    while pos < min(lo + B, self.num_examples):
      i = int(np.searchsorted(self._starts, pos, side="right")) - 1
      _, sd, si, sl = self.shards[i]
      a = pos - self._starts[i]
      n = min(lo + B - pos, len(sl) - a)
      o = pos - lo
      dense[o:o + n], ids[o:o + n], labels[o:o + n] = sd[a:a + n], si[a:a + n], sl[a:a + n]
      mask[o:o + n] = 1
      pos += n
    b = SparseBatch(dense=dense, ids=ids[:, :, None], lengths=self._lengths,
                    labels=labels.astype(np.float32), mask=mask)

    def where(i):
      j = int(np.searchsorted(self._starts, lo + i, side="right")) - 1
      return self.shards[j][0], int(lo + i - self._starts[j])
    return self._check(b, where)


def write_arrays(dst: str, splits: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                 rows_per_feature: Sequence[int]) -> dict:
  """Writes (dense [N, 13] float32, ids [N, 26] int32, labels [N] uint8) per split as one
  converted directory (one unit per split, shards of ROWS_PER_SHARD rows, checksums), for
  benchmarks and tests that need a directory without text files."""
  rows = list(rows_per_feature)
  settings = {"format": FORMAT, "version": VERSION, "ids": "arrays", "rows_per_feature": rows}
  fingerprint = settings_fingerprint(settings)
  manifest = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "settings": settings, "rows_per_feature": rows, "layout": "arrays",
              "note": "arrays written by criteo_bin.write_arrays",
              "columns": {k: {"dtype": d, "width": w} for k, (d, w) in COLUMNS.items()},
              "splits": {}, "sources": [], "bad_lines_skipped": 0}
  for split, (dense, ids, labels) in splits.items():
    os.makedirs(os.path.join(dst, split), exist_ok=True)
    shards = []
    for j, a in enumerate(range(0, len(labels), ROWS_PER_SHARD)):
      name = f"arrays-{j:04d}"
      b = slice(a, a + ROWS_PER_SHARD)
      crc = _write_shard(os.path.join(dst, split, name), dense[b], ids[b], labels[b])
      shards.append({"name": name, "rows": len(labels[b]), **crc})
    _atomic_json(os.path.join(dst, split, "arrays.done"),
                 {"version": VERSION, "fingerprint": fingerprint, "shards": shards})
    manifest["splits"][split] = {"rows": len(labels), "shards": shards, "labeled": True}
  _atomic_json(os.path.join(dst, "manifest.json"), manifest)
  return manifest
