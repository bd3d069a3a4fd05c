"""Small array ops whose autodiff transposes are gathers, not scatter-adds.

A gather with static indices transposes to a scatter-add, which XLA runs as a slow
serial loop on CPU. When the indices are static and distinct, the transpose is itself a
gather (each input column reads the output column that took it, or zero), so
`take_columns` defines it that way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _with_zero_column(x):
  # (zeros of shape [B, 1], also when x has no column: an empty selection's gradient)
  return jnp.concatenate([x, jnp.zeros((x.shape[0], 1), x.dtype)], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def take_columns(x_BN: jax.Array, idx: tuple[int, ...]) -> jax.Array:
  """out[:, k] = x[:, idx[k]], or 0 where idx[k] == -1; static idx, distinct when >= 0."""
  n = x_BN.shape[1]
  sel = np.asarray(idx, np.int64)
  if sel.size and (sel.max() >= n or sel.min() < -1):
    raise ValueError(f"take_columns: indices must lie in [-1, {n}), got [{sel.min()}, {sel.max()}]")
  taken, counts = np.unique(sel[sel >= 0], return_counts=True)
  if (counts > 1).any():
    raise ValueError(f"take_columns: indices {taken[counts > 1].tolist()} appear more than "
                     "once; expected distinct non-negative indices (-1 may repeat)")
  if (sel >= 0).all():
    return x_BN[:, sel]
  return _with_zero_column(x_BN)[:, np.where(sel < 0, n, sel)]


def _take_columns_fwd(x_BN, idx):
  return take_columns(x_BN, idx), x_BN.shape[1]


def _take_columns_bwd(idx, n, g_BK):
  sel = np.asarray(idx, np.int64)
  inv = np.full(n, len(sel), np.int64)      # untaken columns read the appended zero column
  inv[sel[sel >= 0]] = np.nonzero(sel >= 0)[0]
  if (inv < len(sel)).all():
    return (g_BK[:, inv],)
  return (_with_zero_column(g_BK)[:, inv],)


take_columns.defvjp(_take_columns_fwd, _take_columns_bwd)
