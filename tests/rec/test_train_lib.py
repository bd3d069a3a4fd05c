"""RecTask (rec/train_lib.py): the train step's `grad_norm` is the norm of the dense gradients
and of the pooled embeddings' gradient, as computed by hand on one device, and the same
under every sharding plan, with RecD, under DMT's towers and with ExFM's loss terms."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from core import mesh as mesh_lib
from rec import distill
from rec.data import dedup as dedup_lib
from rec.data.batch import SparseBatch
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.planner import TablePlacement
from rec.models.dlrm import DLRM, DLRMConfig
from rec.models.dmt import DMTConfig, DMTModel
from rec.train_lib import RecTask

ROWS = (37, 50, 13, 101, 5, 64)   # no table splits evenly over 8 devices or a 4-device group
D, B, L, LR = 4, 16, 3, 0.1
CFG = DLRMConfig(num_dense=3, num_sparse=len(ROWS), embedding_dim=D, bottom_mlp=(8, D),
                 top_mlp=(8, 1), rows_per_feature=ROWS)
PLANS = {
    "dp": lambda i: TablePlacement("dp", tuple(range(8))),
    "tw": lambda i: TablePlacement("tw", ((3 * i) % 8,)),
    "rw": lambda i: TablePlacement("rw", tuple(range(8))),
    "twrw": lambda i: TablePlacement("twrw", tuple(range(4 * (i % 2), 4 * (i % 2) + 4))),
    "cw": lambda i: TablePlacement("cw", (i % 8, (i + 2) % 8)),
}
# The same gradients summed in another order (the dense all-reduce over 8 batch shards, a
# row-sharded bag's partial sums): each entry moves by a few float32 roundings of its
# terms, ~1e-7 relative, and so does a norm of them; a plan counting a row-sharded bag's
# gradient once per shard (4 or 8 times) moves it by percents here.
RTOL = 1e-5


def _batch(seed=0):
  """Multi-hot bags with per-id weights, empty bags, padding rows; features 0 and 1 repeat
  within each pair of examples (a batch shard on 8 devices), so RecD has bags to share."""
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, r, (B, L)) for r in ROWS], 1).astype(np.int32)
  lengths = rng.integers(0, L + 1, (B, len(ROWS))).astype(np.int32)
  weights = rng.uniform(0.5, 1.5, ids.shape).astype(np.float32)
  for x in (ids, lengths, weights):
    x[1::2, :2] = x[0::2, :2]
  return SparseBatch(rng.standard_normal((B, 3)).astype(np.float32), ids, lengths,
                     (rng.random(B) < 0.4).astype(np.float32),
                     np.r_[np.ones(B - 2), np.zeros(2)].astype(np.float32), weights)


def _task(plan, mesh, model_fn=lambda r: DLRM(CFG, r), tables=CFG.tables(), dedup=None,
          spec=None):
  coll = EmbeddingCollection(tables, plan, mesh, opt_lib.get_sparse_optimizer("sgd", LR),
                             dedup=dedup)
  return RecTask(model_fn, coll, optax.sgd(LR), mesh, distill=spec)


def _one_device(tables):
  one = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  return {t.name: TablePlacement("tw", (0,)) for t in tables}, one


def _on_mesh(task, task1, state1):
  """task1's state `state1` placed for `task` (dense state replicated, tables laid out)."""
  host = jax.device_get({k: state1[k] for k in ("step", "params", "opt")})
  state = jax.device_put(host, NamedSharding(task.mesh, jax.P()))
  state["emb"] = task.collection.from_tables(task1.collection.to_tables(state1["emb"]))
  return state


@functools.cache
def _reference():
  """One device: the state, and grad_norm by hand: jax.grad of the mean BCE w.r.t. the
  dense parameters and the pooled embeddings emb_BFD."""
  task = _task(*_one_device(CFG.tables()))
  state = task.init_state(0)
  batch = task.device_batch(_batch())
  emb = task.collection.lookup(state["emb"], batch.ids, batch.lengths, batch.weights)

  def loss(params, emb):
    logits = task.logits(params, batch.dense, emb)
    per_ex = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
    return jnp.sum(per_ex * batch.mask) / jnp.sum(batch.mask)

  g_params, g_emb = jax.grad(loss, argnums=(0, 1))(state["params"], emb)
  sq = sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(g_params))
  emb_sq = np.sum(np.asarray(g_emb, np.float64) ** 2)
  # Counting the embeddings' gradient twice (a bag on 2 row shards) would move the norm
  # far past the tolerance.
  assert np.sqrt(1 + emb_sq / (sq + emb_sq)) - 1 > 100 * RTOL
  _, metrics = jax.jit(task.train_step)(state, batch)
  return task, state, float(np.sqrt(sq + emb_sq)), float(metrics["grad_norm"])


def test_grad_norm_on_one_device_is_the_pooled_gradients_norm():
  _, _, want, got = _reference()
  np.testing.assert_allclose(got, want, rtol=RTOL)


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind", ["dp", "tw", "rw", "twrw", "cw", "rw_dedup"])
def test_grad_norm_is_the_same_under_every_plan(kind):
  """The same model, state and batch report one grad_norm under every plan (a row-sharded
  bag's gradient counted once, not once per shard; RecD's distinct bags the samples' own),
  and skip_nonfinite reads that figure."""
  task1, state1, want, _ = _reference()
  dedup = dedup_lib.DedupSpec(("C1", "C2")) if kind.endswith("_dedup") else None
  plan = {t.name: PLANS[kind.split("_")[0]](i) for i, t in enumerate(CFG.tables())}
  task = _task(plan, mesh_lib.make_mesh("data:8"), dedup=dedup)
  batch = task.device_batch(_batch())
  assert dedup is None or batch.dedup is not None
  _, metrics = jax.jit(functools.partial(task.train_step, skip_nonfinite=True))(
      _on_mesh(task, task1, state1), batch)
  np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=RTOL)
  assert float(metrics["skipped"]) == 0.0


@pytest.mark.devices(8)
def test_grad_norm_under_sptt_towers_equals_one_device():
  """DMT's SPTT (4 devices per tower group) reports the plain tower model's grad_norm on
  one device, not each bag's gradient once per row shard of its group."""
  cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=((0, 3, 5), (1, 2, 4)), tower_k=2,
                  bottom_mlp=(8, D), top_mlp=(8, 1), rows_per_feature=ROWS)
  model_fn = lambda r: DMTModel(cfg, r)
  task1 = _task(*_one_device(cfg.tables()), model_fn, cfg.tables())
  state1 = task1.init_state(0)
  sptt = _task(planner_lib.tower_plan(cfg.tables(), cfg.towers, 8),
               mesh_lib.make_mesh("data:2,model:4"), model_fn, cfg.tables())
  assert sptt.collection.tower_size == 4
  _, m1 = jax.jit(task1.train_step)(state1, task1.device_batch(_batch()))
  _, m8 = jax.jit(sptt.train_step)(_on_mesh(sptt, task1, state1), sptt.device_batch(_batch()))
  np.testing.assert_allclose(float(m8["grad_norm"]), float(m1["grad_norm"]), rtol=RTOL)


@pytest.mark.devices(8)
def test_grad_norm_of_a_distilled_student_under_rw_equals_one_device():
  """ExFM's loss terms (rec/distill.py) go through the same step: rw reports the one-device
  grad_norm."""
  spec = distill.DistillSpec(kd_weight=0.3, aux_weight=0.7, aux_mlp=(6,), adapter=True,
                             adapter_mlp=(5,))
  model_fn = distill.student_fn(lambda r: DLRM(CFG, r), spec)
  host = dataclasses.replace(_batch(), teacher=np.linspace(-2, 2, B, dtype=np.float32))
  task1 = _task(*_one_device(CFG.tables()), model_fn, spec=spec)
  state1 = task1.init_state(0)
  rw = _task({t.name: PLANS["rw"](i) for i, t in enumerate(CFG.tables())},
             mesh_lib.make_mesh("data:8"), model_fn, spec=spec)
  _, m1 = jax.jit(task1.train_step)(state1, task1.device_batch(host))
  _, m8 = jax.jit(rw.train_step)(_on_mesh(rw, task1, state1), rw.device_batch(host))
  assert float(m8["loss_kd"]) > 0
  np.testing.assert_allclose(float(m8["grad_norm"]), float(m1["grad_norm"]), rtol=RTOL)
