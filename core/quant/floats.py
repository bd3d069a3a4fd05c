"""bfloat16 (arXiv 1905.12322) with round-to-nearest-even and stochastic rounding, and OCP
FP8 E4M3 / E5M2 with per-tensor or row-wise scaling.

bf16: `to_bf16` rounds float32 to nearest even on the bit pattern (ml_dtypes' and XLA's
conversion: NaN becomes the quiet NaN 0x7FC0 with its sign). `stochastic_round_bf16` adds
16 uniform random bits below bf16's last bit and truncates: x rounds up to the next bf16
with probability exactly (x - down) / (up - down), so E[SR(x)] = x for every finite x
whose rounding stays finite (values within one bf16 ulp of the largest finite bf16 round
to Inf with that probability). Small updates that nearest rounding loses (|dw| < half an
ulp of w) survive in expectation, which is why bf16 weights and embedding rows are trained
with it.

FP8 (OCP 8-bit floating point, the float8_e4m3fn / float8_e5m2 types of ml_dtypes and JAX):
  amax  = max |x| over the tensor (granularity "tensor") or over each row's last axis ("row"),
          an exact integer reduction; or given (delayed scaling: from an amax history)
  scale = fmax / amax, correctly rounded; 1 when amax is NaN, Inf or below FP8_MIN_AMAX
          (2^-90; 0 included)
  q     = fp8(x * scale): x * scale rounded once to float32, then to nearest even on the
          FP8 grid, saturating to +-fmax (Inf too; NaN stays NaN): the recipe of
          Transformer Engine and torch._scaled_mm users
  x    ~= q * scale_inv with scale_inv = amax / fmax (correctly rounded; 1 with scale 1)
Every step is a single correctly rounded float32 operation or integer arithmetic, and the
FP8_MIN_AMAX floor keeps every scale, scale_inv and nonzero dequantized value a float32
normal (|q| >= 2^-16, scale_inv >= 2^-90 / 57344): so XLA:CPU's flush-to-zero never
changes a result and the bits are the same on every backend. (A float32 subnormal x or
product x * scale is at most 2^-20 in FP8 units, below half the smallest FP8 subnormal,
so it becomes a zero of its sign whether or not the backend flushes it.) Tensors whose
amax is below 2^-90 are left unscaled and round to zero: an absolute error below 2^-90.
`quantize_fp8_reference` is the numpy + ml_dtypes transcription the tests compare against.

Letters: N rows, D columns (the row-wise scale reduces D).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from core.quant import exact
from core.quant import formats as F

Granularity = Literal["tensor", "row"]

FP8_FORMATS = {"e4m3": (F.E4M3, jnp.float8_e4m3fn), "e5m2": (F.E5M2, jnp.float8_e5m2)}


# ---------------------------------------------------------------------------------- bf16


@jax.jit
def to_bf16(x: jax.Array) -> jax.Array:
  """float32 -> bfloat16, round to nearest even (bit-exact with ml_dtypes, every backend)."""
  u = exact.f32_bits(x)
  lsb = (u >> 16) & np.uint32(1)
  rounded = (u + np.uint32(0x7FFF) + lsb) >> 16
  nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  out = jnp.where(nan, (u >> 16) & np.uint32(0x8000) | np.uint32(0x7FC0), rounded)
  return jax.lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16)


@jax.jit
def stochastic_round_bf16_bits(x: jax.Array, random_bits: jax.Array) -> jax.Array:
  """float32 -> bfloat16 rounding up iff (x's low 16 bits + random_bits) carries, for
  random_bits uint32 in [0, 2^16) (only the low 16 bits are used), broadcastable to x.
  NaN becomes the quiet NaN; +-Inf stays."""
  u = exact.f32_bits(x)
  rb = jnp.asarray(random_bits).astype(jnp.uint32) & np.uint32(0xFFFF)
  out = (u + rb) >> 16
  special = (u & np.uint32(0x7FFFFFFF)) >= np.uint32(0x7F800000)
  nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  out = jnp.where(special, u >> 16, out)                   # Inf: no carry into the NaN range
  out = jnp.where(nan, (u >> 16) & np.uint32(0x8000) | np.uint32(0x7FC0), out)
  return jax.lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16)


@jax.jit
def stochastic_round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
  """float32 -> bfloat16 with unbiased stochastic rounding (random bits from `key`)."""
  x = jnp.asarray(x, jnp.float32)
  bits = jax.random.bits(key, x.shape, jnp.uint32) >> 16
  return stochastic_round_bf16_bits(x, bits)


def to_bf16_reference(x: np.ndarray) -> np.ndarray:
  """ml_dtypes' float32 -> bfloat16 conversion."""
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def stochastic_round_bf16_bits_reference(x: np.ndarray, random_bits: np.ndarray) -> np.ndarray:
  """numpy stochastic rounding in value arithmetic: up with the carry of the low bits."""
  x = np.asarray(x, np.float32)
  down = x.view(np.uint32) & np.uint32(0xFFFF0000)
  low = x.view(np.uint32) & np.uint32(0xFFFF)
  carry = (low.astype(np.int64) + (np.asarray(random_bits).astype(np.int64) & 0xFFFF)) >= 1 << 16
  out = (down.astype(np.uint64) + (carry.astype(np.uint64) << 16)).astype(np.uint32)
  special = np.abs(x) == np.inf
  out = np.where(special, x.view(np.uint32) & np.uint32(0xFFFF0000), out)
  out = (out >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
  with np.errstate(invalid="ignore"):
    return np.where(np.isnan(x), x.astype(ml_dtypes.bfloat16), out)


# ----------------------------------------------------------------------------------- FP8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
  """FP8 values with their dequantization scale: x ~= values * scale_inv."""

  values: jax.Array         # [..., D] float8_e4m3fn or float8_e5m2
  scale_inv: jax.Array      # [] (tensor) or [..., 1] (row) float32
  fmt: str = dataclasses.field(default="e4m3", metadata=dict(static=True))


def _fp8_format(fmt: str):
  try:
    return FP8_FORMATS[fmt]
  except KeyError:
    raise ValueError(f"core/quant/floats.py: fp8 format {fmt!r}, expected 'e4m3' or 'e5m2'") \
        from None


FP8_MIN_AMAX = 2.0 ** -90   # below it a tensor (row) keeps scale 1: see the module docstring


def fp8_amax(x: jax.Array, granularity: Granularity = "tensor") -> jax.Array:
  """max |x| over the tensor ([]) or each row's last axis ([..., 1]), exact; NaN if any
  element is NaN, else Inf if any is +-Inf."""
  a = exact.abs_bits(jnp.asarray(x, jnp.float32))          # NaN > Inf > finite
  if granularity == "tensor":
    return exact.from_bits(jnp.max(a))
  _check_granularity(granularity, a.ndim, "fp8_amax")
  return exact.from_bits(jnp.max(a, axis=-1, keepdims=True))


def _check_granularity(granularity: str, ndim: int, where: str) -> None:
  if granularity not in ("tensor", "row"):
    raise ValueError(f"core/quant/floats.py {where}: granularity={granularity!r}, expected "
                     "'tensor' or 'row'")
  if granularity == "row" and ndim == 0:
    raise ValueError(f"core/quant/floats.py {where}: granularity='row' needs x.ndim >= 1")


def fp8_scales(amax: jax.Array, fmt: str = "e4m3") -> tuple[jax.Array, jax.Array]:
  """(scale, scale_inv) = (fmax / amax, amax / fmax), each correctly rounded; (1, 1) where
  amax is NaN, Inf or below FP8_MIN_AMAX."""
  f, _ = _fp8_format(fmt)
  amax = jnp.asarray(amax, jnp.float32)
  usable = jnp.isfinite(amax) & (amax >= FP8_MIN_AMAX)
  fmax = jnp.float32(f.max)
  safe = jnp.where(usable, amax, fmax)
  return (jnp.where(usable, exact.div_rn(fmax, safe), 1.0),
          jnp.where(usable, exact.div_rn(safe, fmax), 1.0))


@functools.partial(jax.jit, static_argnames=("fmt", "granularity"))
def quantize_fp8(x: jax.Array, fmt: str = "e4m3", granularity: Granularity = "tensor",
                 amax: jax.Array | None = None) -> Fp8Tensor:
  """FP8 `fmt` values of float32 `x` with one scale per tensor or per row (last axis).

  amax: the amax the scale is taken from ([] for "tensor", [..., 1] for "row"); None:
  `fp8_amax(x)` (current scaling). A given amax below max |x| saturates the values past it.
  """
  f, dtype = _fp8_format(fmt)
  x = jnp.asarray(x, jnp.float32)
  _check_granularity(granularity, x.ndim, "quantize_fp8")
  if amax is None:
    amax = fp8_amax(x, granularity)
  else:
    amax = jnp.asarray(amax, jnp.float32)
    want = () if granularity == "tensor" else x.shape[:-1] + (1,)
    if amax.shape != want:
      raise ValueError(f"core/quant/floats.py quantize_fp8: amax shape {amax.shape}, expected "
                       f"{want} for granularity={granularity!r} and x {x.shape}")
  scale, scale_inv = fp8_scales(amax, fmt)
  y = x * scale                                   # one rounding (no add to contract with)
  values = F.round_to_format(y, f, saturate=True)   # on the FP8 grid: the cast is exact
  return Fp8Tensor(values.astype(dtype), scale_inv, fmt)


@jax.jit
def dequantize_fp8(t: Fp8Tensor) -> jax.Array:
  """float32 values * scale_inv."""
  return t.values.astype(jnp.float32) * t.scale_inv


def quantize_fp8_reference(x: np.ndarray, fmt: str = "e4m3", granularity: Granularity = "tensor",
                           amax: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """numpy + ml_dtypes transcription of `quantize_fp8`: (values as ml_dtypes fp8, scale_inv)."""
  f, _ = _fp8_format(fmt)
  dtype = getattr(ml_dtypes, F.ML_DTYPES[fmt])
  x = np.asarray(x, np.float32)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
    if amax is None:
      absx = np.abs(x)                              # np.max propagates NaN
      amax = absx.max() if granularity == "tensor" else absx.max(-1, keepdims=True)
    amax = np.asarray(amax, np.float32)
    usable = np.isfinite(amax) & (amax >= np.float32(FP8_MIN_AMAX))
    safe = np.where(usable, amax, np.float32(1))
    scale = np.where(usable, np.float32(f.max) / safe, np.float32(1)).astype(np.float32)
    scale_inv = np.where(usable, safe / np.float32(f.max), np.float32(1)).astype(np.float32)
    y = (x * scale).astype(np.float32)
    y = np.where(np.isnan(y), y, np.clip(y, -f.max, f.max)).astype(np.float32)
  return y.astype(dtype), scale_inv
