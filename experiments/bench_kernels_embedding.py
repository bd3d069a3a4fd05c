r"""Embedding-bag kernels against the GPU's memory bandwidth (to merge into bench_kernels.py).

  python -m experiments.bench_kernels_embedding          # on a GPU; refuses on CPU

A pooled lookup is memory bound: each (bag, position) reads one row. `bench_embedding_bag`
times the table-batched kernels (`kernels.embedding_bag` in Pallas, the XLA gather +
einsum the collection uses by default, and for int8 rows the Triton kernel through
jax-triton) on F tables of R rows in one flat buffer, counts the bytes each call must
move (rows read at the looked-up positions, ids and coefficients read, pooled bags
written) and reports them per second next to a measured device-to-device copy
(`device_copy_bandwidth`, read + write counted, the figure KINDS.md quotes: ~3.0 TB/s on
an H100, ~4.3 TB/s on an H200). Uniform ids over large tables make nearly every row read
a cache miss, the case the ratio is meant for; Zipf ids (`zipf_alpha`) hit L2 and can
exceed 1. Prints a table; the last stdout line is JSON.

Letters: B batch, F features (tables), L ids per bag, R rows per table, D dim.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Sequence


def _time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
  """Median seconds of one call (each repeat blocks on its result)."""
  import jax
  from core import benchmark
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return benchmark.median(times)


def _require_gpu(what: str) -> None:
  import jax
  backend = jax.default_backend()
  if backend != "gpu":
    raise RuntimeError(
        f"{what} measures GPU memory bandwidth, but JAX's default backend is {backend!r}: "
        "on CPU the Pallas kernel runs in its interpreter (the kernel emulated as an XLA loop "
        "over its grid) and the numbers would say nothing about the kernel. Run it on a GPU.")


def device_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> float:
  """Bytes/s of an on-device elementwise copy, counting bytes read and written."""
  import jax
  import jax.numpy as jnp
  _require_gpu("device_copy_bandwidth")
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  copy = jax.jit(lambda x: x + 1.0)      # one read and one write per element, not elided
  return 2 * x.nbytes / _time(lambda: copy(x), repeats)


def bench_embedding_bag(num_rows: int = 1_000_000, dim: int = 128, batch: int = 8192,
                        features: int = 26, bag_len: int = 20,
                        dtypes: Sequence[str] = ("float32", "bfloat16", "int8"),
                        impls: Sequence[str] = ("pallas", "xla", "triton"),
                        zipf_alpha: float | None = None, repeats: int = 20,
                        seed: int = 0) -> dict[str, Any]:
  """Achieved bytes/s of each lookup implementation vs the device copy bandwidth.

  One flat buffer of `features` tables of `num_rows` rows, full bags of `bag_len` ids
  (ids offset into the buffer beforehand). Returns {"copy_bytes_per_s", "results": [...]}
  with one row per (dtype, impl): seconds per call, bytes moved, bytes/s and the fraction
  of the copy bandwidth. "triton" runs for int8 only, and only where jax_triton imports.
  Raises RuntimeError on a non-GPU backend.
  """
  _require_gpu("bench_embedding_bag")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from core import quant
  from kernels import embedding_bag as eb
  from kernels import triton_int8_pool

  rng = np.random.default_rng(seed)
  total_rows = features * num_rows
  if zipf_alpha:
    from rec.data.synthetic import zipf_ids
    local = zipf_ids(rng, num_rows, (batch, features, bag_len), zipf_alpha)
  else:
    local = rng.integers(0, num_rows, (batch, features, bag_len), dtype=np.int32)
  offsets = (np.arange(features, dtype=np.int64) * num_rows)[None, :, None]
  ids = jnp.asarray((local + offsets).astype(np.int32))
  coef = jnp.asarray(rng.uniform(0.5, 1.5, ids.shape).astype(np.float32))
  copy_bw = device_copy_bandwidth()

  # Rows drawn on device, one table per dtype at a time (a 26 x 1M x 128 fp32 buffer is 13 GB).
  key = jax.random.key(seed)
  results = []
  for dtype in dtypes:
    rows32 = jax.random.uniform(key, (total_rows, dim), jnp.float32, -0.01, 0.01)
    if dtype == "int8":
      table = quant.quantize_rowwise_int8(rows32)
      row_bytes = dim + 8                      # codes + f32 scale and bias
    else:
      table = rows32.astype(dtype)
      row_bytes = dim * jnp.dtype(dtype).itemsize
    del rows32
    positions = batch * features * bag_len
    moved = positions * (row_bytes + 8) + batch * features * dim * 4   # rows, ids + coef, out
    calls = {
        "pallas": jax.jit(lambda t, i, c: eb.embedding_bag(t, i, c)),
        "xla": jax.jit(eb.embedding_bag_reference),
    }
    if dtype == "int8" and triton_int8_pool.available():
      calls["triton"] = jax.jit(triton_int8_pool.int8_pool)
    for impl in impls:
      if impl not in calls:
        continue
      fn = calls[impl]
      sec = _time(lambda fn=fn, table=table: fn(table, ids, coef), repeats)
      results.append({"dtype": dtype, "impl": impl, "ms": 1e3 * sec, "bytes": moved,
                      "bytes_per_s": moved / sec, "of_copy": moved / sec / copy_bw})
    del table
  return {"device": jax.devices()[0].device_kind, "copy_bytes_per_s": copy_bw,
          "config": dict(num_rows=num_rows, dim=dim, batch=batch, features=features,
                         bag_len=bag_len, zipf_alpha=zipf_alpha),
          "results": results}


def format_table(out: dict[str, Any]) -> str:
  lines = [f"{out['device']}: device copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s "
           f"(read + write); {out['config']}",
           f"{'dtype':>9} {'impl':>7} {'ms':>9} {'GB moved':>9} {'TB/s':>7} {'of copy':>8}"]
  for r in out["results"]:
    lines.append(f"{r['dtype']:>9} {r['impl']:>7} {r['ms']:9.3f} {r['bytes'] / 1e9:9.3f} "
                 f"{r['bytes_per_s'] / 1e12:7.3f} {r['of_copy']:8.1%}")
  return "\n".join(lines)


if __name__ == "__main__":
  try:
    result = bench_embedding_bag()
  except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
    raise SystemExit(1)
  print(format_table(result))
  print(json.dumps(result))
