"""RecD: in-batch deduplication of sparse features (arXiv 2211.05239).

In a batch grouped by session, a user's features (ids of the user's history, profile) are
the same for every sample of the session. RecD's inverse-keyed jagged tensor (IKJT) keeps
each distinct bag of a feature once plus, per sample, the index of its bag; embedding
lookups and pooling run on the distinct bags only and the pooled vectors are expanded to
the samples afterwards. Here:

  dedup(batch, capacity, num_shards) -> DedupBatch | None     (host, numpy)
      per feature and per batch shard (one per device of the batch axes), the distinct
      bags (ids, length, weights: equal bags pool to equal vectors) in a static [C, F, L]
      block, C = capacity per shard, and inverse_BF: each sample's bag, local to its shard.
      More than C distinct bags of one feature in one shard is an overflow: None, and
      `RecDTask` (on_overflow="fallback") runs that batch on the plain path and counts it
      (`recd_fallback` metric, `RecDTask.fallbacks`), or raises (on_overflow="error"),
      naming the feature, the count and the capacity.
  expand(emb_CFD, inverse_BF, collection) -> emb_BFD
      under shard_map over the batch axes, so each device expands from its own block
      (no communication); its gradient sums the samples' bag gradients per distinct bag.

`RecDTask` (a `core.train.Task`) splits the tables in two unchanged
`EmbeddingCollection`s over one mesh: `dd` for the deduplicated (user) features, looked up
on the [C, F_d, L_d] block as if it were a batch of C examples, and `rest` for the
per-sample features; the dense model (any `model(dense, emb_BFD)`) sees the features in
their table order. So every sharding kind (dp, tw, rw, cw, twrw) of the dedup tables sees
C bags per device instead of B, and their all-to-all / reduce-scatter volume shrinks by the
same factor. The sparse update gets the distinct bags' gradients, whose per-row sums equal
the plain path's (the optimizers sum duplicate ids before updating): forward logits are
equal bit for bit and gradients / updated tables up to float summation order
(tests/rec/test_recd.py, 8 devices).

`session_batches` draws session-like data: sessions of `session_len` consecutive samples
share their user features (multi-hot histories), item features are drawn per sample.

Letters: B batch, C distinct-bag capacity (per shard: C_l), F features, L ids per bag,
D embedding dim, N shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from core import mesh as mesh_lib
from rec.data.batch import SparseBatch
from rec.data import synthetic


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DedupBatch:
  """An inverse-indexed batch: distinct bags per feature and each sample's bag index.

  - dense, labels, mask: per sample, as in SparseBatch
  - ids [C, F, L], lengths [C, F], weights [C, F, L]: distinct bags; shard s holds rows
    [s * C_l, (s + 1) * C_l), feature f's bags in column f (unused rows: empty bags)
  - inverse [B, F] int32: sample b's bag of feature f, a row of its shard's block (local)
  - num_unique [N, F] int32: distinct bags per shard and feature
  """

  dense: Any
  labels: Any
  mask: Any
  ids: Any
  lengths: Any
  weights: Any
  inverse: Any
  num_unique: Any
  rest_ids: Any = None        # [B, F_r, L_r] features looked up per sample (RecDTask)
  rest_lengths: Any = None
  rest_weights: Any = None

  @property
  def batch_size(self) -> int:
    return self.labels.shape[0]


class CapacityError(ValueError):
  """More distinct bags than the static capacity."""


def _bag_keys(ids_BL, len_B, w_BL):
  """Rows that are equal iff the bags are (ids and weights past the length ignored)."""
  L = ids_BL.shape[1]
  live = np.arange(L)[None, :] < len_B[:, None]
  ids = np.where(live, ids_BL, 0).astype(np.int64)
  w = np.where(live, w_BL, 0).astype(np.float32).view(np.int32).astype(np.int64)
  return np.concatenate([len_B[:, None].astype(np.int64), ids, w], axis=1)


def dedup(batch: SparseBatch, capacity: int, num_shards: int = 1,
          on_overflow: str = "none") -> DedupBatch | None:
  """The inverse-indexed form of `batch` with `capacity` distinct bags per feature and
  shard; None on overflow (on_overflow="none") or CapacityError (on_overflow="error")."""
  B, F, L = batch.ids.shape
  if B % num_shards:
    raise ValueError(f"dedup: batch {B} not divisible by num_shards={num_shards}")
  b = B // num_shards
  weights = (np.ones(batch.ids.shape, np.float32) if batch.weights is None
             else np.asarray(batch.weights, np.float32))
  ids = np.zeros((num_shards, capacity, F, L), np.int32)
  lengths = np.zeros((num_shards, capacity, F), np.int32)
  w = np.zeros((num_shards, capacity, F, L), np.float32)
  inverse = np.zeros((B, F), np.int32)
  counts = np.zeros((num_shards, F), np.int32)
  bids, blen = np.asarray(batch.ids), np.asarray(batch.lengths)
  for s in range(num_shards):
    rows = slice(s * b, (s + 1) * b)
    for f in range(F):
      keys = _bag_keys(bids[rows, f], blen[rows, f], weights[rows, f])
      _, first, inv = np.unique(keys, axis=0, return_index=True, return_inverse=True)
      n = len(first)
      counts[s, f] = n
      if n > capacity:
        if on_overflow == "error":
          raise CapacityError(
              f"dedup: feature {f} has {n} distinct bags in shard {s} ({b} samples), "
              f"over the capacity {capacity}; raise the capacity or use the fallback")
        return None
      src = np.arange(s * b, (s + 1) * b)[first]
      ids[s, :n, f] = bids[src, f]
      lengths[s, :n, f] = blen[src, f]
      w[s, :n, f] = weights[src, f]
      inverse[rows, f] = inv.reshape(-1)
  flat = lambda x: x.reshape((num_shards * capacity,) + x.shape[2:])
  return DedupBatch(np.asarray(batch.dense), np.asarray(batch.labels), np.asarray(batch.mask),
                    flat(ids), flat(lengths), flat(w), inverse, counts)


def duplication_rate(batch: SparseBatch, features=None) -> float:
  """1 - distinct bags / bags over the batch (all features, or `features`)."""
  B, F, _ = batch.ids.shape
  weights = np.ones(batch.ids.shape, np.float32) if batch.weights is None else batch.weights
  fs = range(F) if features is None else features
  distinct = sum(len(np.unique(_bag_keys(batch.ids[:, f], batch.lengths[:, f], weights[:, f]),
                               axis=0)) for f in fs)
  return 1.0 - distinct / (B * len(list(fs)))


def expand(emb_CFD, inverse_BF, collection):
  """emb_BFD[b, f] = emb_CFD[inverse[b, f], f], per shard of the batch axes."""
  def local(e_CFD, inv_BF):
    return e_CFD[inv_BF, jnp.arange(inv_BF.shape[1])[None, :]]
  spec = P(collection.axes)
  return jax.shard_map(local, mesh=collection.mesh, in_specs=(spec, spec), out_specs=spec,
                       check_vma=False)(emb_CFD, inverse_BF)


class RecDTask:
  """Recommendation training with RecD: the features in `dedup_features` (user features)
  looked up through an inverse-indexed block, the others per sample (a `core.train.Task`).

  Two embedding collections over one mesh (a `rec.embedding.collection.EmbeddingCollection`
  each, unchanged): `dd` over the deduplicated features' tables (bags padded to
  `dedup_bag` ids) and `rest` over the others (`rest_bag` ids); the train state's "emb"
  holds {"dedup": ..., "rest": ...}. A plain `SparseBatch` (`plain_batch`, or a capacity
  fallback) runs the same model on every sample's bags: the plain path the dedup path is
  compared with.
  """

  def __init__(self, model_fn, tables, plan, mesh, sparse_optimizer, dense_tx,
               dedup_features, capacity: int, dedup_bag: int, rest_bag: int = 1,
               on_overflow: str = "fallback", rules=mesh_lib.REC_RULES,
               init_scale: str | float = "dlrm"):
    from rec.embedding.collection import EmbeddingCollection
    from rec.train_lib import RecTask
    if on_overflow not in ("fallback", "error"):
      raise ValueError(f"RecDTask: on_overflow={on_overflow!r}, expected fallback or error")
    if capacity < 1:
      raise ValueError(f"RecDTask: capacity={capacity}, expected >= 1 distinct bags per shard")
    names = [t.name for t in tables]
    unknown = [n for n in dedup_features if n not in names]
    if unknown or not dedup_features:
      raise ValueError(f"RecDTask: dedup_features={list(dedup_features)}; expected a non-empty "
                       f"subset of the tables {names}")
    self.dd_idx = [i for i, n in enumerate(names) if n in dedup_features]
    self.rest_idx = [i for i, n in enumerate(names) if n not in dedup_features]
    coll = lambda idx: EmbeddingCollection([tables[i] for i in idx],
                                           {names[i]: plan[names[i]] for i in idx}, mesh,
                                           sparse_optimizer, rules, init_scale=init_scale)
    self.dd = coll(self.dd_idx)
    self.rest = coll(self.rest_idx) if self.rest_idx else None
    self.task = RecTask(model_fn, self.rest or self.dd, dense_tx, mesh, rules)
    self.mesh, self.rules, self.dense_tx = mesh, rules, dense_tx
    self.capacity, self.on_overflow = int(capacity), on_overflow
    self.dedup_bag, self.rest_bag = int(dedup_bag), int(rest_bag)
    self.num_shards = mesh_lib.axis_size("batch", rules, mesh)
    self.order = np.argsort(np.asarray(self.dd_idx + self.rest_idx))
    self.fallbacks = 0

  # --- state

  def init_state(self, seed: int):
    state = self.task.init_state(seed)
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1))
    state["emb"] = {"dedup": self.dd.init(k1),
                    "rest": self.rest.init(k2) if self.rest else {}}
    return state

  def from_tables(self, full: dict[str, Any]) -> dict[str, Any]:
    """The "emb" state of full logical tables {name: [rows, dim]}."""
    return {"dedup": self.dd.from_tables({t.name: full[t.name] for t in self.dd.tables}),
            "rest": self.rest.from_tables({t.name: full[t.name] for t in self.rest.tables})
            if self.rest else {}}

  def to_tables(self, emb) -> dict[str, np.ndarray]:
    out = self.dd.to_tables(emb["dedup"])
    if self.rest:
      out.update(self.rest.to_tables(emb["rest"]))
    return out

  def examples_in(self, host) -> int:
    return self.task.examples_in(host)

  def new_evaluator(self):
    return self.task.new_evaluator()

  # --- batches

  def _check(self, host: SparseBatch) -> None:
    L = host.ids.shape[2]
    for idx, bag, what in ((self.dd_idx, self.dedup_bag, "dedup_bag"),
                           (self.rest_idx, self.rest_bag, "rest_bag")):
      if idx and (bag > L or np.asarray(host.lengths)[:, idx].max(initial=0) > bag):
        raise ValueError(f"RecDTask: bags of features {idx} longer than {what}={bag} "
                         f"(batch L={L})")
    order = self.dd_idx + self.rest_idx
    tables = self.dd.tables + (self.rest.tables if self.rest else [])
    rows = np.asarray([t.num_rows for t in tables])
    ids = np.asarray(host.ids)[:, order]
    live = np.arange(ids.shape[2])[None, None] < np.asarray(host.lengths)[:, order, None]
    bad = live & ((ids < 0) | (ids >= rows[None, :, None]))
    if bad.any():
      b, f, l = map(int, np.argwhere(bad)[0])
      raise ValueError(f"RecDTask: id {int(ids[b, f, l])} at example {b}, feature "
                       f"{order[f]}, position {l} outside its table "
                       f"[0, {rows[f]})")

  def plain_batch(self, host: SparseBatch) -> SparseBatch:
    """The batch on the mesh, every sample's bags (the plain path)."""
    self._check(host)
    return mesh_lib.shard_batch(host, self.mesh, self.rules)

  def device_batch(self, host: SparseBatch):
    """The inverse-indexed batch on the mesh; on overflow the plain batch (fallback)."""
    self._check(host)
    sub = SparseBatch(host.dense, np.asarray(host.ids)[:, self.dd_idx, :self.dedup_bag],
                      np.asarray(host.lengths)[:, self.dd_idx], host.labels, host.mask,
                      None if host.weights is None
                      else np.asarray(host.weights)[:, self.dd_idx, :self.dedup_bag])
    d = dedup(sub, self.capacity, self.num_shards,
              "error" if self.on_overflow == "error" else "none")
    if d is None:
      self.fallbacks += 1
      return self.plain_batch(host)
    rest = self._rest_inputs(host)
    out = dataclasses.replace(d, rest_ids=rest[0], rest_lengths=rest[1], rest_weights=rest[2])
    spec = lambda x: mesh_lib.logical_sharding(("batch",) + (None,) * (np.ndim(x) - 1),
                                               self.rules, self.mesh)
    rep = jax.sharding.NamedSharding(self.mesh, P())
    shard = {k.name: (rep if k.name == "num_unique" else spec(getattr(out, k.name)))
             for k in dataclasses.fields(out)}
    return jax.device_put(out, DedupBatch(**shard))

  def _rest_inputs(self, host):
    if not self.rest:
      B = host.ids.shape[0]
      return (np.zeros((B, 0, 1), np.int32), np.zeros((B, 0), np.int32),
              np.zeros((B, 0, 1), np.float32))
    w = (np.ones(host.ids.shape, np.float32) if host.weights is None
         else np.asarray(host.weights, np.float32))
    return (np.asarray(host.ids)[:, self.rest_idx, :self.rest_bag],
            np.asarray(host.lengths)[:, self.rest_idx], w[:, self.rest_idx, :self.rest_bag])

  # --- steps

  def _inputs(self, batch):
    """(dedup ids, lengths, weights, inverse or None, rest ids, lengths, weights)."""
    if isinstance(batch, DedupBatch):
      return (batch.ids, batch.lengths, batch.weights, batch.inverse, batch.rest_ids,
              batch.rest_lengths, batch.rest_weights)
    w = jnp.ones(batch.ids.shape, jnp.float32) if batch.weights is None else batch.weights
    d, r = np.asarray(self.dd_idx), np.asarray(self.rest_idx, np.int32)
    return (batch.ids[:, d, :self.dedup_bag], batch.lengths[:, d], w[:, d, :self.dedup_bag],
            None, batch.ids[:, r, :self.rest_bag], batch.lengths[:, r], w[:, r, :self.rest_bag])

  def _embeddings(self, emb_state, batch):
    """gather phases: (dedup lookup, rest lookup or None, inverse or None)."""
    di, dl, dw, inv, ri, rl, rw = self._inputs(batch)
    lk_d = self.dd.gather(emb_state["dedup"], di, dl, dw)
    lk_r = self.rest.gather(emb_state["rest"], ri, rl, rw) if self.rest else None
    return lk_d, lk_r, inv

  def _pool(self, lk_d, lk_r, inv, p_d, p_r):
    e = self.dd.pool(lk_d, p_d)
    if inv is not None:
      e = expand(e, inv, self.dd)
    if lk_r is not None:
      e = jnp.concatenate([e, self.rest.pool(lk_r, p_r)], axis=1)
    return e[:, self.order] if not np.array_equal(self.order, np.arange(len(self.order))) else e

  def lookup(self, emb_state, batch) -> jax.Array:
    """emb_BFD [B, F, D] (forward only), of either batch form."""
    lk_d, lk_r, inv = self._embeddings(emb_state, batch)
    return self._pool(lk_d, lk_r, inv, lk_d.partial, lk_r.partial if lk_r else None)

  def loss_and_grads(self, state, batch):
    """Mean BCE; grads w.r.t. the dense params and both collections' bag sums."""
    lk_d, lk_r, inv = self._embeddings(state["emb"], batch)

    def loss_fn(params, p_d, p_r):
      logits = self.task.logits(params, batch.dense, self._pool(lk_d, lk_r, inv, p_d, p_r))
      per_ex = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
      loss = jnp.sum(per_ex * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)
      return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)(
        state["params"], lk_d.partial, lk_r.partial if lk_r else None)
    return loss, logits, (lk_d, lk_r), grads

  def train_step(self, state, batch):
    loss, _, (lk_d, lk_r), (g_params, g_d, g_r) = self.loss_and_grads(state, batch)
    grad_norm = optax.tree.norm((g_params, g_d, g_r))
    updates, opt = self.dense_tx.update(g_params, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    emb = {"dedup": self.dd.apply_gradients(state["emb"]["dedup"], lk_d, g_d, state["step"]),
           "rest": (self.rest.apply_gradients(state["emb"]["rest"], lk_r, g_r, state["step"])
                    if self.rest else {})}
    fallback = jnp.float32(0 if isinstance(batch, DedupBatch) else 1)
    return ({"step": state["step"] + 1, "params": params, "opt": opt, "emb": emb},
            {"loss": loss, "grad_norm": grad_norm, "recd_fallback": fallback})

  def eval_step(self, state, batch):
    emb = self.lookup(state["emb"], batch)
    return {"logits": self.task.logits(state["params"], batch.dense, emb),
            "labels": batch.labels, "mask": batch.mask}


def session_batches(batch_size: int, session_len: int, num_user: int = 4, num_item: int = 4,
                    user_bag: int = 32, item_bag: int = 1, num_rows: int = 100_000,
                    num_dense: int = 13, seed: int = 0, start: int = 0) -> Iterator[SparseBatch]:
  """Session-grouped batches: features 0..num_user-1 are user features (bags of user_bag
  Zipf ids, one bag per session of `session_len` consecutive samples), the rest item
  features (item_bag ids per sample); random labels (for throughput, not quality)."""
  if batch_size % session_len:
    raise ValueError(f"session_batches: batch_size={batch_size} not divisible by "
                     f"session_len={session_len}")
  F, L = num_user + num_item, max(user_bag, item_bag)
  k = start
  while True:
    rng = np.random.default_rng([seed, k])
    S = batch_size // session_len
    ids = np.zeros((batch_size, F, L), np.int32)
    lengths = np.zeros((batch_size, F), np.int32)
    user = synthetic.zipf_ids(rng, num_rows, (S, num_user, user_bag))
    ids[:, :num_user, :user_bag] = np.repeat(user, session_len, axis=0)
    lengths[:, :num_user] = user_bag
    ids[:, num_user:, :item_bag] = synthetic.zipf_ids(rng, num_rows,
                                                      (batch_size, num_item, item_bag))
    lengths[:, num_user:] = item_bag
    yield SparseBatch(rng.standard_normal((batch_size, num_dense)).astype(np.float32), ids,
                      lengths, (rng.random(batch_size) < 0.25).astype(np.float32),
                      np.ones(batch_size, np.float32))
    k += 1


def throughput_study(session_lens, batch_size: int = 2048, num_user: int = 8,
                     num_item: int = 8, user_bag: int = 32, num_rows: int = 100_000,
                     dim: int = 32, steps: int = 5, repeats: int = 5, mesh_spec: str = "-1",
                     seed: int = 0, log=print) -> list[dict[str, Any]]:
  """Per session length: duplication rate of the user features, host dedup time, and the
  median seconds of the forward lookup and of a train step, plain vs dedup (side by side
  in one process; DLRM dense part, every table table-wise)."""
  import time

  from core import benchmark
  from rec.embedding import optimizers as opt_lib
  from rec.embedding import planner as planner_lib
  from rec.embedding.config import ShardingKind
  from rec.models.dlrm import DLRM, DLRMConfig

  mesh = mesh_lib.make_mesh(mesh_spec)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  F = num_user + num_item
  cfg = DLRMConfig(num_dense=13, num_sparse=F, embedding_dim=dim, bottom_mlp=(64, dim),
                   top_mlp=(64, 1), rows_per_feature=(num_rows,) * F)
  tables = cfg.tables()
  plan = planner_lib.uniform_plan(tables, ShardingKind.TABLE_WISE, n)
  user = [t.name for t in tables[:num_user]]
  rows = []
  for S in session_lens:
    b_l = batch_size // n
    capacity = -(-b_l // S)
    task = RecDTask(lambda r: DLRM(cfg, r), tables, plan, mesh,
                    opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.05),
                    optax.adagrad(0.05), user, capacity=capacity, dedup_bag=user_bag,
                    rest_bag=1, on_overflow="error")
    host = next(session_batches(batch_size, S, num_user, num_item, user_bag, 1, num_rows,
                                seed=seed))
    t0 = time.perf_counter()
    dd = task.device_batch(host)
    jax.block_until_ready(dd)
    t_dedup = time.perf_counter() - t0
    plain = task.plain_batch(host)
    state = task.init_state(seed)
    look = jax.jit(task.lookup)
    step = jax.jit(task.train_step, donate_argnums=0)
    row = {"session_len": S, "capacity_per_shard": capacity,
           "dup_rate_user": duplication_rate(host, range(num_user)),
           "dup_rate_all": duplication_rate(host), "dedup_host_s": t_dedup}
    for name, batch in (("plain", plain), ("dedup", dd)):
      # Lookups do not chain: each call is waited for (the same overhead on both paths).
      t_look, _ = benchmark.time_steps(
          lambda s, b=batch: jax.block_until_ready(look(state["emb"], b)), None, steps, repeats)
      t_step, state = benchmark.time_steps(lambda s, b=batch: step(s, b)[0], state, steps,
                                           repeats)
      row[f"{name}_lookup_s"] = benchmark.median(t_look)
      row[f"{name}_step_s"] = benchmark.median(t_step)
    row["lookup_speedup"] = row["plain_lookup_s"] / row["dedup_lookup_s"]
    row["step_speedup"] = row["plain_step_s"] / row["dedup_step_s"]
    row["plain_step_ex_s"] = batch_size / row["plain_step_s"]
    row["dedup_step_ex_s"] = batch_size / row["dedup_step_s"]
    log(format_rows([row], header=not rows))
    rows.append(row)
  return rows


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
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  x = [r["dup_rate_user"] for r in rows]
  ax.plot(x, [r["lookup_speedup"] for r in rows], "o-", label="lookup (gather + pool)")
  ax.plot(x, [r["step_speedup"] for r in rows], "s-", label="train step")
  ax.axhline(1, color="k", lw=0.8)
  ax.set(xlabel="duplication rate of the user features", ylabel="speedup (plain / dedup)",
         title="RecD in-batch dedup")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
