"""Tree acceptance: greedy follows the argmax chain by hand; rejection sampling reproduces the
target's distribution token by token (chi-square on a 6-token vocabulary, with power).

False failures: each goodness-of-fit assertion fails under a correct sampler with probability
1e-3 (its p-value threshold), so the five in this file fail together with probability below
5e-3 for a random key; the power assertions (p < 1e-9 against a wrong distribution) fail
falsely with negligible probability. The keys are fixed, so a run is deterministic: a failure
after a change is a real change in the distribution drawn, or (rarely) a new key's bad luck.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from llm.speculative.accept import accept_tree

V = 6
# Tree: root 0 -> children 1 (token 2), 2 (token 0), 3 (token 5); node 1 -> 4 (token 1),
# 5 (token 2); node 4 -> 6 (token 3).
TOKENS = np.array([4, 2, 0, 5, 1, 2, 3])
CHILDREN = np.array([[1, 2, 3], [4, 5, -1], [-1, -1, -1], [-1, -1, -1], [6, -1, -1],
                     [-1, -1, -1], [-1, -1, -1]])
DEPTH = 3


def _target_probs(seed=None):
  """A distribution per node; node 0's leaves token 3 at 0 (as top-k filtering would).
  seed None: the hand-set rows below; else random rows (Dirichlet)."""
  p = np.random.default_rng(seed or 0).dirichlet(np.full(V, 1.0), size=len(TOKENS))
  if seed is None:
    p[0] = [0.10, 0.05, 0.35, 0.00, 0.20, 0.30]     # children: tokens 2, 0, 5
    p[1] = [0.05, 0.30, 0.15, 0.25, 0.15, 0.10]     # children: tokens 1, 2
    p[4] = [0.20, 0.10, 0.10, 0.40, 0.10, 0.10]     # child: token 3
  p[0, 3] = 0.0
  return p / p.sum(-1, keepdims=True)


def _run(probs, n, greedy=False, seed=0):
  b = lambda x: jnp.asarray(np.broadcast_to(x, (n,) + x.shape))
  f = jax.jit(lambda p, t, c, k: accept_tree(p, t, c, k, depth=DEPTH, greedy=greedy))
  path, acc, bonus = f(b(probs.astype(np.float32)), b(TOKENS), b(CHILDREN), jax.random.key(seed))
  return np.asarray(path), np.asarray(acc), np.asarray(bonus)


def _emitted(path, acc, bonus):
  """Tokens each row emits in the round: the accepted path after the root, then the bonus."""
  return [[int(TOKENS[path[r, j]]) for j in range(1, acc[r] + 1)] + [int(bonus[r])]
          for r in range(len(acc))]


def test_greedy_follows_the_argmax_chain():
  p = np.zeros((len(TOKENS), V))
  p[0, 2] = p[1, 1] = p[4, 0] = p[2, 0] = 1.0     # root: 2 (node 1); node 1: 1 (node 4)
  p[3, 0] = p[5, 0] = p[6, 0] = 1.0
  path, acc, bonus = _run(p, 1, greedy=True)
  assert acc[0] == 2 and list(path[0]) == [0, 1, 4, 0] and bonus[0] == 0  # node 4: 0, no child
  p[0] = np.eye(V)[3]                                # root's argmax is no child
  path, acc, bonus = _run(p, 1, greedy=True)
  assert acc[0] == 0 and bonus[0] == 3 and list(path[0]) == [0, 0, 0, 0]
  p[0], p[1], p[4] = np.eye(V)[2], np.eye(V)[1], np.eye(V)[3]   # the deepest node (6)
  path, acc, bonus = _run(p, 1, greedy=True)
  assert acc[0] == 3 and list(path[0]) == [0, 1, 4, 6]


def _chi2_pvalue(counts, p, min_expected=5.0):
  """Pearson chi-square p-value of counts against p; cells expected below min_expected are
  lumped into one (the chi-square approximation needs about 5 per cell)."""
  p = p / p.sum()
  assert counts[p == 0].sum() == 0, f"draws outside the support: {counts} vs {p}"
  n = counts.sum()
  big = n * p >= min_expected
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(n * p[big], n * p[~big].sum())
  keep = exp > 0
  stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
  return stats.chi2.sf(stat, keep.sum() - 1)


def test_rejection_sampling_reproduces_the_target_distribution():
  """First token ~ p(root); second ~ p(node) given that the first is that node's token;
  third likewise below node 4. Candidates are tried in draft order and rejected mass is
  redistributed; any error in that shows as a skewed histogram."""
  probs = _target_probs()
  n = 40000
  out = _emitted(*_run(probs, n))
  first = np.array([o[0] for o in out])
  assert _chi2_pvalue(np.bincount(first, minlength=V), probs[0]) > 1e-3
  # Given first == token of node 1 (2), the next token is drawn under node 1; given the
  # first two are nodes 1 and 4's tokens (2, 1), the third under node 4.
  second = np.array([o[1] for o in out if o[0] == 2])
  assert len(second) > 3000
  assert _chi2_pvalue(np.bincount(second, minlength=V), probs[1]) > 1e-3
  third = np.array([o[2] for o in out if o[:2] == [2, 1]])
  assert len(third) > 500
  assert _chi2_pvalue(np.bincount(third, minlength=V), probs[4]) > 1e-3
  # The tree's tokens were accepted often (the draft matters), and the test has power: the
  # first tokens are far from node 1's distribution and from uniform.
  assert np.mean([len(o) > 1 for o in out]) > 0.3
  counts = np.bincount(first, minlength=V)
  assert _chi2_pvalue(counts, probs[1]) < 1e-9 and _chi2_pvalue(counts, np.full(V, 1 / V)) < 1e-9


@pytest.mark.parametrize("seed", [1, 2])
def test_rejection_sampling_with_peaked_targets(seed):
  """Targets that put most mass on tokens the draft did not propose (and on ones it did)."""
  probs = _target_probs(seed) ** 4
  probs /= probs.sum(-1, keepdims=True)
  out = _emitted(*_run(probs, 20000, seed=seed))
  first = np.array([o[0] for o in out])
  assert _chi2_pvalue(np.bincount(first, minlength=V), probs[0]) > 1e-3
