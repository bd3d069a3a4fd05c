"""Which features form which tower, for DMT (arXiv 2403.00877): the planner's input for sptt.

  feature_similarity(emb_XFD)    mean |cos| of pooled embeddings per feature pair over
                                 examples (how strongly two features interact in the dot
                                 interaction of a trained flat model)
  partition(sim, costs, T)       towers of balanced cost (e.g. rows x dim) that group similar
                                 features: greedy, most costly feature first, each into the
                                 tower it is most similar to among those with room
  random_partition(F, T)         equal-count towers of a random permutation (the control)

`rec.embedding.planner.tower_plan(tables, towers, N)` places the result (tower t on device
group t) and `rec.models.dmt.DMTConfig(towers=...)` builds the matching model.

Letters: X examples, F features, D embedding dim, T towers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def feature_similarity(emb_XFD: np.ndarray) -> np.ndarray:
  """[F, F] mean over examples of |cos(e_i, e_j)| of pooled embeddings (diagonal 1)."""
  e = np.asarray(emb_XFD, np.float64)
  e = e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
  return np.abs(np.einsum("xfd,xgd->xfg", e, e)).mean(0)


def partition(sim: np.ndarray, costs: Sequence[float], num_towers: int,
              slack: float = 0.1) -> list[list[int]]:
  """Features -> towers: cost per tower at most (1 + slack) x the mean (or the one feature
  that alone exceeds it), at most ceil(F / T) features each, grouped by similarity. When no
  tower has room for a feature under both caps, the least loaded tower takes it (cost wins:
  costs [10, 1, 1, 1, 1, 1] in 2 towers give [0] and five features). No tower is left
  empty (`tower_plan` and `DMTConfig` need every tower): once the features left are as
  many as the empty towers, each goes to an empty one. Deterministic."""
  F = len(costs)
  if not 1 <= num_towers <= F:
    raise ValueError(f"partition: num_towers={num_towers} for {F} features; expected 1..{F}")
  sim = np.asarray(sim)
  if sim.shape != (F, F):
    raise ValueError(f"partition: similarity of shape {sim.shape} for {F} costs; expected "
                     f"[{F}, {F}]")
  costs = np.asarray(costs, np.float64)
  cap = (1 + slack) * costs.sum() / num_towers
  max_feats = -(-F // num_towers)
  towers: list[list[int]] = [[] for _ in range(num_towers)]
  load = np.zeros(num_towers)
  # An empty tower scores the mean similarity: a feature joins a tower only when it is
  # more similar to it than to features on average.
  off = ~np.eye(F, dtype=bool)
  empty = float(sim[off].mean()) if F > 1 else 0.0
  for placed, f in enumerate(sorted(range(F), key=lambda f: (-costs[f], f))):
    def score(t):
      return sim[f, towers[t]].mean() if towers[t] else empty
    room = [t for t in range(num_towers)
            if len(towers[t]) < max_feats and (load[t] + costs[f] <= cap or not towers[t])]
    if not room:
      room = [int(np.argmin(load))]
    # Grouping similar features must not leave a tower without any: the rest fill the
    # empty ones (they are the cheapest, so the balance gains too).
    empty_towers = [t for t in range(num_towers) if not towers[t]]
    if len(empty_towers) >= F - placed:
      room = empty_towers
    t = max(room, key=lambda t: (score(t), -load[t], -t))
    towers[t].append(f)
    load[t] += costs[f]
  return [sorted(t) for t in towers]


def random_partition(num_features: int, num_towers: int, seed: int = 0) -> list[list[int]]:
  """Equal-count towers of a random permutation (the baseline partition)."""
  if not 1 <= num_towers <= num_features:
    raise ValueError(f"random_partition: num_towers={num_towers} for {num_features} "
                     f"features; expected 1..{num_features}")
  perm = np.random.default_rng(seed).permutation(num_features)
  return [sorted(perm[t::num_towers].tolist()) for t in range(num_towers)]
