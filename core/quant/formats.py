"""Small number grids (bf16, fp16, OCP FP8 / FP6 / FP4, the MX integer elements) and exact
round-to-nearest onto them, in integer arithmetic on float32 bit patterns.

A `Format` is the set of values +-r * 2^(e - mbits) with e in [emin, emax] and an integer
significand r < 2^(mbits + 1) (r >= 2^mbits unless e == emin: the subnormals), capped at
the largest finite value rmax * 2^(emax - mbits). `round_to_format` rounds float32 onto a
format, optionally scaled by 2^k (an MX block's shared scale), with ties to even (IEEE,
OCP) or away from zero (microxcaling's "nearest"), and gives, without `saturate`, exactly
what `ml_dtypes` gives for `x.astype(fmt).astype(float32)`: overflow becomes Inf (bf16,
fp16, E5M2), NaN (E4M3, which has no Inf) or the largest value (FP6, FP4, which have
neither). `saturate=True` clamps finite overflow and Inf to +-max (the OCP MX conversion,
and FP8 training recipes). No float arithmetic touches the values, so every backend gives
the same bits, subnormal inputs and outputs included.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from core.quant import exact

Ties = Literal["even", "away"]


@dataclasses.dataclass(frozen=True)
class Format:
  """A sign-magnitude grid +-r * 2^(e - mbits), e in [emin, emax], r <= rmax at emax."""

  name: str
  ebits: int          # exponent field width; 0 for the integer (fixed-point) grids
  mbits: int          # significand bits below the leading one
  emin: int           # exponent of the smallest normal (the subnormals' quantum is 2^(emin - mbits))
  emax: int           # exponent of the largest finite value
  rmax: int           # its significand: max = rmax * 2^(emax - mbits)
  overflow: str       # round-to-nearest past max without saturation: "inf" | "nan" | "saturate"

  @property
  def max(self) -> float:
    return float(self.rmax * 2.0 ** (self.emax - self.mbits))

  @property
  def min_subnormal(self) -> float:
    return float(2.0 ** (self.emin - self.mbits))

  @property
  def bits(self) -> int:
    """Storage bits per value: sign, exponent, mantissa (integer grids: two's complement)."""
    return 1 + self.ebits + self.mbits + (1 if self.ebits == 0 else 0)

  @property
  def exp_bias(self) -> int:
    return 1 - self.emin


BF16 = Format("bf16", 8, 7, -126, 127, 255, "inf")
FP16 = Format("fp16", 5, 10, -14, 15, 2047, "inf")
E4M3 = Format("e4m3", 4, 3, -6, 8, 14, "nan")          # OCP FP8 E4M3 (float8_e4m3fn): max 448
E5M2 = Format("e5m2", 5, 2, -14, 15, 7, "inf")         # OCP FP8 E5M2: max 57344
E3M2 = Format("e3m2", 3, 2, -2, 4, 7, "saturate")      # OCP FP6 E3M2: max 28
E2M3 = Format("e2m3", 2, 3, 0, 2, 15, "saturate")      # OCP FP6 E2M3: max 7.5
E2M1 = Format("e2m1", 2, 1, 0, 2, 3, "saturate")       # OCP FP4 E2M1: max 6
INT8 = Format("int8", 0, 6, 0, 0, 127, "saturate")     # MXINT8 element: k / 64, |k| <= 127
INT4 = Format("int4", 0, 2, 0, 0, 7, "saturate")       # microxcaling's int4 element: k / 4, |k| <= 7

FORMATS = {f.name: f for f in (BF16, FP16, E4M3, E5M2, E3M2, E2M3, E2M1, INT8, INT4)}

# The ml_dtypes type of each float format (what `round_to_format` matches bit for bit).
ML_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "e4m3": "float8_e4m3fn",
             "e5m2": "float8_e5m2", "e3m2": "float6_e3m2fn", "e2m3": "float6_e2m3fn",
             "e2m1": "float4_e2m1fn"}


def get_format(fmt: str | Format) -> Format:
  """The `Format` named `fmt` (or `fmt` itself)."""
  if isinstance(fmt, Format):
    return fmt
  try:
    return FORMATS[fmt]
  except KeyError:
    raise ValueError(f"core/quant/formats.py: unknown format {fmt!r}, expected one of "
                     f"{sorted(FORMATS)}") from None


@dataclasses.dataclass(frozen=True)
class Rounded:
  """A float32 array rounded onto a format scaled by 2^k, as integer fields:
  value = (-1)^sign * r * 2^(e - mbits + k); nan / inf flag the specials."""

  sign: jax.Array     # int32 0 / 1
  r: jax.Array        # int32 significand, 0 <= r <= rmax at e == emax
  e: jax.Array        # int32 exponent within the format, emin <= e <= emax
  nan: jax.Array      # bool
  inf: jax.Array      # bool


def _clz(x):
  return jax.lax.clz(x.astype(jnp.int32))


def round_fields(x: jax.Array, fmt: Format, k: jax.Array | int = 0, *, saturate: bool = False,
                 ties: Ties = "even") -> Rounded:
  """Round float32 `x` to nearest on `fmt` scaled by 2^k (k broadcastable int32)."""
  if ties not in ("even", "away"):
    raise ValueError(f"core/quant/formats.py: ties={ties!r}, expected 'even' or 'away'")
  u = exact.f32_bits(x)
  sign = (u >> 31).astype(jnp.int32)
  a = exact.abs_bits(x)
  k = jnp.asarray(k, jnp.int32)
  ef = a >> 23
  f = a & 0x7FFFFF
  sub = ef == 0
  sig = jnp.where(sub, f, f | 0x800000)
  ex = jnp.where(sub, -118 - _clz(f), ef - 127)          # floor(log2 |x|) for x != 0
  lsb = jnp.where(sub, -149, ef - 150)                   # exponent of sig's last bit
  e_q = jnp.maximum(ex, fmt.emin + k)                    # grid exponent at |x| (unscaled)
  s = jnp.clip(e_q - fmt.mbits - lsb, 1, 25)             # bits of sig below the grid quantum
  kept = sig >> s
  low = sig & ((1 << s) - 1)
  half = 1 << (s - 1)
  if ties == "even":
    up = (low > half) | ((low == half) & ((kept & 1) == 1))
  else:
    up = low >= half
  r = kept + up.astype(jnp.int32)
  carry = r == (1 << (fmt.mbits + 1))                    # rounded up into the next binade
  r = jnp.where(carry, r >> 1, r)
  e = e_q - k + carry.astype(jnp.int32)
  over = (e > fmt.emax) | ((e == fmt.emax) & (r > fmt.rmax))
  is_nan = a > 0x7F800000
  is_inf = a == 0x7F800000
  policy = "saturate" if saturate else fmt.overflow
  if policy == "saturate":
    clamp = over | is_inf
    out_inf = jnp.zeros_like(is_inf)
    out_nan = is_nan
  elif policy == "inf":
    clamp = jnp.zeros_like(over)
    out_inf = (over | is_inf) & ~is_nan
    out_nan = is_nan
  else:  # "nan": no Inf in the format
    clamp = jnp.zeros_like(over)
    out_inf = jnp.zeros_like(over)
    out_nan = is_nan | is_inf | over
  r = jnp.where(clamp, fmt.rmax, r)
  e = jnp.where(clamp, fmt.emax, e)
  zero = (r == 0) | out_nan | out_inf
  r = jnp.where(zero, 0, r)
  e = jnp.where(zero, fmt.emin, e)
  if fmt.ebits == 0:       # integer grids store +-r in two's complement: no -0
    sign = jnp.where(r == 0, 0, sign)
  return Rounded(sign, r, e, out_nan, out_inf)


def compose(sign: jax.Array, r: jax.Array, exp: jax.Array, mbits: int) -> jax.Array:
  """float32 value (-1)^sign * r * 2^(exp - mbits), built from bits (exact; the value must
  be representable: r < 2^24, exponent within float32's range, subnormals included)."""
  r = r.astype(jnp.int32)
  nb = 32 - _clz(r)                                       # bit length of r
  e32 = exp - mbits + nb - 1                              # unbiased exponent of the value
  normal = ((e32 + 127) << 23) | ((r << jnp.clip(24 - nb, 0, 31)) & 0x7FFFFF)
  denorm = r << jnp.clip(exp - mbits + 149, 0, 31)
  mag = jnp.where(e32 >= -126, normal, denorm)
  mag = jnp.where(r == 0, 0, mag)
  return exact.from_bits(mag.astype(jnp.uint32) | (sign.astype(jnp.uint32) << 31))


def to_float(rd: Rounded, fmt: Format, k: jax.Array | int = 0) -> jax.Array:
  """float32 values of rounded fields on `fmt` scaled by 2^k (NaN, +-Inf for the specials)."""
  v = compose(rd.sign, rd.r, rd.e + jnp.asarray(k, jnp.int32), fmt.mbits)
  v = jnp.where(rd.inf, jnp.where(rd.sign == 1, -jnp.inf, jnp.inf), v)
  return jnp.where(rd.nan, jnp.nan, v)


def round_to_format(x: jax.Array, fmt: str | Format, *, saturate: bool = False,
                    ties: Ties = "even") -> jax.Array:
  """float32 `x` rounded to nearest on `fmt`, as float32 (ml_dtypes' conversion when
  saturate=False and ties='even'; NaN stays NaN, also for formats that cannot store it)."""
  fmt = get_format(fmt)
  x = jnp.asarray(x, jnp.float32)
  return to_float(round_fields(x, fmt, saturate=saturate, ties=ties), fmt)


# ------------------------------------------------------------------------------ codes


def encode(rd: Rounded, fmt: Format) -> jax.Array:
  """Storage codes of rounded fields: float formats as sign | exponent | mantissa (uint8,
  uint16 for bf16 / fp16; Inf and NaN as the format encodes them, NaN as 0 in formats
  without one); integer grids as two's complement int8 of +-r."""
  if fmt.ebits == 0:
    return jnp.where(rd.sign == 1, -rd.r, rd.r).astype(jnp.int8)
  subn = rd.r < (1 << fmt.mbits)
  efield = jnp.where(subn, 0, rd.e - fmt.emin + 1)
  mant = jnp.where(subn, rd.r, rd.r - (1 << fmt.mbits))
  top = (1 << fmt.ebits) - 1
  if fmt.overflow == "inf":
    efield = jnp.where(rd.inf | rd.nan, top, efield)
    mant = jnp.where(rd.inf, 0, jnp.where(rd.nan, 1 << (fmt.mbits - 1), mant))
  elif fmt.overflow == "nan":                                # E4M3: NaN is S.1111.111
    efield = jnp.where(rd.nan, top, efield)
    mant = jnp.where(rd.nan, (1 << fmt.mbits) - 1, mant)
  else:
    efield = jnp.where(rd.nan, 0, efield)
    mant = jnp.where(rd.nan, 0, mant)
  sign = jnp.where(rd.nan & (fmt.overflow == "saturate"), 0, rd.sign)
  code = (sign << (fmt.ebits + fmt.mbits)) | (efield << fmt.mbits) | mant
  return code.astype(jnp.uint16 if fmt.bits > 8 else jnp.uint8)


def decode(codes: jax.Array, fmt: Format) -> Rounded:
  """Fields of storage codes (inverse of `encode`)."""
  if fmt.ebits == 0:
    c = codes.astype(jnp.int32)
    z = jnp.zeros(c.shape, bool)
    return Rounded((c < 0).astype(jnp.int32), jnp.abs(c), jnp.zeros_like(c), z, z)
  c = codes.astype(jnp.int32)
  sign = (c >> (fmt.ebits + fmt.mbits)) & 1
  efield = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
  mant = c & ((1 << fmt.mbits) - 1)
  top = (1 << fmt.ebits) - 1
  if fmt.overflow == "inf":
    nan = (efield == top) & (mant != 0)
    inf = (efield == top) & (mant == 0)
  elif fmt.overflow == "nan":
    nan = (efield == top) & (mant == (1 << fmt.mbits) - 1)
    inf = jnp.zeros(c.shape, bool)
  else:
    nan = inf = jnp.zeros(c.shape, bool)
  r = jnp.where(efield == 0, mant, mant | (1 << fmt.mbits))
  e = jnp.where(efield == 0, fmt.emin, efield - 1 + fmt.emin)
  r = jnp.where(nan | inf, 0, r)
  return Rounded(sign, r, e, nan, inf)
