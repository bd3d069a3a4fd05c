"""DMT (rec/models/dmt.py, the collection's sptt kind, rec/embedding/towers.py): training
through SPTT equals the plain tower model with the same weights on 8 devices, forward and
backward; SPTT without a tower module is the plain lookup; the planner places towers; the
partitioner balances cost and groups similar features."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from core import mesh as mesh_lib
from rec.data.batch import SparseBatch
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding import towers as towers_lib
from rec.embedding.collection import EmbeddingCollection
from rec.models.dmt import DMTConfig, DMTModel
from rec.train_lib import RecTask

ROWS = (13, 40, 7, 25, 31, 9)
D, LR = 4, 0.1


def _batch(B=16, L=3, seed=0):
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, r, (B, L)) for r in ROWS], 1).astype(np.int32)
  return SparseBatch(rng.standard_normal((B, 3)).astype(np.float32), ids,
                     rng.integers(0, L + 1, (B, len(ROWS))).astype(np.int32),
                     (rng.random(B) < 0.3).astype(np.float32), np.ones(B, np.float32),
                     rng.uniform(0.5, 1.5, ids.shape).astype(np.float32))


def _task(cfg, plan, mesh):
  coll = EmbeddingCollection(cfg.tables(), plan, mesh, opt_lib.get_sparse_optimizer("sgd", LR))
  return RecTask(lambda r: DMTModel(cfg, r), coll, optax.sgd(LR), mesh)


def _check_sptt_trains_as_plain(towers):
  cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=towers, tower_k=2, bottom_mlp=(8, D),
                  top_mlp=(8, 1), rows_per_feature=ROWS)
  mesh = mesh_lib.make_mesh("data:2,model:4")           # 2 tower groups of 4 devices
  sptt = _task(cfg, planner_lib.tower_plan(cfg.tables(), cfg.towers, 8), mesh)
  one = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  plain = _task(cfg, {t.name: planner_lib.TablePlacement("tw", (0,)) for t in cfg.tables()}, one)
  assert sptt.collection.towers == cfg.towers
  assert [g.comm for g in sptt.collection.groups.values()] == ["sptt"]
  host = _batch()
  rng = np.random.default_rng(0)    # random dense weights: no model init to compile
  shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: DMTModel(cfg, nnx.Rngs(0)))))
  params = jax.tree.map(lambda a: 0.3 * rng.standard_normal(a.shape).astype(a.dtype), shapes)
  state = {"step": np.int32(0), "params": params, "opt": plain.dense_tx.init(params),
           "emb": plain.collection.init(jax.random.key(0))}

  # Forward and backward: the plain model's loss, logits and gradients, on one device.
  l0, lg0, lk0, gp0, gs0 = jax.jit(plain.loss_and_grads)(state, plain.device_batch(host))[:5]
  g0 = plain.collection.dense_gradients(lk0, gs0)
  # SPTT, from the same state: loss, logits, gradients, and one train step (SGD: each row
  # and weight moves by -lr x its gradient).
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  before = plain.collection.to_tables(state["emb"])
  s1 = {k: jax.tree.map(lambda x: jax.device_put(x, rep), state[k])
        for k in ("step", "params", "opt")} | {"emb": sptt.collection.from_tables(before)}
  l1, lg1, lk1, gp1, gs1 = jax.jit(sptt.loss_and_grads)(s1, sptt.device_batch(host))[:5]
  np.testing.assert_allclose(np.asarray(lg1), np.asarray(lg0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  towers_grad = jax.tree.leaves(gp1["towers"])
  assert all(np.abs(np.asarray(g)).max() > 0 for g in towers_grad)   # every tower's module
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), gp1, gp0)
  g1 = sptt.collection.dense_gradients(lk1, gs1)
  for name in g0:
    assert np.abs(g0[name]).max() > 0
    np.testing.assert_allclose(g1[name], g0[name], rtol=1e-5,
                               atol=1e-6 * np.abs(g0[name]).max(), err_msg=name)
  new, _ = jax.jit(sptt.train_step)(s1, sptt.device_batch(host))
  for name, t in sptt.collection.to_tables(new["emb"]).items():
    np.testing.assert_allclose(t, before[name] - LR * g0[name], rtol=1e-5, atol=1e-7,
                               err_msg=name)


@pytest.mark.devices(8)
def test_sptt_trains_as_plain_model():
  _check_sptt_trains_as_plain(((0, 3, 5), (1, 2, 4)))


@pytest.mark.slow
@pytest.mark.devices(8)
def test_sptt_trains_as_plain_model_uneven_towers():
  _check_sptt_trains_as_plain(((5,), (0, 1, 2, 3, 4)))    # padded tower slots, a 1-feature tower


@pytest.mark.devices(8)
def test_sptt_without_tower_module_is_the_plain_lookup():
  """Any model can sit on sptt tables: pool without towers gives emb_BFD in table order."""
  from rec.embedding.config import TableConfig
  tables = [TableConfig(f"C{i + 1}", r, D) for i, r in enumerate(ROWS)]
  mesh = mesh_lib.make_mesh("data:2,model:4")
  plan = planner_lib.tower_plan(tables, [[5], [0, 1, 2, 3, 4]], 8)
  coll = EmbeddingCollection(tables, plan, mesh, opt_lib.get_sparse_optimizer("sgd", LR))
  full = {t.name: np.random.default_rng(i).standard_normal((t.num_rows, D)).astype(np.float32)
          for i, t in enumerate(tables)}
  host = _batch(L=2)
  emb = np.asarray(jax.jit(coll.lookup)(coll.from_tables(full), host.ids, host.lengths,
                                        host.weights))
  for f, t in enumerate(tables):
    live = np.arange(2)[None, :] < host.lengths[:, f, None]
    want = np.einsum("bl,bl,bld->bd", live, host.weights[:, f], full[t.name][host.ids[:, f]])
    np.testing.assert_allclose(emb[:, f], want, rtol=1e-5, atol=1e-6, err_msg=t.name)


def test_sptt_needs_matching_towers_mesh_and_model():
  from rec.models.dlrm import DLRM, DLRMConfig
  cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=((0, 3, 5), (1, 2, 4)),
                  bottom_mlp=(8, D), top_mlp=(8, 1), rows_per_feature=ROWS)
  one = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  sgd = opt_lib.get_sparse_optimizer("sgd", LR)
  plan = planner_lib.tower_plan(cfg.tables(), cfg.towers, 1 * 2)
  with pytest.raises(ValueError, match=r"outside 0\.\.0"):
    EmbeddingCollection(cfg.tables(), plan, one, sgd)
  coll = EmbeddingCollection(cfg.tables(), planner_lib.tower_plan(cfg.tables(), [range(6)], 1),
                             one, sgd)
  assert coll.towers == ((0, 1, 2, 3, 4, 5),)
  with pytest.raises(ValueError, match=r"sptt towers \(\(0, 1, 2, 3, 4, 5\),\) .* same towers"):
    RecTask(lambda r: DMTModel(cfg, r), coll, optax.sgd(LR), one)
  flat = DLRMConfig(num_dense=3, num_sparse=6, embedding_dim=D, bottom_mlp=(8, D),
                    top_mlp=(8, 1), rows_per_feature=ROWS)
  with pytest.raises(ValueError, match="tower_transform"):
    RecTask(lambda r: DLRM(flat, r), coll, optax.sgd(LR), one)
  mixed = dict(planner_lib.tower_plan(cfg.tables(), [range(6)], 1))
  mixed["C1"] = planner_lib.TablePlacement("tw", (0,))
  with pytest.raises(ValueError, match=r"tables \['C1'\] are placed otherwise"):
    EmbeddingCollection(cfg.tables(), mixed, one, sgd)


def test_tower_plan_places_towers_on_groups_within_budget():
  tables = DMTConfig(num_dense=3, embedding_dim=D, towers=((0, 3, 5), (1, 2, 4)),
                     bottom_mlp=(8, D), top_mlp=(8, 1), rows_per_feature=ROWS).tables()
  plan = planner_lib.tower_plan(tables, [[0, 3, 5], [1, 2, 4]], 8)
  assert {n: p.devices for n, p in plan.items() if p.kind == planner_lib.SPTT} == {
      "C1": (0, 1, 2, 3), "C4": (0, 1, 2, 3), "C6": (0, 1, 2, 3),
      "C2": (4, 5, 6, 7), "C3": (4, 5, 6, 7), "C5": (4, 5, 6, 7)}
  est = planner_lib.estimate_plan(plan, tables, 8, 64)
  # Group 1 holds C2 (40 rows), C3 (7), C5 (31) in shards of ceil(R / 4): device 4 has
  # 10 + 2 + 8 rows of 4 floats + 4 optimizer bytes.
  assert est.per_device.memory_bytes[4] == (10 + 2 + 8) * (4 * 4 + 4)
  with pytest.raises(planner_lib.PlanError, match=r"tower 1 \(tables \['C2', 'C3', 'C5'\]\)"):
    planner_lib.tower_plan(tables, [[0, 3, 5], [1, 2, 4]], 8, memory_budget_bytes=300)
  with pytest.raises(ValueError, match="must split the 6 tables"):
    planner_lib.tower_plan(tables, [[0, 3], [1, 2, 4]], 8)
  with pytest.raises(ValueError, match="auto planner does not choose it"):
    planner_lib.plan(tables, 8, 10**9, 64, kinds=["sptt"])
  with pytest.raises(ValueError, match="sptt needs a contiguous, aligned block"):
    planner_lib.validate_plan({**plan, "C1": planner_lib.TablePlacement("sptt", (1, 2, 3, 4))},
                              tables, 8)


def test_model_tower_transform_equals_tower_outputs():
  """The switch over tower modules on padded slots (what SPTT runs in a group) gives each
  tower's output of DMTModel.tower_outputs."""
  cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=((5,), (0, 1, 2, 3, 4)),
                  bottom_mlp=(8, D), top_mlp=(8, 1), rows_per_feature=ROWS)
  rng = np.random.default_rng(0)
  graphdef, shapes = nnx.split(nnx.eval_shape(lambda: DMTModel(cfg, nnx.Rngs(0))))
  model = nnx.merge(graphdef, jax.tree.map(   # any weights will do (no init to compile)
      lambda a: rng.standard_normal(a.shape).astype(a.dtype), shapes))
  emb = rng.standard_normal((4, 6, D)).astype(np.float32)
  fn, params = model.tower_transform()
  slots = np.zeros((2, 4, 5, D), np.float32)            # [T, B, Fm, D], Fm = 5
  for t, feats in enumerate(cfg.towers):
    slots[t, :, :len(feats)] = emb[:, list(feats)]
  want, got = jax.jit(lambda e, s: (model.tower_outputs(e), jax.vmap(
      fn, in_axes=(None, 0, 0))(params, np.arange(2), s)))(emb, slots)
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(want).reshape(4, 2, 3, D).transpose(1, 0, 2, 3),
                             rtol=1e-6, atol=1e-6)


def test_config_refuses_non_positive_layer_sizes():
  """Named at the config (the field), not later by an anonymous MLP."""
  with pytest.raises(ValueError, match=r"DMTConfig: bottom_mlp=\(0, 4\), top_mlp=\(8, 1\); "
                                       "expected positive layer sizes"):
    DMTConfig(num_dense=3, embedding_dim=D, towers=((0,), (1,)), bottom_mlp=(0, D),
              top_mlp=(8, 1), rows_per_feature=ROWS[:2])
  with pytest.raises(ValueError, match=r"top_mlp=\(-2, 1\)"):
    DMTConfig(num_dense=3, embedding_dim=D, towers=((0,), (1,)), bottom_mlp=(8, D),
              top_mlp=(-2, 1), rows_per_feature=ROWS[:2])


def test_partition_balances_and_groups():
  # Two blocks of mutually similar features; equal costs.
  sim = np.full((6, 6), 0.1)
  for blk in ([0, 2, 4], [1, 3, 5]):
    sim[np.ix_(blk, blk)] = 0.9
  towers = towers_lib.partition(sim, [1.0] * 6, 2)
  assert sorted(map(tuple, towers)) == [(0, 2, 4), (1, 3, 5)]
  # Cost balance: a big feature gets a tower of its own.
  towers = towers_lib.partition(sim, [10, 1, 1, 1, 1, 1], 2, slack=0.0)
  assert [0] in towers
  assert sorted(f for t in towers for f in t) == list(range(6))
  e = np.random.default_rng(0).standard_normal((32, 4, 3))
  e[:, 1] = 2 * e[:, 0]
  s = towers_lib.feature_similarity(e)
  assert s[0, 1] == pytest.approx(1.0) and s[0, 2] < 0.9
  r = towers_lib.random_partition(7, 3, seed=1)
  assert sorted(f for t in r for f in t) == list(range(7)) and sorted(map(len, r)) == [2, 2, 3]


def test_partition_leaves_no_tower_empty():
  # Two similar pairs that fit a tower's cost cap (1.1 * 8 / 4 = 2.2) together: grouping
  # them filled three towers and left the fourth empty, which tower_plan and DMTConfig
  # reject. The last features go to the empty towers instead.
  sim = np.full((5, 5), 0.1)
  sim[1, 2] = sim[2, 1] = sim[3, 4] = sim[4, 3] = 0.9
  towers = towers_lib.partition(sim, [4, 1, 1, 1, 1], 4)
  assert towers == [[0], [1, 2], [3], [4]]
  planner_lib.tower_plan(DMTConfig(num_dense=3, embedding_dim=D, towers=towers,
                                   bottom_mlp=(8, D), top_mlp=(8, 1),
                                   rows_per_feature=ROWS[:5]).tables(),
                         towers, 4)
