"""Synthetic data (multi-hot bags, the on-device generator) and the Grain input pipeline.

References: a pure-Python SplitMix64 and per-example sums for the planted model, the exact
Zipf pmf for id marginals (Kolmogorov-Smirnov bounds), the numpy generator for the device
one, and slices of an uninterrupted iteration for resuming.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rec.data import sources, synthetic

MASK64 = 2**64 - 1


def splitmix_uniform(salt: int, i: int) -> float:
  """synthetic._hash_uniform for one (salt, id), in Python integers."""
  x = (salt ^ (i * 0x9E3779B97F4A7C15)) & MASK64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
  x ^= x >> 31
  return (x >> 11) * 2.0**-52 - 1.0


def ks_bound(n: int) -> float:
  return 2.2 / math.sqrt(n)   # Kolmogorov-Smirnov at p ~ 1e-4


def zipf_cdf(num_rows: int, alpha: float) -> np.ndarray:
  pmf = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
  return np.cumsum(pmf) / pmf.sum()


def unpermute(ids: np.ndarray, num_rows: int, seed: int, feature: int) -> np.ndarray:
  """Ranks of ids of `feature` (the inverse of the source's row permutation)."""
  a, b = synthetic.row_permutation(num_rows, seed * 1_000_003 + feature)
  return ((ids.astype(np.int64) - b) * pow(a, -1, num_rows)) % num_rows


# --- multi-hot bags --------------------------------------------------------------------------

SIZES = (3, 1, 5) + (1,) * 20 + (2, 1, 4)


def test_multi_hot_shapes_padding_and_ranges():
  rows = [1000] * 10 + [7] * 10 + [50_000] * 6
  src = synthetic.SyntheticCriteo(128, rows, seed=2, multi_hot=SIZES)
  b = src.batch(0)
  assert src.spec.max_ids_per_bag == 5 and b.ids.shape == (128, 26, 5)
  np.testing.assert_array_equal(b.lengths, np.broadcast_to(SIZES, (128, 26)))
  live = np.arange(5)[None, None, :] < np.asarray(SIZES)[None, :, None]
  assert (b.ids[~np.broadcast_to(live, b.ids.shape)] == 0).all()
  assert (b.ids >= 0).all() and (b.ids < np.asarray(rows)[None, :, None]).all()
  # distinct slots of a bag are independent draws, not copies
  assert (b.ids[:, 0, 0] != b.ids[:, 0, 1]).mean() > 0.5
  # same seed and batch number, same batch; the next one differs
  np.testing.assert_array_equal(src.batch(0).ids, b.ids)
  assert not np.array_equal(src.batch(1).ids, b.ids)


def test_multi_hot_of_ones_is_the_one_hot_stream():
  for teacher in ("linear", "deep"):
    a = synthetic.SyntheticCriteo(64, 500, seed=1, teacher=teacher)
    b = synthetic.SyntheticCriteo(64, 500, seed=1, teacher=teacher, multi_hot=(1,) * 26)
    for k in range(2):
      x, y = a.batch(k), b.batch(k)
      for name in ("dense", "ids", "lengths", "labels", "mask"):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_multi_hot_planted_logit_is_the_mean_of_bag_weights():
  src = synthetic.SyntheticCriteo(16, 300, seed=5, multi_hot=SIZES)
  b = src.batch(3)
  got = src.true_logits(b)
  for e in range(16):
    sparse = sum(np.mean([splitmix_uniform(int(src._salt_F[f]), int(i))
                          for i in b.ids[e, f, :SIZES[f]]]) for f in range(26)) * math.sqrt(3)
    dense = float(b.dense[e].astype(np.float64) @ src._w_dense)
    assert got[e] == pytest.approx(src._logit(np.float64(sparse), np.float64(dense)), abs=1e-9)
  with pytest.raises(ValueError, match="unlike this source's bags"):
    src.true_logits(synthetic.SyntheticCriteo(16, 300, seed=5).batch(0))


def test_multi_hot_ids_follow_zipf_in_every_slot():
  num_rows, alpha = 2000, 1.05
  src = synthetic.SyntheticCriteo(4096, num_rows, seed=0, multi_hot=SIZES)
  ids = np.concatenate([src.batch(k).ids for k in range(4)])
  cdf = zipf_cdf(num_rows, alpha)
  for f, slot in [(0, 0), (0, 2), (2, 4), (25, 3), (1, 0)]:
    ranks = unpermute(ids[:, f, slot], num_rows, 0, f)
    emp = np.cumsum(np.bincount(ranks, minlength=num_rows)) / len(ranks)
    assert np.abs(emp - cdf).max() < ks_bound(len(ranks)), (f, slot)


def test_multi_hot_signal_and_mlperf_sizes():
  src = synthetic.SyntheticCriteo(4096, 100_000, seed=0, multi_hot=synthetic.MLPERF_MULTI_HOT)
  assert src.spec.max_ids_per_bag == 100 and sum(synthetic.MLPERF_MULTI_HOT) == 214
  b = src.batch(0)
  assert 0.2 < b.labels.mean() < 0.3
  assert 0.78 < src.bayes_auc(20_000) < 0.9


def test_multi_hot_bad_sizes():
  for bad in [(1,) * 25, (1,) * 25 + (0,), (1,) * 25 + (1.5,), (True,) * 26]:
    with pytest.raises(ValueError, match="multi_hot=.*expected 26 ints >= 1"):
      synthetic.SyntheticCriteo(8, 100, multi_hot=bad)


def test_synthetic_form_options():
  train, _ = sources.make_sources("synthetic:multi_hot=mlperf,zipf_alpha=1.2", 8, num_rows=100)
  assert train.multi_hot == synthetic.MLPERF_MULTI_HOT and train.alpha == 1.2
  sizes = "-".join(map(str, SIZES))
  train, ev = sources.make_sources(f"synthetic_deep:multi_hot={sizes}", 8, num_rows=100)
  assert train.multi_hot == ev.multi_hot == SIZES and train.teacher == "deep"
  for bad in ["synthetic:multi_hot=3-2", "synthetic:multi_hot=x", "synthetic:zipf_alpha=-1",
              "synthetic:multi_hot=" + "-".join(["0"] * 26), "synthetic:colour=red"]:
    with pytest.raises(ValueError, match=r"option .* of a synthetic form; expected"):
      sources.make_sources(bad, 8)
