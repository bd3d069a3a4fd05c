"""kernels.decode_attention (split-key decode attention over a contiguous KV cache) against the
shared flash attention reference, and as the model's "pallas_decode" implementation.

TestDecodeAttentionInterpret runs the Pallas kernel in interpret mode on CPU (in CI) and
lowers it to Triton for an H100 from here; TestDecodeAttentionGpu compiles it and skips
without a GPU: JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_decode_attention.py -m gpu.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.decode_attention import decode_attention, merge, num_splits, supports
from kernels.flash_attention_reference import flash_attention_reference
from tests.kernels.attention_cases import rel_err

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# bf16: p is rounded to bf16 before p @ v (as the reference does); fp32 in interpret mode
# runs fp32 dots, off only by the order of the sums.
TOL = {F32: 2e-5, BF16: 2e-2, F16: 4e-3}
EMPTY = 2**30        # the model's position of an empty cache slot (above any real one)

# (B, T, H, G, K, S, splits, dtype): decode steps (T = 1) and short verifications (T > 1),
# GQA groups of 1-4, a cache length that is not a multiple of the block, one split or many.
CASES = [
    (2, 1, 8, 2, 64, 100, None, BF16),
    (3, 3, 4, 4, 32, 77, 2, F32),
    (1, 1, 32, 8, 64, 300, 1, BF16),
    (2, 2, 6, 2, 16, 64, 5, F16),
]


def _case_id(c):
  b, t, h, g, k, s, j, dt = c
  return f"B{b}T{t}H{h}G{g}K{k}S{s}J{j}-{jnp.dtype(dt).name}"


def _inputs(case, seed=0):
  """A cache with its last slots empty and the last row empty (its queries see no key); the
  queries are the last T written tokens (causal by position)."""
  b, t, h, g, kd, s, _, dtype = case
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, h, kd)), dtype)
  k = jnp.asarray(rng.normal(size=(b, s, g, kd)), dtype)
  v = jnp.asarray(rng.normal(size=(b, s, g, kd)), dtype)
  lengths = np.asarray([s - 3] + [int(rng.integers(t, s)) for _ in range(b - 2)] + [0])[:b]
  kv_pos = np.where(np.arange(s)[None, :] < lengths[:, None], np.arange(s)[None, :], EMPTY)
  q_pos = np.maximum(lengths[:, None] - t + np.arange(t)[None, :], 0)
  if b > 1:
    q_pos[-1] = np.arange(t)
  return q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32)


class _DecodeAttentionCases:
  interpret: bool

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_matches_reference(self, case):
    q, k, v, q_pos, kv_pos = _inputs(case)
    out, lse = decode_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos,
                                splits=case[6], interpret=self.interpret)
    out_ref, lse_ref = flash_attention_reference(q, k, v, q_positions=q_pos,
                                                 kv_positions=kv_pos)
    dtype = case[-1]
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype and lse.dtype == F32
    assert rel_err(out, out_ref) < TOL[dtype]
    seen = np.isfinite(np.asarray(lse_ref))
    assert np.array_equal(np.isfinite(np.asarray(lse)), seen)
    assert rel_err(np.asarray(lse)[seen], np.asarray(lse_ref)[seen]) < TOL[dtype]
    if case[0] > 1:                                     # the empty row sees no key
      assert np.all(np.asarray(out[-1]) == 0) and np.all(np.isneginf(np.asarray(lse[-1])))

  def test_segments_and_no_causal_rule(self):
    case = (2, 2, 4, 2, 32, 90, 3, F32)
    q, k, v, q_pos, kv_pos = _inputs(case, seed=3)
    rng = np.random.default_rng(4)
    q_seg = jnp.asarray(rng.integers(0, 2, (2, 2)), jnp.int32)
    kv_seg = jnp.asarray(rng.integers(0, 2, (2, 90)), jnp.int32)
    for kw in (dict(causal=False), dict(causal=True, q_positions=q_pos, kv_positions=kv_pos),
               dict(causal=False, q_segment_ids=q_seg, kv_segment_ids=kv_seg),
               dict(causal=True, q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg,
                    kv_segment_ids=kv_seg)):
      out, lse = decode_attention(q, k, v, splits=3, interpret=self.interpret, **kw)
      out_ref, lse_ref = flash_attention_reference(q, k, v, **kw)
      assert rel_err(out, out_ref) < TOL[F32], kw
      seen = np.isfinite(np.asarray(lse_ref))
      assert np.array_equal(np.isfinite(np.asarray(lse)), seen), kw
      assert rel_err(np.asarray(lse)[seen], np.asarray(lse_ref)[seen]) < TOL[F32], kw


class TestDecodeAttentionInterpret(_DecodeAttentionCases):
  """Pallas interpreter on CPU."""
  interpret = True

  def test_lowers_to_triton_for_hopper(self):
    """AOT-lower a Llama 3.2 1B decode step's call (batch 1, 1057 slots) for an H100 from
    this CPU: the kernel body must lower to Triton IR (Triton's own passes and ptxas run
    only on a GPU machine)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    s = jax.ShapeDtypeStruct
    args = (s((1, 1, 32, 64), BF16), s((1, 1057, 8, 64), BF16), s((1, 1057, 8, 64), BF16),
            s((1, 1), jnp.int32), s((1, 1057), jnp.int32))
    run = jax.jit(lambda q, k, v, qp, kp: decode_attention(
        q, k, v, q_positions=qp, kv_positions=kp, interpret=False))
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)    # the Triton backend's notice
      hlo = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1

  def test_splits_and_support(self):
    # Llama 3.2 1B at batch 1: 8 kv heads, 1057 slots in blocks of 64 -> 17 splits (of one
    # block each, 136 programs); at batch 8, 5 splits of 4 blocks.
    assert num_splits(1, 8, 1057, 64) == 17 and num_splits(8, 8, 1057, 64) == 5
    assert num_splits(64, 8, 1057, 64) == 1 and num_splits(1, 1, 10, 64) == 1
    assert supports(BF16, 64) is None and supports(F16, 128) is None
    assert "float32" in supports(F32, 64) and "head dim 96" in supports(BF16, 96)
    with pytest.raises(ValueError, match="head dim 24; expected a power of two"):
      z = jnp.zeros((1, 1, 2, 24), BF16)
      decode_attention(z, z[:, :1].repeat(4, 1), z[:, :1].repeat(4, 1), interpret=True)

  def test_merge_of_empty_splits(self):
    """Splits that saw nothing (lse -inf, out 0) drop out; a row no split saw stays 0, -inf."""
    o = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, 3, 2, 4)), F32)
    lse = jnp.asarray([[[[0.5, -np.inf], [-np.inf, -np.inf], [1.5, -np.inf]]]], F32)
    out, l = merge(o, lse)
    w = np.exp(np.array([0.5, 1.5]) - np.logaddexp(0.5, 1.5))
    np.testing.assert_allclose(out[0, 0, 0], w[0] * o[0, 0, 0, 0] + w[1] * o[0, 0, 2, 0],
                               rtol=1e-6)
    np.testing.assert_allclose(l[0, 0, 0], np.logaddexp(0.5, 1.5), rtol=1e-6)
    assert np.all(np.asarray(out[0, 0, 1]) == 0) and np.isneginf(float(l[0, 0, 1]))

  def test_model_decode_with_the_kernel(self):
    """A bf16 Llama's greedy decode with attention_impl "pallas_decode" (interpreted) follows
    "xla_decode" (the jnp sums): the same tokens, logits within bf16 rounding."""
    from flax import nnx

    from llm import generate as gen
    from llm import model as model_lib
    from llm.config import get_config
    cfg = get_config("tiny", n_layers=2, dtype="bfloat16", param_dtype="bfloat16")
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)),
                         jnp.int32)
    runs = {}
    for impl in ("xla_decode", "pallas_decode"):
      model = model_lib.Llama(cfg.replace(attention_impl=impl), nnx.Rngs(0))
      graphdef, state = nnx.split(model)
      lengths = jnp.full((2,), 9, jnp.int32)
      tok, cache, key = gen.prefill(graphdef, state, prompt, lengths, jax.random.key(0), None,
                                    max_len=14)
      out, _ = gen.decode(graphdef, state, cache, tok, key, None,
                          jnp.asarray((-1,), jnp.int32), n_new=5)
      runs[impl] = np.asarray(out)
    np.testing.assert_array_equal(runs["pallas_decode"], runs["xla_decode"])


@pytest.mark.gpu
class TestDecodeAttentionGpu(_DecodeAttentionCases):
  """Compiled (Triton lowering) on a GPU."""
  interpret = False

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("needs a GPU (run with JAX_PLATFORMS=cuda)")
