"""SparseBatch: the one batch type every recommendation reader yields and every model eats.

Letters: B batch, Dn dense features, F sparse features, L ids per bag (padded), C distinct
bags (C_l per batch shard), F_d deduplicated features.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Protocol

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class DedupIds:
  """Some features of a batch in RecD's inverse-indexed form (arXiv 2211.05239): each batch
  shard's distinct bags of those features once, and each sample's bag
  (`rec.data.dedup.dedup_batch` builds it; the embedding collection's `dedup` option reads it).

  - features: the deduplicated features, indices into the batch's F (static)
  - ids [C, F_d, L] int32, lengths [C, F_d], weights [C, F_d, L] or None: the distinct bags;
    batch shard s (one per device of the batch axes) owns rows [s * C_l, (s + 1) * C_l),
    feature j's bags in column j, its unused rows empty bags
  - inverse [B, F_d] int32: sample b's bag of feature j, a row of its own shard's block
  """

  features: tuple[int, ...]
  ids: np.ndarray
  lengths: np.ndarray
  weights: np.ndarray | None
  inverse: np.ndarray

  def __post_init__(self):
    object.__setattr__(self, "features", tuple(int(f) for f in self.features))

  @property
  def capacity(self) -> int:
    """C: distinct-bag rows of all shards together."""
    return self.ids.shape[0]


jax.tree_util.register_dataclass(DedupIds, data_fields=["ids", "lengths", "weights", "inverse"],
                                 meta_fields=["features"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lookahead:
  """The next batch's ids [B, F, L] and lengths [B, F] (its bags, nothing else), carried by
  a batch so that its train step can bring the next step's rows into the host tier's device
  caches (`rec/data/lookahead.py`, `EmbeddingCollection.prefetch`)."""

  ids: np.ndarray
  lengths: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseBatch:
  """Dense features, multi-hot sparse ids with per-bag lengths, labels and an example mask.

  - dense:   [B, Dn] float32
  - ids:     [B, F, L] int32, row index into feature f's table; slots at or past
             `lengths[b, f]` are padding and never reach a pooled value
  - lengths: [B, F] int32, number of valid ids in each bag (0 <= len <= L)
  - labels:  [B] float32 in {0, 1}
  - mask:    [B] float32, 1 for a real example and 0 for padding (a last partial
             eval batch is padded to full size so shapes stay static)
  - weights: [B, F, L] float32 per-id weights, or None (all ones)
  - dedup:   DedupIds or None: RecD's distinct bags of some features and each sample's bag
             (the plain columns stay as they are, so dropping it gives the plain batch)
  - teacher: [B] float32 or None: an external teacher's logit per example, a label-like
             column the data augmentation step writes (ExFM, arXiv 2502.17494; rec/distill.py)
  - lookahead: Lookahead or None: the next batch's ids and lengths (`--host_prefetch`,
             rec/data/lookahead.py)
  """

  dense: np.ndarray
  ids: np.ndarray
  lengths: np.ndarray
  labels: np.ndarray
  mask: np.ndarray
  weights: np.ndarray | None = None
  dedup: DedupIds | None = None
  teacher: np.ndarray | None = None
  lookahead: Lookahead | None = None

  @property
  def batch_size(self) -> int:
    return self.labels.shape[0]

  @property
  def num_sparse(self) -> int:
    return self.ids.shape[1]

  @property
  def num_dense(self) -> int:
    return self.dense.shape[1]


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What a source yields: feature names and hashed row counts, in SparseBatch order."""

  num_dense: int
  sparse_features: tuple[str, ...]
  rows_per_feature: tuple[int, ...]
  max_ids_per_bag: int = 1

  def __post_init__(self):
    if len(self.sparse_features) != len(self.rows_per_feature):
      raise ValueError(
          f"DataSpec: {len(self.sparse_features)} sparse features but "
          f"{len(self.rows_per_feature)} row counts")


class BatchSource(Protocol):
  """A deterministic, restartable sequence of batches.

  `batches(start)` yields batch number `start`, `start + 1`, ... of the same
  sequence a fresh iteration would yield, so a resumed run sees the same data
  order. `num_batches` is the length of one epoch, or None when infinite.
  """

  spec: DataSpec
  batch_size: int

  @property
  def num_batches(self) -> int | None: ...

  def batches(self, start: int = 0) -> Iterator[SparseBatch]: ...


class WrappedSource:
  """A source around the BatchSource `src` (rec.data.workers.WorkerSource,
  rec.data.lookahead.LookaheadSource): its spec, batch size, batch count and any other
  attribute (bag_sizes, describe, ...) are `src`'s; a subclass makes the batches."""

  def __init__(self, src):
    self.src = src
    self.spec, self.batch_size = src.spec, src.batch_size

  def __getattr__(self, name: str) -> Any:
    if name == "src":   # not set yet (unpickling): no recursion into __getattr__
      raise AttributeError(name)
    return getattr(self.src, name)

  @property
  def num_batches(self) -> int | None:
    return self.src.num_batches
