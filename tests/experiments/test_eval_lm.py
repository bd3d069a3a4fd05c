"""experiments.eval_lm --text end to end on a tiny random Llama, its loss against a direct
computation (each window run alone, its log-softmax in float64); llm.evaluate's windows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm import evaluate
from tests.experiments.test_generate_chat import _chat_dir
from tests.experiments.test_lm_entry import _run
from tests.llm.test_tokenizer import SENTENCES

SEQ_LEN = 16


def _direct_loss_sum(model, tokens, seq_len, starts):
  """Sum of -log p(next token) over the windows starting at `starts`, each run alone with no
  padding (the model's own positions), in float64."""
  import jax
  total, count = 0.0, 0
  for s in starts:
    win = np.asarray(tokens[s:s + seq_len + 1], np.int32)
    with jax.default_matmul_precision("float32"):
      logits = np.asarray(model(win[None, :-1])[0][0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    total -= logp[np.arange(win.size - 1), win[1:]].sum()
    count += win.size - 1
  return total, count


def test_text_windows_predict_every_token_once():
  tokens = np.arange(100, 140)                     # 40 tokens: windows at 0, 16, 32
  batches = list(evaluate.text_batches(tokens, SEQ_LEN, 2))
  assert len(batches) == 2
  inputs = np.concatenate([b.inputs for b in batches])
  targets = np.concatenate([b.targets for b in batches])
  mask = np.concatenate([b.mask for b in batches])
  assert mask.sum(1).tolist() == [16, 16, 7, 0]   # the last window 8 tokens, a padding row
  np.testing.assert_array_equal(targets[mask > 0], tokens[1:])
  np.testing.assert_array_equal(inputs[mask > 0], tokens[:-1])
  np.testing.assert_array_equal(batches[1].positions[0], np.arange(SEQ_LEN))
  first = list(evaluate.text_batches(tokens, SEQ_LEN, 2, max_windows=1))
  assert len(first) == 1 and first[0].mask.sum() == 16
  with pytest.raises(ValueError, match=r"1 token\(s\); expected at least 2"):
    next(evaluate.text_batches([5], SEQ_LEN, 2))
  with pytest.raises(ValueError, match="no targets to score"):
    evaluate.mean_loss(None, [])


def test_eval_lm_text_loss_equals_a_direct_computation(tmp_path):
  from llm import checkpoints
  d, tok, cfg, _ = _chat_dir(tmp_path)
  text = " ".join(SENTENCES[:7])
  path = tmp_path / "book.txt"
  path.write_text(text)
  tokens = tok.encode(text)
  starts = list(range(0, len(tokens) - 1, SEQ_LEN))
  # a short last window and a last batch with a padding row: both must be masked
  assert (len(tokens) - 1) % SEQ_LEN and len(starts) % 4, (len(tokens), len(starts))
  _, model = checkpoints.load_model(f"hf:{d}")
  total, count = _direct_loss_sum(model, tokens, SEQ_LEN, starts)
  lines = _run("experiments.eval_lm", [
      f"--checkpoint=hf:{d}", f"--text={path}", f"--seq_len={SEQ_LEN}", "--batch_size=4",
      f"--workdir={tmp_path / 'ev'}"])
  out = json.loads(lines[-1])
  assert out["num_tokens"] == count == len(tokens) - 1
  np.testing.assert_allclose(out["loss"], total / count, rtol=1e-5)
  np.testing.assert_allclose(out["perplexity"], np.exp(total / count), rtol=1e-5)
  np.testing.assert_allclose(out["bits_per_token"], total / count / np.log(2), rtol=1e-5)
  saved = json.loads((tmp_path / "ev" / "results.json").read_text())
  assert saved["summary"]["loss"] == out["loss"]
  # --max_windows: the first two windows only
  out = json.loads(_run("experiments.eval_lm", [
      f"--checkpoint=hf:{d}", f"--text={path}", f"--seq_len={SEQ_LEN}", "--batch_size=4",
      "--max_windows=2", f"--workdir={tmp_path / 'ev2'}"])[-1])
  total, count = _direct_loss_sum(model, tokens, SEQ_LEN, starts[:2])
  assert out["num_tokens"] == count == 2 * SEQ_LEN
  np.testing.assert_allclose(out["loss"], total / count, rtol=1e-5)
  # the refusals, one line each
  err = _run("experiments.eval_lm", [f"--checkpoint=hf:{d}", f"--workdir={tmp_path / 'e'}"],
             fails=True)
  assert "--text / --data: neither given; expected one of --text=FILE" in err.splitlines()[-1]
  err = _run("experiments.eval_lm", [f"--checkpoint=hf:{d}", f"--text={path}", "--seq_len=97",
                                     f"--workdir={tmp_path / 'e'}"], fails=True)
  assert (f"--seq_len=97: longer than the model's context ({cfg.max_seq_len}); expected at "
          f"most {cfg.max_seq_len}") in err.splitlines()[-1]
