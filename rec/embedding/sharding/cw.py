"""Column-wise (cw): the table's columns in k = len(devices) chunks, chunk i on devices[i].

Chunks are ceil(dim / k) columns wide, the last possibly narrower; every chunk is stored
ceil(dim / k) wide. Its group runs the all-to-all exchange (a2a.py): ids go to every chunk's
device, and the owners' pooled chunks come back and are placed side by side into dim columns
(a column selection: each output column has one source). A row-wise optimizer keeps one
accumulator per row per chunk, as TorchRec does.
"""

from __future__ import annotations

from rec.embedding.config import ShardingKind
from rec.embedding.sharding import a2a, base


class ColumnWise(base.Kind):
  """Column chunks of every row, one per placement device."""

  kind = ShardingKind.COLUMN_WISE
  exchange = a2a.AllToAllExchange

  def shards(self, f, table, devices, num_devices):
    width = -(-table.dim // len(devices))
    return width, [base.Shard(f, d, 0, table.num_rows, i * width, min((i + 1) * width, table.dim))
                   for i, d in enumerate(devices) if i * width < table.dim]
