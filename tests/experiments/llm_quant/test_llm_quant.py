"""experiments/llm_quant: perplexity against an independent computation (the training loss,
`llm.train_lib.chunked_cross_entropy`), the study on stories260K, and on SmolLM2-135M (model
marked): the GGUF's own blocks score as its float32 dequantization does."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.llm_quant import study
from tests.experiments.entry import DATA, run_entry

STORIES = os.path.join(DATA, "llama2c", "stories260K.bin")
TEXT = ("The rabbit-hole went straight on like a tunnel for some way, and then dipped "
        "suddenly down, so suddenly that Alice had not a moment to think about stopping "
        "herself before she found herself falling down a very deep well.")


def _stories():
  if not os.path.exists(STORIES):
    pytest.skip(f"{STORIES} is absent (the shared data folder, see its README)")
  return f"llama2c:{STORIES}"


def test_perplexity_equals_the_training_loss():
  """study.perplexity (windows, padding, masking) against the training loss of the same
  windows, computed by another code path."""
  from llm import checkpoints
  from llm.train_lib import chunked_cross_entropy
  spec = _stories()
  _, model = checkpoints.load_model(spec)
  ids = list(TEXT.encode())
  wins = study.windows(ids, 64)
  assert [len(w) for w in wins] == [64, 64, 64, len(ids) - 192]
  got = study.perplexity(model, wins)

  @jax.jit
  def loss(t):
    h, _ = model.hidden(model.embed_tokens(t[:, :-1]))
    out_w, vocab_major = model.output_weight()
    return chunked_cross_entropy(h, out_w, t[:, 1:], jnp.ones_like(t[:, 1:]), vocab_major, 1)

  total = sum(float(loss(jnp.asarray([w], jnp.int32))) for w in wins)
  assert got["tokens"] == len(ids) - len(wins)
  np.testing.assert_allclose(got["nll"], total / got["tokens"], rtol=1e-5)
  assert math.isclose(got["perplexity"], math.exp(got["nll"]), rel_tol=1e-12)


@pytest.mark.slow
def test_study_on_stories260k():
  res = study.run(_stories(), ["float32", "int8", "int4"], TEXT, "test paragraph", window=64,
                  prompt_len=8, new_tokens=3, repeats=1, rounds=1)
  v = res["variants"]
  assert list(v) == ["float32", "int8", "int4"]
  assert res["text"]["tokenizer"].startswith("utf-8 bytes")
  for mode, r in v.items():
    assert np.isfinite(r["perplexity"]) and r["decode_tokens_per_s"] > 0
    assert len(r["decode_s"]) == 1 and len(r["greedy_ids"]) == 3
  assert v["float32"]["forms"] == {"float32": 47}
  # w_down's input (hidden 172) is not a multiple of 32: those five matrices stay float.
  assert v["int8"]["forms"]["float32 (in 172 not a multiple of 32)"] == 5
  assert v["int4"]["param_bytes"] < v["int8"]["param_bytes"] < v["float32"]["param_bytes"]
  table = study.table(res)
  assert "int4" in table and "perplexity" in table



def test_no_speedup_is_reported_without_a_float32_run():
  """--modes=int8,int4 measures no float32 decode: the table prints "-" and the summary
  None against float32 (not 1.00x, which reads as measured parity)."""
  row = lambda tps, x=None: {"perplexity": 25.0, "param_bytes": 1e6, "decode_tokens_per_s": tps,
                             "forms": {}, **({} if x is None else
                                             {"decode_speedup_vs_float32": x})}
  res = {"checkpoint": "llama2c:x.bin", "variants": {"int8": row(9.0), "int4": row(7.0)}}
  for line in study.table(res).splitlines()[1:]:
    assert line.split()[4] == "-" and "x" not in line.split()[4]
  s = study.summary(res)
  assert s["int8"]["decode_speedup_vs_float32"] is None
  assert s["int4"]["decode_speedup_vs_float32"] is None
  # With float32 measured, the ratio is what run() stored.
  res["variants"] = {"float32": row(8.0, 1.0), "int4": row(6.0, 0.75)}
  assert study.summary(res)["int4"]["decode_speedup_vs_float32"] == 0.75
  assert study.table(res).splitlines()[2].split()[4] == "0.75x"

def test_gguf_mode_needs_a_gguf_checkpoint():
  with pytest.raises(ValueError, match=r"--modes=gguf .* the checkpoint is llama2c"):
    study.load_variants(_stories(), ["float32", "gguf"])


@pytest.mark.slow
def test_entry_point_writes_results_and_plot(tmp_path):
  _stories()
  out, summary = run_entry("experiments.llm_quant", [
      f"--checkpoint=llama2c:{STORIES}", "--modes=float32,int4", "--window=64",
      "--prompt_len=4", "--new_tokens=3", "--repeats=1", "--rounds=1",
      f"--workdir={tmp_path}"])
  assert set(summary) == {"checkpoint", "float32", "int4"}
  assert os.path.exists(tmp_path / "llm_quant.png")
  res = json.loads((tmp_path / "results.json").read_text())
  assert res["variants"]["int4"]["decode_speedup_vs_float32"] > 0
  assert "load average" in out


@pytest.mark.models
def test_smollm2_gguf_blocks_score_as_their_dequantization():
  """SmolLM2-135M-Instruct (Q4_1 layers, Q8_0 embedding): the file's own blocks are its
  float32 weights exactly, so perplexity agrees to float32 rounding; our int8 is close."""
  from tests.real_models import smollm2_gguf_or_skip
  with open(study.HELDOUT, encoding="utf-8") as f:
    text = f.read()[:500]   # 114 tokens, one window: int8 is off by ~0.1%, gguf by ~1e-6
  # The study's perplexity path (study.run adds decode timings, which nothing here checks).
  spec = f"gguf:{smollm2_gguf_or_skip()}"
  cfg, variants = study.load_variants(spec, ["float32", "int8", "gguf"])
  ids, _ = study.text_ids(spec, text, cfg.vocab_size)
  wins = study.windows(ids, 512)
  v = {mode: {**info, **study.perplexity(model, wins)} for mode, (model, info) in variants.items()}
  assert v["gguf"]["forms"] == {"float32": 61, "int4 Q4_1 blocks": 210, "int8 Q8_0 blocks": 1}
  np.testing.assert_allclose(v["gguf"]["perplexity"], v["float32"]["perplexity"], rtol=1e-4)
  np.testing.assert_allclose(v["int8"]["perplexity"], v["float32"]["perplexity"], rtol=0.02)
  assert v["gguf"]["param_bytes"] < 0.2 * v["float32"]["param_bytes"]


def test_a_workdir_checkpoint_says_what_works(tmp_path):
  from tests.experiments.test_generate_chat import run_cases
  [(code, err)] = run_cases("experiments.llm_quant.__main__",
                            [[f"--checkpoint=workdir:{tmp_path}", f"--workdir={tmp_path}/q"]])
  assert code == 2 and err.strip().splitlines() == [
      f"error: --checkpoint=workdir:{tmp_path}: a train_lm workdir; expected llama2c:PATH, "
      "hf:DIR or gguf:FILE (llm_quant compares the weight formats of a checkpoint file; "
      "experiments.generate --checkpoint=workdir:DIR --weights=int8 or int4 runs a workdir's "
      "model quantized)"], err
