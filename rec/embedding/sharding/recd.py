"""RecD (arXiv 2211.05239): a group looked up on a batch's distinct bags, expanded back.

`Deduplicated` wraps any exchange: given a batch's distinct bags (`SparseBatch.dedup`,
rec/data/dedup.py), its gather runs on each batch shard's C_l distinct bags instead of its
B_l samples (the exchange moves C_l / B_l of the ids and partial sums), and its pool expands
the pooled vectors back to the samples by the inverse indices, a local gather whose gradient
sums the samples' gradients per distinct bag. Without distinct bags the group reads the
samples' own bags (the plain path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


class Deduplicated:
  """`inner` (an exchange, possibly wrapped) on distinct bags; every other method is the
  inner exchange's."""

  def __init__(self, inner):
    self.inner = inner

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def inputs(self, ids, lengths, weights, distinct=None):
    """distinct: (ids, lengths, weights, inverse) of the distinct-bag block [C, F_d, ...]
    and {feature: its column there}; None: the samples' bags."""
    if distinct is None:
      return self.inner.inputs(ids, lengths, weights)
    d_ids, d_len, d_w, inverse, col = distinct
    sel = np.asarray([col[f] for f in self.inner.g.features])
    return self.inner._columns(d_ids, d_len, d_w, sel) + (inverse[:, sel],)

  def pool(self, partial, step=None, inverse=None):
    emb = self.inner.pool(partial, step)
    return emb if inverse is None else self._expand(emb, inverse)

  def _expand(self, emb_CFW, inverse_BF):
    """emb_BFW[b, f] = emb_CFW[inverse[b, f], f] on each device's own block (no
    communication); the gradient sums the samples' rows per distinct bag."""
    def local(e_CFW, inv_BF):
      return jnp.take_along_axis(e_CFW, inv_BF[..., None], axis=0)
    spec = P(self.inner.dev.axes)
    return jax.shard_map(local, mesh=self.inner.dev.mesh, in_specs=(spec, spec),
                         out_specs=spec, check_vma=False)(emb_CFW, inverse_BF)
