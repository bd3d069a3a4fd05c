"""attention_impl="cudnn": the mapping of segment ids / positions onto cuDNN's masks, the lse
and its gradient, against attention_reference.

On CPU every case runs `cudnn_attention(..., implementation="xla")`: the same mapping,
custom_vjp and lse-gradient folding around a jnp emulation of cuDNN's kernel (its masks,
statistics layout, and a backward that takes D from the O it is given). fp32 with float32
matmul precision (conftest), so 1e-5 holds. The `gpu` class runs the real kernel in bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.mesh import make_mesh
from llm.attention import cudnn, get_attention, layout, register
from llm.attention.reference import attention_reference

TOL = dict(rtol=1e-5, atol=1e-5)
emulated = functools.partial(cudnn.cudnn_attention, implementation="xla")
register("cudnn_emulated", emulated)
register("cudnn_emulated_packed", functools.partial(emulated, max_segments=4))


def _qkv(seed, b, t, s, h, g, kd=8, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, h, kd), dtype), jax.random.normal(kk, (b, s, g, kd), dtype),
          jax.random.normal(kv, (b, s, g, kd), dtype))


def _arange(b, n, offset=0):
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + offset, (b, n))


def _check(fn, ref, q, k, v, seed=0, lse_only=False, tol=TOL, grads=True):
  """Outputs, lse and the gradients of a loss on both (or on the lse alone) agree."""
  o, l = jax.jit(fn)(q, k, v)
  ro, rl = jax.jit(ref)(q, k, v)
  close = dict(rtol=tol["rtol"], atol=tol["atol"])
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), **close)
  np.testing.assert_allclose(np.asarray(l), np.asarray(rl), **close)
  if not grads:
    return
  w_o = jax.random.normal(jax.random.key(seed + 100), o.shape, jnp.float32)
  w_l = jax.random.normal(jax.random.key(seed + 101), l.shape, jnp.float32)

  def loss(f):
    def inner(q, k, v):
      o, l = f(q, k, v)
      l = jnp.where(jnp.isfinite(l), l, 0.0)
      return jnp.sum(l * w_l) + (0.0 if lse_only else jnp.sum(o.astype(jnp.float32) * w_o))
    return inner

  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
  for name, a, w in zip("qkv", got, want):
    a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
    atol = tol["atol"] * (np.abs(w).max() if tol.get("scaled") else 1.0)
    np.testing.assert_allclose(a, w, rtol=tol["rtol"], atol=atol, err_msg=f"d{name}")


# ----------------------------------------------------------------------------- self-attention


# Causal and full masks are distinct branches; the head grouping (GQA 4/2, MHA 4/4, MQA 4/1)
# is one reshape for any ratio, so each grouping runs under one of the masks at least.
@pytest.mark.parametrize("causal,heads", [(True, (4, 2)), (False, (4, 2)), (True, (4, 4)),
                                          (False, (4, 1))])
def test_self_attention_no_masks(causal, heads):
  q, k, v = _qkv(0, 2, 16, 16, *heads)
  kw = dict(causal=causal)
  _check(lambda q, k, v: emulated(q, k, v, **kw),
         lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)


def test_self_attention_positions_and_single_segment():
  """Positions that rise along the row (any gaps), one segment id per row: exact."""
  q, k, v = _qkv(1, 2, 12, 12, 4, 2)
  pos = jnp.asarray(np.cumsum(np.random.default_rng(0).integers(1, 4, (2, 12)), 1), jnp.int32)
  seg = jnp.full((2, 12), 7, jnp.int32)
  kw = dict(causal=True, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
            kv_segment_ids=seg)
  _check(lambda q, k, v: emulated(q, k, v, **kw),
         lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)


@pytest.mark.parametrize("causal", [True, False])
def test_self_attention_packed_documents(causal):
  """Up to max_segments runs per row go to cuDNN's packed layout; positions restart per
  document (the usual packing) and the lse comes back from the ragged statistics."""
  seg = jnp.asarray([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16, [1] * 3 + [0] * 9 + [5] * 3 + [6]],
                    jnp.int32)
  starts = np.concatenate([np.ones((3, 1), bool), np.diff(np.asarray(seg), axis=1) != 0], 1)
  pos = np.zeros((3, 16), np.int32)
  for r in range(3):
    for j in range(16):
      pos[r, j] = 0 if starts[r, j] else pos[r, j - 1] + 1
  pos = jnp.asarray(pos)
  q, k, v = _qkv(2, 3, 16, 16, 4, 2)
  kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
            kv_positions=pos)
  fn = get_attention("cudnn_emulated_packed")
  _check(lambda q, k, v: fn(q, k, v, **kw),
         lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)


def test_lse_only_loss_takes_the_correcting_call():
  """A loss on the lse alone leaves dO = 0: the gradient still matches."""
  q, k, v = _qkv(3, 2, 8, 8, 4, 2)
  _check(lambda q, k, v: emulated(q, k, v, causal=True),
         lambda q, k, v: attention_reference(q, k, v, causal=True), q, k, v, lse_only=True)


def test_unexpressible_rows_are_nan_not_wrong():
  q, k, v = _qkv(4, 2, 8, 8, 4, 2)
  # Row 1's positions fall back: index order is not position order there.
  pos = jnp.asarray([np.arange(8), [0, 1, 2, 3, 0, 1, 2, 3]], jnp.int32)
  o, l = emulated(q, k, v, causal=True, q_positions=pos, kv_positions=pos)
  ro, _ = attention_reference(q, k, v, causal=True, q_positions=pos, kv_positions=pos)
  np.testing.assert_allclose(np.asarray(o[0]), np.asarray(ro[0]), **TOL)
  assert np.all(np.isnan(np.asarray(o[1]))) and np.all(np.isnan(np.asarray(l[1])))
  # An id that comes back after another one; and more runs than max_segments.
  seg = jnp.asarray([[1, 1, 2, 2, 1, 1, 3, 3], [1] * 8], jnp.int32)
  o, _ = emulated(q, k, v, causal=False, q_segment_ids=seg, kv_segment_ids=seg, max_segments=4)
  assert np.all(np.isnan(np.asarray(o[0]))) and not np.any(np.isnan(np.asarray(o[1])))
  seg = jnp.asarray([[0, 0, 1, 1, 2, 2, 3, 3], [1] * 8], jnp.int32)
  o, _ = emulated(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)      # max_segments=1
  assert np.all(np.isnan(np.asarray(o[0]))) and not np.any(np.isnan(np.asarray(o[1])))


def test_clear_errors():
  q, k, v = _qkv(5, 1, 8, 8, 4, 2)
  with pytest.raises(ValueError, match="dtype float32: cuDNN flash attention takes bfloat16"):
    cudnn.cudnn_attention(q, k, v)
  seg = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="segment ids on a call whose queries and keys"):
    emulated(q, k, v, q_segment_ids=seg, kv_segment_ids=jnp.zeros((1, 8), jnp.int32))
  q16, k16, v16 = _qkv(5, 1, 8, 8, 4, 2, kd=12, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="head dim 12"):
    cudnn.cudnn_attention(q16, k16, v16)


# ----------------------------------------------------------------------------- cross calls


def test_cross_decode_and_prefill_into_a_cache():
  """The model's KV-cache calls: prefill into an empty cache (prefix-causal, right-padded
  prompts) and a decode step (prefix-full), slots tagged with positions, 2**30 empty."""
  b, s, empty = 3, 20, 2 ** 30
  lengths = np.array([5, 8, 1])
  kv_pos = np.full((b, s), empty, np.int32)
  for r, n in enumerate(lengths):
    kv_pos[r, :n] = np.arange(n)
  q, k, v = _qkv(6, b, 8, s, 4, 2)
  kw = dict(causal=True, q_positions=_arange(b, 8), kv_positions=jnp.asarray(kv_pos))
  _check(lambda q, k, v: emulated(q, k, v, **kw),
         lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)
  for r, n in enumerate(lengths):       # one decode token at position n, written at slot n
    kv_pos[r, n] = n
  q1, _, _ = _qkv(7, b, 1, s, 4, 2)
  kw = dict(causal=True, q_positions=jnp.asarray(lengths[:, None], jnp.int32),
            kv_positions=jnp.asarray(kv_pos))
  _check(lambda q, k, v: emulated(q, k, v, **kw),
         lambda q, k, v: attention_reference(q, k, v, **kw), q1, k, v)


def test_cross_chunked_prefill_onto_filled_cache_is_nan():
  b, s = 1, 12
  kv_pos = np.full((b, s), 2 ** 30, np.int32)
  kv_pos[0, :8] = np.arange(8)
  q, k, v = _qkv(8, b, 4, s, 4, 2)
  o, _ = emulated(q, k, v, causal=True, q_positions=_arange(b, 4, 4),
                  kv_positions=jnp.asarray(kv_pos))
  assert np.all(np.isnan(np.asarray(o)))


@pytest.mark.devices(4)
@pytest.mark.parametrize("variant", ["pass_kv", "pass_q"])
def test_ring_attention_with_cudnn_inner_blocks(variant):
  """Load-balanced causal ring attention: each step's block is none, prefix-full (all or
  half the queries) or the diagonal (prefix-causal); out, lse and gradients match."""
  from llm.attention.ring import ring_attention
  n, t = 4, 32
  mesh = make_mesh(f"cp:{n}", devices=jax.devices()[:n])
  q, k, v = _qkv(9, 2, t, t, 4, 2)
  lb = lambda a: layout.load_balance(a, n, 1)
  pos = lb(np.asarray(_arange(2, t)))

  def ring(q, k, v):
    o, l = ring_attention(q, k, v, mesh=mesh, variant=variant, causal=True,
                          q_positions=pos, kv_positions=pos, inner_impl="cudnn_emulated")
    return o, l

  def ref(q, k, v):
    return attention_reference(q, k, v, causal=True, q_positions=pos, kv_positions=pos)

  _check(ring, ref, lb(np.asarray(q)), lb(np.asarray(k)), lb(np.asarray(v)))


@pytest.mark.devices(4)
def test_ring_decode_replicated_queries():
  """A decode step under CP (T=1, replicated queries, each rank's shard filled from the
  front) through the cudnn inner block."""
  from llm.attention.ring import ring_attention
  n, s = 4, 16
  mesh = make_mesh(f"cp:{n}", devices=jax.devices()[:n])
  q, k, v = _qkv(10, 2, 1, s, 4, 2)
  kv_pos = np.full((2, s), 2 ** 30, np.int32)
  for r in range(n):                     # rank r holds slots 4r..4r+3, 3 of them filled
    kv_pos[:, 4 * r:4 * r + 3] = np.arange(3) * n + r
  q_pos = jnp.full((2, 1), 3 * n, jnp.int32)
  kw = dict(causal=True, q_positions=q_pos, kv_positions=jnp.asarray(kv_pos))
  # Forward only: the replicated-query merge (pmax) has no differentiation rule.
  _check(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, inner_impl="cudnn_emulated", **kw),
         lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v, grads=False)


# ----------------------------------------------------------------------------- remat, model


def _dots(jaxpr) -> int:
  """dot_general equations in a jaxpr and its sub-jaxprs."""
  import jax.extend as jex
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "dot_general"
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else [p]:
        if isinstance(sub, jex.core.ClosedJaxpr):
          n += _dots(sub.jaxpr)
        elif isinstance(sub, jex.core.Jaxpr):
          n += _dots(sub)
  return n


def test_remat_policy_saves_the_kernel_outputs():
  """Saving the named residuals (attention_out, attention_stats) keeps the backward from
  running the forward kernel again (the emulated forward is 2 dots, its backward 5)."""
  q, k, v = _qkv(11, 1, 8, 8, 4, 2)

  def dots(policy, remat=True):
    f = lambda q, k, v: jnp.sum(emulated(q, k, v)[0] ** 2)
    f = jax.checkpoint(f, policy=policy) if remat else f
    return _dots(jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v).jaxpr)

  saved = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_stats")
  assert dots(None, remat=False) == 7
  assert dots(saved) == 7
  assert dots(None) == 9


def test_llama_with_cudnn_emulated_attention_matches_xla():
  """The model's three call shapes: training forward (no segment ids / positions), prefill
  into a cache and decode steps (one layer: every layer makes the same attention calls; all
  calls of a model in one jit)."""
  from flax import nnx
  from llm import model as model_lib
  from llm.config import get_config
  cfg = get_config("tiny", n_layers=1, attention_impl="xla")
  ref = model_lib.Llama(cfg, nnx.Rngs(0))
  emu = model_lib.Llama(cfg.replace(attention_impl="cudnn_emulated"), nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)

  def run(m):
    train, _ = m(tokens)
    cache = m.init_cache(2, 16)
    lg, cache = m(tokens[:, :10], cache=cache, lengths_B=jnp.asarray([10, 6]))
    outs = [train, lg]
    for i in range(2):
      lg, cache = m(tokens[:, 10 + i:11 + i], cache=cache)
      outs.append(lg)
    return outs

  for a, w in zip(nnx.jit(run)(emu), nnx.jit(run)(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), **TOL)


# ----------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
class TestCudnnOnGpu:
  """The real kernel in bf16 against the fp32 reference: outputs within 2e-2, gradients
  within 2e-2 of their largest magnitude (bf16 rounding of p, out and dS)."""

  @pytest.fixture(autouse=True)
  def _gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("needs a CUDA GPU with cuDNN")

  def _case(self, fn, ref, q, k, v, lse_only=False):
    f32 = lambda f: (lambda q, k, v: f(q.astype(jnp.float32), k.astype(jnp.float32),
                                       v.astype(jnp.float32)))
    _check(fn, f32(ref), q, k, v, lse_only=lse_only,
           tol=dict(rtol=2e-2, atol=2e-2, scaled=True))

  @pytest.mark.parametrize("causal", [True, False])
  def test_self(self, causal):
    q, k, v = _qkv(20, 2, 256, 256, 8, 2, kd=64, dtype=jnp.bfloat16)
    self._case(lambda q, k, v: cudnn.cudnn_attention(q, k, v, causal=causal),
               lambda q, k, v: attention_reference(q, k, v, causal=causal), q, k, v)

  def test_lse_gradient(self):
    q, k, v = _qkv(21, 1, 128, 128, 4, 4, kd=128, dtype=jnp.bfloat16)
    for lse_only in (False, True):
      self._case(lambda q, k, v: cudnn.cudnn_attention(q, k, v),
                 lambda q, k, v: attention_reference(q, k, v), q, k, v, lse_only=lse_only)

  def test_packed_segments(self):
    seg = jnp.asarray([[0] * 100 + [1] * 156, [2] * 40 + [3] * 216], jnp.int32)
    q, k, v = _qkv(22, 2, 256, 256, 8, 2, kd=64, dtype=jnp.bfloat16)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
    self._case(lambda q, k, v: cudnn.cudnn_attention(q, k, v, max_segments=2, **kw),
               lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)

  def test_positions_in_packed_segments(self):
    """Packed documents with positions restarting at 0 in each (the same arrays for queries
    and keys): cuDNN's packed layout, positions checked to follow index order."""
    seg = jnp.asarray([[0] * 100 + [1] * 156, [2] * 40 + [3] * 216], jnp.int32)
    pos = jnp.asarray([list(range(100)) + list(range(156)),
                       list(range(40)) + list(range(216))], jnp.int32)
    q, k, v = _qkv(24, 2, 256, 256, 8, 2, kd=128, dtype=jnp.bfloat16)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    self._case(lambda q, k, v: cudnn.cudnn_attention(q, k, v, max_segments=2, **kw),
               lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)

  def test_positions_one_segment(self):
    pos = _arange(2, 256, offset=7)
    q, k, v = _qkv(25, 2, 256, 256, 8, 2, kd=64, dtype=jnp.bfloat16)
    kw = dict(q_positions=pos, kv_positions=pos)
    self._case(lambda q, k, v: cudnn.cudnn_attention(q, k, v, **kw),
               lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)

  def test_cache_calls(self):
    b, s = 2, 128
    kv_pos = np.full((b, s), 2 ** 30, np.int32)
    kv_pos[:, :64] = np.arange(64)
    q, k, v = _qkv(23, b, 64, s, 8, 2, kd=64, dtype=jnp.bfloat16)
    kw = dict(q_positions=_arange(b, 64), kv_positions=jnp.asarray(kv_pos))
    self._case(lambda q, k, v: cudnn.cudnn_attention(q, k, v, **kw),
               lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)


# ----------------------------------------------------------------------------- AOT for a GPU


@pytest.fixture
def fake_cudnn(monkeypatch):
  """jax's cuDNN checks answer as on an H100 with cuDNN 9.8, so the real cudnn path traces
  and lowers for CUDA on this CPU-only machine (nothing runs)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)


def _cuda_hlo(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("use_lse", [False, True])
def test_real_kernel_lowers_for_cuda(fake_cudnn, use_lse):
  """One cuDNN forward and one backward when the lse is unused (the model); with an lse
  cotangent, one more backward (the correcting call, under a cond) and no other kernel."""
  q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    o, l = cudnn.cudnn_attention(q, k, v)
    return jnp.sum(o.astype(jnp.float32)) + (jnp.sum(l) if use_lse else 0.0)

  hlo = _cuda_hlo(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
  assert hlo.count("custom_call @__cudnn$fmhaSoftmax(") == 1
  assert hlo.count("custom_call @__cudnn$fmhaSoftmaxBackward(") == (2 if use_lse else 1)


def test_real_kernel_lowers_packed_and_cross_calls(fake_cudnn):
  q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  packed = _cuda_hlo(lambda q, k, v, s: cudnn.cudnn_attention(
      q, k, v, q_segment_ids=s, kv_segment_ids=s, max_segments=4), q, k, k, ids)
  assert packed.count("custom_call @__cudnn$fmhaSoftmax(") == 1
  assert "tensor<8x8x256xf32>" in packed        # ragged statistics: [B*M, H, T]
  cross = _cuda_hlo(lambda q, k, v, p, kp: cudnn.cudnn_attention(
      q, k, v, q_positions=p, kv_positions=kp), q, k, k, ids, ids)
  assert cross.count("custom_call @__cudnn$fmhaSoftmax(") == 2   # prefix-full | prefix-causal


def test_train_step_lowers_for_cuda_with_one_kernel_pair_per_layer(fake_cudnn):
  """LMTask's bf16 step with attention_impl="cudnn": per layer one cuDNN forward and one
  backward (the lse is unused, so no correcting call), lowered for CUDA."""
  from core import mesh as mesh_lib
  from llm import train_lib
  from llm.config import get_config
  from llm.data import LMBatch
  cfg = get_config("tiny", dtype="bfloat16", attention_impl="cudnn", n_layers=2)
  task = train_lib.LMTask(cfg, train_lib.OptimConfig(),
                          mesh_lib.make_mesh("data:1", devices=jax.devices()[:1]))
  state = jax.eval_shape(lambda: task.init_state(0))
  ids = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  batch = LMBatch(inputs=ids, targets=ids, mask=jax.ShapeDtypeStruct((2, 64), jnp.float32),
                  positions=None, segment_ids=None)
  hlo = jax.jit(task.train_step).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("custom_call @__cudnn$fmhaSoftmax(") == cfg.n_layers
  assert hlo.count("custom_call @__cudnn$fmhaSoftmaxBackward(") == cfg.n_layers
