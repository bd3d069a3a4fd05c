"""Criteo text files converted once, in parallel and resumably, into a `format` directory.

`convert(src, dst)` turns a Criteo directory in any layout `criteo.criteo_layout` reads
(Kaggle as downloaded: train.txt cut into the DLRM reference's days + the unlabeled
test.txt; a custom train / valid / test split; Terabyte day_N[.gz], any subset of days)
into the column shards that `format` describes.

A unit is a byte range of about 64 MiB of a plain file's part, or a .gz file's part (its
line range decompressed); units run in spawned worker processes that end with their parent.
A killed conversion resumes: units whose marker carries the same settings are kept (and
said to be), and with `ids="vocab"` so are the units already counted (vocab/counts/). A
finished conversion of other inputs or settings in `dst` is refused unless `overwrite`.
Lines are decoded by `criteo.parse_lines`, so validation and file:line errors are the text
reader's; `bad_lines="skip"` drops and counts them.

Ids: `ids="hash"` is the text reader's 1 + int(hex, 16) % (rows - 1). `ids="vocab"` is the
DLRM / TorchRec preprocessing: a counting pass over the train split only, then per feature
the values seen at least `min_count` times get ids 2, 3, ... by decreasing count (ties by
value), every other value (and any value first seen in eval data) id 1, missing id 0.
Vocabulary keys are the 32-bit values reduced mod 2^31 - 1, so two values collide only when
they differ by exactly 2^31 - 1.

Letters: N rows, F sparse features (26).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.pool
import os
import shutil
import sys
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from core.errors import UserError
from rec.data import criteo, stream
from rec.data.criteo_bin.format import (COLUMNS, FORMAT, ROWS_PER_SHARD, VERSION, atomic_json,
                                        settings_fingerprint, write_shard)

UNIT_BYTES = 64 << 20
_KEY_ROWS = 2**31      # vocab keys: 1 + value % (2^31 - 1), 0 = missing


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



def _marker(dst: str, u: Unit) -> str:
  return os.path.join(dst, u.split, u.name + ".done")


def _read_marker(dst: str, u: Unit, fingerprint: str) -> dict | None:
  try:
    with open(_marker(dst, u)) as f:
      m = json.load(f)
  except (OSError, ValueError):
    return None
  return m if m.get("fingerprint") == fingerprint and m.get("version") == VERSION else None



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
  atomic_json(base + ".done", {"fingerprint": fingerprint, "rows": n, "bad_lines": bad})
  return u, n, bad


def _convert_unit(args) -> dict:
  u, dst, settings, fingerprint, vocab_dir = args
  rows = settings["rows_per_feature"]
  vocab = None
  if settings["ids"] == "vocab":
    # read once per unit: an NpzFile rereads an array from its zip at every access
    vocab = [_npz_arrays(os.path.join(vocab_dir, f"{name}.npz"), ("keys", "ids"))
             for name in criteo.SPARSE_NAMES]
  shards, buf, n_buf, bad, total = [], [], 0, 0, 0

  def flush():
    nonlocal buf, n_buf
    if not n_buf:
      return
    name = f"{u.name}-{len(shards):04d}"
    base = os.path.join(dst, u.split, name)
    crc = write_shard(base, np.concatenate([b.dense for b in buf]),
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
  atomic_json(_marker(dst, u), m)
  return m


def _npz_arrays(path: str, names: Sequence[str]) -> dict[str, np.ndarray]:
  """The arrays `names` of an .npz file, read now, with the file closed again."""
  with np.load(path) as z:
    return {k: z[k] for k in names}


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
  if ids == "hash":
    # A table a run trains holds at most MAX_TABLE_ROWS rows (its ids and its padding id,
    # num_rows, are int32: rec.embedding.storage.check_size); a conversion beyond that
    # could be written but never trained on.
    big = [(n, r) for n, r in zip(criteo.SPARSE_NAMES, rows) if r > stream.MAX_TABLE_ROWS]
    if big:
      name, r = big[0]
      raise UserError(f"--num_rows: rows_per_feature for {name} = {r:,}, expected at most "
                      f"2^31 - 2 = {stream.MAX_TABLE_ROWS:,} (a run's ids and a table's "
                      "padding id, num_rows, are int32)")
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
  atomic_json(os.path.join(dst, "manifest.json"), manifest)
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
  except (OSError, ValueError) as e:
    raise UserError(f"{path}: unreadable ({e}); expected the manifest of a finished conversion: "
                    "--overwrite to replace it, or another --dst") from None
  old = old if isinstance(old, dict) else {}
  if old.get("fingerprint") == fingerprint:
    return
  recorded = old.get("settings")
  diff = (_settings_diff(recorded, settings) if isinstance(recorded, dict) else "") or (
      "another format version")
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
  files = [_counts_path(vocab_dir, u) + ".npz" for u in units]
  for f, name in enumerate(criteo.SPARSE_NAMES):
    # one feature's counts at a time, each file closed after its read: an open NpzFile per
    # unit would hold thousands of descriptors for plain Terabyte days (64 MiB units)
    got = [_npz_arrays(p, (f"k{f}", f"c{f}")) for p in files]
    keys = np.concatenate([z[f"k{f}"] for z in got] or [np.zeros(0, np.int32)])
    cnts = np.concatenate([z[f"c{f}"] for z in got] or [np.zeros(0, np.int64)])
    del got
    uniq, inv = np.unique(keys, return_inverse=True)
    total = np.bincount(inv, cnts, minlength=len(uniq)).astype(np.int64)
    kept = total >= min_count
    order = np.lexsort((uniq[kept], -total[kept]))      # by count down, then key
    ids = np.empty(int(kept.sum()), np.int32)
    ids[order] = 2 + np.arange(len(order), dtype=np.int32)
    np.savez(os.path.join(vocab_dir, f"{name}.npz"), keys=uniq[kept].astype(np.int32), ids=ids)
    rows.append(2 + len(ids))
  atomic_json(os.path.join(vocab_dir, "vocab.done"),
               {"fingerprint": fingerprint, "rows_per_feature": rows, "min_count": min_count})
  return rows
