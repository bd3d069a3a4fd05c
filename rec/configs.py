"""Builds a recommendation run from plain settings: data sources, model, plan, task.

`experiments/train_rec.py` is the flag front end; notebooks and tests call `build_run`
directly with a `RecRunConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


from core import mesh as mesh_lib
from rec.data import sources as sources_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import ShardingKind, TableConfig
from rec.models import dlrm as dlrm_lib
from rec.models import logreg as logreg_lib
from rec.train_lib import RecTask, make_dense_optimizer


@dataclasses.dataclass
class RecRunConfig:
  model: str = "dlrm"                 # dlrm | logreg
  preset: str = "kaggle"              # kaggle | terabyte | small
  data: str = "synthetic"             # synthetic | criteo:DIR | avazu:DIR
  num_rows: int = 100_000             # hashed rows per sparse feature
  mesh: str = "-1"
  batch_size: int = 2048
  eval_batch_size: int = 8192
  eval_batches: int = 8               # synthetic eval set size, in eval batches
  dense_optimizer: str = "adagrad"
  learning_rate: float = 0.05
  sparse_optimizer: str = "rowwise_adagrad"
  embedding_learning_rate: float = 0.05
  sharding: str = "auto"              # auto | dp | tw | rw | cw | twrw
  sharding_overrides: str = ""        # "C1=tw,C3=rw"
  memory_budget_gb: float = 16.0      # per device, for the planner
  storage: str = "fp32"               # fp32 | bf16 embedding rows
  bad_lines: str = "error"            # error | skip
  seed: int = 0


PRESETS = {
    "kaggle": dlrm_lib.DLRMConfig.criteo_kaggle,
    "terabyte": dlrm_lib.DLRMConfig.criteo_terabyte,
}


def build_model_fn(cfg: RecRunConfig, spec) -> tuple[Any, list[TableConfig], str]:
  """Returns (model constructor taking rngs, its tables, init scale of the tables)."""
  names = tuple(spec.sparse_features)
  rows = tuple(spec.rows_per_feature)
  if cfg.model == "dlrm":
    if cfg.preset == "small":
      mcfg = dlrm_lib.DLRMConfig(
          num_dense=spec.num_dense, num_sparse=len(names), embedding_dim=16,
          bottom_mlp=(64, 16) if spec.num_dense else (), top_mlp=(64, 1),
          rows_per_feature=rows, feature_names=names)
    elif cfg.preset in PRESETS:
      over = dict(num_dense=spec.num_dense, num_sparse=len(names), feature_names=names)
      if spec.num_dense == 0:
        over["bottom_mlp"] = ()
      mcfg = PRESETS[cfg.preset](rows, **over)
    else:
      raise ValueError(f"--preset={cfg.preset!r}: expected one of {sorted(PRESETS) + ['small']}")
    tables = mcfg.tables()
    return (lambda rngs: dlrm_lib.DLRM(mcfg, rngs)), tables, "dlrm"
  if cfg.model == "logreg":
    mcfg = logreg_lib.LogRegConfig(num_dense=spec.num_dense, num_sparse=len(names),
                                   rows_per_feature=rows, feature_names=names)
    return (lambda rngs: logreg_lib.LogReg(mcfg, rngs)), mcfg.tables(), 0.0
  raise ValueError(f"--model={cfg.model!r}: expected 'dlrm' or 'logreg'")


def make_plan(cfg: RecRunConfig, tables: list[TableConfig], num_devices: int,
              optimizer: opt_lib.SparseOptimizer) -> planner_lib.Plan:
  overrides = planner_lib.parse_overrides(cfg.sharding_overrides) if cfg.sharding_overrides else {}
  planner_lib.validate_overrides(overrides, tables)
  if cfg.sharding == "auto":
    # A row-wise optimizer keeps one accumulator per row per column chunk under cw (as
    # TorchRec does), which changes the update; auto plans keep it exact by leaving cw out.
    kinds = None
    if isinstance(optimizer, opt_lib.RowWiseAdagrad):
      kinds = tuple(k for k in ShardingKind if k != ShardingKind.COLUMN_WISE)
    return planner_lib.plan(
        tables, num_devices, memory_budget_bytes=int(cfg.memory_budget_gb * 2**30),
        batch_size=cfg.batch_size, overrides=overrides, kinds=kinds,
        optimizer_state_bytes_per_row=optimizer.state_bytes_per_row)
  try:
    kind = ShardingKind(cfg.sharding)
  except ValueError:
    raise ValueError(f"--sharding={cfg.sharding!r}: expected auto or one of "
                     f"{[k.value for k in ShardingKind]}") from None
  plan = planner_lib.uniform_plan(tables, kind, num_devices)
  if overrides:
    for name, k in overrides.items():
      one = [t for t in tables if t.name == name]
      plan[name] = planner_lib.uniform_plan(one, ShardingKind(k), num_devices)[name]
  return plan


def build_run(cfg: RecRunConfig, devices=None):
  """Returns (task, train source, eval source, plan, mesh)."""
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  for what, b in (("batch_size", cfg.batch_size), ("eval_batch_size", cfg.eval_batch_size)):
    if b % n:
      raise ValueError(f"--{what}={b} is not divisible by the {n} devices of --mesh={cfg.mesh!r}")
  train_src, eval_src = sources_lib.make_sources(
      cfg.data, cfg.batch_size, eval_batch_size=cfg.eval_batch_size, num_rows=cfg.num_rows,
      seed=cfg.seed, bad_lines=cfg.bad_lines, eval_batches=cfg.eval_batches)
  model_fn, tables, init_scale = build_model_fn(cfg, train_src.spec)
  if cfg.storage != "fp32":
    tables = [dataclasses.replace(t, storage=cfg.storage) for t in tables]
  sparse_opt = opt_lib.get_sparse_optimizer(cfg.sparse_optimizer, cfg.embedding_learning_rate)
  plan = make_plan(cfg, tables, n, sparse_opt)
  coll = EmbeddingCollection(tables, plan, mesh, sparse_opt, init_scale=init_scale)
  task = RecTask(model_fn, coll, make_dense_optimizer(cfg.dense_optimizer, cfg.learning_rate), mesh)
  return task, train_src, eval_src, plan, mesh


def steps_for(epochs: float, train_src) -> int:
  if train_src.num_batches is None:
    raise ValueError("--epochs needs a finite data set; synthetic data is infinite: use --steps")
  return max(1, math.floor(epochs * train_src.num_batches))
