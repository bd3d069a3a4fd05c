"""The online softmax of the Pallas (Triton lowering) attention kernels that walk keys in
tiles: base-2 exponentials (e^x = 2^(x log2 e), the scale folded into the scores), a finite
mask value instead of -inf (masked - masked = 0, no NaN), float32 state (out, running max,
running sum) per query row. `kernels/paged_attention.py` and `kernels/decode_attention.py`
share it.

    o, m, l = init(rows, kd)
    for each key tile:  s = dot(q, k, trans_b=True) * scale * LOG2E, masked to MASK_VALUE
                        o, m, l = step(o, m, l, s, v)
    out, lse = finish(o, m, l)      # rows that saw no key: out 0, lse -inf
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
# Finite "minus infinity" for masked scores (JAX's DEFAULT_MASK_VALUE).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot(a, b, trans_b: bool = False):
  """a [M, T] . b [T, N] (or b [N, T] with trans_b) in float32."""
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def init(rows: int, kd: int):
  """(out [rows, kd], running max [rows], running sum [rows]) before the first tile."""
  return (jnp.zeros((rows, kd), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def step(o, m, l, s, v):
  """One key tile: scores s [rows, T] (base 2, masked to MASK_VALUE), values v [T, kd].
  Rows with every key so far masked keep m = MASK_VALUE and sum garbage weights of 1, which
  the first allowed key's correction (2^(MASK_VALUE - m) = 0) or `finish` discards."""
  m_next = jnp.maximum(m, jnp.max(s, axis=-1))
  corr = jnp.exp2(m - m_next)
  p = jnp.exp2(s - m_next[:, None])
  l = corr * l + jnp.sum(p, axis=-1)
  o = corr[:, None] * o + dot(p.astype(v.dtype), v)
  return o, m_next, l


def finish(o, m, l):
  """(out [rows, kd] float32, lse [rows] natural log): out 0 and lse -inf for a row that saw
  no key."""
  valid = m > 0.5 * MASK_VALUE
  l = jnp.where(valid, l, 1.0)
  return (jnp.where(valid[:, None], o / l[:, None], 0.0),
          jnp.where(valid, (m + jnp.log2(l)) / LOG2E, -jnp.inf))


__all__ = ["LOG2E", "MASK_VALUE", "dot", "finish", "init", "step"]
