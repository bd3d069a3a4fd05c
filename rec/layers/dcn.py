"""DCN-v2 cross layers (Wang et al., arXiv 2008.13535): explicit bounded-degree crosses.

    x_{l+1} = x0 * (W x_l + b) + x_l

with W full rank [D, D] or low rank W = U V^T (U, V: [D, r]), which the paper finds
as good at r ~ D/4 for a fraction of the cost. Row-vector convention: the kernel is
stored [in, out], so `x @ kernel` is W x with W = kernel^T; low rank is
`(x @ down) @ up` with down [D, r] (V) and up [r, D] (U^T).

Letters: B batch, D input width (the concatenated features), R rank.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rec.layers import fp8
from rec.layers.params import BIAS, KERNEL, param, zeros


class CrossLayer(nnx.Module):
  """One cross layer: x0_BD * (W x_BD + b) + x_BD, W full rank or U V^T of rank `rank`."""

  def __init__(self, dim: int, rngs: nnx.Rngs, rank: int | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, fp8_recipe: str | None = None):
    if dim < 1 or (rank is not None and rank < 1):
      raise ValueError(f"CrossLayer: dim={dim}, rank={rank}; expected dim >= 1 and rank >= 1 "
                       "(or None for full rank)")
    self.dim, self.rank, self.dtype = dim, rank, dtype
    if rank is None:
      self.kernel = param(rngs, (dim, dim), KERNEL, param_dtype=param_dtype)
    else:
      self.down = param(rngs, (dim, rank), KERNEL, param_dtype=param_dtype)
      self.up = param(rngs, (rank, dim), KERNEL, param_dtype=param_dtype)
    # Zero bias, as in the paper's reference: the first layer starts as x0 * W x0 + x0.
    self.bias = param(rngs, (dim,), BIAS, init=zeros, param_dtype=param_dtype)
    # FP8 matmuls (rec/layers/fp8.py); delayed scaling keeps one history per matmul.
    self.fp8_recipe = None if fp8_recipe is None else fp8.get_recipe(fp8_recipe)
    if self.fp8_recipe is not None and self.fp8_recipe.delayed:
      for which in (("",) if rank is None else ("_down", "_up")):
        setattr(self, "fp8_history" + which, fp8.Fp8History(fp8.empty_history(self.fp8_recipe)))

  def _matmul(self, x, w, which=""):
    if self.fp8_recipe is None:
      return x @ w
    r = self.fp8_recipe
    hist = getattr(self, "fp8_history" + which)[...] if r.delayed else None
    return fp8.fp8_matmul(x, w, r, hist)

  def __call__(self, x0_BD, x_BD):
    """x0_BD, x_BD: [B, D] (the stack's input and this layer's input). Returns [B, D]."""
    if x0_BD.shape[-1] != self.dim or x_BD.shape != x0_BD.shape:
      raise ValueError(f"CrossLayer: x0 {x0_BD.shape}, x {x_BD.shape}; expected both [B, {self.dim}]")
    dt = self.dtype
    x0_BD, x_BD = x0_BD.astype(dt), x_BD.astype(dt)
    if self.rank is None:
      h_BD = self._matmul(x_BD, self.kernel[...].astype(dt))
    else:
      h_BD = self._matmul(self._matmul(x_BD, self.down[...].astype(dt), "_down"),
                          self.up[...].astype(dt), "_up")
    if self.fp8_recipe is not None:
      fp8.record_error(self, h_BD, lambda: (
          fp8.reference_matmul(x_BD, self.kernel[...]) if self.rank is None else
          fp8.reference_matmul(fp8.reference_matmul(x_BD, self.down[...]), self.up[...])))
    return x0_BD * (h_BD + self.bias[...].astype(dt)) + x_BD


class CrossNetwork(nnx.Module):
  """`num_layers` stacked cross layers, all crossing with the same x0: [B, D] -> [B, D]."""

  def __init__(self, dim: int, num_layers: int, rngs: nnx.Rngs, rank: int | None = None,
               dtype=jnp.float32, param_dtype=jnp.float32, name: str = "cross",
               fp8_layers: str = "", fp8_recipe: str = "tensor"):
    if num_layers < 1:
      raise ValueError(f"CrossNetwork: num_layers={num_layers}, expected >= 1")
    # Layers named `<name>.<index>` that match fp8_layers run their matmuls in FP8.
    self.layers = nnx.List([
        CrossLayer(dim, rngs, rank, dtype, param_dtype,
                   fp8_recipe if fp8.selected(f"{name}.{i}", fp8_layers) else None)
        for i in range(num_layers)])

  def __call__(self, x0_BD):
    x_BD = x0_BD
    for layer in self.layers:
      x_BD = layer(x0_BD, x_BD)
    return x_BD
