"""Multi-head self-attention across feature embeddings (AutoInt, arXiv 1810.11921; DHEN's
self-attention interaction, arXiv 2203.11014).

The F embeddings of one example are the "tokens": each attends to all F (no mask, no
positions; the feature order carries no meaning the model should use). softmax runs in
float32 whatever the activation dtype.

Letters: B batch, F embeddings, D input dim, H heads, K head dim, E output dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rec.layers.params import KERNEL, param


def self_attention(x_BFD, wq_DHK, wk_DHK, wv_DHK, wo_HKE):
  """softmax(Q K^T / sqrt(K)) V per head, heads concatenated, then out-projected: [B, F, E]."""
  q = jnp.einsum("bfd,dhk->bfhk", x_BFD, wq_DHK)
  k = jnp.einsum("bfd,dhk->bfhk", x_BFD, wk_DHK)
  v = jnp.einsum("bfd,dhk->bfhk", x_BFD, wv_DHK)
  scores_BHFG = jnp.einsum("bfhk,bghk->bhfg", q, k).astype(jnp.float32)
  scores_BHFG = scores_BHFG / jnp.sqrt(jnp.float32(q.shape[-1]))
  probs_BHFG = jax.nn.softmax(scores_BHFG, axis=-1).astype(x_BFD.dtype)
  o_BFHK = jnp.einsum("bhfg,bghk->bfhk", probs_BHFG, v)
  return jnp.einsum("bfhk,hke->bfe", o_BFHK, wo_HKE)


class SelfAttentionInteraction(nnx.Module):
  """Multi-head self-attention over the F embeddings: [B, F, D] -> [B, F, E]."""

  def __init__(self, dim: int, num_heads: int, head_dim: int, rngs: nnx.Rngs,
               out_dim: int | None = None, dtype=jnp.float32, param_dtype=jnp.float32):
    out_dim = dim if out_dim is None else out_dim
    if min(dim, num_heads, head_dim, out_dim) < 1:
      raise ValueError(f"SelfAttentionInteraction: dim={dim}, num_heads={num_heads}, "
                       f"head_dim={head_dim}, out_dim={out_dim}; expected all >= 1")
    self.dim, self.dtype = dim, dtype
    # Kernels are stored 2-D ([D, H*K], [H*K, E]) so the ("mlp_in", "mlp_out") rules
    # apply unchanged; they are viewed per head in __call__.
    self.num_heads, self.head_dim = num_heads, head_dim
    hk = num_heads * head_dim
    self.query = param(rngs, (dim, hk), KERNEL, param_dtype=param_dtype)
    self.key = param(rngs, (dim, hk), KERNEL, param_dtype=param_dtype)
    self.value = param(rngs, (dim, hk), KERNEL, param_dtype=param_dtype)
    self.out = param(rngs, (hk, out_dim), KERNEL, param_dtype=param_dtype)

  def __call__(self, x_BFD):
    if x_BFD.ndim != 3 or x_BFD.shape[-1] != self.dim:
      raise ValueError(f"SelfAttentionInteraction: input {x_BFD.shape}, expected [B, F, {self.dim}]")
    dt, d, h, k = self.dtype, self.dim, self.num_heads, self.head_dim
    wq, wk, wv = (p[...].astype(dt).reshape(d, h, k) for p in (self.query, self.key, self.value))
    return self_attention(x_BFD.astype(dt), wq, wk, wv, self.out[...].astype(dt).reshape(h, k, -1))
