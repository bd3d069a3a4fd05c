"""rec/metrics.py by group and calibration: per-group AUC and gAUC against scikit-learn's
roc_auc_score per group, calibration against numpy, NE by slice against the formula, and
the grouped evaluator of RecTask's eval outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from sklearn.metrics import roc_auc_score

from rec import metrics
from rec.metrics import RecMetrics, device_metrics, group_aucs, group_index, group_metrics


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _ne(logits, labels):
  """NE from its definition: mean log loss over the entropy of the base rate."""
  p, y = _sigmoid(logits), np.asarray(labels, np.float64)
  logloss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
  b = y.mean()
  return logloss / -(b * math.log(b) + (1 - b) * math.log(1 - b)) if 0 < b < 1 else math.nan


def _reference(logits, labels, groups):
  """{group: (impressions, AUC or None)} and gAUC, one sklearn call per group."""
  out = {}
  for k in np.unique(groups):
    sel = groups == k
    auc = roc_auc_score(labels[sel], logits[sel]) if len(np.unique(labels[sel])) == 2 else None
    out[k] = (int(sel.sum()), auc)
  counted = [(n, a) for n, a in out.values() if a is not None]
  gauc = sum(n * a for n, a in counted) / sum(n for n, _ in counted) if counted else math.nan
  return out, gauc


def _data(rng, n, groups, ties=True):
  g = rng.zipf(1.5, n) % groups
  y = (rng.random(n) < 0.3).astype(np.float32)
  x = rng.normal(size=n) + y
  return (np.round(x, 1) if ties else x), y, g


examples = st.integers(1, 60).flatmap(lambda n: st.tuples(
    st.lists(st.integers(-3, 3), min_size=n, max_size=n),      # scores: many ties
    st.lists(st.integers(0, 1), min_size=n, max_size=n),
    st.lists(st.integers(0, 4), min_size=n, max_size=n)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(examples)
def test_group_aucs_and_gauc_equal_sklearn_per_group(data):
  x, y, g = (np.asarray(v) for v in data)
  x = x * 0.5
  gidx, keys = group_index(g)
  auc, pos, neg = group_aucs(x, y, gidx, len(keys))
  ref, gauc = _reference(x, y, g)
  for i, k in enumerate(keys):
    n, want = ref[k]
    assert pos[i] + neg[i] == n and pos[i] == int(y[g == k].sum())
    if want is None:
      assert math.isnan(auc[i])
    else:
      assert auc[i] == pytest.approx(want, abs=1e-12)
  got = group_metrics(x, y, g)
  if math.isnan(gauc):
    assert math.isnan(got["gauc"])
  else:
    assert got["gauc"] == pytest.approx(gauc, abs=1e-12)
  skipped = sum(a is None for _, a in ref.values())
  assert got["gauc_groups"] == {
      "counted": len(ref) - skipped, "skipped": skipped,
      "counted_impressions": sum(n for n, a in ref.values() if a is not None)}


def test_group_metrics_many_groups_match_sklearn():
  rng = np.random.default_rng(0)
  x, y, g = _data(rng, 200_000, 5_000)
  got = group_metrics(x, y, g)
  gidx, keys = group_index(g)
  auc, _, _ = group_aucs(x, y, gidx, len(keys))
  for i in range(0, len(keys), 50):        # a sample of the groups, each through sklearn
    sel = g == keys[i]
    if len(np.unique(y[sel])) == 2:
      assert auc[i] == pytest.approx(roc_auc_score(y[sel], x[sel]), abs=1e-12)
  weights = np.bincount(gidx)[~np.isnan(auc)]
  assert got["gauc"] == pytest.approx(np.sum(weights * auc[~np.isnan(auc)]) / weights.sum())


def test_ne_by_slice_is_the_formula_on_top_groups_and_the_rest():
  rng = np.random.default_rng(1)
  x, y, g = _data(rng, 5_000, 40, ties=False)
  mask = (rng.random(x.shape) < 0.9).astype(np.float32)
  got = group_metrics(x, np.where(mask > 0, y, 5.0), g, mask, top_k=4)   # padding ignored
  x, y, g = x[mask > 0], y[mask > 0], g[mask > 0]
  keys, counts = np.unique(g, return_counts=True)
  top = keys[np.argsort(-counts, kind="stable")[:4]]
  slices = got["ne_by_slice"]
  assert [s["group"] for s in slices] == [int(k) for k in top] + ["other"]
  assert slices[-1]["groups"] == len(keys) - 4
  for s, sel in zip(slices, [g == k for k in top] + [~np.isin(g, top)]):
    assert s["impressions"] == sel.sum() and s["positives"] == y[sel].sum()
    assert s["ne"] == pytest.approx(_ne(x[sel], y[sel]), rel=1e-10)
    assert s["calibration"] == pytest.approx(_sigmoid(x[sel]).sum() / y[sel].sum(), rel=1e-12)
    assert s["auc"] == pytest.approx(roc_auc_score(y[sel], x[sel]), abs=1e-12)
  # Slices by impressions: descending
  sizes = [s["impressions"] for s in slices[:-1]]
  assert sizes == sorted(sizes, reverse=True)


def test_bag_groups_compare_whole_bags():
  # [N, L] keys: equal iff every slot is (padding -1 included); [N, 1] is the plain id
  bags = np.array([[3, 4], [3, -1], [3, 4], [4, 3], [3, -1], [3, 4]])
  idx, keys = group_index(bags)
  assert len(keys) == 3 and idx[0] == idx[2] == idx[5] and idx[1] == idx[4] != idx[3]
  idx1, keys1 = group_index(np.array([[7], [2], [7]]))
  assert keys1.tolist() == [2, 7] and idx1.tolist() == [1, 0, 1]
  x, y = np.array([0.1, 0.2, 0.3, 0.0, 0.5, -0.2]), np.array([0, 1, 1, 0, 0, 1.0])
  got = group_metrics(x, y, bags, top_k=1)
  assert got["ne_by_slice"][0]["group"] == [3, 4] and got["ne_by_slice"][1]["groups"] == 2
  assert got["gauc"] == pytest.approx(
      (3 * roc_auc_score([0, 1, 1], [0.1, 0.3, -0.2]) + 2 * roc_auc_score([1, 0], [0.2, 0.5]))
      / 5)
  assert got["gauc_groups"] == {"counted": 2, "skipped": 1, "counted_impressions": 5}


def test_group_metrics_empty_and_errors():
  got = group_metrics(np.zeros(3), np.zeros(3), np.arange(3), np.zeros(3))
  assert math.isnan(got["gauc"]) and got["ne_by_slice"] == []
  assert got["gauc_groups"] == {"counted": 0, "skipped": 0, "counted_impressions": 0}
  with pytest.raises(ValueError, match="label 2.0 at index 1"):
    group_metrics(np.zeros(3), np.array([0, 2.0, 1]), np.arange(3))
  with pytest.raises(ValueError, match="NaN score at index 1"):
    group_aucs(np.array([0, np.nan]), np.array([0, 1]), np.array([0, 0]))
  # an infinite logit has AUC but a nan log loss: refused, as by device_metrics
  with pytest.raises(ValueError, match="logit inf at index 2, expected finite"):
    group_metrics(np.array([0.1, 0.2, np.inf]), np.array([0, 1, 1]), np.arange(3))
  got = group_metrics(np.array([0.1, 0.2, np.inf]), np.array([0, 1, 1]), np.zeros(3),
                      np.array([1, 1, 0]))                  # ... unless it is padding
  assert got["gauc"] == 1.0 and math.isfinite(got["ne_by_slice"][0]["logloss"])
  with pytest.raises(ValueError, match=r"groups \(2,\); expected one label and one group"):
    group_metrics(np.zeros(3), np.zeros(3), np.arange(2), np.ones(3))


def test_calibration_on_host_and_device_equal_numpy():
  rng = np.random.default_rng(2)
  x = (rng.normal(size=10_001) * 3).astype(np.float32)
  y = (rng.random(x.shape) < _sigmoid(x) * 0.8).astype(np.float32)
  mask = (rng.random(x.shape) < 0.95).astype(np.float32)
  real = mask > 0
  want = _sigmoid(x[real]).sum() / y[real].astype(np.float64).sum()
  m = RecMetrics()
  m.update(x, y, mask)
  assert m.result()["calibration"] == pytest.approx(want, rel=1e-12)
  assert device_metrics(x, y, mask)["calibration"] == pytest.approx(want, rel=1e-6)
  half = RecMetrics()
  half.update(x[:5000], y[:5000], mask[:5000])
  rest = RecMetrics()
  rest.update(x[5000:], y[5000:], mask[5000:])
  assert half.merge(rest).result()["calibration"] == pytest.approx(want, rel=1e-12)
  none = RecMetrics()
  none.update([0.3, -1.0], [0, 0])
  assert math.isnan(none.result()["calibration"])
  assert math.isnan(device_metrics(np.zeros(2, np.float32), np.zeros(2))["calibration"])


def test_grouped_evaluator_reads_the_eval_steps_group_column():
  """RecEvaluator(grouped=True) over eval outputs as RecTask.eval_step leaves them (logits,
  labels, mask [B], group [B, L]) equals group_metrics of the concatenation."""
  import jax.numpy as jnp
  from rec.train_lib import RecEvaluator
  rng = np.random.default_rng(3)
  x, y, g = _data(rng, 3 * 64, 12, ties=False)
  mask = np.ones_like(y)
  mask[-10:] = 0
  ev = RecEvaluator(grouped=True)
  for b in range(3):
    s = slice(64 * b, 64 * (b + 1))
    ev.update({"logits": jnp.asarray(x[s], jnp.float32), "labels": jnp.asarray(y[s]),
               "mask": jnp.asarray(mask[s]), "group": jnp.asarray(g[s, None], jnp.int32)}, None)
  got = ev.result()
  want = group_metrics(x.astype(np.float32), y, g, mask)
  assert got["gauc"] == pytest.approx(want["gauc"], abs=1e-12)
  assert got["gauc_groups"] == want["gauc_groups"]
  assert [s["group"] for s in got["ne_by_slice"]] == [s["group"] for s in want["ne_by_slice"]]
  assert got["calibration"] == pytest.approx(
      _sigmoid(x[:-10].astype(np.float32)).sum() / y[:-10].sum(), rel=1e-6)
  assert "gauc" not in RecEvaluator().result()
  assert metrics.format_groups(got, "site_id").startswith("gAUC ")
