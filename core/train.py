"""The one train loop every model family uses.

A `Task` owns the model: it builds the state, the pure train and eval steps and the
evaluation metrics. The loop owns the run: jit with donated state, a background thread
that prepares batches, eval every N steps, metrics to JSONL and TensorBoard, a progress
line with rate and ETA, orbax checkpoints every N steps and at the end, and `resume`,
which continues the same run exactly: the state, its RNG and optimizer state come from
the checkpoint, and batch k of the resumed run is batch k of the uninterrupted one.

Two guards keep a run honest. Settings: the entry point hands the loop its run's settings
(`TrainConfig.settings`, e.g. the flags); they are saved with every checkpoint, and
`--resume` with different values stops before any array is read, with one message listing
each difference; loop settings (steps, cadences, paths) and those the entry point names in
`changeable` may differ. Finiteness: the per-step metrics the loop fetches anyway (at log
cadence, at least every `check_every` steps, and before every eval and checkpoint) are
checked for a non-finite loss or gradient norm; the run stops at the first such step (no
checkpoint of that state is written) or, with `nonfinite="skip"`, the task's step leaves
the state unchanged on device and the loop counts the skipped steps. No per-step
device-to-host transfer is added.

One run per workdir: `train` holds `<workdir>/run.lock` (`core.workdir`) while it runs.
Preemption keeps the work: SIGTERM (what SLURM and Kubernetes send) or SIGINT during `train`
lets the step in hand finish, writes a checkpoint of it and raises `Interrupted` (message
`stopped at step N; checkpoint N kept; continue with --resume`, `exit_status` 128 + the
signal's number: 143, 130); a second signal stops at once (KeyboardInterrupt). An evaluation
in progress stops between batches (with one process; several finish it). The final
checkpoint is written before the final evaluation, whose result then goes into that
checkpoint's metadata; a resume of a finished run whose final evaluation did not complete
runs it. Besides `checkpoint_every`,
a checkpoint is written once `checkpoint_every_minutes` have passed since the last one
(default 10), so an interrupted default run loses at most that. With several processes,
the stop and the time-based checkpoint are agreed at log steps (`log_every`) by one small
collective (any process's request counts), so every process saves the same step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import json
import math
import os
import queue
import shutil
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from core import checkpoint as ckpt_lib
from core import distributed
from core import workdir as workdir_lib


@dataclasses.dataclass
class TrainConfig:
  workdir: str
  steps: int
  eval_every: int = 0            # 0: evaluate only at the end
  checkpoint_every: int = 0      # 0: checkpoint only at the end
  checkpoint_every_minutes: float = 10.0  # also checkpoint this long after the last (0: off)
  log_every: int = 50
  resume: bool = False
  stop_at_step: int | None = None  # stop (with a checkpoint) before `steps`, as a preemption would
  max_to_keep: int = 3
  seed: int = 0
  prefetch: int = 2
  tensorboard: bool = True
  # The run's settings (JSON-able: the entry point's flags / config), saved with each
  # checkpoint and compared on resume. The loop's own fields (LOOP_SETTINGS) are added.
  settings: dict[str, Any] | None = None
  changeable: Sequence[str] = ()     # settings besides LOOP_SETTINGS that may change on resume
  resume_allow: Sequence[str] = ()   # settings this resume may change deliberately
  # Maps settings (saved and current) to the form compared on resume, e.g. a default stored
  # as 0 to the value it stands for.
  normalize_settings: Callable[[dict[str, Any]], dict[str, Any]] | None = None
  overwrite: bool = False            # delete the workdir's checkpoints and metrics first
  nonfinite: str = "stop"            # stop | skip: what a non-finite loss or grad norm does
  check_every: int = 100             # at most this many steps between finiteness checks
  max_skipped_in_a_row: int = 10     # nonfinite="skip": stop after this many in a row
  hang_timeout_s: float | None = None  # multi-process: a loop stuck this long ends the job
                                      # (None: --hang_timeout_s of core.distributed)
  # Steps dispatched but not finished, at most: the host waits for the oldest beyond this.
  # Two keep the device fed (one runs, one is queued) and bound the device queues: with
  # dozens of multi-device steps queued, XLA:CPU's collectives over simulated devices can
  # wait on participants stuck behind them (an all-to-all rendezvous that never completes
  # on a loaded machine). 0: no bound.
  max_in_flight: int = 2
  nonfinite_hint: str = "lower the learning rate"  # what to try, named by the entry point


# TrainConfig fields that are run settings and may differ on resume (they change how far the
# run goes and what it reports, never the state or the batches it sees).
LOOP_SETTINGS = ("steps", "eval_every", "checkpoint_every", "checkpoint_every_minutes",
                 "log_every", "stop_at_step",
                 "workdir", "max_to_keep", "prefetch", "tensorboard", "nonfinite",
                 "check_every", "max_skipped_in_a_row", "hang_timeout_s")
# The clock of time-based checkpoints (a name of its own, so a test can move it alone).
_clock = time.monotonic
# Metrics that must stay finite; a task reports the ones it has.
FINITE_METRICS = ("loss", "grad_norm")


class RunSettingsError(ValueError):
  """The workdir and the run's settings disagree (a resume with other settings, a finished
  run without --resume)."""


class NonFiniteError(RuntimeError):
  """Training produced a non-finite loss, gradient norm or state."""


class Interrupted(Exception):
  """SIGTERM or SIGINT stopped training after a checkpoint of the step it was at.

  `exit_status` is 128 + the signal's number (SIGTERM 143, SIGINT 130), the shell's code
  for a process a signal ended; `core.cli.run` prints the message as the run's last line
  and exits with it, without a traceback."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"stopped at step {step}; checkpoint {step} kept; continue with --resume")
    self.step, self.signum, self.exit_status = step, signum, 128 + signum


class _EvalStopped(Exception):
  """A stop request reached an evaluation between two batches."""


class _StopSignals:
  """SIGTERM and SIGINT while `train` runs: the first is noted (`signum`), a second stops at
  once (KeyboardInterrupt). The previous handlers come back at exit. Only the main thread
  can install handlers; elsewhere the signals keep theirs."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None
    self._old: dict[int, Any] = {}

  def __enter__(self) -> "_StopSignals":
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._old[s] = signal.signal(s, self._note)
    return self

  def _note(self, signum, frame) -> None:
    del frame
    if self.signum is not None:
      raise KeyboardInterrupt
    self.signum = signum

  def __exit__(self, *exc) -> None:
    for s, h in self._old.items():
      signal.signal(s, signal.SIG_DFL if h is None else h)


def _agree(stop: bool, due: bool) -> tuple[bool, bool]:
  """Whether any process asks to stop / to checkpoint now: a collective that every process
  of a multi-process run calls at the same step."""
  from jax.experimental import multihost_utils
  votes = np.asarray(multihost_utils.process_allgather(np.array([stop, due], np.int32)))
  votes = votes.reshape(-1, 2).any(axis=0)
  return bool(votes[0]), bool(votes[1])


def check_learning_rate(flag: str, value: Any) -> None:
  """Raises a ValueError naming `flag` unless `value` is a finite number > 0."""
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
      math.isfinite(value) and value > 0
  if not ok:
    raise ValueError(f"{flag}={value!r}: expected a finite learning rate > 0")


def select_tree(ok: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the scalar `ok` is true, else `old`, leaf by leaf (for small trees: dense
  parameters and their optimizer state; embedding tables skip by their touched rows)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class Task(Protocol):
  """What the loop needs from a model family."""

  def init_state(self, seed: int) -> Any: ...
  def train_step(self, state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]: ...
  def eval_step(self, state: Any, batch: Any) -> Any: ...
  def device_batch(self, host_batch: Any) -> Any: ...
  def new_evaluator(self) -> "Evaluator": ...
  def examples_in(self, host_batch: Any) -> int: ...
  # Optional: `example_unit`, what examples_in counts, for the progress line ("ex" if absent);
  # `host_metrics(host_batch) -> {name: float}`, numbers measured on each host batch, logged
  # with that step's metrics (None or absent: none).


class Evaluator(Protocol):
  def update(self, outputs: Any, host_batch: Any) -> None: ...
  def result(self) -> dict[str, float]: ...


class MetricWriter:
  """Scalars to `<workdir>/metrics.jsonl` and TensorBoard event files under `<workdir>/tb`;
  in a multi-process run only process 0 writes (the others' writers do nothing)."""

  def __init__(self, workdir: str, resume_step: int | None, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = self._tb = None
    if not distributed.is_primary():
      return
    if resume_step is not None and os.path.exists(self.path):
      # Drop records past the checkpoint: the resumed run writes them again.
      with open(self.path) as f:
        keep = [l for l in f if l.strip() and json.loads(l)["step"] <= resume_step]
      with open(self.path + ".tmp", "w") as f:
        f.writelines(keep)
      os.replace(self.path + ".tmp", self.path)
    elif os.path.exists(self.path):
      os.remove(self.path)
    self._f = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=resume_step)

  def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
    if self._f is None:
      return
    rec = {"step": step, "split": split, **{k: float(v) for k, v in scalars.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(f"{split}/{k}", float(v), step)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
    if self._tb is not None:
      self._tb.close()


def _fmt_time(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
  """One line every `log_every` steps: step, steps/s, examples/s (or the task's own unit,
  `Task.example_unit`, e.g. tokens), loss, ETA. Each report is a line of its own, so a log
  file holds one line per report."""

  def __init__(self, total: int, start: int, unit: str = "ex"):
    self.total, self.start, self.unit = total, start, unit
    self.t0 = None
    self.step0 = start
    self.examples = 0

  def begin(self, step: int) -> None:  # after the first (compiling) step
    self.t0, self.step0, self.examples = time.perf_counter(), step, 0

  def line(self, step: int, scalars: dict[str, float],
           peers: dict[int, int] | None = None) -> str:
    """The progress line; `peers` ({process: last published step}) adds how many
    processes of a multi-process run have reported and the slowest one's step."""
    if self.t0 is None or step == self.step0:
      rate, ex_rate, eta = 0.0, 0.0, "?"
    else:
      dt = time.perf_counter() - self.t0
      rate = (step - self.step0) / dt
      ex_rate = self.examples / dt
      eta = _fmt_time((self.total - step) / rate)
    vals = " ".join(f"{k} {v:.4f}" for k, v in scalars.items())
    procs = ""
    if jax.process_count() > 1:
      procs = (f" | {len(peers or {})}/{jax.process_count()} processes reporting, slowest at "
               f"step {min((peers or {0: 0}).values())}")
    return (f"step {step}/{self.total} ({100 * step / self.total:.0f}%) | {rate:.2f} steps/s | "
            f"{ex_rate:,.0f} {self.unit}/s | {vals} | ETA {eta}{procs}")


def _prefetch(it: Iterator[Any], fn: Callable[[Any], Any], depth: int) -> Iterator[Any]:
  """Runs `fn` over `it` in a background thread, `depth` items ahead."""
  if depth <= 0:
    for x in it:
      yield x, fn(x)
    return
  q: queue.Queue = queue.Queue(maxsize=depth)
  done = object()
  stop = threading.Event()

  def put(item) -> bool:
    # A consumer that stopped early (a finished or failed run) takes nothing more: waiting
    # on a full queue forever would keep `it` open, and with it a loader's worker processes.
    while not stop.is_set():
      try:
        q.put(item, timeout=0.1)
        return True
      except queue.Full:
        pass
    return False

  def work():
    try:
      for x in it:
        if stop.is_set() or not put((x, fn(x))):
          return
      put(done)
    except BaseException as e:  # surfaced in the consumer
      put(e)
    finally:
      if hasattr(it, "close"):   # a generator: its cleanup (e.g. Grain's workers) runs now
        it.close()

  t = threading.Thread(target=work, daemon=True)
  t.start()
  try:
    while True:
      item = q.get()
      if item is done:
        return
      if isinstance(item, BaseException):
        raise item
      yield item
  finally:
    stop.set()
    # Let the thread finish the item in hand and close `it`: a daemon thread still inside
    # XLA or a loader when the process exits aborts it ("exception not rethrown").
    t.join(timeout=30)


def evaluate(task: Task, state: Any, batches: Iterable[Any], eval_step=None,
             stop: Callable[[], bool] | None = None) -> dict[str, float]:
  """The task's metrics over `batches`; `stop()` true between two batches ends it early
  (raising _EvalStopped)."""
  eval_step = eval_step or jax.jit(task.eval_step)
  ev = task.new_evaluator()
  for host, dev in _prefetch(iter(batches), task.device_batch, 2):
    if stop is not None and stop():
      raise _EvalStopped()
    ev.update(eval_step(state, dev), host)
  return ev.result()


def run_settings(cfg: TrainConfig) -> dict[str, Any]:
  """The settings saved with each checkpoint: the loop's LOOP_SETTINGS, `seed` and
  `cfg.settings`, as they read back from JSON."""
  out = {k: getattr(cfg, k) for k in LOOP_SETTINGS + ("seed",)}
  out.update(cfg.settings or {})
  return json.loads(json.dumps(out, default=str))


def _changeable(cfg: TrainConfig) -> list[str]:
  return list(dict.fromkeys(LOOP_SETTINGS + tuple(cfg.changeable)))


def _describe_run(meta: dict[str, Any], step: int) -> str:
  planned = meta.get("steps")
  if planned is None:
    return f"a checkpoint at step {step}"
  state = "a finished run" if step >= planned else "an unfinished run"
  return f"a checkpoint at step {step} ({state} of {planned} steps)"


def check_resume(cfg: TrainConfig) -> int | None:
  """Checks `cfg.workdir` before anything is built; returns the step to resume from.

  Every process of a multi-process run calls it together: barriers around it keep any of
  them from creating the checkpoint directory while another still looks for it (they
  must all take the same branch, or orbax's collective calls would pair up wrongly).
  """
  distributed.barrier("check_resume_begin")
  try:
    return _check_resume(cfg)
  finally:
    distributed.barrier("check_resume_end")


def _check_resume(cfg: TrainConfig) -> int | None:
  """`check_resume` for one process.

  With `overwrite`, first deletes the checkpoints, metrics.jsonl and TensorBoard events a
  previous run left there. A checkpoint without `resume` is a RunSettingsError saying how
  to resume or overwrite. With `resume`, the settings saved with the latest checkpoint are
  compared with `run_settings(cfg)`: any difference outside LOOP_SETTINGS, `changeable` and
  `resume_allow` is one RunSettingsError listing each (old and new value). Reads no array.
  """
  if cfg.overwrite and cfg.resume:
    raise RunSettingsError("--overwrite deletes the run that --resume would continue: pass one")
  ckpt_dir = os.path.join(cfg.workdir, "checkpoints")
  if cfg.overwrite:
    removed = [p for p in (ckpt_dir, os.path.join(cfg.workdir, "tb"),
                           os.path.join(cfg.workdir, "metrics.jsonl")) if os.path.exists(p)]
    distributed.barrier("overwrite_listed")      # every process has looked before any deletes
    if distributed.is_primary():
      for p in removed:
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
      if removed:
        print(f"--overwrite: removed {', '.join(removed)}", flush=True)
    distributed.barrier("overwrite_done")
  if not os.path.isdir(ckpt_dir):
    return None
  ckpt = ckpt_lib.Checkpointer(cfg.workdir, cfg.max_to_keep)
  try:
    latest = ckpt.latest_step()
    if latest is None:
      return None
    meta = ckpt.restore_meta(latest)
  finally:
    ckpt.close()
  if not cfg.resume:
    raise RunSettingsError(
        f"workdir {cfg.workdir!r} already holds {_describe_run(meta, latest)}; pass --resume "
        "to continue that run (with a larger --steps to train further), --overwrite to delete "
        "its checkpoints and metrics and start afresh, or choose another --workdir")
  saved = meta.get("settings")
  if saved is None:
    logging.warning("%s/%d holds no run settings (written by an older version): resuming "
                    "without checking them", ckpt_dir, latest)
    return latest
  now = run_settings(cfg)
  if cfg.normalize_settings is not None:
    saved, now = cfg.normalize_settings(saved), cfg.normalize_settings(now)
  free = set(_changeable(cfg)) | set(cfg.resume_allow)
  unknown = sorted(set(cfg.resume_allow) - set(saved) - set(now))
  if unknown:
    raise RunSettingsError(f"--resume_allow names unknown settings {unknown}; the run's "
                           f"settings are {sorted(set(saved) | set(now))}")
  differ = [k for k in sorted(set(saved) & set(now)) if k not in free and saved[k] != now[k]]
  unrecorded = sorted(set(now) - set(saved) - free)
  if unrecorded:
    logging.warning("settings %s are not recorded in %s/%d (written by an older version); "
                    "not checked", unrecorded, ckpt_dir, latest)
  if differ:
    raise RunSettingsError(
        f"--resume: the settings differ from those of the run in {os.path.abspath(ckpt_dir)} "
        f"(step {latest}):\n"
        + "".join(f"  {k}: {saved[k]!r} (checkpoint) -> {now[k]!r} (now)\n" for k in differ)
        + "Resume with the checkpoint's values, start a new run in another --workdir (or "
        f"--overwrite this one), or allow a deliberate change with --resume_allow="
        f"{','.join(differ)}. Settings that may change on resume: "
        f"{', '.join(_changeable(cfg))}.")
  return latest


def _nonfinite(values: dict[str, float]) -> dict[str, float]:
  return {k: values[k] for k in FINITE_METRICS if k in values and not math.isfinite(values[k])}


@jax.jit
def _finite_leaves(state):
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)),
                      [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)])


def _first_nonfinite_leaf(state) -> str | None:
  """The path of the first state leaf holding a NaN or inf (one fused reduction, at
  checkpoints only), or None."""
  paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  flags = jax.device_get(_finite_leaves(state))
  return next((p for p, ok in zip(paths, flags) if not ok), None)


def train(task: Task, train_batches: Callable[[int], Iterator[Any]],
          eval_batches: Callable[[], Iterable[Any]] | None, cfg: TrainConfig) -> dict[str, Any]:
  """Runs (or resumes) training; returns a summary with the last eval metrics and rates.

  `train_batches(start)` yields host batches from batch number `start` on. Raises
  RunSettingsError (see `check_resume`), checkpoint.CheckpointMismatchError (a checkpoint
  whose arrays do not fit the state), NonFiniteError or Interrupted (see the module
  docstring), a UserError when another run holds the workdir, or
  checkpoint.CheckpointWriteError (a full disk, a file-size limit); when only the final
  checkpoint failed, the final evaluation still runs and the error carries the summary
  this function would have returned (`.summary`), for the entry point's results.json.
  """
  if cfg.nonfinite not in ("stop", "skip"):
    raise ValueError(f"--nonfinite={cfg.nonfinite!r}: expected 'stop' or 'skip'")
  if cfg.check_every < 0 or cfg.max_skipped_in_a_row < 1 or cfg.max_in_flight < 0:
    raise ValueError(f"TrainConfig: check_every={cfg.check_every} (expected >= 0), "
                     f"max_skipped_in_a_row={cfg.max_skipped_in_a_row} (expected >= 1), "
                     f"max_in_flight={cfg.max_in_flight} (expected >= 0)")
  if not cfg.checkpoint_every_minutes >= 0:
    raise ValueError(f"--checkpoint_every_minutes={cfg.checkpoint_every_minutes}: expected "
                     ">= 0 (0: no time-based checkpoints)")
  with workdir_lib.held(cfg.workdir), _StopSignals() as signals:
    return _train(task, train_batches, eval_batches, cfg, signals)


def _train(task: Task, train_batches: Callable[[int], Iterator[Any]],
           eval_batches: Callable[[], Iterable[Any]] | None, cfg: TrainConfig,
           signals: _StopSignals) -> dict[str, Any]:
  """`train` with the workdir held and the stop signals noted in `signals`."""
  os.makedirs(cfg.workdir, exist_ok=True)
  latest = check_resume(cfg)
  train_step = task.train_step
  if cfg.nonfinite == "skip":
    if "skip_nonfinite" not in inspect.signature(task.train_step).parameters:
      raise ValueError(f"--nonfinite=skip: {type(task).__name__}.train_step takes no "
                       "skip_nonfinite argument; use --nonfinite=stop")
    train_step = functools.partial(task.train_step, skip_nonfinite=True)
  settings = run_settings(cfg)
  ckpt = ckpt_lib.Checkpointer(cfg.workdir, cfg.max_to_keep)
  writer = watchdog = None
  try:
    state = task.init_state(cfg.seed)
    start = 0
    meta: dict[str, Any] = {}
    if latest is not None:
      state, meta = ckpt.restore(latest, ckpt_lib.abstract_like(state))
      start = int(meta["step"])
      if meta.get("steps") not in (None, cfg.steps):
        logging.warning("resuming a run planned for %s steps with --steps=%d", meta["steps"],
                        cfg.steps)
      print(f"resumed from {ckpt.directory}/{latest} at step {start}", flush=True)
    elif cfg.resume:
      print(f"--resume: no checkpoint under {ckpt.directory}; starting from step 0", flush=True)

    writer = MetricWriter(cfg.workdir, start if latest is not None else None, cfg.tensorboard)
    step_fn = jax.jit(train_step, donate_argnums=0)
    eval_fn = jax.jit(task.eval_step)
    end = cfg.steps if cfg.stop_at_step is None else min(cfg.steps, cfg.stop_at_step)
    progress = Progress(cfg.steps, start, getattr(task, "example_unit", "ex"))
    last_eval: dict[str, float] = dict(meta.get("last_eval", {}))
    eval_step = meta.get("eval_step")   # the step last_eval was measured at
    skipped = int(meta.get("skipped_steps", 0))
    skip_run = 0
    pending: list[tuple[int, dict[str, jax.Array]]] = []   # (step, metrics on device)
    in_flight: collections.deque = collections.deque()      # metrics of unfinished steps
    fetched: list[tuple[int, dict[str, float]]] = []       # checked, not yet logged
    train_time = 0.0   # seconds of training steps after the first, eval and checkpoints excluded
    saved_step, saved_at = None, _clock()   # the last checkpoint written, and when
    save_error: ckpt_lib.CheckpointWriteError | None = None
    one_process = jax.process_count() == 1

    def stop_message(step: int, what: str) -> str:
      good = [s for s in ckpt.all_steps() if s < step]
      where = (f"the last good checkpoint is {ckpt.directory}/{max(good)} (step {max(good)}); "
               "continue from it with --resume" if good else
               "no checkpoint precedes it; a new run starts from step 0")
      return (f"training stopped: {what}. No checkpoint of the state after it was written; "
              f"{where}. What to try: {cfg.nonfinite_hint}; look for bad values in batch "
              f"{step - 1} (the batch of step {step}); or --nonfinite=skip to skip such steps "
              "and count them (changing a setting on resume needs --resume_allow=NAME).")

    def check(step: int, values: dict[str, float]) -> None:
      nonlocal skipped, skip_run
      bad = _nonfinite(values)
      if values.get("skipped", 0.0) > 0:
        skipped += 1
        skip_run += 1
        if skip_run >= cfg.max_skipped_in_a_row:
          raise NonFiniteError(stop_message(
              step - skip_run + 1, f"steps {step - skip_run + 1} to {step} were all skipped "
              f"for a non-finite loss or gradient norm ({skip_run} in a row, "
              f"max_skipped_in_a_row={cfg.max_skipped_in_a_row})"))
        return
      skip_run = 0
      if bad:
        shown = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise NonFiniteError(stop_message(
            step, f"step {step} is the first with a non-finite loss or gradient norm ({shown})"))

    def drain(keep_last: int = 0) -> None:
      """Fetches and checks the metrics of all pending steps but the newest `keep_last`
      (leaving the step just dispatched to run while the host waits for older ones)."""
      n = len(pending) - keep_last
      if n <= 0:
        return
      take = pending[:n]
      del pending[:n]
      for (s, _), vals in zip(take, jax.device_get([m for _, m in take])):
        values = {k: float(np.mean(v)) for k, v in vals.items()}
        check(s, values)
        fetched.append((s, values))

    def log_scalars() -> dict[str, float]:
      kept = [v for _, v in fetched if not v.get("skipped", 0.0)]
      keys = dict.fromkeys(k for _, v in fetched for k in v)
      scalars = {k: float(np.mean([v[k] for v in kept])) for k in keys
                 if k != "skipped" and kept}
      if cfg.nonfinite == "skip":
        scalars["skipped"] = float(sum(v.get("skipped", 0.0) for _, v in fetched))
      fetched.clear()
      return scalars

    def meta_of(step):
      return {"step": step, "steps": cfg.steps, "last_eval": last_eval, "eval_step": eval_step,
              "skipped_steps": skipped, "settings": settings, "changeable": _changeable(cfg)}

    def save(step):
      nonlocal saved_step, saved_at
      drain()
      bad_leaf = _first_nonfinite_leaf(state)
      if bad_leaf is not None:
        raise NonFiniteError(stop_message(
            step, f"the state after step {step} holds non-finite values (first: {bad_leaf}) "
            "although the losses and gradient norms checked so far were finite"))
      ckpt.save(step, state, meta_of(step))
      saved_step, saved_at = step, _clock()

    def run_eval(step):
      nonlocal last_eval, eval_step
      if eval_batches is None:
        return
      drain()
      t = time.perf_counter()
      try:
        # One process stops an evaluation between batches; several finish it (a process
        # leaving its eval collectives would leave the others waiting).
        last_eval = evaluate(task, state, eval_batches(), eval_fn,
                             stop=(lambda: signals.signum is not None) if one_process else None)
        eval_step = step
      except _EvalStopped:
        if save_error is not None:
          raise save_error from None
        if saved_step != step:
          save(step)
        raise Interrupted(step, signals.signum) from None
      except Exception:
        # A bad eval batch (a corrupt shard, a malformed line) must not lose the training
        # before it: the state is checked and saved first, then the error goes on. With
        # several processes a save needs all of them, and the others may be waiting in an
        # eval collective: there the failure is reported (core.distributed) instead.
        if one_process:
          if step not in ckpt.all_steps():
            save(step)
          print(f"evaluation at step {step} failed; the training so far is saved in "
                f"{ckpt.directory}/{step} (continue with --resume)", flush=True)
        raise
      writer.write(step, "eval", last_eval)
      shown = " ".join(f"{k} {v:.4f}" for k, v in last_eval.items() if isinstance(v, float))
      print(f"eval @ step {step}: {shown} ({time.perf_counter() - t:.1f}s)", flush=True)

    step = start
    host_metrics = getattr(task, "host_metrics", None)
    batches = _prefetch(train_batches(start), task.device_batch, cfg.prefetch)
    t_last = time.perf_counter()
    watchdog = distributed.Watchdog(distributed.hang_timeout_s() if cfg.hang_timeout_s is None
                                    else cfg.hang_timeout_s)
    while step < end:
      host, dev = next(batches)
      state, metrics = step_fn(state, dev)
      step += 1
      watchdog.beat(step)
      n = task.examples_in(host)
      if host_metrics is not None:   # numbers the task measures on the host batch itself
        metrics = {**metrics, **host_metrics(host)}
      pending.append((step, metrics))
      if cfg.max_in_flight:
        in_flight.append(metrics)
        if len(in_flight) > cfg.max_in_flight:
          jax.block_until_ready(in_flight.popleft())  # waits on the device, fetches nothing
      if step == start + 1:
        jax.block_until_ready(metrics)  # first step compiles: keep it out of the rates
        progress.begin(step)
        t_last = time.perf_counter()
      else:
        progress.examples += n
      if step % cfg.log_every == 0 or step == end:
        drain()
        scalars = log_scalars()
        now = time.perf_counter()
        train_time += now - t_last
        writer.write(step, "train", scalars)
        print(progress.line(step, scalars, watchdog.peers()), flush=True)
        t_last = now
      elif cfg.check_every and step % cfg.check_every == 0:
        drain(keep_last=1)
      boundary = False
      if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
        jax.block_until_ready(state)
        train_time += time.perf_counter() - t_last
        run_eval(step)
        boundary = True
      if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < end:
        if not boundary:
          jax.block_until_ready(state)
          train_time += time.perf_counter() - t_last
        save(step)
        boundary = True
      # A stop request (SIGTERM / SIGINT) and the time-based checkpoint, decided at the
      # same step by every process: at each step with one process, at log steps (one small
      # collective) with several.
      if step < end and (one_process or step % cfg.log_every == 0):
        want_stop = signals.signum is not None
        due = (cfg.checkpoint_every_minutes > 0 and
               _clock() - saved_at >= 60 * cfg.checkpoint_every_minutes)
        if not one_process:
          want_stop, due = _agree(want_stop, due)
        if (want_stop or due) and saved_step != step:
          if not boundary:
            jax.block_until_ready(state)
            train_time += time.perf_counter() - t_last
          save(step)
          boundary = True
        if want_stop:
          raise Interrupted(step, signals.signum or signal.SIGTERM)
      if boundary:
        t_last = time.perf_counter()
    jax.block_until_ready(state)
    drain()
    finished_unevaluated = (step >= cfg.steps and eval_batches is not None and
                            meta.get("eval_step", step) != step)
    if step > start:  # a resumed run that had already finished has nothing new to record
      # The final checkpoint goes first, so an interrupt during the final evaluation loses
      # no training; a failed write still lets that evaluation run (results.json).
      try:
        save(step)
      except ckpt_lib.CheckpointWriteError as e:
        save_error = e
      if step >= cfg.steps:
        run_eval(step)
        if save_error is None and eval_batches is not None:
          ckpt.update_meta(step, meta_of(step))
    elif finished_unevaluated:   # its final evaluation was interrupted: run it now
      run_eval(step)
      ckpt.update_meta(step, meta_of(step))
    else:
      print(f"nothing to do: the run is at step {step} of {cfg.steps}", flush=True)
  finally:
    if watchdog is not None:
      watchdog.close()
    if writer is not None:
      writer.close()
    ckpt.close()
  if skipped:
    print(f"{skipped} step(s) skipped for a non-finite loss or gradient norm", flush=True)
  out = {
      "state": state,
      "step": step,
      "finished": step >= cfg.steps,
      "eval": last_eval,
      "skipped_steps": skipped,
      "train_seconds": train_time,
      "examples_per_sec": progress.examples / train_time if train_time > 0 else 0.0,
  }
  if save_error is not None:
    save_error.summary = out
    raise save_error
  return out
