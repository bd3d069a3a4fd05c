"""Packed documents train exactly like documents alone (WLB-LLM, arXiv 2503.17924).

Rows built by `llm.packing.to_lm_batch` carry segment ids and restarting positions, so with
document masking every document is computed as if alone: masked attention equals attention
over each document by itself (XLA, and ring attention on a cp:8 mesh with per-sequence and
per-document layouts), and LMTask's loss sum and gradients over a packed batch equal the sums
over the documents one at a time (each alone in an unpacked, right-padded row), on one device and
context parallel over 8 simulated devices with both layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from llm import train_lib
from llm.attention import attention_reference
from llm.attention.ring import ring_attention
from llm.config import get_config
from llm.data import LMBatch
from llm.packing import batch as B
from llm.packing import cp_shard as S

CFG = get_config("tiny")
T = 64
LENGTHS = [23, 9, 30, 40, 17]
ROWS = [[0, 1, 2], [3, 4]]          # 62 and 57 tokens: both rows end in padding
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _docs():
  rng = np.random.default_rng(0)
  return [rng.integers(0, CFG.vocab_size, size=l).astype(np.int32) for l in LENGTHS]


def _mesh(spec):
  n = 1 if spec == "data:1" else 8
  return mesh_lib.make_mesh(spec, devices=jax.devices()[:n])


def _doc_slices(batch):
  """[(row, doc index, natural-order token indices)] of the packed batch."""
  out = []
  for r, row in enumerate(ROWS):
    o = 0
    for i in row:
      out.append((r, i, np.arange(o, o + LENGTHS[i])))
      o += LENGTHS[i]
  return out


# ----------------------------------------------------------------------------- attention


@pytest.mark.devices(8)
@pytest.mark.parametrize("impl,mode", [("xla", None), ("pass_kv", "document"),
                                       ("pass_q", "document")])
def test_masked_attention_equals_per_document(impl, mode):
  batch = B.to_lm_batch(_docs(), ROWS, T)
  h, g, k = 4, 2, 8
  keys = jax.random.split(jax.random.key(0), 3)
  q = np.asarray(jax.random.normal(keys[0], (2, T, h, k)))
  kk = np.asarray(jax.random.normal(keys[1], (2, T, g, k)))
  v = np.asarray(jax.random.normal(keys[2], (2, T, g, k)))
  seg, pos = batch.segment_ids, batch.positions
  if impl == "xla":
    out, lse = jax.jit(functools.partial(attention_reference, causal=True))(
        q, kk, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
  else:
    # Ring attention shards contiguously: give it the layout itself (model_balances=False).
    _, orders, _ = S.layout_batch(batch, 8, mode, model_balances=False)
    perm = lambda x: np.take_along_axis(x, orders.reshape(orders.shape + (1,) * (x.ndim - 2)),
                                        axis=1)
    fn = jit(functools.partial(ring_attention, mesh=_mesh("cp:8"), variant=impl, causal=True))
    out, lse = fn(perm(q), perm(kk), perm(v), q_segment_ids=perm(seg), kv_segment_ids=perm(seg),
                  q_positions=perm(pos), kv_positions=perm(pos))
    out, lse = S.restore_order(out, orders), S.restore_order(lse, orders)
  ref = jax.jit(functools.partial(attention_reference, causal=True))
  for r, i, idx in _doc_slices(batch):
    want, want_lse = ref(q[r:r + 1, idx], kk[r:r + 1, idx], v[r:r + 1, idx])
    np.testing.assert_allclose(np.asarray(out)[r, idx], np.asarray(want)[0], rtol=1e-5,
                               atol=1e-5, err_msg=f"document {i}")
    np.testing.assert_allclose(np.asarray(lse)[r, idx], np.asarray(want_lse)[0], rtol=1e-5,
                               atol=1e-5)


# ----------------------------------------------------------------------------- training


@functools.lru_cache(maxsize=None)
def _grad_fn(task):
  return jit(jax.value_and_grad(lambda p, b: task.loss_sum(p, b)[0]))


def _loss_and_grads(task, params, batch):
  return _grad_fn(task)(params, task.device_batch(batch))


@pytest.fixture(scope="module")
def alone():
  """(params, loss sum, grads, targets) of the documents one at a time: one unpacked row per
  document, right-padded (causal: no token of a document sees the padding after it; the
  padding's targets are masked), no segment ids or positions."""
  task = train_lib.LMTask(CFG, train_lib.OptimConfig(), _mesh("data:1"))
  params = task.init_state(0)["params"]
  docs, width = _docs(), max(LENGTHS)
  inputs = np.zeros((len(docs), width), np.int32)
  targets = np.zeros_like(inputs)
  mask = np.zeros((len(docs), width), np.float32)
  for r, d in enumerate(docs):
    inputs[r, :len(d)], targets[r, :len(d) - 1], mask[r, :len(d) - 1] = d, d[1:], 1.0
  rows = LMBatch(inputs, targets, mask, np.broadcast_to(np.arange(width, dtype=np.int32),
                                                        inputs.shape).copy(),
                 np.ones_like(inputs))
  loss, grads = _loss_and_grads(task, params, rows)
  return params, float(loss), grads, int(mask.sum())


def _check(loss, grads, alone, n):
  _, want, want_grads, want_n = alone
  assert n == want_n
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                                                       atol=2e-5), grads, want_grads)


def test_packed_training_equals_documents_alone(alone):
  batch = B.to_lm_batch(_docs(), ROWS, T)
  task = train_lib.LMTask(CFG, train_lib.OptimConfig(), _mesh("data:1"), packed=True)
  loss, grads = _loss_and_grads(task, alone[0], batch)
  _check(loss, grads, alone, int(batch.mask.sum()))
  # Without document masking the same rows give another loss (the test can fail).
  merged = LMBatch(batch.inputs, batch.targets, batch.mask,
                   np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)).copy(),
                   np.ones((2, T), np.int32))
  other, _ = _loss_and_grads(task, alone[0], merged)
  assert abs(float(other) - alone[1]) > 1e-3


@pytest.fixture(scope="module")
def cp8(alone):
  """(LMTask with ring attention, pass-KV, over cp:8; the parameters placed for it)."""
  task = train_lib.LMTask(CFG.replace(attention_impl="xla", context_parallel="pass_kv"),
                          train_lib.OptimConfig(), _mesh("cp:8"), packed=True)
  return task, jax.device_put(alone[0], task.param_shardings)


@pytest.mark.devices(8)
def test_packed_ring_training_cp8_equals_documents_alone(alone, cp8):
  """LMTask with ring attention (pass-KV) over cp:8: the per-document layout (given in the
  order the model's own load balancing turns into it) and the per-sequence one."""
  batch = B.to_lm_batch(_docs(), ROWS, T)
  task, params = cp8
  for mode in ("document", "sequence"):
    laid, orders, got_mode = S.layout_batch(batch, 8, mode)
    assert got_mode == mode and (mode == "sequence") == bool(np.all(orders == np.arange(T)))
    loss, grads = _loss_and_grads(task, params, laid)
    _check(loss, grads, alone, int(batch.mask.sum()))


# ----------------------------------------------------------------------------- train_lm's source


def _alone_rows(docs, width):
  """One unpacked, right-padded row per document (no segment ids or positions)."""
  inputs = np.zeros((len(docs), width), np.int32)
  targets = np.zeros_like(inputs)
  mask = np.zeros((len(docs), width), np.float32)
  for r, d in enumerate(docs):
    inputs[r, :len(d)], targets[r, :len(d) - 1], mask[r, :len(d) - 1] = d, d[1:], 1.0
  return LMBatch(inputs, targets, mask, np.broadcast_to(np.arange(width, dtype=np.int32),
                                                        inputs.shape).copy(),
                 np.ones_like(inputs))


@pytest.mark.devices(8)
def test_wlb_source_batch_trains_like_its_documents_alone(alone, cp8):
  """A batch of `experiments.train_lm --packing=wlb --cp_sharding=doc` (PackedSource: Pile-
  shaped documents cut from a token array, WLB-LLM packing, per-document CP layout) through
  the cp:8 ring: loss sum and gradients equal those of its documents one at a time on one
  device."""
  from llm.packing.cost import Shape, flop_cost_model
  from llm.packing.lengths import CorpusLengths
  from llm.packing.source import PackedSource, PackingSpec
  task, params = cp8
  src = PackedSource(np.random.default_rng(1).integers(0, CFG.vocab_size, 4000),
                     CorpusLengths(context=4096, scale=T / 4096),
                     PackingSpec(packing="wlb", layout="document"),
                     seq_len=T, batch_size=2, cp=8, cost=flop_cost_model(Shape.from_config(CFG)),
                     seed=3)
  rows, batch = next(zip(src.steps(), src.batches(0)))
  docs = [src.document(i) for row in rows for i in row]
  assert len(docs) >= 3 and any(len(r) > 1 for r in rows)     # several documents per row
  loss, grads = _loss_and_grads(task, params, batch)
  single = train_lib.LMTask(CFG, train_lib.OptimConfig(), _mesh("data:1"))
  want, want_grads = _loss_and_grads(single, alone[0], _alone_rows(docs, T))
  assert int(batch.mask.sum()) == sum(len(d) - 1 for d in docs)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                                                       atol=2e-5), grads, want_grads)


@pytest.mark.devices(8)
def test_meter_ranks_are_the_models_shards():
  """`meter.rank_tokens` (what the work meter counts per rank) is what each cp device holds
  after the model's own entry balancing, read from the placed array's shards."""
  from llm import model as model_lib
  from llm.packing import meter
  mesh = _mesh("cp:8")
  x = np.arange(2 * T, dtype=np.int32).reshape(2, T)
  cfg = CFG.replace(context_parallel="pass_kv")

  def place(x):
    return model_lib._balance(x, cp=model_lib._context_parallel(cfg))

  with jax.set_mesh(mesh):
    out = jax.jit(place)(x)
  want = meter.rank_tokens(x, 8, model_balances=True)
  ranks = {d: i for i, d in enumerate(mesh.devices.ravel())}
  for shard in out.addressable_shards:
    r = ranks[shard.device]
    np.testing.assert_array_equal(np.asarray(shard.data), want[:, r])
