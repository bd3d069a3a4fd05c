"""experiments.preprocess_criteo as a user runs it: killed during the vocabulary count and
started again (no leaked-semaphore warning, no orphan tracebacks, it says it resumed and
ends with the same data), and its flags' errors in one line naming the flag."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

from tests import cpu_env
from tests.experiments.entry import REPO
from tests.rec.test_criteo_bin import line
from tests import forkserver


def _cmd(*args):
  return [sys.executable, "-m", "experiments.preprocess_criteo", *args]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=cpu_env.python_path(REPO))
  env.pop("XLA_FLAGS", None)
  return env


def test_kill_resume_and_flag_errors(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "train.txt").write_text("".join(line(i) for i in range(30_000)))   # ~2.9 MB
  dst = tmp_path / "bin"
  args = [f"--src={src}", f"--dst={dst}", "--ids=vocab", "--min_count=2", "--unit_mb=1",
          "--workers=2"]
  proc = forkserver.popen(_cmd(*args), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 120
  while not glob.glob(str(dst / "vocab" / "counts" / "*.done")):
    assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)              # as `kill -9`; its workers and tracker stay
  _, err = proc.communicate(timeout=60)
  time.sleep(2)                                 # the orphans see their parent gone
  assert "leaked" not in err and "Traceback" not in err, err[-3000:]
  done = forkserver.run(_cmd(*args), cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resuming the vocabulary count in" in done.stdout
  assert "leaked" not in done.stderr and "\r" not in done.stderr
  resumed = json.loads(done.stdout.strip().splitlines()[-1])
  fresh = forkserver.run(_cmd(*args[:1], f"--dst={tmp_path / 'fresh'}", *args[2:]), cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=300)
  assert fresh.returncode == 0, fresh.stderr[-3000:]
  assert json.loads(fresh.stdout.strip().splitlines()[-1])["rows"] == resumed["rows"]
  m = [json.load(open(d / "manifest.json")) for d in (dst, tmp_path / "fresh")]
  assert m[0]["rows_per_feature"] == m[1]["rows_per_feature"]
  assert [s["crc32"] for s in m[0]["splits"]["train"]["shards"]] == [
      s["crc32"] for s in m[1]["splits"]["train"]["shards"]]
  # flags: one line naming the flag, status 2
  for bad, want in ((["--ids=hash", "--num_rows=3000000000"],
                     "error: --num_rows=3,000,000,000; expected 2 <= rows <= 2^31 - 2 = "
                     "2,147,483,646 (row 0 is the missing value; a table's ids and its "
                     "padding id, num_rows, are int32)"),
                    (["--min_count=3"],
                     f"error: {dst}/manifest.json: a finished conversion of other inputs or "
                     "settings (min_count: 2 -> 3); expected the same --src and settings to "
                     "resume it, --overwrite to replace it, or another --dst")):
    out = forkserver.run(_cmd(*args, *bad), cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == want, out.stderr
  out = forkserver.run(_cmd(f"--src={tmp_path / 'none'}", f"--dst={dst}"), cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and out.stderr.startswith(f"error: --src={tmp_path / 'none'}: ")


def test_flags_refused_before_the_source_is_read(tmp_path):
  """Unchecked, --dst naming a file fails after --src is read and gzip-checked, as
  `<dst>/train: Not a directory` without the flag; --num_rows = 2^31 converts ids no run
  can train on (a table's padding id is num_rows, an int32); and --min_count with hashed
  ids or --num_rows with a vocabulary are accepted and ignored. Each is one line naming
  the flag and the value, and nothing is written."""
  src = tmp_path / "src"
  src.mkdir()
  (src / "train.txt").write_text("".join(line(i) for i in range(100)))
  afile = tmp_path / "afile"
  afile.write_text("")
  dst = tmp_path / "bin"
  for args, want in (
      ([f"--dst={afile}"], f"error: --dst={afile}: {afile}: Not a directory; expected a "
       "directory this run can write"),
      ([f"--dst={dst}", "--num_rows=2147483647"], "error: --num_rows=2,147,483,647; expected "
       "2 <= rows <= 2^31 - 2 = 2,147,483,646 (row 0 is the missing value; a table's ids and "
       "its padding id, num_rows, are int32)"),
      ([f"--dst={dst}", "--min_count=3"], "error: --min_count=3 with --ids=hash; expected "
       "--min_count only with --ids=vocab (hashed ids have --num_rows rows)"),
      ([f"--dst={dst}", "--ids=vocab", "--num_rows=1000"], "error: --num_rows=1000 with "
       "--ids=vocab; expected --num_rows only with --ids=hash (the vocabulary's rows are "
       "counted: --min_count sets them)")):
    out = forkserver.run(_cmd(f"--src={src}", *args), cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == want, out.stderr
    assert "Criteo Kaggle" not in out.stdout and not dst.exists()
  assert afile.read_text() == ""


def test_truncated_gz_is_one_line_and_leaves_no_directories(tmp_path):
  import gzip
  src = tmp_path / "src"
  src.mkdir()
  for d in range(3):
    data = gzip.compress("".join(line(i) for i in range(d * 500, (d + 1) * 500)).encode())
    (src / f"day_{d}.gz").write_bytes(data[:len(data) // 2] if d == 0 else data)
  dst = tmp_path / "bin"
  out = forkserver.run(_cmd(f"--src={src}", f"--dst={dst}", "--workers=2"), cwd=REPO,
                       env=_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1].startswith(
      f"error: {src / 'day_0.gz'}: the gzip stream ends before its end marker"), out.stderr
  assert not dst.exists(), sorted(str(p) for p in dst.rglob("*"))
  # a bad line stops the conversion: no directory it made is left empty
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "train.txt").write_text("".join(line(i) for i in range(100)).replace("\t", " "))
  out = forkserver.run(_cmd(f"--src={bad}", f"--dst={dst}", "--workers=2"), cwd=REPO,
                       env=_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1].startswith(f"error: {bad / 'train.txt'}:1: ")
  assert not [d for d in dst.rglob("*") if d.is_dir() and not any(d.iterdir())]
  assert not dst.exists() or any(dst.iterdir())
