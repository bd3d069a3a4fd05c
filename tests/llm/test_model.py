"""Llama model: numpy reference forward, RoPE scaling, KV cache, causality, remat, bf16,
FSDP x TP on 8 CPU devices, and the flat-weights contract."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core.mesh import make_mesh
from llm import model as M
from llm.config import RopeScaling, get_config

TINY = get_config("tiny")               # untied, no RoPE scaling
TINY_TIED = get_config("tiny_tied")     # tied, RoPE scaling factor 4 around position 64


# --- helpers

def random_weights(cfg, seed=0) -> dict[str, np.ndarray]:
  """Well-spread random weights (logits of order 1-3), so argmax ties are unlikely."""
  rng = np.random.default_rng(seed)
  d, h, g, k, f, v = (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
                      cfg.vocab_size)
  n = lambda shape, fan_in: (rng.normal(size=shape) / math.sqrt(fan_in)).astype(np.float32)
  w = {"embed": n((v, d), 1), "final_norm": (1 + 0.1 * rng.normal(size=d)).astype(np.float32)}
  for i in range(cfg.n_layers):
    p = f"layers.{i}."
    w.update({p + "attn_norm": (1 + 0.1 * rng.normal(size=d)).astype(np.float32),
              p + "wq": n((d, h, k), d), p + "wk": n((d, g, k), d), p + "wv": n((d, g, k), d),
              p + "wo": n((h, k, d), h * k),
              p + "mlp_norm": (1 + 0.1 * rng.normal(size=d)).astype(np.float32),
              p + "w_gate": n((d, f), d), p + "w_up": n((d, f), d), p + "w_down": n((f, d), f)})
  if not cfg.tie_embeddings:
    w["lm_head"] = n((d, v), d)
  return w


def make_model(cfg, seed=0):
  """A model holding `random_weights` (built abstract: no random init to pay for)."""
  model = nnx.eval_shape(lambda: M.Llama(cfg, nnx.Rngs(seed)))
  w = random_weights(cfg, seed)
  M.load_weights(model, w)
  return model, w


def meta_rope_freqs(head_dim, theta, scaling):
  """Llama 3.1's `apply_scaling` as released by Meta (a loop over frequencies)."""
  freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
  if scaling is None:
    return np.asarray(freqs)
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      out.append(freq)
    elif wavelen > low_wavelen:
      out.append(freq / scaling.factor)
    else:
      smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
                / (scaling.high_freq_factor - scaling.low_freq_factor))
      out.append((1 - smooth) * freq / scaling.factor + smooth * freq)
  return np.asarray(out)


def np_forward(w, cfg, tokens, positions=None, segment_ids=None, hidden=False):
  """Independent float64 Llama forward (HF formulation: rotate_half, repeat_kv); the final
  normed hidden state [B,T,D] instead of the logits with `hidden`."""
  b, t = tokens.shape
  pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else np.asarray(positions)
  seg = np.zeros((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  f64 = lambda key: np.asarray(w[key], np.float64)

  def rms(x, scale):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

  inv = meta_rope_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  ang = pos[..., None] * inv                                    # [B,T,K/2]
  cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, :, None]
  sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, :, None]

  def rope(x):
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin

  rep = cfg.n_heads // cfg.n_kv_heads
  mask = (pos[:, None, :] <= pos[:, :, None]) & (seg[:, None, :] == seg[:, :, None])  # [B,T,S]
  x = f64("embed")[tokens]
  for i in range(cfg.n_layers):
    p = f"layers.{i}."
    h = rms(x, f64(p + "attn_norm"))
    q = rope(np.einsum("btd,dhk->bthk", h, f64(p + "wq")))
    k = np.repeat(rope(np.einsum("btd,dgk->btgk", h, f64(p + "wk"))), rep, axis=2)
    v = np.repeat(np.einsum("btd,dgk->btgk", h, f64(p + "wv")), rep, axis=2)
    s = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(cfg.head_dim)
    s = np.where(mask[:, None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("bhts,bshk,hkd->btd", a, v, f64(p + "wo"))
    h = rms(x, f64(p + "mlp_norm"))
    g = h @ f64(p + "w_gate")
    x = x + (g / (1 + np.exp(-g)) * (h @ f64(p + "w_up"))) @ f64(p + "w_down")
  x = rms(x, f64("final_norm"))
  if hidden:
    return x
  return x @ (f64("embed").T if cfg.tie_embeddings else f64("lm_head"))


def tokens_for(cfg, b, t, seed=1):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(b, t)).astype(np.int32)


# --- RoPE

def test_rope_scaling_frequencies_match_meta_formula():
  s = TINY_TIED.rope_scaling                 # factor 4, original 64: all three bands occur
  got = M.rope_frequencies(16, 10000.0, s)
  np.testing.assert_allclose(got, meta_rope_freqs(16, 10000.0, s), rtol=1e-6)
  plain = 10000.0 ** (-np.arange(0, 16, 2) / 16)
  # Hand-computed: wavelengths 2*pi/plain = 6.3, 19.9, 62.8, 199, ...; high band < 16 kept,
  # low band > 64 divided by 4, the two between interpolated.
  assert got[0] == pytest.approx(plain[0], rel=1e-6)
  np.testing.assert_allclose(got[3:], plain[3:] / 4, rtol=1e-6)
  smooth1 = (64 / (2 * np.pi / plain[1]) - 1) / 3
  assert got[1] == pytest.approx((1 - smooth1) * plain[1] / 4 + smooth1 * plain[1], rel=1e-6)
  assert plain[2] / 4 < got[2] < plain[2]
  np.testing.assert_allclose(M.rope_frequencies(16, 10000.0, None), plain, rtol=1e-6)
  # The released 8B setting: head_dim 128, theta 5e5, factor 8, original 8192.
  np.testing.assert_allclose(M.rope_frequencies(128, 500000.0, RopeScaling()),
                             meta_rope_freqs(128, 500000.0, RopeScaling()), rtol=1e-6)


# One case per path of sum_last: a single term (no adds), <= 16 terms added in a row (16),
# padded then halved once (17) or three times (100), halved without padding (64), SmolLM2's
# width (576: halved 6 times to 9 terms) and Llama 3 8B's (4096: halved 8 times to 16).
@pytest.mark.parametrize("n", [1, 16, 17, 64, 100, 576, 4096])
def test_sum_last_is_a_sum_in_one_order_for_any_row_count(n):
  """`sum_last` against a float64 sum (float32 error bound of n additions), its shape, its
  gradient (ones), and each row's bits the same whether 1, 5 or 24 rows are summed in one
  jitted call, alone or inside an RMSNorm."""
  rng = np.random.default_rng(n)
  x = rng.standard_normal((4, 6, n)).astype(np.float32)
  got = np.asarray(jax.jit(M.sum_last)(x))
  assert got.shape == (4, 6, 1)
  want = x.astype(np.float64).sum(-1, keepdims=True)
  bound = n * np.finfo(np.float32).eps * np.abs(x).astype(np.float64).sum(-1, keepdims=True)
  assert np.all(np.abs(got - want) <= bound)
  np.testing.assert_array_equal(jax.jit(jax.grad(lambda a: M.sum_last(a).sum()))(x),
                                np.ones_like(x))
  fns = [jax.jit(M.sum_last)]
  if n % 2 == 0:
    norm = M.RMSNorm(M.LlamaConfig(vocab_size=8, dim=n, n_layers=1, n_heads=1, n_kv_heads=1,
                                   ffn_dim=8))
    fns.append(jax.jit(lambda a: norm(a)))
  for fn in fns:
    full = np.asarray(fn(x))
    for rows in ((0, 1), (0, 5)):
      np.testing.assert_array_equal(np.asarray(fn(x[rows[0], :rows[1]])), full[0, :rows[1]])
    np.testing.assert_array_equal(np.asarray(fn(x.reshape(24, n))), full.reshape(24, -1))


@pytest.mark.parametrize("kw", [dict(factor=0.0), dict(low_freq_factor=4.0),
                                dict(low_freq_factor=0.0), dict(original_max_position=0)])
def test_rope_scaling_refuses_what_gives_no_frequencies(kw):
  """A factor <= 0 (infinite wavelengths), equal band factors (the smooth band divides by
  their difference) or no original length: refused where the config is built (else a
  hand-edited model_config.json gives NaN frequencies)."""
  with pytest.raises(ValueError, match="RopeScaling: .*; expected factor > 0, 0 < "
                     "low_freq_factor < high_freq_factor and original_max_position >= 1"):
    RopeScaling(**kw)


def test_rope_is_a_rotation_of_half_split_pairs():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 2, 8)), jnp.float32)
  inv = M.rope_frequencies(8, 10000.0, None)
  pos = jnp.asarray([[0, 1, 7]])
  y = np.asarray(M.apply_rope(x, pos, inv))
  np.testing.assert_allclose(y[0, 0], x[0, 0], rtol=1e-6)           # position 0: identity
  # Pair (j, j + 4) is rotated by angle pos * inv[j].
  a = 7 * inv[1]
  x1, x2 = np.asarray(x[0, 2, :, 1]), np.asarray(x[0, 2, :, 5])
  np.testing.assert_allclose(y[0, 2, :, 1], x1 * np.cos(a) - x2 * np.sin(a), rtol=1e-5)
  np.testing.assert_allclose(y[0, 2, :, 5], x2 * np.cos(a) + x1 * np.sin(a), rtol=1e-5)


# --- jitted entry points (one compile per config and shape keeps the file fast)

@functools.partial(jax.jit, static_argnums=0)
def fwd(graphdef, state, tokens, positions, segment_ids):
  logits, cache = nnx.merge(graphdef, state)(tokens, positions_BT=positions,
                                             segment_ids_BT=segment_ids)
  assert cache is None
  return logits


@functools.partial(jax.jit, static_argnums=0)
def cached(graphdef, state, tokens, cache, lengths, positions):
  return nnx.merge(graphdef, state)(tokens, positions_BT=positions, cache=cache,
                                    lengths_B=lengths)


def run(model, tokens, positions=None, segment_ids=None):
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
  segment_ids = np.ones((b, t), np.int32) if segment_ids is None else segment_ids
  graphdef, state = nnx.split(model)
  return fwd(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions, jnp.int32),
             jnp.asarray(segment_ids, jnp.int32))


def run_cached(model, tokens, cache, lengths=None, positions=None):
  """A cached call; lengths default to all tokens, positions to cache.length + t."""
  b, t = tokens.shape
  lengths = np.full(b, t) if lengths is None else lengths
  if positions is None:
    positions = np.asarray(cache.length)[:, None] + np.arange(t)
  graphdef, state = nnx.split(model)
  return cached(graphdef, state, jnp.asarray(tokens), cache, jnp.asarray(lengths, jnp.int32),
                jnp.asarray(positions, jnp.int32))


# --- forward vs numpy

@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["untied", "tied_scaled"])
def test_forward_matches_numpy_reference(cfg):
  model, w = make_model(cfg)
  tokens = tokens_for(cfg, 2, 9)
  # Row 0: two packed segments with restarting positions; row 1: one segment at positions
  # past the RoPE scaling knee.
  seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
  pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], np.arange(100, 109)])
  logits = run(model, tokens, pos, seg)
  assert logits.dtype == jnp.float32 and logits.shape == (2, 9, cfg.vocab_size)
  want = np_forward(w, cfg, tokens, pos, seg)
  assert np.abs(want).max() > 1.0              # a real signal, not all near zero
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)
  # Defaults: positions arange(T), one segment.
  logits = nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(tokens[:1, :3]))
  np.testing.assert_allclose(np.asarray(logits), np_forward(w, cfg, tokens[:1, :3]),
                             rtol=1e-4, atol=1e-4)


def test_hidden_taps_are_the_residual_stream_after_those_blocks():
  """taps=(0, 1): block 0's output (run alone here) and block 1's, whose final norm is h; h
  and the cache are those of a call without taps."""
  model, _ = make_model(TINY)
  tokens = jnp.asarray(tokens_for(TINY, 2, 6))
  x = model.embed_tokens(tokens)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

  @jax.jit     # one compile for the four calls (eager, each op would compile on its own)
  def calls(x):
    h, _ = model.hidden(x)
    h2, cache, taps = model.hidden(x, taps=(0, 1))
    block0, _ = model.layers[0](x, pos, None, None, None, None, None)
    return h, h2, cache, taps, block0, model.final_norm(taps[..., TINY.dim:])

  h, h2, cache, taps, block0, normed = calls(x)
  assert cache is None and taps.shape == (2, 6, 2 * TINY.dim)
  np.testing.assert_array_equal(h2, h)
  np.testing.assert_allclose(taps[..., :TINY.dim], block0, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(normed, h, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"taps=\(2,\); expected block indices in \[0, 2\)"):
    model.hidden(x, taps=(2,))


def test_parameter_tree_contract():
  model = nnx.eval_shape(lambda: M.Llama(TINY, nnx.Rngs(0)))
  d, h, g, k, f, v = 64, 4, 2, 16, 128, 256
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  def check(var, spec, shape, names):
    assert tuple(var.shape) == shape and tuple(spec.get_value()) == names
  check(model.embed, specs["embed"], (v, d), ("vocab", "embed"))
  check(model.lm_head, specs["lm_head"], (d, v), ("embed", "vocab"))
  check(model.final_norm.scale, specs["final_norm"]["scale"], (d,), ("norm",))
  blk, s = model.layers[1], specs["layers"][1]
  check(blk.attn_norm.scale, s["attn_norm"]["scale"], (d,), ("norm",))
  check(blk.mlp_norm.scale, s["mlp_norm"]["scale"], (d,), ("norm",))
  check(blk.attn.wq, s["attn"]["wq"], (d, h, k), ("embed", "heads", "head_dim"))
  check(blk.attn.wk, s["attn"]["wk"], (d, g, k), ("embed", "kv_heads", "head_dim"))
  check(blk.attn.wv, s["attn"]["wv"], (d, g, k), ("embed", "kv_heads", "head_dim"))
  check(blk.attn.wo, s["attn"]["wo"], (h, k, d), ("heads", "head_dim", "embed"))
  check(blk.mlp.w_gate, s["mlp"]["w_gate"], (d, f), ("embed", "mlp"))
  check(blk.mlp.w_up, s["mlp"]["w_up"], (d, f), ("embed", "mlp"))
  check(blk.mlp.w_down, s["mlp"]["w_down"], (f, d), ("mlp", "embed"))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == TINY.num_params()
  tied = nnx.eval_shape(lambda: M.Llama(TINY_TIED, nnx.Rngs(0)))
  assert not hasattr(tied, "lm_head")
  assert sum(x.size for x in jax.tree.leaves(nnx.state(tied))) == TINY_TIED.num_params()
  # Initialization: N(0, 1/fan_in) projections and N(0, 1/D) embeddings, unit norm scales.
  one_layer = TINY.replace(n_layers=1)
  params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(M.Llama(one_layer, nnx.Rngs(0)))))()
  assert np.std(params["layers"][0]["attn"]["wo"]) == pytest.approx(64 ** -0.5, rel=0.05)
  assert np.std(params["layers"][0]["mlp"]["w_down"]) == pytest.approx(128 ** -0.5, rel=0.05)
  assert np.std(params["embed"]) == pytest.approx(64 ** -0.5, rel=0.05)
  np.testing.assert_array_equal(params["final_norm"]["scale"], np.ones(64))


def test_weights_round_trip_and_load_errors():
  model, w = make_model(TINY)
  got = M.weights_from_model(model)
  assert set(got) == set(w) and len(got) == 3 + 9 * TINY.n_layers
  for key in w:
    np.testing.assert_array_equal(got[key], w[key])
  bad = dict(w)
  bad["layers.1.wk"] = np.zeros((64, 4, 16), np.float32)
  with pytest.raises(ValueError, match=r"'layers.1.wk': got shape \(64, 4, 16\), expected "
                                       r"\(64, 2, 16\)"):
    M.load_weights(model, bad)
  bad = {k: x for k, x in w.items() if k != "final_norm"}
  bad["layers.9.wq"] = w["layers.0.wq"]
  with pytest.raises(ValueError, match=r"missing keys \['final_norm'\].*unexpected keys "
                                       r"\['layers.9.wq'\]"):
    M.load_weights(model, bad)
  with pytest.raises(ValueError, match=r"unexpected keys \['lm_head'\]"):
    M.load_weights(nnx.eval_shape(lambda: M.Llama(TINY_TIED, nnx.Rngs(0))), w)
  # A failed load changed nothing.
  np.testing.assert_array_equal(M.weights_from_model(model)["final_norm"], w["final_norm"])


# --- KV cache

def test_cached_decode_equals_full_recomputation():
  model, _ = make_model(TINY_TIED)
  tokens = tokens_for(TINY_TIED, 2, 12)
  full = run(model, tokens)
  # Prefill 5 tokens, a chunk of 3, then one token at a time.
  cache = model.init_cache(2, 16)
  logits, cache = run_cached(model, tokens[:, :5], cache)
  np.testing.assert_allclose(logits, full[:, :5], rtol=1e-5, atol=1e-5)
  logits, cache = run_cached(model, tokens[:, 5:8], cache)
  np.testing.assert_allclose(logits, full[:, 5:8], rtol=1e-5, atol=1e-5)
  for t in range(8, 12):
    logits, cache = run_cached(model, tokens[:, t:t + 1], cache)
    np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(cache.length, [12, 12])
  np.testing.assert_array_equal(cache.pos[:, :12], np.tile(np.arange(12), (2, 1)))
  assert (np.asarray(cache.pos[:, 12:]) == M.SENTINEL_POS).all()


def test_ragged_prefill_never_attends_padding_and_slot_order_is_free():
  model, _ = make_model(TINY)
  tokens = tokens_for(TINY, 3, 12)
  lengths = np.array([10, 4, 7])
  padded = tokens[:, :10].copy()
  for b, n in enumerate(lengths):
    padded[b, n:] = 255 - b                          # pad content must not matter
  cache0 = model.init_cache(3, 14)
  logits, cache = run_cached(model, padded, cache0, lengths)
  np.testing.assert_array_equal(cache.length, lengths)
  pos = np.asarray(cache.pos)
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(pos[b, :n], np.arange(n))
    assert (pos[b, n:] == M.SENTINEL_POS).all()
  # Reference: each row's own tokens followed by its two decode tokens, no cache (right
  # padding after them cannot change earlier logits under causal masking).
  nxt = tokens_for(TINY, 3, 2, seed=7)
  seqs = np.zeros((3, 12), np.int32)
  for b, n in enumerate(lengths):
    seqs[b, :n + 2] = np.concatenate([tokens[b, :n], nxt[b]])
  full = np.asarray(run(model, seqs))
  # Each row decodes at its own next slot.
  after_prefill = cache
  dec = []
  for t in range(2):
    lo, cache = run_cached(model, nxt[:, t:t + 1], cache)
    dec.append(np.asarray(lo[:, 0]))
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(logits[b, :n], full[b, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dec[0][b], full[b, n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dec[1][b], full[b, n + 1], rtol=1e-5, atol=1e-5)
  # Slot order is irrelevant (masking is by position alone): reverse every row's slots, so
  # the empty ones come first, and decode into slots 0 and 1 with explicit positions.
  c = after_prefill
  rev = M.KVCache(k=tuple(k[:, ::-1] for k in c.k), v=tuple(v[:, ::-1] for v in c.v),
                  pos=c.pos[:, ::-1], length=jnp.zeros(3, jnp.int32))
  for t in range(2):
    lo, rev = run_cached(model, nxt[:, t:t + 1], rev, positions=lengths[:, None] + t)
    np.testing.assert_allclose(lo[:, 0], dec[t], rtol=1e-5, atol=1e-5)


# --- invariants

def test_causality_through_gradients():
  model, _ = make_model(TINY)
  x = model.embed_tokens(jnp.asarray(tokens_for(TINY, 2, 6)))
  seg = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]])

  @jax.jit
  def jac(x_BTD):
    def f(x_BTD):
      h, _ = model.hidden(x_BTD, segment_ids_BT=seg)
      return model.logits(h).sum(-1)                 # [B,T]
    return jax.jacrev(f)(x_BTD)

  jac = np.abs(np.asarray(jac(x))).sum(-1)           # [B,T,B,S]
  allowed = np.zeros((2, 6, 2, 6), bool)
  for b in range(2):
    for t in range(6):
      for s in range(t + 1):
        allowed[b, t, b, s] = b == 1 or (s >= 3) == (t >= 3)
  assert (jac[~allowed] == 0).all()
  assert (jac[allowed] > 1e-6).all()


def _loss_and_grads(graphdef, state, tokens):
  def loss(state):
    logits, _ = nnx.merge(graphdef, state)(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7]), logits
  return jax.value_and_grad(loss, has_aux=True)(state)


loss_and_grads = jax.jit(_loss_and_grads, static_argnums=0)


def test_remat_on_off_equal():
  model, w = make_model(TINY_TIED)
  rem, w_rem = make_model(TINY_TIED.replace(remat=True))
  assert all(np.array_equal(w[k], w_rem[k]) for k in w)
  tokens = jnp.asarray(tokens_for(TINY_TIED, 4, 8))
  (l0, _), g0 = loss_and_grads(*nnx.split(model), tokens)
  (l1, _), g1 = loss_and_grads(*nnx.split(rem), tokens)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # The remat graph really recomputes: its backward holds a checkpoint (remat) primitive.
  jaxpr = str(jax.make_jaxpr(_loss_and_grads, static_argnums=0)(*nnx.split(rem), tokens))
  assert "checkpoint" in jaxpr or "remat" in jaxpr


@pytest.mark.parametrize("policy", ["dots", "attention"])
def test_remat_policies_equal_gradients(policy):
  """Every remat policy gives the no-remat gradients; "dots" keeps the projection matmuls
  (no dot_general on [B,T,D] x [D,...] weights is recomputed in the backward)."""
  model, _ = make_model(TINY_TIED)
  rem, _ = make_model(TINY_TIED.replace(remat=True, remat_policy=policy))
  tokens = jnp.asarray(tokens_for(TINY_TIED, 4, 8))
  (l0, _), g0 = loss_and_grads(*nnx.split(model), tokens)
  (l1, _), g1 = loss_and_grads(*nnx.split(rem), tokens)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  def count(jaxpr) -> int:                   # dot_generals, sub-jaxprs included
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name == "dot_general"
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else [p]:
          inner = getattr(sub, "jaxpr", sub)
          n += count(inner) if hasattr(inner, "eqns") else 0
    return n

  dots = lambda m: count(jax.make_jaxpr(_loss_and_grads, static_argnums=0)(
      *nnx.split(m), tokens).jaxpr)

  full, _ = make_model(TINY_TIED.replace(remat=True))
  assert dots(model) <= dots(rem) <= dots(full)
  if policy == "dots":
    # The projections' 7 matmuls per layer are not recomputed; only attention's 2 are.
    assert dots(rem) == dots(model) + 2 * TINY_TIED.n_layers


def test_attention_told_default_positions(monkeypatch):
  """Without a cache and without positions the model passes none to attention (so "auto"
  may take cuDNN's plain causal mask); given positions and cache calls pass them."""
  from llm import attention as attn_lib
  seen = []

  def spy(q, k, v, **kw):
    seen.append((kw["q_positions"] is None, kw["kv_positions"] is None))
    return attn_lib.attention_reference(q, k, v, **kw)

  attn_lib.register("spy", spy)
  model, _ = make_model(TINY.replace(attention_impl="spy", n_layers=1))
  ref, _ = make_model(TINY.replace(attention_impl="xla", n_layers=1))
  tokens = jnp.asarray(tokens_for(TINY, 2, 6))
  # Each call jitted (one compile each; the spy sees the trace, once per call).
  np.testing.assert_allclose(np.asarray(jax.jit(lambda t: model(t)[0])(tokens)),
                             np.asarray(jax.jit(lambda t: ref(t)[0])(tokens)), rtol=1e-6,
                             atol=1e-6)
  jax.jit(lambda t: model(t, positions_BT=jnp.broadcast_to(jnp.arange(6), (2, 6)))[0])(tokens)
  jax.jit(lambda t, c: model(t, cache=c)[0])(tokens, model.init_cache(2, 8))
  assert seen == [(True, True), (False, False), (False, False)]


def test_bf16_compute_runs_and_is_close():
  model, w = make_model(TINY)
  bf, _ = make_model(TINY.replace(dtype="bfloat16"))
  assert bf.layers[0].attn.wq[...].dtype == jnp.float32       # fp32 master weights
  tokens = tokens_for(TINY, 2, 8)
  ref = np.asarray(run(model, tokens))
  got, cache = run_cached(bf, tokens, bf.init_cache(2, 8))
  assert got.dtype == jnp.float32 and cache.k[0].dtype == jnp.bfloat16
  err = np.abs(np.asarray(got) - ref)
  assert err.max() < 0.1 * np.abs(ref).max() and err.mean() < 0.05
  assert err.max() > 0                                        # bf16 really was used


def test_few_row_16bit_products_run_as_three_rows_on_cpu_with_the_same_result():
  # XLA:CPU's one-row 16-bit product is its slow matrix-vector path, and on CPUs with
  # AVX512-BF16 / AMX products of one or two rows take another routine than three or more
  # (llm.model.einsum): on CPU the rows repeat up to CPU_MIN_ROWS; rows are independent, so
  # the result is the row's own, and the same bits as inside any larger product.
  assert M.CPU_MIN_ROWS == 3
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, 1, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(64, 96)), jnp.bfloat16)
  f = lambda x, w: M.einsum("btd,df->btf", x, w, preferred_element_type=jnp.float32)
  jaxpr = lambda x, w: str(jax.make_jaxpr(f)(x, w))
  on_cpu = jax.default_backend() == "cpu"
  assert ("concatenate" in jaxpr(x, w)) == on_cpu
  assert ("concatenate" in jaxpr(jnp.concatenate([x, x], 0), w)) == on_cpu   # batch 2
  assert "concatenate" not in jaxpr(x.astype(jnp.float32), w.astype(jnp.float32))
  assert "concatenate" not in jaxpr(jnp.concatenate([x, x, x], 1), w)      # three rows already
  got = np.asarray(jax.jit(f)(x, w))
  assert got.shape == (1, 1, 96)
  # The row inside a product of several rows (any position): the same numbers; so are the
  # rows of a batch of two.
  many = jnp.concatenate([jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.bfloat16), x], 1)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(many, w))[:, 4:], got)
  pair = jnp.concatenate([many[:, 1:2], x], 0)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(pair, w)),
                                np.asarray(jax.jit(f)(many, w))[0, [1, 4]][:, None])
  ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
  # Other specs keep their own order of axes ("bthk,hkd->btd" is the attention's output).
  x4 = jnp.asarray(rng.normal(size=(1, 1, 2, 32)), jnp.bfloat16)
  w3 = jnp.asarray(rng.normal(size=(2, 32, 64)), jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(lambda a, b: M.einsum("bthk,hkd->btd", a, b))(x4, w3)),
      np.asarray(jax.jit(lambda a, b: jnp.einsum("bthk,hkd->btd", a, b))(
          jnp.concatenate([x4, x4, x4, x4], 1), w3))[:, :1])


def test_bf16_batch1_decode_step_equals_its_row_in_a_batch():
  # A batch-1 bf16 decode step (one-row products) gives the logits its row gets in a batch:
  # on CPU both take YNNPACK's product (llm.model.einsum); a GPU's libraries promise no such
  # thing between a matrix-vector and a matrix product.
  if jax.default_backend() != "cpu":
    pytest.skip(f"the one-row rule is XLA:CPU's; backend {jax.default_backend()}")
  model, _ = make_model(TINY.replace(dtype="bfloat16", param_dtype="bfloat16"))
  tokens = tokens_for(TINY, 2, 6)
  _, c2 = run_cached(model, tokens[:, :5], model.init_cache(2, 8))
  two, _ = run_cached(model, tokens[:, 5:6], c2)
  _, c1 = run_cached(model, tokens[:1, :5], model.init_cache(1, 8))
  one, _ = run_cached(model, tokens[:1, 5:6], c1)
  np.testing.assert_array_equal(np.asarray(one), np.asarray(two)[:1])


# --- FSDP x TP

@pytest.mark.devices(8)
@pytest.mark.parametrize("cfg,mesh_spec", [
    (TINY_TIED, "fsdp:2,tp:4"),          # 2 kv heads on tp=4: kv weights replicated
    (TINY_TIED, "data:2,fsdp:2,tp:2"),
], ids=["fsdp2_tp4", "data2_fsdp2_tp2"])
def test_sharded_equals_single_device(cfg, mesh_spec):
  model, w = make_model(cfg)                # same single-device compile as the remat test
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(tokens_for(cfg, 4, 8))
  (l_ref, logits_ref), g_ref = loss_and_grads(graphdef, state, tokens)

  mesh = make_mesh(mesh_spec)
  placed = jax.device_put(state, M.param_shardings(state, mesh))
  wq = placed["layers"][0]["attn"]["wq"].get_value()
  assert wq.sharding.spec == P("fsdp", "tp", None)            # ("embed", "heads", "head_dim")
  assert placed["embed"].get_value().sharding.spec == P("tp", "fsdp")
  assert placed["layers"][1]["mlp"]["w_down"].get_value().sharding.spec == P("tp", "fsdp")
  assert placed["final_norm"]["scale"].get_value().sharding.spec == P(None)
  wk_spec = placed["layers"][0]["attn"]["wk"].get_value().sharding.spec
  assert wk_spec == (P("fsdp", None, None) if "tp:4" in mesh_spec else P("fsdp", "tp", None))
  with jax.set_mesh(mesh):
    (l, logits), g = loss_and_grads(graphdef, placed, tokens)
  batch_axes = "fsdp" if mesh_spec.startswith("fsdp") else ("data", "fsdp")
  assert logits.sharding.spec == P(batch_axes, None, "tp")    # act_batch, act_seq, act_vocab
  # Sharding reorders the fp32 sums (partial sums over D, heads, F per device), which moves
  # results by rounding alone, by an amount set by the arithmetic, not by the machine. A sum
  # of n fp32 terms takes n roundings, each at most eps/2 of a partial sum (<= sum |terms|);
  # adding up as a random walk they move it by about eps * sqrt(n) * sum |terms|. A logit
  # sums D terms h_d * E_vd of the final hidden state (which carries the layers' rounding
  # at the same relative size), so each run is within about eps * sqrt(D) * sum_d |h_d E_vd|
  # of the exact logit, and the two runs within twice that of each other.
  eps = float(np.finfo(np.float32).eps)
  h = np_forward(w, cfg, np.asarray(tokens), hidden=True)                  # float64 [B,T,D]
  terms = np.abs(h) @ np.abs(np.asarray(w["embed"], np.float64)).T        # sum_d |h_d E_vd|
  tol = 2 * eps * math.sqrt(cfg.dim) * terms
  err = np.abs(np.asarray(logits, np.float64) - np.asarray(logits_ref, np.float64))
  assert (err <= tol).all(), (err.max(), tol[err > tol][:4])
  # The loss (a mean of log-softmax entries) moves by at most twice the largest logit error.
  assert abs(float(l) - float(l_ref)) <= 2 * tol.max()
  # A weight's gradient sums B*T tokens' contributions, each through the backward's sums,
  # the longest over the V logits; terms are of the size of the largest gradient entry.
  b_, t_ = tokens.shape
  g_tol = eps * math.sqrt(b_ * t_ * cfg.vocab_size)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=0, atol=g_tol * np.abs(b).max())


@pytest.mark.devices(8)
def test_param_shardings_replicate_what_the_mesh_does_not_divide():
  model = nnx.eval_shape(lambda: M.Llama(TINY, nnx.Rngs(0)))   # 2 kv heads
  sh = M.param_shardings(model, make_mesh("fsdp:2,tp:4"))
  assert sh["layers"][0]["attn"]["wk"].get_value().spec == P("fsdp", None, None)
  assert sh["layers"][0]["attn"]["wq"].get_value().spec == P("fsdp", "tp", None)
