"""Placement: the greedy planner (`plan`), uniform plans and DMT's tower plans.

Planner (`plan`): tables are placed one at a time, overridden ones first, then by size
(full-table bytes, descending). For a table every allowed kind and placement is tried
(dp; tw on each device; cw with k = 2, 4, 8, ... chunks on the k least-loaded devices that
have room; twrw on each group; rw) and the one that fits memory with the smallest
  score = max_d time_d + mean_d time_d
is kept: the max balances, the mean charges total work so that a placement that leaves the
max unchanged but spends bandwidth on every device still loses. Ties (relative 1e-9) go
to the smaller sum of squared device times (the least-loaded devices), then to the kind
order dp, tw, cw, twrw, rw, then to the lowest device indices. dp all-gathers every id
slot's gradient row (rec/embedding/sharding/dp.py), so it wins only where lookups dominate;
with `CostParams(dp_unique_rows=True)` (an exchange of deduplicated rows) tiny tables end up
dp. When nothing fits, the planner retries with the biggest 1, 2, 4, ... tables (then all)
taking their least-memory placement first (time breaks ties); if even that fails,
`PlanError` names the table and the bytes by which its tightest option is over budget.
The greedy is myopic (spreading the first tables column-wise can end slower than one kind
for all), so without overrides a uniform plan that fits and scores lower on the whole
layout's estimate is returned instead.

Host tier (`plan(..., host_tier=HostTier(...))`): when the tables do not fit the device
budget, the biggest tables whose storage has a cached form move, one at a time, to the host
tier (`StorageSpec.on_host`: their rows and optimizer state in host memory, a device cache
of `cache_fraction` of their rows; the placement's `storage`) and the plan is made again,
until it fits. Then every device's host share must fit `host_budget_bytes`; otherwise, or
when no table is left to move, one PlanError line names the table and the bytes.

The greedy search enumerates every allowed placement of a table (`_Greedy.candidates`),
prices it with the cost model (estimate.py) on top of the tables placed so far, and keeps
the best that fits the per-device budget (the memory reservation). The budget is checked
against the collection's layout: tables of one exchange, storage, dim and width share a
buffer that is as long on every device as on its fullest one, so a device holds, per such
group, the group's largest per-device share (`estimate.layout`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from rec.embedding.config import ShardingKind, TableConfig
from rec.embedding.storage_spec import StorageSpec
from rec.embedding.planner.estimate import (EXCHANGE, CostParams, DeviceCosts, OptStateBytes,
                                            _opt_fn, _width, block_bytes_split, estimate_plan,
                                            placement_cost, row_bytes, table_bytes)
from rec.embedding.planner.formats import _fmt_bytes
from rec.embedding.planner.types import (AUTO_KINDS, CW, DP, KIND_ORDER, RW, SPTT, TW, TWRW,
                                         Plan, PlanError, TablePlacement, _check_group_size,
                                         _check_positive, _check_tables, _valid_chunk_count,
                                         as_kind, column_chunk_widths, row_shard_sizes,
                                         validate_overrides, width_multiple)

CW_MIN_WIDTH = 4     # narrowest column chunk the planner makes (16-byte fp32 rows)
_REL_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class HostTier:
  """Lets `plan` move tables that the device budget cannot hold to the host tier."""

  host_budget_bytes: int                 # host memory per device for rows + optimizer state
  cache_fraction: float = 0.05           # each moved table's device cache (share of rows)
  cache_policy: str = "lfu"
  source: str = ""                       # where host_budget_bytes comes from (messages)

  def __post_init__(self):
    if not self.host_budget_bytes > 0:
      raise ValueError(f"HostTier: host_budget_bytes={self.host_budget_bytes}, expected > 0")
    StorageSpec("fp32_cache", self.cache_policy, self.cache_fraction)   # checks both

  def storage(self, spec: StorageSpec) -> StorageSpec:
    """`spec` on the host tier with this tier's cache (a cached spec keeps its own)."""
    if spec.cached:
      return spec.on_host()
    return dataclasses.replace(spec.on_host(self.cache_fraction), cache_policy=self.cache_policy)


@dataclasses.dataclass(frozen=True)
class _Candidate:
  kind: ShardingKind
  devices: tuple[int, ...]
  cost: DeviceCosts
  mem_after: np.ndarray
  time_after: np.ndarray
  group: tuple              # the collection's buffer the table joins (exchange, storage, ...)
  group_after: np.ndarray   # that buffer's rows per device with the table
  group_bytes: int          # that buffer's bytes on every device (as long as its fullest)
  padded_after: int         # bytes per device of every buffer, each as long as its fullest


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


def _cw_counts(dim: int, num_devices: int, cw_min_width: int, search: bool,
               multiple: int = 1) -> tuple[int, ...]:
  """Chunk counts to try for a cw table: the most chunks of at least cw_min_width columns
  (and, searching, the powers of two below), each stored width a multiple of `multiple`
  (int4 / int2 codes); () when none is."""
  kmax = max(1, min(num_devices, dim // max(1, cw_min_width)))
  while kmax > 1 and not _valid_chunk_count(dim, kmax, multiple):
    kmax -= 1
  top = {kmax} if _valid_chunk_count(dim, kmax, multiple) else set()
  if not search:
    return tuple(top)
  ks = {k for k in (2 ** i for i in range(1, 31))
        if k < kmax and _valid_chunk_count(dim, k, multiple)}
  return tuple(sorted(ks | top))


class _Greedy:
  """Places tables one at a time on the cheapest placement that fits (module docstring)."""

  def __init__(self, num_devices, batch_size, budget, group_size, cost_params, opt,
               cw_min_width):
    self.N, self.B, self.budget = num_devices, batch_size, budget
    self.g = group_size
    self.cp, self.opt, self.cw_min_width = cost_params, opt, cw_min_width
    self.mem = np.zeros(num_devices, np.int64)
    self.time = np.zeros(num_devices)
    self.groups: dict[tuple, np.ndarray] = {}   # buffer -> its tables' rows per device
    self.group_bytes: dict[tuple, int] = {}     # buffer -> its bytes on every device

  def _rows(self, table: TableConfig, p: TablePlacement) -> np.ndarray:
    """Rows the table adds to its buffer on each device (the collection's, as
    estimate.layout counts them: rw ceil(R / N) everywhere, cw every row per chunk)."""
    rows, R = np.zeros(self.N, np.int64), table.num_rows
    if p.kind == DP:
      rows[:] = R
    elif p.kind == RW:
      rows[:] = -(-R // self.N)
    elif p.kind in (TWRW, SPTT):
      rows[list(p.devices)] += row_shard_sizes(R, len(p.devices))
    else:   # tw, cw
      rows[list(p.devices)] += R
    return rows

  def _buffer_bytes(self, key: tuple, rows: np.ndarray) -> int:
    """Device bytes of buffer `key` holding `rows` per device: every device's block as long
    as the fullest, laid out by its storage (a cache rounded to whole sets), with its
    optimizer state (estimate.layout's memory, what the collection holds)."""
    _, spec, _, width = key
    n = max(1, int(rows.max()))
    dev, _ = block_bytes_split(spec, n, width)
    return int(dev + (0 if spec.host else n * int(_opt_fn(self.opt)(width))))

  def _make(self, table, kind, devices) -> _Candidate:
    p = TablePlacement(kind, devices)
    c = placement_cost(table, p, self.N, self.B, self.cp, self.opt)
    key = (EXCHANGE[p.kind], table.storage, table.dim, _width(table, p))
    after = self.groups.get(key, 0) + self._rows(table, p)
    gb = self._buffer_bytes(key, after)
    padded = gb + sum(v for k, v in self.group_bytes.items() if k != key)
    return _Candidate(kind, devices, c, self.mem + c.memory_bytes, self.time + c.time_s, key,
                      after, gb, padded)

  def candidates(self, table: TableConfig, kind: ShardingKind, search: bool) -> list[_Candidate]:
    N = self.N
    m = width_multiple(table.storage)
    if kind != CW and table.dim % m:
      return []   # packed codes need whole bytes: only cw chunks of a fitting width store it
    if kind in (DP, RW):
      return [self._make(table, kind, tuple(range(N)))]
    if kind == TW:
      return [self._make(table, kind, (d,)) for d in range(N)]
    if kind in (TWRW, SPTT):
      g = self.g
      return [self._make(table, kind, tuple(range(j * g, (j + 1) * g))) for j in range(N // g)]
    out = []
    o = _opt_fn(self.opt)
    order = _device_order(self.time)
    for k in _cw_counts(table.dim, N, self.cw_min_width, search, m):
      devs: list[int] = []
      W = -(-table.dim // k)       # every chunk's stored width (the last is padded to it)
      for _ in column_chunk_widths(table.dim, k):   # widest chunk to the least-loaded device
        need = table.num_rows * (row_bytes(table, W) + int(o(W)))
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
    if not cands:
      m = width_multiple(table.storage)
      raise PlanError(
          f"table {table.name!r} (dim {table.dim}, {table.storage}): no placement of kinds "
          f"{[as_kind(k).value for k in kinds]} stores its rows in a width that is a multiple "
          f"of {m} (whole bytes of packed codes); pick a dim that is, or allow cw")
    fit = [c for c in cands if c.padded_after <= self.budget]
    if not fit:
      raise self._error(table, cands, why)
    if memory_first:
      fit = _pick_min(fit, lambda c: float(c.padded_after))
    best = _pick_min(fit, lambda c: float(c.time_after.max() + c.time_after.mean()))
    best = _pick_min(best, lambda c: float(np.sum(c.time_after ** 2)))
    c = min(best, key=lambda c: (KIND_ORDER.index(c.kind), c.devices))
    self.mem, self.time = c.mem_after, c.time_after
    self.groups[c.group], self.group_bytes[c.group] = c.group_after, c.group_bytes
    return TablePlacement(c.kind, c.devices)

  def _error(self, table, cands, why) -> PlanError:
    def over(c):
      return float(c.padded_after) - self.budget, int(np.argmax(c.mem_after))
    c = min(cands, key=lambda c: (over(c)[0], KIND_ORDER.index(c.kind), c.devices))
    excess, d = over(c)
    need, used = int(c.cost.memory_bytes[d]), c.padded_after - int(c.cost.memory_bytes[d])
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
    need = est.max_memory_bytes    # every device's buffer is as long as the fullest tower's
    own = sum(c.memory_bytes for c in est.per_table.values())
    d = int(np.argmax(own))
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
         replicate_below_bytes: int = 0, cw_min_width: int = CW_MIN_WIDTH,
         host_tier: HostTier | None = None) -> Plan:
  """A kind and devices per table that fit `memory_budget_bytes` on every device.

  Greedy over tables (overridden first, then biggest first) minimizing the projected
  max + mean per-device time (module docstring). `overrides` fixes a table's kind (its
  devices are still chosen, and the budget still checked); `kinds` restricts the kinds tried
  for the other tables (default: all five; twrw only when 1 < group_size < N). Tables of at
  most `replicate_below_bytes` (table_bytes) go dp without a search, unless overridden;
  by default the cost model alone decides (it picks dp for tables of a few rows).
  `batch_size` is the global batch. Without overrides or replicate_below_bytes, a uniform
  plan (`uniform_plan`) of an allowed kind that fits and whose estimate (max + mean device
  time of the layout) is lower is returned instead of the greedy's. Raises PlanError when a
  table fits nowhere. `host_tier`: tables move to host memory until the plan fits (module
  docstring); their placements carry the storage.
  """
  if host_tier is not None:
    return _plan_with_host_tier(tables, num_devices, memory_budget_bytes, batch_size,
                                overrides, group_size, cost_params,
                                optimizer_state_bytes_per_row, kinds, replicate_below_bytes,
                                cw_min_width, host_tier)
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
      best = attempt(j)
      break
    except PlanError:
      if j >= len(order):
        raise
      j = min(len(order), max(1, 2 * j))
  if forced or replicate_below_bytes:
    return best
  # The greedy is myopic (spreading the first tables column-wise can cost more than one
  # kind for all): a uniform plan of an allowed kind that fits and scores lower wins.
  def score(p: Plan) -> float:
    t = estimate_plan(p, tables, num_devices, batch_size, cost_params,
                      optimizer_state_bytes_per_row).per_device.time_s
    return float(t.max() + t.mean())
  best_score = score(best)
  for k in allowed:
    try:
      u = uniform_plan(tables, k, num_devices, g, memory_budget_bytes=memory_budget_bytes,
                       cost_params=cost_params,
                       optimizer_state_bytes_per_row=optimizer_state_bytes_per_row,
                       cw_min_width=cw_min_width)
    except PlanError:
      continue
    su = score(u)
    if su < best_score * (1 - _REL_TOL):
      best, best_score = u, su
  return best


def _plan_with_host_tier(tables, num_devices, budget, batch_size, overrides, group_size,
                         cost_params, opt, kinds, replicate_below_bytes, cw_min_width,
                         tier: HostTier) -> Plan:
  """`plan` with the biggest tables moved to the host tier until it fits (module docstring)."""
  _check_tables(tables)
  now = list(tables)
  # Biggest first; of equal size the least looked-up (lowest pooling factor) first.
  idx = {t.name: i for i, t in enumerate(tables)}
  movable = [t.name for t in sorted(tables, key=lambda t: (-table_bytes(t, opt),
                                                           t.pooling_factor, idx[t.name]))
             if not t.storage.host and _host_form(t.storage) is not None]
  moved: list[str] = []
  while True:
    try:
      out = plan(now, num_devices, budget, batch_size, overrides, group_size, cost_params, opt,
                 kinds=kinds, replicate_below_bytes=replicate_below_bytes,
                 cw_min_width=cw_min_width)
      break
    except PlanError as e:
      if not movable:
        names = ", ".join(moved[:4]) + (", ..." if len(moved) > 4 else "")
        on = f" with {len(moved)} tables on the host tier ({names})" if moved \
            else " (no table has a host-tier form)"
        raise PlanError(f"{e}{on}") from None
      name = movable.pop(0)
      moved.append(name)
      now = [dataclasses.replace(t, storage=tier.storage(t.storage)) if t.name == name else t
             for t in now]
  out = {t.name: (dataclasses.replace(out[t.name], storage=t.storage) if t.name in moved
                  else out[t.name]) for t in now}
  est = estimate_plan(out, tables, num_devices, batch_size, cost_params, opt)
  host = est.per_device.host_bytes
  if host.max() > tier.host_budget_bytes:
    d = int(np.argmax(host))
    name = max(moved, key=lambda n: (int(est.per_table[n].host_bytes[d]), n))
    need = int(est.per_table[name].host_bytes[d])
    t = next(t for t in now if t.name == name)
    raise PlanError(
        f"table {name!r} ({t.num_rows:,} x {t.dim} {t.storage}) needs {_fmt_bytes(need)} "
        f"({need:,} bytes) of host memory on device {d} even with the host tier; device "
        f"{d}'s host tables need {_fmt_bytes(int(host[d]))} in all, host budget "
        f"{_fmt_bytes(tier.host_budget_bytes)} ({int(tier.host_budget_bytes):,} bytes"
        + (f", {tier.source}" if tier.source else "") + f") per device: over by "
        f"{_fmt_bytes(int(host[d]) - tier.host_budget_bytes)}")
  return out


def _host_form(spec: StorageSpec) -> StorageSpec | None:
  try:
    return spec.on_host()
  except ValueError:
    return None
