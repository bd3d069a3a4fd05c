"""Convolutions over the feature axis of an embedding matrix (DHEN's convolution
interaction, arXiv 2203.11014; CCPM / FGCNN-style).

- `FeatureConv1D`: the F embeddings are a length-F sequence with D channels; a width-W
  kernel mixes W neighbouring features across all dims: [B, F, D] -> [B, F, E].
- `FeatureConv2D`: the [F, D] matrix is a one-channel image; C kernels of size
  (W_f, W_d) give C new [F, D] maps, returned as C * F embeddings (channel-major):
  [B, F, D] -> [B, C * F, D].

Both use 'SAME' zero padding (lo = (W - 1) // 2, hi = W - 1 - lo) and stride 1, so the
feature count is kept; cross-correlation, as every deep-learning conv.

Letters: B batch, F embeddings, D dim, E output dim, C channels, W kernel width.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rec.layers.params import BIAS, glorot_normal, zeros


class FeatureConv1D(nnx.Module):
  """1-D convolution along the features, embedding dims as channels: [B, F, D] -> [B, F, E]."""

  def __init__(self, dim: int, kernel_size: int, rngs: nnx.Rngs, out_dim: int | None = None,
               dtype=jnp.float32, param_dtype=jnp.float32):
    out_dim = dim if out_dim is None else out_dim
    if min(dim, kernel_size, out_dim) < 1:
      raise ValueError(f"FeatureConv1D: dim={dim}, kernel_size={kernel_size}, out_dim={out_dim}; "
                       "expected all >= 1")
    self.dim = dim
    self.conv = nnx.Conv(
        dim, out_dim, kernel_size=(kernel_size,), padding="SAME",
        kernel_init=nnx.with_partitioning(glorot_normal, (None, "mlp_in", "mlp_out"),
                                          eager_sharding=False),
        bias_init=nnx.with_partitioning(zeros, BIAS, eager_sharding=False),
        dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x_BFD):
    if x_BFD.ndim != 3 or x_BFD.shape[-1] != self.dim:
      raise ValueError(f"FeatureConv1D: input {x_BFD.shape}, expected [B, F, {self.dim}]")
    return self.conv(x_BFD)


class FeatureConv2D(nnx.Module):
  """2-D convolution over the [F, D] matrix with C channels: [B, F, D] -> [B, C * F, D]."""

  def __init__(self, kernel_size: tuple[int, int], channels: int, rngs: nnx.Rngs,
               dtype=jnp.float32, param_dtype=jnp.float32):
    kernel_size = tuple(int(k) for k in kernel_size)
    if len(kernel_size) != 2 or min(kernel_size) < 1 or channels < 1:
      raise ValueError(f"FeatureConv2D: kernel_size={kernel_size}, channels={channels}; expected "
                       "two widths >= 1 and channels >= 1")
    self.channels = channels
    self.conv = nnx.Conv(
        1, channels, kernel_size=kernel_size, padding="SAME",
        kernel_init=nnx.with_partitioning(glorot_normal, (None, None, "mlp_in", "mlp_out"),
                                          eager_sharding=False),
        bias_init=nnx.with_partitioning(zeros, BIAS, eager_sharding=False),
        dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x_BFD):
    if x_BFD.ndim != 3:
      raise ValueError(f"FeatureConv2D: input {x_BFD.shape}, expected [B, F, D]")
    b, f, d = x_BFD.shape
    y_BFDC = self.conv(x_BFD[..., None])
    return jnp.moveaxis(y_BFDC, -1, 1).reshape(b, self.channels * f, d)
