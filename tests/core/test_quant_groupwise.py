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
  with pytest.raises(ValueError, match=r"first inf at row 2, column 5"):
    groupwise.quantize_groupwise(np.where(np.isnan(x), np.inf, x), 4)


def test_float16_overflow_names_the_group_and_its_limit():
  """Each format has its own float16 limit: int8's scale max|x| / 127, int4's bias (the
  minimum, >= -65504) and scale (max - min) / 15; the error names the group and the one
  exceeded (-7e4 is far inside +-65504 * 15 yet overflows int4's bias)."""
  x = np.zeros((3, 64), np.float32)
  x[1, 40] = -7e4
  with pytest.raises(ValueError, match=r"wq: row 1, columns 32\.\.63: min = -70000; expected "
                     r"at least -65504"):
    groupwise.quantize_groupwise(x, 4, where="wq")
  assert np.isfinite(groupwise.quantize_groupwise(x, 8).scale).all()     # int8 takes it
  x[1, 40] = 9e5
  x[2, 3] = -9e4
  assert np.isfinite(groupwise.quantize_groupwise(x[:2], 4).scale).all()   # 9e5 / 15 fits
  with pytest.raises(ValueError, match=r"row 2, columns 0\.\.31: min = -90000"):
    groupwise.quantize_groupwise(x, 4)
  y = np.zeros((2, 32), np.float32)
  y[1, :2] = 1e6, -6e4
  with pytest.raises(ValueError, match=r"row 1, columns 0\.\.31: max - min = 1\.06e\+06; "
                     r"expected at most 65504 \* 15"):
    groupwise.quantize_groupwise(y, 4)
  x[0, 63] = -9e6
  with pytest.raises(ValueError, match=r"row 0, columns 32\.\.63: max \|x\| = 9e\+06; expected "
                     r"at most 65504 \* 127"):
    groupwise.quantize_groupwise(x, 8)


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


def test_ggml_blocks_whose_scale_cannot_be_held_are_named():
  """Q4_0's bias -8 d is a float16: a block with |d| > 8188 (weights beyond +-65504, a bf16
  model's outlier) would decode to -Inf where ggml gives finite (q - 8) * d; a non-finite
  d or m (a damaged file) to NaN. Each is an error naming the tensor and the block."""
  blocks = np.zeros((2, 3 * 18), np.uint8)
  blocks[1, 18:20] = np.array([8752], np.float16).view(np.uint8)    # block 1 of row 1
  with pytest.raises(ValueError, match=r"wk \(Q4_0\): row 1, block 1 \(columns 32\.\.63\): "
                     r"d = 8752\.0; expected a finite d with \|d\| <= 8188"):
    groupwise.from_ggml_blocks(blocks, "Q4_0", where="wk (Q4_0)")
  blocks[1, 18:20] = np.array([8188], np.float16).view(np.uint8)    # the largest that fits
  gq = groupwise.from_ggml_blocks(blocks, "Q4_0")
  assert np.asarray(gq.dequantize())[1, 32] == -8 * 8188.0
  q41 = np.zeros((1, 2 * 20), np.uint8)
  q41[0, 22:24] = np.array([np.inf], np.float16).view(np.uint8)     # block 1's m
  with pytest.raises(ValueError, match=r"row 0, block 1 \(columns 32\.\.63\): d = 0\.0, "
                     r"m = inf; expected finite d and m"):
    groupwise.from_ggml_blocks(q41, "Q4_1")
  q80 = np.zeros((1, 34), np.uint8)
  q80[0, :2] = np.array([np.nan], np.float16).view(np.uint8)
  with pytest.raises(ValueError, match=r"row 0, block 0 \(columns 0\.\.31\): d = nan"):
    groupwise.from_ggml_blocks(q80, "Q8_0")


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


def test_int4_matmul_in_bfloat16_rounds_once():
  """In a bfloat16 product the int4 halves (low and high nibbles) meet in float32 and the sum
  is rounded once: within half a bfloat16 unit of the exact product of the bfloat16 inputs
  (plus float32 summation order), where rounding each half first is up to 1.5 units off."""
  import jax
  import jax.numpy as jnp
  gq = jax.tree.map(jnp.asarray, groupwise.quantize_groupwise(_weights(64, 256, 7), 4))
  x = jnp.asarray(np.random.default_rng(8).standard_normal((16, 256)), jnp.bfloat16)
  got = np.asarray(jax.jit(lambda x, gq: groupwise.groupwise_matmul(x, gq, jnp.bfloat16))(x, gq))
  assert got.dtype == jnp.bfloat16
  w = np.asarray(jnp.asarray(groupwise.dequantize_groupwise_reference(gq), jnp.bfloat16),
                 np.float64)
  xs = np.asarray(x, np.float64)
  want = xs @ w.T
  ulp = 2.0 ** (np.floor(np.log2(np.abs(want))) - 7)        # bfloat16: 8 significant bits
  slack = 1e-6 * np.abs(xs) @ np.abs(w).T                    # float32 summation order
  assert np.all(np.abs(got.astype(np.float64) - want) <= ulp / 2 + slack)
