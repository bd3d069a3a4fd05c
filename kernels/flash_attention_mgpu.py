"""FlashAttention-3 style forward and backward as Pallas kernels on Mosaic GPU (arXiv 2407.08608).

    out_BTHK, lse_BTH = flash_attention_mgpu(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                             q_segment_ids=None, kv_segment_ids=None,
                                             q_positions=None, kv_positions=None, scale=None)

Semantics of `kernels.flash_attention.flash_attention_reference` (segment ids, positions,
GQA without repeating K/V, out 0 and lse -inf for a query with no allowed key, gradients
through out and lse). Hopper (sm_90) only: the kernels issue TMA copies and `wgmma`; bf16 or
fp16 inputs, head dim 64 or 128, scale > 0. fp32 and other GPUs take
`kernels/flash_attention_triton.py` (`kernels.flash_attention.flash_attention` chooses).

Structure (one CTA = three warpgroups: two compute, one memory; after JAX's
`pallas/ops/gpu/attention_mgpu.py` and FlashAttention-3):
  * Forward: each compute warpgroup owns block_q query rows (a CTA covers 2 * block_q) held
    in SMEM; the memory warpgroup streams K / V blocks of block_kv rows by TMA through
    `stages` SMEM slots, with a barrier per slot for "loaded" and one for "released by both
    compute warpgroups". Per block: S = Q K^T (wgmma, operands in SMEM), online softmax in
    registers in the exp2 domain (scale * log2 e folded into one multiply-add), O += P V
    (wgmma, P from registers). The two compute warpgroups are offset by half a step with a
    shared barrier (FA3's ping-pong), so one's softmax overlaps the other's matmuls.
  * Backward, "fused" (head dim 128, the default there; FA3's): one kernel per kv tile
    streams Q, dO, lse, delta and computes S^T, dP^T, dV += P^T dO, dK += dS^T Q and
    dQ += dS K, the last added into an fp32 dq buffer with a TMA reduce-add per block (each
    compute warpgroup multiplies the whole tile's dS by its half of the head dim, after a
    barrier that both halves of dS^T are in SMEM). "split" (head dim 64): two kernels as in
    FA2 / JAX, dq (per q tile, streaming K / V; S, dP, dQ += dS K) and dk / dv (the fused
    kernel without dQ): 7 matmuls per block pair instead of 5, no reduction. Both run per kv
    head and loop over the R query heads of its group, so dk, dv are summed over the group
    in fp32 in registers. delta = rowsum(dO * O) - dlse is plain jnp (the lse cotangent:
    d lse_t / d s_ts = p_ts).
  * Block skipping. Without segment ids or explicit positions the schedule is arithmetic:
    causal tiles visit only key blocks at or below the diagonal, unmasked blocks first and
    the diagonal ones (masked with iotas) last, and heavy (late) query tiles are launched
    first. With segment ids or positions the wrapper classifies every (query tile, key
    block) pair from per-block min / max of positions and segment ids as all-visible,
    partly visible or empty (exact for any ordering, tight when both are monotone within a
    block, as in packed documents and ring attention's chunks), and passes each tile the
    list of its non-empty blocks, all-visible ones first, so empty blocks cost nothing and
    all-visible ones skip the mask. The memory and compute warpgroups walk the same list.
  * Masked logits are -inf; a row whose max is still -inf subtracts 0 instead, so exp2
    gives 0, never NaN; rows that saw no key end with l = 0 and are written as out 0,
    lse -inf. The backward turns lse -inf into +inf, so p = exp2(s - lse) = 0 there.
  * Padding: T and S are padded to the tiles; padded keys are masked by index in the
    forward (in the backward they have k = v = 0 and contribute nothing to dq), padded query
    rows are sliced off and, having dO = 0 and delta = 0, add nothing to dk / dv.

Verification without a GPU: Mosaic GPU kernels run on CPU in Pallas's GPU interpret mode
(`plgpu.InterpretGPUParams`: warpgroups as threads, simulated SMEM, TMA, barriers and
wgmma, with race detection), which this module uses when the backend is not a GPU. That
interpreter takes wgmma operands only from SMEM and does not interpret `pl.run_state`, so in
interpret mode `_mma_acc` stages register operands through an SMEM scratch and accumulates
with an add, and it has no TMA reduction, so the fused backward stores per-kv-tile dq
partials that are summed afterwards; everything else, schedules, masks, barriers, TMA
slices, is the compiled code.
Compiled code is checked by ahead-of-time lowering for an abstract H100 (Pallas -> Mosaic
GPU, including the SMEM budget); PTX generation and the timings need the GPU.

Letters: B batch, T query length, S key length, H query heads, G key/value heads
(H = G * R), K head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.flash_attention import check_shapes, default_positions

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# wgmma tiles need multiples of 64; 256 would not fit the default tiles in SMEM / registers.
HEAD_DIMS = (64, 128)
# Registers per thread: two compute warpgroups get most of the file, the TMA warpgroup little
# (2 * 128 * 232 + 128 * 40 <= 64K, as in JAX's attention_mgpu.py).
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40
# Schedule classes of a (query tile, key block) pair.
FULL, PARTIAL, EMPTY = 0, 1, 2


def supports(dtype, head_dim: int, scale: float | None = None) -> bool:
  """Whether these inputs are in the kernel's domain (on a Hopper GPU)."""
  return (jnp.dtype(dtype) in DTYPES and head_dim in HEAD_DIMS
          and (scale is None or scale > 0))


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static kernel parameters (hashable: the custom_vjp's non-differentiable argument)."""
  causal: bool
  scale: float
  block_q: int          # forward rows per compute warpgroup (a CTA holds 2 * block_q)
  block_kv: int         # forward key rows per streamed block
  stages: int
  block_q_dq: int       # dq kernel: rows per compute warpgroup, streamed key block
  block_kv_dq: int
  block_q_dkv: int      # dk/dv kernel: streamed query block, key rows per compute warpgroup
  block_kv_dkv: int
  stages_bwd: int
  bwd: str              # "split": dq and dk/dv kernels; "fused": one kernel, dq by reduce-add
  kv_len: int | None    # real S when keys were padded (padded keys masked), else None
  has_seg: bool
  has_pos: bool         # causal with positions (given, or arange next to segment ids)
  interpret: object     # None (compiled) or plgpu.InterpretGPUParams

  @property
  def dynamic(self) -> bool:
    """Schedules and masks come from segment ids / positions rather than from indices."""
    return self.has_seg or self.has_pos

  @property
  def num_vec(self) -> int:
    return int(self.has_seg) + int(self.has_pos)

  def c(self) -> float:
    """Logit multiplier of the exp2 domain: e^(scale s) = 2^(scale log2(e) s)."""
    return self.scale * LOG2E


def _compiler_params():
  return plgpu.CompilerParams(approx_math=True)


def _smem_mma_operand(shape, dtype):
  """SMEM layout wgmma reads: (8, 64) tiles, 128-byte swizzle (16-bit dtypes)."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def _mma(shape, a, b, after_issue=None, a_smem=None):
  """a @ b into a fresh fp32 accumulator; after_issue runs while the wgmma is in flight."""
  def body(acc_ref):
    if a_smem is not None:
      a_smem[...] = a
      plgpu.commit_smem()
    plgpu.wgmma(acc_ref, a_smem if a_smem is not None else a, b)
    if after_issue is not None:
      after_issue()
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _mma_acc(acc, a, b, after_issue=None, a_smem=None):
  """acc + a @ b, a from registers. Compiled: wgmma accumulates into acc's registers in
  place (pl.run_state). Interpret mode (a_smem given): a is staged through SMEM and the
  product added, since the GPU interpreter handles neither register operands nor run_state."""
  if a_smem is not None:
    return acc + _mma(acc.shape, a, b, after_issue, a_smem)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    if after_issue is not None:
      after_issue()
  return pl.run_state(body)(plgpu.ACC.init(acc))


def _release_after_reads(barrier):
  """Releases a streamed slot that this warpgroup also read with ordinary loads: the proxy
  fence orders those reads before the TMA that refills the slot (wgmma reads need none)."""
  plgpu.commit_smem()
  plgpu.barrier_arrive(barrier)


def _slot(step, stages):
  return lax.rem(step, jnp.array(stages, step.dtype))


def _produce(n, stages, load, free_barriers):
  """The memory warpgroup's loop: load(step, slot) for step in [0, n), slot = step % stages,
  waiting until both compute warpgroups released the slot's previous contents; then waits
  for the last releases, so every barrier ends having had each completed phase observed."""
  static = isinstance(n, int)
  for i in range(min(stages, n) if static else stages):
    first = functools.partial(load, jnp.int32(i), i)
    first() if static else pl.when(i < n)(first)

  @pl.loop(stages, max(n, stages) if static else jnp.maximum(n, stages))
  def _(step):
    slot = _slot(step, stages)
    for bar in free_barriers:
      plgpu.barrier_wait(bar.at[slot])
    load(step, slot)

  @pl.loop(max(n - stages, 0) if static else jnp.maximum(n - stages, 0), n)
  def _(step):
    slot = _slot(step, stages)
    for bar in free_barriers:
      plgpu.barrier_wait(bar.at[slot])


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """The streamed blocks of one CTA: steps [0, n_full) need no mask, [n_full, n) do;
  block(step) is the streamed block index of a step."""
  n_full: jax.Array | int
  n: jax.Array | int
  block: object

  @staticmethod
  def from_arrays(order_ref, count_ref, bi, tile):
    return _Schedule(count_ref[bi, tile, 0], count_ref[bi, tile, 1],
                     lambda step: order_ref[bi, tile, step])


def _static_q_schedule(cfg, q_start, tile_q, bk, nk):
  """Key blocks of the query tile at q_start with default positions: causal tiles visit the
  blocks wholly at or below their first row unmasked, then the diagonal ones; the block
  holding padded keys is masked too."""
  if cfg.causal:
    n = jnp.minimum(lax.div(q_start + tile_q + bk - 1, bk), nk)
    n_full = jnp.minimum(lax.div(q_start + 1, bk), nk)
  else:
    n = n_full = nk
    if cfg.kv_len is not None:
      n_full = cfg.kv_len // bk
    return _Schedule(n_full, n, lambda step: step)
  if cfg.kv_len is not None:
    n_full = jnp.minimum(n_full, cfg.kv_len // bk)
  return _Schedule(n_full, n, lambda step: step)


def _vec_refs(cfg, seg_ref, pos_ref):
  refs = []
  if cfg.has_seg:
    refs.append(seg_ref)
  if cfg.has_pos:
    refs.append(pos_ref)
  return refs


def _mask(cfg, row_vecs, col_vecs, shape, rows_are_queries: bool):
  """Allowed pairs of a [rows, cols] tile from per-row / per-column segment ids and
  positions (lists in has_seg, has_pos order), or None when there is nothing to check."""
  mask = None
  i = 0
  rb = lambda x: lax.broadcast_in_dim(x, shape, [0])
  cb = lambda x: lax.broadcast_in_dim(x, shape, [1])
  if cfg.has_seg:
    mask = rb(row_vecs[i]) == cb(col_vecs[i])
    i += 1
  if cfg.has_pos:
    q_pos, kv_pos = (rb(row_vecs[i]), cb(col_vecs[i])) if rows_are_queries else (
        cb(col_vecs[i]), rb(row_vecs[i]))
    c = kv_pos <= q_pos
    mask = c if mask is None else jnp.logical_and(mask, c)
  return mask


def _and(a, b):
  return b if a is None else jnp.logical_and(a, b)


def _iota(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


ROW = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a WGMMA-layout tile
COL = plgpu.Layout.WGMMA.reduce(0)   # one value per column


# ----------------------------------------------------------------------------- forward


def _forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, sched):
  """Padded inputs -> (out [B,Tp,H,K], lse2 [B,H,Tp] fp32 in base 2, -inf if no key)."""
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  r = h // g
  bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
  nq, nk = t // (2 * bq), s // bk
  dtype, c, nv = q.dtype, cfg.c(), cfg.num_vec
  masked_loop = cfg.causal or cfg.dynamic or cfg.kv_len is not None
  interpret = cfg.interpret is not None

  def kernel(*refs):
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.has_seg else (None, None)
    qpos_ref, kvpos_ref = (next(it), next(it)) if cfg.has_pos else (None, None)
    order_ref, count_ref = (next(it), next(it)) if cfg.dynamic else (None, None)
    out_ref, lse_ref = next(it), next(it)
    (qo_smem2, k_smem, v_smem, lse_smem2, qvec_smem, kvvec_smem, a_smem2,
     q_bar, k_bar, v_bar, k_free, v_free, pingpong) = next(it)

    hi = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    tile = lax.axis_index("q_tile")
    if cfg.causal:
      tile = nq - 1 - tile          # late query tiles see the most keys: launch them first
    q_start = tile * (2 * bq)
    wg = lax.axis_index("wg")
    kv_head = lax.div(hi, jnp.array(r, hi.dtype))

    if cfg.dynamic:
      sched_ = _Schedule.from_arrays(order_ref, count_ref, bi, tile)
    else:
      sched_ = _static_q_schedule(cfg, q_start, 2 * bq, bk, nk)

    def pingpong_sync():
      plgpu.barrier_arrive(pingpong)
      plgpu.barrier_wait(pingpong)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
      qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
      a_smem = a_smem2.at[wg] if interpret else None
      q_base = q_start + wg * bq
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, bq), hi], qo_smem, q_bar.at[wg])
      for i, ref in enumerate(_vec_refs(cfg, qseg_ref, qpos_ref)):
        plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(q_base, bq)], qvec_smem.at[wg, i],
                                q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      q_vecs = [plgpu.load(qvec_smem.at[wg, i], layout=ROW) for i in range(nv)]
      n_full, n = sched_.n_full, sched_.n

      def mask_for(step, slot):
        shape = (bq, bk)
        kv_vecs = [plgpu.load(kvvec_smem.at[slot, i], layout=COL) for i in range(nv)]
        mask = _mask(cfg, q_vecs, kv_vecs, shape, rows_are_queries=True)
        if (cfg.causal and not cfg.dynamic) or cfg.kv_len is not None:
          kv_idx = _iota(shape, 1) + sched_.block(step) * bk
          if cfg.causal and not cfg.dynamic:
            mask = _and(mask, kv_idx <= _iota(shape, 0) + q_base)
          if cfg.kv_len is not None:
            mask = _and(mask, kv_idx < cfg.kv_len)
        return mask

      @pl.when(n > 0)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      pl.when(wg == 1)(pingpong_sync)

      def step_fn(step, carry, masked: bool):
        acc, m_i, l_i = carry
        slot = _slot(step, stages)
        qk = _mma((bq, bk), qo_smem, k_smem.at[slot].transpose((1, 0)), pingpong_sync)
        if masked:
          qk = jnp.where(mask_for(step, slot), qk, -jnp.inf)
          if cfg.dynamic:
            _release_after_reads(k_free.at[slot])
          else:
            plgpu.barrier_arrive(k_free.at[slot])
        else:
          plgpu.barrier_arrive(k_free.at[slot])

        # Online softmax in the exp2 domain; m is kept multiplied by c so that
        # p = exp2(qk * c - m) is one multiply-add per element.
        m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
        m_use = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if masked else m_ij
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_use, qk.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + p.sum(axis=1)
        p16 = p.astype(dtype)
        # Ordering as in JAX's kernel: finish the softmax before letting the other
        # warpgroup's matmuls in.
        acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
        plgpu.barrier_arrive(pingpong)
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(pingpong)

        def wait_next_k():
          @pl.when(step + 1 < n)
          def _():
            plgpu.barrier_wait(k_bar.at[_slot(step + 1, stages)])
        acc = _mma_acc(acc, p16, v_smem.at[slot], wait_next_k, a_smem)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_ij, l_i

      carry = (plgpu.layout_cast(jnp.full((bq, kd), 0.0, jnp.float32), plgpu.Layout.WGMMA),
               plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), ROW),
               plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), ROW))
      carry = lax.fori_loop(0, n_full, functools.partial(step_fn, masked=False), carry)
      if masked_loop:
        carry = lax.fori_loop(n_full, n, functools.partial(step_fn, masked=True), carry)
      acc, m_i, l_i = carry
      pl.when(wg == 0)(pingpong_sync)

      valid = l_i > 0.0                  # saw at least one allowed key
      l_safe = jnp.where(valid, l_i, 1.0)
      out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
      qo_smem[...] = out.astype(dtype)   # rows with no key: acc = 0
      lse_smem[...] = jnp.where(valid, m_i + jnp.log2(l_safe), -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[bi, pl.ds(q_base, bq), hi])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, hi, pl.ds(q_base, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      def load(step, slot):
        j = sched_.block(step)
        rows = (bi, pl.ds(j * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])
        for i, ref in enumerate(_vec_refs(cfg, kvseg_ref, kvpos_ref)):
          plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(j * bk, bk)], kvvec_smem.at[slot, i],
                                  k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

      _produce(sched_.n, stages, load, (k_free, v_free))

  scratch = (
      _smem_mma_operand((2, bq, kd), dtype),
      _smem_mma_operand((stages, bk, kd), dtype),
      _smem_mma_operand((stages, bk, kd), dtype),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((2, nv, bq), jnp.int32) if nv else None,
      plgpu.SMEM((stages, nv, bk), jnp.int32) if nv else None,
      _smem_mma_operand((2, bq, bk), dtype) if interpret else None,
      plgpu.Barrier(num_arrivals=1 + nv, num_barriers=2),
      plgpu.Barrier(num_arrivals=1 + nv, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2),
  )
  args = [q, k, v, *_present(q_seg, kv_seg, q_pos, kv_pos), *(sched or ())]
  return plgpu.kernel(
      kernel,
      out_type=[jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
      scratch_types=[scratch],
      grid=(h, b, nq),
      grid_names=("heads", "batch", "q_tile"),
      num_threads=3,
      thread_name="wg",
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
  )(*args)


def _present(*xs):
  return [x for x in xs if x is not None]


# ---------------------------------------------------------------------------- backward


def _dq(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do, lse2, delta, sched):
  """dq [B,Tp,H,K] (scale included); lse2 is +inf on rows with no key."""
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  r = h // g
  bq, bk, stages = cfg.block_q_dq, cfg.block_kv_dq, cfg.stages_bwd
  nq, nk = t // (2 * bq), s // bk
  dtype, c, nv = q.dtype, cfg.c(), cfg.num_vec
  interpret = cfg.interpret is not None

  def kernel(*refs):
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.has_seg else (None, None)
    qpos_ref, kvpos_ref = (next(it), next(it)) if cfg.has_pos else (None, None)
    order_ref, count_ref = (next(it), next(it)) if cfg.dynamic else (None, None)
    do_ref, lse_ref, delta_ref, dq_ref = next(it), next(it), next(it), next(it)
    (q_smem2, do_smem2, stat_smem2, qvec_smem, k_smem, v_smem, kvvec_smem, a_smem2,
     q_bar, k_bar, k_free) = next(it)

    hi = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    tile = lax.axis_index("q_tile")
    if cfg.causal:
      tile = nq - 1 - tile
    q_start = tile * (2 * bq)
    wg = lax.axis_index("wg")
    kv_head = lax.div(hi, jnp.array(r, hi.dtype))

    if cfg.dynamic:
      sched_ = _Schedule.from_arrays(order_ref, count_ref, bi, tile)
    else:
      sched_ = _static_q_schedule(cfg, q_start, 2 * bq, bk, nk)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      a_smem = a_smem2.at[wg] if interpret else None
      q_base = q_start + wg * bq
      rows = (bi, pl.ds(q_base, bq), hi)
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(lse_ref.at[bi, hi, pl.ds(q_base, bq)], stat_smem2.at[wg, 0],
                              q_bar.at[wg])
      plgpu.copy_gmem_to_smem(delta_ref.at[bi, hi, pl.ds(q_base, bq)], stat_smem2.at[wg, 1],
                              q_bar.at[wg])
      for i, ref in enumerate(_vec_refs(cfg, qseg_ref, qpos_ref)):
        plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(q_base, bq)], qvec_smem.at[wg, i],
                                q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      lse = plgpu.load(stat_smem2.at[wg, 0], layout=ROW)
      delta = plgpu.load(stat_smem2.at[wg, 1], layout=ROW)
      q_vecs = [plgpu.load(qvec_smem.at[wg, i], layout=ROW) for i in range(nv)]

      def step_fn(step, dq, masked: bool):
        slot = _slot(step, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        def both(refs):
          s_ref, dp_ref = refs
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))
          return s_ref[...], dp_ref[...]
        s_, dp = pl.run_scoped(lambda *refs: both(refs), plgpu.ACC((bq, bk), jnp.float32),
                               plgpu.ACC((bq, bk), jnp.float32))
        if masked:
          shape = (bq, bk)
          kv_vecs = [plgpu.load(kvvec_smem.at[slot, i], layout=COL) for i in range(nv)]
          mask = _mask(cfg, q_vecs, kv_vecs, shape, rows_are_queries=True)
          if (cfg.causal and not cfg.dynamic) or cfg.kv_len is not None:
            # Padded keys (k = v = 0) would add nothing to dq, but their p = exp2(-lse)
            # may overflow and make 0 * inf; mask them as the forward does.
            kv_idx = _iota(shape, 1) + sched_.block(step) * bk
            if cfg.causal and not cfg.dynamic:
              mask = _and(mask, kv_idx <= _iota(shape, 0) + q_base)
            if cfg.kv_len is not None:
              mask = _and(mask, kv_idx < cfg.kv_len)
          s_ = jnp.where(mask, s_, -jnp.inf)
        p = jnp.exp2(s_ * c - lax.broadcast_in_dim(lse, s_.shape, [0]))
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
        dq = _mma_acc(dq, ds.astype(dtype), k_smem.at[slot], None, a_smem)
        if masked and cfg.dynamic:
          _release_after_reads(k_free.at[slot])
        else:
          plgpu.barrier_arrive(k_free.at[slot])
        return dq

      dq = plgpu.layout_cast(jnp.full((bq, kd), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      dq = lax.fori_loop(0, sched_.n_full, functools.partial(step_fn, masked=False), dq)
      if cfg.causal or cfg.dynamic or cfg.kv_len is not None:
        dq = lax.fori_loop(sched_.n_full, sched_.n, functools.partial(step_fn, masked=True),
                           dq)
      q_smem[...] = (dq * cfg.scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      def load(step, slot):
        j = sched_.block(step)
        rows = (bi, pl.ds(j * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], k_bar.at[slot])
        for i, ref in enumerate(_vec_refs(cfg, kvseg_ref, kvpos_ref)):
          plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(j * bk, bk)], kvvec_smem.at[slot, i],
                                  k_bar.at[slot])

      _produce(sched_.n, stages, load, (k_free,))

  scratch = (
      _smem_mma_operand((2, bq, kd), dtype),
      _smem_mma_operand((2, bq, kd), dtype),
      plgpu.SMEM((2, 2, bq), jnp.float32),
      plgpu.SMEM((2, nv, bq), jnp.int32) if nv else None,
      _smem_mma_operand((stages, bk, kd), dtype),
      _smem_mma_operand((stages, bk, kd), dtype),
      plgpu.SMEM((stages, nv, bk), jnp.int32) if nv else None,
      _smem_mma_operand((2, bq, bk), dtype) if interpret else None,
      plgpu.Barrier(num_arrivals=4 + nv, num_barriers=2),
      plgpu.Barrier(num_arrivals=2 + nv, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  )
  args = [q, k, v, *_present(q_seg, kv_seg, q_pos, kv_pos), *(sched or ()), do, lse2, delta]
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=[scratch],
      grid=(h, b, nq),
      grid_names=("heads", "batch", "q_tile"),
      num_threads=3,
      thread_name="wg",
      compiler_params=_compiler_params(),
      interpret=cfg.interpret,
  )(*args)


def _dkv(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do, lse2, delta, sched,
         out_refs=None):
  """(dk, dv) [B,Sp,G,K], summed over the R query heads of each kv head.

  out_refs (the fused backward): refs (dq fp32 [B,Tp,H,K], zero on entry, or in interpret
  mode [B,S/tile,Tp,H,K] per-tile partials; dk; dv) written in place instead of returning
  dk, dv. Every CTA adds its dq = dS K contribution to dq:
  adds its dq = dS K contribution: both warpgroups put their dS^T rows in SMEM, meet at a
  barrier, and each multiplies dS by one half of the head dim of the CTA's K tile, adding
  the [block_q, K/2] product to dq with a TMA reduce-add (FlashAttention-3's dQ path).
  """
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  r = h // g
  bq, bk, stages = cfg.block_q_dkv, cfg.block_kv_dkv, cfg.stages_bwd
  nqb, nkt = t // bq, s // (2 * bk)
  dtype, c, nv = q.dtype, cfg.c(), cfg.num_vec
  interpret = cfg.interpret is not None
  fused = out_refs is not None
  hk = kd // 2                      # dq columns per compute warpgroup (fused)
  # Fused: padded keys (k = v = 0) may give p = exp2(-lse) = inf and then inf * 0 in dS K.
  mask_padded = fused and cfg.kv_len is not None

  def kernel(*refs):
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    qseg_ref, kvseg_ref = (next(it), next(it)) if cfg.has_seg else (None, None)
    qpos_ref, kvpos_ref = (next(it), next(it)) if cfg.has_pos else (None, None)
    order_ref, count_ref = (next(it), next(it)) if cfg.dynamic else (None, None)
    do_ref, lse_ref, delta_ref = next(it), next(it), next(it)
    dq_acc_ref = next(it) if fused else None
    dk_ref, dv_ref = next(it), next(it)
    (k_tile, v_smem2, kvvec_smem, q_smem, do_smem, stat_smem, qvec_smem, a_smem2,
     kv_bar, q_bar, q_free, ds_smem, dq_smem, ds_sync) = next(it)

    gi = lax.axis_index("kv_heads")
    bi = lax.axis_index("batch")
    tile = lax.axis_index("kv_tile")
    kv_start = tile * (2 * bk)
    wg = lax.axis_index("wg")

    if cfg.dynamic:
      sched_ = _Schedule.from_arrays(order_ref, count_ref, bi, tile)
    elif cfg.causal:
      # Query blocks ending before the tile starts see none of it; blocks starting at or
      # after the tile's last key see all of it; the ones between are masked.
      first = jnp.minimum(lax.div(kv_start, bq), nqb)
      first_full = jnp.minimum(lax.div(kv_start + 2 * bk - 1 + bq - 1, bq), nqb)
      n_full = nqb - first_full
      sched_ = _Schedule(n_full, nqb - first,
                         lambda step: jnp.where(step < n_full, first_full + step,
                                                first + step - n_full))
    else:
      sched_ = _Schedule(nqb, nqb, lambda step: step)
    if mask_padded and not cfg.dynamic:   # the tile holding padded keys: every block masked
      n_full = jnp.where(tile == nkt - 1, 0, sched_.n_full)
      sched_ = _Schedule(n_full, sched_.n, sched_.block)
    n_per_head = sched_.n

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
      k_smem, v_smem = k_tile.at[pl.ds(wg * bk, bk)], v_smem2.at[wg]
      a_smem = a_smem2.at[wg] if interpret else None
      kv_base = kv_start + wg * bk
      rows = (bi, pl.ds(kv_base, bk), gi)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_bar.at[wg])
      for i, ref in enumerate(_vec_refs(cfg, kvseg_ref, kvpos_ref)):
        plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(kv_base, bk)], kvvec_smem.at[wg, i],
                                kv_bar.at[wg])
      plgpu.barrier_wait(kv_bar.at[wg])
      if fused:   # dS K reads the other warpgroup's K rows too
        plgpu.barrier_wait(kv_bar.at[1 - wg])
      kv_vecs = [plgpu.load(kvvec_smem.at[wg, i], layout=ROW) for i in range(nv)]

      def step_fn(local, carry, head: jax.Array, masked: bool):
        dk, dv = carry
        step = head * n_per_head + local
        slot = _slot(step, stages)
        plgpu.barrier_wait(q_bar.at[slot])

        def both(refs):
          st_ref, dpt_ref = refs
          plgpu.wgmma(st_ref, k_smem, q_smem.at[slot].transpose((1, 0)))
          plgpu.wgmma(dpt_ref, v_smem, do_smem.at[slot].transpose((1, 0)))
          return st_ref[...], dpt_ref[...]
        st, dpt = pl.run_scoped(lambda *refs: both(refs), plgpu.ACC((bk, bq), jnp.float32),
                                plgpu.ACC((bk, bq), jnp.float32))
        if masked:
          shape = (bk, bq)
          q_vecs = [plgpu.load(qvec_smem.at[slot, i], layout=COL) for i in range(nv)]
          mask = _mask(cfg, kv_vecs, q_vecs, shape, rows_are_queries=False)
          if cfg.causal and not cfg.dynamic:
            q_idx = _iota(shape, 1) + sched_.block(local) * bq
            mask = _and(mask, _iota(shape, 0) + kv_base <= q_idx)
          if mask_padded:
            mask = _and(mask, _iota(shape, 0) + kv_base < cfg.kv_len)
          st = jnp.where(mask, st, -jnp.inf)
        lse = plgpu.load(stat_smem.at[slot, 0], layout=COL)
        delta = plgpu.load(stat_smem.at[slot, 1], layout=COL)
        pt = jnp.exp2(st * c - lax.broadcast_in_dim(lse, st.shape, [1]))
        dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
        dv = _mma_acc(dv, pt.astype(dtype), do_smem.at[slot], None, a_smem)
        ds16 = dst.astype(dtype)
        dk = _mma_acc(dk, ds16, q_smem.at[slot], None, a_smem)
        if fused:
          i = sched_.block(local)
          _add_dq(ds16, step, i * bq, gi * r + head)
        _release_after_reads(q_free.at[slot])
        return dk, dv

      def _add_dq(ds16, step, q0, hi):
        """dq[q0:q0+bq, hi, wg half] += (dS K)[:, wg half] for this step's query block."""
        buf = _slot(step, 2)
        ds_smem.at[buf, pl.ds(wg * bk, bk)][...] = ds16     # this warpgroup's dS^T rows
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_sync)                        # both halves of dS^T written
        plgpu.barrier_wait(ds_sync)
        # The other warpgroup rewrites ds_smem[buf] two steps later, after this one has
        # passed the next step's barrier, so one barrier per step protects both buffers.
        dq = _mma((bq, hk), ds_smem.at[buf].transpose((1, 0)),
                  k_tile.at[:, pl.ds(wg * hk, hk)])
        out = dq_smem.at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last store read `out`
        out[...] = dq
        plgpu.commit_smem()
        cols = pl.ds(wg * hk, hk)
        if interpret:
          # The GPU interpreter has no TMA reduction: each CTA stores its partial in its own
          # slice (one per kv tile; each (query block, head) once per CTA), summed after.
          plgpu.copy_smem_to_gmem(out, dq_acc_ref.at[bi, tile, pl.ds(q0, bq), hi, cols])
        else:
          plgpu.copy_smem_to_gmem(out, dq_acc_ref.at[bi, pl.ds(q0, bq), hi, cols],
                                  reduction_op="add")

      def head_fn(head, carry):
        carry = lax.fori_loop(0, sched_.n_full,
                              functools.partial(step_fn, head=head, masked=False), carry)
        if cfg.causal or cfg.dynamic or mask_padded:
          carry = lax.fori_loop(sched_.n_full, sched_.n,
                                functools.partial(step_fn, head=head, masked=True), carry)
        return carry

      zeros = plgpu.layout_cast(jnp.full((bk, kd), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      dk, dv = lax.fori_loop(0, r, head_fn, (zeros, zeros))
      k_smem[...] = (dk * cfg.scale).astype(dtype)
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      def load(step, slot):
        head = lax.div(step, n_per_head)
        i = sched_.block(step - head * n_per_head)
        hi = gi * r + head
        rows = (bi, pl.ds(i * bq, bq), hi)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[bi, hi, pl.ds(i * bq, bq)], stat_smem.at[slot, 0],
                                q_bar.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[bi, hi, pl.ds(i * bq, bq)],
                                stat_smem.at[slot, 1], q_bar.at[slot])
        for vi, ref in enumerate(_vec_refs(cfg, qseg_ref, qpos_ref)):
          plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(i * bq, bq)], qvec_smem.at[slot, vi],
                                  q_bar.at[slot])

      _produce(r * n_per_head, stages, load, (q_free,))

  scratch = (
      _smem_mma_operand((2 * bk, kd), dtype),
      _smem_mma_operand((2, bk, kd), dtype),
      plgpu.SMEM((2, nv, bk), jnp.int32) if nv else None,
      _smem_mma_operand((stages, bq, kd), dtype),
      _smem_mma_operand((stages, bq, kd), dtype),
      plgpu.SMEM((stages, 2, bq), jnp.float32),
      plgpu.SMEM((stages, nv, bq), jnp.int32) if nv else None,
      _smem_mma_operand((2, bk, bq), dtype) if interpret else None,
      plgpu.Barrier(num_arrivals=2 + nv, num_barriers=2),
      plgpu.Barrier(num_arrivals=4 + nv, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      _smem_mma_operand((2, 2 * bk, bq), dtype) if fused else None,
      plgpu.SMEM((2, bq, hk), jnp.float32) if fused else None,
      plgpu.Barrier(num_arrivals=2) if fused else None,
  )
  args = [q, k, v, *_present(q_seg, kv_seg, q_pos, kv_pos), *(sched or ()), do, lse2, delta]
  call = functools.partial(
      plgpu.kernel, kernel, scratch_types=[scratch], grid=(g, b, nkt),
      grid_names=("kv_heads", "batch", "kv_tile"), num_threads=3, thread_name="wg",
      compiler_params=_compiler_params(), interpret=cfg.interpret)
  if not fused:
    return call(out_type=[jax.ShapeDtypeStruct(k.shape, dtype),
                          jax.ShapeDtypeStruct(v.shape, dtype)])(*args)
  call(out_type=())(*args, *out_refs)    # ref operands: written in place (aliased outputs)
  return None


# ------------------------------------------------------------------------ schedules


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
    full = _and_arr(full, k_hi <= q_lo)
    empty = _or_arr(empty, k_lo > q_hi)
  q_any = q_seg if q_seg is not None else q_pos
  kv_any = kv_seg if kv_seg is not None else kv_pos
  shape = (q_any.shape[0], q_any.shape[1] // tile_q, kv_any.shape[1] // tile_kv)
  full = jnp.broadcast_to(True if full is None else full, shape)
  empty = jnp.broadcast_to(False if empty is None else empty, shape)
  if partial_kv is not None:
    full = full.at[:, :, partial_kv].set(False)
  return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def _and_arr(a, b):
  return b if a is None else a & b


def _or_arr(a, b):
  return b if a is None else a | b


def schedule_from_classes(cls_BNM):
  """Per row of [B, N, M]: (order [B,N,M] int32: the non-empty columns, FULL before PARTIAL,
  then the rest; counts [B,N,2] int32: (#FULL, #FULL + #PARTIAL))."""
  order = jnp.argsort(cls_BNM, axis=-1, stable=True).astype(jnp.int32)
  n_full = jnp.sum(cls_BNM == FULL, axis=-1)
  n = n_full + jnp.sum(cls_BNM == PARTIAL, axis=-1)
  return order, jnp.stack([n_full, n], axis=-1).astype(jnp.int32)


def _schedules(cfg: _Config, q_seg, kv_seg, q_pos, kv_pos):
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


# ------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  sched, _, _ = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos)
  out, lse2 = _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, sched)
  return out, lse2 * LN2


def _flash_fwd(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  sched, _, _ = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos)
  out, lse2 = _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, sched)
  return (out, lse2 * LN2), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2)


def _flash_bwd(cfg, res, cts):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2 = res
  do, dlse = cts
  delta = jnp.einsum("bthk,bthk->bht", out.astype(jnp.float32), do.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
  delta = delta - dlse.astype(jnp.float32)
  lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)       # rows with no key: p = 0
  do = do.astype(q.dtype)
  _, sched_dq, sched_dkv = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos)
  masks = (q_seg, kv_seg, q_pos, kv_pos)
  if cfg.bwd == "fused":
    def run(refs):
      _dkv(cfg, q, k, v, *masks, do, lse2, delta, sched_dkv, out_refs=refs)
    dq_shape = q.shape
    if cfg.interpret is not None:   # per-kv-tile partials (see _dkv)
      dq_shape = (q.shape[0], k.shape[1] // (2 * cfg.block_kv_dkv), *q.shape[1:])
    dq, dk, dv = pl.run_state(run)((jnp.zeros(dq_shape, jnp.float32), jnp.zeros_like(k),
                                    jnp.zeros_like(v)))
    if cfg.interpret is not None:
      dq = dq.sum(axis=1)
    dq = (dq * cfg.scale).astype(q.dtype)
  else:
    dq = _dq(cfg, q, k, v, *masks, do, lse2, delta, sched_dq)
    dk, dv = _dkv(cfg, q, k, v, *masks, do, lse2, delta, sched_dkv)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad(x, axis, size, mode="constant"):
  if x is None or x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, mode=mode)


def _round_up(n, m):
  return -(-n // m) * m


def interpret_params(interpret):
  """None / bool / InterpretGPUParams -> what plgpu.kernel takes (None = compiled)."""
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret is True:
    return plgpu.InterpretGPUParams()
  if interpret is False:
    return None
  return interpret


@functools.partial(jax.jit, static_argnames=(
    "causal", "scale", "block_q", "block_kv", "stages", "block_q_dq", "block_kv_dq",
    "block_q_dkv", "block_kv_dkv", "stages_bwd", "bwd", "interpret"))
def flash_attention_mgpu(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, q_segment_ids=None,
                         kv_segment_ids=None, q_positions=None, kv_positions=None,
                         scale: float | None = None, block_q: int = 64, block_kv: int = 128,
                         stages: int = 2, block_q_dq: int = 64, block_kv_dq: int = 128,
                         block_q_dkv: int = 64, block_kv_dkv: int = 64, stages_bwd: int = 2,
                         bwd: str | None = None, interpret=None):
  """Mosaic GPU flash attention; returns (out [B,T,H,K] like q, lse [B,T,H] fp32).

  block_q: query rows per compute warpgroup in the forward (a CTA holds 2 * block_q);
  block_kv: key rows per pipelined block; stages: SMEM slots of the K / V pipeline.
  block_q_dq / block_kv_dq and block_q_dkv / block_kv_dkv: the same for the dq kernel and,
  transposed, for the dk / dv kernel (block_kv_dkv key rows per compute warpgroup,
  block_q_dkv query rows per streamed block). All blocks are multiples of 64; the defaults
  follow JAX's attention_mgpu.py and fit the 227 KiB of SMEM at head dim 128.
  bwd: "split" (a dq kernel and a dk / dv kernel, 7 matmuls per block pair), "fused"
  (head dim 128: one kernel, 5 matmuls, dq added into an fp32 buffer by TMA reduce-add, as
  FlashAttention-3) or None: fused at head dim 128, split otherwise. interpret: None runs the GPU interpreter on CPU (slow; for tests)
  unless the backend is a GPU; True / False / a plgpu.InterpretGPUParams.
  """
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  dtype = q_BTHK.dtype
  if not dtype == k_BSGK.dtype == v_BSGK.dtype or jnp.dtype(dtype) not in DTYPES:
    raise ValueError(f"flash_attention_mgpu: dtypes q {q_BTHK.dtype}, k {k_BSGK.dtype}, "
                     f"v {v_BSGK.dtype}; expected one of bfloat16, float16 for all three "
                     "(fp32 runs on kernels/flash_attention_triton.py)")
  if kd not in HEAD_DIMS:
    raise ValueError(f"flash_attention_mgpu: head dim {kd}, expected one of {HEAD_DIMS}")
  scale = float(kd ** -0.5 if scale is None else scale)
  if scale <= 0:
    raise ValueError(f"flash_attention_mgpu: scale={scale}, expected > 0 (the row max is "
                     "taken before scaling)")
  blocks = dict(block_q=block_q, block_kv=block_kv, block_q_dq=block_q_dq,
                block_kv_dq=block_kv_dq, block_q_dkv=block_q_dkv, block_kv_dkv=block_kv_dkv)
  for name, blk in blocks.items():
    if blk < 64 or blk % 64:
      raise ValueError(f"flash_attention_mgpu: {name}={blk}, expected a multiple of 64")
  if bwd is None:
    bwd = "fused" if kd == 128 else "split"
  if bwd not in ("split", "fused") or (bwd == "fused" and kd != 128):
    raise ValueError(f"flash_attention_mgpu: bwd={bwd!r} with head dim {kd}; expected "
                     "'split', or 'fused' at head dim 128")
  if stages < 2 or stages_bwd < 2:
    raise ValueError(f"flash_attention_mgpu: stages={stages}, stages_bwd={stages_bwd}; "
                     "expected at least 2")

  t_pad = _round_up(t, math.lcm(2 * block_q, 2 * block_q_dq, block_q_dkv))
  s_pad = _round_up(s, math.lcm(block_kv, block_kv_dq, 2 * block_kv_dkv))
  has_seg = q_segment_ids is not None
  has_pos = causal and (q_positions is not None or kv_positions is not None or has_seg)
  q_seg = kv_seg = q_pos = kv_pos = None
  # Padded rows repeat the last real row's segment id and position ("edge"), so block
  # min / max stay those of the real rows; padded keys are masked by index instead.
  if has_seg:
    q_seg = _pad(q_segment_ids.astype(jnp.int32), 1, t_pad, "edge")
    kv_seg = _pad(kv_segment_ids.astype(jnp.int32), 1, s_pad, "edge")
  if has_pos:
    q_pos = q_positions if q_positions is not None else default_positions(b, t)
    kv_pos = kv_positions if kv_positions is not None else default_positions(b, s)
    q_pos = _pad(q_pos.astype(jnp.int32), 1, t_pad, "edge")
    kv_pos = _pad(kv_pos.astype(jnp.int32), 1, s_pad, "edge")

  cfg = _Config(causal=causal, scale=scale, stages=stages, stages_bwd=stages_bwd, bwd=bwd,
                kv_len=s if s_pad != s else None, has_seg=has_seg, has_pos=has_pos,
                interpret=interpret_params(interpret), **blocks)
  q = _pad(q_BTHK, 1, t_pad)
  k = _pad(k_BSGK, 1, s_pad)
  v = _pad(v_BSGK, 1, s_pad)
  out, lse_BHT = _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return out[:, :t], lse_BHT[:, :, :t].transpose(0, 2, 1)
