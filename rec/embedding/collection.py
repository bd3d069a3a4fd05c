"""Sharded embedding-bag collection with sparse updates (Neo / ZionEX, arXiv 2104.05158).

Tables are laid over every device of the mesh the way TorchRec does it: data-parallel
(replicated), table-wise, row-wise, column-wise and table-row-wise, chosen per table by a
plan (`rec.embedding.planner`). Tables that share a sharding pattern, storage type and
width are packed into one flat row buffer per device, with per-table row offsets, like
FBGEMM's table-batched embeddings. A buffer's row storage (`rec.embedding.storage`: fp32,
bf16, or quantized rows with an fp32 cache) keeps one state per device block, so a cache
holds hot rows of the rows its device owns.

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

Communication per pattern (N devices, batch split over all of them):
- dp:  lookup local, no forward communication; the update all-gathers (ids, grads) so every
       replica applies the same exact update.
- a2a (tw, cw, twrw): all-to-all of ids to the shards' devices, all-to-all of pooled
       partials back, summed (twrw row shards) or concatenated (cw column chunks).
- rw:  ids all-gathered (every row shard may own any id: the static-shape form of
       TorchRec's bucketized all-to-all), partial pooled sums reduce-scattered back.
- sptt: DMT's semantic-preserving tower transform (arXiv 2403.00877): tower t's tables lie
       row-wise on the G devices of tower group t (the mesh axes of the logical name
       "emb_tower" pick the group, those of "emb_tower_shard" the device in it). Ids go to
       their tower's group by an all-to-all over the tower axes, then the rw path runs inside
       the group (all-gather of ids, reduce-scatter of partial sums over the group's axes);
       `pool(..., towers=(fn, params))` applies the model's tower module there and sends its
       compressed [B, K, D] output back by an all-to-all over the tower axes. Without a tower
       module `pool` gives the embeddings, emb_BFD like every other kind.

RecD (arXiv 2211.05239), `dedup=DedupSpec` (rec/data/dedup.py): the deduplicated features
form groups of their own. Given a batch's distinct bags (`SparseBatch.dedup`), `gather` runs
those groups on each batch shard's C_l distinct bags instead of its B_l samples (every
pattern above moves C_l / B_l of the ids and partial sums), and `pool` expands their pooled
vectors back to the samples by the inverse indices, a local gather whose gradient sums the
samples' gradients per distinct bag. Without distinct bags the same groups read the
samples' own bags (the plain path). `bag_sizes` {table: n}: the table's feature reads the
first n ids of each bag only (bags padded to a longer L for other features cost n).

Compressed exchange (arXiv 2407.04272), `a2a_compression=A2ACompression` (a2a_compression.py):
the a2a all-to-all and the rw reduce-scatter of pooled partials, and their gradients, are
sent as error-bounded fixed-rate payloads; an exchange where some value cannot meet its
bound falls back to float32 as a whole. `pool(..., step=)` sets the iteration-wise bound.

Letters: B batch (B_l per device, B_g global), F features, L ids per bag, D embedding
dim, W width of a stored row (D, or a column chunk), N devices, S slots per device,
C distinct bags (RecD; C_l per device), T towers of G devices (SPTT), Fm tower slots,
K outputs of a tower module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import mesh as mesh_lib
from core.ops import take_columns
from rec.data.batch import DedupIds
from rec.data.dedup import DedupSpec
from rec.embedding import a2a_compression as a2a_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import storage as storage_lib
from rec.embedding import storage_spec
from rec.embedding.config import ShardingKind, TableConfig
from rec.embedding.planner import Plan, TablePlacement


def _bag_sum(coef_XL, rows_XLW):
  """Weighted sum over the bag axis L: [..., L] x [..., L, W] -> [..., W]."""
  return jnp.einsum("...l,...lw->...w", coef_XL, rows_XLW)



def _all_to_all0(x, axes):
  """all_to_all over the leading (device) dim, sent as a 2-D [N, rest] buffer.

  XLA:CPU's HLO verifier rejects all-to-alls whose split operands have unit dims in
  different layouts (e.g. [1, B, 1, 1] with one table slot and one id per bag), which
  flattening avoids; the bytes sent are the same.
  """
  if x.ndim <= 2:
    return jax.lax.all_to_all(x, axes, 0, 0)
  return jax.lax.all_to_all(x.reshape(x.shape[0], -1), axes, 0, 0).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class _Shard:
  """A block of one table's rows and columns placed on one device."""

  feature: int
  device: int
  row_start: int
  row_end: int
  col_start: int
  col_end: int


@dataclasses.dataclass
class _Group:
  """Features sharing a communication pattern, storage, table dim and stored width."""

  name: str
  comm: str                     # "dp" | "a2a" | "rw" | "sptt"
  storage: storage_spec.StorageSpec
  dim: int
  width: int
  features: list[int]           # indices into the collection's table order
  shards: list[_Shard] = dataclasses.field(default_factory=list)
  rows_per_device: int = 0      # rows of the per-device buffer (dp: the whole buffer)
  # Static index maps, filled by _finalize (numpy).
  maps: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # Where each shard's rows sit: (device, local row offset) per shard.
  offsets: list[int] = dataclasses.field(default_factory=list)
  dedup: bool = False           # RecD: looked up on a batch's distinct bags when it has them
  bag: int | None = None        # ids per bag read (bag_sizes); None: the batch's L


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
    self.tables = list(tables)
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
    for n, p in self.plan.items():
      bad = [d for d in p.devices if not 0 <= d < self.num_devices]
      if bad or not p.devices:
        raise ValueError(f"table {n!r}: placement devices {p.devices} outside 0..{self.num_devices - 1}")
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
    self.groups = self._build_groups()
    if sum(g.comm == "sptt" for g in self.groups.values()) > 1:
      raise ValueError("sptt tables must share storage, dim and bag size (one group): a tower "
                       f"module sees all of its tower's features; groups {list(self.groups)}")
    self.dims = sorted({t.dim for t in self.tables})

  def _init_towers(self) -> None:
    """SPTT: which tables form which tower, from the plan (tower t on group t's devices)."""
    sptt = [t.name for t in self.tables
            if ShardingKind(self.plan[t.name].kind) == ShardingKind.SPTT]
    self.towers: tuple[tuple[int, ...], ...] = ()
    if not sptt:
      return
    names = [t.name for t in self.tables]
    if len(sptt) != len(names):
      raise ValueError(f"sptt places every table by tower, but tables "
                       f"{[n for n in names if n not in sptt]} are placed otherwise")
    self.tower_axes = mesh_lib.mesh_axes("emb_tower", self.rules, self.mesh)
    self.tower_shard_axes = mesh_lib.mesh_axes("emb_tower_shard", self.rules, self.mesh)
    if self.tower_axes + self.tower_shard_axes != self.axes:
      raise ValueError(
          f"sptt: the tower axes {self.tower_axes} (logical 'emb_tower') and the in-group axes "
          f"{self.tower_shard_axes} ('emb_tower_shard') must together be the embedding axes "
          f"{self.axes}, in that order")
    T = math.prod(self.mesh.shape[a] for a in self.tower_axes)
    G = self.num_devices // T
    towers: list[list[int]] = [[] for _ in range(T)]
    for f, t in enumerate(self.tables):
      devs = self.plan[t.name].devices
      if devs != tuple(range(devs[0] // G * G, devs[0] // G * G + G)):
        raise ValueError(
            f"table {t.name!r}: sptt on devices {devs}; expected one whole tower group "
            f"(tower t on devices {G}t..{G}t+{G - 1}: {T} groups of {G} over mesh axes "
            f"{self.tower_axes} x {self.tower_shard_axes})")
      towers[devs[0] // G].append(f)
    empty = [t for t in range(T) if not towers[t]]
    if empty:
      raise ValueError(f"sptt: tower groups {empty} of {T} hold no table; the mesh's "
                       f"{T} tower groups (axes {self.tower_axes}) need one tower each")
    both = [names[f] for f in self.dedup_features]
    if both:
      raise ValueError(f"tables {both}: RecD dedup and sptt do not combine (a tower module "
                       "mixes features whose samples share no distinct bags)")
    self.towers = tuple(tuple(t) for t in towers)
    self.num_towers, self.tower_size = T, G

  # ---------------------------------------------------------------- layout (host, static)

  def _build_groups(self) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    N = self.num_devices
    for f, t in enumerate(self.tables):
      p: TablePlacement = self.plan[t.name]
      kind = ShardingKind(p.kind)
      if kind == ShardingKind.DATA_PARALLEL:
        comm, width, shards = "dp", t.dim, [_Shard(f, -1, 0, t.num_rows, 0, t.dim)]
      elif kind == ShardingKind.ROW_WISE:
        comm, width = "rw", t.dim
        s = -(-t.num_rows // N)
        shards = [_Shard(f, d, min(d * s, t.num_rows), min((d + 1) * s, t.num_rows), 0, t.dim)
                  for d in range(N)]
      elif kind == ShardingKind.TABLE_WISE:
        comm, width = "a2a", t.dim
        shards = [_Shard(f, p.devices[0], 0, t.num_rows, 0, t.dim)]
      elif kind == ShardingKind.COLUMN_WISE:
        comm = "a2a"
        k = len(p.devices)
        width = -(-t.dim // k)
        shards = [_Shard(f, d, 0, t.num_rows, i * width, min((i + 1) * width, t.dim))
                  for i, d in enumerate(p.devices) if i * width < t.dim]
      elif kind in (ShardingKind.TABLE_ROW_WISE, ShardingKind.SPTT):
        # sptt: twrw's layout on the tower group; its own communication (module docstring)
        comm = "a2a" if kind == ShardingKind.TABLE_ROW_WISE else "sptt"
        width = t.dim
        g = len(p.devices)
        s = -(-t.num_rows // g)
        shards = [_Shard(f, d, min(i * s, t.num_rows), min((i + 1) * s, t.num_rows), 0, t.dim)
                  for i, d in enumerate(p.devices)]
      else:
        raise ValueError(f"table {t.name!r}: unknown sharding kind {p.kind!r}")
      key = f"{comm}_{t.storage}_d{t.dim}_w{width}"
      dedup, bag = f in self.dedup_features, self.bag_sizes.get(t.name)
      key += ("_dedup" if dedup else "") + (f"_l{bag}" if bag else "")
      grp = groups.setdefault(key, _Group(key, comm, t.storage, t.dim, width, [], dedup=dedup,
                                          bag=bag))
      grp.features.append(f)
      grp.shards.extend(shards)
    for grp in groups.values():
      self._finalize(grp)
    return groups

  def _finalize(self, g: _Group) -> None:
    N = self.num_devices
    F = len(g.features)
    local_f = {f: i for i, f in enumerate(g.features)}
    if g.comm == "dp":
      offs, acc = [], 0
      for sh in g.shards:
        offs.append(acc)
        acc += sh.row_end - sh.row_start
      g.offsets, g.rows_per_device = offs, acc
      g.maps["offset"] = np.asarray(offs, np.int32)                     # [F]
    elif g.comm == "rw":
      # Every device holds one row shard of every feature, at the same local offsets.
      per_f = {}
      for sh in g.shards:
        per_f.setdefault(sh.feature, []).append(sh)
      shard_rows = [-(-self.tables[f].num_rows // N) for f in g.features]
      offs = np.concatenate([[0], np.cumsum(shard_rows)[:-1]]).astype(np.int32)
      g.rows_per_device = int(sum(shard_rows))
      start = np.zeros((N, F), np.int32)
      end = np.zeros((N, F), np.int32)
      for f in g.features:
        for sh in per_f[f]:
          start[sh.device, local_f[f]] = sh.row_start
          end[sh.device, local_f[f]] = sh.row_end
      g.offsets = [int(offs[local_f[sh.feature]]) for sh in g.shards]
      g.maps.update(start=start, end=end, offset=np.broadcast_to(offs, (N, F)).copy())
    elif g.comm == "sptt":
      # Device (t, i) holds row shard i of each of tower t's tables, in tower slots 0..F_t-1
      # (the tower's features in table order), at the same local offsets on the group.
      T, G = self.num_towers, self.tower_size
      tower = {f: t for t, fs in enumerate(self.towers) for f in fs}
      slots = [[f for f in g.features if tower[f] == t] for t in range(T)]
      Fm = max(len(fs) for fs in slots)
      feat = np.full((T, Fm), -1, np.int32)          # group-local feature per tower slot
      start = np.zeros((N, Fm), np.int32)
      end = np.zeros((N, Fm), np.int32)
      offset = np.zeros((N, Fm), np.int32)
      mean = np.zeros((N, Fm), bool)
      slot_offset, rows = {}, 0
      for t, fs in enumerate(slots):
        acc = 0
        for j, f in enumerate(fs):
          R = self.tables[f].num_rows
          s = -(-R // G)
          feat[t, j] = local_f[f]
          slot_offset[f] = acc
          for i in range(G):
            d = t * G + i
            start[d, j], end[d, j] = min(i * s, R), min((i + 1) * s, R)
            offset[d, j], mean[d, j] = acc, self.tables[f].pooling == "mean"
          acc += s
        rows = max(rows, acc)
      g.rows_per_device = max(1, rows)
      g.offsets = [slot_offset[sh.feature] for sh in g.shards]
      # Where group feature j's vector sits among the T * Fm tower slots (pool without towers).
      where = [tower[f] * Fm + slots[tower[f]].index(f) for f in g.features]
      g.maps.update(tower_feat=feat, start=start, end=end, offset=offset, mean=mean,
                    slot=np.asarray(where, np.int32))
    else:  # a2a
      slots: list[list[_Shard]] = [[] for _ in range(N)]
      for sh in g.shards:
        slots[sh.device].append(sh)
      S = max(1, max(len(s) for s in slots))
      feat = np.full((N, S), -1, np.int32)     # local feature index per (device, slot)
      start = np.zeros((N, S), np.int32)
      end = np.zeros((N, S), np.int32)
      offset = np.zeros((N, S), np.int32)
      mean = np.zeros((N, S), bool)
      col = np.zeros((N, S), np.int32)
      ncol = np.zeros((N, S), np.int32)
      rows_dev = np.zeros(N, np.int64)
      shard_off = {}
      for d in range(N):
        acc = 0
        for s, sh in enumerate(slots[d]):
          feat[d, s] = local_f[sh.feature]
          start[d, s], end[d, s], offset[d, s] = sh.row_start, sh.row_end, acc
          mean[d, s] = self.tables[sh.feature].pooling == "mean"
          col[d, s], ncol[d, s] = sh.col_start, sh.col_end - sh.col_start
          shard_off[id(sh)] = acc
          acc += sh.row_end - sh.row_start
        rows_dev[d] = acc
      g.rows_per_device = int(max(1, rows_dev.max()))
      g.offsets = [shard_off[id(sh)] for sh in g.shards]
      # Combine maps over the flat [B, N*S*W] pooled partials (slot j = d*S + s holds
      # feature feat[d, s], columns [col, col + ncol)). When every output column has one
      # source (tw, cw) the combine is a pure column selection; row shards (twrw) are
      # placed into full width and summed per feature.
      j_feat, j_col, j_ncol = feat.reshape(-1), col.reshape(-1), ncol.reshape(-1)
      sources = np.zeros((F, g.dim), np.int64)
      select = np.full((F, g.dim), -1, np.int64)
      place = np.full((N * S, g.dim), -1, np.int64)
      for j in range(N * S):
        f = j_feat[j]
        if f < 0:
          continue
        cols = np.arange(j_col[j], j_col[j] + j_ncol[j])
        src = j * g.width + np.arange(j_ncol[j])
        sources[f, cols] += 1
        select[f, cols] = src
        place[j, cols] = src
      if (sources == 1).all():
        g.maps["select"] = select.reshape(-1)
      else:
        onehot = np.zeros((N * S, F), np.float32)
        onehot[j_feat >= 0, j_feat[j_feat >= 0]] = 1.0
        g.maps.update(place=place.reshape(-1), combine=onehot)
      g.maps.update(feat=feat, start=start, end=end, offset=offset, mean=mean)

  # ------------------------------------------------------------------- state

  def _specs(self, g: _Group) -> P:
    return P() if g.comm == "dp" else P(self.axes)

  def storage(self, g: _Group) -> storage_lib.RowStorage:
    """The row storage of group `g`'s buffer."""
    return storage_spec.make_storage(g.storage, seed=self.storage_seed)

  def _shards(self, g: _Group) -> int:
    """Blocks of the group's buffer that live on separate devices (1: replicated)."""
    return 1 if g.comm == "dp" else self.num_devices

  def state_shardings(self) -> dict[str, Any]:
    out = {}
    for name, g in self.groups.items():
      s = NamedSharding(self.mesh, self._specs(g))
      shapes = self._abstract_group(g)
      out[name] = jax.tree.map(lambda _: s, shapes)
    return out

  def _buffer_rows(self, g: _Group) -> int:
    return g.rows_per_device if g.comm == "dp" else g.rows_per_device * self.num_devices

  def _abstract_group(self, g: _Group):
    return jax.eval_shape(lambda: self._empty_group(g))

  def _empty_group(self, g: _Group):
    rows = self._buffer_rows(g)
    return {"table": self.storage(g).from_float(jnp.zeros((rows, g.width), jnp.float32),
                                                self._shards(g)),
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
    g = self.groups[name]
    return [(self.tables[sh.feature].name, sh.row_start, sh.row_end, sh.col_start, sh.col_end,
             row) for sh, row in self._blocks(g)]

  def shards(self, name: str) -> int:
    """Blocks of group `name`'s buffer, one per device (1: replicated)."""
    return self._shards(self.groups[name])

  def _blocks(self, g: _Group):
    """(shard, first row of its block in the group's global buffer) for every shard."""
    for sh, off in zip(g.shards, g.offsets):
      yield sh, off + (0 if g.comm == "dp" else sh.device * g.rows_per_device)

  def from_tables(self, full: dict[str, Any]) -> dict[str, Any]:
    """Lays full logical tables [rows, dim] out in device buffers on the mesh, with fresh
    optimizer state (host-side copy; the inverse of `to_tables`)."""
    full = {k: np.asarray(jax.device_get(v), np.float32) for k, v in full.items()}
    state = {}
    shardings = self.state_shardings()
    for name, g in self.groups.items():
      storage = self.storage(g)
      buf = np.zeros((self._buffer_rows(g), g.width), np.float32)
      for sh, row in self._blocks(g):
        blk = full[self.tables[sh.feature].name][sh.row_start:sh.row_end, sh.col_start:sh.col_end]
        buf[row:row + blk.shape[0], :blk.shape[1]] = blk
      group_state = {"table": storage.from_float(buf, self._shards(g)),
                     "opt": self.optimizer.init_state(buf.shape[0], g.width)}
      state[name] = jax.device_put(group_state, shardings[name])
    return state

  def to_tables(self, state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Gathers device buffers back into full logical tables (host numpy, float32)."""
    return self._unpack({n: self.storage(g) for n, g in self.groups.items()}, state)

  def _unpack(self, storages, state) -> dict[str, np.ndarray]:
    out = {t.name: np.zeros((t.num_rows, t.dim), np.float32) for t in self.tables}
    for name, g in self.groups.items():
      storage = storages[name]
      buf = np.asarray(jax.device_get(storage.to_float(state[name]["table"], self._shards(g))))
      for sh, row in self._blocks(g):
        n, c = sh.row_end - sh.row_start, sh.col_end - sh.col_start
        out[self.tables[sh.feature].name][sh.row_start:sh.row_end, sh.col_start:sh.col_end] = (
            buf[row:row + n, :c])
    return out

  # ------------------------------------------------------------------- ids

  def check_ids(self, ids: np.ndarray, lengths: np.ndarray) -> None:
    """Host-side check that every id in a bag is a row of its table (out_of_range='error')."""
    if self.out_of_range != "error":
      return
    ids = np.asarray(ids)
    L = ids.shape[2]
    live = np.arange(L)[None, None, :] < np.asarray(lengths)[:, :, None]
    rows = np.asarray([t.num_rows for t in self.tables])[None, :, None]
    bad = live & ((ids < 0) | (ids >= rows))
    if bad.any():
      b, f, l = map(int, np.argwhere(bad)[0])
      t = self.tables[f]
      raise ValueError(
          f"feature {t.name!r}: id {int(ids[b, f, l])} at example {b}, position {l} is "
          f"outside table {t.name!r} rows [0, {t.num_rows}) ({int(bad.sum())} such ids in "
          "this batch); hash ids into range in the reader, or use out_of_range='hash'")

  def check_lengths(self, lengths: np.ndarray) -> None:
    """Host-side check that no bag is longer than its table's `bag_sizes` entry (the ids
    past it would not be read)."""
    lengths = np.asarray(lengths)
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
    if dedup is not None:
      if not self.dedup_features:
        raise ValueError("the batch carries distinct bags (RecD) but this collection has no "
                         "`dedup` option")
      col = self._check_dedup(dedup)
      d_ids, d_len, d_w = self._prepare_ids(dedup.ids, dedup.lengths, dedup.weights,
                                            dedup.features)
    out = Lookup({}, {}, {}, {})
    bspec = P(self.axes)
    for name, g in self.groups.items():
      if g.dedup and dedup is not None:
        sel = np.asarray([col[f] for f in g.features])
        gi, gl, gw = d_ids[:, sel], d_len[:, sel], d_w[:, sel]
        out.inverse[name] = dedup.inverse[:, sel]
      else:
        sel = np.asarray(g.features)
        gi, gl, gw = ids[:, sel], lengths[:, sel], weights[:, sel]
      if g.bag is not None:
        gi, gw = gi[..., :g.bag], gw[..., :g.bag]
      storage = self.storage(g)
      mean = np.asarray([self.tables[f].pooling == "mean" for f in g.features])
      fn = getattr(self, f"_gather_{g.comm}")
      maps = {k: v for k, v in g.maps.items() if k in ("start", "end", "offset", "feat", "mean")}
      in_maps_spec = {k: (P() if g.comm == "dp" else P(self.axes)) for k in maps}
      f = jax.shard_map(
          lambda tbl, i, l, w, m, g=g, storage=storage, mean=mean, fn=fn:
              fn(g, storage, tbl, i, l, w, m, mean),
          mesh=self.mesh,
          in_specs=(self._specs(g), bspec, bspec, bspec, in_maps_spec),
          out_specs=(bspec,) * 4, check_vma=False)
      partial, coef, index, valid = f(state[name]["table"], gi, gl, gw,
                                      {k: jnp.asarray(v) for k, v in maps.items()})
      out.partial[name], out.coef[name], out.index[name], out.valid[name] = (
          partial, coef, index, valid)
    return out

  def _bag_pool(self, storage, tbl, index, coef):
    """Bag sums [..., W] of local rows `index` [..., L] (in range; padding has coef 0)."""
    if self.lookup_impl == "pallas":   # the kernel reads the storage's own format
      return storage.pallas_pool(tbl, index, coef)
    return _bag_sum(coef, storage.gather(tbl, index, clip=True))

  @staticmethod
  def _coef(valid, w, lengths, mean):
    c = jnp.where(valid, w, 0.0)
    denom = jnp.where(mean, jnp.maximum(lengths, 1).astype(jnp.float32), 1.0)
    return c / denom[..., None]

  def _gather_dp(self, g, storage, tbl, ids, lengths, w, maps, mean):
    L = ids.shape[-1]
    live = jnp.arange(L) < lengths[..., None]                  # [B_l, F, L]
    index = jnp.where(live, ids + maps["offset"][None, :, None], 0)
    coef = self._coef(live, w, lengths, jnp.asarray(mean)[None, :])
    return self._bag_pool(storage, tbl, index, coef), coef, index, live

  def _gather_rw(self, g, storage, tbl, ids, lengths, w, maps, mean):
    return self._rowwise(storage, tbl, ids, lengths, w, maps, jnp.asarray(mean)[None, :],
                         self.axes)

  def _rowwise(self, storage, tbl, ids, lengths, w, maps, mean, axes):
    """The rw path over the devices of `axes`: each sees all their ids (all-gather) and
    sums the rows of its own row shards; `_pool_rw` / `_sptt_out` reduce-scatter the sums
    back over the same axes."""
    if axes:
      ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)     # [B_g, F, L]
      lengths = jax.lax.all_gather(lengths, axes, axis=0, tiled=True)
      w = jax.lax.all_gather(w, axes, axis=0, tiled=True)
    start, end, off = maps["start"][0], maps["end"][0], maps["offset"][0]   # [F]
    L = ids.shape[-1]
    live = jnp.arange(L) < lengths[..., None]
    valid = live & (ids >= start[None, :, None]) & (ids < end[None, :, None])
    index = jnp.where(valid, ids - start[None, :, None] + off[None, :, None], 0)
    coef = self._coef(valid, w, lengths, mean)
    return self._bag_pool(storage, tbl, index, coef), coef, index, valid

  def _gather_sptt(self, g, storage, tbl, ids, lengths, w, maps, mean):
    """Ids to their tower's group (all-to-all over the tower axes), then the rw path inside
    the group: [G * T * B_l, Fm, ...] per device."""
    feat = g.maps["tower_feat"]                                 # [T, Fm]
    fsel, live_slot = np.maximum(feat, 0), feat >= 0
    send_ids = jnp.swapaxes(ids[:, fsel], 0, 1)                 # [T_dest, B_l, Fm, L]
    send_len = jnp.swapaxes(jnp.where(live_slot[None], lengths[:, fsel], 0), 0, 1)
    send_w = jnp.swapaxes(w[:, fsel], 0, 1)
    if self.tower_axes:                                         # [T_src, B_l, Fm, ...]
      send_ids, send_len, send_w = (_all_to_all0(x, self.tower_axes)
                                    for x in (send_ids, send_len, send_w))
    flat = lambda x: x.reshape((-1,) + x.shape[2:])             # [T * B_l, Fm, ...]
    return self._rowwise(storage, tbl, flat(send_ids), flat(send_len), flat(send_w), maps,
                         maps["mean"][0][None, :], self.tower_shard_axes)

  def _gather_a2a(self, g, storage, tbl, ids, lengths, w, maps, mean):
    ax = self.axes
    feat_all = jnp.asarray(g.maps["feat"])                      # [N, S] (all devices)
    live_slot = feat_all >= 0
    fsel = jnp.maximum(feat_all, 0)
    # Send buffers [N_dest, B_l, S, L]: for each destination, the ids of its slots.
    send_ids = jnp.transpose(ids[:, fsel], (1, 0, 2, 3))
    send_len = jnp.transpose(jnp.where(live_slot[None], lengths[:, fsel], 0), (1, 0, 2))
    send_w = jnp.transpose(w[:, fsel], (1, 0, 2, 3))
    r_ids = _all_to_all0(send_ids, ax)               # [N_src, B_l, S, L]
    r_len = _all_to_all0(send_len, ax)
    r_w = _all_to_all0(send_w, ax)
    start, end, off = maps["start"][0], maps["end"][0], maps["offset"][0]   # [S]
    mean_s = maps["mean"][0]
    L = r_ids.shape[-1]
    live = jnp.arange(L) < r_len[..., None]
    valid = live & (r_ids >= start[:, None]) & (r_ids < end[:, None])
    index = jnp.where(valid, r_ids - start[:, None] + off[:, None], 0)
    coef = self._coef(valid, r_w, r_len, mean_s[None, None, :])
    partial = self._bag_pool(storage, tbl, index, coef)                   # [N_src, B_l, S, W]
    n, b = index.shape[:2]
    flat = lambda x: x.reshape((n * b,) + x.shape[2:])
    return flat(partial), flat(coef), flat(index), flat(valid)

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
    bspec = P(self.axes)
    if towers is not None:
      if not self.towers:
        raise ValueError("pool(towers=...): no table of this collection is placed sptt")
      (name, g), = self.groups.items()
      fn, params = towers
      f = jax.shard_map(lambda x, p: self._sptt_out(g, x, fn, p), mesh=self.mesh,
                        in_specs=(bspec, jax.tree.map(lambda _: P(), params)),
                        out_specs=bspec, check_vma=False)
      out = f(partial[name], params)                                # [B, T, K, D]
      return out.reshape(out.shape[0], -1, out.shape[-1])
    if len(self.dims) != 1:
      raise ValueError(f"pool() stacks features into [B, F, D], but table dims differ: {self.dims}")
    outs, order = [], []
    comp = self.a2a_compression
    for name, g in self.groups.items():
      if comp is not None and g.comm in ("a2a", "rw"):
        fn = getattr(self, f"_pool_{g.comm}_compressed")
        scale = comp.schedule.factor(0 if step is None else step)
        f = jax.shard_map(lambda x, c, g=g, fn=fn: fn(g, x, c), mesh=self.mesh,
                          in_specs=(bspec, P()), out_specs=bspec, check_vma=False)
        emb = f(partial[name], scale)
      else:
        fn = getattr(self, f"_pool_{g.comm}")
        f = jax.shard_map(lambda x, g=g, fn=fn: fn(g, x), mesh=self.mesh,
                          in_specs=bspec, out_specs=bspec, check_vma=False)
        emb = f(partial[name])
      if name in lookup.inverse:
        emb = self._expand(emb, lookup.inverse[name])
      outs.append(emb)
      order.extend(g.features)
    emb = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    perm = np.argsort(np.asarray(order))
    return emb if np.array_equal(perm, np.arange(len(perm))) else emb[:, perm]

  def _expand(self, emb_CFW, inverse_BF):
    """RecD: emb_BFW[b, f] = emb_CFW[inverse[b, f], f] on each device's own block (no
    communication); the gradient sums the samples' rows per distinct bag."""
    def local(e_CFW, inv_BF):
      return jnp.take_along_axis(e_CFW, inv_BF[..., None], axis=0)
    spec = P(self.axes)
    return jax.shard_map(local, mesh=self.mesh, in_specs=(spec, spec), out_specs=spec,
                         check_vma=False)(emb_CFW, inverse_BF)

  @staticmethod
  def _pool_dp(g, partial):
    return partial

  def _pool_rw(self, g, partial):                                   # [B_g, F, W]
    return jax.lax.psum_scatter(partial, self.axes, scatter_dimension=0, tiled=True)

  def _pool_sptt(self, g, partial):
    """Without a tower module: each feature's pooled vector, [B_l, F, W] in group order."""
    out = self._sptt_out(g, partial, None, None)                    # [B_l, T, Fm, W]
    b, W = out.shape[0], g.width
    cols = tuple(int(s) * W + c for s in g.maps["slot"] for c in range(W))
    return take_columns(out.reshape(b, -1), cols).reshape(b, len(g.features), W)

  def _sptt_out(self, g, partial, fn, params):
    """Partial sums [G * T * B_l, Fm, W] -> reduce-scatter in the group -> tower module
    (if any) -> all-to-all over the tower axes: [B_l, T, K, W] for this device's samples."""
    emb = partial
    if self.tower_shard_axes:                                       # [T * B_l, Fm, W]
      emb = jax.lax.psum_scatter(partial, self.tower_shard_axes, scatter_dimension=0,
                                 tiled=True)
    if fn is not None:
      t = jax.lax.axis_index(self.tower_axes) if self.tower_axes else 0
      emb = fn(params, t, emb)                                      # [T * B_l, K, W]
    x = emb.reshape((self.num_towers, -1) + emb.shape[1:])         # [T_src, B_l, K, W]
    if self.tower_axes:
      x = _all_to_all0(x, self.tower_axes)                          # [T_tower, B_l, K, W]
    return jnp.swapaxes(x, 0, 1)

  def _pool_a2a(self, g, partial):                                  # [N_src*B_l, S, W]
    N = self.num_devices
    S = g.maps["feat"].shape[1]
    partial = partial.reshape(N, -1, S, g.width)
    back = _all_to_all0(partial, self.axes)          # [N_owner, B_l, S, W]
    return self._combine_a2a(g, back)

  def _combine_a2a(self, g, back):
    """The owners' partials [N_owner, B_l, S, W] -> emb [B_l, F, D] (columns placed, row
    shards summed)."""
    N = self.num_devices
    S = g.maps["feat"].shape[1]
    b = back.shape[1]
    flat = jnp.transpose(back, (1, 0, 2, 3)).reshape(b, N * S * g.width)
    F = len(g.features)
    if "select" in g.maps:
      return take_columns(flat, tuple(g.maps["select"].tolist())).reshape(b, F, g.dim)
    placed = take_columns(flat, tuple(g.maps["place"].tolist())).reshape(b, N * S, g.dim)
    return jnp.einsum("bjd,jf->bfd", placed, jnp.asarray(g.maps["combine"]))

  def _feature_factors(self) -> np.ndarray:
    """Table-wise bound factor per feature index, with a trailing 1 for padding slots (-1)."""
    comp = self.a2a_compression
    return np.append(comp.factors([self.tables[f].name for f in range(len(self.tables))]),
                     np.float32(1.0))

  def _pool_a2a_compressed(self, g, partial, scale):
    """`_pool_a2a` with the all-to-all compressed (a2a_compression); per-row bounds from
    the row's table (table-wise factor) and `scale` (iteration-wise factor)."""
    comp = self.a2a_compression
    N = self.num_devices
    feat = g.maps["feat"]                                           # [N, S]
    S = feat.shape[1]
    fac = jnp.asarray(self._feature_factors()[feat])               # [N, S]; -1 -> 1
    partial = partial.reshape(N, -1, S, g.width)
    B_l = partial.shape[1]
    me = jax.lax.axis_index(self.axes)
    # Rows sent hold this device's slots; rows of the gradient coming back hold the owner's.
    eb_f = jnp.broadcast_to((comp.bound * scale * fac[me])[None, None, :], (N, B_l, S))
    eb_b = None
    if comp.grad_bound is not None:
      eb_b = jnp.broadcast_to((comp.grad_bound * scale * fac)[:, None, :], (N, B_l, S))
    back = a2a_lib.all_to_all(partial, eb_f, eb_b, comp, self.axes)   # [N_owner, B_l, S, W]
    return self._combine_a2a(g, back)

  def _pool_rw_compressed(self, g, partial, scale):                 # [B_g, F, W]
    comp = self.a2a_compression
    fac = jnp.asarray(self._feature_factors()[np.asarray(g.features)])     # [F]
    B_g, F = partial.shape[:2]
    eb_f = jnp.broadcast_to(comp.bound * scale * fac, (B_g, F))
    eb_b = None
    if comp.grad_bound is not None:
      eb_b = jnp.broadcast_to(comp.grad_bound * scale * fac, (B_g // self.num_devices, F))
    return a2a_lib.reduce_scatter(partial, eb_f, eb_b, comp, self.axes)

  @staticmethod
  def _id_grads(coef, partial_grad):
    """Per-id gradient rows [M, W]: each id's coefficient times its bag's gradient."""
    W = partial_grad.shape[-1]
    return (coef[..., None] * partial_grad[..., None, :]).reshape(-1, W)

  def apply_gradients(self, state: dict[str, Any], lookup: Lookup,
                      partial_grads: dict[str, jax.Array], step: jax.Array) -> dict[str, Any]:
    """Sparse optimizer step on the rows each device's lookup touched, from the gradients
    of the bag sums (`pool`'s input)."""
    new = {}
    bspec = P(self.axes)
    for name, g in self.groups.items():
      storage = self.storage(g)
      spec = self._specs(g)
      sspec = jax.tree.map(lambda _: spec, state[name])

      def upd(st, index, valid, coef, pgrad, step, g=g, storage=storage):
        if self.lookup_impl == "pallas":
          from kernels import embedding_bag
          grads = embedding_bag.embedding_bag_id_grads(coef, pgrad)
        else:
          grads = self._id_grads(coef, pgrad)
        index, valid = index.reshape(-1), valid.reshape(-1)
        if g.comm == "dp":  # replicas apply the same update from everyone's ids
          index = jax.lax.all_gather(index, self.axes, axis=0, tiled=True)
          valid = jax.lax.all_gather(valid, self.axes, axis=0, tiled=True)
          grads = jax.lax.all_gather(grads, self.axes, axis=0, tiled=True)
        tbl, opt = self.optimizer.apply(storage, st["table"], st["opt"], index, grads, valid, step)
        return {"table": tbl, "opt": opt}

      f = jax.shard_map(upd, mesh=self.mesh,
                        in_specs=(sspec, bspec, bspec, bspec, bspec, P()),
                        out_specs=sspec, check_vma=False)
      new[name] = f(state[name], lookup.index[name], lookup.valid[name], lookup.coef[name],
                    partial_grads[name], step)
    return new

  def dense_gradients(self, lookup: Lookup, partial_grads: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Full per-table gradients [rows, dim] (host numpy) from the bag-sum gradients; for
    tests and debugging: training never materializes them."""
    if not hasattr(self, "_dense_grads_fn"):
      bspec = P(self.axes)

      def scatter_all(index, valid, coef, pgrads):
        bufs = {}
        for name, g in self.groups.items():
          rows = self._buffer_rows(g) // (1 if g.comm == "dp" else self.num_devices)

          def scat(index, valid, coef, pgrad, rows=rows, g=g):
            gr = jnp.where(valid.reshape(-1)[:, None], self._id_grads(coef, pgrad), 0.0)
            out = jnp.zeros((rows, gr.shape[-1]), jnp.float32).at[index.reshape(-1)].add(gr)
            return jax.lax.psum(out, self.axes) if g.comm == "dp" else out

          f = jax.shard_map(scat, mesh=self.mesh, in_specs=(bspec,) * 4,
                            out_specs=self._specs(g), check_vma=False)
          bufs[name] = {"table": {"rows": f(index[name], valid[name], coef[name], pgrads[name])}}
        return bufs

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
