"""The forward kernel: out and lse of one (head, batch, 2 * block_q query rows) per CTA.

Each compute warpgroup owns block_q query rows held in SMEM; the memory warpgroup streams
K / V blocks of block_kv rows by TMA through `stages` SMEM slots, with a barrier per slot for
"loaded" and one for "released by both compute warpgroups". Per block: S = Q K^T (wgmma,
operands in SMEM), online softmax in registers in the exp2 domain, O += P V (wgmma, P from
registers). The two compute warpgroups are offset by half a step with a shared barrier
(FA3's ping-pong), so one's softmax overlaps the other's matmuls.
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
    COL, COMPUTE_REGISTERS, MEMORY_REGISTERS, ROW, Config, Inputs, Schedule, launch, mma,
    mma_acc, present, produce, q_tile_schedule, query_tile_mask, release_after_reads,
    slot_of, smem_mma_operand, sync, zeros)


class _Scratch(NamedTuple):
  """SMEM buffers and barriers (the scratch_types of `forward`, in order)."""
  qo_smem2: object      # [2, bq, K] per compute warpgroup: Q in, then O out
  k_smem: object        # [stages, bk, K] streamed
  v_smem: object
  lse_smem2: object     # [2, bq] fp32
  qvec_smem: object     # [2, nv, bq] query segment ids / positions
  kvvec_smem: object    # [stages, nv, bk]
  a_smem2: object       # [2, bq, bk] interpret mode: P staged for wgmma
  q_bar: object
  k_bar: object
  v_bar: object
  k_free: object
  v_free: object
  pingpong: object


@dataclasses.dataclass(frozen=True)
class _Cta:
  """What one CTA's warpgroups read: its refs, coordinates and schedule."""
  cfg: Config
  inputs: Inputs
  out_ref: object
  lse_ref: object
  sm: _Scratch
  bi: jax.Array
  hi: jax.Array
  kv_head: jax.Array
  q_start: jax.Array
  wg: jax.Array
  sched: Schedule


def forward(cfg: Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, sched):
  """Padded inputs -> (out [B,Tp,H,K], lse2 [B,H,Tp] fp32 in base 2, -inf if no key)."""
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  bq, bk, stages, nv, dtype = cfg.block_q, cfg.block_kv, cfg.stages, cfg.num_vec, q.dtype
  nq = t // (2 * bq)
  interpret = cfg.interpret is not None
  scratch = (
      smem_mma_operand((2, bq, kd), dtype),
      smem_mma_operand((stages, bk, kd), dtype),
      smem_mma_operand((stages, bk, kd), dtype),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((2, nv, bq), jnp.int32) if nv else None,
      plgpu.SMEM((stages, nv, bk), jnp.int32) if nv else None,
      smem_mma_operand((2, bq, bk), dtype) if interpret else None,
      plgpu.Barrier(num_arrivals=1 + nv, num_barriers=2),
      plgpu.Barrier(num_arrivals=1 + nv, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2),
  )
  kernel = functools.partial(_kernel, cfg, nq, s // bk, h // g)
  out_type = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)]
  return launch(cfg, kernel, out_type=out_type, scratch=scratch, grid=(h, b, nq),
                grid_names=("heads", "batch", "q_tile"))(
                    q, k, v, *present(q_seg, kv_seg, q_pos, kv_pos), *(sched or ()))


def _kernel(cfg: Config, nq: int, nk: int, r: int, *refs):
  it = iter(refs)
  inputs = Inputs.take(cfg, it)
  out_ref, lse_ref, sm = next(it), next(it), _Scratch(*next(it))
  hi = lax.axis_index("heads")
  bi = lax.axis_index("batch")
  tile = lax.axis_index("q_tile")
  if cfg.causal:
    tile = nq - 1 - tile          # late query tiles see the most keys: launch them first
  q_start = tile * (2 * cfg.block_q)
  sched = q_tile_schedule(cfg, inputs, bi, tile, q_start, 2 * cfg.block_q, cfg.block_kv, nk)
  cta = _Cta(cfg, inputs, out_ref, lse_ref, sm, bi, hi, lax.div(hi, jnp.array(r, hi.dtype)),
             q_start, lax.axis_index("wg"), sched)
  pl.when(cta.wg < 2)(functools.partial(_compute, cta))
  pl.when(cta.wg == 2)(functools.partial(_memory, cta))


def _compute(cta: _Cta):
  cfg, sm, wg, bq = cta.cfg, cta.sm, cta.wg, cta.cfg.block_q
  plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
  qo_smem = sm.qo_smem2.at[wg]
  q_base = cta.q_start + wg * bq
  plgpu.copy_gmem_to_smem(cta.inputs.q.at[cta.bi, pl.ds(q_base, bq), cta.hi], qo_smem,
                          sm.q_bar.at[wg])
  for i, ref in enumerate(cta.inputs.q_vecs(cfg)):
    plgpu.copy_gmem_to_smem(ref.at[cta.bi, pl.ds(q_base, bq)], sm.qvec_smem.at[wg, i],
                            sm.q_bar.at[wg])
  plgpu.barrier_wait(sm.q_bar.at[wg])
  q_vecs = [plgpu.load(sm.qvec_smem.at[wg, i], layout=ROW) for i in range(cfg.num_vec)]
  n_full, n = cta.sched.n_full, cta.sched.n

  @pl.when(n > 0)
  def _():
    plgpu.barrier_wait(sm.k_bar.at[0])

  pl.when(wg == 1)(functools.partial(sync, sm.pingpong))
  step = functools.partial(_step, cta, q_vecs, q_base)
  carry = (zeros((bq, cta.inputs.q.shape[-1])),
           plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), ROW),
           plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), ROW))
  carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
  if cfg.causal or cfg.dynamic or cfg.kv_len is not None:
    carry = lax.fori_loop(n_full, n, functools.partial(step, masked=True), carry)
  acc, m_i, l_i = carry
  pl.when(wg == 0)(functools.partial(sync, sm.pingpong))

  valid = l_i > 0.0                  # saw at least one allowed key
  l_safe = jnp.where(valid, l_i, 1.0)
  out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
  lse_smem = sm.lse_smem2.at[wg]
  qo_smem[...] = out.astype(cta.inputs.q.dtype)   # rows with no key: acc = 0
  lse_smem[...] = jnp.where(valid, m_i + jnp.log2(l_safe), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, cta.out_ref.at[cta.bi, pl.ds(q_base, bq), cta.hi])
  plgpu.copy_smem_to_gmem(lse_smem, cta.lse_ref.at[cta.bi, cta.hi, pl.ds(q_base, bq)])
  plgpu.wait_smem_to_gmem(0)


def _step(cta: _Cta, q_vecs, q_base, step, carry, masked: bool):
  """One key block: S = Q K^T, online softmax, O += P V (module docstring)."""
  cfg, sm, wg = cta.cfg, cta.sm, cta.wg
  acc, m_i, l_i = carry
  slot = slot_of(step, cfg.stages)
  qk = mma((cfg.block_q, cfg.block_kv), sm.qo_smem2.at[wg],
           sm.k_smem.at[slot].transpose((1, 0)), functools.partial(sync, sm.pingpong))
  if masked:
    kv_vecs = [plgpu.load(sm.kvvec_smem.at[slot, i], layout=COL) for i in range(cfg.num_vec)]
    mask = query_tile_mask(cfg, q_vecs, kv_vecs, qk.shape, q_base,
                           cta.sched.block(step) * cfg.block_kv)
    qk = jnp.where(mask, qk, -jnp.inf)
  if masked and cfg.dynamic:
    release_after_reads(sm.k_free.at[slot])
  else:
    plgpu.barrier_arrive(sm.k_free.at[slot])

  # Online softmax in the exp2 domain; m is kept multiplied by c so that
  # p = exp2(qk * c - m) is one multiply-add per element.
  c = cfg.c()
  m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
  m_use = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if masked else m_ij
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_use, qk.shape, [0]))
  acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
  l_i = l_i * alpha + p.sum(axis=1)
  p16 = p.astype(cta.inputs.q.dtype)
  # Ordering as in JAX's kernel: finish the softmax before letting the other
  # warpgroup's matmuls in.
  acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
  plgpu.barrier_arrive(sm.pingpong)
  plgpu.barrier_wait(sm.v_bar.at[slot])
  plgpu.barrier_wait(sm.pingpong)

  def wait_next_k():
    @pl.when(step + 1 < cta.sched.n)
    def _():
      plgpu.barrier_wait(sm.k_bar.at[slot_of(step + 1, cfg.stages)])
  a_smem = sm.a_smem2.at[wg] if cfg.interpret is not None else None
  acc = mma_acc(acc, p16, sm.v_smem.at[slot], wait_next_k, a_smem)
  plgpu.barrier_arrive(sm.v_free.at[slot])
  return acc, m_ij, l_i


def _memory(cta: _Cta):
  """Streams the schedule's K / V blocks (and their mask vectors) into the slots."""
  cfg, sm, bk = cta.cfg, cta.sm, cta.cfg.block_kv
  plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

  def load(step, slot):
    j = cta.sched.block(step)
    rows = (cta.bi, pl.ds(j * bk, bk), cta.kv_head)
    plgpu.copy_gmem_to_smem(cta.inputs.k.at[rows], sm.k_smem.at[slot], sm.k_bar.at[slot])
    for i, ref in enumerate(cta.inputs.kv_vecs(cfg)):
      plgpu.copy_gmem_to_smem(ref.at[cta.bi, pl.ds(j * bk, bk)], sm.kvvec_smem.at[slot, i],
                              sm.k_bar.at[slot])
    plgpu.copy_gmem_to_smem(cta.inputs.v.at[rows], sm.v_smem.at[slot], sm.v_bar.at[slot])

  produce(cta.sched.n, cfg.stages, load, (sm.k_free, sm.v_free))
