"""Reference attention in plain jnp (XLA) and the exact merge of partial results.

The reference, the masking rule and the shape check live with the kernels
(`kernels/flash_attention_reference.py`), so that every implementation, XLA, Pallas kernels
and ring attention, shares one copy of the masking math; this module re-exports them under
the names the model and ring attention use and adds `merge_partials`.

Masking rule: query t may attend key s iff
  q_segment_ids[b,t] == kv_segment_ids[b,s]              (when segment ids are given)
  and kv_positions[b,s] <= q_positions[b,t]              (when causal)
Positions default to arange(T) and arange(S); segment ids default to "all equal".
A query with no allowed key gets out = 0 and lse = -inf, so that partial results over key
blocks merge exactly with `merge_partials` (a fully masked block contributes nothing).

Letters: B batch, T query length, S key length, H query heads, G key/value heads,
K head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.flash_attention_reference import (NEG_INF, attention_mask, check_shapes,
                                               default_positions, flash_attention_reference)

attention_reference = flash_attention_reference

__all__ = ["NEG_INF", "attention_mask", "attention_reference", "check_shapes",
           "default_positions", "merge_partials"]


def merge_partials(outs, lses):
  """Exact merge of attention partials over disjoint key sets (arXiv 2411.01783, Eq. 4).

  outs: sequence of [B,T,H,K]; lses: sequence of [B,T,H] (-inf where a part saw no key).
  Max-subtracted, so fully masked parts (lse = -inf) contribute nothing and never NaN.
  Returns (out [B,T,H,K] in the dtype of outs[0], lse [B,T,H] fp32).
  """
  lse_stack = jnp.stack([l.astype(jnp.float32) for l in lses])
  m = jnp.max(lse_stack, axis=0)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_stack - m_safe)                         # 0 for -inf parts
  total = jnp.sum(w, axis=0)
  lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), NEG_INF)
  w = w / jnp.where(total > 0, total, 1.0)
  out = sum(w[i][..., None] * outs[i].astype(jnp.float32) for i in range(len(outs)))
  return out.astype(outs[0].dtype), lse
