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


def test_deep_teacher_hashes_the_live_slots_as_the_whole_array():
  """Draws and hashes skip the padding of unequal bags: the deep teacher's latents and the
  ids equal the whole padded array's formula (hash every slot, mask the padding)."""
  src = synthetic.SyntheticCriteo(16, 300, seed=4, multi_hot=SIZES, teacher="deep")
  b = src.batch(2)
  live = src._live_FL
  assert (b.ids[:, ~live] == 0).all() and not live.all()
  whole = synthetic._hash_uniform(src._lat_salt_FK[None, :, None], b.ids[..., None])
  want = np.where(live[None, :, :, None], whole, 0.0)
  assert np.array_equal(src._hash_live(src._lat_salt_FK, b.ids), want)
  whole = synthetic._hash_uniform(src._salt_F[:, None], b.ids)
  assert np.array_equal(src._hash_live(src._salt_F, b.ids), np.where(live, whole, 0.0))


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
  from rec.data import device_synthetic
  dev, dev_eval = sources.make_sources(f"synthetic_deep:gen=device,multi_hot={sizes}", 8,
                                       num_rows=100, eval_batches=2)
  assert isinstance(dev, device_synthetic.DeviceSynthetic) and dev.teacher == "deep"
  assert dev.multi_hot == SIZES and dev_eval.num_batches == 2
  for bad in ["synthetic:multi_hot=3-2", "synthetic:multi_hot=x", "synthetic:zipf_alpha=-1",
              "synthetic:gen=gpu",
              "synthetic:multi_hot=" + "-".join(["0"] * 26), "synthetic:colour=red"]:
    with pytest.raises(ValueError, match=r"option .* of a synthetic form; expected"):
      sources.make_sources(bad, 8)


# --- the on-device generator --------------------------------------------------------------

def _one_table(num_rows: int, alpha: float):
  from rec.data import device_synthetic
  return device_synthetic.DeviceSynthetic(8, [num_rows], num_sparse=1, num_dense=1,
                                          zipf_alpha=alpha)


def test_device_hash_is_splitmix_to_24_bits():
  import jax.numpy as jnp
  from rec.data import device_synthetic
  salts = [0x123456789ABCDEF0, 2**63 - 5, 7, 0]
  ids = [0, 1, 2**31 - 1, 123_456, 99_999]
  hi, lo = device_synthetic._split64(np.array(salts, np.int64))
  got = np.asarray(device_synthetic.hash_uniform(jnp.asarray(hi)[:, None], jnp.asarray(lo)[:, None],
                                                 jnp.asarray(ids, jnp.int32)[None, :]))
  want = np.array([[splitmix_uniform(s, i) for i in ids] for s in salts])
  # the device keeps the top 24 of the 53 bits: it rounds down by less than 2^-23
  assert ((want - got >= 0) & (want - got < 2.0**-23)).all()


@pytest.mark.parametrize("num_rows,alpha", [(700, 1.05), (6000, 1.05), (9000, 1.0), (2500, 0.5),
                                            (3000, 0.0)])
def test_device_zipf_exact_at_rank_midpoints(num_rows, alpha):
  _check_rank_midpoints(num_rows, alpha, np.arange(num_rows))


def test_device_zipf_exact_at_rank_midpoints_of_a_2_31_row_table():
  n = 2**31 - 1
  ranks = np.unique(np.concatenate([
      np.arange(0, 1100), np.geomspace(1100, n - 1, 3000).astype(np.int64), [n - 2, n - 1]]))
  _check_rank_midpoints(n, 1.05, ranks)


def _check_rank_midpoints(num_rows, alpha, ranks):
  """A (segment uniform, in-segment uniform) pair aimed at the middle of rank r's mass must
  give rank r, head and tail alike."""
  import jax
  import jax.numpy as jnp
  from rec.data import device_synthetic
  segs = device_synthetic.zipf_segments(num_rows, alpha)
  start, width = segs["start"], segs["width"]
  upper = np.append(segs["threshold"].astype(np.float64), 2.0**32)
  lower = np.concatenate([[0.0], upper[:-1]])
  seg = np.searchsorted(start, ranks, side="right") - 1
  u32 = np.floor((lower[seg] + upper[seg]) / 2).astype(np.uint32)
  ad = synthetic._antideriv
  s0 = start[seg] + 0.5
  mid = 0.5 * (ad(ranks + 0.5, alpha) + ad(ranks + 1.5, alpha))
  frac = (mid - ad(s0, alpha)) / (ad(s0 + width[seg], alpha) - ad(s0, alpha))
  q = np.where(width[seg] == 1, 0.5, frac).astype(np.float32)
  src = _one_table(num_rows, alpha)
  fn = jax.jit(src.zipf_ids)
  ids = np.asarray(fn(src._tables_dev, jnp.asarray(u32)[:, None], jnp.asarray(q)[:, None]))[:, 0]
  np.testing.assert_array_equal(unpermute(ids, num_rows, 0, 0), ranks)


def test_device_ids_follow_the_exact_zipf_law():
  import jax
  num_rows = 3000
  src = _one_table(num_rows, 1.05)
  src.batch_size = 50_000
  ids = np.concatenate([np.asarray(src.batch(k).ids[:, 0, 0]) for k in range(4)])
  ranks = unpermute(ids, num_rows, 0, 0)
  emp = np.cumsum(np.bincount(ranks, minlength=num_rows)) / len(ranks)
  assert np.abs(emp - zipf_cdf(num_rows, 1.05)).max() < ks_bound(len(ranks))
  # a 2^31 - 1 row table: the share of draws past rank 10^6 is the law's tail mass
  big = _one_table(2**31 - 1, 1.05)
  big.batch_size = 200_000
  r = unpermute(np.asarray(jax.device_get(big.batch(0).ids[:, 0, 0])), 2**31 - 1, 0, 0)
  ad = synthetic._antideriv
  head = np.sum(np.arange(1, 1025, dtype=np.float64) ** -1.05)
  total = head + ad(2**31 - 0.5, 1.05) - ad(1024.5, 1.05)
  p_tail = (ad(2**31 - 0.5, 1.05) - ad(10**6 + 0.5, 1.05)) / total
  sd = math.sqrt(p_tail * (1 - p_tail) / len(r))
  assert abs((r >= 10**6).mean() - p_tail) < 4.5 * sd
  assert r.max() > 10**8


@pytest.mark.parametrize("teacher,multi_hot", [("linear", None), ("deep", None),
                                               ("linear", SIZES), ("deep", SIZES)])
def test_device_batches_are_draws_of_the_reference_model(teacher, multi_hot):
  from rec.data import device_synthetic
  kw = dict(seed=4, teacher=teacher, multi_hot=multi_hot, split="test")
  dev = device_synthetic.DeviceSynthetic(8192, 5000, **kw)
  ref = dev.reference
  d = [dev.batch(k) for k in range(3)]
  r = [ref.batch(k) for k in range(3)]
  # The device logit of given ids and dense values is the reference's, to float32.
  for b in r:
    np.testing.assert_allclose(dev.true_logits(b), ref.true_logits(b), atol=2e-5, rtol=0)
  host = [synthetic.SparseBatch(*(None if x is None else np.asarray(x) for x in (
      b.dense, b.ids, b.lengths, b.labels, b.mask, b.weights))) for b in d]
  for b in host:
    np.testing.assert_allclose(dev.true_logits(b), ref.true_logits(b), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(b.lengths, np.broadcast_to(ref.multi_hot, b.lengths.shape))
  # Labels are Bernoulli(sigmoid(true logit)): per decile of the logit, the positive rate
  # matches the mean probability (binomial tolerance at ~4.5 sd).
  logit = np.concatenate([ref.true_logits(b) for b in host])
  y = np.concatenate([b.labels for b in host])
  p = 1 / (1 + np.exp(-logit))
  for part in np.array_split(np.argsort(logit), 10):
    sd = math.sqrt(p[part].mean() * (1 - p[part].mean()) / len(part))
    assert abs(y[part].mean() - p[part].mean()) < 4.5 * sd + 1e-3
  # Dense features: the reference's per-column mean and spread.
  dd = np.concatenate([b.dense for b in host])
  rd = np.concatenate([b.dense for b in r])
  se = np.sqrt(dd.var(0) / len(dd) + rd.var(0) / len(rd))
  assert (np.abs(dd.mean(0) - rd.mean(0)) < 4.5 * se).all()
  np.testing.assert_allclose(dd.std(0), rd.std(0), rtol=0.05)
  assert abs(y.mean() - np.concatenate([b.labels for b in r]).mean()) < 0.02


@pytest.mark.devices(8)
def test_device_batches_do_not_depend_on_the_mesh_and_resume():
  import jax
  from core import mesh as mesh_lib
  from rec.data import device_synthetic
  mesh = mesh_lib.make_mesh("data:2,model:4")
  one = device_synthetic.DeviceSynthetic(64, 1000, seed=3, multi_hot=SIZES, num_batches=5)
  eight = device_synthetic.DeviceSynthetic(64, 1000, seed=3, multi_hot=SIZES, num_batches=5,
                                           mesh=mesh, batch_axes=("data", "model"))
  a, b = list(one.batches()), list(eight.batches())
  assert len(a) == 5 and b[0].ids.sharding.spec == jax.sharding.PartitionSpec(("data", "model"),
                                                                              None, None)
  assert len(b[0].ids.addressable_shards) == 8
  for x, y in zip(a, b):
    for name in ("dense", "ids", "lengths", "labels", "mask"):
      np.testing.assert_array_equal(np.asarray(getattr(x, name)), np.asarray(getattr(y, name)))
  for x, y in zip(list(one.batches(3)), a[3:]):
    np.testing.assert_array_equal(np.asarray(x.ids), np.asarray(y.ids))
  assert not np.array_equal(np.asarray(a[0].ids), np.asarray(a[1].ids))


@pytest.mark.devices(8)
def test_device_synthetic_trains_and_resumes_exactly(tmp_path):
  import json
  import os
  from core import train as train_lib
  from rec import configs
  cfg = configs.make_run(model="dlrm", preset="small", data="synthetic:gen=device",
                             num_rows=1000, mesh="data:2,model:4", batch_size=64,
                             eval_batch_size=64, eval_batches=2, sharding="tw")

  def run(workdir, **loop):
    task, train_src, eval_src, _, _ = configs.build_run(cfg)
    assert train_src.batch(0).ids.sharding.spec[0] == ("data", "model")
    out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                          train_lib.TrainConfig(workdir=str(workdir), steps=4, log_every=1,
                                                tensorboard=False, **loop))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return out, [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]

  straight, a = run(tmp_path / "a")
  run(tmp_path / "b", stop_at_step=2)
  resumed, b = run(tmp_path / "b", resume=True)
  assert a == b and straight["eval"] == resumed["eval"]
  assert straight["eval"]["num_examples"] == 128 and a[0] != a[-1]
