r"""Train a small Llama (arXiv 2407.21783) on a local text file: byte tokens, or a tokenizer's.

  python -m experiments.train_lm --text=README.md --steps=300       # ~4 minutes on 2 CPU cores
  python -m experiments.train_lm --text=book.txt --tokenizer=/path/to/tokenizer.json
  python -m experiments.train_lm --text=book.txt --preset=byte_small --mesh=fsdp:2,tp:4 \
      --dtype=bfloat16 --remat --workdir=/tmp/lm
  python -m experiments.train_lm --text=book.txt --workdir=/tmp/lm --resume
  python -m experiments.generate --checkpoint=workdir:/tmp/lm --prompt="Once upon"

Uses the shared train loop (checkpoints, --resume, metrics.jsonl, TensorBoard, curves.png).
--tokenizer (llm.tokenizer: a tokenizer.json, a directory holding one, or a llama2.c
tokenizer.bin) encodes the file as one text without BOS; the model's vocabulary is the
tokenizer's, and a copy of the tokenizer goes into the workdir for experiments.generate.
Writes `<workdir>/model_config.json` (read by experiments.generate) and results.json; the
last stdout line is a JSON summary with the final eval loss and bits per token (per byte
for byte tokens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time

from absl import flags

from core import cli
from core import results as results_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  flags.DEFINE_string("text", None, "Text file to train on (bytes are tokens unless --tokenizer).",
                      required=True)
  flags.DEFINE_string("tokenizer", None, "tokenizer.json, a directory holding one, or a llama2.c "
                      "tokenizer.bin (default: UTF-8 bytes, vocab 256).")
  flags.DEFINE_string("preset", "tiny", "Llama size from llm.config.PRESETS (its vocab is set to "
                      "the tokenizer's).")
  flags.DEFINE_string("mesh", "-1", "Mesh, e.g. fsdp:8, data:2,tp:4, fsdp:2,tp:4; -1 = all devices "
                      "on the data axis.")
  flags.DEFINE_integer("seq_len", 128, "Tokens per training sequence.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 16, "Global batch size (sequences).", lower_bound=1)
  flags.DEFINE_integer("steps", 300, "Train steps.", lower_bound=1)
  flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
  flags.DEFINE_integer("warmup_steps", 30, "Linear warmup steps.", lower_bound=0)
  flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only).")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype (params stay fp32).")
  flags.DEFINE_bool("remat", False, "Rematerialize each block in the backward pass.")
  flags.DEFINE_string("attention_impl", "xla", "Attention implementation (llm.attention).")
  flags.DEFINE_enum("context_parallel", "none", ["none", "pass_kv", "pass_q", "auto"],
                    "Ring attention over the mesh's cp axis (LlamaConfig.context_parallel).")
  flags.DEFINE_integer("eval_every", 100, "Evaluate every N steps (0: only at the end).", lower_bound=0)
  flags.DEFINE_integer("eval_batches", 8, "Eval batches from the held-out tail of the file.", lower_bound=1)
  flags.DEFINE_integer("checkpoint_every", 0, "Checkpoint every N steps (0: only at the end).", lower_bound=0)
  flags.DEFINE_integer("log_every", 25, "Progress line every N steps.", lower_bound=1)
  flags.DEFINE_integer("stop_at_step", None, "Stop (with a checkpoint) at this step.", lower_bound=1)
  flags.DEFINE_string("workdir", "runs/train_lm", "Output directory.")
  flags.DEFINE_bool("resume", False, "Continue the run whose checkpoints are in --workdir (its "
                    "saved model / optimizer / data settings must match these flags).")
  flags.DEFINE_list("resume_allow", [], "Settings --resume may change deliberately, e.g. "
                    "optim.peak_lr,optim.total_steps.")
  flags.DEFINE_bool("overwrite", False, "Delete the checkpoints and metrics in --workdir first.")
  flags.DEFINE_enum("nonfinite", "stop", ["stop", "skip"], "A NaN / inf loss or gradient norm: "
                    "stop the run at that step, or skip the step (counted).")
  flags.DEFINE_integer("check_every", 100, "Check losses for NaN / inf at least every N steps.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seed of parameters and batch sampling.", lower_bound=0)


def copy_tokenizer(tok, workdir: str) -> None:
  """Copies the tokenizer file (and a HF tokenizer's tokenizer_config.json and
  generation_config.json, which name its special tokens) into the workdir, where
  experiments.generate --checkpoint=workdir:DIR finds it."""
  src_dir = os.path.dirname(os.path.abspath(tok.source))
  if tok.source.endswith(".json"):
    names = [(tok.source, "tokenizer.json")] + [
        (os.path.join(src_dir, n), n) for n in ("tokenizer_config.json", "generation_config.json")
        if os.path.exists(os.path.join(src_dir, n))]
  else:
    names = [(tok.source, "tokenizer.bin")]
  for src, name in names:
    dst = os.path.join(workdir, name)
    if os.path.abspath(src) != os.path.abspath(dst):
      shutil.copyfile(src, dst)


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import checkpoint as ckpt_lib
  import jax
  from core import mesh as mesh_lib
  from core import plot as plot_lib
  from core import train as train_lib
  from llm import config as config_lib
  from llm import train_lib as lm_lib
  from llm import tokenizer as tok_lib
  from llm.data import TextSource

  tok = None if FLAGS.tokenizer is None else tok_lib.load_tokenizer(FLAGS.tokenizer)
  cfg = config_lib.get_config(
      FLAGS.preset, vocab_size=tok_lib.ByteTokenizer.vocab_size if tok is None else tok.vocab_size,
      dtype=FLAGS.dtype, remat=FLAGS.remat,
      attention_impl=FLAGS.attention_impl, context_parallel=FLAGS.context_parallel,
      max_seq_len=max(FLAGS.seq_len, 16))
  mesh = mesh_lib.make_mesh(FLAGS.mesh, rules=mesh_lib.LLM_RULES)
  train_lib.check_learning_rate("--learning_rate", FLAGS.learning_rate)
  optim = lm_lib.OptimConfig(peak_lr=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                             total_steps=FLAGS.steps, weight_decay=FLAGS.weight_decay)
  # The run's settings, saved with each checkpoint and compared on --resume.
  settings = {**{f"model.{k}": v for k, v in config_lib.config_to_dict(cfg).items()},
              **{f"optim.{k}": v for k, v in dataclasses.asdict(optim).items()},
              "data.text": os.path.abspath(FLAGS.text), "data.tokenizer": FLAGS.tokenizer and os.path.abspath(FLAGS.tokenizer),
              "data.seq_len": FLAGS.seq_len, "data.batch_size": FLAGS.batch_size,
              "data.eval_batches": FLAGS.eval_batches,
              "mesh": ",".join(f"{a}:{n}" for a, n in mesh.shape.items())}
  loop_cfg = train_lib.TrainConfig(
      workdir=FLAGS.workdir, steps=FLAGS.steps, eval_every=FLAGS.eval_every,
      checkpoint_every=FLAGS.checkpoint_every, log_every=FLAGS.log_every, resume=FLAGS.resume,
      stop_at_step=FLAGS.stop_at_step, seed=FLAGS.seed, settings=settings,
      # Placement and kernels change no arithmetic that the state depends on.
      changeable=("mesh", "model.attention_impl", "model.context_parallel", "model.remat",
                  "model.remat_policy", "data.eval_batches"),
      resume_allow=tuple(FLAGS.resume_allow), overwrite=FLAGS.overwrite,
      nonfinite=FLAGS.nonfinite, check_every=FLAGS.check_every,
      nonfinite_hint="lower --learning_rate or raise --warmup_steps")
  try:
    train_lib.check_resume(loop_cfg)  # before model_config.json is written over
  except train_lib.RunSettingsError as e:
    sys.exit(f"train_lm: {e}")
  loop_cfg = dataclasses.replace(loop_cfg, overwrite=False)
  task = lm_lib.LMTask(cfg, optim, mesh)
  share = dict(zip(("shard_index", "num_shards"),
                   mesh_lib.process_batch_share(mesh, mesh_lib.LLM_RULES, "act_batch")))
  train_src = TextSource(FLAGS.text, FLAGS.seq_len, FLAGS.batch_size, tokenizer=tok,
                         seed=FLAGS.seed, **share)
  eval_src = TextSource(FLAGS.text, FLAGS.seq_len, FLAGS.batch_size, tokenizer=tok,
                        split="eval", eval_batches=FLAGS.eval_batches, **share)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(FLAGS.workdir, "model_config.json"), "w") as f:
      json.dump(config_lib.config_to_dict(cfg), f, indent=2)
    if tok is not None:
      copy_tokenizer(tok, FLAGS.workdir)
  unit = "byte" if tok is None else "token"
  print(f"mesh {dict(mesh.shape)} | Llama {FLAGS.preset}: {cfg.num_params() / 1e6:.2f}M params, "
        f"{cfg.flops_per_token(FLAGS.seq_len) / 1e6:.1f} MFLOPs/token (train) | "
        f"{len(train_src.tokens):,} train {unit}s | {FLAGS.steps} steps of "
        f"{FLAGS.batch_size}x{FLAGS.seq_len}", flush=True)
  t0 = time.time()
  try:
    out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0), loop_cfg)
  except (train_lib.RunSettingsError, train_lib.NonFiniteError,
          ckpt_lib.CheckpointMismatchError) as e:
    sys.exit(f"train_lm: {e}")
  ev = out["eval"]
  summary = {"preset": FLAGS.preset, "mesh": dict(mesh.shape), "steps": out["step"],
             "finished": out["finished"], "eval_loss": ev.get("loss"),
             "eval_bits_per_token": ev.get("bits_per_token"),
             "eval_bits_per_byte": ev.get("bits_per_token") if tok is None else None,
             "tokenizer": FLAGS.tokenizer, "tokens_per_sec": out["examples_per_sec"],
             "params": cfg.num_params(), "wall_seconds": time.time() - t0}
  results = {"summary": summary, "model_config": config_lib.config_to_dict(cfg),
             "optim": dataclasses.asdict(optim), "eval": ev}
  results_lib.write_results(FLAGS.workdir, results)
  plot_lib.plot_run(FLAGS.workdir)
  if ev:
    print(f"eval loss {ev['loss']:.4f} | {ev['bits_per_token']:.3f} bits/{unit} | "
          f"{out['examples_per_sec']:,.0f} train tokens/s", flush=True)
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
