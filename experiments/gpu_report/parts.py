"""The report's parts, one function per GPU target family, and `run_report`, which runs
them under one time budget and writes DIR/report.md and DIR/report.json after each.

Every part measures its figure and the reference it is judged against in the same run:
flash attention against cuDNN on the same shapes, MFU against the device kind's dense
peak, decode against the copy bandwidth measured here, the embedding bag against that
copy and XLA's gather, the train loop against its own jitted step, FP8 against bf16.
`Sizes.gpu()` holds the issue's sizes for one H100 / H200, `Sizes.dry_run()` toy sizes
that take the same code paths on CPU (Pallas interpret mode; cuDNN replaced by XLA's
attention, and in the train step by llm.attention.cudnn's jnp emulation of the kernel).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
import shutil
import tempfile
import time
import types
from typing import Any, Sequence

from experiments.benchmarks import attention as fa_bench
from experiments.benchmarks import decode as decode_bench
from experiments.benchmarks import embedding_bag as eb_bench
from experiments.benchmarks import lm_train
from experiments.benchmarks import rec as rec_bench
from experiments.gpu_report import report as report_lib
from experiments.gpu_report.report import Context, Target, judged

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The targets (issues 11, 23, 24).
FA_TARGETS = fa_bench.MGPU_TARGETS                   # Mosaic GPU / cuDNN: fwd, bwd
MFU_TARGET = 0.5                                     # Llama 3.2 1B train step, seq 8192
DECODE_TARGET = 1.3                                  # batch-1 decode / bandwidth floor
QUANT_TARGETS = {"int8": 0.6, "int4": 0.4}           # weight-only decode ms / bf16 ms
QUANT_TARGETS_MODES = tuple(QUANT_TARGETS)
EB_TARGETS = {"float32": 0.7, "bfloat16": 0.7, "int8": 0.6}   # of copy bandwidth (Pallas)
PIPELINE_TARGET = 0.8                                # end to end / jitted step
MLPERF_REFERENCE = 1.7e6    # NVIDIA, MLPerf Training v4.0 DLRM-DCNv2: 13.8M ex/s on 8 H100
# The FP8 probe's safe set for DCN-v2 (experiments.fp8_probe on the Criteo sample, tensor
# scaling, log loss within 1e-3 relative; BENCHMARKS.md "FP8 dense layers"). Layers the
# MLPerf preset lacks are dropped (and logged).
FP8_PROBE_SAFE = ("bottom_mlp.0", "cross.0", "cross.1", "deep_mlp.0", "top_mlp.0")
# The dry run's attention_impl for the lm_train part's "cudnn" case (see _lm_attention).
CUDNN_STAND_IN = "cudnn_emulated"
# The default test suite's dry run (tests/experiments/test_gpu_report.py), about 50 s of
# CPU: the code paths the CPU dry run would otherwise leave unchecked between GPU rounds
# (the cuDNN and Mosaic GPU train steps, the fused and the split backward, Triton, float32
# and int4 bags, the device-side synthetic generator) and the decode part. The rest
# (auto / xla train cases, the other row formats, criteo_bin in a Grain worker, mlperf,
# fp8, the pytest parts, --profile) is the whole dry run, a slow-marked test.
SUITE_DRY_RUN = ("--parts=attention,lm_train,decode,embedding_bag,rec_pipeline",
                 "--lm_impls=cudnn,pallas_mgpu", "--bag_formats=float32,int4",
                 "--pipeline_data=synthetic:gen=device")
# attention_impl values the lm_train part takes (--lm_impls).
LM_IMPLS = ("auto", "xla", "cudnn", "pallas", "pallas_mgpu", "pallas_triton")


def is_pipeline_data(data: str) -> bool:
  """Whether `data` is a --data source the rec_pipeline part takes: a synthetic form
  (its options checked), criteo_bin:gen or criteo_bin:DIR."""
  from rec.data import sources
  try:
    if sources.synthetic_options(data) is not None:
      return True
  except ValueError:
    return False
  kind, sep, rest = data.partition(":")
  return kind == "criteo_bin" and bool(sep and rest)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Every size the parts use; `gpu()` for the real report, `dry_run()` for CPU."""

  copy_bytes: int
  # flash attention (batch x seq = fa_tokens)
  fa_head_dims: tuple[int, ...]
  fa_seq_lens: tuple[int, ...]
  fa_tokens: int
  fa_heads: int
  fa_causal: tuple[bool, ...]
  fa_mgpu_configs: tuple[str, ...]
  fa_block: int
  fa_steps: int
  fa_repeats: int
  fa_warmup: int
  # Llama training step
  lm_preset: str
  lm_overrides: tuple[tuple[str, Any], ...]
  lm_seq: int
  lm_batch: int
  lm_impls: tuple[str, ...]
  lm_remats: tuple[str, ...]
  lm_steps: int
  lm_repeats: int
  lm_warmup: int
  lm_min_case_s: float
  # decode
  dec_preset: str
  dec_overrides: tuple[tuple[str, Any], ...]
  dec_batches: tuple[int, ...]
  dec_attention: tuple[str, ...]     # decode steps' attention per case; the first is judged
  dec_prompt: int
  dec_new_tokens: int
  dec_repeats: int
  # embedding bag
  eb_rows: int
  eb_dim: int
  eb_batch: int
  eb_features: int
  eb_bag_len: int
  eb_formats: tuple[str, ...]
  eb_min_buffer_bytes: int
  eb_repeats: int
  eb_warmup: int
  # DLRM loop vs step
  rp_data: tuple[str, ...]
  rp_preset: str                     # DLRM preset (rec.configs.MODEL_PRESETS["dlrm"])
  rp_workers: tuple[int, ...]        # Grain worker processes per criteo_bin case (0: none)
  rp_batch: int
  rp_rows: int
  rp_steps: int
  rp_source_batches: int
  rp_gen_rows: int
  rp_repeats: int
  # DCNv2 MLPerf preset and FP8
  ml_batch: int
  ml_rows: int
  ml_steps: int
  ml_repeats: int
  ml_warmup: int
  fp8_layers: tuple[str, ...]
  fp8_recipe: str
  # pytest
  pt_platform: str
  pt_gpu_args: tuple[str, ...]
  pt_suite_args: tuple[str, ...]

  @classmethod
  def gpu(cls, **overrides) -> Sizes:
    """The issue's sizes on one H100 / H200."""
    kw = dict(
        copy_bytes=2 << 30,
        fa_head_dims=(128, 64), fa_seq_lens=(4096, 8192, 16384), fa_tokens=16384, fa_heads=16,
        fa_causal=(True, False), fa_mgpu_configs=("64x128x2:fused", "64x128x2:split"),
        fa_block=128, fa_steps=5, fa_repeats=3, fa_warmup=1,
        lm_preset="llama32_1b", lm_overrides=(), lm_seq=8192, lm_batch=1,
        lm_impls=("auto", "cudnn", "pallas_mgpu"), lm_remats=("none", "attention"),
        lm_steps=5, lm_repeats=2, lm_warmup=1, lm_min_case_s=30.0,
        dec_preset="llama32_1b", dec_overrides=(), dec_batches=(1, 8),
        dec_attention=("auto", "xla_decode"), dec_prompt=1024,
        dec_new_tokens=33, dec_repeats=3,
        eb_rows=1_000_000, eb_dim=128, eb_batch=8192, eb_features=26, eb_bag_len=20,
        eb_formats=("float32", "bfloat16", "int8", "int4", "int8_cache"),
        eb_min_buffer_bytes=int(4.5 * 2**30), eb_repeats=10, eb_warmup=2,
        # "synthetic" on a GPU is drawn on the device (rec.data.device_synthetic).
        rp_data=("synthetic", "criteo_bin:gen"), rp_preset="kaggle", rp_workers=(0, 8),
        rp_batch=16384,
        rp_rows=1_000_000, rp_steps=60, rp_source_batches=30, rp_gen_rows=2_000_000, rp_repeats=3,
        ml_batch=8192, ml_rows=4_000_000, ml_steps=20, ml_repeats=3, ml_warmup=3,
        fp8_layers=FP8_PROBE_SAFE, fp8_recipe="tensor",
        # xdist over the host's cores (compiles dominate; the processes share the GPU). The
        # gpu tests spread test by test: most are in one file (the embedding bag's).
        pt_platform="cuda", pt_gpu_args=("-n", "4", "--dist=load", "-m", "gpu", "tests"),
        pt_suite_args=("-n", "8", "--dist=loadfile", "tests"))
    return cls(**{**kw, **overrides})

  @classmethod
  def dry_run(cls, **overrides) -> Sizes:
    """Toy sizes that take every code path of the GPU report on CPU (numbers meaningless).

    Each path once, at the smallest shape it runs: flash attention at head dim 128 with the
    Mosaic GPU kernel's fused and split backward (interpreted), Triton (interpreted) and
    the cuDNN row (XLA's attention standing in); the train step with attention_impl auto
    (XLA on CPU), xla (which reuses auto's program, as cudnn does on a GPU), cudnn (its
    jnp emulation, `llm.attention.cudnn` implementation="xla": the same mask mapping, lse
    and backward, no kernel) and pallas_mgpu (interpreted; head dim 64, GQA); decode at
    batch 1; every embedding-bag row format of the GPU run (Pallas interpreted, XLA's
    gather); the DLRM loop on synthetic rows drawn by the device-side generator
    (`gen=device`, what "synthetic" resolves to on a GPU) and on generated criteo_bin rows
    in one Grain worker; the MLPerf step with FP8 on one layer (plus one name the preset
    lacks, dropped); pytest on one file.
    """
    kw = dict(
        copy_bytes=1 << 20,
        fa_head_dims=(128,), fa_seq_lens=(128,), fa_tokens=128, fa_heads=1, fa_causal=(True,),
        fa_mgpu_configs=("64x128x2:fused", "64x128x2:split"), fa_block=64, fa_steps=1,
        fa_repeats=1, fa_warmup=0,
        lm_preset="tiny", lm_overrides=(("n_layers", 1), ("n_heads", 2), ("n_kv_heads", 1),
                                        ("head_dim", 64)),
        lm_seq=32, lm_batch=1, lm_impls=("auto", "xla", "cudnn", "pallas_mgpu"),
        lm_remats=("none",), lm_steps=1, lm_repeats=1, lm_warmup=0, lm_min_case_s=0.0,
        dec_preset="tiny", dec_overrides=(("n_layers", 1),), dec_batches=(1,),
        dec_attention=("auto", "pallas_decode"), dec_prompt=8,
        dec_new_tokens=3, dec_repeats=1,
        eb_rows=64, eb_dim=16, eb_batch=4, eb_features=2, eb_bag_len=3,
        eb_formats=("float32", "bfloat16", "int8", "int4", "int8_cache"),
        eb_min_buffer_bytes=0, eb_repeats=1, eb_warmup=0,
        rp_data=("synthetic:gen=device", "criteo_bin:gen"), rp_preset="small", rp_workers=(1,),
        rp_batch=64, rp_rows=1000, rp_steps=2, rp_source_batches=2, rp_gen_rows=1024,
        rp_repeats=1,
        ml_batch=64, ml_rows=1000, ml_steps=1, ml_repeats=1, ml_warmup=1,
        fp8_layers=("deep_mlp.0", "top_mlp.0"),
        pt_platform="cpu",
        pt_gpu_args=("-m", "gpu", "tests/experiments/test_gpu_report.py"),
        pt_suite_args=("tests/experiments/test_gpu_report.py::test_parse_pytest_counts",))
    return cls.gpu(**{**kw, **overrides})


def _profile_tables(profiles: dict[str, Any]) -> dict[str, list[dict]]:
  """report.md tables of --profile summaries: per traced case, its busy time and kernels
  per step, then the kernels that took the most time."""
  out = {}
  for label, s in profiles.items():
    if not s:
      continue
    if "error" in s:
      out[f"profile {label}"] = [{"kernel": "(no profile)", "count": "-", "ms": "-",
                                  "share": s["error"]}]
      continue
    frac = "-" if s["busy_fraction"] is None else f"{s['busy_fraction']:.0%}"
    head = {"kernel": f"(all: {s['lines']})", "count": s["kernels"],
            "ms": s["busy_ms"], "share": f"busy {frac} of {s['span_ms']:.2f} ms, "
                                         f"{s['kernels_per_step']:.0f} per step"}
    out[f"profile {label}"] = [head] + [
        {"kernel": t["name"], "count": t["count"], "ms": t["ms"], "share": f"{t['share']:.1%}"}
        for t in s["top"]]
  return out


def _skipped_reason(ctx: Context, need_s: float = 0.0) -> str | None:
  if ctx.time_left() <= need_s:
    return f"the part's time budget ran out ({ctx.time_left():.0f} s left, {need_s:.0f} s needed)"
  return None


# ------------------------------------------------------------------------ flash attention


def part_attention(ctx: Context) -> dict:
  """Mosaic GPU (fused and split backward), Triton and cuDNN on every shape; the targets
  are the best Mosaic GPU config's forward and backward over cuDNN's."""
  s = ctx.sizes
  base = dict(dtype="bfloat16", heads=s.fa_heads, kv_heads=0, head_dims=s.fa_head_dims,
              seq_lens=s.fa_seq_lens, tokens=s.fa_tokens, causal=s.fa_causal,
              block_q=s.fa_block, block_k=s.fa_block, steps=s.fa_steps, repeats=s.fa_repeats,
              warmup=s.fa_warmup, mgpu_configs=s.fa_mgpu_configs)
  rows: list[dict] = []
  # cuDNN and Mosaic GPU over every shape first, Triton (the fallback) after, so a budget
  # that runs out leaves the targets measured.
  for impls in (("cudnn", "mgpu"), ("triton",)):
    rows += fa_bench.bench_flash_attention(
        types.SimpleNamespace(impls=impls, **base), interpret=ctx.dry_run,
        cudnn_stand_in=ctx.dry_run, deadline=ctx.deadline, log=ctx.log)
  fa_bench.add_cudnn_ratios(rows)
  targets = []
  for key, entry in fa_bench.mgpu_targets(rows).items():
    shape_rows = [r for r in rows if fa_bench.shape_key(r) == key]
    why = _why_unmeasured(shape_rows)
    for part in ("fwd", "bwd"):
      e = entry[part]
      name = f"flash attention {part} {key}, best Mosaic GPU / cuDNN"
      if e["ratio"] is None:
        targets.append(judged("attention", name, None, at_least=FA_TARGETS[part], **why))
        continue
      best = next(r for r in shape_rows if r["impl"] == e["impl"])
      ref = next(r for r in shape_rows if r["impl"] == "cudnn")
      targets.append(judged(
          "attention", name, e["ratio"], at_least=FA_TARGETS[part],
          detail=f"{e['impl']} {best[part + '_tflops']:.1f} vs cuDNN "
                 f"{ref[part + '_tflops']:.1f} TFLOP/s"))
  table = [{"impl": r["impl"], "T": r["seq_len"], "B": r["batch"], "hd": r["head_dim"],
            "causal": r["causal"], "fwd TFLOP/s": r.get("fwd_tflops", ""),
            "bwd TFLOP/s": r.get("bwd_tflops", ""), "fwd/cuDNN": r.get("fwd_vs_cudnn", ""),
            "bwd/cuDNN": r.get("bwd_vs_cudnn", ""),
            "note": r.get("error", r.get("skipped", ""))} for r in rows]
  return {"targets": targets, "details": {"rows": rows, "tables": {"TFLOP/s": table}}}


def _why_unmeasured(rows: list[dict]) -> dict:
  """judged() keywords saying why a shape has no Mosaic GPU / cuDNN ratio."""
  errs = [f"{r['impl']}: {r['error']}" for r in rows
          if "error" in r and (r["impl"] == "cudnn" or r["impl"].startswith("mgpu"))]
  if errs:
    return {"error": "; ".join(errs)}
  if any("skipped" in r for r in rows):
    return {"skipped": next(r["skipped"] for r in rows if "skipped" in r)}
  return {"detail": "no Mosaic GPU or cuDNN timing"}


# ------------------------------------------------------------------------ Llama training


def part_lm_train(ctx: Context) -> dict:
  """Llama train-step MFU per attention_impl at its fastest measured remat policy (every
  impl at the first policy before any impl at the next, as the budget allows). An impl
  that "auto" resolves to reuses auto's measurement (the same program)."""
  s = ctx.sizes
  results: dict[tuple[str, str], dict] = {}

  def run(impl: str, remat: str) -> None:
    skip = _skipped_reason(ctx, s.lm_min_case_s)
    if skip:
      results[(impl, remat)] = {"skipped": skip}
      ctx.log(f"  {impl} remat={remat}: skipped ({skip})")
      return
    try:
      from llm.config import get_config
      base = get_config(s.lm_preset, **dict(s.lm_overrides))
      cfg = base.replace(dtype="bfloat16", attention_impl=_lm_attention(impl, ctx.dry_run),
                         remat=remat != "none",
                         remat_policy="full" if remat == "none" else remat,
                         max_seq_len=max(s.lm_seq, base.max_seq_len))
      res = lm_train.run_benchmark(cfg, seq_len=s.lm_seq, batch=s.lm_batch, mesh_spec="-1",
                                   steps=s.lm_steps, repeats=s.lm_repeats, warmup=s.lm_warmup,
                                   breakdown=False,
                                   profile_dir=ctx.profile_dir(f"lm_train_{impl}_{remat}"))
      results[(impl, remat)] = res
      mfu = "n/a" if res["mfu"] is None else f"{res['mfu']:.1%}"
      ctx.log(f"  {impl} ({res['attention_resolved']}) remat={remat}: step "
              f"{res['step_ms']:.1f} ms, {res['tokens_per_s']:,.0f} tokens/s, MFU {mfu} "
              f"(compile {res['compile_s']:.1f} s)")
      ctx.log_profile(f"{impl} remat={remat} (3 steps)", res.get("profile"))
    except Exception as e:  # noqa: BLE001 - one impl failing must not end the part
      results[(impl, remat)] = {"error": fa_bench.error_text(e)}
      ctx.log(f"  {impl} remat={remat}: FAILED {results[(impl, remat)]['error']}")

  # Every impl at the first remat policy before any other policy, so a budget that runs
  # out leaves each impl measured once.
  first = s.lm_impls[0]
  for remat in s.lm_remats:
    for impl in s.lm_impls:
      same = results.get((first, remat), {})
      if impl != first and first == "auto" and same.get("attention_resolved") == impl:
        results[(impl, remat)] = dict(same, attention_impl=impl,
                                      note=f"the program of auto, which resolved to {impl}")
        continue
      run(impl, remat)

  targets, table, best = [], [], {}
  for impl in s.lm_impls:
    timed = {r: results[(impl, r)] for r in s.lm_remats if "step_ms" in results[(impl, r)]}
    best[impl] = min(timed, key=lambda r: timed[r]["step_ms"]) if timed else s.lm_remats[0]
    res = results[(impl, best[impl])]
    name = (f"Llama {s.lm_preset} train MFU, seq {s.lm_seq}, batch {s.lm_batch}, attention "
            f"{impl}" + (f" (-> {res['attention_resolved']})"
                         if res.get("attention_resolved", impl) != impl else "")
            + f", remat {best[impl]} (fastest of {', '.join(timed) or '-'})")
    if "step_ms" in res:
      detail = (f"{res['step_ms']:.1f} ms/step, {res['model_tflops_per_s']:.0f} TFLOP/s"
                + (f" of {res['peak_tflops_per_device']:.0f}" if res["mfu"] is not None else
                   f"; no peak FLOP/s known for {res['device_kind']!r}")
                + (f"; {res['note']}" if "note" in res else ""))
      targets.append(judged("lm_train", name, res["mfu"], at_least=MFU_TARGET,
                            fmt="{:.1%}", detail=detail))
    else:
      targets.append(judged("lm_train", name, None, at_least=MFU_TARGET, fmt="{:.1%}",
                            error=res.get("error"), skipped=res.get("skipped")))
  for (impl, remat), res in results.items():
    table.append({"impl": impl, "resolved": res.get("attention_resolved", ""), "remat": remat,
                  "step ms": res.get("step_ms", ""), "tokens/s": res.get("tokens_per_s", ""),
                  "TFLOP/s": res.get("model_tflops_per_s", ""), "MFU": res.get("mfu", ""),
                  "compile s": res.get("compile_s", ""),
                  "note": res.get("error", res.get("skipped", res.get("note", "")))})
  profiles = {f"{i} remat={r}": v.get("profile") for (i, r), v in results.items()
              if v.get("profile") and "note" not in v}
  return {"targets": targets,
          "details": {"best_remat": best,
                      "tables": {"train step": table, **_profile_tables(profiles)},
                      "results": {f"{i}/{r}": v for (i, r), v in results.items()}}}


def _lm_attention(impl: str, dry_run: bool) -> str:
  """The attention_impl a train case runs: `impl`, except "cudnn" in the dry run, which
  runs `llm.attention.cudnn` on its jnp emulation of the kernel (registered as
  CUDNN_STAND_IN: the same mask mapping, lse and backward; cuDNN itself needs a GPU)."""
  if not (dry_run and impl == "cudnn"):
    return impl
  from llm import attention as attn_lib
  from llm.attention.cudnn import cudnn_attention
  attn_lib.register(CUDNN_STAND_IN, functools.partial(cudnn_attention, implementation="xla"))
  return CUDNN_STAND_IN


# ------------------------------------------------------------------------ decode


def _decode_attention(impl: str) -> str:
  """The attention_impl of a decode case: "auto" as it is; another name runs only the
  decode steps' calls (auto's own pick for the prefill), registered as "auto+<impl>", so
  the cases differ in the decode attention alone (the jnp sums over a 1K-token prefill
  compiled for minutes on an H200)."""
  if impl == "auto":
    return impl
  from llm import attention as attn_lib
  decode_fn = attn_lib.get_attention(impl)

  def decode_only(q_BTHK, k_BSGK, v_BSGK, **kw):
    t, s = q_BTHK.shape[1], k_BSGK.shape[1]
    fn = (decode_fn if t <= attn_lib.DECODE_MAX_T and t < s
          else attn_lib.get_attention("auto"))
    return fn(q_BTHK, k_BSGK, v_BSGK, **kw)

  attn_lib.register(f"auto+{impl}", decode_only)
  return f"auto+{impl}"


def part_decode(ctx: Context) -> dict:
  """bf16 decode ms per step against the floor (weights + KV cache over the copy
  bandwidth), per attention_impl and batch size; the target is the first impl (auto: on a
  GPU the split-key kernel, kernels/decode_attention.py) at batch 1, the others are the
  same weights with another decode attention, side by side."""
  from flax import nnx

  from llm import model as model_lib
  from llm.config import get_config
  s = ctx.sizes
  base = get_config(s.dec_preset, **dict(s.dec_overrides))
  cfg = base.replace(dtype="bfloat16", param_dtype="bfloat16",
                     max_seq_len=max(base.max_seq_len, s.dec_prompt + s.dec_new_tokens))
  copy_bw = ctx.copy_bandwidth()
  targets, rows, profiles = [], [], {}
  for n, impl in enumerate(s.dec_attention):
    model = model_lib.Llama(cfg.replace(attention_impl=_decode_attention(impl)),
                            nnx.Rngs(0))
    if n == 0:
      ctx.log(f"  Llama {s.dec_preset}: {cfg.num_params() / 1e9:.2f}B params in bf16")
    for b in s.dec_batches:
      name = (f"decode ms/step over the bandwidth floor, {s.dec_preset} bf16, batch {b}, "
              f"prompt {s.dec_prompt}, attention {impl}")
      limit = DECODE_TARGET if b == 1 and n == 0 else None
      skip = _skipped_reason(ctx)
      if skip:
        targets.append(judged("decode", name, None, at_most=limit, skipped=skip))
        continue
      label = f"batch {b}" + ("" if n == 0 else f", {impl}")
      try:
        r = decode_bench.measure_decode(
            model, b, s.dec_prompt, s.dec_new_tokens, s.dec_repeats, copy_bw,
            profile_dir=ctx.profile_dir(f"decode_b{b}") if n == 0 else None)
      except Exception as e:  # noqa: BLE001 - report and go on (OOM at batch 8, ...)
        targets.append(judged("decode", name, None, at_most=limit,
                              error=fa_bench.error_text(e)))
        ctx.log(f"  {label}: FAILED {targets[-1].detail}")
        continue
      if "profile" in r:
        profiles[label] = r.pop("profile")
      r["attention_impl"] = impl
      rows.append(r)
      ctx.log(f"  {label}: prefill {r['prefill_ms']:.1f} ms, decode "
              f"{r['decode_ms_per_step']:.3f} ms/step, floor {r['decode_floor_ms']:.3f} ms "
              f"({r['decode_over_floor']:.2f}x)")
      ctx.log_profile(f"decode {label}", profiles.get(label))
      targets.append(judged(
          "decode", name, r["decode_over_floor"], at_most=limit,
          detail=f"{r['decode_ms_per_step']:.3f} ms vs floor {r['decode_floor_ms']:.3f} ms "
                 f"({(r['weight_bytes_per_step'] + r['kv_bytes_per_step']) / 1e9:.2f} GB at "
                 f"{copy_bw / 1e12:.2f} TB/s)"))
    del model
  return {"targets": targets, "details": {"copy_bytes_per_s": copy_bw, "profiles": profiles,
                                          "tables": {"decode": rows,
                                                     **_profile_tables(profiles)}}}


# ------------------------------------------------------------------------ weight-only decode


def part_quant_decode(ctx: Context) -> dict:
  """Weight-only int8 / int4 decode ms per step at batch 1 against the same model in bf16
  (random weights; the quantized models hold random codes and scales,
  `llm.quantized.random_params`), each measured in this part, one after another: the
  judged int8 / int4 cases multiply through `QuantizedParam.matmul_impl` "auto" (on a GPU
  the Pallas kernel, kernels/weight_only_matmul.py), then the same through XLA's
  `groupwise_matmul` ("xla") beside them."""
  import jax
  from flax import nnx

  from llm import model as model_lib
  from llm import quantized
  from llm.config import get_config
  s = ctx.sizes
  base = get_config(s.dec_preset, **dict(s.dec_overrides))
  cfg = base.replace(dtype="bfloat16", param_dtype="bfloat16",
                     max_seq_len=max(base.max_seq_len, s.dec_prompt + s.dec_new_tokens))
  copy_bw = ctx.copy_bandwidth()
  rows, times, targets = [], {}, []
  cases = [("bfloat16", None)] + [(m, "auto") for m in QUANT_TARGETS_MODES] + [
      (m, "xla") for m in QUANT_TARGETS_MODES]
  for weights, impl in cases:
    mode = weights if impl in (None, "auto") else f"{weights} ({impl})"
    skip = _skipped_reason(ctx)
    if skip:
      ctx.log(f"  {mode}: skipped ({skip})")
      continue
    try:
      if impl is None:
        model = model_lib.Llama(cfg, nnx.Rngs(0))
      else:
        model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
        model_lib.load_weights(model, quantized.random_params(cfg, weights,
                                                              matmul_impl=impl))
      held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
      r = decode_bench.measure_decode(model, 1, s.dec_prompt, s.dec_new_tokens,
                                      s.dec_repeats, copy_bw)
    except Exception as e:  # noqa: BLE001 - report and go on
      times[mode] = fa_bench.error_text(e)
      ctx.log(f"  {mode}: FAILED {times[mode]}")
      continue
    finally:
      model = None              # noqa: F841 - frees this mode's weights before the next
    r.update(weights=weights, matmul_impl=impl, param_bytes=int(held))
    rows.append(r)
    times[mode] = r["decode_ms_per_step"]
    ctx.log(f"  {mode}: decode {r['decode_ms_per_step']:.3f} ms/step ({held / 1e9:.2f} GB of "
            f"parameters), prefill {r['prefill_ms']:.1f} ms")
  for mode, limit in QUANT_TARGETS.items():
    name = (f"weight-only {mode} decode ms/step / bf16, {s.dec_preset}, batch 1, prompt "
            f"{s.dec_prompt}")
    bf16, q = times.get("bfloat16"), times.get(mode)
    if isinstance(q, str) or isinstance(bf16, str):
      targets.append(judged("quant_decode", name, None, at_most=limit,
                            error=q if isinstance(q, str) else f"bf16: {bf16}"))
    elif q is None or bf16 is None:
      targets.append(judged("quant_decode", name, None, at_most=limit,
                            skipped="the part's time budget ran out"))
    else:
      xla = times.get(f"{mode} (xla)")
      beside = f"; XLA's groupwise_matmul {xla:.3f} ms" if isinstance(xla, float) else ""
      targets.append(judged("quant_decode", name, q / bf16, at_most=limit,
                            detail=f"{q:.3f} ms vs bf16 {bf16:.3f} ms{beside}"))
  return {"targets": targets, "details": {"tables": {"quant_decode": rows}}}


# ------------------------------------------------------------------------ embedding bag


def part_embedding_bag(ctx: Context) -> dict:
  """Each row format's Pallas lookup against the copy bandwidth and XLA's gather, every
  buffer raised to at least eb_min_buffer_bytes."""
  s = ctx.sizes
  out = eb_bench.bench_embedding_bag(
      num_rows=s.eb_rows, dim=s.eb_dim, batch=s.eb_batch, features=s.eb_features,
      bag_len=s.eb_bag_len, dtypes=s.eb_formats, impls=("pallas", "xla"),
      repeats=s.eb_repeats, min_buffer_bytes=s.eb_min_buffer_bytes,
      copy_bytes_per_s=ctx.copy_bandwidth(), interpret=True if ctx.dry_run else None,
      gpu_only=not ctx.dry_run, deadline=ctx.deadline, warmup=s.eb_warmup, log=ctx.log)
  targets = []
  for fmt in s.eb_formats:
    fmt_rows = [r for r in out["results"] if r["dtype"] == fmt]
    by_impl = {r["impl"]: r for r in fmt_rows}
    pallas, xla = by_impl.get("pallas"), by_impl.get("xla")
    whole = by_impl.get("-")                 # the table itself failed or was skipped
    gib = next((r["buffer_bytes"] for r in fmt_rows if "buffer_bytes" in r), 0) / 2**30
    name = f"embedding bag {fmt} ({gib:.1f} GiB buffer), Pallas of copy bandwidth"
    src = whole or pallas or {"error": "no Pallas row"}
    targets.append(_eb_target(name, src, "of_copy", EB_TARGETS.get(fmt), "{:.0%}",
                              lambda r: f"{r['ms']:.3f} ms, {r['bytes_per_s'] / 1e12:.2f} TB/s"))
    if fmt == "int8" or (pallas and xla and "ms" in pallas and "ms" in xla):
      name = f"embedding bag {fmt}, XLA gather ms / Pallas ms"
      if whole or not (pallas and xla) or "ms" not in pallas or "ms" not in xla:
        bad = whole or next((r for r in (pallas, xla) if r and "ms" not in r),
                            {"error": "no Pallas or XLA row"})
        targets.append(_eb_target(name, bad, "", None, "{:.2f}x", None))
      else:
        targets.append(judged(
            "embedding_bag", name, xla["ms"] / pallas["ms"],
            at_least=1.0 if fmt == "int8" else None,
            target="> 1.00x (faster than XLA)" if fmt == "int8" else "-",
            detail=f"Pallas {pallas['ms']:.3f} ms, XLA {xla['ms']:.3f} ms"))
  table = [{k: v for k, v in r.items() if k not in ("bytes_per_s",)} for r in out["results"]]
  return {"targets": targets, "details": {"copy_bytes_per_s": out["copy_bytes_per_s"],
                                          "config": out["config"],
                                          "tables": {"lookups": table}}}


def _eb_target(name, row, key, at_least, fmt, detail_fn) -> Target:
  if "error" in row or "skipped" in row:
    return judged("embedding_bag", name, None, at_least=at_least, fmt=fmt,
                  error=row.get("error"), skipped=row.get("skipped"))
  return judged("embedding_bag", name, row[key], at_least=at_least, fmt=fmt,
                detail=detail_fn(row) if detail_fn else "")


# ------------------------------------------------------------------------ recommendation


def part_rec_pipeline(ctx: Context) -> dict:
  """DLRM (Criteo Kaggle architecture): the train loop end to end against its jitted step,
  per data source; criteo_bin rows generated into a temporary directory and read in this
  process and in rp_workers Grain worker processes (train_rec's --data_workers)."""
  s = ctx.sizes
  targets, table, profiles = [], [], {}
  gen_dir = tempfile.mkdtemp(prefix="gpu_report_criteo_bin_")
  try:
    cases = [(data, w) for data in s.rp_data
             for w in (s.rp_workers if data.startswith("criteo_bin") else (0,))]
    for data, workers in cases:
      label = data + (f", {workers} data worker{'s' * (workers > 1)}" if workers else "")
      name = (f"DLRM train loop end to end / jitted step, batch {s.rp_batch}, {label}"
              f" ({s.rp_rows:,} rows per table)")
      skip = _skipped_reason(ctx)
      if skip:
        targets.append(judged("rec_pipeline", name, None, at_least=PIPELINE_TARGET,
                              skipped=skip))
        continue
      try:
        r = rec_bench.pipeline_rates(data, s.rp_batch, s.rp_rows, "dlrm", s.rp_preset, "-1",
                                     s.rp_steps, s.rp_source_batches, gen_dir, s.rp_gen_rows,
                                     repeats=s.rp_repeats, data_workers=workers,
                                     profile_dir=ctx.profile_dir(
                                         f"rec_pipeline_{data}_w{workers}"))
      except Exception as e:  # noqa: BLE001 - report and go on
        targets.append(judged("rec_pipeline", name, None, at_least=PIPELINE_TARGET,
                              error=fa_bench.error_text(e)))
        ctx.log(f"  {label}: FAILED {targets[-1].detail}")
        continue
      ctx.log(f"  {label}: source {r['source_examples_per_sec']:,.0f}, step "
              f"{r['step_examples_per_sec']:,.0f}, end to end "
              f"{r['end_to_end_examples_per_sec']:,.0f} ex/s")
      if "profile" in r:
        profiles[label] = r.pop("profile")
        ctx.log_profile(f"the loop on {label} (steps {s.rp_steps} with a traced window)",
                        profiles[label])
      table.append({"data": label, **r})
      targets.append(judged(
          "rec_pipeline", name, r["end_to_end_over_step"], at_least=PIPELINE_TARGET,
          detail=f"{r['end_to_end_examples_per_sec']:,.0f} vs {r['step_examples_per_sec']:,.0f}"
                 f" ex/s (source alone {r['source_examples_per_sec']:,.0f})"))
  finally:
    shutil.rmtree(gen_dir, ignore_errors=True)
  return {"targets": targets, "details": {"profiles": profiles,
                                          "tables": {"examples/s": table,
                                                     **_profile_tables(profiles)}}}


def _time_rec_step(ctx: Context, batch, rows, steps, repeats, warmup,
                   profile_label: str | None = None, **overrides) -> tuple[float, int, Any]:
  """(median seconds per step, devices, profile summary or None) of the MLPerf DCNv2 step,
  measured once per setting in a report (the fp8 part's bf16 step is the mlperf part's when
  they match); under --profile `steps` more steps are traced."""
  from core import benchmark
  from core import profiling
  key = ("dcnv2_mlperf_step", batch, rows, steps, repeats, warmup,
         tuple(sorted(overrides.items())))
  if key not in ctx.shared:
    step, state, pool, ndev = rec_bench.build_step(batch, rows, "-1", "auto", "dcnv2",
                                                   "mlperf", **overrides)
    per_step, state = rec_bench.time_step(step, state, pool, steps, repeats, warmup)
    summary = None
    trace_dir = ctx.profile_dir(profile_label) if profile_label else None
    if trace_dir:
      _, summary = profiling.profiled(
          trace_dir, lambda: rec_bench.time_step(step, state, pool, steps, 1, 0), steps=steps)
      ctx.log_profile(f"{profile_label} ({steps} steps)", summary)
    del state, pool
    ctx.shared[key] = (benchmark.median(per_step), ndev, summary)
  else:
    ctx.log("  (the same step as measured before in this report)")
  return ctx.shared[key]


def part_mlperf(ctx: Context) -> dict:
  """The MLPerf DLRM-DCNv2 preset's train step (synthetic multi-hot data of its shapes,
  tables capped at ml_rows rows, bf16 dense compute as NVIDIA's mixed precision) in
  examples/s per GPU against NVIDIA's 1.7M per H100."""
  s = ctx.sizes
  sec, ndev, profile = _time_rec_step(ctx, s.ml_batch, s.ml_rows, s.ml_steps, s.ml_repeats,
                                      s.ml_warmup, profile_label="mlperf_bf16",
                                      dtype="bfloat16")
  per_dev = s.ml_batch / sec / ndev
  ctx.log(f"  {per_dev:,.0f} examples/s per device ({1e3 * sec:.2f} ms per step of "
          f"{s.ml_batch}, {ndev} device(s))")
  t = judged("mlperf", f"DCNv2 MLPerf preset, examples/s per GPU over NVIDIA's 1.7M per H100 "
             f"(batch {s.ml_batch}, tables capped at {s.ml_rows:,} rows)",
             per_dev / MLPERF_REFERENCE, at_least=1.0,
             target=">= 1.00x (MLPerf Training v4.0: 13.8M ex/s on 8 H100)",
             detail=f"{per_dev / 1e6:.3f}M ex/s per GPU, {1e3 * sec:.2f} ms per step")
  return {"targets": [t], "details": {"examples_per_sec_per_device": per_dev,
                                      "step_ms": 1e3 * sec, "devices": ndev,
                                      "profile": profile,
                                      "tables": _profile_tables({"bf16 step": profile})}}


def part_fp8(ctx: Context) -> dict:
  """The MLPerf DCNv2 preset's step with FP8 on the probe's safe layers against bf16 (both
  bf16 activations, the mlperf part's batch and tables: its bf16 step is reused)."""
  from rec.models.dcnv2 import DCNv2Config
  s = ctx.sizes
  names = DCNv2Config.mlperf().fp8_layer_names
  safe = [p for p in s.fp8_layers if any(fnmatch.fnmatchcase(n, p) for n in names)]
  dropped = [p for p in s.fp8_layers if p not in safe]
  if dropped:
    ctx.log(f"  fp8 layers not in the MLPerf preset, dropped: {dropped} (its layers: {names})")
  if not safe:
    raise ValueError(f"--fp8_layers={','.join(s.fp8_layers)}: none names a layer of the MLPerf "
                     f"DCNv2 preset (its layers: {names})")
  times = {}
  for variant, over in (("bf16", {}), ("fp8", dict(fp8_layers=",".join(safe),
                                                   fp8_recipe=s.fp8_recipe))):
    skip = _skipped_reason(ctx)
    if skip:
      times[variant] = {"skipped": skip}
      continue
    sec, _, profile = _time_rec_step(
        ctx, s.ml_batch, s.ml_rows, s.ml_steps, s.ml_repeats, s.ml_warmup,
        profile_label="mlperf_bf16" if variant == "bf16" else "fp8_step", dtype="bfloat16",
        **over)
    times[variant] = {"step_ms": 1e3 * sec, "profile": profile}
    ctx.log(f"  {variant}: {1e3 * sec:.3f} ms per step of {s.ml_batch}")
  name = (f"DCNv2 MLPerf preset step, bf16 ms / FP8 ({s.fp8_recipe}) ms on "
          f"{','.join(safe)} (batch {s.ml_batch}, tables capped at {s.ml_rows:,} rows)")
  if all("step_ms" in v for v in times.values()):
    t = judged("fp8", name, times["bf16"]["step_ms"] / times["fp8"]["step_ms"], at_least=1.0,
               target="> 1.00x (FP8 faster than bf16)",
               detail=f"bf16 {times['bf16']['step_ms']:.3f} ms, FP8 "
                      f"{times['fp8']['step_ms']:.3f} ms")
  else:
    t = judged("fp8", name, None, at_least=1.0,
               skipped=next(v["skipped"] for v in times.values() if "skipped" in v))
  return {"targets": [t], "details": {
      "layers": safe, "dropped": dropped, "times": times,
      "tables": _profile_tables({f"{v} step": times[v].get("profile") for v in times})}}


# ------------------------------------------------------------------------ pytest


def _pytest_part(ctx: Context, label: str, args: Sequence[str], part: str) -> dict:
  """pytest's output goes to logs/<part>.out (the part's own log is logs/<part>.log)."""
  log_name = part + ".out"
  env = dict(os.environ, JAX_PLATFORMS=ctx.sizes.pt_platform,
             XLA_PYTHON_CLIENT_PREALLOCATE="false")   # this process holds most of the GPU
  env.pop("XLA_FLAGS", None)
  res = report_lib.run_pytest(list(args), env, ctx.time_left() - 1.0,
                              os.path.join(ctx.out_dir, "logs", log_name), REPO)
  c = res["counts"]
  text = (f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
          f"{c['errors']} errors")
  ctx.log(f"  {label}: {text}" + (" (timed out: partial)" if res["timed_out"] else "")
          + f" in {res['seconds']:.0f} s")
  bad = c["failed"] + c["errors"]
  if res["timed_out"]:
    status, detail = "partial", f"stopped at the part's time limit after {res['seconds']:.0f} s"
  elif res["returncode"] not in (0, 1) or not (c["passed"] + c["skipped"] + bad):
    status, detail = "failed", f"pytest exited {res['returncode']}; see logs/{log_name}"
  else:
    status, detail = ("met" if bad == 0 else "missed"), f"{res['seconds']:.0f} s"
  failures = [{"test": f["test"], "reason": _last_error_line(f["text"])}
              for f in res["failures"]]
  if failures:
    detail += "; failed: " + ", ".join(f["test"] for f in failures[:5]) + (
        f" and {len(failures) - 5} more" if len(failures) > 5 else "")
  for f in failures:
    ctx.log(f"  FAILED {f['test']}: {f['reason']}")
  t = Target(part, f"{label} (python -m pytest {' '.join(args)})",
             "0 failed, 0 errors", float(bad), text, status, detail)
  return {"targets": [t], "details": {"pytest": res, "tables": {"failures": failures}}}


def _last_error_line(text: str) -> str:
  """The line of a pytest failure report that says what went wrong (the first `E ` line:
  the exception and its message; else the last line)."""
  lines = [ln for ln in text.splitlines() if ln.strip()]
  errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
  return (errors[0] if errors else lines[-1].strip() if lines else "")[:300]


def part_pytest_gpu(ctx: Context) -> dict:
  """`JAX_PLATFORMS=cuda python -m pytest -m gpu`: passed / failed / skipped."""
  return _pytest_part(ctx, f"JAX_PLATFORMS={ctx.sizes.pt_platform} pytest -m gpu",
                      ctx.sizes.pt_gpu_args, "pytest_gpu")


def part_pytest_suite(ctx: Context) -> dict:
  """The default suite on one GPU: passed / failed / skipped (partial at its time limit)."""
  return _pytest_part(ctx, f"JAX_PLATFORMS={ctx.sizes.pt_platform} default suite",
                      ctx.sizes.pt_suite_args, "pytest_suite")


PARTS = {p.name: p for p in (
    report_lib.Part("attention", part_attention,
                    "flash attention fwd / bwd: Mosaic GPU (fused, split), Triton vs cuDNN"),
    report_lib.Part("lm_train", part_lm_train,
                    "Llama 3.2 1B train-step MFU at seq 8192 per attention_impl"),
    report_lib.Part("decode", part_decode, "bf16 decode ms/step vs the bandwidth floor"),
    report_lib.Part("quant_decode", part_quant_decode,
                    "weight-only int8 / int4 decode ms/step vs bf16"),
    report_lib.Part("embedding_bag", part_embedding_bag,
                    "embedding bag by row format vs copy bandwidth and XLA's gather"),
    report_lib.Part("rec_pipeline", part_rec_pipeline,
                    "DLRM train loop end to end vs its jitted step"),
    report_lib.Part("mlperf", part_mlperf, "DCNv2 MLPerf preset examples/s per GPU"),
    report_lib.Part("fp8", part_fp8, "DCNv2 FP8 (probe's safe layers) vs bf16 step time"),
    report_lib.Part("pytest_gpu", part_pytest_gpu, "pytest -m gpu on the GPU"),
    report_lib.Part("pytest_suite", part_pytest_suite, "the default suite on the GPU"),
)}
# Seconds per part on a fresh H100 (compilation included), as the first run there took
# (BENCHMARKS.md "GPU report"); they sum to the default --budget_s (about 10 minutes).
DEFAULT_BUDGETS = {"attention": 110, "lm_train": 130, "decode": 50, "quant_decode": 80,
                   "embedding_bag": 30,
                   "rec_pipeline": 100, "mlperf": 70, "fp8": 80, "pytest_gpu": 60,
                   "pytest_suite": 30}


def run_report(sizes: Sizes, parts: Sequence[str], out_dir: str, *, dry_run: bool,
               budget_s: float, budgets: dict[str, float] | None = None,
               settings: dict | None = None, profile: bool = False) -> dict[str, Any]:
  """Runs `parts` in order, each under min(its budget, what is left of `budget_s`), and
  writes out_dir/report.md and report.json after each; returns the report. Off a GPU
  only a dry run is allowed (RuntimeError naming --dry_run otherwise). `profile`: the
  decode, lm_train, rec_pipeline and mlperf parts also trace one timed case each
  (core.profiling: device busy time, kernels per step, top kernels) into their details
  and logs/profile_*."""
  import jax

  from core import benchmark
  unknown = [p for p in parts if p not in PARTS]
  if unknown:
    raise ValueError(f"--parts: {unknown} unknown, expected some of {list(PARTS)}")
  if not dry_run and jax.default_backend() != "gpu":
    raise RuntimeError(
        f"gpu_report: JAX's default backend is {jax.default_backend()!r}, not a GPU; the "
        "report measures GPU targets and its figures would mean nothing here. Run it on an "
        "H100 / H200, or pass --dry_run to run every part at toy sizes on CPU.")
  budgets = {**DEFAULT_BUDGETS, **(budgets or {})}
  os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
  t0 = time.monotonic()
  report = {"dry_run": dry_run, "machine": benchmark.machine(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": 0.0,
            "settings": settings or {}, "sizes": dataclasses.asdict(sizes), "targets": [],
            "parts": {}}
  ctx = Context(sizes=sizes, dry_run=dry_run, out_dir=out_dir, started=t0, profile=profile)
  for name in parts:
    left = budget_s - (time.monotonic() - t0)
    if left < 5:
      rec = {"status": "skipped", "error": f"the report's --budget_s={budget_s:g} ran out",
             "targets": [Target(name, f"{name} (whole part)", "-", None, "", "skipped",
                                f"the report's --budget_s={budget_s:g} ran out")]}
      ctx.log(f"== {name}: skipped, the report's budget ran out")
    else:
      with open(os.path.join(out_dir, "logs", f"{name}.log"), "a") as log_file:
        ctx.log_file = log_file
        rec = report_lib.run_part(PARTS[name], ctx, min(budgets[name], left))
        ctx.log_file = None
    report["targets"] += [dataclasses.asdict(t) for t in rec.pop("targets")]
    report["parts"][name] = rec
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report_lib.write_report(out_dir, report)
  return report


__all__ = ["CUDNN_STAND_IN", "DEFAULT_BUDGETS", "LM_IMPLS", "PARTS", "SUITE_DRY_RUN", "Sizes",
           "is_pipeline_data", "run_report"]
