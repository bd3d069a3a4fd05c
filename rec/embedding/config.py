"""Embedding table configuration shared by the collection, the planner and the models."""

from __future__ import annotations

import dataclasses
import enum

from rec.embedding.storage_spec import StorageSpec


class ShardingKind(str, enum.Enum):
  """How one table is laid over the mesh (TorchRec / Neo arXiv 2104.05158 names)."""

  DATA_PARALLEL = "dp"   # replicated on every device; gradients all-gathered
  TABLE_WISE = "tw"      # the whole table on one device
  ROW_WISE = "rw"        # rows split evenly (last shard may be shorter) over all devices
  COLUMN_WISE = "cw"     # columns split into chunks, each chunk table-wise
  TABLE_ROW_WISE = "twrw"  # table on one group of devices, rows split within the group
  # DMT's tower groups (arXiv 2403.00877): twrw's layout on its tower's group, ids sent to
  # the group, pooled there and passed through the tower module before leaving it
  SPTT = "sptt"


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
  # How rows are stored (rec/embedding/storage_spec.py); a name such as "int8_cache:lfu:0.05"
  # is parsed into the spec here, once.
  storage: StorageSpec = StorageSpec()

  def __post_init__(self):
    if self.num_rows <= 0:
      raise ValueError(f"table {self.name!r}: num_rows={self.num_rows}, expected > 0")
    if self.dim <= 0:
      raise ValueError(f"table {self.name!r}: dim={self.dim}, expected > 0")
    if self.pooling not in ("sum", "mean"):
      raise ValueError(f"table {self.name!r}: pooling={self.pooling!r}, expected 'sum' or 'mean'")
    if not isinstance(self.storage, StorageSpec):
      object.__setattr__(self, "storage",
                         StorageSpec.parse(self.storage, where=f"table {self.name!r} storage"))
