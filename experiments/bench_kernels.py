r"""Pallas kernel benchmarks on one GPU, one function per kernel family.

  python -m experiments.bench_kernels                                # every family, GPU
  python -m experiments.bench_kernels --kernels=flash_attention --seq_lens=4096,8192
  python -m experiments.bench_kernels --interpret_check              # CPU: correctness only

embedding_bag: achieved bytes/s of `kernels.embedding_bag` (Pallas; fp32, bf16 and row-wise
int8 rows), the XLA gather + sum and the jax-triton int8 kernel, against a measured
device-to-device copy (target: at least 60% of it); see experiments/bench_kernels_embedding.py.

flash_attention: TFLOP/s of the forward and of the backward of `kernels.flash_attention`
("pallas") beside `jax.nn.dot_product_attention(implementation="xla")` and ("cudnn"), at
sequence lengths 4K, 8K, 16K, head dim 128, bf16, causal and not. As in the FlashAttention-2
paper (arXiv 2307.08691, Sec. 4.1) the batch shrinks as the sequence grows so that
batch x seq = --tokens (16K), with 16 heads of dim 128 (model dim 2048). FLOPs: forward
4 B H T S K (halved when causal), backward 2.5x forward (five matmuls against two);
backward time = time(forward + backward) - time(forward), both jitted, medians of repeats.
An implementation that fails (cuDNN missing, out of memory) is reported with its error.

Numbers need a GPU: on another backend the script refuses unless --interpret_check, which
runs each family's tiny kernel-vs-reference check in Pallas interpret mode and reports the
errors. Not yet run on a GPU (the session that wrote it had none).

Prints a table; writes results.json to --workdir; the last stdout line is a JSON summary.
To add a family: write its bench, check, table and summary functions (see `Family`) and
add it to FAMILIES; its flags go beside the others.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, NamedTuple

from absl import app, flags, logging

from core import results as results_lib

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["flash_attention", "embedding_bag"], "Kernel families to run (keys of FAMILIES).")
flags.DEFINE_bool("interpret_check", False,
                  "Tiny kernel-vs-reference check in Pallas interpret mode (works on CPU).")
flags.DEFINE_string("workdir", "runs/bench_kernels", "Where results.json goes.")
flags.DEFINE_integer("repeats", 5, "Timed repeats (median reported).")
flags.DEFINE_integer("steps", 10, "Calls per timed repeat.")
# flash_attention
flags.DEFINE_list("seq_lens", ["4096", "8192", "16384"], "Sequence lengths T = S.")
flags.DEFINE_integer("tokens", 16384, "batch x seq_len (batch = tokens // seq_len, at least 1).")
flags.DEFINE_integer("heads", 16, "Query heads H.")
flags.DEFINE_integer("kv_heads", 0, "Key/value heads G (0: = heads).")
flags.DEFINE_integer("head_dim", 128, "Head dim K.")
flags.DEFINE_string("dtype", "bfloat16", "Input dtype.")
flags.DEFINE_list("impls", ["pallas", "xla", "cudnn"], "Attention implementations.")
flags.DEFINE_list("causal", ["true", "false"], "Causal settings to run.")
flags.DEFINE_integer("block_q", 128, "Pallas forward block_q.")
flags.DEFINE_integer("block_k", 128, "Pallas forward block_k.")
# embedding_bag
flags.DEFINE_integer("eb_rows", 1_000_000, "Rows per table.")
flags.DEFINE_integer("eb_dim", 128, "Embedding dim.")
flags.DEFINE_integer("eb_batch", 8192, "Bags per feature.")
flags.DEFINE_integer("eb_features", 26, "Tables (features) in the flat buffer.")
flags.DEFINE_integer("eb_bag_len", 20, "Ids per bag.")
flags.DEFINE_list("eb_dtypes", ["float32", "bfloat16", "int8"], "Row formats.")


# ------------------------------------------------------------------------ flash attention


def _attention_fns(impl: str, causal: bool, block_q: int, block_k: int):
  """(fwd(q, k, v) -> out, fwd_bwd(q, k, v, do) -> (dq, dk, dv)), both jitted."""
  import jax

  if impl == "pallas":
    from kernels.flash_attention import flash_attention

    def attn(q, k, v):
      return flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                             interpret=False)[0]
  elif impl in ("xla", "cudnn"):
    def attn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
  else:
    raise ValueError(f"--impls: {impl!r}, expected pallas, xla or cudnn")

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)
  return jax.jit(attn), jax.jit(fwd_bwd)


def attention_flops(batch, seq_q, seq_k, heads, head_dim, causal):
  """(forward, backward) FLOPs under the FlashAttention-2 paper's convention."""
  fwd = 4 * batch * heads * seq_q * seq_k * head_dim * (0.5 if causal else 1.0)
  return fwd, 2.5 * fwd


def bench_flash_attention(cfg) -> list[dict]:
  """One row per (seq_len, causal, impl): ms and TFLOP/s of forward and backward."""
  import gc

  import jax
  import jax.numpy as jnp

  from core import benchmark

  rows = []
  dtype = jnp.dtype(cfg.dtype)
  heads, kv_heads, kd = cfg.heads, cfg.kv_heads or cfg.heads, cfg.head_dim
  for t in [int(x) for x in cfg.seq_lens]:
    batch = max(1, cfg.tokens // t)
    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (batch, t, heads, kd), dtype)
    k = jax.random.normal(keys[1], (batch, t, kv_heads, kd), dtype)
    v = jax.random.normal(keys[2], (batch, t, kv_heads, kd), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    for causal in [c.lower() in ("1", "true", "yes") for c in cfg.causal]:
      f_flops, b_flops = attention_flops(batch, t, t, heads, kd, causal)
      for impl in cfg.impls:
        row = {"kernel": "flash_attention", "impl": impl, "seq_len": t, "batch": batch,
               "heads": heads, "kv_heads": kv_heads, "head_dim": kd, "dtype": dtype.name,
               "causal": causal}
        try:
          fwd, fwd_bwd = _attention_fns(impl, causal, cfg.block_q, cfg.block_k)
          f_times, _ = benchmark.time_steps(lambda _: fwd(q, k, v), None, cfg.steps,
                                            cfg.repeats, warmup=2)
          fb_times, _ = benchmark.time_steps(lambda _: fwd_bwd(q, k, v, do), None, cfg.steps,
                                             cfg.repeats, warmup=2)
          f_s, fb_s = benchmark.median(f_times), benchmark.median(fb_times)
          b_s = max(fb_s - f_s, 1e-9)
          row.update(fwd_ms=1e3 * f_s, fwd_bwd_ms=1e3 * fb_s, bwd_ms=1e3 * b_s,
                     fwd_tflops=f_flops / f_s / 1e12, bwd_tflops=b_flops / b_s / 1e12)
          print(f"  T={t:>6} B={batch:>2} {'causal' if causal else 'full  '} {impl:>6}: "
                f"fwd {1e3 * f_s:8.2f} ms {row['fwd_tflops']:6.1f} TFLOP/s | "
                f"bwd {1e3 * b_s:8.2f} ms {row['bwd_tflops']:6.1f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on (cuDNN absent, OOM, ...)
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
          print(f"  T={t:>6} {impl:>6} causal={causal}: FAILED {row['error']}", flush=True)
        rows.append(row)
        gc.collect()
        jax.clear_caches()
  return rows


def check_flash_attention(dtypes=("float32", "bfloat16")) -> dict:
  """Kernel (interpret mode) vs reference on one tiny GQA, padded, causal case per dtype."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kernels.flash_attention import flash_attention, flash_attention_reference

  tols = {"float32": 1e-4, "bfloat16": 3e-2}
  report = {}
  for name in dtypes:
    dtype = jnp.dtype(name)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, 40, 4, 32), dtype)
    k = jax.random.normal(keys[1], (1, 40, 2, 32), dtype)
    v = jax.random.normal(keys[2], (1, 40, 2, 32), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)

    def run(fn):
      def f(q, k, v):
        (o, lse), vjp = jax.vjp(lambda *a: fn(*a, causal=True), q, k, v)
        return (o, lse) + vjp((do, jnp.zeros_like(lse)))
      return jax.jit(f)(q, k, v)

    got = run(lambda *a, **kw: flash_attention(*a, block_q=16, block_k=16, interpret=True, **kw))
    want = run(flash_attention_reference)
    errs = {}
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      errs[label] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))
    report[name] = {"rel_err": errs, "tol": tols[name],
                    "ok": all(e < tols[name] for e in errs.values())}
    print(f"  flash_attention {name:>8}: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
          + f"  (tol {tols[name]:.0e}) {'ok' if report[name]['ok'] else 'FAILED'}", flush=True)
  return report


def table_flash_attention(rows):
  print("\nflash_attention  impl      seq  batch  causal   fwd TFLOP/s  bwd TFLOP/s")
  for r in rows:
    f = f"{r['fwd_tflops']:11.1f}" if "fwd_tflops" in r else "     failed"
    b = f"{r['bwd_tflops']:11.1f}" if "bwd_tflops" in r else "     failed"
    print(f"                 {r['impl']:<6} {r['seq_len']:>6} {r['batch']:>5}  "
          f"{str(r['causal']):<6} {f}  {b}")


def summary_flash_attention(rows) -> dict:
  return {f"{r['impl']}/T{r['seq_len']}/{'causal' if r['causal'] else 'full'}":
          ({"fwd_tflops": round(r["fwd_tflops"], 1), "bwd_tflops": round(r["bwd_tflops"], 1)}
           if "fwd_tflops" in r else {"error": r["error"]}) for r in rows}


# ------------------------------------------------------------------------ embedding bag
# The timing code lives in experiments/bench_kernels_embedding.py (also runnable alone).

def bench_embedding_bag(cfg) -> list[dict]:
  from experiments.bench_kernels_embedding import bench_embedding_bag as bench, format_table
  out = bench(num_rows=cfg.eb_rows, dim=cfg.eb_dim, batch=cfg.eb_batch,
              features=cfg.eb_features, bag_len=cfg.eb_bag_len, dtypes=tuple(cfg.eb_dtypes),
              repeats=max(cfg.repeats, 5))
  print(format_table(out), flush=True)
  return [dict(r, copy_bytes_per_s=out["copy_bytes_per_s"], device=out["device"])
          for r in out["results"]]


def check_embedding_bag() -> dict:
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
    print(f"  embedding_bag {name:>8}: pooled {err:.1e}  (tol {tol:.0e}) "
          f"{'ok' if err < tol else 'FAILED'}", flush=True)
  return report


def table_embedding_bag(rows):
  print("\nembedding_bag  dtype     impl      ms    TB/s  of copy")
  for r in rows:
    print(f"               {r['dtype']:<9} {r['impl']:<7} {r['ms']:7.3f} "
          f"{r['bytes_per_s'] / 1e12:7.3f} {r['of_copy']:8.1%}")


def summary_embedding_bag(rows) -> dict:
  return {f"{r['impl']}/{r['dtype']}": {"ms": round(r["ms"], 4), "of_copy": round(r["of_copy"], 3)}
          for r in rows}


class Family(NamedTuple):
  """One kernel family: timed rows on a GPU, a tiny interpret-mode check, how to print."""
  bench: Callable[[Any], list[dict]]
  check: Callable[[], dict]       # {variant: {"rel_err": {...}, "tol": float, "ok": bool}}
  table: Callable[[list[dict]], None]
  summary: Callable[[list[dict]], dict]


FAMILIES = {
    "flash_attention": Family(bench_flash_attention, check_flash_attention,
                              table_flash_attention, summary_flash_attention),
    "embedding_bag": Family(bench_embedding_bag, check_embedding_bag,
                            table_embedding_bag, summary_embedding_bag),
}


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  import jax

  from core import benchmark

  unknown = [k for k in FLAGS.kernels if k not in FAMILIES]
  if unknown:
    raise app.UsageError(f"--kernels: {unknown} unknown, expected some of {sorted(FAMILIES)}")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  out = {"machine": benchmark.machine(), "flags": {
      k: FLAGS[k].value for k in ("kernels", "seq_lens", "tokens", "heads", "kv_heads",
                                  "head_dim", "dtype", "impls", "causal", "block_q", "block_k",
                                  "repeats", "steps", "interpret_check")}}

  if FLAGS.interpret_check:
    checks = {name: FAMILIES[name].check() for name in FLAGS.kernels}
    out["checks"] = checks
    ok = all(r["ok"] for c in checks.values() for r in c.values())
    results_lib.write_results(FLAGS.workdir, out)
    print(json.dumps({"interpret_check": "ok" if ok else "failed",
                      "rel_err": {n: {d: r["rel_err"] for d, r in c.items()}
                                  for n, c in checks.items()}}))
    sys.exit(0 if ok else 1)

  if jax.default_backend() != "gpu":
    msg = (f"bench_kernels: the default JAX backend is {jax.default_backend()!r}; kernel "
           "TFLOP/s need a GPU (the Pallas kernels only run interpreted here). Run it on a "
           "CUDA machine, or pass --interpret_check for a tiny correctness check.")
    print(msg, file=sys.stderr)
    print(json.dumps({"refused": msg}))
    sys.exit(2)

  results, summary = {}, {}
  for name in FLAGS.kernels:
    print(f"{name}:", flush=True)
    results[name] = FAMILIES[name].bench(FLAGS)
    summary[name] = FAMILIES[name].summary(results[name])
  for name in FLAGS.kernels:
    FAMILIES[name].table(results[name])
  out["results"] = results
  results_lib.write_results(FLAGS.workdir, out)
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
