"""Embedding sharding planner: a sharding kind and devices per table, from a cost model.

Like TorchRec's EmbeddingShardingPlanner and Neo (arXiv 2104.05158): each table gets one of
dp / tw / cw / rw / twrw (`rec.embedding.config.ShardingKind`) and a set of devices, chosen
so that every device fits its memory budget and the slowest device's estimated time per
step is small; sptt places DMT's towers. Pure Python and numpy: it runs before any mesh
exists. TorchRec's planner parts, one module each:

  types.py      TablePlacement, Plan, PlanError, validate_plan, the layout helpers (row
                shards, column chunks, twrw groups), sharding overrides
  estimate.py   the cost model (estimator and storage reservation): placement_cost (one
                table), layout / estimate_plan (the collection's buffers and collectives),
                table_bytes, storage_bytes, row_bytes, block_bytes, wire_bytes, CostParams
  placement.py  enumeration and placement: the greedy `plan` (with `HostTier`: tables the
                device cannot hold in host memory), uniform_plan, tower_plan
  formats.py    format_plan (a human table), plan_summary (results.json)

Every name is re-exported here: `from rec.embedding import planner; planner.plan(...)`.
"""

from rec.embedding.planner.estimate import (STORAGE_BYTES, WIRE_FACTOR, CostParams,
                                            DeviceCosts, LayoutGroup, OptStateBytes,
                                            PlanEstimate, block_bytes, block_bytes_split,
                                            estimate_plan, layout, placement_cost, row_bytes,
                                            row_bytes_split, storage_bytes, table_bytes,
                                            wire_bytes)
from rec.embedding.planner.formats import _fmt_bytes, format_plan, plan_summary
from rec.embedding.planner.placement import (CW_MIN_WIDTH, HostTier, plan, tower_plan,
                                             uniform_plan)
from rec.embedding.planner.types import (AUTO_KINDS, CW, DP, KIND_ORDER, RW, SPTT, TW, TWRW,
                                         Plan, PlanError, TablePlacement, as_kind,
                                         column_chunk_widths, default_group_size,
                                         parse_overrides, planned_tables, row_shard_sizes,
                                         validate_overrides, validate_plan, width_multiple)

__all__ = [
    "AUTO_KINDS", "CW", "CW_MIN_WIDTH", "CostParams", "DP", "DeviceCosts", "HostTier",
    "KIND_ORDER",
    "LayoutGroup", "OptStateBytes", "Plan", "PlanError", "PlanEstimate", "RW", "SPTT",
    "STORAGE_BYTES", "TW", "TWRW", "TablePlacement", "WIRE_FACTOR", "as_kind", "block_bytes", "block_bytes_split",
    "column_chunk_widths", "default_group_size", "estimate_plan", "format_plan", "layout",
    "parse_overrides", "placement_cost", "plan", "plan_summary", "planned_tables", "row_bytes",
    "row_bytes_split",
    "row_shard_sizes", "storage_bytes", "table_bytes", "tower_plan", "uniform_plan",
    "validate_overrides", "validate_plan", "width_multiple", "wire_bytes",
]
