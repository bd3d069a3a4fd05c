"""Pooled embedding-bag lookup over many tables in one launch (FBGEMM TBE, arXiv 2101.05615).

Rows of several tables live in one flat buffer `[R, D]` at static offsets, as in the
embedding collection's per-device group buffers (`rec/embedding/collection.py`) and
FBGEMM's table-batched embeddings. One Pallas GPU kernel pools every bag of every feature:

    out[m] = sum_l coef[m, l] * row(ids[m, l] (+ offsets[f(m)]))      (float32)

with mean pooling, per-id weights and padding folded into `coef` (as the collection's
`Lookup.coef` does: weight * valid / length). Positions with coef == 0 or an id outside
[0, R) read nothing: padding costs no memory traffic and never reaches a sum.

Row formats:
- float rows [R, D] (float32, bfloat16, ...);
- `core.quant.RowwiseQuantized` int8 (FBGEMM row-wise: uint8 codes [R, D], float32 scale
  and bias [R] in separate arrays);
- `PackedInt8Rows` (`pack_int8`, `kernels/packed_int8.py`): the same codes with each row's
  scale and bias stored inline after its codes, FBGEMM's fused row, padded to 16 bytes
  (FBGEMM's row_alignment) and held as 32-bit words [R, W]. This is the fast int8 layout:
  one 16-byte-aligned vector read per row fetches codes and scale / bias together, where
  the split layout makes every row three random reads (codes, scale, bias; 32-byte sectors
  each).
- `core.quant.RowwiseQuantized` N-bit (FBGEMM's SBHalf: int4 / int2 / int8 codes packed
  low bits first [R, ceil(D * bits / 8)], float16 scale and bias [R]): column c is read
  from byte c div (8 / bits), shifted down by (c mod (8 / bits)) * bits (two columns of an
  int4 row share a byte load), the scale and bias converted to float32 in the kernel.
int8 and N-bit rows are dequantized in the kernel: row = q * scale + bias, folded as
sum_l (c * scale) q + sum_l c * bias so the bias costs one add per bag.

Mixed-precision tables with a cache (arXiv 2010.11305, `rec/embedding/rowwise_storage.py`):
`cache_rows` [C, D] float32 and `cache_slots` [..., L] (ids' shape; -1 = not cached) make
a position with a slot read its float32 cache row instead of the table row, each position
reading exactly one of the two (masked loads), for float, split int8 and N-bit tables.

Why the int8 path was slow, and what the kernel does about it. The previous kernel read
one position of BM bags per loop step (load BM ids, then BM rows, then accumulate): at
most BM rows in flight per program, and since every step waits on its rows, the time per
(bag, position) was about the same for every dtype (H100, 26 x 500K rows: 4.0G
positions/s for fp32, 6.5G bf16, 4.3G int8), so int8 moved 4x fewer bytes per second than
fp32 (28% of copy bandwidth against 83%) and paid two extra random 32-byte reads per row
for its scale and bias. The Triton compiler does not software-pipeline this loop (its
loads are data-dependent gathers, not the dot-feeding loads it pipelines; checked in the
TTGIR that triton 3.9 produces for sm_90: no async copies in the loop). So the kernel:
  1. issues `unroll` positions' row gathers before it accumulates any of them (rows in
     flight per program = BM * unroll), sized by default to ~16 KB in flight per program
     whatever the row width (fp32 D=128: unroll 1, bf16: 2, int8: 4);
  2. reads packed int8 rows as 16-byte vectors of words, scale and bias with them (one
     8-byte vector), and unpacks the four codes of a word with shifts: byte -> float by
     or-ing it into the mantissa of 2^23 and subtracting 2^23 (exact; full-rate integer
     and FP32 ops instead of quarter-rate int-to-float conversions), into four
     accumulators (columns 4j + k) that are interleaved once per program at the store.

64-bit addressing / size limits: Pallas' Triton lowering addresses an operand with 32-bit
element offsets when it is at most 2^32 bytes, else 64-bit. 32-bit offsets overflow only
for 1-byte elements between 2^31 and 2^32 bytes (a uint8 code buffer of 2-4 GiB, e.g.
26 x 1M x 128 int8). Packed rows are 4-byte words and never hit that; a split-layout code
buffer in that range is cut into pieces of at most 2^31 - 1 elements (a copy per call:
keep big int8 tables packed), each addressed with 32-bit offsets, and each row is read
from the piece that holds it (`_I32_MAX_ELEMENTS` is the limit; the tests lower it to
exercise the pieces on small tables).

Backward: d out / d row is each id's coefficient times its bag's gradient; the kernel
`embedding_bag_id_grads` writes those per-id rows `[M * L, D]`, the form the sparse
optimizers' dedup consumes (`rec.embedding.optimizers.dedup_gradients`). `embedding_bag`
itself is differentiable (custom_vjp) in float rows (a dense scatter-add of the per-id
rows, for use outside the collection), in int8 and N-bit scale / bias, and in `coef` (packed
rows are integer words: differentiable in `coef` only).

GPU layout: grid (bag blocks, column blocks); a program holds a [BM, BD] float32
accumulator (packed int8: four [BM, BD / 4]) and walks the L positions `unroll` at a
time, each a masked gather of BM rows of BD contiguous columns (BD a power of two,
Triton's block rule; columns past D are masked). Every ref is a whole array indexed with
explicit masks, so no operand is padded or sliced around the call.

Lowering: Pallas' Triton backend (deprecated in favour of Mosaic GPU since jax 0.11, still
present in 0.12). Mosaic GPU was considered and not chosen for this op: its memory model
is rectangular blocks moved by TMA / async copies into shared memory and warpgroup-wide
register layouts, and Hopper's TMA cannot gather rows at arbitrary indices (Blackwell's
TMA gather4 can); an embedding bag is per-thread random row reads with per-lane masks,
which is what Triton's pointer tensors express directly, and the op has no matmul for
Mosaic's wgmma path to speed up. `interpret=None` runs the same kernel through Pallas'
interpreter when the default backend is the CPU.

Letters: R rows of the flat buffer, D row width, W words of a packed row, M bags (all
leading dims of ids flattened, e.g. B * F), L ids per bag, F features (the axis before L),
BM / BD block sizes, U positions in flight (`unroll`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from core import quant
# The packed int8 row format (pack_int8 included) is also this module's.
from kernels.packed_int8 import PackedInt8Rows, pack_int8, packed_words_per_row, unpack_int8

_MAGIC = 0x4B000000             # float32 bits of 2^23: (byte | _MAGIC) as float = 2^23 + byte
_TWO23 = 8388608.0
# Largest element count an operand addressed with 32-bit offsets may have (Pallas' Triton
# lowering switches to 64-bit offsets only above 2^32 bytes). Module-level so tests can
# lower it and run the pieces path on small tables.
_I32_MAX_ELEMENTS = 2**31 - 1
_I32_MAX_BYTES = 2**32
# Bytes of rows each program keeps in flight (the default unroll).
_BYTES_IN_FLIGHT = 16384


Table = jax.Array | quant.RowwiseQuantized | PackedInt8Rows


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static launch parameters (hashable: a nondiff argument of the custom_vjp)."""

  layout: str                   # "float" | "split8" | "nbit" | "packed8"
  dim: int                      # D (columns of the pooled rows)
  block_bags: int | None
  block_dim: int | None
  unroll: int | None
  num_warps: int
  num_stages: int
  interpret: bool
  bits: int = 8                 # N-bit codes ("nbit")
  cached: bool = False          # cache rows and per-position slots given


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _check_pow2(name: str, v: int) -> None:
  if v < 1 or v & (v - 1):
    raise ValueError(f"kernels/embedding_bag.py: {name}={v}, expected a power of two "
                     "(Triton block sizes)")


def _units(cfg: _Config) -> int:
  """Column units of a row the grid tiles: columns, or code words for packed rows."""
  return -(-cfg.dim // 4) if cfg.layout == "packed8" else cfg.dim


def _blocks(num_bags: int, bag_len: int, row_itemsize: int, cfg: _Config) -> tuple[int, int, int]:
  """(BM bags, BW column units, U positions in flight) of one program."""
  per_unit = 4 if cfg.layout == "packed8" else 1          # columns per unit
  if cfg.block_dim is not None:
    _check_pow2("block_dim", cfg.block_dim)
    if cfg.block_dim % per_unit:
      raise ValueError(f"kernels/embedding_bag.py: block_dim={cfg.block_dim}, expected a "
                       "multiple of 4 for packed int8 rows (4 codes per word)")
    bw = cfg.block_dim // per_unit
  else:
    bw = min(_next_pow2(_units(cfg)), 256 // per_unit)
  cols = bw * per_unit
  # ~4K float32 accumulator elements per program (32 registers a thread at 4 warps).
  bm = cfg.block_bags or max(1, min(128, 4096 // cols, _next_pow2(num_bags)))
  _check_pow2("block_bags", bm)
  if cfg.unroll is not None:
    _check_pow2("unroll", cfg.unroll)
    u = cfg.unroll
  else:
    row_bytes = {"packed8": 4 * bw + 8, "nbit": bw * cfg.bits // 8 + 4}.get(
        cfg.layout, bw * row_itemsize)
    # The power of two nearest to the rows that make _BYTES_IN_FLIGHT, at most 8.
    u = max(1, min(8, round(_BYTES_IN_FLIGHT / max(1, bm * row_bytes))))
    u = 1 << max(0, round(math.log2(u)))
  return bm, bw, max(1, min(u, _next_pow2(bag_len)))


def _resolve_interpret(interpret: bool | None) -> bool:
  return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _split_table(table: Table):
  """(layout, rows or codes or words, scale | None, bias | None, D)."""
  if isinstance(table, PackedInt8Rows):
    if table.words.ndim != 2 or table.words.dtype != jnp.int32 \
        or table.words.shape[1] != packed_words_per_row(table.dim):
      raise ValueError(f"kernels/embedding_bag.py: PackedInt8Rows words {table.words.shape} "
                       f"{table.words.dtype} for dim {table.dim}, expected int32 "
                       f"[R, {packed_words_per_row(table.dim)}] (use pack_int8)")
    return "packed8", table.words, None, None, table.dim
  if isinstance(table, quant.RowwiseQuantized):
    # SBHalf (float16 scale and bias): N-bit codes packed low bits first; otherwise FBGEMM's
    # 8-bit SBFloat, one code per column (int4 / int2 codes come only with float16 scales).
    if not table.half and table.bits != 8:
      raise ValueError(f"kernels/embedding_bag.py: int{table.bits} codes with "
                       f"{table.scale.dtype} scale and bias, expected float16 (FBGEMM SBHalf; "
                       "core.quant.quantize_rowwise_nbit) or 8 bits")
    width = quant.packed_width(table.dim, table.bits) if table.half else table.dim
    num_rows = table.q.shape[0] if table.q.ndim == 2 else -1
    if (table.q.ndim != 2 or table.q.shape[1] != width
        or table.scale.shape != (num_rows,) or table.bias.shape != (num_rows,)):
      raise ValueError(f"kernels/embedding_bag.py: int{table.bits} codes {table.q.shape}, scale "
                       f"{table.scale.shape}, bias {table.bias.shape} for dim {table.dim}, "
                       f"expected [R, {width}], [R] and [R]")
    if table.half:   # N-bit SBHalf: float16 scale and bias, converted in the kernel
      return "nbit", table.q, table.scale, table.bias, table.dim
    return ("split8", table.q, table.scale.astype(jnp.float32), table.bias.astype(jnp.float32),
            table.dim)
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(f"kernels/embedding_bag.py: table {table.shape} {table.dtype}, expected "
                     "float rows [R, D], a core.quant.RowwiseQuantized or a PackedInt8Rows")
  return "float", table, None, None, table.shape[1]


def _check_ids(ids, coef, offsets):
  if ids.ndim < 1 or ids.shape != coef.shape:
    raise ValueError(f"kernels/embedding_bag.py: ids {ids.shape} and coef {coef.shape}, "
                     "expected the same shape [..., L]")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"kernels/embedding_bag.py: ids dtype {ids.dtype}, expected integers")
  if offsets is not None and (ids.ndim < 2 or offsets.shape != ids.shape[-2:-1]):
    raise ValueError(f"kernels/embedding_bag.py: offsets {offsets.shape} for ids {ids.shape}, "
                     "expected one offset per feature [F] (F = ids.shape[-2])")


def _pieces(rows) -> tuple[tuple[jax.Array, ...], tuple[int, ...]]:
  """Row ranges of `rows` that are each addressable with 32-bit offsets, and their starts
  (plus the end). One piece, the array itself, unless its element count overflows int32
  while its size keeps Pallas on 32-bit offsets (1-byte elements of 2-4 GiB)."""
  num_rows, width = rows.shape
  size = num_rows * width
  if size <= _I32_MAX_ELEMENTS or size * rows.dtype.itemsize > _I32_MAX_BYTES:
    return (rows,), (0, num_rows)
  per = max(1, _I32_MAX_ELEMENTS // max(1, width))
  starts = tuple(range(0, num_rows, per)) + (num_rows,)
  return tuple(rows[a:b] for a, b in zip(starts[:-1], starts[1:])), starts


# ------------------------------------------------------------------------------ kernels


def _gather(refs, starts, idx, ok, cols, col_ok):
  """Masked gather [BM, BW] of rows `idx` (columns `cols`) from row pieces `refs`."""
  mask = ok[:, None] & col_ok[None, :]
  if len(refs) == 1:
    return plgpu.load(refs[0].at[idx[:, None], cols[None, :]], mask=mask, other=0)
  out = None
  for ref, lo, hi in zip(refs, starts[:-1], starts[1:]):
    here = ok & (idx >= lo) & (idx < hi)
    x = plgpu.load(ref.at[jnp.where(here, idx - lo, 0)[:, None], cols[None, :]],
                   mask=here[:, None] & col_ok[None, :], other=0)
    out = x if out is None else jnp.where(here[:, None], x, out)
  return out


def _unpack_codes(words):
  """The four code planes of int32 words [BM, BW] as float32: plane k = byte k."""
  planes = []
  for k in range(4):
    byte = lax.shift_right_logical(words, jnp.int32(8 * k)) if k else words
    if k < 3:
      byte = byte & jnp.int32(0xFF)
    planes.append(lax.bitcast_convert_type(byte | jnp.int32(_MAGIC), jnp.float32) - _TWO23)
  return planes


def _interleave4(planes):
  """[BM, BW] x 4 -> [BM, 4 * BW] with column 4j + k = planes[k][:, j] (tt.join + reshape)."""
  bm, bw = planes[0].shape
  pair = lambda a, b: jnp.stack([a, b], axis=-1)
  return pair(pair(planes[0], planes[2]), pair(planes[1], planes[3])).reshape(bm, 4 * bw)


def _columns(x_BU):
  """The U columns [BM] of a [BM, U] tile (U a power of two), by halving with tt.split."""
  bm, u = x_BU.shape
  if u == 1:
    return [x_BU.reshape(bm)]
  even, odd = lax.unstack(x_BU.reshape(bm, u // 2, 2), axis=-1)
  return [c for pair in zip(_columns(even), _columns(odd)) for c in pair]


def _fetch(layout, data, starts, bits, units, cols, col_ok, idx, ok):
  """One position's reads for BM bags at rows `idx` (`ok`: read at all): (rows,) for float
  rows, (codes or rows, scale, bias) for split int8 and N-bit, (code words, scale / bias
  words) for packed int8."""
  n_pieces = len(starts) - 1
  pieces = data[:n_pieces] if layout != "packed8" else data
  if layout == "packed8":
    (w_ref,) = pieces
    codes = plgpu.load(w_ref.at[idx[:, None], cols[None, :]],
                       mask=ok[:, None] & col_ok[None, :], other=0)
    sb_cols = jnp.arange(2, dtype=jnp.int32) + units
    sb = plgpu.load(w_ref.at[idx[:, None], sb_cols[None, :]], mask=ok[:, None], other=0)
    return codes, sb
  if layout == "nbit":
    per = 8 // bits
    byte = _gather(pieces, starts, idx, ok, cols // per, col_ok).astype(jnp.int32)
    shift = ((cols % per) * bits)[None, :]
    codes = lax.shift_right_logical(byte, shift) & jnp.int32((1 << bits) - 1)
    s_ref, b_ref = data[n_pieces:]
    return (codes.astype(jnp.float32),
            plgpu.load(s_ref.at[idx], mask=ok, other=0.0).astype(jnp.float32),
            plgpu.load(b_ref.at[idx], mask=ok, other=0.0).astype(jnp.float32))
  rows = _gather(pieces, starts, idx, ok, cols, col_ok)
  if layout == "split8":
    s_ref, b_ref = data[n_pieces:]
    return rows, plgpu.load(s_ref.at[idx], mask=ok, other=0.0), plgpu.load(
        b_ref.at[idx], mask=ok, other=0.0)
  return (rows,)


def _accumulate(layout, cached, acc, c, got):
  """`acc` plus coefficient `c` [BM] times the rows `_fetch` read (`got`), dequantized."""
  # The bias term c * b is added to every column here rather than summed per bag and
  # added at the end: a separate [BM] carry gets a Triton layout of its own, and every
  # id, coef and scale / bias load is then issued once more in that layout.
  if layout == "packed8":
    codes, sb = got
    s, b = lax.unstack(lax.bitcast_convert_type(sb, jnp.float32), axis=-1)
    cs, cb = (c * s)[:, None], (c * b)[:, None]
    return tuple(a + (cs * p + cb) for a, p in zip(acc, _unpack_codes(codes)))
  if layout in ("split8", "nbit"):
    q, s, b = got[:3]
    acc = acc + ((c * s)[:, None] * q.astype(jnp.float32) + (c * b)[:, None])
  else:
    acc = acc + c[:, None] * got[0].astype(jnp.float32)
  if cached:        # a cached position read zeros above and its fp32 row here
    acc = acc + c[:, None] * got[-1]
  return acc


def _bag_kernel(*refs, layout, num_rows, dim, units, bag_len, num_bags, num_feat, bm, bw,
                unroll, starts, has_offsets, bits, cached):
  n_pieces = len(starts) - 1
  n_data = {"float": n_pieces, "split8": n_pieces + 2, "nbit": n_pieces + 2,
            "packed8": 1}[layout]
  data, rest = refs[:n_data], refs[n_data:]
  if cached:
    cache_ref, slot_ref, *rest = rest
  ids_ref, coef_ref, *rest = rest
  off_ref = rest[0] if has_offsets else None
  o_ref = rest[-1]

  m0 = pl.program_id(0) * bm
  j0 = pl.program_id(1) * bw
  m = m0 + jnp.arange(bm, dtype=jnp.int32)
  m_ok = m < num_bags
  # Columns past the row are masked, not clamped: min(cols, D - 1) would hide from Triton
  # that each row's columns are contiguous, and the row loads would not vectorize.
  cols = j0 + jnp.arange(bw, dtype=jnp.int32)
  col_ok = cols < units
  if has_offsets:
    off = off_ref[lax.rem(jnp.minimum(m, num_bags - 1), num_feat)]

  fetch = functools.partial(_fetch, layout, data, starts, bits, units, cols, col_ok)
  accumulate = functools.partial(_accumulate, layout, cached)

  def group(g, acc):
    # U positions at once: their ids and coefficients as one [BM, U] tile (contiguous per
    # bag: one vector load instead of U gathers over BM bags), then every row gather of
    # the group before the first accumulate, so U * BM rows are in flight (Triton does
    # not pipeline these data-dependent loads across loop iterations).
    l = g * unroll + jnp.arange(unroll, dtype=jnp.int32)
    # (The position mask only where groups overhang L: a mask that is constant along the
    # tile's rows lets Triton read each bag's U ids as one vector.)
    tile_ok = m_ok[:, None] if bag_len % unroll == 0 else m_ok[:, None] & (l < bag_len)[None, :]
    idx_t = plgpu.load(ids_ref.at[m[:, None], l[None, :]], mask=tile_ok, other=0)
    c_t = plgpu.load(coef_ref.at[m[:, None], l[None, :]], mask=tile_ok, other=0.0)
    if has_offsets:
      idx_t = idx_t + off[:, None]
    pos = []
    if not cached:
      for idx, c in zip(_columns(idx_t), _columns(c_t)):
        ok = (c != 0) & (idx >= 0) & (idx < num_rows)
        pos.append((jnp.where(ok, idx, 0), c, ok))
      got = [fetch(idx, ok) for idx, _, ok in pos]
    else:             # each position reads its cache row or its table row, never both
      slot_t = plgpu.load(slot_ref.at[m[:, None], l[None, :]], mask=tile_ok, other=-1)
      got = []
      for idx, c, slot in zip(_columns(idx_t), _columns(c_t), _columns(slot_t)):
        live = (c != 0) & (idx >= 0) & (idx < num_rows)
        in_cache = live & (slot >= 0)
        ok = live & (slot < 0)
        pos.append((jnp.where(ok, idx, 0), c, ok))
        row = plgpu.load(cache_ref.at[jnp.where(in_cache, slot, 0)[:, None], cols[None, :]],
                         mask=in_cache[:, None] & col_ok[None, :], other=0.0)
        got.append(fetch(jnp.where(ok, idx, 0), ok) + (row,))
    for (_, c, _), gt in zip(pos, got):
      acc = accumulate(acc, c, gt)
    return acc

  if layout == "packed8":
    acc = tuple(jnp.zeros((bm, bw), jnp.float32) for _ in range(4))
  else:
    acc = jnp.zeros((bm, bw), jnp.float32)
  acc = lax.fori_loop(0, pl.cdiv(bag_len, unroll), group, acc)
  if layout == "packed8":
    acc = _interleave4(acc)
    ocols = 4 * j0 + jnp.arange(4 * bw, dtype=jnp.int32)
  else:
    ocols = cols
  plgpu.store(o_ref.at[m[:, None], ocols[None, :]], acc,
              mask=m_ok[:, None] & (ocols < dim)[None, :])


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


def _pool_call(rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets, num_feat,
               cfg: _Config):
  num_rows = rows.shape[0]
  num_bags, bag_len = ids_ML.shape
  if num_bags == 0 or bag_len == 0:      # no position: every bag is empty, sums are 0
    return jnp.zeros((num_bags, cfg.dim), jnp.float32)
  bm, bw, unroll = _blocks(num_bags, bag_len, rows.dtype.itemsize, cfg)
  if cfg.layout == "packed8":
    pieces, starts = (rows,), (0, num_rows)     # 4-byte words: never in the 32-bit hole
  else:
    pieces, starts = _pieces(rows)
  kernel = functools.partial(
      _bag_kernel, layout=cfg.layout, num_rows=num_rows, dim=cfg.dim, units=_units(cfg),
      bag_len=bag_len, num_bags=num_bags, num_feat=num_feat, bm=bm, bw=bw, unroll=unroll,
      starts=starts, has_offsets=offsets is not None, bits=cfg.bits, cached=cfg.cached)
  operands = list(pieces) + ([scale, bias] if cfg.layout in ("split8", "nbit") else [])
  if cfg.cached:
    operands += [cache_rows, slots_ML]
  operands += [ids_ML, coef_ML]
  if offsets is not None:
    operands.append(offsets)
  row_bytes = {"float": cfg.dim * rows.dtype.itemsize, "split8": cfg.dim + 8,
               "nbit": rows.shape[1] + 4, "packed8": 4 * rows.shape[1]}[cfg.layout]
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_bags, cfg.dim), jnp.float32),
      grid=(pl.cdiv(num_bags, bm), pl.cdiv(_units(cfg), bw)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      cost_estimate=pl.CostEstimate(
          flops=2 * num_bags * bag_len * cfg.dim, transcendentals=0,
          bytes_accessed=num_bags * bag_len * (row_bytes + 8) + num_bags * cfg.dim * 4),
      interpret=cfg.interpret,
      name="embedding_bag",
  )(*operands)


def _id_grads_call(coef_ML, g_MD, cfg: _Config):
  num_bags, bag_len = coef_ML.shape
  dim = g_MD.shape[1]
  if num_bags == 0 or bag_len == 0:
    return jnp.zeros((num_bags * bag_len, dim), jnp.float32)
  bd = min(_next_pow2(dim), 256)
  if cfg.block_dim is not None:
    _check_pow2("block_dim", cfg.block_dim)
    bd = cfg.block_dim
  bm = cfg.block_bags or max(1, min(128, 4096 // bd, _next_pow2(num_bags)))
  _check_pow2("block_bags", bm)
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


def _dequantized_rows(layout, rows, scale, bias, idx, dim, bits=8):
  """float32 rows [len(idx), D] at in-range ids `idx`, in any layout."""
  if layout == "float":
    return rows[idx].astype(jnp.float32)
  if layout == "split8":
    return rows[idx].astype(jnp.float32) * scale[idx][:, None] + bias[idx][:, None]
  if layout == "nbit":
    return quant.dequantize_rowwise(quant.RowwiseQuantized(rows[idx], scale[idx], bias[idx],
                                                           bits, dim))
  return quant.dequantize_rowwise(unpack_int8(PackedInt8Rows(rows[idx], dim)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _bag(rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets, num_feat, cfg):
  return _pool_call(rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets, num_feat,
                    cfg)


def _bag_fwd(rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets, num_feat, cfg):
  out = _pool_call(rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets, num_feat,
                   cfg)
  return out, (rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets)


def _bag_bwd(num_feat, cfg, res, g_MD):
  rows, scale, bias, cache_rows, slots_ML, ids_ML, coef_ML, offsets = res
  num_rows, dim = rows.shape[0], cfg.dim
  num_bags, bag_len = ids_ML.shape
  offs_M = None if offsets is None else jnp.tile(offsets, num_bags // num_feat)
  idx, ok = _flat_ids(ids_ML, offs_M, num_rows)
  safe = jnp.where(ok, idx, 0)
  id_grads = _id_grads_call(coef_ML, g_MD, cfg)                       # [M * L, D]
  # Per-position rows (dequantized, or from the cache) for the coefficient gradient
  # <row, bag grad>.
  seen = _dequantized_rows(cfg.layout, rows, scale, bias, safe, dim, cfg.bits)
  d_cache = None
  if cfg.cached:
    slot = slots_ML.reshape(-1)
    in_cache = ok & (slot >= 0)
    seen = jnp.where(in_cache[:, None], cache_rows[jnp.where(in_cache, slot, 0)], seen)
    d_cache = jnp.zeros(cache_rows.shape, jnp.float32).at[
        jnp.where(in_cache, slot, cache_rows.shape[0])].add(id_grads, mode="drop")
    ok_table = ok & ~in_cache
  else:
    ok_table = ok
  g_pos = jnp.repeat(g_MD, bag_len, axis=0) if bag_len else g_MD[:0]
  d_coef = jnp.where(ok, jnp.sum(seen * g_pos, axis=-1), 0.0).reshape(coef_ML.shape)
  drop = jnp.where(ok_table, idx, num_rows)
  d_rows = d_scale = d_bias = None
  if cfg.layout == "float":
    d_rows = jnp.zeros((num_rows, dim), jnp.float32).at[drop].add(id_grads, mode="drop")
    d_rows = d_rows.astype(rows.dtype)
  elif cfg.layout in ("split8", "nbit"):
    # d/dscale_r = sum over ids of r of <q_r, id grad>; d/dbias_r = sum of id grad (in
    # float32, rounded once to the scale's dtype: float16 for N-bit, as autodiff does).
    q_seen = (rows[safe] if cfg.layout == "split8"
              else quant.unpack_nbit(rows[safe], cfg.bits, dim)).astype(jnp.float32)
    d_scale = jnp.zeros((num_rows,), jnp.float32).at[drop].add(
        jnp.sum(q_seen * id_grads, axis=-1), mode="drop").astype(scale.dtype)
    d_bias = jnp.zeros((num_rows,), jnp.float32).at[drop].add(
        jnp.sum(id_grads, axis=-1), mode="drop").astype(bias.dtype)
  return d_rows, d_scale, d_bias, d_cache, None, None, d_coef.astype(coef_ML.dtype), None


_bag.defvjp(_bag_fwd, _bag_bwd)


@functools.partial(jax.jit, static_argnames=("block_bags", "block_dim", "unroll", "num_warps",
                                             "num_stages", "interpret"))
def embedding_bag(table: Table, ids: jax.Array, coef: jax.Array, *,
                  offsets: jax.Array | None = None, block_bags: int | None = None,
                  block_dim: int | None = None, unroll: int | None = None, num_warps: int = 4,
                  num_stages: int = 2, interpret: bool | None = None,
                  cache_rows: jax.Array | None = None,
                  cache_slots: jax.Array | None = None) -> jax.Array:
  """Pooled bags [..., D] float32 of `ids` [..., L] weighted by `coef` [..., L].

  table: float rows [R, D] (float32, bfloat16, ...), a `core.quant.RowwiseQuantized` (int8
    with float32 scale / bias, or N-bit: int4 / int2 with float16 scale / bias), or
    `PackedInt8Rows` (`pack_int8`; the fast int8 layout).
  cache_rows, cache_slots: float32 rows [C, D] and a slot per position (ids' shape, -1 =
    none); a position with a slot reads cache_rows[slot] instead of its table row
    (a mixed-precision table with an fp32 cache; not with PackedInt8Rows).
  ids: rows of the flat buffer, or, with `offsets` [F], ids within feature f's table
    (f indexes ids' axis -2), shifted by offsets[f] in the kernel.
  coef: per-position coefficient (mean, weights and the padding mask folded in).
  Positions whose coef is 0 or whose id is outside [0, R) contribute nothing.
  block_bags / block_dim: bags and columns of one program (powers of two; None: chosen
  from D); unroll: positions whose row gathers a program issues together (None: enough
  for ~16 KB of rows in flight).
  Differentiable in the float rows, RowwiseQuantized scale and bias, the cache rows and coef.
  """
  layout, rows, scale, bias, dim = _split_table(table)
  ids = jnp.asarray(ids)
  coef = jnp.asarray(coef)
  _check_ids(ids, coef, offsets)
  cached = _check_cache(cache_rows, cache_slots, ids, dim, layout)
  *lead, bag_len = ids.shape
  num_feat = ids.shape[-2] if offsets is not None else 1
  cfg = _Config(layout, dim, block_bags, block_dim, unroll, num_warps, num_stages,
                _resolve_interpret(interpret), table.bits if layout == "nbit" else 8, cached)
  num_bags = math.prod(lead)      # (not reshape(-1, L): L may be 0, every bag empty)
  slots = None if not cached else jnp.asarray(cache_slots, jnp.int32).reshape(num_bags, bag_len)
  out = _bag(rows, scale, bias, cache_rows, slots,
             ids.reshape(num_bags, bag_len).astype(jnp.int32),
             coef.reshape(num_bags, bag_len).astype(jnp.float32),
             None if offsets is None else jnp.asarray(offsets, jnp.int32), num_feat, cfg)
  return out.reshape(*lead, dim)


def _check_cache(cache_rows, cache_slots, ids, dim, layout) -> bool:
  """Whether a cache is given (both arrays or neither), checked against ids and D."""
  if (cache_rows is None) != (cache_slots is None):
    raise ValueError("kernels/embedding_bag.py: cache_rows and cache_slots go together, got "
                     f"only {'cache_rows' if cache_slots is None else 'cache_slots'}")
  if cache_rows is None:
    return False
  if layout == "packed8":
    raise NotImplementedError("kernels/embedding_bag.py: a cache with PackedInt8Rows; use the "
                              "split int8 layout (core.quant.RowwiseQuantized)")
  if cache_rows.ndim != 2 or cache_rows.shape[1] != dim or cache_rows.dtype != jnp.float32:
    raise ValueError(f"kernels/embedding_bag.py: cache_rows {cache_rows.shape} "
                     f"{cache_rows.dtype}, expected float32 [C, {dim}]")
  if cache_slots.shape != ids.shape or not jnp.issubdtype(cache_slots.dtype, jnp.integer):
    raise ValueError(f"kernels/embedding_bag.py: cache_slots {cache_slots.shape} "
                     f"{cache_slots.dtype}, expected integers of ids' shape {ids.shape}")
  return True


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
  cfg = _Config("float", dim, block_bags, block_dim, None, num_warps, num_stages,
                _resolve_interpret(interpret))
  num_bags = math.prod(coef.shape[:-1])
  return _id_grads_call(coef.reshape(num_bags, bag_len), grad.reshape(num_bags, dim), cfg)


# ---------------------------------------------------------------------------- references


def embedding_bag_reference(table: Table, ids: jax.Array, coef: jax.Array, *,
                            offsets: jax.Array | None = None,
                            cache_rows: jax.Array | None = None,
                            cache_slots: jax.Array | None = None) -> jax.Array:
  """Pure jnp `embedding_bag` (any RowwiseQuantized width): gather (a position with a
  cache slot reads its cache row), mask, weighted sum."""
  if isinstance(table, PackedInt8Rows):
    num_rows = table.words.shape[0]
    deq = lambda i: quant.dequantize_rowwise(unpack_int8(PackedInt8Rows(table.words[i],
                                                                        table.dim)))
  elif isinstance(table, quant.RowwiseQuantized):
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
  rows = deq(flat)
  if cache_rows is not None:
    slot = jnp.asarray(cache_slots).reshape(-1)
    rows = jnp.where((slot >= 0)[:, None], cache_rows[jnp.maximum(slot, 0)], rows)
  rows = rows.reshape(*ids.shape, rows.shape[-1])
  return jnp.einsum("...l,...ld->...d", jnp.where(ok, coef, 0.0).astype(jnp.float32), rows,
                    precision=lax.Precision.HIGHEST)


def embedding_bag_id_grads_reference(coef: jax.Array, grad: jax.Array) -> jax.Array:
  """Pure jnp `embedding_bag_id_grads`: (coef[..., :, None] * grad[..., None, :]) flattened."""
  return (coef[..., None].astype(jnp.float32) * grad[..., None, :]).reshape(-1, grad.shape[-1])
