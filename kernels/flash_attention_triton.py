"""FlashAttention-2 forward and backward as Pallas kernels on the Triton lowering (arXiv 2307.08691).

    out_BTHK, lse_BTH = flash_attention_triton(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                               q_segment_ids=None, kv_segment_ids=None,
                                               q_positions=None, kv_positions=None, scale=None)

Semantics of `kernels.flash_attention_reference.flash_attention_reference`: query t may attend key s
iff the segment ids are equal (when given) and, when causal, kv_positions[s] <=
q_positions[t] (positions default to arange), so it serves as ring attention's inner block
where key positions are arbitrary. A query with no allowed key gets out 0 and lse -inf,
never NaN. fp32, bf16 or fp16 inputs; logits, softmax statistics and accumulators are fp32;
p is cast to v's dtype before p @ v. This is the path for fp32 and for GPUs before Hopper;
`kernels/flash_attention_mgpu/` is the Hopper bf16 / fp16 path.

Structure follows JAX's `jax/experimental/pallas/ops/gpu/attention.py` (itself after the
Triton fused-attention tutorial), with these changes:
  * GQA without repeating K/V: the forward and dq kernels read kv head h // R through the
    BlockSpec index map; the dk/dv kernel runs per kv head and loops over its R query
    heads, so dk and dv are summed over the group in fp32 inside the kernel.
  * Explicit positions and segment ids for q and kv. With default positions and causal
    masking, whole blocks above the diagonal are skipped; with explicit positions every
    block is visited and masked (the Mosaic GPU kernel skips blocks by their min/max).
  * Masked logits get a large finite negative value and the row max starts there, so no
    inf - inf appears; a row whose max is still that value at the end saw no key and is
    written as out 0, lse -inf. The backward kernels recompute p = exp2(s - lse) with
    lse = +inf for such rows, so p = 0 there.
  * Separate dk/dv and dq backward kernels (the FA2 / Triton tutorial split), so T and S
    may differ and the GQA sums stay in one program.
  * The gradient w.r.t. the lse output is supported (ring attention merges partials by
    lse): d lse_t / d s_ts = p_ts, so it only changes delta_t = rowsum(dO * O) - dlse_t.
  * T, S are padded up to block multiples (padded keys are masked by index, padded query
    rows are sliced off), and the head dim up to a power of two >= 16 (Triton's tl.dot
    needs power-of-two tiles of at least 16).
  * delta = rowsum(dO * O) is plain jnp (XLA fuses it), not a separate Pallas kernel.

Lowering: `pl.pallas_call` on a CUDA device lowers through the Pallas Triton backend when
the compiler params are `jax.experimental.pallas.triton.CompilerParams`; num_warps /
num_stages are passed as JAX's attention.py does. That backend is deprecated since JAX
0.11.0 (lowering emits DeprecationWarning "jax-pallas-triton"), so the kernel bodies use only
`jax.numpy` and `lax.dot_general` on refs (no `pl.dot`, removed in 0.12, and no Triton-only
primitive) and the Triton compiler params are imported defensively: the same bodies run in
Pallas's HLO interpreter on CPU. Forward tiles default to 128 x 128 and backward tiles to
64 x 64; `experiments/bench_kernels.py` measures them beside cuDNN.

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
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from kernels.flash_attention_reference import (check_shapes, default_positions, pad_axis,
                                               round_up)

try:  # The Triton backend is deprecated (JAX 0.11.0); keep importing this module without it.
  from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
  pl_triton = None

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite "minus infinity" for masked logits (JAX's DEFAULT_MASK_VALUE): masked - masked = 0
# and masked - real underflows to 0 in exp2, so the online softmax never sees inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static kernel parameters (hashable: the custom_vjp's non-differentiable argument)."""
  causal: bool
  scale: float
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  kv_len: int | None      # real S when keys were padded (padded keys masked), else None
  has_seg: bool
  has_pos: bool           # explicit positions (causal only); else iota + block skipping
  interpret: bool
  num_warps: int | None
  num_stages: int
  num_warps_bwd: int | None
  num_stages_bwd: int


def _compiler_params(num_warps, num_stages):
  if pl_triton is None:
    return None
  return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
  """2-D a @ b (optionally transposed), fp32 accumulation: what `pl.dot` did, as one
  dot_general that the Triton lowering maps to tl.dot (IEEE fp32 for fp32 inputs)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _mask(cfg: _Config, q_seg, kv_seg, q_pos, kv_pos, kv_idx):
  """[bq, bk] (or [1, bk]) bool of allowed pairs for one tile, or None if all allowed."""
  mask = None
  if cfg.has_seg:
    mask = q_seg[:, None] == kv_seg[None, :]
  if cfg.causal:
    c = kv_pos[None, :] <= q_pos[:, None]
    mask = c if mask is None else jnp.logical_and(mask, c)
  if cfg.kv_len is not None:
    c = (kv_idx < cfg.kv_len)[None, :]
    mask = c if mask is None else jnp.logical_and(mask, c)
  return mask


def _split_refs(cfg: _Config, refs):
  """(q, k, v, q_seg, kv_seg, q_pos, kv_pos, rest); absent optional refs are None."""
  q_ref, k_ref, v_ref, *refs = refs
  q_seg = kv_seg = q_pos = kv_pos = None
  if cfg.has_seg:
    q_seg, kv_seg, *refs = refs
  if cfg.has_pos:
    q_pos, kv_pos, *refs = refs
  return q_ref, k_ref, v_ref, q_seg, kv_seg, q_pos, kv_pos, refs


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, cfg: _Config, num_k_blocks: int):
  """One (q block, batch, head): online softmax over key blocks; writes o and lse (base 2)."""
  q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, qpos_ref, kvpos_ref, (o_ref, lse_ref) = (
      _split_refs(cfg, refs))
  bq, bk = cfg.block_q, cfg.block_k
  i = pl.program_id(0)
  q = q_ref[...]
  q_idx = i * bq + jnp.arange(bq)
  q_seg = qseg_ref[...] if cfg.has_seg else None
  q_pos = qpos_ref[...] if cfg.has_pos else q_idx
  qk_scale = cfg.scale * LOG2E    # exp2 domain: e^x = 2^(x log2 e)

  def body(j, carry):
    o, m, l = carry
    ks = pl.ds(j * bk, bk)
    k = k_ref[ks, :]
    s = _dot(q, k, trans_b=True) * qk_scale                    # [bq, bk] fp32
    kv_idx = j * bk + jnp.arange(bk)
    mask = _mask(cfg, q_seg, kvseg_ref[ks] if cfg.has_seg else None, q_pos,
                 kvpos_ref[ks] if cfg.has_pos else kv_idx, kv_idx)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=-1))
    corr = jnp.exp2(m - m_next)
    # Rows with every key so far masked have m_next = MASK_VALUE and p = 1: harmless, the
    # first real key sets corr = 0 and wipes them; rows that never see one are fixed below.
    p = jnp.exp2(s - m_next[:, None])
    l = corr * l + jnp.sum(p, axis=-1)
    v = v_ref[ks, :]
    o = corr[:, None] * o + _dot(p.astype(v.dtype), v)
    return o, m_next, l

  o = jnp.zeros(q.shape, jnp.float32)
  m = jnp.full((bq,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((bq,), jnp.float32)
  if cfg.causal and not cfg.has_pos:
    # Keys after the block's last query position are all masked: skip those blocks.
    hi = jnp.minimum(lax.div(bq * (i + 1) + bk - 1, bk), num_k_blocks)
  else:
    hi = num_k_blocks
  o, m, l = lax.fori_loop(0, hi, body, (o, m, l))

  valid = m > 0.5 * MASK_VALUE                   # saw at least one allowed key
  l = jnp.where(valid, l, 1.0)
  o_ref[...] = jnp.where(valid[:, None], o / l[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(valid, m + jnp.log2(l), -jnp.inf)


def _mask_inputs(cfg: _Config, q_seg, kv_seg, q_pos, kv_pos, q_row, kv_row):
  """The optional segment-id and position operands and their BlockSpecs, in kernel order."""
  args, specs = [], []
  if cfg.has_seg:
    args += [q_seg, kv_seg]
    specs += [q_row, kv_row]
  if cfg.has_pos:
    args += [q_pos, kv_pos]
    specs += [q_row, kv_row]
  return args, specs


def _forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  """Padded inputs -> (out [B,Tp,H,Kp], lse2 [B,H,Tp] fp32 in base 2, -inf if no key)."""
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  r = h // g
  bq, bk = cfg.block_q, cfg.block_k
  q_spec = pl.BlockSpec((None, bq, None, kd), lambda i, bi, hi: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, s, None, kd), lambda i, bi, hi: (bi, 0, hi // r, 0))
  q_row = pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i))
  kv_row = pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
  mask_args, mask_specs = _mask_inputs(cfg, q_seg, kv_seg, q_pos, kv_pos, q_row, kv_row)
  args, specs = [q, k, v, *mask_args], [q_spec, kv_spec, kv_spec, *mask_specs]
  num_warps = cfg.num_warps if cfg.num_warps is not None else (4 if kd <= 64 else 8)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, num_k_blocks=s // bk),
      grid=(t // bq, b, h),
      in_specs=specs,
      out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
      compiler_params=_compiler_params(num_warps, cfg.num_stages),
      interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(*args)


# ---------------------------------------------------------------------------- backward


def _dkdv_kernel(*refs, cfg: _Config, num_q_blocks: int, group: int):
  """One (key block, batch, kv head): dk, dv summed over the R query heads and all q blocks."""
  (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, qpos_ref, kvpos_ref,
   (do_ref, lse_ref, delta_ref, dk_ref, dv_ref)) = _split_refs(cfg, refs)
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  j = pl.program_id(0)
  k = k_ref[...]
  v = v_ref[...]
  kv_idx = j * bk + jnp.arange(bk)
  kv_seg = kvseg_ref[...] if cfg.has_seg else None
  kv_pos = kvpos_ref[...] if cfg.has_pos else kv_idx
  qk_scale = cfg.scale * LOG2E

  def q_body(i, carry, r):
    dk, dv = carry
    qs = pl.ds(i * bq, bq)
    q = q_ref[qs, r, :]                                            # [bq, Kp]
    do = do_ref[qs, r, :]
    s = _dot(q, k, trans_b=True) * qk_scale
    q_idx = i * bq + jnp.arange(bq)
    mask = _mask(cfg, qseg_ref[qs] if cfg.has_seg else None, kv_seg,
                 qpos_ref[qs] if cfg.has_pos else q_idx, kv_pos, kv_idx)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.exp2(s - lse_ref[r, qs][:, None])                     # lse = +inf: no key
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta_ref[r, qs][:, None])
    dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  if cfg.causal and not cfg.has_pos:
    lo = lax.div(j * bk, bq)       # earlier q blocks end before this key block starts
  else:
    lo = 0

  def head_body(r, carry):
    return lax.fori_loop(lo, num_q_blocks, functools.partial(q_body, r=r), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, cfg: _Config, num_k_blocks: int):
  """One (q block, batch, head): dq over all key blocks."""
  (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, qpos_ref, kvpos_ref,
   (do_ref, lse_ref, delta_ref, dq_ref)) = _split_refs(cfg, refs)
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  i = pl.program_id(0)
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_idx = i * bq + jnp.arange(bq)
  q_seg = qseg_ref[...] if cfg.has_seg else None
  q_pos = qpos_ref[...] if cfg.has_pos else q_idx
  qk_scale = cfg.scale * LOG2E

  def body(j, dq):
    ks = pl.ds(j * bk, bk)
    k = k_ref[ks, :]
    v = v_ref[ks, :]
    s = _dot(q, k, trans_b=True) * qk_scale
    kv_idx = j * bk + jnp.arange(bk)
    mask = _mask(cfg, q_seg, kvseg_ref[ks] if cfg.has_seg else None, q_pos,
                 kvpos_ref[ks] if cfg.has_pos else kv_idx, kv_idx)
    if mask is not None:
      s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.exp2(s - lse[:, None])
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  if cfg.causal and not cfg.has_pos:
    hi = jnp.minimum(lax.div(bq * (i + 1) + bk - 1, bk), num_k_blocks)
  else:
    hi = num_k_blocks
  dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _backward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do, lse2, delta):
  """Padded inputs, lse2 [B,H,Tp] base 2 (+inf for rows with no key), delta [B,H,Tp]."""
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  r = h // g
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  num_warps = cfg.num_warps_bwd
  if num_warps is None:
    num_warps = 4 if bq * bk < 128 * 128 else 8
  params = _compiler_params(num_warps, cfg.num_stages_bwd)

  # dk, dv: grid over (key blocks, batch, kv heads); q, dO, lse, delta of the R heads whole.
  kv_blk = pl.BlockSpec((None, bk, None, kd), lambda j, bi, gi: (bi, j, gi, 0))
  q_grp = pl.BlockSpec((None, t, r, kd), lambda j, bi, gi: (bi, 0, gi, 0))
  stat_grp = pl.BlockSpec((None, r, t), lambda j, bi, gi: (bi, gi, 0))
  q_row = pl.BlockSpec((None, t), lambda j, bi, gi: (bi, 0))
  kv_row = pl.BlockSpec((None, bk), lambda j, bi, gi: (bi, j))
  mask_args, mask_specs = _mask_inputs(cfg, q_seg, kv_seg, q_pos, kv_pos, q_row, kv_row)
  args, specs = [q, k, v, *mask_args], [q_grp, kv_blk, kv_blk, *mask_specs]
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, cfg=cfg, num_q_blocks=t // bq, group=r),
      grid=(s // bk, b, g),
      in_specs=specs + [q_grp, stat_grp, stat_grp],
      out_specs=[kv_blk, kv_blk],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params,
      interpret=cfg.interpret,
      name="flash_attention_dkdv",
  )(*args, do, lse2, delta)

  # dq: grid over (q blocks, batch, heads), like the forward.
  q_blk = pl.BlockSpec((None, bq, None, kd), lambda i, bi, hi: (bi, i, hi, 0))
  kv_all = pl.BlockSpec((None, s, None, kd), lambda i, bi, hi: (bi, 0, hi // r, 0))
  stat_blk = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))
  q_row = pl.BlockSpec((None, bq), lambda i, bi, hi: (bi, i))
  kv_row = pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
  _, mask_specs = _mask_inputs(cfg, q_seg, kv_seg, q_pos, kv_pos, q_row, kv_row)
  specs = [q_blk, kv_all, kv_all, *mask_specs]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, num_k_blocks=s // bk),
      grid=(t // bq, b, h),
      in_specs=specs + [q_blk, stat_blk, stat_blk],
      out_specs=q_blk,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params,
      interpret=cfg.interpret,
      name="flash_attention_dq",
  )(*args, do, lse2, delta)
  return dq, dk, dv


# ------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  out, lse2 = _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return out, lse2 * LN2


def _flash_fwd(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  out, lse2 = _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  # Names for remat policies (llm/remat.py): saving them keeps a rematerialized backward
  # from running the forward kernel again.
  out, lse2 = checkpoint_name(out, "attention_out"), checkpoint_name(lse2, "attention_stats")
  return (out, lse2 * LN2), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2)


def _flash_bwd(cfg, res, cts):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2 = res
  do, dlse = cts
  # d out_t / d s_ts and d lse_t / d s_ts = p_ts give ds = p * (dp - delta + dlse).
  delta = jnp.einsum("bthk,bthk->bht", out.astype(jnp.float32), do.astype(jnp.float32))
  delta = delta - dlse.astype(jnp.float32)
  lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)       # rows with no key: p = 0
  dq, dk, dv = _backward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, do.astype(q.dtype),
                         lse2, delta)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=(
    "causal", "scale", "block_q", "block_k", "block_q_bwd", "block_k_bwd", "interpret",
    "num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd"))
def flash_attention_triton(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True,
                           q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                           kv_positions=None, scale: float | None = None,
                           block_q: int = 128, block_k: int = 128,
                           block_q_bwd: int | None = None, block_k_bwd: int | None = None,
                           interpret: bool | None = None, num_warps: int | None = None,
                           num_stages: int = 2, num_warps_bwd: int | None = None,
                           num_stages_bwd: int = 2):
  """Pallas FlashAttention-2; returns (out [B,T,H,K] like q, lse [B,T,H] fp32).

  block_q / block_k: forward tiles (powers of two; clipped to the padded lengths).
  block_q_bwd / block_k_bwd: backward tiles (powers of two), default min(block, 64),
  clipped to the forward tiles. interpret: None runs Pallas's interpreter unless the
  default backend is a GPU. num_warps / num_stages: Triton launch parameters (None: JAX's
  heuristics). Gradients flow to q, k, v from both out and lse.
  """
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  if not q_BTHK.dtype == k_BSGK.dtype == v_BSGK.dtype:
    raise ValueError(f"flash_attention_triton: dtypes q {q_BTHK.dtype}, k {k_BSGK.dtype}, "
                     f"v {v_BSGK.dtype}; expected one dtype (bf16 or fp32)")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  scale = float(kd ** -0.5 if scale is None else scale)
  for name, blk in (("block_q", block_q), ("block_k", block_k),
                    ("block_q_bwd", block_q_bwd), ("block_k_bwd", block_k_bwd)):
    if blk is not None and (blk < 1 or blk & (blk - 1)):
      raise ValueError(f"flash_attention_triton: {name}={blk}, expected a power of two")
  # Tiles no longer than the (power-of-two rounded) sequence, so short inputs pad little.
  block_q = min(block_q, max(16, pl.next_power_of_2(t)))
  block_k = min(block_k, max(16, pl.next_power_of_2(s)))
  block_q_bwd = min(block_q, 64) if block_q_bwd is None else min(block_q_bwd, block_q)
  block_k_bwd = min(block_k, 64) if block_k_bwd is None else min(block_k_bwd, block_k)
  t_pad, s_pad = round_up(t, block_q), round_up(s, block_k)
  k_pad = max(16, pl.next_power_of_2(kd))

  has_seg = q_segment_ids is not None
  has_pos = causal and (q_positions is not None or kv_positions is not None)
  q_seg = kv_seg = q_pos = kv_pos = None
  if has_seg:
    q_seg = pad_axis(q_segment_ids.astype(jnp.int32), 1, t_pad)
    kv_seg = pad_axis(kv_segment_ids.astype(jnp.int32), 1, s_pad)
  if has_pos:
    q_pos = q_positions if q_positions is not None else default_positions(b, t)
    kv_pos = kv_positions if kv_positions is not None else default_positions(b, s)
    q_pos = pad_axis(q_pos.astype(jnp.int32), 1, t_pad)
    kv_pos = pad_axis(kv_pos.astype(jnp.int32), 1, s_pad)

  cfg = _Config(causal=causal, scale=scale, block_q=block_q, block_k=block_k,
                block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd,
                kv_len=s if s_pad != s else None, has_seg=has_seg, has_pos=has_pos,
                interpret=bool(interpret), num_warps=num_warps, num_stages=num_stages,
                num_warps_bwd=num_warps_bwd, num_stages_bwd=num_stages_bwd)
  q = pad_axis(pad_axis(q_BTHK, 3, k_pad), 1, t_pad)
  k = pad_axis(pad_axis(k_BSGK, 3, k_pad), 1, s_pad)
  v = pad_axis(pad_axis(v_BSGK, 3, k_pad), 1, s_pad)
  out, lse_BHT = _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return out[:, :t, :, :kd], lse_BHT[:, :, :t].transpose(0, 2, 1)

