r"""Llama training-step throughput and MFU, with a breakdown of where the step goes.

  python -m experiments.bench_lm_train --preset=llama32_1b --seq_len=8192 --batch=1
  python -m experiments.bench_lm_train --preset=tiny --seq_len=64 --batch=2 --steps=2   # CPU

One jitted, donated `LMTask.train_step` (llm/train_lib.py: bf16 compute by default, fp32
master weights, AdamW, the chunked cross-entropy) on random tokens, timed over --steps per
repeat after a warm-up; the median step gives tokens/s and MFU = tokens/s x
`LlamaConfig.flops_per_token(seq_len)` / (devices x peak), the peak read from
`core.benchmark.PEAK_FLOPS` by the device kind and printed with it (none on CPU); the
measuring is `experiments.benchmarks.lm_train.run_benchmark`. --breakdown times the parts
separately, each jitted on its own, same shapes:
  forward          the loss alone (no gradients);
  forward+backward the gradients, no optimizer;
  no-attention     forward+backward with attention replaced by a pass-through of q (what
                   the step costs without attention; the difference is attention's share);
  loss head        the output projection + chunked cross-entropy, forward and backward;
  optimizer        clipping + AdamW on fixed gradients.
It also reports XLA's cost analysis of the compiled step (FLOPs, bytes accessed) and its
memory analysis (temporaries, arguments). --profile writes a jax.profiler trace of a few
steps to <workdir>/profile (TensorBoard / Perfetto); --xla_dump writes XLA's HLO passes to
<workdir>/xla_dump and the compiled step's HLO to <workdir>/step.hlo.txt.
Writes results.json; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from core import results as results_lib
from core import settings  # noqa: F401  (the shared settings by name)
from experiments.benchmarks import lm_train
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS


MU_DTYPE = config.setting(
    "mu_dtype", "enum", "AdamW first-moment dtype.", choices=("float32", "bfloat16"))
LOSS_CHUNK = config.setting(
    "loss_chunk", "integer", "Tokens per chunk of the cross-entropy (-1: auto, 0: plain loss over "
    "full logits).", lower=-1)
WARMUP = config.setting(
    "warmup", "integer", "Untimed steps after compiling.", lower=0)
BREAKDOWN = config.setting(
    "breakdown", "bool", "Time forward, backward, attention, loss head, optimizer.")
XLA_DUMP = config.setting(
    "xla_dump", "bool", "XLA HLO dumps to <workdir>/xla_dump.")


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, "preset", "seq_len", "batch", "mesh", "attention_impl", "remat", "dtype", MU_DTYPE,
      LOSS_CHUNK, "steps", "repeats", WARMUP, BREAKDOWN, "profile", XLA_DUMP, "workdir",
      preset="llama32_1b", seq_len=8192, batch=1, mesh="data:1", attention_impl="auto",
      remat="none", dtype="bfloat16", mu_dtype="float32", loss_chunk=-1, steps=10, repeats=3,
      warmup=2, breakdown=True, profile=False, xla_dump=False, workdir="runs/bench_lm_train")


def main(argv):
  del argv
  cli.quiet_library_logs()
  os.makedirs(FLAGS.workdir, exist_ok=True)
  if FLAGS.xla_dump:
    dump = os.path.abspath(os.path.join(FLAGS.workdir, "xla_dump"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
  import jax
  from llm.config import get_config

  cfg = get_config(FLAGS.preset, dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl,
                   remat=FLAGS.remat != "none",
                   remat_policy="full" if FLAGS.remat == "none" else FLAGS.remat,
                   max_seq_len=max(FLAGS.seq_len, get_config(FLAGS.preset).max_seq_len))
  res = lm_train.run_benchmark(
      cfg, seq_len=FLAGS.seq_len, batch=FLAGS.batch, mesh_spec=FLAGS.mesh,
      mu_dtype=FLAGS.mu_dtype, loss_chunk=None if FLAGS.loss_chunk < 0 else FLAGS.loss_chunk,
      steps=FLAGS.steps, repeats=FLAGS.repeats, warmup=FLAGS.warmup, breakdown=FLAGS.breakdown,
      profile_dir=os.path.join(FLAGS.workdir, "profile") if FLAGS.profile else None,
      hlo_path=os.path.join(FLAGS.workdir, "step.hlo.txt") if FLAGS.xla_dump else None)
  from core import benchmark
  res["preset"] = FLAGS.preset
  res["machine"] = benchmark.machine()

  print(f"Llama {FLAGS.preset} ({res['params'] / 1e6:,.1f}M params) | seq {FLAGS.seq_len} | "
        f"batch {FLAGS.batch} | mesh {FLAGS.mesh} ({res['devices']} x {res['device_kind']}) | "
        f"attention {cfg.attention_impl} ({res['attention_resolved']}) | remat {res['remat']} "
        f"| {cfg.dtype} compute, mu {FLAGS.mu_dtype}")
  print(f"{'step ms':>10s}{'tokens/s':>14s}{'model TFLOP/s':>16s}{'MFU':>9s}")
  mfu = "n/a" if res["mfu"] is None else f"{100 * res['mfu']:.1f}%"
  print(f"{res['step_ms']:10.1f}{res['tokens_per_s']:14,.0f}{res['model_tflops_per_s']:16.1f}"
        f"{mfu:>9s}")
  if res["peak_tflops_per_device"] is None:
    print(f"MFU: no peak FLOP/s known for {res['device_kind']!r} "
          f"({jax.default_backend()}); core.benchmark.PEAK_FLOPS lists the GPUs")
  else:
    print(f"MFU against {res['peak_tflops_per_device']:.0f} TFLOP/s per device "
          f"({res['device_kind']}, dense {cfg.dtype}); model FLOPs "
          f"{res['model_flops_per_token'] / 1e9:.2f} GFLOP/token (LlamaConfig.flops_per_token)")
  if res.get("xla_flops"):
    print(f"XLA cost analysis of the step: {res['xla_flops'] / 1e12:.2f} TFLOP, "
          f"{res['xla_bytes_accessed'] / 1e9:.2f} GB accessed; temporaries "
          f"{(res['temp_bytes'] or 0) / 2**30:.2f} GiB")
  if "breakdown_ms" in res:
    print("\nbreakdown (each part jitted alone, median ms):")
    for name, ms in res["breakdown_ms"].items():
      print(f"  {name:32s}{ms:10.2f}{100 * ms / res['step_ms']:8.1f}% of the step")
  results_lib.write_results(FLAGS.workdir, res)
  summary = {k: res[k] for k in ("preset", "seq_len", "batch", "mesh", "attention_impl",
                                 "attention_resolved", "remat", "step_ms", "tokens_per_s", "model_tflops_per_s",
                                 "mfu", "peak_tflops_per_device", "device_kind")}
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
