"""train_lm from a pretrained checkpoint (--init), on a chat file (--data=chat:FILE), fully
or through LoRA adapters; the workdir loads back (generate / eval_lm), a LoRA run's
adapters merged into its base; the refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from llm import checkpoints
from llm import lora as lora_lib
from llm.weights import param_shapes
from tests.experiments.test_generate_chat import _chat_dir
from tests.experiments.test_lm_entry import _run

CONVS = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
         for w in ("the park", "a dog", "the lazy cat", "blue sky", "red fox", "old tree")]


def _chat_file(tmp_path):
  path = tmp_path / "chat.jsonl"
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVS * 3))
  return path


def _train(tmp_path, d, name, *extra):
  wd = tmp_path / name
  lines = _run("experiments.train_lm", [
      f"--init=hf:{d}", f"--data=chat:{_chat_file(tmp_path)}", "--steps=6", "--seq_len=64",
      "--batch_size=8", "--learning_rate=0.01", "--warmup_steps=1", "--eval_every=0",
      "--log_every=3", f"--workdir={wd}", *extra])
  return wd, json.loads(lines[-1])


def _base_eval_loss(d, tok, tmp_path):
  """The base model's loss on the run's held-out conversations (the last tenth)."""
  from llm import chat_data
  from llm import evaluate
  convs = chat_data.read_chat_file(str(_chat_file(tmp_path)), tok, max_len=64)
  held = chat_data.ChatSource("", tok, 64, 8, conversations=convs).eval
  _, model = checkpoints.load_model(f"hf:{d}")
  return evaluate.mean_loss(model, evaluate.chat_batches(held, 64, 8))["loss"]


def test_full_and_lora_fine_tuning_from_a_checkpoint(tmp_path):
  d, tok, cfg, w = _chat_dir(tmp_path)
  base_loss = _base_eval_loss(d, tok, tmp_path)
  wd, full = _train(tmp_path, d, "full")
  assert full["steps"] == 6 and full["eval_loss"] < base_loss - 0.1
  # the workdir loads as a plain checkpoint whose weights moved from the base
  _, model = checkpoints.load_model(f"workdir:{wd}")
  from llm import model as model_lib
  tuned = model_lib.weights_from_model(model)
  assert set(tuned) == set(w)
  assert max(np.abs(tuned[n] - w[n]).max() for n in w) > 1e-4
  assert os.path.exists(wd / "tokenizer.json")
  # its config.py replays it (the file records the preset the run did not read, the default)
  again = json.loads(_run("experiments.train_lm", [
      f"--config={wd / 'config.py'}", f"--workdir={tmp_path / 'again'}"])[-1])
  assert (again["init"], again["eval_loss"]) == (full["init"], full["eval_loss"])

  wl, lo = _train(tmp_path, d, "lora", "--lora_rank=4", "--lora_alpha=8",
                  "--lora_targets=attention")
  assert lo["steps"] == 6 and lo["eval_loss"] < base_loss - 0.1
  adapters, lcfg = lora_lib.load_peft(str(wl / "adapter"), param_shapes(cfg))
  assert lcfg.rank == 4 and lcfg.targets == ("wq", "wk", "wv", "wo")
  assert set(adapters) == {f"layers.{i}.{p}" for i in range(cfg.n_layers)
                           for p in ("wq", "wk", "wv", "wo")}
  # the workdir's model is the base with the adapters merged: MLP weights untouched
  _, model = checkpoints.load_model(f"workdir:{wl}")
  merged = model_lib.weights_from_model(model)
  expect = lora_lib.merge(w, adapters, lcfg)
  for n in w:
    np.testing.assert_allclose(merged[n], expect[n], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(merged["layers.0.w_up"], np.float32(w["layers.0.w_up"]))
  # eval_lm scores the LoRA workdir on the chat file, as the run's final eval did
  out = json.loads(_run("experiments.eval_lm", [
      f"--checkpoint=workdir:{wl}", f"--data=chat:{_chat_file(tmp_path)}", "--seq_len=64",
      f"--workdir={tmp_path / 'ev'}"])[-1])
  assert np.isfinite(out["loss"]) and out["num_tokens"] > 0
  # peft reads the base as a transformers directory; a base changed since the run (one weight
  # here) is refused by name instead of taking the adapters onto other weights.
  with open(wl / "adapter" / "adapter_config.json") as f:
    assert json.load(f)["base_model_name_or_path"] == os.path.abspath(d)
  changed = dict(w, **{"layers.0.wq": w["layers.0.wq"] * 1.01})
  from llm import weights as W
  W.save_hf(d, cfg, changed)
  with pytest.raises(ValueError, match=r"lora\.json: the base hf:.* holds other weights than "
                     r"the adapters were trained on \(fingerprint [0-9a-f]{32}, recorded "):
    checkpoints.load_model(f"workdir:{wl}")


def test_refusals(tmp_path):
  d, _, _, _ = _chat_dir(tmp_path)
  chat = _chat_file(tmp_path)
  # one line each, before any weight is read (entry point)
  err = _run("experiments.train_lm", [f"--init=hf:{d}", "--preset=tiny", f"--data=chat:{chat}",
                                      f"--workdir={tmp_path / 'a'}"], fails=True)
  assert "--preset=tiny with --init=hf:" in err.splitlines()[-1]
  (tmp_path / "small.json").write_text(json.dumps({"preset": "small"}))
  err = _run("experiments.train_lm", [f"--init=hf:{d}", f"--config={tmp_path / 'small.json'}",
                                      f"--data=chat:{chat}", f"--workdir={tmp_path / 'a2'}"],
             fails=True)
  assert "--preset=small with --init=hf:" in err.splitlines()[-1]
  err = _run("experiments.train_lm", [f"--init=hf:{d}", "--seq_len=512", f"--data=chat:{chat}",
                                      f"--workdir={tmp_path / 'b'}"], fails=True)
  assert "--seq_len=512: longer than the context of --init" in err.splitlines()[-1]
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"messages": CONVS[0]}) + "\n{oops\n")
  err = _run("experiments.train_lm", [f"--init=hf:{d}", f"--data=chat:{bad}", "--seq_len=64",
                                      f"--workdir={tmp_path / 'e'}"], fails=True)
  assert f"{bad}:2:2: not JSON" in err.splitlines()[-1]
  # the same checks the entry point makes, in this process
  from core import config
  from llm import run_config
  run = lambda **kw: config.build(run_config.LMRunConfig, data=f"chat:{chat}", **kw)
  with pytest.raises(ValueError, match=r"--lora_targets: 'q_proj'; expected projections"):
    run(lora_rank=2, lora_targets=("q_proj",)).check_data()
  with pytest.raises(ValueError, match=r"--weights=int8: frozen quantized weights without "):
    run(init=f"hf:{d}", weights="int8").check_data()
  with pytest.raises(ValueError, match=r"--text=x --data=chat:.*both given"):
    run(text="x").check_data()
  with pytest.raises(ValueError, match=r"--data=text:x: not a chat file"):
    config.build(run_config.LMRunConfig, data="text:x").check_data()
  with pytest.raises(ValueError, match=r"checkpoint 'nope:.*expected one of"):
    checkpoints.load_pretrained(f"nope:{d}")
