"""Draft trees against hand-built examples: EAGLE-2 re-ranking, parents, ancestor and slot
masks, children; the target's tree pass equals a plain forward along every path; committing
an accepted path leaves the cache a prefill of that path would."""

from __future__ import annotations

import os

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
  s = len(prompt) + T.slot_span(SHAPE)
  prefill = jax.jit(lambda x: model(x, cache=model.init_cache(1, s))[1])
  cache = prefill(jnp.asarray([prompt]))
  start = jnp.asarray([len(prompt)])
  with pytest.raises(ValueError, match="slots_BT needs a cache and mask_BTS"):
    model(jnp.asarray(tokens)[None], cache=cache, slots_BT=start[:, None] + jnp.arange(6))
  offsets = T.node_slots(jnp.asarray(depths)[None])
  np.testing.assert_array_equal(offsets, [[0, 1, 5, 2, 6, 3]])   # depth + 4 * later in level
  mask = T.slot_mask(jnp.asarray(WANT_ANCESTORS)[None], start, s, offsets)
  logits, cache = jax.jit(lambda c: model(jnp.asarray(tokens)[None], cache=c,
                                          positions_BT=start[:, None] + jnp.asarray(depths)[None],
                                          mask_BTS=mask, slots_BT=start[:, None] + offsets))(cache)
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
  committed = commit(cache, start, jnp.asarray([[0, 1, 3, 5]]), jnp.asarray([3]), offsets)
  ref = prefill(jnp.asarray([prompt + [int(tokens[j]) for j in (0, 1, 3, 5)]]))
  np.testing.assert_array_equal(committed.length, [9])
  np.testing.assert_array_equal(committed.pos, ref.pos)
  for a, b in zip(committed.k + committed.v, ref.k + ref.v):
    np.testing.assert_allclose(np.asarray(a)[:, :9], np.asarray(b)[:, :9], rtol=2e-5, atol=2e-5)
  # A shorter acceptance (root and node 2) empties everything past it.
  short = commit(cache, start, jnp.asarray([[0, 2, 0, 0]]), jnp.asarray([1]), offsets)
  np.testing.assert_array_equal(short.pos[0, :7], np.arange(7))
  assert np.all(np.asarray(short.pos)[0, 7:] == M.SENTINEL_POS)
  np.testing.assert_array_equal(short.k[0][0, 6], cache.k[0][0, 5 + 5])   # node 2's keys


@pytest.mark.parametrize("lanes", [1, 2, 4, 8])
def test_node_slots_keep_lanes_and_order_within_the_span(lanes):
  """Random depth-sorted trees: offsets are distinct, congruent to the depth modulo lanes,
  increase along every path among nodes of one residue, stay below `slot_span` (reached),
  and `slot_mask` puts each node's ancestors at exactly those slots."""
  rng = np.random.default_rng(lanes)
  node_slots = jax.jit(T.node_slots, static_argnums=1)
  ancestors = jax.jit(T.ancestors, static_argnums=1)
  slot_mask = jax.jit(T.slot_mask, static_argnums=2)
  for n, depth in ((2, 1), (5, 2), (7, 3), (9, 5), (25, 5)):
    shape = T.TreeShape(top_k=n, depth=depth, budget=n - 1)
    span, reached = T.slot_span(shape, lanes), 0
    for _ in range(8):
      parents, depths = [-1], [0]
      for i in range(1, n):   # a parent on the deepest level or the one above, within depth
        deepest = max(depths)
        cands = [j for j in range(i) if depths[j] in (deepest - 1, deepest)
                 and depths[j] < depth]
        parents.append(int(rng.choice(cands)))
        depths.append(depths[parents[-1]] + 1)
      order = np.argsort(depths, kind="stable")    # depth-sorted, parents first
      rank = np.argsort(order)
      parents = [-1 if parents[o] < 0 else int(rank[parents[o]]) for o in order]
      depths = [depths[o] for o in order]
      off = np.asarray(node_slots(jnp.asarray([depths]), lanes))[0]
      assert len(set(off.tolist())) == n
      assert all((o - d) % lanes == 0 for o, d in zip(off, depths))
      for i in range(n):
        j = parents[i]
        while j >= 0:
          if (depths[i] - depths[j]) % lanes == 0:
            assert off[j] < off[i], (depths, parents, off)
          j = parents[j]
      reached = max(reached, int(off.max()) + 1)
      assert reached <= span, (n, depth, off, span)
      anc = ancestors(jnp.asarray([parents]), depth)
      mask = np.asarray(slot_mask(anc, jnp.asarray([3]), 3 + span + 2,
                                  jnp.asarray(off)[None]))[0]
      anc = np.asarray(anc)
      for i in range(n):
        for s in range(3 + span + 2):
          at = [j for j in range(n) if 3 + off[j] == s]
          assert mask[i, s] == (bool(anc[0, i, at[0]]) if at else True), (i, s)
  # A star (every node a child of the root) reaches the bound of a depth-1 shape; a chain
  # needs no more slots than nodes, a 4:3:6 tree's first level is at most 4 wide.
  star = np.asarray(node_slots(jnp.asarray([[0] + [1] * 6]), lanes))[0]
  assert int(star.max()) + 1 == T.slot_span(T.TreeShape(top_k=6, depth=1, budget=6), lanes)
  chain = np.asarray(node_slots(jnp.asarray([[0, 1, 2, 3, 4]]), lanes))[0]
  np.testing.assert_array_equal(chain, np.arange(5))
  assert T.slot_span(T.TreeShape(top_k=1, depth=4, budget=4), lanes) == 5
  wide = [0, 1, 1, 1, 1, 2, 2]
  off = np.asarray(node_slots(jnp.asarray([wide]), lanes))[0]
  assert int(off.max()) < T.slot_span(T.TreeShape(top_k=4, depth=3, budget=6), lanes)


def product_sums_by_lanes(rows: int, lanes: int) -> bool:
  """Whether this XLA:CPU runs the decode attention's product over the keys (batched
  [b, g] x [r, S] x [S, K + 1], `decode_attention_matmul`) with the same partial sums for 3
  query rows as for `rows`, a term's partial sum fixed by its slot modulo `lanes`: what
  `tree.node_slots` relies on for bit-equal verification."""
  rng = np.random.default_rng(0)
  prod = jax.jit(lambda p, v: jnp.einsum("btgrs,bsgk->btgrk", p, v))
  s, start = 128, 45
  p = np.zeros((1, rows // 3, 3, 3, s), np.float32)
  p[..., :start + 1] = rng.random(p[..., :start + 1].shape)
  v = rng.standard_normal((1, s, 3, 65)).astype(np.float32)
  base = np.asarray(prod(p, v))
  moved_p, moved_v = p.copy(), v.copy()
  moved_p[..., start + lanes], moved_p[..., start] = p[..., start], 0.0
  moved_v[:, start + lanes] = v[:, start]
  one_row = np.asarray(prod(p[:, :1], v))
  return bool((np.asarray(prod(moved_p, moved_v)) == base).all()
              and (one_row[:, 0] == base[:, 0]).all())


def pinned_jax() -> str:
  """The jax version CI and the GPU machines pin (.ci/constraints.txt)."""
  path = os.path.join(os.path.dirname(__file__), "..", "..", "..", ".ci", "constraints.txt")
  with open(path) as f:
    return next(line.split("==")[1].strip() for line in f if line.startswith("jax=="))


def require_lanes(rows: int, lanes: int) -> None:
  """Skips the calling test, with the reason, where this XLA:CPU's product routine groups
  the terms of `rows` query rows otherwise than `product_sums_by_lanes` needs; under the
  pinned jax (CI's) the routine is known to, so there the test fails instead of skipping."""
  if product_sums_by_lanes(rows, lanes):
    return
  why = (f"this XLA:CPU's product routine does not sum 3 and {rows} query rows in {lanes} "
         "slot lanes alike (llm/speculative/tree.py)")
  if jax.__version__ == pinned_jax():
    pytest.fail(f"{why}, under the pinned jax {jax.__version__}, where it must")
  pytest.skip(why)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="the partial sums are XLA:CPU's product routine's")
def test_a_node_at_its_slot_attends_as_a_plain_step_bit_for_bit():
  """Float32 decode attention (llm.attention "auto", SmolLM2's 9 query / 3 KV heads) of a
  tree's 8 queries with the nodes' keys at `node_slots`, against one query per node over
  the prefix and the node's path in consecutive slots (the plain step): every node's output
  bit for bit. (With the nodes in consecutive slots, most nodes past the first child of a
  level come out different in the last bits on XLA:CPU.)"""
  from llm.attention import attention
  parents = [-1, 0, 0, 0, 1, 2, 3, 5]
  depths = [0, 1, 1, 1, 2, 2, 2, 3]
  n, s, start, h, g, k = 8, 128, 45, 9, 3, 64
  require_lanes(3 * n, T.SLOT_LANES)
  rng = np.random.default_rng(0)
  q = rng.standard_normal((n, h, k)).astype(np.float32)
  kn, vn = (rng.standard_normal((n, g, k)).astype(np.float32) for _ in range(2))
  kp, vp = (rng.standard_normal((start, g, k)).astype(np.float32) for _ in range(2))
  attend = jax.jit(lambda q, kc, vc, qpos, kvpos, mask: attention(
      q, kc, vc, impl="auto", mask=mask, causal=True, q_positions=qpos, kv_positions=kvpos)[0])

  def cache(rows):   # prefix, then rows {slot: node}
    kc, vc = np.zeros((1, s, g, k), np.float32), np.zeros((1, s, g, k), np.float32)
    pos = np.full((1, s), M.SENTINEL_POS, np.int32)
    kc[0, :start], vc[0, :start], pos[0, :start] = kp, vp, np.arange(start)
    for slot, node in rows.items():
      kc[0, slot], vc[0, slot], pos[0, slot] = kn[node], vn[node], start + depths[node]
    return jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(pos)

  off = np.asarray(T.node_slots(jnp.asarray([depths])))[0]
  kc, vc, pos = cache({start + int(o): i for i, o in enumerate(off)})
  anc = T.ancestors(jnp.asarray([parents]), 3)
  qpos = jnp.asarray([[start + d for d in depths]])
  tree = np.asarray(attend(jnp.asarray(q)[None], kc, vc, qpos, pos,
                           T.slot_mask(anc, jnp.asarray([start]), s, jnp.asarray(off)[None])))
  for i in range(n):
    path, j = [], i
    while j >= 0:
      path.insert(0, j)
      j = parents[j]
    kc, vc, pos = cache({start + d: node for d, node in enumerate(path)})
    plain = np.asarray(attend(jnp.asarray(q[i])[None, None], kc, vc, qpos[:, i:i + 1], pos,
                              jnp.ones((1, 1, s), bool)))
    np.testing.assert_array_equal(tree[0, i], plain[0, 0], err_msg=f"node {i}")
