"""DMT: Disaggregated Multi-Tower (arXiv 2403.00877), the tower model.

dense_BD -> bottom MLP -> x_BD ───────────────────────────────┐
emb_BFD -> per tower t: TowerModule(emb of tower t's features) ├─> dot interaction -> top MLP
           -> [B, K + 1, D] (K mixtures + one local-dot vector) ┘

Features are split into towers (`rec.embedding.towers.partition` groups features whose
embeddings interact strongly); each tower's interactions are compressed by its tower module
before the global interaction, so the global interaction sees T (K + 1) vectors instead of
F. With the tables placed "sptt" (`rec.embedding.planner.tower_plan`) each tower module runs
inside its tower's device group (`tower_transform`, called by the embedding collection's
`pool`), and only the compressed [B, K + 1, D] leaves the group; `head` takes the result.
The plain layout calls `__call__(dense, emb_BFD)`; both compute the same function.

Letters: B batch, Dn dense features, D embedding dim, F features (F_t in tower t, Fm tower
slots), T towers, K compressed vectors per tower, P pairwise dot products.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rec.embedding.config import TableConfig
from rec.layers.compression import linear_compression
from rec.layers.interaction import dot_interaction, num_dot_outputs
from rec.layers.mlp import MLP
from rec.models import common


@dataclasses.dataclass(frozen=True)
class DMTConfig:
  """A DLRM whose features are split into towers, each compressed to K + 1 vectors.

  towers lists feature indices (into the tables' order) per tower; each tower is kept in
  ascending order, the order of its slots in the collection's tower groups.
  """

  num_dense: int
  embedding_dim: int
  towers: tuple[tuple[int, ...], ...]      # feature indices per tower
  tower_k: int = 2                         # compressed vectors per tower (+ 1 local-dot vector)
  bottom_mlp: tuple[int, ...] = (64, 16)
  top_mlp: tuple[int, ...] = (64, 1)
  rows_per_feature: int | Sequence[int] = 100_000
  feature_names: tuple[str, ...] | None = None

  def __post_init__(self):
    object.__setattr__(self, "towers", tuple(tuple(sorted(int(f) for f in t))
                                             for t in self.towers))
    flat = sorted(f for t in self.towers for f in t)
    if flat != list(range(len(flat))) or any(not t for t in self.towers):
      raise ValueError(f"DMTConfig: towers={self.towers} must split 0..F-1, none empty")
    if self.tower_k < 1:
      raise ValueError(f"DMTConfig: tower_k={self.tower_k}, expected >= 1")
    object.__setattr__(self, "bottom_mlp", tuple(int(s) for s in self.bottom_mlp))
    object.__setattr__(self, "top_mlp", tuple(int(s) for s in self.top_mlp))
    if any(s < 1 for s in self.bottom_mlp + self.top_mlp):
      raise ValueError(f"DMTConfig: bottom_mlp={self.bottom_mlp}, top_mlp={self.top_mlp}; "
                       "expected positive layer sizes")
    if self.num_dense < 1 or not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
      raise ValueError(f"DMTConfig: num_dense={self.num_dense}, bottom_mlp={self.bottom_mlp}; "
                       f"expected dense features and a bottom MLP ending at embedding_dim="
                       f"{self.embedding_dim}")
    if not self.top_mlp or self.top_mlp[-1] != 1:
      raise ValueError(f"DMTConfig: top_mlp={self.top_mlp} must end at 1 (the logit)")
    common.normalize_features(self)

  @property
  def num_sparse(self) -> int:
    return sum(len(t) for t in self.towers)

  def tables(self) -> list[TableConfig]:
    """One sum-pooled table per sparse feature, named after the feature."""
    return [TableConfig(name=name, num_rows=rows, dim=self.embedding_dim)
            for name, rows in zip(self.feature_names, self.rows_per_feature)]


class TowerModule(nnx.Module):
  """[B, F_t, D] -> [B, K + 1, D]: K learned mixtures of the tower's embeddings (a linear
  compression) and one projection of the tower's pairwise dot products."""

  def __init__(self, num_features: int, dim: int, k: int, rngs: nnx.Rngs):
    init = nnx.initializers.normal(1.0 / np.sqrt(num_features))
    self.mix = nnx.Param(init(rngs.params(), (num_features, k)))
    self.self_interaction = num_features == 1   # one feature: its square is the only dot
    p = num_dot_outputs(num_features, self_interaction=self.self_interaction)
    self.local = nnx.Linear(p, dim, rngs=rngs)

  def __call__(self, emb_BFD):
    mixed_BKD = linear_compression(emb_BFD, self.mix[...])
    dots_BP = dot_interaction(None, emb_BFD, self.self_interaction)
    return jnp.concatenate([mixed_BKD, self.local(dots_BP)[:, None]], axis=1)


class DMTModel(nnx.Module):
  """Bottom MLP, tower modules, global dot interaction, top MLP -> logit [B]."""

  def __init__(self, config: DMTConfig, rngs: nnx.Rngs):
    self.config = config
    D = config.embedding_dim
    self.bottom_mlp = MLP(config.num_dense, config.bottom_mlp, rngs, activate_last=True)
    self.towers = nnx.List([TowerModule(len(t), D, config.tower_k, rngs) for t in config.towers])
    n = 1 + len(config.towers) * (config.tower_k + 1)
    self.top_mlp = MLP(D + num_dot_outputs(n), config.top_mlp, rngs, activate_last=False)

  def tower_outputs(self, emb_BFD):
    """[B, T (K + 1), D]: each tower module on its features (the plain layout)."""
    return jnp.concatenate([m(emb_BFD[:, np.asarray(t)]) for m, t in
                            zip(self.towers, self.config.towers)], axis=1)

  def tower_transform(self):
    """(fn, params) for the collection's SPTT pool: fn(params, t, emb [b, Fm, D]) is tower
    t's module on the slots 0..F_t-1 of its tower group's embeddings, -> [b, K + 1, D]. t
    is the device's tower (traced), so the modules are the branches of one switch."""
    graphdef, params = nnx.split(self.towers)
    sizes = [len(t) for t in self.config.towers]

    def fn(params, t, emb_bFD):
      towers = nnx.merge(graphdef, params)
      branches = [functools.partial(lambda m, n, e: m(e[:, :n]), m, n)
                  for m, n in zip(towers, sizes)]
      return jax.lax.switch(t, branches, emb_bFD)

    return fn, params

  def head(self, dense_BD, towers_BND):
    """Logits [B] from the dense features and the towers' outputs [B, T (K + 1), D]."""
    x_BD = self.bottom_mlp(dense_BD)
    return self.top_mlp(dot_interaction(x_BD, towers_BND))[:, 0]

  def __call__(self, dense_BD, emb_BFD):
    common.check_inputs("DMTModel", self.config, dense_BD, emb_BFD)
    return self.head(dense_BD, self.tower_outputs(emb_BFD))
