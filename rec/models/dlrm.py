"""DLRM: Deep Learning Recommendation Model (Naumov et al., arXiv 1906.00091).

dense_BD -> bottom MLP -> x_BD ─┐
emb_BFD (pooled) ───────────────┴─> dot interaction -> top MLP -> logit_B

The embedding tables are not in this module: the sharded embedding collection looks up
and pools them (one table per sparse feature, `DLRMConfig.tables()`) and passes emb_BFD
in, so this module is the data-parallel dense part only.

Letters: B batch, Dn dense input features, D embedding dim, F sparse features,
P pairwise dot products.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from flax import nnx

from rec.layers.interaction import dot_interaction, num_dot_outputs
from rec.models import common

@dataclasses.dataclass(frozen=True)
class DLRMConfig(common.DenseConfig):
  """Sizes of a DLRM; bottom_mlp and top_mlp list layer outputs (inputs are implied).

  bottom_mlp must end at embedding_dim (the dense vector joins the dot interaction),
  and is empty when num_dense == 0. top_mlp must end at 1 (the logit).
  feature_names defaults to C1..CF (Criteo's names).
  """

  num_dense: int
  num_sparse: int
  embedding_dim: int
  bottom_mlp: tuple[int, ...]
  top_mlp: tuple[int, ...]
  rows_per_feature: tuple[int, ...]
  self_interaction: bool = False
  feature_names: tuple[str, ...] | None = None
  dtype: str = "float32"   # activation dtype; parameters stay float32, logits are float32
  # FP8 matmuls (rec/layers/fp8.py) in the layers matching fp8_layers ("", "all", or
  # patterns over fp8_layer_names such as "top_mlp.*"), with recipe tensor | row | delayed.
  fp8_layers: str = ""
  fp8_recipe: str = "tensor"

  def __post_init__(self):
    self.check_dense("DLRMConfig", mlps=("bottom_mlp", "top_mlp"), bottom="dot")
    if self.num_dense == 0 and self.num_sparse == 1 and not self.self_interaction:
      raise ValueError("DLRMConfig: one embedding and no dense features give no pairwise "
                       "interaction; use self_interaction=True or more features")
    common.check_fp8("DLRMConfig", self)

  @property
  def fp8_layer_names(self) -> list[str]:
    """The layers fp8_layers can pick: bottom_mlp.<i>, top_mlp.<i>."""
    return ([f"bottom_mlp.{i}" for i in range(len(self.bottom_mlp))]
            + [f"top_mlp.{i}" for i in range(len(self.top_mlp))])

  @property
  def interaction_dim(self) -> int:
    """Width of the top MLP's input: [dense (D, if any), P pairwise products]."""
    num_vectors = self.num_sparse + (1 if self.num_dense > 0 else 0)
    p = num_dot_outputs(num_vectors, self.self_interaction)
    return p + (self.embedding_dim if self.num_dense > 0 else 0)

  @classmethod
  def criteo_kaggle(cls, num_rows: int | Sequence[int], **overrides) -> DLRMConfig:
    """The reference Kaggle run: dim 16, bottom 13-512-256-64-16, top 512-256-1."""
    kwargs = dict(num_dense=13, num_sparse=26, embedding_dim=16, bottom_mlp=(512, 256, 64, 16),
                  top_mlp=(512, 256, 1), rows_per_feature=num_rows)
    return cls(**{**kwargs, **overrides})

  @classmethod
  def criteo_terabyte(cls, num_rows: int | Sequence[int], **overrides) -> DLRMConfig:
    """The reference Terabyte run: dim 64, bottom 13-512-256-64, top 512-512-256-1."""
    kwargs = dict(num_dense=13, num_sparse=26, embedding_dim=64, bottom_mlp=(512, 256, 64),
                  top_mlp=(512, 512, 256, 1), rows_per_feature=num_rows)
    return cls(**{**kwargs, **overrides})


class DLRM(common.DenseModel):
  """The dense part of DLRM: bottom MLP, dot interaction, top MLP to one logit."""

  def __init__(self, config: DLRMConfig, rngs: nnx.Rngs):
    self.config = config
    # Bottom MLP ends in a ReLU, as in the reference (its sigmoid_bot = -1).
    self.bottom_mlp = common.bottom_mlp(config, rngs, relu_last=True)
    # The reference's last top layer is a sigmoid; we return the logit before it.
    self.top_mlp = common.top_mlp(config, config.interaction_dim, rngs)

  def interact(self, x_BD, emb_BFD):
    """[dense vector, pairwise dot products of it and the embeddings]: [B, interaction_dim]."""
    return dot_interaction(x_BD, emb_BFD, self.config.self_interaction)
