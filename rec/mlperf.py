"""The MLPerf Training DLRM-DCNv2 run (Criteo 1TB multi-hot): config, data of its shapes, plans.

The model is `rec.models.dcnv2.DCNv2Config.mlperf` (`--model=dcnv2 --preset=mlperf`; its
docstring lists the reference's sizes). Here: the run settings of the MLCommons reference
(`run_config`: a constant lr 0.005 (no warmup or decay), the dense part by
torch.optim.Adagrad's update with its accumulator from 0 and eps 1e-8
(`--dense_optimizer=torch_adagrad`, not optax's adagrad), the tables by row-wise Adagrad at
the same rate: the reference's tables use FBGEMM's element-wise EXACT_ADAGRAD, whose state
of 128 floats per row would not fit one 80 GB GPU; row-wise keeps one per row), a synthetic
source with its 26 table sizes (optionally capped) and bag sizes (`build_run`, the steps of
`rec.configs.build_run` with that source), and the planner's plans at full size (`plans`;
with `host_memory_gb`, tables the device cannot hold go to the host tier,
rec/embedding/host_tier.py). `experiments.bench_dlrm --model=dcnv2 --preset=mlperf` times
it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from core import mesh as mesh_lib
from rec import configs
from rec.data import synthetic
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.storage_spec import StorageSpec
from rec.models import dcnv2

LEARNING_RATE = 0.005   # the MLCommons reference's Adagrad learning rate (dense and sparse)
GLOBAL_BATCH = 65536    # its global batch (8 GPUs x 8192)


def run_config(batch_size: int, mesh: str = "-1", sharding: str = "auto",
               memory_budget_gb: float | None = None, **overrides) -> configs.RecRunConfig:
  """RecRunConfig of the MLPerf DCNv2 (the reference's learning rate and dense Adagrad,
  row-wise Adagrad tables); the planner's budget `memory_budget_gb` GiB per device, by
  default the device's memory (`rec.configs.plan_budget`)."""
  kw = dict(model="dcnv2", preset="mlperf", data="synthetic:multi_hot=mlperf", mesh=mesh,
            batch_size=batch_size, eval_batch_size=batch_size, dense_optimizer="torch_adagrad",
            learning_rate=LEARNING_RATE, sparse_optimizer="rowwise_adagrad",
            embedding_learning_rate=LEARNING_RATE, sharding=sharding,
            memory_budget_gb=memory_budget_gb)
  return configs.make_run(**{**kw, **overrides})


def build_run(cfg: configs.RecRunConfig, max_rows: int | None = None, devices=None):
  """(task, train source, plan): `rec.configs.build_run` of `cfg` on the MLPerf tables
  (`dcnv2.mlperf_rows(max_rows)`) fed by synthetic Zipf ids in bags of the reference's sizes
  (MLPERF_MULTI_HOT), this process's share of each global batch; every other setting of
  `cfg` (storage, host tier and prefetch, FP8 recipe, a2a, RecD, ...) applies as in
  train_rec."""
  mesh = mesh_lib.make_mesh(cfg.mesh, devices, rules=mesh_lib.REC_RULES)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  if cfg.train.batch_size % n:
    raise ValueError(f"--batch_size={cfg.train.batch_size} is not divisible by the {n} "
                     f"devices of --mesh={cfg.mesh!r}")
  shard, shards = mesh_lib.process_batch_share(mesh, mesh_lib.REC_RULES)
  src = synthetic.SyntheticCriteo(cfg.train.batch_size, dcnv2.mlperf_rows(max_rows),
                                  seed=cfg.seed, multi_hot=synthetic.MLPERF_MULTI_HOT,
                                  shard_index=shard, num_shards=shards)
  task, train_src, _, plan, _ = configs.build_run(cfg, devices, sources=(src, src))
  return task, train_src, plan


def full_size_plan(num_devices: int, memory_budget_gb: float = 70.0,
                   batch_size: int = GLOBAL_BATCH, storage: StorageSpec | None = None,
                   host_tier: planner_lib.HostTier | None = None):
  """(plan, tables, optimizer) of the full-size tables on `num_devices` devices: row-wise
  Adagrad state, `memory_budget_gb` GiB per device, every table stored as `storage` (None:
  the preset's, bf16 big tables); `host_tier` lets the planner move the tables the devices
  cannot hold to host memory. A plan that fits nowhere raises planner.PlanError (one line
  naming the table and the bytes)."""
  tables = dcnv2.DCNv2Config.mlperf().tables()
  if storage is not None:
    tables = [dataclasses.replace(t, storage=storage) for t in tables]
  opt = opt_lib.get_sparse_optimizer("rowwise_adagrad", LEARNING_RATE)
  if host_tier is None:
    cfg = run_config(batch_size, memory_budget_gb=memory_budget_gb)
    return configs.make_plan(cfg, tables, num_devices, opt), tables, opt
  # make_plan's auto plan (no cw under row-wise Adagrad), with the host tier
  kinds = tuple(k for k in planner_lib.AUTO_KINDS if k != planner_lib.CW)
  plan = planner_lib.plan(tables, num_devices, int(memory_budget_gb * 2**30), batch_size,
                          kinds=kinds, optimizer_state_bytes_per_row=opt.state_bytes_per_row,
                          host_tier=host_tier)
  return plan, tables, opt


def plans(num_devices: Sequence[int] = (1, 8), memory_budget_gb: float = 70.0,
          batch_size: int = GLOBAL_BATCH, storage: StorageSpec | None = None,
          host_memory_gb: float | None = None, budget_source: str = "",
          host_source: str = "") -> dict[int, str]:
  """The planner's plan (as text) of the full-size tables for each device count
  (`full_size_plan`); `host_memory_gb` GiB of host memory per device for the host tier
  (None: no host tier)."""
  tier = None if host_memory_gb is None else planner_lib.HostTier(
      int(host_memory_gb * 2**30), source=host_source)
  out = {}
  for n in num_devices:
    plan, tables, opt = full_size_plan(n, memory_budget_gb, batch_size, storage, tier)
    out[n] = planner_lib.format_plan(
        plan, tables, n, batch_size, int(memory_budget_gb * 2**30),
        optimizer_state_bytes_per_row=opt.state_bytes_per_row, budget_source=budget_source,
        host_budget_bytes=None if tier is None else tier.host_budget_bytes,
        host_source=host_source)
  return out
