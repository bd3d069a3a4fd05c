"""Group-wise int8 / int4 weight formats for weight-only quantized inference, laid out as
ggml's (llama.cpp's) Q8_0 / Q4_0 / Q4_1 blocks so GGUF files map onto them without
requantizing.

A matrix is held as rows [N, K] (N outputs, K the contraction axis), cut into groups of G
consecutive columns; every group has a float16 scale and, optionally, a float16 bias:

    x ~= scale * code + bias                       (per group; bias 0 when absent)

  bits 8   code int8 in [-127, 127], no bias                 (ggml Q8_0: d * q)
  bits 4   code 0..15, packed two per byte in ggml's order: byte j of a group holds column
           j in its low nibble and column j + G/2 in its high one
           with bias                                         (ggml Q4_1: d * q + m)
           Q4_0's d * (q - 8) is the bias -8 d, exact in float16

Dequantization is `scale * code + bias` in float32: the product of a float16 scale and a
code of <= 8 bits is exact, so the only rounding is the add's, on every backend, and it
equals `gguf.quants.dequantize` of the same blocks bit for bit (but for the sign of a zero:
Q4_0's code 8 with d < 0 gives -0 there, +0 here).

Quantization here (numpy, once at load time, every step float32):
  int8: scale = amax / 127 rounded *up* to float16, code = round-half-even(x / scale);
  int4: bias = min rounded *down* to float16, scale = (max - bias) / 15 rounded up to
        float16, code = round-half-even((x - bias) / scale) clipped to [0, 15].
Rounding the float16 scale up and the bias down keeps every code inside its range, so the
round-trip error is at most half a step, |x - dequantize(quantize(x))| <= scale / 2 per
group, up to float32 rounding of the division and the add (`groupwise_error_bound`).

Letters: N rows, K columns (contraction), G group size, J = K / G groups per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32                           # ggml's block size for Q8_0 / Q4_0 / Q4_1
BITS = (8, 4)
# ggml type -> (bits, bytes per 32-block); Q8_0: f16 d + 32 int8; Q4_0: f16 d + 16 nibble
# bytes; Q4_1: f16 d, f16 m + 16 nibble bytes.
GGML_BLOCKS = {"Q8_0": (8, 34), "Q4_0": (4, 18), "Q4_1": (4, 20)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupQuantized:
  """Rows [N, K] as codes, float16 scales [N, J] and optional float16 biases [N, J]."""

  q: jax.Array | np.ndarray            # [N, K] int8 (bits 8) or [N, K / 2] uint8 (bits 4)
  scale: jax.Array | np.ndarray        # [N, J] float16
  bias: jax.Array | np.ndarray | None  # [N, J] float16, or None (0)
  bits: int = dataclasses.field(default=8, metadata=dict(static=True))
  group: int = dataclasses.field(default=GROUP, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    """Shape of the float rows (N, K)."""
    return (self.q.shape[0], self.scale.shape[1] * self.group)

  @property
  def nbytes(self) -> int:
    """Bytes held: codes, scales and biases."""
    return sum(int(a.size) * a.dtype.itemsize for a in (self.q, self.scale, self.bias)
               if a is not None)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """float rows [N, K] (jnp, inside a jitted computation)."""
    return dequantize_groupwise(self, dtype)

  def take_rows(self, ids, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` (any shape [...]) dequantized: [..., K]; only those rows are read."""
    flat = jnp.reshape(ids, (-1,))
    take = lambda a: None if a is None else jnp.take(a, flat, axis=0)
    part = GroupQuantized(take(self.q), take(self.scale), take(self.bias), self.bits,
                          self.group)
    return dequantize_groupwise(part, dtype).reshape(*jnp.shape(ids), self.shape[1])


def _fail(where: str, what: str):
  raise ValueError(f"{where}: {what}")


def _check(x: np.ndarray, bits: int, group: int, where: str) -> np.ndarray:
  if bits not in BITS:
    _fail(where, f"bits={bits}; expected one of {BITS}")
  if group <= 0 or group % 2:
    _fail(where, f"group={group}; expected a positive even group size")
  x = np.asarray(x, np.float32)
  if x.ndim != 2:
    _fail(where, f"shape {x.shape}; expected rows [N, K]")
  if x.shape[1] % group:
    _fail(where, f"{x.shape[1]} columns; expected a multiple of the group size {group}")
  if not np.all(np.isfinite(x)):
    r, c = np.argwhere(~np.isfinite(x))[0]
    _fail(where, f"holds NaN or Inf (first {x[r, c]} at row {r}, column {c}); expected "
          "finite weights")
  return x


def _f16_up(v: np.ndarray) -> np.ndarray:
  """float32 -> the smallest float16 >= v."""
  h = v.astype(np.float16)
  return np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)


def _f16_down(v: np.ndarray) -> np.ndarray:
  """float32 -> the largest float16 <= v."""
  h = v.astype(np.float16)
  return np.where(h.astype(np.float32) > v, np.nextafter(h, np.float16(-np.inf)), h)


def pack_int4(codes: np.ndarray, group: int) -> np.ndarray:
  """Codes [N, K] (0..15) -> [N, K / 2] bytes in ggml's order (module docstring)."""
  n, k = codes.shape
  c = codes.astype(np.uint8).reshape(n, k // group, 2, group // 2)
  return (c[:, :, 0] | (c[:, :, 1] << np.uint8(4))).reshape(n, k // 2)


def unpack_int4(packed, group: int):
  """[N, K / 2] bytes -> codes [N, K] (uint8 0..15); numpy or jnp by the input."""
  xp = jnp if isinstance(packed, jax.Array) else np
  n, half = packed.shape
  b = packed.reshape(n, half // (group // 2), 1, group // 2)
  codes = xp.concatenate([b & 0x0F, b >> 4], axis=2)
  return codes.reshape(n, 2 * half)


def quantize_groupwise(x_NK: np.ndarray, bits: int, group: int = GROUP, *,
                       where: str = "quantize_groupwise") -> GroupQuantized:
  """Rows x [N, K] (float) -> GroupQuantized (numpy arrays); `where` names the tensor in
  errors (non-finite values, K not a multiple of `group`, a scale beyond float16)."""
  x = _check(x_NK, bits, group, where)
  n, k = x.shape
  g = x.reshape(n, k // group, group)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    if bits == 8:
      amax = np.max(np.abs(g), axis=-1)
      scale = _f16_up((amax / np.float32(127)).astype(np.float32))
      bias = None
      s = scale.astype(np.float32)[..., None]
      codes = np.where(s > 0, np.rint(g / s), 0)
      q = np.clip(codes, -127, 127).astype(np.int8).reshape(n, k)
    else:
      bias = _f16_down(np.min(g, axis=-1))
      lo = bias.astype(np.float32)
      rng = (np.max(g, axis=-1) - lo).astype(np.float32)
      scale = _f16_up((rng / np.float32(15)).astype(np.float32))
      s = scale.astype(np.float32)[..., None]
      codes = np.where(s > 0, np.rint((g - lo[..., None]) / s), 0)
      q = pack_int4(np.clip(codes, 0, 15).reshape(n, k), group)
  _check_float16(g, scale, bias, group, where)
  return GroupQuantized(q, scale.astype(np.float16), bias, bits, group)


def _check_float16(g: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, group: int,
                   where: str) -> None:
  """Fails naming the first group [N, J, G] whose float16 scale or bias overflowed."""
  bad = ~np.isfinite(scale) if bias is None else ~(np.isfinite(scale) & np.isfinite(bias))
  if not bad.any():
    return
  r, j = np.argwhere(bad)[0]
  vals, at = g[r, j], f"row {r}, columns {j * group}..{(j + 1) * group - 1}"
  if bias is None:
    _fail(where, f"{at}: max |x| = {np.max(np.abs(vals)):.6g}; expected at most 65504 * 127 "
          "(the float16 scale max |x| / 127)")
  if not np.isfinite(bias[r, j]):
    _fail(where, f"{at}: min = {np.min(vals):.6g}; expected at least -65504 (the float16 "
          "bias, the group's minimum)")
  _fail(where, f"{at}: max - min = {np.max(vals) - np.float64(np.min(vals)):.6g}; expected "
        "at most 65504 * 15 (the float16 scale (max - min) / 15)")


def dequantize_groupwise(gq: GroupQuantized, dtype=jnp.float32) -> jax.Array:
  """float rows [N, K]: scale * code + bias in float32 (one rounding), cast to `dtype`."""
  n, k = gq.shape
  j = k // gq.group
  codes = gq.q if gq.bits == 8 else unpack_int4(jnp.asarray(gq.q), gq.group)
  c = jnp.asarray(codes).reshape(n, j, gq.group).astype(jnp.float32)
  x = jnp.asarray(gq.scale).astype(jnp.float32)[..., None] * c
  if gq.bias is not None:
    x = x + jnp.asarray(gq.bias).astype(jnp.float32)[..., None]
  return x.reshape(n, k).astype(dtype)


# Rows dequantized at a time by `groupwise_matmul`: a 1 MiB float32 transient stays in cache
# while the codes stream from memory. Dequantizing a whole 49152 x 576 embedding (113 MB)
# per decode step instead took 470 ms against 24 ms chunked (2-core CPU, int8).
CHUNK_ELEMENTS = 1 << 18


def _chunk_rows(n: int, k: int) -> int:
  """The largest divisor of n with rows * k <= CHUNK_ELEMENTS (at least 1)."""
  best = 1
  for r in range(1, n + 1):
    if n % r == 0 and r * k <= CHUNK_ELEMENTS:
      best = r
  return best


def _matmul_rows(x_MK, gq: GroupQuantized, dtype, preferred_element_type):
  """x [M, K] times rows [N, K] transposed: [M, N], every element dequantized as
  `dequantize_groupwise` does (int4: low and high nibbles contracted apart, no interleave)."""
  n, k = gq.shape
  j, g = k // gq.group, gq.group
  scale = gq.scale.astype(jnp.float32)[..., None]
  bias = 0.0 if gq.bias is None else gq.bias.astype(jnp.float32)[..., None]
  deq = lambda c: (scale * c.astype(jnp.float32) + bias).astype(dtype)
  kw = dict(preferred_element_type=preferred_element_type)
  x = x_MK.astype(dtype)
  if gq.bits == 8:
    return jnp.einsum("mk,nk->mn", x, deq(gq.q.reshape(n, j, g)).reshape(n, k), **kw)
  b = gq.q.reshape(n, j, g // 2)
  x = x.reshape(-1, j, 2, g // 2)
  half = lambda a: a.reshape(a.shape[0], k // 2)    # one contracting dim: a plain GEMM
  # The two halves' products meet in float32 and the sum is rounded once to the result's
  # type (in a 16-bit result each half would be rounded first: up to a unit apart).
  out = jnp.result_type(preferred_element_type or dtype)
  wide = dict(preferred_element_type=jnp.promote_types(out, jnp.float32))
  return (jnp.einsum("mk,nk->mn", half(x[:, :, 0]), half(deq(b & 0x0F)), **wide)
          + jnp.einsum("mk,nk->mn", half(x[:, :, 1]), half(deq(b >> 4)), **wide)).astype(out)


def groupwise_matmul(x_MK: jax.Array, gq: GroupQuantized, dtype=jnp.float32,
                     preferred_element_type=None) -> jax.Array:
  """x [M, K] @ dequantize(gq).T -> [M, N] inside a jitted computation: on CPU the rows are
  dequantized CHUNK_ELEMENTS at a time (lax.map over row chunks; elsewhere in one product)
  and contracted in their [N, K] layout, so only the codes are read from memory. Equals
  the float product of the dequantized rows (in `dtype`) up to float32 summation order,
  rounded once to the result's type (int4's two nibble halves are summed in float32
  first)."""
  n, k = gq.shape
  # The chunks are for a CPU's cache; a GPU's compiler fuses the dequantization into the
  # product's operand load (XLA's gemm fusions), and a loop of small products there would
  # be launch-bound.
  rows = _chunk_rows(n, k) if jax.default_backend() == "cpu" else n
  if rows == n:
    return _matmul_rows(x_MK, gq, dtype, preferred_element_type)
  c = n // rows
  split = lambda a: None if a is None else a.reshape(c, rows, *a.shape[1:])

  def one(parts):
    q, scale, bias = parts
    return _matmul_rows(x_MK, GroupQuantized(q, scale, bias, gq.bits, gq.group), dtype,
                        preferred_element_type)

  y_CMR = jax.lax.map(one, (split(gq.q), split(gq.scale), split(gq.bias)))
  return jnp.moveaxis(y_CMR, 0, 1).reshape(x_MK.shape[0], n)


def dequantize_groupwise_reference(gq: GroupQuantized) -> np.ndarray:
  """numpy float32 rows [N, K]: the product in float64 (exact), the sum rounded once."""
  n, k = gq.shape
  q = np.asarray(gq.q)
  codes = q if gq.bits == 8 else unpack_int4(q, gq.group)
  c = codes.reshape(n, k // gq.group, gq.group).astype(np.float64)
  x = np.asarray(gq.scale).astype(np.float64)[..., None] * c
  if gq.bias is not None:
    x = x + np.asarray(gq.bias).astype(np.float64)[..., None]
  return x.astype(np.float32).reshape(n, k)


def groupwise_error_bound(gq: GroupQuantized) -> np.ndarray:
  """Per-group bound [N, J] on |x - dequantize(quantize(x))| before float32 rounding:
  half a step, scale / 2 (the scale rounded up and the bias down keep codes in range)."""
  return np.asarray(gq.scale).astype(np.float32) / 2


def from_ggml_blocks(blocks: np.ndarray, qtype: str, *, where: str = "from_ggml_blocks"
                     ) -> GroupQuantized:
  """Raw ggml rows [N, J * block bytes] (uint8) of a Q8_0, Q4_0 or Q4_1 tensor ->
  GroupQuantized with the same codes, scales and minimums (no requantization)."""
  if qtype not in GGML_BLOCKS:
    _fail(where, f"ggml type {qtype}; expected one of {sorted(GGML_BLOCKS)}")
  bits, size = GGML_BLOCKS[qtype]
  blocks = np.ascontiguousarray(np.asarray(blocks, np.uint8))
  if blocks.ndim != 2 or blocks.shape[1] % size:
    _fail(where, f"{qtype} rows of shape {blocks.shape}; expected [N, J * {size}] bytes")
  n, j = blocks.shape[0], blocks.shape[1] // size
  b = blocks.reshape(n, j, size)
  d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
  m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0] if qtype == "Q4_1" else d
  # A non-finite d or m (a damaged file) would decode to NaN / Inf weights; Q4_0's bias
  # -8 d is a float16 here, so |d| > 65504 / 8 would decode to Inf where ggml's float
  # (q - 8) * d is finite.
  bad = ~(np.isfinite(d) & np.isfinite(m))
  if qtype == "Q4_0":
    bad |= np.abs(d.astype(np.float32)) > np.float32(65504 / 8)
  if bad.any():
    r, jb = np.argwhere(bad)[0]
    block = f"row {r}, block {jb} (columns {jb * GROUP}..{(jb + 1) * GROUP - 1})"
    if qtype == "Q4_1":
      _fail(where, f"{block}: d = {d[r, jb]}, m = {m[r, jb]}; expected finite d and m")
    limit = " with |d| <= 8188 (the float16 bias -8 d)" if qtype == "Q4_0" else ""
    _fail(where, f"{block}: d = {d[r, jb]}; expected a finite d{limit}")
  if qtype == "Q8_0":
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, j * GROUP)
    return GroupQuantized(q, d, None, 8, GROUP)
  if qtype == "Q4_0":
    bias = (d.astype(np.float32) * np.float32(-8)).astype(np.float16)   # exact
    qs = b[..., 2:]
  else:
    bias = m
    qs = b[..., 4:]
  return GroupQuantized(np.ascontiguousarray(qs).reshape(n, j * GROUP // 2), d,
                        np.ascontiguousarray(bias), 4, GROUP)
