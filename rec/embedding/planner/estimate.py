"""Cost model of the embedding planner: per-device memory, lookups, traffic and time.

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

Communication follows the collection's exchanges (`rec.embedding.sharding`): tw / cw / twrw move ids and pooled
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
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from rec.embedding import storage_spec
from rec.embedding.config import TableConfig
from rec.embedding.planner.types import (CW, DP, RW, SPTT, TW, TWRW, TablePlacement,
                                         column_chunk_widths, row_shard_sizes, validate_plan)

STORAGE_BYTES = {"fp32": 4, "bf16": 2, "bf16_sr": 2}


def storage_bytes(table: TableConfig) -> float:
  """Bytes per element of the table's rows: STORAGE_BYTES, or for quantized rows with a
  cache (rec/embedding/rowwise_storage.py) their bytes per row (codes, scale, bias, the
  row's share of the cache and counters) over the dim."""
  if table.storage.kind in STORAGE_BYTES:
    return STORAGE_BYTES[table.storage.kind]
  return storage_spec.make_storage(table.storage).bytes_per_row(table.dim) / table.dim


OptStateBytes = Callable[[int], int] | int   # bytes per row of a shard of width w, or fixed


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
