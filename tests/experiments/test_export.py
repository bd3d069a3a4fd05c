"""experiments.export: a checkpoint as a HF directory (tokenizer and chat template with it)
or a GGUF file, read back by our loaders with the same weights and greedy ids; refusals
leave nothing behind."""

from __future__ import annotations

import json
import os

import numpy as np

from llm import checkpoints
from llm import gguf as G
from llm import model as model_lib
from tests.experiments.test_generate_chat import _chat_dir
from tests.experiments.test_lm_entry import _greedy, _run
from tests.llm.test_reader_errors import CFG, _weights
from tests.llm.test_reader_fuzz import _vocab


def _flat(spec):
  _, model = checkpoints.load_model(spec)
  return model_lib.weights_from_model(model)


def test_hf_export_with_tokenizer_and_template(tmp_path):
  d, tok, cfg, w = _chat_dir(tmp_path)
  out = tmp_path / "export"
  summary = json.loads(_run("experiments.export", [f"--checkpoint=hf:{d}", "--to=hf",
                                                   f"--out={out}"])[-1])
  assert summary["to"] == "hf" and summary["bytes"] > 0
  got = _flat(f"hf:{out}")
  for n in w:
    np.testing.assert_array_equal(got[n], np.float32(w[n]))
  tok2 = checkpoints.find_tokenizer(f"hf:{out}", None, cfg.vocab_size)
  msgs = [{"role": "user", "content": "the park"}]
  from llm import chat
  assert chat.encode_chat(tok2, msgs) == chat.encode_chat(tok, msgs)
  assert (tok2.bos_id, tok2.eos_id, tok2.add_bos) == (tok.bos_id, tok.eos_id, tok.add_bos)
  prompt = chat.encode_chat(tok, msgs)
  assert _greedy(cfg, got, prompt, 6) == _greedy(cfg, w, prompt, 6)
  # a tokenizer.json has no GGUF form here: refused, nothing left behind
  err = _run("experiments.export", [f"--checkpoint=hf:{d}", "--to=gguf",
                                    f"--out={tmp_path / 'x.gguf'}"], fails=True)
  assert "a HFTokenizer tokenizer" in err.splitlines()[-1]
  assert not [n for n in os.listdir(tmp_path) if n.startswith("x.gguf")]
  err = _run("experiments.export", [f"--checkpoint=hf:{d}", "--to=hf", f"--out={out}"],
             fails=True)
  assert f"--out={out}: exists" in err.splitlines()[-1]


def test_gguf_export_keeps_vocabulary_and_weights(tmp_path):
  src = G.save_gguf(str(tmp_path / "m.gguf"), CFG, _weights(CFG), qtype="F32", vocab=_vocab())
  out = tmp_path / "out.gguf"
  _run("experiments.export", [f"--checkpoint=gguf:{src}", "--to=gguf", "--gguf_type=F32",
                              f"--out={out}"])
  a, b = _flat(f"gguf:{src}"), _flat(f"gguf:{out}")
  for n in a:
    np.testing.assert_array_equal(a[n], b[n])
  assert G.read_vocab(str(out)).tokens == G.read_vocab(src).tokens
