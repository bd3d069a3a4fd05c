"""FBGEMM row-wise 8-bit / N-bit formats against numpy transcriptions of FBGEMM's reference
code (bit-exact), hand-computed rows, edge rows, the round-trip error bound, and the
exact arithmetic (core/quant/exact.py) that makes every backend give the same bits."""

from __future__ import annotations

import fractions
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import quant
from core.quant import exact
from tests import peer_env
from tests.peer_env import peer_python


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


def _edge_rows(d=8):
  """Rows FBGEMM leaves undefined or that XLA:CPU cannot compute as written."""
  rows = np.zeros((9, d), np.float32)
  rows[1, 0] = np.nan                                    # NaN row
  rows[2, -1] = np.inf                                   # +Inf row
  rows[3, 1] = -np.inf                                   # -Inf row
  rows[4] = np.float32(1e-40) * np.arange(d)             # subnormal values
  rows[5] = np.linspace(-3e38, 3e38, d)                  # range overflows float32
  rows[6] = 0.0
  rows[6, ::2] = -0.0                                    # signed zeros
  rows[7] = np.float32(2.0 ** -126) * (1 + np.arange(d) / 16)  # range is subnormal
  rows[8] = np.linspace(1.0, 1.0 + 7 * 2.0 ** -23, d)    # range of a few ulps
  return rows


def _same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
  width = {2: np.uint16, 4: np.uint32, 1: np.uint8}[a.dtype.itemsize]
  np.testing.assert_array_equal(a.view(width), b.view(width))


SHAPES = [(64, 16), (33, 7), (5, 1), (8, 128)]


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_bit_exact_with_fbgemm_reference(shape):
  x = _rows(1, *shape)
  qr = jax.jit(quant.quantize_rowwise_int8)(x)
  q, scale, bias = quant.quantize_rowwise_int8_reference(x)
  assert qr.q.dtype == jnp.uint8 and qr.q.shape == shape and qr.bits == 8 and qr.dim == shape[1]
  np.testing.assert_array_equal(qr.q, q)
  _same_bits(qr.scale, scale)
  _same_bits(qr.bias, bias)
  # FBGEMM's dequantization rounds q * scale + bias once (double in its reference, FMA in
  # its kernels): bit for bit, fused by XLA or not.
  _same_bits(quant.dequantize_rowwise_int8(qr), quant.dequantize_rowwise_int8_reference(q, scale, bias))
  if shape[1] > 1:                                    # every non-constant row spans 0..255
    assert (q[2:].max(axis=1) == 255).all() and (q[2:].min(axis=1) == 0).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_nbit_bit_exact_with_fbgemm_reference(shape, bits):
  x = _rows(2, *shape)
  qr = jax.jit(quant.quantize_rowwise_nbit, static_argnums=1)(x, bits)
  packed, scale, bias = quant.quantize_rowwise_nbit_reference(x, bits)
  assert qr.q.shape == (shape[0], -(-shape[1] * bits // 8)) and qr.scale.dtype == jnp.float16
  np.testing.assert_array_equal(qr.q, packed)
  _same_bits(qr.scale, scale)
  _same_bits(qr.bias, bias)
  # A float16 scale times a code of <= 8 bits is exact in float32: one rounding anywhere.
  _same_bits(quant.dequantize_rowwise_nbit(qr),
             quant.dequantize_rowwise_nbit_reference(packed, scale, bias, bits, shape[1]))
  np.testing.assert_array_equal(quant.unpack_nbit(qr.q, bits, shape[1]) >> bits, 0)
  pad = qr.q.shape[1] * (8 // bits) - shape[1]
  if pad:                                             # padding codes stay 0
    assert (np.asarray(qr.q)[:, -1] >> (8 - pad * bits) == 0).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_edge_rows(bits):
  """NaN / Inf rows: NaN scale and bias, codes 0; overflowing range: Inf scale (8-bit),
  dequantizes to NaN; subnormals and signed zeros: as the references, bit for bit."""
  x = _edge_rows()
  if bits == 8:
    qr = quant.quantize_rowwise_int8(x)
    want = quant.quantize_rowwise_int8_reference(x)
    deq_want = quant.dequantize_rowwise_int8_reference(*want)
  else:
    qr = quant.quantize_rowwise_nbit(x, bits)
    want = quant.quantize_rowwise_nbit_reference(x, bits)
    deq_want = quant.dequantize_rowwise_nbit_reference(*want, bits, x.shape[1])
  for got, w in zip((qr.q, qr.scale, qr.bias), want):
    _same_bits(got, w)
  deq = np.asarray(quant.dequantize_rowwise(qr))
  np.testing.assert_array_equal(np.isnan(deq), np.isnan(deq_want))
  ok = ~np.isnan(deq_want)
  _same_bits(deq[ok], deq_want[ok])
  assert np.isnan(deq[1:4]).all() and np.isnan(np.asarray(qr.scale[1:4], np.float32)).all()
  assert (np.asarray(qr.q)[1:4] == 0).all()
  if bits == 8:
    assert np.isinf(qr.scale[5]) and np.isnan(deq[5]).all()
  assert np.asarray(qr.bias[6]).view(np.uint32 if bits == 8 else np.uint16) >> (
      31 if bits == 8 else 15) == 1                      # -0 orders below +0
  np.testing.assert_array_equal(deq[6], 0.0)
  assert (np.asarray(qr.q)[4] == 0).all()               # subnormal range reads as 0


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


def test_nbit_hand_computed():
  # 0..15: bias 0, scale 1, code c at column c; even column in the low nibble.
  qr = quant.quantize_rowwise_int4(np.arange(16, dtype=np.float32)[None])
  np.testing.assert_array_equal(qr.q, [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]])
  np.testing.assert_array_equal(qr.scale, [1.0])
  np.testing.assert_array_equal(qr.bias, [0.0])
  np.testing.assert_array_equal(quant.dequantize_rowwise_int4(qr), np.arange(16)[None])
  # 2 bits: 0, 1, 2, 3 packed low bits first: 0b11_10_01_00; a fifth column starts byte 2.
  qr = quant.quantize_rowwise_nbit(np.array([[0, 1, 2, 3, 3]], np.float32), 2)
  np.testing.assert_array_equal(qr.q, [[0b11100100, 0b11]])
  np.testing.assert_array_equal(qr.scale, [1.0])
  # 8 bits with float16 scale and bias: 0..255 is its own code.
  qr = quant.quantize_rowwise_nbit(np.arange(256, dtype=np.float32)[None], 8)
  np.testing.assert_array_equal(qr.q, np.arange(256)[None])
  assert qr.scale.dtype == jnp.float16 and float(qr.scale[0]) == 1.0
  # Constant row: scale 1 (FBGEMM's corner case), every code 0, exact round trip.
  qr = quant.quantize_rowwise_int4(np.full((1, 3), 0.5, np.float32))
  np.testing.assert_array_equal(qr.scale, [1.0])
  np.testing.assert_array_equal(qr.q, [[0, 0]])
  np.testing.assert_array_equal(quant.dequantize_rowwise_int4(qr), [[0.5, 0.5, 0.5]])
  # Range 1.5 over 3 steps: fp16(0.5) exact; 0.25 is half a step: ties to even (0).
  qr = quant.quantize_rowwise_nbit(np.array([[0.0, 0.25, 0.75, 1.5]], np.float32), 2)
  np.testing.assert_array_equal(quant.unpack_nbit(qr.q, 2, 4), [[0, 0, 2, 3]])


# FBGEMM's hand-calculated fused rows (test/QuantUtilsTest.cc,
# EmbeddingQuantizeFixedNumberTest): row 1 constant, row 2 has range 255 and min -64, and
# 61.625 becomes 61.5 in float16. Codes, then scale and bias bytes (little-endian).
_FBGEMM_INPUT = [[1, 1, 1, 1], [-64, -2.75, 61.625, 191]]
_FBGEMM_FUSED = {
    8: [[0, 0, 0, 0, 0x00, 0x3c, 0x00, 0x3c], [0, 61, 126, 255, 0x00, 0x3c, 0x00, 0xd4]],
    4: [[0x00, 0x00, 0x00, 0x3c, 0x00, 0x3c], [0x40, 0xf7, 0x40, 0x4c, 0x00, 0xd4]],
    2: [[0b00000000, 0x00, 0x3c, 0x00, 0x3c], [0b11010100, 0x50, 0x55, 0x00, 0xd4]],
}
_FBGEMM_FUSED_FLOAT = [[0, 0, 0, 0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x3f],
                       [0, 61, 126, 255, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x80, 0xc2]]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_fbgemm_fixed_number_vectors(bits):
  x = np.float32(_FBGEMM_INPUT)
  fused = quant.to_fused_bytes(quant.quantize_rowwise_nbit(x, bits))
  np.testing.assert_array_equal(fused, _FBGEMM_FUSED[bits])
  if bits == 8:   # the 8-bit SBFloat layout: scale 0 and bias 1, scale 1 and bias -64
    fused = quant.to_fused_bytes(quant.quantize_rowwise_int8(x))
    np.testing.assert_array_equal(fused, _FBGEMM_FUSED_FLOAT)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_round_trip_error_bound(bits):
  """|x - deq(q(x))| <= bound per row (scale/2 for 8-bit, plus fp16 roundings for N-bit),
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


def test_nbit_bias_rounding_term_is_needed():
  """Rows far from zero: fp16(100.05) = 100.0625 (ulp 1/16 there) lies above the row's
  minimum, whose values clip to code 0, off by more than half a step; the bound's
  |min - bias| term accounts for it."""
  rng = np.random.default_rng(4)
  x = (100.05 + rng.uniform(0, 0.15, (16, 8))).astype(np.float32)
  x[:, 0] = np.float32(100.05)
  qr = quant.quantize_rowwise_int4(x)
  err = np.abs(np.asarray(quant.dequantize_rowwise_int4(qr)) - x).max(axis=1)
  scale = np.asarray(qr.scale, np.float32)
  assert float(qr.bias[0]) == 100.0625
  assert (err > scale / 2 * 1.01).any()
  assert (err <= np.asarray(quant.rowwise_error_bound(qr, x)) + 1e-5).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_nbit_bound_holds_for_a_subnormal_fp16_scale(bits):
  """Rows of range < qmax * 2^-14 get a float16 subnormal scale, whose rounding is up to
  2^-25 absolute, far more than scale * 2^-11: range / qmax = 1.49 * 2^-24 rounds to 2^-24,
  so the top code clips by 0.49 * qmax * 2^-24. And DLRM-init rows (+-1e-3) in 8 bits."""
  qmax = (1 << bits) - 1
  rng = np.random.default_rng(5)
  x = np.stack([np.linspace(0, qmax * 1.49 * 2.0 ** -24, 16),
                rng.uniform(-1e-3, 1e-3, 16)]).astype(np.float32)
  qr = quant.quantize_rowwise_nbit(x, bits)
  assert np.asarray(qr.scale[0], np.float32) == 2.0 ** -24
  err = np.abs(np.asarray(quant.dequantize_rowwise_nbit(qr)) - x).max(axis=1)
  # Every value is below 2^-9, so float32 rounding of the dequantized row is < 2^-33.
  assert (err <= np.asarray(quant.rowwise_error_bound(qr, x)) + 2.0 ** -33).all(), err
  assert err[0] > 0.4 * qmax * 2.0 ** -24                    # the clipped top code


@pytest.mark.parametrize("bits,half,dim", [(8, False, 16), (8, True, 16), (4, True, 16),
                                           (4, True, 7), (2, True, 7)])
def test_fused_bytes_layout(bits, half, dim):
  """FBGEMM's fused rows: codes, then scale and bias bytes (little-endian)."""
  x = _rows(5, 6, dim)
  qr = quant.quantize_rowwise_nbit(x, bits) if half else quant.quantize_rowwise_int8(x)
  fused = np.asarray(quant.to_fused_bytes(qr))
  q, s, b = map(np.asarray, (qr.q, qr.scale, qr.bias))
  sb = np.stack([s, b], axis=1).astype(s.dtype.newbyteorder("<"))      # [N, 2]
  want = np.concatenate([q, sb.view(np.uint8).reshape(q.shape[0], -1)], axis=1)
  np.testing.assert_array_equal(fused, want)
  assert fused.shape[1] == q.shape[1] + (4 if half else 8)
  back = quant.from_fused_bytes(jnp.asarray(fused), bits, dim, half)
  for a, c in ((back.q, q), (back.scale, s), (back.bias, b)):
    np.testing.assert_array_equal(a, c)
  with pytest.raises(ValueError, match="expected \\[N, "):
    quant.from_fused_bytes(jnp.asarray(fused[:, 1:]), bits, dim, half)


def test_errors():
  with pytest.raises(ValueError, match="rows shape \\(3,\\), expected \\[N, D\\]"):
    quant.quantize_rowwise_int8(np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="bits=3, expected 8, 4 or 2"):
    quant.quantize_rowwise(np.zeros((2, 2), np.float32), bits=3)
  with pytest.raises(ValueError, match="bits=3, expected one of \\(2, 4, 8\\)"):
    quant.quantize_rowwise_nbit(np.zeros((2, 2), np.float32), 3)
  qr4 = quant.quantize_rowwise_int4(np.zeros((2, 2), np.float32))
  with pytest.raises(ValueError, match="expected 8 with float32 scale"):
    quant.dequantize_rowwise_int8(qr4)


def test_is_a_pytree_under_jit():
  x = _rows(6, 8, 8)
  qr = quant.quantize_rowwise_int8(x)
  leaves, tree = jax.tree.flatten(qr)
  assert len(leaves) == 3                                # bits and dim are static
  out = jax.jit(quant.dequantize_rowwise)(qr)
  _same_bits(out, quant.dequantize_rowwise(jax.tree.unflatten(tree, leaves)))


def test_dequantize_gradients_are_those_of_q_scale_plus_bias():
  qr = quant.quantize_rowwise_int8(_rows(7, 4, 5))
  g = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
  f = lambda s, b: jnp.sum(quant.dequantize_rowwise_int8(
      quant.RowwiseQuantized(qr.q, s, b, 8, 5)) * g)
  ds, db = jax.grad(f, argnums=(0, 1))(qr.scale, qr.bias)
  np.testing.assert_allclose(ds, (np.asarray(qr.q, np.float32) * g).sum(1), rtol=1e-6)
  np.testing.assert_allclose(db, g.sum(1), rtol=1e-6)


# ---------------------------------------------------------------------------- exact


def _bit_patterns(n, seed):
  rng = np.random.default_rng(seed)
  rand = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  close = (rng.normal(size=n) * 10.0 ** rng.integers(-40, 38, n)).astype(np.float32)
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 2.0 ** -126,
                      3.4e38, 1.0, 255.0, 15.0, 3.0], np.float32)
  return rand, close, special


def test_div_rn_is_ieee_division():
  """Every float32 pair class: random bit patterns (all exponents, subnormals, NaN
  payloads), magnitudes near each other, and the IEEE special cases."""
  rand, close, special = _bit_patterns(100_000, 0)
  sa, sb = np.meshgrid(special, special)
  a = np.concatenate([rand, close, close, sa.ravel()])
  b = np.concatenate([rand[::-1], close[::-1], np.roll(close, 1) * np.float32(1.0001),
                      sb.ravel()])
  got = np.asarray(jax.jit(exact.div_rn)(a, b))
  with np.errstate(all="ignore"):
    want = a / b
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  _same_bits(got[~nan], want[~nan])


def test_div_rn_runs_no_loop():
  """Unrolled integer steps, no while loop: on a GPU each trip of one is a kernel and a host
  read of its predicate (a 26-trip loop per FP8 scale made the FP8 step slower than bf16)."""
  hlo = jax.jit(exact.div_rn).lower(np.float32(1.0), np.ones(4, np.float32)).as_text()
  assert "while" not in hlo and "stablehlo.divide" in hlo


def _round_once(x: fractions.Fraction) -> np.float32:
  """x rounded to the nearest float32, ties to even (from exact rationals)."""
  f = np.float32(float(x))
  cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
  return min(cands, key=lambda c: (abs(fractions.Fraction(float(c)) - x),
                                   int(np.asarray(c).view(np.uint32)) & 1))


def test_fma_rn_rounds_once():
  """q * scale + bias rounded once (checked against exact rationals), including sums that
  cancel and scale / bias magnitudes far apart; |scale| < 2^-103 reads as 0, and so does
  |bias| < 2^-103 unless q * scale is 0 (then the result is the bias)."""
  rng = np.random.default_rng(1)
  n = 4000
  q = rng.integers(0, 256, n).astype(np.float32)
  s = (rng.random(n) * 10.0 ** rng.uniform(-25, 30, n)).astype(np.float32)
  b = (rng.normal(size=n) * 10.0 ** rng.uniform(-25, 30, n)).astype(np.float32)
  b[: n // 4] = -(q * s)[: n // 4] * np.float32(1 + 1e-6)      # near cancellation
  b[n // 4: n // 2] = -(q * s)[n // 4: n // 2]                   # product's rounding only
  s[-3:] = np.float32(1e-32)                                    # read as 0
  b[-2:] = np.float32(1e-35)                                    # kept: q * s reads as 0
  q[-5:-3], b[-5:-3] = 7, np.float32(1e-35)                     # read as 0
  got = np.asarray(jax.jit(exact.fma_rn)(q, s, b))
  tiny = np.float32(2.0 ** -103)
  s_eff = np.where(np.abs(s) < tiny, 0, s)
  b_eff = np.where((np.abs(b) < tiny) & (q * s_eff != 0), 0, b)   # kept when q * s is 0
  want = np.array([_round_once(fractions.Fraction(float(qi)) * fractions.Fraction(float(si))
                               + fractions.Fraction(float(bi)))
                   for qi, si, bi in zip(q, s_eff, b_eff)], np.float32)
  _same_bits(got, want)
  # The two-rounding product + sum differs on many of these: the test can tell them apart.
  assert (((q * s_eff).astype(np.float32) + b_eff) != want).sum() > n // 10


def test_order_key_is_a_total_order():
  x = np.array([-np.inf, -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-45, 1e-40, 2.0 ** -126, 1.0,
                np.inf], np.float32)
  k = np.asarray(exact.order_key(x))
  assert (np.diff(k) > 0).all()
  _same_bits(exact.from_order_key(k), x)


def test_ftz():
  x = np.array([1e-40, -1e-40, 2.0 ** -126, -(2.0 ** -126), 0.0], np.float32)
  _same_bits(exact.ftz(x), np.array([0.0, -0.0, 2.0 ** -126, -(2.0 ** -126), 0.0], np.float32))


QUANTIZERS = {
    "int8": lambda x: quant.dequantize_rowwise(quant.quantize_rowwise_int8(x)),
    "nbit4": lambda x: quant.dequantize_rowwise(quant.quantize_rowwise_nbit(x, 4)),
    "fp8_row": lambda x: quant.dequantize_fp8(quant.quantize_fp8(x, "e4m3", "row")),
    "mxfp4": lambda x: quant.dequantize_mx(quant.quantize_mx(x, "mxfp4")),
    "mx6": lambda x: quant.dequantize_bdr(quant.quantize_bdr(x, "mx6")),
    "bf16_sr": lambda x: quant.stochastic_round_bf16(x, jax.random.key(0)),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_no_float_division_reaches_xla(name, platform):
  """XLA:GPU divides float32 approximately (div.full.f32, up to 2 ulp) and XLA may turn
  x / c into x * (1 / c): the quantizers lower to no floating-point division at all, on
  CPU and for an abstract CUDA device (ahead-of-time lowering, no GPU needed)."""
  x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
  text = jax.jit(QUANTIZERS[name]).trace(x).lower(lowering_platforms=(platform,)).as_text()
  divides = re.findall(r"stablehlo\.divide[^\n]*", text)
  assert not [d for d in divides if re.search(r"tensor<[^>]*f(16|32|64)>", d)], divides


# ------------------------------------------------------------- FBGEMM (peer environment)

_FBGEMM_ROWWISE = r'''
import sys
import numpy as np, torch, fbgemm_gpu
inp = dict(np.load(sys.argv[1]))
ops, out = torch.ops.fbgemm, {}
x = torch.from_numpy(inp["x"])
out["q8"] = ops.FloatToFused8BitRowwiseQuantized(x).numpy()
out["d8"] = ops.Fused8BitRowwiseQuantizedToFloat(torch.from_numpy(inp["f8"])).numpy()
for b in (2, 4, 8):
    out[f"q{b}h"] = ops.FloatToFusedNBitRowwiseQuantizedSBHalf(x, b).numpy()
    out[f"d{b}h"] = ops.FusedNBitRowwiseQuantizedSBHalfToFloat(
        torch.from_numpy(inp[f"f{b}h"]), b).numpy()
np.savez(sys.argv[2], **out)
'''


@pytest.mark.peer
def test_fused_rows_bit_exact_with_fbgemm_ops(tmp_path):
  """FBGEMM's own CPU ops (fbgemm_gpu: FloatToFused8BitRowwiseQuantized,
  FloatToFusedNBitRowwiseQuantizedSBHalf and their inverses), not a transcription: the fused
  rows of float rows (wide magnitudes, constant, one huge value, ties, signed zeros, fp16
  scales that are subnormal), and the floats of random fused rows (any scale and bias,
  8-bit's q * scale + bias rounded once, as FBGEMM's FMA does), bit for bit. Rows with a
  subnormal range are left out: FBGEMM keeps the subnormal, XLA:CPU reads it as 0."""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  d = 16                                   # FBGEMM's SBHalf ops need an even width
  x = _rows(7, 96, d)
  x[4] = 0.0
  x[4, 3] = 1e4                            # one huge value
  x[5] = np.where(np.arange(d) % 2, 0.0, -0.0)
  x[6] = np.arange(d) * 0.5 + 0.25         # many exact ties
  x[7] = np.linspace(0, 15 * 1.49 * 2.0 ** -24, d)    # fp16 subnormal scales
  x[8] = np.linspace(-1e-3, 1e-3, d)
  x[9] = 65000.0
  x[9, 0] = 65519.0                        # bias at float16's largest
  rng = np.random.default_rng(8)
  layouts = (("8", 8, False), ("8h", 8, True), ("4h", 4, True), ("2h", 2, True))
  fused = {}
  for key, bits, half in layouts:
    codes = rng.integers(0, 256, (64, quant.packed_width(d, bits))).astype(np.uint8)
    if half:                                   # every float16 bit pattern
      sb = rng.integers(0, 1 << 16, (64, 2)).astype(np.uint16)
    else:
      sb = (rng.normal(size=(64, 2)) * 10.0 ** rng.uniform(-8, 3, (64, 1))).astype(np.float32)
    fused[f"f{key}"] = np.concatenate([codes, sb.view(np.uint8)], 1)
  np.savez(tmp_path / "in.npz", x=x, **fused)
  peer_env.run_script(peer, _FBGEMM_ROWWISE, tmp_path, "fbgemm_gpu")
  fb = dict(np.load(tmp_path / "out.npz"))
  np.testing.assert_array_equal(quant.to_fused_bytes(quant.quantize_rowwise_int8(x)), fb["q8"])
  for bits in (8, 4, 2):
    np.testing.assert_array_equal(quant.to_fused_bytes(quant.quantize_rowwise_nbit(x, bits)),
                                  fb[f"q{bits}h"], err_msg=f"{bits}-bit")
  for key, bits, half in layouts:
    got = np.asarray(quant.dequantize_rowwise(quant.from_fused_bytes(fused[f"f{key}"], bits, d,
                                                                      half=half)))
    want = fb[f"d{key}"]
    assert np.array_equal(np.isnan(got), np.isnan(want)), key
    _same_bits(got[~np.isnan(got)], want[~np.isnan(want)])
