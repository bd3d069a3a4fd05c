"""experiments.finetune_lm end to end on a tiny random chat model: data written, exact match
before and after each mode, curves, plot (the benchmark runs it on SmolLM2-135M)."""

from __future__ import annotations

import json

from experiments.finetune_lm import tasks
from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig
from tests.experiments.test_generate_chat import TEMPLATE
from tests.experiments.test_lm_entry import _run, _tiny_weights
from tests.llm.test_tokenizer import train_bpe


def test_tasks_split_and_score():
  train = tasks.make_examples(200, 0, "train")
  held = tasks.make_examples(50, 0, "held_out")
  assert tasks.make_examples(200, 0, "train") == train
  surnames = lambda xs: {x["answer"].split(",")[0] for x in xs}
  assert not surnames(train) & surnames(held)
  e = held[0]
  assert tasks.exact_match(f"  {e['answer']} \nmore", e) and not tasks.exact_match("x", e)


def test_finetune_lm_study_on_a_tiny_model(tmp_path):
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
  wd = tmp_path / "study"
  out = json.loads(_run("experiments.finetune_lm", [
      f"--init=hf:{d}", "--train_examples=24", "--held_out=2", "--steps=2", "--seq_len=512",
      "--batch_size=8", "--reply_tokens=4", "--methods=lora", "--lora_rank=2",
      f"--workdir={wd}"])[-1])   # full fine-tuning through train_lm: tests/experiments/test_finetune.py
  assert set(out) >= {"exact_match_before", "exact_match_lora"}
  res = json.loads((wd / "results.json").read_text())
  assert res["runs"]["lora"]["curves"]["train"] and res["runs"]["lora"]["eval_loss"] > 0
  assert (wd / "finetune.png").stat().st_size > 0
  assert sum(1 for _ in open(wd / "train.jsonl")) == 24
