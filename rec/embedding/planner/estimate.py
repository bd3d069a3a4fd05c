"""Cost model of the embedding planner: per-device memory, lookups, traffic and time.

Cost model, per table and per training step. Symbols: N embedding devices, B global batch
(b = B / N examples per device), P pooling factor (mean ids per bag), L id slots per bag
the batch carries (its padded bag: `CostParams.ids_per_bag`, else ceil(P)), R rows, D dim,
w width of a column chunk as stored (ceil(D / k) for every chunk: the last, narrower one is
padded to it), g devices in a twrw / sptt group (T = N / g towers), r_i rows of
row shard i (shards of ceil(R / n) rows, the last shorter), m(w) storage bytes of a row of
width w (fp32 4w, bf16 2w; int8 / int4 codes plus each row's scale and bias, so every
column chunk has its own; a cache's share), s = m(D) / D, o(w) optimizer state bytes per
row of a shard of width w, ib bytes per id (4), a bytes per pooled activation / gradient
element (4), vb bytes of a valid flag (1), and the bytes of one bag on the wire:
  u    = L*ib + L*wb + lb   all-to-all (ids, float32 weights wb = 4, int32 length lb = 4)
  u_rw = L*ib + lb          rw's all-gather (+ L*wb when the batches carry weights)
X(w) = u + 2*a*w: bytes per example that a model-parallel shard of width w moves (the bag
in, pooled sums out, pooled gradients back).

  kind  device          memory bytes          fwd elements     comm bytes (sent + received)
  dp    every device    R*(m(D) + o(D))       b*P*D            2*(N-1)*U*(a*D + ib + vb),  U = b*L
  tw    owner           R*(m(D) + o(D))       B*P*D            (N-1)*b*X(D)
        any other       0                     0                b*X(D)
  cw    owner, chunk i  R*(m(w) + o(w))       B*P*w            (N-1)*b*X(w)
        not owner of i  0                     0                b*X(w)        (summed over chunks)
  rw    shard i         r_i*(m(D) + o(D))     B*P*D*r_i/R      2*(N-1)*b*u_rw + 4*(N-1)/N*B*a*D
  twrw  member j        r_j*(m(D) + o(D))     B*P*D*r_j/R      (N+g-2)*b*X(D)
        non-member      0                     0                g*b*X(D)
  sptt  member j        r_j*(m(D) + o(D))     B*P*D*r_j/R      (T-1)*b*X(D) + 2*(g-1)*(B/g)*u
                                                               + 4*(g-1)/g*B*a*D
        non-member      0                     0                b*X(D)

Backward elements (rows read and written by the sparse update) are
min(ids landing on the shard, rows of the shard) * width; for dp every replica applies the
all-gathered update, min(B*P, R)*D. Per device, summed over tables:

  time = s*(fwd + backward_factor*bwd) / hbm_bandwidth + comm / interconnect_bandwidth

Communication follows the collection's exchanges (`rec.embedding.sharding`): tw / cw / twrw
move bags and pooled partials by all-to-all (every twrw member receives all of the table's
bags and returns a full-width partial, summed at the consumer); rw all-gathers the bags
(ring: N-1 blocks of b bags out and in) and reduce-scatters the [B, D] partial sums
(all-gather of their gradients backward); dp all-gathers each device's id slots with their
valid flags and gradient rows (`CostParams(dp_unique_rows=True)`: U = min(b*L, R), what a
dp exchange that deduplicated rows before its all-gather would send). sptt (DMT's tower
groups): every device sends its samples' bags of the table to its counterpart in the
table's group (all-to-all over the towers), which all-gathers them in the group and
reduce-scatters the [B, D] partial sums there (all-gather of their gradients backward); the
pooled vectors go back by an all-to-all over the towers (per table here; with a tower
module, its K outputs per tower: `CostParams.tower_outputs`, priced by `estimate_plan`).
The all-to-all sends the float32 weights even when a batch has none (the collection makes
ones, and XLA keeps them through the all-to-all), while rw's all-gather of those constant
ones is folded away by XLA: u_rw counts weights only under `CostParams.id_weights`.
Lookups count only the ids that land on a shard, and local traffic is counted where it is
cheap to get right (an owner does not send to itself). Activation buffers are not in the
budget.

The layout (`estimate_plan`): a plan's per-device costs follow the collection's buffers.
Tables that share an exchange (dp; a2a: tw, cw, twrw; rw; sptt), storage, dim and stored
width form one group: one buffer per device, as long on every device as on its fullest one
(a2a: the most rows any device holds; rw: the sum of ceil(R / N); sptt: the largest tower's
sum of ceil(R / g); dp: the sum of R), and an all-to-all that gives every device S slots
(a2a: the most shards any device holds; sptt: Fm, the largest tower's table count). Per
device, summed over groups (F tables of the group; W its stored width):

  memory       block(rows, W) + rows * o(W)   (block: the storage's state of that many rows,
                                               a cache rounded to whole sets)
  collectives  result bytes per device, what `core.hlo.collective_bytes` reads from the
               compiled step (the forward and the backward's transposed collectives):
    dp    all-gather(N)       N*b*F*L*(ib + vb + a*W)     (dp_unique_rows: b*L -> min(b*L, R))
    a2a   all-to-all(N)       N*b*S*(u + 2*a*W)
    rw    all-gather(N)       N*b*F*(u_rw + a*W)          reduce-scatter(N)  b*F*a*W
    sptt  all-to-all(T)       T*b*Fm*u + 2*T*b*K*a*W      (K: tower_outputs, else Fm)
          all-gather(g)       g*T*b*Fm*(u + a*W)          reduce-scatter(g)  T*b*Fm*a*W
  comm         sum of collectives x WIRE_FACTOR (sent + received, own share excluded, ring
               algorithms: all-to-all and all-gather 2(n-1)/n, reduce-scatter 2(n-1))

so the layout's comm equals the per-table sums averaged over the devices when every device
holds the same number of shards, and exceeds it by the padding otherwise. Every term was
checked against the compiled train step (collectives from its HLO, memory from the state's
per-device shards) by experiments/planner_check on 8 simulated devices; none is a fitted
constant. The step's temporaries (XLA's temp buffers: received bags, gathered rows, per-id
gradients) are not in the budget; the study reports them beside it.

Host tier (a `..._cache...@host` storage, rec/embedding/host_tier.py): a table's rows and its
optimizer state are host memory; only the cache, its tags and counters count against the
device. `DeviceCosts.host_bytes` and `LayoutGroup.host_bytes` carry the host part
(`row_bytes_split`, `block_bytes_split`); `memory_bytes` is device memory throughout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from rec.embedding import rowwise_storage, storage_spec
from rec.embedding.config import TableConfig
from rec.embedding.planner.types import (CW, DP, RW, SPTT, TW, TWRW, TablePlacement,
                                         column_chunk_widths, planned_tables, row_shard_sizes,
                                         validate_plan)

STORAGE_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2}

# Sent + received bytes per device of a collective over n devices, per byte of its result
# on one device (ring algorithms; own share excluded): an all-to-all's result is what a
# device receives (its own block included), an all-gather's the gathered array, a
# reduce-scatter's its shard, an all-reduce's the whole array.
WIRE_FACTOR: dict[str, Callable[[int], float]] = {
    "all-to-all": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: 2 * (n - 1) / n,
    "reduce-scatter": lambda n: 2 * (n - 1),
    "all-reduce": lambda n: 4 * (n - 1) / n,
}

# The collection's exchange of each kind (rec/embedding/sharding: the module's Exchange.name).
EXCHANGE = {DP: "dp", TW: "a2a", CW: "a2a", TWRW: "a2a", RW: "rw", SPTT: "sptt"}


def storage_bytes(table: TableConfig) -> float:
  """Bytes per element of the table's rows: STORAGE_BYTES, or for quantized rows with a
  cache (rec/embedding/rowwise_storage.py) their bytes per row (codes, scale, bias, the
  row's share of the cache and counters) over the dim."""
  if table.storage.kind in STORAGE_BYTES:
    return STORAGE_BYTES[table.storage.kind]
  return row_bytes(table, table.dim) / table.dim


def row_bytes(table: TableConfig, width: int) -> float:
  """m(w): bytes of one stored row of `width` columns (a column chunk of a cw table is a row
  of its own: int formats give it its own scale and bias)."""
  if table.storage.kind in STORAGE_BYTES:
    return STORAGE_BYTES[table.storage.kind] * width
  return _storage(table.storage).bytes_per_row(width)


def row_bytes_split(table: TableConfig, width: int) -> tuple[float, float]:
  """(device, host) bytes of one stored row of `width` columns: the host tier keeps the
  row's values in host memory and its share of the cache on the device."""
  spec = table.storage
  if spec.kind in STORAGE_BYTES:
    return STORAGE_BYTES[spec.kind] * width, 0.0
  rows, cache = _storage(spec).row_bytes_split(width)
  return (cache, rows) if spec.host else (rows + cache, 0.0)


@functools.lru_cache(maxsize=None)
def _storage(spec: storage_spec.StorageSpec):
  return storage_spec.make_storage(spec)


@functools.lru_cache(maxsize=1024)
def block_bytes(spec: storage_spec.StorageSpec, rows: int, width: int) -> int:
  """Bytes of one device's block of `rows` stored rows of `width` columns, as the storage
  lays it out (a cache rounded up to whole sets): the shapes of its state, not an average."""
  return sum(block_bytes_split(spec, rows, width))


@functools.lru_cache(maxsize=4096)
def block_bytes_split(spec: storage_spec.StorageSpec, rows: int, width: int) -> tuple[int, int]:
  """`block_bytes` as (device, host) bytes: the host tier's arrays in host memory."""
  if spec.kind in STORAGE_BYTES:
    return STORAGE_BYTES[spec.kind] * rows * width, 0
  per = _block_bytes_per(spec, width)
  if per is None:
    return _shape_bytes(spec, rows, width)
  (rd, rh), (sd, sh) = per
  slots = _cache_slots(spec, rows)
  return rd * rows + sd * slots, rh * rows + sh * slots


def _cache_slots(spec: storage_spec.StorageSpec, rows: int) -> int:
  st = _storage(spec)
  s, a = rowwise_storage.cache_geometry(rows, getattr(st, "fraction", 0.0),
                                        getattr(st, "ways", 1))
  return s * a


def _shape_bytes(spec: storage_spec.StorageSpec, rows: int, width: int) -> tuple[int, int]:
  """(device, host) bytes of the state `from_float` makes of rows x width (traced only)."""
  import jax
  import jax.numpy as jnp
  st = _storage(spec)
  shapes = jax.eval_shape(lambda: st.from_float(jnp.zeros((rows, width), jnp.float32), 1))
  out = [0, 0]
  for k, x in shapes.items():
    out[k in st.host_keys] += math.prod(x.shape) * np.dtype(x.dtype).itemsize
  return out[0], out[1]


@functools.lru_cache(maxsize=None)
def _block_bytes_per(spec: storage_spec.StorageSpec, width: int):
  """((device, host) bytes per row, (device, host) bytes per cache slot) of the storage's
  state at this width, read from its shapes at two block sizes; None when they are not of
  that form (then every size is traced). Tracing the storage for every candidate buffer
  would make the planner's search take seconds."""
  st = _storage(spec)
  import jax
  import jax.numpy as jnp
  per = {}
  for n in (1000, 1700):
    shapes = jax.eval_shape(lambda n=n: st.from_float(jnp.zeros((n, width), jnp.float32), 1))
    per[n] = {k: (x.shape, np.dtype(x.dtype).itemsize) for k, x in shapes.items()}
  out = [[0, 0], [0, 0]]
  for k, (shape, size) in per[1000].items():
    shape2 = per[1700][k][0]
    if shape[1:] != shape2[1:] or not shape:
      return None
    lead = [(n, _cache_slots(spec, n)) for n in (1000, 1700)]
    kind = [j for j in (0, 1) if (shape[0], shape2[0]) == (lead[0][j], lead[1][j])]
    if len(kind) != 1:
      return None
    out[kind[0]][k in st.host_keys] += math.prod(shape[1:]) * size
  return (out[0][0], out[0][1]), (out[1][0], out[1][1])


OptStateBytes = Callable[[int], int] | int   # bytes per row of a shard of width w, or fixed


@dataclasses.dataclass(frozen=True)
class CostParams:
  """Constants of the cost model (defaults: a generic accelerator) and what the batches and
  the model send besides (defaults: what the collection and XLA do, module docstring)."""

  hbm_bandwidth: float = 1.0e12          # bytes/s of embedding-row gathers and updates
  interconnect_bandwidth: float = 1.0e11  # bytes/s per device, sent + received together
  id_bytes: int = 4                       # int32 ids
  activation_bytes: int = 4               # fp32 pooled sums and their gradients
  backward_factor: float = 2.0            # sparse update reads and writes each touched row
  # dp all-gathers deduplicated rows (True) or every id slot (False: what dp.py does).
  dp_unique_rows: bool = False
  # Memory moves whole transactions: a row access costs at least this many bytes, so
  # narrow column chunks are not free (a 16-byte chunk costs what a 64-byte row does).
  min_access_bytes: int = 64
  weight_bytes: int = 4                   # float32 per-id weight sent with the ids
  length_bytes: int = 4                   # int32 bag length sent with the ids
  valid_bytes: int = 1                    # dp's all-gathered valid flag per id slot (pred)
  id_weights: bool = False                # batches carry per-id weights (e.g. libFM values)
  ids_per_bag: int | None = None          # L, the batch's padded bag; None: ceil(P)
  tower_outputs: int | None = None        # sptt: vectors a tower module returns (DMT: K + 1)

  def __post_init__(self):
    for f in ("hbm_bandwidth", "interconnect_bandwidth"):
      if not getattr(self, f) > 0:
        raise ValueError(f"CostParams.{f}={getattr(self, f)}, expected > 0")
    for f in ("ids_per_bag", "tower_outputs"):
      v = getattr(self, f)
      if v is not None and v < 1:
        raise ValueError(f"CostParams.{f}={v}, expected None or >= 1")

  def slots(self, table: TableConfig) -> int:
    """L: id slots per bag that the exchanges send for `table`."""
    return self.ids_per_bag or max(1, math.ceil(table.pooling_factor - 1e-9))

  def bag_bytes(self, slots: int, weights: bool = True) -> float:
    """u (weights=True, the all-to-all's bag) or u_rw (weights=id_weights: rw's)."""
    return slots * (self.id_bytes + (self.weight_bytes if weights else 0)) + self.length_bytes


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
  """Per-device estimates, each an array of length N (one table, or a sum over tables)."""

  memory_bytes: np.ndarray   # int64, device memory
  lookup_elems: np.ndarray   # float64: forward gathered + backward updated elements
  comm_bytes: np.ndarray     # float64: bytes sent + received
  time_s: np.ndarray         # float64
  host_bytes: np.ndarray | None = None   # int64, host memory (the host tier); None: zeros

  def __post_init__(self):
    if self.host_bytes is None:
      object.__setattr__(self, "host_bytes", np.zeros(len(self.memory_bytes), np.int64))

  @staticmethod
  def zeros(num_devices: int) -> DeviceCosts:
    z = np.zeros(num_devices)
    return DeviceCosts(np.zeros(num_devices, np.int64), z, z.copy(), z.copy())

  def __add__(self, other: DeviceCosts) -> DeviceCosts:
    return DeviceCosts(self.memory_bytes + other.memory_bytes,
                       self.lookup_elems + other.lookup_elems,
                       self.comm_bytes + other.comm_bytes, self.time_s + other.time_s,
                       self.host_bytes + other.host_bytes)


@dataclasses.dataclass(frozen=True)
class LayoutGroup:
  """One buffer of the collection as the cost model sees it (module docstring, layout)."""

  exchange: str                     # "dp" | "a2a" | "rw" | "sptt"
  storage: str
  dim: int
  width: int
  tables: tuple[str, ...]
  rows_per_device: int              # every device's block (dp: the whole buffer)
  slots: int                        # a2a: S; sptt: Fm; dp / rw: the group's tables
  memory_bytes: int                 # per device: storage block + optimizer state
  collectives: dict[tuple[str, int], float]   # (collective, devices) -> result bytes/device
  host_bytes: int = 0               # per device, in host memory (the host tier)


@dataclasses.dataclass(frozen=True)
class PlanEstimate:
  """A plan's costs: per table (its own share on each device, as the greedy planner adds
  them up) and per device (the collection's layout: group buffers and exchanges padded to
  the fullest device, `layout`, `collectives`)."""

  per_table: dict[str, DeviceCosts]
  per_device: DeviceCosts
  layout: tuple[LayoutGroup, ...] = ()
  # (collective, devices in its groups) -> result bytes per device, summed over groups:
  # what core.hlo.collective_bytes reads from the compiled train step.
  collectives: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)

  @property
  def max_time_s(self) -> float:
    return float(self.per_device.time_s.max())

  @property
  def max_memory_bytes(self) -> int:
    return int(self.per_device.memory_bytes.max())

  @property
  def max_host_bytes(self) -> int:
    return int(self.per_device.host_bytes.max())


def _opt_fn(optimizer_state_bytes_per_row: OptStateBytes) -> Callable[[int], int]:
  if callable(optimizer_state_bytes_per_row):
    return optimizer_state_bytes_per_row
  v = int(optimizer_state_bytes_per_row)
  if v < 0:
    raise ValueError(f"optimizer_state_bytes_per_row={v}, expected >= 0")
  return lambda width: v


def table_bytes(table: TableConfig, optimizer_state_bytes_per_row: OptStateBytes = 4) -> int:
  """Bytes of the whole table with its optimizer state: R * (m(D) + o(D)), host and device."""
  o = _opt_fn(optimizer_state_bytes_per_row)
  return int(table.num_rows * (row_bytes(table, table.dim) + int(o(table.dim))))


def wire_bytes(collectives: Mapping[tuple[str, int], float]) -> float:
  """Sent + received bytes per device of collectives given as (kind, devices) -> result
  bytes per device (WIRE_FACTOR)."""
  return float(sum(WIRE_FACTOR[k](n) * v for (k, n), v in collectives.items()))


def placement_cost(table: TableConfig, placement: TablePlacement, num_devices: int,
                   batch_size: int, cost_params: CostParams | None = None,
                   optimizer_state_bytes_per_row: OptStateBytes = 4) -> DeviceCosts:
  """Per-device memory, lookup elements, communication and time of one placed table.

  The formulas are in the module docstring; `batch_size` is the global batch B.
  """
  cp = cost_params or CostParams()
  o = _opt_fn(optimizer_state_bytes_per_row)
  if placement.storage is not None and placement.storage != table.storage:
    table = dataclasses.replace(table, storage=placement.storage)
  N, B = num_devices, batch_size
  b = B / N
  R, D, P = table.num_rows, table.dim, table.pooling_factor
  s, ib, a = storage_bytes(table), cp.id_bytes, cp.activation_bytes
  L = cp.slots(table)
  u, u_rw = cp.bag_bytes(L), cp.bag_bytes(L, cp.id_weights)
  X = lambda w: u + 2 * a * w
  host = table.storage.host    # the host tier: rows and optimizer state in host memory
  m = lambda w: row_bytes_split(table, w)[0] + (0 if host else int(o(w)))
  mh = lambda w: row_bytes_split(table, w)[1] + (int(o(w)) if host else 0)
  # Elements a row access of width w costs, rounded up to the memory transaction size.
  E = lambda w: max(w, cp.min_access_bytes / s)
  devs = placement.devices
  if any(not 0 <= d < N for d in devs):
    raise ValueError(f"table {table.name!r}: devices {devs} outside 0..{N - 1}")
  mem, hmem = np.zeros(N, np.int64), np.zeros(N, np.int64)
  fwd, bwd, comm = np.zeros(N), np.zeros(N), np.zeros(N)
  kind = placement.kind
  if kind == DP:
    U = min(b * L, R) if cp.dp_unique_rows else b * L
    mem[:] = int(R * m(D))
    hmem[:] = int(R * mh(D))
    fwd[:] = b * P * E(D)
    bwd[:] = min(B * P, R) * E(D)
    comm[:] = 2 * (N - 1) * U * (a * D + ib + cp.valid_bytes)
  elif kind in (TW, CW):
    # Every cw chunk is stored, gathered and sent ceil(D / k) wide, the last one too
    # (cw.py pads it), so its device pays that width.
    widths = (D,) if kind == TW else (_width(table, placement),) * len(
        column_chunk_widths(D, len(devs)))
    if kind == TW and len(devs) != 1:
      raise ValueError(f"table {table.name!r}: tw placement needs 1 device, got {devs}")
    for d, w in zip(devs, widths):
      mem[d] += int(R * m(w))
      hmem[d] += int(R * mh(w))
      fwd[d] += B * P * E(w)
      bwd[d] += min(B * P, R) * E(w)
      comm += b * X(w)                      # every other device: send bags, get sums back
      comm[d] += (N - 1) * b * X(w) - b * X(w)
  elif kind in (RW, TWRW, SPTT):
    g = len(devs)
    if kind == RW and sorted(devs) != list(range(N)):
      raise ValueError(f"table {table.name!r}: rw placement needs all {N} devices, got {devs}")
    if kind in (TWRW, SPTT):
      # non-members: bags to the group (twrw: to each of its g members, sptt: to the one
      # counterpart) and the pooled sums back
      comm += (g if kind == TWRW else 1) * b * X(D)
    for d, r in zip(devs, row_shard_sizes(R, g)):
      mem[d] += int(r * m(D))
      hmem[d] += int(r * mh(D))
      fwd[d] += B * P * E(D) * r / R
      bwd[d] += min(B * P * r / R, r) * E(D)
      if kind == RW:
        comm[d] = 2 * (N - 1) * b * u_rw + 4 * (N - 1) / N * B * a * D
      elif kind == TWRW:
        comm[d] = (N + g - 2) * b * X(D)
      else:
        comm[d] = ((N // g - 1) * b * X(D) + 2 * (g - 1) * (B / g) * u
                   + 4 * (g - 1) / g * B * a * D)
  else:
    raise ValueError(f"table {table.name!r}: unknown sharding kind {kind!r}")
  time = s * (fwd + cp.backward_factor * bwd) / cp.hbm_bandwidth
  time = time + comm / cp.interconnect_bandwidth
  return DeviceCosts(mem, fwd + bwd, comm, time, hmem)


def _width(table: TableConfig, placement: TablePlacement) -> int:
  return -(-table.dim // len(placement.devices)) if placement.kind == CW else table.dim


def layout(plan: Mapping[str, TablePlacement], tables: Sequence[TableConfig], num_devices: int,
           batch_size: int, cost_params: CostParams | None = None,
           optimizer_state_bytes_per_row: OptStateBytes = 4) -> tuple[LayoutGroup, ...]:
  """The collection's groups of `plan` (rec/embedding/collection.py `_build_groups`): each
  group's per-device buffer and the collectives of its exchange (module docstring)."""
  cp = cost_params or CostParams()
  o = _opt_fn(optimizer_state_bytes_per_row)
  tables = planned_tables(plan, tables)
  N, B = num_devices, batch_size
  b, ib, a = B / N, cp.id_bytes, cp.activation_bytes
  # One padded bag for the whole batch: ids [B, F, L].
  L = max(cp.slots(t) for t in tables)
  u, u_rw = cp.bag_bytes(L), cp.bag_bytes(L, cp.id_weights)
  members: dict[tuple, list[TableConfig]] = {}
  for t in tables:
    p = plan[t.name]
    key = (EXCHANGE[p.kind], t.storage, t.dim, _width(t, p))
    members.setdefault(key, []).append(t)
  out = []
  for (ex, spec, dim, W), ts in members.items():
    F = len(ts)
    col: dict[tuple[str, int], float] = {}
    if ex == "dp":
      rows, slots = sum(t.num_rows for t in ts), F
      U = sum(min(b * L, t.num_rows) if cp.dp_unique_rows else b * L for t in ts)
      if N > 1:
        col[("all-gather", N)] = N * U * (ib + cp.valid_bytes + a * W)
    elif ex == "rw":
      rows, slots = sum(-(-t.num_rows // N) for t in ts), F
      if N > 1:
        col[("all-gather", N)] = N * b * F * (u_rw + a * W)
        col[("reduce-scatter", N)] = b * F * a * W
    elif ex == "a2a":
      rows_d, shards_d = np.zeros(N, np.int64), np.zeros(N, np.int64)
      for t in ts:
        p = plan[t.name]
        if p.kind == TWRW:
          for d, r in zip(p.devices, row_shard_sizes(t.num_rows, len(p.devices))):
            rows_d[d] += r
            shards_d[d] += 1
        else:   # tw, and cw: every chunk holds every row
          for d in p.devices:
            rows_d[d] += t.num_rows
            shards_d[d] += 1
      rows, slots = max(1, int(rows_d.max())), max(1, int(shards_d.max()))
      if N > 1:
        col[("all-to-all", N)] = N * b * slots * (u + 2 * a * W)
    else:   # sptt: towers on contiguous groups of g devices
      g = len(plan[ts[0].name].devices)
      T = N // g
      towers: dict[int, list[TableConfig]] = {}
      for t in ts:
        towers.setdefault(plan[t.name].devices[0] // g, []).append(t)
      rows = max(1, max(sum(-(-t.num_rows // g) for t in tt) for tt in towers.values()))
      slots = max(len(tt) for tt in towers.values())
      K = cp.tower_outputs or slots
      if T > 1:
        col[("all-to-all", T)] = T * b * slots * u + 2 * T * b * K * a * W
      if g > 1:
        col[("all-gather", g)] = g * T * b * slots * (u + a * W)
        col[("reduce-scatter", g)] = T * b * slots * a * W
    dev, host = block_bytes_split(spec, rows, W)
    opt = rows * int(o(W))      # with the rows: in host memory under the host tier
    mem, host = (dev, host + opt) if spec.host else (dev + opt, host)
    out.append(LayoutGroup(ex, str(spec), dim, W, tuple(t.name for t in ts), int(rows),
                           int(slots), int(mem), col, int(host)))
  return tuple(out)


def estimate_plan(plan: Mapping[str, TablePlacement], tables: Sequence[TableConfig],
                  num_devices: int, batch_size: int, cost_params: CostParams | None = None,
                  optimizer_state_bytes_per_row: OptStateBytes = 4) -> PlanEstimate:
  """Costs of every table of `plan` (its own share) and per device: memory and
  communication of the collection's layout (`layout`), lookups summed over tables."""
  validate_plan(plan, tables, num_devices)
  cp = cost_params or CostParams()
  tables = planned_tables(plan, tables)
  per_table = {t.name: placement_cost(t, plan[t.name], num_devices, batch_size, cp,
                                      optimizer_state_bytes_per_row) for t in tables}
  total = DeviceCosts.zeros(num_devices)
  for c in per_table.values():
    total = total + c
  groups = layout(plan, tables, num_devices, batch_size, cp, optimizer_state_bytes_per_row)
  collectives: dict[tuple[str, int], float] = {}
  for grp in groups:
    for k, v in grp.collectives.items():
      collectives[k] = collectives.get(k, 0.0) + v
  comm = np.full(num_devices, wire_bytes(collectives))
  mem = np.full(num_devices, sum(grp.memory_bytes for grp in groups), np.int64)
  host = np.full(num_devices, sum(grp.host_bytes for grp in groups), np.int64)
  time = (total.time_s - total.comm_bytes / cp.interconnect_bandwidth
          + comm / cp.interconnect_bandwidth)
  per_device = DeviceCosts(mem, total.lookup_elems, comm, time, host)
  return PlanEstimate(per_table, per_device, groups, collectives)
