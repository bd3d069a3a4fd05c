"""Recommendation-model throughput: the jitted train step alone (what experiments.bench_dlrm
times) and the train loop end to end against it (experiments.bench_pipeline).

`build_step` builds the DLRM / DCNv2 task of a `rec.configs.RecRunConfig` (or the MLPerf
DLRM-DCNv2 run, `rec.mlperf`), its donated jitted step and a pool of 8 device batches
generated before timing; `time_step` times it. `pipeline_rates` measures one --data source:
the source alone, the step alone and `core.train.train` end to end (`rec.throughput`);
`recd_rates` the same step and end-to-end rates plain against RecD's dedup on session data;
`host_prefetch_rates` the step with every table on the host tier, without and with the
next batch's rows prefetched into the device caches (--host_prefetch).
"""

from __future__ import annotations

import math
from typing import Any, Sequence


def is_mlperf(model: str, preset: str) -> bool:
  return (model, preset) == ("dcnv2", "mlperf")


def build_step(batch_size: int, rows: int, mesh: str, sharding: str, model: str = "dlrm",
               preset: str = "kaggle", memory_budget_gb: float | None = None, **overrides):
  """(jitted donated step, state, pool of device batches, devices) for the benchmark; the
  planner's budget is `memory_budget_gb` GiB per device, by default the device's memory.

  The Criteo Kaggle DLRM: Adagrad dense, row-wise Adagrad sparse, both lr 0.1, `rows` per
  table; --model=dcnv2 --preset=mlperf: `rec.mlperf`'s run with tables capped at `rows`
  (0: the reference's 204M rows). overrides: RecRunConfig fields (dtype, fp8_layers, ...).
  """
  return step_of(*build_task(batch_size, rows, mesh, sharding, model, preset,
                             memory_budget_gb, **overrides))


def step_of(task, train_src):
  """`build_step`'s (step, state, pool, devices) of a built task and its train source."""
  import jax

  hosts = [train_src.batch(k) for k in range(8)]
  if task.host_prefetch:   # the pool's batches in a cycle: batch k looks at batch k + 1
    from rec.data.lookahead import with_lookahead
    hosts = [with_lookahead(b, hosts[(k + 1) % len(hosts)]) for k, b in enumerate(hosts)]
  pool = [task.device_batch(b) for b in hosts]
  state = task.init_state(0)
  step = jax.jit(task.train_step, donate_argnums=0)
  return step, state, pool, task.mesh.size


def build_task(batch_size: int, rows: int, mesh: str, sharding: str, model: str = "dlrm",
               preset: str = "kaggle", memory_budget_gb: float | None = None, **overrides):
  """(task, train source) of `build_step`."""
  from rec import configs, mlperf

  if is_mlperf(model, preset):
    cfg = mlperf.run_config(batch_size, mesh, sharding, memory_budget_gb, **overrides)
    task, train_src, _ = mlperf.build_run(cfg, rows or None)
  else:
    kw = dict(model=model, preset=preset, data="synthetic", num_rows=rows, mesh=mesh,
              batch_size=batch_size, eval_batch_size=batch_size, dense_optimizer="adagrad",
              learning_rate=0.1, sparse_optimizer="rowwise_adagrad",
              embedding_learning_rate=0.1, sharding=sharding, memory_budget_gb=memory_budget_gb)
    cfg = configs.make_run(**{**kw, **overrides})
    task, train_src, _, _, _ = configs.build_run(cfg)
  return task, train_src


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


def host_prefetch_rates(batch_size: int = 2048, rows: int = 100_000, mesh: str = "-1",
                        sharding: str = "tw", storage: str = "fp32_cache:lru:0.05@host",
                        steps: int = 20, repeats: int = 3, rounds: int = 3,
                        model: str = "dlrm", preset: str = "kaggle") -> dict[str, Any]:
  """The train step of `model` with every table on the host tier (`storage`), without and
  with --host_prefetch, side by side: rounds alternate the two over the same pool of 8
  batches (with prefetch each carries the next one's ids, in a cycle). Returns per setting
  the median seconds per step over every repeat, and the ids per step read from host
  memory in the lookups (`EmbeddingCollection.cache_misses` before each step of one pass
  over the pool, after the timing)."""
  import jax
  import numpy as np

  from core import benchmark

  tasks = {on: build_task(batch_size, rows, mesh, sharding, model, preset, storage=storage,
                         host_prefetch=on) for on in (False, True)}
  built = {on: step_of(*t) for on, t in tasks.items()}
  times: dict[bool, list[float]] = {False: [], True: []}
  states = {on: b[1] for on, b in built.items()}
  for _ in range(rounds):
    for on, (step, _, pool, _) in built.items():
      per_step, states[on] = time_step(step, states[on], pool, steps, repeats)
      times[on] += list(per_step)
  out: dict[str, Any] = {}
  misses_fn = jax.jit(tasks[False][0].collection.cache_misses)
  for on, (step, _, pool, ndev) in built.items():
    state, misses = states[on], []
    for b in pool:
      misses.append(int(sum(np.sum(v) for v in misses_fn(state["emb"], b.ids,
                                                         b.lengths).values())))
      state, _ = step(state, b)
    states[on] = state
    ids = sum(int(np.sum(np.asarray(b.lengths))) for b in pool) / len(pool)
    out["prefetch" if on else "plain"] = {
        "seconds_per_step_median": benchmark.median(times[on]), "seconds_per_step_all":
        times[on], "host_ids_per_step": float(np.mean(misses)), "ids_per_step": ids,
        "devices": ndev}
  out["plain_over_prefetch"] = (out["plain"]["seconds_per_step_median"]
                                / out["prefetch"]["seconds_per_step_median"])
  return out


def pipeline_rates(data: str, batch_size: int, num_rows: int, model: str, preset: str,
                   mesh: str, steps: int, source_batches: int, gen_dir: str,
                   gen_rows: int, repeats: int = 3, data_workers: int = 0,
                   profile_dir: str | None = None) -> dict[str, Any]:
  """{source, step, end_to_end} examples/s, end_to_end / step and "source" (the batch
  source's class) for one --data source;
  "criteo_bin:gen" writes `gen_rows` random rows in the criteo_bin layout under `gen_dir`
  once (`rec.throughput.synthetic_bin_dir`) and reads them back through Grain;
  `data_workers` > 0 draws the batches in that many Grain worker processes (train_rec's
  --data_workers)."""
  from rec import configs, throughput
  if data == "criteo_bin:gen":
    data = "criteo_bin:" + throughput.synthetic_bin_dir(gen_dir, gen_rows, num_rows)
  cfg = configs.make_run(model=model, preset=preset, data=data, num_rows=num_rows, mesh=mesh,
                         batch_size=batch_size, eval_batch_size=batch_size, eval_batches=1,
                         learning_rate=0.05, embedding_learning_rate=0.05, sharding="auto")
  task, train_src, _, _, _ = configs.build_run(cfg, data_workers=data_workers)
  out = throughput.measure(task, train_src, steps=steps, repeats=repeats,
                           source_batches=source_batches, profile_dir=profile_dir)
  out["source"] = type(train_src).__name__    # what drew the batches (DeviceSynthetic, ...)
  return out


def recd_capacity(batch_shard: int, dup_rate: float, sigmas: float = 6.0) -> int:
  """A fixed RecD capacity for sessions data: distinct bags of a batch shard of b samples
  are about 1 + Binomial(b - 1, 1 - dup) (+ 1 for a session cut by the shard's start);
  `sigmas` standard deviations above that, so one compiled step serves every batch."""
  b, d = batch_shard, dup_rate
  return min(b, math.ceil(2 + (b - 1) * (1 - d) + sigmas * math.sqrt((b - 1) * d * (1 - d))))


def recd_rates(repeats: Sequence[float], batch_size: int, num_rows: int, model: str,
               preset: str, mesh: str, steps: int, timing_repeats: int, data_workers: int,
               num_user: int = 8, user_bag: int = 32, log=print) -> list[dict[str, Any]]:
  """RecD (arXiv 2211.05239) end to end: per mean session length x (`sessions:dup=1-1/x`,
  rec.data.sessions), examples/s of the jitted step alone (device batches placed before
  timing) and of `core.train.train` end to end, plain against dedup of the user features,
  both with the train batches drawn (and, for dedup, deduplicated) in `data_workers` Grain
  worker processes. The end-to-end runs alternate plain / dedup `timing_repeats` times
  (medians reported), so both see the same machine load."""
  from core import benchmark
  from rec import configs, throughput
  from rec.data import dedup as dedup_lib
  rows = []
  for x in repeats:
    dup = 1.0 - 1.0 / x
    data = f"sessions:dup={dup!r},user={num_user},user_bag={user_bag}"
    base = configs.make_run(model=model, preset=preset, data=data, num_rows=num_rows,
                            mesh=mesh, batch_size=batch_size, eval_batch_size=batch_size,
                            eval_batches=1, learning_rate=0.05,
                            embedding_learning_rate=0.05, sharding="auto")
    built = {}
    for name in ("plain", "dedup"):
      cfg = base
      if name == "dedup":
        n = built["plain"][0].dedup_shards()
        cfg = configs.replace_run(
            base, dedup_features=",".join(f"C{f + 1}" for f in range(num_user)),
            dedup_capacity=recd_capacity(batch_size // n, dup))
      built[name] = configs.build_run(cfg, data_workers=data_workers)[:2]
    src = built["plain"][1]
    row = {"repeats": x, "dup_rate": dup, "data": data,
           "dup_rate_measured": dedup_lib.duplication_rate(src.batch(0), range(num_user)),
           "capacity_per_shard": built["dedup"][0].collection.dedup.capacity}
    for name, (task, train_src) in built.items():
      row[f"{name}_step_ex_s"] = throughput.step_rate(task, train_src, max(steps // 3, 1), 3)
    e2e = {"plain": [], "dedup": []}
    for _ in range(timing_repeats):
      for name, (task, train_src) in built.items():
        e2e[name].append(throughput.loop_rate(task, train_src, steps))
    for name in e2e:
      row[f"{name}_e2e_ex_s_runs"] = e2e[name]
      row[f"{name}_e2e_ex_s"] = benchmark.median(e2e[name])
    row["step_speedup"] = row["dedup_step_ex_s"] / row["plain_step_ex_s"]
    row["e2e_speedup"] = row["dedup_e2e_ex_s"] / row["plain_e2e_ex_s"]
    log(f"repeats {x:g} (dup {dup:.3f}, measured {row['dup_rate_measured']:.3f}): step "
        f"{row['plain_step_ex_s']:,.0f} -> {row['dedup_step_ex_s']:,.0f} ex/s "
        f"({row['step_speedup']:.2f}x), end to end {row['plain_e2e_ex_s']:,.0f} -> "
        f"{row['dedup_e2e_ex_s']:,.0f} ex/s ({row['e2e_speedup']:.2f}x)")
    rows.append(row)
  return rows


__all__ = ["build_step", "is_mlperf", "pipeline_rates", "recd_capacity", "recd_rates",
           "time_step"]
