"""Generation: greedy vs full recomputation, batched vs one at a time, stop tokens, sampling
distributions, and a sharded run on 8 CPU devices."""

from __future__ import annotations

import functools
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.mesh import make_mesh
from llm import generate as G
from llm import model as M
from llm.config import get_config
from tests.llm.test_model import make_model
from tests.peer_env import peer_python

TINY = get_config("tiny")
TINY_TIED = get_config("tiny_tied")
PROMPTS = [[5, 17, 99, 3, 250], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42, 42]]
MAX_LEN = 16


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens_BT):
  return nnx.merge(graphdef, state)(tokens_BT)[0]


def greedy_by_recomputation(model, prompts, n_new, width=MAX_LEN):
  """Reference: no cache; every step re-runs the whole (right-padded) sequence."""
  graphdef, state = nnx.split(model)
  seqs = [list(p) for p in prompts]
  for _ in range(n_new):
    tokens = np.zeros((len(seqs), width), np.int32)
    for b, s in enumerate(seqs):
      tokens[b, :len(s)] = s
    logits = np.asarray(_full_logits(graphdef, state, jnp.asarray(tokens)))
    for b, s in enumerate(seqs):
      s.append(int(np.argmax(logits[b, len(s) - 1])))
  return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def tiny():
  return make_model(TINY)[0]


@pytest.fixture(scope="module")
def greedy_out(tiny):
  return G.generate(tiny, PROMPTS, 7, max_len=MAX_LEN)


def test_greedy_matches_full_recomputation(tiny, greedy_out):
  assert [len(o) for o in greedy_out] == [7, 7, 7]
  assert greedy_out == greedy_by_recomputation(tiny, PROMPTS, 7)
  assert len({tuple(o) for o in greedy_out}) == 3     # rows really differ


def test_batched_equals_one_at_a_time(tiny, greedy_out):
  for p, want in zip(PROMPTS, greedy_out):
    assert G.generate(tiny, [p], 7, max_len=MAX_LEN) == [want]
  # The decode loop compiled once for the batch size and cache size, whatever the prompt.
  before = G.decode._cache_size()
  G.generate(tiny, [[7, 7, 7, 7]], 7, max_len=MAX_LEN)
  assert G.decode._cache_size() == before


def test_stop_tokens_end_rows_early(tiny, greedy_out):
  stop = greedy_out[0][2]
  want = [o[:o.index(stop) + 1] if stop in o else o for o in greedy_out]
  got = G.generate(tiny, PROMPTS, 7, stop_tokens=[stop], max_len=MAX_LEN)
  assert got == want and got[0][-1] == stop and len(got[0]) == 3
  # Every row stops on its first new token: the loop ends after one token.
  firsts = {o[0] for o in greedy_out}
  assert G.generate(tiny, PROMPTS, 7, stop_tokens=firsts, max_len=MAX_LEN) == [
      [o[0]] for o in greedy_out]


def test_generate_with_hidden(tiny, greedy_out):
  """The same rows as generate, and per row the model's final hidden states of prompt and
  new tokens: equal to one forward pass over the whole sequence, also when rows stop early
  (a stop token's own state included) and when every row stops on its first token."""
  graphdef, state = nnx.split(tiny)
  hidden_of = jax.jit(lambda s, t: nnx.merge(graphdef, s).hidden(
      nnx.merge(graphdef, s).embed_tokens(t))[0])
  stop = greedy_out[0][2]
  for stops in ((), (stop,), tuple({o[0] for o in greedy_out})):
    want = G.generate(tiny, PROMPTS, 7, stop_tokens=stops, max_len=MAX_LEN)
    rows, hidden = G.generate_with_hidden(tiny, PROMPTS, 7, stop_tokens=stops,
                                          max_len=MAX_LEN + 1)
    assert rows == want
    # Every whole sequence right-padded into one batch of MAX_LEN (the padding after a
    # row's tokens is never seen by them): one forward pass, one compiled program.
    seqs = np.zeros((len(PROMPTS), MAX_LEN), np.int32)
    for b, (p, r) in enumerate(zip(PROMPTS, rows)):
      seqs[b, :len(p) + len(r)] = p + r
    full_all = np.asarray(hidden_of(state, jnp.asarray(seqs)))
    for p, r, h, full in zip(PROMPTS, rows, hidden, full_all):
      assert h.shape == (len(p) + len(r), TINY.dim) and h.dtype == np.float32
      np.testing.assert_allclose(h, full[:len(p) + len(r)], rtol=2e-4, atol=2e-5)
  with pytest.raises(ValueError, match="max_len=16 slots.*need 17"):
    G.generate_with_hidden(tiny, [[1] * 10], 7, max_len=16)


def test_generate_sampling(tiny, greedy_out):
  key = jax.random.key(3)
  a = G.generate(tiny, PROMPTS, 7, temperature=1.0, top_p=0.95, rng=key, max_len=MAX_LEN)
  b = G.generate(tiny, PROMPTS, 7, temperature=1.0, top_p=0.95, rng=key, max_len=MAX_LEN)
  c = G.generate(tiny, PROMPTS, 7, temperature=1.0, top_p=0.95, rng=jax.random.key(4),
                 max_len=MAX_LEN)
  assert a == b and a != c and a != greedy_out
  # top_k=1 and a tiny top_p keep only the argmax: greedy, through the same compiled loop.
  assert G.generate(tiny, PROMPTS, 7, temperature=1.5, top_k=1, rng=key,
                    max_len=MAX_LEN) == greedy_out
  assert G.generate(tiny, PROMPTS, 7, temperature=1.0, top_p=1e-6, rng=key,
                    max_len=MAX_LEN) == greedy_out


def test_the_smallest_cache_that_fits(tiny, greedy_out):
  """The last new token is never fed back: 9 + 7 - 1 = 15 slots hold the longest row (and
  with_hidden, which feeds it, 16); one slot fewer is refused, never silently dropped."""
  assert G.generate(tiny, PROMPTS, 7, max_len=15) == greedy_out
  assert G.generate_with_hidden(tiny, PROMPTS, 7, max_len=16)[0] == greedy_out
  with pytest.raises(ValueError, match="max_len=14 slots.*needs 15"):
    G.generate(tiny, PROMPTS, 7, max_len=14)
  with pytest.raises(ValueError, match="max_len=15 slots.*need 16"):
    G.generate_with_hidden(tiny, PROMPTS, 7, max_len=15)


def test_generate_errors(tiny):
  with pytest.raises(ValueError, match="pass rng"):
    G.generate(tiny, PROMPTS, 3, temperature=0.5)
  with pytest.raises(ValueError, match="max_len=8 slots.*needs 11"):
    G.generate(tiny, PROMPTS, 3, max_len=8)
  with pytest.raises(ValueError, match=r"prompt 1 has token ids \[256\]"):
    G.generate(tiny, [[1], [256]], 3)
  with pytest.raises(ValueError, match="no empty prompt"):
    G.generate(tiny, [[1], []], 3)
  with pytest.raises(ValueError, match="top_p=0"):
    G.generate(tiny, PROMPTS, 3, temperature=1.0, top_p=0.0, rng=jax.random.key(0))
  with pytest.raises(ValueError, match=r"top_k=2.5; expected an integer"):   # not 2
    G.generate(tiny, PROMPTS, 3, temperature=1.0, top_k=2.5, rng=jax.random.key(0))
  with pytest.raises(ValueError, match=r"stop_tokens \[256, -1\] outside \[0, 256\)"):
    G.generate(tiny, PROMPTS, 3, stop_tokens=[5, 256, -1])
  assert G.generate(tiny, PROMPTS, 0) == [[], [], []]


def test_request_helpers():
  """Padding and stop handling that generate and speculative_generate share."""
  tokens, lengths = G.pad_prompts([[3, 4, 5], [7]])
  np.testing.assert_array_equal(tokens, [[3, 4, 5], [7, 0, 0]])
  np.testing.assert_array_equal(lengths, [3, 1])
  assert tokens.dtype == lengths.dtype == np.int32
  np.testing.assert_array_equal(G.pad_prompts([[1]], 4)[0], [[1, 0, 0, 0]])
  with pytest.raises(ValueError, match="width=1, but the longest prompt has 2"):
    G.pad_prompts([[1, 2]], 1)
  rows = np.array([[5, 2, 9, 2], [1, 1, 1, 1], [4, 4, 2, 8]])
  # Per-row counts, then each row up to and including its first stop id.
  assert G.cut_rows(rows, [4, 2, 1], (2,)) == [[5, 2], [1, 1], [4]]
  assert G.cut_rows(rows, 4, (8, 9)) == [[5, 2, 9], [1, 1, 1, 1], [4, 4, 2, 8]]
  assert G.cut_rows(rows, 3, ()) == [r[:3] for r in rows.tolist()]
  assert G.sampling_settings(0.0, 5, 0.5) is None
  assert [float(x) for x in G.sampling_settings(0.5, 5, 0.9)] == [0.5, 5.0, pytest.approx(0.9)]
  np.testing.assert_array_equal(G.stop_array(()), [-1])
  np.testing.assert_array_equal(G.stop_array((3, 4)), [3, 4])


def test_generate_stays_within_max_seq_len(tiny, greedy_out):
  """Prompt + new tokens may not pass cfg.max_seq_len (the longest prompt has 9 tokens)."""
  short, _ = make_model(TINY.replace(max_seq_len=16))     # the same weights as `tiny`
  assert G.generate(short, PROMPTS, 7, max_len=MAX_LEN) == greedy_out   # 9 + 7 = 16: allowed
  with pytest.raises(ValueError, match=r"longest prompt \(9 tokens\) plus max_new_tokens=8 "
                     r"makes 17 tokens, beyond the model's max_seq_len=16 .*at most 7 new"):
    G.generate(short, PROMPTS, 8)
  with pytest.raises(ValueError, match="max_seq_len=512"):
    G.generate(tiny, [[1] * 500], 13)


@pytest.mark.devices(8)
def test_sharded_generate_equals_single_device():
  model, _ = make_model(TINY_TIED)
  prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [100], [7, 7, 7, 7]]
  want = G.generate(model, prompts, 5, max_len=12)
  mesh = make_mesh("data:2,fsdp:2,tp:2")
  M.shard_model(model, mesh)
  assert model.layers[0].attn.wk[...].sharding.spec == jax.P("fsdp", "tp", None)
  with jax.set_mesh(mesh):
    assert G.generate(model, prompts, 5, max_len=12) == want


# --- sample_logits

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


@jax.jit
def _draw(keys, temperature, top_k, top_p):
  return jax.vmap(lambda k: G.sample_logits(jnp.asarray(LOGITS), k, temperature, top_k,
                                            top_p))(keys)


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _chi2(counts, p):
  n = counts.sum()
  keep = p > 0
  assert counts[~keep].sum() == 0, f"draws outside the support: {counts}"
  return float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())


def _target(temperature, top_k, top_p):
  """Hand-worked sampling distribution over LOGITS (sorted in decreasing order)."""
  p = _softmax(LOGITS.astype(np.float64) / temperature)
  if top_k:
    p[top_k:] = 0
    p /= p.sum()
  before = np.cumsum(p) - p
  p[before >= top_p] = 0                            # nucleus, counted before each token
  return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,support", [
    (1.0, 0, 1.0, 8), (2.0, 0, 1.0, 8), (0.5, 3, 1.0, 3), (1.0, 0, 0.7, 3), (1.0, 4, 0.9, 4)])
def test_sampling_distribution_matches_softmax(temperature, top_k, top_p, support):
  p = _target(temperature, top_k, top_p)
  assert (p > 0).sum() == support
  n = 20000
  draws = np.asarray(_draw(jax.random.split(jax.random.key(0), n), temperature, top_k, top_p))
  counts = np.bincount(draws, minlength=8).astype(np.float64)
  # The 99.9% quantile of chi-square with support - 1 <= 7 degrees of freedom is 24.3.
  assert _chi2(counts, p) < 24.3
  # The test has power: the same support at temperature 1 is rejected.
  if temperature != 1.0:
    assert _chi2(counts, _target(1.0, top_k, top_p)) > 100


def test_sample_logits_greedy_limits_and_reproducibility():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
  greedy = np.argmax(np.asarray(logits), -1)
  np.testing.assert_array_equal(G.sample_logits(logits, None, 0.0), greedy)
  for i in range(5):
    key = jax.random.key(i)
    np.testing.assert_array_equal(G.sample_logits(logits, key, 1.0, 1, 1.0), greedy)
    np.testing.assert_array_equal(G.sample_logits(logits, key, 1.0, 0, 1e-6), greedy)
  key = jax.random.key(9)
  a = G.sample_logits(logits, key, 1.0, 0, 1.0)
  np.testing.assert_array_equal(a, G.sample_logits(logits, key, 1.0, 0, 1.0))
  assert not np.array_equal(a, greedy)
  # Per-row settings: temperature 0 rows are greedy, others sample.
  t = jnp.array([0.0, 5.0, 0.0, 5.0, 0.0, 5.0])
  many = np.stack([np.asarray(G.sample_logits(logits, jax.random.key(i), t)) for i in range(8)])
  assert (many[:, ::2] == greedy[::2]).all() and (many[:, 1::2] != greedy[1::2]).any()
  with pytest.raises(ValueError, match="top_k=-1"):
    G.sample_logits(logits, key, 1.0, -1)


def test_filtered_logits_unrestricted_skips_nothing():
  """No top-k / top-p: the logits / temperature as they are (the sort is skipped); with a
  restricted row in the batch every row goes through the sort, with the same result."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(3, 40)), jnp.float32)
  np.testing.assert_array_equal(G.filtered_logits(logits, 2.0), np.asarray(logits) / 2.0)
  out = np.asarray(G.filtered_logits(logits, 1.0, jnp.array([0, 5, 0]), 1.0))
  np.testing.assert_array_equal(out[[0, 2]], np.asarray(logits)[[0, 2]])
  assert np.isfinite(out[1]).sum() == 5
  np.testing.assert_array_equal(out[1] > -np.inf, np.asarray(logits)[1] >= np.sort(
      np.asarray(logits)[1])[-5])



def test_top_p_1_cuts_nothing_whatever_the_other_rows_ask():
  """top_p = 1 keeps the whole (top-k) support, as transformers (no TopPLogitsWarper then):
  a confident row's tail, whose float32 mass before each token rounds to 1.0, is not cut
  when another row of the batch sets top-k, or a row's distribution would depend on its
  batch."""
  # Tail probabilities e^-17 ~ 4e-8 and less: float32 1 - p(head) is below its spacing.
  peaked = np.array([0.0, -17.0, -17.5, -18.0, -18.5, -19.0, -19.5, -20.0], np.float32)
  logits = jnp.asarray(np.stack([peaked, peaked, LOGITS]))
  alone = np.asarray(G.filtered_logits(logits[:1], 1.0))
  np.testing.assert_array_equal(alone[0], peaked)
  mixed = np.asarray(G.filtered_logits(logits, 1.0, jnp.array([0, 6, 2]), 1.0))
  np.testing.assert_array_equal(mixed[0], peaked)
  # top_k = 6 with top_p = 1: the six best, none of them cut by the nucleus.
  np.testing.assert_array_equal(mixed[1], np.where(np.arange(8) < 6, peaked, -np.inf))
  np.testing.assert_array_equal(mixed[2], np.where(np.arange(8) < 2, LOGITS, -np.inf))



# transformers' sampling warpers in the order `generate(do_sample=True)` builds them
# (generation/utils.py: temperature unless 1, top-k unless 0, top-p unless 1), then softmax.
_HF_WARPERS = """
import sys, numpy as np, torch
from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)
d = np.load(sys.argv[1])
out = []
for t, k, p in d["settings"]:
  s = torch.tensor(d["logits"])
  if t != 1.0: s = TemperatureLogitsWarper(float(t))(None, s)
  if k != 0: s = TopKLogitsWarper(int(k))(None, s)
  if p < 1.0: s = TopPLogitsWarper(float(p))(None, s)
  out.append(torch.softmax(s, -1).numpy())
np.save(sys.argv[2], np.stack(out))
"""


@pytest.mark.peer
def test_sampling_distribution_equals_transformers_warpers(tmp_path):
  """softmax(filtered_logits) against transformers' TemperatureLogitsWarper ->
  TopKLogitsWarper -> TopPLogitsWarper: the same support on every row (random logits
  without ties, whose nucleus boundary transformers counts from the other end, and
  confident rows whose tail is below float32's spacing at 1) and the same probabilities
  to float32 softmax rounding."""
  python = peer_python("HF_PEER_PYTHON")
  if not os.path.exists(python):
    pytest.skip(f"transformers peer environment absent ({python})")
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(200, 60)) * rng.uniform(0.5, 6.0, size=(200, 1))
  logits[:20, 0] += 25.0                  # confident rows
  logits = logits.astype(np.float32)
  settings = np.array([(1.0, 0, 0.9), (0.7, 10, 0.8), (1.3, 5, 1.0), (1.0, 0, 0.5),
                       (0.5, 3, 0.95), (2.0, 60, 0.3), (1.0, 80, 0.99), (1.0, 40, 1.0)])
  np.savez(tmp_path / "in.npz", logits=logits, settings=settings)
  subprocess.run([python, "-c", _HF_WARPERS, str(tmp_path / "in.npz"),
                  str(tmp_path / "hf.npy")], check=True, timeout=300)
  hf = np.load(tmp_path / "hf.npy")
  for (t, k, p), want in zip(settings, hf):
    got = np.asarray(jax.nn.softmax(G.filtered_logits(jnp.asarray(logits), t, int(k), p), -1))
    np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"support, {(t, k, p)}")
    # Probabilities <= 1 from two float32 softmaxes: a few ulps of 1 apart at most.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=f"{(t, k, p)}")


# SmolLM2-135M's shapes, 2 of its 30 blocks (the second reads the first's attention
# output) and a 4096-token vocabulary, in bfloat16: with the prompt attending through the
# whole cache (fresh_cache=False) its logits changed with the cache size (76 slots against
# 83 or 116).
SMOL_BF16 = M.LlamaConfig(vocab_size=4096, dim=576, n_layers=2, n_heads=9, n_kv_heads=3,
                          ffn_dim=1536, rope_theta=1e5, max_seq_len=512, tie_embeddings=True,
                          dtype="bfloat16", param_dtype="bfloat16")


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="the cache-size rule is XLA:CPU's (llm/attention/decode.py)")
def test_bf16_logits_do_not_depend_on_the_cache_size():
  """The prompt's logits and four decode steps', bit for bit, for caches of 40 to 116 slots:
  the prefill attends within the call and a step's sums over the keys are matrix products
  (both: a bfloat16 model's greedy output otherwise changed with max_len)."""
  graphdef, state = nnx.split(M.Llama(SMOL_BF16, nnx.Rngs(0)))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, SMOL_BF16.vocab_size, (1, 12)))

  def logits(max_len):
    @jax.jit
    def run(state):
      m = nnx.merge(graphdef, state)
      h, cache = m.hidden(m.embed_tokens(toks), cache=m.init_cache(1, max_len),
                          fresh_cache=True)
      out = [m.logits(h)]
      for i in range(4):
        lg, cache = m(toks[:, i:i + 1], cache=cache)
        out.append(lg)
      return jnp.concatenate(out, axis=1)
    return np.asarray(run(state))

  want = logits(76)
  for max_len in (40, 83, 116):
    np.testing.assert_array_equal(logits(max_len), want, err_msg=f"max_len={max_len}")


def test_fresh_cache_prefill_equals_the_cache_path(tiny):
  """fresh_cache=True (the prompt attends within the call) gives the cache path's hidden
  states and cache (padding never written); it refuses a mask_BTS and a missing cache."""
  graphdef, state = nnx.split(tiny)
  toks = jnp.asarray([[5, 17, 99, 3, 250, 7], [1, 2, 3, 0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([6, 3], jnp.int32)

  @functools.partial(jax.jit, static_argnums=0)
  def run(fresh):
    m = nnx.merge(graphdef, state)
    return m.hidden(m.embed_tokens(toks), cache=m.init_cache(2, 20), lengths_B=lengths,
                    fresh_cache=fresh)

  (h0, c0), (h1, c1) = run(False), run(True)
  for b, n in enumerate((6, 3)):
    np.testing.assert_allclose(np.asarray(h1[b, :n]), np.asarray(h0[b, :n]), rtol=1e-5,
                               atol=1e-5)
  for a, b in zip(c1.k + c1.v, c0.k + c0.v):    # layers past the first see h's last bits
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(c1.pos), np.asarray(c0.pos))
  np.testing.assert_array_equal(np.asarray(c1.length), np.asarray(c0.length))
  m = nnx.merge(graphdef, state)
  with pytest.raises(ValueError, match="fresh_cache=True needs a cache and no mask_BTS"):
    m.hidden(m.embed_tokens(toks), cache=m.init_cache(2, 20), fresh_cache=True,
             mask_BTS=jnp.ones((2, 6, 20), bool))
  with pytest.raises(ValueError, match="fresh_cache=True needs a cache"):
    m.hidden(m.embed_tokens(toks), fresh_cache=True)
