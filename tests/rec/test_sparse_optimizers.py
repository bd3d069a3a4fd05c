"""Tests for rec/embedding/storage.py and rec/embedding/optimizers.py.

Every sparse step is checked against a dense reference written here independently in numpy
float64: the dense gradient (scatter-add of the valid per-id gradients) with the dense rule
(lazy Adam: the rule on the rows touched that step), and against optax where the formulas
coincide; and (peer-marked) against FBGEMM's fused TBE optimizers on CPU.
Letters: N table rows, D dim, M ids per batch.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from rec.embedding import optimizers as so
from rec.embedding import storage as st
from rec.embedding.storage_spec import StorageSpec, make_storage
from tests import peer_env
from tests.peer_env import peer_python

N, D, M, STEPS = 50, 8, 96, 5
POOL = 30  # ids come from rows [0, POOL); rows POOL.. are never touched


def _batch(rng, n=N, m=M, pool=POOL):
  """Skewed ids (many duplicates), ~25% padding with junk ids and NaN gradients."""
  p = 1.0 / np.arange(1, pool + 1) ** 1.1
  idx = rng.choice(pool, size=m, p=p / p.sum()).astype(np.int32)
  grads = rng.standard_normal((m, D)).astype(np.float32)
  valid = rng.random(m) < 0.75
  # Padding slots carry in-range ids, the sentinel, beyond-range and negative ids, and NaN
  # gradients: none of them may reach the table or the state.
  idx[~valid] = rng.choice([3, -1, n, n + 7], size=(~valid).sum())
  grads[~valid] = np.nan
  return idx, grads, valid


def _dense_grad(idx, grads, valid, n=N):
  g = np.zeros((n, grads.shape[1]), np.float64)
  np.add.at(g, idx[valid], grads[valid].astype(np.float64))
  touched = np.zeros(n, bool)
  touched[idx[valid]] = True
  return g, touched


# Dense numpy references: (w, state, G, touched, lr, t) -> (w, state); t = step + 1.

def _ref_sgd(w, s, g, touched, lr, t, **kw):
  return w - lr * g, s


def _ref_adagrad(w, s, g, touched, lr, t, eps, **kw):
  acc = s["sum_sq"] + g * g
  inv = np.zeros_like(acc)
  pos = acc > 0
  inv[pos] = 1.0 / np.sqrt(acc[pos] + eps)
  return w - lr * g * inv, {"sum_sq": acc}


def _ref_rowwise_adagrad(w, s, g, touched, lr, t, eps, weight_decay=0.0, **kw):
  g = g + weight_decay * w
  acc = s["sum_sq"].copy()
  acc[touched] += np.mean(g[touched] ** 2, axis=1)
  w = w.copy()
  w[touched] -= lr * g[touched] / (np.sqrt(acc[touched]) + eps)[:, None]
  return w, {"sum_sq": acc}


def _ref_lazy_adam(w, s, g, touched, lr, t, b1, b2, eps, **kw):
  m, v, w = s["m"].copy(), s["v"].copy(), w.copy()
  m[touched] = b1 * m[touched] + (1 - b1) * g[touched]
  v[touched] = b2 * v[touched] + (1 - b2) * g[touched] ** 2
  m_hat = m[touched] / (1 - b1 ** t)
  v_hat = v[touched] / (1 - b2 ** t)
  w[touched] -= lr * m_hat / (np.sqrt(v_hat) + eps)
  return w, {"m": m, "v": v}


CASES = {
    "sgd": (so.SGD, {}, _ref_sgd, 0.3),
    "sgd_schedule": (so.SGD, {}, _ref_sgd, "schedule"),
    "adagrad": (so.Adagrad, {"eps": 1e-10}, _ref_adagrad, 0.2),
    "adagrad_init_acc": (so.Adagrad, {"eps": 1e-7, "initial_accumulator_value": 0.1},
                         _ref_adagrad, 0.2),
    "rowwise_adagrad": (so.RowWiseAdagrad, {"eps": 1e-8}, _ref_rowwise_adagrad, 0.2),
    "rowwise_adagrad_wd": (so.RowWiseAdagrad, {"eps": 1e-6, "initial_accumulator_value": 0.5,
                                               "weight_decay": 0.1},
                           _ref_rowwise_adagrad, 0.2),
    "adam": (so.Adam, {"b1": 0.9, "b2": 0.999, "eps": 1e-8}, _ref_lazy_adam, 0.05),
    "adam_schedule": (so.Adam, {"b1": 0.8, "b2": 0.99, "eps": 1e-6}, _ref_lazy_adam, "schedule"),
}


def _schedule_jax(step):
  return 0.3 * 0.8 ** step


def _schedule_np(step):
  return 0.3 * 0.8 ** step


def _jit_apply(opt):
  # storage (arg 0) is static; table and optimizer state are donated.
  return jax.jit(opt.apply, static_argnums=0, donate_argnums=(1, 2))


def _copy(tree):
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_dense_reference(case):
  cls, kw, ref, lr = CASES[case]
  opt = cls(learning_rate=_schedule_jax if lr == "schedule" else lr, **kw)
  storage = st.Fp32Storage()
  table = storage.init(jax.random.key(0), N, D, 0.5)
  state = opt.init_state(N, D)
  w_ref = np.array(table["rows"], np.float64)
  s_ref = {k: np.array(v, np.float64) for k, v in state.items()}
  w_init = np.array(table["rows"])
  apply = _jit_apply(opt)
  rng = np.random.default_rng(1)
  for step in range(STEPS):
    idx, grads, valid = _batch(rng)
    g, touched = _dense_grad(idx, grads, valid)
    lr_t = _schedule_np(step) if lr == "schedule" else lr
    w_ref, s_ref = ref(w_ref, s_ref, g, touched, lr_t, step + 1, **kw)
    old_w, old_s = _copy(table["rows"]), _copy(state)
    table, state = apply(storage, table, state, jnp.asarray(idx), jnp.asarray(grads),
                         jnp.asarray(valid), jnp.int32(step))
    new_w, new_s = np.asarray(table["rows"]), _copy(state)
    np.testing.assert_allclose(new_w, w_ref, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    assert set(new_s) == set(s_ref)
    for k in s_ref:
      np.testing.assert_allclose(new_s[k], s_ref[k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"state {k} step {step}")
    # Rows not touched this step keep table and state bitwise.
    np.testing.assert_array_equal(new_w[~touched], old_w[~touched])
    for k in s_ref:
      np.testing.assert_array_equal(new_s[k][~touched], old_s[k][~touched])
    assert touched.sum() < POOL  # the batch really leaves some pool rows out
  np.testing.assert_array_equal(np.asarray(table["rows"])[POOL:], w_init[POOL:])
  assert not np.array_equal(np.asarray(table["rows"])[:POOL], w_init[:POOL])


@pytest.mark.parametrize("name", ["sgd", "sgd_schedule", "adagrad"])
def test_matches_optax_on_dense_gradient(name):
  storage = st.Fp32Storage()
  if name == "adagrad":
    opt = so.Adagrad(0.2, eps=1e-7, initial_accumulator_value=0.1)
    tx = optax.adagrad(0.2, initial_accumulator_value=0.1, eps=1e-7)
  else:
    lr = _schedule_jax if name == "sgd_schedule" else 0.3
    opt, tx = so.SGD(lr), optax.sgd(lr)
  table = storage.init(jax.random.key(2), N, D, 0.5)
  state = opt.init_state(N, D)
  params = jnp.array(table["rows"])
  tx_state = tx.init(params)
  tx_update = jax.jit(tx.update)
  apply = _jit_apply(opt)
  rng = np.random.default_rng(3)
  for step in range(STEPS):
    idx, grads, valid = _batch(rng)
    # Dense gradient in jax: scatter-add of the valid per-id rows.
    g = jnp.zeros((N, D)).at[idx[valid]].add(grads[valid])
    updates, tx_state = tx_update(g, tx_state, params)
    params = params + updates
    table, state = apply(storage, table, state, jnp.asarray(idx), jnp.asarray(grads),
                         jnp.asarray(valid), jnp.int32(step))
    np.testing.assert_allclose(table["rows"], params, rtol=1e-5, atol=1e-6)
  if name == "adagrad":
    np.testing.assert_allclose(state["sum_sq"], tx_state[0].sum_of_squares, rtol=1e-5)


def test_lazy_adam_is_optax_adam_when_every_row_is_touched():
  n = 16
  opt = so.Adam(0.05, b1=0.8, b2=0.95, eps=1e-6)
  tx = optax.adam(0.05, b1=0.8, b2=0.95, eps=1e-6)
  storage = st.Fp32Storage()
  table = storage.init(jax.random.key(4), n, D, 0.5)
  state = opt.init_state(n, D)
  params = jnp.array(table["rows"])
  tx_state = tx.init(params)
  tx_update = jax.jit(tx.update)
  apply = _jit_apply(opt)
  rng = np.random.default_rng(5)
  for step in range(STEPS):
    idx = rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 24)])).astype(np.int32)
    grads = rng.standard_normal((idx.size, D)).astype(np.float32)
    valid = np.ones(idx.size, bool)
    g = jnp.zeros((n, D)).at[idx].add(grads)
    updates, tx_state = tx_update(g, tx_state, params)
    params = params + updates
    table, state = apply(storage, table, state, jnp.asarray(idx), jnp.asarray(grads),
                         jnp.asarray(valid), jnp.int32(step))
    np.testing.assert_allclose(table["rows"], params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state["m"], tx_state[0].mu, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(state["v"], tx_state[0].nu, rtol=1e-5, atol=1e-9)


def test_dedup_gradients_against_numpy():
  rng = np.random.default_rng(6)
  idx, grads, valid = _batch(rng)
  idx[:3] = [N, N + 100, -5]  # out of range yet marked valid: treated as padding
  valid[:3] = True
  grads[:3] = 1e6
  uniq, summed, uniq_valid = jax.jit(so.dedup_gradients, static_argnums=3)(
      jnp.asarray(idx), jnp.asarray(grads), jnp.asarray(valid), N)
  keep = valid & (idx >= 0) & (idx < N)
  ref_ids = np.unique(idx[keep])
  k = ref_ids.size
  assert uniq.shape == (M,) and summed.shape == (M, D) and uniq_valid.shape == (M,)
  np.testing.assert_array_equal(uniq[:k], ref_ids)
  np.testing.assert_array_equal(uniq[k:], N)
  np.testing.assert_array_equal(uniq_valid, np.arange(M) < k)
  ref_sum = np.stack([grads[keep & (idx == r)].astype(np.float64).sum(0) for r in ref_ids])
  np.testing.assert_allclose(summed[:k], ref_sum, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(summed[k:], 0.0)  # sentinel slots: zero, never NaN


def test_out_of_range_and_padding_ids_are_not_written():
  storage = st.Fp32Storage()
  opt = so.RowWiseAdagrad(0.1)
  table = storage.init(jax.random.key(7), N, D, 0.5)
  state = opt.init_state(N, D)
  before = _copy((table, state))
  idx = np.array([N, N + 1, -1, -N, 2**30, 4], np.int32)
  valid = np.array([True, True, True, True, True, False])
  grads = np.full((idx.size, D), 1e3, np.float32)
  table, state = _jit_apply(opt)(storage, table, state, jnp.asarray(idx), jnp.asarray(grads),
                                 jnp.asarray(valid), jnp.int32(0))
  np.testing.assert_array_equal(table["rows"], before[0]["rows"])
  np.testing.assert_array_equal(state["sum_sq"], before[1]["sum_sq"])


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_storage_gather_scatter(name):
  storage = make_storage(StorageSpec.parse(name))
  dtype = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16}[name]
  table = storage.init(jax.random.key(8), N, D, 0.25)
  rows = np.asarray(table["rows"])
  assert rows.dtype == dtype and rows.shape == (N, D)
  assert storage.num_rows(table) == N and storage.dim(table) == D
  assert np.abs(rows.astype(np.float32)).max() <= 0.25 and rows.astype(np.float32).std() > 0.1
  assert storage.bytes_per_row(D) * N == rows.nbytes
  idx = jnp.array([[0, 7, N - 1], [N, N + 9, -1]], jnp.int32)
  out = storage.gather(table, idx)
  assert out.dtype == jnp.float32 and out.shape == (2, 3, D)
  np.testing.assert_array_equal(out[0], rows[[0, 7, N - 1]].astype(np.float32))
  np.testing.assert_array_equal(out[1], 0.0)  # out of range (negative too) reads zeros
  # Sentinel, beyond-range and negative ids are dropped; the in-range ones are written.
  new_vals = np.arange(5 * D, dtype=np.float32).reshape(5, D) / 7.0
  table2 = storage.scatter(table, jnp.array([N, 3, N + 5, -1, 11]), jnp.asarray(new_vals))
  expect = rows.copy()
  expect[[3, 11]] = new_vals[[1, 4]].astype(dtype)
  np.testing.assert_array_equal(np.asarray(table2["rows"]), expect)
  with pytest.raises(ValueError, match="rows shape"):
    storage.scatter(table, jnp.array([1, 2]), jnp.zeros((2, D + 1)))


def test_bf16_rounds_to_nearest_even():
  storage = st.Bf16Storage()
  table = storage.init(jax.random.key(9), 4, 2, 0.1)
  # Halfway cases (hand computed): 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 -> 1 (even);
  # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6 -> 1 + 2^-6 (even).
  vals = np.array([[1 + 2**-8, 1 + 3 * 2**-8], [1 + 2**-8 + 2**-12, -(1 + 2**-8)]], np.float32)
  table = storage.scatter(table, jnp.array([0, 2]), jnp.asarray(vals))
  got = np.asarray(storage.gather(table, jnp.array([0, 2])))
  np.testing.assert_array_equal(got, [[1.0, 1 + 2**-6], [1 + 2**-7, -1.0]])
  rng = np.random.default_rng(10)
  x = rng.standard_normal((4, 2)).astype(np.float32)
  table = storage.scatter(table, jnp.arange(4), jnp.asarray(x))
  np.testing.assert_array_equal(storage.gather(table, jnp.arange(4)),
                                x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_storage_updates():
  bf16, fp32 = st.Bf16Storage(), st.Fp32Storage()
  opt = so.RowWiseAdagrad(0.2)
  table = bf16.init(jax.random.key(11), N, D, 0.5)
  state = opt.init_state(N, D)
  # Same bf16 values held in fp32: one step must equal the fp32 step rounded to bf16.
  table32 = {"rows": table["rows"].astype(jnp.float32)}
  state32 = opt.init_state(N, D)
  s_ref = {"sum_sq": np.zeros(N)}
  apply = _jit_apply(opt)
  rng = np.random.default_rng(12)
  for step in range(STEPS):
    idx, grads, valid = _batch(rng)
    w_prev = np.array(table["rows"], np.float64)
    args = (jnp.asarray(idx), jnp.asarray(grads), jnp.asarray(valid), jnp.int32(step))
    table, state = apply(bf16, table, state, *args)
    assert table["rows"].dtype == jnp.bfloat16
    if step == 0:
      table32, _ = apply(fp32, table32, state32, *args)
      np.testing.assert_array_equal(
          np.asarray(table["rows"]), np.asarray(table32["rows"]).astype(ml_dtypes.bfloat16))
    g, touched = _dense_grad(idx, grads, valid)
    w_ref, s_ref = _ref_rowwise_adagrad(w_prev, s_ref, g, touched, 0.2, step + 1, eps=1e-8)
    w_ref = w_ref.astype(ml_dtypes.bfloat16).astype(np.float64)  # rows live in bf16
    assert np.median(np.abs(w_ref - w_prev)[touched]) > 0.01  # updates well above bf16 ulps
    # float32 vs float64 before rounding can flip one rounding: within one bf16 ulp.
    np.testing.assert_allclose(np.asarray(table["rows"], np.float64), w_ref, rtol=2**-7)
    np.testing.assert_allclose(state["sum_sq"], s_ref["sum_sq"], rtol=1e-5)


def test_jit_with_donation_matches_eager_and_consumes_inputs():
  storage = st.Fp32Storage()
  opt = so.Adam(0.05)
  rng = np.random.default_rng(13)
  idx, grads, valid = (jnp.asarray(a) for a in _batch(rng))
  table = storage.init(jax.random.key(14), N, D, 0.5)
  state = opt.init_state(N, D)
  eager = opt.apply(storage, table, state, idx, grads, valid, jnp.int32(3))
  jitted = _jit_apply(opt)(storage, table, state, idx, grads, valid, jnp.int32(3))
  assert table["rows"].is_deleted() and state["m"].is_deleted() and state["v"].is_deleted()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               jitted, eager)


def test_registry_and_state_sizes():
  for name, cls in [("rowwise_adagrad", so.RowWiseAdagrad), ("adagrad", so.Adagrad),
                    ("sgd", so.SGD), ("adam", so.Adam)]:
    opt = so.get_sparse_optimizer(name, 0.1)
    assert type(opt) is cls and opt.learning_rate == 0.1
    state = opt.init_state(N, D)
    assert sum(a.nbytes for a in state.values()) == N * opt.state_bytes_per_row(D), name
    assert all(a.shape[0] == N and a.dtype == jnp.float32 for a in state.values())
  opt = so.get_sparse_optimizer("adam", 0.1, b1=0.5)
  assert opt.b1 == 0.5
  with pytest.raises(ValueError, match="'adamw'"):
    so.get_sparse_optimizer("adamw", 0.1)
  with pytest.raises(ValueError, match="momentum"):
    so.get_sparse_optimizer("sgd", 0.1, momentum=0.9)
  with pytest.raises(ValueError, match="'fp16'"):
    make_storage(StorageSpec.parse("fp16"))
  assert isinstance(make_storage(StorageSpec.parse("bf16")), st.Bf16Storage)
  with pytest.raises(dataclasses.FrozenInstanceError):
    opt.b1 = 0.1


def test_apply_rejects_mismatched_shapes():
  storage = st.Fp32Storage()
  opt = so.RowWiseAdagrad(0.1)
  table = storage.init(jax.random.key(15), N, D, 0.5)
  idx = jnp.zeros((4,), jnp.int32)
  valid = jnp.ones((4,), bool)
  with pytest.raises(ValueError, match=r"grads shape \(4, 9\)"):
    opt.apply(storage, table, opt.init_state(N, D), idx, jnp.zeros((4, D + 1)), valid, 0)
  with pytest.raises(ValueError, match="sum_sq"):
    opt.apply(storage, table, opt.init_state(N + 1, D), idx, jnp.zeros((4, D)), valid, 0)
  # An LFU cache counts lookups on its own path (dedup_ids): the same named error there.
  lfu = make_storage(StorageSpec.parse("int8_cache:lfu:0.5"))
  table8 = lfu.from_float(jnp.zeros((N, D)))
  for idx_, grads_, valid_ in [(idx, jnp.zeros((5, D)), valid),
                               (idx, jnp.zeros((4, D)), valid[:3]),
                               (idx[None], jnp.zeros((4, D)), valid[None])]:
    with pytest.raises(ValueError, match=r"RowWiseAdagrad.apply: idx .*expected \[M\], \[M, D\]"):
      opt.apply(lfu, table8, opt.init_state(N, D), idx_, grads_, valid_, 0)


@pytest.mark.parametrize("name", ["fp32", "int8_cache:lfu:0.5", "int4_cache:lru:0.5"])
def test_a_step_without_ids_changes_nothing(name):
  """M = 0 (a device or step with no lookups): the table, its cache and the state stay."""
  storage = make_storage(StorageSpec.parse(name))
  opt = so.RowWiseAdagrad(0.1)
  table = storage.from_float(jax.random.uniform(jax.random.key(16), (N, D)))
  state = opt.init_state(N, D)
  out = opt.apply(storage, table, state, jnp.zeros((0,), jnp.int32), jnp.zeros((0, D)),
                  jnp.zeros((0,), bool), jnp.int32(0))
  jax.tree.map(np.testing.assert_array_equal, out, (table, state))
  uniq, seg = so.dedup_ids(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), bool), N)
  assert uniq.shape == seg.shape == (0,)
  jax.tree.map(np.testing.assert_array_equal, storage.prefetch(table, uniq, None, 0), table)


def test_learning_rate_accepts_numpy_numbers_and_names_a_bad_one():
  """A learning rate read from a numpy array (np.float32) is a number like a float."""
  assert so.RowWiseAdagrad(np.float32(0.05)).lr(jnp.int32(0)) == np.float32(0.05)
  assert so.SGD(np.int64(1)).lr(jnp.int32(0)) == 1.0
  for bad in (0.0, -0.1, float("nan"), np.float32("inf"), True, "0.1"):
    with pytest.raises(ValueError, match=r"learning_rate=.*expected a finite number > 0"):
      so.Adam(bad)


# ------------------------------------------------------------- FBGEMM (peer environment)

_FBGEMM_TBE = r'''
import json, sys
import numpy as np, torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_embedding_configs import EmbOptimType
inp = dict(np.load(sys.argv[1]))
w0 = inp["w0"]
emb = SplitTableBatchedEmbeddingBagsCodegen(
    [(w0.shape[0], w0.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU)],
    optimizer=getattr(EmbOptimType, str(inp["opt"])), learning_rate=float(inp["lr"]),
    eps=float(inp["eps"]), pooling_mode=PoolingMode.SUM)
with torch.no_grad():
    emb.split_embedding_weights()[0].copy_(torch.from_numpy(w0))
out = {}
for t in range(int(inp["steps"])):
    y = emb(torch.from_numpy(inp[f"idx{t}"]), torch.from_numpy(inp[f"off{t}"]),
            per_sample_weights=torch.from_numpy(inp[f"psw{t}"]))
    y.backward(torch.from_numpy(inp[f"g{t}"]))
    out[f"w{t}"] = emb.split_embedding_weights()[0].detach().numpy().copy()
    for k, v in (emb.get_optimizer_state() or [{}])[0].items():
        out[f"{k}{t}"] = v.detach().numpy().reshape(w0.shape[0], -1).copy()
np.savez(sys.argv[2], **out)
'''


@pytest.mark.peer
@pytest.mark.parametrize("opt_name", ["EXACT_ROWWISE_ADAGRAD", "EXACT_SGD", "EXACT_ADAGRAD"])
def test_matches_fbgemm_tbe_on_cpu(opt_name, tmp_path):
  """FBGEMM's own fused backward + optimizer (SplitTableBatchedEmbeddingBagsCodegen on CPU,
  sum pooling with per-sample weights) over 4 steps of bags with repeated ids and rows never
  looked up, against `apply` on each id's gradient (its weight times its bag's gradient).
  EXACT_ADAGRAD puts eps outside the square root, ours inside (optax): eps = 1e-10 keeps
  that difference below 1e-9 here. (FBGEMM 1.8.0's CPU kernel ignores weight_decay, so the
  L2 mode is checked only against the dense reference above.)"""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  n, d, bags, steps, lr, eps = 24, 8, 6, 4, 0.1, 1e-10
  rng = np.random.default_rng(17)
  w0 = rng.uniform(-0.5, 0.5, (n, d)).astype(np.float32)
  inp = dict(w0=w0, steps=steps, opt=opt_name, lr=lr, eps=eps)
  batches = []
  for t in range(steps):
    lens = rng.integers(0, 6, bags)
    idx = rng.integers(0, n // 2, lens.sum())          # repeats; rows n/2.. never looked up
    psw = rng.uniform(0.5, 2.0, idx.size).astype(np.float32)
    g = rng.standard_normal((bags, d)).astype(np.float32)
    inp.update({f"idx{t}": idx, f"off{t}": np.concatenate([[0], np.cumsum(lens)]),
                f"psw{t}": psw, f"g{t}": g})
    batches.append((idx.astype(np.int32), np.repeat(g, lens, axis=0) * psw[:, None]))
  np.savez(tmp_path / "in.npz", **inp)
  peer_env.run_script(peer, _FBGEMM_TBE, tmp_path, "fbgemm_gpu")
  fb = dict(np.load(tmp_path / "out.npz"))
  opt = {"EXACT_ROWWISE_ADAGRAD": so.RowWiseAdagrad(lr, eps=eps), "EXACT_SGD": so.SGD(lr),
         "EXACT_ADAGRAD": so.Adagrad(lr, eps=eps)}[opt_name]
  storage = st.Fp32Storage()
  table, state = storage.from_float(jnp.asarray(w0)), opt.init_state(n, d)
  for t, (idx, grads) in enumerate(batches):
    table, state = opt.apply(storage, table, state, jnp.asarray(idx), jnp.asarray(grads),
                             jnp.ones(idx.shape, bool), jnp.int32(t))
    # Both sum the per-id gradients in float32 in their own order and round each step's
    # arithmetic differently: a few float32 ulps of |w| <= 1 per step.
    np.testing.assert_allclose(table["rows"], fb[f"w{t}"], rtol=0, atol=1e-6,
                               err_msg=f"step {t}")
    if "sum_sq" in state:
      np.testing.assert_allclose(np.asarray(state["sum_sq"]).reshape(n, -1), fb[f"sum{t}"],
                                 rtol=1e-5, atol=0, err_msg=f"state, step {t}")
  np.testing.assert_array_equal(np.asarray(table["rows"])[n // 2:], w0[n // 2:])
  assert np.abs(np.asarray(table["rows"]) - w0).max() > 0.05     # the steps moved rows
