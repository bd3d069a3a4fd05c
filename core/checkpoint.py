"""Orbax checkpoints of a train state plus a small JSON of loop metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint either exists whole or not at all; `latest_step` only sees finished ones.

`restore` compares the stored tree (paths, shapes, dtypes, from orbax's metadata) with the
target before reading any array: a mismatch is one error listing the leaves that differ.
Letting orbax find it instead fails inside its asyncio reads, and the reads still in flight
then report into the closed event loop (hundreds of lines of `RuntimeError: Event loop is
closed` before the real error).

`restore(..., on_host=("emb",))` reads a part of the state as host numpy arrays in the
shapes it was written with (a layout of another device count or plan), for the caller to
convert (rec/embedding/reshard.py); `mismatches` lists the leaves that differ.

`save` turns a failed write (a full disk, a file-size limit: an OSError, or tensorstore's
ValueError carrying `os_error_code`) into one CheckpointWriteError naming the checkpoint,
the file and the OS error; orbax's threads' copies of it are not logged, nor are the
reports of the writes still in flight, which end after orbax's event loop closed (a
traceback each: `RuntimeError: Event loop is closed`, asyncio's `Task exception was never
retrieved`). The unfinished checkpoint stays a `*.orbax-checkpoint-tmp` directory, so the
previous one is still the latest.
"""

from __future__ import annotations

import contextlib
import errno
import logging as py_logging
import os
import re
import sys
from typing import Any, Iterator, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from core import errors


class CheckpointMismatchError(ValueError):
  """The stored state's tree, shapes or dtypes differ from the restore target's."""


class CheckpointWriteError(errors.UserError):
  """Writing a checkpoint failed for a reason of the machine (disk full, file too large)."""


# tensorstore's text of a failed write: 'Failed writing: "PATH": ... [os_error_code='28']'
_TS_FILE = re.compile(r'Failed (?:writing|to write)[^"]*"([^"]+)"')
_TS_ERRNO = re.compile(r"os_error_code='?(\d+)")


def write_error(directory: str, step: int, e: BaseException) -> CheckpointWriteError | None:
  """The CheckpointWriteError for `e` raised while saving checkpoint `step`, or None when
  `e` is not a failed write of the machine's (a bug keeps its traceback)."""
  text = str(e)
  if isinstance(e, OSError):
    code, path = e.errno, e.filename
  else:
    m = _TS_ERRNO.search(text)
    if not isinstance(e, ValueError) or m is None:
      return None
    code = int(m.group(1))
    f = _TS_FILE.search(text)
    path = f.group(1) if f else None
  what = os.strerror(code) if code else (getattr(e, "strerror", None) or
                                         (text.splitlines() or [type(e).__name__])[0])
  name = errno.errorcode.get(code, "")
  return CheckpointWriteError(
      f"checkpoint {directory}/{step}: writing {path or directory} failed: {what}"
      f"{f' ({name})' if name else ''}; expected room for the checkpoint on that file "
      "system (free space, a file-size limit: ulimit -f) or another --workdir")


class _DropOrbaxThreadErrors(py_logging.Filter):
  """orbax's worker threads log the failed write before it is raised here, traceback and
  all; the raised error is reported once."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return "raised an exception" not in str(record.msg)


@contextlib.contextmanager
def _quiet_orbax_threads() -> Iterator[None]:
  f = _DropOrbaxThreadErrors()
  loggers = [py_logging.getLogger("absl"), py_logging.getLogger()]
  for lg in loggers:
    lg.addFilter(f)
  try:
    yield
  finally:
    for lg in loggers:
      lg.removeFilter(f)


class _DropUnretrievedWriteErrors(py_logging.Filter):
  """asyncio's `Task exception was never retrieved` for a failed checkpoint write (the
  other writes of a save that already failed), reported once by `save`."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and "never retrieved" in str(record.msg) and
                (isinstance(exc, OSError) or _TS_ERRNO.search(str(exc))))


def _drop_loop_closed_reports() -> None:
  """sys.unraisablehook and sys.excepthook (through which tensorstore's callbacks report)
  skip the `RuntimeError: Event loop is closed` of writes that end after orbax's loop
  closed, and asyncio's log the never-retrieved errors of failed writes; anything else
  goes where it went."""
  def closed(kind, value) -> bool:
    return kind is RuntimeError and str(value) == "Event loop is closed"

  if not getattr(sys.unraisablehook, "drops_loop_closed", False):
    unraisable = sys.unraisablehook
    def unraisablehook(u):
      if not closed(u.exc_type, u.exc_value):
        unraisable(u)
    unraisablehook.drops_loop_closed = True
    sys.unraisablehook = unraisablehook
  asyncio_log = py_logging.getLogger("asyncio")
  if not any(isinstance(f, _DropUnretrievedWriteErrors) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropUnretrievedWriteErrors())
  if not getattr(sys.excepthook, "drops_loop_closed", False):
    excepthook = sys.excepthook
    def hook(kind, value, tb):
      if not closed(kind, value):
        excepthook(kind, value, tb)
    hook.drops_loop_closed = True
    sys.excepthook = hook


class Checkpointer:
  """Saves and restores {state, meta} under `<workdir>/checkpoints/<step>`."""

  def __init__(self, workdir: str, max_to_keep: int | None = 3):
    # orbax reads max_to_keep=0 as "keep none" and deletes every checkpoint, the one just
    # written included; None keeps them all.
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or
                                    not isinstance(max_to_keep, (int, np.integer)) or
                                    max_to_keep < 1):
      raise ValueError(f"core/checkpoint.py Checkpointer: max_to_keep={max_to_keep!r}, "
                       "expected an int >= 1 (checkpoints kept) or None (keep all)")
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
    """Writes checkpoint `step`; a failed write is one CheckpointWriteError (module
    docstring)."""
    _drop_loop_closed_reports()
    try:
      with _quiet_orbax_threads():
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      err = write_error(self.directory, step, e)
      if err is None:
        raise
      raise err from None

  def update_meta(self, step: int, meta: dict[str, Any]) -> None:
    """Replaces the JSON metadata of the finished checkpoint `step` (written through a
    temporary file and a rename; the arrays are untouched): the final evaluation's result,
    which runs after the final checkpoint is written."""
    import json
    if jax.process_index() != 0:
      return
    path = os.path.join(self.directory, str(step), "meta", "metadata")
    if not os.path.exists(path):   # another orbax layout: a resume evaluates again
      py_logging.getLogger(__name__).warning("no %s to update", path)
      return
    tmp = path + ".tmp"
    try:
      with open(tmp, "w") as f:
        json.dump(meta, f)
        # On disk before the rename: else a crash soon after can leave the checkpoint's
        # only metadata empty (the rename reaches the disk before the data on XFS, or ext4
        # mounted noauto_da_alloc), and a resume could not read its settings.
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    except BaseException as e:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      if isinstance(e, OSError):
        raise write_error(self.directory, step, e) from None
      raise

  def restore_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata saved with checkpoint `step`; reads no array."""
    return dict(self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta or {})

  def mismatches(self, step: int, abstract_state: Any) -> tuple[list[str], int]:
    """(the leaves whose path, shape or dtype in checkpoint `step` differ from
    `abstract_state`'s, one line each; the number of leaves of both); reads no array."""
    stored = _leaf_specs(self._manager.item_metadata(step)["state"])
    wanted = _leaf_specs(abstract_state)
    problems = []
    for path in sorted(set(stored) | set(wanted)):
      if path not in wanted:
        problems.append(f"{path}: in the checkpoint {stored[path]}, not in the new state")
      elif path not in stored:
        problems.append(f"{path}: in the new state {wanted[path]}, not in the checkpoint")
      elif stored[path] != wanted[path]:
        problems.append(f"{path}: checkpoint {stored[path]}, new state {wanted[path]}")
    return problems, len(set(stored) | set(wanted))

  def check_compatible(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError listing every leaf whose path, shape or dtype in
    checkpoint `step` differs from `abstract_state`'s."""
    problems, total = self.mismatches(step, abstract_state)
    if problems:
      shown = [f"  {p}" for p in problems[:20]] + (
          [f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step} does not fit the state this run builds "
          f"({len(problems)} of {total} arrays differ):\n"
          + "\n".join(shown) + "\nThe run's settings (model, sizes, mesh, sharding, "
          "optimizer) must be those the checkpoint was written with.")

  def restore(self, step: int, abstract_state: Any,
              on_host: Sequence[str] = ()) -> tuple[Any, dict[str, Any]]:
    """Restores the state with the shardings of `abstract_state` (ShapeDtypeStructs),
    after `check_compatible`. `on_host`: top-level keys of the state (a dict) read as host
    numpy arrays in the tree, shapes and dtypes they were saved with, whatever
    `abstract_state` holds there: a part written in another layout (another device count,
    another plan), which the caller converts (rec/embedding/reshard.py)."""
    if on_host:
      stored = self._manager.item_metadata(step)["state"]
      missing = [k for k in on_host if k not in stored]
      if missing:
        raise CheckpointMismatchError(f"checkpoint {self.directory}/{step} holds no "
                                      f"{missing}; expected a state with them")
      abstract_state = {**abstract_state, **{
          k: jax.tree.map(lambda m: np.empty(m.shape, m.dtype), stored[k]) for k in on_host}}
    self.check_compatible(step, abstract_state)
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self._manager.close()


def tree_fingerprint(tree: Any, salt: str = "", samples: int = 1024) -> str:
  """A hash of a tree of arrays (numpy or jax, on any device): every leaf's path, shape and
  dtype and `samples` of its values at evenly spaced positions (gathered where the array
  lies, not read whole), with `salt` (e.g. the model's config). What a file derived from a
  model (a LoRA run's base, a draft head's cached features) records of it, so that a model
  changed since is found instead of silently mixed with the old one's products."""
  import hashlib
  h = hashlib.sha256(salt.encode())
  leaves = sorted(jax.tree_util.tree_flatten_with_path(tree)[0],
                  key=lambda kv: jax.tree_util.keystr(kv[0]))
  for path, x in leaves:
    x = x if hasattr(x, "reshape") else np.asarray(x)   # a Python number
    shape, size = tuple(np.shape(x)), int(np.prod(np.shape(x)))
    h.update(f"{jax.tree_util.keystr(path)}:{shape}:{np.dtype(x.dtype)};".encode())
    if size:
      idx = np.unique(np.linspace(0, size - 1, min(size, samples)).astype(np.int64))
      h.update(np.asarray(x.reshape(-1)[idx]).tobytes())
  return h.hexdigest()[:32]


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
