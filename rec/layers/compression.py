"""Linear compression of feature embeddings: n_in embeddings -> n_out learned mixtures.

Wukong's Linear Compression Block (LCB, arXiv 2403.02545) and DHEN's "linear"
interaction (arXiv 2203.11014): Y = W^T X with X [n_in, D] and W [n_in, n_out], the
same mixing for every embedding dimension. It recombines embeddings without raising
the interaction order, and doubles as the residual projection where widths differ.

Letters: B batch, F input embeddings (n_in), N output embeddings (n_out), D dim.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rec.layers.params import KERNEL, param


def linear_compression(x_BFD, w_FN):
  """out[b, n, d] = sum_f x[b, f, d] w[f, n]: [B, F, D] x [F, N] -> [B, N, D]."""
  if x_BFD.ndim != 3 or w_FN.ndim != 2 or x_BFD.shape[1] != w_FN.shape[0]:
    raise ValueError(f"linear_compression: x {x_BFD.shape} and w {w_FN.shape}; expected "
                     "[B, F, D] and [F, N]")
  return jnp.einsum("bfd,fn->bnd", x_BFD, w_FN)


class LinearCompression(nnx.Module):
  """[B, F, D] -> [B, N, D] through a learned [F, N] matrix (no bias, as in Wukong's LCB)."""

  def __init__(self, num_in: int, num_out: int, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    if num_in < 1 or num_out < 1:
      raise ValueError(f"LinearCompression: num_in={num_in}, num_out={num_out}; expected >= 1")
    self.num_in, self.num_out, self.dtype = num_in, num_out, dtype
    self.kernel = param(rngs, (num_in, num_out), KERNEL, param_dtype=param_dtype)

  def __call__(self, x_BFD):
    if x_BFD.ndim != 3 or x_BFD.shape[1] != self.num_in:
      raise ValueError(f"LinearCompression: input {x_BFD.shape}, expected [B, {self.num_in}, D]")
    return linear_compression(x_BFD.astype(self.dtype), self.kernel[...].astype(self.dtype))
