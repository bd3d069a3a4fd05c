"""The dk / dv kernel, and with `dq_acc` the whole fused backward (FlashAttention-3's).

One CTA per (kv head, batch, 2 * block_kv_dkv key rows): each compute warpgroup holds
block_kv_dkv rows of K and V in SMEM; the memory warpgroup streams Q, dO, lse and delta
blocks of block_q_dkv rows for each of the R query heads of the kv head. Per block:
S^T = K Q^T and dP^T = V dO^T (two wgmmas in flight), P^T = exp2(S^T c - lse),
dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q, so dk, dv are summed over the group
in fp32 in registers.

Fused (head dim 128): the same kernel also adds dQ += dS K into an fp32 dq buffer. Both
warpgroups write their dS^T rows into one SMEM tile (double-buffered by step parity), meet
at `ds_sync`, and each multiplies the whole dS by its half of the head dim of the CTA's
K tile (both warpgroups' K rows), adding the [block_q, K/2] product to dq with a TMA
reduce-add. The orderings this relies on:
  * dS^T writes -> commit_smem (proxy fence) -> ds_sync -> the other warpgroup's wgmma.
  * A dS buffer is rewritten two steps later, after its writer passed the next step's
    ds_sync, which the reader reached only after its wgmma on that buffer completed.
  * dk overwrites this warpgroup's K rows only after one more ds_sync past the last step:
    the other warpgroup's last dS K product reads them.
  * dq_smem is rewritten after `wait_smem_to_gmem(0, wait_read_only=True)`: the previous
    reduce-add has read it.
The GPU interpreter has no TMA reduction: there each CTA stores its partial into its own
slice of a [B, S / tile, T, H, K] buffer (each (query block, head) once per CTA), summed
afterwards in a fixed order, so interpret-mode results are exact and deterministic. On a
GPU the reduce-adds of different CTAs land in any order: dq is exact up to fp32 rounding
order, not bitwise reproducible across runs (dk, dv are).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.flash_attention_mgpu.common import (
    COL, COMPUTE_REGISTERS, MEMORY_REGISTERS, ROW, Config, Inputs, Schedule, and_, iota,
    launch, mma, mma_acc, mma_pair, present, produce, release_after_reads, slot_of,
    smem_mma_operand, sync, vector_mask, zeros)


class _Scratch(NamedTuple):
  """SMEM buffers and barriers (the scratch_types of `dkv`, in order)."""
  k_tile: object        # [2 * bk, K]: both compute warpgroups' K rows, then dK out
  v_smem2: object       # [2, bk, K]: V in, then dV out
  kvvec_smem: object    # [2, nv, bk]
  q_smem: object        # [stages, bq, K] streamed
  do_smem: object
  stat_smem: object     # [stages, 2, bq] fp32: lse, delta
  qvec_smem: object     # [stages, nv, bq]
  a_smem2: object       # [2, bk, bq] interpret mode: P^T / dS^T staged for wgmma
  kv_bar: object
  q_bar: object
  q_free: object
  ds_smem: object       # fused: [2, 2 * bk, bq] dS^T, double-buffered
  dq_smem: object       # fused: [2, bq, K / 2] fp32 per warpgroup
  ds_sync: object       # fused


@dataclasses.dataclass(frozen=True)
class _Cta:
  """What one CTA's warpgroups read: its refs, coordinates and schedule."""
  cfg: Config
  inputs: Inputs
  do_ref: object
  lse_ref: object
  delta_ref: object
  dq_acc_ref: object    # fused only
  dk_ref: object
  dv_ref: object
  sm: _Scratch
  r: int
  bi: jax.Array
  gi: jax.Array
  tile: jax.Array
  kv_start: jax.Array
  wg: jax.Array
  sched: Schedule       # query blocks of one query head; every head walks the same list

  @property
  def fused(self) -> bool:
    return self.dq_acc_ref is not None

  @property
  def mask_padded(self) -> bool:
    """Fused: padded keys (k = v = 0) may give p = exp2(-lse) = inf, then inf * 0 in dS K."""
    return self.fused and self.cfg.kv_len is not None


def dkv(cfg: Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do, lse2, delta, sched,
        out_refs=None):
  """(dk, dv) [B,Sp,G,K], summed over the R query heads of each kv head.

  out_refs (the fused backward): refs (dq fp32 [B,Tp,H,K], zero on entry, or in interpret
  mode [B,S/tile,Tp,H,K] per-tile partials; dk; dv) written in place instead of returning
  dk, dv (module docstring).
  """
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  bq, bk, stages, nv, dtype = (cfg.block_q_dkv, cfg.block_kv_dkv, cfg.stages_bwd, cfg.num_vec,
                               q.dtype)
  nkt = s // (2 * bk)
  fused = out_refs is not None
  interpret = cfg.interpret is not None
  scratch = (
      smem_mma_operand((2 * bk, kd), dtype),
      smem_mma_operand((2, bk, kd), dtype),
      plgpu.SMEM((2, nv, bk), jnp.int32) if nv else None,
      smem_mma_operand((stages, bq, kd), dtype),
      smem_mma_operand((stages, bq, kd), dtype),
      plgpu.SMEM((stages, 2, bq), jnp.float32),
      plgpu.SMEM((stages, nv, bq), jnp.int32) if nv else None,
      smem_mma_operand((2, bk, bq), dtype) if interpret else None,
      plgpu.Barrier(num_arrivals=2 + nv, num_barriers=2),
      plgpu.Barrier(num_arrivals=4 + nv, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      smem_mma_operand((2, 2 * bk, bq), dtype) if fused else None,
      plgpu.SMEM((2, bq, kd // 2), jnp.float32) if fused else None,
      plgpu.Barrier(num_arrivals=2) if fused else None,
  )
  args = [q, k, v, *present(q_seg, kv_seg, q_pos, kv_pos), *(sched or ()), do, lse2, delta]
  kernel = functools.partial(_kernel, cfg, fused, t // bq, nkt, h // g)
  call = functools.partial(launch, cfg, kernel, scratch=scratch, grid=(g, b, nkt),
                           grid_names=("kv_heads", "batch", "kv_tile"))
  if not fused:
    return call(out_type=[jax.ShapeDtypeStruct(k.shape, dtype),
                          jax.ShapeDtypeStruct(v.shape, dtype)])(*args)
  call(out_type=())(*args, *out_refs)    # ref operands: written in place (aliased outputs)
  return None


def _kv_tile_schedule(cfg: Config, inputs: Inputs, bi, tile, kv_start, nqb, nkt,
                      mask_padded: bool):
  """Query blocks of the key tile at kv_start: the precomputed list with segment ids or
  positions; else, when causal, blocks ending before the tile starts see none of it,
  blocks starting at or after its last key see all of it, the ones between are masked."""
  bq, tile_kv = cfg.block_q_dkv, 2 * cfg.block_kv_dkv
  if cfg.dynamic:
    return Schedule.from_arrays(inputs.order, inputs.count, bi, tile)
  if cfg.causal:
    first = jnp.minimum(lax.div(kv_start, bq), nqb)
    first_full = jnp.minimum(lax.div(kv_start + tile_kv - 1 + bq - 1, bq), nqb)
    n_full = nqb - first_full
    sched = Schedule(n_full, nqb - first,
                     lambda step: jnp.where(step < n_full, first_full + step,
                                            first + step - n_full))
  else:
    sched = Schedule(nqb, nqb, lambda step: step)
  if mask_padded:   # the tile holding padded keys: every block masked
    sched = Schedule(jnp.where(tile == nkt - 1, 0, sched.n_full), sched.n, sched.block)
  return sched


def _kernel(cfg: Config, fused: bool, nqb: int, nkt: int, r: int, *refs):
  it = iter(refs)
  inputs = Inputs.take(cfg, it)
  do_ref, lse_ref, delta_ref = next(it), next(it), next(it)
  dq_acc_ref = next(it) if fused else None
  dk_ref, dv_ref, sm = next(it), next(it), _Scratch(*next(it))
  bi = lax.axis_index("batch")
  tile = lax.axis_index("kv_tile")
  kv_start = tile * (2 * cfg.block_kv_dkv)
  mask_padded = fused and cfg.kv_len is not None
  sched = _kv_tile_schedule(cfg, inputs, bi, tile, kv_start, nqb, nkt, mask_padded)
  cta = _Cta(cfg, inputs, do_ref, lse_ref, delta_ref, dq_acc_ref, dk_ref, dv_ref, sm, r, bi,
             lax.axis_index("kv_heads"), tile, kv_start, lax.axis_index("wg"), sched)
  pl.when(cta.wg < 2)(functools.partial(_compute, cta))
  pl.when(cta.wg == 2)(functools.partial(_memory, cta))


def _compute(cta: _Cta):
  cfg, sm, wg, bk = cta.cfg, cta.sm, cta.wg, cta.cfg.block_kv_dkv
  plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
  k_smem, v_smem = sm.k_tile.at[pl.ds(wg * bk, bk)], sm.v_smem2.at[wg]
  kv_base = cta.kv_start + wg * bk
  rows = (cta.bi, pl.ds(kv_base, bk), cta.gi)
  plgpu.copy_gmem_to_smem(cta.inputs.k.at[rows], k_smem, sm.kv_bar.at[wg])
  plgpu.copy_gmem_to_smem(cta.inputs.v.at[rows], v_smem, sm.kv_bar.at[wg])
  for i, ref in enumerate(cta.inputs.kv_vecs(cfg)):
    plgpu.copy_gmem_to_smem(ref.at[cta.bi, pl.ds(kv_base, bk)], sm.kvvec_smem.at[wg, i],
                            sm.kv_bar.at[wg])
  plgpu.barrier_wait(sm.kv_bar.at[wg])
  if cta.fused:   # dS K reads the other warpgroup's K rows too
    plgpu.barrier_wait(sm.kv_bar.at[1 - wg])
  kv_vecs = [plgpu.load(sm.kvvec_smem.at[wg, i], layout=ROW) for i in range(cfg.num_vec)]
  step = functools.partial(_step, cta, kv_base, kv_vecs)

  def head_fn(head, carry):
    n_full, n = cta.sched.n_full, cta.sched.n
    carry = lax.fori_loop(0, n_full, functools.partial(step, head=head, masked=False), carry)
    if cfg.causal or cfg.dynamic or cta.mask_padded:
      carry = lax.fori_loop(n_full, n, functools.partial(step, head=head, masked=True), carry)
    return carry

  kd = cta.inputs.q.shape[-1]
  dk, dv = lax.fori_loop(0, cta.r, head_fn, (zeros((bk, kd)), zeros((bk, kd))))
  if cta.fused:
    sync(sm.ds_sync)   # the other warpgroup's last dS K read our K rows (module docstring)
  k_smem[...] = (dk * cfg.scale).astype(cta.inputs.q.dtype)
  v_smem[...] = dv.astype(cta.inputs.q.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_smem, cta.dk_ref.at[rows], commit_group=False)
  plgpu.copy_smem_to_gmem(v_smem, cta.dv_ref.at[rows], commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0)


def _step(cta: _Cta, kv_base, kv_vecs, local, carry, head: jax.Array, masked: bool):
  """One query block of query head `head`: dV, dK and, fused, dQ (module docstring)."""
  cfg, sm, wg = cta.cfg, cta.sm, cta.wg
  bq, bk, dtype = cfg.block_q_dkv, cfg.block_kv_dkv, cta.inputs.q.dtype
  dk, dv = carry
  step = head * cta.sched.n + local
  slot = slot_of(step, cfg.stages_bwd)
  plgpu.barrier_wait(sm.q_bar.at[slot])
  k_smem, v_smem = sm.k_tile.at[pl.ds(wg * bk, bk)], sm.v_smem2.at[wg]
  st, dpt = mma_pair((bk, bq), k_smem, sm.q_smem.at[slot].transpose((1, 0)),
                     v_smem, sm.do_smem.at[slot].transpose((1, 0)))
  if masked:
    shape = (bk, bq)
    q_vecs = [plgpu.load(sm.qvec_smem.at[slot, i], layout=COL) for i in range(cfg.num_vec)]
    mask = vector_mask(cfg, kv_vecs, q_vecs, shape, rows_are_queries=False)
    if cfg.causal and not cfg.dynamic:
      q_idx = iota(shape, 1) + cta.sched.block(local) * bq
      mask = and_(mask, iota(shape, 0) + kv_base <= q_idx)
    if cta.mask_padded:
      mask = and_(mask, iota(shape, 0) + kv_base < cfg.kv_len)
    st = jnp.where(mask, st, -jnp.inf)
  lse = plgpu.load(sm.stat_smem.at[slot, 0], layout=COL)
  delta = plgpu.load(sm.stat_smem.at[slot, 1], layout=COL)
  pt = jnp.exp2(st * cfg.c() - lax.broadcast_in_dim(lse, st.shape, [1]))
  dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
  a_smem = sm.a_smem2.at[wg] if cfg.interpret is not None else None
  dv = mma_acc(dv, pt.astype(dtype), sm.do_smem.at[slot], None, a_smem)
  ds16 = dst.astype(dtype)
  dk = mma_acc(dk, ds16, sm.q_smem.at[slot], None, a_smem)
  if cta.fused:
    _add_dq(cta, ds16, step, cta.sched.block(local) * bq, cta.gi * cta.r + head)
  release_after_reads(sm.q_free.at[slot])
  return dk, dv


def _add_dq(cta: _Cta, ds16, step, q0, hi):
  """dq[q0:q0+bq, hi, wg half] += (dS K)[:, wg half] for this step's query block."""
  cfg, sm, wg = cta.cfg, cta.sm, cta.wg
  bq, bk = cfg.block_q_dkv, cfg.block_kv_dkv
  hk = cta.inputs.q.shape[-1] // 2        # dq columns per compute warpgroup
  buf = slot_of(step, 2)
  sm.ds_smem.at[buf, pl.ds(wg * bk, bk)][...] = ds16     # this warpgroup's dS^T rows
  plgpu.commit_smem()
  sync(sm.ds_sync)                                        # both halves of dS^T written
  cols = pl.ds(wg * hk, hk)
  dq = mma((bq, hk), sm.ds_smem.at[buf].transpose((1, 0)), sm.k_tile.at[:, cols])
  out = sm.dq_smem.at[wg]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)        # the last store read `out`
  out[...] = dq
  plgpu.commit_smem()
  if cfg.interpret is not None:   # no TMA reduction there: per-CTA partials (module docstring)
    plgpu.copy_smem_to_gmem(out, cta.dq_acc_ref.at[cta.bi, cta.tile, pl.ds(q0, bq), hi, cols])
  else:
    plgpu.copy_smem_to_gmem(out, cta.dq_acc_ref.at[cta.bi, pl.ds(q0, bq), hi, cols],
                            reduction_op="add")


def _memory(cta: _Cta):
  """Streams Q, dO, lse, delta (and the mask vectors) of every query head's blocks."""
  cfg, sm, bq = cta.cfg, cta.sm, cta.cfg.block_q_dkv
  plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
  n_per_head = cta.sched.n

  def load(step, slot):
    head = lax.div(step, n_per_head)
    i = cta.sched.block(step - head * n_per_head)
    hi = cta.gi * cta.r + head
    rows = (cta.bi, pl.ds(i * bq, bq), hi)
    bar = sm.q_bar.at[slot]
    plgpu.copy_gmem_to_smem(cta.inputs.q.at[rows], sm.q_smem.at[slot], bar)
    plgpu.copy_gmem_to_smem(cta.do_ref.at[rows], sm.do_smem.at[slot], bar)
    for j, ref in enumerate((cta.lse_ref, cta.delta_ref)):
      plgpu.copy_gmem_to_smem(ref.at[cta.bi, hi, pl.ds(i * bq, bq)], sm.stat_smem.at[slot, j],
                              bar)
    for j, ref in enumerate(cta.inputs.q_vecs(cfg)):
      plgpu.copy_gmem_to_smem(ref.at[cta.bi, pl.ds(i * bq, bq)], sm.qvec_smem.at[slot, j], bar)

  produce(cta.r * n_per_head, cfg.stages_bwd, load, (sm.q_free,))
