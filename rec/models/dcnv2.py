"""DCN-v2: Deep & Cross Network v2 (Wang et al., arXiv 2008.13535), the dense part.

dense_BD -> bottom MLP ─┐
emb_BFD (pooled) ───────┴─> x0 = concat ─> cross network ─> deep MLP ─> top ─> logit_B   (stacked)
                                       └─> cross network ─┬─> top ─> logit_B           (parallel)
                                       └─> deep MLP ──────┘

The cross network is `num_cross_layers` layers x_{l+1} = x0 * (W x_l + b) + x_l (full
rank, or W = U V^T of rank `cross_rank`). As in DLRM, the embedding tables live in the
sharded collection (`DCNv2Config.tables()`); this module is the data-parallel dense part.

`DCNv2Config.mlperf` is the MLPerf Training DLRM-DCNv2 benchmark (Criteo 1TB with
multi-hot bags): the MLCommons reference `recommendation_v2/torchrec_dlrm` (README, the
run on the materialized multi-hot data set) trains 26 tables of `MLPERF_ROWS` rows, dim
128, with `MLPERF_MULTI_HOT` ids per bag, bottom MLP 13-512-256-128, DCN-v2 with 3
low-rank (512) cross layers, over arch 1024-1024-512-256-1, Adagrad for the dense and the
sparse part (lr 0.005, eps 1e-8, initial accumulator 0, no warm-up or decay: the
script's defaults), global batch 65536 on 8 GPUs. That is 204.2M rows, 26.1G embedding
parameters: 104.5 GB in float32, 52.3 GB in bfloat16, so the preset stores the tables
of at least `MLPERF_BF16_ROWS` rows (the five 40M-row tables and the 3.07M one) in
bfloat16, which with a row-wise Adagrad accumulator (0.8 GB) fits one 80 GB GPU; the
planner shards them over more (`experiments.bench_dlrm --model=dcnv2 --preset=mlperf
--show_plan`). The reference's exact (per-element) Adagrad on the tables would double
their memory; `rowwise_adagrad` is FBGEMM's and TorchRec's usual choice at this size.

Letters: B batch, Dn dense input features, D embedding dim, F sparse features,
X width of x0 (bottom output + F * D).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rec.data.synthetic import MLPERF_MULTI_HOT
from rec.layers.dcn import CrossNetwork
from rec.layers.mlp import MLP
from rec.models import common

STRUCTURES = ("stacked", "parallel")
# Rows of the 26 tables of MLPerf Training DLRM-DCNv2 (--num_embeddings_per_feature of the
# MLCommons reference's multi-hot run); ids per bag are rec.data.synthetic.MLPERF_MULTI_HOT.
MLPERF_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
               405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152,
               12973, 108, 36)
MLPERF_BF16_ROWS = 1 << 20     # the mlperf preset stores tables of at least this many rows bf16


def mlperf_rows(max_rows: int | None = None) -> tuple[int, ...]:
  """MLPERF_ROWS, each capped at `max_rows` (None: the reference's): the same 26 tables at
  a size a CPU or a test can hold (the small tables keep their reference sizes)."""
  if max_rows is None:
    return MLPERF_ROWS
  if max_rows < 1:
    raise ValueError(f"mlperf_rows: max_rows={max_rows}, expected >= 1")
  return tuple(min(r, int(max_rows)) for r in MLPERF_ROWS)


@dataclasses.dataclass(frozen=True)
class DCNv2Config(common.DenseConfig):
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
  # FP8 matmuls (rec/layers/fp8.py) in the layers matching fp8_layers ("", "all", or
  # patterns over fp8_layer_names such as "cross.*"), with recipe tensor | row | delayed.
  fp8_layers: str = ""
  fp8_recipe: str = "tensor"
  # Per table: mean ids per bag (the planner's pooling factor) and row storage; None: 1
  # and "fp32" for every table.
  pooling_factors: tuple[float, ...] | None = None
  table_storage: tuple[str, ...] | None = None

  def __post_init__(self):
    w = "DCNv2Config"
    self.check_dense(w, mlps=("bottom_mlp", "deep_mlp", "top_mlp"), positive="each")
    if self.num_cross_layers < 1 or self.cross_rank < 0:
      raise ValueError(f"{w}: num_cross_layers={self.num_cross_layers}, cross_rank="
                       f"{self.cross_rank}; expected >= 1 layers and rank >= 0 (0: full rank)")
    if self.structure not in STRUCTURES:
      raise ValueError(f"{w}: structure={self.structure!r}, expected one of {STRUCTURES}")
    if self.structure == "parallel" and not self.deep_mlp:
      raise ValueError(f"{w}: structure='parallel' needs a deep_mlp beside the cross network")
    common.check_fp8(w, self)
    for f in ("pooling_factors", "table_storage"):
      v = getattr(self, f)
      if v is not None:
        object.__setattr__(self, f, tuple(v))
        if len(v) != self.num_sparse:
          raise ValueError(f"{w}: {f} has {len(v)} entries, expected one per sparse feature "
                           f"({self.num_sparse})")

  @property
  def fp8_layer_names(self) -> list[str]:
    """The layers fp8_layers can pick: bottom_mlp.<i>, cross.<i>, deep_mlp.<i>, top_mlp.<i>."""
    return ([f"bottom_mlp.{i}" for i in range(len(self.bottom_mlp))]
            + [f"cross.{i}" for i in range(self.num_cross_layers)]
            + [f"deep_mlp.{i}" for i in range(len(self.deep_mlp))]
            + [f"top_mlp.{i}" for i in range(len(self.top_mlp))])

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

  @classmethod
  def criteo(cls, num_rows: int | Sequence[int], **overrides) -> DCNv2Config:
    """MLPerf Training's DLRM-DCNv2 on Criteo: dim 128, bottom 13-512-256-128, 3 cross
    layers of rank 512 (stacked), then 1024-1024-512-256-1."""
    kwargs = dict(num_dense=13, num_sparse=26, embedding_dim=128, rows_per_feature=num_rows,
                  bottom_mlp=(512, 256, 128), num_cross_layers=3, cross_rank=512,
                  deep_mlp=(1024, 1024, 512, 256), structure="stacked", top_mlp=(1,))
    return cls(**{**kwargs, **overrides})

  @classmethod
  def mlperf(cls, num_rows: int | Sequence[int] | None = None, **overrides) -> DCNv2Config:
    """MLPerf Training DLRM-DCNv2 (module docstring): `criteo`'s architecture on tables of
    `num_rows` rows (None: MLPERF_ROWS; a data set's rows per feature when called as the
    `--preset=mlperf` of `rec.configs`), pooling factors MLPERF_MULTI_HOT (26 features),
    and tables of at least MLPERF_BF16_ROWS rows stored in bfloat16."""
    rows = MLPERF_ROWS if num_rows is None else num_rows
    n = overrides.get("num_sparse", 26)
    rows_t = (int(rows),) * n if isinstance(rows, (int, np.integer)) else tuple(rows)
    defaults = dict(
        table_storage=tuple("bf16" if r >= MLPERF_BF16_ROWS else "fp32" for r in rows_t),
        pooling_factors=tuple(float(x) for x in MLPERF_MULTI_HOT) if n == 26 else None)
    return cls.criteo(rows_t, **{**defaults, **overrides})


class DCNv2(common.DenseModel):
  """The dense part of DCN-v2: bottom MLP, cross network, deep MLP, top to one logit."""

  def __init__(self, config: DCNv2Config, rngs: nnx.Rngs):
    self.config = cfg = config
    dtype = common.DTYPES[cfg.dtype]
    fp8 = dict(fp8_layers=cfg.fp8_layers, fp8_recipe=cfg.fp8_recipe)
    self.bottom_mlp = common.bottom_mlp(cfg, rngs, relu_last=True)
    self.cross = CrossNetwork(cfg.cross_dim, cfg.num_cross_layers, rngs,
                              rank=cfg.cross_rank or None, dtype=dtype, name="cross", **fp8)
    # Stacked: the deep MLP reads the cross output; parallel: x0. Both are X wide.
    self.deep_mlp = (MLP(cfg.cross_dim, cfg.deep_mlp, rngs, activate_last=True, dtype=dtype,
                         name="deep_mlp", **fp8) if cfg.deep_mlp else None)
    self.top_mlp = common.top_mlp(cfg, cfg.top_in, rngs)

  def interact(self, x_BD, emb_BFD):
    """Cross network over x0 = [dense part, flattened embeddings], then the deep MLP
    (stacked) or beside it (parallel): [B, top_in]."""
    flat_BX = emb_BFD.reshape(emb_BFD.shape[0], -1)
    x0_BX = flat_BX if x_BD is None else jnp.concatenate([x_BD, flat_BX], axis=1)
    cross_BX = self.cross(x0_BX)
    if self.config.structure == "stacked":
      return self.deep_mlp(cross_BX) if self.deep_mlp is not None else cross_BX
    return jnp.concatenate([cross_BX, self.deep_mlp(x0_BX)], axis=1)
