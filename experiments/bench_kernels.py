r"""Kernel benchmarks on one GPU, one function per kernel family.

  python -m experiments.bench_kernels                                # every family, GPU
  python -m experiments.bench_kernels --kernels=flash_attention --seq_lens=4096,8192
  python -m experiments.bench_kernels --kernels=flash_attention --head_dims=128 \
      --mgpu_configs=64x128x2:fused,64x128x2:split,64x64x3
  python -m experiments.bench_kernels --interpret_check              # CPU: correctness only

flash_attention: TFLOP/s of the forward and of the backward of the Pallas kernels, "mgpu"
(`kernels/flash_attention_mgpu.py`, Mosaic GPU, Hopper) and "triton"
(`kernels/flash_attention_triton.py`), beside cuDNN (`jax.nn.dot_product_attention(
implementation="cudnn")`) and XLA ("xla"), at sequence lengths 4K, 8K, 16K, head dims 128 and
64, bf16, causal and not. As in the FlashAttention-2 paper (arXiv 2307.08691, Sec. 4.1) the
batch shrinks as the sequence grows so that batch x seq = --tokens (16K), with 16 heads.
FLOPs: forward 4 B H T S K (halved when causal), backward 2.5x forward (five matmuls against
two); backward time = time(forward + backward) - time(forward), both jitted, medians of
repeats. Each row also gives its ratio to cuDNN on the same shape, and the table says
whether the Mosaic GPU kernel meets its targets (forward >= 0.9x cuDNN, backward >= 0.8x;
the best of --mgpu_configs counts). An implementation that fails (compile error, cuDNN or
jax-triton missing, out of memory) is reported with its error and the run goes on.

embedding_bag: achieved bytes/s of `kernels.embedding_bag` (Pallas), the XLA gather + sum and
the jax-triton int8 kernel against a measured device-to-device copy (target: at least 60% of
it); see experiments/bench_kernels_embedding.py. A family that fails as a whole is reported
and the others still run.

Numbers need a GPU: on another backend the script refuses unless --interpret_check, which
runs each family's tiny kernel-vs-reference check in Pallas interpret mode (the Mosaic GPU
kernel in Pallas's GPU interpreter) and reports the errors.

Prints a table; writes results.json to --workdir; the last stdout line is a JSON summary.
To add a family: write its bench, check, table and summary functions (see `Family`) and
add it to FAMILIES; its flags go beside the others.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, NamedTuple

# Pallas's GPU interpreter (--interpret_check) runs each warpgroup on its own XLA CPU thread;
# the CPU client's pool must have more threads than a 2-core machine gives by default. Only
# read when the CPU client starts.
os.environ.setdefault("PJRT_NPROC", "16")

from absl import app, flags, logging  # noqa: E402

from core import cli
from core import results as results_lib  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
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
  flags.DEFINE_list("head_dims", ["128", "64"], "Head dims K.")
  flags.DEFINE_string("dtype", "bfloat16", "Input dtype.")
  flags.DEFINE_list("impls", ["mgpu", "triton", "cudnn", "xla"],
                    "Attention implementations: mgpu, triton, pallas (the backend's choice of "
                    "the two), cudnn, xla.")
  flags.DEFINE_list("causal", ["true", "false"], "Causal settings to run.")
  flags.DEFINE_integer("block_q", 128, "Triton kernel forward block_q.")
  flags.DEFINE_integer("block_k", 128, "Triton kernel forward block_k.")
  flags.DEFINE_list("mgpu_configs", ["64x128x2"],
                    "Mosaic GPU configs to time, each BLOCK_QxBLOCK_KVxSTAGES[:split|fused]: "
                    "forward tiling (block_q rows per compute warpgroup) and backward variant "
                    "(default fused at head dim 128, split at 64).")
  # embedding_bag
  flags.DEFINE_integer("eb_rows", 1_000_000, "Rows per table.")
  flags.DEFINE_integer("eb_dim", 128, "Embedding dim.")
  flags.DEFINE_integer("eb_batch", 8192, "Bags per feature.")
  flags.DEFINE_integer("eb_features", 26, "Tables (features) in the flat buffer.")
  flags.DEFINE_integer("eb_bag_len", 20, "Ids per bag.")
  flags.DEFINE_list("eb_dtypes", ["float32", "bfloat16", "int8", "int8_split"], "Row formats.")


ATTENTION_IMPLS = ("mgpu", "triton", "pallas", "cudnn", "xla")
# Mosaic GPU kernel vs cuDNN, same shape (issue 11): forward and backward.
MGPU_TARGETS = {"fwd": 0.9, "bwd": 0.8}


def _error(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ------------------------------------------------------------------------ flash attention


def parse_mgpu_config(text: str) -> dict:
  """"64x128x2" -> {"block_q": 64, "block_kv": 128, "stages": 2}; "64x128x2:split" also
  sets the backward ("split" or "fused"; default: fused at head dim 128, else split)."""
  tiles, _, bwd = text.lower().partition(":")
  try:
    bq, bk, st = (int(x) for x in tiles.split("x"))
  except ValueError:
    raise app.UsageError(f"--mgpu_configs: {text!r}, expected BLOCK_QxBLOCK_KVxSTAGES[:BWD] "
                         "such as 64x128x2 or 64x128x2:split") from None
  if bwd not in ("", "split", "fused"):
    raise app.UsageError(f"--mgpu_configs: {text!r}, the backward after ':' must be split "
                         "or fused")
  return {"block_q": bq, "block_kv": bk, "stages": st, **({"bwd": bwd} if bwd else {})}


def _impl_label(impl: str, mgpu_cfg: dict | None, n_cfgs: int) -> str:
  if impl != "mgpu" or n_cfgs <= 1:
    return impl
  bwd = f":{mgpu_cfg['bwd']}" if "bwd" in mgpu_cfg else ""
  return "mgpu[{block_q}x{block_kv}x{stages}".format(**mgpu_cfg) + bwd + "]"


def _attention_fns(impl: str, causal: bool, block_q: int, block_k: int,
                   mgpu_cfg: dict | None = None):
  """(fwd(q, k, v) -> out, fwd_bwd(q, k, v, do) -> (dq, dk, dv)), both jitted."""
  import jax

  if impl == "mgpu":
    from kernels.flash_attention_mgpu import flash_attention_mgpu

    def attn(q, k, v):
      return flash_attention_mgpu(q, k, v, causal=causal, interpret=False, **(mgpu_cfg or {}))[0]
  elif impl == "triton":
    from kernels.flash_attention_triton import flash_attention_triton

    def attn(q, k, v):
      return flash_attention_triton(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                    interpret=False)[0]
  elif impl == "pallas":
    from kernels.flash_attention import flash_attention

    def attn(q, k, v):
      return flash_attention(q, k, v, causal=causal, interpret=False)[0]
  elif impl in ("xla", "cudnn"):
    def attn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
  else:
    raise ValueError(f"--impls: {impl!r}, expected some of {ATTENTION_IMPLS}")

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)
  return jax.jit(attn), jax.jit(fwd_bwd)


def attention_flops(batch, seq_q, seq_k, heads, head_dim, causal):
  """(forward, backward) FLOPs under the FlashAttention-2 paper's convention."""
  fwd = 4 * batch * heads * seq_q * seq_k * head_dim * (0.5 if causal else 1.0)
  return fwd, 2.5 * fwd


def _shape_key(r) -> str:
  return f"T{r['seq_len']}/{'causal' if r['causal'] else 'full'}/hd{r['head_dim']}"


def add_cudnn_ratios(rows: list[dict]) -> None:
  """Adds fwd_vs_cudnn / bwd_vs_cudnn to every timed row whose shape has a cuDNN row."""
  cudnn = {_shape_key(r): r for r in rows if r["impl"] == "cudnn" and "fwd_tflops" in r}
  for r in rows:
    ref = cudnn.get(_shape_key(r))
    if ref is not None and "fwd_tflops" in r:
      r["fwd_vs_cudnn"] = r["fwd_tflops"] / ref["fwd_tflops"]
      r["bwd_vs_cudnn"] = r["bwd_tflops"] / ref["bwd_tflops"]


def mgpu_targets(rows: list[dict]) -> dict[str, dict]:
  """Per shape: the best Mosaic GPU row's ratios to cuDNN and whether each target is met
  ("met", "missed", or "unmeasured" when the kernel or cuDNN has no number)."""
  out = {}
  for key in dict.fromkeys(_shape_key(r) for r in rows):
    mg = [r for r in rows if _shape_key(r) == key and r["impl"].startswith("mgpu")]
    if not mg:
      continue
    timed = [r for r in mg if "fwd_vs_cudnn" in r]
    entry = {}
    for part in ("fwd", "bwd"):
      if not timed:
        entry[part] = {"ratio": None, "target": MGPU_TARGETS[part], "status": "unmeasured"}
        continue
      best = max(r[f"{part}_vs_cudnn"] for r in timed)
      entry[part] = {"ratio": round(best, 3), "target": MGPU_TARGETS[part],
                     "status": "met" if best >= MGPU_TARGETS[part] else "missed"}
    out[key] = entry
  return out


def bench_flash_attention(cfg) -> list[dict]:
  """One row per (seq_len, head_dim, causal, impl): ms and TFLOP/s of forward and backward."""
  import gc

  import jax
  import jax.numpy as jnp

  from core import benchmark

  rows = []
  dtype = jnp.dtype(cfg.dtype)
  unknown = [i for i in cfg.impls if i not in ATTENTION_IMPLS]
  if unknown:
    raise app.UsageError(f"--impls: {unknown}, expected some of {ATTENTION_IMPLS}")
  mgpu_cfgs = [parse_mgpu_config(c) for c in cfg.mgpu_configs]
  heads, kv_heads = cfg.heads, cfg.kv_heads or cfg.heads
  runs = [(impl, mc) for impl in cfg.impls
          for mc in (mgpu_cfgs if impl == "mgpu" else [None])]
  for kd in [int(x) for x in cfg.head_dims]:
    for t in [int(x) for x in cfg.seq_lens]:
      batch = max(1, cfg.tokens // t)
      keys = jax.random.split(jax.random.key(t), 4)
      q = jax.random.normal(keys[0], (batch, t, heads, kd), dtype)
      k = jax.random.normal(keys[1], (batch, t, kv_heads, kd), dtype)
      v = jax.random.normal(keys[2], (batch, t, kv_heads, kd), dtype)
      do = jax.random.normal(keys[3], q.shape, dtype)
      for causal in [c.lower() in ("1", "true", "yes") for c in cfg.causal]:
        f_flops, b_flops = attention_flops(batch, t, t, heads, kd, causal)
        for impl, mc in runs:
          label = _impl_label(impl, mc, len(mgpu_cfgs))
          row = {"kernel": "flash_attention", "impl": label, "seq_len": t, "batch": batch,
                 "heads": heads, "kv_heads": kv_heads, "head_dim": kd, "dtype": dtype.name,
                 "causal": causal}
          if mc is not None:
            row["mgpu_config"] = mc
          try:
            fwd, fwd_bwd = _attention_fns(impl, causal, cfg.block_q, cfg.block_k, mc)
            f_times, _ = benchmark.time_steps(lambda _: fwd(q, k, v), None, cfg.steps,
                                              cfg.repeats, warmup=2)
            fb_times, _ = benchmark.time_steps(lambda _: fwd_bwd(q, k, v, do), None, cfg.steps,
                                               cfg.repeats, warmup=2)
            f_s, fb_s = benchmark.median(f_times), benchmark.median(fb_times)
            b_s = max(fb_s - f_s, 1e-9)
            row.update(fwd_ms=1e3 * f_s, fwd_bwd_ms=1e3 * fb_s, bwd_ms=1e3 * b_s,
                       fwd_tflops=f_flops / f_s / 1e12, bwd_tflops=b_flops / b_s / 1e12)
            print(f"  T={t:>6} B={batch:>2} hd={kd:>3} {'causal' if causal else 'full  '} "
                  f"{label:>18}: fwd {1e3 * f_s:8.2f} ms {row['fwd_tflops']:6.1f} TFLOP/s | "
                  f"bwd {1e3 * b_s:8.2f} ms {row['bwd_tflops']:6.1f} TFLOP/s", flush=True)
          except Exception as e:  # noqa: BLE001 - report and go on (compile error, OOM, ...)
            row["error"] = _error(e)
            print(f"  T={t:>6} hd={kd:>3} {label:>18} causal={causal}: FAILED {row['error']}",
                  flush=True)
          rows.append(row)
          gc.collect()
          jax.clear_caches()
      del q, k, v, do
  add_cudnn_ratios(rows)
  return rows


def check_flash_attention(variants=(("triton", "float32"), ("triton", "bfloat16"),
                                    ("mgpu", "bfloat16"))) -> dict:
  """Kernel (interpret mode) vs reference on one small GQA, padded, causal case per
  (kernel, dtype): forward and backward through out and lse."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kernels.flash_attention import flash_attention, flash_attention_reference

  tols = {"float32": 1e-4, "bfloat16": 3e-2}
  tuning = {"triton": dict(block_q=16, block_k=16), "mgpu": {}}
  report = {}
  for impl, name in variants:
    dtype = jnp.dtype(name)
    t, s, kd = (40, 40, 32) if impl == "triton" else (136, 200, 64)
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (1, t, 4, kd), dtype)
    k = jax.random.normal(keys[1], (1, s, 2, kd), dtype)
    v = jax.random.normal(keys[2], (1, s, 2, kd), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    dlse = jax.random.normal(keys[4], q.shape[:3], jnp.float32)

    def run(fn):
      def f(q, k, v):
        (o, lse), vjp = jax.vjp(lambda *a: fn(*a, causal=True), q, k, v)
        return (o, lse) + vjp((do, dlse))
      return jax.jit(f)(q, k, v)

    got = run(lambda *a, **kw: flash_attention(*a, implementation=impl, interpret=True,
                                               **tuning[impl], **kw))
    want = run(flash_attention_reference)
    errs = {}
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      errs[label] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))
    key = f"{impl}/{name}"
    report[key] = {"rel_err": errs, "tol": tols[name],
                   "ok": all(e < tols[name] for e in errs.values())}
    print(f"  flash_attention {key:>15}: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
          + f"  (tol {tols[name]:.0e}) {'ok' if report[key]['ok'] else 'FAILED'}", flush=True)
  return report


def _ratio(r, part):
  key = f"{part}_vs_cudnn"
  return f"{r[key]:6.2f}x" if key in r else "      -"


def table_flash_attention(rows):
  print("\nflash_attention  impl                  seq  batch   hd  causal   fwd TFLOP/s  "
        "bwd TFLOP/s  fwd/cuDNN  bwd/cuDNN")
  for r in rows:
    if "error" in r:
      print(f"                 {r['impl']:<18} {r['seq_len']:>6} {r['batch']:>5} "
            f"{r['head_dim']:>4}  {str(r['causal']):<6}  failed: {r['error']}")
      continue
    print(f"                 {r['impl']:<18} {r['seq_len']:>6} {r['batch']:>5} {r['head_dim']:>4}"
          f"  {str(r['causal']):<6} {r['fwd_tflops']:11.1f}  {r['bwd_tflops']:11.1f}"
          f"    {_ratio(r, 'fwd')}    {_ratio(r, 'bwd')}")
  targets = mgpu_targets(rows)
  if targets:
    print(f"\nMosaic GPU kernel vs cuDNN (targets: forward >= {MGPU_TARGETS['fwd']}x, "
          f"backward >= {MGPU_TARGETS['bwd']}x)")
    for key, t in targets.items():
      cells = []
      for part in ("fwd", "bwd"):
        ratio = "-" if t[part]["ratio"] is None else f"{t[part]['ratio']:.2f}x"
        cells.append(f"{part} {ratio:>6} {t[part]['status']:<10}")
      print(f"  {key:<22} " + "  ".join(cells))


def summary_flash_attention(rows) -> dict:
  out = {}
  for r in rows:
    key = f"{r['impl']}/{_shape_key(r)}"
    if "error" in r:
      out[key] = {"error": r["error"]}
      continue
    out[key] = {"fwd_tflops": round(r["fwd_tflops"], 1), "bwd_tflops": round(r["bwd_tflops"], 1)}
    if "fwd_vs_cudnn" in r:
      out[key].update(fwd_vs_cudnn=round(r["fwd_vs_cudnn"], 3),
                      bwd_vs_cudnn=round(r["bwd_vs_cudnn"], 3))
  targets = mgpu_targets(rows)
  if targets:
    out["mgpu_targets"] = {k: {p: v[p]["status"] for p in ("fwd", "bwd")}
                           for k, v in targets.items()}
  return out


# ------------------------------------------------------------------------ embedding bag
# The timing code lives in experiments/bench_kernels_embedding.py (also runnable alone).

def bench_embedding_bag(cfg) -> dict:
  """experiments.bench_kernels_embedding's result: {"device", "copy_bytes_per_s", "config",
  "results": one row per (format, impl), with "error" for an implementation that failed}."""
  from experiments.bench_kernels_embedding import bench_embedding_bag as bench, format_table
  out = bench(num_rows=cfg.eb_rows, dim=cfg.eb_dim, batch=cfg.eb_batch,
              features=cfg.eb_features, bag_len=cfg.eb_bag_len, dtypes=tuple(cfg.eb_dtypes),
              repeats=max(cfg.repeats, 5))
  print(format_table(out), flush=True)
  return out


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


def table_embedding_bag(out):
  from experiments.bench_kernels_embedding import format_table
  print("\nembedding_bag")
  print(format_table(out))


def summary_embedding_bag(out) -> dict:
  from experiments.bench_kernels_embedding import summary
  return summary(out)


class Family(NamedTuple):
  """One kernel family: timed results on a GPU, a tiny interpret-mode check, how to print."""
  bench: Callable[[Any], Any]     # flags -> JSON-able results
  check: Callable[[], dict]       # {variant: {"rel_err": {...}, "tol": float, "ok": bool}}
  table: Callable[[Any], None]
  summary: Callable[[Any], dict]


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
                                  "head_dims", "dtype", "impls", "causal", "block_q", "block_k",
                                  "mgpu_configs", "repeats", "steps", "interpret_check")}}

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
    try:
      results[name] = FAMILIES[name].bench(FLAGS)
      summary[name] = FAMILIES[name].summary(results[name])
    except app.UsageError:
      raise
    except Exception as e:  # noqa: BLE001 - one family failing must not end the others
      results[name] = summary[name] = {"error": _error(e)}
      print(f"  {name}: FAILED {results[name]['error']}", flush=True)
  for name in FLAGS.kernels:
    if "error" in summary[name] and len(summary[name]) == 1:
      print(f"\n{name}: failed: {summary[name]['error']}")
    else:
      FAMILIES[name].table(results[name])
  out["results"] = results
  results_lib.write_results(FLAGS.workdir, out)
  print(json.dumps(summary))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
