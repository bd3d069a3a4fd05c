"""Packed training batches from a document stream (WLB-LLM, arXiv 2503.17924).

`PackedSource` is a resumable `LMBatch` source for `core.train`:
  documents   lengths from a long-tailed distribution (`lengths.CorpusLengths`, the Pile's
              shape, or `lengths.LengthDist`), drawn in blocks from (seed, block); document
              i's tokens are a span of the token array (a text's train part) at an offset
              drawn from (seed, block), so document i is the same in every run
  arrivals    the loader's next-fit into global batches of `batch_size` sequences of
              `seq_len` tokens (`packers.next_fit`): when each document arrives
  packing     "original" (the arrivals as they are), "fixed" (fixed-length greedy over
              windows of `fixed_window` global batches) or "wlb" (WLB-LLM's
              variable-length packing, micro-batches of at most `seq_len` tokens, with
              `wlb_queues` outlier queues); each micro-batch is one row
  CP layout   over `cp` ranks (`cp_shard.layout_batch`): "sequence" (the model's own
              2N-chunk balancing of the row), "document" (2N chunks of every document,
              rank r chunks r and 2N-1-r) or "adaptive" (the tile model's per-batch pick)
Batch k is a deterministic function of (seed, k): `batches(start)` replays the packers'
state (queues, carried documents) over the lengths alone up to `start`, then builds rows.
Rows carry segment ids and restarting positions (`batch.to_lm_batch`), so attention never
crosses documents. `step_metrics(host)` measures the attention work of a batch it yielded
(`meter.step_metrics`), with the CP layout picked for it. `from_run` builds the source an
`llm.run_config.LMRunConfig` trains on (train_lm --packing, wlb_packing's training grid).

Letters: B rows per global batch, T tokens per row.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

import numpy as np

from llm.data import LMBatch
from llm.packing import cp_shard, meter
from llm.packing import packers as P
from llm.packing.batch import to_lm_batch
from llm.packing.cost import CostModel
from llm.packing.lengths import CorpusLengths

PACKINGS = ("original", "fixed", "wlb")
LAYOUTS = ("sequence", "document", "adaptive")
_BLOCK = 4096   # documents drawn per (seed, block)


@dataclasses.dataclass(frozen=True)
class PackingSpec:
  """How a stream is packed and laid out; `outlier_fractions` are WLB's queue thresholds as
  fractions of seq_len, of which `wlb_queues` (the largest) are used."""

  packing: str = "wlb"
  layout: str = "sequence"
  fixed_window: int = 2
  wlb_queues: int = 2
  outlier_fractions: tuple[float, ...] = (0.125, 0.25, 0.5)

  def __post_init__(self):
    if self.packing not in PACKINGS:
      raise ValueError(f"PackingSpec: packing={self.packing!r}, expected one of {PACKINGS}")
    if self.layout not in LAYOUTS:
      raise ValueError(f"PackingSpec: layout={self.layout!r}, expected one of {LAYOUTS}")
    if self.fixed_window < 1:
      raise ValueError(f"PackingSpec: fixed_window={self.fixed_window}, expected >= 1")
    if not 0 <= self.wlb_queues <= len(self.outlier_fractions):
      raise ValueError(f"PackingSpec: wlb_queues={self.wlb_queues}, expected 0.."
                       f"{len(self.outlier_fractions)} (one per outlier fraction)")
    if any(not 0 < f <= 1 for f in self.outlier_fractions):
      raise ValueError(f"PackingSpec: outlier_fractions={self.outlier_fractions}, expected "
                       "fractions of seq_len in (0, 1]")

  def thresholds(self, seq_len: int) -> tuple[int, ...]:
    fr = sorted(self.outlier_fractions)[len(self.outlier_fractions) - self.wlb_queues:]
    thr = tuple(max(1, int(f * seq_len)) for f in fr)
    return tuple(sorted(set(thr)))


class PackedSource:
  """Global batches of packed rows, laid out for context parallelism (module docstring)."""

  def __init__(self, tokens: np.ndarray, lengths, spec: PackingSpec, *, seq_len: int,
               batch_size: int, cp: int = 1, cost: CostModel, n_layers: int = 1,
               seed: int = 0, model_balances: bool | None = None,
               tile_model: cp_shard.TileModel = cp_shard.TileModel(),
               shard_index: int = 0, num_shards: int = 1):
    tokens = np.asarray(tokens)
    if len(tokens) < seq_len + 1:
      raise ValueError(f"PackedSource: {len(tokens)} tokens to cut documents from, fewer than "
                       f"seq_len + 1 = {seq_len + 1}")
    if cp < 1 or seq_len % cp:
      raise ValueError(f"PackedSource: seq_len={seq_len} over cp={cp} ranks; expected a "
                       "multiple")
    if spec.layout != "sequence" and (cp == 1 or seq_len % (2 * cp)):
      raise ValueError(f"PackedSource: layout={spec.layout!r} needs cp > 1 ranks and seq_len "
                       f"a multiple of 2 * cp; got cp={cp}, seq_len={seq_len}")
    if num_shards < 1 or not 0 <= shard_index < num_shards or batch_size % num_shards:
      raise ValueError(f"PackedSource: shard {shard_index} of {num_shards} with batch_size="
                       f"{batch_size}: expected 0 <= shard < num_shards dividing the batch")
    self.tokens, self.dist, self.spec = tokens, lengths, spec
    self.seq_len, self.batch_size, self.cp, self.cost = seq_len, batch_size, cp, cost
    self.n_layers, self.seed, self.tile_model = n_layers, seed, tile_model
    self.model_balances = (cp > 1 and seq_len % (2 * cp) == 0) if model_balances is None \
        else model_balances
    self.shard_index, self.num_shards = shard_index, num_shards
    self._lengths = np.zeros(0, np.int64)
    self._starts = np.zeros(0, np.int64)
    self._layouts: dict[int, str] = {}
    self.records: list[dict[str, float]] = []

  # --------------------------------------------------------------------------- documents

  def _grow(self, n: int) -> None:
    while self._lengths.size < n:
      b = self._lengths.size // _BLOCK
      l = np.asarray(self.dist.sample(_BLOCK, [self.seed, b]), np.int64)
      bad = np.flatnonzero((l < 1) | (l > self.seq_len))
      if bad.size:
        raise ValueError(f"PackedSource: document {b * _BLOCK + bad[0]} has {l[bad[0]]} tokens;"
                         f" expected 1..seq_len={self.seq_len} (the length distribution's "
                         "context must not exceed seq_len)")
      rng = np.random.default_rng([self.seed, b, 1])
      starts = rng.integers(0, len(self.tokens) - l + 1)
      self._lengths = np.concatenate([self._lengths, l])
      self._starts = np.concatenate([self._starts, starts])

  def lengths_of(self, ids) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    if ids.size:
      self._grow(int(ids.max()) + 1)
    return self._lengths[ids] if ids.size else np.zeros(0, np.int64)

  def document(self, i: int) -> np.ndarray:
    """Document i's tokens."""
    self._grow(i + 1)
    s = int(self._starts[i])
    return self.tokens[s:s + int(self._lengths[i])]

  def _length_stream(self) -> Iterator[int]:
    for i in itertools.count():
      yield int(self.lengths_of([i])[0])

  # --------------------------------------------------------------------------- packing

  def steps(self) -> Iterator[list[list[int]]]:
    """The packed global batches, from step 0: B micro-batches of document ids each."""
    arrivals = P.next_fit(self._length_stream(), seq_len=self.seq_len,
                          micro_batches=self.batch_size)
    flat = lambda step: [i for mb in step for i in mb]
    sp = self.spec
    if sp.packing == "original":
      yield from arrivals
    elif sp.packing == "fixed":
      packer = P.FixedGreedyPacker(seq_len=self.seq_len, micro_batches=self.batch_size,
                                   window=sp.fixed_window, cost=self.cost)
      while True:
        ids = [i for step in itertools.islice(arrivals, sp.fixed_window) for i in flat(step)]
        yield from packer.pack_window(ids, self.lengths_of)
    else:
      packer = P.WLBPacker(micro_batches=self.batch_size, max_len=self.seq_len, cost=self.cost,
                           outlier_thresholds=sp.thresholds(self.seq_len))
      for step in arrivals:
        yield packer.pack(flat(step), self.lengths_of)

  def layout(self, batch: LMBatch) -> tuple[LMBatch, str]:
    """The global batch (natural order) laid out for CP, and the layout used."""
    if self.spec.layout == "sequence":
      return batch, "sequence"              # the model balances the row itself
    laid, _, mode = cp_shard.layout_batch(batch, self.cp, self.spec.layout,
                                          model_balances=self.model_balances,
                                          tile_model=self.tile_model)
    return laid, mode

  def global_batch(self, rows: list[list[int]]) -> tuple[LMBatch, str]:
    docs = {i: self.document(i) for row in rows for i in row}
    return self.layout(to_lm_batch(docs, rows, self.seq_len))

  def batches(self, start: int = 0) -> Iterator[LMBatch]:
    for rows in itertools.islice(self.steps(), start, None):
      batch, mode = self.global_batch(rows)
      if self.num_shards > 1:
        n = self.batch_size // self.num_shards
        sl = slice(self.shard_index * n, (self.shard_index + 1) * n)
        batch = LMBatch(*(np.asarray(getattr(batch, f.name))[sl]
                          for f in dataclasses.fields(LMBatch)))
      self._layouts[id(batch)] = mode
      if len(self._layouts) > 64:            # batches made but never measured (prefetch)
        self._layouts.pop(next(iter(self._layouts)))
      yield batch

  # --------------------------------------------------------------------------- measuring

  def step_metrics(self, host: LMBatch) -> dict[str, float]:
    """The attention work of a batch this source yielded, as the devices receive it
    (`meter.step_metrics`), and the layout picked for it (`layout_document` 1 for
    per-document); names prefixed `pack_`. Appends them to `records`."""
    work = meter.step_work(host.segment_ids, host.positions, self.cp,
                           model_balances=self.model_balances, cost=self.cost,
                           tile_model=self.tile_model if self.cp > 1 else None)
    out = meter.step_metrics(work, self.n_layers)
    out["layout_document"] = float(self._layouts.pop(id(host), None) == "document")
    out = {f"pack_{k}": v for k, v in out.items()}
    self.records.append(out)
    return out


# --cp_sharding's names of the CP layouts.
CP_SHARDINGS = {"seq": "sequence", "doc": "document", "adaptive": "adaptive"}


def from_run(run, tokens: np.ndarray, cp_ranks: int, *, n_layers: int, cost: CostModel,
             tile_model: cp_shard.TileModel | None = None, shard_index: int = 0,
             num_shards: int = 1) -> PackedSource:
  """The packed source of an LMRunConfig `run` (its data.packing section, seq_len,
  batch_size and seed) over documents cut from `tokens`: Pile-shaped lengths drawn at
  doc_context and scaled to seq_len (doc_context 0: drawn at seq_len), laid out over
  `cp_ranks`; `cost`: the workload model the meter times (llm.packing.cost), for an
  `n_layers` model; `tile_model`: default square tiles of cp_tile (0: 128 scaled like the
  documents)."""
  p, seq_len = run.data.packing, run.data.seq_len
  dist = (CorpusLengths(context=seq_len) if not p.doc_context else
          CorpusLengths(context=p.doc_context, scale=seq_len / p.doc_context))
  spec = PackingSpec(packing=p.packing, fixed_window=p.fixed_window, wlb_queues=p.wlb_queues,
                     layout=CP_SHARDINGS[p.cp_sharding])
  if tile_model is None:
    tile = p.cp_tile or max(1, round(128 * seq_len / (p.doc_context or seq_len)))
    tile_model = cp_shard.TileModel(tile, tile)
  return PackedSource(tokens, dist, spec, seq_len=seq_len, batch_size=run.train.batch_size,
                      cp=cp_ranks, cost=cost, n_layers=n_layers, seed=run.train.seed,
                      tile_model=tile_model, shard_index=shard_index, num_shards=num_shards)
