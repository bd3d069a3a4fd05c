"""What the Mosaic GPU attention kernels share: static config, wgmma helpers, the TMA producer
loop, per-CTA schedules and masks.

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
class Config:
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


def interpret_params(interpret):
  """None / bool / InterpretGPUParams -> what plgpu.kernel takes (None = compiled)."""
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret is True:
    return plgpu.InterpretGPUParams()
  if interpret is False:
    return None
  return interpret


def launch(cfg: Config, kernel, *, out_type, scratch, grid, grid_names):
  """plgpu.kernel over `grid` with three warpgroups ("wg": two compute, one memory)."""
  return plgpu.kernel(kernel, out_type=out_type, scratch_types=[scratch], grid=grid,
                      grid_names=grid_names, num_threads=3, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(approx_math=True),
                      interpret=cfg.interpret)


def smem_mma_operand(shape, dtype):
  """SMEM layout wgmma reads: (8, 64) tiles, 128-byte swizzle (16-bit dtypes)."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def mma(shape, a, b, after_issue=None, a_smem=None):
  """a @ b into a fresh fp32 accumulator; after_issue runs while the wgmma is in flight.
  Reading the accumulator waits for the wgmma, so its SMEM operands are free on return."""
  def body(acc_ref):
    if a_smem is not None:
      a_smem[...] = a
      plgpu.commit_smem()
    plgpu.wgmma(acc_ref, a_smem if a_smem is not None else a, b)
    if after_issue is not None:
      after_issue()
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def mma_acc(acc, a, b, after_issue=None, a_smem=None):
  """acc + a @ b, a from registers. Compiled: wgmma accumulates into acc's registers in
  place (pl.run_state). Interpret mode (a_smem given): a is staged through SMEM and the
  product added, since the GPU interpreter handles neither register operands nor run_state."""
  if a_smem is not None:
    return acc + mma(acc.shape, a, b, after_issue, a_smem)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    if after_issue is not None:
      after_issue()
  return pl.run_state(body)(plgpu.ACC.init(acc))


def mma_pair(shape, a1, b1, a2, b2):
  """(a1 @ b1, a2 @ b2), both wgmmas issued before either is waited for."""
  def both(refs):
    r1, r2 = refs
    plgpu.wgmma(r1, a1, b1)
    plgpu.wgmma(r2, a2, b2)
    return r1[...], r2[...]
  return pl.run_scoped(lambda *refs: both(refs), plgpu.ACC(shape, jnp.float32),
                       plgpu.ACC(shape, jnp.float32))


def release_after_reads(barrier):
  """Releases a streamed slot that this warpgroup also read with ordinary loads: the proxy
  fence orders those reads before the TMA that refills the slot (wgmma reads need none)."""
  plgpu.commit_smem()
  plgpu.barrier_arrive(barrier)


def sync(barrier):
  """Both compute warpgroups meet at `barrier` (num_arrivals=2)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def slot_of(step, stages):
  return lax.rem(step, jnp.array(stages, step.dtype))


def produce(n, stages, load, free_barriers):
  """The memory warpgroup's loop: load(step, slot) for step in [0, n), slot = step % stages,
  waiting until both compute warpgroups released the slot's previous contents; then waits
  for the last releases, so every barrier ends having had each completed phase observed."""
  static = isinstance(n, int)
  for i in range(min(stages, n) if static else stages):
    first = functools.partial(load, jnp.int32(i), i)
    first() if static else pl.when(i < n)(first)

  @pl.loop(stages, max(n, stages) if static else jnp.maximum(n, stages))
  def _(step):
    s = slot_of(step, stages)
    for bar in free_barriers:
      plgpu.barrier_wait(bar.at[s])
    load(step, s)

  @pl.loop(max(n - stages, 0) if static else jnp.maximum(n - stages, 0), n)
  def _(step):
    s = slot_of(step, stages)
    for bar in free_barriers:
      plgpu.barrier_wait(bar.at[s])


@dataclasses.dataclass(frozen=True)
class Inputs:
  """The refs every kernel takes first: q, k, v, the present mask vectors, the schedule."""
  q: object
  k: object
  v: object
  q_seg: object = None
  kv_seg: object = None
  q_pos: object = None
  kv_pos: object = None
  order: object = None
  count: object = None

  @staticmethod
  def take(cfg: Config, it) -> Inputs:
    """Consumes the refs from iterator `it` in the order `present` lays them out."""
    q, k, v = next(it), next(it), next(it)
    seg = (next(it), next(it)) if cfg.has_seg else (None, None)
    pos = (next(it), next(it)) if cfg.has_pos else (None, None)
    sched = (next(it), next(it)) if cfg.dynamic else (None, None)
    return Inputs(q, k, v, *seg, *pos, *sched)

  def q_vecs(self, cfg: Config):
    """Per-query vectors the mask reads, in has_seg, has_pos order."""
    return [r for r, on in ((self.q_seg, cfg.has_seg), (self.q_pos, cfg.has_pos)) if on]

  def kv_vecs(self, cfg: Config):
    return [r for r, on in ((self.kv_seg, cfg.has_seg), (self.kv_pos, cfg.has_pos)) if on]


def present(*xs):
  return [x for x in xs if x is not None]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The streamed blocks of one CTA: steps [0, n_full) need no mask, [n_full, n) do;
  block(step) is the streamed block index of a step."""
  n_full: jax.Array | int
  n: jax.Array | int
  block: object

  @staticmethod
  def from_arrays(order_ref, count_ref, bi, tile):
    return Schedule(count_ref[bi, tile, 0], count_ref[bi, tile, 1],
                    lambda step: order_ref[bi, tile, step])


def q_tile_schedule(cfg: Config, inputs: Inputs, bi, tile, q_start, tile_q, bk, nk):
  """Key blocks of the query tile at q_start: the precomputed list with segment ids or
  positions; else (default positions) causal tiles visit the blocks wholly at or below
  their first row unmasked, then the diagonal ones; the block holding padded keys is
  masked too."""
  if cfg.dynamic:
    return Schedule.from_arrays(inputs.order, inputs.count, bi, tile)
  if cfg.causal:
    n = jnp.minimum(lax.div(q_start + tile_q + bk - 1, bk), nk)
    n_full = jnp.minimum(lax.div(q_start + 1, bk), nk)
  else:
    n = n_full = nk
    if cfg.kv_len is not None:
      n_full = cfg.kv_len // bk
    return Schedule(n_full, n, lambda step: step)
  if cfg.kv_len is not None:
    n_full = jnp.minimum(n_full, cfg.kv_len // bk)
  return Schedule(n_full, n, lambda step: step)


def and_(a, b):
  return b if a is None else jnp.logical_and(a, b)


def iota(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


ROW = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a WGMMA-layout tile
COL = plgpu.Layout.WGMMA.reduce(0)   # one value per column


def vector_mask(cfg: Config, row_vecs, col_vecs, shape, rows_are_queries: bool):
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


def query_tile_mask(cfg: Config, q_vecs, kv_vecs, shape, q_base, kv_base):
  """Allowed pairs of a [queries, keys] tile whose rows start at q_base and columns at
  kv_base: the vectors' rule, the causal rule by index (default positions) and padded keys
  (which would make 0 * inf in the backward: their p = exp2(-lse) may overflow)."""
  mask = vector_mask(cfg, q_vecs, kv_vecs, shape, rows_are_queries=True)
  if (cfg.causal and not cfg.dynamic) or cfg.kv_len is not None:
    kv_idx = iota(shape, 1) + kv_base
    if cfg.causal and not cfg.dynamic:
      mask = and_(mask, kv_idx <= iota(shape, 0) + q_base)
    if cfg.kv_len is not None:
      mask = and_(mask, kv_idx < cfg.kv_len)
  return mask


def zeros(shape, layout=plgpu.Layout.WGMMA):
  return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), layout)
