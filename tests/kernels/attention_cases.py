"""Cases and checks the attention kernel tests share: a case's id and inputs, the normalized
error, and (out, lse) with the gradients of a fixed weighting of both.

A flash attention case is (B, T, S, H, G, K, causal, dtype, masks): batch, query and key
lengths, query and key / value heads, head dim; masks joins "seg" (packed documents),
"pos" (a ring step: the queries after part of the keys) and "perm" (positions permuted, as
after a load-balancing shuffle) with "+".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def case_id(c) -> str:
  b, t, s, h, g, k, causal, dtype, masks = c
  return (f"B{b}T{t}S{s}H{h}G{g}K{k}-{'causal' if causal else 'full'}-"
          f"{jnp.dtype(dtype).name}{'-' + masks if masks else ''}")


def inputs(case, seed: int = 0):
  """q, k, v and the keyword arguments of one case."""
  b, t, s, h, g, kd, causal, dtype, masks = case
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
             for shape in ((b, t, h, kd), (b, s, g, kd), (b, s, g, kd)))
  kw = dict(causal=causal)
  if "seg" in masks:   # packed documents: sorted ids, a few per row
    kw["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
    kw["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
  if "perm" in masks:  # arbitrary order, as after a load-balancing shuffle
    kw["q_positions"] = jnp.asarray(np.stack([rng.permutation(t) for _ in range(b)]), jnp.int32)
    kw["kv_positions"] = jnp.asarray(np.stack([rng.permutation(s) for _ in range(b)]), jnp.int32)
  elif "pos" in masks:  # a ring step: this query chunk sits after part of the key chunk
    kw["q_positions"] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + s // 2, (b, t))
    kw["kv_positions"] = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return q, k, v, kw


def rel_err(a, b) -> float:
  """max |a - b| / max |b| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def vjp_outputs(fn, q, k, v, kw):
  """(out, lse) and the grads of sum(out * w) + sum(lse * u) (the lse term where finite)."""
  (o, l), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
  w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape).astype(o.dtype)
  u = jnp.where(jnp.isfinite(l), jnp.sin(jnp.arange(l.size, dtype=jnp.float32)).reshape(l.shape),
                0.0)
  return o, l, vjp((w, u))


def out_lse_grads(fn, q, k, v, kw):
  """vjp_outputs in one jit (one compile per case keeps interpret mode fast)."""
  return jax.jit(lambda q, k, v: vjp_outputs(fn, q, k, v, kw))(q, k, v)
