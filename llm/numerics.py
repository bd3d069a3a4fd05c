"""RoPE and the products and sums of the Llama layers, in arithmetic whose bits per row do not
depend on how many rows are computed together.

`rope_frequencies` (Llama 3.1 or YaRN scaling), `rope_scale` (YaRN's factor on cos / sin) and
`apply_rope` (half-split pairs j, j + K/2);
`einsum` (on CPU, 16-bit products of one or two rows run with the rows repeated to
CPU_MIN_ROWS) and `sum_last` (a sum over the last axis in one fixed order of adds): a decode
step, a prefill and a speculative verification give each row the same bits.

Letters: B batch, T tokens, N heads, K head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from llm.config import RopeScaling, YarnScaling


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | YarnScaling | None) -> np.ndarray:
  """Inverse frequencies [K/2] (float32). Llama 3.1 scaling (`RopeScaling`): long
  wavelengths are divided by `factor`, short ones kept, and the band between
  original_max_position / high_freq_factor and / low_freq_factor interpolated smoothly.
  YaRN (`YarnScaling`): `_yarn_frequencies`."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if isinstance(scaling, YarnScaling):
    return _yarn_frequencies(inv, head_dim, theta, scaling).astype(np.float32)
  if scaling is not None:
    s = scaling
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * inv / s.factor + smooth * inv
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled)
  return inv.astype(np.float32)


def _yarn_frequencies(inv: np.ndarray, head_dim: int, theta: float,
                      s: YarnScaling) -> np.ndarray:
  """YaRN as transformers' `_compute_yarn_parameters` (and llama.cpp's rope_yarn): pair j
  keeps its frequency (extrapolation) below the correction range's low end, takes it / factor
  (interpolation) above its high end, and a linear blend between. The range: the pairs
  that turn beta_fast and beta_slow times over original_max_position, floored / ceiled when
  `truncate`, clipped to [0, K - 1]."""
  def dim_of(rotations):
    return (head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001          # as transformers: no division by zero
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  return inv / s.factor * ramp + inv * (1 - ramp)


def rope_scale(scaling: RopeScaling | YarnScaling | None) -> float:
  """The factor on cos and sin: YaRN's attention factor, else 1."""
  return scaling.cos_sin_scale() if isinstance(scaling, YarnScaling) else 1.0


def apply_rope(x_BTNK: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray,
               scale: float = 1.0) -> jax.Array:
  """Rotates (x[j], x[j + K/2]) by position * inv_freq[j] (half-split convention), in fp32,
  cos and sin multiplied by `scale` (YaRN's attention factor; `rope_scale`)."""
  angles_BTk = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  cos, sin = jnp.cos(angles_BTk)[:, :, None], jnp.sin(angles_BTk)[:, :, None]
  if scale != 1.0:
    cos, sin = cos * np.float32(scale), sin * np.float32(scale)
  x1, x2 = jnp.split(x_BTNK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNK.dtype)


# On CPU a 16-bit product runs with at least this many activation rows (see `einsum`).
CPU_MIN_ROWS = 3


def einsum(spec: str, x, w, **kw) -> jax.Array:
  """`jnp.einsum(spec, x, w)` for an activation x [B, T, ...] (spec "bt...,...->bt...").

  On CPU a product of 16-bit operands whose activation has fewer than CPU_MIN_ROWS rows
  (B * T: a decode step at batch 1 or 2) runs with the rows repeated up to that count, and
  keeps the first. Two reasons, both XLA:CPU's (jax 0.11.2):
  - speed: one row goes to Eigen's matrix-vector routine, which in 16-bit floats is 7-12x
    slower than YNNPACK's matrix product of a few rows (bfloat16 [1,576] x [576,49152]:
    42-46 ms against 3.6 ms on a 2-core AMD EPYC);
  - the same bits for a row whatever the row count: on a CPU with AVX512-BF16 / AMX (an
    Intel Xeon here) products of one or two rows take another routine than those of three or
    more, and with float32 outputs about three quarters of the values differ in the last
    bits (bfloat16 [r,576] x [576,4096]), while any count from three on gives the same bits;
    speculative verification of many rows must equal a plain step's.
  Rows of a product are computed independently, so the kept rows are the product's. float32
  keeps the matrix-vector routine, which is the faster one there."""
  lhs, out = spec.split(",")[0], spec.split("->")[-1]
  if (x.ndim >= 2 and x.shape[0] * x.shape[1] < CPU_MIN_ROWS and out[:2] == lhs[:2]
      and jnp.dtype(x.dtype).itemsize == 2 and jnp.dtype(w.dtype).itemsize == 2
      and jax.default_backend() == "cpu"):
    reps = -(-CPU_MIN_ROWS // (x.shape[0] * x.shape[1]))
    return jnp.einsum(spec, jnp.concatenate([x] * reps, axis=1), w, **kw)[:, :x.shape[1]]
  return jnp.einsum(spec, x, w, **kw)


def sum_last(x) -> jax.Array:
  """Sum over the last axis (kept, size 1) in one fixed order of elementwise adds: zero-padded
  to a multiple of 2**p that leaves at most 16 terms, halved p times (x[:n] + x[n:]), then
  the rest added left to right.

  A reduce leaves the order of its adds to the backend, and XLA:CPU picks by context: a
  bfloat16 SmolLM2's norms over 10 rows (a batch of two verifying 5 tree nodes) ran as
  YNNPACK fusions, over 2 or 4 rows (plain decode steps) as XLA's own loops, and a row's sum
  of squares came out different in its last bits. Elementwise float32 adds cannot be
  reordered, so every row gets the same sum whatever the row count, batch or fusion."""
  n = x.shape[-1]
  p = max(0, math.ceil(math.log2(n / 16))) if n > 16 else 0
  pad = -n % (2 ** p)
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  n += pad
  for _ in range(p):
    n //= 2
    x = x[..., :n] + x[..., n:]
  out = x[..., :1]
  for i in range(1, n):
    out = out + x[..., i:i + 1]
  return out
