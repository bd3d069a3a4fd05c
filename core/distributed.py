"""Many processes, one program: JAX's own multi-process runtime (`jax.distributed`).

Every entry point goes through `core.cli.run`, which calls `initialize_from_flags()` after
parsing flags and before anything touches a device, so each of them takes:

  --coordinator_address=HOST:PORT --num_processes=N --process_id=I   (explicit), or the
  environment: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (with
  JOB_COMPLETION_INDEX, a Kubernetes Indexed Job's pod index, as the process id), or a
  launcher jax detects itself: SLURM (`srun`, SLURM_NTASKS > 1) and Open MPI (`mpirun`).

Without any of these the run is one process, as before. `--distributed=off` forces one.

Failures end the job instead of hanging it: the coordination service drops a process
that stops sending heartbeats for --heartbeat_timeout_s (a crash, a kill, a lost host) and
terminates every other process with an error naming it; `--initialization_timeout_s` bounds
the wait for all processes to join. A process that hangs while still alive (a deadlock, a
stuck read) keeps its heartbeat, so the train loop also runs a `Watchdog`: each process
publishes its step in the coordination service's key-value store, and one whose loop makes
no progress for --hang_timeout_s ends itself with a message naming the processes that are
behind (then the heartbeat check ends the rest).

A process that dies is named before jax ends the job: a `_Monitor` thread in every process
publishes its step to the key-value store every second and watches the others'. A process
that fails with a Python error (`report_failure`, called by `core.cli.run`) publishes its
one-line error, and every other process prints `error: process I failed at step S: ...;
last step reported: ...` and exits (status 4) at once, instead of aborting at the heartbeat
timeout. A process that vanishes (killed, lost host) is named in one line once it has been
silent for a quarter of --heartbeat_timeout_s (at least 3 polls), before the coordination
service's own abort text: the service sends heartbeats every half timeout, so it can declare
a process dead as early as half the timeout after its death.

On CPU, cross-process collectives use gloo (set here before the backend starts); its
"[Gloo] Rank i is connected to ..." lines (written to stdout at every new communicator) are
dropped from process 0's stdout when it is not a terminal, and the stdout of processes > 0
is silenced at the file-descriptor level.
Logs, results and plots are written by process 0 (`is_primary`); checkpoints by all
processes together through orbax.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from typing import Callable

import jax
from absl import flags, logging

from core.errors import UserError

FLAGS = flags.FLAGS
HANG_TIMEOUT_S = 1800   # --hang_timeout_s's default


def define_flags(flag_values=FLAGS) -> None:
  """Defines this module's flags (once; `core.cli.run` calls it for every entry point), so
  that importing the library defines none."""
  if "distributed" in flag_values:
    return
  flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                    "Multi-process run through jax.distributed: auto = when a coordinator is "
                    "given (flag or JAX_COORDINATOR_ADDRESS) or SLURM / Open MPI launched several "
                    "processes; on = always (jax detects the cluster); off = one process.",
                    flag_values=flag_values)
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator "
                      "(default: $JAX_COORDINATOR_ADDRESS, or detected under SLURM / Open MPI).",
                      flag_values=flag_values)
  flags.DEFINE_integer("num_processes", None, "Processes in the job (default: $JAX_NUM_PROCESSES "
                       "or detected).", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes) (default: "
                       "$JAX_PROCESS_ID, $JOB_COMPLETION_INDEX, or detected).", lower_bound=0,
                       flag_values=flag_values)
  flags.DEFINE_integer("heartbeat_timeout_s", 60, "A process silent this long is declared dead "
                       "and the whole job ends with an error naming it.", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("initialization_timeout_s", 300, "How long processes wait for each other "
                       "to join at start.", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("hang_timeout_s", HANG_TIMEOUT_S, "A process whose train loop makes no "
                       "progress this long ends the job, naming the processes that are behind "
                       "(0: off).",
                       lower_bound=0, flag_values=flag_values)


_initialized = False
_monitor: "_Monitor | None" = None
PEER_FAILED_STATUS = 4   # exit status of a process ended because another one failed


def _env_int(*names: str) -> int | None:
  for n in names:
    v = os.environ.get(n)
    if v not in (None, ""):
      try:
        return int(v)
      except ValueError:
        raise UserError(f"${n}={v!r}: expected an integer") from None
  return None


def _launcher() -> str | None:
  """The multi-process launcher jax can read its settings from, if any."""
  if (_env_int("SLURM_NTASKS") or 1) > 1 and "SLURM_PROCID" in os.environ:
    return "slurm"
  if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "ompi"
  return None


def _check_address(address: str, source: str) -> None:
  """HOST:PORT (an IPv6 host in brackets) with a port in [1, 65535]: jax takes the port after
  the last ':' for process 0's service, and without one (an IndexError) or with one that is
  not a number or is 0 (an abort in its C++ service) ends the process naming neither."""
  host, sep, port = address.rpartition(":")
  if not (sep and host and host != "[]" and port.isascii() and port.isdigit()
          and 1 <= int(port) <= 65535) or (":" in host and not host.startswith("[")):
    raise UserError(f"{source}={address!r}: expected HOST:PORT with a port in [1, 65535] "
                    "(an IPv6 host in brackets: [::1]:1234), process 0's address")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, mode: str = "auto",
               heartbeat_timeout_s: int = 60, initialization_timeout_s: int = 300) -> bool:
  """Starts jax.distributed when the settings or the environment ask for several processes;
  returns whether it did. Call before any device is touched (`core.cli.run` does)."""
  global _initialized
  if _initialized or mode == "off":
    return _initialized
  address_from = "--coordinator_address" if coordinator_address else "$JAX_COORDINATOR_ADDRESS"
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if coordinator_address:
    _check_address(coordinator_address, address_from)
  # Where each value came from, for the messages (the flags have bounds, the environment not).
  n_from = "--num_processes" if num_processes is not None else "$JAX_NUM_PROCESSES"
  id_from = "--process_id" if process_id is not None else next(
      (f"${n}" for n in ("JAX_PROCESS_ID", "JOB_COMPLETION_INDEX")
       if os.environ.get(n) not in (None, "")), "--process_id")
  num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID",
                                                                  "JOB_COMPLETION_INDEX")
  if num_processes is not None and num_processes < 1:
    raise UserError(f"{n_from}={num_processes}: expected an integer >= 1")
  launcher = _launcher()
  if mode == "auto" and not coordinator_address and launcher is None:
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise UserError(f"--num_processes={num_processes} / --process_id={process_id} without "
                      "--coordinator_address (or $JAX_COORDINATOR_ADDRESS): expected all three, "
                      "or a SLURM / Open MPI launch")
    return False
  if coordinator_address and launcher is None and (num_processes is None or process_id is None):
    raise UserError(f"--coordinator_address={coordinator_address!r} needs --num_processes and "
                    f"--process_id (got {num_processes}, {process_id}); their $JAX_NUM_PROCESSES / "
                    "$JAX_PROCESS_ID / $JOB_COMPLETION_INDEX forms work too")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise UserError(f"{id_from}={process_id}: expected in [0, {n_from}={num_processes})")
  # Cross-process collectives of the CPU backend need a transport (GPUs use NCCL); and its
  # thread pool must outnumber the devices that can block in one (with the default of one
  # thread per core, steps queued by async dispatch deadlock on a 2-core machine).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  os.environ.setdefault("PJRT_NPROC", "32")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)
  _initialized = True
  _quiet_stdout()
  global _monitor
  _monitor = _Monitor(heartbeat_timeout_s)
  # Registered after jax's own clean-up, so run before it (atexit is last in, first out):
  # the monitor thread must not touch jax while the backends and the coordination service
  # shut down (a call there re-creates the CPU client, which needs the service: an abort).
  atexit.register(_monitor.close)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def hang_timeout_s(flag_values=FLAGS) -> float:
  """--hang_timeout_s once parsed; its default outside an entry point (a notebook, a test)."""
  if "hang_timeout_s" not in flag_values or not flag_values.is_parsed():
    return float(HANG_TIMEOUT_S)
  return float(flag_values.hang_timeout_s)


def initialize_from_flags(flag_values=FLAGS) -> bool:
  """`initialize` with this module's flags."""
  return initialize(flag_values.coordinator_address, flag_values.num_processes,
                    flag_values.process_id, mode=flag_values.distributed,
                    heartbeat_timeout_s=flag_values.heartbeat_timeout_s,
                    initialization_timeout_s=flag_values.initialization_timeout_s)


def is_primary() -> bool:
  """Whether this process writes logs, results and plots (process 0)."""
  return jax.process_index() == 0


def process_count() -> int:
  return jax.process_count()


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (no-op for one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _kv_client():
  from jax._src import distributed as dist_state
  return dist_state.global_state.client


# --- stdout of a multi-process run --------------------------------------------------------

_GLOO_TAG = b"[Gloo] "
# A child process between this process's stdout and the real one: drops whole lines that
# start with _GLOO_TAG and passes everything else through at once. A process of its own,
# so nothing is lost when this one aborts (it drains the pipe and ends at EOF).
_STDOUT_FILTER = r"""
import os, sys
tag = %r
out = sys.stdout.buffer
pending, dropping, inside = b"", False, False
while True:
  chunk = os.read(0, 1 << 16)
  if not chunk:
    out.write(pending)
    out.flush()
    break
  data, pending, keep, i = pending + chunk, b"", [], 0
  while i < len(data):
    if dropping or inside:
      j = data.find(b"\n", i)
      end = len(data) if j < 0 else j + 1
      if not dropping:
        keep.append(data[i:end])
      if j >= 0:
        dropping = inside = False
      i = end
      continue
    rest = data[i:i + len(tag)]
    if len(rest) < len(tag) and tag.startswith(rest) and i + len(rest) == len(data):
      pending = data[i:]
      break
    dropping, inside = rest == tag, rest != tag
  out.write(b"".join(keep))
  out.flush()
""" % (_GLOO_TAG,)


def _quiet_stdout() -> None:
  """Process 0: gloo's connection lines filtered out of stdout (unless it is a terminal);
  processes > 0: stdout to /dev/null (C++ writers included)."""
  try:
    sys.stdout.flush()
    if jax.process_index() > 0:
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, 1)
      os.close(devnull)
    elif not os.isatty(1):
      real = os.dup(1)
      try:
        proc = subprocess.Popen([sys.executable, "-c", _STDOUT_FILTER],
                                stdin=subprocess.PIPE, stdout=real, close_fds=True)
      finally:
        os.close(real)   # the filter holds it now; a copy kept here would never be closed
      os.dup2(proc.stdin.fileno(), 1)
      proc.stdin.close()
  except OSError as e:   # the output is only noisier
    logging.warning("could not filter gloo's lines from stdout: %s", e)


# --- which processes are alive, and how far they got ---------------------------------------

_ALIVE, _FAILED = "metasys/alive/", "metasys/failed/"


class _Monitor:
  """Publishes this process's step every `interval_s` and watches the other processes:
  a failure one of them published ends this process with a line naming it; one silent for
  more than `silence_s` is named once (the coordination service ends the job when it
  stays silent for the heartbeat timeout)."""

  def __init__(self, heartbeat_timeout_s: float, interval_s: float = 1.0,
               exit_fn: Callable[[int], None] = os._exit):
    self.interval_s = interval_s
    # Under the half timeout at which the service can first declare a death (module
    # docstring), with room for a late poll.
    self.silence_s = max(3.0 * interval_s, heartbeat_timeout_s / 4)
    self.heartbeat_timeout_s = heartbeat_timeout_s
    self.step = -1                     # -1: before the train loop's first step
    self.steps: dict[int, int] = {}    # process -> last step it published
    # process -> (value, local time it last changed); a process that never publishes is
    # silent from the start
    now = time.monotonic()
    self._seen: dict[int, tuple[str | None, float]] = {
        p: (None, now) for p in range(jax.process_count())}
    self.named: set[int] = set()       # silent processes named (by the monitor or failure_line)
    self._seq = 0
    self._exit = exit_fn
    self.ending = threading.Event()   # set once a peer's failure ends this process
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="distributed-monitor")
    self._thread.start()

  def publish(self) -> None:
    self._seq += 1
    _kv_client().key_value_set(f"{_ALIVE}{jax.process_index()}", f"{self.step} {self._seq}",
                               allow_overwrite=True)

  def last_steps(self) -> str:
    steps = {**self.steps, jax.process_index(): self.step}
    def one(p: int) -> str:
      if p not in steps:
        return f"process {p}: nothing reported"
      return f"process {p}: " + (f"step {steps[p]}" if steps[p] >= 0 else "not training yet")
    return ", ".join(one(p) for p in range(jax.process_count()))

  def silence(self) -> list[tuple[int, float]]:
    """[(process, seconds since its published value last changed)] of the other processes."""
    now = time.monotonic()
    return [(p, now - since) for p, (_, since) in sorted(self._seen.items())
            if p != jax.process_index()]

  def check(self) -> None:
    """One round: publish, read the others, act on failures and silence."""
    self.publish()
    now = time.monotonic()
    for key, value in _kv_client().key_value_dir_get(_ALIVE):
      p = int(key.rsplit("/", 1)[-1])
      self.steps[p] = int(value.split()[0])
      if p not in self._seen or self._seen[p][0] != value:
        if p in self.named:
          print(f"process {p} is reporting again (step {self.steps[p]})", file=sys.stderr,
                flush=True)
          self.named.discard(p)
        self._seen[p] = (value, now)
    failed = _kv_client().key_value_dir_get(_FAILED)
    for key, value in failed:
      p = int(key.rsplit("/", 1)[-1])
      if p == jax.process_index():
        continue
      step, _, line = value.partition("\t")
      what = line[len("error: "):] if line.startswith("error: ") else line
      at = f" at step {step}" if int(step) >= 0 else " before training"
      self.ending.set()   # the main thread's own errors (a collective that lost its peer) wait
      print(f"error: process {p} failed{at}: {what}; last step reported: {self.last_steps()}",
            file=sys.stderr, flush=True)
      if jax.process_index() == 0:
        # It hosts the coordination service: the others read the failure and the failing
        # process ends (report_failure waits 2 intervals) before the service goes.
        time.sleep(4 * self.interval_s)
      self._exit(PEER_FAILED_STATUS)
      return
    for p, (_, since) in self._seen.items():
      if p != jax.process_index() and p not in self.named and now - since > self.silence_s:
        self.named.add(p)
        print(f"error: process {p} stopped reporting {now - since:.0f} s ago (died, lost "
              f"its host or hangs outside Python); last step reported: {self.last_steps()}. "
              f"The coordination service ends the job when it is silent for "
              f"--heartbeat_timeout_s={self.heartbeat_timeout_s:g}.", file=sys.stderr, flush=True)

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      try:
        self.check()
      except Exception as e:   # the store is a diagnostic aid; the job goes on without it
        logging.log_every_n_seconds(logging.WARNING, "distributed monitor: %s", 60, e)

  def close(self) -> None:
    """Stops the thread and waits for its round in flight (a key-value call) to end."""
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=min(10.0 * self.interval_s, 60.0))


def multi_process() -> bool:
  """Whether this run is one of several processes (and the monitor runs)."""
  return _monitor is not None


def settle(intervals: float = 3.0) -> None:
  """Gives the monitor `intervals` more polls (a collective that fails in this process is
  often a peer that died or failed a moment ago), then, if a peer's failure was published,
  waits for the monitor to end this process with the line naming it."""
  if _monitor is None:
    return
  time.sleep(intervals * _monitor.interval_s)
  while _monitor.ending.is_set():
    time.sleep(60)


def failure_line(line: str) -> str:
  """`line` with what the other processes last reported, and which of them have gone
  silent (call `settle` first)."""
  if _monitor is None:
    return line
  gone = [(p, s) for p, s in _monitor.silence() if s >= 2 * _monitor.interval_s]
  _monitor.named.update(p for p, _ in gone)   # named here: the monitor does not again
  silent = "".join(f"; process {p} has not reported for {s:.0f} s" for p, s in gone)
  return f"{line}{silent}; last step reported: {_monitor.last_steps()}"


def set_step(step: int) -> None:
  """The step this process's monitor publishes (called by the train loop)."""
  if _monitor is not None:
    _monitor.step = step


def report_failure(line: str, exit_process: bool = True, status: int = 2) -> None:
  """In a multi-process run: publishes this process's one-line error for the others'
  monitors (they end with a line naming it), waits until they can have read it, and with
  `exit_process` ends this process (os._exit: the jax runtime's shutdown would wait for the
  others). A no-op in a one-process run."""
  if _monitor is None:
    return
  if _monitor.ending.is_set():   # another process failed first: the monitor ends this one
    while True:
      time.sleep(60)
  try:
    sys.stdout.flush()
    sys.stderr.flush()
    _kv_client().key_value_set(f"{_FAILED}{jax.process_index()}",
                               f"{_monitor.step}\t{line}", allow_overwrite=True)
    time.sleep(2 * _monitor.interval_s)   # every monitor polls once per interval
  except Exception as e:
    print(f"could not tell the other processes: {e}", file=sys.stderr, flush=True)
  if exit_process:
    os._exit(status)


class Watchdog:
  """Ends a multi-process job whose loop stops making progress (see the module docstring).

  `beat(step)` from the loop (cheap: the step is handed to the monitor thread, which
  publishes it); a daemon thread checks that beats keep coming and, after `timeout_s`
  without one, writes which processes are behind to stderr and exits the process (status
  3). For one process, or `timeout_s` 0, it does nothing.
  """

  def __init__(self, timeout_s: float, exit_fn: Callable[[int], None] = os._exit):
    self.timeout_s = float(timeout_s)
    self._exit = exit_fn
    self._last = time.monotonic()
    self._step = 0
    self._stop = threading.Event()
    self._on = timeout_s > 0 and jax.process_count() > 1
    if self._on:
      self._thread = threading.Thread(target=self._watch, daemon=True)
      self._thread.start()

  def beat(self, step: int) -> None:
    self._last, self._step = time.monotonic(), step
    set_step(step)

  def peers(self) -> dict[int, int]:
    """{process: last published step} of the processes in their train loop, as this
    process's monitor last read them."""
    if _monitor is None:
      return {}
    return {p: s for p, s in _monitor.steps.items() if s >= 0}

  def report(self) -> str:
    """'process 0: step 57, process 1: step 55, ...' as last published."""
    return _monitor.last_steps() if _monitor is not None else f"process 0: step {self._step}"

  def _watch(self) -> None:
    while not self._stop.wait(min(self.timeout_s / 4, 30.0)):
      idle = time.monotonic() - self._last
      if idle > self.timeout_s:
        line = (f"error: process {jax.process_index()} made no progress for {idle:.0f} s after "
                f"step {self._step} (--hang_timeout_s={self.timeout_s:g}); last step reported: "
                f"{self.report()}. Ending the job.")
        print(line, file=sys.stderr, flush=True)
        report_failure(line, exit_process=False)
        self._exit(3)
        return

  def close(self) -> None:
    self._stop.set()
