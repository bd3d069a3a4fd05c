r"""Fine-tune a pretrained chat model on a skill it lacks, fully and through LoRA, and score
held-out exact match before and after.

  python -m experiments.finetune_lm --init=gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

The task (experiments/finetune_lm/tasks.py): a person's fields in random order and wording
in, one fixed-format record out. The study writes train.jsonl (--train_examples) and
held_out.jsonl (--held_out, surnames never in train) into --workdir, scores the base model's
greedy replies to the held-out requests, then for each of --methods runs
`python -m experiments.train_lm --init=... --data=chat:train.jsonl` (full: every weight;
lora: rank --lora_rank adapters on every projection, the base frozen) for --steps steps and
scores the tuned model the same way. results.json holds exact match before and after per
mode, the train and eval loss curves (from each run's metrics.jsonl), wall time and the
settings (steps, sequence length, batch); finetune.png plots the loss curves and exact match.

A rerun in the same --workdir resumes with --resume: without it, a method whose run
directory (<workdir>/full, <workdir>/lora) holds an earlier run is refused before anything
is written or scored (rec.runs.check_fresh); with it
each run continues from its last checkpoint (`train_lm --resume`: a run a stop cut short trains
on, a finished one only reports its results; its saved settings must match), its
train_seconds counting this invocation only (`resumed_from_step` says where it began), and
every model is scored again. train.jsonl must then hold the examples the runs trained on
(the same --train_examples and --seed): another one is refused naming it; and the flags an
earlier run was made of (--init, --steps, --seq_len, --batch_size, --seed and the method's
learning rate / --lora_rank, kept in <workdir>/run_flags.json) must be the same: a changed
one is named in one line before the base model is scored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from absl import flags

from core import cli
from core import config
from core import errors
from core import results as results_lib
from experiments.common.report import Report

FLAGS = flags.FLAGS
TRAIN_EXAMPLES = config.setting("train_examples", "integer", "Generated training examples.",
                                lower=2)
HELD_OUT = config.setting("held_out", "integer", "Held-out examples scored by exact match.",
                          lower=1)
METHODS = config.setting("methods", "list", "Fine-tuning methods run: full (every weight), "
                          "lora (adapters).")
LORA_LEARNING_RATE = config.setting("lora_learning_rate", "float", "Peak learning rate of "
                                    "the LoRA run (--learning_rate: the full run's).", lower=0)
REPLY_TOKENS = config.setting("reply_tokens", "integer", "Greedy tokens generated per "
                              "held-out request.", lower=1)


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting but
  --workdir / --resume may come from a --config file (configs/ beside this file), --init
  too."""
  from core import settings  # noqa: F401  (the settings named below)
  from llm import run_config  # noqa: F401
  from llm import settings as lm_settings  # noqa: F401
  config.define_flags(
      None, "init", TRAIN_EXAMPLES, HELD_OUT, METHODS, "steps", "seq_len", "batch_size",
      "learning_rate", LORA_LEARNING_RATE, "lora_rank", REPLY_TOKENS, "seed", in_config=True,
      flag_values=flag_values, init=None, train_examples=2000, held_out=100,
      methods=("full", "lora"), steps=40, seq_len=128, batch_size=8, learning_rate=1e-4,
      lora_learning_rate=2e-3, lora_rank=16, reply_tokens=32, seed=0)
  config.define_flags(None, "workdir", "resume", flag_values=flag_values,
                      workdir="runs/finetune_lm", resume=False)


def exact_match(spec: str, examples, reply_tokens: int) -> tuple[float, list[str]]:
  """(fraction of held-out examples answered exactly, the replies) of checkpoint `spec`."""
  from experiments.finetune_lm import tasks
  from llm import checkpoints
  from llm import evaluate
  cfg, model = checkpoints.load_model(spec)
  tok = checkpoints.find_tokenizer(spec, None, cfg.vocab_size)
  replies = evaluate.greedy_replies(model, tok, [tasks.messages(e, False) for e in examples],
                                    reply_tokens)
  return sum(tasks.exact_match(r, e) for r, e in zip(replies, examples)) / len(examples), replies


def curves(workdir: str) -> dict[str, list]:
  """Train loss by step and eval loss by step from a run's metrics.jsonl."""
  out = {"train": [], "eval": []}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      split = rec.get("split", "train")
      if "loss" in rec and split in out:
        out[split].append((rec["step"], rec["loss"]))
  return out


def finetune(mode: str, train_file: str, workdir: str) -> dict:
  """Runs train_lm for one mode (with --resume: continuing the run in `workdir`); returns
  its summary line, wall time and the step it resumed from (None: from the start)."""
  lr = FLAGS.learning_rate if mode == "full" else FLAGS.lora_learning_rate
  args = [sys.executable, "-c", _CHILD, f"--init={FLAGS.init}",
          f"--data=chat:{train_file}", f"--steps={FLAGS.steps}", f"--seq_len={FLAGS.seq_len}",
          f"--batch_size={FLAGS.batch_size}", f"--learning_rate={lr}",
          f"--warmup_steps={min(max(1, FLAGS.steps // 10), FLAGS.steps - 1)}",
          f"--eval_every={max(1, FLAGS.steps // 4)}",
          "--log_every=5", "--checkpoint_every_minutes=0", f"--seed={FLAGS.seed}",
          f"--workdir={workdir}"] + (["--resume"] if FLAGS.resume else [])
  if mode == "lora":
    args += [f"--lora_rank={FLAGS.lora_rank}", f"--lora_alpha={2 * FLAGS.lora_rank}",
             "--lora_targets=all"]
  t0 = time.time()
  last, resumed = "", None
  with subprocess.Popen(args, text=True, stdout=subprocess.PIPE) as proc:
    # SIGTERM / SIGINT reach the run, which keeps a checkpoint and stops; the study ends
    # with it (a rerun with --resume continues it).
    forward = lambda signum, frame: proc.send_signal(signum)
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
      for line in proc.stdout:   # the run's progress lines, shown as they come
        print(f"  [{mode}] {line.rstrip()}", flush=True)
        last = line if line.strip() else last
        if line.startswith("resumed from ") and " at step " in line:   # core.train's line
          resumed = int(line.rsplit(" at step ", 1)[1])
    finally:
      for sig, handler in old.items():
        signal.signal(sig, handler)
  if proc.returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT):
    raise SystemExit(f"finetune_lm: stopped during the {mode} run ({last.strip()}); continue "
                     "with --resume")
  if proc.returncode == 2:   # a refusal: its one line is on stderr above
    raise SystemExit(f"finetune_lm: the {mode} run (train_lm) refused its settings or data; "
                     "its error is the line above")
  if proc.returncode != 0:
    raise RuntimeError(f"finetune_lm: train_lm ({mode}) failed with status {proc.returncode}")
  return {"summary": json.loads(last), "seconds": time.time() - t0, "resumed_from": resumed}


# The train_lm child: on Linux it asks for SIGTERM when this study's process dies
# (PR_SET_PDEATHSIG, set in the child before JAX starts threads), so no run outlives the
# study; then it runs train_lm as `python -m experiments.train_lm` would.
_CHILD = ("import ctypes, os, runpy, signal, sys\n"
          "if sys.platform.startswith('linux'):\n"
          "  ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, int(signal.SIGTERM))\n"
          "  if os.getppid() == 1:\n"
          "    sys.exit('finetune_lm: the study ended before its run started')\n"
          "sys.argv[0] = 'experiments.train_lm'\n"
          "runpy.run_module('experiments.train_lm', run_name='__main__', alter_sys=True)\n")


def plot(results: dict, path: str) -> None:
  """Train and eval loss curves per run, and held-out exact match before and after."""
  from core import plot as plot_lib
  with plot_lib.figure(path, 1, 2, figsize=(11, 4), tight=False,
                       bbox_inches="tight") as (fig, (a, b)):
    for mode, r in results["runs"].items():
      if r["curves"]["train"]:
        s, l = zip(*r["curves"]["train"])
        a.plot(s, l, label=f"{mode} train")
      if r["curves"]["eval"]:
        s, l = zip(*r["curves"]["eval"])
        a.plot(s, l, "o--", label=f"{mode} eval")
    a.set_xlabel("step")
    a.set_ylabel("loss (assistant tokens)")
    a.legend()
    names = ["base"] + list(results["runs"])
    values = [results["exact_match_before"]] + [r["exact_match"] for r in results["runs"].values()]
    b.bar(names, values)
    b.set_ylim(0, 1)
    b.set_ylabel(f"held-out exact match ({results['held_out']} examples)")
    fig.suptitle(f"{FLAGS.init}: {FLAGS.steps} steps x {FLAGS.batch_size} rows of "
                 f"{FLAGS.seq_len} tokens")


def check_flags():
  """What the train_lm runs and the scoring would refuse, each naming its flag, before the
  workdir gets a file, the base model is scored (minutes) or a run starts: the methods, the
  learning rates of the runs made, and --init's checkpoint (its config and chat template,
  read without its weights; --seq_len within its context). Returns its tokenizer."""
  from core import train as train_lib
  from llm import checkpoints
  methods = ",".join(FLAGS.methods)
  bad = [m for m in FLAGS.methods if m not in ("full", "lora")]
  if bad:
    raise errors.expected(f"--methods={methods}", f"{bad[0]!r}", "full and / or lora")
  if not FLAGS.methods:
    raise errors.expected("--methods=", "no method", "full and / or lora")
  twice = sorted({m for m in FLAGS.methods if FLAGS.methods.count(m) > 1})
  if twice:
    raise errors.expected(f"--methods={methods}", f"{twice[0]!r} twice (both runs would "
                          "share one workdir)", "each method once")
  if "lora" in FLAGS.methods and FLAGS.lora_rank < 1:
    raise errors.expected(f"--lora_rank={FLAGS.lora_rank}", "no adapters for --methods=lora",
                          "a rank >= 1")
  if "full" in FLAGS.methods:
    train_lib.check_learning_rate("--learning_rate", FLAGS.learning_rate)
  if "lora" in FLAGS.methods:
    train_lib.check_learning_rate("--lora_learning_rate", FLAGS.lora_learning_rate)
  cfg = checkpoints.load_config(FLAGS.init)
  if FLAGS.seq_len > cfg.max_seq_len:
    raise errors.expected(f"--seq_len={FLAGS.seq_len}", f"longer than the context of --init="
                          f"{FLAGS.init} ({cfg.max_seq_len} tokens)", f"at most {cfg.max_seq_len}")
  tok = checkpoints.find_tokenizer(FLAGS.init, None, cfg.vocab_size)
  if getattr(tok, "chat_template", None) is None:
    raise errors.expected(f"--init={FLAGS.init}", "no chat template in its tokenizer "
                          f"({getattr(tok, 'source', 'none found')})", "a chat model's "
                          "checkpoint (tokenizer_config.json, chat_template.jinja or a GGUF's "
                          "tokenizer.chat_template): the study's requests are chats")
  return tok


# The flags a method's train_lm run is made of (the others only score or choose methods):
# those of every run, then those of one method's.
RUN_FLAGS = ("init", "steps", "seq_len", "batch_size", "seed", "train_examples")
METHOD_FLAGS = {"full": ("learning_rate",), "lora": ("lora_learning_rate", "lora_rank")}
SETTINGS_FILE = "run_flags.json"


def run_flags(mode: str) -> dict:
  """{flag: value} of the flags method `mode`'s run is made of (--init as an absolute
  spec, so a relative path and its absolute form are one checkpoint)."""
  from llm import checkpoints
  out = {n: FLAGS[n].value for n in RUN_FLAGS + METHOD_FLAGS[mode]}
  out["init"] = checkpoints.absolute_spec(out["init"])
  return out


def check_earlier_runs(train) -> None:
  """One run per workdir, never replaced: without --resume, a method's run directory that
  holds an earlier run is refused (rec.runs.check_fresh); with --resume, a train.jsonl
  there must hold `train`, the examples the runs were trained on (their saved settings
  name the file, not its contents), and each earlier run's flags (run_flags.json beside
  them) must be this invocation's: one line naming each changed flag. Before the workdir
  gets a file or the base is scored (minutes on a real model)."""
  from experiments.finetune_lm import tasks
  from rec import runs
  dirs = [os.path.join(FLAGS.workdir, m) for m in FLAGS.methods]
  if not FLAGS.resume:
    runs.check_fresh(dirs)
    return
  earlier = [m for m, d in zip(FLAGS.methods, dirs) if runs.earlier_run(d)]
  path = os.path.join(FLAGS.workdir, "train.jsonl")
  if os.path.exists(path) and earlier:
    with open(path, encoding="utf-8") as f:
      held = f.read()
    if held != tasks.chat_text(train):
      raise errors.expected(
          path, f"other training examples ({held.count(chr(10))} lines) than --train_examples="
          f"{FLAGS.train_examples} --seed={FLAGS.seed} make, the ones the runs --resume would "
          "continue trained on", "the --train_examples and --seed of those runs, or a fresh "
          "--workdir")
  path = os.path.join(FLAGS.workdir, SETTINGS_FILE)
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  changed = [f"--{n}={now!r} (the run: {was[n]!r})" for m in earlier
             if isinstance(was := saved.get(m), dict)
             for n, now in run_flags(m).items() if n in was and was[n] != now]
  if changed:
    runs_made = ", ".join(m for m in earlier if m in saved)
    raise errors.expected(
        f"--resume in {FLAGS.workdir}", "other flags than the earlier runs "
        f"({runs_made}) were made with: " + ", ".join(dict.fromkeys(changed)),
        "those runs' flags, or a fresh --workdir")


def save_run_flags() -> None:
  """`<workdir>/run_flags.json`: each method's run flags (`run_flags`), for a later
  --resume to compare (`check_earlier_runs`); a method this invocation does not run keeps
  the entry of its earlier run."""
  path = os.path.join(FLAGS.workdir, SETTINGS_FILE)
  saved = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  saved.update({m: run_flags(m) for m in FLAGS.methods})
  results_lib.write_json(saved, path)


def main(argv):
  del argv
  from experiments.finetune_lm import tasks
  if FLAGS.init is None:   # required, but a --config file may give it
    raise errors.expected("--init", "not given", "the checkpoint to fine-tune, e.g. "
                          "gguf:FILE or hf:DIR (or a --config file that sets init)")
  tok = check_flags()
  train = tasks.make_examples(FLAGS.train_examples, FLAGS.seed, "train")
  check_earlier_runs(train)
  report = Report(FLAGS.workdir)
  save_run_flags()
  held = tasks.make_examples(FLAGS.held_out, FLAGS.seed, "held_out")
  train_file = tasks.write_chat_file(report.path("train.jsonl"), train)
  tasks.write_chat_file(report.path("held_out.jsonl"), held)
  from llm import chat_data   # as train_lm reads it: a conversation over --seq_len is refused
  chat_data.read_chat_file(train_file, tok, max_len=FLAGS.seq_len)   # before the base's scoring
  before, replies = exact_match(FLAGS.init, held, FLAGS.reply_tokens)
  print(f"base model: held-out exact match {before:.3f} (e.g. {replies[0]!r} for "
        f"{held[0]['answer']!r})", flush=True)
  results = {"init": FLAGS.init, "held_out": len(held), "train_examples": len(train),
             "steps": FLAGS.steps, "seq_len": FLAGS.seq_len, "batch_size": FLAGS.batch_size,
             "exact_match_before": before, "base_replies": replies[:5],
             "methods": list(FLAGS.methods), "runs": {}}
  for mode in FLAGS.methods:
    wd = os.path.join(FLAGS.workdir, mode)
    run = finetune(mode, train_file, wd)
    after, replies = exact_match(f"workdir:{wd}", held, FLAGS.reply_tokens)
    print(f"{mode}: held-out exact match {before:.3f} -> {after:.3f} "
          f"({run['seconds']:.0f} s of training)", flush=True)
    results["runs"][mode] = {
        "exact_match": after, "replies": replies[:5], "train_seconds": run["seconds"],
        "eval_loss": run["summary"].get("eval_loss"), "curves": curves(wd),
        "resumed_from_step": run["resumed_from"],
        "learning_rate": FLAGS.learning_rate if mode == "full" else FLAGS.lora_learning_rate,
        "lora_rank": FLAGS.lora_rank if mode == "lora" else None}
    # The methods done so far, kept should a later one fail (results["methods"]: all asked).
    results_lib.write_results(report.path(), results)
  summary = {"exact_match_before": before, **{f"exact_match_{m}": r["exact_match"]
                                              for m, r in results["runs"].items()},
             "steps": FLAGS.steps, "seq_len": FLAGS.seq_len, "batch_size": FLAGS.batch_size}
  report.finish(results, summary, wall="wall_seconds", plots=[(plot, (results,), "finetune.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
