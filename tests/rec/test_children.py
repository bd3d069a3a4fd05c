"""A train_rec run's child processes (Grain workers, multiprocessing's resource tracker) end
with it: kill -9 of the run, SIGTERM to every process of it (as SLURM sends) or Ctrl-C in
its terminal (SIGINT to its process group), and every former child is gone within 10 s of
the run's end; the signals sent to the whole group stop the run without a traceback (the
workers leave them to the training process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GONE_WITHIN_S = 10.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc for the process tree")


def _stat(pid: int) -> tuple[str, int] | None:
  """(state, ppid) of `pid` from /proc, or None once it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (FileNotFoundError, ProcessLookupError, IndexError):
    return None
  return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace")
  except OSError:
    return ""


def _children(parent: int) -> dict[int, str]:
  kids = {}
  for name in os.listdir("/proc"):
    if name.isdigit() and (st := _stat(int(name))) and st[1] == parent:
      kids[int(name)] = _cmdline(int(name))
  return kids


def _alive(pid: int) -> bool:
  st = _stat(pid)
  return st is not None and st[0] not in ("Z", "X")   # a zombie has ended


@pytest.mark.parametrize("sig, group", [(signal.SIGKILL, False), (signal.SIGTERM, True),
                                        (signal.SIGINT, True)], ids=["kill9", "term", "ctrl_c"])
def test_workers_and_tracker_end_with_the_run(tmp_path, sig, group):
  log = open(tmp_path / "run.log", "wb")
  run = forkserver.popen(
      [sys.executable, "-m", "experiments.train_rec", "--model=logreg", "--data_workers=2",
       "--steps=10000000", "--batch_size=8", "--num_rows=100", "--eval_every=0",
       "--log_every=1000000", f"--workdir={tmp_path / 'run'}"],
      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  kids: dict[int, str] = {}
  try:
    deadline = time.monotonic() + 240
    while True:   # until both workers and the tracker have started
      kids = _children(run.pid)
      workers = [p for p, c in kids.items() if "spawn_main" in c]
      if len(workers) >= 2 and any("resource_tracker" in c for c in kids.values()):
        break
      if run.poll() is not None or time.monotonic() > deadline:
        pytest.fail(f"no 2 Grain workers under the run (exit {run.poll()}):\n"
                    + (tmp_path / "run.log").read_text()[-3000:])
      time.sleep(0.2)
    time.sleep(1.0)   # the workers are past their start-up (the watch runs from their init)
    kids.update(_children(run.pid))
    (os.killpg if group else os.kill)(run.pid, sig)   # the run leads its own session
    run.wait(timeout=120)
    ended_at = time.monotonic()
    while (alive := [p for p in kids if _alive(p)]) and time.monotonic() - ended_at < GONE_WITHIN_S:
      time.sleep(0.1)
    assert not alive, (f"{len(alive)} former children still alive {GONE_WITHIN_S:.0f} s after "
                       f"the run ended ({sig.name}): " + "; ".join(kids[p][:120] for p in alive))
    if group:
      out = (tmp_path / "run.log").read_text()
      assert "Traceback" not in out and "terminated unexpectedly" not in out, out[-3000:]
  finally:
    if run.poll() is None:
      run.kill()
      run.wait()
    for p in kids:
      if _alive(p):
        os.kill(p, signal.SIGKILL)
    log.close()
