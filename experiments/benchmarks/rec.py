"""Recommendation-model throughput: the jitted train step alone (what experiments.bench_dlrm
times) and the train loop end to end against it (experiments.bench_pipeline).

`build_step` builds the DLRM / DCNv2 task of a `rec.configs.RecRunConfig` (or the MLPerf
DLRM-DCNv2 run, `rec.mlperf`), its donated jitted step and a pool of 8 device batches
generated before timing; `time_step` times it. `pipeline_rates` measures one --data source:
the source alone, the step alone and `core.train.train` end to end (`rec.throughput`).
"""

from __future__ import annotations

from typing import Any


def is_mlperf(model: str, preset: str) -> bool:
  return (model, preset) == ("dcnv2", "mlperf")


def build_step(batch_size: int, rows: int, mesh: str, sharding: str, model: str = "dlrm",
               preset: str = "kaggle", memory_budget_gb: float = 70.0, **overrides):
  """(jitted donated step, state, pool of device batches, devices) for the benchmark.

  The Criteo Kaggle DLRM: Adagrad dense, row-wise Adagrad sparse, both lr 0.1, `rows` per
  table; --model=dcnv2 --preset=mlperf: `rec.mlperf`'s run with tables capped at `rows`
  (0: the reference's 204M rows). overrides: RecRunConfig fields (dtype, fp8_layers, ...).
  """
  import jax

  from rec import configs, mlperf

  if is_mlperf(model, preset):
    cfg = mlperf.run_config(batch_size, mesh, sharding, memory_budget_gb, **overrides)
    task, train_src, _ = mlperf.build_run(cfg, rows or None)
  else:
    kw = dict(model=model, preset=preset, data="synthetic", num_rows=rows, mesh=mesh,
              batch_size=batch_size, eval_batch_size=batch_size, dense_optimizer="adagrad",
              learning_rate=0.1, sparse_optimizer="rowwise_adagrad",
              embedding_learning_rate=0.1, sharding=sharding, memory_budget_gb=memory_budget_gb)
    cfg = configs.RecRunConfig(**{**kw, **overrides})
    task, train_src, _, _, _ = configs.build_run(cfg)
  pool = [task.device_batch(train_src.batch(k)) for k in range(8)]
  state = task.init_state(0)
  step = jax.jit(task.train_step, donate_argnums=0)
  return step, state, pool, task.mesh.size


def time_step(step, state, pool, steps: int, repeats: int, warmup: int = 5):
  """(seconds per step of each repeat, state): the step over the pool's batches in turn."""
  from core import benchmark

  i = [0]

  def one(s):
    b = pool[i[0] % len(pool)]
    i[0] += 1
    s, _ = step(s, b)
    return s

  return benchmark.time_steps(one, state, steps, repeats, warmup)


def pipeline_rates(data: str, batch_size: int, num_rows: int, model: str, preset: str,
                   mesh: str, steps: int, source_batches: int, gen_dir: str,
                   gen_rows: int, repeats: int = 3) -> dict[str, Any]:
  """{source, step, end_to_end} examples/s and end_to_end / step for one --data source;
  "criteo_bin:gen" writes `gen_rows` random rows in the criteo_bin layout under `gen_dir`
  once (`rec.throughput.synthetic_bin_dir`) and reads them back through Grain."""
  from rec import configs, throughput
  if data == "criteo_bin:gen":
    data = "criteo_bin:" + throughput.synthetic_bin_dir(gen_dir, gen_rows, num_rows)
  cfg = configs.RecRunConfig(model=model, preset=preset, data=data, num_rows=num_rows, mesh=mesh,
                             batch_size=batch_size, eval_batch_size=batch_size, eval_batches=1,
                             learning_rate=0.05, embedding_learning_rate=0.05, sharding="auto")
  task, train_src, _, _, _ = configs.build_run(cfg)
  return throughput.measure(task, train_src, steps=steps, repeats=repeats,
                            source_batches=source_batches)


__all__ = ["build_step", "is_mlperf", "pipeline_rates", "time_step"]
