"""tests/forkserver.py behaves as `subprocess` does for the runs the suite forks: exit status,
streams, stdin, timeouts, signals, sessions, environment, cwd, and `python -m` semantics
(__main__, sys.argv, an entry point's settings defined once)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forkserver

CODE = ("import os, sys, time\n"
        "print('argv', sys.argv[1:], flush=True)\n"
        "print('env', os.environ.get('FORKSERVER_T'), os.getcwd(), flush=True)\n"
        "print('err line', file=sys.stderr, flush=True)\n"
        "if sys.argv[1:2] == ['sleep']:\n"
        "  print('sleeping', flush=True); time.sleep(60)\n"
        "sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)\n")


def _cmd(*args):
  return [sys.executable, "-c", CODE, *args]


def test_run_status_streams_env_and_cwd(tmp_path):
  env = dict(os.environ, FORKSERVER_T="x1")
  out = forkserver.run(_cmd("3", "a b"), fork=True, env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 3
  assert out.stdout.splitlines() == ["argv ['3', 'a b']", f"env x1 {tmp_path}"]
  assert out.stderr == "err line\n"
  merged = forkserver.run(_cmd(), fork=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  assert b"err line" in merged.stdout and merged.stderr is None and merged.returncode == 0
  fed = forkserver.run([sys.executable, "-c", "print(input()[::-1])"], fork=True,
                       input="olleh", capture_output=True, text=True)
  assert fed.stdout == "hello\n"
  with pytest.raises(subprocess.CalledProcessError):
    forkserver.run(_cmd("1"), fork=True, capture_output=True, check=True)


def test_timeout_kills_and_popen_signals_and_pipes(tmp_path):
  with pytest.raises(subprocess.TimeoutExpired) as e:
    forkserver.run(_cmd("sleep"), fork=True, capture_output=True, text=True, timeout=2)
  assert "sleeping" in e.value.output
  p = forkserver.popen(_cmd("sleep"), fork=True, stdout=subprocess.PIPE, text=True,
                       start_new_session=True)
  assert isinstance(p, forkserver.Popen)
  assert p.stdout.readline().startswith("argv")
  assert os.getsid(p.pid) == p.pid   # its own session
  while "sleeping" not in p.stdout.readline():
    pass
  assert p.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    p.wait(timeout=0.2)
  os.killpg(p.pid, signal.SIGTERM)
  out, err = p.communicate(timeout=30)
  assert p.returncode == -signal.SIGTERM and out == "" and err is None
  log = open(tmp_path / "log", "w+")
  q = forkserver.popen(_cmd("5"), fork=True, stdout=log, stderr=subprocess.STDOUT)
  assert q.wait(timeout=60) == 5
  log.seek(0)
  assert "err line" in log.read()


def test_python_m_runs_an_entry_point_as_main():
  """--help of an entry point: its settings defined once in the child (the server imported
  the module), exit 0, usage on stdout; an unknown flag: status 2, one line."""
  t = time.monotonic()
  out = forkserver.run([sys.executable, "-m", "experiments.mx_qsnr", "--help"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and "--workdir" in out.stdout, out.stderr[-2000:]
  bad = forkserver.run([sys.executable, "-m", "experiments.mx_qsnr", "--nope=1"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "nope" in bad.stderr
  assert "RuntimeWarning" not in out.stderr + bad.stderr
  assert time.monotonic() - t < 120
