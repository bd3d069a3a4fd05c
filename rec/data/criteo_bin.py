"""Criteo click logs converted once into memory-mapped numpy shards, and a Grain reader of them.

`convert(src, dst)` turns Criteo Kaggle `train.txt` (+ `valid.txt`, `test.txt`) or Criteo 1TB
`day_0 .. day_23[.gz]` into columns per shard:

  dst/manifest.json                  written last (atomically): format, version, settings,
                                     columns and dtypes, rows per feature, splits -> shards
                                     with row counts, source files and sizes, bad lines
  dst/<split>/<unit>-<j>.dense.npy   float32 [N, 13], log1p(max(x, 0)) as the text reader
  dst/<split>/<unit>-<j>.sparse.npy  int32 [N, 26], row ids (0 = missing)
  dst/<split>/<unit>-<j>.label.npy   uint8 [N]
  dst/<split>/<unit>.done            a unit's completion marker (JSON, atomic): its shards

A unit is a byte range of about 64 MiB of a plain file, or a whole .gz file; units run in
worker processes, and a killed conversion resumes by skipping the units whose marker
carries the same settings. Lines are decoded by `criteo.parse_lines`, so validation and
file:line errors are the text reader's; `bad_lines="skip"` drops and counts them.

Ids: `ids="hash"` is the text reader's 1 + int(hex, 16) % (rows - 1). `ids="vocab"` is the
DLRM / TorchRec preprocessing: a counting pass over the train split, then per feature the
values seen at least `min_count` times get ids 2, 3, ... by decreasing count (ties by value),
every other value (and any value first seen in eval data) id 1, missing id 0. Vocabulary keys
are the 32-bit values reduced mod 2^31 - 1, so two values collide only when they differ by
exactly 2^31 - 1.

`CriteoBinSource` reads a split through Grain: a `MapDataset` whose element k is batch k of
this process (so `batches(start)` resumes exactly and Grain's iterator state checkpoints),
global shuffling of `block_rows`-row blocks reseeded every epoch, per-process shares of
every global batch, reads in Grain's thread pool. Opening checks every shard's files, shapes,
dtypes and settings against the manifest; every batch checks labels, ids and dense values.

Letters: N rows of a shard, B batch, Dn dense features (13), F sparse features (26).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from rec.data import criteo, stream
from rec.data.batch import DataSpec, SparseBatch

FORMAT = "criteo_bin"
VERSION = 1
UNIT_BYTES = 64 << 20
ROWS_PER_SHARD = 2_000_000
COLUMNS = {"dense": ("float32", criteo.NUM_DENSE), "sparse": ("int32", criteo.NUM_SPARSE),
           "label": ("uint8", None)}
_KEY_ROWS = 2**31      # vocab keys: 1 + value % (2^31 - 1), 0 = missing


# --- layout of the source directory -----------------------------------------------------------

def source_splits(src: str) -> dict[str, list[str]]:
  """{split: files}: Kaggle (train.txt, valid.txt, test.txt) or 1TB (day_0 .. day_22 train,
  day_23 test). A missing file is an error naming it."""
  from rec.data import sources
  train, evals = sources.criteo_files(f"criteo_bin source {src}", src)
  if os.path.basename(train[0]) == "train.txt":
    return {"train": train, "valid": evals[:1], "test": evals[1:]}
  return {"train": train, "test": evals}


@dataclasses.dataclass(frozen=True)
class Unit:
  split: str
  name: str            # <split>/<name>.done, <split>/<name>-<j>.*.npy
  path: str
  start: int           # byte range [start, end); whole file for .gz (end = -1)
  end: int


def plan_units(splits: dict[str, list[str]], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
  """Byte ranges of plain files, cut after a newline; whole .gz files."""
  units = []
  for split, files in splits.items():
    for path in files:
      stem = os.path.basename(path).replace(".", "_")
      if path.endswith(".gz"):
        units.append(Unit(split, stem, path, 0, -1))
        continue
      size = os.path.getsize(path)
      cuts = [0]
      with open(path, "rb") as f:
        while cuts[-1] + unit_bytes < size:
          f.seek(cuts[-1] + unit_bytes)
          f.readline()
          if f.tell() >= size:
            break
          cuts.append(f.tell())
      cuts.append(size)
      for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        if b > a:
          units.append(Unit(split, f"{stem}-{i:05d}", path, a, b))
  return units


def _unit_lines(u: Unit, chunk_bytes: int = 1 << 20) -> Iterator[tuple[int, list[bytes]]]:
  """(byte offset of the chunk's first line, lines) of a unit."""
  with stream.open_binary(u.path) as f:
    if u.end < 0:
      pos = 0
      while lines := f.readlines(chunk_bytes):
        yield pos, lines
        pos += sum(map(len, lines))
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
  """Yields (dense, ids, labels) per chunk of a unit; counts or raises on bad lines."""
  bad = 0
  for pos, lines in _unit_lines(u):
    parsed = criteo.parse_lines(lines, rows)
    if parsed.bad:
      if bad_lines == "error":
        i, msg = parsed.bad[0]
        line_no = _line_number(u.path, pos + sum(map(len, lines[:i])))
        raise ValueError(f"{u.path}:{line_no}: {msg}")
      bad += len(parsed.bad)
    yield parsed, bad


# --- conversion ------------------------------------------------------------------------------

def settings_fingerprint(settings: dict) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_json(path: str, obj) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def _save_npy(path: str, x: np.ndarray) -> None:
  tmp = f"{path}.tmp{os.getpid()}.npy"
  np.save(tmp, x)
  os.replace(tmp, path)


def _marker(dst: str, u: Unit) -> str:
  return os.path.join(dst, u.split, u.name + ".done")


def _read_marker(dst: str, u: Unit, fingerprint: str) -> dict | None:
  try:
    with open(_marker(dst, u)) as f:
      m = json.load(f)
  except (OSError, ValueError):
    return None
  return m if m.get("fingerprint") == fingerprint and m.get("version") == VERSION else None


def _count_unit(args) -> tuple[Unit, list[tuple[np.ndarray, np.ndarray]], int, int]:
  """Vocabulary counting pass over one unit: per feature (keys, counts)."""
  u, bad_lines = args
  parts: list[list[np.ndarray]] = [[] for _ in range(criteo.NUM_SPARSE)]
  bad = n = 0
  for parsed, bad in _parse_unit(u, [_KEY_ROWS] * criteo.NUM_SPARSE, bad_lines):
    n += len(parsed.labels)
    for f in range(criteo.NUM_SPARSE):
      parts[f].append(parsed.ids[:, f])
  counts = []
  for f in range(criteo.NUM_SPARSE):
    keys = np.concatenate(parts[f]) if parts[f] else np.zeros(0, np.int32)
    counts.append(np.unique(keys[keys > 0], return_counts=True))
  return u, counts, n, bad


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
    _save_npy(base + ".dense.npy", np.concatenate([b.dense for b in buf]))
    _save_npy(base + ".sparse.npy", np.concatenate([b.ids for b in buf]).astype(np.int32))
    _save_npy(base + ".label.npy", np.concatenate([b.labels for b in buf]).astype(np.uint8))
    shards.append({"name": name, "rows": n_buf})
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
  """A progress line on stderr: bytes done, rate, units, ETA."""

  def __init__(self, what: str, total_bytes: int, units: int):
    self.what, self.total, self.units = what, max(total_bytes, 1), units
    self.done = self.n = self.rows = 0
    self.t0 = time.perf_counter()

  def add(self, nbytes: int, rows: int) -> None:
    self.done += nbytes
    self.rows += rows
    self.n += 1
    dt = max(time.perf_counter() - self.t0, 1e-9)
    rate = self.done / dt
    eta = (self.total - self.done) / rate if rate > 0 else float("inf")
    end = "\n" if self.n == self.units else ""
    print(f"\r{self.what}: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB "
          f"({100 * self.done / self.total:.0f}%) | {rate / 2**20:.0f} MiB/s | "
          f"{self.rows / dt:,.0f} rows/s | units {self.n}/{self.units} | ETA {eta:.0f}s",
          end=end, file=sys.stderr, flush=True)


def _unit_bytes(u: Unit) -> int:
  return (os.path.getsize(u.path) if u.end < 0 else u.end - u.start)


def convert(src: str, dst: str, *, ids: str = "hash", num_rows: int | Sequence[int] = 100_000,
            min_count: int = 1, bad_lines: str = "error", workers: int | None = None,
            unit_bytes: int = UNIT_BYTES) -> dict:
  """Converts the Criteo files of `src` into shards under `dst`; returns the manifest.

  Resumable: units whose marker carries these settings are kept. See the module docstring.
  """
  if ids not in ("hash", "vocab"):
    raise ValueError(f"ids={ids!r}, expected 'hash' or 'vocab'")
  if bad_lines not in stream.BAD_LINE_MODES:
    raise ValueError(f"bad_lines={bad_lines!r}, expected one of {stream.BAD_LINE_MODES}")
  if ids == "vocab" and min_count < 1:
    raise ValueError(f"min_count={min_count}, expected >= 1")
  splits = source_splits(src)
  rows = list(stream.check_rows_per_feature(num_rows, criteo.SPARSE_NAMES, "criteo_bin"))
  sources_info = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p)}
                  for files in splits.values() for p in files]
  settings = {"format": FORMAT, "version": VERSION, "ids": ids, "bad_lines": bad_lines,
              "rows_per_feature": rows if ids == "hash" else None,
              "min_count": min_count if ids == "vocab" else None, "sources": sources_info}
  fingerprint = settings_fingerprint(settings)
  units = plan_units(splits, unit_bytes)
  for split in splits:
    os.makedirs(os.path.join(dst, split), exist_ok=True)
  workers = workers or max(1, min(len(units), os.cpu_count() or 1))
  ctx = multiprocessing.get_context("spawn")
  vocab_dir = os.path.join(dst, "vocab")
  with ctx.Pool(workers) as pool:
    if ids == "vocab":
      rows = _build_vocab(pool, [u for u in units if u.split == "train"], bad_lines, min_count,
                          vocab_dir, fingerprint)
      settings["rows_per_feature"] = rows
    todo = [u for u in units if _read_marker(dst, u, fingerprint) is None]
    progress = _Progress("convert", sum(_unit_bytes(u) for u in todo), len(todo))
    args = [(u, dst, settings, fingerprint, vocab_dir) for u in todo]
    by_name = {u.name: u for u in todo}
    for m in pool.imap_unordered(_convert_unit, args):
      progress.add(_unit_bytes(by_name[m["unit"]["name"]]), m["rows"])
  markers = [_read_marker(dst, u, fingerprint) for u in units]
  manifest = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "settings": settings, "rows_per_feature": rows,
              "columns": {k: {"dtype": d, "width": w} for k, (d, w) in COLUMNS.items()},
              "splits": {}, "sources": sources_info,
              "bad_lines_skipped": sum(m["bad_lines"] for m in markers)}
  for split in splits:
    shards = [dict(s, split=split) for u, m in zip(units, markers) if u.split == split
              for s in m["shards"]]
    manifest["splits"][split] = {"rows": sum(s["rows"] for s in shards), "shards": shards}
  _atomic_json(os.path.join(dst, "manifest.json"), manifest)
  return manifest


def _build_vocab(pool, units: list[Unit], bad_lines: str, min_count: int, vocab_dir: str,
                 fingerprint: str) -> list[int]:
  """The counting pass and the vocabularies (vocab_dir/C<i>.npz: sorted keys, their ids)."""
  os.makedirs(vocab_dir, exist_ok=True)
  done_path = os.path.join(vocab_dir, "vocab.done")
  try:
    with open(done_path) as f:
      done = json.load(f)
    if done.get("fingerprint") == fingerprint:
      return done["rows_per_feature"]
  except (OSError, ValueError):
    pass
  progress = _Progress("count", sum(_unit_bytes(u) for u in units), len(units))
  per_feature: list[list] = [[] for _ in range(criteo.NUM_SPARSE)]
  for u, counts, n, _ in pool.imap_unordered(_count_unit, [(u, bad_lines) for u in units]):
    progress.add(_unit_bytes(u), n)
    for f, kc in enumerate(counts):
      per_feature[f].append(kc)
  rows = []
  for f, name in enumerate(criteo.SPARSE_NAMES):
    keys = np.concatenate([k for k, _ in per_feature[f]] or [np.zeros(0, np.int32)])
    cnts = np.concatenate([c for _, c in per_feature[f]] or [np.zeros(0, np.int64)])
    uniq, inv = np.unique(keys, return_inverse=True)
    total = np.bincount(inv, cnts, minlength=len(uniq)).astype(np.int64)
    kept = total >= min_count
    order = np.lexsort((uniq[kept], -total[kept]))      # by count down, then key
    ids = np.empty(int(kept.sum()), np.int32)
    ids[order] = 2 + np.arange(len(order), dtype=np.int32)
    np.savez(os.path.join(vocab_dir, f"{name}.npz"), keys=uniq[kept].astype(np.int32), ids=ids)
    rows.append(2 + len(ids))
  _atomic_json(done_path, {"fingerprint": fingerprint, "rows_per_feature": rows})
  return rows


# --- reading ---------------------------------------------------------------------------------

def load_manifest(d: str) -> dict:
  path = os.path.join(d, "manifest.json")
  if not os.path.isfile(path):
    raise ValueError(f"{d!r} has no manifest.json: expected a directory written by "
                     "`python -m experiments.preprocess_criteo --dst=DIR` (a conversion that "
                     "did not finish writes none; run it again to resume)")
  with open(path) as f:
    m = json.load(f)
  if m.get("format") != FORMAT or m.get("version") != VERSION:
    raise ValueError(f"{path}: format {m.get('format')!r} version {m.get('version')!r}, expected "
                     f"{FORMAT!r} version {VERSION}: convert the data again with this code")
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
  """

  def __init__(self, d: str, split: str | Sequence[str], batch_size: int, *, shuffle: bool = True,
               repeat: bool = True, seed: int = 0, block_rows: int | None = None,
               shard_index: int = 0,
               num_shards: int = 1, num_threads: int = 4, prefetch: int = 8,
               num_workers: int = 0, num_rows: int | Sequence[int] | None = None):
    import grain
    m = load_manifest(d)
    splits = (split,) if isinstance(split, str) else tuple(split)
    self.dir, self.split, self.manifest = d, splits, m
    for sp in splits:
      if sp not in m["splits"]:
        raise ValueError(f"{d}/manifest.json has no split {sp!r}; it has {sorted(m['splits'])}")
    rows = tuple(m["rows_per_feature"])
    if num_rows is not None and tuple(stream.check_rows_per_feature(
        num_rows, criteo.SPARSE_NAMES, "criteo_bin")) != rows:
      raise ValueError(f"{d}: converted with rows per feature {rows[:3]}...; --num_rows="
                       f"{num_rows} differs (convert again, or leave --num_rows at the "
                       "converted value)")
    self.spec = DataSpec(num_dense=criteo.NUM_DENSE, sparse_features=criteo.SPARSE_NAMES,
                         rows_per_feature=rows, max_ids_per_bag=1)
    self._rows_F = np.asarray(rows, np.int64)
    if batch_size % num_shards:
      raise ValueError(f"batch_size={batch_size} is not divisible by num_shards={num_shards}")
    self.batch_size, self.local = batch_size, batch_size // num_shards
    if block_rows is None:
      block_rows = 256
      while block_rows > 1 and (self.local % block_rows or self.local // block_rows < 8):
        block_rows //= 2
    self._lengths = np.ones((self.local, criteo.NUM_SPARSE), np.int32)
    self._lengths.flags.writeable = False   # shared by every batch (Criteo bags hold one id)
    self.shard_index, self.num_shards = shard_index, num_shards
    self.shuffle, self.repeat, self.seed, self.block_rows = shuffle, repeat, seed, block_rows
    self.shards = [self._open(sp, s, m["fingerprint"]) for sp in splits
                   for s in m["splits"][sp]["shards"]]
    self.num_examples = sum(len(s[2]) for s in self.shards)
    if shuffle:
      if self.local % block_rows:
        raise ValueError(f"per-process batch {self.local} is not a multiple of block_rows="
                         f"{block_rows}")
      self._block_shard = np.concatenate(
          [np.full(len(s[2]) // block_rows, i, np.int32) for i, s in enumerate(self.shards)])
      self._block_start = np.concatenate(
          [np.arange(len(s[2]) // block_rows, dtype=np.int64) * block_rows for s in self.shards])
      n_blocks = len(self._block_shard)
      per_batch = batch_size // block_rows
      if n_blocks < per_batch:
        raise ValueError(f"{d} split {'+'.join(splits)}: {n_blocks} blocks of {block_rows} rows, fewer than "
                         f"one batch of {batch_size}")
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

  def _open(self, split: str, s: dict, fingerprint: str):
    base = os.path.join(self.dir, split, s["name"])
    marker = os.path.join(self.dir, split, s["name"].rsplit("-", 1)[0] + ".done")
    try:
      with open(marker) as f:
        mk = json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f"{marker}: shard marker unreadable ({e}); expected the marker of the "
                       "conversion that wrote manifest.json") from None
    if mk.get("fingerprint") != fingerprint or mk.get("version") != VERSION:
      raise ValueError(f"{marker}: written by another conversion (settings {mk.get('fingerprint')}"
                       f", version {mk.get('version')}); manifest.json expects {fingerprint}, "
                       f"version {VERSION}")
    out = []
    for col, (dtype, width) in COLUMNS.items():
      path = f"{base}.{col}.npy"
      shape = (s["rows"],) if width is None else (s["rows"], width)
      try:
        x = np.load(path, mmap_mode="r")
      except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable or truncated ({e}); expected {dtype} {shape} as "
                         "manifest.json says") from None
      if x.shape != shape or x.dtype != np.dtype(dtype):
        raise ValueError(f"{path}: {x.dtype} {x.shape}, expected {dtype} {shape} as "
                         "manifest.json says (a shard from another conversion?)")
      out.append(x.view(np.ndarray))   # slicing a plain view skips memmap's Python hooks
    return (base, *out)

  def _check(self, b: SparseBatch, where) -> SparseBatch:
    """Labels in {0, 1}, ids in [0, rows), dense finite and >= 0; else names the shard row."""
    ids = b.ids[:, :, 0]
    # Whole-batch reductions first (cheap); the per-row search only when one fails. NaN
    # propagates through min, so `not (min >= 0)` also catches NaN dense values.
    if (b.labels.max(initial=0) <= 1 and ids.min(initial=0) >= 0
        and (ids.max(0, initial=0) < self._rows_F).all() and b.dense.min(initial=0) >= 0):
      return b
    bad = b.labels > 1
    bad |= (b.ids[:, :, 0] >= self._rows_F).any(1) | (b.ids[:, :, 0] < 0).any(1)
    bad |= ~(b.dense >= 0).all(1)  # NaN fails too
    if bad.any():
      i = int(np.argmax(bad))
      base, row = where(i)
      raise ValueError(f"{base}.*.npy row {row}: label {b.labels[i]}, ids out of rows "
                       f"{np.flatnonzero(b.ids[i, :, 0] >= self._rows_F).tolist()} or dense "
                       f"{b.dense[i].tolist()}: corrupt shard (expected labels 0/1, ids below "
                       "the manifest's rows, finite dense >= 0)")
    return b

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
  converted directory (one unit per split, shards of ROWS_PER_SHARD rows), for benchmarks
  and tests that need a directory without text files."""
  rows = list(rows_per_feature)
  settings = {"format": FORMAT, "version": VERSION, "ids": "arrays", "rows_per_feature": rows}
  fingerprint = settings_fingerprint(settings)
  manifest = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "settings": settings, "rows_per_feature": rows,
              "columns": {k: {"dtype": d, "width": w} for k, (d, w) in COLUMNS.items()},
              "splits": {}, "sources": [], "bad_lines_skipped": 0}
  for split, (dense, ids, labels) in splits.items():
    os.makedirs(os.path.join(dst, split), exist_ok=True)
    shards = []
    for j, a in enumerate(range(0, len(labels), ROWS_PER_SHARD)):
      name = f"arrays-{j:04d}"
      b = slice(a, a + ROWS_PER_SHARD)
      base = os.path.join(dst, split, name)
      _save_npy(base + ".dense.npy", np.asarray(dense[b], np.float32))
      _save_npy(base + ".sparse.npy", np.asarray(ids[b], np.int32))
      _save_npy(base + ".label.npy", np.asarray(labels[b], np.uint8))
      shards.append({"name": name, "rows": len(labels[b])})
    _atomic_json(os.path.join(dst, split, "arrays.done"),
                 {"version": VERSION, "fingerprint": fingerprint, "shards": shards})
    manifest["splits"][split] = {"rows": len(labels), "shards": shards}
  _atomic_json(os.path.join(dst, "manifest.json"), manifest)
  return manifest
