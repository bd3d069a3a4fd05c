"""Bad files and paths given to the LLM readers end in one line naming the file (and the key):
what `core.cli.run` prints as `error: ...` with status 2, checked here through
`cli.is_user_error` / `cli.error_line` on the exception each reader raises."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from core import cli
from core import profiling
from llm import checkpoints as C
from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig
from llm.data import TextSource
from llm.packing.cost import CostModel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = LlamaConfig(vocab_size=12, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                  norm_eps=float(np.float32(1e-5)), rope_theta=10000.0, max_seq_len=32)


def _line(fn) -> str:
  """The one line an entry point would end with when `fn` raises."""
  with pytest.raises(Exception) as info:
    fn()
  assert cli.is_user_error(info.value), repr(info.value)
  line = cli.error_line(info.value)
  assert "\n" not in line
  return line


def _weights(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {n: (np.ones(s, np.float32) if "norm" in n
              else (0.1 * rng.standard_normal(s)).astype(np.float32))
          for n, s in W.param_shapes(cfg).items()}


def test_no_file_not_found_without_a_file_name():
  """`raise FileNotFoundError(f"...")` leaves `filename` unset, and is_user_error then shows
  a traceback: every such raise in the project passes (errno, message, path)."""
  bad = []
  for root in ("core", "rec", "llm", "kernels", "experiments"):
    for dirpath, _, names in os.walk(os.path.join(REPO, root)):
      for name in names:
        if name.endswith(".py"):
          path = os.path.join(dirpath, name)
          text = open(path, encoding="utf-8").read()
          bad += [f"{os.path.relpath(path, REPO)}:{text[:m.start()].count(chr(10)) + 1}"
                  for m in re.finditer(r"raise (FileNotFoundError|NotADirectoryError|"
                                       r"IsADirectoryError|PermissionError)\(f?[\"']", text)]
  assert not bad, bad


def test_missing_paths_are_one_line(tmp_path):
  assert _line(lambda: C.load_weights("gguf:/nope.gguf")) == "error: /nope.gguf: no such GGUF file"
  assert _line(lambda: C.load_model("gguf:/nope.gguf")) == "error: /nope.gguf: no such GGUF file"
  assert _line(lambda: T.load_tokenizer("/nope/tokenizer.json")) == (
      "error: /nope/tokenizer.json: no such file; expected a Hugging Face tokenizer.json")
  assert _line(lambda: T.load_tokenizer("/nope/tok.bin")) == (
      "error: /nope/tok.bin: no such file; expected a llama2.c tokenizer.bin")
  assert _line(lambda: T.load_tokenizer(str(tmp_path))) == (
      f"error: {tmp_path}: no tokenizer.json in this directory")
  assert _line(lambda: TextSource("/nope.txt", 8, 2)) == "error: /nope.txt: no such file (--text)"
  assert _line(lambda: W.load_hf("/nope")) == (
      "error: /nope: no such directory; expected a Hugging Face model directory (config.json and "
      "safetensors)")
  assert _line(lambda: C.load_config(f"workdir:{tmp_path}")).startswith(
      f"error: {tmp_path}/model_config.json: missing; expected a workdir written by")
  from llm.train_lib import load_workdir
  assert _line(lambda: load_workdir(str(tmp_path))).startswith(
      f"error: {tmp_path}/model_config.json: missing")
  assert _line(lambda: CostModel.load(str(tmp_path / "c.json"))).startswith(
      f"error: {tmp_path / 'c.json'}: no such cost model file")
  assert _line(lambda: profiling.summarize(str(tmp_path))).startswith(
      f"error: {tmp_path}: no perfetto_trace.json.gz under it")


def test_hf_dir_with_a_deleted_shard(tmp_path):
  d = str(tmp_path / "hf")
  W.save_hf(d, CFG, _weights(CFG), max_shard_bytes=3000)
  shard = sorted(n for n in os.listdir(d) if n.startswith("model-"))[1]
  os.remove(os.path.join(d, shard))
  assert _line(lambda: W.load_hf(d)) == (
      f"error: {d}/{shard}: listed in {d}/model.safetensors.index.json but absent")


@pytest.mark.parametrize("text,found,want", [
    ("{bad", "config.json:1:2: not JSON (Expecting property name enclosed in double quotes)",
     "a JSON file"),
    ("[1, 2]", "config.json: a JSON list", "a JSON object"),
    (lambda c: {**c, "num_hidden_layers": "abc"}, "config.json: num_hidden_layers='abc'",
     "an integer >= 1"),
    (lambda c: {**c, "num_hidden_layers": -2}, "config.json: num_hidden_layers=-2",
     "an integer >= 1"),
    (lambda c: {**c, "num_hidden_layers": 10**9}, "config.json: num_hidden_layers=1000000000",
     "the 2 layers whose tensors"),
    (lambda c: {**c, "num_hidden_layers": 3}, "config.json: num_hidden_layers=3",
     "the 2 layers whose tensors"),
    (lambda c: {**c, "rms_norm_eps": "1e-5"}, "config.json: rms_norm_eps='1e-5'", "a number"),
    (lambda c: {**c, "tie_word_embeddings": "false"}, "config.json: tie_word_embeddings='false'",
     "true or false"),
    (lambda c: {**c, "num_key_value_heads": 3}, "num_attention_heads=2, num_key_value_heads=3",
     "a number of heads that is a multiple"),
    (lambda c: {**c, "rope_theta": None}, "config.json: rope_theta=None", "a number > 1"),
    (lambda c: {**c, "rope_scaling": {"rope_type": ["x"]}}, "rope type ['x']", "one of"),
    (lambda c: {**c, "rope_scaling": {"rope_type": "llama3", "factor": "8",
                                      "low_freq_factor": 1, "high_freq_factor": 4,
                                      "original_max_position_embeddings": 8192}},
     "rope_scaling.factor='8'", "a number"),
    ("\xff\xfe{}", "config.json: byte 0 (0xFF) is not UTF-8", "a UTF-8 JSON file"),
    ("[" * 100000 + "]" * 100000, "config.json: JSON nested too deeply", "a JSON file"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "config.json: both rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0} and "
     "rope_scaling={'rope_type': 'linear', 'factor': 2.0}", "one of them"),
    (lambda c: {**{k: v for k, v in c.items() if k != "max_position_embeddings"},
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "config.json: rope_scaling of rope type 'yarn' without original_max_position_embeddings or "
     "max_position_embeddings", "the pretraining context length"),
    (lambda c: {**c, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}},
     "config.json: rope_scaling.truncate='yes'", "true or false"),
    (lambda c: {**{k: v for k, v in c.items() if k != "head_dim"}, "hidden_size": 17},
     "config.json: hidden_size=17, num_attention_heads=2 and no head_dim",
     "hidden_size a multiple of num_attention_heads"),
    (lambda c: {**c, "head_dim": 7}, "config.json: head_dim=7", "an even head size"),
    (lambda c: {**c, "rms_norm_eps": 0}, "config.json: rms_norm_eps=0", "a number > 0"),
    (lambda c: {**c, "rms_norm_eps": 10**400}, "config.json: rms_norm_eps=1000000", "a number"),
    (lambda c: {**c, "model_type": "qwen2", "use_sliding_window": "yes"},
     "config.json: use_sliding_window='yes'", "true or false"),
    (lambda c: {**c, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
                "max_window_layers": -1}, "config.json: max_window_layers=-1", "an integer >= 0"),
])
def test_bad_config_json_names_file_and_key(tmp_path, text, found, want):
  d = str(tmp_path / "hf")
  W.save_hf(d, CFG, _weights(CFG))
  path = os.path.join(d, "config.json")
  if callable(text):
    text = json.dumps(text(json.load(open(path))))
  with open(path, "wb") as fh:
    fh.write(text.encode("latin-1") if text.startswith("\xff") else text.encode())
  line = _line(lambda: W.load_hf(d))
  assert line.startswith(f"error: {d}/") and found in line and f"; expected {want}" in line, line


def test_a_gguf_as_tokenizer_uses_its_vocabulary(tmp_path):
  from llm import gguf as G
  from llm.gguf_vocab import vocab_tokenizer
  from tests.llm.test_reader_fuzz import _vocab
  path = G.save_gguf(str(tmp_path / "m.gguf"), CFG, _weights(CFG), qtype="F32", vocab=_vocab())
  want = vocab_tokenizer(G.read_gguf(path).vocab, path, CFG.vocab_size)
  for p in (path, str(tmp_path / "copy.bin")):   # by its magic, whatever its name
    if p != path:
      with open(path, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read())
    tok = C.find_tokenizer("llama2c:/unused.bin", p, CFG.vocab_size)
    assert tok.encode("ab abc", bos=tok.add_bos) == want.encode("ab abc", bos=want.add_bos)
    assert tok.encode("ab abc", bos=True)[0] == 1 and tok.source == p
  with pytest.raises(ValueError, match="more than the model's vocabulary of 8"):
    C.load_tokenizer(path, vocab_size=8)
  # llm.tokenizer alone (train_lm's --tokenizer) names what it is instead of reading it as a
  # llama2.c tokenizer.bin ("the file is truncated").
  assert _line(lambda: T.load_tokenizer(path)).startswith(f"error: {path}: a GGUF file; expected")
  assert _line(lambda: C.load_tokenizer("/nope.gguf")) == "error: /nope.gguf: no such GGUF file"


def test_train_lm_keeps_a_gguf_tokenizer_in_its_workdir(tmp_path):
  """train_lm --tokenizer=FILE.gguf: the vocabulary read from the GGUF, the file copied into
  the workdir as tokenizer.gguf, where generate --checkpoint=workdir:DIR finds it."""
  from experiments.train_lm import copy_tokenizer
  from llm import gguf as G
  from tests.llm.test_reader_fuzz import _vocab
  path = G.save_gguf(str(tmp_path / "m.gguf"), CFG, _weights(CFG), qtype="F32", vocab=_vocab())
  tok = C.load_tokenizer(path)
  wd = tmp_path / "run"
  wd.mkdir()
  copy_tokenizer(tok, str(wd))
  assert sorted(os.listdir(wd)) == ["tokenizer.gguf"]
  got = C.find_tokenizer(f"workdir:{wd}", None, tok.vocab_size)
  assert got.encode("ab abc", bos=False) == tok.encode("ab abc", bos=False)
  assert (got.add_bos, got.add_eos) == (False, False)   # train_lm's stream has none


def test_gguf_counts_past_the_file_are_refused_at_once(tmp_path):
  """Length and count fields are checked against the file before anything is allocated or
  looped over; block_count against the blocks the tensors hold."""
  from llm import gguf as G
  from tests.llm.test_reader_fuzz import _vocab
  path = G.save_gguf(str(tmp_path / "m.gguf"), CFG, _weights(CFG), qtype="F32", vocab=_vocab())
  r = G._reader(path)
  src = open(path, "rb").read()
  tensor = r.tensors[0].field

  def value_at(key, part):
    f = r.fields[key]
    return f.offset + sum(int(p.nbytes) for p in f.parts[:part])

  cases = [(value_at("llama.block_count", 3), (2**31).to_bytes(4, "little"),
            "metadata llama.block_count=2147483648; expected the 2 blocks"),
           (value_at("tokenizer.ggml.token_type", 4), (2**40).to_bytes(8, "little"),
            "not a complete GGUF file: a field at byte"),
           (value_at("llama.attention.head_count", 3), (0).to_bytes(4, "little"),
            "metadata llama.attention.head_count=0; expected an integer >= 1"),
           (value_at("llama.block_count", 2), (8).to_bytes(4, "little"),   # uint32 -> string
            "not a complete GGUF file"),
           # A tensor offset that wraps around 2**64 to the file's first bytes.
           (tensor.offset + sum(int(p.nbytes) for p in tensor.parts[:5]),
            (2**64 - int(r.data_offset)).to_bytes(8, "little"), "but the file has")]
  # "At once", measured in Python lines run rather than seconds (deterministic on any machine
  # and load): a corrupt file may run no more than twice the lines reading the intact file
  # did (its error's own lines and another gguf version's reader fit in that), while a loop
  # over a 2**31 block count or a 2**40-element array would run billions.
  budget = 2 * _lines_run(lambda: G.read_gguf(path))
  for at, b, match in cases:
    out = bytearray(src)
    out[at:at + len(b)] = b
    bad = str(tmp_path / "bad.gguf")
    open(bad, "wb").write(bytes(out))
    line = _line(lambda: _lines_run(lambda: G.read_gguf(bad), budget))
    assert match in line, line


class _TooManyLines(BaseException):
  """Not an Exception: no `except Exception` of the code under test can swallow it."""


def _lines_run(fn, budget=None) -> int:
  """The Python lines `fn()` runs (every frame, library code included); raises
  _TooManyLines once past `budget`."""
  n = 0

  def trace(frame, event, arg):
    nonlocal n
    if event == "line":
      n += 1
      if budget is not None and n > budget:
        raise _TooManyLines(f"more than {budget} Python lines run")
    return trace

  old = sys.gettrace()
  sys.settrace(trace)
  try:
    fn()
  finally:
    sys.settrace(old)
  return n


def test_bad_safetensors_files_and_index_are_one_line(tmp_path):
  d = str(tmp_path / "hf")
  w = _weights(CFG)
  single = os.path.join(d, "model.safetensors")

  def header(fn):
    """Rewrites model.safetensors' JSON header with fn(header), the tensor bytes kept; returns
    the new header's length."""
    data = open(single, "rb").read()
    n = int.from_bytes(data[:8], "little")
    h = json.dumps(fn(json.loads(data[8:8 + n]))).encode()
    open(single, "wb").write(len(h).to_bytes(8, "little") + h + data[8 + n:])
    return len(h)

  W.save_hf(d, CFG, w)
  n = header(lambda h: {**h, "model.norm.weight": {"dtype": "F32", "shape": [16]}})
  assert _line(lambda: W.load_hf(d)) == (
      f"error: {single}: the {n}-byte safetensors header is not a valid tensor table "
      "(KeyError: 'data_offsets')")
  W.save_hf(d, CFG, w)
  header(lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "X9"}})
  assert _line(lambda: W.load_hf(d)).startswith(f"error: {single}: cannot read as safetensors:")
  W.save_hf(d, CFG, w)
  os.rename(single, os.path.join(d, "a.safetensors"))
  W.save_hf(str(tmp_path / "other"), CFG, w)
  os.rename(str(tmp_path / "other" / "model.safetensors"), os.path.join(d, "b.safetensors"))
  assert _line(lambda: W.load_hf(d)) == (
      f"error: {d}: tensor 'lm_head.weight' is in both {d}/a.safetensors and {d}/b.safetensors")
  for name in ("a", "b"):
    os.remove(os.path.join(d, f"{name}.safetensors"))
  assert _line(lambda: W.load_hf(d)) == (
      f"error: {d}: no model.safetensors.index.json, model.safetensors or *.safetensors files")
  index = os.path.join(d, "model.safetensors.index.json")
  for text, line in (("[]", f"error: {index}: no 'weight_map' object"),
                     ('{"weight_map": {"lm_head.weight": 3}}',
                      f"error: {index}: weight_map['lm_head.weight']=3; expected a safetensors "
                      "file name")):
    open(index, "w").write(text)
    assert _line(lambda: W.load_hf(d)) == line
  os.remove(index)
  W.save_hf(d, CFG, w)
  with pytest.raises(ValueError, match=r"load_hf: dtype='float64', expected None or one of "
                     r"\['bfloat16', 'float16', 'float32'\]"):
    W.load_hf(d, "float64")
  with pytest.raises(ValueError, match=r"save_hf: dtype='int8', expected one of \['bfloat16'"):
    W.save_hf(d, CFG, w, dtype="int8")

