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


def test_inputs_refused_before_the_weights_load(tmp_path):
  """Refused before the weights load: --max_windows with --data=chat:FILE (else accepted
  and ignored), and a --text of fewer than two tokens (else a failure after the weights
  load, naming neither the flag nor the file)."""
  from tests.experiments.entry import run_refused
  d, _, _, _ = _chat_dir(tmp_path)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  chat = tmp_path / "c.jsonl"
  chat.write_text(json.dumps({"messages": [{"role": "user", "content": "the park"},
                                           {"role": "assistant", "content": "a dog"}]}) + "\n")
  for args, line in (
      ([f"--data=chat:{chat}", "--max_windows=2"], f"--max_windows=2: given with "
       f"--data=chat:{chat}; expected --max_windows only with --text (chat rows are whole "
       "conversations)"),
      ([f"--text={empty}"], f"--text={empty}: 0 token(s); expected at least 2 (one to predict "
       "from the one before it)")):
    out = run_refused("experiments.eval_lm", [f"--checkpoint=hf:{d}", *args, "--seq_len=16",
                                              f"--workdir={tmp_path / 'ev'}"])
    assert out.stderr.strip().splitlines()[-1] == "error: " + line
    assert "eval_lm:" not in out.stdout and not (tmp_path / "ev" / "results.json").exists()


def test_chat_loss_equals_each_conversation_alone(tmp_path):
  """llm.evaluate on chat rows (one conversation per row, padded; the last batch short)
  equals each conversation run alone, on its learned targets only. The padding's positions
  start from 0 again, so without the segment ids the causal mask (by position) lets every
  token see the padding after it."""
  from llm import chat_data
  from llm import checkpoints
  d, _, cfg, _ = _chat_dir(tmp_path)
  rng = np.random.default_rng(0)
  convs = []
  for n in (30, 64, 17, 41, 52):
    learn = np.zeros(n, bool)
    learn[n // 2:] = True
    convs.append(chat_data.Conversation(
        rng.integers(0, cfg.vocab_size, n).astype(np.int32), learn))
  _, model = checkpoints.load_model(f"hf:{d}")
  out = evaluate.mean_loss(model, evaluate.chat_batches(convs, 64, 2))
  # the reference: each conversation on its own row at positions 0..63, its padding after
  # it at later positions, which a causal mask keeps out
  import jax
  rows = np.zeros((len(convs), 64), np.int32)
  for r, c in enumerate(convs):
    rows[r, :len(c)] = c.tokens
  with jax.default_matmul_precision("float32"):
    logits = np.asarray(model(rows)[0], np.float64)
  total, count = 0.0, 0
  for r, c in enumerate(convs):
    logp = logits[r, :len(c) - 1] - logits[r, :len(c) - 1].max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = logp[np.arange(len(c) - 1), c.tokens[1:]]
    total -= picked[c.learn[1:]].sum()
    count += int(c.learn[1:].sum())
  assert out["num_tokens"] == count
  # float32 logits summed in float32 per batch: ~1e-6 relative
  np.testing.assert_allclose(out["loss"], total / count, rtol=1e-5)


def test_text_window_settings_are_checked():
  # max_windows=-1 is refused: as a Python slice [:-1] it would drop the last window silently
  for args, match in (((16, 2, -1), r"max_windows=-1; expected an integer >= 1 or None"),
                      ((16, 2, 0), r"max_windows=0; expected"),
                      ((0, 2, None), r"seq_len=0; expected an integer >= 1"),
                      ((16, 0, None), r"batch_size=0; expected an integer >= 1")):
    with pytest.raises(ValueError, match=match):
      next(evaluate.text_batches(np.arange(40), *args))


def test_perplexity_beyond_float64_is_inf_not_a_clipped_number(monkeypatch):
  batch = next(evaluate.text_batches(np.arange(10), 4, 1))
  for loss, want in ((800.0, float("inf")), (700.0, np.exp(700.0)), (2.0, np.exp(2.0))):
    monkeypatch.setattr(evaluate, "_loss_sums", lambda *a, loss=loss: (4 * loss, 4.0))
    out = evaluate.mean_loss(None, [batch])
    assert out["loss"] == loss and out["perplexity"] == want, (loss, out)
