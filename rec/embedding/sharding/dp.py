"""Data-parallel (dp): every device holds the whole table.

Lookups are local, with no forward communication: each device gathers the rows of its own
samples' ids and pools them. An id outside its table's rows (a batch that skipped
`check_ids`) reads nothing, as under every other kind, rather than a row of the next table
in the buffer. The update all-gathers (ids, gradients) so that every replica
applies the same exact update to its copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rec.embedding.config import ShardingKind
from rec.embedding.sharding import base


class DataParallelExchange(base.Exchange):
  """Replicated buffers: local lookups, all-gathered updates."""

  name = "dp"
  replicated = True

  def finalize(self) -> None:
    g = self.g
    offs, acc = [], 0
    for sh in g.shards:
      offs.append(acc)
      acc += sh.row_end - sh.row_start
    g.offsets, g.rows_per_device = offs, acc
    g.maps["offset"] = np.asarray(offs, np.int32)                     # [F]
    g.maps["end"] = np.asarray([sh.row_end for sh in g.shards], np.int32)   # [F] rows

  def local_ids(self, ids, lengths, maps):
    L = ids.shape[-1]
    live = ((jnp.arange(L) < lengths[..., None])               # [B_l, F, L]
            & (ids >= 0) & (ids < maps["end"][None, :, None]))
    return jnp.where(live, ids + maps["offset"][None, :, None], 0), live

  def local_gather(self, storage, tbl, ids, lengths, w, maps):
    index, live = self.local_ids(ids, lengths, maps)
    coef = base.pool_coef(live, w, lengths, jnp.asarray(self.mean())[None, :])
    return self.dev.bag_pool(storage, tbl, index, coef, live), coef, index, live

  def local_pool(self, partial, send=base.PLAIN):
    return partial

  def prefetch_ids(self, index, valid):
    """Replicas admit the same rows: everyone's."""
    ax = self.dev.axes
    return (jax.lax.all_gather(index, ax, axis=0, tiled=True),
            jax.lax.all_gather(valid, ax, axis=0, tiled=True))

  def update_rows(self, index, valid, grads):
    """Replicas apply the same update from everyone's ids."""
    ax = self.dev.axes
    index = jax.lax.all_gather(index, ax, axis=0, tiled=True)
    valid = jax.lax.all_gather(valid, ax, axis=0, tiled=True)
    grads = jax.lax.all_gather(grads, ax, axis=0, tiled=True)
    return index, valid, grads

  def sum_dense(self, rows):
    return jax.lax.psum(rows, self.dev.axes)


class DataParallel(base.Kind):
  """The whole table, replicated."""

  kind = ShardingKind.DATA_PARALLEL
  exchange = DataParallelExchange

  def shards(self, f, table, devices, num_devices):
    return table.dim, [base.Shard(f, -1, 0, table.num_rows, 0, table.dim)]
