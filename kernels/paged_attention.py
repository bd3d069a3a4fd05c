"""Paged attention (vLLM, arXiv 2309.06180): queries of each row against a KV cache held in
fixed-size pages of a shared pool, found through the row's block table.

    out_BTHK, lse_BTH = paged_attention(q_BTHK, k_pages_GNPK, v_pages_GNPK, tables_BM,
                                        lengths_B, q_positions_BT, scale=None)

The pool is kv-head major, [G, N, P, K] (JAX's and vLLM's kernels keep one head's pages
together too): a row's gathered pages are then [G, B, S, K], whose products over the keys
are batched over (g, b) with no transpose of the keys. A row's cache is compact: the token at
position s sits in slot s, offset s % P of page tables[b, s // P]. Query t of row b sees
slot s iff s < lengths[b] and s <= q_positions[b, t] (causal by position); a query that sees
nothing gets out 0 and lse -inf, as in `kernels.flash_attention_reference`, so partial
results merge exactly by their lse.

`paged_attention_reference` is the semantics in jnp: each row's pages gathered into a
contiguous [G, B, M*P, K] view, then `attention_over_view` (fp32 softmax, p cast to v's
dtype before p @ v, as the flash attention reference). It is also what a CPU serves with
(`llm.serving.paged`, which writes a call's own keys into the view before attending).
`paged_attention` is the Pallas kernel: one program per (row, kv head) holds the R query
heads of all T queries as rows of one tile and walks the row's pages up to the last slot any
of them sees (`lax.fori_loop` with a traced bound: pages past it are never read), with an
online softmax in fp32 (base-2 exponentials, a finite mask value as in
`flash_attention_triton.py`; `kernels/online_softmax.py`). Pages are read through the block table inside the kernel, so
no gathered copy is made. It is written in plain `pallas_call` form (the Triton lowering on a
GPU, Pallas's interpreter elsewhere; `interpret=None` picks by backend). Tiles are padded to
what Triton's dot takes (rows and head dim powers of two >= 16); a page is one key tile, so
its size must be a power of two >= 16.

Letters: B batch, T queries per row, H query heads, G key/value heads (H = G * R), K head
dim, N pages in the pool, P slots per page, M pages per row (table width), S = M * P.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels import online_softmax as osm
from kernels.flash_attention_reference import NEG_INF, pad_axis

try:  # The Triton backend is deprecated (JAX 0.11.0); keep importing this module without it.
  from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
  pl_triton = None



def check_paged_shapes(q_BTHK, k_pages, v_pages, tables_BM, lengths_B, q_positions_BT):
  """Validates the signature; returns (B, T, H, G, K, N, P, M)."""
  if q_BTHK.ndim != 4 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
    raise ValueError(f"paged_attention: q {q_BTHK.shape}, k_pages {k_pages.shape}, v_pages "
                     f"{v_pages.shape}; expected q [B,T,H,K] and pages [G,N,P,K] of equal shape")
  b, t, h, kd = q_BTHK.shape
  g, n, p, kk = k_pages.shape
  if kk != kd or h % g:
    raise ValueError(f"paged_attention: q {q_BTHK.shape} vs pages {k_pages.shape}; expected "
                     "the same head dim and query heads a multiple of key/value heads")
  if tables_BM.ndim != 2 or tables_BM.shape[0] != b:
    raise ValueError(f"paged_attention: block tables {tables_BM.shape}, expected [{b}, M]")
  if lengths_B.shape != (b,) or q_positions_BT.shape != (b, t):
    raise ValueError(f"paged_attention: lengths {lengths_B.shape}, q_positions "
                     f"{q_positions_BT.shape}; expected ({b},) and ({b}, {t})")
  return b, t, h, g, kd, n, p, tables_BM.shape[1]


def gather_pages(pages_GNPK, tables_BM):
  """Each row's pages as one contiguous [G, B, M*P, K] view (slot = position)."""
  g, _, p, kd = pages_GNPK.shape
  b, m = tables_BM.shape
  return pages_GNPK[:, tables_BM].reshape(g, b, m * p, kd)


def attention_over_view(q_BTHK, k_GBSK, v_GBSK, lengths_B, q_positions_BT, *,
                        scale: float | None = None):
  """The rule over gathered views [G, B, S, K]: (out like q, lse [B,T,H] fp32)."""
  b, t, h, kd = q_BTHK.shape
  g, s = k_GBSK.shape[0], k_GBSK.shape[2]
  r = h // g
  scale = kd ** -0.5 if scale is None else scale
  q_GBQK = q_BTHK.reshape(b, t, g, r, kd).transpose(2, 0, 1, 3, 4).reshape(g, b, t * r, kd)
  logits = jnp.einsum("gbqk,gbsk->gbqs", q_GBQK, k_GBSK,
                      preferred_element_type=jnp.float32) * scale
  slot_S = jnp.arange(s, dtype=jnp.int32)
  pos_BQ = jnp.repeat(q_positions_BT.astype(jnp.int32), r, axis=1)
  mask_BQS = ((slot_S[None, None, :] <= pos_BQ[:, :, None])
              & (slot_S[None, None, :] < lengths_B.astype(jnp.int32)[:, None, None]))
  logits = jnp.where(mask_BQS[None], logits, NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m_safe)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  seen = denom > 0
  lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, denom, 1.0)), NEG_INF)
  p = p / jnp.where(seen, denom, 1.0)
  out = jnp.einsum("gbqs,gbsk->gbqk", p.astype(v_GBSK.dtype), v_GBSK,
                   preferred_element_type=jnp.float32)
  out = out.reshape(g, b, t, r, kd).transpose(1, 2, 0, 3, 4).reshape(b, t, h, kd)
  lse = lse[..., 0].reshape(g, b, t, r).transpose(1, 2, 0, 3).reshape(b, t, h)
  return out.astype(q_BTHK.dtype), lse


def paged_attention_reference(q_BTHK, k_pages, v_pages, tables_BM, lengths_B, q_positions_BT,
                              *, scale: float | None = None):
  """The semantics: the rows' gathered pages through `attention_over_view`; (out, lse)."""
  check_paged_shapes(q_BTHK, k_pages, v_pages, tables_BM, lengths_B, q_positions_BT)
  return attention_over_view(q_BTHK, gather_pages(k_pages, tables_BM),
                             gather_pages(v_pages, tables_BM), lengths_B, q_positions_BT,
                             scale=scale)


def _kernel(q_ref, limit_ref, table_ref, k_ref, v_ref, o_ref, lse_ref, *, scale: float,
            page: int):
  """One (row, kv head): q rows [Rp, Kp] (queries x heads of the group), limit [Rp] (the
  last slot each row sees, -1: none), the row's table [M], the kv head's pages [N, P, Kp]."""
  q = q_ref[...]
  limit = limit_ref[...]
  qk_scale = scale * osm.LOG2E
  n_pages = lax.div(jnp.max(limit) + page, page)      # pages up to the last slot seen

  def body(i, carry):
    o, m, l = carry
    blk = table_ref[i]
    k = k_ref[blk]                                     # [P, Kp]
    v = v_ref[blk]
    s = osm.dot(q, k, trans_b=True) * qk_scale         # [Rp, P] fp32
    slot = i * page + jnp.arange(page)
    return osm.step(o, m, l, jnp.where(slot[None, :] <= limit[:, None], s, osm.MASK_VALUE), v)

  carry = lax.fori_loop(0, n_pages, body, osm.init(*q.shape))
  out, lse_ref[...] = osm.finish(*carry)
  o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_warps", "num_stages"))
def paged_attention(q_BTHK, k_pages, v_pages, tables_BM, lengths_B, q_positions_BT, *,
                    scale: float | None = None, interpret: bool | None = None,
                    num_warps: int = 4, num_stages: int = 2):
  """Pallas paged attention; returns (out [B,T,H,K] like q, lse [B,T,H] fp32).

  interpret: None runs Pallas's interpreter unless the default backend is a GPU.
  num_warps / num_stages: Triton launch parameters."""
  b, t, h, g, kd, n, p, m = check_paged_shapes(q_BTHK, k_pages, v_pages, tables_BM, lengths_B,
                                               q_positions_BT)
  if p < 16 or p & (p - 1):            # a page is one key tile of Triton's dot
    raise ValueError(f"paged_attention: page size {p}; expected a power of two >= 16")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  scale = float(kd ** -0.5 if scale is None else scale)
  r = h // g
  rows = t * r
  rows_pad = max(16, pl.next_power_of_2(rows))
  k_pad = max(16, pl.next_power_of_2(kd))
  # Query rows (t, r) of kv head g: [B, G, T*R, K]; padded rows see nothing (limit -1).
  q_BGRK = q_BTHK.reshape(b, t, g, r, kd).transpose(0, 2, 1, 3, 4).reshape(b, g, rows, kd)
  q_BGRK = pad_axis(pad_axis(q_BGRK, 3, k_pad), 2, rows_pad)
  # The last slot each query sees; never past the table's M * P slots, which is all the
  # reference reads (a length beyond them would walk the kernel off the end of the table).
  limit_BT = jnp.minimum(jnp.minimum(q_positions_BT.astype(jnp.int32),
                                     lengths_B.astype(jnp.int32)[:, None] - 1), m * p - 1)
  limit_BR = pad_axis(jnp.repeat(jnp.maximum(limit_BT, -1), r, axis=1), 1, rows_pad)
  limit_BR = jnp.where(jnp.arange(rows_pad)[None, :] < rows, limit_BR, -1)
  kp = pad_axis(k_pages, 3, k_pad)
  vp = pad_axis(v_pages, 3, k_pad)
  q_spec = pl.BlockSpec((None, None, rows_pad, k_pad), lambda bi, gi: (bi, gi, 0, 0))
  page_spec = pl.BlockSpec((None, n, p, k_pad), lambda bi, gi: (gi, 0, 0, 0))
  compiler_params = (None if pl_triton is None
                     else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages))
  out, lse = pl.pallas_call(
      functools.partial(_kernel, scale=scale, page=p),
      grid=(b, g),
      in_specs=[q_spec,
                pl.BlockSpec((None, rows_pad), lambda bi, gi: (bi, 0)),
                pl.BlockSpec((None, m), lambda bi, gi: (bi, 0)),
                page_spec, page_spec],
      out_specs=[q_spec, pl.BlockSpec((None, None, rows_pad), lambda bi, gi: (bi, gi, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, g, rows_pad, k_pad), q_BTHK.dtype),
                 jax.ShapeDtypeStruct((b, g, rows_pad), jnp.float32)],
      compiler_params=compiler_params,
      interpret=bool(interpret),
      name="paged_attention",
  )(q_BGRK, limit_BR, tables_BM.astype(jnp.int32), kp, vp)
  out = out[:, :, :rows, :kd].reshape(b, g, t, r, kd).transpose(0, 2, 1, 3, 4)
  lse = lse[:, :, :rows].reshape(b, g, t, r).transpose(0, 2, 1, 3)
  return out.reshape(b, t, h, kd), lse.reshape(b, t, h)
