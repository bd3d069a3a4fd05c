"""Attention for a few queries against a long KV cache (decode steps), reading the cache in place.

    out_BTHK, lse_BTH = decode_attention(q_BTHK, k_BSGK, v_BSGK, causal=True, ...)

The shared signature and rule of `reference.attention_reference` (segment ids, positions,
out 0 and lse -inf where a query sees no key), registered as attention_impl "xla_decode";
"auto" takes it for calls of at most `DECODE_MAX_T` queries against a longer key axis.

Why a second jnp form: the reference's einsums are matmuls batched over (batch, KV head).
The KV cache is stored [B,S,G,K], where those two batch dims are not adjacent, so XLA
transposes the whole cache of every layer into a [B,G,S,K] copy at every decode step before
the matmul (K and V read twice and written once). As elementwise products and reductions
the same arithmetic reads K and V once, in the layout they are stored in; with a few queries
per step the FLOPs are negligible and the step is bound by those reads. Arithmetic is fp32
throughout (q, k, v upcast in the fused products).

Letters: B batch, T queries, S keys (cache slots), H query heads, G key/value heads
(H = G * R), K head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from llm.attention.reference import NEG_INF, attention_mask, check_shapes


def decode_attention(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, q_segment_ids=None,
                     kv_segment_ids=None, q_positions=None, kv_positions=None,
                     scale: float | None = None):
  """The reference rule without batched matmuls; returns (out like q, lse [B,T,H] fp32)."""
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  r = h // g
  scale = kd ** -0.5 if scale is None else scale
  f32 = jnp.float32
  q_BTGRK = q_BTHK.reshape(b, t, g, r, kd).astype(f32) * scale
  k_B1SG1K = k_BSGK.astype(f32)[:, None, :, :, None, :]
  logits_BTSGR = jnp.sum(q_BTGRK[:, :, None] * k_B1SG1K, axis=-1)
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal,
                        b, t, s)
  if mask is not None:
    logits_BTSGR = jnp.where(mask[..., None, None], logits_BTSGR, NEG_INF)
  m = jnp.max(logits_BTSGR, axis=2, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits_BTSGR - m_safe)
  denom_BT1GR = jnp.sum(p, axis=2, keepdims=True)
  seen = denom_BT1GR > 0
  lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, denom_BT1GR, 1.0)), NEG_INF)
  p = p / jnp.where(seen, denom_BT1GR, 1.0)
  v_B1SG1K = v_BSGK.astype(f32)[:, None, :, :, None, :]
  out_BTGRK = jnp.sum(p[..., None] * v_B1SG1K, axis=2)
  return (out_BTGRK.reshape(b, t, h, kd).astype(q_BTHK.dtype),
          lse[:, :, 0].reshape(b, t, h))

