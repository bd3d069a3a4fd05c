"""What a run's compressed embedding exchange (arXiv 2407.04272; rec/embedding/
a2a_compression.py, --a2a_mode of train_rec) sends and how far it moves the values:
`step_exchange_bytes` (bytes per train step, from its HLO), `a2a_report` (bytes and the
errors against a float32 copy of the collection, beside their bounds) and
`format_a2a_report` (its one line).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rec.embedding import a2a_compression as ac
from rec.embedding.config import ShardingKind

def step_exchange_bytes(task, state: dict[str, Any], batch) -> dict[str, int]:
  """Per-device bytes the embedding exchanges of one train step (forward and backward) move,
  read off the step's HLO (`a2a_compression.exchange_bytes`: the uint8 payload and the float32
  collectives of the pooled partials, told from the step's other collectives by their named
  scope, which the HLO carries only with its debug info)."""
  return ac.exchange_bytes(jax.jit(task.train_step).lower(state, batch).as_text(
      dialect="hlo", debug_info=True))


def _row_range(x):
  """max - min of each row (last axis) of x, [..., 1]."""
  return jnp.max(x, axis=-1, keepdims=True) - jnp.min(x, axis=-1, keepdims=True)


def _per_span(err, span):
  """err / span elementwise: 0 where both are 0, inf where only the span is (a row of one
  value has a rel bound of 0: it must arrive exact)."""
  return jnp.where(span > 0, err / jnp.where(span > 0, span, 1.0),
                   jnp.where(err > 0, jnp.inf, 0.0))


def _float32_task(task):
  """`task` with its collection's exchange in float32: same layout, state and model."""
  coll = copy.copy(task.collection)
  coll.a2a_compression = None
  plain = copy.copy(task)
  plain.collection = coll
  return plain


def a2a_report(task, state: dict[str, Any], host_batches: Sequence[Any]) -> dict[str, Any]:
  """What a run's compressed embedding exchange (`task.collection.a2a_compression`, arXiv
  2407.04272) sends and how far it moves the values, at `state` on `host_batches` (train
  batches: the first one's shape is the step whose bytes are counted):

  bytes: per device and train step, forward and backward, from the HLO of the train step
    (`a2a_compression.exchange_bytes`: the pooled partials' exchanges and their gradients,
    not the ids, per-id weights or dp gradients): `payload`, the uint8 codes sent; `float32`,
    the same exchanges in float32 with compression off (the step lowered again);
    `float32_in_compressed`, the compressed step's float32 exchanges (the fallback
    branches, taken only when some row cannot meet its bound).
  tables: per table, the largest |pooled embedding compressed - float32| over the batches
    (same state, same lookups), the bound of one sent value (bound x table factor x the
    schedule's factor at the state's step) and the partials summed into one pooled value
    (rw / twrw row shards; each adds at most one bound); 0 partials: not compressed.
    error_over_bound: abs, the largest error over partials x bound; rel (the bound a
    fraction of each sent row's value range), the largest of each value's error over bound
    x the summed ranges of the rows sent for it.
  groups: per embedding group, the largest |bag-sum gradient compressed - float32| for one
    cotangent (the loss's gradient w.r.t. the float32 pooled embeddings) and its bound
    (None: gradients in float32); under rel, error_over_bound takes each gradient row's
    error over its bound x the row's value range.
  """
  coll = task.collection
  comp = coll.a2a_compression
  if comp is None:
    raise ValueError("a2a_report: the task's collection has no a2a_compression")
  if coll.towers:
    raise ValueError("a2a_report: sptt towers (their exchange is not compressed)")
  plain = _float32_task(task)
  batches = [task.device_batch(b) for b in host_batches]
  if not batches:
    raise ValueError("a2a_report: no batches")

  sent = step_exchange_bytes(task, state, batches[0])
  f32 = step_exchange_bytes(plain, state, batches[0])

  # Replicated results: every process can read them (multi-process runs).
  @functools.partial(jax.jit, out_shardings=jax.sharding.NamedSharding(
      task.mesh, jax.sharding.PartitionSpec()))
  def errors(state, batch):
    lookup = task.gather(state["emb"], batch)
    step = state["step"]
    emb_f, vjp_f = jax.vjp(lambda p: plain.collection.pool(lookup, p, step=step), lookup.partial)
    emb_c, vjp_c = jax.vjp(lambda p: coll.pool(lookup, p, step=step), lookup.partial)

    def loss(emb):
      per = optax.sigmoid_binary_cross_entropy(
          task.logits(state["params"], batch.dense, emb), batch.labels)
      return jnp.sum(per * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)

    ct = jax.grad(loss)(emb_f)
    g_f, g_c = vjp_f(ct)[0], vjp_c(ct)[0]
    emb_err = jnp.abs(emb_c - emb_f)
    # rel: a row's bound is eb times the value range of the row sent, so each error is
    # measured in units of the ranges of the rows summed into it: forward, the partial rows
    # (their ranges pooled through the float32 exchange: placed, or summed over row
    # shards); backward, the gradient rows, which arrive as they were sent.
    spans = {n: jnp.broadcast_to(_row_range(p), p.shape) for n, p in lookup.partial.items()}
    span = plain.collection.pool(lookup, spans, step=step)
    return (jnp.max(emb_err, axis=(0, 2)), jnp.max(_per_span(emb_err, span), axis=(0, 2)),
            jnp.max(jnp.abs(emb_f)), {n: jnp.max(jnp.abs(g_c[n] - g_f[n])) for n in g_f},
            {n: jnp.max(_per_span(jnp.max(jnp.abs(g_c[n] - g_f[n]), axis=-1, keepdims=True),
                                  _row_range(g_f[n]))) for n in g_f})

  emb_err = np.zeros(len(coll.tables))
  emb_rel = np.zeros(len(coll.tables))
  emb_max = 0.0
  grad_err = {n: 0.0 for n in coll.groups}
  grad_rel = {n: 0.0 for n in coll.groups}
  for batch in batches:
    e, er, m, g, gr = jax.device_get(errors(state, batch))
    emb_err = np.maximum(emb_err, np.asarray(e, np.float64))
    emb_rel = np.maximum(emb_rel, np.asarray(er, np.float64))
    emb_max = max(emb_max, float(m))
    grad_err = {n: max(grad_err[n], float(g[n])) for n in grad_err}
    grad_rel = {n: max(grad_rel[n], float(gr[n])) for n in grad_rel}
  rel = comp.mode == "rel"
  step = int(jax.device_get(state["step"]))
  scale = float(comp.schedule.factor(step))
  names = [t.name for t in coll.tables]
  factors = dict(zip(names, comp.factors(names).tolist()))
  group_of = {coll.tables[f].name: (n, g) for n, g in coll.groups.items() for f in g.features}
  tables = {}
  for i, name in enumerate(names):
    _, g = group_of[name]
    p = coll.plan[name]
    kind = ShardingKind(p.kind).value
    partials = 0 if g.comm not in ("a2a", "rw") or coll.num_devices == 1 else (
        len(p.devices) if kind in ("rw", "twrw") else 1)
    bound = comp.bound * factors[name] * scale
    err = float(emb_err[i])
    over = (float(emb_rel[i]) / bound if rel else err / (partials * bound)) if partials else None
    tables[name] = {"kind": kind, "max_abs_error": err, "bound": bound, "partials": partials,
                    "error_over_bound": over}
  groups = {}
  for n, g in coll.groups.items():
    compressed = g.comm in ("a2a", "rw") and coll.num_devices > 1
    gb = (None if comp.grad_bound is None or not compressed else
          comp.grad_bound * scale * max(factors[coll.tables[f].name] for f in g.features))
    groups[n] = {"pattern": g.comm, "tables": [coll.tables[f].name for f in g.features],
                 "max_abs_grad_error": grad_err[n], "grad_bound": gb,
                 "error_over_bound": (grad_rel[n] if rel else grad_err[n]) / gb if gb else None}
  ratios = [t["error_over_bound"] for t in tables.values() if t["error_over_bound"] is not None]
  gratios = [g["error_over_bound"] for g in groups.values() if g["error_over_bound"] is not None]
  return {
      "setting": {"mode": comp.mode, "bound": comp.bound, "grad_bound": comp.grad_bound,
                  "bits": comp.bits, "table_factors": dict(comp.table_factors),
                  "schedule": dataclasses.asdict(comp.schedule)},
      "step": step, "batches": len(batches),
      "bytes": {"payload": sent["payload"], "float32": f32["float32"],
                "float32_in_compressed": sent["float32"]},
      "tables": tables, "groups": groups, "max_abs_pooled": emb_max,
      "max_error_over_bound": max(ratios, default=None),
      "max_grad_error_over_bound": max(gratios, default=None),
  }


def format_a2a_report(rep: Mapping[str, Any]) -> str:
  """One line: bytes sent per step and the largest errors against their bounds."""
  b = rep["bytes"]
  s = rep["setting"]
  gworst = rep["max_grad_error_over_bound"]
  grad = ("gradients sent in float32" if s["grad_bound"] is None or gworst is None else
          f"gradient error <= {gworst:.3f} x its bound")
  worst = rep["max_error_over_bound"]
  pooled = ("no pooled exchange compressed (one device, or no table exchanged)"
            if worst is None else f"pooled error <= {worst:.3f} x its bound"
            f"{' (exact: the exchanges fell back to float32)' if worst == 0 else ''}")
  return (f"a2a compression ({s['mode']} {s['bound']:g}, {s['bits']} bits): "
          f"{b['payload']:,} payload bytes per device per step (the step uncompressed: "
          f"{b['float32']:,} float32 bytes of exchanges); {pooled}, "
          f"{grad} (step {rep['step']}, {rep['batches']} batch"
          f"{'es' if rep['batches'] != 1 else ''})")
