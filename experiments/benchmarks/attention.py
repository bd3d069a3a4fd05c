"""Flash attention forward and backward TFLOP/s beside cuDNN, and a tiny interpret-mode
check of the kernels against the reference.

Implementations: "mgpu" (`kernels.flash_attention_mgpu`, Mosaic GPU, Hopper), "triton"
(`kernels.flash_attention_triton`), "pallas" (the backend's choice of the two), "cudnn"
(`jax.nn.dot_product_attention(implementation="cudnn")`) and "xla". As in the
FlashAttention-2 paper (arXiv 2307.08691, Sec. 4.1) the batch shrinks as the sequence grows
so that batch x seq = tokens. FLOPs: forward 4 B H T S K (halved when causal), backward 2.5x
forward (five matmuls against two); backward time = time(forward + backward) -
time(forward), both jitted, medians of repeats.

Letters: B batch, T query length, S key length, H heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import functools
import gc
import time

from absl import app

ATTENTION_IMPLS = ("mgpu", "triton", "pallas", "cudnn", "xla")
# Mosaic GPU kernel vs cuDNN, same shape (issue 11): forward and backward.
MGPU_TARGETS = {"fwd": 0.9, "bwd": 0.8}
_print = functools.partial(print, flush=True)


def error_text(e: BaseException) -> str:
  """The exception's type and first line, short enough for a table cell."""
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def parse_mgpu_config(text: str) -> dict:
  """"64x128x2" -> {"block_q": 64, "block_kv": 128, "stages": 2}; "64x128x2:split" also
  sets the backward ("split" or "fused"; default: fused at head dim 128, else split)."""
  tiles, sep, bwd = text.lower().partition(":")
  try:
    bq, bk, st = (int(x) for x in tiles.split("x"))
    if min(bq, bk, st) < 1:
      raise ValueError
  except ValueError:
    raise app.UsageError(f"--mgpu_configs: {text!r}, expected BLOCK_QxBLOCK_KVxSTAGES[:BWD] "
                         "of positive integers, such as 64x128x2 or 64x128x2:split") from None
  if bwd not in ("split", "fused") and (sep or bwd):
    raise app.UsageError(f"--mgpu_configs: {text!r}, the backward after ':' must be split "
                         "or fused")
  return {"block_q": bq, "block_kv": bk, "stages": st, **({"bwd": bwd} if bwd else {})}


def impl_label(impl: str, mgpu_cfg: dict | None, n_cfgs: int) -> str:
  if impl != "mgpu" or n_cfgs <= 1:
    return impl
  bwd = f":{mgpu_cfg['bwd']}" if "bwd" in mgpu_cfg else ""
  return "mgpu[{block_q}x{block_kv}x{stages}".format(**mgpu_cfg) + bwd + "]"


def attention_fns(impl: str, causal: bool, block_q: int, block_k: int,
                  mgpu_cfg: dict | None = None, interpret: bool = False,
                  cudnn_stand_in: bool = False):
  """(fwd(q, k, v) -> out, fwd_bwd(q, k, v, do) -> (dq, dk, dv)), both jitted.

  interpret: run the Pallas kernels in their interpreters (CPU). cudnn_stand_in: "cudnn"
  runs XLA's attention instead (a CPU dry run has no cuDNN; its figures mean nothing).
  """
  import jax

  if impl == "mgpu":
    from kernels import flash_attention_mgpu as mgpu

    def attn(q, k, v):
      return mgpu.flash_attention_mgpu(q, k, v, causal=causal, interpret=interpret,
                                       **(mgpu_cfg or {}))[0]
  elif impl == "triton":
    from kernels import flash_attention_triton as triton

    def attn(q, k, v):
      return triton.flash_attention_triton(q, k, v, causal=causal, block_q=block_q,
                                           block_k=block_k, interpret=interpret)[0]
  elif impl == "pallas":
    from llm.attention.pallas import pallas_attention

    def attn(q, k, v):
      return pallas_attention(q, k, v, causal=causal, interpret=interpret)[0]
  elif impl in ("xla", "cudnn"):
    implementation = "xla" if cudnn_stand_in else impl

    def attn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                          implementation=implementation)
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


def shape_key(r) -> str:
  return f"T{r['seq_len']}/{'causal' if r['causal'] else 'full'}/hd{r['head_dim']}"


def add_cudnn_ratios(rows: list[dict]) -> None:
  """Adds fwd_vs_cudnn / bwd_vs_cudnn to every timed row whose shape has a cuDNN row."""
  cudnn = {shape_key(r): r for r in rows if r["impl"] == "cudnn" and "fwd_tflops" in r}
  for r in rows:
    ref = cudnn.get(shape_key(r))
    if ref is not None and "fwd_tflops" in r:
      r["fwd_vs_cudnn"] = r["fwd_tflops"] / ref["fwd_tflops"]
      r["bwd_vs_cudnn"] = r["bwd_tflops"] / ref["bwd_tflops"]


def mgpu_targets(rows: list[dict]) -> dict[str, dict]:
  """Per shape: the best Mosaic GPU row's ratios to cuDNN and whether each target is met
  ("met", "missed", or "unmeasured" when the kernel or cuDNN has no number)."""
  out = {}
  for key in dict.fromkeys(shape_key(r) for r in rows):
    mg = [r for r in rows if shape_key(r) == key and r["impl"].startswith("mgpu")]
    if not mg:
      continue
    timed = [r for r in mg if "fwd_vs_cudnn" in r]
    entry = {}
    for part in ("fwd", "bwd"):
      if not timed:
        entry[part] = {"ratio": None, "target": MGPU_TARGETS[part], "status": "unmeasured"}
        continue
      best = max(timed, key=lambda r: r[f"{part}_vs_cudnn"])
      ratio = best[f"{part}_vs_cudnn"]
      entry[part] = {"ratio": round(ratio, 3), "target": MGPU_TARGETS[part], "impl": best["impl"],
                     "status": "met" if ratio >= MGPU_TARGETS[part] else "missed"}
    out[key] = entry
  return out


def bench_flash_attention(cfg, *, interpret: bool = False, cudnn_stand_in: bool = False,
                          deadline: float | None = None, log=_print) -> list[dict]:
  """One row per (head_dim, seq_len, causal, impl): ms and TFLOP/s of forward and backward.

  cfg: dtype, impls, mgpu_configs, heads, kv_heads, head_dims, seq_lens, tokens, causal,
  block_q, block_k, steps, repeats (and optionally warmup). Each implementation runs in its
  own try: a failure (compile error, cuDNN missing, out of memory) is the row's "error".
  Mosaic GPU configs that differ only in the backward share one forward timing. deadline
  (time.monotonic()): rows not started by then get "skipped" instead of timings.
  """
  import jax
  import jax.numpy as jnp

  from core import benchmark

  rows = []
  dtype = jnp.dtype(cfg.dtype)
  unknown = [i for i in cfg.impls if i not in ATTENTION_IMPLS]
  if unknown:
    raise app.UsageError(f"--impls: {unknown}, expected some of {ATTENTION_IMPLS}")
  mgpu_cfgs = [parse_mgpu_config(c) if isinstance(c, str) else dict(c) for c in cfg.mgpu_configs]
  heads, kv_heads = cfg.heads, cfg.kv_heads or cfg.heads
  warmup = getattr(cfg, "warmup", 2)
  runs = [(impl, mc) for impl in cfg.impls for mc in (mgpu_cfgs if impl == "mgpu" else [None])]
  for kd in [int(x) for x in cfg.head_dims]:
    for t in [int(x) for x in cfg.seq_lens]:
      batch = max(1, cfg.tokens // t)
      keys = jax.random.split(jax.random.key(t), 4)
      q = jax.random.normal(keys[0], (batch, t, heads, kd), dtype)
      k = jax.random.normal(keys[1], (batch, t, kv_heads, kd), dtype)
      v = jax.random.normal(keys[2], (batch, t, kv_heads, kd), dtype)
      do = jax.random.normal(keys[3], q.shape, dtype)
      for causal in [str(c).lower() in ("1", "true", "yes") for c in cfg.causal]:
        f_flops, b_flops = attention_flops(batch, t, t, heads, kd, causal)
        fwd_seconds: dict[tuple, float] = {}    # forward timing shared across backward variants
        for impl, mc in runs:
          label = impl_label(impl, mc, len(mgpu_cfgs))
          row = {"kernel": "flash_attention", "impl": label, "seq_len": t, "batch": batch,
                 "heads": heads, "kv_heads": kv_heads, "head_dim": kd, "dtype": dtype.name,
                 "causal": causal}
          if mc is not None:
            row["mgpu_config"] = mc
          if impl == "cudnn" and cudnn_stand_in:
            row["stand_in"] = "xla"
          if mc is not None and mc.get("bwd") == "fused" and kd != 128:
            continue                      # the fused backward exists at head dim 128 only
          if deadline is not None and time.monotonic() > deadline:
            row["skipped"] = "the part's time budget ran out"
            rows.append(row)
            continue
          try:
            fwd, fwd_bwd = attention_fns(impl, causal, cfg.block_q, cfg.block_k, mc,
                                         interpret=interpret, cudnn_stand_in=cudnn_stand_in)
            fkey = (impl,) + tuple(sorted((k_, v_) for k_, v_ in (mc or {}).items()
                                          if k_ != "bwd"))
            if fkey not in fwd_seconds:
              f_times, _ = benchmark.time_steps(lambda _: fwd(q, k, v), None, cfg.steps,
                                                cfg.repeats, warmup=warmup)
              fwd_seconds[fkey] = benchmark.median(f_times)
            f_s = fwd_seconds[fkey]
            fb_times, _ = benchmark.time_steps(lambda _: fwd_bwd(q, k, v, do), None, cfg.steps,
                                               cfg.repeats, warmup=warmup)
            fb_s = benchmark.median(fb_times)
            b_s = max(fb_s - f_s, 1e-9)
            row.update(fwd_ms=1e3 * f_s, fwd_bwd_ms=1e3 * fb_s, bwd_ms=1e3 * b_s,
                       fwd_tflops=f_flops / f_s / 1e12, bwd_tflops=b_flops / b_s / 1e12)
            log(f"  T={t:>6} B={batch:>2} hd={kd:>3} {'causal' if causal else 'full  '} "
                f"{label:>18}: fwd {1e3 * f_s:8.2f} ms {row['fwd_tflops']:6.1f} TFLOP/s | "
                f"bwd {1e3 * b_s:8.2f} ms {row['bwd_tflops']:6.1f} TFLOP/s")
          except Exception as e:  # noqa: BLE001 - report and go on (compile error, OOM, ...)
            row["error"] = error_text(e)
            log(f"  T={t:>6} hd={kd:>3} {label:>18} causal={causal}: FAILED {row['error']}")
          rows.append(row)
          gc.collect()
          jax.clear_caches()
      del q, k, v, do
  add_cudnn_ratios(rows)
  return rows


def check_flash_attention(variants=(("triton", "float32"), ("triton", "bfloat16"),
                                    ("mgpu", "bfloat16")), log=_print) -> dict:
  """Kernel (interpret mode) vs reference on one small GQA, padded, causal case per
  (kernel, dtype): forward and backward through out and lse."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kernels.flash_attention_reference import flash_attention_reference
  from llm.attention.pallas import KERNELS

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

    got = run(lambda *a, **kw: KERNELS[f"pallas_{impl}"](*a, interpret=True, **tuning[impl],
                                                        **kw))
    want = run(flash_attention_reference)
    errs = {}
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      errs[label] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))
    key = f"{impl}/{name}"
    report[key] = {"rel_err": errs, "tol": tols[name],
                   "ok": all(e < tols[name] for e in errs.values())}
    log(f"  flash_attention {key:>15}: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
        + f"  (tol {tols[name]:.0e}) {'ok' if report[key]['ok'] else 'FAILED'}")
  return report


__all__ = ["ATTENTION_IMPLS", "MGPU_TARGETS", "add_cudnn_ratios", "attention_flops",
           "attention_fns", "bench_flash_attention", "check_flash_attention", "error_text",
           "impl_label", "mgpu_targets", "parse_mgpu_config", "shape_key"]
