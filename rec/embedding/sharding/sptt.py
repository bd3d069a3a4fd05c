"""SPTT: DMT's semantic-preserving tower transform (arXiv 2403.00877).

Tower t's tables lie row-wise on the G devices of tower group t (the mesh axes of the
logical name "emb_tower" pick the group, those of "emb_tower_shard" the device in it): twrw's
layout on the tower group, device (t, i) holding row shard i of each of tower t's tables in
tower slots 0..F_t-1. Ids go to their tower's group by an all-to-all over the tower axes,
then the rw path runs inside the group (all-gather of ids, reduce-scatter of partial sums
over the group's axes); `pool_towers` applies the model's tower module there and sends its
compressed [B, K, D] output back by an all-to-all over the tower axes. Without a tower module
`local_pool` gives the embeddings, emb_BFD like every other kind.

Letters: T towers of G devices, Fm tower slots (the largest tower's features), K outputs of
a tower module; B_l, W, N as in base.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from core import mesh as mesh_lib
from core.ops import take_columns
from rec.embedding.config import ShardingKind, TableConfig
from rec.embedding.sharding import base, rw


@dataclasses.dataclass(frozen=True)
class Towers:
  """Which tables form which tower (tower t on group t's devices), over which mesh axes."""

  features: tuple[tuple[int, ...], ...]   # tower t's features, in table order
  axes: tuple[str, ...]                   # "emb_tower": which group
  shard_axes: tuple[str, ...]             # "emb_tower_shard": which device in the group
  size: int                               # G devices per group

  @property
  def num(self) -> int:
    return len(self.features)


def towers_of(tables: Sequence[TableConfig], plan: Mapping[str, Any], mesh: Mesh,
              rules: mesh_lib.Rules, axes: tuple[str, ...], num_devices: int,
              dedup_features: Sequence[int]) -> Towers | None:
  """The towers of a collection's plan (None without sptt tables), after checking that every
  table is sptt, each on one whole tower group, every group holding a tower."""
  sptt = [t.name for t in tables if ShardingKind(plan[t.name].kind) == ShardingKind.SPTT]
  if not sptt:
    return None
  names = [t.name for t in tables]
  if len(sptt) != len(names):
    raise ValueError(f"sptt places every table by tower, but tables "
                     f"{[n for n in names if n not in sptt]} are placed otherwise")
  tower_axes = mesh_lib.mesh_axes("emb_tower", rules, mesh)
  shard_axes = mesh_lib.mesh_axes("emb_tower_shard", rules, mesh)
  if tower_axes + shard_axes != axes:
    raise ValueError(
        f"sptt: the tower axes {tower_axes} (logical 'emb_tower') and the in-group axes "
        f"{shard_axes} ('emb_tower_shard') must together be the embedding axes "
        f"{axes}, in that order")
  T = math.prod(mesh.shape[a] for a in tower_axes)
  G = num_devices // T
  towers: list[list[int]] = [[] for _ in range(T)]
  for f, t in enumerate(tables):
    devs = plan[t.name].devices
    if devs != tuple(range(devs[0] // G * G, devs[0] // G * G + G)):
      raise ValueError(
          f"table {t.name!r}: sptt on devices {devs}; expected one whole tower group "
          f"(tower t on devices {G}t..{G}t+{G - 1}: {T} groups of {G} over mesh axes "
          f"{tower_axes} x {shard_axes})")
    towers[devs[0] // G].append(f)
  empty = [t for t in range(T) if not towers[t]]
  if empty:
    raise ValueError(f"sptt: tower groups {empty} of {T} hold no table; the mesh's "
                     f"{T} tower groups (axes {tower_axes}) need one tower each")
  both = [names[f] for f in dedup_features]
  if both:
    raise ValueError(f"tables {both}: RecD dedup and sptt do not combine (a tower module "
                     "mixes features whose samples share no distinct bags)")
  return Towers(tuple(tuple(t) for t in towers), tower_axes, shard_axes, G)


def check_groups(groups: Mapping[str, base.Group]) -> None:
  """A tower module sees all of its tower's features: the sptt tables form one group."""
  if sum(g.comm == SPTTExchange.name for g in groups.values()) > 1:
    raise ValueError("sptt tables must share storage, dim and bag size (one group): a tower "
                     f"module sees all of its tower's features; groups {list(groups)}")


class SPTTExchange(base.Exchange):
  """Ids to the tower's group (all-to-all over the tower axes), the rw path inside it."""

  name = "sptt"

  def finalize(self) -> None:
    """Device (t, i) holds row shard i of each of tower t's tables, in tower slots
    0..F_t-1 (the tower's features in table order), at the same local offsets on the
    group."""
    g, N, tw = self.g, self.dev.num_devices, self.dev.towers
    T, G = tw.num, tw.size
    local_f = {f: i for i, f in enumerate(g.features)}
    tower = {f: t for t, fs in enumerate(tw.features) for f in fs}
    slots = [[f for f in g.features if tower[f] == t] for t in range(T)]
    Fm = max(len(fs) for fs in slots)
    feat = np.full((T, Fm), -1, np.int32)          # group-local feature per tower slot
    start = np.zeros((N, Fm), np.int32)
    end = np.zeros((N, Fm), np.int32)
    offset = np.zeros((N, Fm), np.int32)
    mean = np.zeros((N, Fm), bool)
    slot_offset, rows = {}, 0
    for t, fs in enumerate(slots):
      acc = 0
      for j, f in enumerate(fs):
        R = self.dev.tables[f].num_rows
        s = -(-R // G)
        feat[t, j] = local_f[f]
        slot_offset[f] = acc
        for i in range(G):
          d = t * G + i
          start[d, j], end[d, j] = min(i * s, R), min((i + 1) * s, R)
          offset[d, j], mean[d, j] = acc, self.dev.tables[f].pooling == "mean"
        acc += s
      rows = max(rows, acc)
    g.rows_per_device = max(1, rows)
    g.offsets = [slot_offset[sh.feature] for sh in g.shards]
    # Where group feature j's vector sits among the T * Fm tower slots (pool without towers).
    where = [tower[f] * Fm + slots[tower[f]].index(f) for f in g.features]
    g.maps.update(tower_feat=feat, start=start, end=end, offset=offset, mean=mean,
                  slot=np.asarray(where, np.int32))

  def _to_towers(self, *xs):
    """This device's batch block's ids, lengths (, weights) -> those of its tower's slots
    from every tower group's samples, [T * B_l, Fm, ...] (all-to-all over the tower axes)."""
    tw = self.dev.towers
    feat = self.g.maps["tower_feat"]                            # [T, Fm]
    fsel, live_slot = np.maximum(feat, 0), feat >= 0
    ids, lengths, *w = xs
    send = [jnp.swapaxes(ids[:, fsel], 0, 1),                   # [T_dest, B_l, Fm, L]
            jnp.swapaxes(jnp.where(live_slot[None], lengths[:, fsel], 0), 0, 1)]
    send += [jnp.swapaxes(x[:, fsel], 0, 1) for x in w]
    if tw.axes:                                                 # [T_src, B_l, Fm, ...]
      send = [base.all_to_all0(x, tw.axes) for x in send]
    return [x.reshape((-1,) + x.shape[2:]) for x in send]      # [T * B_l, Fm, ...]

  def local_gather(self, storage, tbl, ids, lengths, w, maps):
    """Ids to their tower's group (all-to-all over the tower axes), then the rw path inside
    the group: [G * T * B_l, Fm, ...] per device."""
    t_ids, t_len, t_w = self._to_towers(ids, lengths, w)
    return rw.rowwise_gather(self.dev, storage, tbl, t_ids, t_len, t_w, maps,
                             maps["mean"][0][None, :], self.dev.towers.shard_axes)

  def local_ids(self, ids, lengths, maps):
    t_ids, t_len = self._to_towers(ids, lengths)
    return rw.rowwise_ids(t_ids, t_len, maps, self.dev.towers.shard_axes)

  def local_pool(self, partial, send=base.PLAIN):
    """Without a tower module: each feature's pooled vector, [B_l, F, W] in group order."""
    g = self.g
    out = self.tower_out(partial, None, None)                       # [B_l, T, Fm, W]
    b, W = out.shape[0], g.width
    cols = tuple(int(s) * W + c for s in g.maps["slot"] for c in range(W))
    return take_columns(out.reshape(b, -1), cols).reshape(b, len(g.features), W)

  def tower_out(self, partial, fn, params):
    """Partial sums [G * T * B_l, Fm, W] -> reduce-scatter in the group -> tower module
    (if any) -> all-to-all over the tower axes: [B_l, T, K, W] for this device's samples."""
    tw = self.dev.towers
    emb = partial
    if tw.shard_axes:                                               # [T * B_l, Fm, W]
      emb = jax.lax.psum_scatter(partial, tw.shard_axes, scatter_dimension=0, tiled=True)
    if fn is not None:
      t = jax.lax.axis_index(tw.axes) if tw.axes else 0
      emb = fn(params, t, emb)                                      # [T * B_l, K, W]
    x = emb.reshape((tw.num, -1) + emb.shape[1:])                   # [T_src, B_l, K, W]
    if tw.axes:
      x = base.all_to_all0(x, tw.axes)                              # [T_tower, B_l, K, W]
    return jnp.swapaxes(x, 0, 1)

  def pool_towers(self, partial, fn: Callable[..., jax.Array], params):
    """fn(params, t, emb [b, Fm, D]) -> [b, K, D], tower t's module on its slots (t is
    traced: the device's tower), run inside each tower group -> [B, T * K, D]."""
    bspec = P(self.dev.axes)
    f = jax.shard_map(lambda x, p: self.tower_out(x, fn, p), mesh=self.dev.mesh,
                      in_specs=(bspec, jax.tree.map(lambda _: P(), params)),
                      out_specs=bspec, check_vma=False)
    out = f(partial, params)                                        # [B, T, K, D]
    return out.reshape(out.shape[0], -1, out.shape[-1])


class SPTT(base.Kind):
  """Row shards over the table's tower group (shard i on devices[i])."""

  kind = ShardingKind.SPTT
  exchange = SPTTExchange

  def shards(self, f, table, devices, num_devices):
    return table.dim, base.row_shards(f, table, devices)
