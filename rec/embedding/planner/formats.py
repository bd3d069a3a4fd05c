"""A plan for people and for results.json: format_plan (a table per table and per device),
plan_summary (JSON-able, with the cost model's estimates).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from rec.embedding.config import TableConfig
from rec.embedding.planner.estimate import CostParams, OptStateBytes, estimate_plan
from rec.embedding.planner.types import KIND_ORDER, TablePlacement, planned_tables


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
                optimizer_state_bytes_per_row: OptStateBytes = 4, budget_source: str = "",
                host_budget_bytes: int | None = None, host_source: str = "") -> str:
  """A human table: one row per table (storage, tier, device and host bytes on its fullest
  device), then one per device (memory, host memory, load, comm, time); with a host-tier
  table or `host_budget_bytes`, a line of host and device totals; the last line names the
  budget and `budget_source` (where its number comes from)."""
  est = estimate_plan(plan, tables, num_devices, batch_size, cost_params,
                      optimizer_state_bytes_per_row)
  rows = []
  for t in planned_tables(plan, tables):
    p, c = plan[t.name], est.per_table[t.name]
    rows.append([t.name, f"{t.num_rows:,}", t.dim, t.storage, t.storage.tier, p.kind.value,
                 _fmt_devices(p.devices), _fmt_bytes(int(c.memory_bytes.max())),
                 _fmt_bytes(int(c.host_bytes.max())), f"{c.time_s.max() * 1e6:.1f}"])
  lines = _table_text(["table", "rows", "dim", "storage", "tier", "kind", "devices",
                       "device mem", "host mem", "max us"], rows, right={1, 2, 7, 8, 9})
  dev = est.per_device
  budget = memory_budget_bytes

  def used(n, of):
    return f"{_fmt_bytes(n)} / {_fmt_bytes(of)} ({100 * n / of:.0f}%)" if of else _fmt_bytes(n)

  drows = []
  for d in range(num_devices):
    drows.append([d, used(int(dev.memory_bytes[d]), budget),
                  used(int(dev.host_bytes[d]), host_budget_bytes),
                  f"{dev.lookup_elems[d]:.3g}", _fmt_bytes(dev.comm_bytes[d]),
                  f"{dev.time_s[d] * 1e6:.1f}"])
  lines += [""] + _table_text(["device", "memory / budget" if budget else "memory",
                               "host / budget" if host_budget_bytes else "host",
                               "lookup elems", "comm", "est us"], drows, right={0, 3, 4, 5})
  slow = int(np.argmax(dev.time_s))
  on_host = sum(p.storage is not None and p.storage.host for p in plan.values())
  if on_host or host_budget_bytes:
    lines.append(f"host tier: {on_host} tables, max host memory {_fmt_bytes(est.max_host_bytes)}"
                 + (f" of {_fmt_bytes(host_budget_bytes)} per device" if host_budget_bytes
                    else "")
                 + (f" ({host_source})" if host_budget_bytes and host_source else "")
                 + f"; total device memory {_fmt_bytes(int(dev.memory_bytes.sum()))}, host "
                 f"memory {_fmt_bytes(int(dev.host_bytes.sum()))}")
  lines.append(f"{len(tables)} tables on {num_devices} device{'s' if num_devices != 1 else ''}, global batch {batch_size}: "
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
      "tables": {n: {"kind": p.kind.value, "devices": list(p.devices),
                     **({"storage": str(p.storage)} if p.storage is not None else {})}
                 for n, p in plan.items()},
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
        "device_host_bytes": [int(x) for x in dev.host_bytes],
        "device_comm_bytes": [float(x) for x in dev.comm_bytes],
    }
  return out
