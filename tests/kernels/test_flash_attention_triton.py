"""kernels.flash_attention_triton vs the jnp reference: out, lse and dq, dk, dv (through out and lse).

Two classes share the cases (JAX's `...InterpretTest(...Test)` pattern):
TestFlashAttentionInterpret runs the Pallas kernels in interpret mode on CPU (in CI);
TestFlashAttentionGpu compiles them (Triton lowering) and skips without a GPU. On a GPU
machine: JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_flash_attention_triton.py -m gpu
(conftest otherwise pins the CPU platform).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.flash_attention_reference import flash_attention_reference
from kernels.flash_attention_triton import flash_attention_triton as flash_attention
from llm.attention import attention, get_attention
from tests.kernels import attention_cases as cases

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# Normalized max error (max |a - b| / max |b|) allowed, by input dtype: a few units in the
# last place of the output dtype (bf16 2^-8, fp16 2^-11), fp32 accumulation throughout.
OUT_TOL = {F32: 2e-5, BF16: 2e-2, F16: 3e-3}
LSE_TOL = {F32: 2e-5, BF16: 1e-3, F16: 1e-3}
GRAD_TOL = {F32: 5e-5, BF16: 3e-2, F16: 5e-3}

# (B, T, S, H, G, K, causal, dtype, masks): tests/kernels/attention_cases.py.
CASES = [
    (1, 40, 40, 4, 2, 32, True, F32, ""),           # T, S not block multiples; GQA
    (2, 64, 40, 2, 1, 16, False, F32, ""),          # T != S, multi-query
    (1, 40, 64, 2, 2, 64, True, F32, ""),           # head dim 64; more keys than queries
    (1, 64, 24, 4, 2, 16, True, F32, ""),           # more queries than keys
    (1, 40, 48, 4, 2, 16, True, F32, "seg+perm"),   # packed segments, permuted positions
    (2, 32, 32, 2, 1, 16, True, F32, "pos"),        # ring-style offset positions
    (1, 64, 64, 4, 2, 32, True, BF16, ""),
    (1, 40, 40, 2, 1, 16, False, BF16, "seg"),
    (1, 48, 40, 4, 2, 32, True, F16, "seg+perm"),
]



class _FlashAttentionCases:
  """Kernel vs reference; subclasses say interpret or compiled and the tile sizes."""
  interpret: bool
  blocks = dict(block_q=16, block_k=16)

  def _kernel(self, q, k, v, **kw):
    return flash_attention(q, k, v, interpret=self.interpret, **self.blocks, **kw)

  @pytest.mark.parametrize("case", CASES, ids=cases.case_id)
  def test_matches_reference(self, case):
    q, k, v, kw = cases.inputs(case)
    dtype = case[7]
    o, l, grads = cases.out_lse_grads(self._kernel, q, k, v, kw)
    o_ref, l_ref, grads_ref = cases.out_lse_grads(flash_attention_reference, q, k, v, kw)
    assert o.shape == q.shape and o.dtype == q.dtype and l.shape == q.shape[:3]
    assert l.dtype == jnp.float32
    np.testing.assert_array_equal(np.isfinite(l), np.isfinite(l_ref))
    assert cases.rel_err(o, o_ref) < OUT_TOL[dtype]
    fin = np.isfinite(np.asarray(l_ref))
    assert cases.rel_err(np.asarray(l)[fin], np.asarray(l_ref)[fin]) < LSE_TOL[dtype]
    for name, g, g_ref in zip("qkv", grads, grads_ref):
      assert g.shape == g_ref.shape and g.dtype == g_ref.dtype, name
      assert np.all(np.isfinite(np.asarray(g, np.float32))), name
      err = cases.rel_err(g, g_ref)
      assert err < GRAD_TOL[dtype], f"d{name}: relative error {err:.2e}"

  def test_fully_masked_rows(self):
    """Rows with no allowed key: out exactly 0, lse -inf, zero dq, no NaN anywhere."""
    b, t, s, h, g, kd = 1, 40, 40, 2, 1, 16
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(b, t, h, kd)), F32)
    k = jnp.asarray(rng.normal(size=(b, s, g, kd)), F32)
    v = jnp.asarray(rng.normal(size=(b, s, g, kd)), F32)
    # Segment 7 has no keys; rows 0..3 sit before every key; segment 1 starts later in
    # the keys (24) than in the queries (20 + 4), so its first rows see no key either.
    q_seg = np.array([[0] * 20 + [1] * 12 + [7] * 8], np.int32)
    kv_seg = np.array([[0] * 24 + [1] * 16], np.int32)
    q_pos = np.array([np.arange(t) - 4], np.int32)
    allowed = (q_seg[0, :, None] == kv_seg[0, None, :]) & (np.arange(s)[None] <= q_pos[0, :, None])
    empty = ~allowed.any(axis=1)
    assert empty[:4].all() and empty[20:28].all() and empty[32:].all() and empty.sum() == 20
    kw = dict(causal=True, q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg),
              q_positions=jnp.asarray(q_pos))
    o, l, (dq, dk, dv) = cases.out_lse_grads(self._kernel, q, k, v, kw)
    np.testing.assert_array_equal(np.isneginf(np.asarray(l[0])), np.stack([empty] * h, 1))
    assert np.all(np.asarray(o)[0, empty] == 0.0)
    assert not np.any(np.isnan(np.asarray(l)))
    for grad in (dq, dk, dv):
      assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(dq)[0, empty] == 0.0)
    o_ref, _, grads_ref = cases.out_lse_grads(flash_attention_reference, q, k, v, kw)
    assert cases.rel_err(o, o_ref) < OUT_TOL[F32]
    for grad, grad_ref in zip((dq, dk, dv), grads_ref):
      assert cases.rel_err(grad, grad_ref) < GRAD_TOL[F32]

  def test_uneven_tiles(self):
    """Forward tiles 32 x 16, backward 16 x 16, padded T and S: same numbers."""
    q, k, v, kw = cases.inputs((1, 40, 56, 4, 2, 16, True, F32, ""), seed=2)
    fn = lambda q, k, v, **kw: flash_attention(q, k, v, interpret=self.interpret, block_q=32,
                                               block_k=16, block_q_bwd=16, **kw)
    o, l, grads = cases.out_lse_grads(fn, q, k, v, kw)
    o_ref, l_ref, grads_ref = cases.out_lse_grads(flash_attention_reference, q, k, v, kw)
    assert cases.rel_err(o, o_ref) < OUT_TOL[F32] and cases.rel_err(l, l_ref) < LSE_TOL[F32]
    for grad, grad_ref in zip(grads, grads_ref):
      assert cases.rel_err(grad, grad_ref) < GRAD_TOL[F32]


class TestFlashAttentionInterpret(_FlashAttentionCases):
  """Pallas interpreter on CPU."""
  interpret = True

  def test_registered_as_pallas_triton(self):
    q, k, v, kw = cases.inputs((1, 16, 16, 2, 1, 16, True, F32, ""))
    assert get_attention("pallas_triton") is flash_attention
    o, l = attention(q, k, v, impl="pallas_triton", **kw)
    o_ref, l_ref = attention(q, k, v, impl="xla", **kw)
    assert cases.rel_err(o, o_ref) < OUT_TOL[F32] and cases.rel_err(l, l_ref) < LSE_TOL[F32]

  @pytest.mark.parametrize("device_kind,dtype,masks", [
      ("NVIDIA H100 80GB HBM3", BF16, ""), ("NVIDIA H200", F32, "seg+perm")])
  def test_lowers_to_triton_for_hopper(self, device_kind, dtype, masks):
    """AOT-lower forward + backward for a Hopper GPU from this CPU: every kernel body must
    lower to Triton IR (Triton's own passes and ptxas run only on a GPU machine)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    q, k, v, kw = cases.inputs((1, 200, 136, 4, 2, 128, True, dtype, masks))
    fn = lambda q, k, v, **kw: flash_attention(q, k, v, interpret=False, **kw)
    run = jax.jit(lambda q, k, v: cases.vjp_outputs(fn, q, k, v, kw))
    device = AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh), pytest.warns(DeprecationWarning, match="Triton backend"):
      hlo = run.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3      # forward, dk/dv, dq

  def test_remat_attention_policy_keeps_the_forward(self):
    """llm.remat's "attention" policy saves only what the attention kernels name (out,
    lse): the rematerialized backward reuses the forward kernel's outputs, as many kernel
    calls as without remat (else the forward runs again, as under full remat)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    from llm.remat import remat_policy
    q, k, v, _ = cases.inputs((1, 128, 128, 2, 1, 64, True, BF16, ""))
    loss = lambda q, k, v: jnp.sum(
        flash_attention(q, k, v, interpret=False)[0].astype(jnp.float32))
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)

    def calls(f):
      with use_abstract_mesh(mesh), pytest.warns(DeprecationWarning, match="Triton backend"):
        hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).trace(q, k, v).lower(
            lowering_platforms=("cuda",)).as_text()
      return hlo.count("__gpu$xla.gpu.triton")

    # value_and_grad: the loss is used, so the primal forward stays.
    plain = calls(loss)                      # forward, dk / dv, dq
    assert calls(jax.checkpoint(loss, policy=remat_policy("attention"))) == plain == 3
    assert calls(jax.checkpoint(loss)) == plain + 1

  def test_rejects_bad_block(self):
    q, k, v, _ = cases.inputs((1, 16, 16, 2, 1, 16, True, F32, ""))
    with pytest.raises(ValueError, match="block_q=24"):
      flash_attention(q, k, v, block_q=24, interpret=True)


@pytest.mark.gpu
class TestFlashAttentionGpu(_FlashAttentionCases):
  """Compiled (Triton lowering) on a GPU; bigger tiles and one production-sized shape."""
  interpret = False
  blocks = dict(block_q=64, block_k=64)

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("needs a GPU (run with JAX_PLATFORMS=cuda)")

  @pytest.mark.parametrize("causal", [True, False])
  def test_large_bf16_head128(self, causal):
    case = (2, 1024, 1024, 8, 2, 128, causal, BF16, "")
    q, k, v, kw = cases.inputs(case)
    o, l, grads = cases.out_lse_grads(
        lambda *a, **kw: flash_attention(*a, interpret=False, **kw), q, k, v, kw)
    o_ref, l_ref, grads_ref = cases.out_lse_grads(flash_attention_reference, q, k, v, kw)
    assert cases.rel_err(o, o_ref) < OUT_TOL[BF16] and cases.rel_err(l, l_ref) < LSE_TOL[BF16]
    for grad, grad_ref in zip(grads, grads_ref):
      assert cases.rel_err(grad, grad_ref) < GRAD_TOL[BF16]
