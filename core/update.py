"""The dense optimizer step every task shares, with the non-finite guard.

`dense_update` applies one optax step to a task's dense parameters and reports `loss` and
`grad_norm`; with `skip_nonfinite` a step whose loss or gradient norm is NaN or inf keeps
the parameters and optimizer state (a select on device, as optax.apply_if_finite) and
reports `skipped` 1 (else 0), which the train loop counts (`core.train`). Sparse state
(embedding rows) skips by its own means, from the returned `ok`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class DenseUpdate(NamedTuple):
  """The updated parameters and optimizer state, the step's metrics ({loss, grad_norm} and
  `skipped` under the guard) and `ok` (a scalar bool under the guard, else None)."""

  params: Any
  opt: Any
  metrics: dict[str, jax.Array]
  ok: jax.Array | None


def select_tree(ok: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the scalar `ok` is true, else `old`, leaf by leaf (for small trees: dense
  parameters and their optimizer state; embedding tables skip by their touched rows)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def dense_update(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
                 loss: jax.Array, *, grad_norm: jax.Array | None = None,
                 skip_nonfinite: bool = False) -> DenseUpdate:
  """One `tx` step of `params` by `grads`. `grad_norm`: the norm the guard checks and
  reports (default: the global norm of `grads`; a task with other gradients too, such as
  embedding rows, passes the norm over all of them)."""
  if grad_norm is None:
    grad_norm = optax.tree.norm(grads)
  updates, new_opt = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  metrics = {"loss": loss, "grad_norm": grad_norm}
  ok = None
  if skip_nonfinite:
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_params = select_tree(ok, new_params, params)
    new_opt = select_tree(ok, new_opt, opt_state)
    metrics["skipped"] = (~ok).astype(jnp.float32)
  return DenseUpdate(new_params, new_opt, metrics, ok)
