"""experiments.finetune_lm end to end on a tiny random chat model: data written, exact match
before and after each mode, curves, plot (the benchmark runs it on SmolLM2-135M)."""

from __future__ import annotations

import json
import os

import pytest

from experiments.finetune_lm import tasks
from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig
from tests.experiments.test_generate_chat import TEMPLATE
from tests.experiments.entry import run_refused
from tests.experiments.test_lm_entry import _hf_dir, _run, _tiny_weights
from tests.llm.test_tokenizer import train_bpe


def test_tasks_split_and_score():
  train = tasks.make_examples(200, 0, "train")
  held = tasks.make_examples(50, 0, "held_out")
  assert tasks.make_examples(200, 0, "train") == train
  surnames = lambda xs: {x["answer"].split(",")[0] for x in xs}
  assert not surnames(train) & surnames(held)
  e = held[0]
  assert tasks.exact_match(f"  {e['answer']} \nmore", e) and not tasks.exact_match("x", e)


def _chat_model(tmp_path):
  """A tiny random Llama whose tokenizer has a chat template, context 512."""
  d = str(tmp_path / "hf")
  path = train_bpe(d, config={"bos_token": "<s>", "eos_token": "</s>"})
  from tokenizers import Tokenizer
  raw = Tokenizer.from_file(path)
  raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  raw.save(path)
  (tmp_path / "hf" / "chat_template.jinja").write_text(TEMPLATE)
  tok = T.load_tokenizer(d)
  cfg = LlamaConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_dim=64, rope_theta=10000.0, max_seq_len=512)
  W.save_hf(d, cfg, _tiny_weights(cfg, seed=2))
  return d


def test_finetune_lm_study_on_a_tiny_model(tmp_path):
  d = _chat_model(tmp_path)
  wd = tmp_path / "study"
  out = json.loads(_run("experiments.finetune_lm", [
      f"--init=hf:{d}", "--train_examples=24", "--held_out=2", "--steps=2", "--seq_len=256",
      "--batch_size=8", "--reply_tokens=4", "--methods=lora", "--lora_rank=2",
      f"--workdir={wd}"])[-1])   # full fine-tuning through train_lm: tests/experiments/test_finetune.py
  assert set(out) >= {"exact_match_before", "exact_match_lora"}
  res = json.loads((wd / "results.json").read_text())
  assert res["runs"]["lora"]["curves"]["train"] and res["runs"]["lora"]["eval_loss"] > 0
  assert res["methods"] == ["lora"] and list(res["runs"]) == ["lora"]
  assert (wd / "finetune.png").stat().st_size > 0
  assert sum(1 for _ in open(wd / "train.jsonl")) == 24
  assert json.loads((wd / "run_flags.json").read_text()) == {"lora": {
      "init": f"hf:{d}", "steps": 2, "seq_len": 256, "batch_size": 8, "seed": 0,
      "train_examples": 24, "lora_learning_rate": 2e-3, "lora_rank": 2}}
  # A rerun with --resume takes the finished run as it is (train_lm --resume: nothing to
  # train) and scores it again: the same greedy replies.
  lines = _run("experiments.finetune_lm", [
      f"--init=hf:{d}", "--train_examples=24", "--held_out=2", "--steps=2", "--seq_len=256",
      "--batch_size=8", "--reply_tokens=4", "--methods=lora", "--lora_rank=2",
      f"--workdir={wd}", "--resume"])
  assert any("nothing to do: the run is at step 2 of 2" in l for l in lines), lines[-20:]
  again = json.loads((wd / "results.json").read_text())["runs"]["lora"]
  assert again["resumed_from_step"] == 2 and res["runs"]["lora"]["resumed_from_step"] is None
  assert again["replies"] == res["runs"]["lora"]["replies"]
  assert again["exact_match"] == res["runs"]["lora"]["exact_match"]
  assert again["eval_loss"] == res["runs"]["lora"]["eval_loss"]


def test_a_rerun_without_resume_or_with_other_examples_is_refused(tmp_path):
  """A rerun into the same --workdir never replaces a run (a SIGTERM'd one keeps its
  checkpoint): before anything is written or the base scored, without --resume one line
  names the run directory and the choices; with --resume, a train.jsonl of other examples
  than the flags make (the children's settings name the file, not its contents) is
  refused, and so is a flag an earlier run was made of with another value."""
  d = _chat_model(tmp_path)
  wd = tmp_path / "w"
  run_dir = wd / "lora"
  (run_dir / "checkpoints" / "1").mkdir(parents=True)
  (run_dir / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 2.0}\n')
  args = [f"--init=hf:{d}", "--train_examples=8", "--held_out=1", "--seq_len=512",
          "--methods=full,lora", f"--workdir={wd}"]
  out = run_refused("experiments.finetune_lm", args)
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {run_dir}: holds an earlier run (metrics.jsonl, checkpoints); expected a fresh "
      "run directory (one run per workdir, never replaced): reuse its finished runs with "
      "--resume (where the study has it; reuse_finished=True), or choose a fresh --workdir, "
      "or delete it to train again"), out.stderr[-3000:]
  assert sorted(os.listdir(wd)) == ["lora"] and "base model" not in out.stdout
  assert sorted(os.listdir(run_dir)) == ["checkpoints", "metrics.jsonl"]
  tasks.write_chat_file(str(wd / "train.jsonl"), tasks.make_examples(8, 1, "train"))
  before = (wd / "train.jsonl").read_text()
  out = run_refused("experiments.finetune_lm", args + ["--resume"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {wd / 'train.jsonl'}: other training examples (8 lines) than "
      "--train_examples=8 --seed=0 make, the ones the runs --resume would continue trained "
      "on; expected the --train_examples and --seed of those runs, or a fresh --workdir")
  assert (wd / "train.jsonl").read_text() == before and "base model" not in out.stdout
  # The examples right, the flags of the earlier lora run (run_flags.json) not: each changed
  # flag of that run named (--steps, --lora_rank; --seed is the same; full has no earlier
  # run, so its --learning_rate is not compared).
  tasks.write_chat_file(str(wd / "train.jsonl"), tasks.make_examples(8, 0, "train"))
  (wd / "run_flags.json").write_text(json.dumps(
      {"lora": {"steps": 3, "seed": 0, "lora_rank": 2}, "full": {"learning_rate": 1.0}}))
  out = run_refused("experiments.finetune_lm", args + ["--resume"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --resume in {wd}: other flags than the earlier runs (lora) were made with: "
      "--steps=40 (the run: 3), --lora_rank=16 (the run: 2); expected those runs' flags, or "
      "a fresh --workdir"), out.stderr[-3000:]
  assert "base model" not in out.stdout


@pytest.mark.parametrize("args, want", [
    (["--methods=full,full"], "error: --methods=full,full: 'full' twice (both runs would share "
                              "one workdir); expected each method once"),
    (["--methods="], "error: --methods=: no method; expected full and / or lora"),
    (["--lora_learning_rate=0"], "error: --lora_learning_rate=0.0: expected a finite learning "
                                 "rate > 0"),
    (["--seq_len=128"], "error: --seq_len=128: longer than the context of --init=hf:{d} (64 "
                        "tokens); expected at most 64"),
    ([], "error: --init=hf:{d}: no chat template in its tokenizer ({d}/tokenizer.json); "
         "expected a chat model's checkpoint"),
])
def test_refused_before_the_base_is_scored(tmp_path, args, want):
  """One line naming the flag before the workdir gets the data files and before the base
  model is scored (else a learning rate train_lm refuses ends the study in a traceback
  after that, and a repeated method runs twice into one workdir)."""
  d, _, _, _ = _hf_dir(tmp_path)   # a tokenizer without a chat template, a 64-token context
  out = run_refused("experiments.finetune_lm", [
      f"--init=hf:{d}", "--seq_len=32", "--train_examples=8", "--held_out=1", *args,
      f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1].startswith(want.format(d=d)), out.stderr[-3000:]
  assert os.listdir(tmp_path / "w") == []


def test_conversations_longer_than_seq_len_are_refused_before_the_base_is_scored(tmp_path):
  """train_lm refuses a conversation longer than --seq_len; the study reads its train file
  the same way before scoring the base (rather than finding out in the first run)."""
  d = _chat_model(tmp_path)
  out = run_refused("experiments.finetune_lm", [
      f"--init=hf:{d}", "--seq_len=16", "--train_examples=8", "--held_out=1",
      f"--workdir={tmp_path / 'w'}"])
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {tmp_path / 'w' / 'train.jsonl'}:1: ") and last.endswith(
      "tokens; expected at most 16 (a row holds whole conversations: raise --seq_len or "
      "shorten it)"), last
  assert "base model" not in out.stdout
