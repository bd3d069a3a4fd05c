"""Session-grouped click data for RecD (arXiv 2211.05239): user features repeat across the
samples of a session, as in the paper's training data (samples logged per user session).

`SessionSource` is `SyntheticCriteo` (rec/data/synthetic.py: Criteo's 13 dense and 26
sparse features, Zipf ids, a planted logistic signal) whose first `num_user` sparse features
are user features: bags of `user_bag` ids, the same for every sample of a session. Item
features stay one id per sample (`num_item` of them; by default the other 26 - num_user).
Sessions come in one of two forms:

- coin flips (`dup_rate`, the default, 0.75): each sample of a batch but the first starts a
  new session with probability 1 - dup_rate (the first always does), so session lengths are
  geometric with mean 1 / (1 - dup_rate) ("repeats") and a batch of B samples holds
  1 + Binomial(B - 1, 1 - dup_rate) sessions. The duplication rate of a user feature,
  1 - distinct bags / B, is then

      E = dup_rate * (B - 1) / B,    std = sqrt((B - 1) dup_rate (1 - dup_rate)) / B

  per batch (`expected_dup_rate`).
- fixed length (`session_len=S`, S dividing the batch): every S consecutive samples of a
  global batch form one session, so each batch holds B / S sessions and its duplication
  rate is 1 - 1 / S exactly, with no spread between batches (the controlled setting of a
  throughput sweep, experiments/recd).

Both hold up to chance equal bags of different sessions (of `user_bag` Zipf ids each: none
in practice once user_bag is a few ids). Labels are drawn from the planted logits of the
final ids (`SyntheticCriteo.true_logits`), so a session's samples share the user part of
their logit and a model learns as on `synthetic`.

Batch k is a pure function of (seed, split, k) (`batch(k)`, random access), so
`batches(start)` resumes exactly and `rec.data.workers.WorkerSource` can draw batches in
Grain worker processes. The `--data=sessions:dup=0.75` form (rec/data/sources.py) builds the
coin-flip form.

Letters: B batch, F sparse features, L ids per bag (padded to user_bag).
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import jax
import numpy as np

from rec.data import synthetic
from rec.data.batch import SparseBatch

NUM_SPARSE = 26


def expected_dup_rate(dup_rate: float, batch_size: int) -> tuple[float, float]:
  """(mean, std) of one batch's user-feature duplication rate, chance equal bags aside."""
  B = batch_size
  return dup_rate * (B - 1) / B, math.sqrt((B - 1) * dup_rate * (1.0 - dup_rate)) / B


def dup_rate_for_repeats(repeats: float) -> float:
  """The dup_rate whose sessions hold `repeats` samples on average (1 -> 0, 4 -> 0.75)."""
  if not repeats >= 1:
    raise ValueError(f"repeats={repeats!r}: expected a mean session length >= 1")
  return 1.0 - 1.0 / repeats


class SessionSource:
  """Criteo-shaped batches whose user features repeat across each session's samples."""

  def __init__(self, batch_size: int, rows_per_feature=100_000, dup_rate: float | None = None,
               num_user: int = 8, user_bag: int = 32, seed: int = 0, split: str = "train",
               num_batches: int | None = None, shard_index: int = 0, num_shards: int = 1,
               flag: str = "SessionSource", num_item: int | None = None,
               session_len: int | None = None, **synthetic_kw):
    if session_len is not None:
      if dup_rate is not None:
        raise ValueError(f"{flag}: dup={dup_rate!r} and session_len={session_len!r}; expected "
                         "one of them (coin-flip sessions of mean 1 / (1 - dup), or fixed "
                         "sessions of session_len samples)")
      if not (isinstance(session_len, (int, np.integer)) and session_len >= 1
              and batch_size % session_len == 0):
        raise ValueError(f"{flag}: session_len={session_len!r} for batch_size={batch_size}; "
                         "expected a session length >= 1 dividing the batch")
      dup_rate = 1.0 - 1.0 / int(session_len)
    elif dup_rate is None:
      dup_rate = 0.75
    if not (isinstance(dup_rate, (int, float)) and 0.0 <= dup_rate < 1.0):
      raise ValueError(f"{flag}: dup={dup_rate!r}; expected a duplication rate in [0, 1) "
                       "(the mean session length is 1 / (1 - dup))")
    items_ok = (1 <= num_user <= NUM_SPARSE if num_item is None
                else num_user >= 1 and num_item >= 0)
    if not items_ok or user_bag < 1:
      raise ValueError(f"{flag}: user={num_user}, user_bag={user_bag}, num_item={num_item}; "
                       f"expected 1..{NUM_SPARSE} user features (>= 1 with num_item >= 0 given) "
                       "and bags of >= 1 ids")
    if not 0 <= shard_index < num_shards or batch_size % num_shards:
      raise ValueError(f"{flag}: shard {shard_index} of {num_shards} for batch_size="
                       f"{batch_size}; expected 0 <= shard < shards dividing the batch")
    if synthetic_kw.get("multi_hot") is not None:
      raise ValueError(f"{flag}: multi_hot is set by the session form (user features: bags "
                       "of user_bag ids, items: one id)")
    self.dup_rate, self.num_user, self.user_bag = float(dup_rate), int(num_user), int(user_bag)
    self.session_len = None if session_len is None else int(session_len)
    self.num_item = NUM_SPARSE - self.num_user if num_item is None else int(num_item)
    bags = (self.user_bag,) * self.num_user + (1,) * self.num_item
    # The whole global batch is drawn and this process's rows cut out, so sessions (and the
    # global batches) do not depend on the process count.
    self._base = synthetic.SyntheticCriteo(batch_size, rows_per_feature, num_sparse=len(bags),
                                           seed=seed, split=split, num_batches=num_batches,
                                           multi_hot=bags, **synthetic_kw)
    self.spec = self._base.spec
    self.batch_size, self.split, self.seed = int(batch_size), split, int(seed)
    self.shard_index, self.num_shards = int(shard_index), int(num_shards)
    self.user_features = tuple(range(self.num_user))
    # Per table, the ids a bag holds: item tables read one slot, not the padded user_bag.
    self.bag_sizes = {name: n for name, n in zip(self.spec.sparse_features, bags)}

  @property
  def num_batches(self) -> int | None:
    return self._base.num_batches

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    stop = self.num_batches
    for k in (itertools.count(start) if stop is None else range(start, stop)):
      yield self.batch(k)

  def session_starts(self, k: int) -> np.ndarray:
    """[B] bool: which samples of global batch k start a session."""
    if self.session_len is not None:
      return np.arange(self.batch_size) % self.session_len == 0
    rng = np.random.default_rng([self.seed, synthetic.SPLITS[self.split], k, 0x5E55])
    starts = rng.random(self.batch_size) >= self.dup_rate
    starts[0] = True
    return starts

  def batch(self, k: int) -> SparseBatch:
    """Batch k (this process's rows of global batch k)."""
    base = self._base.batch(k)
    starts = self.session_starts(k)
    first_B = np.flatnonzero(starts)[np.cumsum(starts) - 1]   # each sample's session start
    ids = base.ids.copy()
    ids[:, :self.num_user] = ids[first_B, :self.num_user]
    rng = np.random.default_rng([self.seed, synthetic.SPLITS[self.split], k, 0x1AB])
    batch = SparseBatch(base.dense, ids, base.lengths, labels=None, mask=base.mask)
    p = 1.0 / (1.0 + np.exp(-self._base.true_logits(batch)))
    batch = SparseBatch(base.dense, ids, base.lengths,
                        (rng.random(self.batch_size) < p).astype(np.float32), base.mask)
    if self.num_shards == 1:
      return batch
    b = self.batch_size // self.num_shards
    rows = slice(self.shard_index * b, (self.shard_index + 1) * b)
    return jax.tree.map(lambda x: x[rows], batch)

  def true_logits(self, batch: SparseBatch) -> np.ndarray:
    """The logits [B] the labels of `batch` were drawn from (float64)."""
    return self._base.true_logits(batch)

  def describe(self) -> str:
    sessions = (f"fixed sessions of {self.session_len} samples" if self.session_len is not None
                else f"sessions of {1 / (1 - self.dup_rate):.2f} samples on average")
    return (f"sessions: {self.num_user} user features (bags of {self.user_bag} ids) repeat "
            f"over {sessions} (dup rate {self.dup_rate:g}), {self.num_item} one-id item "
            "features")
