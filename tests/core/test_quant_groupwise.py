"""Group-wise int8 / int4 weights (core/quant/groupwise.py): the round trip within half a
step per group, jnp dequantization against the float64 numpy reference, and ggml Q8_0 /
Q4_0 / Q4_1 blocks taken directly equal to `gguf.quants.dequantize` of the same blocks."""

import numpy as np
import pytest

from core.quant import groupwise


def _weights(n=48, k=256, seed=0):
  """Gaussian rows at scales from 1e-4 to 1e3, an outlier per row, a constant group and a
  zero group: groups whose range is tiny, huge, or nothing."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, k)).astype(np.float32)
  x *= np.logspace(-4, 3, n, dtype=np.float32)[:, None]
  x[np.arange(n), rng.integers(0, k, n)] *= 20
  x[0, :32] = 0.0
  x[1, 32:64] = -0.37
  return x


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_within_half_a_step(bits):
  x = _weights()
  gq = groupwise.quantize_groupwise(x, bits)
  assert gq.q.dtype == (np.int8 if bits == 8 else np.uint8)
  assert gq.q.shape == (48, 256 if bits == 8 else 128)
  assert gq.scale.dtype == np.float16 and gq.scale.shape == (48, 8)
  assert (gq.bias is None) == (bits == 8)
  deq = np.asarray(gq.dequantize())
  err = np.abs(deq - x).reshape(48, 8, 32).max(-1)
  bound = groupwise.groupwise_error_bound(gq)
  # float32 rounding of the division and of the add: a few ulps of the values
  slack = 4 * np.spacing(np.abs(x).reshape(48, 8, 32).max(-1))
  assert np.all(err <= bound + slack), np.max(err - bound)
  g = x.reshape(48, 8, 32)
  scale = gq.scale.astype(np.float32)
  if bits == 8:
    amax = np.abs(g).max(-1)
    assert np.all(scale * 127 >= amax)                    # codes never clip
    ideal = amax / 127
  else:
    lo, hi = g.min(-1), g.max(-1)
    assert np.all(gq.bias.astype(np.float32) <= lo)
    assert np.all(scale * 15 >= hi - gq.bias.astype(np.float32))
    ideal = (hi - lo) / 15
  # The step is the ideal one up to float16 rounding (normal range: 2^-10 relative).
  normal = ideal > 2.0 ** -14
  assert np.all(scale[normal] <= ideal[normal] * (1 + 2.0 ** -9) + 1e-30)
  # Zero and constant groups come back exactly.
  np.testing.assert_array_equal(deq[0, :32], 0.0)
  np.testing.assert_allclose(deq[1, 32:64], -0.37, rtol=0, atol=float(bound[1, 1]) + 1e-7)


@pytest.mark.parametrize("bits", [8, 4])
def test_jnp_dequantize_equals_reference_bit_for_bit(bits):
  gq = groupwise.quantize_groupwise(_weights(seed=1), bits)
  got = np.asarray(gq.dequantize())
  np.testing.assert_array_equal(got.view(np.int32),
                                groupwise.dequantize_groupwise_reference(gq).view(np.int32))
  ids = np.array([[3, 0], [47, 3]])
  np.testing.assert_array_equal(np.asarray(gq.take_rows(ids)), got[ids])


def test_int4_packing_is_ggml_order():
  codes = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
  packed = groupwise.pack_int4(codes, 32)
  # byte j of a group: column j low, column j + 16 high
  assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4)
  assert packed[0, 16] == codes[0, 32] | (codes[0, 48] << 4)
  np.testing.assert_array_equal(groupwise.unpack_int4(packed, 32), codes)


def test_bad_input_names_the_tensor():
  x = _weights(4, 64)
  x[2, 5] = np.nan
  with pytest.raises(ValueError, match=r"layers\.3\.wq: holds NaN"):
    groupwise.quantize_groupwise(x, 8, where="layers.3.wq")
  with pytest.raises(ValueError, match=r"w_down: 172 columns; expected a multiple of .* 32"):
    groupwise.quantize_groupwise(np.zeros((2, 172), np.float32), 4, where="w_down")
  with pytest.raises(ValueError, match=r"bits=3"):
    groupwise.quantize_groupwise(np.zeros((2, 32), np.float32), 3)
  with pytest.raises(ValueError, match=r"ggml type Q5_K"):
    groupwise.from_ggml_blocks(np.zeros((2, 176), np.uint8), "Q5_K")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_ggml_blocks_equal_gguf_dequantize(qtype):
  gguf = pytest.importorskip("gguf")
  x = _weights(16, 128, seed=2)
  t = gguf.GGMLQuantizationType[qtype]
  blocks = gguf.quants.quantize(x, t)                      # [16, 4 * block bytes]
  gq = groupwise.from_ggml_blocks(blocks, qtype)
  assert gq.bits == (8 if qtype == "Q8_0" else 4) and gq.shape == (16, 128)
  want = np.asarray(gguf.quants.dequantize(blocks, t), np.float32)
  got = np.asarray(gq.dequantize())
  # Bit for bit, except that Q4_0's d * (8 - 8) is -0 where d < 0 and our d * 8 + (-8 d) is +0.
  np.testing.assert_array_equal(got, want)
  nonzero = want != 0
  np.testing.assert_array_equal(got[nonzero].view(np.int32), want[nonzero].view(np.int32))
  assert qtype == "Q4_0" or np.array_equal(got.view(np.int32), want.view(np.int32))
  np.testing.assert_array_equal(groupwise.dequantize_groupwise_reference(gq), want)


@pytest.mark.parametrize("bits", [8, 4])
def test_matmul_equals_the_dequantized_product(bits, monkeypatch):
  """groupwise_matmul, whole and in row chunks (lax.map), against x @ dequantize(rows).T in
  float64: float32 summation order only."""
  import jax
  import jax.numpy as jnp
  gq = jax.tree.map(jnp.asarray, groupwise.quantize_groupwise(_weights(48, 256, 4)[:, :], bits))
  x = np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32)
  want = x.astype(np.float64) @ groupwise.dequantize_groupwise_reference(gq).astype(np.float64).T
  tol = 1e-6 * np.abs(x).sum() * np.max(np.abs(groupwise.dequantize_groupwise_reference(gq)))
  for chunk in (1 << 18, 256 * 12):          # one piece; 4 chunks of 12 rows
    monkeypatch.setattr(groupwise, "CHUNK_ELEMENTS", chunk)
    assert groupwise._chunk_rows(48, 256) == (48 if chunk > 48 * 256 else 12)
    got = np.asarray(jax.jit(groupwise.groupwise_matmul)(jnp.asarray(x), gq))
    assert got.shape == (3, 48)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
