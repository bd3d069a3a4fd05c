"""Flash attention's reference and shared helpers (arXiv 2205.14135, 2307.08691, 2407.08608).

    out_BTHK, lse_BTH = flash_attention_reference(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                                  q_segment_ids=None, kv_segment_ids=None,
                                                  q_positions=None, kv_positions=None,
                                                  scale=None)

One signature for every attention implementation in this repository: q [B,T,H,K] and k, v
[B,S,G,K] with H a multiple of G (grouped-query attention; K/V are never repeated), optional
segment ids and positions; returns out [B,T,H,K] (q's dtype) and lse [B,T,H] (fp32, natural
log). Masking rule: query t may attend key s iff

    q_segment_ids[b,t] == kv_segment_ids[b,s]     (when segment ids are given)
    and kv_positions[b,s] <= q_positions[b,t]     (when causal)

with positions defaulting to arange(T) and arange(S); positions only matter when causal. A
query with no allowed key gets out 0 and lse -inf, so partial results over disjoint key sets
merge exactly by their lse (ring attention). Gradients flow to q, k, v from out and lse.

This module holds the pure-jnp reference (the semantics), the shape check and mask helpers
every implementation shares, and the padding helpers of the two kernels
(`kernels/flash_attention_mgpu`, `kernels/flash_attention_triton.py`), which import it.
Which kernel runs a call is decided by the attention registry (`llm.attention.choose`).

Letters: B batch, T query length, S key length, H query heads, G key/value heads
(H = G * R), K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def default_positions(batch: int, length: int, offset: int = 0) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) + offset, (batch, length))


def check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_positions=None) -> tuple[int, int, int, int, int, int]:
  """Validates the shared signature; returns (B, T, S, H, G, K)."""
  if q_BTHK.ndim != 4 or k_BSGK.ndim != 4 or v_BSGK.shape != k_BSGK.shape:
    raise ValueError(f"attention: q {q_BTHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}; "
                     "expected q [B,T,H,K] and k, v [B,S,G,K] of equal shape")
  b, t, h, kd = q_BTHK.shape
  bk, s, g, kk = k_BSGK.shape
  if bk != b or kk != kd or h % g:
    raise ValueError(f"attention: q {q_BTHK.shape} vs k {k_BSGK.shape}; expected the same batch "
                     "and head dim, and query heads a multiple of key/value heads")
  for name, arr, n in (("q_segment_ids", q_segment_ids, t), ("kv_segment_ids", kv_segment_ids, s),
                       ("q_positions", q_positions, t), ("kv_positions", kv_positions, s)):
    if arr is not None and arr.shape != (b, n):
      raise ValueError(f"attention: {name} shape {arr.shape}, expected {(b, n)}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention: give both q_segment_ids and kv_segment_ids, or neither")
  return b, t, s, h, g, kd


def attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal: bool,
                   b: int, t: int, s: int):
  """Boolean [B,T,S] mask of allowed (query, key) pairs, or None when all are allowed."""
  mask = None
  if q_segment_ids is not None:
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  if causal:
    qp = q_positions if q_positions is not None else default_positions(b, t)
    kp = kv_positions if kv_positions is not None else default_positions(b, s)
    c = kp[:, None, :] <= qp[:, :, None]
    mask = c if mask is None else mask & c
  return mask


def flash_attention_reference(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True,
                              q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                              kv_positions=None, scale: float | None = None, mask_BTS=None):
  """Softmax(q k^T * scale, masked) v in jnp with an fp32 softmax; p is cast to v's dtype
  before p @ v, as the kernels do. Returns (out like q, lse [B,T,H] fp32). mask_BTS: an
  optional [B,T,S] bool narrowing the rule (tree attention; the kernels take none)."""
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  scale = kd ** -0.5 if scale is None else scale
  q_BTGRK = q_BTHK.reshape(b, t, g, h // g, kd)
  logits_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK,
                            preferred_element_type=jnp.float32) * scale
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, b, t, s)
  if mask_BTS is not None:
    mask = mask_BTS.astype(bool) if mask is None else mask & mask_BTS.astype(bool)
  if mask is not None:
    logits_BGRTS = jnp.where(mask[:, None, None], logits_BGRTS, NEG_INF)
  m = jnp.max(logits_BGRTS, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits_BGRTS - m_safe)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  lse_BGRT = jnp.where(denom[..., 0] > 0, m_safe[..., 0] + jnp.log(denom[..., 0]), NEG_INF)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out_BTGRK = jnp.einsum("bgrts,bsgk->btgrk", p.astype(v_BSGK.dtype), v_BSGK,
                         preferred_element_type=jnp.float32)
  out = out_BTGRK.reshape(b, t, h, kd).astype(q_BTHK.dtype)
  lse = lse_BGRT.transpose(0, 3, 1, 2).reshape(b, t, h)
  return out, lse


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def pad_axis(x, axis: int, size: int, mode: str = "constant"):
  """x padded with zeros ("constant") or copies of its last entry ("edge") along `axis` up
  to `size`; None stays None, and x is returned as is when it already has that size."""
  if x is None or x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, mode=mode)
