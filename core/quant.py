"""Number formats as pure functions, each with an exact numpy reference.

Today: FBGEMM's row-wise integer formats for embedding tables (arXiv 2101.05615, the
formats TorchRec / FBGEMM use for quantized table-batched embeddings):

  int8: `FloatToFused8BitRowwiseQuantized`, per row r of a float32 table
          scale_r = (max_r - min_r) / 255,  bias_r = min_r       (both float32)
          q = lrint((x - min_r) * 255 / (max_r - min_r + 1e-8))   (uint8, 0..255)
          x ~ q * scale_r + bias_r
  int4: `FloatToFusedNBitRowwiseQuantizedSBHalf(bit_rate=4)`: scale and bias in float16,
        bias = fp16(min_r), scale = fp16((max_r - bias) / 15) (1 when the row is constant),
        q = clip(lrint((x - bias) / scale), 0, 15), two codes per byte (even column in the
        low nibble, odd column in the high nibble; an odd last column pads with 0).

`lrint` rounds half to even (the default rounding mode), as `np.rint` and `jnp.round` do.
Quantization is bit-exact with the numpy references; int8 dequantization may differ by
the product's rounding where XLA contracts q * scale + bias into one FMA (int4's product
is exact, so it matches bit for bit).
Round-trip error per element: int8 |x - deq(q(x))| <= scale/2 + 1e-8 (the epsilon in the
inverse scale) up to float32 rounding; int4 adds the float16 rounding of scale and bias
(see `rowwise_error_bound`).

FBGEMM stores scale and bias fused at the end of each row (`to_fused_bytes` gives that
byte layout); here they are kept apart (`RowwiseQuantized`) so a kernel can load the
codes as one aligned [N, P] array and the per-row scalars as [N] vectors.

The module is laid out for the formats that come next, each as `quantize_<fmt>` /
`dequantize_<fmt>` in jnp plus `<...>_reference` in numpy: bf16 round-to-nearest-even and
stochastic rounding, FP8 E4M3 / E5M2, OCP MX (block 32, E8M0 scale) and BDR MX9/6/4.

Letters: N rows, D columns (embedding dim), P bytes of codes per row (D for int8,
ceil(D / 2) for int4).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

INT8_EPS = 1e-8   # FBGEMM's kEpsilon in the int8 inverse scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowwiseQuantized:
  """Row-wise quantized rows: codes [N, P] uint8, per-row scale and bias [N] (FBGEMM)."""

  q: jax.Array          # [N, P] uint8: int8 codes (P = D) or packed int4 pairs (P = ceil(D/2))
  scale: jax.Array      # [N] float32 (int8) or float16 (int4)
  bias: jax.Array       # [N] float32 (int8) or float16 (int4)
  bits: int = dataclasses.field(default=8, metadata=dict(static=True))
  dim: int = dataclasses.field(default=0, metadata=dict(static=True))   # D

  @property
  def shape(self) -> tuple[int, int]:
    """Shape of the float rows these codes stand for: (N, D)."""
    return (self.q.shape[0], self.dim)


def _divisor(like: jax.Array, value: float) -> jax.Array:
  # XLA rewrites x / broadcast(c) as x * (1 / c), which is not the correctly rounded
  # quotient FBGEMM computes; a divisor array hidden behind a barrier keeps the division.
  return jax.lax.optimization_barrier(jnp.full(like.shape, value, jnp.float32))


def _check_rows(x, where):
  if x.ndim != 2:
    raise ValueError(f"core/quant.py {where}: rows shape {x.shape}, expected [N, D]")


# ---------------------------------------------------------------------------------- int8


@jax.jit
def quantize_rowwise_int8(x_ND: jax.Array) -> RowwiseQuantized:
  """FBGEMM row-wise int8 (float32 scale and bias) of float rows `x_ND`."""
  _check_rows(x_ND, "quantize_rowwise_int8")
  x = jnp.asarray(x_ND, jnp.float32)
  lo_N = jnp.min(x, axis=1)
  hi_N = jnp.max(x, axis=1)
  range_N = hi_N - lo_N
  scale_N = range_N / _divisor(range_N, 255.0)
  inv_N = jnp.float32(255.0) / (range_N + jnp.float32(INT8_EPS))
  # (x - min) * inv lies in [0, 255 * range / (range + eps)] < 255.5: no clamp needed.
  q = jnp.round((x - lo_N[:, None]) * inv_N[:, None]).astype(jnp.uint8)
  return RowwiseQuantized(q, scale_N, lo_N, bits=8, dim=x.shape[1])


@jax.jit
def dequantize_rowwise_int8(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows q * scale + bias of an int8 `RowwiseQuantized`."""
  if qr.bits != 8:
    raise ValueError(f"dequantize_rowwise_int8: bits={qr.bits}, expected 8")
  return qr.q.astype(jnp.float32) * qr.scale[:, None] + qr.bias[:, None]


def quantize_rowwise_int8_reference(x_ND: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """numpy transcription of FBGEMM's FloatToFused8BitRowwiseQuantizedSBFloatRef:
  `(q [N, D] uint8, scale [N] f32, bias [N] f32)`, every step in float32."""
  x = np.asarray(x_ND, np.float32)
  _check_rows(x, "quantize_rowwise_int8_reference")
  lo = x.min(axis=1)
  rng = x.max(axis=1) - lo
  scale = rng / np.float32(255.0)
  inv = np.float32(255.0) / (rng + np.float32(INT8_EPS))
  q = np.rint((x - lo[:, None]) * inv[:, None]).astype(np.uint8)
  return q, scale.astype(np.float32), lo


def dequantize_rowwise_int8_reference(q, scale, bias) -> np.ndarray:
  """numpy FBGEMM Fused8BitRowwiseQuantizedSBFloatToFloatRef: q * scale + bias in float32."""
  return (np.asarray(q).astype(np.float32) * np.asarray(scale, np.float32)[:, None]
          + np.asarray(bias, np.float32)[:, None])


# ---------------------------------------------------------------------------------- int4


@jax.jit
def quantize_rowwise_int4(x_ND: jax.Array) -> RowwiseQuantized:
  """FBGEMM row-wise int4 (float16 scale and bias, two codes per byte) of float rows."""
  _check_rows(x_ND, "quantize_rowwise_int4")
  x = jnp.asarray(x_ND, jnp.float32)
  n, d = x.shape
  bias_h = jnp.min(x, axis=1).astype(jnp.float16)
  lo = bias_h.astype(jnp.float32)          # the fp16 bias, as the codes are taken against it
  range_N = jnp.max(x, axis=1) - lo
  scale = jnp.where(range_N == 0, jnp.float32(1.0), range_N / _divisor(range_N, 15.0))
  scale = scale.astype(jnp.float16).astype(jnp.float32)
  scale = jnp.where(scale == 0, jnp.float32(1.0), scale)   # underflowed in fp16
  inv = jnp.float32(1.0) / scale
  bad = jnp.isinf(inv)
  scale, inv = jnp.where(bad, 1.0, scale), jnp.where(bad, 1.0, inv)
  codes = jnp.clip(jnp.round((x - lo[:, None]) * inv[:, None]), 0, 15).astype(jnp.uint8)
  if d % 2:
    codes = jnp.pad(codes, ((0, 0), (0, 1)))
  packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
  return RowwiseQuantized(packed, scale.astype(jnp.float16), bias_h, bits=4, dim=d)


@functools.partial(jax.jit, static_argnames="dim")
def unpack_int4(packed_NP: jax.Array, dim: int) -> jax.Array:
  """The 4-bit codes [N, dim] (uint8, 0..15) of packed pairs [N, ceil(dim / 2)]."""
  lo = packed_NP & 0xF
  hi = packed_NP >> 4
  codes = jnp.stack([lo, hi], axis=-1).reshape(packed_NP.shape[0], -1)
  return codes[:, :dim]


@jax.jit
def dequantize_rowwise_int4(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows scale * code + bias of an int4 `RowwiseQuantized` (fp16 scale, bias)."""
  if qr.bits != 4:
    raise ValueError(f"dequantize_rowwise_int4: bits={qr.bits}, expected 4")
  codes = unpack_int4(qr.q, qr.dim).astype(jnp.float32)
  return qr.scale.astype(jnp.float32)[:, None] * codes + qr.bias.astype(jnp.float32)[:, None]


def quantize_rowwise_int4_reference(x_ND: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """numpy transcription of FBGEMM's FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfRef with
  bit_rate 4: `(packed [N, ceil(D/2)] uint8, scale [N] f16, bias [N] f16)`, row by row."""
  x = np.asarray(x_ND, np.float32)
  _check_rows(x, "quantize_rowwise_int4_reference")
  n, d = x.shape
  packed = np.zeros((n, (d + 1) // 2), np.uint8)
  scales = np.zeros(n, np.float16)
  biases = np.zeros(n, np.float16)
  with np.errstate(divide="ignore", over="ignore"):
    for r in range(n):
      row = x[r]
      bias_h = np.float16(row.min())
      lo = np.float32(bias_h)
      rng = np.float32(row.max() - lo)
      scale = np.float32(1.0) if rng == 0 else np.float32(rng / np.float32(15.0))
      scale = np.float32(np.float16(scale))
      if scale == 0:
        scale = np.float32(1.0)
      inv = np.float32(np.float32(1.0) / scale)
      if np.isinf(inv):
        scale, inv = np.float32(1.0), np.float32(1.0)
      scales[r], biases[r] = np.float16(scale), bias_h
      for c in range(d):
        code = int(min(max(np.rint(np.float32((row[c] - lo) * inv)), 0), 15))
        packed[r, c // 2] |= code << (4 * (c % 2))
  return packed, scales, biases


def dequantize_rowwise_int4_reference(packed, scale, bias, dim: int) -> np.ndarray:
  """numpy FBGEMM FusedNBitRowwiseQuantizedSBHalfToFloatRef (bit_rate 4)."""
  packed = np.asarray(packed, np.uint8)
  cols = np.arange(dim)
  codes = (packed[:, cols // 2] >> (4 * (cols % 2))) & 0xF
  return (np.asarray(scale).astype(np.float32)[:, None] * codes.astype(np.float32)
          + np.asarray(bias).astype(np.float32)[:, None])


# ------------------------------------------------------------------------------ generic


@functools.partial(jax.jit, static_argnames="bits")
def quantize_rowwise(x_ND: jax.Array, bits: int = 8) -> RowwiseQuantized:
  """Row-wise int8 (`bits=8`) or int4 (`bits=4`) FBGEMM quantization."""
  if bits == 8:
    return quantize_rowwise_int8(x_ND)
  if bits == 4:
    return quantize_rowwise_int4(x_ND)
  raise ValueError(f"core/quant.py quantize_rowwise: bits={bits}, expected 8 or 4")


@jax.jit
def dequantize_rowwise(qr: RowwiseQuantized) -> jax.Array:
  """float32 rows [N, D] of a `RowwiseQuantized` of either width."""
  return dequantize_rowwise_int8(qr) if qr.bits == 8 else dequantize_rowwise_int4(qr)


@jax.jit
def rowwise_error_bound(qr: RowwiseQuantized, x_ND: jax.Array | None = None) -> jax.Array:
  """Per-row bound [N] on |x - dequantize(quantize(x))|, before float32 rounding.

  int8: scale/2 + 1e-8: rounding to the nearest code is off by half a step, and the
  inverse scale 255 / (range + 1e-8) shrinks each code by at most 1e-8 in value.
  int4: the codes are taken against the fp16 bias and fp16 scale, so half a step plus
  the two float16 roundings: the top code may clip (max - bias exceeds 15 * scale by at
  most 15 * scale * 2^-11 from the scale's rounding), and the bias' rounding (given
  `x_ND`, |min - bias|) moves the bottom of the range, where values below the bias clip
  to code 0.
  """
  scale = qr.scale.astype(jnp.float32)
  if qr.bits == 8:
    return scale / 2 + INT8_EPS
  bound = scale / 2 + 15 * scale * 2.0 ** -11
  if x_ND is not None:
    bound = bound + jnp.abs(jnp.min(jnp.asarray(x_ND, jnp.float32), axis=1)
                            - qr.bias.astype(jnp.float32))
  return bound


@jax.jit
def to_fused_bytes(qr: RowwiseQuantized) -> jax.Array:
  """FBGEMM's fused row layout [N, P + 8] (int8: f32 scale, f32 bias) or [N, P + 4]
  (int4: f16 scale, f16 bias), the scale and bias bytes little-endian after the codes."""
  sb = jnp.stack([qr.scale, qr.bias], axis=1)                      # [N, 2]
  sb_bytes = jax.lax.bitcast_convert_type(sb, jnp.uint8).reshape(qr.q.shape[0], -1)
  return jnp.concatenate([qr.q, sb_bytes], axis=1)


@functools.partial(jax.jit, static_argnames=("bits", "dim"))
def from_fused_bytes(fused_NB: jax.Array, bits: int, dim: int) -> RowwiseQuantized:
  """Inverse of `to_fused_bytes` for rows of width `dim`."""
  p = dim if bits == 8 else (dim + 1) // 2
  dtype, width = (jnp.float32, 4) if bits == 8 else (jnp.float16, 2)
  if fused_NB.ndim != 2 or fused_NB.shape[1] != p + 2 * width:
    raise ValueError(
        f"core/quant.py from_fused_bytes: shape {fused_NB.shape}, expected [N, {p + 2 * width}] "
        f"for bits={bits}, dim={dim}")
  n = fused_NB.shape[0]
  sb = jax.lax.bitcast_convert_type(fused_NB[:, p:].reshape(n, 2, width), dtype)
  return RowwiseQuantized(fused_NB[:, :p], sb[:, 0], sb[:, 1], bits=bits, dim=dim)
