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
from llm.config import LlamaConfig, YarnScaling, family, get_config
from llm.speculative import DraftHead, TreeShape, speculative_generate
from tests.llm.test_model import meta_rope_freqs, random_weights
from tests.llm.test_reader_errors import _line

QWEN2 = get_config("tiny_qwen2", vocab_size=32)        # biases, tied, RoPE base 1e6
MISTRAL = get_config("tiny_mistral", vocab_size=32)    # window 8, untied
# Both options at once (Qwen2 with use_sliding_window in every layer), window 4: the cache
# and speculative tests cover the bias and the window in one compiled program each.
BOTH = QWEN2.replace(sliding_window=4, tie_embeddings=False)
# Qwen2 with its window in layer 1 only (max_window_layers=1) and YaRN (factor 4 over an
# original context of 64: pair 0 kept, pairs 1-2 blended, 3-7 divided by 4).
YARN = YarnScaling(factor=4.0, original_max_position=64)
PER_LAYER = QWEN2.replace(sliding_window=3, window_layers=(1,), rope_theta=10000.0,
                          rope_scaling=YARN, tie_embeddings=False)


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


def yarn_freqs(head_dim, theta, s: YarnScaling):
  """YaRN's frequencies and cos / sin factor pair by pair, as transformers'
  `_compute_yarn_parameters` defines them (a ramp over pair indices between the pairs that
  turn beta_fast and beta_slow times over the original context)."""
  def pair_of(turns):
    return head_dim * math.log(s.original_max_position / (turns * 2 * math.pi)) / (
        2 * math.log(theta))

  low = max(math.floor(pair_of(s.beta_fast)), 0)
  high = min(math.ceil(pair_of(s.beta_slow)), head_dim - 1)
  out = []
  for j in range(head_dim // 2):
    base = 1.0 / theta ** (2 * j / head_dim)
    ramp = min(max((j - low) / max(high - low, 1e-3), 0.0), 1.0)   # 0: kept, 1: / factor
    out.append(base * (1 - ramp) + base / s.factor * ramp)
  return np.asarray(out), 0.1 * math.log(s.factor) + 1.0


def np_forward(w, cfg, tokens, positions, segment_ids, window=None, windows=None):
  """float64 decoder in transformers' formulation (rotate_half, repeat_kv), q / k / v biases
  before RoPE; query t sees key s iff same segment, pos_s <= pos_t and, with a window,
  pos_t - pos_s < window (transformers' `kv_idx > q_idx - sliding_window`), the mask built
  pair by pair; `windows`: one window (or None) per layer instead. YaRN: `yarn_freqs`, cos
  and sin times its factor."""
  b, t = tokens.shape
  f64 = lambda key: np.asarray(w[key], np.float64)  # noqa: E731
  rms = lambda x, s: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * s  # noqa
  scale = 1.0
  if isinstance(cfg.rope_scaling, YarnScaling):
    freqs, scale = yarn_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  else:
    freqs = meta_rope_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  ang = positions[..., None] * freqs
  cos = scale * np.concatenate([np.cos(ang)] * 2, -1)[:, :, None]
  sin = scale * np.concatenate([np.sin(ang)] * 2, -1)[:, :, None]

  def rope(x):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

  def mask_of(window):
    mask = np.zeros((b, t, t), bool)
    for r in range(b):
      for i in range(t):
        for j in range(t):
          seen = segment_ids[r, j] == segment_ids[r, i] and positions[r, j] <= positions[r, i]
          mask[r, i, j] = seen and (window is None or positions[r, i] - positions[r, j] < window)
    return mask

  windows = [window] * cfg.n_layers if windows is None else windows
  rep = cfg.n_heads // cfg.n_kv_heads
  x = f64("embed")[tokens]
  for i in range(cfg.n_layers):
    mask = mask_of(windows[i])
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


def test_per_layer_window_and_yarn_match_numpy_reference():
  """PER_LAYER: a window of 3 in layer 1 only and YaRN RoPE, against the float64 reference
  with the window per layer and YaRN's frequencies and factor pair by pair; both settings
  bite (the window in both layers, or plain RoPE, give other logits)."""
  model, w = make(PER_LAYER)
  tokens = _tokens(PER_LAYER, 2, 10)
  seg = np.ones((2, 10), np.int32)
  pos = np.array([list(range(10)), list(range(60, 70))])
  with jax.default_matmul_precision("float32"):
    got = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(pos, jnp.int32),
                              jnp.asarray(seg)))
  want = np_forward(w, PER_LAYER, tokens, pos, seg, windows=[None, 3])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  both = np_forward(w, PER_LAYER, tokens, pos, seg, windows=[3, 3])
  assert np.abs(both[:, 3:] - want[:, 3:]).max() > 1e-2
  plain = np_forward(w, PER_LAYER.replace(rope_scaling=None), tokens, pos, seg,
                     windows=[None, 3])
  assert np.abs(plain - want).max() > 1e-2
  freqs, scale = yarn_freqs(16, 10000.0, YARN)
  np.testing.assert_allclose(M.rope_frequencies(16, 10000.0, YARN), freqs, rtol=1e-6)
  assert scale == YARN.cos_sin_scale() and 0 < freqs[1] / freqs[0] < 1


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


def test_rolling_cache_equals_the_full_cache():
  """Mistral's rolling buffer: window 4, 5 slots, a prefill of 7 tokens, then calls of 2
  and 1 tokens to 16 (each wrapping around the slots): every call's logits equal the full
  forward's (1e-5); the cache holds its 5 slots only, the last tokens' positions. A call of
  3 tokens (S < W + T - 1) is refused. (`generate` takes a rolling cache of W slots by
  default for a window in every layer: test_generate_and_eagle_greedy_... goes through it.)"""
  cfg = MISTRAL.replace(sliding_window=4, n_layers=1)
  model, _ = make(cfg)
  tokens = _tokens(cfg, 2, 16)
  pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
  full = np.asarray(_forward(model, jnp.asarray(tokens), pos, jnp.ones((2, 16), jnp.int32)))
  logits, cache = _rolling(model, jnp.asarray(tokens), 5, (0, 7, 9, 11, 12, 14, 16))
  np.testing.assert_allclose(np.asarray(logits), full, rtol=1e-5, atol=1e-5)
  assert cache.k[0].shape[1] == 5 and cache.rolling
  np.testing.assert_array_equal(np.sort(cache.pos, axis=1), np.tile(np.arange(11, 16), (2, 1)))
  with pytest.raises(ValueError, match="a rolling cache of 5 slots \\(window 4\\) takes "
                     "prefills \\(fresh_cache\\) and calls of up to 2 tokens"):
    _rolling(model, jnp.asarray(tokens), 5, (0, 7, 10))
  assert "rolling=True with sliding_window=3, window_layers=(1,)" in _line(
      lambda: M.KVCache.init(PER_LAYER, 1, 8, rolling=True))


@nnx.jit(static_argnames=("slots", "cuts"))
def _rolling(model, tokens, slots, cuts):
  """The logits of tokens[:, cuts[i]:cuts[i + 1]] call by call through a rolling cache of
  `slots` slots, the first call a prefill; and the cache."""
  cache = model.init_cache(tokens.shape[0], slots, rolling=True)
  out = []
  for a, b in zip(cuts, cuts[1:]):
    h_BTD, cache = model.hidden(model.embed_tokens(tokens[:, a:b]), cache=cache,
                                fresh_cache=a == 0)
    out.append(model.logits(h_BTD))
  return jnp.concatenate(out, axis=1), cache


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
  hf = _round_trip_hf(tmp_path, PER_LAYER)
  assert (hf["use_sliding_window"], hf["sliding_window"], hf["max_window_layers"],
          hf["layer_types"], hf["rope_scaling"]) == (
              True, 3, 1, ["full_attention", "sliding_attention"],
              {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
               "beta_fast": 32.0, "beta_slow": 1.0})
  hf = _round_trip_hf(tmp_path, MISTRAL)
  assert (hf["architectures"], hf["sliding_window"]) == (["MistralForCausalLM"], 8)
  assert "use_sliding_window" not in hf and "attention_bias" not in hf
  hf = _round_trip_hf(tmp_path, MISTRAL.replace(sliding_window=None))
  assert hf["model_type"] == "llama"      # a Mistral without a window is Llama's arithmetic


def _write_llamacpp_qwen2(path, cfg, w, extra=None):
  """A GGUF as llama.cpp's Qwen2 converter lays it out: arch qwen2, HF rows as they are (no
  q / k permutation: NEOX RoPE), blk.N.attn_q.bias etc., no output.weight when tied;
  `extra(writer)` adds metadata."""
  gguf = pytest.importorskip("gguf")
  out = gguf.GGUFWriter(path, "qwen2")
  if extra is not None:
    extra(out)
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
  for c in (cfg, BOTH.replace(norm_eps=cfg.norm_eps), PER_LAYER.replace(norm_eps=cfg.norm_eps),
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
  # The window in some layers: those from max_window_layers on, or as layer_types says.
  some = W.config_from_hf({**_QWEN25, "use_sliding_window": True})
  assert (some.sliding_window, some.window_layers, some.layer_window(20)) == (
      32768, (21, 22, 23), None)
  assert W.config_from_hf({**q5, "layer_types": ["full_attention", "sliding_attention"] * 12}
                          ).window_layers == tuple(range(1, 24, 2))
  assert W.config_from_hf(W.config_to_hf(some)) == some
  # Qwen2.5's long-context setting (its model card: add it to config.json): YaRN, factor 4.
  y = W.config_from_hf({**_QWEN25, "rope_scaling": {
      "factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}})
  assert y.rope_scaling == YarnScaling(factor=4.0, original_max_position=32768)
  assert y.rope_scaling.cos_sin_scale() == pytest.approx(1 + 0.1 * math.log(4))
  assert W.config_from_hf(W.config_to_hf(y)) == y
  # transformers 5's layout, optional keys, and original_max_position_embeddings defaulting to
  # max_position_embeddings as transformers' standardize_rope_params does.
  y5 = W.config_from_hf({**q5, "rope_parameters": {
      "rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "beta_fast": 16,
      "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False}})
  assert y5.rope_scaling == YarnScaling(factor=2.0, original_max_position=32768,
                                        beta_fast=16.0, mscale=0.707, mscale_all_dim=1.0,
                                        truncate=False)


def test_an_absent_sliding_window_is_transformers_default():
  # MistralConfig and Qwen2Config default sliding_window to 4096 when config.json has no such
  # key (transformers 4.x and 5); null is no window.
  no_key = {k: v for k, v in _MISTRAL7B.items() if k != "sliding_window"}
  assert W.config_from_hf(no_key).sliding_window == 4096
  assert W.config_from_hf({**no_key, "sliding_window": None}).sliding_window is None
  q = {k: v for k, v in _QWEN25.items() if k != "sliding_window"}
  on = W.config_from_hf({**q, "use_sliding_window": True})
  assert (on.sliding_window, on.window_layers) == (4096, (21, 22, 23))
  assert W.config_from_hf({**q, "use_sliding_window": True, "sliding_window": None}
                          ).sliding_window is None
  assert W.config_from_hf(q).sliding_window is None   # use_sliding_window false


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
  assert _line(lambda: W.config_from_hf({**_QWEN25, "rope_scaling": {
      "type": "longrope", "factor": 4.0}}, "q/config.json")) == (
      "error: q/config.json: rope_scaling rope type 'longrope'; expected one of ['default', "
      "'llama3', 'yarn'] (others change the RoPE frequencies)")
  assert _line(lambda: W.config_from_hf({**_QWEN25, "rope_scaling": {
      "type": "yarn", "factor": 4.0, "extrapolation": 1}}, "q/config.json")) == (
      "error: q/config.json: rope_scaling keys ['extrapolation'] are not understood for rope "
      "type 'yarn' (expected only ['attention_factor', 'beta_fast', 'beta_slow', 'factor', "
      "'mscale', 'mscale_all_dim', 'original_max_position_embeddings', 'partial_rotary_factor', "
      "'rope_theta', 'rope_type', 'truncate', 'type'])")
  assert _line(lambda: W.config_from_hf({**_QWEN25, "rope_scaling": {
      "type": "yarn", "factor": 0.5}}, "q/config.json")) == (
      "error: q/config.json: rope_scaling.factor=0.5; expected a YaRN factor >= 1")
  assert _line(lambda: W.config_from_hf({**_QWEN25, "layer_types": ["sliding"] * 24},
                                        "q/config.json")) == (
      "error: q/config.json: layer_types=['sliding', 'sliding', 'sliding', 'sliding', 'sliding', "
      "'sliding', 'sliding',...; expected a list of 24 entries (num_hidden_layers), each "
      "'full_attention' or 'sliding_attention'")
  assert _line(lambda: W.config_to_hf(MISTRAL.replace(window_layers=(0,)))) == (
      "error: config_to_hf: window_layers=(0,) on a mistral config (no qkv_bias); expected a "
      "window in every layer (Mistral) or a Qwen2 config (qkv_bias=True), whose layer_types "
      "say it per layer")
  assert _line(lambda: QWEN2.replace(window_layers=(1,))) == (
      "error: LlamaConfig: window_layers=(1,) with sliding_window=None; expected a "
      "sliding_window for the listed layers, or window_layers=None")
  assert _line(lambda: MISTRAL.replace(window_layers=(1, 0))) == (
      "error: LlamaConfig: window_layers=(1, 0); expected increasing layer indices in [0, 2) "
      "(sliding_window=None for none)")
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
  # A llama.cpp Qwen2 file with YaRN as its converter writes it reads as our YaRN; settings
  # with no counterpart are refused by key.
  cfg = QWEN2.replace(norm_eps=float(np.float32(1e-6)))
  w = family_weights(cfg)

  def qwen2_file(name, extra):
    _write_llamacpp_qwen2(str(tmp_path / name), cfg, w, extra)
    return str(tmp_path / name)

  def yarn(out, kind="yarn"):
    out.add_string("qwen2.rope.scaling.type", kind)
    out.add_float32("qwen2.rope.scaling.factor", 4.0)
    out.add_uint32("qwen2.rope.scaling.original_context_length", 64)

  assert GG.read_gguf(qwen2_file("y.gguf", yarn)).config.rope_scaling == YARN
  path = qwen2_file("lin.gguf", lambda out: yarn(out, "linear"))
  assert _line(lambda: GG.read_gguf(path)) == (
      f"error: {path}: qwen2.rope.scaling.type='linear'; supported: none, yarn and Llama 3's "
      "rope_freqs.weight factors")
  path = qwen2_file("attn.gguf", lambda out: (yarn(out), out.add_float32(
      "qwen2.rope.scaling.attn_factor", 0.5)))
  assert _line(lambda: GG.read_gguf(path)) == (
      f"error: {path}: metadata keys ['qwen2.rope.scaling.attn_factor'] are not understood by "
      "this loader and may change the model's arithmetic")
  path = qwen2_file("p.gguf", lambda out: (out.add_uint32("qwen2.attention.sliding_window", 4),
                                          out.add_sliding_window_pattern(2)))
  assert _line(lambda: GG.read_gguf(path)) == (
      f"error: {path}: metadata qwen2.attention.sliding_window_pattern=2; expected 2 bools "
      "(block_count), true where the sliding window applies, with attention.sliding_window set")
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
