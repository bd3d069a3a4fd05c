"""Acceptance of a verified draft tree: the longest path the target agrees with, exactly.

Walk from the root. At a node whose target distribution is p (the target's sampling
distribution there: `llm.generate.filtered_logits`, one-hot at the argmax for greedy), try
its children one at a time, in draft order: child token x is accepted with probability
p(x) / sum(p); if it is rejected, p(x) is set to 0 (the residual) and the next child is
tried. An accepted child becomes the node (p its own distribution); when every child is
rejected, or a leaf is reached, the bonus token is drawn from the residual p and the round
ends. Candidates are deterministic (the draft's top-k), so this is recursive rejection
sampling with point-mass proposals (SpecInfer, arXiv 2305.09781; EAGLE's sampling rule,
arXiv 2401.15077): each emitted token has exactly the target's distribution given the tokens
before it. With x accepted with probability p(x), otherwise a draw from p restricted to the
untried tokens, P(x) = p(x) for a single candidate, and by induction over the candidates for
any number of them. Greedy: p is one-hot at the argmax, so a child is accepted iff it is the
target's argmax and the bonus is the argmax: output identical to greedy decoding.

Letters: B batch, N tree nodes, K children per node, V vocab, J = depth + 1 path slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accept_tree(probs_BNV, tokens_BN, children_BNK, key, *, depth: int, greedy: bool):
  """(path_BJ, accepted_B, bonus_B): path[b, :accepted+1] are the accepted node indices
  from the root (path[b, 0] = 0; entries past accepted are 0), accepted_B the number of
  drafted tokens accepted, bonus_B the token drawn after the last accepted node.

  probs_BNV: the target's sampling distribution at each node (need not be normalized);
  key: one key for the batch (split per row); greedy: take the argmax instead of drawing.
  """
  keys = jax.random.split(key, probs_BNV.shape[0])
  row = lambda p, t, c, k: _accept_row(p, t, c, k, depth=depth, greedy=greedy)
  return jax.vmap(row)(probs_BNV.astype(jnp.float32), tokens_BN, children_BNK, keys)


def _accept_row(probs_NV, tokens_N, children_NK, key, *, depth, greedy):
  k = children_NK.shape[1]

  def level(d, carry):
    node, p_V, alive, accepted, path_J = carry

    def try_child(j, c):
      found, p_V = c
      child = children_NK[node, j]
      x = tokens_N[jnp.maximum(child, 0)]
      tried = alive & (found < 0) & (child >= 0)
      # Greedy: u = 0, so x is accepted iff p(x) > 0 (p is one-hot at the argmax).
      u = 0.0 if greedy else jax.random.uniform(jax.random.fold_in(key, d * k + j))
      ok = tried & (u * jnp.sum(p_V) < p_V[x])
      found = jnp.where(ok, child, found)
      p_V = jnp.where(tried & ~ok, p_V.at[x].set(0.0), p_V)
      return found, p_V

    found, p_V = jax.lax.fori_loop(0, k, try_child, (jnp.int32(-1), p_V))
    hit = found >= 0
    node = jnp.where(hit, found, node)
    p_V = jnp.where(hit, probs_NV[jnp.maximum(found, 0)], p_V)
    path_J = path_J.at[d + 1].set(jnp.where(hit, found, 0))
    return node, p_V, alive & hit, accepted + hit.astype(jnp.int32), path_J

  init = (jnp.int32(0), probs_NV[0], jnp.bool_(True), jnp.int32(0),
          jnp.zeros((depth + 1,), jnp.int32))
  _, p_V, _, accepted, path_J = jax.lax.fori_loop(0, depth, level, init)
  if greedy:
    bonus = jnp.argmax(p_V).astype(jnp.int32)
  else:
    bonus = jax.random.categorical(jax.random.fold_in(key, depth * k), jnp.log(p_V))
  return path_J, accepted, bonus.astype(jnp.int32)
