"""Pooled embedding-bag lookup over many tables in one launch (FBGEMM TBE, arXiv 2101.05615).

Rows of several tables live in one flat buffer `[R, D]` at static offsets, as in the
embedding collection's per-device group buffers (`rec/embedding/collection.py`) and
FBGEMM's table-batched embeddings. One Pallas GPU (Triton backend) kernel pools every bag
of every feature:

    out[m] = sum_l coef[m, l] * row(ids[m, l] (+ offsets[f(m)]))      (float32)

with mean pooling, per-id weights and padding folded into `coef` (as the collection's
`Lookup.coef` does: weight * valid / length). Positions with coef == 0 or an id outside
[0, R) read nothing: padding costs no memory traffic and never reaches a sum.

Rows may be float32, bfloat16 or FBGEMM row-wise int8 (`core.quant.RowwiseQuantized`,
dequantized in the kernel: row = q * scale + bias, folded as
sum_l (c*scale) q + sum_l c*bias so the bias costs one add per bag).

Backward: d out / d row is each id's coefficient times its bag's gradient; the kernel
`embedding_bag_id_grads` writes those per-id rows `[M * L, D]`, the form the sparse
optimizers' dedup consumes (`rec.embedding.optimizers.dedup_gradients`). `embedding_bag`
itself is differentiable (custom_vjp) in the rows (a dense scatter-add of the per-id
rows, for use outside the collection), in int8 scale / bias, and in `coef`.

GPU layout: grid (bag blocks, dim blocks); a program holds a [BM, BD] float32
accumulator and walks the L positions, each a masked gather of BM rows of BD contiguous
columns (BD a power of two, Triton's block rule; columns past D are masked). Every ref is
a whole array indexed with explicit masks, so no operand is padded or sliced around the
call. This uses Pallas' Triton backend (deprecated in favor of Mosaic GPU in jax 0.11,
still the backend whose pointer gathers suit this op); `interpret=None` runs the same
kernel through Pallas' interpreter when the default backend is the CPU.

Letters: R rows of the flat buffer, D row width, M bags (all leading dims of ids
flattened, e.g. B * F), L ids per bag, F features (the axis before L), BM / BD block sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from core import quant

Table = jax.Array | quant.RowwiseQuantized


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static launch parameters (hashable: a nondiff argument of the custom_vjp)."""

  block_bags: int | None
  block_dim: int | None
  num_warps: int
  num_stages: int
  interpret: bool


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _blocks(num_bags: int, dim: int, cfg: _Config) -> tuple[int, int]:
  bd = cfg.block_dim or min(_next_pow2(dim), 256)
  # ~4K float32 accumulator elements per program (32 registers a thread at 4 warps).
  bm = cfg.block_bags or max(1, min(128, 4096 // bd, _next_pow2(num_bags)))
  for name, v in (("block_bags", bm), ("block_dim", bd)):
    if v & (v - 1):
      raise ValueError(f"kernels/embedding_bag.py: {name}={v}, expected a power of two "
                       "(Triton block sizes)")
  return bm, bd


def _resolve_interpret(interpret: bool | None) -> bool:
  return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _split_table(table: Table):
  """(rows or codes [R, D], scale [R] | None, bias [R] | None)."""
  if isinstance(table, quant.RowwiseQuantized):
    if table.bits != 8:
      raise NotImplementedError(
          f"kernels/embedding_bag.py: RowwiseQuantized bits={table.bits}; the kernel reads "
          "int8 rows only (dequantize int4 tables, or use embedding_bag_reference)")
    return table.q, table.scale.astype(jnp.float32), table.bias.astype(jnp.float32)
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(f"kernels/embedding_bag.py: table {table.shape} {table.dtype}, expected "
                     "float rows [R, D] or a core.quant.RowwiseQuantized")
  return table, None, None


def _check_ids(ids, coef, offsets):
  if ids.ndim < 1 or ids.shape != coef.shape:
    raise ValueError(f"kernels/embedding_bag.py: ids {ids.shape} and coef {coef.shape}, "
                     "expected the same shape [..., L]")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"kernels/embedding_bag.py: ids dtype {ids.dtype}, expected integers")
  if offsets is not None and (ids.ndim < 2 or offsets.shape != ids.shape[-2:-1]):
    raise ValueError(f"kernels/embedding_bag.py: offsets {offsets.shape} for ids {ids.shape}, "
                     "expected one offset per feature [F] (F = ids.shape[-2])")


# ------------------------------------------------------------------------------ kernels


def _bag_kernel(*refs, num_rows, dim, bag_len, num_bags, num_feat, bm, bd, quantized,
                has_offsets):
  if quantized:
    q_ref, s_ref, b_ref, ids_ref, coef_ref, *rest = refs
  else:
    r_ref, ids_ref, coef_ref, *rest = refs
  off_ref = rest[0] if has_offsets else None
  o_ref = rest[-1]

  m0 = pl.program_id(0) * bm
  d0 = pl.program_id(1) * bd
  m = m0 + jnp.arange(bm, dtype=jnp.int32)
  m_ok = m < num_bags
  cols = d0 + jnp.arange(bd, dtype=jnp.int32)
  col_ok = cols < dim
  # Columns past D are masked, not clamped: min(cols, D - 1) would hide from Triton that
  # each row's columns are contiguous, and the row loads would not vectorize.
  cols = cols[None, :]
  if has_offsets:
    off = off_ref[lax.rem(jnp.minimum(m, num_bags - 1), num_feat)]

  def body(l, carry):
    acc, bsum = carry
    idx = plgpu.load(ids_ref.at[pl.ds(m0, bm), l], mask=m_ok, other=0)
    c = plgpu.load(coef_ref.at[pl.ds(m0, bm), l], mask=m_ok, other=0.0)
    if has_offsets:
      idx = idx + off
    ok = (c != 0) & (idx >= 0) & (idx < num_rows)
    idx = jnp.where(ok, idx, 0)
    mask = ok[:, None] & col_ok[None, :]
    if quantized:
      q = plgpu.load(q_ref.at[idx[:, None], cols], mask=mask, other=0)
      s = plgpu.load(s_ref.at[idx], mask=ok, other=0.0)
      b = plgpu.load(b_ref.at[idx], mask=ok, other=0.0)
      acc = acc + (c * s)[:, None] * q.astype(jnp.float32)
      bsum = bsum + c * b
    else:
      rows = plgpu.load(r_ref.at[idx[:, None], cols], mask=mask, other=0)
      acc = acc + c[:, None] * rows.astype(jnp.float32)
    return acc, bsum

  init = (jnp.zeros((bm, bd), jnp.float32), jnp.zeros((bm,), jnp.float32))
  acc, bsum = lax.fori_loop(0, bag_len, body, init)
  if quantized:
    acc = acc + bsum[:, None]
  plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(d0, bd)], acc,
              mask=m_ok[:, None] & col_ok[None, :])


def _id_grads_kernel(coef_ref, g_ref, o_ref, *, dim, bag_len, num_bags, bm, bd):
  m0 = pl.program_id(0) * bm
  d0 = pl.program_id(1) * bd
  m_ok = m0 + jnp.arange(bm, dtype=jnp.int32) < num_bags
  col_ok = d0 + jnp.arange(bd, dtype=jnp.int32) < dim
  mask = m_ok[:, None] & col_ok[None, :]
  g = plgpu.load(g_ref.at[pl.ds(m0, bm), pl.ds(d0, bd)], mask=mask, other=0.0)

  def body(l, carry):
    c = plgpu.load(coef_ref.at[pl.ds(m0, bm), l], mask=m_ok, other=0.0)
    plgpu.store(o_ref.at[pl.ds(m0, bm), l, pl.ds(d0, bd)], c[:, None] * g, mask=mask)
    return carry

  lax.fori_loop(0, bag_len, body, 0)


def _pool_call(rows, scale, bias, ids_ML, coef_ML, offsets, num_feat, cfg: _Config):
  num_rows, dim = rows.shape
  num_bags, bag_len = ids_ML.shape
  if num_bags == 0:
    return jnp.zeros((0, dim), jnp.float32)
  bm, bd = _blocks(num_bags, dim, cfg)
  quantized = scale is not None
  if rows.dtype.itemsize == 1 and 2**31 <= num_rows * dim <= 2**32 and not cfg.interpret:
    # Pallas' Triton lowering addresses a buffer of <= 2^32 bytes with int32 element
    # offsets, which overflow past 2^31 one-byte elements.
    raise NotImplementedError(
        f"kernels/embedding_bag.py: int8 buffer of {num_rows} x {dim} bytes lies in "
        "[2^31, 2^32]: split it into buffers under 2 GiB (or over 4 GiB)")
  kernel = functools.partial(
      _bag_kernel, num_rows=num_rows, dim=dim, bag_len=bag_len, num_bags=num_bags,
      num_feat=num_feat, bm=bm, bd=bd, quantized=quantized, has_offsets=offsets is not None)
  operands = [rows] + ([scale, bias] if quantized else []) + [ids_ML, coef_ML]
  if offsets is not None:
    operands.append(offsets)
  row_bytes = dim * rows.dtype.itemsize + (8 if quantized else 0)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_bags, dim), jnp.float32),
      grid=(pl.cdiv(num_bags, bm), pl.cdiv(dim, bd)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      cost_estimate=pl.CostEstimate(
          flops=2 * num_bags * bag_len * dim, transcendentals=0,
          bytes_accessed=num_bags * bag_len * (row_bytes + 8) + num_bags * dim * 4),
      interpret=cfg.interpret,
      name="embedding_bag",
  )(*operands)


def _id_grads_call(coef_ML, g_MD, cfg: _Config):
  num_bags, bag_len = coef_ML.shape
  dim = g_MD.shape[1]
  if num_bags == 0 or bag_len == 0:
    return jnp.zeros((num_bags * bag_len, dim), jnp.float32)
  bm, bd = _blocks(num_bags, dim, cfg)
  kernel = functools.partial(_id_grads_kernel, dim=dim, bag_len=bag_len, num_bags=num_bags,
                             bm=bm, bd=bd)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_bags, bag_len, dim), jnp.float32),
      grid=(pl.cdiv(num_bags, bm), pl.cdiv(dim, bd)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="embedding_bag_id_grads",
  )(coef_ML.astype(jnp.float32), g_MD.astype(jnp.float32))
  return out.reshape(num_bags * bag_len, dim)


# ----------------------------------------------------------------------- differentiable op


def _flat_ids(ids, offsets, num_rows):
  """Absolute row ids [M * L] and whether each is a row of the buffer."""
  if offsets is not None:
    ids = ids + offsets.astype(ids.dtype)[:, None]
  idx = ids.reshape(-1)
  return idx, (idx >= 0) & (idx < num_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _bag(rows, scale, bias, ids_ML, coef_ML, offsets, num_feat, cfg):
  return _pool_call(rows, scale, bias, ids_ML, coef_ML, offsets, num_feat, cfg)


def _bag_fwd(rows, scale, bias, ids_ML, coef_ML, offsets, num_feat, cfg):
  out = _pool_call(rows, scale, bias, ids_ML, coef_ML, offsets, num_feat, cfg)
  return out, (rows, scale, bias, ids_ML, coef_ML, offsets)


def _bag_bwd(num_feat, cfg, res, g_MD):
  rows, scale, bias, ids_ML, coef_ML, offsets = res
  num_rows, dim = rows.shape
  num_bags, bag_len = ids_ML.shape
  offs_M = None if offsets is None else jnp.tile(offsets, num_bags // num_feat)
  idx, ok = _flat_ids(ids_ML, offs_M, num_rows)
  safe = jnp.where(ok, idx, 0)
  id_grads = _id_grads_call(coef_ML, g_MD, cfg)                       # [M * L, D]
  # Per-position rows (dequantized) for the coefficient gradient <row, bag grad>.
  if scale is None:
    seen = rows[safe].astype(jnp.float32)
  else:
    seen = rows[safe].astype(jnp.float32) * scale[safe][:, None] + bias[safe][:, None]
  g_pos = jnp.repeat(g_MD, bag_len, axis=0) if bag_len else g_MD[:0]
  d_coef = jnp.where(ok, jnp.sum(seen * g_pos, axis=-1), 0.0).reshape(coef_ML.shape)
  drop = jnp.where(ok, idx, num_rows)
  if scale is None:
    d_rows = jnp.zeros((num_rows, dim), jnp.float32).at[drop].add(id_grads, mode="drop")
    d_rows, d_scale, d_bias = d_rows.astype(rows.dtype), None, None
  else:   # d/dscale_r = sum over ids of r of <q_r, id grad>; d/dbias_r = sum of id grad
    q_seen = rows[safe].astype(jnp.float32)
    d_scale = jnp.zeros((num_rows,), jnp.float32).at[drop].add(
        jnp.sum(q_seen * id_grads, axis=-1), mode="drop")
    d_bias = jnp.zeros((num_rows,), jnp.float32).at[drop].add(
        jnp.sum(id_grads, axis=-1), mode="drop")
    d_rows = None
  return d_rows, d_scale, d_bias, None, d_coef.astype(coef_ML.dtype), None


_bag.defvjp(_bag_fwd, _bag_bwd)


@functools.partial(jax.jit, static_argnames=("block_bags", "block_dim", "num_warps",
                                             "num_stages", "interpret"))
def embedding_bag(table: Table, ids: jax.Array, coef: jax.Array, *,
                  offsets: jax.Array | None = None, block_bags: int | None = None,
                  block_dim: int | None = None, num_warps: int = 4, num_stages: int = 2,
                  interpret: bool | None = None) -> jax.Array:
  """Pooled bags [..., D] float32 of `ids` [..., L] weighted by `coef` [..., L].

  table: float rows [R, D] (float32, bfloat16, ...) or an int8 `core.quant.RowwiseQuantized`.
  ids: rows of the flat buffer, or, with `offsets` [F], ids within feature f's table
    (f indexes ids' axis -2), shifted by offsets[f] in the kernel.
  coef: per-position coefficient (mean, weights and the padding mask folded in).
  Positions whose coef is 0 or whose id is outside [0, R) contribute nothing.
  Differentiable in the float rows, int8 scale and bias, and coef.
  """
  rows, scale, bias = _split_table(table)
  ids = jnp.asarray(ids)
  coef = jnp.asarray(coef)
  _check_ids(ids, coef, offsets)
  *lead, bag_len = ids.shape
  num_feat = ids.shape[-2] if offsets is not None else 1
  cfg = _Config(block_bags, block_dim, num_warps, num_stages, _resolve_interpret(interpret))
  out = _bag(rows, scale, bias, ids.reshape(-1, bag_len).astype(jnp.int32),
             coef.reshape(-1, bag_len).astype(jnp.float32),
             None if offsets is None else jnp.asarray(offsets, jnp.int32), num_feat, cfg)
  return out.reshape(*lead, rows.shape[1])


@functools.partial(jax.jit, static_argnames=("block_bags", "block_dim", "num_warps",
                                             "num_stages", "interpret"))
def embedding_bag_id_grads(coef: jax.Array, grad: jax.Array, *, block_bags: int | None = None,
                           block_dim: int | None = None, num_warps: int = 4,
                           num_stages: int = 2, interpret: bool | None = None) -> jax.Array:
  """Per-id row gradients [M * L, D]: coef[m, l] * grad[m] for coef [..., L], grad [..., D].

  Row m * L + l belongs to position l of bag m (leading dims flattened in order), the
  layout `rec.embedding.optimizers.dedup_gradients` takes with the flattened ids.
  """
  if coef.shape[:-1] != grad.shape[:-1]:
    raise ValueError(f"kernels/embedding_bag.py embedding_bag_id_grads: coef {coef.shape} and "
                     f"grad {grad.shape}, expected [..., L] and [..., D] with the same bags")
  bag_len, dim = coef.shape[-1], grad.shape[-1]
  cfg = _Config(block_bags, block_dim, num_warps, num_stages, _resolve_interpret(interpret))
  return _id_grads_call(coef.reshape(-1, bag_len), grad.reshape(-1, dim), cfg)


# ---------------------------------------------------------------------------- references


def embedding_bag_reference(table: Table, ids: jax.Array, coef: jax.Array, *,
                            offsets: jax.Array | None = None) -> jax.Array:
  """Pure jnp `embedding_bag` (any RowwiseQuantized width): gather, mask, weighted sum."""
  if isinstance(table, quant.RowwiseQuantized):
    num_rows = table.q.shape[0]
    deq = lambda i: quant.dequantize_rowwise(
        dataclasses.replace(table, q=table.q[i], scale=table.scale[i], bias=table.bias[i]))
  else:
    num_rows = table.shape[0]
    deq = lambda i: table[i].astype(jnp.float32)
  ids = jnp.asarray(ids)
  _check_ids(ids, coef, offsets)
  if offsets is not None:
    ids = ids + jnp.asarray(offsets, ids.dtype)[:, None]
  # coef == 0 adds 0 * row: the kernel skips the read, the sum is the same (finite rows).
  ok = (ids >= 0) & (ids < num_rows)
  flat = jnp.where(ok, ids, 0).reshape(-1)
  rows = deq(flat).reshape(*ids.shape, -1)
  return jnp.einsum("...l,...ld->...d", jnp.where(ok, coef, 0.0).astype(jnp.float32), rows,
                    precision=lax.Precision.HIGHEST)


def embedding_bag_id_grads_reference(coef: jax.Array, grad: jax.Array) -> jax.Array:
  """Pure jnp `embedding_bag_id_grads`: (coef[..., :, None] * grad[..., None, :]) flattened."""
  return (coef[..., None].astype(jnp.float32) * grad[..., None, :]).reshape(-1, grad.shape[-1])
