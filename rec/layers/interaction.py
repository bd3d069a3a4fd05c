"""Feature interactions of DLRM (arXiv 1906.00091): pairwise dot products and plain concat.

Letters: B batch, D embedding dim, F sparse features, N = F + 1 vectors (dense + F),
P pairwise products: N (N - 1) / 2, or N (N + 1) / 2 with self-interaction.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from core.ops import take_columns


def tril_indices(n: int, self_interaction: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Row and column of each kept pair, in the DLRM reference order.

  The reference builds `[(i, j) for i in range(n) for j in range(i + offset)]`: row by
  row, strictly below the diagonal (offset 0) or including it (offset 1).
  """
  offset = 1 if self_interaction else 0
  pairs = [(i, j) for i in range(n) for j in range(i + offset)]
  li = np.array([i for i, _ in pairs], np.int32)
  lj = np.array([j for _, j in pairs], np.int32)
  return li, lj


def num_dot_outputs(num_vectors: int, self_interaction: bool = False) -> int:
  """P: number of pairwise products among num_vectors vectors."""
  n = num_vectors
  return n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2


def dot_interaction(dense_BD, emb_BFD, self_interaction: bool = False):
  """DLRM dot interaction: [dense, Z_flat] of shape [B, D + P].

  z = [dense, emb_1, ..., emb_F] stacked to [B, N, D]; Z = z z^T; Z_flat keeps the
  lower triangle in the reference's order. With dense_BD None (no dense features) the
  vectors are the F embeddings only and the output is just Z_flat, [B, P].
  """
  if dense_BD is None:
    z_BND = emb_BFD
  else:
    if dense_BD.shape[-1] != emb_BFD.shape[-1]:
      raise ValueError(f"dot_interaction: dense dim {dense_BD.shape[-1]} != embedding dim "
                       f"{emb_BFD.shape[-1]}; the bottom MLP must end at the embedding dim")
    z_BND = jnp.concatenate([dense_BD[:, None, :], emb_BFD], axis=1)
  z_BNN = jnp.einsum("bnd,bmd->bnm", z_BND, z_BND)
  n = z_BND.shape[1]
  li, lj = tril_indices(n, self_interaction)
  flat_BP = take_columns(z_BNN.reshape(z_BNN.shape[0], n * n), tuple((li * n + lj).tolist()))
  if dense_BD is None:
    return flat_BP
  return jnp.concatenate([dense_BD, flat_BP], axis=1)


def cat_interaction(dense_BD, emb_BFD):
  """Plain concatenation [dense, emb_1, ..., emb_F]: [B, D + F * D] (dense may be None)."""
  flat = emb_BFD.reshape(emb_BFD.shape[0], -1)
  if dense_BD is None:
    return flat
  return jnp.concatenate([dense_BD, flat], axis=1)
