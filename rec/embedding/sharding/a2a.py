"""The all-to-all exchange of table-wise, column-wise and table-row-wise shards.

Each device holds up to S slots, a slot being one shard (a table, a column chunk or a row
shard). Ids go to the shards' devices by an all-to-all: for each destination, the ids of its
slots [N_dest, B_l, S, L]. Every device pools its slots' rows for the samples of every
source, and an all-to-all sends the pooled partials [N_owner, B_l, S, W] back, where they
are combined: columns placed (cw chunks), row shards summed (twrw). Under `a2a_compression`
the all-to-all of partials is sent compressed (compressed.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from core.ops import take_columns
from rec.embedding.sharding import base


class AllToAllExchange(base.Exchange):
  """Ids to the shards' devices and pooled partials back, both by all-to-all."""

  name = "a2a"
  compressible = True

  def finalize(self) -> None:
    self._combine_maps(*self._slot_maps())

  def _slot_maps(self) -> tuple[np.ndarray, np.ndarray]:
    """Per (device, slot): the local feature, its rows, its local offset; the group's rows
    per device and every shard's offset. Returns the slots' columns (col, ncol), [N, S]."""
    g, N = self.g, self.dev.num_devices
    local_f = {f: i for i, f in enumerate(g.features)}
    slots: list[list[base.Shard]] = [[] for _ in range(N)]
    for sh in g.shards:
      slots[sh.device].append(sh)
    S = max(1, max(len(s) for s in slots))
    feat = np.full((N, S), -1, np.int32)     # local feature index per (device, slot)
    start = np.zeros((N, S), np.int32)
    end = np.zeros((N, S), np.int32)
    offset = np.zeros((N, S), np.int32)
    mean = np.zeros((N, S), bool)
    col = np.zeros((N, S), np.int32)
    ncol = np.zeros((N, S), np.int32)
    rows_dev = np.zeros(N, np.int64)
    shard_off = {}
    for d in range(N):
      acc = 0
      for s, sh in enumerate(slots[d]):
        feat[d, s] = local_f[sh.feature]
        start[d, s], end[d, s], offset[d, s] = sh.row_start, sh.row_end, acc
        mean[d, s] = self.dev.tables[sh.feature].pooling == "mean"
        col[d, s], ncol[d, s] = sh.col_start, sh.col_end - sh.col_start
        shard_off[id(sh)] = acc
        acc += sh.row_end - sh.row_start
      rows_dev[d] = acc
    g.rows_per_device = int(max(1, rows_dev.max()))
    g.offsets = [shard_off[id(sh)] for sh in g.shards]
    g.maps.update(feat=feat, start=start, end=end, offset=offset, mean=mean)
    return col, ncol

  def _combine_maps(self, col: np.ndarray, ncol: np.ndarray) -> None:
    """Combine maps over the flat [B, N*S*W] pooled partials (slot j = d*S + s holds
    feature feat[d, s], columns [col, col + ncol)). When every output column has one
    source (tw, cw) the combine is a pure column selection; row shards (twrw) are placed
    into full width and summed per feature."""
    g, N = self.g, self.dev.num_devices
    feat = g.maps["feat"]
    S, F = feat.shape[1], len(g.features)
    j_feat, j_col, j_ncol = feat.reshape(-1), col.reshape(-1), ncol.reshape(-1)
    sources = np.zeros((F, g.dim), np.int64)
    select = np.full((F, g.dim), -1, np.int64)
    place = np.full((N * S, g.dim), -1, np.int64)
    for j in range(N * S):
      f = j_feat[j]
      if f < 0:
        continue
      cols = np.arange(j_col[j], j_col[j] + j_ncol[j])
      src = j * g.width + np.arange(j_ncol[j])
      sources[f, cols] += 1
      select[f, cols] = src
      place[j, cols] = src
    if (sources == 1).all():
      g.maps["select"] = select.reshape(-1)
    else:
      onehot = np.zeros((N * S, F), np.float32)
      onehot[j_feat >= 0, j_feat[j_feat >= 0]] = 1.0
      g.maps.update(place=place.reshape(-1), combine=onehot)

  def _receive(self, ids, lengths, w=None):
    """This device's batch block -> the ids, lengths and (given `w`) weights of its slots
    from every source, [N_src, B_l, S, ...], by all-to-all."""
    ax = self.dev.axes
    feat_all = jnp.asarray(self.g.maps["feat"])                 # [N, S] (all devices)
    live_slot = feat_all >= 0
    fsel = jnp.maximum(feat_all, 0)
    # Send buffers [N_dest, B_l, S, L]: for each destination, the ids of its slots.
    send_ids = jnp.transpose(ids[:, fsel], (1, 0, 2, 3))
    send_len = jnp.transpose(jnp.where(live_slot[None], lengths[:, fsel], 0), (1, 0, 2))
    r_ids = base.all_to_all0(send_ids, ax)           # [N_src, B_l, S, L]
    r_len = base.all_to_all0(send_len, ax)
    r_w = None if w is None else base.all_to_all0(jnp.transpose(w[:, fsel], (1, 0, 2, 3)), ax)
    return r_ids, r_len, r_w

  @staticmethod
  def _index(r_ids, r_len, maps):
    """(index, valid) [N_src, B_l, S, L]: the local rows of the received ids."""
    start, end, off = maps["start"][0], maps["end"][0], maps["offset"][0]   # [S]
    L = r_ids.shape[-1]
    live = jnp.arange(L) < r_len[..., None]
    valid = live & (r_ids >= start[:, None]) & (r_ids < end[:, None])
    return jnp.where(valid, r_ids - start[:, None] + off[:, None], 0), valid

  def local_ids(self, ids, lengths, maps):
    r_ids, r_len, _ = self._receive(ids, lengths)
    return self._index(r_ids, r_len, maps)

  def local_gather(self, storage, tbl, ids, lengths, w, maps):
    r_ids, r_len, r_w = self._receive(ids, lengths, w)
    index, valid = self._index(r_ids, r_len, maps)
    mean_s = maps["mean"][0]
    coef = base.pool_coef(valid, r_w, r_len, mean_s[None, None, :])
    partial = self.dev.bag_pool(storage, tbl, index, coef, valid)        # [N_src, B_l, S, W]
    n, b = index.shape[:2]
    flat = lambda x: x.reshape((n * b,) + x.shape[2:])
    return flat(partial), flat(coef), flat(index), flat(valid)

  def local_pool(self, partial, send=base.PLAIN):                    # [N_src*B_l, S, W]
    N = self.dev.num_devices
    S = self.g.maps["feat"].shape[1]
    partial = partial.reshape(N, -1, S, self.g.width)
    back = send.all_to_all(partial, self.dev.axes)    # [N_owner, B_l, S, W]
    return self._combine(back)

  def _combine(self, back):
    """The owners' partials [N_owner, B_l, S, W] -> emb [B_l, F, D] (columns placed, row
    shards summed)."""
    g, N = self.g, self.dev.num_devices
    S = g.maps["feat"].shape[1]
    b = back.shape[1]
    flat = jnp.transpose(back, (1, 0, 2, 3)).reshape(b, N * S * g.width)
    F = len(g.features)
    if "select" in g.maps:
      return take_columns(flat, tuple(g.maps["select"].tolist())).reshape(b, F, g.dim)
    placed = take_columns(flat, tuple(g.maps["place"].tolist())).reshape(b, N * S, g.dim)
    return jnp.einsum("bjd,jf->bfd", placed, jnp.asarray(g.maps["combine"]))

  def bound_factors(self, factors):
    """Table-wise bound factors of the rows sent (this device's slots, [1, 1, S]) and of the
    gradient rows coming back (the owners' slots, [N, 1, S]); `factors` is indexed by the
    collection's table order (a trailing 1 for empty slots), the slots by the group's."""
    feat = self.g.maps["feat"]                                      # group-local, -1: none
    table = np.where(feat >= 0, np.asarray(self.g.features)[np.maximum(feat, 0)], -1)
    fac = jnp.asarray(factors[table])                               # [N, S]; -1 -> 1
    me = jax.lax.axis_index(self.dev.axes)
    return fac[me][None, None, :], fac[:, None, :]
