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

On CPU the sums over the keys run as matrix products instead (`decode_attention_matmul`,
`decode_form`): XLA:CPU's fused reductions group a sum's terms by the length of the key
axis, so a step's float32 sums changed in their last bits with the cache's size, and a
bfloat16 model, which rounds every activation, then parted greedy choices at near ties
(SmolLM2-135M, bfloat16, with the prompt's prefill also attending through the whole cache:
2 to 6 of 8 greedy rows changed with 7 or 40 more cache slots; `Llama.hidden`'s fresh_cache).
XLA:CPU's product routines (jax 0.11) add a key's term into partial sum (slot mod 4) and
add the four at the end, so empty or masked slots leave the sums bit for bit as they are: a
step does not depend on the cache size, and a tree node verified in one pass
(`llm.speculative`) gets the bits of a plain step at its position when its key and its
ancestors' sit in the residues the plain step's tokens would (`llm.speculative.tree.
node_slots`; keys of siblings masked in between). On the 2-core CPU it is also no slower
(SmolLM2 bfloat16, batch 1, with fresh_cache: 25.8 against 27.0 ms per step; float32 31.6
against 31.9; bench_llm, BENCHMARKS.md). Elsewhere the elementwise form stays (one read of
the cache in place, no transposed copy).

Letters: B batch, T queries, S keys (cache slots), H query heads, G key/value heads
(H = G * R), K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llm.attention.reference import NEG_INF, attention_mask, check_shapes

# The matrix-product form pads the key axis to a multiple of this many slots.
KEY_BLOCK = 64


def decode_form() -> str:
  """"matmul" on CPU, else "sums": which form `decode_attention` runs (module docstring)."""
  return "matmul" if jax.default_backend() == "cpu" else "sums"


def decode_attention(q_BTHK, k_BSGK, v_BSGK, **kwargs):
  """The reference rule for decode steps in the form `decode_form` picks; returns (out like
  q, lse [B,T,H] fp32)."""
  fn = decode_attention_matmul if decode_form() == "matmul" else decode_attention_sums
  return fn(q_BTHK, k_BSGK, v_BSGK, **kwargs)


def decode_attention_sums(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, q_segment_ids=None,
                          kv_segment_ids=None, q_positions=None, kv_positions=None,
                          scale: float | None = None):
  """The reference rule without batched matmuls: elementwise products and reductions that
  read the cache in its stored layout."""
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


def decode_attention_matmul(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True,
                            q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                            kv_positions=None, scale: float | None = None):
  """The reference rule with its two sums over the keys as float32 matrix products: the
  scores, and the values with a column of ones beside them (the softmax's denominator comes
  out of the same product, summed in the same order as the output). The key axis is padded
  with masked slots to a multiple of `KEY_BLOCK`: XLA:CPU picks its product routine by size
  (jax 0.12 takes another one below 64 keys than above), so nearby cache sizes share one."""
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  r = h // g
  scale = kd ** -0.5 if scale is None else scale
  f32 = jnp.float32
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal,
                        b, t, s)
  pad = -s % KEY_BLOCK
  if pad:
    mask = jnp.ones((b, t, s), bool) if mask is None else mask
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
  keys = ((0, 0), (0, pad), (0, 0), (0, 0))
  q_BTGRK = q_BTHK.reshape(b, t, g, r, kd).astype(f32) * scale
  logits_BTGRS = jnp.einsum("btgrk,bsgk->btgrs", q_BTGRK, jnp.pad(k_BSGK.astype(f32), keys))
  if mask is not None:
    logits_BTGRS = jnp.where(mask[:, :, None, None, :], logits_BTGRS, NEG_INF)
  m = jnp.max(logits_BTGRS, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p_BTGRS = jnp.exp(logits_BTGRS - m_safe)
  ones_BSG1 = jnp.ones(v_BSGK.shape[:-1] + (1,), f32)
  v1_BSGK = jnp.pad(jnp.concatenate([v_BSGK.astype(f32), ones_BSG1], axis=-1), keys)
  o1_BTGRK = jnp.einsum("btgrs,bsgk->btgrk", p_BTGRS, v1_BSGK)
  denom = o1_BTGRK[..., kd:]
  seen = denom > 0
  out_BTGRK = o1_BTGRK[..., :kd] / jnp.where(seen, denom, 1.0)
  lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, denom, 1.0)), NEG_INF)
  return (out_BTGRK.reshape(b, t, h, kd).astype(q_BTHK.dtype),
          lse[..., 0].reshape(b, t, h))
