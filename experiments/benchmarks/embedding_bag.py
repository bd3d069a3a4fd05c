"""Embedding-bag lookups against the device's memory bandwidth and XLA's gather, by row
format, and a tiny interpret-mode check of the kernel against its reference.

A pooled lookup is memory bound: each (bag, position) reads one row. `bench_embedding_bag`
times the table-batched kernels (`kernels.embedding_bag` in Pallas, the XLA gather +
einsum the collection uses by default (`embedding_bag_reference`), and for split int8 rows
the Triton kernel through jax-triton where it imports) on F tables of R rows in one flat
buffer, counts the bytes each call must move (rows read at the looked-up positions, ids
and coefficients read, pooled bags written) and reports them per second next to a
measured device-to-device copy (`core.benchmark.copy_bandwidth`, read + write counted).
Uniform ids over the tables make nearly every row read a cache miss, the case the ratio
is meant for (Zipf ids hit L2 and can exceed 1).

Row formats: float32, bfloat16, int8 (FBGEMM row-wise int8 in the kernel's packed layout,
`kernels.embedding_bag.pack_int8`: scale and bias inline, 16-byte rows), int8_split
(codes, scale and bias in three arrays, `core.quant.RowwiseQuantized`), int4 (FBGEMM's
N-bit row: packed codes, fp16 scale and bias, D / 2 + 4 bytes, dequantized in the kernel),
and int8_cache / int4_cache: the mixed-precision tables of arXiv 2010.11305
(`rec/embedding/rowwise_storage.py`, a fraction of the rows in an fp32 LFU cache filled
by one admission pass over the timed batch's ids). Both int8 formats are charged D + 8
bytes per row read; a cached position 4 D, any other its quantized row; the cache's tag
reads and the packed row's padding are not counted as work. The cached formats' "pallas"
and "xla" rows time the storage's whole lookup (cache search + pooled gather);
"pallas_kernel" times the kernel alone, its slots found beforehand.

Letters: B batch, F features (tables), L ids per bag, R rows per table, D dim.
"""

from __future__ import annotations

import functools
import gc
import math
import time
from typing import Any, Callable, Sequence

from experiments.benchmarks.attention import error_text

FORMATS = ("float32", "bfloat16", "int8", "int8_split", "int4", "int8_cache", "int4_cache")
CACHED = {"int8_cache": 8, "int4_cache": 4}
# Pallas launch configs tried by sweep=True, beside the default (None), per row format.
SWEEP = {
    "float32": ({"unroll": 2}, {"block_bags": 16, "unroll": 2}, {"num_warps": 8, "block_bags": 64}),
    "bfloat16": ({"unroll": 1}, {"unroll": 4}, {"num_warps": 8, "block_bags": 64, "unroll": 2}),
    "int8": ({"unroll": 2}, {"unroll": 8, "block_bags": 16}, {"num_warps": 8, "block_bags": 64},
             {"num_warps": 8, "block_bags": 64, "unroll": 4}),
    "int8_split": ({"unroll": 1}, {"unroll": 8, "block_bags": 16}),
    "int4": ({"unroll": 8}, {"num_warps": 8, "block_bags": 64, "unroll": 4}),
    "int8_cache": (),
    "int4_cache": (),
}
_print = functools.partial(print, flush=True)


def require_gpu(what: str) -> None:
  """Raises RuntimeError unless JAX's default backend is a GPU."""
  import jax
  backend = jax.default_backend()
  if backend != "gpu":
    raise RuntimeError(
        f"{what} measures GPU memory bandwidth, but JAX's default backend is {backend!r}: "
        "on CPU the Pallas kernel runs in its interpreter (the kernel emulated as an XLA loop "
        "over its grid) and the numbers would say nothing about the kernel. Run it on a GPU.")


def stored_row_bytes(fmt: str, dim: int) -> int:
  """Bytes one row occupies in the buffer (the int8 packed row padded to 16 bytes)."""
  if fmt == "float32":
    return 4 * dim
  if fmt == "bfloat16":
    return 2 * dim
  if fmt == "int8":
    return -(-(dim + 8) // 16) * 16
  if fmt in ("int8_split", "int8_cache"):
    return dim + 8
  if fmt in ("int4", "int4_cache"):
    return -(-dim // 2) + 4
  raise ValueError(f"stored_row_bytes: format {fmt!r}, expected one of {FORMATS}")


def read_row_bytes(fmt: str, dim: int) -> int:
  """Bytes of work per row read: the int8 formats D + 8 (codes, scale, bias), int4 D / 2 + 4."""
  if fmt.startswith("int8"):
    return dim + 8
  if fmt.startswith("int4"):
    return -(-dim // 2) + 4
  return stored_row_bytes(fmt, dim)


def _make_table(fmt: str, total_rows: int, dim: int, key):
  """The flat buffer in format `fmt`, drawn on device (float32 rows, then converted)."""
  import jax
  import jax.numpy as jnp

  from core import quant
  from kernels import embedding_bag as eb
  rows32 = jax.random.uniform(key, (total_rows, dim), jnp.float32, -0.01, 0.01)
  if fmt == "int4":
    return quant.quantize_rowwise_int4(rows32)
  if fmt in ("int8", "int8_split"):
    table = quant.quantize_rowwise_int8(rows32)
    del rows32
    return eb.pack_int8(table) if fmt == "int8" else table
  return rows32 if fmt == "float32" else rows32.astype(fmt)


def _make_cached(fmt: str, total_rows: int, dim: int, key, ids, fraction: float):
  """(storage, state) of a cached mixed-precision buffer whose cache was filled by one
  LFU admission pass over the distinct `ids`."""
  import jax
  import jax.numpy as jnp

  from rec.embedding import storage_spec
  spec = storage_spec.StorageSpec.parse(f"{fmt}:lfu:{fraction}", where="embedding bag format")
  storage = storage_spec.make_storage(spec)
  state = storage.from_float(jax.random.uniform(key, (total_rows, dim), jnp.float32, -0.01,
                                                0.01))
  flat = ids.reshape(-1)
  uniq, counts = jnp.unique(flat, return_counts=True, size=flat.size, fill_value=total_rows)
  state = jax.jit(storage.prepare_update)(state, uniq.astype(jnp.int32),
                                          counts.astype(jnp.int32), jnp.int32(0))
  return storage, state


def bench_embedding_bag(num_rows: int = 1_000_000, dim: int = 128, batch: int = 8192,
                        features: int = 26, bag_len: int = 20,
                        dtypes: Sequence[str] = FORMATS,
                        impls: Sequence[str] = ("pallas", "xla", "triton"),
                        zipf_alpha: float | None = None, repeats: int = 20,
                        sweep: bool = False, seed: int = 0,
                        cache_fraction: float | None = None,
                        min_buffer_bytes: int = 0, copy_bytes_per_s: float | None = None,
                        interpret: bool | None = None, gpu_only: bool = True,
                        deadline: float | None = None, warmup: int = 2,
                        log: Callable[[str], None] = _print) -> dict[str, Any]:
  """Achieved bytes/s of each lookup implementation vs the device copy bandwidth.

  One flat buffer of `features` tables of `num_rows` rows per format (raised per format so
  that the buffer holds at least `min_buffer_bytes`), full bags of `bag_len` ids (ids
  offset into the buffer beforehand). Returns {"device", "copy_bytes_per_s", "config",
  "results": one row per (dtype, impl[, config]): seconds per call, bytes moved, bytes/s,
  the fraction of the copy bandwidth and the buffer's bytes, or "error" for a run that
  failed ("skipped" past `deadline`, a time.monotonic() value)}. "triton" runs for
  int8_split only, where jax_triton imports. cache_fraction: the cached formats' cache
  size (None: the paper's, int8 5%, int4 1%). copy_bytes_per_s: a copy bandwidth measured
  beforehand (None: measured here). gpu_only: raise RuntimeError off a GPU (the CPU dry
  run of experiments.gpu_report passes False and interpret=True).
  """
  if gpu_only:
    require_gpu("bench_embedding_bag")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from core import benchmark
  from core import quant
  from kernels import embedding_bag as eb
  from kernels import triton_int8_pool
  from rec.embedding import rowwise_storage

  unknown = [d for d in dtypes if d not in FORMATS]
  if unknown:
    raise ValueError(f"bench_embedding_bag: dtypes {unknown}, expected some of {FORMATS}")
  rng = np.random.default_rng(seed)
  copy_bw = copy_bytes_per_s or benchmark.copy_bandwidth(1 << 30 if gpu_only else 1 << 20)
  key = jax.random.key(seed)
  positions = batch * features * bag_len
  results = []
  for fmt in dtypes:
    if deadline is not None and time.monotonic() > deadline:
      results.append({"dtype": fmt, "impl": "-", "skipped": "the part's time budget ran out"})
      continue
    rows_per_table = max(num_rows, math.ceil(min_buffer_bytes
                                             / (features * stored_row_bytes(fmt, dim))))
    total_rows = features * rows_per_table
    if zipf_alpha:
      from rec.data.synthetic import zipf_ids
      local = zipf_ids(rng, rows_per_table, (batch, features, bag_len), zipf_alpha)
    else:
      local = rng.integers(0, rows_per_table, (batch, features, bag_len), dtype=np.int32)
    offsets = (np.arange(features, dtype=np.int64) * rows_per_table)[None, :, None]
    ids = jnp.asarray((local + offsets).astype(np.int32))
    coef = jnp.asarray(rng.uniform(0.5, 1.5, ids.shape).astype(np.float32))
    extra: dict[str, Any] = {"rows_per_table": rows_per_table}
    try:   # one table at a time (26 x 1M x 128 float32 is 13 GB)
      if fmt in CACHED:
        frac = cache_fraction or rowwise_storage.DEFAULT_FRACTION[CACHED[fmt]]
        storage, table = _make_cached(fmt, total_rows, dim, key, ids, frac)
        hits = int(jnp.sum(storage.cache_slots(table, ids) >= 0))
        rows_read = hits * 4 * dim + (positions - hits) * read_row_bytes(fmt, dim)
        extra.update(cache_fraction=frac, hit_rate=hits / positions)
      else:
        table = _make_table(fmt, total_rows, dim, key)
        rows_read = positions * read_row_bytes(fmt, dim)
      extra["buffer_bytes"] = int(sum(getattr(x, "nbytes", 0)
                                      for x in jax.tree.leaves(table)))
    except Exception as e:  # noqa: BLE001 - report and go on (out of memory, ...)
      results.append({"dtype": fmt, "impl": "-", "error": error_text(e), **extra})
      log(f"  {fmt}: table FAILED {results[-1]['error']}")
      continue
    moved = rows_read + positions * 8 + batch * features * dim * 4   # rows, ids + coef, out
    calls: dict[str, Callable] = {}
    if fmt in CACHED:
      if "pallas" in impls:
        calls["pallas"] = jax.jit(lambda t, i, c, storage=storage: storage.pallas_pool(t, i, c))
        slots = storage.cache_slots(table, ids)
        calls["pallas_kernel"] = jax.jit(
            lambda t, i, c, slots=slots, storage=storage: eb.embedding_bag(
                quant.RowwiseQuantized(t["q"], t["scale"], t["bias"], storage.bits, dim), i, c,
                cache_rows=t["cache_rows"], cache_slots=slots, interpret=interpret))
      if "xla" in impls:
        calls["xla"] = jax.jit(lambda t, i, c, storage=storage: jnp.einsum(
            "...l,...ld->...d", c, storage.gather(t, i, clip=True)))
    if "pallas" in impls and fmt not in CACHED:
      for cfg in (None,) + (SWEEP[fmt] if sweep else ()):
        name = "pallas" if cfg is None else "pallas[" + ",".join(
            f"{k}={v}" for k, v in cfg.items()) + "]"
        calls[name] = jax.jit(lambda t, i, c, cfg=cfg: eb.embedding_bag(
            t, i, c, interpret=interpret, **(cfg or {})))
    if "xla" in impls and fmt not in CACHED:
      calls["xla"] = jax.jit(eb.embedding_bag_reference)
    if "triton" in impls and fmt == "int8_split" and triton_int8_pool.available():
      calls["triton"] = jax.jit(triton_int8_pool.int8_pool)
    for impl, fn in calls.items():
      row = {"dtype": fmt, "impl": impl, "bytes": moved, **extra}
      try:
        sec = benchmark.time_call(lambda fn=fn: fn(table, ids, coef), repeats, warmup)
        row.update(ms=1e3 * sec, bytes_per_s=moved / sec, of_copy=moved / sec / copy_bw)
        log(f"  {fmt:>10} {impl:<40} {1e3 * sec:8.3f} ms {row['of_copy']:7.1%} of copy")
      except Exception as e:  # noqa: BLE001 - a failed compile or OOM must not end the run
        row["error"] = error_text(e)
        log(f"  {fmt:>10} {impl:<40} FAILED {row['error']}")
      results.append(row)
    del table, calls
    gc.collect()
    jax.clear_caches()
  return {"device": jax.devices()[0].device_kind, "copy_bytes_per_s": copy_bw,
          "config": dict(num_rows=num_rows, dim=dim, batch=batch, features=features,
                         bag_len=bag_len, zipf_alpha=zipf_alpha,
                         min_buffer_bytes=min_buffer_bytes),
          "results": results}


def format_table(out: dict[str, Any]) -> str:
  lines = [f"{out['device']}: device copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s "
           f"(read + write); {out['config']}",
           f"{'dtype':>10} {'impl':<40} {'ms':>9} {'GB moved':>9} {'TB/s':>7} {'of copy':>8}"
           f" {'buffer GiB':>10}"]
  for r in out["results"]:
    if "error" in r or "skipped" in r:
      lines.append(f"{r['dtype']:>10} {r['impl']:<40} "
                   + (f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"))
      continue
    hit = (f"  (cache {r['cache_fraction']:g}: {r['hit_rate']:.1%} of lookups)"
           if "hit_rate" in r else "")
    lines.append(f"{r['dtype']:>10} {r['impl']:<40} {r['ms']:9.3f} {r['bytes'] / 1e9:9.3f} "
                 f"{r['bytes_per_s'] / 1e12:7.3f} {r['of_copy']:8.1%} "
                 f"{r.get('buffer_bytes', 0) / 2**30:10.2f}{hit}")
  return "\n".join(lines)


def summary(out: dict[str, Any]) -> dict[str, Any]:
  """{dtype/impl: of_copy (or the error)} plus the copy bandwidth, for the JSON line."""
  rows = {f"{r['dtype']}/{r['impl']}": (round(r["of_copy"], 3) if "of_copy" in r
                                       else r.get("error", r.get("skipped")))
          for r in out["results"]}
  return {"device": out["device"], "copy_tb_per_s": round(out["copy_bytes_per_s"] / 1e12, 3),
          "of_copy": rows}


def check_embedding_bag(log: Callable[[str], None] = _print) -> dict:
  """Kernel (interpret mode) vs reference: multi-hot padded bags over 3 tables, per dtype."""
  import jax.numpy as jnp
  import numpy as np

  from core import quant
  from kernels import embedding_bag as eb

  rng = np.random.default_rng(0)
  rows = jnp.asarray(rng.normal(size=(3 * 50, 24)).astype(np.float32))
  ids = jnp.asarray(rng.integers(0, 150, (8, 3, 5)).astype(np.int32))
  coef = jnp.asarray(np.where(rng.random((8, 3, 5)) < 0.7, rng.uniform(0.5, 1.5, (8, 3, 5)),
                              0.0).astype(np.float32))
  report = {}
  for name, table, tol in (("float32", rows, 1e-5), ("bfloat16", rows.astype(jnp.bfloat16), 1e-5),
                           ("int8", quant.quantize_rowwise_int8(rows), 1e-5)):
    got = np.asarray(eb.embedding_bag(table, ids, coef, interpret=True), np.float64)
    want = np.asarray(eb.embedding_bag_reference(table, ids, coef), np.float64)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))
    report[name] = {"rel_err": {"pooled": err}, "tol": tol, "ok": err < tol}
    log(f"  embedding_bag {name:>8}: pooled {err:.1e}  (tol {tol:.0e}) "
        f"{'ok' if err < tol else 'FAILED'}")
  return report


__all__ = ["CACHED", "FORMATS", "SWEEP", "bench_embedding_bag", "check_embedding_bag",
           "format_table", "read_row_bytes", "require_gpu", "stored_row_bytes", "summary"]
