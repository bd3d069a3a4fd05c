"""Property-based fuzzing of the LLM file readers: GGUF header, metadata and vocabulary
(llm.gguf), HF config.json (llm.weights), tokenizer.json and tokenizer.bin (llm.tokenizer)
and llama2.c checkpoints (llm.weights).

Each reader gets a small valid file written here, then mutated: truncated, bytes
overwritten (length fields set to huge values among them), JSON values replaced, keys
dropped. Every case must end in the reader's own one-line error (`core.cli.is_user_error`:
what an entry point prints as `error: ...`, status 2) or in a correct parse (equal to the
unmutated one where the mutation only touched bytes the parse does not read), never another
exception, a hang or unbounded memory.

Examples per reader: FUZZ_EXAMPLES (default 80: about 10 s for the file on a loaded 2-core
machine); e.g. FUZZ_EXAMPLES=2000 for a longer run.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import cli
from core import errors
from llm import checkpoints as C
from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig

gguf = pytest.importorskip("gguf")
from llm import gguf as G  # noqa: E402
from llm import gguf_vocab as GV  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "80"))
FUZZ = settings(derandomize=True, deadline=None, max_examples=EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
CFG = LlamaConfig(vocab_size=12, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                  norm_eps=float(np.float32(1e-5)), rope_theta=10000.0, max_seq_len=32)


def _weights(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {n: (np.ones(s, np.float32) if "norm" in n
              else (0.1 * rng.standard_normal(s)).astype(np.float32))
          for n, s in W.param_shapes(cfg).items()}


def _vocab():
  """A 12-token SentencePiece vocabulary (GGUF `llama` model)."""
  tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "▁a", "ab", "bc", "abc", "▁ab"]
  types = [2, 3, 3] + [1] * 9
  return GV.GGUFVocab(model="llama", tokens=tokens, token_types=types,
                     scores=[0.0, 0.0, 0.0] + [-float(i) for i in range(9)], bos_id=1, eos_id=2,
                     unk_id=0, add_bos=True, add_eos=False, add_space_prefix=True)


def _outcome(fn):
  """fn's result, or None when it raised one of the readers' own errors; any other exception
  fails the test with the case. A scalar overflow (an offset or size that wrapped around) is
  such an exception too."""
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message="overflow encountered in scalar",
                              category=RuntimeWarning)
      return fn()
  except Exception as e:   # noqa: BLE001 - the oracle decides
    if cli.is_user_error(e):
      line = cli.error_line(e)
      assert "\n" not in line.strip(), line
      return None
    raise


def _mutations(size: int, head: int):
  """One mutation of a `size`-byte file whose first `head` bytes are its header/metadata:
  ("cut", n) keeps n bytes; ("put", offset, bytes) overwrites; offsets favour the header."""
  offset = st.one_of(st.integers(0, max(head - 1, 0)), st.integers(0, size - 1))
  payload = st.one_of(st.binary(min_size=1, max_size=8),
                      st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\xff\xff\xff\x7f",
                                       b"\x00\x00\x00\x80", b"\x01\x00\x00\x00\x00\x00\x00\x10"]))
  return st.one_of(st.tuples(st.just("cut"), st.integers(0, size - 1)),
                   st.tuples(st.just("put"), offset, payload))


_INTERESTING = (0, 1, 2, 3, 7, 8, 9, 12, 31, 32, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31,
                2**32 - 1, 2**40, 2**63, 2**64 - 1)


def _field_mutations(parts):
  """A field of a binary header (offset, width) set to an interesting or random unsigned
  integer of its width."""
  def put(pick):
    (at, width), value = pick
    return ("put", at, (value % 2**(8 * width)).to_bytes(width, "little"))
  return st.tuples(st.sampled_from(parts),
                   st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 2**64 - 1))).map(put)


def _apply(data: bytes, m) -> tuple[bytes, int]:
  """(mutated bytes, first offset whose meaning may have changed)."""
  if m[0] == "cut":
    return data[:m[1]], m[1]
  _, at, b = m
  out = bytearray(data)
  out[at:at + len(b)] = b
  return bytes(out[:len(data)]), at


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("fuzz")
  out = {}
  out["gguf"] = G.save_gguf(str(d / "m.gguf"), CFG, _weights(CFG), qtype="F32", vocab=_vocab())
  r = G._reader(out["gguf"])
  out["gguf_data_offset"] = int(r.data_offset)
  # (offset, width) of every field of the header, metadata and tensor table: the lengths,
  # counts, type ids, dimensions and values a structure-aware mutation overwrites.
  parts = []
  for f in list(r.fields.values()) + [t.field for t in r.tensors]:
    at = f.offset
    for part in f.parts:
      if part.nbytes:
        parts.append((at, min(int(part.nbytes), 8)))
      at += int(part.nbytes)
  out["gguf_parts"] = sorted(set(parts))
  out["llama2c"] = str(d / "m.bin")
  W.save_llama2c(out["llama2c"], CFG.replace(norm_eps=1e-5), _weights(CFG, 1))
  hf = str(d / "hf")
  W.save_hf(hf, CFG, _weights(CFG, 2))
  out["hf"] = hf
  from tests.llm.test_tokenizer import _TINY, _bin_pieces, train_bpe
  out["tokenizer.json"] = train_bpe(str(d / "tok"), vocab_size=300)
  out["tokenizer.bin"] = str(d / "tok.bin")
  T.write_llama2c_tokenizer(out["tokenizer.bin"], *_bin_pieces(_TINY))
  return out


def _write(tmp_path, name, data: bytes) -> str:
  path = str(tmp_path / name)
  with open(path, "wb") as fh:
    fh.write(data)
  return path


# ---------------------------------------------------------------------------------------------
# GGUF


def _read_gguf(path):
  ckpt = G.read_gguf(path)
  w = ckpt.weights()
  tok = GV.vocab_tokenizer(ckpt.vocab, path, ckpt.config.vocab_size)
  return ckpt.config, w, tok.encode("ab a", bos=tok.add_bos)


@FUZZ
@given(data=st.data())
def test_gguf_reader(files, tmp_path, data):
  src = open(files["gguf"], "rb").read()
  head = files["gguf_data_offset"]
  m = data.draw(st.one_of(_mutations(len(src), head), _field_mutations(files["gguf_parts"])))
  mutated, at = _apply(src, m)
  path = _write(tmp_path, "x.gguf", mutated)
  got = _outcome(lambda: _read_gguf(path))
  if got is not None and at >= head:   # only tensor bytes changed: the same model and vocabulary
    want = _read_gguf(files["gguf"])
    assert got[0] == want[0] and got[2] == want[2]
  # The same file as a tokenizer (its vocabulary only, whatever its architecture).
  tok = _outcome(lambda: C.load_tokenizer(path))
  if tok is not None:
    _outcome(lambda: tok.decode(tok.encode("abc b")))


# ---------------------------------------------------------------------------------------------
# HF config.json

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                     | st.floats(allow_nan=True) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _config_edits(keys):
  key = st.sampled_from(sorted(keys) + ["rope_scaling", "rope_parameters", "head_dim"])
  return st.lists(st.one_of(st.tuples(st.just("set"), key, _JSON),
                            st.tuples(st.just("drop"), key, st.none())), min_size=1, max_size=3)


def _check_hf_config(cfg, hf):
  """What a parse must say about the dict it parsed."""
  assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.ffn_dim) == (
      hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"])
  assert cfg.n_heads == hf["num_attention_heads"] and cfg.norm_eps == float(hf["rms_norm_eps"])
  assert cfg.max_seq_len == (hf.get("max_position_embeddings") or 2048)   # null: the default
  assert cfg.tie_embeddings == hf.get("tie_word_embeddings", False)


@FUZZ
@given(data=st.data())
def test_hf_config_json(files, tmp_path, data):
  d = str(tmp_path / "hf")
  if not os.path.isdir(d):
    shutil.copytree(files["hf"], d)
  good = json.load(open(os.path.join(files["hf"], "config.json")))
  text = json.dumps(good)
  if data.draw(st.booleans()):   # structure-aware: values replaced, keys dropped
    hf = dict(good)
    for op, key, value in data.draw(_config_edits(good)):
      if op == "set":
        hf[key] = value
      else:
        hf.pop(key, None)
    raw = json.dumps(hf).encode()
  else:                          # bytes: truncated or overwritten
    hf = None
    raw, _ = _apply(text.encode(), data.draw(_mutations(len(text), len(text))))
  with open(os.path.join(d, "config.json"), "wb") as fh:
    fh.write(raw)
  got = _outcome(lambda: W.load_hf(d))
  if got is not None:
    parsed = json.loads(raw)
    _check_hf_config(got[0], parsed)
    if all(parsed.get(k) == good.get(k) for k in set(good) | set(parsed)
           if k not in ("architectures", "torch_dtype", "use_cache", "initializer_range")):
      assert got[0] == W.load_hf(files["hf"])[0]


# ---------------------------------------------------------------------------------------------
# tokenizer.json and tokenizer.bin


def _json_paths(v, prefix=()):
  if isinstance(v, dict):
    for k, x in v.items():
      yield prefix + (k,)
      yield from _json_paths(x, prefix + (k,))
  elif isinstance(v, list):
    for i, x in enumerate(v[:6]):   # the first entries of long lists (vocab, merges)
      yield prefix + (i,)
      yield from _json_paths(x, prefix + (i,))


def _use_tokenizer(path):
  tok = T.load_tokenizer(path)
  ids = tok.encode("the park, 12 ab", bos=tok.bos_id is not None)
  return ids, tok.decode(ids)


@FUZZ
@given(data=st.data())
def test_tokenizer_json(files, tmp_path, data):
  src = open(files["tokenizer.json"], "rb").read()
  tree = json.loads(src)
  paths = sorted(_json_paths(tree), key=repr)
  if data.draw(st.booleans()):
    where = data.draw(st.sampled_from(paths))
    node = tree
    for k in where[:-1]:
      node = node[k]
    node[where[-1]] = data.draw(_JSON)
    raw = json.dumps(tree).encode()
  else:
    raw, _ = _apply(src, data.draw(_mutations(len(src), 2000)))
  path = _write(tmp_path, "tokenizer.json", raw)
  _outcome(lambda: _use_tokenizer(path))


@FUZZ
@given(data=st.data())
def test_tokenizer_bin(files, tmp_path, data):
  src = open(files["tokenizer.bin"], "rb").read()
  mutated, _ = _apply(src, data.draw(_mutations(len(src), 64)))
  path = _write(tmp_path, "tok.bin", mutated)
  _outcome(lambda: _use_tokenizer(path))


# ---------------------------------------------------------------------------------------------
# llama2.c checkpoints


@FUZZ
@given(data=st.data())
def test_llama2c_checkpoint(files, tmp_path, data):
  src = open(files["llama2c"], "rb").read()
  m = data.draw(st.one_of(_mutations(len(src), 28),
                          st.tuples(st.just("put"), st.sampled_from(range(0, 28, 4)),
                                    st.integers(-2**31, 2**31 - 1).map(
                                        lambda v: int(v).to_bytes(4, "little", signed=True)))))
  mutated, at = _apply(src, m)
  path = _write(tmp_path, "m.bin", mutated)
  got = _outcome(lambda: W.load_llama2c(path))
  if got is not None and at >= 28:
    assert got[0] == W.load_llama2c(files["llama2c"])[0]


def test_fuzz_oracle_can_fail():
  """The oracle lets a reader's own error through and stops anything else."""
  def own():
    raise errors.expected("x.bin", "3 bytes", "at least 28")
  assert _outcome(own) is None
  with pytest.raises(IndexError):
    _outcome(lambda: [][1])
