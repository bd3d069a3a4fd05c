"""FBGEMM's row-wise integer formats for embedding tables (arXiv 2101.05615), the formats
TorchRec / FBGEMM use for quantized table-batched embeddings.

Specified by FBGEMM's reference code, src/QuantUtils.cc (pytorch/FBGEMM at 71d6f8b2):

  8-bit, float32 scale and bias (`FloatOrHalfToFused8BitRowwiseQuantizedSBFloatRef`), per
  row r:  scale_r = range_r / 255,  bias_r = min_r,  range_r = max_r - min_r  (float32)
          q = lrint((x - min_r) * (255 / (range_r + 1e-8)))     (uint8, 0..255)
  N-bit, N in {2, 4, 8}, float16 scale and bias
  (`FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfRef`):
          bias_r = fp16(min_r), lo = float32(bias_r), range_r = max_r - lo
          scale_r = fp16(range_r / (2^N - 1)); 1 when range_r == 0 or fp16 rounds it to 0
          q = clamp(lrint((x - lo) * (1 / scale_r)), 0, 2^N - 1)
          codes packed 8 / N per byte, column c in bits (c mod (8/N)) * N up: low bits first
  dequantization (`Fused8BitRowwiseQuantizedSBFloatToFloatOrHalfRef`, `FusedNBit...Ref`):
          x ~= q * scale_r + bias_r, rounded once (FBGEMM's reference writes it in float,
          which compilers contract into one fused multiply-add, as its AVX2 and CUDA
          kernels do; N-bit: a float16 scale times a code of <= 8 bits is exact, so the
          only rounding is the add's)

`lrint` rounds half to even; every step is float32. FBGEMM's Python test references
(fbgemm_gpu/test/quantize/common.py) round halves away from zero and compute the N-bit
inverse in float64, so at exact ties they can differ from the C++ reference by one code.

Here every step is computed so that the bits are the same on every XLA backend (see
core/quant/exact.py for why plain jnp is not): divisions are correctly rounded in integer
arithmetic, min / max are integer reductions over an order key (-0 orders below +0, where
FBGEMM's std::min_element keeps the first of equal values, so a zero bias may carry the
other sign; the values are equal), 8-bit dequantization is `exact.fma_rn`. The contract
beyond FBGEMM's, for inputs FBGEMM leaves undefined or that XLA:CPU cannot reproduce:
  - a row holding NaN or +-Inf gets NaN scale and bias and codes 0 (dequantizes to NaN);
  - a finite row whose range or scale overflows gets an Inf scale and codes 0 (it too
    dequantizes to NaN); N-bit rows need min and range / (2^N - 1) within float16;
  - float32 subnormals in max, min and the range read as 0 (XLA:CPU flushes them);
    codes, and bias bits, are those of FBGEMM for every input;
  - 8-bit dequantization reads |scale| below 2^-103 as 0, and |bias| below 2^-103 as 0
    unless the code or the scale is 0 (then it returns the bias, as FBGEMM does).
The numpy references below are transcriptions of FBGEMM's C++ with the same contract.
Round-trip error per element: 8-bit |x - deq(q(x))| <= scale / 2 + 1e-8 up to float32
rounding; N-bit adds the float16 roundings of scale and bias (`rowwise_error_bound`).

FBGEMM stores scale and bias fused at the end of each row (`to_fused_bytes` gives that
byte layout); here they are kept apart (`RowwiseQuantized`) so a kernel can load the
codes as one aligned [N, P] array and the per-row scalars as [N] vectors.

Letters: N rows, D columns (embedding dim), P bytes of codes per row (D for 8-bit,
ceil(D * bits / 8) for N-bit).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from core.quant import exact

INT8_EPS = 1e-8   # FBGEMM's kEpsilon in the 8-bit inverse scale
NBIT_RATES = (2, 4, 8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowwiseQuantized:
  """Row-wise quantized rows: codes [N, P] uint8, per-row scale and bias [N] (FBGEMM).

  float32 scale and bias: FBGEMM's 8-bit SBFloat format (bits 8); float16: its N-bit
  SBHalf format (bits 2, 4 or 8, codes packed low bits first).
  """

  q: jax.Array          # [N, P] uint8 codes
  scale: jax.Array      # [N] float32 (8-bit SBFloat) or float16 (N-bit SBHalf)
  bias: jax.Array       # [N] like scale
  bits: int = dataclasses.field(default=8, metadata=dict(static=True))
  dim: int = dataclasses.field(default=0, metadata=dict(static=True))   # D

  @property
  def shape(self) -> tuple[int, int]:
    """Shape of the float rows these codes stand for: (N, D)."""
    return (self.q.shape[0], self.dim)

  @property
  def half(self) -> bool:
    """True for the N-bit SBHalf layout (float16 scale and bias)."""
    return self.scale.dtype == jnp.float16


def packed_width(dim: int, bits: int) -> int:
  """Bytes of codes per row: ceil(dim * bits / 8)."""
  per = 8 // bits
  return (dim + per - 1) // per


def _check_rows(x, where):
  if x.ndim != 2:
    raise ValueError(f"core/quant/rowwise.py {where}: rows shape {x.shape}, expected [N, D]")


def _check_bits(bits, where):
  if bits not in NBIT_RATES:
    raise ValueError(f"core/quant/rowwise.py {where}: bits={bits}, expected one of {NBIT_RATES}")


def _row_min_max(x):
  """(min, max, any non-finite) per row, by integer order keys."""
  key = exact.order_key(x)
  lo = exact.from_order_key(jnp.min(key, axis=1))
  hi = exact.from_order_key(jnp.max(key, axis=1))
  bad = jnp.any(exact.abs_bits(x) >= 0x7F800000, axis=1)
  return lo, hi, bad


def _codes(v, qmax):
  """Codes round-half-even(v) clamped to [0, qmax]; NaN (0 * Inf) gives 0."""
  c = jnp.clip(jnp.round(v), 0, qmax)
  return jnp.where(jnp.isnan(c), 0, c).astype(jnp.uint8)


# -------------------------------------------------------------------------------- 8-bit


@jax.jit
def quantize_rowwise_int8(x_ND: jax.Array) -> RowwiseQuantized:
  """FBGEMM row-wise 8-bit (float32 scale and bias) of float rows `x_ND`."""
  _check_rows(x_ND, "quantize_rowwise_int8")
  x = jnp.asarray(x_ND, jnp.float32)
  lo, hi, bad = _row_min_max(x)
  range_N = exact.ftz(exact.ftz(hi) - exact.ftz(lo))
  scale = exact.div_rn(range_N, jnp.float32(255.0))
  inv = exact.div_rn(jnp.float32(255.0), range_N + jnp.float32(INT8_EPS))
  # (x - min) * inv lies in [0, 255 * range / (range + eps)] < 255.5: clip only guards NaN.
  q = _codes((x - lo[:, None]) * inv[:, None], 255)
  q = jnp.where(bad[:, None], jnp.uint8(0), q)
  scale = jnp.where(bad, jnp.nan, scale)
  bias = jnp.where(bad, jnp.nan, lo)
  return RowwiseQuantized(q, scale, bias, bits=8, dim=x.shape[1])


@jax.jit
def dequantize_rowwise_int8(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows q * scale + bias (rounded once) of an 8-bit SBFloat `RowwiseQuantized`."""
  if qr.bits != 8 or qr.half:
    raise ValueError(f"dequantize_rowwise_int8: bits={qr.bits}, scale {qr.scale.dtype}; "
                     "expected 8 with float32 scale")
  return exact.fma_rn(qr.q.astype(jnp.float32), qr.scale[:, None], qr.bias[:, None])


# -------------------------------------------------------------------------------- N-bit


@functools.partial(jax.jit, static_argnames="bits")
def quantize_rowwise_nbit(x_ND: jax.Array, bits: int) -> RowwiseQuantized:
  """FBGEMM row-wise N-bit (float16 scale and bias, 8 / bits codes per byte)."""
  _check_rows(x_ND, "quantize_rowwise_nbit")
  _check_bits(bits, "quantize_rowwise_nbit")
  x = jnp.asarray(x_ND, jnp.float32)
  n, d = x.shape
  qmax = (1 << bits) - 1
  mn, mx, bad = _row_min_max(x)
  bias_h = mn.astype(jnp.float16)
  lo = bias_h.astype(jnp.float32)            # the codes are taken against the fp16 bias
  range_N = exact.ftz(exact.ftz(mx) - lo)
  scale = jnp.where(range_N == 0, jnp.float32(1.0), exact.div_rn(range_N, jnp.float32(qmax)))
  scale = scale.astype(jnp.float16).astype(jnp.float32)
  scale = jnp.where(scale == 0, jnp.float32(1.0), scale)    # underflowed in fp16
  inv = exact.div_rn(jnp.float32(1.0), scale)
  bad_inv = jnp.isinf(inv)
  scale, inv = jnp.where(bad_inv, 1.0, scale), jnp.where(bad_inv, 1.0, inv)
  codes = _codes((x - lo[:, None]) * inv[:, None], qmax)
  codes = jnp.where(bad[:, None], jnp.uint8(0), codes)
  scale_h = jnp.where(bad, jnp.nan, scale).astype(jnp.float16)
  bias_h = jnp.where(bad, jnp.float16(jnp.nan), bias_h)
  return RowwiseQuantized(pack_nbit(codes, bits), scale_h, bias_h, bits=bits, dim=d)


@functools.partial(jax.jit, static_argnames="bits")
def pack_nbit(codes_ND: jax.Array, bits: int) -> jax.Array:
  """Codes [N, D] (uint8, < 2^bits) packed [N, ceil(D * bits / 8)], low bits first."""
  per = 8 // bits
  n, d = codes_ND.shape
  pad = packed_width(d, bits) * per - d
  c = jnp.pad(codes_ND.astype(jnp.uint8), ((0, 0), (0, pad))).reshape(n, -1, per)
  out = c[..., 0]
  for i in range(1, per):
    out = out | (c[..., i] << jnp.uint8(i * bits))
  return out


@functools.partial(jax.jit, static_argnames=("bits", "dim"))
def unpack_nbit(packed_NP: jax.Array, bits: int, dim: int) -> jax.Array:
  """The codes [N, dim] (uint8, < 2^bits) of packed rows [N, P]."""
  per = 8 // bits
  shifts = jnp.arange(per, dtype=jnp.uint8) * bits
  codes = (packed_NP[:, :, None] >> shifts) & jnp.uint8((1 << bits) - 1)
  return codes.reshape(packed_NP.shape[0], packed_NP.shape[1] * per)[:, :dim]   # N may be 0


@functools.partial(jax.jit, static_argnames="dim")
def unpack_int4(packed_NP: jax.Array, dim: int) -> jax.Array:
  """The 4-bit codes [N, dim] (uint8, 0..15) of packed pairs [N, ceil(dim / 2)]."""
  return unpack_nbit(packed_NP, 4, dim)


@jax.jit
def dequantize_rowwise_nbit(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows scale * code + bias of an N-bit SBHalf `RowwiseQuantized` (the product
  of a float16 scale and a code of <= 8 bits is exact, so any backend rounds once)."""
  if not qr.half:
    raise ValueError(f"dequantize_rowwise_nbit: scale {qr.scale.dtype}, expected float16")
  codes = unpack_nbit(qr.q, qr.bits, qr.dim).astype(jnp.float32)
  return qr.scale.astype(jnp.float32)[:, None] * codes + qr.bias.astype(jnp.float32)[:, None]


@jax.jit
def quantize_rowwise_int4(x_ND: jax.Array) -> RowwiseQuantized:
  """FBGEMM row-wise int4 (float16 scale and bias, two codes per byte)."""
  return quantize_rowwise_nbit(x_ND, 4)


@jax.jit
def dequantize_rowwise_int4(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows of an int4 `RowwiseQuantized`."""
  if qr.bits != 4:
    raise ValueError(f"dequantize_rowwise_int4: bits={qr.bits}, expected 4")
  return dequantize_rowwise_nbit(qr)


# ------------------------------------------------------------------------------ generic


@functools.partial(jax.jit, static_argnames="bits")
def quantize_rowwise(x_ND: jax.Array, bits: int = 8) -> RowwiseQuantized:
  """Row-wise 8-bit SBFloat (`bits=8`) or N-bit SBHalf (`bits=4` or `2`) quantization;
  `quantize_rowwise_nbit(x, 8)` gives 8 bits with float16 scale and bias."""
  if bits == 8:
    return quantize_rowwise_int8(x_ND)
  if bits in (2, 4):
    return quantize_rowwise_nbit(x_ND, bits)
  raise ValueError(f"core/quant/rowwise.py quantize_rowwise: bits={bits}, expected 8, 4 or 2")


@jax.jit
def dequantize_rowwise(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows [N, D] of a `RowwiseQuantized` of any layout."""
  return dequantize_rowwise_nbit(qr) if qr.half else dequantize_rowwise_int8(qr)


@jax.jit
def rowwise_error_bound(qr: RowwiseQuantized, x_ND: jax.Array | None = None) -> jax.Array:
  """Per-row bound [N] on |x - dequantize(quantize(x))|, before float32 rounding.

  8-bit: scale/2 + 1e-8: rounding to the nearest code is off by half a step, and the
  inverse scale 255 / (range + 1e-8) shrinks each code by at most 1e-8 in value.
  N-bit: the codes are taken against the fp16 bias and fp16 scale, so half a step plus
  the two float16 roundings: the top code may clip (max - bias exceeds qmax * scale by at
  most qmax times half an fp16 ulp of the scale: scale * 2^-11 for a normal scale, 2^-25
  for a subnormal one, below 2^-14, which rows of range < qmax * 2^-14 get, e.g. DLRM's
  +-1e-3 init rows in 8 bits), and the bias' rounding (given `x_ND`, |min - bias|) moves
  the bottom of the range, where values below the bias clip to code 0.
  """
  scale = qr.scale.astype(jnp.float32)
  if not qr.half:
    return scale / 2 + INT8_EPS
  qmax = (1 << qr.bits) - 1
  half_ulp = jnp.maximum(scale * 2.0 ** -11, jnp.float32(2.0 ** -25))
  bound = scale / 2 + qmax * half_ulp
  if x_ND is not None:
    bound = bound + jnp.abs(jnp.min(jnp.asarray(x_ND, jnp.float32), axis=1)
                            - qr.bias.astype(jnp.float32))
  return bound


@jax.jit
def to_fused_bytes(qr: RowwiseQuantized) -> jax.Array:
  """FBGEMM's fused row layout [N, P + 8] (f32 scale, f32 bias) or [N, P + 4] (f16 scale,
  f16 bias), the scale and bias bytes little-endian after the codes."""
  sb = jnp.stack([qr.scale, qr.bias], axis=1)                      # [N, 2]
  sb_bytes = jax.lax.bitcast_convert_type(sb, jnp.uint8).reshape(qr.q.shape[0], -1)
  return jnp.concatenate([qr.q, sb_bytes], axis=1)


@functools.partial(jax.jit, static_argnames=("bits", "dim", "half"))
def from_fused_bytes(fused_NB: jax.Array, bits: int, dim: int,
                     half: bool | None = None) -> RowwiseQuantized:
  """Inverse of `to_fused_bytes` for rows of width `dim`; half (float16 scale and bias)
  defaults to bits != 8."""
  _check_bits(bits, "from_fused_bytes")
  half = bits != 8 if half is None else half
  p = packed_width(dim, bits)
  dtype, width = (jnp.float16, 2) if half else (jnp.float32, 4)
  if fused_NB.ndim != 2 or fused_NB.shape[1] != p + 2 * width:
    raise ValueError(
        f"core/quant/rowwise.py from_fused_bytes: shape {fused_NB.shape}, expected "
        f"[N, {p + 2 * width}] for bits={bits}, dim={dim}, half={half}")
  n = fused_NB.shape[0]
  sb = jax.lax.bitcast_convert_type(fused_NB[:, p:].reshape(n, 2, width), dtype)
  return RowwiseQuantized(fused_NB[:, :p], sb[:, 0], sb[:, 1], bits=bits, dim=dim)


# ------------------------------------------------------------------- numpy references


def _ftz_np(v):
  v = np.asarray(v, np.float32)
  return np.where(np.abs(v) < np.float32(2.0 ** -126), np.copysign(np.float32(0), v), v)


def _row_min_max_np(x):
  s = np.ascontiguousarray(x).view(np.int32)
  key = np.where(s < 0, s ^ np.int32(0x7FFFFFFF), s)
  unkey = lambda k: np.where(k < 0, k ^ np.int32(0x7FFFFFFF), k).astype(np.int32).view(np.float32)
  return unkey(key.min(axis=1)), unkey(key.max(axis=1)), ~np.isfinite(x).all(axis=1)


def quantize_rowwise_int8_reference(x_ND: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """numpy transcription of FBGEMM's FloatOrHalfToFused8BitRowwiseQuantizedSBFloatRef:
  `(q [N, D] uint8, scale [N] f32, bias [N] f32)`, every step in float32."""
  x = np.asarray(x_ND, np.float32)
  _check_rows(x, "quantize_rowwise_int8_reference")
  lo, hi, bad = _row_min_max_np(x)
  with np.errstate(invalid="ignore", over="ignore"):
    rng = _ftz_np(_ftz_np(hi) - _ftz_np(lo))
    scale = (rng / np.float32(255.0)).astype(np.float32)
    inv = (np.float32(255.0) / (rng + np.float32(INT8_EPS))).astype(np.float32)
    v = ((x - lo[:, None]) * inv[:, None]).astype(np.float32)
    q = np.where(np.isnan(v), 0, np.clip(np.rint(v), 0, 255)).astype(np.uint8)
  q[bad] = 0
  return q, np.where(bad, np.nan, scale).astype(np.float32), np.where(bad, np.nan, lo)


def dequantize_rowwise_int8_reference(q, scale, bias) -> np.ndarray:
  """numpy FBGEMM Fused8BitRowwiseQuantizedSBFloatToFloatOrHalfRef, q * scale + bias as
  one FMA would round it: the product is exact in double, the sum is rounded to double and
  then to float32, which equals the single rounding unless the double sum lands exactly on
  a float32 midpoint (test_fma_rn_rounds_once checks `exact.fma_rn` against rationals)."""
  scale = np.asarray(scale, np.float32).astype(np.float64)[:, None]
  bias = np.asarray(bias, np.float32).astype(np.float64)[:, None]
  with np.errstate(invalid="ignore", over="ignore"):
    return (np.asarray(q).astype(np.float64) * scale + bias).astype(np.float32)


def quantize_rowwise_nbit_reference(x_ND: np.ndarray, bits: int
                                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """numpy transcription of FBGEMM's FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfRef,
  row by row: `(packed [N, P] uint8, scale [N] f16, bias [N] f16)`."""
  x = np.asarray(x_ND, np.float32)
  _check_rows(x, "quantize_rowwise_nbit_reference")
  _check_bits(bits, "quantize_rowwise_nbit_reference")
  n, d = x.shape
  per, qmax = 8 // bits, (1 << bits) - 1
  packed = np.zeros((n, packed_width(d, bits)), np.uint8)
  scales = np.zeros(n, np.float16)
  biases = np.zeros(n, np.float16)
  mins, maxs, bads = _row_min_max_np(x)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    for r in range(n):
      if bads[r]:
        scales[r] = biases[r] = np.float16(np.nan)
        continue
      row = x[r]
      bias_h = np.float16(mins[r])
      lo = np.float32(bias_h)
      rng = _ftz_np(_ftz_np(maxs[r]) - lo)
      scale = np.float32(1.0) if rng == 0 else np.float32(rng / np.float32(qmax))
      scale = np.float32(np.float16(scale))
      if scale == 0:
        scale = np.float32(1.0)
      inv = np.float32(np.float32(1.0) / scale)
      if np.isinf(inv):
        scale, inv = np.float32(1.0), np.float32(1.0)
      scales[r], biases[r] = np.float16(scale), bias_h
      for c in range(d):
        v = np.float32((row[c] - lo) * inv)
        code = 0 if np.isnan(v) else int(min(max(np.rint(v), 0), qmax))
        packed[r, c // per] |= code << (bits * (c % per))
  return packed, scales, biases


def dequantize_rowwise_nbit_reference(packed, scale, bias, bits: int, dim: int) -> np.ndarray:
  """numpy FBGEMM FusedNBitRowwiseQuantizedSBHalfToFloatOrHalfRef: float(double(scale) *
  q + double(bias))."""
  packed = np.asarray(packed, np.uint8)
  per = 8 // bits
  cols = np.arange(dim)
  codes = (packed[:, cols // per] >> (bits * (cols % per))) & ((1 << bits) - 1)
  with np.errstate(invalid="ignore", over="ignore"):
    return (np.asarray(scale).astype(np.float64)[:, None] * codes
            + np.asarray(bias).astype(np.float64)[:, None]).astype(np.float32)


def quantize_rowwise_int4_reference(x_ND: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`quantize_rowwise_nbit_reference(x, 4)`."""
  return quantize_rowwise_nbit_reference(x_ND, 4)


def dequantize_rowwise_int4_reference(packed, scale, bias, dim: int) -> np.ndarray:
  """`dequantize_rowwise_nbit_reference(..., 4, dim)`."""
  return dequantize_rowwise_nbit_reference(packed, scale, bias, 4, dim)
