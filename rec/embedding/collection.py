"""Sharded embedding-bag collection with sparse updates (Neo / ZionEX, arXiv 2104.05158).

Tables are laid over every device of the mesh the way TorchRec does it: data-parallel
(replicated), table-wise, row-wise, column-wise, table-row-wise and DMT's towers (SPTT),
chosen per table by a plan (`rec.embedding.planner`); each kind is one module of
`rec.embedding.sharding`, which says where its shards lie and how its ids and pooled sums
move. Tables that share an exchange, storage type and width are packed into one flat row
buffer per device, with per-table row offsets, like FBGEMM's table-batched embeddings. A
buffer's row storage (`rec.embedding.storage`: fp32, bf16, or quantized rows with an fp32
cache) keeps one state per device block, so a cache holds hot rows of the rows its device
owns.

A train step runs in three phases, so that gradients reach only the rows a batch touched:

  lookup = collection.gather(tables, ids, lengths, weights)   # input dist, gather, bag sums
  emb_BFD = collection.pool(lookup, partial)                  # output dist (+ combine)
  ... loss, grads w.r.t. dense params and w.r.t. `partial` (the per-device bag sums) ...
  tables = collection.apply_gradients(tables, lookup, partial_grads, step)

The per-device gather and bag sums run in XLA (`lookup_impl="xla"`) or in one Pallas
kernel launch per group over its flat buffer (`lookup_impl="pallas"`,
`kernels/embedding_bag.py`, FBGEMM's table-batched embedding kernel), whose backward kernel
also writes the per-id gradients for `apply_gradients`.

`pool` is differentiable in the bag sums; its communication transposes under autodiff
(all-to-all to all-to-all, reduce-scatter to all-gather), so their gradients arrive on the
devices that own the rows. As in FBGEMM's backward, the gradient of each looked-up id is
its pooling coefficient times its bag's gradient; `apply_gradients` forms those, sums
them per row (dedup) and applies a sparse row-wise optimizer (`rec.embedding.optimizers`)
to the touched rows only, without materializing per-id rows for autodiff.

Communication per exchange (N devices, batch split over all of them; rec/embedding/sharding):
- dp (dp.py): lookup local; the update all-gathers (ids, grads) to every replica.
- a2a (tw, cw, twrw; a2a.py): all-to-all of ids to the shards' devices, all-to-all of
  pooled partials back, summed (twrw row shards) or concatenated (cw column chunks).
- rw (rw.py): ids all-gathered, partial pooled sums reduce-scattered back.
- sptt (sptt.py): ids to the tower's group by an all-to-all over the tower axes, the rw path
  inside the group; `pool(..., towers=(fn, params))` runs the model's tower module there.

RecD (arXiv 2211.05239), `dedup=DedupSpec` (rec/data/dedup.py; sharding/recd.py): the
deduplicated features form groups of their own, looked up on a batch's distinct bags
(`SparseBatch.dedup`) and expanded back to the samples in `pool`. `bag_sizes` {table: n}:
the table's feature reads the first n ids of each bag only (bags padded to a longer L for
other features cost n).

Compressed exchange (arXiv 2407.04272), `a2a_compression=A2ACompression` (a2a_compression.py;
sharding/compressed.py): the a2a all-to-all and the rw reduce-scatter of pooled partials,
and their gradients, are sent as error-bounded fixed-rate payloads. `pool(..., step=)` sets
the iteration-wise bound.

Host tier lookahead (`prefetch`): the rows a later batch will read are admitted to the
host-tier groups' device caches ahead of its step (each device's own rows, after the ids'
exchange), so that step's lookups find them cached and read no host memory
(`cache_misses` counts the ones that would).

Resharding (rec/embedding/reshard.py): `layout()` says where every table's rows are in the
state (saved with checkpoints); `from_layout(saved_layout, host_state, step)` restores a
state written under any other plan, mesh or device count through the tables' unsharded
rows, optimizer state and storage extras with them.

Letters: B batch (B_l per device, B_g global), F features, L ids per bag, D embedding
dim, W width of a stored row (D, or a column chunk), N devices, C distinct bags (RecD),
T towers (SPTT), K outputs of a tower module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from core import mesh as mesh_lib
from rec.data.batch import DedupIds
from rec.data.dedup import DedupSpec
from rec.embedding import a2a_compression as a2a_lib
from rec.embedding import host_tier
from rec.embedding import optimizers as opt_lib
from rec.embedding import reshard
from rec.embedding import sharding
from rec.embedding import storage as storage_lib
from rec.embedding import storage_spec
from rec.embedding.config import TableConfig
from rec.embedding.planner import Plan, planned_tables, validate_plan
from rec.embedding.sharding import base, compressed, recd, sptt


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lookup:
  """Per-group results of `gather`: each device's bag sums and what the update needs.

  Arrays have a leading dimension that concatenates the devices' local blocks.
  """

  partial: dict[str, jax.Array]  # [..., W] float32 bag sums of this device's rows
  coef: dict[str, jax.Array]     # [..., L] pooling coefficient (weight * valid / len)
  index: dict[str, jax.Array]    # [..., L] int32 local row in the device buffer
  valid: dict[str, jax.Array]    # [..., L] bool
  # RecD groups looked up on distinct bags: [B, F_g] int32, each sample's bag (its shard's)
  inverse: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


class EmbeddingCollection:
  """Named embedding-bag tables over a mesh; one feature per table, in table order."""

  def __init__(self, tables: Sequence[TableConfig], plan: Plan, mesh: Mesh,
               optimizer: opt_lib.SparseOptimizer, rules: mesh_lib.Rules = mesh_lib.REC_RULES,
               out_of_range: str = "error", init_scale: str = "dlrm", lookup_impl: str = "xla",
               storage_seed: int = 0, dedup: DedupSpec | None = None,
               bag_sizes: Mapping[str, int] | None = None,
               a2a_compression: a2a_lib.A2ACompression | None = None):
    if out_of_range not in ("error", "hash"):
      raise ValueError(f"out_of_range={out_of_range!r}: expected 'error' or 'hash'")
    if lookup_impl not in ("xla", "pallas"):
      raise ValueError(f"lookup_impl={lookup_impl!r}: expected 'xla' or 'pallas'")
    self.lookup_impl = lookup_impl
    self.storage_seed = storage_seed    # seeds stochastic rounding (bf16_sr, int8 / int4)
    self.tables = planned_tables(plan, tables)    # a placement's storage (host tier) wins
    names = [t.name for t in self.tables]
    if len(set(names)) != len(names):
      raise ValueError(f"duplicate table names in {names}")
    missing = [n for n in names if n not in plan]
    if missing:
      raise ValueError(f"plan has no placement for tables {missing}")
    self.plan = {n: plan[n] for n in names}
    self.mesh = mesh
    self.rules = rules
    self.optimizer = optimizer
    self.out_of_range = out_of_range
    self.init_scale = init_scale
    self.axes = mesh_lib.mesh_axes("emb_shard", rules, mesh)
    batch_axes = mesh_lib.mesh_axes("batch", rules, mesh)
    if self.axes != batch_axes:
      raise ValueError(
          f"embedding shards over {self.axes} but the batch over {batch_axes}: this "
          "collection needs both on the same mesh axes")
    self.num_devices = mesh_lib.axis_size("emb_shard", rules, mesh)
    # A hand-written plan is held to what the planner's plans satisfy: an rw / dp table on
    # some devices, a twrw group not aligned to its size, ran over other devices than named.
    validate_plan(self.plan, self.tables, self.num_devices)
    self.dedup = dedup
    self.dedup_features: tuple[int, ...] = ()
    if dedup is not None:
      unknown = [n for n in dedup.features if n not in names]
      if unknown:
        raise ValueError(f"dedup features {unknown} are not tables of this collection {names}")
      self.dedup_features = tuple(names.index(n) for n in dedup.features)
    self.bag_sizes = dict(bag_sizes or {})
    bad = {n: b for n, b in self.bag_sizes.items()
           if n not in names or not isinstance(b, int) or b < 1}
    if bad:
      raise ValueError(f"bag_sizes {bad}: expected a size >= 1 for tables of {names}")
    self.a2a_compression = (None if a2a_compression is None
                            else a2a_compression.check(names))
    self._init_towers()
    self.groups, self.exchanges = self._build_groups()
    sptt.check_groups(self.groups)
    self.dims = sorted({t.dim for t in self.tables})

  def _init_towers(self) -> None:
    """SPTT: which tables form which tower, from the plan (tower t on group t's devices)."""
    tw = sptt.towers_of(self.tables, self.plan, self.mesh, self.rules, self.axes,
                        self.num_devices, self.dedup_features)
    self._towers = tw
    self.towers: tuple[tuple[int, ...], ...] = () if tw is None else tw.features
    if tw is not None:
      self.tower_axes, self.tower_shard_axes = tw.axes, tw.shard_axes
      self.num_towers, self.tower_size = tw.num, tw.size

  # ---------------------------------------------------------------- layout (host, static)

  def _build_groups(self) -> tuple[dict[str, base.Group], dict[str, base.Exchange]]:
    """Tables grouped by exchange, storage, dim, width (and RecD, bag size); each group's
    exchange, its layout finalized."""
    devices = base.Devices(self.mesh, self.axes, self.num_devices, tuple(self.tables),
                           self.lookup_impl, self._towers)
    groups: dict[str, base.Group] = {}
    kinds: dict[str, type[base.Exchange]] = {}
    for f, t in enumerate(self.tables):
      p = self.plan[t.name]
      impl = sharding.get(p.kind, t.name)
      width, shards = impl.shards(f, t, p.devices, self.num_devices)
      comm = impl.exchange.name
      key = f"{comm}_{t.storage}_d{t.dim}_w{width}"
      dedup, bag = f in self.dedup_features, self.bag_sizes.get(t.name)
      key += ("_dedup" if dedup else "") + (f"_l{bag}" if bag else "")
      grp = groups.setdefault(key, base.Group(key, comm, t.storage, t.dim, width, [],
                                              dedup=dedup, bag=bag))
      kinds[key] = impl.exchange
      grp.features.append(f)
      grp.shards.extend(shards)
    exchanges = {}
    for key, grp in groups.items():
      exchanges[key] = kinds[key](devices, grp)
      exchanges[key].finalize()
    return groups, exchanges

  def _exchange(self, name: str):
    """Group `name`'s exchange, wrapped for the compressed exchange and for RecD."""
    ex = self.exchanges[name]
    if self.a2a_compression is not None and ex.compressible:
      ex = compressed.Compressed(ex, self.a2a_compression, [t.name for t in self.tables])
    if ex.g.dedup:
      ex = recd.Deduplicated(ex)
    return ex

  # ------------------------------------------------------------------- state

  def storage(self, g: base.Group) -> storage_lib.RowStorage:
    """The row storage of group `g`'s buffer."""
    return storage_spec.make_storage(g.storage, seed=self.storage_seed)

  def state_shardings(self) -> dict[str, Any]:
    if not hasattr(self, "_state_shardings"):   # the layout is static: made once
      out = {}
      for name, ex in self.exchanges.items():
        s = NamedSharding(self.mesh, ex.spec())
        host = self.storage(ex.g).host_keys   # the host tier: these and the optimizer state
        h = host_tier.host_sharding(s) if host else s
        tmpl = self._host_template(ex, rows_per_block=1)
        out[name] = {"table": {k: h if k in host else s for k in tmpl["table"]},
                     "opt": jax.tree.map(lambda _: h, tmpl["opt"])}
      self._state_shardings = out
    return dict(self._state_shardings)

  def _empty_group(self, ex: base.Exchange):
    rows, g = ex.buffer_rows(), ex.g
    return {"table": self.storage(g).from_float(jnp.zeros((rows, g.width), jnp.float32),
                                                ex.num_blocks()),
            "opt": self.optimizer.init_state(rows, g.width)}

  def table_scale(self, t: TableConfig) -> float:
    # DLRM reference init: uniform(-sqrt(1/rows), sqrt(1/rows)).
    return math.sqrt(1.0 / t.num_rows) if self.init_scale == "dlrm" else float(self.init_scale)

  def init_tables(self, key: jax.Array) -> dict[str, np.ndarray]:
    """Full logical tables [rows, dim] f32 (host); table i's draw depends on (key, i) only,
    not on the plan, so every sharding starts from the same tables."""
    seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
    out = {}
    for i, t in enumerate(self.tables):
      s = self.table_scale(t)
      rng = np.random.default_rng(seed + [i])
      x = rng.random((t.num_rows, t.dim), dtype=np.float32)   # float32 draws: no float64 copy
      x *= np.float32(2 * s)
      x -= np.float32(s)
      out[t.name] = x
    return out

  def init(self, key: jax.Array) -> dict[str, Any]:
    """Initial state (tables in device layout and optimizer state) placed on the mesh."""
    return self.from_tables(self.init_tables(key))

  def blocks(self, name: str) -> list[tuple[str, int, int, int, int, int]]:
    """Where group `name`'s table shards lie: (table, row_start, row_end, col_start,
    col_end, first row of the block in the group's global buffer) per shard. The global
    buffer is `shards(name)` equal blocks, one per device (1: replicated)."""
    return [(self.tables[sh.feature].name, sh.row_start, sh.row_end, sh.col_start, sh.col_end,
             row) for sh, row in self.exchanges[name].blocks()]

  def shards(self, name: str) -> int:
    """Blocks of group `name`'s buffer, one per device (1: replicated)."""
    return self.exchanges[name].num_blocks()

  def from_tables(self, full: dict[str, Any]) -> dict[str, Any]:
    """Lays full logical tables [rows, dim] out in device buffers on the mesh, with fresh
    optimizer state (host-side copy; the inverse of `to_tables`)."""
    full = {k: np.asarray(jax.device_get(v), np.float32) for k, v in full.items()}
    want = {t.name: (t.num_rows, t.dim) for t in self.tables}
    bad = {k: full[k].shape if k in full else None for k in want
           if k not in full or full[k].shape != want[k]}
    extra = [k for k in full if k not in want]
    if bad or extra:
      raise ValueError(
          "from_tables: " + "; ".join(
              [f"table {k!r} is {'missing' if v is None else f'shaped {v}'}, expected "
               f"[rows, dim] = {want[k]}" for k, v in bad.items()]
              + ([f"tables {extra} are not in this collection {list(want)}"] if extra else [])))
    state = {}
    shardings = self.state_shardings()
    for name, ex in self.exchanges.items():
      g = ex.g
      storage = self.storage(g)
      buf = np.zeros((ex.buffer_rows(), g.width), np.float32)
      for sh, row in ex.blocks():
        blk = full[self.tables[sh.feature].name][sh.row_start:sh.row_end, sh.col_start:sh.col_end]
        buf[row:row + blk.shape[0], :blk.shape[1]] = blk
      group_state = {"table": storage.from_float(buf, ex.num_blocks()),
                     "opt": self.optimizer.init_state(buf.shape[0], g.width)}
      state[name] = jax.device_put(group_state, shardings[name])
    return state

  def layout(self) -> reshard.Layout:
    """Where every table's rows are in this collection's state (saved with checkpoints, so
    that another layout can restore them: `from_layout`)."""
    groups = []
    for name, ex in self.exchanges.items():
      spans = tuple(reshard.Span(self.tables[sh.feature].name, sh.row_start, sh.row_end,
                                 sh.col_start, sh.col_end, int(row)) for sh, row in ex.blocks())
      groups.append((name, reshard.GroupLayout(str(ex.g.storage), ex.g.width, ex.buffer_rows(),
                                               ex.num_blocks(), spans)))
    return reshard.Layout(
        self.num_devices, tuple((str(a), int(n)) for a, n in self.mesh.shape.items()),
        tuple((t.name, sharding.get(self.plan[t.name].kind, t.name).kind.value)
              for t in self.tables),
        tuple((t.name, t.num_rows, t.dim) for t in self.tables), tuple(groups))

  def from_layout(self, layout: reshard.Layout, state: dict[str, Any], step: int,
                  where: str = "checkpoint") -> dict[str, Any]:
    """The state `state` (host arrays, laid out as `layout`: another plan, mesh or device
    count) in this collection's layout, placed on its mesh: tables and optimizer state
    through their unsharded rows (rec/embedding/reshard.py). Tables of other rows or dim
    raise reshard.LayoutMismatchError naming `where`, the table and both shapes."""
    now = self.layout()
    layout.check_tables(now, where)
    logical = reshard.to_logical(layout, state)
    host = reshard.from_logical(now, logical, self.storages(), self.host_templates(), step)
    return jax.device_put(host, self.state_shardings())

  def storages(self) -> dict[str, storage_lib.RowStorage]:
    """Each group's row storage."""
    return {n: self.storage(g) for n, g in self.groups.items()}

  def host_templates(self) -> dict[str, Any]:
    """Each group's fresh state (`_empty_group`: zero rows, initial optimizer state) as
    host arrays, what a buffer's padding rows and columns hold; made from one row each."""
    return {n: self._host_template(ex) for n, ex in self.exchanges.items()}

  def _host_template(self, ex: base.Exchange, rows_per_block: int | None = None):
    w, blocks = ex.g.width, ex.num_blocks()
    rows = ex.buffer_rows() if rows_per_block is None else rows_per_block * blocks
    storage = self.storage(ex.g)
    opt = jax.device_get(self.optimizer.init_state(1, w))
    return {"table": storage.from_rows(storage.zero_rows(rows, w, blocks), blocks),
            "opt": {k: np.broadcast_to(v, (rows,) + v.shape[1:]).copy() for k, v in opt.items()}}

  def to_tables(self, state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gathers device buffers back into full logical tables (host numpy, float32)."""
    return self._unpack({n: self.storage(g) for n, g in self.groups.items()}, state)

  def _unpack(self, storages, state) -> dict[str, np.ndarray]:
    out = {t.name: np.zeros((t.num_rows, t.dim), np.float32) for t in self.tables}
    for name, ex in self.exchanges.items():
      storage = storages[name]
      buf = np.asarray(jax.device_get(storage.to_float(state[name]["table"], ex.num_blocks())))
      for sh, row in ex.blocks():
        n, c = sh.row_end - sh.row_start, sh.col_end - sh.col_start
        out[self.tables[sh.feature].name][sh.row_start:sh.row_end, sh.col_start:sh.col_end] = (
            buf[row:row + n, :c])
    return out

  # ------------------------------------------------------------------- ids

  def check_ids(self, ids: np.ndarray, lengths: np.ndarray) -> None:
    """Host-side check that every id in a bag is a row of its table (out_of_range='error');
    under out_of_range='hash', that every id fits int32, the ids the device hashes (id mod
    rows): a wider id (a raw 32- or 64-bit hash) would wrap into another id first."""
    ids = np.asarray(ids)
    L = ids.shape[2]
    live = np.arange(L)[None, None, :] < np.asarray(lengths)[:, :, None]
    if self.out_of_range != "error":
      info = np.iinfo(np.int32)
      bad = live & ((ids < info.min) | (ids > info.max))
      if bad.any():
        b, f, l = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"feature {self.tables[f].name!r}: id {int(ids[b, f, l])} at example {b}, position "
            f"{l} does not fit int32 ({int(bad.sum())} such ids in this batch); "
            "out_of_range='hash' hashes int32 ids (id mod rows) on the device, so hash wider "
            "ids into range in the reader")
      return
    rows = np.asarray([t.num_rows for t in self.tables])[None, :, None]
    bad = live & ((ids < 0) | (ids >= rows))
    if bad.any():
      b, f, l = map(int, np.argwhere(bad)[0])
      t = self.tables[f]
      raise ValueError(
          f"feature {t.name!r}: id {int(ids[b, f, l])} at example {b}, position {l} is "
          f"outside table {t.name!r} rows [0, {t.num_rows}) ({int(bad.sum())} such ids in "
          "this batch); hash ids into range in the reader, or use out_of_range='hash'")

  def check_lengths(self, lengths: np.ndarray, max_len: int | None = None) -> None:
    """Host-side check that every bag length is in [0, max_len] (`max_len`: the batch's
    id slots L; a longer bag's ids past L are not in the batch, and its mean would divide
    by ids never summed) and no bag is longer than its table's `bag_sizes` entry (the ids
    past it would not be read)."""
    lengths = np.asarray(lengths)
    if max_len is not None:
      bad = (lengths < 0) | (lengths > max_len)
      if bad.any():
        b, f = map(int, np.argwhere(bad)[0])
        raise ValueError(f"feature {self.tables[f].name!r}: a bag of length "
                         f"{int(lengths[b, f])} at example {b}, expected 0..{max_len} (the "
                         f"batch's {max_len} id slots per bag; {int(bad.sum())} such bags)")
    for f, t in enumerate(self.tables):
      n = self.bag_sizes.get(t.name)
      if n is not None and (lengths[:, f] > n).any():
        b = int(np.argmax(lengths[:, f] > n))
        raise ValueError(f"feature {t.name!r}: a bag of {int(lengths[b, f])} ids at example "
                         f"{b}, longer than its bag size {n} (bag_sizes)")

  def _check_dedup(self, dedup: DedupIds) -> dict[int, int]:
    """{feature: column of the distinct-bag block} after checking it matches the option."""
    if tuple(dedup.features) != self.dedup_features:
      names = [t.name for t in self.tables]
      raise ValueError(
          f"batch deduplicates features {[names[f] for f in dedup.features]}, the collection "
          f"{[names[f] for f in self.dedup_features]} (its `dedup` option)")
    return {f: j for j, f in enumerate(dedup.features)}

  def _prepare_ids(self, ids, lengths, weights, features=None):
    """int32 ids (hashed into range under out_of_range="hash"), lengths, float32 weights of
    the given features (the columns of ids; default: every table)."""
    if self.out_of_range == "hash":
      fs = range(len(self.tables)) if features is None else features
      rows = jnp.asarray([self.tables[f].num_rows for f in fs], jnp.int32)[None, :, None]
      ids = jnp.mod(ids, rows)
    if weights is None:
      weights = jnp.ones(ids.shape, jnp.float32)
    return ids.astype(jnp.int32), lengths.astype(jnp.int32), weights.astype(jnp.float32)

  # ------------------------------------------------------------------- phases

  def gather(self, state: dict[str, Any], ids: jax.Array, lengths: jax.Array,
             weights: jax.Array | None = None, dedup: DedupIds | None = None) -> Lookup:
    """Input distribution and row gather; `ids` [B, F, L] sharded over the batch axes.
    `dedup` (a batch's distinct bags, RecD): the dedup groups read those instead."""
    ids, lengths, weights = self._prepare_ids(ids, lengths, weights)
    distinct = None
    if dedup is not None:
      if not self.dedup_features:
        raise ValueError("the batch carries distinct bags (RecD) but this collection has no "
                         "`dedup` option")
      col = self._check_dedup(dedup)
      distinct = self._prepare_ids(dedup.ids, dedup.lengths, dedup.weights,
                                   dedup.features) + (dedup.inverse, col)
    out = Lookup({}, {}, {}, {})
    for name, g in self.groups.items():
      ex = self._exchange(name)
      gi, gl, gw, inverse = ex.inputs(ids, lengths, weights, distinct)
      if inverse is not None:
        out.inverse[name] = inverse
      partial, coef, index, valid = ex.gather(self.storage(g), state[name]["table"], gi, gl, gw)
      out.partial[name], out.coef[name], out.index[name], out.valid[name] = (
          partial, coef, index, valid)
    return out

  def pool(self, lookup: Lookup, partial: dict[str, jax.Array] | None = None,
           towers: tuple[Callable[..., jax.Array], Any] | None = None,
           step: jax.Array | int | None = None) -> jax.Array:
    """Output distribution of the bag sums -> emb_BFD [B, F, D] (all tables share D).

    Differentiable in `partial` (defaults to lookup.partial): pass it explicitly to take
    gradients with respect to it, for `apply_gradients`.

    towers=(fn, params) (SPTT tables only): fn(params, t, emb [b, Fm, D]) -> [b, K, D], tower
    t's module on its slots 0..F_t-1 (t is traced: the device's tower), runs inside each
    tower group; returns [B, T * K, D], the towers' outputs in tower order.

    `step` (the train step; None: 0) picks the iteration-wise bound of an
    `a2a_compression`, which compresses the a2a and rw exchanges and their gradients.
    """
    partial = lookup.partial if partial is None else partial
    if towers is not None:
      if not self.towers:
        raise ValueError("pool(towers=...): no table of this collection is placed sptt")
      (name, ex), = self.exchanges.items()
      return ex.pool_towers(partial[name], *towers)
    if len(self.dims) != 1:
      raise ValueError(f"pool() stacks features into [B, F, D], but table dims differ: {self.dims}")
    outs, order = [], []
    for name, g in self.groups.items():
      outs.append(self._exchange(name).pool(partial[name], step, lookup.inverse.get(name)))
      order.extend(g.features)
    emb = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    perm = np.argsort(np.asarray(order))
    return emb if np.array_equal(perm, np.arange(len(perm))) else emb[:, perm]

  def apply_gradients(self, state: dict[str, Any], lookup: Lookup,
                      partial_grads: dict[str, jax.Array], step: jax.Array) -> dict[str, Any]:
    """Sparse optimizer step on the rows each device's lookup touched, from the gradients
    of the bag sums (`pool`'s input)."""
    return {name: ex.update(state[name], lookup.index[name], lookup.valid[name],
                            lookup.coef[name], partial_grads[name], step, self.storage(ex.g),
                            self.optimizer)
            for name, ex in self.exchanges.items()}

  def host_groups(self) -> list[str]:
    """The groups on the host tier (rows in host memory, hot rows in device caches)."""
    return [n for n, g in self.groups.items() if self.storage(g).host_keys]

  def prefetch(self, state: dict[str, Any], ids: jax.Array, lengths: jax.Array,
               step: jax.Array) -> dict[str, Any]:
    """The state with the rows that a batch's ids [B, F, L] (`lengths` [B, F]) will read
    admitted, where they fit, to the device caches of the host-tier groups (`host_groups`):
    the lookahead that lets step `step`, which reads that batch, find its rows cached and
    leave host memory alone in its lookups (FBGEMM's TBE prefetch). Each group runs its
    exchange's id phase (ids only) and every device admits into its own cache
    (`CachedQuantizedStorage.prefetch`: the policy's ranking, nothing of step `step`'s
    accesses recorded twice). RecD groups take the samples' bags (the same rows as their
    distinct bags). Other groups are returned as they are."""
    ids, lengths, weights = self._prepare_ids(ids, lengths, None)
    out = dict(state)
    for name in self.host_groups():
      ex = self._exchange(name)
      gi, gl, _, _ = ex.inputs(ids, lengths, weights)
      out[name] = {**state[name], "table": ex.prefetch(self.storage(ex.g), state[name]["table"],
                                                      gi, gl, step)}
    return out

  def cache_misses(self, state: dict[str, Any], ids: jax.Array, lengths: jax.Array
                   ) -> dict[str, jax.Array]:
    """Per host-tier group, [devices] int32: the ids of a batch (not padding) whose rows
    each device would read from host memory rather than its cache (0 everywhere: the
    batch's lookups leave host memory alone). For tests and benchmarks."""
    ids, lengths, weights = self._prepare_ids(ids, lengths, None)
    out = {}
    for name in self.host_groups():
      ex = self._exchange(name)
      gi, gl, _, _ = ex.inputs(ids, lengths, weights)
      storage = self.storage(ex.g)

      def misses(tbl, index, valid, storage=storage):
        miss = valid & (storage.cache_slots(tbl, index) < 0)
        return jnp.sum(miss, dtype=jnp.int32)[None]

      out[name] = ex.on_local_ids(misses, state[name]["table"], gi, gl,
                                  out_specs=jax.sharding.PartitionSpec(ex.dev.axes))
    return out

  def dense_gradients(self, lookup: Lookup, partial_grads: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Full per-table gradients [rows, dim] (host numpy) from the bag-sum gradients; for
    tests and debugging: training never materializes them."""
    if not hasattr(self, "_dense_grads_fn"):
      def scatter_all(index, valid, coef, pgrads):
        return {name: {"table": {"rows": ex.dense_gradients(index[name], valid[name],
                                                            coef[name], pgrads[name])}}
                for name, ex in self.exchanges.items()}

      self._dense_grads_fn = jax.jit(scatter_all)
    bufs = self._dense_grads_fn(lookup.index, lookup.valid, lookup.coef, partial_grads)
    fp32 = storage_spec.make_storage(storage_spec.StorageSpec("fp32"))
    return self._unpack({n: fp32 for n in self.groups}, bufs)

  def lookup(self, state: dict[str, Any], ids, lengths, weights=None,
             dedup: DedupIds | None = None, towers=None) -> jax.Array:
    """Forward only: emb_BFD (or the towers' outputs) for eval and inference."""
    return self.pool(self.gather(state, ids, lengths, weights, dedup), towers=towers)

  # ------------------------------------------------------------------- reporting

  def describe(self) -> dict[str, Any]:
    return {name: {"pattern": g.comm, "storage": str(g.storage), "width": g.width,
                   "tables": [self.tables[f].name for f in g.features],
                   "rows_per_device": g.rows_per_device, "dedup": g.dedup}
            for name, g in self.groups.items()}
