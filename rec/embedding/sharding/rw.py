"""Row-wise (rw): row shard d of ceil(rows / N) rows on device d, every device.

Ids are all-gathered: every row shard may own any id, the static-shape form of TorchRec's
bucketized all-to-all. Each device sums the rows of its own shards for every sample of the
global batch, and the partial pooled sums [B_g, F, W] are reduce-scattered back to the
samples' devices (an all-gather of their gradients backward). Under `a2a_compression` the
reduce-scatter is sent compressed (compressed.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rec.embedding.config import ShardingKind
from rec.embedding.sharding import base


def rowwise_gather(dev: base.Devices, storage, tbl, ids, lengths, w, maps, mean, axes):
  """The rw path over the devices of `axes`: each sees all their ids (all-gather) and sums
  the rows of its own row shards; the pool reduce-scatters the sums back over the same axes
  (rw over every device, sptt inside a tower group)."""
  if axes:
    ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)     # [B_g, F, L]
    lengths = jax.lax.all_gather(lengths, axes, axis=0, tiled=True)
    w = jax.lax.all_gather(w, axes, axis=0, tiled=True)
  index, valid = _rowwise_index(ids, lengths, maps)
  coef = base.pool_coef(valid, w, lengths, mean)
  return dev.bag_pool(storage, tbl, index, coef, valid), coef, index, valid


def rowwise_ids(ids, lengths, maps, axes):
  """`rowwise_gather`'s id phase alone: (index, valid) of the local rows read."""
  if axes:
    ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)
    lengths = jax.lax.all_gather(lengths, axes, axis=0, tiled=True)
  return _rowwise_index(ids, lengths, maps)


def _rowwise_index(ids, lengths, maps):
  start, end, off = maps["start"][0], maps["end"][0], maps["offset"][0]   # [F]
  L = ids.shape[-1]
  live = jnp.arange(L) < lengths[..., None]
  valid = live & (ids >= start[None, :, None]) & (ids < end[None, :, None])
  return jnp.where(valid, ids - start[None, :, None] + off[None, :, None], 0), valid


class RowWiseExchange(base.Exchange):
  """All-gather of ids, reduce-scatter of partial sums, over every embedding device."""

  name = "rw"
  compressible = True

  def finalize(self) -> None:
    """Every device holds one row shard of every feature, at the same local offsets."""
    g, N = self.g, self.dev.num_devices
    F = len(g.features)
    local_f = {f: i for i, f in enumerate(g.features)}
    per_f = {}
    for sh in g.shards:
      per_f.setdefault(sh.feature, []).append(sh)
    shard_rows = [-(-self.dev.tables[f].num_rows // N) for f in g.features]
    offs = np.concatenate([[0], np.cumsum(shard_rows)[:-1]]).astype(np.int32)
    g.rows_per_device = int(sum(shard_rows))
    start = np.zeros((N, F), np.int32)
    end = np.zeros((N, F), np.int32)
    for f in g.features:
      for sh in per_f[f]:
        start[sh.device, local_f[f]] = sh.row_start
        end[sh.device, local_f[f]] = sh.row_end
    g.offsets = [int(offs[local_f[sh.feature]]) for sh in g.shards]
    g.maps.update(start=start, end=end, offset=np.broadcast_to(offs, (N, F)).copy())

  def local_gather(self, storage, tbl, ids, lengths, w, maps):
    return rowwise_gather(self.dev, storage, tbl, ids, lengths, w, maps,
                          jnp.asarray(self.mean())[None, :], self.dev.axes)

  def local_ids(self, ids, lengths, maps):
    return rowwise_ids(ids, lengths, maps, self.dev.axes)

  def local_pool(self, partial, send=base.PLAIN):                   # [B_g, F, W]
    return send.reduce_scatter(partial, self.dev.axes)

  def bound_factors(self, factors):
    """Table-wise bound factors of the rows sent and of the gradient rows back: [F] each."""
    fac = jnp.asarray(factors[np.asarray(self.g.features)])         # [F]
    return fac, fac


class RowWise(base.Kind):
  """Row shards over all N devices (shard d on device d)."""

  kind = ShardingKind.ROW_WISE
  exchange = RowWiseExchange

  def shards(self, f, table, devices, num_devices):
    return table.dim, base.row_shards(f, table, range(num_devices))
