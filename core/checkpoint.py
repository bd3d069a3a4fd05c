"""Orbax checkpoints of a train state plus a small JSON of loop metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint either exists whole or not at all; `latest_step` only sees finished ones.

`restore` compares the stored tree (paths, shapes, dtypes, from orbax's metadata) with the
target before reading any array: a mismatch is one error listing the leaves that differ.
Letting orbax find it instead fails inside its asyncio reads, and the reads still in flight
then report into the closed event loop (hundreds of lines of `RuntimeError: Event loop is
closed` before the real error).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  """The stored state's tree, shapes or dtypes differ from the restore target's."""


class Checkpointer:
  """Saves and restores {state, meta} under `<workdir>/checkpoints/<step>`."""

  def __init__(self, workdir: str, max_to_keep: int = 3):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata saved with checkpoint `step`; reads no array."""
    return dict(self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta or {})

  def check_compatible(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError listing every leaf whose path, shape or dtype in
    checkpoint `step` differs from `abstract_state`'s."""
    stored = _leaf_specs(self._manager.item_metadata(step)["state"])
    wanted = _leaf_specs(abstract_state)
    problems = []
    for path in sorted(set(stored) | set(wanted)):
      if path not in wanted:
        problems.append(f"  {path}: in the checkpoint {stored[path]}, not in the new state")
      elif path not in stored:
        problems.append(f"  {path}: in the new state {wanted[path]}, not in the checkpoint")
      elif stored[path] != wanted[path]:
        problems.append(f"  {path}: checkpoint {stored[path]}, new state {wanted[path]}")
    if problems:
      shown = problems[:20] + ([f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step} does not fit the state this run builds "
          f"({len(problems)} of {len(set(stored) | set(wanted))} arrays differ):\n"
          + "\n".join(shown) + "\nThe run's settings (model, sizes, mesh, sharding, "
          "optimizer) must be those the checkpoint was written with.")

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores the state with the shardings of `abstract_state` (ShapeDtypeStructs),
    after `check_compatible`."""
    self.check_compatible(step, abstract_state)
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self._manager.close()


def _leaf_specs(tree: Any) -> dict[str, str]:
  """{'emb/group/table/rows': 'float32[64000]', ...} for arrays or orbax ArrayMetadata."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)
    shape = tuple(getattr(leaf, "shape", ()) or ())
    dtype = getattr(leaf, "dtype", None)
    out[name] = f"{jax.numpy.dtype(dtype).name if dtype is not None else '?'}{list(shape)}"
  return out


def abstract_like(state: Any) -> Any:
  """ShapeDtypeStructs carrying each leaf's sharding, the restore target for `state`."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
