"""The embedding planner's cost model checked against the compiled program.

For a grid of table sets (`Point`: rows, dim and bag size per table, storage, global batch)
and each sharding kind, `check` builds the run as train_rec does (synthetic Criteo-shaped
data, the model's tables, `rec.configs.make_plan` for the kind, the EmbeddingCollection and
RecTask; sptt: DMT's tower model on `planner.tower_plan`), compiles its train step and
reads what it moves and holds:

  bytes    per collective (kind, devices in its groups), result bytes per device, from the
           compiled HLO (`core.hlo.collective_bytes`); the dense model's gradient
           all-reduce is reported apart (the planner prices the embeddings only)
  memory   the embedding state's per-device shard bytes (tables + optimizer state), the
           planner's memory; XLA's memory_analysis (arguments, temporaries) beside it

and puts the planner's estimate beside them (`planner.estimate_plan`: the layout's
collectives and memory per device), with the per-table sums the greedy planner adds up
(no padding of the collection's buffers and all-to-all slots) for contrast.

`step="embedding"` compiles the collection's phases alone (gather, pool, the gradient of a
fixed loss of the pooled embeddings, apply_gradients; sptt without a tower module): the
same embedding collectives without the dense model, compiled in about half the time
(tests/experiments/test_planner_check.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

KINDS = ("dp", "tw", "rw", "cw", "twrw", "sptt")
TOWER_K = 2          # DMT's compressed vectors per tower (each tower returns K + 1)
NUM_DENSE = 4
TARGET = 0.10        # the bound on |estimate / measured - 1|


@dataclasses.dataclass(frozen=True)
class Point:
  """One table set and batch: table i has rows[i] rows and bags of exactly bags[i] ids (the
  batch pads every bag to max(bags) slots); `weights`: the batches carry per-id weights."""

  name: str
  rows: tuple[int, ...]
  dim: int
  bags: tuple[int, ...]
  batch: int
  storage: str = "fp32"
  weights: bool = False

  def __post_init__(self):
    if len(self.rows) != len(self.bags) or len(self.rows) < 2:
      raise ValueError(f"Point {self.name!r}: rows {self.rows} and bags {self.bags}: "
                       "expected two or more tables, one bag size each")


def _pts(name, rows, dim, bags, batches, storage="fp32", weights=False):
  return tuple(Point(f"{name} B={b}", tuple(rows), dim, tuple(bags), b, storage, weights)
               for b in batches)


MIXED_ROWS = (50_000, 20_000, 8_000, 5_000, 2_000, 1_000, 300, 100)
TINY = ("4 tables 1000-40 rows, d8, bags 1-3", (1000, 300, 120, 40), 8, (1, 2, 1, 3))
GRIDS: dict[str, tuple[Point, ...]] = {
    # The tests' size: four unequal tables on eight devices (half of them hold none, so
    # the all-to-all pads), mixed bags (padded to 3 slots).
    "tiny": _pts(*TINY, (32,)),
    "full": (
        _pts(*TINY, (256,))
        + _pts("8 x 1k rows, d16, one-hot", (1000,) * 8, 16, (1,) * 8, (64, 1024))
        + _pts("8 x 20k rows, d64, bags of 4", (20_000,) * 8, 64, (4,) * 8, (64, 1024))
        + _pts("8 tables 50k-100 rows, d32, bags 1-8", MIXED_ROWS, 32, (1, 2, 4, 8) * 2,
               (64, 1024))
        + _pts("8 x 5k rows, d32, bags of 2, per-id weights", (5_000,) * 8, 32, (2,) * 8,
               (256,), weights=True)
        + _pts("8 x 5k rows, d32, bags of 2, bf16", (5_000,) * 8, 32, (2,) * 8, (256,), "bf16")
        + _pts("8 x 5k rows, d32, bags of 2, int8 + 5% LFU cache", (5_000,) * 8, 32, (2,) * 8,
               (256,), "int8_cache:lfu:0.05")),
}


@dataclasses.dataclass
class Case:
  """A built run of one point and kind: what to compile, and what the planner is told."""

  fn: Callable[..., Any]       # jitted step
  args: tuple                  # its arguments (state, batch)
  emb_state: Any               # the embedding state (per-device shard bytes: memory)
  plan: dict
  tables: list
  mesh: Any
  optimizer: Any
  cost_params: Any


def _towers(num_tables: int) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(range(t, num_tables, 2)) for t in range(2))


def build(point: Point, kind: str, devices, step: str = "train") -> Case:
  """The run of `point` with every table placed `kind` over `devices` (sptt: two towers of
  alternate tables on two groups of half the devices), as train_rec builds it."""
  import jax
  import jax.numpy as jnp

  from core import mesh as mesh_lib
  from rec import configs
  from rec.data import synthetic
  from rec.embedding import optimizers as opt_lib
  from rec.embedding import planner
  from rec.embedding.collection import EmbeddingCollection
  from rec.train_lib import RecTask, make_dense_optimizer

  if kind not in KINDS:
    raise ValueError(f"sharding kind {kind!r}: expected one of {list(KINDS)}")
  if step not in ("train", "embedding"):
    raise ValueError(f"step={step!r}: expected 'train' or 'embedding'")
  N, B, F = len(devices), point.batch, len(point.rows)
  if B % N:
    raise ValueError(f"{point.name}: batch {B} is not divisible by the {N} devices")
  rules = mesh_lib.REC_RULES
  src = synthetic.SyntheticCriteo(B, point.rows, num_dense=NUM_DENSE, num_sparse=F,
                                  multi_hot=point.bags, seed=0)
  cfg = configs.make_run(model="dlrm", preset="small", embedding_dim=point.dim,
                         batch_size=B, eval_batch_size=B, sharding="tw" if kind == "sptt"
                         else kind, sparse_optimizer="rowwise_adagrad",
                         embedding_learning_rate=0.05, storage=point.storage)
  opt = opt_lib.get_sparse_optimizer(cfg.train.sparse_optimizer,
                                     cfg.train.embedding_learning_rate)
  tower_outputs = None
  if kind == "sptt":
    from rec.models.dmt import DMTConfig, DMTModel
    if N % 2:
      raise ValueError(f"sptt: two tower groups need an even device count, got {N}")
    mesh = mesh_lib.make_mesh(f"data:2,model:{N // 2}", devices, rules=rules)
    towers = _towers(F)
    dcfg = DMTConfig(num_dense=NUM_DENSE, embedding_dim=point.dim, towers=towers,
                     tower_k=TOWER_K, bottom_mlp=(16, point.dim), top_mlp=(16, 1),
                     rows_per_feature=point.rows, feature_names=src.spec.sparse_features)
    model_fn = lambda rngs: DMTModel(dcfg, rngs)
    tables = dcfg.tables()
  else:
    mesh = mesh_lib.make_mesh("-1", devices, rules=rules)
    model_fn, tables, _ = configs.build_model_fn(cfg, src.spec)
  tables = [dataclasses.replace(t, pooling_factor=float(p), storage=cfg.embedding.storage)
            for t, p in zip(tables, point.bags)]
  if kind == "sptt":
    plan = planner.tower_plan(tables, towers, N)
  else:
    plan = configs.make_plan(cfg, tables, N, opt)
  coll = EmbeddingCollection(tables, plan, mesh, opt, init_scale="dlrm")
  host = src.batch(0)
  if point.weights:    # libFM-style values: rw's all-gather sends them (XLA folds ones)
    import numpy as np
    w = np.random.default_rng(0).uniform(0.5, 1.5, host.ids.shape).astype(np.float32)
    host = dataclasses.replace(host, weights=w)
  if step == "train":
    task = RecTask(model_fn, coll, make_dense_optimizer("adagrad", 0.05), mesh)
    state = task.init_state(0)
    args = (state, task.device_batch(host))
    fn = jax.jit(task.train_step, donate_argnums=0)
    emb_state = state["emb"]
    tower_outputs = TOWER_K + 1 if kind == "sptt" else None
  else:
    emb_state = coll.init(jax.random.key(0))
    args = (emb_state, mesh_lib.shard_batch(host, mesh, rules))

    def emb_step(st, batch):
      lookup = coll.gather(st, batch.ids, batch.lengths, batch.weights)
      loss = lambda partial: jnp.sum(jnp.square(coll.pool(lookup, partial)))
      grads = jax.grad(loss)(lookup.partial)
      return coll.apply_gradients(st, lookup, grads, jnp.int32(0))

    fn = jax.jit(emb_step, donate_argnums=0)
  cp = planner.CostParams(ids_per_bag=src.spec.max_ids_per_bag,
                          id_weights=host.weights is not None, tower_outputs=tower_outputs)
  return Case(fn, args, emb_state, plan, tables, mesh, opt, cp)


def _devices_in(mesh, axes) -> int:
  if not isinstance(axes, tuple):
    raise ValueError(f"collective over replica groups {axes!r}: expected mesh axes")
  return math.prod(mesh.shape[a] for a in axes)


def shard_bytes(state) -> list[int]:
  """Bytes each device holds of `state` (its arrays' addressable shards), by device id."""
  import jax
  out: dict[int, int] = {}
  for x in jax.tree.leaves(state):
    for s in x.addressable_shards:
      out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
  return [out[d] for d in sorted(out)]


def measure(case: Case) -> dict[str, Any]:
  """Compiles the case's step: its embedding collectives (result bytes per device, by
  (kind, devices)), the dense model's all-reduce, the embedding state's bytes per device,
  XLA's memory analysis and the compile time."""
  from core import hlo
  t0 = time.perf_counter()
  compiled = case.fn.lower(*case.args).compile()
  compile_s = time.perf_counter() - t0
  emb: dict[tuple[str, int], float] = {}
  dense = 0.0
  for (kind, axes), v in hlo.collective_bytes(compiled.as_text()).items():
    if kind == "all-reduce":     # the dense gradients (and the grad norm's scalars)
      dense += v
      continue
    key = (kind, _devices_in(case.mesh, axes))
    emb[key] = emb.get(key, 0.0) + v
  held = shard_bytes(case.emb_state)
  ma = compiled.memory_analysis()
  xla = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "temp", "alias")}
  return {"collectives": emb, "dense_all_reduce": dense, "memory_per_device": held,
          "xla": xla, "compile_s": compile_s}


def estimate(case: Case, batch: int) -> dict[str, Any]:
  """The planner's numbers for the case: the layout's collectives and memory per device,
  and the per-table sums (what the greedy adds up)."""
  import numpy as np

  from rec.embedding import planner
  N = len(case.mesh.devices.flat)
  est = planner.estimate_plan(case.plan, case.tables, N, batch, case.cost_params,
                              case.optimizer.state_bytes_per_row)
  mem_sum = sum(c.memory_bytes for c in est.per_table.values())
  comm_sum = sum(c.comm_bytes for c in est.per_table.values())
  return {"collectives": dict(est.collectives),
          "memory": int(est.max_memory_bytes),
          "wire": float(est.per_device.comm_bytes.max()),
          "table_sum_memory": int(np.max(mem_sum)),
          "table_sum_wire": float(np.mean(comm_sum)),
          "groups": [{"exchange": g.exchange, "storage": g.storage, "width": g.width,
                      "tables": list(g.tables), "rows_per_device": g.rows_per_device,
                      "slots": g.slots} for g in est.layout]}


def _key(k: tuple[str, int]) -> str:
  return f"{k[0]}/{k[1]}"


def check(point: Point, kind: str, devices, step: str = "train") -> dict[str, Any]:
  """One grid row: estimate and measurement of `kind` at `point`, and their ratios."""
  from rec.embedding import planner
  t0 = time.perf_counter()
  case = build(point, kind, devices, step)
  got, est = measure(case), estimate(case, point.batch)
  hlo_bytes = sum(got["collectives"].values())
  est_bytes = sum(est["collectives"].values())
  mem = max(got["memory_per_device"])
  wire = planner.wire_bytes(got["collectives"])
  ratio = lambda e, m: e / m if m else (1.0 if e == m else math.inf)
  return {
      "kind": kind, "point": point.name, "batch": point.batch, "tables": len(point.rows),
      "dim": point.dim, "storage": point.storage, "bag_slots": max(point.bags), "step": step,
      "devices": len(devices),
      "bytes_est": est_bytes, "bytes_hlo": hlo_bytes, "bytes_ratio": ratio(est_bytes, hlo_bytes),
      "collectives_est": {_key(k): v for k, v in sorted(est["collectives"].items())},
      "collectives_hlo": {_key(k): v for k, v in sorted(got["collectives"].items())},
      "wire_est": est["wire"], "wire_hlo": wire, "wire_ratio": ratio(est["wire"], wire),
      "table_sum_wire_ratio": ratio(est["table_sum_wire"], wire),
      "memory_est": est["memory"], "memory": mem, "memory_ratio": ratio(est["memory"], mem),
      "memory_per_device": got["memory_per_device"],
      "table_sum_memory_ratio": ratio(est["table_sum_memory"], mem),
      "xla": got["xla"], "dense_all_reduce": got["dense_all_reduce"],
      "groups": est["groups"], "compile_s": got["compile_s"],
      "seconds": time.perf_counter() - t0}


def run(points: Sequence[Point], kinds: Sequence[str], devices, step: str = "train",
        log: Callable[[str], None] = print) -> list[dict[str, Any]]:
  rows = []
  for p in points:
    for k in kinds:
      r = check(p, k, devices, step)
      log(f"{k:5} {p.name}: bytes {r['bytes_est']:,.0f} est / {r['bytes_hlo']:,.0f} HLO "
          f"= {r['bytes_ratio']:.3f}; memory {r['memory_est']:,} / {r['memory']:,} = "
          f"{r['memory_ratio']:.3f} (compile {r['compile_s']:.1f} s)")
      rows.append(r)
  return rows


def _kib(x: float) -> str:
  return f"{x / 1024:,.1f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Markdown table: per kind and grid point, estimate / measured bytes and memory."""
  head = ("| kind | grid point | bytes/step est KiB | HLO KiB | ratio | memory/device est KiB "
          "| held KiB | ratio | XLA temp KiB | table sums: bytes, memory |")
  lines = [head, "|" + "---|" * 10]
  for r in rows:
    lines.append(
        f"| {r['kind']} | {r['point']} | {_kib(r['bytes_est'])} | {_kib(r['bytes_hlo'])} | "
        f"{r['bytes_ratio']:.3f} | {_kib(r['memory_est'])} | {_kib(r['memory'])} | "
        f"{r['memory_ratio']:.3f} | {_kib(r['xla']['temp'])} | "
        f"{r['table_sum_wire_ratio']:.2f}, {r['table_sum_memory_ratio']:.2f} |")
  return "\n".join(lines)


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Worst |ratio - 1| per kind for bytes and memory, and whether all are within TARGET."""
  worst = lambda key, rs: max(abs(r[key] - 1.0) for r in rs)
  out: dict[str, Any] = {"cases": len(rows)}
  for k in dict.fromkeys(r["kind"] for r in rows):
    rs = [r for r in rows if r["kind"] == k]
    out[k] = {"bytes_err": round(worst("bytes_ratio", rs), 4),
              "memory_err": round(worst("memory_ratio", rs), 4)}
  out["max_bytes_err"] = round(worst("bytes_ratio", rows), 4)
  out["max_memory_err"] = round(worst("memory_ratio", rows), 4)
  out["within_target"] = bool(out["max_bytes_err"] <= TARGET
                              and out["max_memory_err"] <= TARGET)
  return out


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
  """Estimate / measured per kind (one dot per grid point): bytes moved and memory per
  device, the layout's estimate against the per-table sums; the target band shaded."""
  from core import plot as plot_lib
  plt = plot_lib.pyplot()
  kinds = list(dict.fromkeys(r["kind"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for ax, what, title in ((axes[0], "bytes_ratio", "bytes moved per step"),
                          (axes[1], "memory_ratio", "memory per device")):
    ax.axhspan(1 - TARGET, 1 + TARGET, color="tab:green", alpha=0.12, label="within 10%")
    sums = "table_sum_wire_ratio" if what == "bytes_ratio" else "table_sum_memory_ratio"
    for i, k in enumerate(kinds):
      rs = [r for r in rows if r["kind"] == k]
      ax.plot([i - 0.1] * len(rs), [r[what] for r in rs], "o", color="tab:blue",
              label="planner (layout)" if i == 0 else None)
      ax.plot([i + 0.1] * len(rs), [r[sums] for r in rs], "x", color="tab:orange",
              label="per-table sums" if i == 0 else None)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set(title=title, ylabel="estimate / measured")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
