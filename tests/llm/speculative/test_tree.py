"""Draft trees against hand-built examples: EAGLE-2 re-ranking, parents, ancestor and slot
masks, children; the target's tree pass equals a plain forward along every path; committing
an accepted path leaves the cache a prefill of that path would."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm import model as M
from llm.config import get_config
from llm.speculative import decode as D
from llm.speculative import tree as T
from tests.llm.test_model import make_model

SHAPE = T.TreeShape(top_k=2, depth=3, budget=5)
# Pool (depth-major): depth 1 [0, 1]; depth 2 [2, 3] under 0, [4, 5] under 1; depth 3: the
# depth-2 frontier is {2, 4} (best two values), [6, 7] under 2 and [8, 9] under 4.
POOL_TOK = [10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
POOL_PAR = [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
POOL_VAL = [-0.1, -0.5, -0.3, -1.0, -0.6, -2.0, -0.4, -3.0, -0.7, -0.9]
# Top 5 by value: pool 0 (-0.1), 2 (-0.3), 6 (-0.4), 1 (-0.5), 4 (-0.6), kept in pool order.
WANT_TOKENS = [99, 10, 11, 20, 22, 30]
WANT_PARENTS = [-1, 0, 0, 1, 2, 3]
WANT_DEPTHS = [0, 1, 1, 2, 2, 3]
WANT_ANCESTORS = np.array([  # [i, j]: j is i or an ancestor of i
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 0, 1, 0, 1, 0],
    [1, 1, 0, 1, 0, 1]], bool)
WANT_CHILDREN = [[1, 2], [3, -1], [4, -1], [5, -1], [-1, -1], [-1, -1]]


def test_tree_shape():
  assert SHAPE.pool_size == 10 and SHAPE.nodes == 6
  assert T.TreeShape.parse("4:5:24") == T.TreeShape(4, 5, 24)
  assert T.TreeShape.parse("chain:4") == T.TreeShape(1, 4, 4)
  np.testing.assert_array_equal(T.pool_depths(SHAPE), [1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
  with pytest.raises(ValueError, match="budget=11 exceeds the 10 nodes"):
    T.TreeShape(2, 3, 11)
  with pytest.raises(ValueError, match="top_k=0"):
    T.TreeShape(0, 3, 1)
  with pytest.raises(ValueError, match="expected TOP_K:DEPTH:BUDGET"):
    T.TreeShape.parse("4x5")


def test_select_tree_masks_and_children_by_hand():
  # Row 1: every value ties, so the lowest pool indices win (parents before children).
  tok = jnp.asarray([POOL_TOK, POOL_TOK])
  val = jnp.asarray([POOL_VAL, [0.0] * 10])
  par = jnp.asarray([POOL_PAR, POOL_PAR])
  tokens, parents, depths = jax.jit(T.select_tree, static_argnums=4)(jnp.asarray([99, 98]),
                                                                      tok, val, par, SHAPE)
  np.testing.assert_array_equal(tokens, [WANT_TOKENS, [98, 10, 11, 20, 21, 22]])
  np.testing.assert_array_equal(parents, [WANT_PARENTS, [-1, 0, 0, 1, 1, 2]])
  np.testing.assert_array_equal(depths, [WANT_DEPTHS, [0, 1, 1, 2, 2, 2]])
  anc = np.asarray(jax.jit(T.ancestors, static_argnums=1)(parents, SHAPE.depth))
  children = np.asarray(jax.jit(T.children, static_argnums=1)(parents, SHAPE.top_k))
  np.testing.assert_array_equal(anc[0], WANT_ANCESTORS)
  np.testing.assert_array_equal(anc[1], np.array([
      [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
      [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]], bool))
  np.testing.assert_array_equal(children[0], WANT_CHILDREN)
  np.testing.assert_array_equal(children[1],
                                [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [-1, -1]])
  # Slot mask: row 0's tree in slots [3, 9), row 1's in [5, 11) of 12 slots.
  mask = np.asarray(jax.jit(T.slot_mask, static_argnums=2)(jnp.asarray(anc),
                                                          jnp.asarray([3, 5]), 12))
  assert mask.shape == (2, 6, 12)
  for b, start in enumerate((3, 5)):
    for i in range(6):
      for s in range(12):
        inside = start <= s < start + 6
        assert mask[b, i, s] == (anc[b, i, s - start] if inside else True), (b, i, s)


@pytest.fixture(scope="module")
def tiny():
  return make_model(get_config("tiny"))[0]


def test_tree_pass_equals_plain_forward_per_path_and_commit(tiny):
  """Every node's logits from one masked pass over the tree (cache, tree positions) equal a
  plain forward of prompt + its path; committing path 0-1-3-5 leaves what prefilling
  prompt + that path leaves."""
  model = tiny    # attention_impl "auto": the masked calls run as per-query "xla_decode"
  prompt = [5, 17, 99, 3, 250]
  tokens = np.asarray(WANT_TOKENS)
  parents = np.asarray(WANT_PARENTS)
  depths = np.asarray(WANT_DEPTHS)
  s = 16
  prefill = jax.jit(lambda x: model(x, cache=model.init_cache(1, s))[1])
  cache = prefill(jnp.asarray([prompt]))
  start = jnp.asarray([len(prompt)])
  mask = T.slot_mask(jnp.asarray(WANT_ANCESTORS)[None], start, s)
  logits, cache = jax.jit(lambda c: model(jnp.asarray(tokens)[None], cache=c,
                                          positions_BT=start[:, None] + jnp.asarray(depths)[None],
                                          mask_BTS=mask))(cache)
  # Every root-to-node path, right-padded into one batch (padding after is never seen).
  seqs = np.zeros((len(tokens), len(prompt) + SHAPE.depth + 1), np.int32)
  for i in range(len(tokens)):
    path, node = [], i
    while node >= 0:
      path.insert(0, int(tokens[node]))
      node = int(parents[node])
    seqs[i, :len(prompt) + len(path)] = prompt + path
  full = np.asarray(jax.jit(lambda x: model(x)[0])(jnp.asarray(seqs)))
  for i in range(len(tokens)):
    np.testing.assert_allclose(np.asarray(logits[0, i]), full[i, len(prompt) + depths[i]],
                               rtol=2e-5, atol=2e-5)
  # Commit the path root -> 1 -> 3 -> 5 (3 accepted), and compare with a prefill.
  commit = jax.jit(D.commit_path)
  committed = commit(cache, start, jnp.asarray([[0, 1, 3, 5]]), jnp.asarray([3]))
  ref = prefill(jnp.asarray([prompt + [int(tokens[j]) for j in (0, 1, 3, 5)]]))
  np.testing.assert_array_equal(committed.length, [9])
  np.testing.assert_array_equal(committed.pos, ref.pos)
  for a, b in zip(committed.k + committed.v, ref.k + ref.v):
    np.testing.assert_allclose(np.asarray(a)[:, :9], np.asarray(b)[:, :9], rtol=2e-5, atol=2e-5)
  # A shorter acceptance (root and node 2) empties everything past it.
  short = commit(cache, start, jnp.asarray([[0, 2, 0, 0]]), jnp.asarray([1]))
  np.testing.assert_array_equal(short.pos[0, :7], np.arange(7))
  assert np.all(np.asarray(short.pos)[0, 7:] == M.SENTINEL_POS)
  np.testing.assert_array_equal(short.k[0][0, 6], cache.k[0][0, 5 + 2])   # node 2's keys
