"""Draft trees with static shapes: the EAGLE-2 expansion (arXiv 2406.16858), masks, positions.

A `TreeShape(top_k, depth, budget)` fixes every shape under jit. The draft expands the root's
top_k children (depth 1); at each further depth it expands the top_k nodes of the previous
depth with the highest value (the draft's log-probability of the whole path, its estimate of
the path being accepted), top_k children each, so a pool holds

    top_k + (depth - 1) * top_k**2     candidates (`TreeShape.pool_size`),

laid out depth-major: depth 1 at [0, K), then K*K per depth in parent-major order. The
`budget` candidates of highest value, with the root, are the tree the target verifies (EAGLE-2's
re-ranking). A child's value is its parent's plus a log-probability <= 0 and its pool index
is larger, and `lax.top_k` breaks ties toward the lower index, so the selection always holds
a node's parent: it is a tree. Selected nodes keep pool order, so every parent comes before
its children and nodes are sorted by depth.

A tree of N = budget + 1 nodes (node 0: the root, the last token sampled from the target)
is `tokens [B,N]`, `parents [B,N]` (-1 at the root) and `depths [B,N]`. Node i sits at
position `start + depths[i]` and sees the cached prefix by position and, of the other
nodes, only its ancestors (`ancestors`): written into cache slots start + `node_slots`,
that is the [B,N,S] mask `slot_mask` builds for `llm.attention`'s `mask`.

Slot layout (`node_slots`): a node's key goes to a slot congruent to start + depth modulo
`SLOT_LANES`, after its ancestors of the same residue (a chain's at start + depth).
XLA:CPU's product routines (jax 0.11), which the decode attention's sums over the keys run
as (`llm.attention.decode`), add the term of slot s into partial sum s mod 4 and add the
partial sums at the end, so a node then sees its prefix and ancestors in the partial sums,
and in the order, in which the plain decoding step at its position sees the same keys:
verification gives that step's bits (with `llm.model.sum_last`'s norms, whatever the batch).
A routine that groups terms otherwise can still part them in the last bit: jax 0.12's XLA:CPU
runs these float32 products as YNNPACK fusions whose partial sums for a row change with the
number of rows beside it (and its exp's bits with the array's shape), so there a node's
logits differ from the plain step's in last bits, and a bfloat16 model's greedy choices can
part at near ties (tests/llm/speculative/test_tree.py `require_lanes` probes the routine).

A chain (plain speculative decoding with one candidate per step) is TreeShape(1, d, d).

Letters: B batch, N tree nodes, P pool candidates, K top_k, S cache slots, T queries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from llm.speculative.draft import write_slots


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """Static draft-tree shape: top_k children per expanded node (and nodes expanded per
  depth), depth draft steps, budget drafted nodes verified."""

  top_k: int
  depth: int
  budget: int

  def __post_init__(self):
    for name in ("top_k", "depth", "budget"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"TreeShape: {name}={v!r}, expected an integer >= 1 ({self})")
    if self.budget > self.pool_size:
      raise ValueError(f"TreeShape: budget={self.budget} exceeds the {self.pool_size} nodes "
                       f"drafted by top_k={self.top_k}, depth={self.depth} "
                       "(top_k + (depth - 1) * top_k**2)")

  @property
  def pool_size(self) -> int:
    return self.top_k + (self.depth - 1) * self.top_k ** 2

  @property
  def nodes(self) -> int:
    """Tree nodes the target scores in one pass: the budget plus the root."""
    return self.budget + 1

  def __str__(self) -> str:
    return f"{self.top_k}:{self.depth}:{self.budget}"

  @classmethod
  def parse(cls, spec: str) -> TreeShape:
    """"top_k:depth:budget", e.g. "4:5:24"; "chain:D" is 1:D:D."""
    parts = spec.strip().split(":")
    try:
      if parts[0] == "chain" and len(parts) == 2:
        return cls(1, int(parts[1]), int(parts[1]))
      if len(parts) == 3:
        return cls(*(int(p) for p in parts))
    except ValueError as e:
      if "TreeShape" in str(e):
        raise
    raise ValueError(f"tree shape {spec!r}: expected TOP_K:DEPTH:BUDGET (e.g. 4:5:24) or "
                     "chain:DEPTH")


def pool_depths(shape: TreeShape) -> np.ndarray:
  """Depth of each pool candidate [P] (static): K at depth 1, then K*K per depth."""
  k = shape.top_k
  return np.concatenate([np.ones(k, np.int32)] + [np.full(k * k, d, np.int32)
                                                   for d in range(2, shape.depth + 1)])


def select_tree(root_B, pool_tokens_BP, pool_values_BP, pool_parents_BP, shape: TreeShape):
  """The `budget` highest-value pool candidates under the root: (tokens, parents, depths),
  each [B,N]. pool_parents_BP: the pool index of each candidate's parent, -1 for the root."""
  b, p = pool_values_BP.shape
  m = shape.budget
  _, top_BM = jax.lax.top_k(pool_values_BP, m, is_stable=True)   # ties: lower index first
  sel_BM = jnp.sort(top_BM, axis=-1)                     # pool order: parents first
  node_of_pool_BP = jax.vmap(lambda s: jnp.full((p,), -1, jnp.int32).at[s].set(
      jnp.arange(1, m + 1, dtype=jnp.int32)))(sel_BM)
  par_pool_BM = jnp.take_along_axis(pool_parents_BP, sel_BM, axis=1)
  par_BM = jnp.where(par_pool_BM < 0, 0,
                     jnp.take_along_axis(node_of_pool_BP, jnp.maximum(par_pool_BM, 0), axis=1))
  tokens_BN = jnp.concatenate([root_B[:, None].astype(jnp.int32),
                               jnp.take_along_axis(pool_tokens_BP, sel_BM, axis=1)], axis=1)
  parents_BN = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par_BM.astype(jnp.int32)],
                               axis=1)
  depths_BN = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                               jnp.asarray(pool_depths(shape))[sel_BM]], axis=1)
  return tokens_BN, parents_BN, depths_BN


def ancestors(parents_BN, max_depth: int):
  """[B,N,N] bool: [b, i, j] iff node j is node i or one of its ancestors (the tree mask
  among nodes). Needs parents before children; max_depth bounds the deepest node."""
  n = parents_BN.shape[1]
  eye = jnp.eye(n, dtype=bool)
  vis_BNN = jnp.broadcast_to(eye, parents_BN.shape + (n,))
  has_parent = (parents_BN >= 0)[..., None]
  for _ in range(max_depth):
    from_parent = jnp.take_along_axis(vis_BNN, jnp.maximum(parents_BN, 0)[..., None], axis=1)
    vis_BNN = eye | (has_parent & from_parent)
  return vis_BNN


# Partial sums of XLA:CPU's product routine over the key axis (module docstring).
SLOT_LANES = 4


def node_slots(depths_BN, lanes: int = SLOT_LANES):
  """[B,N] cache slot of each node, as an offset from the tree's start: depth + lanes * c,
  c = the nodes before it whose depth has its residue modulo lanes, less the depth // lanes
  levels of that residue above it (each holds at least one). Needs nodes sorted by depth
  (`select_tree`'s order). Offsets are distinct, congruent to the depth, increase along every
  root-to-node path within a residue, stay below `slot_span`, and are the depths for a chain:
  the first node of every level sits where plain decoding puts its token."""
  n = depths_BN.shape[1]
  same_BNN = (depths_BN[:, :, None] % lanes) == (depths_BN[:, None, :] % lanes)
  earlier_NN = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
  kin_BN = jnp.sum(same_BNN & earlier_NN, axis=-1, dtype=jnp.int32) - depths_BN // lanes
  return depths_BN + lanes * kin_BN


def slot_span(shape: TreeShape, lanes: int = SLOT_LANES) -> int:
  """Slots past start that `node_slots` can use for a tree of `shape` (static). A node at
  depth d >= 1 gets lanes * c past its depth, c at most: the other N - 1 nodes less its d
  ancestors (d // lanes of which share its residue), less the d // lanes; and the nodes that
  the levels of its residue down to d can hold (1 root, top_k at depth 1, top_k**2 deeper),
  less itself and d // lanes. The span is one past the largest offset over d <= depth."""
  n, k = shape.nodes, shape.top_k
  level = lambda d: 1 if d == 0 else (k if d == 1 else k * k)
  def c(d):
    held = sum(level(e) for e in range(d % lanes, d + 1, lanes))
    return max(0, min(n - 1 - d, held - 1 - d // lanes))
  return 1 + max([0] + [d + lanes * c(d) for d in range(1, min(shape.depth, n - 1) + 1)])


def slot_mask(visible_BTN, start_B, num_slots: int, offsets_BN=None):
  """[B,T,S] attention mask over cache slots for queries whose tree keys were written at
  slots start + offsets (default: start + arange(N), [start, start + N)): at those slots
  visible_BTN decides, every other slot is left to the positions (the cached prefix; empty
  slots are hidden by theirs)."""
  b, t, n = visible_BTN.shape
  if offsets_BN is None:
    offsets_BN = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  # The node in each slot (-1: none); slots past the cache are dropped.
  node_BS = write_slots(jnp.full((b, num_slots), -1, jnp.int32), start_B[:, None] + offsets_BN,
                        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))
  idx_BTS = jnp.broadcast_to(jnp.maximum(node_BS, 0)[:, None, :], (b, t, num_slots))
  vis_BTS = jnp.take_along_axis(visible_BTN, idx_BTS, axis=2)
  return jnp.where((node_BS >= 0)[:, None, :], vis_BTS, True)


def children(parents_BN, top_k: int):
  """[B,N,K] node indices of each node's children in node order (-1: none). A node has at
  most top_k children (the candidates it was expanded with)."""
  b, n = parents_BN.shape
  same_BNN = parents_BN[:, :, None] == parents_BN[:, None, :]
  earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
  rank_BN = jnp.sum(same_BNN & earlier, axis=-1, dtype=jnp.int32)
  # The root (parent -1) goes to row N, out of range, and is dropped.
  row_BN = jnp.where(parents_BN < 0, n, parents_BN)

  def one(row, rank):
    return jnp.full((n, top_k), -1, jnp.int32).at[row, rank].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")

  return jax.vmap(one)(row_BN, rank_BN)
