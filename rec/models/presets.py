"""Model presets of the rec families and the model a run config builds.

PRESETS / PATTERNS: each family's named sizes (`--preset`: kaggle, small, terabyte,
dhen_4l, l3_n16, scaled<i>, ...) and the patterns that name a size (`w<W>[_d<depth>]`);
`model_config(cfg, spec)`: the family's config for a `rec.configs.RecRunConfig` and a data
spec (embedding dim, dtype, FP8 layers applied); `searched_config` for
`--model=searched:FILE`; MODELS maps a config type to its module; `build_model_fn` and
`model_stats` (parameter counts, forward GFLOPs per example). `rec.configs` re-exports them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable

from flax import nnx

from core import flops as flops_lib
from rec.embedding.config import TableConfig
from rec.models import dcnv2 as dcnv2_lib
from rec.models import dhen as dhen_lib
from rec.models import dlrm as dlrm_lib
from rec.models import logreg as logreg_lib
from rec.models import searched as searched_lib
from rec.models import wukong as wukong_lib

if TYPE_CHECKING:   # annotations only
  from rec.configs import RecRunConfig
  from rec.train_lib import RecTask

PRESETS = {
    "kaggle": dlrm_lib.DLRMConfig.criteo_kaggle,
    "terabyte": dlrm_lib.DLRMConfig.criteo_terabyte,
}

# Per model: preset name -> constructor(rows, **overrides). "kaggle" is each model's
# Criteo default, "small" a tiny one for tests and smoke runs. Size patterns (PATTERNS,
# for scaling studies such as experiments.wukong_scaling) are parsed by `_pattern`:
#   wukong  "l<layers>_n<n>" (the paper's Criteo search space, n_F = n_L = n), optionally
#           "_k<rank>_w<mlp width>" (WukongConfig.family; defaults k24, w512), and
#           "scaled<i>" (rung i of wukong.SCALING_LADDER);
#   dlrm    "w<W>[_d<depth>]": bottom MLP (W, D), top MLP depth x W then 1 (depth 2), dim 16;
#   dcnv2   "x<layers>_r<rank>_w<W>[_d<depth>]": raw dense features, <layers> cross layers
#           of rank <rank> (0: full rank), deep MLP depth x W (depth 2), stacked, dim 16.
MODEL_PRESETS: dict[str, dict[str, Callable[..., Any]]] = {
    "dlrm": {
        **PRESETS,
        "small": lambda rows, **o: dlrm_lib.DLRMConfig(
            **{"embedding_dim": 16, "bottom_mlp": (64, 16), "top_mlp": (64, 1),
               "rows_per_feature": rows, **o}),
    },
    "dcnv2": {
        "kaggle": dcnv2_lib.DCNv2Config.criteo,
        # MLPerf Training DLRM-DCNv2: criteo's architecture, multi-hot pooling factors, big
        # tables in bf16 (rows from the data: MLPERF_ROWS for MLPerf-shaped data).
        "mlperf": dcnv2_lib.DCNv2Config.mlperf,
        "small": lambda rows, **o: dcnv2_lib.DCNv2Config(
            **{"embedding_dim": 16, "rows_per_feature": rows, "bottom_mlp": (64, 16),
               "num_cross_layers": 2, "cross_rank": 32, "deep_mlp": (64,), "top_mlp": (1,), **o}),
    },
    "dhen": {
        "kaggle": dhen_lib.DHENConfig.criteo,
        "dhen_2l": dhen_lib.DHENConfig.dhen_2l,
        "dhen_4l": dhen_lib.DHENConfig.dhen_4l,
        "dhen_8l": dhen_lib.DHENConfig.dhen_8l,
        # Every interaction kind once, so a smoke run exercises them all.
        "small": lambda rows, **o: dhen_lib.DHENConfig(
            **{"embedding_dim": 16, "rows_per_feature": rows, "bottom_mlp": (64, 16),
               "layers": (("dot", "self_attention", "linear"), ("dcn", "conv", "conv2d")),
               "width": 8, "dcn_rank": 16, "top_mlp": (64, 1), **o}),
    },
    "wukong": {
        "kaggle": wukong_lib.WukongConfig.criteo,
        "small": lambda rows, **o: wukong_lib.WukongConfig(
            **{"embedding_dim": 16, "rows_per_feature": rows, "bottom_mlp": (64, 32),
               "num_layers": 2, "num_fm": 4, "num_lcb": 4, "fm_rank": 8, "fm_mlp": (64,),
               "top_mlp": (64, 1), **o}),
    },
}


PATTERNS = {"dlrm": ["w<W>[_d<depth>]"], "dcnv2": ["x<layers>_r<rank>_w<W>[_d<depth>]"],
            "wukong": ["l<layers>_n<n>[_k<rank>][_w<width>]", "scaled<i>"]}


def _pattern(model: str, preset: str) -> Callable[..., Any] | None:
  """The constructor of a size-pattern preset (see MODEL_PRESETS' comment), or None."""
  if model == "wukong":
    if m := re.fullmatch(r"l(\d+)_n(\d+)(?:_k(\d+))?(?:_w(\d+))?", preset):
      layers, n = int(m[1]), int(m[2])
      rank, width = int(m[3] or 24), int(m[4] or 512)
      # k24, w512 is WukongConfig.criteo's own FMB / top MLP, so "l2_n8" is unchanged.
      return lambda rows, **o: wukong_lib.WukongConfig.family(rows, layers, n, n, rank, width, **o)
    if m := re.fullmatch(r"scaled(\d+)", preset):
      return lambda rows, **o: wukong_lib.WukongConfig.scaled(rows, int(m[1]), **o)
  if model == "dlrm" and (m := re.fullmatch(r"w(\d+)(?:_d(\d+))?", preset)):
    width, depth = int(m[1]), int(m[2] or 2)
    return lambda rows, **o: dlrm_lib.DLRMConfig(
        **{"num_dense": 13, "num_sparse": 26, "embedding_dim": 16, "rows_per_feature": rows,
           "bottom_mlp": (width, 16), "top_mlp": (width,) * depth + (1,), **o})
  if model == "dcnv2" and (m := re.fullmatch(r"x(\d+)_r(\d+)_w(\d+)(?:_d(\d+))?", preset)):
    layers, rank, width, depth = int(m[1]), int(m[2]), int(m[3]), int(m[4] or 2)
    return lambda rows, **o: dcnv2_lib.DCNv2Config(
        **{"num_dense": 13, "num_sparse": 26, "embedding_dim": 16, "rows_per_feature": rows,
           "bottom_mlp": (), "num_cross_layers": layers, "cross_rank": rank,
           "deep_mlp": (width,) * depth, "structure": "stacked", "top_mlp": (1,), **o})
  return None


def _with_embedding_dim(mcfg, dim: int):
  """The config at embedding dim `dim`; a bottom MLP that feeds embeddings ends at the
  new dim (DLRM, DHEN) or keeps its number of dense embeddings (Wukong)."""
  over: dict[str, Any] = {"embedding_dim": dim}
  if mcfg.num_dense > 0 and isinstance(mcfg, (dlrm_lib.DLRMConfig, dhen_lib.DHENConfig)):
    over["bottom_mlp"] = mcfg.bottom_mlp[:-1] + (dim,)
  if mcfg.num_dense > 0 and isinstance(mcfg, wukong_lib.WukongConfig):
    over["bottom_mlp"] = mcfg.bottom_mlp[:-1] + (mcfg.num_dense_embeddings * dim,)
  return dataclasses.replace(mcfg, **over)


def model_config(cfg: RecRunConfig, spec):
  """The model config for `cfg.model` (its model, preset ...) on data shaped like `spec`."""
  m = cfg.model
  names = tuple(spec.sparse_features)
  rows = tuple(spec.rows_per_feature)
  if m.model == "logreg":
    if m.embedding_dim not in (0, 1):
      raise ValueError(f"--embedding_dim={m.embedding_dim}: logreg's tables are dim 1")
    if m.dtype != "float32" or m.fp8_layers:
      raise ValueError(f"--dtype={m.dtype!r}, --fp8_layers={m.fp8_layers!r} with "
                       "--model=logreg: logreg has no dense layers to run in low precision "
                       "(expected float32 and no FP8 layers)")
    return logreg_lib.LogRegConfig(num_dense=spec.num_dense, num_sparse=len(names),
                                   rows_per_feature=rows, feature_names=names)
  if m.model.startswith(SEARCHED):
    return searched_config(cfg, spec)
  if m.model not in MODEL_PRESETS:
    raise ValueError(f"--model={m.model!r}: expected one of "
                     f"{sorted(MODEL_PRESETS) + ['logreg', SEARCHED + 'FILE']}")
  presets = MODEL_PRESETS[m.model]
  named = presets.get(m.preset)
  make = named or _pattern(m.model, m.preset)
  if make is None:
    extra = PATTERNS.get(m.model, [])
    raise ValueError(f"--preset={m.preset!r} for --model={m.model}: expected one of "
                     f"{sorted(presets) + extra}")
  over: dict[str, Any] = dict(num_dense=spec.num_dense, num_sparse=len(names), feature_names=names)
  if m.dtype != "float32":
    over["dtype"] = m.dtype
  if m.fp8_layers:
    if m.model not in ("dlrm", "dcnv2"):
      raise ValueError(f"--fp8_layers={m.fp8_layers!r} with --model={m.model}: FP8 layers "
                       "are wired into dlrm and dcnv2")
    over.update(fp8_layers=m.fp8_layers, fp8_recipe=m.fp8_recipe)
  if spec.num_dense == 0:
    over["bottom_mlp"] = ()
  try:
    mcfg = make(rows, **over)
  except ValueError as e:
    if named is not None:
      raise
    # A size pattern's numbers are the flag's (scaled9, l0_n8, w0): say so.
    raise ValueError(f"--preset={m.preset!r} for --model={m.model}: {e}") from None
  if m.embedding_dim < 0:
    raise ValueError(f"--embedding_dim={m.embedding_dim}: expected >= 0 (0: the preset's)")
  if m.embedding_dim and m.embedding_dim != mcfg.embedding_dim:
    mcfg = _with_embedding_dim(mcfg, m.embedding_dim)
  return mcfg


SEARCHED = "searched:"   # --model=searched:FILE, an architecture JSON (rec/models/searched.py)


def searched_config(cfg: RecRunConfig, spec) -> searched_lib.SearchedConfig:
  """The architecture of --model=searched:FILE on data shaped like `spec` (its embedding dim
  is the file's; --preset does not apply)."""
  m = cfg.model
  path = m.model[len(SEARCHED):]
  arch = searched_lib.load_arch(path)
  if m.fp8_layers:
    raise ValueError(f"--fp8_layers={m.fp8_layers!r} with --model={m.model}: FP8 layers "
                     "are wired into dlrm and dcnv2")
  if m.embedding_dim and m.embedding_dim != arch.get("embedding_dim"):
    raise ValueError(f"--embedding_dim={m.embedding_dim} with --model={m.model}: the file "
                     f"sets embedding_dim={arch.get('embedding_dim')}; expected 0 or that value")
  return searched_lib.SearchedConfig.from_arch(
      arch, num_dense=spec.num_dense, num_sparse=len(spec.sparse_features),
      rows_per_feature=tuple(spec.rows_per_feature), feature_names=tuple(spec.sparse_features),
      dtype=m.dtype, where=path)


MODELS = {dlrm_lib.DLRMConfig: dlrm_lib.DLRM, dcnv2_lib.DCNv2Config: dcnv2_lib.DCNv2,
          dhen_lib.DHENConfig: dhen_lib.DHEN, wukong_lib.WukongConfig: wukong_lib.Wukong,
          logreg_lib.LogRegConfig: logreg_lib.LogReg,
          searched_lib.SearchedConfig: searched_lib.SearchedModel}


def build_model_fn(cfg: RecRunConfig, spec) -> tuple[Any, list[TableConfig], str | float]:
  """Returns (model constructor taking rngs, its tables, init scale of the tables)."""
  mcfg = model_config(cfg, spec)
  model_cls = MODELS[type(mcfg)]
  init_scale = 0.0 if cfg.model.model == "logreg" else "dlrm"
  return (lambda rngs: model_cls(mcfg, rngs)), mcfg.tables(), init_scale


def model_stats(task: RecTask, spec, batch: int = 64) -> dict[str, float]:
  """Dense and embedding parameter counts and forward GFLOPs/example of the dense model
  (XLA's count, FP8 layers counted as the matmuls they are: `fp8.as_plain_matmuls`; the
  embedding lookup is memory traffic and not counted)."""
  from rec.layers import fp8 as fp8_lib
  tables = task.collection.tables
  dense = flops_lib.count_params(nnx.eval_shape(lambda: task.model_fn(nnx.Rngs(0))))
  shapes = (spec.num_dense, len(tables), tables[0].dim)
  with fp8_lib.as_plain_matmuls():
    gflops = flops_lib.model_flops_per_example(task.model_fn, shapes, batch=batch) / 1e9
  return {"dense_params": dense, "embedding_params": sum(t.num_rows * t.dim for t in tables),
          "gflops_per_example": gflops}
