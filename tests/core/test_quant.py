"""FBGEMM row-wise int8 / int4 formats against numpy transcriptions of FBGEMM's reference
code (bit-exact), hand-computed rows, and the round-trip error bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import quant


def _rows(seed=0, n=64, d=16):
  """Rows of very different magnitudes and offsets, plus edge rows."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)) * 10.0 ** rng.uniform(-4, 2, (n, 1)) + rng.normal(size=(n, 1))
  x = x.astype(np.float32)
  x[0] = 0.25                               # constant row: range 0
  x[1] = -3.0                               # constant negative row
  x[2, :] = np.linspace(-1, 1, d)           # exact grid
  x[3] = rng.uniform(-1e-3, 1e-3, d)        # DLRM-init-sized values
  return x


SHAPES = [(64, 16), (33, 7), (5, 1), (8, 128)]


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_bit_exact_with_fbgemm_reference(shape):
  x = _rows(1, *shape)
  qr = jax.jit(quant.quantize_rowwise_int8)(x)
  q, scale, bias = quant.quantize_rowwise_int8_reference(x)
  assert qr.q.dtype == jnp.uint8 and qr.q.shape == shape and qr.bits == 8 and qr.dim == shape[1]
  np.testing.assert_array_equal(qr.q, q)
  np.testing.assert_array_equal(qr.scale, scale)
  np.testing.assert_array_equal(qr.bias, bias)
  # q * scale + bias: XLA may contract it into one FMA (one rounding instead of two), so
  # allow the product's rounding on top of the sum's.
  got = np.asarray(quant.dequantize_rowwise_int8(qr))
  want = quant.dequantize_rowwise_int8_reference(q, scale, bias)
  prod = np.abs(q.astype(np.float32) * scale[:, None])
  assert (np.abs(got - want) <= np.spacing(prod) + np.spacing(np.abs(want))).all()
  if shape[1] > 1:                                    # every non-constant row spans 0..255
    assert (q[2:].max(axis=1) == 255).all() and (q[2:].min(axis=1) == 0).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_bit_exact_with_fbgemm_reference(shape):
  x = _rows(2, *shape)
  qr = jax.jit(quant.quantize_rowwise_int4)(x)
  packed, scale, bias = quant.quantize_rowwise_int4_reference(x)
  assert qr.q.shape == (shape[0], (shape[1] + 1) // 2) and qr.scale.dtype == jnp.float16
  np.testing.assert_array_equal(qr.q, packed)
  np.testing.assert_array_equal(qr.scale, scale)
  np.testing.assert_array_equal(qr.bias, bias)
  # fp16 scale times a 4-bit code is exact in float32, so even an FMA matches bit for bit.
  np.testing.assert_array_equal(quant.dequantize_rowwise_int4(qr),
                                quant.dequantize_rowwise_int4_reference(packed, scale, bias,
                                                                        shape[1]))
  if shape[1] % 2:                                     # the pad nibble stays 0
    assert (np.asarray(qr.q)[:, -1] >> 4 == 0).all()


def test_int8_hand_computed():
  # min -1, range 2: scale = 2/255; 255 / (2 + 1e-8) rounds to 127.5 in float32, so the
  # middle value sits exactly halfway and rounds to the even code 128.
  qr = quant.quantize_rowwise_int8(np.array([[-1.0, 0.0, 1.0]], np.float32))
  np.testing.assert_array_equal(qr.q, [[0, 128, 255]])
  np.testing.assert_array_equal(qr.scale, [np.float32(2.0) / np.float32(255.0)])
  np.testing.assert_array_equal(qr.bias, [-1.0])
  deq = np.asarray(quant.dequantize_rowwise_int8(qr))[0]
  assert deq[0] == -1.0 and abs(deq[2] - 1.0) < 1e-6
  np.testing.assert_allclose(deq[1], 1.0 / 255.0, atol=1e-7)   # off by exactly scale / 2


def test_int4_hand_computed():
  # 0..15: bias 0, scale 1, code c at column c; even column in the low nibble.
  qr = quant.quantize_rowwise_int4(np.arange(16, dtype=np.float32)[None])
  np.testing.assert_array_equal(qr.q, [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]])
  np.testing.assert_array_equal(qr.scale, [1.0])
  np.testing.assert_array_equal(qr.bias, [0.0])
  np.testing.assert_array_equal(quant.dequantize_rowwise_int4(qr), np.arange(16)[None])
  # Constant row: scale 1 (FBGEMM's corner case), every code 0, exact round trip.
  qr = quant.quantize_rowwise_int4(np.full((1, 3), 0.5, np.float32))
  np.testing.assert_array_equal(qr.scale, [1.0])
  np.testing.assert_array_equal(qr.q, [[0, 0]])
  np.testing.assert_array_equal(quant.dequantize_rowwise_int4(qr), [[0.5, 0.5, 0.5]])


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_bound(bits):
  """|x - deq(q(x))| <= bound per row (scale/2 for int8, plus fp16 roundings for int4),
  and the bound is nearly reached, so it says something."""
  x = _rows(3, 256, 24)
  qr = quant.quantize_rowwise(x, bits)
  err = np.abs(np.asarray(quant.dequantize_rowwise(qr)) - x).max(axis=1)
  bound = np.asarray(quant.rowwise_error_bound(qr, x))
  # float32 rounding of (x - min) * inv and of q * scale + bias: a few ulps of the row.
  ulps = 4 * np.finfo(np.float32).eps * np.abs(x).max(axis=1)
  assert (err <= bound + ulps).all(), np.max((err - bound) / np.maximum(ulps, 1e-30))
  assert np.median(err / bound) > 0.8
  if bits == 8:
    scale = np.asarray(qr.scale)
    assert (err <= scale / 2 + quant.INT8_EPS + ulps).all()


def test_int4_bias_rounding_term_is_needed():
  """Rows far from zero: fp16(100.05) = 100.0625 (ulp 1/16 there) lies above the row's
  minimum, whose values clip to code 0, off by more than half a step; the bound's
  |min - bias| term accounts for it."""
  rng = np.random.default_rng(4)
  x = (100.05 + rng.uniform(0, 0.15, (16, 8))).astype(np.float32)
  x[:, 0] = np.float32(100.05)
  qr = quant.quantize_rowwise_int4(x)
  err = np.abs(np.asarray(quant.dequantize_rowwise_int4(qr)) - x).max(axis=1)
  scale = np.asarray(qr.scale, np.float32)
  assert (err > scale / 2 * 1.01).any()
  assert (err <= np.asarray(quant.rowwise_error_bound(qr, x)) + 1e-5).all()


@pytest.mark.parametrize("bits,dim", [(8, 16), (4, 16), (4, 7)])
def test_fused_bytes_layout(bits, dim):
  """FBGEMM's fused rows: codes, then scale and bias bytes (little-endian)."""
  x = _rows(5, 6, dim)
  qr = quant.quantize_rowwise(x, bits)
  fused = np.asarray(quant.to_fused_bytes(qr))
  q, s, b = map(np.asarray, (qr.q, qr.scale, qr.bias))
  sb = np.stack([s, b], axis=1).astype(s.dtype.newbyteorder("<"))      # [N, 2]
  want = np.concatenate([q, sb.view(np.uint8).reshape(q.shape[0], -1)], axis=1)
  np.testing.assert_array_equal(fused, want)
  assert fused.shape[1] == q.shape[1] + (8 if bits == 8 else 4)
  back = quant.from_fused_bytes(jnp.asarray(fused), bits, dim)
  for a, c in ((back.q, q), (back.scale, s), (back.bias, b)):
    np.testing.assert_array_equal(a, c)
  with pytest.raises(ValueError, match="expected \\[N, "):
    quant.from_fused_bytes(jnp.asarray(fused[:, 1:]), bits, dim)


def test_errors():
  with pytest.raises(ValueError, match="rows shape \\(3,\\), expected \\[N, D\\]"):
    quant.quantize_rowwise_int8(np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="bits=3, expected 8 or 4"):
    quant.quantize_rowwise(np.zeros((2, 2), np.float32), bits=3)
  qr4 = quant.quantize_rowwise_int4(np.zeros((2, 2), np.float32))
  with pytest.raises(ValueError, match="bits=4, expected 8"):
    quant.dequantize_rowwise_int8(qr4)


def test_is_a_pytree_under_jit():
  x = _rows(6, 8, 8)
  qr = quant.quantize_rowwise_int8(x)
  leaves, tree = jax.tree.flatten(qr)
  assert len(leaves) == 3                                # bits and dim are static
  out = jax.jit(quant.dequantize_rowwise)(qr)
  # Under jit XLA may fuse q * scale + bias into one FMA: equal up to that rounding.
  np.testing.assert_allclose(out, quant.dequantize_rowwise(jax.tree.unflatten(tree, leaves)),
                             rtol=1e-6, atol=1e-6 * np.abs(x).max())
