"""FlashAttention-3 style forward and backward as Pallas kernels on Mosaic GPU (arXiv 2407.08608).

    out_BTHK, lse_BTH = flash_attention_mgpu(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                             q_segment_ids=None, kv_segment_ids=None,
                                             q_positions=None, kv_positions=None, scale=None)

Semantics of `kernels.flash_attention_reference.flash_attention_reference` (segment ids,
positions, GQA without repeating K/V, out 0 and lse -inf for a query with no allowed key,
gradients through out and lse). Hopper (sm_90) only: TMA copies and wgmma; bf16 or fp16,
head dim 64 or 128, scale > 0 (`supports`). One CTA = two compute warpgroups and one memory
warpgroup (TMA producer), after JAX's `pallas/ops/gpu/attention_mgpu.py`. The parts:

  forward.py       out, lse: K / V streamed through SMEM slots, online softmax in the exp2
                   domain, the compute warpgroups in FA3's ping-pong.
  backward_dq.py   the split backward's dq kernel (per query tile, streaming K / V).
  backward_dkv.py  dk / dv (per key tile, streaming Q, dO, lse, delta; summed over the R
                   query heads of a kv head); with a dq buffer it is the fused backward
                   (dq by TMA reduce-add, 5 matmuls per block pair instead of the split's 7).
  schedules.py     per-CTA block lists from segment ids / positions (empty blocks skipped).
  common.py        config, wgmma helpers, the producer loop, masks.

bwd="fused" is the default at head dim 128, "split" at 64. delta = rowsum(dO * O) - dlse is
plain jnp. Padding: T and S are padded to the tiles; padded keys are masked by index where
they could matter, padded query rows (dO = 0, delta = 0) add nothing and are sliced off.

Off a GPU the kernels run in Pallas's GPU interpret mode (`plgpu.InterpretGPUParams`:
warpgroups as threads; SMEM, TMA, barriers and wgmma simulated; race detection). It takes
wgmma operands only from SMEM, does not interpret `pl.run_state` and has no TMA reduction,
so there register operands are staged through SMEM (`common.mma_acc`) and the fused
backward stores per-kv-tile dq partials summed afterwards; the rest is the compiled code.
WORKSPACE_NOTES.md ("Kernels") holds the design notes: orderings, block skipping, what the
interpreter cannot check.

Letters: B batch, T query length, S key length, H query heads, G key/value heads
(H = G * R), K head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.flash_attention_mgpu.backward_dkv import dkv
from kernels.flash_attention_mgpu.backward_dq import dq as dq_kernel
from kernels.flash_attention_mgpu.common import (DTYPES, EMPTY, FULL, HEAD_DIMS, LN2, PARTIAL,
                                                 Config, interpret_params, supports)
from kernels.flash_attention_mgpu.forward import forward
from kernels.flash_attention_mgpu.schedules import (classify_blocks, schedule_from_classes,
                                                    schedules)
from kernels.flash_attention_reference import check_shapes, default_positions, pad_axis, round_up


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  return _flash_fwd(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0]


def _flash_fwd(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  sched, _, _ = schedules(cfg, q_seg, kv_seg, q_pos, kv_pos)
  out, lse2 = forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, sched)
  # Names for remat policies (llm/remat.py): saving them keeps a rematerialized backward
  # from running the forward kernel again.
  out, lse2 = checkpoint_name(out, "attention_out"), checkpoint_name(lse2, "attention_stats")
  return (out, lse2 * LN2), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2)


def _flash_bwd(cfg, res, cts):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2 = res
  do, dlse = cts
  delta = jnp.einsum("bthk,bthk->bht", out.astype(jnp.float32), do.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
  delta = delta - dlse.astype(jnp.float32)
  lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)       # rows with no key: p = 0
  do = do.astype(q.dtype)
  _, sched_dq, sched_dkv = schedules(cfg, q_seg, kv_seg, q_pos, kv_pos)
  masks = (q_seg, kv_seg, q_pos, kv_pos)
  if cfg.bwd == "fused":
    def run(refs):
      dkv(cfg, q, k, v, *masks, do, lse2, delta, sched_dkv, out_refs=refs)
    dq_shape = q.shape
    if cfg.interpret is not None:   # per-kv-tile partials (backward_dkv.py)
      dq_shape = (q.shape[0], k.shape[1] // (2 * cfg.block_kv_dkv), *q.shape[1:])
    dq, dk, dv = pl.run_state(run)((jnp.zeros(dq_shape, jnp.float32), jnp.zeros_like(k),
                                    jnp.zeros_like(v)))
    if cfg.interpret is not None:
      dq = dq.sum(axis=1)
    dq = (dq * cfg.scale).astype(q.dtype)
  else:
    dq = dq_kernel(cfg, q, k, v, *masks, do, lse2, delta, sched_dq)
    dk, dv = dkv(cfg, q, k, v, *masks, do, lse2, delta, sched_dkv)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_settings(q_dtype, k_dtype, v_dtype, kd, scale, blocks, bwd, stages, stages_bwd):
  """The wrapper's settings checked; returns (scale, bwd) with their defaults filled in."""
  if not q_dtype == k_dtype == v_dtype or jnp.dtype(q_dtype) not in DTYPES:
    raise ValueError(f"flash_attention_mgpu: dtypes q {q_dtype}, k {k_dtype}, v {v_dtype}; "
                     "expected one of bfloat16, float16 for all three (fp32 runs on "
                     "kernels/flash_attention_triton.py)")
  if kd not in HEAD_DIMS:
    raise ValueError(f"flash_attention_mgpu: head dim {kd}, expected one of {HEAD_DIMS}")
  scale = float(kd ** -0.5 if scale is None else scale)
  if scale <= 0:
    raise ValueError(f"flash_attention_mgpu: scale={scale}, expected > 0 (the row max is "
                     "taken before scaling)")
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
  return scale, bwd


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
  FlashAttention-3) or None: fused at head dim 128, split otherwise. interpret: None runs
  the GPU interpreter on CPU (slow; for tests) unless the backend is a GPU; True / False /
  a plgpu.InterpretGPUParams.
  """
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  blocks = dict(block_q=block_q, block_kv=block_kv, block_q_dq=block_q_dq,
                block_kv_dq=block_kv_dq, block_q_dkv=block_q_dkv, block_kv_dkv=block_kv_dkv)
  scale, bwd = _check_settings(q_BTHK.dtype, k_BSGK.dtype, v_BSGK.dtype, kd, scale, blocks,
                               bwd, stages, stages_bwd)
  t_pad = round_up(t, math.lcm(2 * block_q, 2 * block_q_dq, block_q_dkv))
  s_pad = round_up(s, math.lcm(block_kv, block_kv_dq, 2 * block_kv_dkv))
  has_seg = q_segment_ids is not None
  has_pos = causal and (q_positions is not None or kv_positions is not None or has_seg)
  q_seg = kv_seg = q_pos = kv_pos = None
  # Padded rows repeat the last real row's segment id and position ("edge"), so block
  # min / max stay those of the real rows; padded keys are masked by index instead.
  if has_seg:
    q_seg = pad_axis(q_segment_ids.astype(jnp.int32), 1, t_pad, "edge")
    kv_seg = pad_axis(kv_segment_ids.astype(jnp.int32), 1, s_pad, "edge")
  if has_pos:
    q_pos = q_positions if q_positions is not None else default_positions(b, t)
    kv_pos = kv_positions if kv_positions is not None else default_positions(b, s)
    q_pos = pad_axis(q_pos.astype(jnp.int32), 1, t_pad, "edge")
    kv_pos = pad_axis(kv_pos.astype(jnp.int32), 1, s_pad, "edge")

  cfg = Config(causal=causal, scale=scale, stages=stages, stages_bwd=stages_bwd, bwd=bwd,
               kv_len=s if s_pad != s else None, has_seg=has_seg, has_pos=has_pos,
               interpret=interpret_params(interpret), **blocks)
  q = pad_axis(q_BTHK, 1, t_pad)
  k = pad_axis(k_BSGK, 1, s_pad)
  v = pad_axis(v_BSGK, 1, s_pad)
  out, lse_BHT = _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return out[:, :t], lse_BHT[:, :, :t].transpose(0, 2, 1)


__all__ = ["DTYPES", "EMPTY", "FULL", "HEAD_DIMS", "PARTIAL", "classify_blocks",
           "flash_attention_mgpu", "interpret_params", "plgpu", "schedule_from_classes",
           "supports"]
