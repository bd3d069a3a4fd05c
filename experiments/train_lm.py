r"""Train a small Llama (arXiv 2407.21783) on a local text file: byte tokens, or a tokenizer's.

  python -m experiments.train_lm --text=README.md --steps=300       # ~4 minutes on 2 CPU cores
  python -m experiments.train_lm --text=book.txt --tokenizer=/path/to/tokenizer.json
  python -m experiments.train_lm --text=book.txt --preset=byte_small --mesh=fsdp:2,tp:4 \
      --dtype=bfloat16 --remat --workdir=/tmp/lm
  python -m experiments.train_lm --text=book.txt --workdir=/tmp/lm --resume
  python -m experiments.generate --checkpoint=workdir:/tmp/lm --prompt="Once upon"
  python -m experiments.train_lm --text=book.txt --seq_len=1024 --batch_size=4 \
      --mesh=data:2,cp:4 --context_parallel=pass_kv --packing=wlb --cp_sharding=adaptive

Uses the shared train loop (checkpoints, --resume, metrics.jsonl, TensorBoard, curves.png;
one run per workdir, default a new runs/train_lm_<preset>_<date-time>; SIGTERM / SIGINT keep
a checkpoint of the step and end with `stopped at step N; checkpoint N kept; continue with
--resume`, status 143 / 130; a checkpoint every --checkpoint_every_minutes besides
--checkpoint_every).
--tokenizer (llm.checkpoints.load_tokenizer: a tokenizer.json, a directory holding one, a
llama2.c tokenizer.bin, or a GGUF file, whose vocabulary is used) encodes the file as one text without BOS; the model's vocabulary is the
tokenizer's, and a copy of the tokenizer goes into the workdir for experiments.generate.
Writes `<workdir>/model_config.json` (read by experiments.generate) and results.json; the
last stdout line is a JSON summary with the final eval loss and bits per token (per byte
for byte tokens).

--packing (WLB-LLM, arXiv 2503.17924; llm/packing/source.py): instead of random windows,
documents (spans of the file's train part, lengths with the Pile's long-tailed shape drawn
at --doc_context and scaled to --seq_len) packed into rows with segment ids, so attention
never crosses documents: original (loader next-fit), fixed (greedy over --fixed_window
global batches), wlb (variable-length rows with --wlb_queues outlier queues). Each row is a
micro-batch. --cp_sharding lays rows out over the cp ranks: seq (the model's own 2N-chunk
balancing), doc (2N chunks of every document), adaptive (per batch, the tile model's pick).
Every step logs, measured on the batch the devices get: pack_imbalance_mb / _cp / _cp_row
(max / mean of attention pairs over micro-batches, CP ranks, ranks within a row),
pack_model_step / _ideal (the --cost_model's step time, slowest vs mean micro-batch x rank),
pack_tile_step, pack_layout_document, pack_tokens; results.json holds every step's numbers.
Eval stays on the held-out windows.

Flag combinations the library cannot train stop before anything is built (`check_flags`,
naming the flags): --attention_impl=cudnn with --packing (cuDNN takes one document per row,
and no segment ids in ring attention blocks; so no --cp_sharding=doc|adaptive either), with
--dtype=float32, or off a GPU with cuDNN; auto, xla and the Pallas kernels take them all.
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
  flags.DEFINE_string("tokenizer", None, "tokenizer.json, a directory holding one, a llama2.c "
                      "tokenizer.bin or a GGUF file's vocabulary (default: UTF-8 bytes, vocab "
                      "256).")
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
  flags.DEFINE_float("checkpoint_every_minutes", 10, "Also checkpoint once this many minutes "
                     "have passed since the last checkpoint (0: off).", lower_bound=0)
  flags.DEFINE_integer("log_every", 25, "Progress line every N steps.", lower_bound=1)
  flags.DEFINE_integer("stop_at_step", None, "Stop (with a checkpoint) at this step.", lower_bound=1)
  flags.DEFINE_string("workdir", None, "Output directory (default: a new "
                      "runs/train_lm_<preset>_<YYYYmmdd-HHMMSS>).")
  flags.DEFINE_bool("resume", False, "Continue the run whose checkpoints are in --workdir (its "
                    "saved model / optimizer / data settings must match these flags).")
  flags.DEFINE_list("resume_allow", [], "Settings --resume may change deliberately, e.g. "
                    "optim.peak_lr,optim.total_steps.")
  flags.DEFINE_bool("overwrite", False, "Delete the checkpoints and metrics in --workdir first.")
  flags.DEFINE_enum("nonfinite", "stop", ["stop", "skip"], "A NaN / inf loss or gradient norm: "
                    "stop the run at that step, or skip the step (counted).")
  flags.DEFINE_integer("check_every", 100, "Check losses for NaN / inf at least every N steps.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seed of parameters and batch sampling.", lower_bound=0)
  flags.DEFINE_enum("packing", "none", ["none", "original", "fixed", "wlb"],
                    "none: random windows of --text; else documents (spans of --text with "
                    "the Pile's long-tailed lengths) packed into rows by the loader's next-fit "
                    "(original), fixed-length greedy balancing (fixed) or WLB-LLM's "
                    "variable-length packing with outlier queues (wlb); arXiv 2503.17924.")
  flags.DEFINE_enum("cp_sharding", "seq", ["seq", "doc", "adaptive"],
                    "Context-parallel layout of packed rows: per sequence (the model's 2N "
                    "chunks), per document (2N chunks of each document) or the per-batch "
                    "adaptive choice; doc / adaptive need --packing and a cp mesh axis.")
  flags.DEFINE_integer("fixed_window", 2, "--packing=fixed: global batches per greedy window.",
                       lower_bound=1)
  flags.DEFINE_integer("wlb_queues", 2, "--packing=wlb: outlier queues (thresholds 1/2, 1/4, "
                       "1/8 of --seq_len; q queues use the q largest).", lower_bound=0,
                       upper_bound=3)
  flags.DEFINE_integer("doc_context", 131072, "Packed documents: lengths drawn with the Pile's "
                       "shape at this context, then scaled to --seq_len (0: drawn at --seq_len, "
                       "unscaled).", lower_bound=0)
  flags.DEFINE_integer("cp_tile", 0, "--cp_sharding=adaptive: query / key tile of the tile "
                       "model (0: the Mosaic GPU kernel's 128, scaled like the documents by "
                       "--seq_len / --doc_context).", lower_bound=0)
  flags.DEFINE_string("cost_model", "flops", "Packing's workload model: 'flops' (the model's "
                      "FLOP counts, GFLOP units) or a CostModel JSON (llm.packing.cost; seconds).")
  flags.DEFINE_bool("memory_check", True, "Refuse a run whose parameters, optimizer state, "
                    "gradients and activations (llm.memory's lower-bound estimate) exceed the "
                    "device's memory (GPU: bytes_limit; CPU: available RAM), before compiling.")


def copy_tokenizer(tok, workdir: str) -> None:
  """Copies the tokenizer file (and a HF tokenizer's tokenizer_config.json and
  generation_config.json, which name its special tokens) into the workdir, where
  experiments.generate --checkpoint=workdir:DIR finds it."""
  from llm import tokenizer as tok_lib
  src_dir = os.path.dirname(os.path.abspath(tok.source))
  if tok_lib.is_gguf(tok.source):      # the vocabulary lives in the GGUF: the file goes along
    names = [(tok.source, "tokenizer.gguf")]
  elif tok.source.endswith(".json"):
    names = [(tok.source, "tokenizer.json")] + [
        (os.path.join(src_dir, n), n) for n in ("tokenizer_config.json", "generation_config.json")
        if os.path.exists(os.path.join(src_dir, n))]
  else:
    names = [(tok.source, "tokenizer.bin")]
  for src, name in names:
    dst = os.path.join(workdir, name)
    if os.path.abspath(src) != os.path.abspath(dst):
      shutil.copyfile(src, dst)


def check_flags(f, cfg, cp_ranks: int, device=None) -> None:
  """Every flag combination the library cannot train, refused before anything is traced:
  the attention implementation's (`check_attention_flags`), then packing's."""
  check_attention_flags(f, cfg, device)
  check_packing_flags(f, cp_ranks)


# What each --attention_impl trains (llm/attention): "xla", "xla_decode" and the Pallas
# kernels ("pallas", "pallas_mgpu", "pallas_triton") take segment ids and positions
# anywhere, so every --packing x --context_parallel x --cp_sharding combination; "auto"
# picks per call among them (cuDNN only for calls without segment ids or positions).
# "cudnn" takes one document per row (its registry entry's max_segments=1: a packed row
# comes out NaN) and refuses segment ids on ring attention blocks, so no --packing (and so
# no --cp_sharding=doc|adaptive, which need packed documents); ring attention without
# packing runs its blocks (tests/llm/test_attention_cudnn.py). cuDNN computes in bfloat16 /
# float16 with head dims a multiple of 8 up to 256, on a GPU with cuDNN (sm >= 8.0).
def check_attention_flags(f, cfg, device=None) -> None:
  """--attention_impl=cudnn combinations cuDNN cannot run (the table above), each named
  with its flags' values. `device`: an llm.attention.choose.DeviceInfo (None: probed)."""
  if f.attention_impl != "cudnn":
    return
  from llm.attention import choose
  from llm.attention.cudnn import supports
  instead = "expected --attention_impl=auto (cuDNN where a call allows it), pallas or xla"
  if f.packing != "none" or f.cp_sharding != "seq":
    raise ValueError(
        f"--attention_impl=cudnn with --packing={f.packing} --cp_sharding={f.cp_sharding} "
        f"--context_parallel={f.context_parallel}: packed rows hold several documents "
        "(segment ids); cuDNN attention takes one document per row, and no segment ids on "
        f"ring attention blocks; {instead}, or --packing=none --cp_sharding=seq")
  reason = supports(cfg.dtype, cfg.head_dim)
  if reason:
    raise ValueError(f"--attention_impl=cudnn with --dtype={f.dtype} --preset={f.preset} "
                     f"(head dim {cfg.head_dim}): {reason}; {instead}")
  device = choose.device_info() if device is None else device
  if not device.cudnn:
    here = (f"backend {device.backend}" if device.backend != "gpu" else
            f"compute capability {device.compute_capability}; it needs sm 8.0 or newer and "
            "cuDNN found")
    raise ValueError(f"--attention_impl=cudnn: no GPU with cuDNN flash attention here "
                     f"({here}); {instead}")


def check_packing_flags(f, cp_ranks: int) -> None:
  """Flag combinations packing cannot run; the error names the flag."""
  if f.cp_sharding != "seq" and f.packing == "none":
    raise ValueError(f"--cp_sharding={f.cp_sharding} needs documents: set --packing="
                     "original|fixed|wlb (--packing=none trains on windows of one sequence)")
  if f.cp_sharding != "seq" and cp_ranks < 2:
    raise ValueError(f"--cp_sharding={f.cp_sharding} needs context parallelism: "
                     "--context_parallel=pass_kv|pass_q|auto and a --mesh with a cp axis of "
                     f"2 or more ranks (got --context_parallel={f.context_parallel}, "
                     f"--mesh={f.mesh})")
  if f.cp_sharding != "seq" and f.seq_len % (2 * cp_ranks):
    raise ValueError(f"--seq_len={f.seq_len} with --cp_sharding={f.cp_sharding}: expected a "
                     f"multiple of 2 x {cp_ranks} cp ranks (2 chunks per rank)")
  if f.packing != "none" and f.doc_context and f.doc_context < f.seq_len:
    raise ValueError(f"--doc_context={f.doc_context}: expected 0 or at least --seq_len="
                     f"{f.seq_len} (lengths are drawn at it and scaled down to --seq_len)")


def packed_source(f, cfg, tokens, cp_ranks: int, share: dict):
  """The --packing source over documents cut from `tokens` (see llm/packing/source.py)."""
  from llm.packing import cost as cost_lib
  from llm.packing.cp_shard import TileModel
  from llm.packing.lengths import CorpusLengths
  from llm.packing.source import PackedSource, PackingSpec
  if f.cost_model == "flops":
    cost = cost_lib.flop_cost_model(cost_lib.Shape.from_config(cfg)).scaled(1e-9, 1e-9,
                                                                            unit="GFLOP")
  else:
    cost = cost_lib.CostModel.load(f.cost_model)
  dist = (CorpusLengths(context=f.seq_len) if not f.doc_context else
          CorpusLengths(context=f.doc_context, scale=f.seq_len / f.doc_context))
  spec = PackingSpec(packing=f.packing, fixed_window=f.fixed_window, wlb_queues=f.wlb_queues,
                     layout={"seq": "sequence", "doc": "document"}.get(f.cp_sharding,
                                                                       f.cp_sharding))
  tile = f.cp_tile or max(1, round(128 * f.seq_len / (f.doc_context or f.seq_len)))
  return PackedSource(tokens, dist, spec, seq_len=f.seq_len, batch_size=f.batch_size,
                      cp=cp_ranks, cost=cost, n_layers=cfg.n_layers, seed=f.seed,
                      tile_model=TileModel(tile, tile), **share)


def packing_summary(src) -> dict:
  """Means over the steps run of what `PackedSource.step_metrics` measured."""
  recs = src.records
  if not recs:
    return {}
  mean = {k: float(sum(r[k] for r in recs) / len(recs)) for k in recs[0]}
  tokens = sum(r["pack_tokens"] for r in recs)
  mean["pack_model_tokens_per_unit"] = tokens / sum(r["pack_model_step"] for r in recs)
  return mean


def main(argv):
  del argv
  if FLAGS.resume and not FLAGS.workdir:
    sys.exit("train_lm: --resume needs --workdir, the run to continue")
  cli.quiet_library_logs()
  from core import workdir as workdir_lib
  workdir = FLAGS.workdir or workdir_lib.dated(f"train_lm_{FLAGS.preset}")
  from core import checkpoint as ckpt_lib
  import jax
  from core import mesh as mesh_lib
  from core import plot as plot_lib
  from core import train as train_lib
  from llm import checkpoints
  from llm import config as config_lib
  from llm import memory as lm_memory
  from llm import train_lib as lm_lib
  from llm import tokenizer as tok_lib
  from llm.data import TextSource

  tok = None if FLAGS.tokenizer is None else checkpoints.load_tokenizer(FLAGS.tokenizer)
  cfg = config_lib.get_config(
      FLAGS.preset, vocab_size=tok_lib.ByteTokenizer.vocab_size if tok is None else tok.vocab_size,
      dtype=FLAGS.dtype, remat=FLAGS.remat,
      attention_impl=FLAGS.attention_impl, context_parallel=FLAGS.context_parallel,
      max_seq_len=max(FLAGS.seq_len, 16))
  mesh = mesh_lib.make_mesh(FLAGS.mesh, rules=mesh_lib.LLM_RULES)
  cp_ranks = 1 if FLAGS.context_parallel == "none" else dict(mesh.shape).get("cp", 1)
  check_flags(FLAGS, cfg, cp_ranks)
  train_lib.check_learning_rate("--learning_rate", FLAGS.learning_rate)
  optim = lm_lib.OptimConfig(peak_lr=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                             total_steps=FLAGS.steps, weight_decay=FLAGS.weight_decay)
  if FLAGS.memory_check:   # seconds, where compiling a run that cannot fit takes minutes
    lm_memory.check_train_run(cfg, mesh, FLAGS.batch_size, FLAGS.seq_len,
                              mu_dtype=optim.mu_dtype, where=f"--preset={FLAGS.preset} "
                              f"--batch_size={FLAGS.batch_size} --seq_len={FLAGS.seq_len} "
                              f"--mesh={FLAGS.mesh}")
  # The run's settings, saved with each checkpoint and compared on --resume.
  settings = {**{f"model.{k}": v for k, v in config_lib.config_to_dict(cfg).items()},
              **{f"optim.{k}": v for k, v in dataclasses.asdict(optim).items()},
              "data.text": os.path.abspath(FLAGS.text), "data.tokenizer": FLAGS.tokenizer and os.path.abspath(FLAGS.tokenizer),
              "data.seq_len": FLAGS.seq_len, "data.batch_size": FLAGS.batch_size,
              "data.eval_batches": FLAGS.eval_batches,
              "mesh": ",".join(f"{a}:{n}" for a, n in mesh.shape.items())}
  if FLAGS.packing != "none":
    settings.update({"data.packing": FLAGS.packing, "data.cp_sharding": FLAGS.cp_sharding,
                     "data.cp_tile": FLAGS.cp_tile,
                     "data.fixed_window": FLAGS.fixed_window, "data.wlb_queues": FLAGS.wlb_queues,
                     "data.doc_context": FLAGS.doc_context, "data.cost_model": FLAGS.cost_model})
  workdir_lib.claim(workdir)   # for the run's life (cli.run holds a --workdir given already)
  loop_cfg = train_lib.TrainConfig(
      workdir=workdir, steps=FLAGS.steps, eval_every=FLAGS.eval_every,
      checkpoint_every=FLAGS.checkpoint_every,
      checkpoint_every_minutes=FLAGS.checkpoint_every_minutes, log_every=FLAGS.log_every,
      resume=FLAGS.resume,
      stop_at_step=FLAGS.stop_at_step, seed=FLAGS.seed, settings=settings,
      # Placement and kernels change no arithmetic that the state depends on.
      changeable=("mesh", "model.attention_impl", "model.context_parallel", "model.remat",
                  "model.remat_policy", "data.eval_batches", "data.cp_sharding",
                  "data.cp_tile"),
      resume_allow=tuple(FLAGS.resume_allow), overwrite=FLAGS.overwrite,
      nonfinite=FLAGS.nonfinite, check_every=FLAGS.check_every,
      nonfinite_hint="lower --learning_rate or raise --warmup_steps")
  try:
    train_lib.check_resume(loop_cfg)  # before model_config.json is written over
  except train_lib.RunSettingsError as e:
    sys.exit(f"train_lm: {e}")
  loop_cfg = dataclasses.replace(loop_cfg, overwrite=False)
  share = dict(zip(("shard_index", "num_shards"),
                   mesh_lib.process_batch_share(mesh, mesh_lib.LLM_RULES, "act_batch")))
  train_src = TextSource(FLAGS.text, FLAGS.seq_len, FLAGS.batch_size, tokenizer=tok,
                         seed=FLAGS.seed, **share)
  packed = None
  if FLAGS.packing != "none":
    packed = packed_source(FLAGS, cfg, train_src.tokens, cp_ranks, share)
  task = lm_lib.LMTask(cfg, optim, mesh, packed=packed is not None,
                       host_metrics=packed and packed.step_metrics)
  eval_src = TextSource(FLAGS.text, FLAGS.seq_len, FLAGS.batch_size, tokenizer=tok,
                        split="eval", eval_batches=FLAGS.eval_batches, **share)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "model_config.json"), "w") as f:
      json.dump(config_lib.config_to_dict(cfg), f, indent=2)
    if tok is not None:
      copy_tokenizer(tok, workdir)
  unit = "byte" if tok is None else "token"
  print(f"workdir {workdir} | mesh {dict(mesh.shape)} | Llama {FLAGS.preset}: "
        f"{cfg.num_params() / 1e6:.2f}M params, "
        f"{cfg.flops_per_token(FLAGS.seq_len) / 1e6:.1f} MFLOPs/token (train) | "
        f"{len(train_src.tokens):,} train {unit}s | {FLAGS.steps} steps of "
        f"{FLAGS.batch_size}x{FLAGS.seq_len}", flush=True)
  t0 = time.time()
  write_failed = None
  try:
    out = train_lib.train(task, (packed or train_src).batches, lambda: eval_src.batches(0),
                          loop_cfg)
  except (train_lib.RunSettingsError, train_lib.NonFiniteError,
          ckpt_lib.CheckpointMismatchError) as e:
    sys.exit(f"train_lm: {e}")
  except ckpt_lib.CheckpointWriteError as e:
    if getattr(e, "summary", None) is None:
      raise
    out, write_failed = e.summary, e   # trained and evaluated: results.json first
  ev = out["eval"]
  summary = {"preset": FLAGS.preset, "mesh": dict(mesh.shape), "steps": out["step"],
             "finished": out["finished"], "eval_loss": ev.get("loss"),
             "eval_bits_per_token": ev.get("bits_per_token"),
             "eval_bits_per_byte": ev.get("bits_per_token") if tok is None else None,
             "tokenizer": FLAGS.tokenizer, "tokens_per_sec": out["examples_per_sec"],
             "params": cfg.num_params(), "wall_seconds": time.time() - t0, "workdir": workdir}
  results = {"summary": summary, "model_config": config_lib.config_to_dict(cfg),
             "optim": dataclasses.asdict(optim), "eval": ev}
  if packed is not None:
    means = packing_summary(packed)
    summary.update({"packing": FLAGS.packing, "cp_sharding": FLAGS.cp_sharding,
                    **{k: round(v, 4) for k, v in means.items()}})
    results["packing"] = {"spec": dataclasses.asdict(packed.spec), "cp_ranks": cp_ranks,
                          "cost_model": packed.cost.to_dict(), "means": means,
                          "steps": packed.records}
  results_lib.write_results(workdir, results)
  plot_lib.plot_run(workdir)
  if ev:
    print(f"eval loss {ev['loss']:.4f} | {ev['bits_per_token']:.3f} bits/{unit} | "
          f"{out['examples_per_sec']:,.0f} train tokens/s", flush=True)
  if write_failed is not None:
    raise write_failed
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
