"""An explicit attention mask on top of the shared rule, through unchanged implementations.

    out, lse = attention(q_BTHK, k_BSGK, v_BSGK, impl=..., mask=mask_BTS, **shared_kwargs)

`mask [B,T,S]` (bool) narrows the shared rule: query t may attend key s iff the rule allows
it (segment ids, kv_pos <= q_pos when causal) and mask[b,t,s]. Tree attention needs it
(speculative decoding, `llm/speculative`): a draft-tree node sees the cached prefix by
position, but of the other tree nodes only its ancestors, which positions alone cannot say.

No implementation changes: any subset of keys is one segment for a single query. The call is
vmapped over queries; query t runs alone (T = 1) with q_segment_ids 1 and kv_segment_ids
mask[:, t] (and its own segment test folded in), so each implementation applies the mask by
the segment-id rule it already honours exactly. Keys and values are not batched by the vmap
(no copies). For the jnp implementations ("xla", "xla_decode") the arithmetic is that of T
separate decode steps; "auto" sees T = 1 and takes "xla_decode", as it does for plain decode
steps. Implementations whose segment ids are restricted by data ("cudnn": same-array ids) or
that shard keys over a ring (context parallelism) are refused with an error, as are the Pallas
kernels (a T = 1 launch per query: correct, but no faster than "xla_decode"; untested here).

Calls of more than `DECODE_MAX_T` queries under "xla" or "auto" (training a draft head on its
own unrolled predictions, `llm.speculative.distill`) are not decode steps: they take the
reference once with the mask folded into its rule (`dense_masked`), one [B,H,T,S] score
block instead of T vmapped decode steps, whose backward pass is slow and memory-hungry
(SmolLM2's draft head unrolled 3 steps at batch 4 x 160 tokens needed more than 8 GB that
way; unrolled 2 steps at batch 8 it trains at 0.85-0.88 s per step, BENCHMARKS.md).

Letters: B batch, T queries, S keys, H query heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llm.attention.choose import DECODE_MAX_T
from llm.attention.reference import attention_reference, check_shapes, default_positions

# Implementations that take an explicit mask (through per-query segment ids).
MASK_IMPLS = ("auto", "xla", "xla_decode")


def check_mask_impl(impl: str) -> None:
  if impl not in MASK_IMPLS:
    raise ValueError(f"attention: impl={impl!r} takes no explicit mask (tree attention); "
                     f"use one of {MASK_IMPLS} (attention_impl='auto' picks 'xla_decode')")


def _check_mask(q_BTHK, k_BSGK, mask_BTS) -> None:
  b, t = q_BTHK.shape[:2]
  s = k_BSGK.shape[1]
  if mask_BTS.shape != (b, t, s):
    raise ValueError(f"attention: mask shape {mask_BTS.shape}, expected [B,T,S] = {(b, t, s)} "
                     f"for q {q_BTHK.shape} and k {k_BSGK.shape}")


def masked_attention(impl: str, fn, q_BTHK, k_BSGK, v_BSGK, mask_BTS, **kwargs):
  """`attention(..., impl=impl, mask=mask_BTS)`: `dense_masked` for long calls under "xla" /
  "auto", else `per_query_masked` through `fn` (module docstring)."""
  check_mask_impl(impl)
  if impl in ("xla", "auto") and q_BTHK.shape[1] > DECODE_MAX_T:
    return dense_masked(q_BTHK, k_BSGK, v_BSGK, mask_BTS, **kwargs)
  return per_query_masked(fn, q_BTHK, k_BSGK, v_BSGK, mask_BTS, **kwargs)


def dense_masked(q_BTHK, k_BSGK, v_BSGK, mask_BTS, **kwargs):
  """The reference over the whole call with `mask_BTS` folded into its rule."""
  _check_mask(q_BTHK, k_BSGK, mask_BTS)
  return attention_reference(q_BTHK, k_BSGK, v_BSGK, mask_BTS=mask_BTS, **kwargs)


def per_query_masked(fn, q_BTHK, k_BSGK, v_BSGK, mask_BTS, *, q_segment_ids=None,
                     kv_segment_ids=None, q_positions=None, kv_positions=None, **kwargs):
  """`fn` (a registered implementation) with `mask_BTS` applied, one query at a time."""
  b, t = q_BTHK.shape[:2]
  # The caller's own arrays are checked here: `fn` sees only the per-query ones built below,
  # so a lone kv_segment_ids or a [B,1] q_segment_ids would otherwise be dropped or broadcast.
  check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids, q_positions,
               kv_positions)
  _check_mask(q_BTHK, k_BSGK, mask_BTS)
  visible_BTS = mask_BTS.astype(bool)
  if q_segment_ids is not None:
    visible_BTS = visible_BTS & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
  if q_positions is None:
    q_positions = default_positions(b, t)
  one_B1 = jnp.ones((b, 1), jnp.int32)

  def one_query(q_BHK, visible_BS, q_pos_B):
    out, lse = fn(q_BHK[:, None], k_BSGK, v_BSGK, q_segment_ids=one_B1,
                  kv_segment_ids=visible_BS.astype(jnp.int32), q_positions=q_pos_B[:, None],
                  kv_positions=kv_positions, **kwargs)
    return out[:, 0], lse[:, 0]

  return jax.vmap(one_query, in_axes=(1, 1, 1), out_axes=(1, 1))(q_BTHK, visible_BTS,
                                                                 q_positions)
