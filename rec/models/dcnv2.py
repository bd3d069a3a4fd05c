"""DCN-v2: Deep & Cross Network v2 (Wang et al., arXiv 2008.13535), the dense part.

dense_BD -> bottom MLP ─┐
emb_BFD (pooled) ───────┴─> x0 = concat ─> cross network ─> deep MLP ─> top ─> logit_B   (stacked)
                                       └─> cross network ─┬─> top ─> logit_B           (parallel)
                                       └─> deep MLP ──────┘

The cross network is `num_cross_layers` layers x_{l+1} = x0 * (W x_l + b) + x_l (full
rank, or W = U V^T of rank `cross_rank`). As in DLRM, the embedding tables live in the
sharded collection (`DCNv2Config.tables()`); this module is the data-parallel dense part.

Letters: B batch, Dn dense input features, D embedding dim, F sparse features,
X width of x0 (bottom output + F * D).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from rec.embedding.config import TableConfig
from rec.layers.dcn import CrossNetwork
from rec.layers.mlp import MLP
from rec.models import common

STRUCTURES = ("stacked", "parallel")


def _positive(name: str, sizes: tuple[int, ...], where: str) -> None:
  if any(s < 1 for s in sizes):
    raise ValueError(f"{where}: {name}={sizes}, expected positive layer sizes")


@dataclasses.dataclass(frozen=True)
class DCNv2Config:
  """Sizes of a DCN-v2; MLPs list layer outputs (inputs are implied).

  bottom_mlp (ReLU after every layer) maps the dense features before the concat; () uses
  them raw (the paper's choice) and must be () when num_dense == 0. deep_mlp (ReLU after
  every layer) follows the cross network (stacked) or runs beside it on x0 (parallel,
  where it must not be empty). top_mlp maps the result to the logit and must end at 1.
  cross_rank 0 means full-rank cross kernels.
  """

  num_dense: int
  num_sparse: int
  embedding_dim: int
  rows_per_feature: tuple[int, ...]
  bottom_mlp: tuple[int, ...] = ()
  num_cross_layers: int = 3
  cross_rank: int = 0
  deep_mlp: tuple[int, ...] = ()
  structure: str = "stacked"
  top_mlp: tuple[int, ...] = (1,)
  feature_names: tuple[str, ...] | None = None
  dtype: str = "float32"   # activation dtype; parameters stay float32, logits are float32

  def __post_init__(self):
    for f in ("bottom_mlp", "deep_mlp", "top_mlp"):
      object.__setattr__(self, f, tuple(int(s) for s in getattr(self, f)))
    common.normalize_features(self)
    w = "DCNv2Config"
    if self.num_sparse < 1 or self.num_dense < 0 or self.embedding_dim < 1:
      raise ValueError(f"{w}: num_sparse={self.num_sparse}, num_dense={self.num_dense}, "
                       f"embedding_dim={self.embedding_dim}; expected >= 1, >= 0, >= 1")
    for f in ("bottom_mlp", "deep_mlp", "top_mlp"):
      _positive(f, getattr(self, f), w)
    if self.num_dense == 0 and self.bottom_mlp:
      raise ValueError(f"{w}: bottom_mlp={self.bottom_mlp} with num_dense=0; expected ()")
    if self.num_cross_layers < 1 or self.cross_rank < 0:
      raise ValueError(f"{w}: num_cross_layers={self.num_cross_layers}, cross_rank="
                       f"{self.cross_rank}; expected >= 1 layers and rank >= 0 (0: full rank)")
    if self.structure not in STRUCTURES:
      raise ValueError(f"{w}: structure={self.structure!r}, expected one of {STRUCTURES}")
    if self.structure == "parallel" and not self.deep_mlp:
      raise ValueError(f"{w}: structure='parallel' needs a deep_mlp beside the cross network")
    if not self.top_mlp or self.top_mlp[-1] != 1:
      raise ValueError(f"{w}: top_mlp={self.top_mlp} must end at 1 (the logit)")
    common.check_dtype(w, self.dtype)

  @property
  def cross_dim(self) -> int:
    """X: width of x0 = [dense part, F embeddings flattened]."""
    dense = self.bottom_mlp[-1] if self.bottom_mlp else self.num_dense
    return dense + self.num_sparse * self.embedding_dim

  @property
  def top_in(self) -> int:
    if self.structure == "parallel":
      return self.cross_dim + self.deep_mlp[-1]
    return self.deep_mlp[-1] if self.deep_mlp else self.cross_dim

  def tables(self) -> list[TableConfig]:
    """One sum-pooled table per sparse feature, named after the feature."""
    return [TableConfig(name=name, num_rows=rows, dim=self.embedding_dim)
            for name, rows in zip(self.feature_names, self.rows_per_feature)]

  @classmethod
  def criteo(cls, num_rows: int | Sequence[int], **overrides) -> DCNv2Config:
    """MLPerf Training's DLRM-DCNv2 on Criteo: dim 128, bottom 13-512-256-128, 3 cross
    layers of rank 512 (stacked), then 1024-1024-512-256-1."""
    kwargs = dict(num_dense=13, num_sparse=26, embedding_dim=128, rows_per_feature=num_rows,
                  bottom_mlp=(512, 256, 128), num_cross_layers=3, cross_rank=512,
                  deep_mlp=(1024, 1024, 512, 256), structure="stacked", top_mlp=(1,))
    return cls(**{**kwargs, **overrides})


class DCNv2(nnx.Module):
  """The dense part of DCN-v2: bottom MLP, cross network, deep MLP, top to one logit."""

  def __init__(self, config: DCNv2Config, rngs: nnx.Rngs):
    self.config = cfg = config
    dtype = common.DTYPES[cfg.dtype]
    self.bottom_mlp = (MLP(cfg.num_dense, cfg.bottom_mlp, rngs, activate_last=True, dtype=dtype)
                       if cfg.bottom_mlp else None)
    self.cross = CrossNetwork(cfg.cross_dim, cfg.num_cross_layers, rngs,
                              rank=cfg.cross_rank or None, dtype=dtype)
    # Stacked: the deep MLP reads the cross output; parallel: x0. Both are X wide.
    self.deep_mlp = (MLP(cfg.cross_dim, cfg.deep_mlp, rngs, activate_last=True, dtype=dtype)
                     if cfg.deep_mlp else None)
    self.top_mlp = MLP(cfg.top_in, cfg.top_mlp, rngs, activate_last=False, dtype=dtype)

  def __call__(self, dense_BD, emb_BFD):
    """dense_BD: [B, Dn] (ignored, may be None, when num_dense == 0); emb_BFD: [B, F, D].

    Returns float32 logits [B].
    """
    cfg = self.config
    common.check_inputs("DCNv2", cfg, dense_BD, emb_BFD)
    dtype = common.DTYPES[cfg.dtype]
    parts = []
    if cfg.num_dense > 0:
      dense_BD = dense_BD.astype(dtype)
      parts.append(self.bottom_mlp(dense_BD) if self.bottom_mlp is not None else dense_BD)
    parts.append(emb_BFD.astype(dtype).reshape(emb_BFD.shape[0], -1))
    x0_BX = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    cross_BX = self.cross(x0_BX)
    if cfg.structure == "stacked":
      h = self.deep_mlp(cross_BX) if self.deep_mlp is not None else cross_BX
    else:
      h = jnp.concatenate([cross_BX, self.deep_mlp(x0_BX)], axis=1)
    return self.top_mlp(h)[:, 0].astype(jnp.float32)
