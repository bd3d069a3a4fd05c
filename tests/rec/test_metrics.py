"""Tests for rec/metrics.py against brute-force and hand-computed references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rec.metrics import AUCAccumulator, RecMetrics


def brute_force_auc(scores, labels):
  """O(P * N) Mann-Whitney: fraction of (pos, neg) pairs ranked right, ties 1/2."""
  pos = [s for s, y in zip(scores, labels) if y == 1]
  neg = [s for s, y in zip(scores, labels) if y == 0]
  total = 0.0
  for p in pos:
    for n in neg:
      total += 1.0 if p > n else 0.5 if p == n else 0.0
  return total / (len(pos) * len(neg))


def _tied_data(rng, n=600):
  labels = (rng.random(n) < 0.3).astype(np.float32)
  # Informative scores rounded to one decimal: about 20 distinct values, many ties
  # within and across classes.
  scores = np.round(rng.normal(size=n) + labels, 1)
  return scores, labels


def test_auc_matches_brute_force_with_ties():
  rng = np.random.default_rng(0)
  scores, labels = _tied_data(rng)
  acc = AUCAccumulator()
  acc.update(scores, labels)
  assert len(acc.scores) < 80  # compacted to distinct scores
  assert acc.result() == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_auc_batching_and_merge_order_are_bit_exact():
  rng = np.random.default_rng(1)
  scores, labels = _tied_data(rng)
  whole = AUCAccumulator()
  whole.update(scores, labels)
  expected = whole.result()
  for trial in range(5):
    cuts = np.sort(rng.choice(np.arange(1, len(scores)), size=7, replace=False))
    parts = []
    for idx in np.split(rng.permutation(len(scores)), cuts):
      a = AUCAccumulator()
      a.update(scores[idx], labels[idx])
      parts.append(a)
    order = rng.permutation(len(parts))
    merged = AUCAccumulator()
    for i in order:
      merged = merged.merge(parts[i])
    assert merged.result() == expected, trial
    # Tree merge in another order too.
    while len(parts) > 1:
      parts = [parts[i].merge(parts[i + 1]) if i + 1 < len(parts) else parts[i]
               for i in range(0, len(parts), 2)]
    assert parts[0].result() == expected


def test_auc_merge_does_not_mutate_inputs():
  a, b = AUCAccumulator(), AUCAccumulator()
  a.update([0.1, 0.4], [0, 1])
  b.update([0.35, 0.8], [1, 0])
  before = a.to_arrays()
  a.merge(b)
  np.testing.assert_array_equal(a.to_arrays()["scores"], before["scores"])
  assert a.result() == 1.0


def test_auc_hand_example():
  # sklearn.metrics.roc_auc_score([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75.
  acc = AUCAccumulator()
  acc.update(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
  assert acc.result() == 0.75
  # Ties: positives {0.5, 0.5}, negatives {0.5, 0.2}: pairs 1/2, 1, 1/2, 1 -> 3/4.
  acc = AUCAccumulator()
  acc.update([0.5, 0.5, 0.5, 0.2], [1, 1, 0, 0])
  assert acc.result() == 0.75
  # All scores equal -> 1/2; perfectly reversed -> 0.
  acc = AUCAccumulator()
  acc.update([3.0] * 4, [1, 0, 1, 0])
  assert acc.result() == 0.5
  acc = AUCAccumulator()
  acc.update([1.0, 2.0, 3.0], [1, 0, 0])
  assert acc.result() == 0.0


def test_auc_mask_excludes_examples():
  acc = AUCAccumulator()
  # The masked-out pair would flip the ranking if it counted.
  acc.update([0.1, 0.9, 0.95, 0.0], [0, 1, 0, 1], mask=[1, 1, 0, 0])
  assert acc.result() == 1.0
  assert acc.num_examples == 2


def test_auc_undefined_is_nan_and_bad_labels_raise():
  acc = AUCAccumulator()
  assert math.isnan(acc.result())
  acc.update([0.1, 0.2], [1, 1])
  assert math.isnan(acc.result())
  with pytest.raises(ValueError, match="label 2"):
    acc.update([0.1], [2])
  with pytest.raises(ValueError, match="NaN"):
    acc.update([float("nan")], [1])


def test_auc_arrays_roundtrip_with_padding():
  rng = np.random.default_rng(2)
  scores, labels = _tied_data(rng, 300)
  hosts = []
  for idx in np.array_split(np.arange(300), 3):
    a = AUCAccumulator()
    a.update(scores[idx], labels[idx])
    hosts.append(a.to_arrays())
  # Simulate an all-gather: pad each host's arrays to the same length with zero counts.
  k = max(len(h["scores"]) for h in hosts)
  pad = lambda x, v: np.concatenate([x, np.full(k - len(x), v, x.dtype)])
  gathered = {key: np.concatenate([pad(h[key], 0) for h in hosts]) for key in hosts[0]}
  rebuilt = AUCAccumulator.from_arrays(**gathered)
  whole = AUCAccumulator()
  whole.update(scores, labels)
  assert rebuilt.result() == whole.result()
  np.testing.assert_array_equal(rebuilt.to_arrays()["pos"], whole.to_arrays()["pos"])


def _numpy_logloss(logits, labels):
  p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  return float(np.mean(-(labels * np.log(p) + (1 - labels) * np.log(1 - p))))


def test_rec_metrics_against_numpy():
  rng = np.random.default_rng(3)
  n = 500
  labels = (rng.random(n) < 0.25).astype(np.float32)
  logits = (rng.normal(size=n) * 2 + labels).astype(np.float32)
  mask = (rng.random(n) < 0.8).astype(np.float32)
  m = RecMetrics()
  for idx in np.array_split(np.arange(n), 7):
    m.update(logits[idx], labels[idx], mask[idx])
  r = m.result()
  sel = mask > 0
  ll = _numpy_logloss(logits[sel], labels[sel])
  p = labels[sel].mean()
  h = -(p * np.log(p) + (1 - p) * np.log(1 - p))
  assert r["num_examples"] == int(sel.sum())
  assert r["base_rate"] == pytest.approx(p, abs=1e-12)
  assert r["logloss"] == pytest.approx(ll, rel=1e-12)
  assert r["ne"] == pytest.approx(ll / h, rel=1e-12)
  assert r["accuracy"] == pytest.approx(np.mean((logits[sel] > 0) == (labels[sel] == 1)),
                                        abs=1e-12)
  assert r["auc"] == pytest.approx(brute_force_auc(logits[sel], labels[sel]), abs=1e-12)


def test_rec_metrics_logloss_stable_for_huge_logits():
  m = RecMetrics()
  m.update(np.array([1000.0, -1000.0, 1000.0]), np.array([1, 0, 0]))
  r = m.result()
  assert r["logloss"] == pytest.approx(1000.0 / 3, rel=1e-12)
  assert r["accuracy"] == pytest.approx(2 / 3)


def test_ne_of_base_rate_predictor_is_one():
  labels = np.array([1, 0, 0, 0, 1, 0, 0, 0], np.float32)
  p = labels.mean()
  logits = np.full(labels.shape, np.log(p / (1 - p)))
  m = RecMetrics()
  m.update(logits, labels)
  r = m.result()
  assert r["ne"] == pytest.approx(1.0, abs=1e-12)
  assert r["auc"] == 0.5


def test_rec_metrics_merge_and_arrays_match_single_pass():
  rng = np.random.default_rng(4)
  labels = (rng.random(200) < 0.4).astype(np.float32)
  logits = np.round(rng.normal(size=200), 1)
  whole = RecMetrics()
  whole.update(logits, labels)
  a, b = RecMetrics(), RecMetrics()
  a.update(logits[:70], labels[:70])
  b.update(logits[70:], labels[70:])
  merged = b.merge(a)
  arrs = [a.to_arrays(), b.to_arrays()]
  gathered = {k: np.concatenate([x[k] for x in arrs]) for k in arrs[0]}
  rebuilt = RecMetrics.from_arrays(**gathered)
  for got in (merged.result(), rebuilt.result()):
    for key, want in whole.result().items():
      assert got[key] == pytest.approx(want, rel=1e-12, abs=1e-15), key


def test_rec_metrics_empty_and_single_class():
  r = RecMetrics().result()
  assert r["num_examples"] == 0 and math.isnan(r["auc"]) and math.isnan(r["logloss"])
  m = RecMetrics()
  m.update([0.5, -0.5], [0, 0])
  r = m.result()
  assert math.isnan(r["ne"]) and math.isnan(r["auc"]) and r["base_rate"] == 0.0


def test_rec_metrics_refuses_non_finite_logits_and_keeps_its_state():
  m = RecMetrics()
  m.update([0.5, -1.0], [1, 0])
  before = m.result()
  # softplus(inf) - 1 * inf is nan: an infinite logit would turn the log loss and NE into nan
  for bad in (np.inf, -np.inf, np.nan):
    with pytest.raises(ValueError, match=f"logit {bad!r} at index 1, expected finite"):
      m.update([0.3, bad, 0.2], [1, 1, 0])
  assert m.result() == before            # a refused batch adds nothing (sums, counts, AUC)
  assert m.auc.num_examples == m.num_examples == 2
  m.update([0.3, np.inf, 0.2], [1, 1, 0], mask=[1, 0, 1])   # padding is never read
  assert m.num_examples == 4 and math.isfinite(m.result()["logloss"])


# --- on device

def _host(logits, labels, mask):
  m = RecMetrics()
  m.update(logits, labels, mask)
  return m.result()


def _check_device_equals_host(logits, labels, mask, **kw):
  from rec.metrics import device_metrics
  got = device_metrics(logits, labels, mask, **kw)
  want = _host(np.asarray(logits, np.float32), labels, mask)
  assert got["num_examples"] == want["num_examples"]
  assert got["auc"] == want["auc"]                       # exact, ties as 1/2
  assert got["accuracy"] == want["accuracy"] and got["base_rate"] == want["base_rate"]
  # float32 per-example losses (rel. error ~6e-8 each) summed exactly enough: rel 1e-6
  np.testing.assert_allclose(got["logloss"], want["logloss"], rtol=1e-6)
  np.testing.assert_allclose(got["ne"], want["ne"], rtol=1e-6)


def test_device_metrics_equal_the_host_metrics_with_ties_padding_and_signed_zeros():
  rng = np.random.default_rng(4)
  scores, labels = _tied_data(rng, n=70_001)             # > 2 AUC chunks, odd length
  scores = scores.astype(np.float32)
  scores[::97] = -0.0                                    # ties between -0 and +0
  scores[1::97] = 0.0
  mask = (rng.random(scores.shape) < 0.9).astype(np.float32)
  labels_padded = np.where(mask > 0, labels, 7.0)        # padding labels are never read
  _check_device_equals_host(scores, labels_padded, mask)
  _check_device_equals_host(scores[:5], labels[:5], None)


@pytest.mark.devices(8)
def test_device_metrics_of_batch_sharded_logits():
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(5)
  scores, labels = _tied_data(rng, n=8 * 1000)
  mask = np.ones_like(labels)
  mesh = jax.make_mesh((8,), ("data",))
  put = lambda x: jax.device_put(np.asarray(x, np.float32), NamedSharding(mesh, P("data")))
  _check_device_equals_host(put(scores), put(labels), put(mask))


def test_device_metrics_errors_and_empty():
  from rec.metrics import device_metrics
  with pytest.raises(ValueError, match="1 logits are NaN or infinite"):
    device_metrics(np.array([0.1, np.nan, 0.3], np.float32), np.array([0, 1, 1.0]))
  with pytest.raises(ValueError, match="1 labels are not 0 or 1"):
    device_metrics(np.array([0.1, 0.2], np.float32), np.array([0, 2.0]))
  # a NaN in a padding slot is not an example
  out = device_metrics(np.array([0.1, np.nan, 0.3], np.float32), np.array([0, 1, 1.0]),
                       np.array([1, 0, 1.0]))
  assert out["auc"] == 1.0 and out["num_examples"] == 2
  assert device_metrics(np.zeros(3, np.float32), np.zeros(3), np.zeros(3))["num_examples"] == 0
  assert math.isnan(device_metrics(np.zeros(3, np.float32), np.zeros(3))["auc"])
