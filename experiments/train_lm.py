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

The run's settings are one llm.run_config.LMRunConfig (model / data / packing / parallelism /
train / loop sections, a flag per setting); the workdir keeps it as config.py, with the
command that made it, and `--config=<workdir>/config.py` replays the run (flags given win,
named in one printed line). Combinations the library cannot train stop before anything is
built (`LMRunConfig.validate`, naming the flags): --attention_impl=cudnn with --packing
(cuDNN takes one document per row, and no segment ids in ring attention blocks; so no
--cp_sharding=doc|adaptive either), with --dtype=float32, or off a GPU with cuDNN; auto, xla
and the Pallas kernels take them all. A setting given that the run would not read (another
packing's, LoRA's without --lora_rank, --eval_batches with a chat file) is refused naming it,
and with --init every such check, the data files and the memory estimate come before the
checkpoint's weights are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
import time

from absl import flags

from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings
from llm import run_config

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names): one per setting of
  llm.run_config.LMRunConfig, --config, and the loop's per-invocation --workdir / --resume /
  --resume_allow / --overwrite."""
  config.define_flags(run_config.LMRunConfig)
  config.define_flags(None, *settings.RUN_FLAGS, resume=False, resume_allow=(),
                      overwrite=False)


def copy_tokenizer(tok, workdir: str) -> None:
  """Copies the tokenizer file (and a HF tokenizer's tokenizer_config.json,
  generation_config.json and chat_template.jinja, which name its special tokens and hold
  its chat template) into the workdir, where
  experiments.generate --checkpoint=workdir:DIR finds it."""
  from llm import tokenizer as tok_lib
  src_dir = os.path.dirname(os.path.abspath(tok.source))
  if tok_lib.is_gguf(tok.source):      # the vocabulary lives in the GGUF: the file goes along
    names = [(tok.source, "tokenizer.gguf")]
  elif tok.source.endswith(".json"):
    names = [(tok.source, "tokenizer.json")] + [
        (os.path.join(src_dir, n), n)
        for n in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")
        if os.path.exists(os.path.join(src_dir, n))]
  else:
    names = [(tok.source, "tokenizer.bin")]
  for src, name in names:
    dst = os.path.join(workdir, name)
    if os.path.abspath(src) != os.path.abspath(dst):
      shutil.copyfile(src, dst)


def check_flags(f, cfg, cp_ranks: int, device=None) -> None:
  """Every combination the library cannot train, on settings by flat name (`f`), refused
  before anything is traced (llm.run_config.check; `LMRunConfig.validate` runs it)."""
  run_config.check(f, cfg, cp_ranks, device)


check_packing_flags = run_config.check_packing


def packing_cost(run: run_config.LMRunConfig, cfg):
  """The workload model of --cost_model for a packed run: 'flops' (`cfg`'s FLOP counts) or
  a CostModel JSON file, read here, before anything is built; an error names the flag."""
  from llm.packing import cost as cost_lib
  text = run.data.packing.cost_model
  if text == "flops":
    return cost_lib.from_setting(text, cfg)
  want = ("'flops' or a CostModel JSON file (experiments.wlb_packing --cost_model=fit "
          "--save_cost_model=FILE writes one)")
  if not os.path.isfile(text):
    raise errors.expected(f"--cost_model={text}", "no such file", want)
  try:
    return cost_lib.CostModel.load(text)
  except (ValueError, TypeError) as e:
    raise errors.expected(f"--cost_model={text}", f"not a CostModel JSON ({e})", want) from None


def packed_source(run: run_config.LMRunConfig, cfg, tokens, cp_ranks: int, share: dict, cost):
  """The --packing source over documents cut from `tokens` (llm.packing.source.from_run),
  `cost` its workload model (`packing_cost`)."""
  from llm.packing import source
  return source.from_run(run, tokens, cp_ranks, n_layers=cfg.n_layers, cost=cost, **share)


def packing_summary(src) -> dict:
  """Means over the steps run of what `PackedSource.step_metrics` measured."""
  recs = src.records
  if not recs:
    return {}
  mean = {k: float(sum(r[k] for r in recs) / len(recs)) for k in recs[0]}
  tokens = sum(r["pack_tokens"] for r in recs)
  mean["pack_model_tokens_per_unit"] = tokens / sum(r["pack_model_step"] for r in recs)
  return mean


def check_init_flags(run: run_config.LMRunConfig, flag_values) -> None:
  """With --init the checkpoint sets the model's shape: a --preset given (flag, or a --config
  file's other than the default, which every run's own config.py records) is refused, naming
  both."""
  given = flag_values["preset"].present
  if flag_values["config"].value:
    default = run_config.ModelSection().preset
    given = given or config.read_file(run_config.LMRunConfig, flag_values["config"].value).get(
        "preset", default) != default
  if given:
    raise errors.expected(f"--preset={run.model.preset} with --init={run.model.init}",
                          "a size for a model whose checkpoint sets it",
                          "no --preset with --init")


def check_unused_flags(run: run_config.LMRunConfig, flag_values) -> None:
  """A setting given on the command line that this run would not read (one of another
  packing, LoRA without --lora_rank, --eval_batches with a chat file, whose eval is its
  whole held-out tenth) is refused naming it and what reads it, not ignored."""
  p, lora = run.data.packing, run.lora
  reads = {"fixed_window": ("--packing=fixed", p.packing == "fixed"),
           "wlb_queues": ("--packing=wlb", p.packing == "wlb"),
           "doc_context": ("--packing=original|fixed|wlb", p.packing != "none"),
           "cost_model": ("--packing=original|fixed|wlb", p.packing != "none"),
           "cp_tile": ("--packing=original|fixed|wlb", p.packing != "none"),
           "lora_alpha": ("--lora_rank >= 1", lora.lora_rank > 0),
           "lora_targets": ("--lora_rank >= 1", lora.lora_rank > 0),
           "eval_batches": ("--text", not run.data.data)}
  for name, (reader, read) in reads.items():
    if not read and flag_values[name].present:
      value = flag_values[name].value
      value = ",".join(value) if isinstance(value, (list, tuple)) else value
      raise errors.expected(f"--{name}={value}", "not read by this run", f"it only with "
                            f"{reader}, which reads it")


def chat_sources(run: run_config.LMRunConfig, tok, share: dict):
  """(train, eval) sources of --data=chat:FILE: conversations packed whole into rows, the
  loss on the assistant's tokens (llm.chat_data), a tenth held out for eval."""
  from llm import chat_data
  if tok is None or getattr(tok, "chat_template", None) is None:
    raise errors.expected(f"--data={run.data.data}", "no chat template in the tokenizer "
                          f"({getattr(tok, 'source', 'bytes')})", "--init or --tokenizer with "
                          "a chat template (tokenizer_config.json, chat_template.jinja or a "
                          "GGUF's tokenizer.chat_template)")
  if share.get("num_shards", 1) > 1:
    raise errors.UserError(f"--data={run.data.data}: chat files train in one process; "
                           "expected a single-process run")
  path, d, t = run.chat_file(), run.data, run.train
  convs = chat_data.read_chat_file(path, tok, max_len=d.seq_len)
  train = chat_data.ChatSource(path, tok, d.seq_len, t.batch_size, seed=t.seed,
                               conversations=convs)
  ev = chat_data.ChatSource(path, tok, d.seq_len, t.batch_size, split="eval",
                            conversations=convs)
  return train, ev


def train_size(src, unit: str) -> str:
  """What the run trains on, for the first line."""
  if hasattr(src, "tokens"):
    return f"{len(src.tokens):,} train {unit}s"
  return f"{len(src.train):,} train conversations ({len(src.eval)} held out)"


def resolved_config() -> tuple[run_config.LMRunConfig, dict]:
  """The run's config from the flags (and --config), and the settings whose flag overrode
  the --config file ({name: (file's, flag's)}), announced in one line."""
  run = config.from_flags(run_config.LMRunConfig)
  over = config.command_line_overrides(run_config.LMRunConfig)
  if over:
    print(f"--config={FLAGS.config}: overridden by the command line: " + ", ".join(
        f"--{n}={now!r} (file: {was!r})" for n, (was, now) in over.items()), flush=True)
  return run, over


def main(argv):
  del argv
  if FLAGS.resume and not FLAGS.workdir:
    sys.exit("train_lm: --resume needs --workdir, the run to continue")
  cli.quiet_library_logs()
  run, overridden = resolved_config()
  m, d, t = run.model, run.data, run.train
  seq_len, batch_size = d.seq_len, t.batch_size
  from core import workdir as workdir_lib
  from core import checkpoint as ckpt_lib
  import jax
  if jax.process_count() > 1 and not FLAGS.workdir:   # each process would name its own
    raise errors.expected("--workdir", f"not given, in a run of {jax.process_count()} "
                          "processes", "the same directory on shared storage for every process")
  from core import mesh as mesh_lib
  from core import plot as plot_lib
  from core import train as train_lib
  from llm import attention
  from llm import checkpoints
  from llm import config as config_lib
  from llm import memory as lm_memory
  from llm import quantized
  from llm import train_lib as lm_lib
  from llm import tokenizer as tok_lib
  from llm.data import TextSource

  run.check_data()   # before any file is read
  check_unused_flags(run, FLAGS)
  if FLAGS["warmup_steps"].present and t.warmup_steps >= run.loop.steps:
    raise errors.expected(   # llm.train_lib.schedule would cut it to steps - 1
        f"--warmup_steps={t.warmup_steps}", f"not below --steps={run.loop.steps}",
        f"at most {run.loop.steps - 1}, so that the learning rate reaches its peak")
  if t.warmup_steps >= run.loop.steps:   # the default, on a run shorter than it
    print(f"--warmup_steps: the default {t.warmup_steps} is not below --steps="
          f"{run.loop.steps}; warming up over {max(0, run.loop.steps - 1)} "
          f"step{'' if run.loop.steps == 2 else 's'}", flush=True)
  if not m.init and m.preset not in config_lib.PRESETS:
    raise errors.expected(f"--preset={m.preset}", "unknown",
                          f"one of {', '.join(sorted(config_lib.PRESETS))}")
  attention.check_impl(m.attention_impl, "--attention_impl")
  # Everything a setting or an input can refuse is checked before the --init checkpoint's
  # weights are read (seconds to minutes for a large one) and before the workdir is written:
  # its config and tokenizer, the data files, the mesh, validate(), the memory estimate.
  pcfg = None
  if m.init:
    check_init_flags(run, FLAGS)
    quantized.check_mode(m.weights, checkpoints.parse_spec(m.init)[0])
    pcfg = checkpoints.load_config(m.init)
    if seq_len > pcfg.max_seq_len:
      raise errors.expected(f"--seq_len={seq_len}", f"longer than the context of --init="
                            f"{m.init} ({pcfg.max_seq_len} tokens)", f"at most {pcfg.max_seq_len}")
    tok = checkpoints.find_tokenizer(m.init, d.tokenizer, pcfg.vocab_size)
    if tok is None and pcfg.vocab_size != tok_lib.ByteTokenizer.vocab_size:
      raise errors.expected(f"--init={m.init}", "no tokenizer beside it", "--tokenizer=PATH "
                            f"with its vocabulary of {pcfg.vocab_size}")
  else:
    tok = None if d.tokenizer is None else checkpoints.load_tokenizer(d.tokenizer)
  vocab = tok_lib.ByteTokenizer.vocab_size if tok is None else tok.vocab_size
  cfg = run.llama_config(vocab, pcfg)
  mesh = mesh_lib.make_mesh(run.parallelism.mesh, rules=mesh_lib.LLM_RULES)
  cp_ranks = 1 if m.context_parallel == "none" else dict(mesh.shape).get("cp", 1)
  run.validate(cp_ranks, llama=cfg)
  optim = run.optim_config()
  lora = run.lora_config()
  cost = packing_cost(run, cfg) if d.packing.packing != "none" else None
  if t.memory_check:   # seconds, where compiling a run that cannot fit takes minutes
    lm_memory.check_train_run(cfg, mesh, batch_size, seq_len,
                              mu_dtype=optim.mu_dtype, lora=lora, weights=m.weights, where=(
                                  f"--init={m.init}" if m.init else f"--preset={m.preset}")
                              + f" --batch_size={batch_size} --seq_len={seq_len} "
                              f"--mesh={run.parallelism.mesh}"
                              + (f" --lora_rank={lora.rank}" if lora else "")
                              + (f" --weights={m.weights}" if m.weights != "float32" else ""))
  share = dict(zip(("shard_index", "num_shards"),
                   mesh_lib.process_batch_share(mesh, mesh_lib.LLM_RULES, "act_batch")))
  packed = None
  if run.chat_file():
    train_src, eval_src = chat_sources(run, tok, share)
  else:
    train_src = TextSource(d.text, seq_len, batch_size, tokenizer=tok, seed=t.seed, **share)
    if cost is not None:
      packed = packed_source(run, cfg, train_src.tokens, cp_ranks, share, cost)
    eval_src = TextSource(d.text, seq_len, batch_size, tokenizer=tok,
                          split="eval", eval_batches=d.eval_batches, **share)
  init_weights = None
  if m.init:
    pretrained, init_weights, _ = checkpoints.load_pretrained(m.init, m.weights, d.tokenizer)
    cfg = run.llama_config(vocab, pretrained)
  # the default workdir is made only now, so a refused run leaves no empty one behind
  workdir = FLAGS.workdir or workdir_lib.dated(f"train_lm_{m.preset}")
  workdir_lib.claim(workdir)   # for the run's life (cli.run holds a --workdir given already)
  loop_cfg = settings.loop_config(
      run.loop, workdir=workdir, seed=t.seed,
      settings=run.run_settings(cfg, optim, mesh),   # saved with each checkpoint
      changeable=run_config.CHANGEABLE,
      nonfinite_hint="lower --learning_rate or raise --warmup_steps")
  try:
    train_lib.check_resume(loop_cfg)  # before model_config.json is written over
  except train_lib.RunSettingsError as e:
    sys.exit(f"train_lm: {e}")
  loop_cfg = dataclasses.replace(loop_cfg, overwrite=False)
  try:
    task = lm_lib.LMTask(cfg, optim, mesh, packed=packed is not None or bool(run.chat_file()),
                         host_metrics=packed and packed.step_metrics,
                         init_weights=init_weights, lora=lora)
  except ValueError as e:
    raise errors.UserError(str(e)) from None
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "model_config.json"), "w") as f:
      json.dump(config_lib.config_to_dict(cfg), f, indent=2)
    config.write_file(run, os.path.join(workdir, "config.py"),
                      command=" ".join(["python -m experiments.train_lm", *map(
                          shlex.quote, sys.argv[1:])]), overridden=overridden)
    if tok is not None and getattr(tok, "source", "bytes") != "bytes":
      copy_tokenizer(tok, workdir)
    if lora is not None:
      lm_lib.save_lora_run(workdir, checkpoints.absolute_spec(m.init), m.weights, lora,
                           base=init_weights)
  unit = "byte" if tok is None else "token"
  print(f"workdir {workdir} | mesh {dict(mesh.shape)} | Llama {m.init or m.preset}: "
        f"{cfg.num_params() / 1e6:.2f}M params, "
        f"{cfg.flops_per_token(seq_len) / 1e6:.1f} MFLOPs/token (train) | "
        f"{train_size(train_src, unit)} | {run.loop.steps} steps of "
        f"{batch_size}x{seq_len}", flush=True)
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
  if lora is not None and jax.process_index() == 0:   # the adapters on their own (PEFT)
    from llm import lora as lora_lib
    lora_lib.save_peft(os.path.join(workdir, "adapter"), out["state"]["lora"], lora,
                       base=checkpoints.absolute_spec(m.init))
  summary = {"preset": None if m.init else m.preset, "init": m.init,
             "mesh": dict(mesh.shape), "steps": out["step"],
             "finished": out["finished"], "eval_loss": ev.get("loss"),
             "eval_bits_per_token": ev.get("bits_per_token"),
             "eval_bits_per_byte": ev.get("bits_per_token") if tok is None else None,
             "tokenizer": d.tokenizer, "tokens_per_sec": out["examples_per_sec"],
             "params": cfg.num_params(), "wall_seconds": time.time() - t0, "workdir": workdir}
  results = {"summary": summary, "config": config.to_dict(run),
             "model_config": config_lib.config_to_dict(cfg),
             "optim": dataclasses.asdict(optim), "eval": ev}
  if packed is not None:
    means = packing_summary(packed)
    summary.update({"packing": d.packing.packing, "cp_sharding": d.packing.cp_sharding,
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
