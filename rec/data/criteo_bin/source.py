"""CriteoBinSource: batches of a converted Criteo directory (`format`) through Grain.

A `MapDataset` whose element k is batch k of this process (so `batches(start)` resumes
exactly and Grain's iterator state checkpoints), global shuffling of `block_rows`-row
blocks reseeded every epoch, per-process shares of every global batch, reads in Grain's
thread pool or worker processes. Opening checks every shard's files, shapes, dtypes,
settings and (`verify=True`, the default) CRC-32 against its marker, so a changed byte
anywhere in any split stops the run before its first step; every batch checks labels, ids
and dense values and names the file, row, column and value of a bad one.

Letters: B batch, Dn dense features (13), F sparse features (26).
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import math
import os
from typing import Iterator, Sequence

import numpy as np

from core.errors import UserError
from rec.data import criteo, stream
from rec.data.batch import DataSpec, SparseBatch
from rec.data.criteo_bin.format import COLUMNS, VERSION, file_crc32, load_manifest


class EpochShuffle:
  """Element i of a repeated range(n) -> block index: epoch i // n's permutation of
  range(n) at i % n, reseeded every epoch. Grain's `index_shuffle` with the epoch's seed
  (seed + epoch, as `MapDataset.shuffle` draws it, so orders match `shuffle().repeat()`),
  except where its max_index is a power of two from 2^16 on: there it is not a permutation
  (grain 0.2.18: 2^16 + 1, 2^18 + 1, 2^20 + 1 and 2^22 + 1 elements each see one index twice
  and miss one), so those lengths shuffle over n + 1 and walk past the index n (cycle
  walking: a permutation of range(n + 1) restricted to range(n) stays one)."""

  def __init__(self, n: int, seed: int):
    self.n, self.seed = int(n), int(seed)
    m1 = self.n - 1
    self.max_index = m1 + 1 if m1 >= 1 << 16 and m1 & (m1 - 1) == 0 else m1

  def __call__(self, i: int, element=None) -> int:
    from grain.experimental import index_shuffle
    epoch, j = divmod(int(i), self.n)
    seed = (self.seed + epoch) % 2**32
    while True:
      j = index_shuffle(j, max_index=self.max_index, seed=seed, rounds=4)
      if j < self.n:
        return j


def _map_columns(base: str, rows: int) -> list[np.ndarray]:
  """The column files of shard `base` memory-mapped, each checked for `rows` rows and its
  dtype and width."""
  out = []
  for col, (dtype, width) in COLUMNS.items():
    path = f"{base}.{col}.npy"
    shape = (rows,) if width is None else (rows, width)
    try:
      x = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
      if isinstance(e, OSError) and e.errno == errno.EMFILE:
        raise   # not the file's fault; `_allow_open_files` says how many are needed
      raise UserError(f"{path}: unreadable or truncated ({e}); expected {dtype} {shape} as "
                      "manifest.json says") from None
    if x.shape != shape or x.dtype != np.dtype(dtype):
      raise UserError(f"{path}: {x.dtype} {x.shape}; expected {dtype} {shape} as "
                      "manifest.json says (a shard from another conversion?)")
    out.append(x.view(np.ndarray))   # slicing a plain view skips memmap's Python hooks
  return out


# descriptors kept free for everything else a process opens (sockets, checkpoints, logs):
# wanted, and the least that must be left
_SPARE_FILES, _MIN_SPARE_FILES = 1024, 64


def _allow_open_files(n: int, what: str) -> None:
  """Makes room for `n` more memory-mapped files: every map holds a file descriptor (3 per
  shard, thousands for Criteo Terabyte, above the usual soft limit of 1,024). Raises the
  soft limit up to the hard one when needed (children started later inherit it); a hard
  limit too low for them is a UserError saying how many are needed."""
  try:
    import resource
  except ImportError:   # not a Unix: no such limit to raise
    return
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  try:
    in_use = len(os.listdir("/proc/self/fd"))
  except OSError:
    in_use = 0
  want = in_use + n + _SPARE_FILES
  if soft == resource.RLIM_INFINITY or want <= soft:
    return
  need = in_use + n + _MIN_SPARE_FILES
  if hard != resource.RLIM_INFINITY and need > hard:
    raise UserError(f"{what}: {n:,} column files to map, each holding an open file, with "
                    f"{in_use:,} open already; expected an open-file limit of at least {need:,} "
                    f"(`ulimit -n {need}` before the run), the hard limit is {hard:,}")
  resource.setrlimit(resource.RLIMIT_NOFILE,
                     (want if hard == resource.RLIM_INFINITY else min(hard, want), hard))


class CriteoBinSource:
  """Batches of one split of a converted directory, read through a Grain MapDataset.

  Train (`shuffle=True, repeat=True`): blocks of `block_rows` consecutive rows (within a
  shard; a shard's last partial block is left out) in a global order reshuffled every epoch
  (`EpochShuffle`); global batch k is blocks [k*n, (k+1)*n) of that order, n = batch_size /
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
    big = [(n, r) for n, r in zip(criteo.SPARSE_NAMES, rows) if r > stream.MAX_TABLE_ROWS]
    if big:   # written before convert refused them: no run can train such a table
      raise UserError(f"{d}/manifest.json: rows per feature {big[0][0]} = {big[0][1]:,}; "
                      f"expected at most 2^31 - 2 = {stream.MAX_TABLE_ROWS:,} (a run's ids "
                      "and a table's padding id are int32): convert again with a smaller "
                      "--num_rows")
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
    _allow_open_files(len(COLUMNS) * len(listed), f"{d} split {'+'.join(splits)}")
    self.shards = [self._open(sp, s, m["fingerprint"]) for sp, s in listed]
    if verify:
      self._verify(listed)
    self.num_examples = sum(len(s[2]) for s in self.shards)
    if shuffle:
      if self.local % block_rows:
        raise UserError(f"per-process batch {self.local} is not a multiple of block_rows="
                        f"{block_rows}")
      self._block_shard, self._block_start = self._blocks()
      n_blocks = len(self._block_shard)
      per_batch = batch_size // block_rows
      if n_blocks < per_batch:
        raise UserError(f"{d} split {'+'.join(splits)}: {n_blocks} blocks of {block_rows} rows; "
                        f"expected at least one batch of {batch_size}")
      order = grain.MapDataset.range(n_blocks)
      order = (order.repeat() if repeat else order).map_with_index(
          EpochShuffle(n_blocks, seed))
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

  def __getstate__(self) -> dict:
    # Grain's worker processes receive this source pickled (mp_prefetch, WorkerSource): the
    # column maps travel as their file names, not as a copy of every shard's data, and the
    # block tables are rebuilt there
    state = self.__dict__.copy()
    state["shards"] = [(s[0], len(s[3])) for s in self.shards]
    state.pop("_block_shard", None)
    state.pop("_block_start", None)
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    _allow_open_files(len(COLUMNS) * len(self.shards), f"{self.dir} split {'+'.join(self.split)}")
    self.shards = [(base, *_map_columns(base, rows)) for base, rows in self.shards]
    if self.shuffle:
      self._block_shard, self._block_start = self._blocks()

  def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
    """(shard, first row) of every whole block of `block_rows` rows, shard by shard."""
    R = self.block_rows
    return (np.concatenate([np.zeros(0, np.int32)] + [np.full(len(s[3]) // R, i, np.int32)
                                                      for i, s in enumerate(self.shards)]),
            np.concatenate([np.zeros(0, np.int64)] + [np.arange(len(s[3]) // R, dtype=np.int64) * R
                                                      for s in self.shards]))

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
    return (base, *_map_columns(base, s["rows"]))

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
