"""RecD in-batch deduplication of sparse features (arXiv 2211.05239), the host side.

In a batch grouped by session, a user's features (the ids of the user's history, profile)
are the same for every sample of the session. RecD's inverse-keyed jagged tensor keeps each
distinct bag of such a feature once plus, per sample, the index of its bag: lookups and
pooling run on the distinct bags, and the pooled vectors are expanded to the samples
afterwards (a gather, whose gradient sums the samples' bag gradients per distinct bag).

  DedupSpec                 which features, how many distinct bags a batch shard may hold
                            (fixed, or 0: the next power of two that fits), and what a fixed
                            capacity's overflow does (the plain batch, or an error); parsed
                            once from the flags (`--dedup_features`, `--dedup_capacity`)
  dedup_batch(batch, ...)   a pure numpy function of one batch: the same batch with
                            `SparseBatch.dedup` (rec/data/batch.py DedupIds) attached
  DedupTransform            dedup_batch with its settings bound, for the input pipeline's
                            worker processes (rec/data/workers.py WorkerSource)
  duplication_rate(batch)   1 - distinct bags / bags

`dedup_batch` is pure so that it can run anywhere before the device: `RecTask.device_batch`
calls it for a batch that arrives without `dedup`; with `--data_workers` (rec.configs.build_run)
Grain's worker processes run it as `DedupTransform` and batches arrive carrying it. The device side is the embedding collection's `dedup` option
(rec/embedding/collection.py). Distinct bags are found per batch shard (the rows one device
of the batch axes receives), so the expansion back to samples needs no communication.
Bags are equal when their lengths, ids and weights up to the length are; equal bags pool
to equal vectors, so the deduplicated lookup gives every sample the vector the plain one
does.

Letters: B batch (B_l per shard), F features (F_d deduplicated), L ids per bag,
C distinct-bag rows (C_l per shard), N batch shards.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rec.data.batch import DedupIds, SparseBatch

OVERFLOW = ("fallback", "error")


class CapacityError(ValueError):
  """More distinct bags in a batch shard than the fixed capacity."""


@dataclasses.dataclass(frozen=True)
class DedupSpec:
  """RecD's setting: features looked up on their distinct bags, the capacity, overflow."""

  features: tuple[str, ...]       # table / feature names
  capacity: int = 0               # distinct bags per batch shard and feature; 0: automatic
  on_overflow: str = "fallback"   # a fixed capacity's overflow: fallback (plain batch) | error

  def __post_init__(self):
    object.__setattr__(self, "features", tuple(self.features))
    if not self.features or len(set(self.features)) != len(self.features):
      raise ValueError(f"dedup features {list(self.features)}: expected distinct feature names")
    if not isinstance(self.capacity, int) or self.capacity < 0:
      raise ValueError(f"dedup capacity {self.capacity!r}: expected an int >= 0 (0: the next "
                       "power of two that holds a batch's distinct bags)")
    if self.on_overflow not in OVERFLOW:
      raise ValueError(f"dedup on_overflow={self.on_overflow!r}: expected one of {OVERFLOW}")

  @classmethod
  def from_flags(cls, features: str | Sequence[str], capacity: int = 0,
                 on_overflow: str = "fallback", known: Sequence[str] | None = None,
                 flag: str = "--dedup_features") -> DedupSpec | None:
    """The spec of `--dedup_features=C1,C3` (None when empty); names outside `known` (the
    tables) are an error naming the flag."""
    names = [n.strip() for n in (features.split(",") if isinstance(features, str) else features)]
    names = [n for n in names if n]
    if not names:
      return None
    if known is not None:
      unknown = [n for n in names if n not in set(known)]
      if unknown:
        raise ValueError(f"{flag}={','.join(names)}: unknown features {unknown}; the tables "
                         f"are {list(known)}")
    try:
      return cls(tuple(names), capacity, on_overflow)
    except ValueError as e:
      raise ValueError(f"{flag}={','.join(names)}: {e}") from None


def _bag_keys(ids_BL, len_B, w_BL):
  """[B, K] int64 rows, equal iff the bags are (ids and weights past the length ignored)."""
  L = ids_BL.shape[1]
  live = np.arange(L)[None, :] < len_B[:, None]
  parts = [len_B[:, None].astype(np.int64), np.where(live, ids_BL, 0).astype(np.int64)]
  if w_BL is not None:
    w = np.where(live, w_BL, 0).astype(np.float32).view(np.int32).astype(np.int64)
    parts.append(w)
  return np.concatenate(parts, axis=1)


_HASH_MULT = np.random.default_rng(0x5EED).integers(1, 2**63, 4096, dtype=np.uint64) | np.uint64(1)


def _distinct(ids_BL, len_B, w_BL, num_shards):
  """Per shard the distinct bags: (first sample of each distinct bag, ordered by shard and
  then first occurrence [U], its shard [U], each sample's bag local to its shard [B],
  distinct bags per shard [N])."""
  B = ids_BL.shape[0]
  b = B // num_shards
  shard_B = np.arange(B) // b
  keys = np.concatenate([shard_B[:, None], _bag_keys(ids_BL, len_B, w_BL)], axis=1)
  # Rows hashed to 64 bits (a random linear form, wrapping) are sorted far faster than
  # the rows themselves; equal hashes are then checked to be equal rows, and the exact
  # row sort runs only if some are not (a collision).
  mult = _HASH_MULT[:keys.shape[1]] if keys.shape[1] <= len(_HASH_MULT) else None
  exact = mult is None
  if not exact:
    _, first_U, inv_B = np.unique((keys.astype(np.uint64) * mult).sum(axis=1),
                                  return_index=True, return_inverse=True)
    exact = not (keys[first_U[inv_B.reshape(-1)]] == keys).all()
  if exact:
    _, first_U, inv_B = np.unique(keys, axis=0, return_index=True, return_inverse=True)
  inv_B = inv_B.reshape(-1)
  shard_U = shard_B[first_U]
  order = np.lexsort((first_U, shard_U))
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  first_U, shard_U, inv_B = first_U[order], shard_U[order], rank[inv_B]
  counts_N = np.bincount(shard_U, minlength=num_shards)
  start_N = np.concatenate([[0], np.cumsum(counts_N)[:-1]])
  return first_U, shard_U, inv_B - start_N[shard_B], counts_N


def dedup_batch(batch: SparseBatch, features: Sequence[int], capacity: int = 0,
                num_shards: int = 1, on_overflow: str = "fallback",
                names: Sequence[str] | None = None) -> SparseBatch:
  """`batch` with the distinct bags of `features` (indices into F) per batch shard attached
  as `batch.dedup` (rec/data/batch.py DedupIds); its other fields are unchanged.

  `num_shards`: the batch shards of this batch (the devices of the batch axes that it
  feeds); each shard's bags are deduplicated on their own. `capacity`: distinct bags per
  shard and feature, C_l; 0 takes the smallest power of two that holds the batch's (at
  most B_l), so a run compiles one step per capacity it meets. A fixed capacity that some
  shard exceeds gives back `batch` unchanged (on_overflow="fallback": the plain path) or
  raises CapacityError naming the feature (by its name in `names`, the F feature names,
  when given), shard, count and capacity.
  """
  if on_overflow not in OVERFLOW:
    raise ValueError(f"dedup_batch: on_overflow={on_overflow!r}, expected one of {OVERFLOW}")
  ids, lengths = np.asarray(batch.ids), np.asarray(batch.lengths)
  B, F, L = ids.shape
  features = tuple(int(f) for f in features)
  if not features or any(not 0 <= f < F for f in features) or len(set(features)) != len(features):
    raise ValueError(f"dedup_batch: features {list(features)}, expected distinct indices in "
                     f"0..{F - 1}")
  if num_shards < 1 or B % num_shards:
    raise ValueError(f"dedup_batch: batch of {B} samples does not split into "
                     f"num_shards={num_shards} equal shards")
  if capacity < 0:
    raise ValueError(f"dedup_batch: capacity={capacity}, expected >= 0 (0: automatic)")
  b = B // num_shards
  weights = None if batch.weights is None else np.asarray(batch.weights, np.float32)
  found = []
  for f in features:
    found.append(_distinct(ids[:, f], lengths[:, f], None if weights is None else weights[:, f],
                           num_shards))
  most = max(int(c.max()) for *_, c in found)
  if capacity == 0:
    cap = min(b, 1 << max(0, most - 1).bit_length())
  else:
    cap = capacity
    if most > cap:
      j = next(j for j, (*_, c) in enumerate(found) if c.max() > cap)
      s = int(np.argmax(found[j][3]))
      if on_overflow == "error":
        f = features[j]
        raise CapacityError(
            f"dedup: feature {f if names is None else repr(names[f])} has "
            f"{int(found[j][3][s])} distinct bags in batch shard {s} ({b} samples), over the "
            f"capacity {cap}; raise the capacity "
            "(--dedup_capacity; 0: automatic) or let such batches fall back to the plain path")
      return batch
  Fd = len(features)
  out_ids = np.zeros((num_shards * cap, Fd, L), ids.dtype)
  out_len = np.zeros((num_shards * cap, Fd), lengths.dtype)
  out_w = None if weights is None else np.zeros((num_shards * cap, Fd, L), np.float32)
  inverse = np.zeros((B, Fd), np.int32)
  for j, (f, (first_U, shard_U, inv_B, counts_N)) in enumerate(zip(features, found)):
    start_N = np.concatenate([[0], np.cumsum(counts_N)[:-1]])
    row_U = shard_U * cap + (np.arange(len(first_U)) - start_N[shard_U])
    out_ids[row_U, j] = ids[first_U, f]
    out_len[row_U, j] = lengths[first_U, f]
    if out_w is not None:
      out_w[row_U, j] = weights[first_U, f]
    inverse[:, j] = inv_B
  return dataclasses.replace(batch, dedup=DedupIds(features, out_ids, out_len, out_w, inverse))


class DedupTransform:
  """`dedup_batch` with its settings bound: a picklable callable batch -> batch for an input
  pipeline's worker processes (rec/data/workers.py); `num_shards` must be the batch shards
  the train step's devices expect (`RecTask.dedup_shards()`)."""

  def __init__(self, features: Sequence[int], capacity: int = 0, num_shards: int = 1,
               on_overflow: str = "fallback", names: Sequence[str] | None = None):
    self.features, self.capacity = tuple(int(f) for f in features), int(capacity)
    self.num_shards, self.on_overflow = int(num_shards), on_overflow
    self.names = None if names is None else tuple(names)

  def __call__(self, batch: SparseBatch) -> SparseBatch:
    return dedup_batch(batch, self.features, self.capacity, self.num_shards, self.on_overflow,
                       self.names)

  def __repr__(self) -> str:
    return (f"DedupTransform(features={self.features}, capacity={self.capacity}, "
            f"num_shards={self.num_shards}, on_overflow={self.on_overflow!r})")


def duplication_rate(batch: SparseBatch, features: Sequence[int] | None = None) -> float:
  """1 - distinct bags / bags over the whole batch, of all features or `features`."""
  ids, lengths = np.asarray(batch.ids), np.asarray(batch.lengths)
  fs = list(range(ids.shape[1]) if features is None else features)
  w = None if batch.weights is None else np.asarray(batch.weights, np.float32)
  distinct = sum(len(np.unique(_bag_keys(ids[:, f], lengths[:, f], None if w is None else w[:, f]),
                               axis=0)) for f in fs)
  return 1.0 - distinct / (ids.shape[0] * len(fs))
