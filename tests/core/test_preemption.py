"""Preemption keeps the work, and one run per workdir, through `experiments.train_rec` as a
user runs it: a second run on a live run's workdir (and a --resume beside it) is refused at
once naming the first; SIGTERM / SIGINT finish the step, keep a checkpoint of it and end with
the one line `stopped at step N; checkpoint N kept; continue with --resume`, status 128 +
the signal, no traceback; --resume continues from N. In process: the final checkpoint is
written before the final evaluation, an interrupt during that evaluation loses nothing and
the resume runs it; time-based checkpoints; a full disk during a checkpoint is one line
naming the checkpoint and the OS error, results.json still written, the previous checkpoint
intact."""

import errno
import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time

import jax
import orbax.checkpoint as ocp
import pytest

from core import checkpoint as ckpt_lib
from core import train as train_lib
from core.errors import UserError
from rec import configs
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--num_rows=1000", "--batch_size=64", "--log_every=10", "--eval_every=0",
        "--eval_batches=1", "--eval_batch_size=64"]
FAST = ["--model=logreg"]   # compiles in a moment
STOPPED = re.compile(r"stopped at step (\d+); checkpoint (\d+) kept; continue with --resume")


def _env():
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _start(args, log):
  return forkserver.popen([sys.executable, "-m", "experiments.train_rec", *ARGS, *args],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                          env=_env())


def _wait_for(p, pattern, timeout=400):
  """Stdout lines of `p` up to the first matching `pattern`."""
  seen, deadline = [], time.time() + timeout
  while time.time() < deadline:
    ready, _, _ = select.select([p.stdout], [], [], 1.0)
    if not ready:
      assert p.poll() is None, "".join(seen)
      continue
    line = p.stdout.readline()
    assert line, f"ended before {pattern!r}:\n" + "".join(seen)
    seen.append(line)
    if re.search(pattern, line):
      return seen
  raise AssertionError(f"no {pattern!r} in {timeout} s:\n" + "".join(seen))


def _stop(p, sig, log):
  p.send_signal(sig)
  out, _ = p.communicate(timeout=300)
  err = open(log).read()
  return p.returncode, out, err


def _run(args):
  return forkserver.run([sys.executable, "-m", "experiments.train_rec", *ARGS, *args],
                        cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())


def test_one_run_per_workdir_and_signals_keep_the_work(tmp_path):
  w = tmp_path / "w"
  first = _start([*FAST, "--steps=100000", f"--workdir={w}"], tmp_path / "first.err")
  try:
    _wait_for(first, r"^step \d+/100000")
    # the reproduction: a second run on the same workdir, and a --resume beside it
    for extra in (["--steps=1500", "--learning_rate=0.2"], ["--steps=1500", "--resume"]):
      extra = FAST + extra
      second = _run([f"--workdir={w}", *extra])
      assert second.returncode == 2, second.stderr[-2000:]
      last = second.stderr.strip().splitlines()[-1]
      assert last.startswith(f"error: --workdir={w}: in use by the run of pid {first.pid} on "
                             f"host {socket.gethostname()} since "), last
      assert "experiments.train_rec" in last and "Traceback" not in second.stderr
      assert not os.path.exists(w / "results.json")
    status, out, err = _stop(first, signal.SIGTERM, tmp_path / "first.err")
  finally:
    first.kill()
  assert status == 128 + signal.SIGTERM, err[-3000:]
  assert "Traceback" not in out + err
  last = err.strip().splitlines()[-1]
  m = STOPPED.fullmatch(last)
  assert m and m.group(1) == m.group(2), last
  n = int(m.group(1))
  assert len(STOPPED.findall(out + err)) == 1
  assert str(n) in os.listdir(w / "checkpoints")
  assert not os.path.exists(w / "run.lock")   # released

  # --resume continues from N; SIGINT (Ctrl-C) there keeps its work the same way
  again = _start([*FAST, "--steps=100000", f"--workdir={w}", "--resume"],
                 tmp_path / "again.err")
  try:
    seen = _wait_for(again, r"^step \d+/100000")
    assert any(f"at step {n}" in l and l.startswith("resumed from") for l in seen), seen
    status, out, err = _stop(again, signal.SIGINT, tmp_path / "again.err")
  finally:
    again.kill()
  assert status == 128 + signal.SIGINT, err[-3000:]
  assert "Traceback" not in out + err
  m = STOPPED.fullmatch(err.strip().splitlines()[-1])
  assert m and int(m.group(1)) > n
  assert m.group(1) in os.listdir(w / "checkpoints")


def _small():
  cfg = configs.make_run(model="logreg", data="synthetic", num_rows=100, mesh="-1",
                             batch_size=64, eval_batch_size=64, eval_batches=2, sharding="dp")
  return configs.build_run(cfg, jax.devices()[:1])


def test_final_checkpoint_before_final_eval_and_an_interrupt_there(tmp_path, monkeypatch):
  task, train_src, eval_src, _, _ = _small()
  loop = dict(workdir=str(tmp_path), steps=6, log_every=2, tensorboard=False)
  kills = {"n": 0}

  def eval_with_sigterm():
    # the checkpoint of the final step exists when the final evaluation starts
    assert ckpt_lib.Checkpointer(str(tmp_path)).all_steps() == [6]
    for i, b in enumerate(eval_src.batches(0)):
      if i == 1:
        kills["n"] += 1
        os.kill(os.getpid(), signal.SIGTERM)   # noted; the eval stops before the next batch
      yield b

  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(train_lib.Interrupted) as e:
    train_lib.train(task, train_src.batches, eval_with_sigterm, train_lib.TrainConfig(**loop))
  assert str(e.value) == "stopped at step 6; checkpoint 6 kept; continue with --resume"
  assert e.value.exit_status == 143 and kills["n"] == 1
  assert signal.getsignal(signal.SIGTERM) is before   # handlers restored
  # the resume of the finished run runs its final evaluation, then has nothing to do
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                        train_lib.TrainConfig(**loop, resume=True))
  assert out["step"] == 6 and 0 <= out["eval"]["auc"] <= 1
  meta = ckpt_lib.Checkpointer(str(tmp_path)).restore_meta(6)
  assert meta["eval_step"] == 6 and meta["last_eval"]["auc"] == out["eval"]["auc"]
  again = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                          train_lib.TrainConfig(**loop, resume=True))
  assert again["eval"] == out["eval"]


def test_time_based_checkpoints(tmp_path, monkeypatch):
  task, train_src, eval_src, _, _ = _small()
  clock = {"t": 0.0}

  def fake_monotonic():   # one simulated minute per call
    clock["t"] += 60.0
    return clock["t"]

  monkeypatch.setattr(train_lib, "_clock", fake_monotonic)
  loop = dict(workdir=str(tmp_path), steps=8, log_every=4, tensorboard=False, max_to_keep=20)
  train_lib.train(task, train_src.batches, None,
                  train_lib.TrainConfig(**loop, checkpoint_every_minutes=3))
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), 20)
  steps = ckpt.all_steps()
  ckpt.close()
  assert 8 in steps and 2 <= len(steps) < 8, steps
  # changeable on resume; 0 turns them off (only --checkpoint_every and the end remain)
  train_lib.train(task, train_src.batches, None,
                  train_lib.TrainConfig(**{**loop, "steps": 12}, resume=True,
                                        checkpoint_every_minutes=0))
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), 20)
  assert ckpt.all_steps() == steps + [12]
  ckpt.close()


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
  task, train_src, eval_src, _, _ = _small()
  loop = dict(workdir=str(tmp_path), steps=6, log_every=2, checkpoint_every=3,
              tensorboard=False)
  real_save = ocp.CheckpointManager.save
  d = f"{tmp_path}/checkpoints"

  def save(self, step, *a, **k):
    if step == 6:   # a data file's write fails, as tensorstore reports it
      raise ValueError(f'OUT_OF_RANGE: Error writing "a/0" in OCDBT database at local file '
                       f'"{d}/6.orbax-checkpoint-tmp/state/": Failed writing: '
                       f'"{d}/6.orbax-checkpoint-tmp/state/d/ab12": No space left on device '
                       "[os_error_code='28']")
    return real_save(self, step, *a, **k)

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                    train_lib.TrainConfig(**loop))
  msg = str(e.value)
  assert msg.startswith(f"checkpoint {tmp_path}/checkpoints/6: writing {tmp_path}/checkpoints/"
                        "6.orbax-checkpoint-tmp/state/d/ab12 failed: No space left on device "
                        "(ENOSPC); expected room for the checkpoint"), msg
  assert "\n" not in msg and isinstance(e.value, UserError)
  # training and the final evaluation finished: their summary comes with the error
  assert e.value.summary["step"] == 6 and 0 <= e.value.summary["eval"]["auc"] <= 1
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [3] and ckpt.restore_meta(3)["step"] == 3
  ckpt.close()


_FSIZE = r"""
import resource, signal, sys
import jax
from core import checkpoint as ckpt_lib
ckpt = ckpt_lib.Checkpointer(sys.argv[1])
ckpt.save(1, {"w": jax.numpy.ones(4)}, {"step": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
  ckpt.save(2, {"w": jax.random.normal(jax.random.key(0), (1_000_000,))}, {"step": 2})
except ckpt_lib.CheckpointWriteError as e:
  print("ERROR", e)
print("STEPS", ckpt.all_steps())
"""


def test_a_file_size_limit_during_a_checkpoint(tmp_path):
  out = forkserver.run([sys.executable, "-c", _FSIZE, str(tmp_path)], fork=True, cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=_env())
  lines = out.stdout.splitlines()
  assert lines[-1] == "STEPS [1]", out.stdout + out.stderr[-3000:]
  assert re.fullmatch(rf"ERROR checkpoint {tmp_path}/checkpoints/2: writing {tmp_path}/"
                      r"checkpoints/2\.orbax-checkpoint-tmp/\S+ failed: File too large "
                      r"\(EFBIG\); expected .*ulimit -f.*", lines[-2]), lines
  assert "Traceback" not in out.stderr and "raised an exception" not in out.stderr, out.stderr


def test_train_rec_with_a_file_size_limit_writes_results_and_one_line(tmp_path):
  w = tmp_path / "w"

  # 1 MB per file: results.json and the plot fit, the checkpoint does not
  limited = ("import resource, runpy, signal, sys\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))\n"
             "sys.argv = ['train_rec', *sys.argv[1:]]\n"
             "runpy.run_module('experiments.train_rec', run_name='__main__', alter_sys=True)\n")
  out = forkserver.run([sys.executable, "-c", limited, *ARGS, "--steps=20", f"--workdir={w}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert re.fullmatch(rf"error: checkpoint {w}/checkpoints/20: writing {w}/checkpoints/20\."
                      r"orbax-checkpoint-tmp/\S+ failed: File too large \(EFBIG\); expected .*",
                      last), last
  assert "Traceback" not in out.stderr and "raised an exception" not in out.stderr, out.stderr
  with open(w / "results.json") as f:
    summary = json.load(f)["summary"]
  assert summary["steps"] == 20 and summary["finished"] and 0 <= summary["test_auc"] <= 1
