"""One run per workdir: a lock file, `<workdir>/run.lock`, held for the run's life.

The file holds the holder's host, pid, start time and command line (JSON). It is taken with
`fcntl.flock` on a file opened without O_EXCL, then checked to be the file now at that
path (a holder that removed it meanwhile makes the taker start over), so two processes
racing cannot both win, and the kernel drops the flock of a process that dies however it
dies (kill -9 included). What the file says decides the rest:
- flock refused: a live run on this host holds it; refused naming it (UserError);
- flock granted and the file names another host: that host's run may be alive on a file
  system whose locks do not reach here; refused naming it and how to remove the file;
- flock granted and the file names a process of this host that is gone (or a pid now
  reused by another program): taken over with one printed line;
- empty or absent: free.
`release` (at the end of the run, normal or not) removes the file while holding the flock.

Claims are counted per process: the entry point and the train loop may both claim one
workdir, and it is released when the last claim ends. In a multi-process jax run only
process 0 claims (`distributed.is_primary()`): every process of one job shares the
workdir, and a second job's process 0 is refused and ends that job through
`distributed.report_failure`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Any, Iterator

from core import errors

LOCK_NAME = "run.lock"
_held: dict[str, list] = {}   # realpath of the workdir -> [fd, claims, lock path]
_owner = os.getpid()          # the process whose claims _held records


def _proc_start(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (Linux /proc), or None: with the
  pid it names a process, so a reused pid is not taken for the holder."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(info: dict[str, Any]) -> bool:
  pid = info.get("pid")
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # another user's process
    pass
  start = info.get("proc_start")
  return start is None or _proc_start(pid) in (None, start)


def _command() -> str:
  """This process's command line as typed: `python -m experiments.train_rec --steps=...`."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  name = spec.name.removesuffix(".__main__") if spec is not None else None
  head = ["-m", name] if name and name != "__main__" else sys.argv[:1]
  return " ".join(["python", *head, *sys.argv[1:]])[:500]


def describe(info: dict[str, Any]) -> str:
  """'pid 123 on host h since 2026-12-01 23:07:30 UTC (python -m ...)'."""
  cmd = info.get("command")
  return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since "
          f"{info.get('started', '?')}" + (f" ({cmd})" if cmd else ""))


def _read(fd: int) -> dict[str, Any] | None:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 1 << 16).decode(errors="replace").strip()
  if not text:
    return None
  try:
    info = json.loads(text)
  except ValueError:
    info = None
  return info if isinstance(info, dict) else {"host": "?", "pid": "?", "started": text[:80]}


def _path_error(workdir: str, e: OSError) -> errors.UserError:
  what = e.strerror or type(e).__name__
  return errors.expected(f"--workdir={workdir}", f"{e.filename or workdir}: {what}",
                         "a directory this run can create and write")


def check_writable(path: str, flag: str, value: str | None = None) -> None:
  """Raises a UserError naming `flag`=`value` (default `path`), the directory and the OS
  error unless `path` is a directory this process can write a file into, or can be created
  as one (its nearest existing ancestor is such a directory). Leaves nothing behind."""
  p = os.path.abspath(path)
  while not os.path.lexists(p) and os.path.dirname(p) != p:
    p = os.path.dirname(p)
  try:
    if not os.path.isdir(p):
      raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), p)
    probe = os.path.join(p, f".write_test.{os.getpid()}")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    what = e.strerror or type(e).__name__
    raise errors.expected(f"{flag}={value or path}", f"{p}: {what}",
                          "a directory this run can write") from None


def claim(workdir: str) -> None:
  """Takes the lock of `workdir` for this process (creating the directory), or raises a
  UserError naming its holder; a second claim by this process only counts (see module
  docstring). Released by `release` or at exit."""
  if "jax" in sys.modules:   # without jax this is no multi-process run
    from core import distributed
    if not distributed.is_primary():
      return
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise _path_error(workdir, e) from None
  global _owner
  if os.getpid() != _owner:   # a forked child claims for itself
    _held.clear()
    _owner = os.getpid()
  key = os.path.realpath(workdir)
  if key in _held:
    _held[key][1] += 1
    return
  path = os.path.join(workdir, LOCK_NAME)
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise _path_error(workdir, e) from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):   # e.g. ENOLCK: no locks on this mount
        os.close(fd)
        raise errors.expected(f"--workdir={workdir}",
                              f"{path}: flock: {e.strerror or type(e).__name__}",
                              "a file system with file locks (flock), or another --workdir"
                              ) from None
      info = _read(fd)
      os.close(fd)
      who = describe(info) if info else "another process"
      raise errors.expected(f"--workdir={workdir}", f"in use by the run of {who}",
                            "one run per workdir: wait for it, stop it, or choose another "
                            "--workdir") from None
    try:
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False
    if not same:   # its holder removed the file between our open and flock: start over
      os.close(fd)
      continue
    break
  try:
    info = _read(fd)
    if info is not None:
      if info.get("host") != socket.gethostname():
        raise errors.expected(
            f"--workdir={workdir}", f"locked by the run of {describe(info)}",
            f"one run per workdir; if that run has ended, delete {os.path.abspath(path)}")
      if info.get("pid") != os.getpid() and _alive(info):
        raise errors.expected(
            f"--workdir={workdir}", f"locked by the live process of {describe(info)} (this "
            "file system does not share its lock)", "one run per workdir")
      print(f"{workdir}: taking over the lock of {describe(info)}, a process that is gone",
            flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    mine = {"host": socket.gethostname(), "pid": os.getpid(),
            "proc_start": _proc_start(os.getpid()),
            "started": now.strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": _command()}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(mine) + "\n").encode())
    os.fsync(fd)
  except OSError as e:
    os.close(fd)
    raise _path_error(workdir, e) from None
  except BaseException:
    os.close(fd)
    raise
  _held[key] = [fd, 1, path]


def release(workdir: str) -> None:
  """Ends one claim of `workdir`; the last removes the lock file and drops the lock."""
  entry = _held.get(os.path.realpath(workdir))
  if entry is None:
    return
  entry[1] -= 1
  if entry[1] > 0:
    return
  del _held[os.path.realpath(workdir)]
  fd, _, path = entry
  with contextlib.suppress(OSError):
    os.remove(path)   # while still locked: a waiting taker sees the inode change
  with contextlib.suppress(OSError):
    os.close(fd)


@contextlib.contextmanager
def held(workdir: str) -> Iterator[None]:
  """`claim` for the body of a with statement."""
  claim(workdir)
  try:
    yield
  finally:
    release(workdir)


def holds(workdir: str) -> bool:
  """Whether this process holds the lock of `workdir`."""
  return os.path.realpath(workdir) in _held


@atexit.register
def _release_all() -> None:
  if os.getpid() != _owner:   # a forked child: the lock is its parent's
    return
  for key in list(_held):
    _held[key][1] = 1
    release(key)


def dated(prefix: str, root: str = "runs") -> str:
  """A new `<root>/<prefix>_<YYYYmmdd-HHMMSS>` (suffixed -2, -3, ... if taken): a run's
  default workdir, new for every run. A one-process run creates the directory here (an empty
  one), so runs started in the same second (a sweep's launches) each get their own, not one
  another's; the processes of a multi-process run only name it (they share one)."""
  base = os.path.join(root, f"{prefix}_{time.strftime('%Y%m%d-%H%M%S')}")
  path, i = base, 1
  if "jax" in sys.modules:
    from core import distributed
    if distributed.multi_process():
      while os.path.exists(path):
        i += 1
        path = f"{base}-{i}"
      return path
  while True:
    try:
      os.makedirs(path)   # the leaf must be new: the reservation is atomic
      return path
    except FileExistsError:
      i += 1
      path = f"{base}-{i}"
    except OSError as e:
      what = e.strerror or type(e).__name__
      raise errors.expected(f"--workdir (not given; its default {path})",
                            f"{e.filename or path}: {what}",
                            "a directory this run can create and write, or a --workdir"
                            ) from None
