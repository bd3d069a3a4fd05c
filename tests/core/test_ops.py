"""core.ops.take_columns: values and gradients against plain indexing and jax's autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.ops import take_columns


def _reference(x, idx):
  """Plain indexing of x with a zero column appended (index -1 reads it)."""
  padded = jnp.concatenate([x, jnp.zeros((x.shape[0], 1), x.dtype)], axis=1)
  return padded[:, np.asarray([i if i >= 0 else x.shape[1] for i in idx], np.int64)]


@pytest.mark.parametrize("n,idx", [
    (5, (4, 0, 2)), (5, (-1, 3, -1, 1)), (5, (0, 1, 2, 3, 4)),
    (5, ()),          # nothing selected (a one-feature interaction has no pairs)
    (0, (-1, -1)),    # no column to take: zeros
])
def test_take_columns_values_and_gradient(n, idx):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, n)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, len(idx))), jnp.float32)
  np.testing.assert_array_equal(take_columns(x, idx), _reference(x, idx))
  got = jax.grad(lambda x: jnp.sum(take_columns(x, idx) * w))(x)
  want = jax.grad(lambda x: jnp.sum(_reference(x, idx) * w))(x)
  # each gradient entry is one w value or 0, moved, not summed: exact
  np.testing.assert_array_equal(got, want)


def test_take_columns_names_bad_indices():
  x = jnp.zeros((2, 5), jnp.float32)
  with pytest.raises(ValueError, match=r"indices \[1, 3\] appear more than once"):
    take_columns(x, (3, 1, -1, 1, 3, -1, 0))
  with pytest.raises(ValueError, match=r"must lie in \[-1, 5\), got \[0, 5\]"):
    take_columns(x, (0, 5))
  np.testing.assert_array_equal(take_columns(x + 1, (-1, 2, -1)), [[0, 1, 0]] * 2)
