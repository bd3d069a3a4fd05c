r"""Embedding-bag kernels against the GPU's memory bandwidth, by row format.

  python -m experiments.bench_kernels_embedding                     # on a GPU; refuses on CPU
  python -m experiments.bench_kernels_embedding --sweep             # + Pallas launch configs
  python -m experiments.bench_kernels_embedding --rows=500000 --dtypes=int8,int8_split

A pooled lookup is memory bound: each (bag, position) reads one row. `bench_embedding_bag`
times the table-batched kernels (`kernels.embedding_bag` in Pallas, the XLA gather +
einsum the collection uses by default (`embedding_bag_reference`), and for split int8 rows
the Triton kernel through jax-triton where it imports) on F tables of R rows in one flat
buffer, counts the bytes each call must move (rows read at the looked-up positions, ids
and coefficients read, pooled bags written) and reports them per second next to a
measured device-to-device copy (`device_copy_bandwidth`, read + write counted: ~3.0 TB/s
on an H100). Default size: the issue's 26 tables x 1M rows x dim 128, batch 8192, 20 ids
per bag; uniform ids over the tables make nearly every row read a cache miss, the case
the ratio is meant for (Zipf ids, `--zipf_alpha`, hit L2 and can exceed 1).

Row formats (`--dtypes`): float32, bfloat16, int8 (FBGEMM row-wise int8 in the kernel's
packed layout, `kernels.embedding_bag.pack_int8`: scale and bias inline, 16-byte rows)
and int8_split (codes, scale and bias in three arrays, `core.quant.RowwiseQuantized`).
Both int8 formats are charged D + 8 bytes per row read (codes, scale, bias), so their
figures compare directly; the packed row's 8 padding bytes are not counted as work.
int4 is FBGEMM's N-bit row (packed codes, fp16 scale and bias: D / 2 + 4 bytes),
dequantized in the kernel. int8_cache / int4_cache are the mixed-precision tables of
arXiv 2010.11305 (`rec/embedding/cached_storage.py`, `--cache_fraction` of the rows in an
fp32 LFU cache, 16-way set-associative, filled by one admission pass over the timed
batch's ids); their "pallas" and "xla" rows time the storage's whole lookup, the cache
search (each position's set: 16 tags read) plus the pooled gather, through
`pallas_pool` (int8 / int4 dequantized in the kernel, cached rows read in fp32) and
through `gather` + sum (the collection's XLA path); "pallas_kernel" times the kernel
alone, the slots found beforehand. A position served by the cache is
charged 4 D bytes, any other its quantized row; the tag reads are not counted as work.
The hit rate goes into the results. Compare their ms with float32's: that is the
lookup's cost of the mixed-precision table against fp32 rows.
`--sweep` adds a few Pallas launch configurations per format (rows in flight `unroll`,
bags per program, warps) beside the default one.

Every implementation runs in its own try: one that fails to compile or runs out of
memory is reported with its error and the others go on. Prints a table, writes
results.json to --workdir; the last stdout line is JSON. Not yet run on a GPU.

Letters: B batch, F features (tables), L ids per bag, R rows per table, D dim.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Sequence

from absl import flags, logging
from core import cli

FORMATS = ("float32", "bfloat16", "int8", "int8_split", "int4", "int8_cache", "int4_cache")
CACHED = {"int8_cache": 8, "int4_cache": 4}
# Pallas launch configs tried by --sweep, beside the default (None), per row format.
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


def _error(e: BaseException) -> str:
  msg = str(e).strip().splitlines()
  return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


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

  from rec.embedding import cached_storage
  storage = cached_storage.CachedQuantizedStorage(bits=CACHED[fmt], policy="lfu",
                                                  fraction=fraction)
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
                        cache_fraction: float | None = None) -> dict[str, Any]:
  """Achieved bytes/s of each lookup implementation vs the device copy bandwidth.

  One flat buffer of `features` tables of `num_rows` rows, full bags of `bag_len` ids
  (ids offset into the buffer beforehand). Returns {"copy_bytes_per_s", "results": [...]}
  with one row per (dtype, impl[, config]): seconds per call, bytes moved, bytes/s and
  the fraction of the copy bandwidth, or "error" for a run that failed. "triton" runs for
  int8_split only, and only where jax_triton imports. cache_fraction: the cached formats'
  cache size (None: the paper's, int8 5%, int4 1%). Raises RuntimeError on a non-GPU
  backend.
  """
  _require_gpu("bench_embedding_bag")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from core import quant
  from kernels import embedding_bag as eb
  from kernels import triton_int8_pool

  unknown = [d for d in dtypes if d not in FORMATS]
  if unknown:
    raise ValueError(f"bench_embedding_bag: dtypes {unknown}, expected some of {FORMATS}")
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

  key = jax.random.key(seed)
  results = []
  for fmt in dtypes:
    positions = batch * features * bag_len
    extra: dict[str, Any] = {}
    try:   # one table at a time (26 x 1M x 128 float32 is 13 GB)
      if fmt in CACHED:
        from rec.embedding import cached_storage
        frac = cache_fraction or cached_storage.DEFAULT_FRACTION[CACHED[fmt]]
        storage, table = _make_cached(fmt, total_rows, dim, key, ids, frac)
        hits = int(jnp.sum(storage.cache_slots(table, ids) >= 0))
        q_bytes = (dim if CACHED[fmt] == 8 else -(-dim // 2)) + (8 if CACHED[fmt] == 8 else 4)
        rows_read = hits * 4 * dim + (positions - hits) * q_bytes
        extra = {"cache_fraction": frac, "hit_rate": hits / positions}
      else:
        table = _make_table(fmt, total_rows, dim, key)
        row_bytes = {"int4": -(-dim // 2) + 4}.get(
            fmt, dim + 8 if fmt.startswith("int8") else dim * jnp.dtype(fmt).itemsize)
        rows_read = positions * row_bytes
    except Exception as e:  # noqa: BLE001 - report and go on (out of memory, ...)
      results.append({"dtype": fmt, "impl": "-", "error": _error(e)})
      print(f"  {fmt}: table FAILED {results[-1]['error']}", flush=True)
      continue
    moved = rows_read + positions * 8 + batch * features * dim * 4   # rows, ids + coef, out
    calls: dict[str, Callable] = {}
    if fmt in CACHED:
      if "pallas" in impls:
        calls["pallas"] = jax.jit(lambda t, i, c, storage=storage: storage.pallas_pool(t, i, c))
        # The kernel alone, its cache slots found beforehand (what the search costs is the
        # difference to "pallas").
        slots = storage.cache_slots(table, ids)
        calls["pallas_kernel"] = jax.jit(
            lambda t, i, c, slots=slots, storage=storage: eb.embedding_bag(
                quant.RowwiseQuantized(t["q"], t["scale"], t["bias"], storage.bits, dim), i, c,
                cache_rows=t["cache_rows"], cache_slots=slots))
      if "xla" in impls:
        calls["xla"] = jax.jit(lambda t, i, c, storage=storage: jnp.einsum(
            "...l,...ld->...d", c, storage.gather(t, i, clip=True)))
    if "pallas" in impls and fmt not in CACHED:
      for cfg in (None,) + (SWEEP[fmt] if sweep else ()):
        name = "pallas" if cfg is None else "pallas[" + ",".join(
            f"{k}={v}" for k, v in cfg.items()) + "]"
        calls[name] = jax.jit(lambda t, i, c, cfg=cfg: eb.embedding_bag(t, i, c, **(cfg or {})))
    if "xla" in impls and fmt not in CACHED:
      calls["xla"] = jax.jit(eb.embedding_bag_reference)
    if "triton" in impls and fmt == "int8_split" and triton_int8_pool.available():
      calls["triton"] = jax.jit(triton_int8_pool.int8_pool)
    for impl, fn in calls.items():
      row = {"dtype": fmt, "impl": impl, "bytes": moved, **extra}
      try:
        sec = _time(lambda fn=fn: fn(table, ids, coef), repeats)
        row.update(ms=1e3 * sec, bytes_per_s=moved / sec, of_copy=moved / sec / copy_bw)
        print(f"  {fmt:>10} {impl:<40} {1e3 * sec:8.3f} ms {row['of_copy']:7.1%} of copy",
              flush=True)
      except Exception as e:  # noqa: BLE001 - a failed compile or OOM must not end the run
        row["error"] = _error(e)
        print(f"  {fmt:>10} {impl:<40} FAILED {row['error']}", flush=True)
      results.append(row)
    del table
    jax.clear_caches()
  return {"device": jax.devices()[0].device_kind, "copy_bytes_per_s": copy_bw,
          "config": dict(num_rows=num_rows, dim=dim, batch=batch, features=features,
                         bag_len=bag_len, zipf_alpha=zipf_alpha),
          "results": results}


def format_table(out: dict[str, Any]) -> str:
  lines = [f"{out['device']}: device copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s "
           f"(read + write); {out['config']}",
           f"{'dtype':>10} {'impl':<40} {'ms':>9} {'GB moved':>9} {'TB/s':>7} {'of copy':>8}"]
  for r in out["results"]:
    if "error" in r:
      lines.append(f"{r['dtype']:>10} {r['impl']:<40} failed: {r['error']}")
      continue
    hit = f"  (cache {r['cache_fraction']:g}: {r['hit_rate']:.1%} of lookups)" if "hit_rate" in r else ""
    lines.append(f"{r['dtype']:>10} {r['impl']:<40} {r['ms']:9.3f} {r['bytes'] / 1e9:9.3f} "
                 f"{r['bytes_per_s'] / 1e12:7.3f} {r['of_copy']:8.1%}{hit}")
  return "\n".join(lines)


def summary(out: dict[str, Any]) -> dict[str, Any]:
  """{dtype/impl: of_copy (or the error)} plus the copy bandwidth, for the JSON line."""
  rows = {f"{r['dtype']}/{r['impl']}": (round(r["of_copy"], 3) if "of_copy" in r
                                       else r["error"]) for r in out["results"]}
  return {"device": out["device"], "copy_tb_per_s": round(out["copy_bytes_per_s"] / 1e12, 3),
          "of_copy": rows}


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined only when run as a script: experiments.bench_kernels
  imports this module and has flags of the same names."""
  flags.DEFINE_integer("rows", 1_000_000, "Rows per table.")
  flags.DEFINE_integer("dim", 128, "Embedding dim D.")
  flags.DEFINE_integer("batch", 8192, "Bags per feature.")
  flags.DEFINE_integer("features", 26, "Tables (features) in the flat buffer.")
  flags.DEFINE_integer("bag_len", 20, "Ids per bag.")
  flags.DEFINE_list("dtypes", list(FORMATS), f"Row formats, some of {FORMATS}.")
  flags.DEFINE_list("impls", ["pallas", "xla", "triton"], "Implementations.")
  flags.DEFINE_float("zipf_alpha", 0.0, "Zipf exponent of the ids (0: uniform).")
  flags.DEFINE_integer("repeats", 20, "Timed calls (median reported).")
  flags.DEFINE_bool("sweep", False, "Also time a few Pallas launch configs per format.")
  flags.DEFINE_float("cache_fraction", None, "int8_cache / int4_cache: cache size as a fraction "
                     "of the rows (default: int8 0.05, int4 0.01).")
  flags.DEFINE_string("workdir", "runs/bench_kernels_embedding", "Where results.json goes.")


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from core import benchmark
  from core import results as results_lib
  try:
    out = bench_embedding_bag(FLAGS.rows, FLAGS.dim, FLAGS.batch, FLAGS.features, FLAGS.bag_len,
                              tuple(FLAGS.dtypes), tuple(FLAGS.impls), FLAGS.zipf_alpha or None,
                              FLAGS.repeats, FLAGS.sweep, cache_fraction=FLAGS.cache_fraction)
  except RuntimeError as e:
    print(str(e), file=sys.stderr)
    print(json.dumps({"refused": str(e)}))
    sys.exit(2)
  print(format_table(out))
  os.makedirs(FLAGS.workdir, exist_ok=True)
  results_lib.write_results(FLAGS.workdir, {**out, "machine": benchmark.machine()})
  print(json.dumps(summary(out)))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
