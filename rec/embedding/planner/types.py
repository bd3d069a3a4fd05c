"""What a plan is: a sharding kind and devices per table, and what makes one valid.

Like TorchRec's planner types: `TablePlacement` (kind + devices) per table, `Plan` (table
name -> placement), `PlanError` when no placement fits, and the checks and layout helpers
(row shards, column chunks, twrw groups, `--sharding_overrides`) that the cost model
(estimate.py), the placement search (placement.py) and the formats (formats.py) share.
Pure Python and numpy: it runs before any mesh exists.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

from rec.embedding.config import ShardingKind, TableConfig
from rec.embedding.storage_spec import StorageSpec, make_storage

DP = ShardingKind.DATA_PARALLEL
TW = ShardingKind.TABLE_WISE
RW = ShardingKind.ROW_WISE
CW = ShardingKind.COLUMN_WISE
TWRW = ShardingKind.TABLE_ROW_WISE

SPTT = ShardingKind.SPTT

KIND_ORDER: tuple[ShardingKind, ...] = (DP, TW, CW, TWRW, RW, SPTT)   # tie-break preference
# What `plan` chooses from: sptt only comes with a tower model (`tower_plan` places it).
AUTO_KINDS: tuple[ShardingKind, ...] = (DP, TW, CW, TWRW, RW)


class PlanError(ValueError):
  """No placement of some table fits the per-device memory budget."""


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """One table's sharding kind and the embedding devices (0..N-1) holding its shards.

  dp: all N devices; tw: one device; rw: all N devices (row shard i on devices[i]);
  cw: one device per column chunk (chunk i on devices[i]; chunks are ceil(dim / k) wide
  for k = len(devices), the last may be narrower); twrw: a contiguous block of
  `group_size` devices holding row shards of the table (shard i on devices[i]).
  `storage`: the planner's storage for the table when it differs from the table's own (the
  host tier, `plan(..., host_tier=)`); None: the table's.
  """

  kind: ShardingKind
  devices: tuple[int, ...]
  storage: StorageSpec | None = None

  def __post_init__(self):
    object.__setattr__(self, "kind", as_kind(self.kind))
    object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
    if not self.devices:
      raise ValueError(f"TablePlacement({self.kind.value}): devices is empty")
    if len(set(self.devices)) != len(self.devices):
      raise ValueError(f"TablePlacement({self.kind.value}): repeated device in {self.devices}")


Plan = dict[str, TablePlacement]   # keyed by table name, in table order


def planned_tables(plan: Mapping[str, TablePlacement],
                   tables: Sequence[TableConfig]) -> list[TableConfig]:
  """`tables` with the storage their placements give (the host tier), else their own."""
  out = []
  for t in tables:
    p = plan.get(t.name)
    s = None if p is None else p.storage
    out.append(t if s is None or s == t.storage else dataclasses.replace(t, storage=s))
  return out


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


def _valid_chunk_count(dim: int, k: int, multiple: int = 1) -> bool:
  """k chunks of ceil(dim / k) cover dim exactly, in a stored width that is a multiple of
  `multiple` (`width_multiple`: every chunk is stored ceil(dim / k) wide)."""
  return 1 <= k <= dim and -(-dim // -(-dim // k)) == k and -(-dim // k) % multiple == 0


def stored_width(table: TableConfig, placement: TablePlacement) -> int:
  """Width of the table's stored rows under `placement`: cw chunks ceil(dim / k), else dim."""
  return -(-table.dim // len(placement.devices)) if placement.kind == CW else table.dim


@functools.lru_cache(maxsize=None)
def width_multiple(spec: StorageSpec) -> int:
  """Columns a stored row's width must be a multiple of under `spec`: int4 / int2 codes are
  packed into whole bytes (2 / 4 columns; rowwise_storage's width check), else 1."""
  return max(1, 8 // getattr(make_storage(spec), "bits", 32))


def default_group_size(num_devices: int) -> int:
  """twrw group size when none is given: the largest divisor of N that is at most 4."""
  return max(g for g in range(1, min(4, num_devices) + 1) if num_devices % g == 0)


def _check_group_size(group_size: int | None, num_devices: int) -> int:
  g = default_group_size(num_devices) if group_size is None else int(group_size)
  if not 1 <= g <= num_devices or num_devices % g:
    raise ValueError(f"twrw group_size={group_size}: expected a divisor of num_devices="
                     f"{num_devices}")
  return g


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
    elif stored_width(t, p) % width_multiple(p.storage or t.storage):
      bad = (f"rows stored {stored_width(t, p)} wide in {p.storage or t.storage}, whose packed "
             f"codes need a width that is a multiple of {width_multiple(p.storage or t.storage)}")
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
