"""Several processes through jax.distributed (core/distributed.py) on loopback, each with its
own simulated CPU devices, against one process holding all of them: the same parameters,
metrics and logits; checkpoints that resume on other process counts; a dead process ends
the job. The processes are started and ended by the tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from core import distributed
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Logistic regression: the smallest model train_rec has that still trains dense weights and
# table-wise sharded embeddings (their exchange crosses processes), so each process compiles
# a small program.
REC = ["--model=logreg", "--preset=small", "--num_rows=1000", "--batch_size=64",
       "--eval_batch_size=64", "--eval_batches=2", "--log_every=2", "--heartbeat_timeout_s=60"]
# A loaded 2-core machine can starve a process's heartbeat thread for seconds; tests that
# check how a dead process is detected pass their own shorter --heartbeat_timeout_s.


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(devices),
             JAX_PLATFORMS="cpu", PYTHONPATH=cpu_env.python_path(REPO))
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  return env


def _start(module: str, args: list[str], processes: int, devices: int, tmp) -> list:
  """Starts `processes` processes of `module`, `devices` CPU devices each."""
  if processes == 1:
    cmd = [[sys.executable, "-m", module, *args]]
  else:
    port = _port()
    cmd = [[sys.executable, "-m", module, *args, f"--coordinator_address=127.0.0.1:{port}",
            f"--num_processes={processes}", f"--process_id={i}"] for i in range(processes)]
  procs = []
  for i, c in enumerate(cmd):
    out = open(tmp / f"{module}.{len(os.listdir(tmp))}.p{i}.log", "w+")
    procs.append((forkserver.popen(c, cwd=REPO, env=_env(devices), stdout=out,
                                   stderr=subprocess.STDOUT), out))
  return procs


def _wait(procs, timeout: float = 420) -> list[str]:
  """Waits for every process (killing all of them past `timeout`); returns their logs."""
  deadline = time.monotonic() + timeout
  try:
    for p, _ in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 1))
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  logs = []
  for p, f in procs:
    f.seek(0)
    logs.append(f.read())
    f.close()
  return logs


def _run(module, args, processes, devices, tmp) -> dict:
  """Runs to completion; every process must succeed; returns process 0's last JSON line."""
  procs = _start(module, args, processes, devices, tmp)
  logs = _wait(procs)
  for (p, _), log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  return json.loads([l for l in logs[0].splitlines() if l.startswith("{")][-1])


def _state(workdir, step=None) -> dict[str, np.ndarray]:
  """The arrays of checkpoint `step` (default the latest), read on one device (any
  topology)."""
  import jax
  import orbax.checkpoint as ocp
  mgr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                              item_handlers={"state": ocp.StandardCheckpointHandler()})
  step = mgr.latest_step() if step is None else step
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh),
                        mgr.item_metadata(step)["state"])
  state = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  mgr.close()
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(state["state"])}


def _same_state(a, b, atol, step_b=None):
  sa, sb = _state(a), _state(b, step_b)
  assert sa.keys() == sb.keys()
  for k in sa:
    if sa[k].dtype.kind == "f":
      np.testing.assert_allclose(sa[k], sb[k], rtol=0, atol=atol, err_msg=k)
    else:
      np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


# Cross-process all-reduces (gloo) add the devices' partial sums in another order than one
# process's in-memory reduction: parameters move by float32 rounding of the gradient sums
# (a few 1e-8 per step at these sizes, seen up to 2e-7 after 10 steps); 1e-6 leaves room.
ATOL = 1e-6


def _two_and_straight(tmp_path) -> dict:
  """A 4-step run on 2 processes (4 devices each) checked against step 4 of an uninterrupted
  6-step run on 1 process with the 8 devices (checkpointed and evaluated at step 4 too);
  returns that 1-process run's summary, which resumes are held to."""
  two = _run("experiments.train_rec", REC + ["--steps=4", f"--workdir={tmp_path / 'two'}"],
             2, 4, tmp_path)
  one = _run("experiments.train_rec", REC + ["--steps=6", "--checkpoint_every=4",
                                             "--eval_every=4", f"--workdir={tmp_path / 'one'}"],
             1, 8, tmp_path)
  assert two["mesh"] == one["mesh"] == {"data": 8} and one["steps"] == 6
  with open(tmp_path / "one" / "metrics.jsonl") as f:
    at4 = [r for r in map(json.loads, f) if r["split"] == "eval" and r["step"] == 4]
  assert len(at4) == 1
  assert two["test_auc"] == at4[0]["auc"] and two["test_examples"] == at4[0]["num_examples"]
  np.testing.assert_allclose(two["test_logloss"], at4[0]["logloss"], rtol=1e-6)
  _same_state(tmp_path / "two", tmp_path / "one", ATOL, step_b=4)
  assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))
  return one


def _resume_two_on(tmp_path, straight, name, procs, devs):
  """The 2-process checkpoint continues on `procs` processes of `devs` devices exactly as
  the uninterrupted run."""
  shutil.copytree(tmp_path / "two", tmp_path / name)
  out = _run("experiments.train_rec",
             REC + ["--steps=6", "--resume", f"--workdir={tmp_path / name}"], procs, devs,
             tmp_path)
  assert out["steps"] == 6 and out["test_auc"] == straight["test_auc"], name
  _same_state(tmp_path / name, tmp_path / "one", ATOL)


def test_train_rec_two_processes_equal_one_and_resume_on_one(tmp_path):
  straight = _two_and_straight(tmp_path)
  _resume_two_on(tmp_path, straight, "r1", 1, 8)


@pytest.mark.slow   # 4 processes on top of the test above: resuming across counts is covered there
def test_train_rec_two_processes_resume_on_four(tmp_path):
  straight = _two_and_straight(tmp_path)
  _resume_two_on(tmp_path, straight, "r4", 4, 2)


@pytest.mark.slow   # cross-process collectives: train_rec's test above; CP / FSDP x TP x CP in
                    # one process: tests/llm/test_llama_cp.py, test_train_lib.py, test_cp_prefill
def test_llama_cp_prefill_and_fsdp_tp_cp_training_across_processes(tmp_path):
  # CP prefill over 8 ranks split across 2 processes: the ring's ppermutes cross processes.
  for variant in ("pass_kv", "pass_q"):
    out = _run("experiments.cp_prefill", ["--mesh=cp:8", "--seq_len=64", f"--variant={variant}",
                                          "--repeats=1", f"--workdir={tmp_path / variant}"],
               2, 4, tmp_path)
    assert out["passed"] and out["variant_used"] == variant and out["max_abs_diff"] < 1e-4
  # Training with FSDP x CP x TP over 2 processes equals one process with the 8 devices.
  args = ["--text=README.md", "--mesh=fsdp:2,cp:2,tp:2", "--context_parallel=pass_kv",
          "--steps=3", "--seq_len=32", "--batch_size=4", "--log_every=1", "--eval_batches=1"]
  two = _run("experiments.train_lm", args + [f"--workdir={tmp_path / 'lm2'}"], 2, 4, tmp_path)
  one = _run("experiments.train_lm", args + [f"--workdir={tmp_path / 'lm1'}"], 1, 8, tmp_path)
  np.testing.assert_allclose(two["eval_loss"], one["eval_loss"], rtol=1e-6)
  _same_state(tmp_path / "lm2", tmp_path / "lm1", ATOL)


def test_train_lm_of_several_processes_needs_a_workdir(tmp_path):
  """Each process would date its own default workdir: refused before any is made."""
  before = set(os.listdir(os.path.join(REPO, "runs"))) if os.path.isdir(
      os.path.join(REPO, "runs")) else set()
  procs = _start("experiments.train_lm", ["--text=README.md", "--steps=1", "--seq_len=32",
                                          "--batch_size=4"], 2, 4, tmp_path)
  logs = _wait(procs, timeout=180)
  want = ("error: --workdir: not given, in a run of 2 processes; expected the same directory "
          "on shared storage for every process")
  assert all(p.returncode != 0 for p, _ in procs), logs
  # a process refuses (another may be ended first by its monitor, naming the refusal)
  assert any(want in log.splitlines() for log in logs), [l[-1500:] for l in logs]
  after = set(os.listdir(os.path.join(REPO, "runs"))) if os.path.isdir(
      os.path.join(REPO, "runs")) else set()
  assert not {n for n in after - before if n.startswith("train_lm_")}


def test_a_killed_process_ends_the_job(tmp_path):
  procs = _start("experiments.train_rec",
                 REC + ["--steps=100000", "--log_every=5", "--heartbeat_timeout_s=16",
                        f"--workdir={tmp_path / 'run'}"], 2, 4, tmp_path)
  log0 = procs[0][1]
  try:
    deadline = time.monotonic() + 300
    while "step 10/" not in open(log0.name).read():
      assert time.monotonic() < deadline and procs[0][0].poll() is None, open(log0.name).read()
      time.sleep(1)
    # Each process publishes its step every second (core.distributed._Monitor): after 5 more
    # seconds of training process 0 has read a step of process 1's, which the last line names.
    time.sleep(5)
    procs[1][0].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    procs[0][0].wait(timeout=60)                   # ends on its own, within a minute
    waited = time.monotonic() - t0
  finally:
    logs = _wait(procs, timeout=5)
  assert procs[0][0].returncode != 0 and waited < 60
  # Usually the coordination service's heartbeat check ends it, naming the dead task; on a
  # loaded machine a collective can hit the closed connection first and end it (gloo).
  errors = [l for l in logs[0].splitlines() if l[:1] in ("E", "F") or "rror" in l]
  reasons = ("stopped sending heartbeats", "heartbeat timeout", "connection closed by peer",
             "connection reset by peer", "gloo")
  assert any(r in logs[0].lower() for r in reasons), "\n".join(errors)[-4000:]
  # Our own line names the silent process and every process's last step: before jax's text
  # when the heartbeat check ends the job, or last when a collective fails first (a gloo
  # error raised in Python); only a C++ abort inside gloo leaves no room for it.
  lines = logs[0].splitlines()
  ours = [i for i, l in enumerate(lines) if l.startswith("error: process 1 stopped reporting")
          or (l.startswith("error: ") and "process 1 has not reported for" in l)]
  steps = r"last step reported: process 0: step \d+, process 1: step \d+"
  if any("Terminating process" in l for l in lines):
    jax_at = next(i for i, l in enumerate(lines) if "Terminating process" in l)
    assert ours and ours[0] < jax_at, "\n".join(lines[-60:])
    assert re.search(steps, lines[ours[0]]), lines[ours[0]]
  elif any("JaxRuntimeError" in l for l in lines):
    assert ours and ours[-1] == len(lines) - 1 and re.search(steps, lines[-1]), lines[-5:]
  assert not any(l.startswith("[Gloo]") for l in lines)   # gloo's connection lines dropped


@pytest.mark.slow   # 150 steps over text data in 2 processes; the naming itself: the monitor's
                    # test below, a process ending the job: test_a_killed_process_ends_the_job
def test_a_failing_process_is_named_by_the_others(tmp_path):
  """Process 1 meets a bad line (its shard's alone): it ends with that line (status 2), and
  process 0 ends at once with a line naming process 1, its step and error (status 4)."""
  from tests.rec.test_data import numbered_criteo, write
  d = tmp_path / "data"
  d.mkdir()
  lines = numbered_criteo(9600)
  # record 9001: process 1's shard, in the file's second 1 MiB chunk (read at step ~140)
  lines[9001] = lines[9001].replace("\t", "\tx", 1)
  write(d, "train.txt", lines)
  write(d, "valid.txt", numbered_criteo(64))
  procs = _start("experiments.train_rec",
                 REC + ["--steps=150", "--log_every=50", f"--data=criteo:{d}",
                        "--heartbeat_timeout_s=60", f"--workdir={tmp_path / 'run'}"], 2, 4,
                 tmp_path)
  t0 = time.monotonic()
  logs = _wait(procs, timeout=300)
  assert time.monotonic() - t0 < 200        # long before the 60 s heartbeat timeout matters
  assert procs[1][0].returncode == 2 and procs[0][0].returncode == 4, logs[0][-3000:]
  bad = f"{d}/train.txt:9002: field I1 = 'x9001'; expected an integer or empty"
  assert logs[1].strip().splitlines()[-1] == f"error: {bad}", logs[1][-3000:]
  last = logs[0].strip().splitlines()[-1]
  assert re.fullmatch(rf"error: process 1 failed at step \d+: {re.escape(bad)}; last step "
                      r"reported: process 0: step \d+, process 1: step \d+", last), last


def test_monitor_names_failed_and_silent_processes(monkeypatch, capsys):
  store: dict[str, str] = {}

  class FakeKV:
    def key_value_set(self, k, v, allow_overwrite=False):
      store[k] = v

    def key_value_dir_get(self, prefix):
      return [(k, v) for k, v in store.items() if k.startswith(prefix)]

  monkeypatch.setattr(distributed, "_kv_client", lambda: FakeKV())
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 3)
  monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
  exits = []
  mon = distributed._Monitor(heartbeat_timeout_s=0.4, interval_s=1e9, exit_fn=exits.append)
  mon.close()
  mon.silence_s, mon.interval_s = 0.2, 0.01
  mon.step = 7
  store["metasys/alive/1"] = "5 1"
  store["metasys/alive/2"] = "6 1"
  mon.check()
  assert mon.steps == {0: 7, 1: 5, 2: 6} and capsys.readouterr().err == ""
  time.sleep(0.3)
  store["metasys/alive/2"] = "8 2"        # process 2 goes on, process 1 is silent
  mon.check()
  err = capsys.readouterr().err
  assert err.startswith("error: process 1 stopped reporting 0 s ago") and "process 2" not in \
      err.split(";")[0]
  assert "last step reported: process 0: step 7, process 1: step 5, process 2: step 8." in err
  mon.check()
  assert capsys.readouterr().err == ""    # named once
  store["metasys/alive/1"] = "9 2"
  mon.check()
  assert capsys.readouterr().err == "process 1 is reporting again (step 9)\n"
  store["metasys/failed/2"] = "8\terror: /data/day_3:17: field label = '7'; expected 0 or 1"
  mon.check()
  assert exits == [distributed.PEER_FAILED_STATUS]
  assert capsys.readouterr().err == (
      "error: process 2 failed at step 8: /data/day_3:17: field label = '7'; expected 0 or 1; "
      "last step reported: process 0: step 7, process 1: step 9, process 2: step 8\n")


def test_stdout_filter_drops_gloo_lines_only():
  data = (b"step 1/10\n[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
          b"connected peer ranks is : 1\n[Glo\npartial without newline then more\n"
          b"[Gloo] Rank 1 is connected\nlast")
  want = b"step 1/10\n[Glo\npartial without newline then more\nlast"
  for chunks in ([data], [data[i:i + 3] for i in range(0, len(data), 3)]):
    proc = forkserver.popen([sys.executable, "-c", distributed._STDOUT_FILTER],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    for c in chunks:
      proc.stdin.write(c)
      proc.stdin.flush()
    out, _ = proc.communicate(timeout=60)
    assert out == want


_FDS_AFTER_FILTER = r"""
import os
from core import distributed
distributed.jax.process_index = lambda: 0
os.isatty = lambda fd: False
before = set(os.listdir("/proc/self/fd"))
distributed._quiet_stdout()
print(sorted(set(os.listdir("/proc/self/fd")) - before), flush=True)
"""


def test_the_stdout_filter_leaves_no_descriptor_open():
  # Process 0's stdout goes through the filter process; the copy of the real stdout handed
  # to it must not also stay open here.
  out = forkserver.run([sys.executable, "-c", _FDS_AFTER_FILTER], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_watchdog_ends_a_loop_that_stops(monkeypatch):
  exits = []
  dog = distributed.Watchdog(0.4, exit_fn=exits.append)
  assert not dog._on                                 # one process: nothing runs
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  # The watchdog reads a fake clock, and each phase waits until its thread has read the
  # clock's new time twice (one whole check): on a loaded machine a real 0.2 s sleep could
  # outlast the 0.4 s timeout and end the loop between two beats.
  now, reads, main = [0.0], [0], threading.get_ident()

  def monotonic():
    if threading.get_ident() != main:
      reads[0] += 1
    return now[0]
  monkeypatch.setattr(distributed, "time", types.SimpleNamespace(monotonic=monotonic,
                                                                  sleep=time.sleep))

  def wait_for(done, what):
    deadline = time.monotonic() + 60
    while not done() and time.monotonic() < deadline:
      time.sleep(0.01)
    assert done(), what

  def checked_at(t):
    now[0] = t
    start = reads[0]
    wait_for(lambda: reads[0] >= start + 2 or exits, f"the watchdog never checked at {t}")

  dog = distributed.Watchdog(0.4, exit_fn=exits.append)
  dog.beat(1)                  # at 0
  checked_at(0.3)
  dog.beat(2)                  # at 0.3
  checked_at(0.6)              # 0.6 s since it started, 0.3 s since the last beat
  assert not exits
  now[0] = 0.75                # 0.45 s without a beat
  wait_for(lambda: exits, "the watchdog did not end the loop")
  dog.close()
  assert exits == [3]


def test_initialize_settings_are_checked(monkeypatch):
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "JOB_COMPLETION_INDEX", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(k, raising=False)
  assert distributed.initialize() is False           # nothing asks for several processes
  with pytest.raises(ValueError, match="without --coordinator_address"):
    distributed.initialize(num_processes=2, process_id=1)
  with pytest.raises(ValueError, match="needs --num_processes and --process_id"):
    distributed.initialize("127.0.0.1:1234", num_processes=2)
  with pytest.raises(ValueError, match=r"--process_id=2: expected in \[0, --num_processes=2\)"):
    distributed.initialize("127.0.0.1:1234", num_processes=2, process_id=2)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "x")
  with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES='x': expected an integer"):
    distributed.initialize()


def _no_launcher_and_no_jax_initialize(monkeypatch):
  """No multi-process setting in the environment, and jax.distributed.initialize fails the
  test if reached (the checks under test come before it)."""
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "JOB_COMPLETION_INDEX", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(k, raising=False)

  def reached(*a, **k):
    raise AssertionError("jax.distributed.initialize reached")
  monkeypatch.setattr(distributed.jax.distributed, "initialize", reached)


@pytest.mark.parametrize("address,source", [
    ("localhost", "--coordinator_address"),        # jax: IndexError, naming nothing
    ("localhost:abc", "--coordinator_address"),    # jax: an abort in its C++ service
    ("localhost:0", "--coordinator_address"),
    ("10.0.0.1:70000", "--coordinator_address"),
    (":1234", "--coordinator_address"),
    ("::1:1234", "--coordinator_address"),         # IPv6 without brackets: which is the port?
    ("node7", "$JAX_COORDINATOR_ADDRESS")])
def test_a_bad_coordinator_address_is_named_before_jax_sees_it(monkeypatch, address, source):
  _no_launcher_and_no_jax_initialize(monkeypatch)
  arg = None
  if source.startswith("$"):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", address)
  else:
    arg = address
  with pytest.raises(ValueError, match=re.escape(f"{source}={address!r}: expected HOST:PORT")):
    distributed.initialize(arg, num_processes=2, process_id=0)


def test_good_coordinator_addresses_pass_the_check():
  for address in ("127.0.0.1:1234", "node-7.cluster:65535", "[::1]:8476"):
    distributed._check_address(address, "--coordinator_address")   # no error


def test_settings_from_the_environment_are_named_as_such(monkeypatch):
  _no_launcher_and_no_jax_initialize(monkeypatch)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")     # an Indexed Job with more pods
  with pytest.raises(ValueError, match=re.escape(
      "$JOB_COMPLETION_INDEX=3: expected in [0, $JAX_NUM_PROCESSES=2)")):
    distributed.initialize()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "0")
  with pytest.raises(ValueError, match=re.escape("$JAX_NUM_PROCESSES=0: expected an integer >= 1")):
    distributed.initialize(process_id=0)
