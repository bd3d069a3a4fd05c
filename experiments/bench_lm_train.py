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
steps to <workdir>/profile (TensorBoard / Perfetto); --xla_dump writes XLA's HLO passes of
the step to <workdir>/xla_dump and the compiled step's HLO to <workdir>/step.hlo.txt (with
--compare: each variant's passes in <workdir>/xla_dump/<variant>).
Writes results.json; the last stdout line is a JSON summary.

--compare: LoRA (and QLoRA-style int8 / int4 base weights) against full fine-tuning, memory
and step time, side by side in one run:

  python -m experiments.bench_lm_train --compare=full,lora,qlora8,qlora4 --preset=llama32_1b \
      --seq_len=2048 --batch=4 --lora_rank=16 --lora_targets=attention,mlp           # GPU
  python -m experiments.bench_lm_train --compare=full,lora,qlora8,qlora4 \
      --init=gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --seq_len=256 --batch=4 \
      --lora_rank=16 --steps=2 --repeats=5 --warmup=1 --workdir=runs/lora_vs_full     # CPU

  full    every weight trained: fp32 master weights, AdamW state of every parameter;
  lora    adapters of --lora_rank on the --lora_targets projections (llm.lora), the base
          frozen in the compute dtype (--dtype), AdamW state of the adapters only;
  qlora8  the same adapters, the base's matrices int8 (groups of 32, float16 scale);
  qlora4  the same, int4 (groups of 32, float16 scale and minimum; llm.quantized).
Same weights (--init's, else random at --preset), same random tokens, the same compute
dtype, remat and attention. Reported per variant: trainable parameters, bytes of the
parameters, adapters and optimizer state, XLA's memory analysis of the compiled step
(argument / temporary / output bytes, per device), the median step and tokens/s, and each
figure's ratio to full fine-tuning; the timed repeats (--steps steps each) are interleaved
(full, lora, qlora8, qlora4, full, ...), so a busy machine slows every variant alike.
Writes results.json, compare.png (experiments.benchmarks.lm_train.plot_comparison) and the
markdown table. --breakdown and --profile are single-step measurements, refused here;
--lora_rank / --lora_alpha / --lora_targets are read by the LoRA variants only, refused
without one.
--init (any --compare or not) takes the model's shape from a checkpoint; without --compare
its weights are not read (random weights time the same).
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings  # noqa: F401  (the shared settings by name)
from experiments.benchmarks import lm_train
from experiments.common.report import Report
from llm import run_config  # train_lm's LoRA and --init settings by name; check_attention
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
COMPARE = config.setting(
    "compare", "enum", "Fine-tuning variants measured side by side instead of the one step: "
    "full (every weight), lora (adapters on a frozen base in the compute dtype), qlora8 / "
    "qlora4 (adapters on an int8 / int4 base).", choices=lm_train.VARIANTS)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, "preset", "init", "seq_len", "batch", "mesh", "attention_impl", "remat", "dtype",
      MU_DTYPE, LOSS_CHUNK, "steps", "repeats", WARMUP, BREAKDOWN, "profile", XLA_DUMP,
      COMPARE.several(), config.get("lora_rank").narrowed(lower=1), "lora_alpha",
      "lora_targets", "workdir",
      preset="llama32_1b", seq_len=8192, batch=1, mesh="data:1", attention_impl="auto",
      remat="none", dtype="bfloat16", mu_dtype="float32", loss_chunk=-1, steps=10, repeats=3,
      warmup=2, breakdown=True, profile=False, xla_dump=False, compare=(), lora_rank=16,
      lora_alpha=32.0, lora_targets=("attention", "mlp"), workdir="runs/bench_lm_train")


def model_config():
  """The LlamaConfig measured: --preset's, or --init's shape (a checkpoint), at --dtype,
  --attention_impl, --remat, with a context of at least --seq_len."""
  from llm.config import get_config
  numerics = dict(dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl,
                  remat=FLAGS.remat != "none",
                  remat_policy="full" if FLAGS.remat == "none" else FLAGS.remat)
  if FLAGS.init:
    if FLAGS["preset"].present:
      raise errors.expected(f"--preset={FLAGS.preset} --init={FLAGS.init}", "both given",
                            "one: --init's checkpoint sets the model's shape")
    from llm import checkpoints
    cfg = checkpoints.load_config(FLAGS.init)
    return cfg.replace(max_seq_len=max(FLAGS.seq_len, cfg.max_seq_len), **numerics)
  return get_config(FLAGS.preset, max_seq_len=max(FLAGS.seq_len,
                                                  get_config(FLAGS.preset).max_seq_len),
                    **numerics)


def compare(cfg, dump, report: Report) -> None:
  """--compare: the fine-tuning variants side by side (table, plot, results.json)."""
  from core import benchmark
  from llm import lora as lora_lib
  lora = None
  if any(v != "full" for v in FLAGS.compare):
    lora = lora_lib.LoraConfig(FLAGS.lora_rank, FLAGS.lora_alpha, tuple(FLAGS.lora_targets))
  weights = None
  if FLAGS.init:
    from llm import checkpoints
    _, weights, _ = checkpoints.load_pretrained(FLAGS.init)
  res = lm_train.compare_finetuning(
      cfg, lora, variants=tuple(dict.fromkeys(FLAGS.compare)), weights=weights,
      seq_len=FLAGS.seq_len, batch=FLAGS.batch, mesh_spec=FLAGS.mesh, mu_dtype=FLAGS.mu_dtype,
      loss_chunk=None if FLAGS.loss_chunk < 0 else FLAGS.loss_chunk, steps=FLAGS.steps,
      repeats=FLAGS.repeats, warmup=FLAGS.warmup, xla_dump_dir=dump)
  res.update(preset=None if FLAGS.init else FLAGS.preset, init=FLAGS.init,
             machine=benchmark.machine())
  model = FLAGS.init or FLAGS.preset
  lora_text = ("" if lora is None else f" | LoRA rank {lora.rank}, alpha {lora.alpha:g} on "
               f"{','.join(lora.targets)}")
  print(f"Llama {model} ({res['params'] / 1e6:,.1f}M params) | seq {FLAGS.seq_len} | batch "
        f"{FLAGS.batch} | mesh {FLAGS.mesh} ({res['devices']} x {res['device_kind']}) | "
        f"{cfg.dtype} compute, mu {FLAGS.mu_dtype} | remat {res['remat']}{lora_text}")
  print(f"median of {FLAGS.repeats} interleaved repeats of {FLAGS.steps} steps each; XLA "
        "bytes per device, of the compiled step\n")
  report.table(lm_train.comparison_table(res))
  print(f"\nplot: {report.path('compare.png')}")
  summary = {"model": model, "seq_len": FLAGS.seq_len, "batch": FLAGS.batch,
             "device_kind": res["device_kind"],
             **{f"{v}_step_ms": round(r["step_ms"], 2) for v, r in res["variants"].items()},
             **{f"{v}_optimizer_state_bytes": r["optimizer_state_bytes"]
                for v, r in res["variants"].items()},
             **{f"{v}_step_vs_full": round(q["step_ms"], 3) for v, q in res["ratios"].items()}}
  report.finish(res, summary, plots=[(lm_train.plot_comparison, (res,), "compare.png")])


def check_flags() -> None:
  """What the flags alone can refuse, each naming its flag, before a checkpoint is read or
  anything is built: unknown names, a loss chunk that does not divide --seq_len, settings
  of the other mode (--breakdown / --profile with --compare, LoRA settings without a LoRA
  variant, which nothing would read)."""
  from llm import attention
  from llm.config import PRESETS
  if not FLAGS.init and FLAGS.preset not in PRESETS:
    raise errors.expected(f"--preset={FLAGS.preset}", "unknown",
                          f"one of {', '.join(sorted(PRESETS))}")
  attention.check_impl(FLAGS.attention_impl, "--attention_impl")
  if FLAGS.loss_chunk > 0 and FLAGS.seq_len % FLAGS.loss_chunk:
    raise errors.expected(f"--loss_chunk={FLAGS.loss_chunk}", f"does not divide --seq_len="
                          f"{FLAGS.seq_len}", "a divisor of it, 0 (plain loss) or -1 (auto)")
  if FLAGS.compare:
    for flag in ("breakdown", "profile"):
      if FLAGS[flag].present and FLAGS[flag].value:
        raise errors.expected(f"--{flag} with --compare", "a single-step measurement",
                              f"--compare alone, or --{flag} without --compare")
  if not any(v != "full" for v in FLAGS.compare):
    given = [f"--{n}" for n in ("lora_rank", "lora_alpha", "lora_targets") if FLAGS[n].present]
    if given:
      raise errors.expected(", ".join(given), "given without a LoRA variant to read "
                            f"{'them' if len(given) > 1 else 'it'} (--compare="
                            f"{','.join(FLAGS.compare)})", "--compare with lora, qlora8 or "
                            "qlora4")
  else:
    from llm import lora as lora_lib
    lora_lib.LoraConfig(FLAGS.lora_rank, FLAGS.lora_alpha, tuple(FLAGS.lora_targets))


def check_attention(cfg) -> None:
  """--attention_impl=cudnn where cuDNN cannot run it (dtype, head dim, no GPU with cuDNN),
  refused naming the flags before anything compiles (llm.run_config.check_attention)."""
  import types
  f = types.SimpleNamespace(attention_impl=cfg.attention_impl, packing="none",
                            cp_sharding="seq", context_parallel=cfg.context_parallel,
                            dtype=cfg.dtype, preset=f"(none; --init={FLAGS.init})"
                            if FLAGS.init else FLAGS.preset)
  run_config.check_attention(f, cfg)


def main(argv):
  del argv
  cli.quiet_library_logs()
  check_flags()
  report = Report(FLAGS.workdir)
  report.path()
  dump = os.path.join(FLAGS.workdir, "xla_dump") if FLAGS.xla_dump else None
  import jax

  cfg = model_config()
  check_attention(cfg)
  if FLAGS.compare:
    return compare(cfg, dump, report)
  res = lm_train.run_benchmark(
      cfg, seq_len=FLAGS.seq_len, batch=FLAGS.batch, mesh_spec=FLAGS.mesh,
      mu_dtype=FLAGS.mu_dtype, loss_chunk=None if FLAGS.loss_chunk < 0 else FLAGS.loss_chunk,
      steps=FLAGS.steps, repeats=FLAGS.repeats, warmup=FLAGS.warmup, breakdown=FLAGS.breakdown,
      profile_dir=os.path.join(FLAGS.workdir, "profile") if FLAGS.profile else None,
      hlo_path=os.path.join(FLAGS.workdir, "step.hlo.txt") if FLAGS.xla_dump else None,
      xla_dump_dir=dump)
  from core import benchmark
  res["preset"] = None if FLAGS.init else FLAGS.preset
  res["init"] = FLAGS.init
  res["machine"] = benchmark.machine()

  print(f"Llama {FLAGS.init or FLAGS.preset} ({res['params'] / 1e6:,.1f}M params) | seq {FLAGS.seq_len} | "
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
  summary = {k: res[k] for k in ("preset", "init", "seq_len", "batch", "mesh", "attention_impl",
                                 "attention_resolved", "remat", "step_ms", "tokens_per_s", "model_tflops_per_s",
                                 "mfu", "peak_tflops_per_device", "device_kind")}
  report.finish(res, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
