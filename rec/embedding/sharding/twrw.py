"""Table-row-wise (twrw): row shards of the table over its group of g devices.

Row shard i of ceil(rows / g) rows (the last shorter) lies on devices[i], a contiguous
block of the mesh. Its group runs the all-to-all exchange (a2a.py): every member receives
all of the table's ids and returns a full-width partial sum of its rows, and the consumer
sums the members' partials per feature.
"""

from __future__ import annotations

from rec.embedding.config import ShardingKind
from rec.embedding.sharding import a2a, base


class TableRowWise(base.Kind):
  """Row shards over the placement's devices (shard i on devices[i])."""

  kind = ShardingKind.TABLE_ROW_WISE
  exchange = a2a.AllToAllExchange

  def shards(self, f, table, devices, num_devices):
    return table.dim, base.row_shards(f, table, devices)
