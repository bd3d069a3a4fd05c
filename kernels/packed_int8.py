"""FBGEMM's fused int8 rows as 32-bit words: codes, then scale and bias inline, 16-byte rows.

The fast int8 layout of `kernels.embedding_bag`: one 16-byte-aligned vector read per row
fetches a row's codes with its scale and bias. `pack_int8` builds it from an int8
`core.quant.RowwiseQuantized`, `unpack_int8` inverts it exactly.

Letters: R rows, D codes per row, W words per packed row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from core import quant

_ROW_ALIGN_WORDS = 4            # packed rows are a multiple of 16 bytes (FBGEMM row_alignment)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedInt8Rows:
  """FBGEMM row-wise int8 rows with scale and bias inline, as 32-bit words [R, W].

  Row r: its D codes (uint8, four per word, column c in byte c % 4 of word c // 4, the
  little-endian byte order of FBGEMM's fused row), zero-padded to a whole word, then the
  float32 bit patterns of its scale and bias, then zero words up to a multiple of 4 words
  (16 bytes). `pack_int8` builds it from a `core.quant.RowwiseQuantized`; `unpack_int8`
  inverts it.
  """

  words: jax.Array                 # [R, W] int32
  dim: int = dataclasses.field(default=0, metadata=dict(static=True))   # D

  @property
  def shape(self) -> tuple[int, int]:
    """Shape of the float rows these codes stand for: (R, D)."""
    return (self.words.shape[0], self.dim)


def packed_words_per_row(dim: int) -> int:
  """W: words of a packed row of `dim` int8 codes (codes, scale, bias, 16-byte padding)."""
  return -(-(-(-dim // 4) + 2) // _ROW_ALIGN_WORDS) * _ROW_ALIGN_WORDS


@jax.jit
def pack_int8(table: quant.RowwiseQuantized) -> PackedInt8Rows:
  """The packed layout of an int8 `RowwiseQuantized` (FBGEMM's fused row, 16-byte rows)."""
  if table.bits != 8:
    raise ValueError(f"kernels/packed_int8.py pack_int8: bits={table.bits}, expected 8")
  n, d = table.q.shape[0], table.dim
  d4 = -(-d // 4) * 4
  q = table.q if d4 == d else jnp.pad(table.q, ((0, 0), (0, d4 - d)))
  fused = quant.to_fused_bytes(quant.RowwiseQuantized(q, table.scale, table.bias, 8, d4))
  w = packed_words_per_row(d)
  fused = jnp.pad(fused, ((0, 0), (0, 4 * w - fused.shape[1])))
  return PackedInt8Rows(lax.bitcast_convert_type(fused.reshape(n, w, 4), jnp.int32), d)


@jax.jit
def unpack_int8(packed: PackedInt8Rows) -> quant.RowwiseQuantized:
  """The `RowwiseQuantized` (codes, scale, bias) held in packed rows."""
  n, w = packed.words.shape
  d4 = -(-packed.dim // 4) * 4
  raw = lax.bitcast_convert_type(packed.words, jnp.uint8).reshape(n, 4 * w)
  qr = quant.from_fused_bytes(raw[:, :d4 + 8], 8, d4)
  return quant.RowwiseQuantized(qr.q[:, :packed.dim], qr.scale, qr.bias, 8, packed.dim)
