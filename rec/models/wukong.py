"""Wukong: stacked factorization machines (Zhang et al., arXiv 2403.02545), the dense part.

    X_0     = [bottom MLP(dense) as n_d embeddings, F pooled sparse embeddings]   [B, N_0, D]
    X_{i+1} = LayerNorm(concat(FMB(X_i), LCB(X_i)) + Res(X_i))                   [B, n_F + n_L, D]
    FMB(X)  = reshape(MLP(LayerNorm(flatten(X X^T Y))))   Y: learned [N_i, k]     -> n_F embeddings
    LCB(X)  = W^T X                                       W: learned [N_i, n_L]   -> n_L embeddings
    Res(X)  = X when N_i == n_F + n_L, else a linear compression N_i -> n_F + n_L
    logit   = top MLP(flatten(X_l))

The bottom MLP's last width is n_d * D: the dense features become n_d embeddings (the
paper's Criteo setup, bottom MLP [512, 256] at D = 128, gives n_d = 2). The layer's
LayerNorm normalizes each embedding over its D values; the FMB's normalizes the flat
N_i * k interaction vector. As in DLRM, the tables live in the sharded collection
(`WukongConfig.tables()`). FuxiCTR's WuKong, an independent implementation, gives the same
layer outputs and logits with the same weights (`fm_output_relu=True` for its FMB ReLU;
experiments/peers/README.md lists every difference).

Letters: B batch, Dn dense input features, D embedding dim, F sparse features,
N embeddings entering a layer, K FM rank (k), M FMB outputs (n_F), L LCB outputs (n_L).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from rec.layers.compression import LinearCompression
from rec.layers.fm import FactorizationMachineBlock
from rec.models import common

# Our dense-scaling ladder, following the paper's recipe (grow depth l, the embedding
# counts n_F = n_L, the rank k and the MLP width together). On Criteo-shaped inputs it
# spans 0.006 to 6.2 forward GFLOPs/example and 2.6M to 3.05B dense parameters, each rung
# 1.4-5x the one before. Rows: (l, n_F, n_L, k, MLP width).
SCALING_LADDER = (
    (1, 8, 8, 24, 512),
    (2, 8, 8, 24, 512),
    (2, 16, 16, 24, 1024),
    (4, 16, 16, 32, 1024),
    (4, 32, 32, 48, 2048),
    (8, 32, 32, 48, 2048),
    (8, 64, 64, 96, 4096),
    (8, 96, 96, 128, 8192),
)


@dataclasses.dataclass(frozen=True)
class WukongConfig(common.DenseConfig):
  """Sizes of a Wukong; MLPs list layer outputs (inputs are implied).

  bottom_mlp must end at a multiple of embedding_dim (that many dense embeddings) and is
  () when num_dense == 0. fm_mlp lists the FMB's hidden widths (ReLU); its last layer,
  num_fm * embedding_dim wide and linear, is implied. top_mlp must end at 1.
  """

  num_dense: int
  num_sparse: int
  embedding_dim: int
  rows_per_feature: tuple[int, ...]
  bottom_mlp: tuple[int, ...] = ()
  num_layers: int = 2      # l
  num_fm: int = 8          # n_F: embeddings out of each FMB
  num_lcb: int = 8         # n_L: embeddings out of each LCB
  fm_rank: int = 24        # k: columns of the FM projection Y
  fm_mlp: tuple[int, ...] = (512, 512)
  fm_output_relu: bool = False   # ReLU after the FMB's last layer (FuxiCTR's WuKong); off:
                                 # a linear output (the paper names no activation there)
  top_mlp: tuple[int, ...] = (512, 512, 1)
  feature_names: tuple[str, ...] | None = None
  dtype: str = "float32"   # activation dtype; parameters stay float32, logits are float32

  def __post_init__(self):
    w = "WukongConfig"
    self.check_dense(w, mlps=("bottom_mlp", "fm_mlp", "top_mlp"), bottom="embeddings")
    for name in ("num_layers", "num_fm", "num_lcb", "fm_rank"):
      if getattr(self, name) < 1:
        raise ValueError(f"{w}: {name}={getattr(self, name)}, expected >= 1")

  @property
  def num_dense_embeddings(self) -> int:
    return self.bottom_mlp[-1] // self.embedding_dim if self.num_dense > 0 else 0

  @property
  def num_inputs(self) -> int:
    """N_0: dense embeddings and the F sparse embeddings."""
    return self.num_sparse + self.num_dense_embeddings

  def layer_sizes(self) -> list[tuple[int, int]]:
    """(N_in, N_out) of every layer."""
    n_out = self.num_fm + self.num_lcb
    return [(self.num_inputs if i == 0 else n_out, n_out) for i in range(self.num_layers)]

  @classmethod
  def criteo(cls, num_rows: int | Sequence[int], layers: int = 2, n_fm: int = 8,
             n_lcb: int = 8, **overrides) -> WukongConfig:
    """The paper's public-data search space on Criteo: dim 128, bottom MLP [512, 256]
    (two dense embeddings), l in 1..4, n_F = n_L in {8, 16}, k = 24. The FMB and top
    MLP widths (512, 512) are ours (the text does not fix them)."""
    kwargs = dict(num_dense=13, num_sparse=26, embedding_dim=128, rows_per_feature=num_rows,
                  bottom_mlp=(512, 256), num_layers=layers, num_fm=n_fm, num_lcb=n_lcb,
                  fm_rank=24, fm_mlp=(512, 512), top_mlp=(512, 512, 1))
    return cls(**{**kwargs, **overrides})

  @classmethod
  def family(cls, num_rows: int | Sequence[int], layers: int, n_fm: int, n_lcb: int, rank: int,
             mlp_width: int, mlp_depth: int = 2, **overrides) -> WukongConfig:
    """One point of the dense-scaling space: Criteo inputs, FMB and top MLPs of
    `mlp_depth` layers of `mlp_width`."""
    kwargs = dict(layers=layers, n_fm=n_fm, n_lcb=n_lcb, fm_rank=rank,
                  fm_mlp=(mlp_width,) * mlp_depth, top_mlp=(mlp_width,) * mlp_depth + (1,))
    return cls.criteo(num_rows, **{**kwargs, **overrides})

  @classmethod
  def scaled(cls, num_rows: int | Sequence[int], size_index: int, **overrides) -> WukongConfig:
    """Rung `size_index` of SCALING_LADDER (0 smallest)."""
    if not 0 <= size_index < len(SCALING_LADDER):
      raise ValueError(f"WukongConfig.scaled: size_index={size_index}, expected 0.."
                       f"{len(SCALING_LADDER) - 1}")
    l, nf, nl, k, width = SCALING_LADDER[size_index]
    return cls.family(num_rows, l, nf, nl, k, width, **overrides)


class WukongLayer(nnx.Module):
  """LayerNorm(concat(FMB(X), LCB(X)) + Res(X)): [B, N, D] -> [B, n_F + n_L, D]."""

  def __init__(self, num_in: int, cfg: WukongConfig, rngs: nnx.Rngs):
    dtype = common.DTYPES[cfg.dtype]
    d, n_out = cfg.embedding_dim, cfg.num_fm + cfg.num_lcb
    self.fmb = FactorizationMachineBlock(num_in, cfg.num_fm, d, cfg.fm_rank, cfg.fm_mlp, rngs,
                                         dtype=dtype, output_relu=cfg.fm_output_relu)
    self.lcb = LinearCompression(num_in, cfg.num_lcb, rngs, dtype=dtype)
    self.residual = LinearCompression(num_in, n_out, rngs, dtype=dtype) if num_in != n_out else None
    self.norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)

  def __call__(self, x_BND):
    y_BND = jnp.concatenate([self.fmb(x_BND), self.lcb(x_BND)], axis=1)
    skip = self.residual(x_BND) if self.residual is not None else x_BND
    return self.norm(y_BND + skip.astype(y_BND.dtype))


class Wukong(common.StackedModel):
  """The dense part of Wukong: bottom MLP, l Wukong layers, top MLP to one logit."""

  def __init__(self, config: WukongConfig, rngs: nnx.Rngs):
    self.config = cfg = config
    # No ReLU after the last bottom layer: dense embeddings are signed like the sparse ones.
    self.bottom_mlp = common.bottom_mlp(cfg, rngs, relu_last=False)
    self.layers = nnx.List([WukongLayer(n_in, cfg, rngs) for n_in, _ in cfg.layer_sizes()])
    self.top_mlp = common.top_mlp(cfg, (cfg.num_fm + cfg.num_lcb) * cfg.embedding_dim, rngs)
