"""Embedding table configuration shared by the collection, the planner and the models."""

from __future__ import annotations

import dataclasses
import enum


class ShardingKind(str, enum.Enum):
  """How one table is laid over the mesh (TorchRec / Neo arXiv 2104.05158 names)."""

  DATA_PARALLEL = "dp"   # replicated on every device; gradients all-gathered
  TABLE_WISE = "tw"      # the whole table on one device
  ROW_WISE = "rw"        # rows split evenly (last shard may be shorter) over all devices
  COLUMN_WISE = "cw"     # columns split into chunks, each chunk table-wise
  TABLE_ROW_WISE = "twrw"  # table on one group of devices, rows split within the group


@dataclasses.dataclass(frozen=True)
class TableConfig:
  """One embedding table, fed by one sparse feature of the same name.

  pooling_factor is the mean number of ids per bag; the planner uses it for load.
  """

  name: str
  num_rows: int
  dim: int
  pooling: str = "sum"          # "sum" | "mean"
  pooling_factor: float = 1.0
  storage: str = "fp32"         # "fp32" | "bf16" | "bf16_sr" | "int8[_cache...]" (storage.py)

  def __post_init__(self):
    if self.num_rows <= 0:
      raise ValueError(f"table {self.name!r}: num_rows={self.num_rows}, expected > 0")
    if self.dim <= 0:
      raise ValueError(f"table {self.name!r}: dim={self.dim}, expected > 0")
    if self.pooling not in ("sum", "mean"):
      raise ValueError(f"table {self.name!r}: pooling={self.pooling!r}, expected 'sum' or 'mean'")
    from rec.embedding import storage as storage_lib
    try:
      storage_lib.get_storage(self.storage)
    except ValueError as e:
      raise ValueError(f"table {self.name!r}: {e}") from None
