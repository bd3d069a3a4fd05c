"""Float32 arithmetic whose bits do not depend on the XLA backend.

XLA backends round some float32 operations differently, so a quantizer written with plain
`/`, `*` and `+` gives codes one ulp apart on different machines:
  - XLA:GPU lowers f32 division to PTX `div.full.f32` (`-nvptx-prec-divf32=1`), which is
    off by up to 2 ulp, and rewrites x / c as x * (1 / c) for constants c;
  - both XLA:CPU and XLA:GPU may contract a * b + c into one fused multiply-add (one
    rounding instead of two), depending on what lands in one fusion;
  - XLA:CPU runs with flush-to-zero and denormals-are-zero (a float32 subnormal reads and
    writes as 0), XLA:GPU keeps subnormals.
The functions here avoid all three: division and the order key are integer arithmetic;
`fma_rn` computes a * b + c rounded once from exact pieces (error-free transformations on
operands that can never be subnormal), so fusing or not fusing gives the same bits; `ftz`
flushes subnormals explicitly where a result may be one, so GPUs agree with CPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SIGN = np.uint32(0x80000000)
_ABS = np.int32(0x7FFFFFFF)
_INF_BITS = 0x7F800000
_MIN_NORMAL_BITS = 0x00800000


def f32_bits(x: jax.Array) -> jax.Array:
  """The float32 bit patterns of `x` as uint32."""
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def abs_bits(x: jax.Array) -> jax.Array:
  """|x|'s float32 bit pattern as int32: monotone in |x| for non-NaN values; a NaN's is
  larger than every other (> 0x7F800000, the pattern of Inf)."""
  return jax.lax.bitcast_convert_type(f32_bits(x) & np.uint32(0x7FFFFFFF), jnp.int32)


def from_bits(u: jax.Array) -> jax.Array:
  """float32 values of bit patterns `u` (uint32 or int32)."""
  return jax.lax.bitcast_convert_type(jnp.asarray(u).astype(jnp.uint32), jnp.float32)


def ftz(x: jax.Array) -> jax.Array:
  """`x` with float32 subnormals replaced by a zero of the same sign (what XLA:CPU's
  flush-to-zero does to every arithmetic result; explicit here so every backend agrees)."""
  u = f32_bits(x)
  tiny = (u & np.uint32(0x7FFFFFFF)) < _MIN_NORMAL_BITS
  return from_bits(jnp.where(tiny, u & _SIGN, u))


def order_key(x: jax.Array) -> jax.Array:
  """int32 keys with key(a) < key(b) iff a < b for non-NaN float32, and -0 below +0.

  Min and max by these keys are integer reductions, exact on every backend (float
  min / max reductions on XLA:CPU see subnormals as 0 and may return either zero).
  """
  s = jax.lax.bitcast_convert_type(f32_bits(x), jnp.int32)
  return jnp.where(s < 0, s ^ _ABS, s)


def from_order_key(k: jax.Array) -> jax.Array:
  """Inverse of `order_key`."""
  return from_bits(jnp.where(k < 0, k ^ _ABS, k))


def _clz(x):
  return jax.lax.clz(x.astype(jnp.int32))


def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
  """IEEE float32 division a / b rounded to nearest even, in integer arithmetic.

  Exact for every pair of float32 values (subnormals, zeros, Inf, NaN included), the same
  on every backend. Meant for per-row scalars: it costs five integer divisions.
  """
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  a, b = jnp.broadcast_arrays(a, b)
  ua, ub = f32_bits(a), f32_bits(b)
  sign = (ua ^ ub) & _SIGN
  xa = jax.lax.bitcast_convert_type(ua & np.uint32(0x7FFFFFFF), jnp.int32)
  xb = jax.lax.bitcast_convert_type(ub & np.uint32(0x7FFFFFFF), jnp.int32)

  def unpack(x):                      # finite nonzero -> significand in [2^23, 2^24), exponent
    e = x >> 23
    m = x & 0x7FFFFF
    sig = jnp.where(e == 0, m, m | 0x800000)
    e = jnp.maximum(e, 1)
    shift = jnp.maximum(_clz(sig) - 8, 0)
    return sig << shift, e - shift

  sa, ea = unpack(xa)
  sb, eb = unpack(xb)
  small = sa < sb                      # make the significand ratio lie in [1, 2)
  sa = jnp.where(small, sa << 1, sa)
  e = ea - eb + 127 - small.astype(jnp.int32)   # biased exponent of the quotient

  # q = floor(sa / sb * 2^25): the leading bit, then 25 more in chunks of at most 7 bits by
  # integer division (rem < sb < 2^24, so rem << 7 stays below 2^31). Five unrolled steps,
  # not a loop: on a GPU each trip of a while loop is a kernel and a device-to-host read of
  # its predicate (a bit-by-bit loop of 26 trips made each FP8 scale cost ~100 us).
  safe_sb = jnp.where(sb == 0, 1, sb)   # b zero: decided by the special cases below
  q = sa // safe_sb
  rem = sa - q * safe_sb
  for k in (7, 7, 7, 4):
    r = rem << k
    d = r // safe_sb
    q, rem = (q << k) | d, r - d * safe_sb
  sticky_rem = rem != 0
  s = jnp.clip(2 + jnp.maximum(1 - e, 0), 2, 27)  # bits to drop (more when subnormal)
  kept = q >> s
  low = q & ((1 << s) - 1)
  half = 1 << (s - 1)
  up = (low > half) | ((low == half) & (sticky_rem | ((kept & 1) == 1)))
  kept = kept + up.astype(jnp.int32)
  e_c = jnp.clip(e, 0, 255)
  mag = jnp.minimum((jnp.maximum(e_c - 1, 0) << 23) + kept, _INF_BITS)
  mag = jnp.where(e > 254, _INF_BITS, mag)
  # IEEE special cases, decided on the bit patterns.
  nan_a, nan_b = xa > _INF_BITS, xb > _INF_BITS
  inf_a, inf_b = xa == _INF_BITS, xb == _INF_BITS
  zero_a, zero_b = xa == 0, xb == 0
  is_nan = nan_a | nan_b | (zero_a & zero_b) | (inf_a & inf_b)
  mag = jnp.where(inf_a | zero_b, _INF_BITS, mag)
  mag = jnp.where(zero_a | inf_b, 0, mag)
  out = mag.astype(jnp.uint32) | sign
  out = jnp.where(is_nan, np.uint32(0x7FC00000), out)
  return from_bits(out)


def _two_sum(a, b):
  s = a + b
  bb = s - a
  err = (a - (s - bb)) + (b - bb)
  return s, err


_TINY = np.float32(2.0 ** -103)   # below this, fma_rn's pieces could be float32 subnormals


def fma_rn(q: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  """q * scale + bias rounded once to float32, for integer-valued q in [0, 4096).

  The same bits whether or not the backend fuses it into an FMA: scale splits into two
  12-bit halves (bit masks, exact), so q * scale = p_hi + p_lo exactly and no contraction
  can change a product; Knuth's two-sum carries the exact remainder, and rounding that
  remainder to odd before the last add makes the final sum a single correct rounding.
  |scale| below 2^-103 reads as 0, and so does |bias| unless q * scale is then 0, when
  the result is `bias` itself (so no intermediate is a subnormal, which XLA:CPU would
  flush). Differentiable like q * scale + bias.
  """
  return _fma_rn(jnp.asarray(q, jnp.float32), jnp.asarray(scale, jnp.float32),
                 jnp.asarray(bias, jnp.float32))


@jax.custom_jvp
def _fma_rn(q, scale, bias):
  scale = jnp.where(jnp.abs(scale) < _TINY, jnp.float32(0), scale)
  # q * scale == 0 (after the flush above) and bias != 0: the answer is `bias` itself,
  # selected rather than computed so that a tiny or subnormal bias keeps its bits on every
  # backend (a zero bias takes the sum below, which gives IEEE's signed zero).
  bias_only = ((q == 0) | (scale == 0)) & jnp.isfinite(scale) & (abs_bits(bias) != 0)
  raw_bias = bias
  bias = jnp.where(jnp.abs(bias) < _TINY, jnp.float32(0), bias)
  s_hi = from_bits(f32_bits(scale) & np.uint32(0xFFFFF000))
  s_lo = scale - s_hi
  p_hi = q * s_hi                 # <= 12 + 12 significant bits: exact
  p_lo = q * s_lo                 # <= 12 + 12 significant bits: exact
  s, e = _two_sum(p_hi, bias)     # p_hi + bias = s + e exactly
  t, f = _two_sum(e, p_lo)        # e + p_lo = t + f exactly
  # Round t to odd: if t + f is inexact in t, move t one ulp towards f when t is even, so
  # s + t sits strictly off every rounding midpoint of s that t + f is off.
  ut = f32_bits(t)
  toward = jnp.where((f > 0) == (t > 0), np.uint32(1), np.uint32(0xFFFFFFFF))
  fix = (f != 0) & ((ut & 1) == 0)
  t = from_bits(jnp.where(fix, ut + toward, ut))
  # Inf / NaN operands or an overflowing sum: the plain expression has the IEEE answer.
  out = jnp.where(jnp.isfinite(s), s + t, q * scale + bias)
  return jnp.where(bias_only & jnp.isfinite(q), raw_bias, out)


@_fma_rn.defjvp
def _fma_rn_jvp(primals, tangents):
  q, scale, bias = primals
  dq, dscale, dbias = tangents
  return _fma_rn(q, scale, bias), dq * scale + q * dscale + dbias
