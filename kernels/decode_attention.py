"""Split-key decode attention (flash-decoding): a few queries per row against a contiguous KV
cache [B, S, G, K], read in place.

    out_BTHK, lse_BTH = decode_attention(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                         q_positions=..., kv_positions=..., scale=None)

The shared signature and masking rule of `kernels.flash_attention_reference` (segment ids,
positions defaulting to arange, out 0 and lse -inf where a query sees no key), registered in
`llm.attention` as "pallas_decode"; "auto" takes it for decode steps of a bfloat16 / float16
model on a GPU (`llm.attention.choose`).

Why a kernel: a decode step's attention reads each layer's cache once and does almost no
arithmetic, so it should cost about one pass over the cache. Written in jnp
(`llm.attention.decode`'s sums) it becomes five reductions over the key axis per layer, each a
kernel of its own; on an H200 a Llama 3.2 1B decode step at batch 1 then ran ~400 kernels,
and those reductions and their elementwise neighbours, not the weight reads, took about half
its time (BENCHMARKS.md "GPU report"). Here one kernel reads K and V once, in their stored
layout, and a small jnp merge combines the splits.

Grid (B, G, splits): program (b, g, j) takes the R = H / G query heads of kv head g for all T
queries as the rows of one tile (padded to 16, what Triton's dot takes) and walks slots
[j * chunk, (j + 1) * chunk) in blocks of `block` with an online softmax in fp32 (base-2
exponentials, a finite mask value: `kernels/online_softmax.py`, as the paged kernel), writing
its normalized partial output and lse. Splitting the key axis gives the GPU B * G * splits
programs instead of B * G (8 at batch 1 for Llama 3.2 1B; an H200 has 132 multiprocessors);
`merge` then combines the
partials exactly by their lse (`llm.attention.merge_partials`' rule). Slots past S are masked
loads; the head dim must be a power of two >= 16 (the cache is not padded: that would copy it).

Numerics: the scores are q . k in the inputs' dtype with fp32 accumulation (bf16 products are
exact in fp32), the softmax in fp32, and p is cast to v's dtype before p @ v, as the flash
attention kernels and their reference do; against `flash_attention_reference` the error is
the bf16 rounding of p and the order of the fp32 sums.

Plain `pallas_call` form: the Triton lowering on a GPU, Pallas's interpreter elsewhere
(`interpret=None` picks by backend).

Letters: B batch, T queries per row, S cache slots, H query heads, G key/value heads (H = G *
R), K head dim, J splits of the key axis, Rp padded query rows (T * R).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import online_softmax as osm
from kernels.flash_attention_reference import check_shapes, default_positions, pad_axis

try:  # The Triton backend is deprecated (JAX 0.11.0); keep importing this module without it.
  from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
  pl_triton = None

# Programs to aim for when choosing the split count: about two per multiprocessor of an
# H100 / H200 (132), so that every one has a program in flight while others load.
TARGET_PROGRAMS = 264


def supports(dtype, head_dim: int) -> str | None:
  """None if the kernel takes this call's dtype and head dim, else why not."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name}: the kernel's dots take bfloat16 / float16"
  if head_dim < 16 or head_dim & (head_dim - 1) or head_dim > 256:
    return f"head dim {head_dim}: expected a power of two in [16, 256]"
  return None


def num_splits(b: int, g: int, s: int, block: int, target: int = TARGET_PROGRAMS) -> int:
  """Splits of the key axis: enough programs for `target`, at least one block per split."""
  blocks = -(-s // block)
  return max(1, min(blocks, -(-target // (b * g))))


def _load(ref, idx, ok, cols=None):
  from jax.experimental.pallas import triton as plgpu
  if cols is None:
    return plgpu.load(ref.at[idx], mask=ok, other=0)
  return plgpu.load(ref.at[idx[:, None], cols[None, :]], mask=ok[:, None], other=0)


def _kernel(q_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, k_ref, v_ref, o_ref, lse_ref, *,
            scale: float, block: int, chunk: int, s_len: int, causal: bool, segments: bool):
  """One (row, kv head, split): q [Rp, K], qpos / qseg [Rp], kpos / kseg [S], k / v [S, K]."""
  q = q_ref[...]
  qpos = qpos_ref[...]
  qseg = qseg_ref[...] if segments else None
  kd = q.shape[-1]
  cols = jnp.arange(kd)
  start = pl.program_id(2) * chunk
  qk_scale = scale * osm.LOG2E

  def body(i, carry):
    o, m, l = carry
    slots = start + i * block + jnp.arange(block)
    ok = slots < s_len
    idx = jnp.where(ok, slots, 0)
    k = _load(k_ref, idx, ok, cols)                          # [block, K]
    v = _load(v_ref, idx, ok, cols)
    s = osm.dot(q, k, trans_b=True) * qk_scale               # [Rp, block] fp32
    allowed = jnp.broadcast_to(ok[None, :], s.shape)
    if causal:
      kpos = _load(kpos_ref, idx, ok)
      allowed = allowed & (kpos[None, :] <= qpos[:, None])
    if segments:
      kseg = _load(kseg_ref, idx, ok)
      allowed = allowed & (kseg[None, :] == qseg[:, None])
    return osm.step(o, m, l, jnp.where(allowed, s, osm.MASK_VALUE), v)

  carry = lax.fori_loop(0, chunk // block, body, osm.init(q.shape[0], kd))
  o_ref[...], lse_ref[...] = osm.finish(*carry)


def merge(o_BGJRK, lse_BGJR):
  """The splits' partials (each normalized over its own keys) combined by their lse:
  (out [B,G,R,K] fp32, lse [B,G,R]); a row no split saw gets 0 and -inf."""
  m = jnp.max(lse_BGJR, axis=2, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_BGJR - m_safe)                            # 0 for an empty split
  denom = jnp.sum(w, axis=2)
  seen = denom > 0
  out = jnp.sum(w[..., None] * o_BGJRK, axis=2) / jnp.where(seen, denom, 1.0)[..., None]
  lse = jnp.where(seen, m_safe[:, :, 0] + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
  return out, lse


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block", "splits",
                                             "interpret", "num_warps", "num_stages"))
def decode_attention(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, q_segment_ids=None,
                     kv_segment_ids=None, q_positions=None, kv_positions=None,
                     scale: float | None = None, block: int = 64, splits: int | None = None,
                     interpret: bool | None = None, num_warps: int = 4, num_stages: int = 2):
  """The kernel under the shared signature; returns (out [B,T,H,K] like q, lse [B,T,H] fp32).

  block: key slots per step (a power of two >= 16); splits: of the key axis (None:
  `num_splits`); interpret: None runs Pallas's interpreter unless the backend is a GPU;
  num_warps / num_stages: Triton launch parameters."""
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  if kd < 16 or kd & (kd - 1):
    raise ValueError(f"decode_attention: head dim {kd}; expected a power of two >= 16 (the "
                     "cache is read in place, unpadded)")
  if block < 16 or block & (block - 1):
    raise ValueError(f"decode_attention: block={block}; expected a power of two >= 16")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  scale = float(kd ** -0.5 if scale is None else scale)
  r = h // g
  rows = t * r
  rows_pad = max(16, pl.next_power_of_2(rows))
  n_split = num_splits(b, g, s, block) if splits is None else int(splits)
  if n_split < 1:
    raise ValueError(f"decode_attention: splits={splits}; expected >= 1")
  blocks = -(-s // block)
  chunk = -(-blocks // n_split) * block                     # whole blocks per split
  n_split = -(-s // chunk)
  segments = q_segment_ids is not None
  # Query rows (t, r) of kv head g: [B, G, T*R, K]; padded rows see nothing (position -1
  # under the causal rule; without it they see everything and are dropped).
  q_BGRK = q_BTHK.reshape(b, t, g, r, kd).transpose(0, 2, 1, 3, 4).reshape(b, g, rows, kd)
  q_BGRK = pad_axis(q_BGRK, 2, rows_pad)
  qpos_BT = default_positions(b, t) if q_positions is None else q_positions
  kpos_BS = default_positions(b, s) if kv_positions is None else kv_positions
  qpos_BR = jnp.repeat(qpos_BT.astype(jnp.int32), r, axis=1)
  qpos_BR = jnp.where(jnp.arange(rows_pad)[None, :] < rows, pad_axis(qpos_BR, 1, rows_pad), -1)
  if segments:
    qseg_BR = pad_axis(jnp.repeat(q_segment_ids.astype(jnp.int32), r, axis=1), 1, rows_pad)
    kseg_BS = kv_segment_ids.astype(jnp.int32)
  else:                                 # zeros the kernel does not read (segments=False)
    qseg_BR = jnp.zeros((b, rows_pad), jnp.int32)
    kseg_BS = jnp.zeros((b, s), jnp.int32)
  row_spec = pl.BlockSpec((None, rows_pad), lambda bi, gi, ji: (bi, 0))
  key_spec = pl.BlockSpec((None, s), lambda bi, gi, ji: (bi, 0))
  cache_spec = pl.BlockSpec((None, s, None, kd), lambda bi, gi, ji: (bi, 0, gi, 0))
  compiler_params = (None if pl_triton is None
                     else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages))
  o, lse = pl.pallas_call(
      functools.partial(_kernel, scale=scale, block=block, chunk=chunk, s_len=s,
                        causal=causal, segments=segments),
      grid=(b, g, n_split),
      in_specs=[pl.BlockSpec((None, None, rows_pad, kd), lambda bi, gi, ji: (bi, gi, 0, 0)),
                row_spec, row_spec, key_spec, key_spec, cache_spec, cache_spec],
      out_specs=[pl.BlockSpec((None, None, None, rows_pad, kd),
                              lambda bi, gi, ji: (bi, gi, ji, 0, 0)),
                 pl.BlockSpec((None, None, None, rows_pad), lambda bi, gi, ji: (bi, gi, ji, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, g, n_split, rows_pad, kd), jnp.float32),
                 jax.ShapeDtypeStruct((b, g, n_split, rows_pad), jnp.float32)],
      compiler_params=compiler_params,
      interpret=bool(interpret),
      name="decode_attention",
  )(q_BGRK, qpos_BR, qseg_BR, kpos_BS.astype(jnp.int32), kseg_BS, k_BSGK, v_BSGK)
  out, lse = merge(o, lse)                                 # [B, G, Rp, K], [B, G, Rp]
  out = out[:, :, :rows].reshape(b, g, t, r, kd).transpose(0, 2, 1, 3, 4)
  lse = lse[:, :, :rows].reshape(b, g, t, r).transpose(0, 2, 1, 3)
  return out.reshape(b, t, h, kd).astype(q_BTHK.dtype), lse.reshape(b, t, h)


__all__ = ["decode_attention", "merge", "num_splits", "supports"]
