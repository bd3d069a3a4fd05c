"""Table-wise (tw): the whole table on one device, devices[0] of its placement.

Its group runs the all-to-all exchange (a2a.py): every device sends its samples' ids of the
table to the owner, which pools them and sends the pooled sums back.
"""

from __future__ import annotations

from rec.embedding.config import ShardingKind
from rec.embedding.sharding import a2a, base


class TableWise(base.Kind):
  """One shard: every row and column, on the placement's device."""

  kind = ShardingKind.TABLE_WISE
  exchange = a2a.AllToAllExchange

  def shards(self, f, table, devices, num_devices):
    return table.dim, [base.Shard(f, devices[0], 0, table.num_rows, 0, table.dim)]
