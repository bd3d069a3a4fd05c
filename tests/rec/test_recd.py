"""RecD inverse-indexed batches (rec/recd.py): dedup path == plain path, forward and
gradients, on 8 devices under the sharding kinds; capacity overflow errors or falls back."""

import jax
import numpy as np
import optax
import pytest

from core import mesh as mesh_lib
from rec import recd
from rec.data.batch import SparseBatch
from rec.embedding import optimizers as opt_lib
from rec.embedding.planner import TablePlacement
from rec.models.dlrm import DLRM, DLRMConfig

CFG = DLRMConfig(num_dense=3, num_sparse=5, embedding_dim=8, bottom_mlp=(8, 8), top_mlp=(8, 1),
                 rows_per_feature=(50,) * 5)
KINDS = {"dp": TablePlacement("dp", tuple(range(8))), "tw": TablePlacement("tw", (3,)),
         "rw": TablePlacement("rw", tuple(range(8))), "cw": TablePlacement("cw", (1, 5)),
         "twrw": TablePlacement("twrw", (4, 5, 6, 7))}
USER = ["C1", "C3", "C4"]     # deduplicated (repeated within a session); C2, C5 per sample


def _task(mesh, kinds=("dp", "tw", "rw", "cw", "twrw"), capacity=4, **kw):
  plan = {t.name: KINDS[kinds[i % len(kinds)]] for i, t in enumerate(CFG.tables())}
  return recd.RecDTask(lambda r: DLRM(CFG, r), CFG.tables(), plan, mesh,
                       opt_lib.get_sparse_optimizer("adagrad", 0.1), optax.adagrad(0.1),
                       USER, capacity=capacity, dedup_bag=3, rest_bag=2, **kw)


def _batch():
  b = next(recd.session_batches(32, 4, num_user=3, num_item=2, user_bag=3, item_bag=2,
                                num_rows=50, num_dense=3, seed=1))
  perm = [0, 3, 1, 2, 4]                   # user features at C1, C3, C4
  ids, lengths = b.ids[:, perm], b.lengths[:, perm].copy()
  lengths[::5, 0] = 1                      # some bags shorter than their padded ids
  w = np.random.default_rng(0).uniform(0.5, 1.5, ids.shape).astype(np.float32)
  w[:, [0, 2, 3]] = w[::4][:, [0, 2, 3]].repeat(4, 0)   # equal within a session
  return SparseBatch(b.dense, ids, lengths, b.labels, b.mask, w)


def _check_equal(task, train_step):
  state = task.init_state(0)
  host = _batch()
  assert recd.duplication_rate(host, [0, 2, 3]) > 0.5
  plain, dd = task.plain_batch(host), task.device_batch(host)
  assert isinstance(dd, recd.DedupBatch) and dd.ids.shape == (8 * 4, 3, 3)
  assert int(np.asarray(dd.num_unique).max()) <= 2   # one session per shard (+ short bags)

  l0, lg0, (a0, b0), (gp0, gd0, gr0) = jax.jit(task.loss_and_grads)(state, plain)
  l1, lg1, (a1, b1), (gp1, gd1, gr1) = jax.jit(task.loss_and_grads)(state, dd)
  np.testing.assert_array_equal(np.asarray(lg1), np.asarray(lg0))   # forward: bit for bit
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), gp1, gp0)
  for coll, (lk0, g0), (lk1, g1) in ((task.dd, (a0, gd0), (a1, gd1)),
                                     (task.rest, (b0, gr0), (b1, gr1))):
    t0, t1 = coll.dense_gradients(lk0, g0), coll.dense_gradients(lk1, g1)
    for n in t0:
      assert np.abs(t0[n]).max() > 0
      np.testing.assert_allclose(t1[n], t0[n], rtol=1e-5, atol=1e-6 * np.abs(t0[n]).max(),
                                 err_msg=n)
  if not train_step:
    return
  step = jax.jit(task.train_step)
  s0, m0 = step(state, plain)
  s1, m1 = step(task.init_state(0), dd)
  assert float(m1["recd_fallback"]) == 0 and float(m0["recd_fallback"]) == 1
  a, b = task.to_tables(s0["emb"]), task.to_tables(s1["emb"])
  for n in a:
    np.testing.assert_allclose(b[n], a[n], rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.devices(8)
def test_dedup_equals_plain_a2a_and_rw():
  """Table-wise (all-to-all) and row-wise (all-gather / reduce-scatter) patterns."""
  _check_equal(_task(mesh_lib.make_mesh("data:2,model:4"), ("tw", "rw")), train_step=False)


@pytest.mark.slow
@pytest.mark.devices(8)
def test_dedup_equals_plain_every_kind_and_train_step():
  _check_equal(_task(mesh_lib.make_mesh("data:2,model:4")), train_step=True)


@pytest.mark.devices(8)
def test_capacity_overflow_falls_back_or_errors():
  mesh = mesh_lib.make_mesh("data:8")
  host = _batch()
  host.lengths[:4, 0] = [0, 1, 2, 3]       # shard 0: 4 distinct bags of C1 > capacity 2
  task = _task(mesh, ("dp",), capacity=2)
  b = task.device_batch(host)
  assert isinstance(b, SparseBatch) and task.fallbacks == 1
  with pytest.raises(recd.CapacityError, match=r"feature 0 has 4 distinct bags in shard 0"):
    _task(mesh, ("dp",), capacity=2, on_overflow="error").device_batch(host)


def test_dedup_numpy_reference():
  host = _batch()
  d = recd.dedup(host, capacity=32)
  for b in range(32):
    for f in range(5):
      u = d.inverse[b, f]
      n = host.lengths[b, f]
      assert d.lengths[u, f] == n
      np.testing.assert_array_equal(d.ids[u, f, :n], host.ids[b, f, :n])
      np.testing.assert_array_equal(d.weights[u, f, :n], host.weights[b, f, :n])
  assert d.num_unique[0, 1] == 32 and d.num_unique[0, 0] <= 16
