"""FLOP and parameter counts from XLA's cost analysis: what a model costs per example.

`xla_flops` compiles a function for the given (possibly abstract) arguments and reads
XLA's own count of the compiled program (a multiply-add counts 2), so fusions and
rewrites are reflected and no hand formula can drift from the code. Counts come from the
backend that compiles (CPU and GPU agree on matmul FLOPs, may differ slightly on
elementwise work). Training costs about 3x the forward (forward + two backward matmuls).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def _flops_of(cost: Any) -> float:
  """The 'flops' entry of a cost analysis: a dict (newer jax), a list of dicts, one per
  computation (older jax), or None (backends without a cost model). XLA leaves out the
  counts that are 0: an analysis without 'flops' (a transpose, a copy) is 0 FLOPs."""
  if cost is None:
    raise ValueError("xla_flops: this backend returned no cost analysis")
  if isinstance(cost, dict):
    cost = [cost]
  entries = [entry for entry in cost if entry]
  if not entries:
    raise ValueError(f"xla_flops: an empty cost analysis {cost!r}")
  return sum(float(entry.get("flops", 0.0)) for entry in entries)


def xla_flops(fn: Callable, *args, **kwargs) -> float:
  """FLOPs of one call of jax.jit(fn)(*args, **kwargs), as XLA counts them.

  Arguments may be arrays or jax.ShapeDtypeStruct (nothing is run, only compiled).
  """
  compiled = jax.jit(fn).lower(*args, **kwargs).compile()
  return _flops_of(compiled.cost_analysis())


def count_params(model: Any) -> int:
  """Number of scalars in the nnx.Params of `model` (a module, concrete or from
  nnx.eval_shape) or in a pytree of arrays / ShapeDtypeStructs."""
  tree = nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model
  return int(sum(x.size for x in jax.tree.leaves(tree)))


def _input_shapes(spec_or_shapes) -> tuple[int, int, int]:
  if isinstance(spec_or_shapes, (tuple, list)):
    num_dense, num_sparse, dim = spec_or_shapes
  else:  # a model config: num_dense, num_sparse, and embedding_dim (1 when absent: logreg)
    num_dense = spec_or_shapes.num_dense
    num_sparse = spec_or_shapes.num_sparse
    dim = getattr(spec_or_shapes, "embedding_dim", 1)
  return int(num_dense), int(num_sparse), int(dim)


def model_flops_per_example(model_fn: Callable[[nnx.Rngs], nnx.Module], spec_or_shapes,
                            batch: int = 64, dtype=jnp.float32) -> float:
  """Forward FLOPs per example of a rec dense model `model(dense_BD, emb_BFD) -> [B]`.

  model_fn builds the model from rngs (only its shapes are used). spec_or_shapes is a
  model config with num_dense / num_sparse / embedding_dim, or a tuple (num_dense,
  num_sparse, embedding_dim). The embedding lookup itself is not counted (it is memory
  traffic, not FLOPs). Divides the count for a batch of `batch` by `batch`.
  """
  if batch < 1:
    raise ValueError(f"model_flops_per_example: batch={batch}, expected >= 1")
  num_dense, num_sparse, dim = _input_shapes(spec_or_shapes)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))

  def forward(state, dense_BD, emb_BFD):
    return nnx.merge(graphdef, state)(dense_BD, emb_BFD)

  dense = jax.ShapeDtypeStruct((batch, num_dense), dtype) if num_dense > 0 else None
  emb = jax.ShapeDtypeStruct((batch, num_sparse, dim), dtype)
  return xla_flops(forward, state, dense, emb) / batch
