"""Qwen2 / Qwen2.5 and Mistral as options of the one model (`qkv_bias`, `sliding_window`):
the forward pass against an independent float64 numpy model that adds the biases and builds
the window mask explicitly, prefill + decode over the KV cache against the full forward,
EAGLE greedy against plain greedy, HF and GGUF round trips (and a GGUF laid out as
llama.cpp's Qwen2 converter writes it), configs in the published layouts, and the one-line
refusals. transformers itself is the peer of tests/llm/test_families_peer.py (marker peer).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm import generate as G
from llm import gguf as GG
from llm import model as M
from llm import weights as W
from llm.config import LlamaConfig, family, get_config
from llm.speculative import DraftHead, TreeShape, speculative_generate
from tests.llm.test_model import meta_rope_freqs, random_weights
from tests.llm.test_reader_errors import _line

QWEN2 = get_config("tiny_qwen2", vocab_size=32)        # biases, tied, RoPE base 1e6
MISTRAL = get_config("tiny_mistral", vocab_size=32)    # window 8, untied
# Both options at once (Qwen2 with use_sliding_window in every layer), window 4: the cache
# and speculative tests cover the bias and the window in one compiled program each.
BOTH = QWEN2.replace(sliding_window=4, tie_embeddings=False)


def family_weights(cfg, seed=0) -> dict[str, np.ndarray]:
  """`random_weights` plus q / k / v biases of 0.3 N(0, 1) when the config has them."""
  w = random_weights(cfg, seed)
  rng = np.random.default_rng(seed + 100)
  for name, shape in W.param_shapes(cfg).items():
    if name.rsplit(".", 1)[-1] in ("bq", "bk", "bv"):
      w[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
  return w


def make(cfg, seed=0):
  model = nnx.eval_shape(lambda: M.Llama(cfg, nnx.Rngs(seed)))
  w = family_weights(cfg, seed)
  M.load_weights(model, w)
  return model, w


def np_forward(w, cfg, tokens, positions, segment_ids, window=None):
  """float64 decoder in transformers' formulation (rotate_half, repeat_kv), q / k / v biases
  before RoPE; query t sees key s iff same segment, pos_s <= pos_t and, with a window,
  pos_t - pos_s < window (transformers' `kv_idx > q_idx - sliding_window`), the mask built
  pair by pair."""
  b, t = tokens.shape
  f64 = lambda key: np.asarray(w[key], np.float64)  # noqa: E731
  rms = lambda x, s: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * s  # noqa
  ang = positions[..., None] * meta_rope_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  cos = np.concatenate([np.cos(ang)] * 2, -1)[:, :, None]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[:, :, None]

  def rope(x):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

  mask = np.zeros((b, t, t), bool)
  for r in range(b):
    for i in range(t):
      for j in range(t):
        seen = segment_ids[r, j] == segment_ids[r, i] and positions[r, j] <= positions[r, i]
        mask[r, i, j] = seen and (window is None or positions[r, i] - positions[r, j] < window)
  rep = cfg.n_heads // cfg.n_kv_heads
  x = f64("embed")[tokens]
  for i in range(cfg.n_layers):
    p = f"layers.{i}."
    bias = lambda n: f64(p + n) if cfg.qkv_bias else 0.0  # noqa: E731
    h = rms(x, f64(p + "attn_norm"))
    q = rope(np.einsum("btd,dhk->bthk", h, f64(p + "wq")) + bias("bq"))
    k = np.repeat(rope(np.einsum("btd,dgk->btgk", h, f64(p + "wk")) + bias("bk")), rep, 2)
    v = np.repeat(np.einsum("btd,dgk->btgk", h, f64(p + "wv")) + bias("bv"), rep, 2)
    s = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(cfg.head_dim)
    s = np.where(mask[:, None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    x = x + np.einsum("bhts,bshk,hkd->btd", a / a.sum(-1, keepdims=True), v, f64(p + "wo"))
    h = rms(x, f64(p + "mlp_norm"))
    g = h @ f64(p + "w_gate")
    x = x + (g / (1 + np.exp(-g)) * (h @ f64(p + "w_up"))) @ f64(p + "w_down")
  x = rms(x, f64("final_norm"))
  return x @ (f64("embed").T if cfg.tie_embeddings else f64("lm_head"))


@nnx.jit
def _forward(model, tokens, positions, segment_ids):
  return model(tokens, positions_BT=positions, segment_ids_BT=segment_ids)[0]


@nnx.jit
def _cached(model, tokens, cache):
  return model(tokens, cache=cache)


def _tokens(cfg, b, t, seed=1):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)


# --- the model against the float64 reference

@pytest.mark.parametrize("cfg", [QWEN2, MISTRAL.replace(sliding_window=4)],
                         ids=["qwen2_bias_tied", "mistral_window4"])
def test_forward_matches_numpy_reference(cfg):
  """Row 0: two packed segments (positions restart), row 1: positions 100.. (the window
  moves with the positions, not the slots). Tolerance 1e-4 on logits of order 3: float32
  against float64 through two layers (observed ~1e-6)."""
  model, w = make(cfg)
  tokens = _tokens(cfg, 2, 12)
  seg = np.array([[1] * 5 + [2] * 7, [1] * 12])
  pos = np.array([list(range(5)) + list(range(7)), list(range(100, 112))])
  with jax.default_matmul_precision("float32"):
    got = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(pos, jnp.int32),
                              jnp.asarray(seg, jnp.int32)))
  want = np_forward(w, cfg, tokens, pos, seg, cfg.sliding_window)
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  if cfg.sliding_window is not None:
    # The window bites: without it, every query past it would see more keys.
    full = np_forward(w, cfg, tokens, pos, seg, None)
    np.testing.assert_allclose(full[:, :4], want[:, :4], rtol=1e-9, atol=1e-9)
    assert np.abs(full[1, 4:] - want[1, 4:]).min(axis=-1).max() > 1e-3
  else:
    # The biases matter: the same weights without them give other logits.
    plain = cfg.replace(qkv_bias=False)
    no_bias = {k: v for k, v in w.items() if k.rsplit(".", 1)[-1] not in ("bq", "bk", "bv")}
    assert np.abs(np_forward(no_bias, plain, tokens, pos, seg) - want).max() > 1e-2


def test_sliding_window_mask_is_the_rule():
  """`sliding_window_mask` against pairs enumerated one by one; None where it cannot bite."""
  q = np.array([[0, 5, 9], [3, 3, 40]])
  kv = np.array([[0, 1, 5, 6, 9, 2 ** 30], [0, 1, 2, 3, 37, 38]])
  got = np.asarray(M.sliding_window_mask(jnp.asarray(q), jnp.asarray(kv), 4, 2, 3, 6))
  want = np.array([[[kv[r, s] > q[r, t] - 4 for s in range(6)] for t in range(3)]
                   for r in range(2)])
  np.testing.assert_array_equal(got, want)
  assert M.sliding_window_mask(None, None, 4, 2, 4, 4) is None      # T <= W from 0
  assert M.sliding_window_mask(None, None, None, 2, 9, 9) is None
  assert M.sliding_window_mask(None, None, 4, 1, 5, 5).shape == (1, 5, 5)


# --- KV cache and decoding

def test_prefill_and_decode_over_the_cache_equal_the_full_forward():
  """Bias and window (4) together: a prefill of 6, then single steps to 14 tokens (the
  window slides over the cache), each against the full forward's logits. Tolerance 1e-5 on
  logits of order 3: the same float32 products in another grouping (cache slots vs the
  call's keys; observed ~1e-6)."""
  model, _ = make(BOTH)
  tokens = _tokens(BOTH, 2, 14)
  pos = np.broadcast_to(np.arange(14), (2, 14))
  full = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(pos, jnp.int32),
                             jnp.ones((2, 14), jnp.int32)))
  cache = model.init_cache(2, 16)
  got = []
  for a, b in [(0, 6)] + [(t, t + 1) for t in range(6, 14)]:
    logits, cache = _cached(model, jnp.asarray(tokens[:, a:b]), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, 1), full, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(cache.length, [14, 14])


def test_generate_and_eagle_greedy_equal_the_full_forward_argmax():
  """Ragged prompts (4 and 9 tokens; window 4) through `generate` (prefill with fresh_cache,
  then decode) and through EAGLE draft-tree verification (an untrained head: drafts are
  mostly rejected, yet every round's bonus and accepted tokens are the target's): the same
  tokens, each the full forward's argmax after the tokens before it (one layer: the
  speculative program is the costly compile here)."""
  cfg = BOTH.replace(vocab_size=8, n_layers=1)
  model, _ = make(cfg, seed=3)
  prompts = [[1, 2, 3, 4], [7, 0, 5, 5, 6, 1, 2, 3, 0]]
  n_new = 10
  plain = G.generate(model, prompts, n_new)
  seqs = np.zeros((2, 19), np.int32)
  seg = np.zeros((2, 19), np.int32)            # segment 0: right padding, seen by nothing
  for r, (p, new) in enumerate(zip(prompts, plain)):
    seqs[r, :len(p) + n_new], seg[r, :len(p) + n_new] = p + new, 1
  logits = np.asarray(_forward(model, jnp.asarray(seqs), jnp.broadcast_to(
      jnp.arange(19, dtype=jnp.int32), (2, 19)), jnp.asarray(seg)))
  for r, (p, new) in enumerate(zip(prompts, plain)):
    np.testing.assert_array_equal(logits[r, len(p) - 1:len(p) + n_new - 1].argmax(-1), new)
  # A random head without an init program to compile: its abstract state filled from numpy.
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DraftHead(cfg, nnx.Rngs(5))))
  rng = np.random.default_rng(5)
  draft = nnx.merge(graphdef, jax.tree.map(
      lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype), abstract))
  # Two sibling drafts per round (depth 1: the cheapest tree program to compile): each sees
  # the cached prefix through the window and not its sibling.
  out = speculative_generate(model, draft, prompts, n_new, shape=TreeShape(2, 1, 2))
  assert out.tokens == plain


# --- files

def _round_trip_hf(tmp_path, cfg):
  w = family_weights(cfg)
  d = str(tmp_path / f"hf_{family(cfg)}_{cfg.tie_embeddings}_{cfg.sliding_window}")
  W.save_hf(d, cfg, w)
  with open(os.path.join(d, "config.json")) as f:
    hf = json.load(f)
  got_cfg, got = W.load_hf(d)
  assert got_cfg == cfg and set(got) == set(w)
  for k in w:
    np.testing.assert_array_equal(got[k], w[k])
  return hf


def test_hf_round_trip_writes_each_family(tmp_path):
  hf = _round_trip_hf(tmp_path, QWEN2)
  assert (hf["architectures"], hf["model_type"], hf["use_sliding_window"],
          hf["tie_word_embeddings"]) == (["Qwen2ForCausalLM"], "qwen2", False, True)
  from safetensors import safe_open
  with safe_open(os.path.join(tmp_path, "hf_qwen2_True_None", "model.safetensors"), "np") as f:
    assert f.get_tensor("model.layers.1.self_attn.k_proj.bias").shape == (32,)
  hf = _round_trip_hf(tmp_path, BOTH)
  assert (hf["use_sliding_window"], hf["sliding_window"], hf["max_window_layers"],
          hf["layer_types"]) == (True, 4, 0, ["sliding_attention"] * 2)
  hf = _round_trip_hf(tmp_path, MISTRAL)
  assert (hf["architectures"], hf["sliding_window"]) == (["MistralForCausalLM"], 8)
  assert "use_sliding_window" not in hf and "attention_bias" not in hf
  hf = _round_trip_hf(tmp_path, MISTRAL.replace(sliding_window=None))
  assert hf["model_type"] == "llama"      # a Mistral without a window is Llama's arithmetic


def _write_llamacpp_qwen2(path, cfg, w):
  """A GGUF as llama.cpp's Qwen2 converter lays it out: arch qwen2, HF rows as they are (no
  q / k permutation: NEOX RoPE), blk.N.attn_q.bias etc., no output.weight when tied."""
  gguf = pytest.importorskip("gguf")
  out = gguf.GGUFWriter(path, "qwen2")
  for key, value in {"context_length": cfg.max_seq_len, "embedding_length": cfg.dim,
                     "block_count": cfg.n_layers, "feed_forward_length": cfg.ffn_dim,
                     "attention.head_count": cfg.n_heads,
                     "attention.head_count_kv": cfg.n_kv_heads}.items():
    out.add_uint32(f"qwen2.{key}", value)
  out.add_float32("qwen2.rope.freq_base", cfg.rope_theta)
  out.add_float32("qwen2.attention.layer_norm_rms_epsilon", cfg.norm_eps)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
  parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for hf_name, contract in W._hf_names(cfg).items():
    a = np.asarray(W._from_contract(contract, w[contract]), np.float32)
    if hf_name not in names:
      _, _, i, rest = hf_name.split(".", 3)
      module, kind = rest.rsplit(".", 1)
      names[hf_name] = f"blk.{i}.{parts[module]}.{kind}"
    out.add_tensor(names[hf_name], np.ascontiguousarray(a))
  out.write_header_to_file()
  out.write_kv_data_to_file()
  out.write_tensors_to_file()
  out.close()


def test_gguf_reads_llamacpp_qwen2_and_round_trips_each_family(tmp_path):
  cfg = QWEN2.replace(norm_eps=float(np.float32(1e-6)))   # GGUF stores it as float32
  w = family_weights(cfg)
  path = str(tmp_path / "q.gguf")
  _write_llamacpp_qwen2(path, cfg, w)
  ckpt = GG.read_gguf(path)
  assert ckpt.arch == "qwen2" and ckpt.config == cfg.replace(max_seq_len=cfg.max_seq_len)
  got = ckpt.weights()
  assert set(got) == set(w)
  for k in w:
    np.testing.assert_array_equal(got[k], w[k])
  for c in (cfg, BOTH.replace(norm_eps=cfg.norm_eps),
            MISTRAL.replace(norm_eps=float(np.float32(1e-5)))):
    w = family_weights(c)
    path = str(tmp_path / f"{family(c)}_{c.sliding_window}.gguf")
    GG.save_gguf(path, c, w, "F32")
    ckpt = GG.read_gguf(path)
    assert ckpt.arch == ("qwen2" if c.qkv_bias else "llama") and ckpt.config == c
    got = ckpt.weights()
    for k in w:
      np.testing.assert_allclose(got[k], w[k], rtol=0, atol=0)


# Configs in the layouts the published checkpoints use (transformers 4.x writers): Qwen2.5's
# sliding_window is set but off (use_sliding_window false), Mistral 7B v0.1's is on.
_QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
           "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
           "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
           "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
           "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
           "vocab_size": 151936}
_MISTRAL7B = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
              "intermediate_size": 14336, "max_position_embeddings": 32768,
              "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}


def test_configs_in_published_layouts():
  q = W.config_from_hf(_QWEN25)
  assert (q.dim, q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim, q.rope_theta, q.norm_eps,
          q.tie_embeddings, q.qkv_bias, q.sliding_window) == (
              896, 24, 14, 2, 64, 1e6, 1e-6, True, True, None)
  m = W.config_from_hf(_MISTRAL7B)
  assert (m.sliding_window, m.qkv_bias, m.head_dim, family(m)) == (4096, False, 128, "mistral")
  assert W.config_from_hf(W.config_to_hf(q)) == q and W.config_from_hf(W.config_to_hf(m)) == m
  # transformers 5's layout: layer_types and rope_parameters; every layer windowed is read.
  q5 = {k: v for k, v in _QWEN25.items() if k not in ("rope_theta", "torch_dtype")}
  q5.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="bfloat16",
            use_sliding_window=True, sliding_window=1024,
            layer_types=["sliding_attention"] * 24)
  assert W.config_from_hf(q5).sliding_window == 1024
  assert W.config_from_hf({**q5, "use_sliding_window": False}).sliding_window is None
  assert W.config_from_hf({**_QWEN25, "use_sliding_window": True,
                           "max_window_layers": 0}).sliding_window == 32768
  assert W.config_from_hf({**_QWEN25, "use_sliding_window": True,
                           "max_window_layers": 24}).sliding_window is None


# --- one-line refusals

def test_refusals_are_one_line(tmp_path):
  assert _line(lambda: W.config_from_hf({**_QWEN25, "model_type": "gemma2",
                                          "architectures": ["Gemma2ForCausalLM"]}, "g/config.json")
               ) == ("error: g/config.json: model_type='gemma2' (architectures "
                     "['Gemma2ForCausalLM']), an architecture this loader does not read; expected "
                     "one of 'llama' (LlamaForCausalLM), 'qwen2' (Qwen2ForCausalLM), 'mistral' "
                     "(MistralForCausalLM)")
  missing = {k: v for k, v in _QWEN25.items() if k != "intermediate_size"}
  assert _line(lambda: W.config_from_hf(missing, "q/config.json")) == (
      "error: q/config.json: missing key 'intermediate_size'; expected it in a 'qwen2' "
      "config.json (Qwen2ForCausalLM)")
  some = {**_QWEN25, "use_sliding_window": True}      # layers 21..23 of 24 only
  assert _line(lambda: W.config_from_hf(some, "q/config.json")) == (
      "error: q/config.json: use_sliding_window=true with the window in layers [21, 22, 23] of "
      "24 only (max_window_layers=21); expected the window in every layer or in none (a "
      "per-layer window is not supported)")
  assert "keys ['sliding_window'] are not understood by this llama loader" in _line(
      lambda: W.config_from_hf({**_MISTRAL7B, "model_type": "llama"}, "l/config.json"))
  for impl in ("cudnn", "pallas"):
    assert _line(lambda: MISTRAL.replace(attention_impl=impl)) == (
        f"error: LlamaConfig: sliding_window=8 with attention_impl={impl!r}, which applies no "
        "window; expected attention_impl one of ('auto', 'xla', 'xla_decode') (the jnp paths "
        "mask the window) or sliding_window=None")
  assert "context_parallel='pass_kv' (ring attention applies no window)" in _line(
      lambda: MISTRAL.replace(context_parallel="pass_kv"))
  gguf = pytest.importorskip("gguf")
  path = str(tmp_path / "g.gguf")
  out = gguf.GGUFWriter(path, "gemma2")
  out.add_uint32("gemma2.block_count", 1)
  out.write_header_to_file()
  out.write_kv_data_to_file()
  out.write_tensors_to_file()
  out.close()
  assert _line(lambda: GG.read_gguf(path)) == (
      f"error: {path}: general.architecture='gemma2', an architecture this loader does not "
      "read; expected one of 'llama' (Llama, Mistral, SmolLM, TinyLlama, ...), 'qwen2' "
      "(Qwen2 / Qwen2.5)")
  assert "run.c's Llama has no biases and no window" in _line(
      lambda: W.save_llama2c(str(tmp_path / "x.bin"), QWEN2.replace(rope_theta=10000.0,
                                                                     norm_eps=1e-5),
                             family_weights(QWEN2)))


def test_num_params_counts_the_biases():
  model = nnx.eval_shape(lambda: M.Llama(QWEN2, nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == QWEN2.num_params() == QWEN2.replace(qkv_bias=False).num_params() + 2 * 16 * 8
  assert LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8,
                     sliding_window=3).sliding_window == 3
