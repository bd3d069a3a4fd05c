"""Speculative decoding end to end: greedy output equals plain greedy decoding token for token
(several prompts of different lengths in one batch, chain / tree / wide-tree shapes, stop
tokens, a distilled and an untrained draft head); sampling reproduces the target's
distribution over the first three new tokens (slow)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from llm import generate as G
from llm.model import Llama
from llm.speculative import DraftHead, TreeShape, speculative_generate
from llm.speculative.decode import cache_slots
from llm.speculative.draft import cast_head
from tests.llm.speculative.conftest import CFG, V

PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 6, 0, 2, 5, 1], [4, 4]]
N_NEW = 24
# A chain, a pruned tree, and a tree holding every 2-token continuation (top_k = V), so
# each round accepts at least 2 drafted tokens whatever the draft, sometimes 3.
SHAPES = [TreeShape(1, 3, 3), TreeShape(4, 3, 10), TreeShape(V, 3, V + 2 * V * V)]
MAX_LEN = max(cache_slots(7, N_NEW, s) for s in SHAPES)   # one prefill program for all


@pytest.fixture(scope="module")
def greedy(target):
  return G.generate(target, PROMPTS, N_NEW)


def _check_rounds(out, shape, n_new, stopped=()):
  """The per-round log against the tokens returned and the counters: each row's first token
  comes from the prefill and round k adds a_k + 1 (accepted drafts and the bonus); a row
  runs rounds until it has n_new tokens (or emitted a stop token in `stopped` rows) and
  not one round more. EAGLE's counts recomputed from the log."""
  logs = out.accepted_per_round
  for r, (toks, log) in enumerate(zip(out.tokens, logs)):
    assert len(log) == out.rounds[r] >= 1 and sum(log) == out.accepted[r], r
    assert all(0 <= a <= shape.depth for a in log), (r, log)
    made = 1 + sum(a + 1 for a in log)
    before_last = made - (log[-1] + 1)
    if r in stopped:
      assert before_last < len(toks) <= made, (r, log, len(toks))
    else:
      assert len(toks) == n_new and before_last < n_new <= made, (r, log)
  assert out.tokens_per_call == pytest.approx(   # pooled over rows, as accept_length
      sum(map(len, out.tokens)) / sum(1 + len(log) for log in logs), rel=1e-12)
  assert out.accept_length == pytest.approx(
      sum(a + 1 for log in logs for a in log) / sum(len(log) for log in logs), rel=1e-12)
  assert out.loop_rounds == max(len(log) for log in logs)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_equals_plain_greedy(target, draft, greedy, shape):
  out = speculative_generate(target, draft, PROMPTS, N_NEW, shape=shape, max_len=MAX_LEN)
  assert out.tokens == greedy
  assert all(len(t) == N_NEW for t in out.tokens)
  _check_rounds(out, shape, N_NEW)
  if shape.top_k == V:
    # The tree holds every 2-token continuation: each round accepts at least 2 drafts.
    assert all(a >= 2 for log in out.accepted_per_round for a in log)
    assert out.accept_length > 3.0
  # The distilled head gets drafts accepted; in a pruned tree rows advance by different
  # amounts in the same batch.
  assert out.accept_length > 2.0
  if shape.top_k < V:
    assert len(set((out.accepted / out.rounds).round(3).tolist())) > 1


def test_untrained_draft_head(target, draft, greedy):
  """A random head's drafts are accepted less often (accept length 1.71 against the distilled
  head's 3.35 here); the output is still the target's. (Same graph and shardings as the
  distilled head's: the decode program compiled above is reused.)"""
  graphdef, state = nnx.split(draft)
  fresh = nnx.state(DraftHead(CFG, nnx.Rngs(5)))
  untrained = nnx.merge(graphdef, jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                                               fresh, state))
  out = speculative_generate(target, untrained, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN)
  trained = speculative_generate(target, draft, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN)
  assert out.tokens == greedy
  _check_rounds(out, SHAPES[1], N_NEW)
  assert out.accept_length < trained.accept_length - 0.3, (out.accept_length,
                                                           trained.accept_length)


def test_stop_tokens(target, draft, greedy):
  stop = 6          # row 0 stops after 14 tokens, row 3 after 2; rows 1 and 2 never
  want = [g[:g.index(stop) + 1] if stop in g else g for g in greedy]
  got = speculative_generate(target, draft, PROMPTS, N_NEW, shape=SHAPES[1], stop_tokens=[stop],
                             max_len=MAX_LEN)
  assert got.tokens == want and [len(t) for t in want] == [14, N_NEW, N_NEW, 2]
  _check_rounds(got, SHAPES[1], N_NEW, stopped=(0, 3))


def test_draft_vocab(target, draft, greedy):
  """A reduced draft vocabulary (EAGLE-3's): the draft proposes only those tokens (a node
  outside it is never drafted: only the bonus can be one), the output is still the target's;
  the whole vocabulary as draft vocabulary drafts exactly what no draft vocabulary does."""
  vocab = np.array([0, 2, 4, 6], np.int32)
  out = speculative_generate(target, draft, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN,
                             draft_vocab=vocab)
  assert out.tokens == greedy
  _check_rounds(out, SHAPES[1], N_NEW)
  # Tokens emitted by accepted drafts (all but the bonus of each round) lie in the vocabulary.
  for row, log in zip(out.tokens, out.accepted_per_round):
    at = 1
    for a in log:
      assert set(row[at:at + a]) <= set(vocab.tolist()), (row, log)
      at += a + 1
  full = speculative_generate(target, draft, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN,
                              draft_vocab=np.arange(V))
  plain = speculative_generate(target, draft, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN)
  assert full.accepted_per_round == plain.accepted_per_round and full.tokens == greedy
  for bad in (np.array([0, 9, 1, 2]), np.array([0, 0, 1, 2]), np.array([1, 2]),
              np.array([[0, 1, 2, 3]])):
    with pytest.raises(ValueError, match="draft_vocab of shape"):
      speculative_generate(target, draft, PROMPTS, 3, shape=SHAPES[1], draft_vocab=bad)


def test_errors(target, draft):
  with pytest.raises(ValueError, match="pass rng"):
    speculative_generate(target, draft, PROMPTS, 3, shape=SHAPES[0], temperature=0.5)
  with pytest.raises(ValueError, match=r"max_len=10 slots.*need 15"):
    speculative_generate(target, draft, [[1]], 10, shape=SHAPES[0], max_len=10)
  with pytest.raises(ValueError, match=r"prompt 1 has token ids \[8\]"):
    speculative_generate(target, draft, [[1], [8]], 3, shape=SHAPES[0])
  wrong = nnx.eval_shape(lambda: DraftHead(CFG.replace(vocab_size=16), nnx.Rngs(0)))
  with pytest.raises(ValueError, match="vocab 16"):
    speculative_generate(target, wrong, PROMPTS, 3, shape=SHAPES[0])
  assert speculative_generate(target, draft, PROMPTS, 0, shape=SHAPES[0]).tokens == [[]] * 4


@pytest.mark.parametrize("prompts,n_new,kw", [
    ([[1], []], 3, {}),
    ([[1], [8]], 3, {}),
    ([[1] * 500], 13, {}),
    (PROMPTS, -1, {}),
    (PROMPTS, 3, {"temperature": 0.5}),
    (PROMPTS, 3, {"temperature": 1.0, "top_p": 0.0, "rng": jax.random.key(0)}),
    (PROMPTS, 3, {"stop_tokens": [3, 8]}),
], ids=["empty", "vocab", "max_seq_len", "negative", "rng", "top_p", "stop_ids"])
def test_refuses_what_generate_refuses(target, draft, prompts, n_new, kw):
  """One request check for both: the same requests refused with the same message."""
  with pytest.raises(ValueError) as plain:
    G.generate(target, prompts, n_new, **kw)
  with pytest.raises(ValueError) as spec:
    speculative_generate(target, draft, prompts, n_new, shape=SHAPES[0], **kw)
  assert str(spec.value) == str(plain.value).replace("generate:", "speculative_generate:", 1)


@functools.partial(jax.jit, static_argnums=0)
def _next_probs(graphdef, state, seqs_NT, temperature, top_k):
  """The target's sampling distribution after every prefix of every sequence [N,T,V]."""
  logits = nnx.merge(graphdef, state)(seqs_NT)[0]
  return jax.nn.softmax(G.filtered_logits(logits, temperature, top_k, 1.0), axis=-1)


def _lumped_pvalue(counts, p, min_expected=5.0):
  """Chi-square p-value, cells expected below min_expected lumped into one."""
  n = counts.sum()
  assert counts[p == 0].sum() == 0, "draws outside the support"
  big = n * p >= min_expected
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(n * p[big], n * p[~big].sum())
  keep = exp > 0
  stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
  return stats.chi2.sf(stat, keep.sum() - 1)


@pytest.mark.slow   # ~20 s (3000 rows); the acceptance rule itself: test_accept.py (fast)
def test_sampling_reproduces_the_target_distribution(target, draft):
  """3000 rows of one prompt at temperature 0.8 with top_k 6: the joint of the first two new
  tokens and the marginal of the third (drawn in later rounds, after KV commits) match the
  target's exact distributions, computed by full forwards over every continuation. False
  failures: each fit assertion fails under a correct sampler with probability 1e-3 (its
  p-value threshold), both together below 2e-3 for a random key (the key is fixed)."""
  prompt, n, temperature, top_k = [1, 2, 3], 3000, 0.8, 6
  out = speculative_generate(target, draft, [prompt] * n, 3, shape=TreeShape(2, 2, 4),
                             temperature=temperature, top_k=top_k, rng=jax.random.key(7))
  got = np.array(out.tokens)
  assert got.shape == (n, 3) and out.accepted.sum() > 0.3 * out.rounds.sum()
  # One forward over prompt + (a, b) for every a, b: p(x1), p(x2 | a), p(x3 | a, b).
  seqs = [prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)]
  probs = np.asarray(_next_probs(*nnx.split(target), jnp.asarray(seqs, jnp.int32), temperature,
                                 top_k), np.float64).reshape(V, V, len(prompt) + 2, V)
  p1, p2, p3 = probs[0, 0, -3], probs[:, 0, -2], probs[:, :, -1].reshape(V * V, V)
  joint12 = p1[:, None] * p2
  marg3 = (joint12.reshape(-1)[:, None] * p3).sum(0)
  assert _lumped_pvalue(np.bincount(got[:, 0] * V + got[:, 1], minlength=V * V),
                        joint12.reshape(-1)) > 1e-3
  counts3 = np.bincount(got[:, 2], minlength=V)
  assert _lumped_pvalue(counts3, marg3) > 1e-3
  # Power: the third token's marginal is not the second token's.
  marg2 = joint12.sum(0)
  assert np.all(marg2[counts3 > 0] > 0) and _lumped_pvalue(counts3, marg2) < 1e-6


def test_a_head_with_taps(target, greedy):
  """A head that also reads the target's block states (EAGLE-3's fused features): the prefill
  hands it the prompt's states (its root feature equals the head run by hand over them),
  greedy output is still the target's, and the taps change the drafts (the same head with
  their input weights zeroed is accepted differently)."""
  from llm.speculative import decode as dec
  head = DraftHead(CFG, nnx.Rngs(7), taps=(0, 1))
  d = CFG.dim
  head.fc[...] = head.fc[...].at[2 * d:].multiply(8.0)        # the taps weigh in
  prompt = jnp.asarray([PROMPTS[2]], jnp.int32)
  tg, ts = nnx.split(target)
  dg, ds = nnx.split(head)
  root, h_root, *_ = dec.prefill(tg, ts, dg, ds, prompt, jnp.asarray([prompt.shape[1]]),
                                 jax.random.key(0), None, max_len=MAX_LEN)

  @jax.jit
  def by_hand(prompt, root):
    h, _, taps = target.hidden(target.embed_tokens(prompt), taps=(0, 1))
    nxt = jnp.concatenate([prompt[:, 1:], root[:, None]], axis=1)
    return head(h, target.embed_tokens(nxt), taps_BTK=taps)[0][:, -1]

  want = by_hand(prompt, root)
  np.testing.assert_allclose(h_root, want, rtol=1e-5, atol=1e-5)
  out = speculative_generate(target, head, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN)
  assert out.tokens == greedy
  _check_rounds(out, SHAPES[1], N_NEW)
  blind = nnx.merge(dg, ds)
  blind.fc[...] = blind.fc[...].at[2 * d:].set(0.0)
  other = speculative_generate(target, blind, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN)
  assert other.tokens == greedy
  assert other.accepted_per_round != out.accepted_per_round


def test_a_bfloat16_copy_of_the_head(target, draft, greedy):
  """`cast_head`: a bfloat16 copy of a trained float32 head (every weight and its arithmetic
  in bfloat16; the original untouched; taps kept) predicts the features the float32 head
  does to bfloat16 accuracy, and decodes the float32 target's greedy output unchanged."""
  bf = cast_head(draft, jnp.bfloat16)
  assert bf.cfg.dtype == bf.cfg.param_dtype == "bfloat16" and bf.taps == draft.taps
  leaves = jax.tree.leaves(nnx.state(bf, nnx.Param))
  assert leaves and {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(nnx.state(draft, nnx.Param))} == {
      jnp.dtype(jnp.float32)}
  assert cast_head(draft, "float32") is draft
  rng = np.random.default_rng(0)

  @jax.jit
  def both(prompt, nxt):
    h = target.hidden(target.embed_tokens(prompt))[0]
    e = target.embed_tokens(nxt)
    return draft(h, e)[0], bf(h, e)[0]

  want, got = both(jnp.asarray([PROMPTS[2]]),
                   jnp.asarray([rng.integers(0, V, len(PROMPTS[2]))]))
  assert got.dtype == jnp.bfloat16
  # bfloat16 keeps 8 significant bits (relative rounding 2**-9 per operation); a dozen
  # roundings in sequence through one block, on RMS-normalized outputs of size ~1.
  err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
  assert 0 < err < 0.03, err
  out = speculative_generate(target, bf, PROMPTS, N_NEW, shape=SHAPES[1], max_len=MAX_LEN)
  assert out.tokens == greedy
  _check_rounds(out, SHAPES[1], N_NEW)
  with pytest.raises(ValueError, match="cast_head: dtype=float16; expected float32 or "
                     "bfloat16"):
    cast_head(draft, jnp.float16)
  taps = cast_head(DraftHead(CFG, nnx.Rngs(1), taps=(1,)), "bfloat16")
  assert taps.taps == (1,) and taps.fc[...].shape == (3 * CFG.dim, CFG.dim)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="bit-equal rows rest on XLA:CPU's decode attention "
                           "(llm/attention/decode.py) and its product routine")
def test_bf16_tree_verification_equals_plain_steps_bit_for_bit():
  """A bfloat16 target (SmolLM2's shapes, 2 blocks) verifying an 8-node tree in one pass,
  with the nodes at `tree.node_slots` in a cache of another size, computes at every node
  the logits of the plain decode step that feeds that node's path, bit for bit (second and
  third children included, whose keys sit past their siblings'), in a batch of one and of
  two (whose 16 rows XLA:CPU runs through other routines: `model.sum_last`); the committed
  path's keys and values are the plain steps'. What makes greedy speculative decoding of a
  bfloat16 model return plain decoding's tokens. (A float32 step's one-row products run XLA:CPU's
  matrix-vector routine, the tree's rows a matrix product: equal to about 1e-6, not in bits;
  the attention's own sums are bit-equal in both: test_tree.py.)"""
  from llm.speculative import tree as tree_lib
  from llm.speculative.decode import commit_path
  from tests.llm.speculative.test_tree import require_lanes
  from tests.llm.test_generate import SMOL_BF16
  nodes = 8
  require_lanes(3 * nodes, tree_lib.SLOT_LANES)
  cfg = SMOL_BF16
  graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(0)))
  rng = np.random.default_rng(1)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 13)))
  parents = [-1, 0, 0, 0, 1, 2, 3, 5]
  depths = [0, 1, 1, 1, 2, 2, 2, 3]
  parents_BN, depths_BN = jnp.asarray([parents]), jnp.asarray([depths])
  tokens = [int(t) for t in rng.integers(0, cfg.vocab_size, nodes)]

  @functools.partial(jax.jit, static_argnums=0)
  def prefill(max_len, state):
    m = nnx.merge(graphdef, state)
    _, cache = m.hidden(m.embed_tokens(prompt), cache=m.init_cache(1, max_len),
                        fresh_cache=True)
    return cache

  @jax.jit
  def step(state, cache, tok):
    logits, cache = nnx.merge(graphdef, state)(tok[None, None], cache=cache)
    return logits[0, 0], cache

  @jax.jit
  def verify(state, cache, tokens_BN):
    m = nnx.merge(graphdef, state)
    start, shape = cache.length, tokens_BN.shape
    depths = jnp.broadcast_to(depths_BN, shape)
    offsets = tree_lib.node_slots(depths)
    mask = tree_lib.slot_mask(tree_lib.ancestors(jnp.broadcast_to(parents_BN, shape), 3),
                              start, cache.max_len, offsets)
    h, cache = m.hidden(m.embed_tokens(tokens_BN), positions_BT=start[:, None] + depths,
                        cache=cache, slots_BT=start[:, None] + offsets, mask_BTS=mask)
    return m.logits(h), cache, offsets

  def path_to(node):
    return [] if node < 0 else path_to(parents[node]) + [node]

  plain_logits, plain_cache = {}, {}
  for node in range(nodes):
    cache = prefill(40, state)
    for n in path_to(node):
      logits, cache = step(state, cache, jnp.asarray(tokens[n]))
    plain_logits[node], plain_cache[node] = np.asarray(logits), cache
  start = prefill(40, state).length
  tree_cache = prefill(40 + tree_lib.slot_span(TreeShape(3, 3, nodes - 1)), state)
  got, cache, offsets = verify(state, tree_cache, jnp.asarray([tokens]))
  got2, _, _ = verify(state, jax.tree.map(lambda a: jnp.concatenate([a, a]), tree_cache),
                      jnp.asarray([tokens, tokens]))
  assert sorted(np.asarray(offsets)[0].tolist()) != list(range(nodes))   # not contiguous
  for node in range(nodes):
    for b, rows in ((0, got), (0, got2), (1, got2)):
      np.testing.assert_array_equal(np.asarray(rows[b, node]), plain_logits[node],
                                    err_msg=f"node {node} (depth {depths[node]}), row {b} of "
                                            f"{rows.shape[0]}")
  committed = commit_path(cache, start, jnp.asarray([path_to(7)]), jnp.asarray([3]), offsets)
  ref = plain_cache[7]
  n = int(ref.length[0])
  np.testing.assert_array_equal(committed.length, ref.length)
  np.testing.assert_array_equal(np.asarray(committed.pos)[:, :n], np.asarray(ref.pos)[:, :n])
  for a, b in zip(committed.k + committed.v, ref.k + ref.v):
    np.testing.assert_array_equal(np.asarray(a)[:, :n], np.asarray(b)[:, :n])
