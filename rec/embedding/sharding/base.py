"""The interface of a sharding kind and of the exchange its tables' group runs.

A sharding kind (`Kind`, one module per kind) says where one table's rows and columns lie:
its shards, blocks of rows x columns placed on devices, and the exchange (`Exchange`) that
moves the batch's ids to those devices and their pooled sums back. The collection packs the
tables whose kinds share an exchange, storage, dim and stored width into one group: one flat
row buffer per device with per-table row offsets, like FBGEMM's table-batched embeddings.
An exchange instance serves one group:

  layout (host, static)  finalize: the group's index maps, its shards' offsets, its rows per
                         device; spec / num_blocks / buffer_rows / blocks: its device buffer
  gather                 input distribution, row gather and bag sums (`local_gather`, per
                         device inside shard_map) -> partial sums, coefficients, local rows
  pool                   output distribution of the partial sums -> emb [B, F, D]
                         (`local_pool`, its collectives through a `Send`)
  update                 the sparse optimizer step on the rows each device touched
                         (`update_rows`: the ids and gradients a device's buffer applies)
  prefetch               a later batch's rows into each device's cache (the host tier's
                         lookahead): `local_ids`, gather's id phase without the rows,
                         `prefetch_ids` (dp: every replica's), `storage.prefetch`

Wrappers around an exchange (`recd.Deduplicated`, `compressed.Compressed`) change what its
gather reads or how its pool sends, for every kind that uses it.

Letters: B batch (B_l per device, B_g global), F features, L ids per bag, D embedding dim,
W width of a stored row (D, or a column chunk), N devices, S slots per device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from rec.embedding import a2a_compression as a2a_lib
from rec.embedding import storage_spec
from rec.embedding.config import ShardingKind, TableConfig


def bag_sum(coef_XL, rows_XLW):
  """Weighted sum over the bag axis L: [..., L] x [..., L, W] -> [..., W]."""
  return jnp.einsum("...l,...lw->...w", coef_XL, rows_XLW)


def all_to_all0(x, axes):
  """all_to_all over the leading (device) dim, sent as a 2-D [N, rest] buffer.

  XLA:CPU's HLO verifier rejects all-to-alls whose split operands have unit dims in
  different layouts (e.g. [1, B, 1, 1] with one table slot and one id per bag), which
  flattening avoids; the bytes sent are the same.
  """
  if x.ndim <= 2:
    return jax.lax.all_to_all(x, axes, 0, 0)
  return jax.lax.all_to_all(x.reshape(x.shape[0], -1), axes, 0, 0).reshape(x.shape)


def pool_coef(valid, w, lengths, mean):
  """Pooling coefficients [..., L]: weight * valid, over the bag's length for mean pooling."""
  c = jnp.where(valid, w, 0.0)
  denom = jnp.where(mean, jnp.maximum(lengths, 1).astype(jnp.float32), 1.0)
  return c / denom[..., None]


def id_grads(coef, partial_grad):
  """Per-id gradient rows [M, W]: each id's coefficient times its bag's gradient."""
  W = partial_grad.shape[-1]
  return (coef[..., None] * partial_grad[..., None, :]).reshape(-1, W)


@dataclasses.dataclass(frozen=True)
class Shard:
  """A block of one table's rows and columns placed on one device (-1: every device)."""

  feature: int
  device: int
  row_start: int
  row_end: int
  col_start: int
  col_end: int


def row_shards(f: int, table: TableConfig, devices: Sequence[int]) -> list[Shard]:
  """Row shard i of ceil(rows / len(devices)) rows (the last shorter) on devices[i]."""
  R, s = table.num_rows, -(-table.num_rows // len(devices))
  return [Shard(f, d, min(i * s, R), min((i + 1) * s, R), 0, table.dim)
          for i, d in enumerate(devices)]


@dataclasses.dataclass
class Group:
  """Features sharing a communication pattern, storage, table dim and stored width."""

  name: str
  comm: str                     # the exchange: "dp" | "a2a" | "rw" | "sptt"
  storage: storage_spec.StorageSpec
  dim: int
  width: int
  features: list[int]           # indices into the collection's table order
  shards: list[Shard] = dataclasses.field(default_factory=list)
  rows_per_device: int = 0      # rows of the per-device buffer (dp: the whole buffer)
  # Static index maps, filled by the exchange's finalize (numpy).
  maps: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # Where each shard's rows sit: local row offset per shard (in its device's block).
  offsets: list[int] = dataclasses.field(default_factory=list)
  dedup: bool = False           # RecD: looked up on a batch's distinct bags when it has them
  bag: int | None = None        # ids per bag read (bag_sizes); None: the batch's L


@dataclasses.dataclass(frozen=True)
class Devices:
  """What an exchange knows of its collection: the mesh and its embedding axes, the tables
  (in the collection's order), the lookup implementation, and the towers (SPTT)."""

  mesh: Mesh
  axes: tuple[str, ...]         # mesh axes of the logical name "emb_shard" (= the batch's)
  num_devices: int
  tables: tuple[TableConfig, ...]
  lookup_impl: str = "xla"      # "xla" | "pallas" (kernels/embedding_bag.py)
  towers: Any = None            # sptt.Towers, or None without sptt tables

  def bag_pool(self, storage, tbl, index, coef, valid=None):
    """Bag sums [..., W] of local rows `index` [..., L] (in range; padding has coef 0;
    `valid`: the ids that are not padding, whose rows the storage must read)."""
    if self.lookup_impl == "pallas" and not storage.host_keys:   # the kernel reads the
      return storage.pallas_pool(tbl, index, coef)                 # storage's own format
    return bag_sum(coef, storage.gather(tbl, index, clip=True, live=valid))


class Send:
  """The collectives that carry pooled partials (and, transposed, their gradients) in
  float32. `compressed.CompressedSend` sends the same ones as error-bounded payloads. Both
  run under the named scope `a2a_lib.EXCHANGE_SCOPE`, by which `a2a_lib.exchange_bytes`
  tells them from the step's other collectives (ids, per-id weights, dp gradients)."""

  def all_to_all(self, x, axes):
    with jax.named_scope(a2a_lib.EXCHANGE_SCOPE):
      return all_to_all0(x, axes)

  def reduce_scatter(self, x, axes):
    with jax.named_scope(a2a_lib.EXCHANGE_SCOPE):
      return jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)


PLAIN = Send()


class Exchange:
  """How a group's buffers lie on the devices and how ids and pooled sums move (module
  docstring). Subclasses set `name` and implement finalize, local_gather and local_pool."""

  name: ClassVar[str]
  replicated: ClassVar[bool] = False    # one full buffer on every device (dp)
  compressible: ClassVar[bool] = False  # local_pool sends through a Send (a2a_compression)
  MAP_KEYS: ClassVar[tuple[str, ...]] = ("start", "end", "offset", "feat", "mean")

  def __init__(self, devices: Devices, group: Group):
    self.dev, self.g = devices, group

  # ---------------------------------------------------------------- layout (host, static)

  def finalize(self) -> None:
    """Fills the group's maps, offsets and rows_per_device from its shards."""
    raise NotImplementedError

  def spec(self) -> P:
    return P() if self.replicated else P(self.dev.axes)

  def num_blocks(self) -> int:
    """Blocks of the group's buffer that live on separate devices (1: replicated)."""
    return 1 if self.replicated else self.dev.num_devices

  def buffer_rows(self) -> int:
    return self.g.rows_per_device * self.num_blocks()

  def blocks(self):
    """(shard, first row of its block in the group's global buffer) for every shard."""
    g = self.g
    for sh, off in zip(g.shards, g.offsets):
      yield sh, off + (0 if self.replicated else sh.device * g.rows_per_device)

  def mean(self) -> np.ndarray:
    """[F] bool: the group's features that mean-pool."""
    return np.asarray([self.dev.tables[f].pooling == "mean" for f in self.g.features])

  # ---------------------------------------------------------------- per device (shard_map)

  def local_gather(self, storage, tbl, ids, lengths, w, maps):
    """This device's batch block ids [B_l, F, L] -> (partial [..., W], coef, index, valid)."""
    raise NotImplementedError

  def local_pool(self, partial, send: Send = PLAIN):
    """This device's partial sums -> emb [B_l, F, D] of its own samples."""
    raise NotImplementedError

  def local_ids(self, ids, lengths, maps):
    """The id phase of `local_gather` alone: this device's batch block ids [B_l, F, L] ->
    (index, valid) of the local rows its buffer reads for them (the ids' exchange, no row
    read)."""
    raise NotImplementedError

  def prefetch_ids(self, index, valid):
    """The (local rows, valid) [M] of a lookahead that this device's cache admits."""
    return index, valid

  def update_rows(self, index, valid, grads):
    """The (local rows, valid, gradient rows) this device's buffer applies."""
    return index, valid, grads

  def sum_dense(self, rows):
    """A device's dense [rows, W] gradient block as its buffer holds it."""
    return rows

  # ---------------------------------------------------------------- group (whole mesh)

  def _columns(self, ids, lengths, weights, sel):
    gi, gl, gw = ids[:, sel], lengths[:, sel], weights[:, sel]
    if self.g.bag is not None:
      gi, gw = gi[..., :self.g.bag], gw[..., :self.g.bag]
    return gi, gl, gw

  def inputs(self, ids, lengths, weights, distinct=None):
    """The group's columns of a batch's ids, lengths, weights (bags cut to the group's bag
    size) and the inverse indices of distinct bags (None: the samples' own bags)."""
    return self._columns(ids, lengths, weights, np.asarray(self.g.features)) + (None,)

  def gather(self, storage, tbl, ids, lengths, w):
    """(partial, coef, index, valid) of the group's columns, each [devices' blocks, ...]."""
    bspec = P(self.dev.axes)
    maps = {k: v for k, v in self.g.maps.items() if k in self.MAP_KEYS}
    f = jax.shard_map(
        lambda tbl, i, l, w, m: self.local_gather(storage, tbl, i, l, w, m),
        mesh=self.dev.mesh,
        in_specs=(self.spec(), bspec, bspec, bspec, {k: self.spec() for k in maps}),
        out_specs=(bspec,) * 4, check_vma=False)
    return f(tbl, ids, lengths, w, {k: jnp.asarray(v) for k, v in maps.items()})

  def pool(self, partial, step=None, inverse=None):
    """emb [B, F_g, D] from the group's partial sums (`inverse`: RecD's, see recd.py)."""
    del step    # the iteration-wise bound of a compressed exchange (compressed.py)
    if inverse is not None:
      raise ValueError(f"group {self.g.name!r}: distinct bags for a group without dedup")
    bspec = P(self.dev.axes)
    f = jax.shard_map(lambda x: self.local_pool(x, PLAIN), mesh=self.dev.mesh,
                      in_specs=bspec, out_specs=bspec, check_vma=False)
    return f(partial)

  def on_local_ids(self, fn, tbl, ids, lengths, *args, out_specs=None):
    """fn(table block, index, valid, *args) on every device under shard_map, `index` /
    `valid` the local rows that ids [B, F_g, L] (lengths [B, F_g]) read there (`local_ids`:
    the ids' exchange, no row read); `args` replicated; `out_specs` None: the table's
    (fn returns the block)."""
    bspec = P(self.dev.axes)
    maps = {k: v for k, v in self.g.maps.items() if k in self.MAP_KEYS}
    sspec = jax.tree.map(lambda _: self.spec(), tbl)

    def local(tbl, ids, lengths, maps, *args):
      index, valid = self.local_ids(ids, lengths, maps)
      return fn(tbl, index, valid, *args)

    f = jax.shard_map(
        local, mesh=self.dev.mesh,
        in_specs=(sspec, bspec, bspec, {k: self.spec() for k in maps}) + (P(),) * len(args),
        out_specs=sspec if out_specs is None else out_specs, check_vma=False)
    return f(tbl, ids, lengths, {k: jnp.asarray(v) for k, v in maps.items()}, *args)

  def prefetch(self, storage, tbl, ids, lengths, step):
    """The group's table state with the rows that ids [B, F_g, L] (lengths [B, F_g]) will
    read admitted to each device's cache (`storage.prefetch` on every device's block, after
    the ids' exchange; `step`: the step that reads them)."""
    from rec.embedding import optimizers   # optimizers import storage only

    def admit(tbl, index, valid, step):
      index, valid = self.prefetch_ids(index.reshape(-1), valid.reshape(-1))
      m = index.shape[0]
      uniq_M, seg_M = optimizers.dedup_ids(index, valid, storage.num_rows(tbl))
      counts_M = (jax.ops.segment_sum(jnp.ones((m,), jnp.int32), seg_M, num_segments=m)
                  if storage.counts_accesses else None)
      return storage.prefetch(tbl, uniq_M, counts_M, step)

    return self.on_local_ids(admit, tbl, ids, lengths, jnp.asarray(step, jnp.int32))

  def update(self, state, index, valid, coef, pgrad, step, storage, optimizer):
    """Sparse optimizer step on the rows each device's lookup touched, from the gradients
    of the bag sums."""
    bspec = P(self.dev.axes)
    sspec = jax.tree.map(lambda _: self.spec(), state)

    def upd(st, index, valid, coef, pgrad, step):
      if self.dev.lookup_impl == "pallas":
        from kernels import embedding_bag
        grads = embedding_bag.embedding_bag_id_grads(coef, pgrad)
      else:
        grads = id_grads(coef, pgrad)
      index, valid = index.reshape(-1), valid.reshape(-1)
      index, valid, grads = self.update_rows(index, valid, grads)
      tbl, opt = optimizer.apply(storage, st["table"], st["opt"], index, grads, valid, step)
      return {"table": tbl, "opt": opt}

    f = jax.shard_map(upd, mesh=self.dev.mesh,
                      in_specs=(sspec, bspec, bspec, bspec, bspec, P()),
                      out_specs=sspec, check_vma=False)
    return f(state, index, valid, coef, pgrad, step)

  def dense_gradients(self, index, valid, coef, pgrad):
    """The group's full-buffer gradient [buffer rows, W] (tests and debugging)."""
    bspec = P(self.dev.axes)
    rows = self.g.rows_per_device

    def scat(index, valid, coef, pgrad):
      gr = jnp.where(valid.reshape(-1)[:, None], id_grads(coef, pgrad), 0.0)
      out = jnp.zeros((rows, gr.shape[-1]), jnp.float32).at[index.reshape(-1)].add(gr)
      return self.sum_dense(out)

    f = jax.shard_map(scat, mesh=self.dev.mesh, in_specs=(bspec,) * 4,
                      out_specs=self.spec(), check_vma=False)
    return f(index, valid, coef, pgrad)


class Kind:
  """A sharding kind: where a table's rows and columns lie, and its group's exchange."""

  kind: ClassVar[ShardingKind]
  exchange: ClassVar[type[Exchange]]

  def shards(self, f: int, table: TableConfig, devices: tuple[int, ...],
             num_devices: int) -> tuple[int, list[Shard]]:
    """(stored row width, shards) of table f placed on `devices` of num_devices."""
    raise NotImplementedError
