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


def test_hf_export_keeps_the_stop_ids(tmp_path):
  """generation_config.json's stop ids (a Llama 3 instruct lists three) come back from the
  exported tokenizer files; without them transformers' generate never stops, and ours stops
  at the EOS alone."""
  from experiments import export
  d, tok, cfg, _ = _chat_dir(tmp_path)
  eot = tok.tokenizers.token_to_id("<|im_end|>")
  with open(os.path.join(d, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": tok.bos_id, "eos_token_id": [tok.eos_id, eot]}, f)
  tok = checkpoints.find_tokenizer(f"hf:{d}", None, cfg.vocab_size)
  assert tok.stop_ids == (tok.eos_id, eot)
  out = tmp_path / "exported"
  out.mkdir()
  for name, text in export.hf_tokenizer_files(tok, "test").items():
    (out / name).write_text(text)
  assert json.loads((out / "generation_config.json").read_text()) == {
      "bos_token_id": tok.bos_id, "eos_token_id": [tok.eos_id, eot]}
  back = checkpoints.find_tokenizer(f"hf:{out}", None, cfg.vocab_size)
  assert (back.stop_ids, back.eos_id, back.bos_id) == (tok.stop_ids, tok.eos_id, tok.bos_id)


def test_hf_export_tokenizer_json_adds_what_the_tokenizer_adds(tmp_path):
  """transformers' PreTrainedTokenizerFast encodes through tokenizer.json's post-processor
  (`tokenizers`' encode with add_special_tokens, as here) and ignores add_bos_token: the
  exported post-processor must add a BOS where ours adds one (a GGUF or llama2.c vocabulary
  has no post-processor) and none where ours adds none (a train_lm workdir, whose
  tokenizer.json may carry Llama 3's BOS template); a ByteLevel step stays."""
  from tokenizers import Tokenizer
  from tokenizers import processors
  from experiments import export
  d, tok, _, _ = _chat_dir(tmp_path)
  text = "the park <|im_end|> again"

  def exported(tok):
    t = Tokenizer.from_str(export.hf_tokenizer_files(tok, "test")["tokenizer.json"])
    return t, t.encode(text).ids

  assert tok.tokenizers.post_processor is None and not tok.add_bos
  assert exported(tok)[1] == tok.encode(text)                       # nothing to add
  tok.add_bos = True
  assert exported(tok)[1] == tok.encode(text, bos=True) and tok.bos_id is not None
  tok.add_eos = True
  assert exported(tok)[1] == tok.encode(text, bos=True, eos=True)
  # a BOS template plus ByteLevel offsets (Llama 3's tokenizer.json), in a run that adds none
  tok.tokenizers.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_id)])])
  tok.add_bos = tok.add_eos = False
  t, ids = exported(tok)
  assert ids == tok.encode(text)
  assert json.loads(t.to_str())["post_processor"]["processors"][0]["type"] == "ByteLevel"


def test_a_format_flag_the_other_format_ignores_is_refused(tmp_path):
  d, _, _, _ = _chat_dir(tmp_path)
  for args, want in ((["--to=gguf", "--dtype=bfloat16"], "--dtype=bfloat16: not read with "
                      "--to=gguf; expected it only with --to=hf"),
                     (["--to=hf", "--gguf_type=Q8_0"], "--gguf_type=Q8_0: not read with "
                      "--to=hf; expected it only with --to=gguf")):
    err = _run("experiments.export", [f"--checkpoint=hf:{d}", *args,
                                      f"--out={tmp_path / 'x'}"], fails=True)
    assert want in err.splitlines()[-1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("x")]


def test_gguf_export_adds_bos_as_the_checkpoints_tokenizer_does(tmp_path):
  """A train_lm workdir's tokenizer adds no BOS (its stream had none) even where its
  tokenizer.gguf's metadata says add_bos_token: the exported GGUF says what ours adds."""
  from experiments import export
  src = G.save_gguf(str(tmp_path / "m.gguf"), CFG, _weights(CFG), qtype="F32", vocab=_vocab())
  spec = f"gguf:{src}"
  tok = checkpoints.find_tokenizer(spec, None, CFG.vocab_size)
  assert tok.add_bos
  assert export.gguf_vocab(spec, tok, "test").add_bos is True
  tok.add_bos = False                      # as find_tokenizer leaves a workdir's
  vocab = export.gguf_vocab(spec, tok, "test")
  assert (vocab.add_bos, vocab.add_eos) == (False, False)
  out = str(tmp_path / "out.gguf")
  G.save_gguf(out, CFG, _weights(CFG), qtype="F32", vocab=vocab)
  back = checkpoints.find_tokenizer(f"gguf:{out}", None, CFG.vocab_size)
  assert back.encode("ab a", bos=back.add_bos) == tok.encode("ab a", bos=tok.add_bos)
