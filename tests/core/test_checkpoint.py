"""core.checkpoint on its own: a failed write of the machine's is one CheckpointWriteError
naming the checkpoint, the file and the OS error (a bug keeps its own error), the final
evaluation's metadata replaced in place, a part read on the host that the checkpoint lacks
named, and the noise of orbax's failed writes dropped while anything else still reports."""

import errno
import json
import logging
import os
import sys
import types

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from core import checkpoint as ckpt_lib
from core.errors import UserError

_EXPECT = ("; expected room for the checkpoint on that file system (free space, a file-size "
           "limit: ulimit -f) or another --workdir")


@pytest.fixture
def ckpt(tmp_path):
  c = ckpt_lib.Checkpointer(str(tmp_path))
  yield c
  c.close()


def test_write_error_of_an_os_error():
  full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/w/checkpoints/5/meta/metadata.tmp")
  err = ckpt_lib.write_error("/w/checkpoints", 5, full)
  assert isinstance(err, UserError) and str(err) == (
      "checkpoint /w/checkpoints/5: writing /w/checkpoints/5/meta/metadata.tmp failed: No space "
      "left on device (ENOSPC)" + _EXPECT)
  # no errno, no file: the OS's text, the checkpoint's directory
  assert str(ckpt_lib.write_error("/w/checkpoints", 5, OSError("device gone\nmore"))) == (
      "checkpoint /w/checkpoints/5: writing /w/checkpoints failed: device gone" + _EXPECT)
  assert str(ckpt_lib.write_error("/w/checkpoints", 5, OSError())) == (
      "checkpoint /w/checkpoints/5: writing /w/checkpoints failed: OSError" + _EXPECT)


def test_save_turns_a_failed_write_into_one_line_and_keeps_a_bugs_error(ckpt, monkeypatch):
  state = {"w": jnp.ones(3)}
  ckpt.save(1, state, {"step": 1})

  def fail(e):
    def save(self, step, *a, **k):
      raise e
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)

  fail(OSError(errno.EFBIG, os.strerror(errno.EFBIG), f"{ckpt.directory}/2/state/x"))
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    ckpt.save(2, state, {"step": 2})
  assert str(e.value) == (f"checkpoint {ckpt.directory}/2: writing {ckpt.directory}/2/state/x "
                          "failed: File too large (EFBIG)" + _EXPECT)
  assert e.value.__cause__ is None and e.value.__suppress_context__
  bug = ValueError("Composite: item 'state' is not registered")
  fail(bug)
  with pytest.raises(ValueError) as e:
    ckpt.save(2, state, {"step": 2})
  assert e.value is bug
  assert ckpt.all_steps() == [1]


def test_update_meta_replaces_the_json_only(ckpt, monkeypatch, caplog):
  ckpt.save(3, {"w": jnp.arange(4.0)}, {"step": 3, "last_eval": {}})
  ckpt.update_meta(3, {"step": 3, "last_eval": {"auc": 0.75}})
  assert ckpt.restore_meta(3) == {"step": 3, "last_eval": {"auc": 0.75}}
  state, meta = ckpt.restore(3, {"w": jnp.zeros(4)})
  np.testing.assert_array_equal(state["w"], np.arange(4.0))
  assert meta["last_eval"] == {"auc": 0.75}
  # a step with no such file: a warning, nothing written
  with caplog.at_level(logging.WARNING, logger="core.checkpoint"):
    ckpt.update_meta(7, {"step": 7})
  assert f"no {ckpt.directory}/7/meta/metadata to update" in caplog.text
  assert not os.path.exists(f"{ckpt.directory}/7")
  # a full disk: one line, the old metadata intact, no temporary file left
  assert not os.path.exists(f"{ckpt.directory}/3/meta/metadata.tmp")
  real_replace = os.replace

  def full(src, dst):
    if str(src).endswith(".tmp"):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)
    return real_replace(src, dst)
  monkeypatch.setattr(os, "replace", full)
  path = f"{ckpt.directory}/3/meta/metadata"
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    ckpt.update_meta(3, {"step": 3, "last_eval": {"auc": 0.5}})
  assert str(e.value) == (f"checkpoint {ckpt.directory}/3: writing {path}.tmp failed: No space "
                          "left on device (ENOSPC)" + _EXPECT)
  with open(path) as f:
    assert json.load(f)["last_eval"] == {"auc": 0.75}
  assert not os.path.exists(f"{path}.tmp")


def test_update_meta_is_on_disk_before_the_rename(ckpt, monkeypatch):
  """The new metadata is fsynced before it replaces the old (else a crash can leave the
  checkpoint's metadata empty); metadata that is not JSON leaves no temporary file."""
  ckpt.save(2, {"w": jnp.arange(4.0)}, {"step": 2})
  path = f"{ckpt.directory}/2/meta/metadata"
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)

  def replace(src, dst):
    events.append(("replace", str(src)))
    return real_replace(src, dst)
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "replace", replace)
  ckpt.update_meta(2, {"step": 2, "last_eval": {"auc": 0.5}})
  assert events == [("fsync", os.path.realpath(f"{path}.tmp")), ("replace", f"{path}.tmp")]
  with pytest.raises(TypeError, match="not JSON serializable"):
    ckpt.update_meta(2, {"step": 2, "last_eval": {"auc": object()}})
  assert not os.path.exists(f"{path}.tmp")
  assert ckpt.restore_meta(2) == {"step": 2, "last_eval": {"auc": 0.5}}


def test_a_part_on_the_host_that_the_checkpoint_lacks(ckpt):
  ckpt.save(1, {"params": {"w": jnp.ones((2, 3))}}, {"step": 1})
  with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
    ckpt.restore(1, {"params": {"w": jnp.zeros((2, 3))}}, on_host=("emb", "params"))
  assert str(e.value) == (f"checkpoint {ckpt.directory}/1 holds no ['emb']; expected a state "
                          "with them")
  state, _ = ckpt.restore(1, {}, on_host=("params",))   # as written, as numpy
  assert isinstance(state["params"]["w"], np.ndarray) and state["params"]["w"].shape == (2, 3)


def test_noise_of_failed_writes_is_dropped_and_the_rest_reported(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(("unraisable", u.exc_value)))
  monkeypatch.setattr(sys, "excepthook", lambda k, v, tb: seen.append(("except", v)))
  asyncio_log = logging.getLogger("asyncio")
  monkeypatch.setattr(asyncio_log, "filters", [])
  ckpt_lib._drop_loop_closed_reports()
  ckpt_lib._drop_loop_closed_reports()   # installed once
  assert len(asyncio_log.filters) == 1
  closed, other = RuntimeError("Event loop is closed"), RuntimeError("Event loop is running")
  for v in (closed, other):
    sys.unraisablehook(types.SimpleNamespace(exc_type=type(v), exc_value=v))
    sys.excepthook(type(v), v, None)
  assert seen == [("unraisable", other), ("except", other)]

  def record(msg, exc):
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None,
                             (type(exc), exc, None) if exc is not None else None)
  never = "Task exception was never retrieved"
  ts = ValueError("Failed writing: \"/w/x\": No space left on device [os_error_code='28']")
  kept = [r.getMessage() for r in (
      record(never, OSError(errno.ENOSPC, "No space left on device")),
      record(never, ts),
      record(never, ValueError("a bug")),      # not a write: reported
      record(never, None),
      record("Unclosed client session", OSError(errno.EIO, "I/O error")))
          if asyncio_log.filters[0].filter(r)]
  assert kept == [never, never, "Unclosed client session"]


def test_keep_policy(tmp_path):
  """max_to_keep=N keeps the newest N, None keeps all; 0 (orbax's "keep none", which deletes
  even the checkpoint just written) and other non-counts are refused naming the value."""
  for keep, want in ((2, [2, 3]), (None, [1, 2, 3])):
    c = ckpt_lib.Checkpointer(str(tmp_path / str(keep)), keep)
    for step in (1, 2, 3):
      c.save(step, {"w": jnp.full((2,), float(step))}, {"step": step})
    assert c.all_steps() == want and c.latest_step() == 3
    state, meta = c.restore(3, {"w": jnp.zeros((2,))})
    assert meta == {"step": 3} and np.asarray(state["w"]).tolist() == [3.0, 3.0]
    c.close()
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=rf"max_to_keep={bad!r}, expected an int >= 1 .* or "
                       r"None \(keep all\)"):
      ckpt_lib.Checkpointer(str(tmp_path / "bad"), bad)
  assert not (tmp_path / "bad").exists()


def test_tree_fingerprint():
  """Equal for the same arrays (numpy or jax, any leaf order), different for a changed
  value, shape, dtype, name or salt."""
  import jax.numpy as jnp
  from core.checkpoint import tree_fingerprint
  rng = np.random.default_rng(0)
  w = {"a": rng.standard_normal((64, 32)).astype(np.float32), "b": np.arange(5, dtype=np.int8)}
  f = tree_fingerprint(w)
  assert len(f) == 32 and f == tree_fingerprint({"b": jnp.asarray(w["b"]),
                                                 "a": jnp.asarray(w["a"])})
  changed = dict(w, a=w["a"] * np.float32(1.01))
  others = [changed, dict(w, a=w["a"].reshape(32, 64)), dict(w, b=w["b"].astype(np.int16)),
            {"c": w["a"], "b": w["b"]}]
  assert len({f, *(tree_fingerprint(o) for o in others), tree_fingerprint(w, salt="x")}) == 6
