"""Row-wise int8 dequantize-and-pool as a Triton kernel called from JAX through jax-triton.

The same op as `kernels.embedding_bag` on `core.quant.RowwiseQuantized` int8 rows (FBGEMM
arXiv 2101.05615), written directly in Triton rather than through Pallas: a program pools
BLOCK_M bags over BLOCK_D columns,

    out[m] = sum_l c[m, l] * (q[id] * scale[id] + bias[id])
           = sum_l (c * scale[id]) * q[id]  +  sum_l c * bias[id]

one masked gather of BLOCK_M code rows per position l. Positions with c == 0 or an id
outside [0, R) read nothing. Row addresses are 64-bit, so buffers over 2^31 bytes work.

`triton` and `jax_triton` (the `gpu` extra in pyproject.toml) are imported on first use,
so this module, its reference and their tests import on a machine without them; `int8_pool`
then raises ImportError. jax-triton and triton releases come in pairs: jax-triton 0.4 imports
`TMA_TF32` from Triton's NVIDIA driver, which triton 3.6 lacks; it then replaces the whole
NVIDIA backend by stubs and every launch fails with "'_Stub' object has no attribute
'backend'". jax-triton 0.3.1 is the release for triton 3.6 (jax >= 0.8.2); 0.4.x needs
triton >= 3.7. `int8_pool` detects the stubbed backend and raises a RuntimeError saying so.
Forward only (no custom_vjp): training goes through `kernels.embedding_bag`, whose backward
writes the per-id gradients.

Letters: R rows, D row width, M bags (leading dims of ids flattened), L ids per bag.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import jax
import jax.numpy as jnp

from core import quant


def _import(name: str):
  try:
    return importlib.import_module(name)
  except ImportError as e:
    raise ImportError(
        f"kernels/triton_int8_pool.py needs {name} ({e}); install the gpu extra: "
        "pip install -e '.[gpu]'") from e


def available() -> bool:
  """Whether triton and jax_triton import here (a GPU is still needed to run the kernel)."""
  try:
    _import("triton")
    _import("jax_triton")
  except ImportError:
    return False
  return True


def _version(module) -> str:
  return getattr(module, "__version__", "unknown")


def _jax_triton():
  """jax_triton, checked to have loaded Triton's NVIDIA backend (see the module docstring)."""
  jt = _import("jax_triton")
  lib = getattr(jt, "triton_lib", None)
  stub = getattr(lib, "_Stub", None)
  if stub is not None and getattr(getattr(lib, "cb", None), "GPUTarget", None) is stub:
    triton = _import("triton")
    raise RuntimeError(
        f"kernels/triton_int8_pool.py: jax-triton {_version(jt)} could not load Triton's "
        f"NVIDIA backend from triton {_version(triton)} (jax-triton 0.4 needs triton >= 3.7; "
        "for triton 3.6 install jax-triton 0.3.1), so every launch would fail with "
        "\"'_Stub' object has no attribute 'backend'\". Install a matching pair, e.g. "
        "pip install 'jax-triton==0.3.1' next to triton 3.6, or triton >= 3.7.")
  return jt


@functools.cache
def _kernel():
  """The @triton.jit kernel, defined on first use (triton is imported lazily)."""
  triton = _import("triton")
  tl = _import("triton.language")

  @triton.jit
  def int8_pool_kernel(q_ptr, scale_ptr, bias_ptr, ids_ptr, coef_ptr, out_ptr,
                       NUM_BAGS: tl.constexpr, NUM_ROWS: tl.constexpr, DIM: tl.constexpr,
                       BAG_LEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_ok = offs_m < NUM_BAGS
    d_ok = offs_d < DIM
    pos = offs_m.to(tl.int64) * BAG_LEN
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    bsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for l in range(BAG_LEN):
      idx = tl.load(ids_ptr + pos + l, mask=m_ok, other=0)
      c = tl.load(coef_ptr + pos + l, mask=m_ok, other=0.0)
      ok = m_ok & (c != 0.0) & (idx >= 0) & (idx < NUM_ROWS)
      row = tl.where(ok, idx, 0).to(tl.int64)
      s = tl.load(scale_ptr + row, mask=ok, other=0.0)
      b = tl.load(bias_ptr + row, mask=ok, other=0.0)
      q = tl.load(q_ptr + row[:, None] * DIM + offs_d[None, :],
                  mask=ok[:, None] & d_ok[None, :], other=0)
      acc += (c * s)[:, None] * q.to(tl.float32)
      bsum += c * b
    acc += bsum[:, None]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * DIM + offs_d[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & d_ok[None, :])

  return int8_pool_kernel


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def int8_pool(table: quant.RowwiseQuantized, ids: jax.Array, coef: jax.Array, *,
              block_bags: int | None = None, block_dim: int | None = None,
              num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Pooled bags [..., D] float32 of int8 rows `table` at `ids` [..., L] weighted by `coef`.

  Same semantics as `kernels.embedding_bag.embedding_bag` without offsets. Needs triton,
  a jax_triton release that matches it, and a GPU.
  """
  if not isinstance(table, quant.RowwiseQuantized) or table.bits != 8:
    raise ValueError(f"kernels/triton_int8_pool.py int8_pool: table {type(table).__name__}, "
                     "expected an int8 core.quant.RowwiseQuantized")
  ids, coef = jnp.asarray(ids), jnp.asarray(coef)
  if ids.shape != coef.shape or ids.ndim < 1:
    raise ValueError(f"kernels/triton_int8_pool.py int8_pool: ids {ids.shape} and coef "
                     f"{coef.shape}, expected the same shape [..., L]")
  *lead, bag_len = ids.shape
  num_rows, dim = table.q.shape
  ids_ML = ids.reshape(-1, bag_len).astype(jnp.int32)
  coef_ML = coef.reshape(-1, bag_len).astype(jnp.float32)
  num_bags = ids_ML.shape[0]
  if num_bags == 0:
    return jnp.zeros((*lead, dim), jnp.float32)
  bd = block_dim or min(_next_pow2(dim), 256)
  bm = block_bags or max(1, min(128, 4096 // bd, _next_pow2(num_bags)))
  jt = _jax_triton()
  out_type = jax.ShapeDtypeStruct((num_bags, dim), jnp.float32)
  # jax-triton >= 0.4 names the output `out_type`; earlier versions `out_shape`.
  out_kw = ("out_type" if "out_type" in inspect.signature(jt.triton_call).parameters
            else "out_shape")
  out = jt.triton_call(
      table.q, table.scale.astype(jnp.float32), table.bias.astype(jnp.float32), ids_ML, coef_ML,
      kernel=_kernel(), grid=(_cdiv(num_bags, bm), _cdiv(dim, bd)),
      num_warps=num_warps, num_stages=num_stages, name="int8_pool",
      NUM_BAGS=num_bags, NUM_ROWS=num_rows, DIM=dim, BAG_LEN=bag_len, BLOCK_M=bm, BLOCK_D=bd,
      **{out_kw: out_type})
  return out.reshape(*lead, dim)


def int8_pool_reference(table: quant.RowwiseQuantized, ids: jax.Array,
                        coef: jax.Array) -> jax.Array:
  """Pure jnp `int8_pool`: dequantize the looked-up rows, mask, weighted sum."""
  from kernels import embedding_bag
  return embedding_bag.embedding_bag_reference(table, ids, coef)
