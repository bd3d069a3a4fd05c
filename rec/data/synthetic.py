"""Synthetic Criteo-shaped click data with a planted, learnable signal, for tests and benchmarks.

Sparse ids follow a bounded Zipf law per feature (rank r has probability ∝ (r+1)^-alpha)
whose ranks are scattered over the table by a fixed pseudo-random permutation (rank ->
(a * rank + b) mod rows, a coprime to rows: no memory for any table size), so hot rows are
spread over row-wise shards as in real logs. Dense features are log1p of log-normal
counts, like the Criteo reader's output. Labels: Bernoulli(sigmoid(logit)) with

    logit = scale * (sqrt(0.7) * std(sum_f w_f[id_f]) + sqrt(0.3) * std(dense · w_d)) + bias

where w_f are hidden per-row weights (a hash of seed, feature and row, so any table size
costs no memory), w_d a hidden dense weight vector, std(.) standardizes over a calibration
sample, and `bias` is set so that about 25% of labels are 1. With the defaults the
Bayes-optimal AUC (of the true logits) is 0.83, and a logistic regression trained with
Adagrad on the train split reaches a test AUC of 0.77 after 300 batches of 2048 and 0.79
after 1000: most of the signal sits on hot rows, which a model sees often.

`multi_hot=(L_1, ..., L_F)` gives feature f bags of exactly L_f ids, each drawn from the
same Zipf law (as the MLPerf DLRM-DCNv2 benchmark's multi-hot Criteo 1TB: fixed bag sizes
per feature, `MLPERF_MULTI_HOT`); a bag's hidden weight is the mean of its rows' weights
(its latent, for the deep teacher), so one-hot data is the case L_f = 1 and unchanged.
Bags are padded to L = max(L_f) with id 0 past their length.

`teacher="deep"` replaces the sum of per-row weights by a hidden network with planted
high-order interactions (for capacity and scaling studies, e.g. experiments.wukong_scaling):
each row carries a hidden latent vector u_f[id] (K_LAT values, a hash of seed, feature, row
and component), and the sparse score is a random two-hidden-layer tanh network of the
concatenated latents plus third-order products u_f1 * u_f2 * u_f3 over random feature
triples. Such a score is not a sum of per-feature terms, so a model gains from capacity
that can represent interactions; the Bayes-optimal AUC is reported by `bayes_auc()`.

Batch k is a pure function of (seed, split, k), so `batches(start)` resumes exactly and the
train and test splits are different draws of the same hidden model.

Letters: B batch, Dn dense features, F sparse features, L ids per bag (padded), K latent
components.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Iterator, Sequence

import jax
import numpy as np

from rec.data.batch import DataSpec, SparseBatch

SPLITS = {"train": 0, "test": 1}
BASE_RATE = 0.25
LOGIT_SCALE = 1.6       # std of the logit before the bias (see the module docstring)
SPARSE_SHARE = 0.7      # share of the logit variance carried by the sparse ids
_EXACT_HEAD = 1024      # ranks below this come from the exact discrete CDF; later ones (relative
                        # error of their mass ~a(a+1)/(24 r^2) < 3e-7) from the continuous one
_GUIDE = 8 * _EXACT_HEAD
K_LAT = 4               # latent components per row of the deep teacher
TEACHER_WIDTH = 64      # hidden width of the deep teacher's tanh network
NUM_TRIPLES = 16        # planted third-order products of the deep teacher
# Bag sizes of the MLPerf Training DLRM-DCNv2 benchmark's 26 multi-hot features (Criteo 1TB).
MLPERF_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3,
                    1, 1)


@functools.lru_cache(maxsize=64)
def _zipf_table(num_rows: int, alpha: float) -> tuple[np.ndarray, np.ndarray, float, float]:
  """(cumulative weights of the exact head ranks + an inf sentinel, guide table, head mass,
  tail mass) of bounded Zipf.

  Ranks past the head get the mass of x^-alpha integrated over [r + 0.5, r + 1.5) (0-based
  r), the midpoint rule that matches r^-alpha to ~a(a+1)/(24 r^2) that far out. The guide
  table (Chen & Asau's indexed search) holds, for each of G equal slices of the head mass,
  the first rank whose cumulative weight passes the slice's start, so a draw needs a few
  forward steps instead of a binary search.
  """
  head = min(num_rows, _EXACT_HEAD)
  cum = np.cumsum(np.arange(1, head + 1, dtype=np.float64) ** -alpha)
  head_mass = float(cum[-1])
  tail = 0.0
  if num_rows > head:
    tail = _antideriv(num_rows + 0.5, alpha) - _antideriv(head + 0.5, alpha)
  guide = np.searchsorted(cum, np.arange(_GUIDE) * (head_mass / _GUIDE), side="right")
  return np.append(cum, np.inf), guide, head_mass, float(tail)


def _antideriv(x, alpha: float):
  return np.log(x) if alpha == 1.0 else x ** (1.0 - alpha) / (1.0 - alpha)


def _antideriv_inv(y, alpha: float):
  return np.exp(y) if alpha == 1.0 else ((1.0 - alpha) * y) ** (1.0 / (1.0 - alpha))


def zipf_ranks(rng: np.random.Generator, num_rows: int, size, alpha: float) -> np.ndarray:
  """Ranks in [0, num_rows), rank r drawn with probability ∝ (r + 1)^-alpha (inverse CDF)."""
  if num_rows < 1 or alpha < 0:
    raise ValueError(f"zipf_ranks: num_rows={num_rows}, alpha={alpha}; expected >= 1 and >= 0")
  cum, guide, head_mass, tail_mass = _zipf_table(int(num_rows), float(alpha))
  u = rng.random(size) * (head_mass + tail_mass)
  ranks = guide[np.minimum((u * (_GUIDE / head_mass)).astype(np.int64), _GUIDE - 1)]
  while True:  # step to the first rank whose cumulative weight exceeds u
    step = cum[ranks] <= u
    if not step.any():
      break
    ranks += step
  head = len(cum) - 1
  if tail_mass > 0:
    in_tail = ranks == head  # only draws past the head mass stop on the sentinel
    if in_tail.any():
      x = _antideriv_inv(_antideriv(head + 0.5, alpha) + (u[in_tail] - head_mass), alpha)
      ranks[in_tail] = np.clip(np.floor(x - 0.5).astype(np.int64), head, num_rows - 1)
  return np.minimum(ranks, num_rows - 1)


def row_permutation(num_rows: int, seed: int) -> tuple[int, int]:
  """(a, b) of the fixed permutation rank -> (a * rank + b) % num_rows, a coprime to num_rows."""
  rng = np.random.default_rng([seed, 7, num_rows])
  if num_rows <= 2:
    return 1, 0
  while True:
    a = int(rng.integers(1, num_rows))
    if math.gcd(a, num_rows) == 1:
      return a, int(rng.integers(0, num_rows))


def zipf_ids(rng: np.random.Generator, num_rows: int, size, alpha: float = 1.05,
             perm_seed: int | None = 0) -> np.ndarray:
  """Zipf-distributed ids in [0, num_rows) as int32, hot ranks scattered by `perm_seed`.

  perm_seed=None returns the ranks themselves (row 0 hottest).
  """
  ranks = zipf_ranks(rng, num_rows, size, alpha)
  if perm_seed is not None:
    a, b = row_permutation(num_rows, perm_seed)
    ranks = (ranks * a + b) % num_rows
  return ranks.astype(np.int32)


def _hash_uniform(salt_F: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """A uniform [-1, 1) value per (salt, id) from SplitMix64; salt_F broadcasts over ids."""
  x = salt_F.astype(np.uint64) ^ (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  x = x ^ (x >> np.uint64(31))
  return (x >> np.uint64(11)).astype(np.float64) * (2.0 ** -52) - 1.0


def check_multi_hot(multi_hot, num_sparse: int, what: str) -> tuple[int, ...]:
  """Bag sizes per feature as a tuple (None: all 1); each an int >= 1, one per feature."""
  if multi_hot is None:
    return (1,) * num_sparse
  sizes = tuple(multi_hot)
  if len(sizes) != num_sparse or any(
      isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in sizes):
    raise ValueError(f"{what}: multi_hot={multi_hot!r}, expected {num_sparse} ints >= 1 (one "
                     "bag size per sparse feature)")
  return tuple(int(x) for x in sizes)


class SyntheticCriteo:
  """Criteo-shaped batches (dense log-counts, Zipf ids in one-hot or fixed-size multi-hot
  bags) with a planted logistic signal.

  Shards (one per process) share the hidden model and the batch stream: shard i of n
  yields rows [i * b, (i + 1) * b) of each global batch of `batch_size` rows (b =
  batch_size / n), so the global batches are the same for every process count.
  """

  def __init__(self, batch_size: int, rows_per_feature: int | Sequence[int] = 100_000,
               num_dense: int = 13, num_sparse: int = 26, zipf_alpha: float = 1.05,
               seed: int = 0, split: str = "train", num_batches: int | None = None,
               shard_index: int = 0, num_shards: int = 1, teacher: str = "linear",
               logit_scale: float = LOGIT_SCALE, multi_hot: Sequence[int] | None = None):
    if teacher not in ("linear", "deep"):
      raise ValueError(f"SyntheticCriteo: teacher={teacher!r}, expected 'linear' or 'deep'")
    if isinstance(rows_per_feature, (int, np.integer)):
      rows_per_feature = [int(rows_per_feature)] * num_sparse
    rows = tuple(int(r) for r in rows_per_feature)
    if len(rows) != num_sparse or any(not 1 <= r < 2**31 for r in rows):
      raise ValueError(f"SyntheticCriteo: rows_per_feature={rows_per_feature!r}, expected one int "
                       f"or {num_sparse} ints in [1, 2**31)")
    if split not in SPLITS:
      raise ValueError(f"SyntheticCriteo: split={split!r}, expected one of {tuple(SPLITS)}")
    if batch_size < 1 or num_dense < 0 or num_sparse < 0 or zipf_alpha < 0:
      raise ValueError(f"SyntheticCriteo: batch_size={batch_size}, num_dense={num_dense}, "
                       f"num_sparse={num_sparse}, zipf_alpha={zipf_alpha}; expected >= 1, >= 0, "
                       ">= 0, >= 0")
    if not 0 <= shard_index < num_shards:
      raise ValueError(f"SyntheticCriteo: shard_index={shard_index}, expected in [0, {num_shards})")
    if batch_size % num_shards:
      raise ValueError(f"SyntheticCriteo: batch_size={batch_size} is not divisible by "
                       f"num_shards={num_shards}")
    if num_batches is not None and num_batches < 0:
      raise ValueError(f"SyntheticCriteo: num_batches={num_batches}, expected None or >= 0")
    self.multi_hot = check_multi_hot(multi_hot, num_sparse, "SyntheticCriteo")
    self.batch_size = int(batch_size)
    L = max(self.multi_hot, default=1)
    self.spec = DataSpec(num_dense=num_dense,
                         sparse_features=tuple(f"C{i + 1}" for i in range(num_sparse)),
                         rows_per_feature=rows, max_ids_per_bag=L)
    self._bag_F = np.array(self.multi_hot, np.int64)
    self._live_FL = np.arange(L)[None, :] < self._bag_F[:, None]
    # The live (feature, slot) pairs of a padded [B, F, L] bag array: multi-hot bags of
    # unequal sizes (MLPerf's: 1 to 100 ids) leave most of it padding, which draws and
    # hashes skip (None: every slot live, the arrays are used whole).
    self._live = None if self._live_FL.all() else np.nonzero(self._live_FL)
    # Per table, the ids its bags hold, where sizes differ: the embedding collection then
    # reads L_f slots of table f, not the padded L (`EmbeddingCollection(bag_sizes=...)`;
    # MLPerf's sizes sum to 214 ids per example, padded to 26 x 100).
    self.bag_sizes = ({} if self._live is None else
                      dict(zip(self.spec.sparse_features, map(int, self.multi_hot))))
    self.alpha = float(zipf_alpha)
    self.seed = int(seed)
    self.split = split
    self._num_batches = num_batches
    self.shard_index, self.num_shards = int(shard_index), int(num_shards)

    # The hidden model: a function of the seed only, shared by both splits.
    rng = np.random.default_rng([self.seed, 1000])
    self._rows_F = np.array(rows, np.int64)
    perms = [row_permutation(r, self.seed * 1_000_003 + f) for f, r in enumerate(rows)]
    self._perm_a_F = np.array([p[0] for p in perms], np.int64)
    self._perm_b_F = np.array([p[1] for p in perms], np.int64)
    self._salt_F = rng.integers(0, 2**63, num_sparse, dtype=np.int64)
    self._dense_mu = rng.uniform(0.0, 3.0, num_dense)
    self._dense_sigma = rng.uniform(0.5, 1.5, num_dense)
    self._w_dense = rng.standard_normal(num_dense)
    self.teacher, self.logit_scale = teacher, float(logit_scale)
    if teacher == "deep":
      trng = np.random.default_rng([self.seed, 1002])
      n_in = num_sparse * K_LAT
      self._lat_salt_FK = trng.integers(0, 2**63, (num_sparse, K_LAT), dtype=np.int64)
      self._t_w1 = trng.standard_normal((n_in, TEACHER_WIDTH)) * (2.0 / math.sqrt(n_in))
      self._t_w2 = trng.standard_normal((TEACHER_WIDTH, TEACHER_WIDTH)) * (
          2.0 / math.sqrt(TEACHER_WIDTH))
      self._t_w3 = trng.standard_normal(TEACHER_WIDTH) / math.sqrt(TEACHER_WIDTH)
      self._triples = np.stack([trng.choice(num_sparse, 3, replace=False)
                                for _ in range(NUM_TRIPLES)]) if num_sparse >= 3 else None
    self._sparse_mean = self._sparse_std = 0.0
    self._dense_mean = self._dense_std = 0.0
    self._bias = 0.0
    self._calibrate()

  # --- BatchSource --------------------------------------------------------------------------

  @property
  def num_batches(self) -> int | None:
    return self._num_batches

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    stop = self._num_batches
    for k in (itertools.count(start) if stop is None else range(start, stop)):
      yield self.batch(k)

  def batch(self, k: int) -> SparseBatch:
    """Batch number k of this split (of this shard: its rows of global batch k)."""
    full = self._draw(np.random.default_rng([self.seed, SPLITS[self.split], k]),
                      self.batch_size)[0]
    if self.num_shards == 1:
      return full
    b = self.batch_size // self.num_shards
    rows = slice(self.shard_index * b, (self.shard_index + 1) * b)
    return jax.tree.map(lambda x: x[rows], full)

  # --- the hidden model -------------------------------------------------------------------

  def true_logits(self, batch: SparseBatch) -> np.ndarray:
    """The logits [B] the labels of `batch` were drawn from (float64)."""
    ids_BFL = np.asarray(batch.ids)
    L = self._live_FL.shape[1]
    if ids_BFL.shape[1:] != (len(self._rows_F), L) or np.any(
        np.asarray(batch.lengths) != self._bag_F):
      raise ValueError(f"true_logits: ids {ids_BFL.shape} with lengths unlike this source's "
                       f"bags (F={len(self._rows_F)}, bag sizes {self.multi_hot})")
    sparse, dense = self._raw_scores(ids_BFL, np.asarray(batch.dense))
    return self._logit(sparse, dense)

  def _hash_live(self, salt_F: np.ndarray, ids_BFL: np.ndarray) -> np.ndarray:
    """`_hash_uniform` of each id with its feature's salt (salt_F [F] or [F, K]: -> [B, F, L]
    or [B, F, L, K]), computed in the live slots only (0 in the padding, which `_bag_mean`
    leaves out)."""
    extra = salt_F.shape[1:]
    salt = salt_F.reshape(salt_F.shape[:1] + (1,) + extra)
    ids = ids_BFL.reshape(ids_BFL.shape + (1,) * len(extra))
    if self._live is None:
      return _hash_uniform(salt, ids)
    f, l = self._live
    out = np.zeros(ids_BFL.shape + extra)
    out[:, f, l] = _hash_uniform(salt_F[f], ids[:, f, l])
    return out

  def _bag_mean(self, v_BFL: np.ndarray) -> np.ndarray:
    """Mean over each bag's live slots: [B, F, L, ...] -> [B, F, ...] (exact for one-hot)."""
    live = self._live_FL.reshape(self._live_FL.shape + (1,) * (v_BFL.ndim - 3))
    if live.shape[1] == 1:
      return v_BFL[:, :, 0]
    bag = self._bag_F.reshape((-1,) + (1,) * (v_BFL.ndim - 3)).astype(np.float64)
    return np.where(live, v_BFL, 0.0).sum(2) / bag

  def _raw_scores(self, ids_BFL: np.ndarray, dense_BD: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dense = dense_BD.astype(np.float64) @ self._w_dense
    if self.teacher == "deep":
      return self._deep_score(ids_BFL), dense
    w_BF = self._bag_mean(self._hash_live(self._salt_F, ids_BFL))
    return w_BF.sum(1) * math.sqrt(3.0), dense  # unit-variance weights

  def _deep_score(self, ids_BFL: np.ndarray) -> np.ndarray:
    """The deep teacher's sparse score: tanh network of latents + planted triple products."""
    u_BFLK = self._hash_live(self._lat_salt_FK, ids_BFL) * math.sqrt(3.0)
    u_BFK = self._bag_mean(u_BFLK)
    b = u_BFK.shape[0]
    h = np.tanh(u_BFK.reshape(b, -1) @ self._t_w1)
    h = np.tanh(h @ self._t_w2)
    score = h @ self._t_w3
    score = score / max(float(np.std(self._t_w3)) * math.sqrt(TEACHER_WIDTH), 1e-12)
    if self._triples is not None:
      tri = u_BFK[:, self._triples, :].prod(axis=2).sum(axis=(1, 2))   # [B]
      score = score + tri / math.sqrt(NUM_TRIPLES * K_LAT)
    return score

  def bayes_auc(self, num_examples: int = 200_000) -> float:
    """AUC of the true logits on fresh draws: the ceiling any model can reach."""
    from rec.metrics import RecMetrics
    m = RecMetrics()
    rng = np.random.default_rng([self.seed, 1003])
    for _ in range(max(1, num_examples // 8192)):
      batch, scores = self._draw(rng, 8192)
      m.update(self._logit(*scores), batch.labels, batch.mask)
    return float(m.result()["auc"])

  def _logit(self, sparse: np.ndarray, dense: np.ndarray) -> np.ndarray:
    z = (math.sqrt(SPARSE_SHARE) * (sparse - self._sparse_mean) / self._sparse_std
         + math.sqrt(1.0 - SPARSE_SHARE) * (dense - self._dense_mean) / self._dense_std)
    return self.logit_scale * z + self._bias

  def _calibrate(self) -> None:
    """Standardizes both scores and sets the bias for a BASE_RATE positive rate."""
    sample = self._draw(np.random.default_rng([self.seed, 1001]), 16384, labels=False)[1]
    sparse, dense = sample
    self._sparse_mean, self._sparse_std = sparse.mean(), max(sparse.std(), 1e-12)
    self._dense_mean, self._dense_std = dense.mean(), max(dense.std(), 1e-12)
    z = self._logit(sparse, dense) - self._bias
    lo, hi = -20.0, 20.0
    for _ in range(60):  # bisection: mean sigmoid(z + b) is increasing in b
      mid = 0.5 * (lo + hi)
      if np.mean(1.0 / (1.0 + np.exp(-(z + mid)))) < BASE_RATE:
        lo = mid
      else:
        hi = mid
    self._bias = 0.5 * (lo + hi)

  def _draw(self, rng: np.random.Generator, B: int, labels: bool = True):
    """One batch of B examples from rng, and its (sparse, dense) raw scores."""
    F, Dn = len(self._rows_F), len(self._dense_mu)
    L = self._live_FL.shape[1]
    ranks_BFL = np.zeros((B, F, L), np.int64)
    # One inverse-CDF draw per distinct (table size, bag size), in that order: with every bag
    # of size 1 this is one draw per table size, the one-hot stream.
    for r, n in sorted(set(zip(self._rows_F.tolist(), self.multi_hot))):
      cols = np.flatnonzero((self._rows_F == r) & (self._bag_F == n))
      ranks_BFL[:, cols, :n] = zipf_ranks(rng, int(r), (B, len(cols), n), self.alpha)
    if self._live is None:
      ids_BFL = ((ranks_BFL * self._perm_a_F[:, None] + self._perm_b_F[:, None])
                 % self._rows_F[:, None]).astype(np.int32)
    else:   # the same ids in the live slots, 0 in the padding
      f, l = self._live
      ids_BFL = np.zeros(ranks_BFL.shape, np.int32)
      ids_BFL[:, f, l] = ((ranks_BFL[:, f, l] * self._perm_a_F[f] + self._perm_b_F[f])
                          % self._rows_F[f]).astype(np.int32)
    counts = np.floor(np.exp(self._dense_mu + self._dense_sigma * rng.standard_normal((B, Dn))))
    dense_BD = np.log1p(counts).astype(np.float32)
    scores = self._raw_scores(ids_BFL, dense_BD)
    if not labels:
      return None, scores
    p = 1.0 / (1.0 + np.exp(-self._logit(*scores)))
    y = (rng.random(B) < p).astype(np.float32)
    lengths = np.broadcast_to(self._bag_F.astype(np.int32), (B, F)).copy()
    batch = SparseBatch(dense=dense_BD, ids=ids_BFL, lengths=lengths, labels=y,
                        mask=np.ones(B, np.float32))
    return batch, scores
