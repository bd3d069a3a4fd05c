"""Parameter helpers shared by the interaction layers (DCN, FM, attention, conv, compression).

Every weight carries logical axis names, kernels ("mlp_in", "mlp_out") and biases
("mlp_out",), with eager sharding off, as `rec.layers.mlp.MLP` does: the module builds
without a mesh and the experiment's rules table places the weights (replicated under
`core.mesh.REC_RULES`: the dense part of a recommendation model is data parallel).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

KERNEL = ("mlp_in", "mlp_out")
BIAS = ("mlp_out",)


def glorot_normal(key, shape, dtype=jnp.float32):
  """Normal(0, sqrt(2 / (fan_in + fan_out))); the leading dims of a conv kernel
  [..., in, out] are its receptive field. For 2-D shapes this is `dlrm_kernel_init`."""
  receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
  fan_in = receptive * (shape[-2] if len(shape) > 1 else 1)
  fan_out = receptive * shape[-1]
  return jax.random.normal(key, shape, dtype) * jnp.sqrt(2.0 / (fan_in + fan_out)).astype(dtype)


def param(rngs: nnx.Rngs, shape: Sequence[int], names: tuple[str | None, ...] | None,
          init: Callable = glorot_normal, param_dtype=jnp.float32) -> nnx.Param:
  """A Param drawn from `init`, tagged with logical axis `names` (None: replicated)."""
  shape = tuple(int(s) for s in shape)
  value = init(rngs.params(), shape, param_dtype)
  if names is None:
    return nnx.Param(value)
  if len(names) != len(shape):
    raise ValueError(f"param: {len(names)} axis names {names} for shape {shape}")
  return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def zeros(key, shape, dtype=jnp.float32):
  del key
  return jnp.zeros(shape, dtype)
