"""core.workdir: one run per workdir. A live holder is named and refused, racing processes
never both win, a dead holder's lock is taken over with one line, another host's is refused
with how to remove it, claims nest within a process; a --workdir that is a file or cannot be
written is one UserError naming the path and the OS error."""

import errno
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from core import workdir as workdir_lib
from core.errors import UserError
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Claims the workdir argv[1] (once the file argv[3] exists, if given: it prints "waiting"
# first), prints "held" (or the error), holds it for argv[2] seconds.
_HOLDER = r"""
import os, sys, time
from core import workdir
if len(sys.argv) > 3:
  print("waiting", flush=True)
while len(sys.argv) > 3 and not os.path.exists(sys.argv[3]):
  time.sleep(0.005)
try:
  workdir.claim(sys.argv[1])
except Exception as e:
  print("refused", e, flush=True)
  sys.exit(3)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(path, seconds, gate=None):
  return forkserver.popen([sys.executable, "-c", _HOLDER, str(path), str(seconds)]
                          + ([str(gate)] if gate else []), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _lock(path):
  with open(os.path.join(path, workdir_lib.LOCK_NAME)) as f:
    return json.load(f)


def test_claims_nest_and_release_removes_the_file(tmp_path):
  workdir_lib.claim(str(tmp_path))
  workdir_lib.claim(str(tmp_path))   # the entry point and the train loop
  info = _lock(tmp_path)
  assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
  assert "UTC" in info["started"] and info["command"]
  workdir_lib.release(str(tmp_path))
  assert workdir_lib.holds(str(tmp_path)) and os.path.exists(tmp_path / workdir_lib.LOCK_NAME)
  workdir_lib.release(str(tmp_path))
  assert not workdir_lib.holds(str(tmp_path))
  assert not os.path.exists(tmp_path / workdir_lib.LOCK_NAME)


def test_a_live_holder_is_named_and_refused(tmp_path, capsys):
  p = _holder(tmp_path, 30)
  try:
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(UserError) as e:
      workdir_lib.claim(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"--workdir={tmp_path}: in use by the run of pid {p.pid} on host "
                          f"{socket.gethostname()} since ") and "UTC" in msg and "\n" not in msg
    assert "-c" in msg   # its command line
  finally:
    p.kill()
    p.wait()
  workdir_lib.claim(str(tmp_path))   # killed, its file left behind: taken over
  workdir_lib.release(str(tmp_path))
  assert f"taking over the lock of pid {p.pid}" in capsys.readouterr().out


def test_racing_processes_never_both_win(tmp_path):
  work, gate = tmp_path / "work", tmp_path / "go"
  procs = [_holder(work, 60, gate) for _ in range(4)]
  try:
    # every process started and waiting at the gate, however loaded the machine: they race
    assert [p.stdout.readline().strip() for p in procs] == ["waiting"] * 4
    gate.write_text("")
    outs = [p.stdout.readline().strip() for p in procs]
  finally:
    for p in procs:
      p.terminate()
      p.wait()
  assert sorted(o.split()[0] for o in outs) == ["held", "refused", "refused", "refused"], outs


def test_a_dead_holder_is_taken_over_with_one_line(tmp_path, capsys):
  dead = forkserver.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  (tmp_path / workdir_lib.LOCK_NAME).write_text(json.dumps(
      {"host": socket.gethostname(), "pid": int(dead), "started": "2026-01-01 00:00:00 UTC",
       "command": "python -m experiments.train_rec"}))
  workdir_lib.claim(str(tmp_path))
  try:
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{tmp_path}: taking over the lock of pid {dead} on host "
                   f"{socket.gethostname()} since 2026-01-01 00:00:00 UTC (python -m "
                   "experiments.train_rec), a process that is gone"]
    assert _lock(tmp_path)["pid"] == os.getpid()
  finally:
    workdir_lib.release(str(tmp_path))


def test_a_reused_pid_is_not_the_holder(tmp_path, capsys):
  # this very test process's pid, with another start time: a pid the system reused
  (tmp_path / workdir_lib.LOCK_NAME).write_text(json.dumps(
      {"host": socket.gethostname(), "pid": os.getppid(), "proc_start": "1",
       "started": "2026-01-01 00:00:00 UTC"}))
  workdir_lib.claim(str(tmp_path))
  workdir_lib.release(str(tmp_path))
  assert "taking over the lock" in capsys.readouterr().out


def test_another_hosts_lock_is_refused_with_how_to_remove_it(tmp_path):
  path = tmp_path / workdir_lib.LOCK_NAME
  path.write_text(json.dumps({"host": "node-17", "pid": 4242,
                              "started": "2026-01-01 00:00:00 UTC"}))
  with pytest.raises(UserError) as e:
    workdir_lib.claim(str(tmp_path))
  msg = str(e.value)
  assert "locked by the run of pid 4242 on host node-17" in msg
  assert f"if that run has ended, delete {path}" in msg
  assert path.exists() and not workdir_lib.holds(str(tmp_path))


def test_a_file_or_a_read_only_workdir_is_one_line(tmp_path, monkeypatch):
  f = tmp_path / "results.txt"
  f.write_text("x")
  with pytest.raises(UserError, match=rf"^--workdir={f}: {f}: File exists; expected a "
                                      "directory this run can create and write$"):
    workdir_lib.claim(str(f))
  with pytest.raises(UserError, match=rf"^--output={f}/sub: {f}: Not a directory; expected a "
                                      "directory this run can write$"):
    workdir_lib.check_writable(str(f / "sub"), "--output")
  real_open = os.open

  def read_only(path, *a, **k):
    if str(path).startswith(str(tmp_path / "ro")):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return real_open(path, *a, **k)

  os.makedirs(tmp_path / "ro")
  monkeypatch.setattr(os, "open", read_only)
  with pytest.raises(UserError, match=r"--workdir=.*/ro: .*/ro/run.lock: Read-only file system"):
    workdir_lib.claim(str(tmp_path / "ro"))
  workdir_lib.check_writable(str(tmp_path / "new" / "dir"), "--output")   # creatable
  assert not (tmp_path / "new").exists()


def test_dated_names_are_new(tmp_path):
  a = workdir_lib.dated("train_lm_tiny", root=str(tmp_path))
  b = workdir_lib.dated("train_lm_tiny", root=str(tmp_path))
  assert b != a and os.path.basename(a).startswith("train_lm_tiny_")
  assert os.path.isdir(a) and os.path.isdir(b) and not os.listdir(a)


def test_runs_started_in_the_same_second_get_their_own_dated_workdir(tmp_path, monkeypatch):
  # A sweep launching runs at once: each reserves its directory when it names it, so the
  # second is not refused by (or, once the first ended, handed) the first's workdir.
  monkeypatch.setattr(workdir_lib.time, "strftime", lambda fmt: "20261203-115130")
  names = [workdir_lib.dated("train_lm_tiny", root=str(tmp_path)) for _ in range(3)]
  base = os.path.join(str(tmp_path), "train_lm_tiny_20261203-115130")
  assert names == [base, base + "-2", base + "-3"] and all(map(os.path.isdir, names))
  f = tmp_path / "a_file"      # a --workdir root it cannot create in: one line naming it
  f.write_text("")
  with pytest.raises(UserError, match=re.escape(
      f"--workdir (not given; its default {f}/x_20261203-115130): {f}/x_20261203-115130: "
      "Not a directory; expected a directory this run can create and write, or a --workdir")):
    workdir_lib.dated("x", root=str(f))


# Runs an entry point (argv[2:]) with every write under argv[1] failing as on a read-only mount.
_READ_ONLY = r"""
import builtins, errno, os, runpy, sys
root, real_open, real_os_open = sys.argv[1], builtins.open, os.open
def ro(path):
  if str(path).startswith(root):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
def open_ro(path, mode="r", *a, **k):
  if any(c in mode for c in "wax+"):
    ro(path)
  return real_open(path, mode, *a, **k)
def os_open_ro(path, flags, *a, **k):
  if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
    ro(path)
  return real_os_open(path, flags, *a, **k)
builtins.open, os.open = open_ro, os_open_ro
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module,flag", [("experiments.predict", "--output"),
                                         ("experiments.cp_model", "--workdir")])
def test_entry_points_name_a_read_only_path_before_any_work(tmp_path, module, flag):
  ro = tmp_path / "ro"
  os.makedirs(ro)
  target = ro / "p.csv" if flag == "--output" else ro
  args = [f"{flag}={target}"] + (["--checkpoint=/nonexistent/run"] if flag == "--output" else [])
  out = forkserver.run([sys.executable, "-c", _READ_ONLY, str(ro), module, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {flag}={target}: {ro}") and "Read-only file system" in last, last
  assert "Traceback" not in out.stderr and "nonexistent" not in out.stderr


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  f = tmp_path / "taken"
  f.write_text("x")
  out = forkserver.run([sys.executable, "-m", "experiments.cp_model", f"--workdir={f}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --workdir={f}: {f}: File exists; expected a directory this run can create "
      "and write")


def test_a_live_process_named_by_an_unshared_lock_is_refused(tmp_path, monkeypatch):
  # the flock was granted, yet the file names a live process of this host: a file system
  # whose locks do not reach here (or another user's process, which os.kill may not signal)
  parent = os.getppid()
  path = tmp_path / workdir_lib.LOCK_NAME
  path.write_text(json.dumps({"host": socket.gethostname(), "pid": parent,
                              "proc_start": workdir_lib._proc_start(parent),
                              "started": "2026-01-01 00:00:00 UTC"}))
  want = (f"--workdir={tmp_path}: locked by the live process of pid {parent} on host "
          f"{socket.gethostname()} since 2026-01-01 00:00:00 UTC (this file system does not "
          "share its lock); expected one run per workdir")
  with pytest.raises(UserError) as e:
    workdir_lib.claim(str(tmp_path))
  assert str(e.value) == want

  def not_permitted(pid, sig):
    raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
  monkeypatch.setattr(os, "kill", not_permitted)
  with pytest.raises(UserError) as e:
    workdir_lib.claim(str(tmp_path))
  assert str(e.value) == want and not workdir_lib.holds(str(tmp_path))
  assert workdir_lib._proc_start(2**22 + 1) is None   # above any pid: no /proc entry


def test_a_lock_file_it_cannot_read_is_not_taken_over(tmp_path, capsys):
  path = tmp_path / workdir_lib.LOCK_NAME
  path.write_text('{"host": "node-3", "pi')   # cut short
  with pytest.raises(UserError) as e:
    workdir_lib.claim(str(tmp_path))
  assert str(e.value) == (f'--workdir={tmp_path}: locked by the run of pid ? on host ? since '
                          f'{{"host": "node-3", "pi; expected one run per workdir; if that run '
                          f'has ended, delete {path}')
  # this host, a pid that is no number: no process of this host holds it
  path.write_text(json.dumps({"host": socket.gethostname(), "pid": "123", "started": "x"}))
  workdir_lib.claim(str(tmp_path))
  workdir_lib.release(str(tmp_path))
  assert capsys.readouterr().out == (f"{tmp_path}: taking over the lock of pid 123 on host "
                                     f"{socket.gethostname()} since x, a process that is gone\n")


def _open_fds(directory):
  """Descriptors this process holds on files under `directory` (a removed file's link
  reads "<path> (deleted)"): other threads' descriptors do not count."""
  n = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    except OSError:   # (the listing's own descriptor, closed by now)
      pass
  return n


def test_a_mount_without_locks_and_a_failed_write_are_one_line(tmp_path, monkeypatch):
  import fcntl
  fds = _open_fds(tmp_path)
  real_flock = fcntl.flock

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(fcntl, "flock", no_locks)
  with pytest.raises(UserError) as e:
    workdir_lib.claim(str(tmp_path))
  assert str(e.value) == (f"--workdir={tmp_path}: {tmp_path}/run.lock: flock: No locks "
                          "available; expected a file system with file locks (flock), or "
                          "another --workdir")
  monkeypatch.setattr(fcntl, "flock", real_flock)

  def full(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(UserError) as e:
    workdir_lib.claim(str(tmp_path))
  assert str(e.value) == (f"--workdir={tmp_path}: {tmp_path}: No space left on device; "
                          "expected a directory this run can create and write")
  assert not workdir_lib.holds(str(tmp_path)) and _open_fds(tmp_path) == fds   # nothing held open
  monkeypatch.undo()
  workdir_lib.claim(str(tmp_path))   # the file it left is free
  workdir_lib.release(str(tmp_path))


def test_a_lock_file_removed_before_its_flock_is_opened_again(tmp_path, monkeypatch):
  # its holder released it between this process's open and flock: the flock is on a file no
  # longer at the path, so the claim starts over on the new file
  fds = _open_fds(tmp_path)
  lock = str(tmp_path / workdir_lib.LOCK_NAME)
  real_stat, calls = os.stat, []

  def stat(path, *a, **k):
    if str(path) == lock:
      calls.append(path)
      if len(calls) == 1:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return real_stat(path, *a, **k)
  monkeypatch.setattr(os, "stat", stat)
  workdir_lib.claim(str(tmp_path))
  try:
    assert len(calls) == 2 and _lock(tmp_path)["pid"] == os.getpid()
    assert _open_fds(tmp_path) == fds + 1   # the first descriptor closed, the held one open
  finally:
    workdir_lib.release(str(tmp_path))
  assert _open_fds(tmp_path) == fds


def test_a_forked_child_at_exit_leaves_its_parents_lock(tmp_path, monkeypatch):
  workdir_lib.claim(str(tmp_path))
  try:
    monkeypatch.setattr(workdir_lib, "_owner", os.getpid() + 1)   # as in a forked child
    workdir_lib._release_all()
    assert workdir_lib.holds(str(tmp_path)) and os.path.exists(tmp_path / workdir_lib.LOCK_NAME)
  finally:
    monkeypatch.undo()
    workdir_lib.release(str(tmp_path))
  assert not os.path.exists(tmp_path / workdir_lib.LOCK_NAME)
