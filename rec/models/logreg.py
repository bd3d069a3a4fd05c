"""Logistic regression on the same hashed features as DLRM: the baseline every CTR paper beats.

logit = sum_f w_f[id_f] + w_dense . dense + b, where the per-row weights w_f live in
dim-1 embedding tables (`LogRegConfig.tables()`, looked up and sum-pooled by the
embedding collection), so this module holds only w_dense and b.

Letters: B batch, Dn dense features, F sparse features.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from rec.embedding.config import TableConfig
from rec.models import common


@dataclasses.dataclass(frozen=True)
class LogRegConfig:
  """Feature counts and hashed row counts; feature_names defaults to C1..CF."""

  num_dense: int
  num_sparse: int
  rows_per_feature: tuple[int, ...]
  feature_names: tuple[str, ...] | None = None

  def __post_init__(self):
    common.normalize_features(self)
    if self.num_dense < 0 or self.num_sparse < 0 or self.num_dense + self.num_sparse == 0:
      raise ValueError(f"LogRegConfig: num_dense={self.num_dense}, num_sparse={self.num_sparse}; "
                       "expected non-negative counts, not both zero")

  def tables(self) -> list[TableConfig]:
    """One sum-pooled dim-1 table (the per-id weights) per sparse feature."""
    return [TableConfig(name=name, num_rows=rows, dim=1)
            for name, rows in zip(self.feature_names, self.rows_per_feature)]


class LogReg(nnx.Module):
  """Dense weights and bias of logistic regression; sparse weights come in as emb_BF1."""

  def __init__(self, config: LogRegConfig, rngs: nnx.Rngs):
    del rngs  # zero init: the problem is convex, and zeros make the first logit 0
    self.config = config
    # No dense features (Avazu): no dense weight at all, rather than a zero-size array
    # (checkpoints cannot hold those).
    self.dense_weight = (nnx.Param(jnp.zeros((config.num_dense,), jnp.float32))
                         if config.num_dense > 0 else None)
    self.bias = nnx.Param(jnp.zeros((), jnp.float32))

  def __call__(self, dense_BD, emb_BF1):
    """dense_BD: [B, Dn] (may be None when Dn == 0); emb_BF1: [B, F, 1]. Returns logits [B]."""
    cfg = self.config
    if emb_BF1.ndim != 3 or emb_BF1.shape[1:] != (cfg.num_sparse, 1):
      raise ValueError(f"LogReg: emb_BF1 shape {emb_BF1.shape}, expected [B, {cfg.num_sparse}, 1]")
    logits_B = emb_BF1.astype(jnp.float32).sum(axis=(1, 2)) + self.bias[...]
    common.check_dense_input("LogReg", cfg.num_dense, dense_BD, emb_BF1.shape[0])
    if cfg.num_dense > 0:
      logits_B = logits_B + dense_BD.astype(jnp.float32) @ self.dense_weight[...]
    return logits_B
