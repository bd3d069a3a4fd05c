"""Factorization machines: Rendle's FM (ICDM 2010) and Wukong's optimized FM block (arXiv 2403.02545).

- `fm_interaction`: the second-order FM term sum_{i<j} <v_i, v_j>, computed in O(F D) as
  0.5 * sum_d ((sum_f v_fd)^2 - sum_f v_fd^2).
- `optimized_fm`: Wukong's low-rank FM X X^T Y. X X^T holds every pairwise dot product
  (n x n); the learned Y [n, k] projects it to n x k, and computing X (X^T Y) costs
  O(n d k) instead of O(n^2 d). With k = n and Y = I it is X X^T itself.
- `FactorizationMachineBlock` (FMB): optimized FM -> flatten -> LayerNorm -> MLP ->
  reshape to n_F embeddings of dim D. The paper names no output activation; the MLP ends
  linear (signed embeddings like the LCB's; the layer's LayerNorm follows), and
  `output_relu=True` adds a ReLU on the output, as FuxiCTR's WuKong does.

Letters: B batch, F (= N) input embeddings, D dim, K projection rank, M FMB outputs (n_F).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from rec.layers.mlp import MLP
from rec.layers.params import KERNEL, param


def fm_interaction(emb_BFD):
  """Second-order FM term per example: sum over pairs f < g of <v_f, v_g>, shape [B], in
  the input's dtype.

  Computed in float32 (at least) whatever the input dtype: the O(F D) form subtracts two
  sums of squares, each about F times the result's size for uncorrelated embeddings, so in
  bfloat16 their rounding errors (up to 2^-8 of each) would swamp a small result.
  """
  if emb_BFD.ndim != 3:
    raise ValueError(f"fm_interaction: input {emb_BFD.shape}, expected [B, F, D]")
  e = emb_BFD.astype(jnp.promote_types(emb_BFD.dtype, jnp.float32))
  sum_BD = e.sum(axis=1)
  sum_sq_BD = (e * e).sum(axis=1)
  return (0.5 * (sum_BD * sum_BD - sum_sq_BD).sum(axis=-1)).astype(emb_BFD.dtype)


def optimized_fm(x_BND, y_NK):
  """X X^T Y per example, as X (X^T Y): [B, N, D] x [N, K] -> [B, N, K]."""
  if x_BND.ndim != 3 or y_NK.ndim != 2 or x_BND.shape[1] != y_NK.shape[0]:
    raise ValueError(f"optimized_fm: x {x_BND.shape} and y {y_NK.shape}; expected [B, N, D] "
                     "and [N, K]")
  xty_BDK = jnp.einsum("bnd,nk->bdk", x_BND, y_NK)
  return jnp.einsum("bnd,bdk->bnk", x_BND, xty_BDK)


class LowRankFM(nnx.Module):
  """Wukong's optimized FM with a learned projection Y [N, K]: [B, N, D] -> [B, N, K]."""

  def __init__(self, num_in: int, rank: int, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    if num_in < 1 or rank < 1:
      raise ValueError(f"LowRankFM: num_in={num_in}, rank={rank}; expected >= 1")
    self.num_in, self.rank, self.dtype = num_in, rank, dtype
    self.projection = param(rngs, (num_in, rank), KERNEL, param_dtype=param_dtype)

  def __call__(self, x_BND):
    if x_BND.ndim != 3 or x_BND.shape[1] != self.num_in:
      raise ValueError(f"LowRankFM: input {x_BND.shape}, expected [B, {self.num_in}, D]")
    return optimized_fm(x_BND.astype(self.dtype), self.projection[...].astype(self.dtype))


class FactorizationMachineBlock(nnx.Module):
  """Wukong's FMB: reshape(MLP(LN(flatten(X X^T Y)))): [B, N, D] -> [B, M, D]."""

  def __init__(self, num_in: int, num_out: int, dim: int, rank: int, hidden: Sequence[int],
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
               output_relu: bool = False):
    if num_out < 1 or dim < 1:
      raise ValueError(f"FactorizationMachineBlock: num_out={num_out}, dim={dim}; expected >= 1")
    self.num_out, self.dim = num_out, dim
    self.fm = LowRankFM(num_in, rank, rngs, dtype, param_dtype)
    self.norm = nnx.LayerNorm(num_in * rank, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    # Hidden layers with ReLU; the last layer is linear unless output_relu (the layer's
    # LayerNorm follows).
    self.mlp = MLP(num_in * rank, tuple(hidden) + (num_out * dim,), rngs,
                   activate_last=output_relu, dtype=dtype, param_dtype=param_dtype)

  def __call__(self, x_BND):
    fm_BNK = self.fm(x_BND)
    h = self.mlp(self.norm(fm_BNK.reshape(fm_BNK.shape[0], -1)))
    return h.reshape(h.shape[0], self.num_out, self.dim)
