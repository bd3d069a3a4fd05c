"""Embedding sharding kinds, one module each, behind one interface (base.py).

  dp.py    data-parallel: the whole table on every device; local lookups
  tw.py    table-wise: the whole table on one device          } the all-to-all
  cw.py    column-wise: column chunks on k devices            } exchange of
  twrw.py  table-row-wise: row shards over a group of devices } a2a.py
  rw.py    row-wise: row shards over every device; ids all-gathered, sums reduce-scattered
  sptt.py  DMT's towers: row shards inside a tower group, the tower module run there
  recd.py        RecD: any exchange on a batch's distinct bags, expanded back
  compressed.py  an exchange's pooled partials sent as error-bounded payloads

`KINDS` maps each ShardingKind to its implementation; a new kind is one module (a `Kind`
and, unless it reuses one, its `Exchange`) and one line here.
"""

from __future__ import annotations

from rec.embedding.config import ShardingKind
from rec.embedding.sharding import base, cw, dp, rw, sptt, tw, twrw

KINDS: dict[ShardingKind, base.Kind] = {
    ShardingKind.DATA_PARALLEL: dp.DataParallel(),
    ShardingKind.TABLE_WISE: tw.TableWise(),
    ShardingKind.COLUMN_WISE: cw.ColumnWise(),
    ShardingKind.TABLE_ROW_WISE: twrw.TableRowWise(),
    ShardingKind.ROW_WISE: rw.RowWise(),
    ShardingKind.SPTT: sptt.SPTT(),
}


def get(kind: ShardingKind | str, table: str = "") -> base.Kind:
  """The implementation of `kind`; a ValueError naming the table for an unknown one."""
  try:
    return KINDS[ShardingKind(kind)]
  except (ValueError, KeyError):
    raise ValueError(f"table {table!r}: unknown sharding kind {kind!r}") from None
