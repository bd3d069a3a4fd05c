"""RecD (arXiv 2211.05239) study: lookup / train-step throughput of the deduplicated path
against the plain path through the same RecTask and collection, by duplication rate.

  throughput_study(...)       per session length: duplication rate, host dedup time, median
                              lookup and train-step seconds, plain vs dedup
  format_rows(rows), plot(rows, path)

Batches come from the library's session data (rec.data.sessions.SessionSource, the source
of `train_rec --data=sessions:...`) in its fixed-length form: every `session_len`
consecutive samples share their user features, so a batch's user-feature duplication rate
is 1 - 1 / session_len exactly and each row of the sweep sits at its own rate.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import optax

from core import benchmark
from core import mesh as mesh_lib
from rec.data import dedup as dedup_lib
from rec.data import sessions
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import ShardingKind
from rec.models.dlrm import DLRM, DLRMConfig
from rec.train_lib import RecTask


def throughput_study(session_lens, batch_size: int = 2048, num_user: int = 8,
                     num_item: int = 8, user_bag: int = 32, num_rows: int = 100_000,
                     dim: int = 32, steps: int = 5, repeats: int = 5, mesh_spec: str = "-1",
                     seed: int = 0, log=print) -> list[dict[str, Any]]:
  """Per session length: duplication rate of the user features, host dedup time, and the
  median seconds of the forward lookup and of a train step, plain vs dedup (side by side
  in one process, their timed repeats taking turns: `side_by_side`; DLRM dense part, every
  table table-wise, one RecTask whose collection deduplicates the user features: the plain
  path is the same task fed batches without distinct bags). Batch 0 of
  SessionSource(session_len=S) per length; item features read bags of 1 id (the source's
  `bag_sizes`) on both paths."""
  mesh = mesh_lib.make_mesh(mesh_spec)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  F = num_user + num_item
  cfg = DLRMConfig(num_dense=13, num_sparse=F, embedding_dim=dim, bottom_mlp=(64, dim),
                   top_mlp=(64, 1), rows_per_feature=(num_rows,) * F)
  tables = cfg.tables()
  plan = planner_lib.uniform_plan(tables, ShardingKind.TABLE_WISE, n)
  user = tuple(t.name for t in tables[:num_user])
  rows = []
  for S in session_lens:
    src = sessions.SessionSource(batch_size, num_rows, session_len=S, num_user=num_user,
                                 num_item=num_item, user_bag=user_bag, seed=seed,
                                 flag=f"--session_lens={S}")
    bags = src.bag_sizes
    # Distinct user bags of a batch shard of b rows: the sessions its rows meet.
    b = batch_size // n
    capacity = max(((i + 1) * b - 1) // S - i * b // S + 1 for i in range(n))
    coll = EmbeddingCollection(
        tables, plan, mesh, opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.05),
        dedup=dedup_lib.DedupSpec(user, capacity, "error"), bag_sizes=bags)
    task = RecTask(lambda r: DLRM(cfg, r), coll, optax.adagrad(0.05), mesh)
    host = src.batch(0)
    t0 = time.perf_counter()
    dd = task.device_batch(host)           # dedup on the host, then onto the mesh
    jax.block_until_ready(dd)
    t_dedup = time.perf_counter() - t0
    plain = mesh_lib.shard_batch(host, mesh, mesh_lib.REC_RULES)
    state = task.init_state(seed)
    look = jax.jit(lambda emb, b: coll.lookup(emb, b.ids, b.lengths, b.weights, b.dedup))
    step = jax.jit(task.train_step, donate_argnums=0)
    row = {"session_len": S, "capacity_per_shard": capacity,
           "dup_rate_user": dedup_lib.duplication_rate(host, range(num_user)),
           "dup_rate_all": dedup_lib.duplication_rate(host), "dedup_host_s": t_dedup}
    paths = {"plain": plain, "dedup": dd}
    # Lookups do not chain: each call is waited for (the same overhead on both paths).
    t_look, _ = side_by_side(
        {name: lambda s, b=batch: jax.block_until_ready(look(state["emb"], b))
         for name, batch in paths.items()}, None, steps, repeats)
    t_step, state = side_by_side(
        {name: lambda s, b=batch: step(s, b)[0] for name, batch in paths.items()}, state,
        steps, repeats)
    for name in paths:
      row[f"{name}_lookup_s"] = benchmark.median(t_look[name])
      row[f"{name}_step_s"] = benchmark.median(t_step[name])
    row["lookup_speedup"] = row["plain_lookup_s"] / row["dedup_lookup_s"]
    row["step_speedup"] = row["plain_step_s"] / row["dedup_step_s"]
    row["plain_step_ex_s"] = batch_size / row["plain_step_s"]
    row["dedup_step_ex_s"] = batch_size / row["dedup_step_s"]
    log(format_rows([row], header=not rows))
    rows.append(row)
  return rows


def side_by_side(fns: dict[str, Any], state: Any, steps: int, repeats: int
                 ) -> tuple[dict[str, list[float]], Any]:
  """({name: seconds per step of each repeat}, state) of `steps` calls of `state = fn(state)`
  for every fn, after one untimed call of each (the compiles), the fns taking turns repeat
  by repeat: a change in the machine's load during the measurement reaches every path
  alike, so the medians' ratio compares the paths, not two stretches of time."""
  for fn in fns.values():
    state = fn(state)
  jax.block_until_ready(state)
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t, state = benchmark.time_steps(fn, state, steps, 1, warmup=0)
      times[name] += t
  return times, state


def format_rows(rows, header: bool = True) -> str:
  lines = ([f"{'session':>7} {'dup(user)':>9} {'dup(all)':>8} {'C_l':>5} {'lookup plain':>13} "
            f"{'dedup':>9} {'x':>5} {'step plain':>11} {'dedup':>9} {'x':>5} "
            f"{'ex/s dedup':>11} {'host dedup':>10}"] if header else [])
  for r in rows:
    lines.append(f"{r['session_len']:>7} {r['dup_rate_user']:>9.3f} {r['dup_rate_all']:>8.3f} "
                 f"{r['capacity_per_shard']:>5} {1e3 * r['plain_lookup_s']:>10.2f} ms "
                 f"{1e3 * r['dedup_lookup_s']:>6.2f} ms {r['lookup_speedup']:>5.2f} "
                 f"{1e3 * r['plain_step_s']:>8.2f} ms {1e3 * r['dedup_step_s']:>6.2f} ms "
                 f"{r['step_speedup']:>5.2f} {r['dedup_step_ex_s']:>11,.0f} "
                 f"{1e3 * r['dedup_host_s']:>7.1f} ms")
  return "\n".join(lines)


def plot(rows, path: str) -> str:
  """Lookup and step speedup (plain / dedup) against the user features' duplication rate."""
  from core import plot as plot_lib
  with plot_lib.figure(path, figsize=(6, 4)) as (fig, ax):
    x = [r["dup_rate_user"] for r in rows]
    ax.plot(x, [r["lookup_speedup"] for r in rows], "o-", label="lookup (gather + pool)")
    ax.plot(x, [r["step_speedup"] for r in rows], "s-", label="train step")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xlabel="duplication rate of the user features", ylabel="speedup (plain / dedup)",
           title="RecD in-batch dedup")
    ax.grid(alpha=0.3)
    ax.legend()
  return path
