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

On CPU, cross-process collectives use gloo (set here before the backend starts).
Logs, results and plots are written by process 0 (`is_primary`); checkpoints by all
processes together through orbax.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import jax
from absl import flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                  "Multi-process run through jax.distributed: auto = when a coordinator is given "
                  "(flag or JAX_COORDINATOR_ADDRESS) or SLURM / Open MPI launched several "
                  "processes; on = always (jax detects the cluster); off = one process.")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator "
                    "(default: $JAX_COORDINATOR_ADDRESS, or detected under SLURM / Open MPI).")
flags.DEFINE_integer("num_processes", None, "Processes in the job (default: $JAX_NUM_PROCESSES "
                     "or detected).")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes) (default: "
                     "$JAX_PROCESS_ID, $JOB_COMPLETION_INDEX, or detected).")
flags.DEFINE_integer("heartbeat_timeout_s", 60, "A process silent this long is declared dead "
                     "and the whole job ends with an error naming it.")
flags.DEFINE_integer("initialization_timeout_s", 300, "How long processes wait for each other "
                     "to join at start.")
flags.DEFINE_integer("hang_timeout_s", 1800, "A process whose train loop makes no progress this "
                     "long ends the job, naming the processes that are behind (0: off).")

_initialized = False


def _env_int(*names: str) -> int | None:
  for n in names:
    v = os.environ.get(n)
    if v not in (None, ""):
      try:
        return int(v)
      except ValueError:
        raise ValueError(f"${n}={v!r}: expected an integer") from None
  return None


def _launcher() -> str | None:
  """The multi-process launcher jax can read its settings from, if any."""
  if (_env_int("SLURM_NTASKS") or 1) > 1 and "SLURM_PROCID" in os.environ:
    return "slurm"
  if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "ompi"
  return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, mode: str = "auto",
               heartbeat_timeout_s: int = 60, initialization_timeout_s: int = 300) -> bool:
  """Starts jax.distributed when the settings or the environment ask for several processes;
  returns whether it did. Call before any device is touched (`core.cli.run` does)."""
  global _initialized
  if _initialized or mode == "off":
    return _initialized
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID",
                                                                  "JOB_COMPLETION_INDEX")
  launcher = _launcher()
  if mode == "auto" and not coordinator_address and launcher is None:
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise ValueError(f"--num_processes={num_processes} / --process_id={process_id} without "
                       "--coordinator_address (or $JAX_COORDINATOR_ADDRESS): expected all three, "
                       "or a SLURM / Open MPI launch")
    return False
  if coordinator_address and launcher is None and (num_processes is None or process_id is None):
    raise ValueError(f"--coordinator_address={coordinator_address!r} needs --num_processes and "
                     f"--process_id (got {num_processes}, {process_id}); their $JAX_NUM_PROCESSES / "
                     "$JAX_PROCESS_ID / $JOB_COMPLETION_INDEX forms work too")
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id}: expected in [0, --num_processes={num_processes})")
  # Cross-process collectives of the CPU backend need a transport (GPUs use NCCL); and its
  # thread pool must outnumber the devices that can block in one (with the default of one
  # thread per core, steps queued by async dispatch deadlock on a 2-core machine).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  os.environ.setdefault("PJRT_NPROC", "32")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)
  _initialized = True
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


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


class Watchdog:
  """Ends a multi-process job whose loop stops making progress (see the module docstring).

  `beat(step)` from the loop (cheap: a key-value write at most every `publish_s`); a daemon
  thread checks that beats keep coming and, after `timeout_s` without one, writes which
  processes are behind to stderr and exits the process (status 3). For one process, or
  `timeout_s` 0, it does nothing.
  """

  def __init__(self, timeout_s: float, publish_s: float = 10.0,
               exit_fn: Callable[[int], None] = os._exit):
    self.timeout_s, self.publish_s = float(timeout_s), float(publish_s)
    self._exit = exit_fn
    self._last = time.monotonic()
    self._published = 0.0
    self._step = 0
    self._stop = threading.Event()
    self._on = timeout_s > 0 and jax.process_count() > 1
    if self._on:
      self._thread = threading.Thread(target=self._watch, daemon=True)
      self._thread.start()

  def beat(self, step: int) -> None:
    now = time.monotonic()
    self._last, self._step = now, step
    if self._on and now - self._published >= self.publish_s:
      self._published = now
      try:
        _kv_client().key_value_set(f"metasys/progress/{jax.process_index()}",
                                   f"{step} {time.time():.0f}", allow_overwrite=True)
      except Exception as e:   # the store is a diagnostic aid; the job goes on without it
        logging.warning("watchdog: could not publish progress: %s", e)

  def peers(self) -> dict[int, int]:
    """{process: last published step} of the processes that have published (no waiting)."""
    if not self._on:
      return {}
    try:
      items = _kv_client().key_value_dir_get("metasys/progress/")
    except Exception:
      return {}
    return {int(k.rsplit("/", 1)[-1]): int(v.split()[0]) for k, v in items}

  def report(self) -> str:
    """'process 1: step 57, 95 s ago; ...' from the key-value store."""
    now = time.time()
    parts = []
    for p in range(jax.process_count()):
      try:
        v = _kv_client().blocking_key_value_get(f"metasys/progress/{p}", 2000)
        step, t = v.split()
        parts.append(f"process {p}: step {step}, {now - float(t):.0f} s ago")
      except Exception:
        parts.append(f"process {p}: no progress published")
    return "; ".join(parts)

  def _watch(self) -> None:
    while not self._stop.wait(min(self.timeout_s / 4, 30.0)):
      idle = time.monotonic() - self._last
      if idle > self.timeout_s:
        print(f"error: process {jax.process_index()} made no progress for {idle:.0f} s after "
              f"step {self._step} (--hang_timeout_s={self.timeout_s:g}); last progress of each "
              f"process: {self.report()}. Ending the job.", file=sys.stderr, flush=True)
        self._exit(3)
        return

  def close(self) -> None:
    self._stop.set()
