"""Orbax checkpoints of a train state plus a small JSON of loop metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint either exists whole or not at all; `latest_step` only sees finished ones.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores {state, meta} under `<workdir>/checkpoints/<step>`."""

  def __init__(self, workdir: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores the state with the shardings of `abstract_state` (ShapeDtypeStructs)."""
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self._manager.close()


def abstract_like(state: Any) -> Any:
  """ShapeDtypeStructs carrying each leaf's sharding, the restore target for `state`."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
