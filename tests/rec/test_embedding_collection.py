"""Sharded embedding collection on 8 simulated devices against the 1-device reference.

For every sharding kind: pooled forward, full-table gradients, and tables after 5 sparse
optimizer steps equal the single-device run (fp32), with uneven row splits, multi-hot
bags, per-id weights, sum and mean pooling.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import TableConfig
from rec.embedding.planner import TablePlacement
from tests import peer_env
from tests.peer_env import peer_python

# Row counts chosen so that no table splits evenly over 8 devices or a 4-device group.
TABLES = [TableConfig(f"t{i}", r, 8, pooling=("mean" if i % 2 else "sum"))
          for i, r in enumerate([37, 50, 13, 101, 5, 64])]
B, L = 16, 3


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, t.num_rows, (B, L)) for t in TABLES], 1).astype(np.int32)
  # Skewed so duplicates are common; some bags empty, padding slots hold garbage ids.
  ids[:, :, 0] = ids[:, :, 0] % 3
  lengths = rng.integers(0, L + 1, (B, len(TABLES))).astype(np.int32)
  ids = np.where(np.arange(L) < lengths[..., None], ids, 10**6)  # padding never looked up
  weights = rng.uniform(0.5, 1.5, (B, len(TABLES), L)).astype(np.float32)
  target = rng.normal(size=(B, len(TABLES), 8)).astype(np.float32)
  return ids, lengths, weights, target


PLANS = {
    "dp": lambda i: TablePlacement("dp", tuple(range(8))),
    "tw": lambda i: TablePlacement("tw", ((3 * i) % 8,)),
    "rw": lambda i: TablePlacement("rw", tuple(range(8))),
    "cw": lambda i: TablePlacement("cw", (i % 8, (i + 2) % 8, (i + 5) % 8)),   # widths 3, 3, 2
    "twrw": lambda i: TablePlacement("twrw", tuple(range(4 * (i % 2), 4 * (i % 2) + 4))),
    "mixed": lambda i: [PLANS[k](i) for k in ("dp", "tw", "rw", "cw", "twrw")][i % 5],
}


def _run(mesh, plan, opt, steps=5):
  coll = EmbeddingCollection(TABLES, plan, mesh, opt)
  state = coll.init(jax.random.key(0))
  ids, lengths, weights, target = _batch()
  coll.check_ids(np.where(np.arange(L) < lengths[..., None], ids, 0), lengths)
  bi, bl, bw, bt = mesh_lib.shard_batch((ids, lengths, weights, target), mesh, mesh_lib.REC_RULES)

  @jax.jit
  def step(state, s):
    lk = coll.gather(state, bi, bl, bw)

    def loss(partial):
      emb = coll.pool(lk, partial)
      return jnp.sum((emb - bt) ** 2 * jnp.arange(1, 9)), emb

    (_, emb), g = jax.value_and_grad(loss, has_aux=True)(lk.partial)
    return coll.apply_gradients(state, lk, g, s), emb, lk, g

  embs, grads = [], []
  for s in range(steps):
    state, emb, lk, g = step(state, jnp.int32(s))
    embs.append(np.asarray(emb))
    grads.append(coll.dense_gradients(lk, g))
  return coll, state, embs, grads


@pytest.fixture(scope="module")
def mesh8():
  return mesh_lib.make_mesh("data:2,model:4")


@pytest.fixture(scope="module")
def mesh1():
  return mesh_lib.make_mesh("data:1", jax.devices()[:1])


OPTS = {"adagrad": opt_lib.get_sparse_optimizer("adagrad", 0.1),
        "rowwise_adagrad": opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.1)}


@pytest.mark.devices(8)
@pytest.mark.parametrize("opt_name", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("kind", list(PLANS))
def test_sharded_equals_single_device(kind, opt_name, mesh8, mesh1):
  if kind in ("cw", "mixed") and opt_name == "rowwise_adagrad":
    pytest.skip("row-wise Adagrad keeps one accumulator per row per column chunk under cw "
                "(as TorchRec does), so cw differs from one device by design")
  opt = OPTS[opt_name]
  ref_plan = {t.name: TablePlacement("tw", (0,)) for t in TABLES}
  _, ref_state, ref_embs, ref_grads = _run(mesh1, ref_plan, opt)
  coll, state, embs, grads = _run(mesh8, {t.name: PLANS[kind](i) for i, t in enumerate(TABLES)}, opt)
  assert embs[0].shape == (B, len(TABLES), 8)
  for a, b in zip(embs, ref_embs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for ga, gb in zip(grads, ref_grads):
    for n in gb:  # summation order differs: absolute tolerance scaled to the gradient size
      np.testing.assert_allclose(ga[n], gb[n], rtol=1e-5, atol=1e-6 * np.abs(gb[n]).max(), err_msg=n)
  ref_coll = EmbeddingCollection(TABLES, ref_plan, mesh1, opt)
  ref_tables = ref_coll.to_tables(ref_state)
  tables = coll.to_tables(state)
  for n in tables:
    np.testing.assert_allclose(tables[n], ref_tables[n], rtol=1e-5, atol=1e-6, err_msg=n)
    # The run really trained: tables moved from their initial values.
  init = ref_coll.init_tables(jax.random.key(0))
  assert any(not np.allclose(tables[n], np.asarray(init[n])) for n in tables)


@pytest.mark.devices(8)
def test_pooling_matches_numpy(mesh8):
  """Forward against an explicit numpy embedding bag (weights, sum / mean, padding)."""
  coll = EmbeddingCollection(TABLES, {t.name: PLANS["mixed"](i) for i, t in enumerate(TABLES)},
                             mesh8, OPTS["adagrad"])
  state = coll.init(jax.random.key(0))
  full = {k: np.asarray(v) for k, v in coll.init_tables(jax.random.key(0)).items()}
  ids, lengths, weights, _ = _batch()
  batch = mesh_lib.shard_batch((ids, lengths, weights), mesh8, mesh_lib.REC_RULES)
  emb = np.asarray(jax.jit(coll.lookup)(state, *batch))
  for b in range(B):
    for f, t in enumerate(TABLES):
      acc = np.zeros(8)
      for l in range(lengths[b, f]):
        acc += weights[b, f, l] * full[t.name][ids[b, f, l]]
      if t.pooling == "mean" and lengths[b, f]:
        acc /= lengths[b, f]
      np.testing.assert_allclose(emb[b, f], acc, rtol=1e-5, atol=1e-6)


@pytest.mark.devices(8)
def test_round_trip_layout(mesh8):
  coll = EmbeddingCollection(TABLES, {t.name: PLANS["mixed"](i) for i, t in enumerate(TABLES)},
                             mesh8, OPTS["adagrad"])
  full = coll.init_tables(jax.random.key(3))
  back = coll.to_tables(coll.from_tables(full))
  for n in full:
    np.testing.assert_array_equal(back[n], np.asarray(full[n]))
  # Tables of another shape (another checkpoint's rows or dim) are refused, by name: sliced
  # into the shards silently, rows would be cut off or left zero, columns dropped.
  with pytest.raises(ValueError, match=r"table 't1' is shaped \(49, 8\), expected \[rows, "
                     r"dim\] = \(50, 8\)"):
    coll.from_tables({**full, "t1": full["t1"][:49]})
  with pytest.raises(ValueError, match=r"table 't2' is shaped \(13, 9\)"):
    coll.from_tables({**full, "t2": np.zeros((13, 9), np.float32)})
  with pytest.raises(ValueError, match=r"table 't3' is missing.*tables \['t9'\] are not"):
    coll.from_tables({**{k: v for k, v in full.items() if k != "t3"}, "t9": full["t3"]})


def test_out_of_range_ids(mesh1):
  plan = {t.name: TablePlacement("tw", (0,)) for t in TABLES}
  coll = EmbeddingCollection(TABLES, plan, mesh1, OPTS["adagrad"])
  ids, lengths, _, _ = _batch()
  ids = np.where(np.arange(L) < lengths[..., None], ids, 0)
  ids[2, 4, 0], lengths[2, 4] = 5, 1   # table t4 has 5 rows: id 5 is out of range
  with pytest.raises(ValueError, match=r"feature 't4': id 5 at example 2.*rows \[0, 5\)"):
    coll.check_ids(ids, lengths)
  ids[2, 4, 0] = -1
  with pytest.raises(ValueError, match="id -1"):
    coll.check_ids(ids, lengths)
  # Documented alternative: hash into range (id mod rows), inside the step.
  hashed = EmbeddingCollection(TABLES, plan, mesh1, OPTS["adagrad"], out_of_range="hash")
  state = hashed.init(jax.random.key(0))
  ids[2, 4, 0] = 5 + 2
  emb = np.asarray(hashed.lookup(state, ids, lengths))
  full = np.asarray(hashed.init_tables(jax.random.key(0))["t4"])
  np.testing.assert_allclose(emb[2, 4], full[2], rtol=1e-6)


@pytest.mark.devices(8)
def test_unchecked_out_of_range_ids_read_and_update_no_row_under_any_kind(mesh8, mesh1):
  # A batch that skips check_ids (drawn on device) with ids past its table's rows, or
  # negative: every kind reads nothing for them (coefficient 0) and updates no row. dp used
  # to read and train the next table's first row (id 5 of t4 -> row 0 of t5) or clip.
  ids, lengths, weights, target = _batch()
  ids = np.where(np.arange(L) < lengths[..., None], ids, 0)
  lengths[:4] = L
  ids[0, 4, 0], ids[1, 4, 1], ids[2, 5, 2], ids[3, 0, 0] = 5, 7, 64, -1
  opt = opt_lib.get_sparse_optimizer("sgd", 1.0)

  def run(mesh, plan):
    coll = EmbeddingCollection(TABLES, plan, mesh, opt)
    state = coll.init(jax.random.key(0))
    bi, bl, bw, bt = mesh_lib.shard_batch((ids, lengths, weights, target), mesh,
                                          mesh_lib.REC_RULES)

    @jax.jit
    def step(state):
      lk = coll.gather(state, bi, bl, bw)
      emb, vjp = jax.vjp(lambda p: coll.pool(lk, p), lk.partial)
      return emb, coll.apply_gradients(state, lk, vjp(bt)[0], jnp.int32(0))

    emb, state = step(state)
    return np.asarray(emb), coll.to_tables(state)

  ref_emb, ref_tables = run(mesh1, {t.name: TablePlacement("tw", (0,)) for t in TABLES})
  for kind in ("dp", "mixed"):    # mixed: dp beside tw, rw, cw, twrw in one collection
    emb, tables = run(mesh8, {t.name: PLANS[kind](i) for i, t in enumerate(TABLES)})
    np.testing.assert_allclose(emb, ref_emb, rtol=1e-5, atol=1e-6, err_msg=kind)
    for n in tables:   # one SGD step of lr 1: the step is the summed gradient, order aside
      np.testing.assert_allclose(tables[n], ref_tables[n], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{kind} {n}")


def test_check_lengths_refuses_bags_outside_the_id_slots(mesh1):
  # A bag longer than the batch's L id slots sums L ids but a mean would divide by its
  # length; a negative length is no bag. Both are refused, naming feature and example.
  coll = EmbeddingCollection(TABLES, {t.name: TablePlacement("tw", (0,)) for t in TABLES},
                             mesh1, OPTS["adagrad"])
  _, lengths, _, _ = _batch()
  coll.check_lengths(lengths, L)
  lengths[5, 3] = L + 1
  with pytest.raises(ValueError, match=r"feature 't3': a bag of length 4 at example 5, "
                     r"expected 0..3"):
    coll.check_lengths(lengths, L)
  lengths[5, 3], lengths[2, 1] = 0, -1
  with pytest.raises(ValueError, match=r"feature 't1': a bag of length -1 at example 2"):
    coll.check_lengths(lengths, L)


def test_hash_refuses_ids_wider_than_int32(mesh1):
  # out_of_range='hash' takes id mod rows on the device, of int32 ids: a raw 32-bit hash
  # such as 2**32 - 7 would wrap to -7 first (row 993, not 2**32 - 7 mod 1000 = 289).
  hashed = EmbeddingCollection(TABLES, {t.name: TablePlacement("tw", (0,)) for t in TABLES},
                               mesh1, OPTS["adagrad"], out_of_range="hash")
  ids, lengths, _, _ = _batch()
  ids = np.where(np.arange(L) < lengths[..., None], ids, 0).astype(np.int64)
  hashed.check_ids(ids + 2**31 - 200, lengths)       # out of range but int32: hashed
  ids[7, 2, 0], lengths[7, 2] = 2**32 - 7, 1
  with pytest.raises(ValueError, match=r"feature 't2': id 4294967289 at example 7, position 0 "
                     "does not fit int32"):
    hashed.check_ids(ids, lengths)
  ids[7, 2, 0], lengths[7, 2] = 2**32 - 7, 0       # padding: never read
  hashed.check_ids(ids, lengths)


@pytest.mark.devices(8)
def test_bad_plans(mesh8):
  with pytest.raises(ValueError, match="no placement for tables"):
    EmbeddingCollection(TABLES, {}, mesh8, OPTS["adagrad"])
  plan = {t.name: TablePlacement("tw", (9,)) for t in TABLES}
  with pytest.raises(ValueError, match="outside 0..7"):
    EmbeddingCollection(TABLES, plan, mesh8, OPTS["adagrad"])
  # Placements the planner never makes are refused as validate_plan does, not run over other
  # devices than they name (rw over all 8, a twrw block in the group its first device falls in).
  for kind, devs, why in [("rw", (0, 1, 2, 3), "rw needs all 8 devices"),
                          ("twrw", (1, 2, 3, 4), "twrw needs a contiguous, aligned block"),
                          ("tw", (0, 1), "tw needs exactly 1 device")]:
    plan = {t.name: TablePlacement("tw", (0,)) for t in TABLES} | {
        "t2": TablePlacement(kind, devs)}
    with pytest.raises(ValueError, match=re.escape(f"table 't2' placed {kind} on {devs}: {why}")):
      EmbeddingCollection(TABLES, plan, mesh8, OPTS["adagrad"])


@pytest.mark.devices(8)
@pytest.mark.parametrize("num_tables", [1, 2, 3])
def test_fewer_tables_than_devices_one_hot(num_tables, mesh8, mesh1):
  """Table-wise with one one-hot table per device: unit dims in the all-to-all buffers."""
  tables = [TableConfig(f"s{i}", 50, 8) for i in range(num_tables)]
  rng = np.random.default_rng(1)
  ids = rng.integers(0, 50, (B, num_tables, 1)).astype(np.int32)
  lengths = np.ones((B, num_tables), np.int32)

  def run(mesh, plan):
    coll = EmbeddingCollection(tables, plan, mesh, opt_lib.RowWiseAdagrad(0.1))
    state = coll.init(jax.random.key(0))
    bi, bl = mesh_lib.shard_batch((ids, lengths), mesh, mesh_lib.REC_RULES)
    return np.asarray(jax.jit(lambda s: coll.lookup(s, bi, bl, None))(state))

  one = run(mesh1, {t.name: TablePlacement("dp", (0,)) for t in tables})
  eight = run(mesh8, {t.name: TablePlacement("tw", (2 * i + 1,)) for i, t in enumerate(tables)})
  np.testing.assert_allclose(eight, one, rtol=1e-6)


_TORCH_BAGS = r'''
import sys
import numpy as np, torch
inp = dict(np.load(sys.argv[1]))
out = {}
for f, mode in enumerate(inp["modes"]):
    w = torch.tensor(inp[f"w{f}"], requires_grad=True)
    lens = inp["lengths"][:, f]
    ids = np.concatenate([inp["ids"][b, f, :n] for b, n in enumerate(lens)]).astype(np.int64)
    psw = np.concatenate([inp["weights"][b, f, :n] for b, n in enumerate(lens)])
    y = torch.nn.functional.embedding_bag(
        torch.from_numpy(ids), w, torch.from_numpy(np.concatenate([[0], np.cumsum(lens)[:-1]])),
        mode=str(mode), per_sample_weights=torch.from_numpy(psw) if mode == "sum" else None)
    (y * torch.from_numpy(inp["target"][:, f])).sum().backward()
    out[f"y{f}"], out[f"g{f}"] = y.detach().numpy(), w.grad.numpy()
np.savez(sys.argv[2], **out)
'''


@pytest.mark.peer
@pytest.mark.devices(8)
def test_pooling_and_gradients_match_torch_embedding_bag(mesh8, tmp_path):
  """The mixed plan on 8 devices against torch's embedding_bag per table (peer environment):
  sum with per-sample weights, mean (torch takes no weights with it: ours are ones there),
  empty bags (zeros under both), the table gradients of sum(emb * target)."""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  ids, lengths, weights, target = _batch()
  ids = np.where(np.arange(L) < lengths[..., None], ids, 0)
  mean = np.asarray([t.pooling == "mean" for t in TABLES])
  weights[:, mean] = 1.0
  coll = EmbeddingCollection(TABLES, {t.name: PLANS["mixed"](i) for i, t in enumerate(TABLES)},
                             mesh8, OPTS["adagrad"])
  full = coll.init_tables(jax.random.key(0))
  np.savez(tmp_path / "in.npz", ids=ids, lengths=lengths, weights=weights, target=target,
           modes=np.asarray([t.pooling for t in TABLES]),
           **{f"w{f}": full[t.name] for f, t in enumerate(TABLES)})
  peer_env.run_script(peer, _TORCH_BAGS, tmp_path, "torch")
  ref = dict(np.load(tmp_path / "out.npz"))
  bi, bl, bw, bt = mesh_lib.shard_batch((ids, lengths, weights, target), mesh8,
                                        mesh_lib.REC_RULES)

  @jax.jit
  def run(state):
    lk = coll.gather(state, bi, bl, bw)
    emb, vjp = jax.vjp(lambda p: coll.pool(lk, p), lk.partial)
    return emb, lk, vjp(bt)[0]

  emb, lk, g = run(coll.from_tables(full))
  grads = coll.dense_gradients(lk, g)
  # float32 sums of <= 3 terms of |w x| < 0.5 (emb) and of <= B*L terms of |w t| < 6
  # (gradients), in each side's own order: a few ulps of those magnitudes.
  for f, t in enumerate(TABLES):
    np.testing.assert_allclose(np.asarray(emb)[:, f], ref[f"y{f}"], rtol=0, atol=1e-6,
                               err_msg=t.name)
    np.testing.assert_allclose(grads[t.name], ref[f"g{f}"], rtol=0, atol=2e-5, err_msg=t.name)
  assert (lengths == 0).any() and np.abs(ref["y0"]).max() > 0
