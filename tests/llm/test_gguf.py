"""llm.gguf and llm.gguf_vocab on small GGUF files written here with ggml's own `gguf.GGUFWriter`.

Weights: every supported type, the expected values from the gguf package's own
`gguf.quants.dequantize`, and q / k rows written the way llama.cpp's converter writes them
(its `permute`, reimplemented here) so that loading must undo it. Tokenizers: byte-level BPE
vocabularies trained with `tokenizers` (the GGUF copy must encode as the original does) and
SentencePiece vocabularies against llama2.c's run.c rules (`llm.tokenizer.Llama2cTokenizer`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import unicodedata

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")   # a main dependency; the reason names it where absent

from llm import gguf as G  # noqa: E402
from llm import gguf_vocab as GV  # noqa: E402
from llm import weights as W  # noqa: E402
from llm.config import LlamaConfig, RopeScaling  # noqa: E402
from llm.tokenizer import Llama2cTokenizer, load_tokenizer, write_llama2c_tokenizer  # noqa: E402
from tests.llm.test_tokenizer import _bin_pieces, _random_vocab, train_bpe  # noqa: E402

Q = gguf.GGMLQuantizationType
# Rows of 256 (K-quant super-blocks) everywhere: dim 256, 4 heads of 64, 2 KV heads, FFN 256.
# GGUF stores the RMS epsilon as float32, and the loader keeps that value (llama.cpp and
# transformers compute with it), so the config here uses a float32 one.
CFG = LlamaConfig(vocab_size=96, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=256,
                  head_dim=64, norm_eps=float(np.float32(1e-5)), rope_theta=10000.0,
                  max_seq_len=128)
_HF_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def converter_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: half-split rows -> interleaved."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _gguf_name(hf):
  if hf == "model.embed_tokens.weight":
    return "token_embd.weight"
  if hf == "model.norm.weight":
    return "output_norm.weight"
  if hf == "lm_head.weight":
    return "output.weight"
  _, _, i, rest = hf.split(".", 3)
  return f"blk.{i}.{_HF_TO_GGUF[rest.rsplit('.', 1)[0]]}.weight"


def _hf_weights(cfg, seed=0):
  """HF-layout ([out, in]) float32 tensors by HF name."""
  rng = np.random.default_rng(seed)
  out = {}
  for hf, contract in W._hf_names(cfg).items():
    shape = W._hf_shape(cfg, contract)
    out[hf] = (1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
               else 0.05 * rng.standard_normal(shape)).astype(np.float32)
  return out


def _random_blocks(qtype, rows, cols, rng):
  """Raw K-quant rows with random codes and small positive fp16 scales (d, dmin)."""
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  scales = rng.uniform(1e-3, 1e-2, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
  if qtype == Q.Q6_K:
    raw[..., size - 2:] = scales[..., :2]              # d at the end
  else:
    raw[..., :4] = scales.reshape(rows, cols // block, 4)   # d, dmin first
  return raw.reshape(rows, -1)


def write(path, cfg, hf, qtype="F32", arch="llama", meta=None, skip=(), extra=None, rng=None):
  """A GGUF of HF-layout tensors: q / k permuted as llama.cpp's converter does, matrices in
  `qtype` (K-quants: random blocks), norms F32. Returns {HF name: expected float32 [out, in]}."""
  rng = rng or np.random.default_rng(1)
  w = gguf.GGUFWriter(path, arch)
  base = {f"{arch}.{key}": value for key, value in {
      "context_length": cfg.max_seq_len, "embedding_length": cfg.dim,
      "block_count": cfg.n_layers, "feed_forward_length": cfg.ffn_dim,
      "attention.head_count": cfg.n_heads, "attention.head_count_kv": cfg.n_kv_heads,
      "rope.dimension_count": cfg.head_dim, "rope.freq_base": float(cfg.rope_theta),
      "attention.layer_norm_rms_epsilon": float(cfg.norm_eps)}.items()}
  for key, value in {**base, **(meta or {})}.items():   # `meta` replaces a key or adds one
    add = (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int)
           else w.add_float32 if isinstance(value, float)
           else w.add_array if isinstance(value, list) else w.add_string)
    add(key, value)
  expected = {}
  for name, a in hf.items():
    g = _gguf_name(name)
    if g in skip:
      continue
    heads = (cfg.n_heads if "q_proj" in name else cfg.n_kv_heads if "k_proj" in name else None)
    t = Q[qtype]
    if a.ndim == 1:
      expected[name] = a
      w.add_tensor(g, a)
      continue
    if t == Q.F32:
      raw = a
    elif t in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
      raw = _random_blocks(t, *a.shape, rng)
    else:
      raw = gguf.quants.quantize(a, t)
    expected[name] = gguf.quants.dequantize(raw, t).reshape(a.shape).astype(np.float32)
    if heads is not None:
      raw = converter_permute(raw, heads)      # whole rows move: blocks stay valid
    if t in (Q.F32, Q.F16):
      w.add_tensor(g, np.ascontiguousarray(raw))
    else:
      w.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=t)
  for g, a in (extra or {}).items():
    w.add_tensor(g, a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return expected


def _check_contract(cfg, weights, hf):
  """The contract's definition (llm/weights.py docstring) against HF-layout tensors."""
  d, h, g, k = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  np.testing.assert_array_equal(weights["embed"], hf["model.embed_tokens.weight"])
  np.testing.assert_array_equal(weights["final_norm"], hf["model.norm.weight"])
  for i in range(cfg.n_layers):
    p, q = f"layers.{i}.", f"model.layers.{i}."
    np.testing.assert_array_equal(weights[p + "wq"].reshape(d, h * k).T,
                                  hf[q + "self_attn.q_proj.weight"])
    np.testing.assert_array_equal(weights[p + "wk"].reshape(d, g * k).T,
                                  hf[q + "self_attn.k_proj.weight"])
    np.testing.assert_array_equal(weights[p + "wv"].reshape(d, g * k).T,
                                  hf[q + "self_attn.v_proj.weight"])
    np.testing.assert_array_equal(weights[p + "wo"].reshape(h * k, d).T,
                                  hf[q + "self_attn.o_proj.weight"])
    for c, n in (("w_gate", "mlp.gate_proj"), ("w_up", "mlp.up_proj"),
                 ("w_down", "mlp.down_proj")):
      np.testing.assert_array_equal(weights[p + c].T, hf[q + n + ".weight"])
    np.testing.assert_array_equal(weights[p + "attn_norm"], hf[q + "input_layernorm.weight"])
    np.testing.assert_array_equal(weights[p + "mlp_norm"],
                                  hf[q + "post_attention_layernorm.weight"])
  if not cfg.tie_embeddings:
    np.testing.assert_array_equal(weights["lm_head"].T, hf["lm_head.weight"])


@pytest.mark.parametrize("qtype", G.SUPPORTED_TYPES)
def test_every_type_against_gguf_dequantize(tmp_path, qtype):
  path = str(tmp_path / f"m.{qtype}.gguf")
  expected = write(path, CFG, _hf_weights(CFG), qtype)
  ckpt = G.read_gguf(path)
  assert ckpt.config == CFG
  assert {t.qtype for t in ckpt.tensors.values() if len(t.shape) == 2} == {qtype}
  _check_contract(CFG, ckpt.weights(), expected)
  if qtype != "F32":   # the permutation is really there: stored rows differ from the HF rows
    t = ckpt.tensors["layers.0.wq"]
    assert not np.array_equal(t.data, t.rows())


def test_model_logits_from_gguf_equal_hf_layout(tmp_path):
  """The loaded model against the same tensors loaded from a HF safetensors directory."""
  import jax
  from flax import nnx

  from llm import model as M
  cfg = CFG.replace(tie_embeddings=False, n_layers=2)
  hf = _hf_weights(cfg, seed=3)
  path = str(tmp_path / "m.gguf")
  write(path, cfg, hf)
  d = str(tmp_path / "hf")
  os.makedirs(d)
  from safetensors.numpy import save_file
  save_file(hf, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
  import json
  with open(os.path.join(d, "config.json"), "w") as fh:
    json.dump(W.config_to_hf(cfg), fh)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)

  def logits(loaded):
    m = M.Llama(loaded[0], nnx.Rngs(0))
    M.load_weights(m, loaded[1])
    with jax.default_matmul_precision("float32"):
      return np.asarray(m(tokens)[0])

  np.testing.assert_allclose(logits(G.load_gguf(path)), logits(W.load_hf(d)), rtol=1e-5,
                             atol=1e-5)


def test_rope_freqs_tensor_is_llama3_scaling(tmp_path):
  from llm.model import rope_frequencies
  scaling = RopeScaling(factor=32.0, original_max_position=64)   # short: factors vary here
  cfg = CFG.replace(rope_scaling=RopeScaling(factor=32.0))
  base = rope_frequencies(64, 10000.0, None).astype(np.float64)
  good = (base / rope_frequencies(64, 10000.0, RopeScaling(factor=32.0))).astype(np.float32)
  path = str(tmp_path / "m.gguf")
  write(path, cfg, _hf_weights(cfg), extra={"rope_freqs.weight": good})
  assert G.read_gguf(path).config == cfg
  other = (base / rope_frequencies(64, 10000.0, scaling)).astype(np.float32)
  write(path, cfg, _hf_weights(cfg), extra={"rope_freqs.weight": other})
  with pytest.raises(ValueError, match="rope_freqs.weight .* does not match Llama 3's RoPE"):
    G.read_gguf(path)
  write(path, cfg, _hf_weights(cfg), extra={"rope_freqs.weight": np.ones(32, np.float32)})
  assert G.read_gguf(path).config.rope_scaling is None


def _tensor_info_offset(path, name):
  data = open(path, "rb").read()
  at = data.index(name.encode()) + len(name)
  n_dims = int.from_bytes(data[at:at + 4], "little")
  return at + 4 + 8 * n_dims   # the uint32 type id follows the dims


def test_errors_name_file_tensor_and_key(tmp_path):
  hf = _hf_weights(CFG)
  path = str(tmp_path / "m.gguf")
  write(path, CFG, hf, arch="gemma")
  with pytest.raises(ValueError, match=f"{path}: general.architecture='gemma', an architecture "
                     "this loader does not read; expected one of 'llama'"):
    G.read_gguf(path)
  write(path, CFG, hf, "Q8_0")
  size = os.path.getsize(path)
  with open(path, "r+b") as fh:
    fh.truncate(size - 100)
  with pytest.raises(ValueError, match=rf"{path}: tensor 'output.weight' \(Q8_0, shape "
                     rf"\(96, 256\)\) needs bytes \[\d+, \d+\) but the file has {size - 100} "
                     "bytes: the file is truncated"):
    G.read_gguf(path)
  with open(path, "r+b") as fh:
    fh.truncate(200)
  with pytest.raises(ValueError, match=f"{path}: not a complete GGUF file"):
    G.read_gguf(path)
  write(path, CFG, hf, "Q8_0")
  at = _tensor_info_offset(path, "blk.0.attn_q.weight")
  with open(path, "r+b") as fh:
    fh.seek(at)
    fh.write((200).to_bytes(4, "little"))
  with pytest.raises(ValueError, match=f"{path}: tensor 'blk.0.attn_q.weight' has ggml type id "
                     "200, which gguf .* does not know; supported types: F32, F16, BF16, Q8_0"):
    G.read_gguf(path)
  write(path, CFG, hf, "Q5_0")
  with pytest.raises(ValueError, match=f"{path}: tensor '.*' is quantized as Q5_0; supported "
                     "types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"):
    G.read_gguf(path)
  for meta, match in (({"llama.expert_count": 8}, "llama.expert_count=8: a mixture of experts"),
                      ({"llama.attn_logit_softcapping": 4096},
                       r"metadata keys \['llama.attn_logit_softcapping'\] are not understood"),
                      ({"llama.rope.scaling.type": "longrope"},
                       "llama.rope.scaling.type='longrope'; supported: none, yarn"),
                      ({"llama.rope.scaling.type": "yarn"},
                       "missing metadata key llama.'rope.scaling.factor'")):
    write(path, CFG, hf, meta=meta)
    with pytest.raises(ValueError, match=f"{path}: {match}"):
      G.read_gguf(path)
  write(path, CFG, hf, extra={"blk.0.attn_q.bias": np.zeros(256, np.float32)})
  with pytest.raises(ValueError, match=f"{path}: unexpected tensor 'blk.0.attn_q.bias'"):
    G.read_gguf(path)
  write(path, CFG, hf, skip=("blk.0.ffn_up.weight",))
  with pytest.raises(ValueError, match=f"{path}: missing tensor 'blk.0.ffn_up.weight'"):
    G.read_gguf(path)
  bad = dict(hf)
  bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:128]
  write(path, CFG, bad)
  with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has shape \(128, 256\) "
                     r"\(rows, cols\), expected \(256, 256\)"):
    G.read_gguf(path)
  nan = dict(hf)
  nan["model.layers.0.mlp.up_proj.weight"] = nan["model.layers.0.mlp.up_proj.weight"].copy()
  nan["model.layers.0.mlp.up_proj.weight"][3, 5] = np.inf
  write(path, CFG, nan)
  with pytest.raises(ValueError, match="tensor 'blk.0.ffn_up.weight' .* non-finite"):
    G.read_gguf(path).weights()
  with pytest.raises(FileNotFoundError, match="no such GGUF file"):
    G.read_gguf(str(tmp_path / "absent.gguf"))


@pytest.mark.parametrize("meta,extra,match", [
    ({"llama.attention.head_count_kv": [2, 1]}, None,
     r"llama.attention.head_count_kv varies by layer \(\[2, 1\]\); expected one value"),
    ({"llama.attention.head_count_kv": 3}, None, "metadata llama.attention.head_count_kv=3; "
     "expected an integer >= 1 that divides head_count=4"),
    ({"llama.attention.key_length": 63}, None, r"head dim 63 \(embedding_length=256, "
     r"head_count=4, key_length\); expected an even number >= 2"),
    ({"llama.attention.value_length": 32}, None, "key_length=64, value_length=32, "
     r"rope.dimension_count=64; expected all equal"),
    ({"llama.rope.freq_base": 1.0}, None, "metadata llama.rope.freq_base=1.0, llama.attention."
     "layer_norm_rms_epsilon=.*; expected a RoPE base > 1 and an epsilon > 0"),
    ({"split.count": 2}, None, "split.count=2: one file of a split GGUF; merge the parts"),
    ({"llama.attention.sliding_window": 4, "llama.attention.sliding_window_pattern": [False]},
     None, "metadata llama.attention.sliding_window_pattern all false; expected no "
     "attention.sliding_window"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 64}, {"rope_freqs.weight": np.ones(32,
                                                                                 np.float32)},
     "both llama.rope.scaling.type='yarn' and a rope_freqs.weight tensor; expected one"),
    (None, {"rope_freqs.weight": np.ones(16, np.float32)},
     "rope_freqs.weight has 16 entries, expected head_dim / 2 = 32"),
    (None, {"rope_freqs.weight": np.ones(32, np.float64)},
     "tensor 'rope_freqs.weight' is stored as F64; supported types: F32, F16"),
    # llama.cpp reads a factor without a type as linear scaling (its default type).
    ({"llama.rope.scaling.factor": 4.0}, None, "metadata llama.rope.scaling.factor=4.0 without "
     "llama.rope.scaling.type, which llama.cpp runs as linear RoPE scaling"),
])
def test_config_metadata_errors_name_the_key(tmp_path, meta, extra, match):
  path = str(tmp_path / "m.gguf")
  write(path, CFG, _hf_weights(CFG), meta=meta, extra=extra)
  with pytest.raises(ValueError, match=f"^{path}: {match}"):
    G.read_gguf(path)


def test_a_rope_factor_llama_cpp_ignores_is_ignored(tmp_path):
  # llama.cpp: type "none" never scales, and a factor of 0 or 1 is no scaling.
  path = str(tmp_path / "m.gguf")
  for meta in ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0},
               {"llama.rope.scaling.factor": 1.0}, {"llama.rope.scaling.factor": 0.0}):
    write(path, CFG, _hf_weights(CFG), meta=meta)
    assert G.read_gguf(path).config == CFG, meta


def test_per_layer_metadata_and_a_flat_embedding(tmp_path):
  path = str(tmp_path / "m.gguf")
  hf = _hf_weights(CFG)
  write(path, CFG, hf, meta={"llama.attention.head_count_kv": [2]})   # one value per layer
  assert G.read_gguf(path).config == CFG
  flat = hf["model.embed_tokens.weight"].reshape(-1)
  write(path, CFG, hf, skip=("token_embd.weight",), extra={"token_embd.weight": flat})
  with pytest.raises(ValueError, match=rf"{path}: token_embd.weight has shape \[24576\] and "
                     "there is no llama.vocab_size; expected a 2-d embedding"):
    G.read_gguf(path)


def test_one_pass_arrays_equal_the_packages_reader(tmp_path):
  """The reader's one-pass array parsing gives the fields gguf.GGUFReader gives, and arrays
  it does not parse itself (nested) take the package's path."""
  path = str(tmp_path / "m.gguf")
  write(path, CFG, _hf_weights(CFG), meta={
      "general.tags": ["a", "bc", ""], "general.ints": [3, 1, 4], "general.floats": [0.5, 2.0],
      "general.bools": [True, False], "general.nested": [[1, 2], [3]]})
  ours, theirs = G._reader(path), gguf.GGUFReader(path)
  assert list(ours.fields) == list(theirs.fields)
  for key, f in theirs.fields.items():
    g = ours.fields[key]
    assert g.types == f.types and g.data == f.data and g.offset == f.offset, key
    assert len(g.parts) == len(f.parts), key
    for a, b in zip(g.parts, f.parts):
      np.testing.assert_array_equal(a, b)
    assert g.contents() == f.contents(), key
  assert ours.fields["general.tags"].contents() == ["a", "bc", ""]
  assert ours.fields["general.floats"].contents() == [0.5, 2.0]


# ---------------------------------------------------------------------------------------------
# Tokenizers

TEXTS = ["Once upon a time, there was a little girl named Lily.", "  two  spaces\n\nand\ttab ",
         "digits 1234567 and 3.14", "ünïcödé wörds 🦙 ok", "<s>special</s> inline", "", "a"]


def _write_vocab_only(path, cfg, vocab):
  w = gguf.GGUFWriter(path, "llama")
  G._add_vocab(w, vocab)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  r = G._reader(path)
  return G._vocab(r)


def _bpe_vocab(tok_json_path, pre):
  """A tokenizer.json's byte-level BPE as GGUF gpt2 metadata (what convert_hf_to_gguf writes)."""
  import json
  d = json.load(open(tok_json_path))
  vocab = dict(d["model"]["vocab"])
  specials = {t["content"]: t["id"] for t in d["added_tokens"]}
  vocab.update(specials)
  tokens = [None] * len(vocab)
  for t, i in vocab.items():
    tokens[i] = t
  merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
  types = [3 if t in specials else 1 for t in tokens]
  return GV.GGUFVocab(model="gpt2", tokens=tokens, token_types=types, merges=merges, pre=pre,
                     bos_id=specials.get("<s>"), eos_id=specials.get("</s>"))


@pytest.mark.parametrize("pre,pretok", [
    ("gpt-2", None),
    ("smollm", "digits"),
    ("llama-bpe", "llama3"),
    ("qwen2", "qwen2"),
])
def test_gpt2_vocab_encodes_as_the_original(tmp_path, pre, pretok):
  """A byte-level BPE written as GGUF gpt2 metadata encodes as the tokenizer.json it came from
  with the pre-tokenizer `tokenizer.ggml.pre` names (Qwen2's: transformers' Qwen2Tokenizer
  layout, NFC then its regex; `nfd` is a decomposed é, which NFC composes)."""
  from tokenizers import Regex, normalizers, pre_tokenizers
  from tokenizers import Tokenizer as HFTok
  path = train_bpe(str(tmp_path / "t"))
  ref = HFTok.from_file(path)
  regex = {"llama3": GV._LLAMA3_REGEX, "qwen2": GV._QWEN2_REGEX}.get(pretok)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
  if pretok == "digits":
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 byte_level])
  elif regex is not None:   # Llama 3's / Qwen2's tokenizer.json
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(
        Regex(regex), behavior="isolated"), byte_level])
  if pretok == "qwen2":
    ref.normalizer = normalizers.NFC()
  v = _write_vocab_only(str(tmp_path / "v.gguf"), CFG, _bpe_vocab(path, pre))
  tok = GV.vocab_tokenizer(v, "v.gguf")
  nfd = "cafe\u0301 1999"
  for text in TEXTS + [nfd]:
    want = ref.encode(text, add_special_tokens=False).ids
    if pretok == "llama3":   # ignore_merges: a pre-token in the vocabulary is one token
      assert tok.encode(text) == tok.tokenizers.encode(text, add_special_tokens=False).ids
    else:
      assert tok.encode(text) == want, text
    back = text.replace("<s>", "").replace("</s>", "")
    assert tok.decode(tok.encode(text)) == (unicodedata.normalize("NFC", back)
                                            if pretok == "qwen2" else back)
  assert "<s>" not in tok.decode(tok.encode("<s>x"), skip_special=True)
  assert tok.encode("<s>x")[0] == tok.bos_id == 1     # specials in text become their ids
  assert tok.add_bos == (pre == "llama-bpe") and not tok.add_eos   # llama.cpp's defaults
  if pretok in ("llama3", "qwen2"):
    # The two regexes differ on digits (Qwen2: one each; Llama 3: up to three together).
    other = GV.vocab_tokenizer(dataclasses.replace(v, pre="qwen2" if pretok == "llama3"
                                                   else "llama-bpe"), "v.gguf")
    split = lambda t: [p for p, _ in t.tokenizers.pre_tokenizer.pre_tokenize_str("in 1999")]  # noqa
    qwen2, llama3 = (split(tok), split(other))[::1 if pretok == "qwen2" else -1]
    assert (qwen2, llama3) == (["in", "Ġ", "1", "9", "9", "9"], ["in", "Ġ", "199", "9"])
  v.add_bos = True
  assert GV.vocab_tokenizer(v, "v.gguf").add_bos
  v.pre = "deepseek-coder"
  with pytest.raises(ValueError, match="v.gguf: tokenizer.ggml.pre='deepseek-coder'; supported "
                     "pre-tokenizers: default, gpt-2, smollm, .*, qwen2, deepseek-r1-qwen"):
    GV.vocab_tokenizer(v, "v.gguf")
  v.pre, v.model = "gpt-2", "bert"
  with pytest.raises(ValueError, match="tokenizer.ggml.model='bert'; supported: 'gpt2'"):
    GV.vocab_tokenizer(v, "v.gguf")


def test_gpt2_added_tokens_decode_as_written(tmp_path):
  """llama.cpp writes user-defined and control tokens' text as it is (convert_hf_to_gguf stores
  them so); through the ByteLevel decoder "é" (a byte-level character) would become byte 0xE9
  and the text "\ufffdt\ufffd". Recorded from llama-cpp-python 0.3.36 on these tokens:
  "un été chaud" and "c<ctrlé>d" with special=True."""
  v = _bpe_vocab(train_bpe(str(tmp_path / "t")), "gpt-2")
  n = len(v.tokens)
  v.tokens += ["été", "<ctrlé>", "<think>"]
  v.token_types += [4, 3, 4]
  tok = GV.vocab_tokenizer(v, "v.gguf")
  ids = tok.encode("un été chaud")
  assert n in ids and tok.decode(ids) == "un été chaud"
  ids = tok.encode("c<ctrlé>d<think>")
  assert ids[1] == n + 1 and ids[-1] == n + 2
  assert tok.decode(ids) == "cd<think>"                          # control tokens skipped
  assert tok.decode(ids, skip_special=False) == "c<ctrlé>d<think>"
  assert tok.decode(tok.encode("é\u00e9é")) == "ééé"             # normal tokens as before


def test_llama_vocab_without_space_prefix_keeps_leading_spaces(tmp_path):
  """add_space_prefix=false (Gemma's files): no "▁" is put before the text, so none is taken
  off its decoding; the decoder stripped the text's own leading space (" ab" -> "ab").
  llama.cpp (llama-cpp-python 0.3.36, without BOS) and transformers' Gemma decoder keep it."""
  bin_path = str(tmp_path / "tok.bin")
  write_llama2c_tokenizer(bin_path, *_bin_pieces({" ": -1.0, "a": -2.0, "b": -3.0, " a": -4.0,
                                                  "ab": -5.0}))
  v = GV.vocab_from_llama2c(Llama2cTokenizer(bin_path))
  v.add_space_prefix = False
  tok = GV.vocab_tokenizer(v, "v.gguf")
  for text in (" ab", "  a b", "ab", "\n a"):
    assert tok.decode(tok.encode(text)) == text
  assert tok.tokenizers.id_to_token(tok.encode(" ab")[0]) == "▁a"   # the text's own space
  assert tok.tokenizers.id_to_token(tok.encode("ab")[0]) == "ab"     # and no other
  v.add_space_prefix = True
  assert GV.vocab_tokenizer(v, "v.gguf").decode(tok.encode(" ab")) == "ab"   # the prefix's


def test_vocab_tokens_must_be_distinct(tmp_path):
  """A repeated token is refused: it would lose its id in the tokenizer (the vocabulary one
  short, the id decoding to nothing); llama.cpp aborts on such a file. An empty token is llama.cpp's
  "[EMPTY_<id>]"."""
  v = _bpe_vocab(train_bpe(str(tmp_path / "t")), "gpt-2")
  n = len(v.tokens)
  with pytest.raises(ValueError, match=f"v.gguf: tokenizer.ggml.tokens 1 and {n} are both "
                     "'<s>'; expected distinct tokens"):
    GV.vocab_tokenizer(dataclasses.replace(v, tokens=v.tokens + ["<s>"],
                                           token_types=v.token_types + [3]), "v.gguf")
  tok = GV.vocab_tokenizer(dataclasses.replace(v, tokens=v.tokens + ["", ""],
                                               token_types=v.token_types + [4, 4]), "v.gguf")
  assert tok.vocab_size == n + 2 and tok.decode([n + 1]) == f"[EMPTY_{n + 1}]"


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_vocab_encodes_as_run_c(tmp_path, seed):
  """SentencePiece vocabularies: the GGUF tokenizer (tokenizers' BPE, merges by score) against
  llama2.c's run.c rules on random vocabularies and texts (byte fallback included)."""
  rng = random.Random(seed)
  alphabet = "abcde fgh.é"
  vocab = _random_vocab(rng, alphabet.replace(" ", "▁"), 120)
  bin_path = str(tmp_path / "tok.bin")
  write_llama2c_tokenizer(bin_path, *_bin_pieces({p.replace("▁", " "): s
                                                  for p, s in vocab.items()}))
  ref = Llama2cTokenizer(bin_path)
  v = _write_vocab_only(str(tmp_path / "v.gguf"), CFG, GV.vocab_from_llama2c(ref))
  tok = GV.vocab_tokenizer(v, "v.gguf")
  assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
  for _ in range(200):
    text = "".join(rng.choice(alphabet + "xyz€\n") for _ in range(rng.randint(1, 50)))
    assert tok.encode(text, bos=tok.add_bos) == ref.encode(text, bos=True), text
    assert tok.decode(ref.encode(text, bos=True)) == text


# ---------------------------------------------------------------------------------------------
# Export


@pytest.mark.parametrize("qtype", G.EXPORT_TYPES)
@pytest.mark.parametrize("tied", [True, False])
def test_save_gguf_round_trip(tmp_path, qtype, tied):
  cfg = CFG.replace(tie_embeddings=tied, n_layers=2, vocab_size=264,
                    rope_scaling=RopeScaling(factor=8.0) if tied else None)
  hf = _hf_weights(cfg, seed=5)
  contract = {c: W._to_contract(cfg, c, hf[n]) for n, c in W._hf_names(cfg).items()}
  path = str(tmp_path / "out.gguf")
  bin_path = str(tmp_path / "tok.bin")
  write_llama2c_tokenizer(bin_path, *_bin_pieces({" ": -1.0, "a": -2.0, "b": -3.0, " a": -4.0,
                                                        "ab": -5.0}))
  src_tok = Llama2cTokenizer(bin_path)
  G.save_gguf(path, cfg, contract, qtype=qtype, vocab=GV.vocab_from_llama2c(src_tok))
  ckpt = G.read_gguf(path)
  assert ckpt.config == cfg
  r = gguf.GGUFReader(path)   # what llama.cpp sees: its names, types, interleaved q / k rows
  types = {t.name: t.tensor_type.name for t in r.tensors}
  assert types["blk.0.attn_norm.weight"] == "F32" and types["token_embd.weight"] == qtype
  assert ("rope_freqs.weight" in types) == tied and ("output.weight" in types) == (not tied)
  q_raw = next(t for t in r.tensors if t.name == "blk.1.attn_q.weight")
  want = {"F32": lambda a: a, "F16": lambda a: a.astype(np.float16).astype(np.float32),
          "Q8_0": lambda a: gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0)}[qtype]
  np.testing.assert_array_equal(
      gguf.quants.dequantize(q_raw.data, q_raw.tensor_type).reshape(256, 256),
      want(converter_permute(hf["model.layers.1.self_attn.q_proj.weight"], cfg.n_heads)))
  _check_contract(cfg, ckpt.weights(), {n: (want(a) if a.ndim == 2 else a) for n, a in hf.items()})
  tok = ckpt.tokenizer()
  for text in ("ab a", "b a ab", "é"):
    assert tok.encode(text, bos=tok.add_bos) == src_tok.encode(text, bos=True)


def test_save_gguf_refuses(tmp_path):
  with pytest.raises(ValueError, match=r"qtype='Q4_1', expected one of \('F32', 'F16', 'Q8_0'\)"):
    G.save_gguf(str(tmp_path / "x.gguf"), CFG, {}, qtype="Q4_1")
  with pytest.raises(ValueError, match="missing parameters"):
    G.save_gguf(str(tmp_path / "x.gguf"), CFG, {"embed": np.zeros((96, 256))})


def test_save_gguf_f16_refuses_values_float16_cannot_hold(tmp_path):
  """F16 (export's default) turns 70000 (> 65504) into an Inf: refused naming the tensor;
  Q8_0 (scale amax / 127 in float16) and F32 hold it."""
  w = {n: np.full(s, 0.5, np.float32) for n, s in W.param_shapes(CFG).items()}
  w["layers.0.w_down"][3, 5] = 7e4
  path = str(tmp_path / "x.gguf")
  with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_down\.weight' \(256, 256\) holds "
                     r"values up to 70000 in magnitude, which float16 cannot hold"):
    G.save_gguf(path, CFG, w, qtype="F16")
  assert not os.path.exists(path)
  G.save_gguf(path, CFG, w, qtype="Q8_0")
  np.testing.assert_allclose(G.read_gguf(path).weights()["layers.0.w_down"][3, 5], 7e4,
                             rtol=2 ** -11)   # the Q8_0 scale's float16 rounding


def test_save_gguf_head_dim_padding_and_chat_template(tmp_path):
  """A head dim other than dim / heads is written as key / value length; a vocabulary shorter
  than the embedding is padded with unused [PAD<id>] tokens (llama.cpp needs one token per
  row); the chat template travels; YaRN settings GGUF cannot hold are refused."""
  from llm.config import YarnScaling
  cfg = CFG.replace(head_dim=32, vocab_size=270, n_layers=2)
  hf = _hf_weights(cfg, seed=2)
  w = {c: W._to_contract(cfg, c, hf[n]) for n, c in W._hf_names(cfg).items()}
  bin_path = str(tmp_path / "tok.bin")
  write_llama2c_tokenizer(bin_path, *_bin_pieces({" ": -1.0, "a": -2.0, "b": -3.0}))
  vocab = dataclasses.replace(GV.vocab_from_llama2c(Llama2cTokenizer(bin_path)),
                              chat_template="{{ messages[0]['content'] }}")
  n = len(vocab.tokens)
  assert n < 270
  path = G.save_gguf(str(tmp_path / "m.gguf"), cfg, w, qtype="F32", vocab=vocab)
  ckpt = G.read_gguf(path)
  assert ckpt.config == cfg
  r = gguf.GGUFReader(path)
  assert r.fields["llama.attention.key_length"].contents() == 32
  assert r.fields["llama.attention.value_length"].contents() == 32
  v = ckpt.vocab
  assert v.tokens[:n] == vocab.tokens and v.tokens[n:] == [f"[PAD{i}]" for i in range(n, 270)]
  assert list(v.token_types[n:]) == [5] * (270 - n) and list(v.scores[n:]) == [-1000.0] * (270 - n)
  assert ckpt.tokenizer().chat_template == "{{ messages[0]['content'] }}"
  got = ckpt.weights()
  for k in w:
    np.testing.assert_array_equal(got[k], w[k])
  with pytest.raises(ValueError, match=r"save_gguf\(.*x.gguf\): 270 vocabulary tokens, more "
                     "than the model's 100 embedding rows"):
    G.save_gguf(str(tmp_path / "x.gguf"), cfg.replace(vocab_size=100),
                {**w, "embed": w["embed"][:100], "lm_head": w["lm_head"][:, :100]}, "F32",
                vocab=v)
  yarn = cfg.replace(rope_scaling=YarnScaling(4.0, 64, attention_factor=1.2))
  with pytest.raises(ValueError, match=r"save_gguf\(.*x.gguf\): YarnScaling\(factor=4.0.*; "
                     "expected YaRN with the default attention factor and truncate=True"):
    G.save_gguf(str(tmp_path / "x.gguf"), yarn, w, "F32")


def test_hf_tokenizer_dir_still_loads(tmp_path):
  """load_tokenizer is untouched by the GGUF path (a smoke check of the shared class)."""
  path = train_bpe(str(tmp_path / "a"), config={"bos_token": "<s>", "eos_token": "</s>"})
  tok = load_tokenizer(path)
  assert not tok.add_bos and tok.chat_template is None


def test_save_gguf_closes_the_file_when_a_write_fails(tmp_path, monkeypatch):
  import gguf
  opened = []
  real_open = gguf.GGUFWriter.open_output_file

  def record(self, *a, **k):
    real_open(self, *a, **k)
    opened.extend(self.fout)

  def fail(self, *a, **k):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(gguf.GGUFWriter, "open_output_file", record)
  monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
  w = {n: np.zeros(s, np.float32) for n, s in W.param_shapes(CFG).items()}
  with pytest.raises(OSError, match="No space left"):
    G.save_gguf(str(tmp_path / "x.gguf"), CFG, w, qtype="F32")
  assert opened and all(f.closed for f in opened)
