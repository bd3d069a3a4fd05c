"""Multi-layer perceptron with the DLRM reference initialization (arXiv 1906.00091).

Kernels carry the logical axis names ("mlp_in", "mlp_out") and biases ("mlp_out",) as
nnx metadata, with eager sharding off so the module builds without a mesh; the
experiment's rules table turns them into mesh axes via `nnx.get_partition_spec` (dense
rec models are data-parallel, so the rules usually map both names to None).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rec.layers import fp8


def dlrm_kernel_init(key, shape, dtype=jnp.float32):
  """Normal(0, sqrt(2 / (fan_in + fan_out))) for a [fan_in, fan_out] kernel, as in DLRM."""
  fan_in, fan_out = shape
  return jax.random.normal(key, shape, dtype) * jnp.sqrt(2.0 / (fan_in + fan_out)).astype(dtype)


def dlrm_bias_init(key, shape, dtype=jnp.float32):
  """Normal(0, sqrt(1 / fan_out)) for a [fan_out] bias, as in DLRM."""
  (fan_out,) = shape
  return jax.random.normal(key, shape, dtype) * jnp.sqrt(1.0 / fan_out).astype(dtype)


class MLP(nnx.Module):
  """Stack of Linear + ReLU layers; the last ReLU is optional (off for a logit head)."""

  def __init__(self, in_features: int, layer_sizes: Sequence[int], rngs: nnx.Rngs,
               activate_last: bool = True, dtype=jnp.float32, param_dtype=jnp.float32,
               name: str = "mlp", fp8_layers: str = "", fp8_recipe: str = "tensor"):
    layer_sizes = tuple(int(s) for s in layer_sizes)
    if not layer_sizes or min(layer_sizes) <= 0 or in_features <= 0:
      raise ValueError(f"MLP: in_features={in_features}, layer_sizes={layer_sizes}; expected a "
                       "positive input size and at least one positive layer size")
    self.in_features = in_features
    self.layer_sizes = layer_sizes
    self.activate_last = activate_last
    kernel_init = nnx.with_partitioning(dlrm_kernel_init, ("mlp_in", "mlp_out"),
                                        eager_sharding=False)
    bias_init = nnx.with_partitioning(dlrm_bias_init, ("mlp_out",), eager_sharding=False)
    sizes = (in_features,) + layer_sizes
    # Layers named `<name>.<index>` that match fp8_layers run their matmul in FP8
    # (rec/layers/fp8.py); the parameters are the same either way.
    def linear(i, n_in, n_out):
      kw = dict(kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
      if fp8.selected(f"{name}.{i}", fp8_layers):
        return fp8.Fp8Linear(n_in, n_out, recipe=fp8_recipe, **kw)
      return nnx.Linear(n_in, n_out, **kw)
    self.layers = nnx.List([linear(i, n_in, n_out)
                            for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]))])

  def __call__(self, x):
    last = len(self.layers) - 1
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < last or self.activate_last:
        x = nnx.relu(x)
    return x
