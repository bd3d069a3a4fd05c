"""Block-scaled formats: OCP Microscaling (MX) v1.0 and the paper's BDR MX9 / MX6 / MX4
(Rouhani et al., "With Shared Microexponents, A Little Shifting Goes a Long Way",
arXiv 2302.08007).

OCP MX (spec v1.0 section 6.3; microsoft/microxcaling mx/mx_ops.py `_quantize_mx` at
7bc41952): along the last axis, blocks of k = 32 values V_i share one E8M0 scale X = 2^s:
  s   = floor(log2(max_i |V_i|)) - emax_elem, clamped below at -127 (E8M0's smallest);
        a zero block takes floor(log2) = -126 (microxcaling's choice; any s is valid)
  P_i = V_i / X rounded to nearest on the element grid (ties to even, or away from zero
        as microxcaling's round="nearest"), normal values past the largest element
        clamped to it (the spec's saturation)
  a block holding NaN or +-Inf gets the NaN scale (E8M0 0xFF): every value decodes to NaN
  (spec section 5.3), its element codes are 0
Elements: MXFP8 E4M3 / E5M2, MXFP6 E2M3 / E3M2, MXFP4 E2M1, MXINT8 (two's complement
k / 64, |k| <= 127: microxcaling's symmetric range) and microxcaling's MXINT4 (k / 4,
|k| <= 7; not in the spec). The spec leaves the last partial block's padding open: it is
padded with zeros here, and decoded back to the original length.

BDR MX9 / MX6 / MX4 (paper section 3, Table 2): blocks of k1 = 16 share an 8-bit exponent
E = floor(log2(max |V_i|)) (clamped to [-127, 127]); each pair (k2 = 2) has a 1-bit
micro-exponent t = 1 if the pair's max has exponent below E, else 0; elements are sign
and m-bit magnitude fixed point, V_i ~= +-r * 2^(E - t - (m - 1)), r <= 2^m - 1 (m = 7, 4,
2: 9, 6 and 4 bits per element with the shared bits). Rounding and saturation as above.

Integer elements (MXINT, BDR) have no -0: a negative value that rounds to 0 is +0 (the
two's complement code 0; microxcaling's float emulation returns -0.0, equal in value).
floor(log2 amax) is exact here; microxcaling takes it with float32 torch.log2, which can
round up to the next integer for an amax a few ulps below a large power of two.

Every step is integer arithmetic on float32 bit patterns (`formats.round_fields`): the
bits are the same on every backend, subnormal inputs included. The numpy `*_reference`
functions transcribe microxcaling's float algorithm (floor(log2), scale, round, clamp)
in float64, which is exact for these grids, as an independent check.

Letters: B blocks along the last axis, K values per block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from core.quant import exact
from core.quant import formats as F
from core.quant.formats import Ties

MX_FORMATS = {
    "mxfp8_e4m3": F.E4M3, "mxfp8_e5m2": F.E5M2, "mxfp6_e2m3": F.E2M3, "mxfp6_e3m2": F.E3M2,
    "mxfp4": F.E2M1, "mxint8": F.INT8, "mxint4": F.INT4,
}
MX_BLOCK = 32
E8M0_NAN = 255

BDR_FORMATS = {"mx9": 7, "mx6": 4, "mx4": 2}     # magnitude bits m per element
BDR_BLOCK, BDR_SUB_BLOCK = 16, 2


def _mx_format(fmt: str) -> F.Format:
  try:
    return MX_FORMATS[fmt]
  except KeyError:
    raise ValueError(f"core/quant/mx.py: MX format {fmt!r}, expected one of "
                     f"{sorted(MX_FORMATS)}") from None


def bdr_element_format(fmt: str) -> F.Format:
  """The element grid of a BDR format: sign and m-bit magnitude, r / 2^(m - 1)."""
  try:
    m = BDR_FORMATS[fmt]
  except KeyError:
    raise ValueError(f"core/quant/mx.py: BDR format {fmt!r}, expected one of "
                     f"{sorted(BDR_FORMATS)}") from None
  return F.Format(fmt, 0, m - 1, 0, 0, (1 << m) - 1, "saturate")


def _blocks(x, block):
  """[..., D] -> [..., B, K] zero-padded along the last axis."""
  if x.ndim == 0:
    raise ValueError("core/quant/mx.py: x is a scalar, expected [..., D]")
  if block < 1:
    raise ValueError(f"core/quant/mx.py: block_size={block}, expected >= 1")
  d = x.shape[-1]
  pad = (-d) % block
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, block)


def _unblock(v, dim):
  return v.reshape(*v.shape[:-2], -1)[..., :dim]


def floor_log2(abs_bits: jax.Array) -> jax.Array:
  """floor(log2 |v|) from |v|'s float32 bits (int32), exact; -126 for 0 (microxcaling)."""
  ef = abs_bits >> 23
  sub = -118 - jax.lax.clz(abs_bits.astype(jnp.int32))
  return jnp.where(ef > 0, ef - 127, jnp.where(abs_bits > 0, sub, -126))


# ------------------------------------------------------------------------------ OCP MX


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXArray:
  """An MX-encoded array: element codes [..., B, K] and E8M0 scales [..., B]."""

  elements: jax.Array     # uint8 (FP elements: sign|exponent|mantissa) or int8 (MXINT)
  scales: jax.Array       # uint8 E8M0: the scale is 2^(code - 127), 255 is NaN
  fmt: str = dataclasses.field(default="mxfp8_e4m3", metadata=dict(static=True))
  dim: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def bits_per_value(self) -> float:
    """Storage per value: element bits plus the block's 8-bit scale shared over K."""
    return MX_FORMATS[self.fmt].bits + 8 / self.elements.shape[-1]


def _mx_fields(x, fmt, block_size, ties):
  f = _mx_format(fmt)
  xb = _blocks(jnp.asarray(x, jnp.float32), block_size)
  amax = jnp.max(exact.abs_bits(xb), axis=-1)                # NaN > Inf > finite
  nonfinite = amax >= 0x7F800000
  shared = jnp.maximum(floor_log2(amax) - f.emax, -127)
  rd = F.round_fields(xb, f, shared[..., None], saturate=True, ties=ties)
  return f, rd, shared, nonfinite


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "ties"))
def quantize_mx(x: jax.Array, fmt: str = "mxfp8_e4m3", block_size: int = MX_BLOCK,
                ties: Ties = "even") -> MXArray:
  """MX encoding of float32 `x` along its last axis (blocks of `block_size`)."""
  f, rd, shared, nonfinite = _mx_fields(x, fmt, block_size, ties)
  codes = F.encode(rd, f)
  codes = jnp.where(nonfinite[..., None], jnp.zeros_like(codes), codes)
  scales = jnp.where(nonfinite, E8M0_NAN, shared + 127).astype(jnp.uint8)
  return MXArray(codes, scales, fmt, x.shape[-1])


@jax.jit
def dequantize_mx(m: MXArray) -> jax.Array:
  """float32 values P_i * X of an `MXArray`, shape [..., dim]."""
  f = _mx_format(m.fmt)
  k = m.scales.astype(jnp.int32) - 127
  v = F.to_float(F.decode(m.elements, f), f, k[..., None])
  v = jnp.where((m.scales == E8M0_NAN)[..., None], jnp.nan, v)
  return _unblock(v, m.dim)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "ties"))
def mx_round(x: jax.Array, fmt: str = "mxfp8_e4m3", block_size: int = MX_BLOCK,
             ties: Ties = "even") -> jax.Array:
  """dequantize_mx(quantize_mx(x)) without materializing the codes."""
  f, rd, shared, nonfinite = _mx_fields(x, fmt, block_size, ties)
  v = F.to_float(rd, f, shared[..., None])
  v = jnp.where(nonfinite[..., None], jnp.nan, v)
  return _unblock(v, x.shape[-1])


# --------------------------------------------------------------------------------- BDR


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BDRArray:
  """A BDR (MX9 / MX6 / MX4) array: elements +-r [..., B, K] int8, micro-exponents
  [..., B, K / 2] uint8 (0 / 1), shared exponents [..., B] uint8 (E + 127, 255 NaN)."""

  elements: jax.Array
  micro: jax.Array
  shared: jax.Array
  fmt: str = dataclasses.field(default="mx9", metadata=dict(static=True))
  dim: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def bits_per_value(self) -> float:
    k, pairs = self.elements.shape[-1], self.micro.shape[-1]
    return 1 + BDR_FORMATS[self.fmt] + (8 + pairs) / k


def _bdr_fields(x, fmt, block_size, sub_block, ties):
  f = bdr_element_format(fmt)
  if sub_block < 1 or block_size % sub_block:
    raise ValueError(f"core/quant/mx.py: sub_block={sub_block} must divide "
                     f"block_size={block_size}")
  xb = _blocks(jnp.asarray(x, jnp.float32), block_size)       # [..., B, K]
  a = exact.abs_bits(xb)
  amax = jnp.max(a, axis=-1)
  nonfinite = amax >= 0x7F800000
  e = jnp.clip(floor_log2(amax), -127, 127)                   # 8-bit shared exponent
  sub = a.reshape(*a.shape[:-1], -1, sub_block)
  smax = jnp.max(sub, axis=-1)                                # [..., B, K / sub]
  e_sub = jnp.where(smax > 0, floor_log2(smax), -1 << 20)
  micro = (e_sub < e[..., None]).astype(jnp.int32)            # 1-bit micro-exponent
  k = jnp.repeat(e[..., None] - micro, sub_block, axis=-1)    # [..., B, K]
  rd = F.round_fields(xb, f, k, saturate=True, ties=ties)
  return f, rd, e, micro, k, nonfinite


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "sub_block", "ties"))
def quantize_bdr(x: jax.Array, fmt: str = "mx9", block_size: int = BDR_BLOCK,
                 sub_block: int = BDR_SUB_BLOCK, ties: Ties = "even") -> BDRArray:
  """BDR MX9 / MX6 / MX4 encoding of float32 `x` along its last axis."""
  f, rd, e, micro, _, nonfinite = _bdr_fields(x, fmt, block_size, sub_block, ties)
  codes = jnp.where(nonfinite[..., None], 0, F.encode(rd, f)).astype(jnp.int8)
  micro = jnp.where(nonfinite[..., None], 0, micro).astype(jnp.uint8)
  shared = jnp.where(nonfinite, E8M0_NAN, e + 127).astype(jnp.uint8)
  return BDRArray(codes, micro, shared, fmt, x.shape[-1])


@jax.jit
def dequantize_bdr(b: BDRArray) -> jax.Array:
  """float32 values of a `BDRArray`, shape [..., dim]."""
  f = bdr_element_format(b.fmt)
  sub = b.elements.shape[-1] // b.micro.shape[-1]
  k = b.shared.astype(jnp.int32)[..., None] - 127 - jnp.repeat(
      b.micro.astype(jnp.int32), sub, axis=-1)
  v = F.to_float(F.decode(b.elements, f), f, k)
  v = jnp.where((b.shared == E8M0_NAN)[..., None], jnp.nan, v)
  return _unblock(v, b.dim)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "sub_block", "ties"))
def bdr_round(x: jax.Array, fmt: str = "mx9", block_size: int = BDR_BLOCK,
              sub_block: int = BDR_SUB_BLOCK, ties: Ties = "even") -> jax.Array:
  """dequantize_bdr(quantize_bdr(x)) without materializing the codes."""
  f, rd, _, _, k, nonfinite = _bdr_fields(x, fmt, block_size, sub_block, ties)
  v = jnp.where(nonfinite[..., None], jnp.nan, F.to_float(rd, f, k))
  return _unblock(v, x.shape[-1])


# ------------------------------------------------------------------- numpy references


def _round_np(v, ties):
  if ties == "even":
    return np.rint(v)
  return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _elem_round_np(a, f: F.Format, ties):
  """microxcaling's _quantize_elemwise_core(saturate_normals=True) in float64."""
  if f.ebits == 0:
    q = _round_np(a * 2.0 ** f.mbits, ties) / 2.0 ** f.mbits
    q = q + 0.0                  # two's complement has no -0 (microxcaling returns -0.0)
  else:
    with np.errstate(divide="ignore"):
      pe = np.floor(np.log2(np.abs(a) + (a == 0)))
    pe = np.maximum(pe, f.emin)
    q = _round_np(a / 2.0 ** pe * 2.0 ** f.mbits, ties) / 2.0 ** f.mbits * 2.0 ** pe
  return np.clip(q, -f.max, f.max)


def _blocks_np(x, block):
  x = np.asarray(x, np.float32).astype(np.float64)
  pad = (-x.shape[-1]) % block
  x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, block)


def mx_round_reference(x: np.ndarray, fmt: str = "mxfp8_e4m3", block_size: int = MX_BLOCK,
                       ties: Ties = "even") -> np.ndarray:
  """numpy transcription of microxcaling's `_quantize_mx` (float64, exact here)."""
  f = _mx_format(fmt)
  d = np.shape(x)[-1]
  xb = _blocks_np(x, block_size)
  with np.errstate(invalid="ignore", divide="ignore"):
    amax = np.max(np.abs(xb), axis=-1, keepdims=True)         # NaN propagates
    shared = np.floor(np.log2(np.where(amax == 0, 2.0 ** -126, amax))) - f.emax
    shared = np.maximum(shared, -127)
    out = _elem_round_np(xb / 2.0 ** shared, f, ties) * 2.0 ** shared
    out = np.where(np.isfinite(amax), out, np.nan)
  return out.reshape(*out.shape[:-2], -1)[..., :d].astype(np.float32)


def bdr_round_reference(x: np.ndarray, fmt: str = "mx9", block_size: int = BDR_BLOCK,
                        sub_block: int = BDR_SUB_BLOCK, ties: Ties = "even") -> np.ndarray:
  """numpy float64 BDR quantization, following the paper's two-level scaling."""
  f = bdr_element_format(fmt)
  d = np.shape(x)[-1]
  xb = _blocks_np(x, block_size)
  with np.errstate(invalid="ignore", divide="ignore"):
    absx = np.abs(xb)
    amax = absx.max(axis=-1, keepdims=True)
    e = np.clip(np.floor(np.log2(np.where(amax == 0, 2.0 ** -126, amax))), -127, 127)
    smax = absx.reshape(*absx.shape[:-1], -1, sub_block).max(axis=-1)
    e_sub = np.where(smax > 0, np.floor(np.log2(np.where(smax > 0, smax, 1.0))), -np.inf)
    micro = (e_sub < e).astype(np.float64)
    scale = 2.0 ** (e - np.repeat(micro, sub_block, axis=-1))
    out = _elem_round_np(xb / scale, f, ties) * scale
    out = np.where(np.isfinite(amax), out, np.nan)
  return out.reshape(*out.shape[:-2], -1)[..., :d].astype(np.float32)
