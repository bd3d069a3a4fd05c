"""Embedding sharding planner: a sharding kind and devices per table, from a cost model.

Like TorchRec's EmbeddingShardingPlanner and Neo (arXiv 2104.05158): each table gets one of
dp / tw / cw / rw / twrw (`rec.embedding.config.ShardingKind`) and a set of devices, chosen
so that every device fits its memory budget and the slowest device's estimated time per
step is small. Pure Python and numpy: it runs before any mesh exists.

Cost model, per table and per training step. Symbols: N embedding devices, B global batch
(b = B / N examples per device), P pooling factor (mean ids per bag), R rows, D dim,
w width of a column chunk, g devices in a twrw group, r_i rows of row shard i (shards of
ceil(R / n) rows, the last shorter), s storage bytes per element (fp32 4, bf16 2),
o(w) optimizer state bytes per row of a shard of width w, ib bytes per id (4),
a bytes per pooled activation / gradient element (4), and
X(w) = ib*P + 2*a*w: bytes per example that a model-parallel shard of width w moves
(ids in, pooled sums out, pooled gradients back).

  kind  device          memory bytes        fwd elements     comm bytes (sent + received)
  dp    every device    R*(D*s + o(D))      b*P*D            2*(N-1)*U*(a*D + ib),  U = min(b*P, R)
  tw    owner           R*(D*s + o(D))      B*P*D            (N-1)*b*X(D)
        any other       0                   0                b*X(D)
  cw    owner, chunk i  R*(w_i*s + o(w_i))  B*P*w_i          (N-1)*b*X(w_i)
        not owner of i  0                   0                b*X(w_i)      (summed over chunks)
  rw    shard i         r_i*(D*s + o(D))    B*P*D*r_i/R      2*(N-1)*b*ib*P + 4*(N-1)/N*B*a*D
  twrw  member j        r_j*(D*s + o(D))    B*P*D*r_j/R      (N+g-2)*b*X(D)
        non-member      0                   0                g*b*X(D)
  sptt  member j        r_j*(D*s + o(D))    B*P*D*r_j/R      b*ib*P + (T-1)*b*ib*P
                                                             + 2*(g-1)*(B/g)*ib*P + 4*(g-1)/g*B*a*D
        non-member      0                   0                b*ib*P

Backward elements (rows read and written by the sparse update) are
min(ids landing on the shard, rows of the shard) * width; for dp every replica applies the
all-gathered update, min(B*P, R)*D. Per device, summed over tables:

  time = s*(fwd + backward_factor*bwd) / hbm_bandwidth + comm / interconnect_bandwidth

Communication follows `rec.embedding.collection`: tw / cw / twrw move ids and pooled
partials by all-to-all (every twrw member receives all of the table's ids and returns a
full-width partial, summed at the consumer); rw all-gathers ids (ring: N-1 blocks of b*P ids
out and in) and reduce-scatters the [B, D] partial sums (all-gather of their gradients
backward); dp all-gathers each device's touched rows with their ids. U = min(b*P, R)
assumes ids are deduplicated per device before that all-gather; the collection currently
sends every id slot, which `CostParams(dp_unique_rows=False)` models (U = b*P). sptt (DMT's
tower groups, T = N / g of them): every device sends its samples' ids of the table to its
counterpart in the table's group (all-to-all over the towers), which all-gathers them in
the group and reduce-scatters the [B / g, D] partial sums there (all-gather of their
gradients backward); the tower module's compressed output goes back by one all-to-all per
tower, not per table, and is left out here (experiments/dmt counts it). Lookups
count only the ids that land on a shard, and local traffic is counted where it is cheap to
get right (an owner does not send to itself). Activation buffers are not in the budget.

Planner (`plan`): tables are placed one at a time, overridden ones first, then by size
(full-table bytes, descending). For a table every allowed kind and placement is tried
(dp; tw on each device; cw with k = 2, 4, 8, ... chunks on the k least-loaded devices that
have room; twrw on each group; rw) and the one that fits memory with the smallest
  score = max_d time_d + mean_d time_d
is kept: the max balances, the mean charges total work so that a placement that leaves the
max unchanged but spends bandwidth on every device still loses. Ties (relative 1e-9) go
to the smaller sum of squared device times (the least-loaded devices), then to the kind
order dp, tw, cw, twrw, rw, then to the lowest device indices. Tiny tables end up dp
because exchanging their few touched rows is cheaper than any all-to-all. When nothing
fits, the planner retries with the biggest 1, 2, 4, ... tables (then all) taking their
least-memory placement first (time breaks ties); if even that fails, `PlanError` names the
table and the bytes by which its tightest option is over budget.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from rec.embedding import storage_spec
from rec.embedding.config import ShardingKind, TableConfig

DP = ShardingKind.DATA_PARALLEL
TW = ShardingKind.TABLE_WISE
RW = ShardingKind.ROW_WISE
CW = ShardingKind.COLUMN_WISE
TWRW = ShardingKind.TABLE_ROW_WISE

SPTT = ShardingKind.SPTT

KIND_ORDER: tuple[ShardingKind, ...] = (DP, TW, CW, TWRW, RW, SPTT)   # tie-break preference
# What `plan` chooses from: sptt only comes with a tower model (`tower_plan` places it).
AUTO_KINDS: tuple[ShardingKind, ...] = (DP, TW, CW, TWRW, RW)
STORAGE_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2}


def storage_bytes(table: TableConfig) -> float:
  """Bytes per element of the table's rows: STORAGE_BYTES, or for quantized rows with a
  cache (rec/embedding/rowwise_storage.py) their bytes per row (codes, scale, bias, the
  row's share of the cache and counters) over the dim."""
  if table.storage.kind in STORAGE_BYTES:
    return STORAGE_BYTES[table.storage.kind]
  return storage_spec.make_storage(table.storage).bytes_per_row(table.dim) / table.dim
CW_MIN_WIDTH = 4     # narrowest column chunk the planner makes (16-byte fp32 rows)
_REL_TOL = 1e-9

OptStateBytes = Callable[[int], int] | int


class PlanError(ValueError):
  """No placement of some table fits the per-device memory budget."""


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """One table's sharding kind and the embedding devices (0..N-1) holding its shards.

  dp: all N devices; tw: one device; rw: all N devices (row shard i on devices[i]);
  cw: one device per column chunk (chunk i on devices[i]; chunks are ceil(dim / k) wide
  for k = len(devices), the last may be narrower); twrw: a contiguous block of
  `group_size` devices holding row shards of the table (shard i on devices[i]).
  """

  kind: ShardingKind
  devices: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "kind", as_kind(self.kind))
    object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
    if not self.devices:
      raise ValueError(f"TablePlacement({self.kind.value}): devices is empty")
    if len(set(self.devices)) != len(self.devices):
      raise ValueError(f"TablePlacement({self.kind.value}): repeated device in {self.devices}")


Plan = dict[str, TablePlacement]   # keyed by table name, in table order


@dataclasses.dataclass(frozen=True)
class CostParams:
  """Throughput constants of the cost model (defaults: a generic accelerator)."""

  hbm_bandwidth: float = 1.0e12          # bytes/s of embedding-row gathers and updates
  interconnect_bandwidth: float = 1.0e11  # bytes/s per device, sent + received together
  id_bytes: int = 4                       # int32 ids
  activation_bytes: int = 4               # fp32 pooled sums and their gradients
  backward_factor: float = 2.0            # sparse update reads and writes each touched row
  dp_unique_rows: bool = True             # dp all-gathers deduplicated rows (False: all ids)
  # Memory moves whole transactions: a row access costs at least this many bytes, so
  # narrow column chunks are not free (a 16-byte chunk costs what a 64-byte row does).
  min_access_bytes: int = 64

  def __post_init__(self):
    for f in ("hbm_bandwidth", "interconnect_bandwidth"):
      if not getattr(self, f) > 0:
        raise ValueError(f"CostParams.{f}={getattr(self, f)}, expected > 0")


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
  """Per-device estimates, each an array of length N (one table, or a sum over tables)."""

  memory_bytes: np.ndarray   # int64
  lookup_elems: np.ndarray   # float64: forward gathered + backward updated elements
  comm_bytes: np.ndarray     # float64: bytes sent + received
  time_s: np.ndarray         # float64

  @staticmethod
  def zeros(num_devices: int) -> DeviceCosts:
    z = np.zeros(num_devices)
    return DeviceCosts(np.zeros(num_devices, np.int64), z, z.copy(), z.copy())

  def __add__(self, other: DeviceCosts) -> DeviceCosts:
    return DeviceCosts(self.memory_bytes + other.memory_bytes,
                       self.lookup_elems + other.lookup_elems,
                       self.comm_bytes + other.comm_bytes, self.time_s + other.time_s)


@dataclasses.dataclass(frozen=True)
class PlanEstimate:
  """A plan's costs: per table (its share on each device) and per device (summed)."""

  per_table: dict[str, DeviceCosts]
  per_device: DeviceCosts

  @property
  def max_time_s(self) -> float:
    return float(self.per_device.time_s.max())

  @property
  def max_memory_bytes(self) -> int:
    return int(self.per_device.memory_bytes.max())


# ----------------------------------------------------------------------------- helpers


def as_kind(value: ShardingKind | str, where: str = "") -> ShardingKind:
  """ShardingKind from an enum or its string value ("dp", "tw", "rw", "cw", "twrw")."""
  if isinstance(value, ShardingKind):
    return value
  try:
    return ShardingKind(str(value).strip().lower())
  except ValueError:
    at = f" for {where}" if where else ""
    raise ValueError(f"unknown sharding kind {value!r}{at}; valid kinds: "
                     f"{', '.join(k.value for k in ShardingKind)}") from None


def row_shard_sizes(num_rows: int, num_shards: int) -> tuple[int, ...]:
  """Rows per shard: ceil(num_rows / num_shards) each, the last shorter (possibly 0)."""
  s = -(-num_rows // num_shards)
  return tuple(max(0, min(s, num_rows - i * s)) for i in range(num_shards))


def column_chunk_widths(dim: int, num_chunks: int) -> tuple[int, ...]:
  """Widths of `num_chunks` column chunks of ceil(dim / num_chunks), the last narrower.

  Raises when those chunks cover `dim` with fewer than `num_chunks` (e.g. dim 9 in 4
  chunks of 3), since a cw placement has exactly one device per chunk.
  """
  if not 1 <= num_chunks <= dim:
    raise ValueError(f"column chunks: {num_chunks} chunks of dim {dim}, expected 1..{dim}")
  w = -(-dim // num_chunks)
  widths = tuple(min(w, dim - i * w) for i in range(num_chunks))
  if widths[-1] <= 0:
    raise ValueError(f"column chunks: dim {dim} in chunks of ceil({dim}/{num_chunks}) = {w} "
                     f"gives {-(-dim // w)} chunks, not {num_chunks}")
  return widths


def _valid_chunk_count(dim: int, k: int) -> bool:
  return 1 <= k <= dim and -(-dim // -(-dim // k)) == k


def default_group_size(num_devices: int) -> int:
  """twrw group size when none is given: the largest divisor of N that is at most 4."""
  return max(g for g in range(1, min(4, num_devices) + 1) if num_devices % g == 0)


def _check_group_size(group_size: int | None, num_devices: int) -> int:
  g = default_group_size(num_devices) if group_size is None else int(group_size)
  if not 1 <= g <= num_devices or num_devices % g:
    raise ValueError(f"twrw group_size={group_size}: expected a divisor of num_devices="
                     f"{num_devices}")
  return g


def _opt_fn(optimizer_state_bytes_per_row: OptStateBytes) -> Callable[[int], int]:
  if callable(optimizer_state_bytes_per_row):
    return optimizer_state_bytes_per_row
  v = int(optimizer_state_bytes_per_row)
  if v < 0:
    raise ValueError(f"optimizer_state_bytes_per_row={v}, expected >= 0")
  return lambda width: v


def table_bytes(table: TableConfig, optimizer_state_bytes_per_row: OptStateBytes = 4) -> int:
  """Bytes of the whole table with its optimizer state: R * (D*s + o(D))."""
  o = _opt_fn(optimizer_state_bytes_per_row)
  return int(table.num_rows * (table.dim * storage_bytes(table) + int(o(table.dim))))


def _check_tables(tables: Sequence[TableConfig]) -> None:
  if not tables:
    raise ValueError("planner: no tables given")
  names = [t.name for t in tables]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f"planner: duplicate table names {dup}")


def _check_positive(**kw) -> None:
  for k, v in kw.items():
    if v is None or v < 1:
      raise ValueError(f"planner: {k}={v}, expected >= 1")


# ----------------------------------------------------------------------------- cost model


def placement_cost(table: TableConfig, placement: TablePlacement, num_devices: int,
                   batch_size: int, cost_params: CostParams | None = None,
                   optimizer_state_bytes_per_row: OptStateBytes = 4) -> DeviceCosts:
  """Per-device memory, lookup elements, communication and time of one placed table.

  The formulas are in the module docstring; `batch_size` is the global batch B.
  """
  cp = cost_params or CostParams()
  o = _opt_fn(optimizer_state_bytes_per_row)
  N, B = num_devices, batch_size
  b = B / N
  R, D, P = table.num_rows, table.dim, table.pooling_factor
  s, ib, a = storage_bytes(table), cp.id_bytes, cp.activation_bytes
  X = lambda w: ib * P + 2 * a * w
  # Elements a row access of width w costs, rounded up to the memory transaction size.
  E = lambda w: max(w, cp.min_access_bytes / s)
  devs = placement.devices
  if any(not 0 <= d < N for d in devs):
    raise ValueError(f"table {table.name!r}: devices {devs} outside 0..{N - 1}")
  mem = np.zeros(N, np.int64)
  fwd, bwd, comm = np.zeros(N), np.zeros(N), np.zeros(N)
  kind = placement.kind
  if kind == DP:
    U = min(b * P, R) if cp.dp_unique_rows else b * P
    mem[:] = int(R * (D * s + int(o(D))))
    fwd[:] = b * P * E(D)
    bwd[:] = min(B * P, R) * E(D)
    comm[:] = 2 * (N - 1) * U * (a * D + ib)
  elif kind in (TW, CW):
    widths = (D,) if kind == TW else column_chunk_widths(D, len(devs))
    if kind == TW and len(devs) != 1:
      raise ValueError(f"table {table.name!r}: tw placement needs 1 device, got {devs}")
    for d, w in zip(devs, widths):
      mem[d] += int(R * (w * s + int(o(w))))
      fwd[d] += B * P * E(w)
      bwd[d] += min(B * P, R) * E(w)
      comm += b * X(w)                      # every other device: send ids, get sums back
      comm[d] += (N - 1) * b * X(w) - b * X(w)
  elif kind in (RW, TWRW, SPTT):
    g = len(devs)
    if kind == RW and sorted(devs) != list(range(N)):
      raise ValueError(f"table {table.name!r}: rw placement needs all {N} devices, got {devs}")
    if kind == TWRW:
      comm += g * b * X(D)                  # non-members: ids to and sums from g members
    if kind == SPTT:
      comm += b * ib * P                    # every device: its ids to its group counterpart
    for d, r in zip(devs, row_shard_sizes(R, g)):
      mem[d] += int(r * (D * s + int(o(D))))
      fwd[d] += B * P * E(D) * r / R
      bwd[d] += min(B * P * r / R, r) * E(D)
      if kind == RW:
        comm[d] = 2 * (N - 1) * b * ib * P + 4 * (N - 1) / N * B * a * D
      elif kind == TWRW:
        comm[d] = (N + g - 2) * b * X(D)
      else:
        comm[d] += ((N // g - 1) * b * ib * P + 2 * (g - 1) * (B / g) * ib * P
                    + 4 * (g - 1) / g * B * a * D)
  else:
    raise ValueError(f"table {table.name!r}: unknown sharding kind {kind!r}")
  time = s * (fwd + cp.backward_factor * bwd) / cp.hbm_bandwidth
  time = time + comm / cp.interconnect_bandwidth
  return DeviceCosts(mem, fwd + bwd, comm, time)


def estimate_plan(plan: Mapping[str, TablePlacement], tables: Sequence[TableConfig],
                  num_devices: int, batch_size: int, cost_params: CostParams | None = None,
                  optimizer_state_bytes_per_row: OptStateBytes = 4) -> PlanEstimate:
  """Costs of every table of `plan` and their per-device sums."""
  validate_plan(plan, tables, num_devices)
  per_table = {t.name: placement_cost(t, plan[t.name], num_devices, batch_size, cost_params,
                                      optimizer_state_bytes_per_row) for t in tables}
  total = DeviceCosts.zeros(num_devices)
  for c in per_table.values():
    total = total + c
  return PlanEstimate(per_table, total)


def validate_plan(plan: Mapping[str, TablePlacement], tables: Sequence[TableConfig],
                  num_devices: int, group_size: int | None = None) -> None:
  """Raises ValueError unless `plan` places exactly `tables`, each as its kind requires."""
  names = [t.name for t in tables]
  missing = [n for n in names if n not in plan]
  extra = [n for n in plan if n not in set(names)]
  if missing or extra:
    raise ValueError(f"plan: tables without a placement {missing}, placements for unknown "
                     f"tables {extra}; known tables: {names}")
  N = num_devices
  for t in tables:
    p = plan[t.name]
    devs = p.devices
    bad = ""
    if any(not 0 <= d < N for d in devs):
      bad = f"devices outside 0..{N - 1}"
    elif p.kind in (DP, RW) and sorted(devs) != list(range(N)):
      bad = f"{p.kind.value} needs all {N} devices"
    elif p.kind == TW and len(devs) != 1:
      bad = "tw needs exactly 1 device"
    elif p.kind == CW and not _valid_chunk_count(t.dim, len(devs)):
      bad = f"dim {t.dim} does not split into {len(devs)} chunks of ceil({t.dim}/{len(devs)})"
    elif p.kind in (TWRW, SPTT):
      g = len(devs)
      k = p.kind.value
      groups = {len(q.devices) for q in plan.values() if q.kind == SPTT}
      if N % g or devs[0] % g or devs != tuple(range(devs[0], devs[0] + g)):
        bad = f"{k} needs a contiguous, aligned block of a group size dividing {N}"
      elif group_size is not None and g != group_size:
        bad = f"{k} group of {g} devices, expected group_size={group_size}"
      elif p.kind == SPTT and len(groups) > 1:
        bad = f"sptt tower groups of sizes {sorted(groups)}; every tower group has the same size"
    if bad:
      raise ValueError(f"plan: table {t.name!r} placed {p.kind.value} on {devs}: {bad}")


# ----------------------------------------------------------------------------- greedy


@dataclasses.dataclass(frozen=True)
class _Candidate:
  kind: ShardingKind
  devices: tuple[int, ...]
  cost: DeviceCosts
  mem_after: np.ndarray
  time_after: np.ndarray


def _pick_min(items: list, key: Callable[[Any], float]) -> list:
  """Items whose key is within a relative 1e-9 of the smallest key."""
  vals = [key(x) for x in items]
  lo = min(vals)
  tol = _REL_TOL * max(abs(lo), 1e-300)
  return [x for x, v in zip(items, vals) if v <= lo + tol]


def _device_order(time: np.ndarray) -> list[int]:
  """Devices by load, ties (relative 1e-9) to the lowest index."""
  scale = max(float(time.max()), 1e-300)
  q = np.round(time / scale / _REL_TOL)
  return sorted(range(len(time)), key=lambda d: (q[d], d))


def _cw_counts(dim: int, num_devices: int, cw_min_width: int, search: bool) -> tuple[int, ...]:
  kmax = max(1, min(num_devices, dim // max(1, cw_min_width)))
  while not _valid_chunk_count(dim, kmax):
    kmax -= 1
  if not search:
    return (kmax,)
  ks = {k for k in (2 ** i for i in range(1, 31)) if k < kmax and _valid_chunk_count(dim, k)}
  return tuple(sorted(ks | {kmax}))


class _Greedy:
  """Places tables one at a time on the cheapest placement that fits (module docstring)."""

  def __init__(self, num_devices, batch_size, budget, group_size, cost_params, opt,
               cw_min_width):
    self.N, self.B, self.budget = num_devices, batch_size, budget
    self.g = group_size
    self.cp, self.opt, self.cw_min_width = cost_params, opt, cw_min_width
    self.mem = np.zeros(num_devices, np.int64)
    self.time = np.zeros(num_devices)

  def _make(self, table, kind, devices) -> _Candidate:
    c = placement_cost(table, TablePlacement(kind, devices), self.N, self.B, self.cp, self.opt)
    return _Candidate(kind, devices, c, self.mem + c.memory_bytes, self.time + c.time_s)

  def candidates(self, table: TableConfig, kind: ShardingKind, search: bool) -> list[_Candidate]:
    N = self.N
    if kind in (DP, RW):
      return [self._make(table, kind, tuple(range(N)))]
    if kind == TW:
      return [self._make(table, kind, (d,)) for d in range(N)]
    if kind in (TWRW, SPTT):
      g = self.g
      return [self._make(table, kind, tuple(range(j * g, (j + 1) * g))) for j in range(N // g)]
    out = []
    o = _opt_fn(self.opt)
    s = storage_bytes(table)
    order = _device_order(self.time)
    for k in _cw_counts(table.dim, N, self.cw_min_width, search):
      devs: list[int] = []
      for w in column_chunk_widths(table.dim, k):   # widest chunk to the least-loaded device
        need = table.num_rows * (w * s + int(o(w)))
        free = [d for d in order if d not in devs]
        fits = [d for d in free if self.mem[d] + need <= self.budget]
        devs.append(fits[0] if fits else min(free, key=lambda d: (self.mem[d], d)))
      out.append(self._make(table, kind, tuple(devs)))
    return out

  def place(self, table: TableConfig, kinds: Sequence[ShardingKind], search: bool,
            why: str = "its best option", memory_first: bool = False) -> TablePlacement:
    cands = [c for k in kinds for c in self.candidates(table, k, search)]
    if len(kinds) > 1:   # a one-chunk cw is tw; keep it only where cw is the only kind
      cands = [c for c in cands if c.kind != CW or len(c.devices) > 1]
    fit = [c for c in cands if np.all(c.mem_after <= self.budget)]
    if not fit:
      raise self._error(table, cands, why)
    if memory_first:
      fit = _pick_min(fit, lambda c: float(c.mem_after.max()))
    best = _pick_min(fit, lambda c: float(c.time_after.max() + c.time_after.mean()))
    best = _pick_min(best, lambda c: float(np.sum(c.time_after ** 2)))
    c = min(best, key=lambda c: (KIND_ORDER.index(c.kind), c.devices))
    self.mem, self.time = c.mem_after, c.time_after
    return TablePlacement(c.kind, c.devices)

  def _error(self, table, cands, why) -> PlanError:
    def over(c):
      d = int(np.argmax(c.mem_after))
      return float(c.mem_after[d]) - self.budget, d
    c = min(cands, key=lambda c: (over(c)[0], KIND_ORDER.index(c.kind), c.devices))
    excess, d = over(c)
    need, used = int(c.cost.memory_bytes[d]), int(self.mem[d])
    o = int(_opt_fn(self.opt)(table.dim))
    tried = ", ".join(dict.fromkeys(k.kind.value for k in cands))
    return PlanError(
        f"table {table.name!r} ({table.num_rows:,} x {table.dim} {table.storage} + {o} B/row "
        f"optimizer state) needs {_fmt_bytes(need)} ({need:,} bytes) on device {d} under "
        f"{c.kind.value} on {self.N} devices ({why}; {_fmt_bytes(used)} already used there "
        f"by earlier tables; kinds tried: {tried}); budget {_fmt_bytes(self.budget)} "
        f"({int(self.budget):,} bytes): over by {_fmt_bytes(excess)} ({int(excess):,} bytes)")


def _order_tables(tables, forced, opt) -> list[TableConfig]:
  idx = {t.name: i for i, t in enumerate(tables)}
  return sorted(tables, key=lambda t: (t.name not in forced, -table_bytes(t, opt),
                                       -t.dim * t.pooling_factor, idx[t.name]))


def uniform_plan(tables: Sequence[TableConfig], kind: ShardingKind | str, num_devices: int,
                 group_size: int | None = None, *, memory_budget_bytes: int | None = None,
                 cost_params: CostParams | None = None,
                 optimizer_state_bytes_per_row: OptStateBytes = 4,
                 cw_min_width: int = CW_MIN_WIDTH) -> Plan:
  """Every table sharded the same `kind`; placements balance the cost-model load.

  Tables go biggest first (full-table bytes). tw: to the least-loaded device (ties: lowest
  index), so equal tables go round-robin. cw: k = the largest chunk count <= min(N,
  dim // cw_min_width) (at least 1) that splits dim exactly into chunks of ceil(dim / k),
  chunk i (widest first) on the i-th least-loaded device. twrw: row shards over the
  least-loaded contiguous block of `group_size` devices (default: the largest divisor of N
  that is at most 4); sptt the same (each group's tables form its tower; a DMT model's own
  towers go through `tower_plan`). dp and rw: all devices. The load is the time of the cost model; every
  term scales with the batch, so the placement does not depend on it. With
  `memory_budget_bytes`, devices without room are skipped and PlanError raised if none has.
  """
  _check_tables(tables)
  _check_positive(num_devices=num_devices)
  kind = as_kind(kind)
  g = _check_group_size(group_size, num_devices)
  budget = math.inf if memory_budget_bytes is None else memory_budget_bytes
  greedy = _Greedy(num_devices, 1024, budget, g, cost_params, optimizer_state_bytes_per_row,
                   cw_min_width)
  placed = {t.name: greedy.place(t, (kind,), search=False, why=f"uniform {kind.value} plan")
            for t in _order_tables(tables, (), optimizer_state_bytes_per_row)}
  return {t.name: placed[t.name] for t in tables}


def tower_plan(tables: Sequence[TableConfig], towers: Sequence[Sequence[int]], num_devices: int,
               memory_budget_bytes: int | None = None, batch_size: int = 1024,
               cost_params: CostParams | None = None,
               optimizer_state_bytes_per_row: OptStateBytes = 4) -> Plan:
  """DMT's SPTT placement (arXiv 2403.00877): tower k's tables (indices into `tables`, e.g.
  from `rec.embedding.towers.partition`) row-wise on tower group k, devices k*g..k*g+g-1 with
  g = N / len(towers). Raises PlanError when a device's share is over the budget."""
  _check_tables(tables)
  _check_positive(num_devices=num_devices, batch_size=batch_size)
  T = len(towers)
  flat = sorted(int(f) for t in towers for f in t)
  if T < 1 or flat != list(range(len(tables))) or any(not t for t in towers):
    raise ValueError(f"tower_plan: towers {[list(t) for t in towers]} must split the "
                     f"{len(tables)} tables 0..{len(tables) - 1}, none empty")
  if num_devices % T:
    raise ValueError(f"tower_plan: {T} towers on {num_devices} devices; expected a tower "
                     f"count that divides the devices (one group of N / T each)")
  g = num_devices // T
  out = {tables[f].name: TablePlacement(SPTT, tuple(range(k * g, (k + 1) * g)))
         for k, t in enumerate(towers) for f in t}
  out = {t.name: out[t.name] for t in tables}
  if memory_budget_bytes is not None:
    est = estimate_plan(out, tables, num_devices, batch_size, cost_params,
                        optimizer_state_bytes_per_row)
    d = int(np.argmax(est.per_device.memory_bytes))
    need = int(est.per_device.memory_bytes[d])
    if need > memory_budget_bytes:
      k = d // g
      raise PlanError(
          f"tower {k} (tables {[tables[f].name for f in towers[k]]}) needs {_fmt_bytes(need)} "
          f"({need:,} bytes) on device {d} of its group of {g}; budget "
          f"{_fmt_bytes(memory_budget_bytes)} ({int(memory_budget_bytes):,} bytes): over by "
          f"{_fmt_bytes(need - memory_budget_bytes)}; use more devices per tower or fewer "
          "rows in that tower")
  return out


def plan(tables: Sequence[TableConfig], num_devices: int, memory_budget_bytes: int,
         batch_size: int, overrides: Mapping[str, ShardingKind | str] | None = None,
         group_size: int | None = None, cost_params: CostParams | None = None,
         optimizer_state_bytes_per_row: OptStateBytes = 4, *,
         kinds: Iterable[ShardingKind | str] | None = None,
         replicate_below_bytes: int = 0, cw_min_width: int = CW_MIN_WIDTH) -> Plan:
  """A kind and devices per table that fit `memory_budget_bytes` on every device.

  Greedy over tables (overridden first, then biggest first) minimizing the projected
  max + mean per-device time (module docstring). `overrides` fixes a table's kind (its
  devices are still chosen, and the budget still checked); `kinds` restricts the kinds tried
  for the other tables (default: all five; twrw only when 1 < group_size < N). Tables of at
  most `replicate_below_bytes` (table_bytes) go dp without a search, unless overridden;
  by default the cost model alone decides (it picks dp for tables of a few rows).
  `batch_size` is the global batch. Raises PlanError when a table fits nowhere.
  """
  _check_tables(tables)
  _check_positive(num_devices=num_devices, batch_size=batch_size,
                  memory_budget_bytes=memory_budget_bytes)
  g = _check_group_size(group_size, num_devices)
  forced = {n: as_kind(k, f"table {n!r}") for n, k in (overrides or {}).items()}
  validate_overrides(forced, tables)
  allowed = AUTO_KINDS if kinds is None else tuple(dict.fromkeys(as_kind(k) for k in kinds))
  if SPTT in allowed or SPTT in forced.values():
    raise ValueError("plan: sptt places tables by tower (tower_plan, with the towers of a "
                     "DMT model); the auto planner does not choose it")
  if kinds is None and not 1 < g < num_devices:
    allowed = tuple(k for k in allowed if k != TWRW)   # same as tw (g=1) or rw (g=N)
  allowed = tuple(k for k in KIND_ORDER if k in allowed)
  if not allowed:
    raise ValueError("plan: kinds is empty")
  order = _order_tables(tables, forced, optimizer_state_bytes_per_row)

  def attempt(num_memory_first: int) -> Plan:
    greedy = _Greedy(num_devices, batch_size, memory_budget_bytes, g, cost_params,
                     optimizer_state_bytes_per_row, cw_min_width)
    placed = {}
    for i, t in enumerate(order):
      if t.name in forced:
        ks, why = (forced[t.name],), "forced by override"
      elif table_bytes(t, optimizer_state_bytes_per_row) <= replicate_below_bytes:
        ks, why = (DP,), f"replicated: at most replicate_below_bytes={replicate_below_bytes:,}"
      else:
        ks, why = allowed, "its best option"
      placed[t.name] = greedy.place(t, ks, search=True, why=why,
                                    memory_first=i < num_memory_first)
    return {t.name: placed[t.name] for t in tables}

  # Time first; when that runs out of memory, the biggest 1, 2, 4, ... tables take their
  # least-memory placement instead, ending with every table (the tightest packing).
  j = 0
  while True:
    try:
      return attempt(j)
    except PlanError:
      if j >= len(order):
        raise
      j = min(len(order), max(1, 2 * j))


# ----------------------------------------------------------------------------- overrides


def parse_overrides(s: str) -> dict[str, str]:
  """{"C1": "tw", "C3": "rw"} from a flag value "C1=tw,C3=rw" (empty string: {})."""
  out: dict[str, str] = {}
  for item in (x.strip() for x in (s or "").split(",")):
    if not item:
      continue
    name, eq, kind = (x.strip() for x in item.partition("="))
    if not eq or not name or not kind:
      raise ValueError(f"sharding override {item!r} in {s!r}: expected TABLE=KIND, e.g. "
                       f"'C1=tw,C3=rw'")
    if name in out:
      raise ValueError(f"sharding override for table {name!r} given twice in {s!r}")
    out[name] = as_kind(kind, f"table {name!r} in {s!r}").value
  return out


def validate_overrides(overrides: Mapping[str, Any], tables: Sequence[TableConfig]) -> None:
  """Raises ValueError for override names that are not tables, or kinds that are not kinds."""
  names = [t.name for t in tables]
  unknown = [n for n in overrides if n not in set(names)]
  if unknown:
    raise ValueError(f"sharding overrides name unknown tables {unknown}; known tables: {names}")
  for n, k in overrides.items():
    as_kind(k, f"table {n!r}")


# ----------------------------------------------------------------------------- reporting


def _fmt_bytes(n: float) -> str:
  """Decimal units: 999 B, 1.50 KB, 2.60 GB."""
  if n == math.inf:
    return "inf"
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def _fmt_devices(devs: tuple[int, ...]) -> str:
  """0-7 for a contiguous ascending run of 3 or more, else 3,0,5."""
  if len(devs) >= 3 and devs == tuple(range(devs[0], devs[0] + len(devs))):
    return f"{devs[0]}-{devs[-1]}"
  return ",".join(map(str, devs))


def _table_text(header: Sequence[str], rows: list[Sequence[str]], right: set[int]) -> list[str]:
  widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
  fmt = lambda r: "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths))).rstrip()
  return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def format_plan(plan: Mapping[str, TablePlacement], tables: Sequence[TableConfig],
                num_devices: int, batch_size: int, memory_budget_bytes: int | None = None,
                cost_params: CostParams | None = None,
                optimizer_state_bytes_per_row: OptStateBytes = 4, budget_source: str = "") -> str:
  """A human table: one row per table, then one per device (memory, load, comm, time);
  the last line names the budget and `budget_source` (where its number comes from)."""
  est = estimate_plan(plan, tables, num_devices, batch_size, cost_params,
                      optimizer_state_bytes_per_row)
  rows = []
  for t in tables:
    p, c = plan[t.name], est.per_table[t.name]
    rows.append([t.name, f"{t.num_rows:,}", t.dim, t.storage, p.kind.value,
                 _fmt_devices(p.devices), _fmt_bytes(int(c.memory_bytes.max())),
                 f"{c.time_s.max() * 1e6:.1f}"])
  lines = _table_text(["table", "rows", "dim", "dtype", "kind", "devices", "mem/device",
                       "max us"], rows, right={1, 2, 6, 7})
  dev = est.per_device
  budget = memory_budget_bytes
  drows = []
  for d in range(num_devices):
    mem = int(dev.memory_bytes[d])
    used = f"{_fmt_bytes(mem)} / {_fmt_bytes(budget)} ({100 * mem / budget:.0f}%)" if budget \
        else _fmt_bytes(mem)
    drows.append([d, used, f"{dev.lookup_elems[d]:.3g}", _fmt_bytes(dev.comm_bytes[d]),
                  f"{dev.time_s[d] * 1e6:.1f}"])
  lines += [""] + _table_text(["device", "memory / budget" if budget else "memory",
                               "lookup elems", "comm", "est us"], drows, right={0, 2, 3, 4})
  slow = int(np.argmax(dev.time_s))
  lines.append(f"{len(tables)} tables on {num_devices} devices, global batch {batch_size}: "
               f"slowest device {slow} at {est.max_time_s * 1e6:.1f} us/step (estimated), "
               f"max memory {_fmt_bytes(est.max_memory_bytes)}"
               + (f", budget {_fmt_bytes(budget)} per device" if budget else "")
               + (f" ({budget_source})" if budget and budget_source else ""))
  return "\n".join(lines)


def plan_summary(plan: Mapping[str, TablePlacement], tables: Sequence[TableConfig] | None = None,
                 num_devices: int | None = None, batch_size: int | None = None,
                 cost_params: CostParams | None = None,
                 optimizer_state_bytes_per_row: OptStateBytes = 4) -> dict[str, Any]:
  """JSON-able summary for results.json; with tables, N and batch it adds the estimates."""
  counts = {k.value: sum(p.kind == k for p in plan.values()) for k in KIND_ORDER}
  out: dict[str, Any] = {
      "tables": {n: {"kind": p.kind.value, "devices": list(p.devices)} for n, p in plan.items()},
      "kinds": {k: v for k, v in counts.items() if v},
  }
  if tables is not None and num_devices is not None and batch_size is not None:
    est = estimate_plan(plan, tables, num_devices, batch_size, cost_params,
                        optimizer_state_bytes_per_row)
    dev = est.per_device
    out["estimate"] = {
        "num_devices": num_devices, "batch_size": batch_size,
        "max_time_s": est.max_time_s, "max_memory_bytes": est.max_memory_bytes,
        "device_time_s": [float(x) for x in dev.time_s],
        "device_memory_bytes": [int(x) for x in dev.memory_bytes],
        "device_comm_bytes": [float(x) for x in dev.comm_bytes],
    }
  return out
