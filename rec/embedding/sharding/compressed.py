"""The compressed exchange (arXiv 2407.04272): an exchange whose pooled partials travel as
error-bounded payloads.

`Compressed` wraps an exchange that sends its partials through a `Send` (a2a's all-to-all,
rw's reduce-scatter): the partials and, transposed, their gradients are sent as
error-bounded fixed-rate payloads (rec/embedding/a2a_compression.py); an exchange where some
value cannot meet its bound falls back to float32 as a whole. A row's bound is the setting's
bound times its table's factor (table-wise) times the step's factor (iteration-wise, from
`pool(..., step=)`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rec.embedding import a2a_compression as a2a_lib
from rec.embedding.sharding import base


@dataclasses.dataclass(frozen=True)
class CompressedSend(base.Send):
  """A Send whose collectives are compressed, with rows' table-wise factors fac_fwd (rows
  sent) and fac_bwd (gradient rows coming back), broadcast to the rows."""

  comp: a2a_lib.A2ACompression
  scale: Any              # iteration-wise factor (a traced scalar)
  fac_fwd: Any
  fac_bwd: Any
  num_devices: int

  def _bounds(self, rows_fwd, rows_bwd):
    comp = self.comp
    eb_f = jnp.broadcast_to(comp.bound * self.scale * self.fac_fwd, rows_fwd)
    eb_b = None
    if comp.grad_bound is not None:
      eb_b = jnp.broadcast_to(comp.grad_bound * self.scale * self.fac_bwd, rows_bwd)
    return eb_f, eb_b

  def all_to_all(self, x, axes):                    # [N, B_l, S, W]
    eb_f, eb_b = self._bounds(x.shape[:-1], x.shape[:-1])
    with jax.named_scope(a2a_lib.EXCHANGE_SCOPE):
      return a2a_lib.all_to_all(x, eb_f, eb_b, self.comp, axes)

  def reduce_scatter(self, x, axes):                # [B_g, F, W]
    rows = x.shape[:-1]
    eb_f, eb_b = self._bounds(rows, (rows[0] // self.num_devices,) + rows[1:])
    with jax.named_scope(a2a_lib.EXCHANGE_SCOPE):
      return a2a_lib.reduce_scatter(x, eb_f, eb_b, self.comp, axes)


class Compressed:
  """`inner` (a compressible exchange) with its pool's collectives compressed by `comp`;
  every other method is the inner exchange's."""

  def __init__(self, inner: base.Exchange, comp: a2a_lib.A2ACompression, table_names):
    if not inner.compressible:
      raise ValueError(f"group {inner.g.name!r}: the {inner.name} exchange is not compressible")
    self.inner, self.comp = inner, comp
    # Table-wise bound factor per feature index, with a trailing 1 for padding slots (-1).
    self.factors = np.append(comp.factors(list(table_names)), np.float32(1.0))

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def pool(self, partial, step=None, inverse=None):
    """The inner exchange's pool, sent compressed under the bound of `step` (None: 0)."""
    inner = self.inner
    if inverse is not None:
      raise ValueError(f"group {inner.g.name!r}: distinct bags for a group without dedup")

    def local(x, scale):
      fac_fwd, fac_bwd = inner.bound_factors(self.factors)
      send = CompressedSend(self.comp, scale, fac_fwd, fac_bwd, inner.dev.num_devices)
      return inner.local_pool(x, send)

    scale = self.comp.schedule.factor(0 if step is None else step)
    bspec = P(inner.dev.axes)
    f = jax.shard_map(local, mesh=inner.dev.mesh, in_specs=(bspec, P()), out_specs=bspec,
                      check_vma=False)
    return f(partial, scale)
