"""The split backward's dq kernel: dq of one (head, batch, 2 * block_q_dq query rows) per CTA.

As in FA2 / JAX's attention_mgpu.py: each compute warpgroup holds its query rows' Q, dO,
lse and delta in SMEM and streams K / V blocks (the forward's schedule): S = Q K^T and
dP = dO V^T (two wgmmas in flight), P = exp2(S c - lse), dS = P (dP - delta), dQ += dS K.
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
    COL, COMPUTE_REGISTERS, MEMORY_REGISTERS, ROW, Config, Inputs, Schedule, launch, mma_acc,
    mma_pair, present, produce, q_tile_schedule, query_tile_mask, release_after_reads,
    slot_of, smem_mma_operand, zeros)


class _Scratch(NamedTuple):
  """SMEM buffers and barriers (the scratch_types of `dq`, in order)."""
  q_smem2: object       # [2, bq, K] per compute warpgroup: Q in, then dQ out
  do_smem2: object      # [2, bq, K]
  stat_smem2: object    # [2, 2, bq] fp32: lse, delta
  qvec_smem: object     # [2, nv, bq]
  k_smem: object        # [stages, bk, K] streamed
  v_smem: object
  kvvec_smem: object    # [stages, nv, bk]
  a_smem2: object       # [2, bq, bk] interpret mode: dS staged for wgmma
  q_bar: object
  k_bar: object
  k_free: object


@dataclasses.dataclass(frozen=True)
class _Cta:
  """What one CTA's warpgroups read: its refs, coordinates and schedule."""
  cfg: Config
  inputs: Inputs
  do_ref: object
  lse_ref: object
  delta_ref: object
  dq_ref: object
  sm: _Scratch
  bi: jax.Array
  hi: jax.Array
  kv_head: jax.Array
  q_start: jax.Array
  wg: jax.Array
  sched: Schedule


def dq(cfg: Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do, lse2, delta, sched):
  """dq [B,Tp,H,K] (scale included); lse2 is +inf on rows with no key."""
  t, h, kd = q.shape[1:]
  s, g = k.shape[1], k.shape[2]
  bq, bk, stages, nv, dtype = (cfg.block_q_dq, cfg.block_kv_dq, cfg.stages_bwd, cfg.num_vec,
                               q.dtype)
  nq = t // (2 * bq)
  scratch = (
      smem_mma_operand((2, bq, kd), dtype),
      smem_mma_operand((2, bq, kd), dtype),
      plgpu.SMEM((2, 2, bq), jnp.float32),
      plgpu.SMEM((2, nv, bq), jnp.int32) if nv else None,
      smem_mma_operand((stages, bk, kd), dtype),
      smem_mma_operand((stages, bk, kd), dtype),
      plgpu.SMEM((stages, nv, bk), jnp.int32) if nv else None,
      smem_mma_operand((2, bq, bk), dtype) if cfg.interpret is not None else None,
      plgpu.Barrier(num_arrivals=4 + nv, num_barriers=2),
      plgpu.Barrier(num_arrivals=2 + nv, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  )
  kernel = functools.partial(_kernel, cfg, nq, s // bk, h // g)
  return launch(cfg, kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch=scratch,
                grid=(h, q.shape[0], nq), grid_names=("heads", "batch", "q_tile"))(
                    q, k, v, *present(q_seg, kv_seg, q_pos, kv_pos), *(sched or ()), do, lse2,
                    delta)


def _kernel(cfg: Config, nq: int, nk: int, r: int, *refs):
  it = iter(refs)
  inputs = Inputs.take(cfg, it)
  do_ref, lse_ref, delta_ref, dq_ref = next(it), next(it), next(it), next(it)
  sm = _Scratch(*next(it))
  hi = lax.axis_index("heads")
  bi = lax.axis_index("batch")
  tile = lax.axis_index("q_tile")
  if cfg.causal:
    tile = nq - 1 - tile
  bq = cfg.block_q_dq
  q_start = tile * (2 * bq)
  sched = q_tile_schedule(cfg, inputs, bi, tile, q_start, 2 * bq, cfg.block_kv_dq, nk)
  cta = _Cta(cfg, inputs, do_ref, lse_ref, delta_ref, dq_ref, sm, bi, hi,
             lax.div(hi, jnp.array(r, hi.dtype)), q_start, lax.axis_index("wg"), sched)
  pl.when(cta.wg < 2)(functools.partial(_compute, cta))
  pl.when(cta.wg == 2)(functools.partial(_memory, cta))


def _compute(cta: _Cta):
  cfg, sm, wg, bq = cta.cfg, cta.sm, cta.wg, cta.cfg.block_q_dq
  plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
  q_smem, bar = sm.q_smem2.at[wg], sm.q_bar.at[wg]
  q_base = cta.q_start + wg * bq
  rows = (cta.bi, pl.ds(q_base, bq), cta.hi)
  plgpu.copy_gmem_to_smem(cta.inputs.q.at[rows], q_smem, bar)
  plgpu.copy_gmem_to_smem(cta.do_ref.at[rows], sm.do_smem2.at[wg], bar)
  for i, ref in enumerate((cta.lse_ref, cta.delta_ref)):
    plgpu.copy_gmem_to_smem(ref.at[cta.bi, cta.hi, pl.ds(q_base, bq)], sm.stat_smem2.at[wg, i],
                            bar)
  for i, ref in enumerate(cta.inputs.q_vecs(cfg)):
    plgpu.copy_gmem_to_smem(ref.at[cta.bi, pl.ds(q_base, bq)], sm.qvec_smem.at[wg, i], bar)
  plgpu.barrier_wait(bar)
  lse = plgpu.load(sm.stat_smem2.at[wg, 0], layout=ROW)
  delta = plgpu.load(sm.stat_smem2.at[wg, 1], layout=ROW)
  q_vecs = [plgpu.load(sm.qvec_smem.at[wg, i], layout=ROW) for i in range(cfg.num_vec)]

  step = functools.partial(_step, cta, q_base, lse, delta, q_vecs)
  acc = zeros((bq, cta.inputs.q.shape[-1]))
  acc = lax.fori_loop(0, cta.sched.n_full, functools.partial(step, masked=False), acc)
  if cfg.causal or cfg.dynamic or cfg.kv_len is not None:
    acc = lax.fori_loop(cta.sched.n_full, cta.sched.n, functools.partial(step, masked=True), acc)
  q_smem[...] = (acc * cfg.scale).astype(cta.inputs.q.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, cta.dq_ref.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _step(cta: _Cta, q_base, lse, delta, q_vecs, step, acc, masked: bool):
  """One key block: S, dP, P, dS and dQ += dS K (module docstring)."""
  cfg, sm, wg = cta.cfg, cta.sm, cta.wg
  slot = slot_of(step, cfg.stages_bwd)
  plgpu.barrier_wait(sm.k_bar.at[slot])
  s_, dp = mma_pair((cfg.block_q_dq, cfg.block_kv_dq),
                    sm.q_smem2.at[wg], sm.k_smem.at[slot].transpose((1, 0)),
                    sm.do_smem2.at[wg], sm.v_smem.at[slot].transpose((1, 0)))
  if masked:
    kv_vecs = [plgpu.load(sm.kvvec_smem.at[slot, i], layout=COL) for i in range(cfg.num_vec)]
    mask = query_tile_mask(cfg, q_vecs, kv_vecs, s_.shape, q_base,
                           cta.sched.block(step) * cfg.block_kv_dq)
    s_ = jnp.where(mask, s_, -jnp.inf)
  p = jnp.exp2(s_ * cfg.c() - lax.broadcast_in_dim(lse, s_.shape, [0]))
  ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
  a_smem = sm.a_smem2.at[wg] if cfg.interpret is not None else None
  acc = mma_acc(acc, ds.astype(cta.inputs.q.dtype), sm.k_smem.at[slot], None, a_smem)
  if masked and cfg.dynamic:
    release_after_reads(sm.k_free.at[slot])
  else:
    plgpu.barrier_arrive(sm.k_free.at[slot])
  return acc


def _memory(cta: _Cta):
  """Streams the schedule's K / V blocks (and their mask vectors) into the slots."""
  cfg, sm, bk = cta.cfg, cta.sm, cta.cfg.block_kv_dq
  plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

  def load(step, slot):
    j = cta.sched.block(step)
    rows = (cta.bi, pl.ds(j * bk, bk), cta.kv_head)
    plgpu.copy_gmem_to_smem(cta.inputs.k.at[rows], sm.k_smem.at[slot], sm.k_bar.at[slot])
    plgpu.copy_gmem_to_smem(cta.inputs.v.at[rows], sm.v_smem.at[slot], sm.k_bar.at[slot])
    for i, ref in enumerate(cta.inputs.kv_vecs(cfg)):
      plgpu.copy_gmem_to_smem(ref.at[cta.bi, pl.ds(j * bk, bk)], sm.kvvec_smem.at[slot, i],
                              sm.k_bar.at[slot])

  produce(cta.sched.n, cfg.stages_bwd, load, (sm.k_free,))
