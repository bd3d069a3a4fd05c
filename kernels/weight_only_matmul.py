"""Weight-only int8 / int4 matrix product for decode: activations x [M, K] (a few rows) times
group-wise quantized weight rows [N, K] transposed, dequantized in registers.

    y_MN = weight_only_matmul(x_MK, gq)      # gq: core.quant.groupwise.GroupQuantized

The weights are ggml's Q8_0 / Q4_0 / Q4_1 blocks as `core.quant.groupwise` holds them (what
llm/quantized.py loads from a GGUF or quantizes): groups of 32 along K, one float16 scale per
group (and a float16 minimum for Q4_1); int8 codes [N, K], or int4 codes two per byte [N, K/2]
in ggml's order (byte t of a group holds element t in its low nibble, element t + 16 in its
high one). A decode step is bound by reading the weights; this kernel reads each code byte
once and never writes the dequantized matrix: XLA's path (`groupwise.groupwise_matmul`)
dequantizes into a float matrix first unless its fusion takes the dequantization into the
product's operand load.

Grid (N / BN, splits of K): program (i, j) holds BN output columns and walks its share of K in
tiles of BK: x's tile [Mp, BK] (rows padded to 16, what Triton's dot takes), the codes' tile,
each element's scale (and minimum) read through its group index, w = scale * code (+ min) in
float32 rounded to x's dtype, and a dot with float32 accumulation; the splits' partial sums
are added in jnp. Splitting K gives the GPU enough programs when N is small (a 2048-wide
projection is 16 programs of 128 columns; an H200 has 132 multiprocessors). int4 tiles are
two dots, one per nibble, against x's columns of those elements.

Numerics: as `groupwise_matmul` in x's dtype: each weight is scale * code + min in float32,
rounded once to x's dtype (bfloat16 / float16), products summed in float32; only the order of
the sums differs. x must be bfloat16 or float16 (Triton's float32 dot runs in tf32).

Plain `pallas_call` form: the Triton lowering on a GPU, Pallas's interpreter elsewhere
(`interpret=None` picks by backend).

Letters: M rows of x (Mp padded), K contraction, N output columns, J = K / 32 groups, BN / BK
the program's tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from core.quant import groupwise
from kernels.flash_attention_reference import pad_axis

try:  # The Triton backend is deprecated (JAX 0.11.0); keep importing this module without it.
  from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
  pl_triton = None

# Programs to aim for when splitting K: about two per multiprocessor of an H100 / H200.
TARGET_PROGRAMS = 264
MAX_ROWS = 64          # x rows the kernel takes (decode steps, short verifications)


def supports(x_dtype, m: int, gq: groupwise.GroupQuantized) -> str | None:
  """None if the kernel takes x [m, K] of `x_dtype` times `gq`, else why not."""
  n, k = gq.shape
  if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"x dtype {jnp.dtype(x_dtype).name}: the kernel's dots take bfloat16 / float16"
  if m > MAX_ROWS:
    return f"{m} rows of x: the kernel is for decode (at most {MAX_ROWS})"
  if gq.group != groupwise.GROUP or k % 64 or n % 16:
    return (f"rows [{n}, {k}] in groups of {gq.group}: expected groups of "
            f"{groupwise.GROUP}, K a multiple of 64 and N of 16")
  return None


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap dividing n."""
  d = 1
  while d * 2 <= cap and n % (d * 2) == 0:
    d *= 2
  return d


def tiles(m: int, n: int, k: int, block_n: int | None = None, block_k: int | None = None,
          splits: int | None = None) -> tuple[int, int, int]:
  """(BN, BK, splits): BN the largest power of two <= 128 dividing N, BK <= 256 dividing K,
  and enough K splits (each a whole number of BK tiles) for TARGET_PROGRAMS programs."""
  bn = block_n or _pow2_divisor(n, 128)
  bk = block_k or _pow2_divisor(k, 256)
  tiles_k = k // bk
  if splits is None:
    want = max(1, -(-TARGET_PROGRAMS // (n // bn)))
    splits = max(d for d in range(1, tiles_k + 1) if tiles_k % d == 0 and d <= want)
  if bn < 16 or n % bn or bk < 32 or k % bk or (k // bk) % splits:
    raise ValueError(f"weight_only_matmul: tiles BN={bn}, BK={bk}, splits={splits} do not "
                     f"divide N={n}, K={k} (BN >= 16, BK >= 32, splits | K / BK)")
  return bn, bk, splits


def _load(ref, rows, cols):
  from jax.experimental.pallas import triton as plgpu
  return plgpu.load(ref.at[rows[:, None], cols[None, :]])


def _dot_t(a, b):
  """a [M, T] . b [N, T] -> [M, N] in float32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(x_ref, q_ref, s_ref, b_ref, o_ref, *, bits: int, group: int, bk: int,
            k_split: int):
  """Program (i, j): x [Mp, K], codes [BN, K or K/2], scales / minimums [BN, J] of the
  program's columns; its partial product [Mp, BN] over K columns [j * k_split, (j+1) *
  k_split)."""
  mp = x_ref.shape[0]
  bn = q_ref.shape[0]
  rows_x = jnp.arange(mp)
  rows_w = jnp.arange(bn)
  k0 = pl.program_id(1) * k_split
  dt = x_ref.dtype

  def dequant(codes, kcols):
    g = kcols // group
    w = codes.astype(jnp.float32) * _load(s_ref, rows_w, g).astype(jnp.float32)
    if b_ref is not None:
      w = w + _load(b_ref, rows_w, g).astype(jnp.float32)
    return w.astype(dt)

  def body(t, acc):
    base = k0 + t * bk
    if bits == 8:
      kcols = base + jnp.arange(bk)
      x = _load(x_ref, rows_x, kcols)                        # [Mp, BK]
      codes = _load(q_ref, rows_w, kcols)                    # [BN, BK] int8
      return acc + _dot_t(x, dequant(codes, kcols))
    h = jnp.arange(bk // 2)
    half = group // 2
    klo = base + (h // half) * group + h % half               # the low nibbles' elements
    packed = _load(q_ref, rows_w, base // 2 + h)               # [BN, BK/2] uint8
    lo = dequant(packed & 0x0F, klo)
    hi = dequant(packed >> 4, klo + half)
    return (acc + _dot_t(_load(x_ref, rows_x, klo), lo)
            + _dot_t(_load(x_ref, rows_x, klo + half), hi))

  acc = lax.fori_loop(0, k_split // bk, body, jnp.zeros((mp, bn), jnp.float32))
  o_ref[...] = acc


def _kernel_no_bias(x_ref, q_ref, s_ref, o_ref, **kw):
  _kernel(x_ref, q_ref, s_ref, None, o_ref, **kw)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_k", "splits",
                                             "interpret", "num_warps", "num_stages"))
def weight_only_matmul(x_MK, gq: groupwise.GroupQuantized, *, out_dtype=None,
                       block_n: int | None = None, block_k: int | None = None,
                       splits: int | None = None, interpret: bool | None = None,
                       num_warps: int = 4, num_stages: int = 3):
  """x [M, K] @ dequantize(gq).T -> [M, N] in `out_dtype` (default x's), the weights
  dequantized inside the kernel (module docstring). block_n / block_k / splits: the tiles
  (default `tiles`); interpret: None runs Pallas's interpreter unless the backend is a GPU;
  num_warps / num_stages: Triton launch parameters."""
  m, k = x_MK.shape
  n, kk = gq.shape
  if kk != k:
    raise ValueError(f"weight_only_matmul: x {x_MK.shape} vs rows {gq.shape}; expected the "
                     "same K")
  why = supports(x_MK.dtype, m, gq)
  if why is not None:
    raise ValueError(f"weight_only_matmul: {why}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  bn, bk, n_split = tiles(m, n, k, block_n, block_k, splits)
  mp = max(16, pl.next_power_of_2(m))
  x = pad_axis(x_MK, 0, mp)
  j = k // gq.group
  kq = gq.q.shape[1]
  in_specs = [pl.BlockSpec((mp, k), lambda i, s: (0, 0)),
              pl.BlockSpec((bn, kq), lambda i, s: (i, 0)),
              pl.BlockSpec((bn, j), lambda i, s: (i, 0))]
  args = [x, gq.q, gq.scale]
  if gq.bias is not None:
    in_specs.append(pl.BlockSpec((bn, j), lambda i, s: (i, 0)))
    args.append(gq.bias)
  kw = dict(bits=gq.bits, group=gq.group, bk=bk, k_split=k // n_split)
  kernel = (functools.partial(_kernel, **kw) if gq.bias is not None
            else functools.partial(_kernel_no_bias, **kw))
  compiler_params = (None if pl_triton is None
                     else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages))
  part = pl.pallas_call(
      kernel,
      grid=(n // bn, n_split),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, mp, bn), lambda i, s: (s, 0, i)),
      out_shape=jax.ShapeDtypeStruct((n_split, mp, n), jnp.float32),
      compiler_params=compiler_params,
      interpret=bool(interpret),
      name=f"weight_only_matmul_int{gq.bits}",
  )(*args)
  y = part[0] if n_split == 1 else jnp.sum(part, axis=0)
  return y[:m].astype(out_dtype or x_MK.dtype)


__all__ = ["MAX_ROWS", "supports", "tiles", "weight_only_matmul"]
