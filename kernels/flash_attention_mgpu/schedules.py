"""Block schedules for segment ids and positions, computed in jnp before the kernels run.

With segment ids or explicit positions, every (query tile, key tile) pair is classified from
per-tile min / max of positions and segment ids as all-visible (FULL), partly visible
(PARTIAL) or EMPTY: exact for any ordering, tight when both are monotone within a tile, as in
packed documents and ring attention's chunks. Each CTA gets the list of its non-empty
blocks, FULL first, so empty blocks cost nothing and all-visible ones skip the mask; its
memory and compute warpgroups walk the same list.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from kernels.flash_attention_mgpu.common import EMPTY, FULL, PARTIAL, Config


def _block_min_max(x_BL, block):
  b, l = x_BL.shape
  x = x_BL.reshape(b, l // block, block)
  return x.min(-1), x.max(-1)


def classify_blocks(causal, q_seg, kv_seg, q_pos, kv_pos, tile_q, tile_kv, partial_kv=None):
  """[B, T / tile_q, S / tile_kv] int32 class of each (query tile, key tile) pair: FULL
  (every pair allowed), PARTIAL or EMPTY (none allowed), from the tiles' min / max segment
  ids and positions. Conservative: FULL and EMPTY are exact claims, PARTIAL may be either.
  partial_kv: a key-tile index forced to PARTIAL (the one holding padded keys)."""
  full = empty = None
  if q_seg is not None:
    q_lo, q_hi = (x[:, :, None] for x in _block_min_max(q_seg, tile_q))
    k_lo, k_hi = (x[:, None, :] for x in _block_min_max(kv_seg, tile_kv))
    full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    empty = (k_hi < q_lo) | (k_lo > q_hi)
  if causal and q_pos is not None:
    q_lo, q_hi = (x[:, :, None] for x in _block_min_max(q_pos, tile_q))
    k_lo, k_hi = (x[:, None, :] for x in _block_min_max(kv_pos, tile_kv))
    full = _and(full, k_hi <= q_lo)
    empty = _or(empty, k_lo > q_hi)
  q_any = q_seg if q_seg is not None else q_pos
  kv_any = kv_seg if kv_seg is not None else kv_pos
  shape = (q_any.shape[0], q_any.shape[1] // tile_q, kv_any.shape[1] // tile_kv)
  full = jnp.broadcast_to(True if full is None else full, shape)
  empty = jnp.broadcast_to(False if empty is None else empty, shape)
  if partial_kv is not None:
    full = full.at[:, :, partial_kv].set(False)
  return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def _and(a, b):
  return b if a is None else a & b


def _or(a, b):
  return b if a is None else a | b


def schedule_from_classes(cls_BNM):
  """Per row of [B, N, M]: (order [B,N,M] int32: the non-empty columns, FULL before PARTIAL,
  then the rest; counts [B,N,2] int32: (#FULL, #FULL + #PARTIAL))."""
  order = jnp.argsort(cls_BNM, axis=-1, stable=True).astype(jnp.int32)
  n_full = jnp.sum(cls_BNM == FULL, axis=-1)
  n = n_full + jnp.sum(cls_BNM == PARTIAL, axis=-1)
  return order, jnp.stack([n_full, n], axis=-1).astype(jnp.int32)


def schedules(cfg: Config, q_seg, kv_seg, q_pos, kv_pos):
  """(forward, dq, dk/dv) schedules for the dynamic case, else Nones."""
  if not cfg.dynamic:
    return None, None, None
  cls = functools.partial(classify_blocks, cfg.causal, q_seg, kv_seg, q_pos, kv_pos)
  s = (kv_seg if kv_seg is not None else kv_pos).shape[1]
  pad_fwd = (s // cfg.block_kv - 1) if cfg.kv_len is not None else None
  fwd = schedule_from_classes(cls(2 * cfg.block_q, cfg.block_kv, pad_fwd))
  if (cfg.block_q_dq, cfg.block_kv_dq) == (cfg.block_q, cfg.block_kv):
    dq = fwd
  else:
    pad_dq = (s // cfg.block_kv_dq - 1) if cfg.kv_len is not None else None
    dq = schedule_from_classes(cls(2 * cfg.block_q_dq, cfg.block_kv_dq, pad_dq))
  pad_dkv = (s // (2 * cfg.block_kv_dkv) - 1) if cfg.kv_len is not None else None
  dkv = schedule_from_classes(
      cls(cfg.block_q_dkv, 2 * cfg.block_kv_dkv, pad_dkv).transpose(0, 2, 1))
  return fwd, dq, dkv
