r"""Kernel benchmarks on one GPU, one function per kernel family.

  python -m experiments.bench_kernels                                # every family, GPU
  python -m experiments.bench_kernels --kernels=flash_attention --seq_lens=4096,8192
  python -m experiments.bench_kernels --kernels=flash_attention --head_dims=128 \
      --mgpu_configs=64x128x2:fused,64x128x2:split,64x64x3
  python -m experiments.bench_kernels --interpret_check              # CPU: correctness only

flash_attention: TFLOP/s of the forward and of the backward of the Pallas kernels, "mgpu"
(`kernels/flash_attention_mgpu/`, Mosaic GPU, Hopper) and "triton"
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
and the others still run. The measuring code of both families is in experiments/benchmarks/
(attention.py, embedding_bag.py), shared with experiments.gpu_report.

Numbers need a GPU: on another backend the script refuses unless --interpret_check, which
runs each family's tiny kernel-vs-reference check in Pallas interpret mode (the Mosaic GPU
kernel in Pallas's GPU interpreter) and reports the errors.

Prints a table; writes results.json to --workdir; the last stdout line is a JSON summary.
To add a family: write its bench, check, table and summary functions (see `Family`) and
add it to FAMILIES; its flags go beside the others.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any, Callable, NamedTuple

# Pallas's GPU interpreter (--interpret_check) runs each warpgroup on its own XLA CPU thread;
# the CPU client's pool must have more threads than a 2-core machine gives by default. Only
# read when the CPU client starts.
os.environ.setdefault("PJRT_NPROC", "16")

from absl import app, flags  # noqa: E402

from core import cli  # noqa: E402
from core import config  # noqa: E402
from core import errors  # noqa: E402
from core import results as results_lib  # noqa: E402
from core import settings  # noqa: E402
from experiments.benchmarks import attention  # noqa: E402
from experiments.benchmarks import embedding_bag  # noqa: E402
from experiments.common.report import Report  # noqa: E402
from llm import settings as lm_settings  # noqa: E402,F401  (the LM settings by name)

FLAGS = flags.FLAGS


KERNELS = config.setting(
    "kernels", "list", "Kernel families to run (keys of FAMILIES).")
INTERPRET_CHECK = config.setting(
    "interpret_check", "bool", "Tiny kernel-vs-reference check in Pallas interpret mode (works on "
    "CPU).")
SEQ_LENS = config.setting(
    "seq_lens", "list", "Sequence lengths T = S.",
    item=config.Setting("seq_lens", "integer", "A sequence length.", lower=1))
TOKENS = config.setting(
    "tokens", "integer", "batch x seq_len (batch = tokens // seq_len, at least 1).", lower=1)
KV_HEADS = config.setting(
    "kv_heads", "integer", "Key/value heads G (0: = heads).", lower=0)
HEAD_DIMS = config.setting(
    "head_dims", "list", "Head dims K.",
    item=config.Setting("head_dims", "integer", "A head dim.", lower=1))
CAUSAL = config.setting(
    "causal", "list", "Causal settings to run.",
    item=config.Setting("causal", "bool", "Causal or not."))
BLOCK_Q = config.setting(
    "block_q", "integer", "Triton kernel forward block_q.", lower=1)
BLOCK_K = config.setting(
    "block_k", "integer", "Triton kernel forward block_k.", lower=1)
MGPU_CONFIGS = config.setting(
    "mgpu_configs", "list", "Mosaic GPU configs to time, each "
    "BLOCK_QxBLOCK_KVxSTAGES[:split|fused]: forward tiling (block_q rows per compute warpgroup) "
    "and backward variant (default fused at head dim 128, split at 64).")
EB_ROWS = config.setting(
    "eb_rows", "integer", "Rows per table.", lower=1)
EB_DIM = config.setting(
    "eb_dim", "integer", "Embedding dim.", lower=1)
EB_BATCH = config.setting(
    "eb_batch", "integer", "Bags per feature.", lower=1)
EB_FEATURES = config.setting(
    "eb_features", "integer", "Tables (features) in the flat buffer.", lower=1)
EB_BAG_LEN = config.setting(
    "eb_bag_len", "integer", "Ids per bag.", lower=1)
EB_DTYPES = config.setting(
    "eb_dtypes", "list", "Row formats.",
    item=config.Setting("eb_dtypes", "enum", "A row format.", choices=embedding_bag.FORMATS))

# The kernels take float16 inputs too: --dtype is the shared setting with that choice added.
DTYPE = dataclasses.replace(settings.DTYPE, choices=(*settings.DTYPE.choices, "float16"))


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, KERNELS, INTERPRET_CHECK, "workdir", "repeats", "steps", SEQ_LENS, TOKENS, "heads",
      KV_HEADS, HEAD_DIMS, DTYPE, "impls", CAUSAL, BLOCK_Q, BLOCK_K, MGPU_CONFIGS, EB_ROWS,
      EB_DIM, EB_BATCH, EB_FEATURES, EB_BAG_LEN, EB_DTYPES,
      kernels=["flash_attention", "embedding_bag"], interpret_check=False,
      workdir="runs/bench_kernels", repeats=5, steps=10, seq_lens=["4096", "8192", "16384"],
      tokens=16384, heads=["16"], kv_heads=0, head_dims=["128", "64"], dtype="bfloat16",
      impls=["mgpu", "triton", "cudnn", "xla"], causal=["true", "false"], block_q=128,
      block_k=128, mgpu_configs=["64x128x2"], eb_rows=1_000_000, eb_dim=128, eb_batch=8192,
      eb_features=26, eb_bag_len=20, eb_dtypes=["float32", "bfloat16", "int8", "int8_split"])
  flags.register_validator("heads", lambda v: len(v) == 1 and v[0].isdigit() and int(v[0]) >= 1,
                           message="expected one query head count >= 1")


def bench_config(fv=None):
  """The flags' values as the benchmarks read them (`cfg.heads`: the query head count)."""
  fv = FLAGS if fv is None else fv
  cfg = types.SimpleNamespace(**{name: fv[name].value for name in fv})
  cfg.heads = int(cfg.heads[0])
  return cfg


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
  targets = attention.mgpu_targets(rows)
  if targets:
    goal = attention.MGPU_TARGETS
    print(f"\nMosaic GPU kernel vs cuDNN (targets: forward >= {goal['fwd']}x, "
          f"backward >= {goal['bwd']}x)")
    for key, t in targets.items():
      cells = []
      for part in ("fwd", "bwd"):
        ratio = "-" if t[part]["ratio"] is None else f"{t[part]['ratio']:.2f}x"
        cells.append(f"{part} {ratio:>6} {t[part]['status']:<10}")
      print(f"  {key:<22} " + "  ".join(cells))


def summary_flash_attention(rows) -> dict:
  out = {}
  for r in rows:
    key = f"{r['impl']}/{attention.shape_key(r)}"
    if "error" in r:
      out[key] = {"error": r["error"]}
      continue
    out[key] = {"fwd_tflops": round(r["fwd_tflops"], 1), "bwd_tflops": round(r["bwd_tflops"], 1)}
    if "fwd_vs_cudnn" in r:
      out[key].update(fwd_vs_cudnn=round(r["fwd_vs_cudnn"], 3),
                      bwd_vs_cudnn=round(r["bwd_vs_cudnn"], 3))
  targets = attention.mgpu_targets(rows)
  if targets:
    out["mgpu_targets"] = {k: {p: v[p]["status"] for p in ("fwd", "bwd")}
                           for k, v in targets.items()}
  return out


# ------------------------------------------------------------------------ embedding bag


def bench_embedding_bag(cfg) -> dict:
  """experiments.benchmarks.embedding_bag's result: {"device", "copy_bytes_per_s", "config",
  "results": one row per (format, impl), with "error" for an implementation that failed}."""
  out = embedding_bag.bench_embedding_bag(
      num_rows=cfg.eb_rows, dim=cfg.eb_dim, batch=cfg.eb_batch, features=cfg.eb_features,
      bag_len=cfg.eb_bag_len, dtypes=tuple(cfg.eb_dtypes), repeats=cfg.repeats)
  print(embedding_bag.format_table(out), flush=True)
  return out


def table_embedding_bag(out):
  print("\nembedding_bag")
  print(embedding_bag.format_table(out))


class Family(NamedTuple):
  """One kernel family: timed results on a GPU, a tiny interpret-mode check, how to print."""
  bench: Callable[[Any], Any]     # flags -> JSON-able results
  check: Callable[[], dict]       # {variant: {"rel_err": {...}, "tol": float, "ok": bool}}
  table: Callable[[Any], None]
  summary: Callable[[Any], dict]


FAMILIES = {
    "flash_attention": Family(lambda cfg: attention.bench_flash_attention(cfg),
                              attention.check_flash_attention, table_flash_attention,
                              summary_flash_attention),
    "embedding_bag": Family(bench_embedding_bag, embedding_bag.check_embedding_bag,
                            table_embedding_bag, embedding_bag.summary),
}


def check_flags() -> None:
  """The lists the chosen families read, checked before anything is compiled or timed (each
  value of --seq_lens, --head_dims, --causal and --eb_dtypes is checked while parsing)."""
  def refuse(flag, found, want):
    value = ",".join(str(v) for v in FLAGS[flag].value)
    raise errors.expected(f"--{flag}={value}", found, want)

  if not FLAGS.kernels:
    refuse("kernels", "no kernel family", f"some of {sorted(FAMILIES)}")
  unknown = [k for k in FLAGS.kernels if k not in FAMILIES]
  if unknown:
    refuse("kernels", f"unknown {unknown}", f"some of {sorted(FAMILIES)}")
  if FLAGS.interpret_check:   # the checks take no sizes
    return
  if "flash_attention" in FLAGS.kernels:
    for flag in ("seq_lens", "head_dims", "causal", "impls"):
      if not FLAGS[flag].value:
        refuse(flag, "nothing to time", "at least one value")
    unknown = [i for i in FLAGS.impls if i not in attention.ATTENTION_IMPLS]
    if unknown:
      refuse("impls", f"unknown {unknown}", f"some of {list(attention.ATTENTION_IMPLS)}")
    if "mgpu" in FLAGS.impls:
      if not FLAGS.mgpu_configs:
        refuse("mgpu_configs", "no config for --impls=mgpu", "at least one")
      for c in FLAGS.mgpu_configs:
        try:
          attention.parse_mgpu_config(c)
        except app.UsageError as e:
          raise errors.UserError(str(e)) from None
  if "embedding_bag" in FLAGS.kernels and not FLAGS.eb_dtypes:
    refuse("eb_dtypes", "nothing to time", f"some of {list(embedding_bag.FORMATS)}")


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax

  from core import benchmark

  check_flags()
  report = Report(FLAGS.workdir)
  report.path()
  cfg = bench_config()
  out = {"machine": benchmark.machine(), "flags": {
      k: getattr(cfg, k) for k in ("kernels", "seq_lens", "tokens", "heads", "kv_heads",
                                  "head_dims", "dtype", "impls", "causal", "block_q", "block_k",
                                  "mgpu_configs", "repeats", "steps", "interpret_check")}}

  if FLAGS.interpret_check:
    checks = {name: FAMILIES[name].check() for name in FLAGS.kernels}
    out["checks"] = checks
    ok = all(r["ok"] for c in checks.values() for r in c.values())
    report.finish(out, {"interpret_check": "ok" if ok else "failed",
                        "rel_err": {n: {d: r["rel_err"] for d, r in c.items()}
                                    for n, c in checks.items()}})
    sys.exit(0 if ok else 1)

  if jax.default_backend() != "gpu":
    msg = (f"bench_kernels: the default JAX backend is {jax.default_backend()!r}; kernel "
           "TFLOP/s need a GPU (the Pallas kernels only run interpreted here). Run it on a "
           "CUDA machine, or pass --interpret_check for a tiny correctness check.")
    print(msg, file=sys.stderr)
    results_lib.print_summary({"refused": msg})
    sys.exit(2)

  results, summary = {}, {}
  for name in FLAGS.kernels:
    print(f"{name}:", flush=True)
    try:
      results[name] = FAMILIES[name].bench(cfg)
      summary[name] = FAMILIES[name].summary(results[name])
    except app.UsageError:
      raise
    except Exception as e:  # noqa: BLE001 - one family failing must not end the others
      results[name] = summary[name] = {"error": attention.error_text(e)}
      print(f"  {name}: FAILED {results[name]['error']}", flush=True)
  for name in FLAGS.kernels:
    if "error" in summary[name] and len(summary[name]) == 1:
      print(f"\n{name}: failed: {summary[name]['error']}")
    else:
      FAMILIES[name].table(results[name])
  out["results"] = results
  report.finish(out, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
