"""The one train loop every model family uses.

A `Task` owns the model: it builds the state, the pure train and eval steps and the
evaluation metrics (its dense optimizer step: `core.update.dense_update`). The loop owns
the run: jit with donated state, a background thread that prepares batches, and after each
step the hooks due then (`core.hooks`): eval every N steps, metrics to JSONL and
TensorBoard, a progress line with rate and ETA, orbax checkpoints every N steps and at the
end, the finiteness checks, the multi-process watchdog. `resume` continues the same run
exactly: the state, its RNG and optimizer state come from the checkpoint, and batch k of
the resumed run is batch k of the uninterrupted one; the checkpoint's metadata also carries
the metrics of the steps after the last log line and the count of skipped steps in a row,
and a periodic evaluation that a stop (or an error) cut short runs first, so metrics.jsonl
reads as the uninterrupted run's.

Adding a hook (a custom evaluation, a probe, a writer) is one argument to `train`:

    def probe(run):                 # run: `Run`; step, state, cfg, task, writer, ...
      run.pause()                   # the steps in flight finish; its time is not training's
      run.writer.write(run.step, "probe", my_metrics(run.state))

    train(task, batches, eval_batches, cfg, hooks=[Hook(probe, every=500)])

`Hook(fn, every=N, last=False)` runs `fn(run)` after every step divisible by N (and at the
loop's last step with `last=True`), after the loop's own hooks and before the stop check.

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
from core import errors
from core import workdir as workdir_lib
from core.hooks import Hook, MetricWriter, Progress, builtin_hooks, run_hooks
from core.update import dense_update, select_tree  # core.train's names too


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



def check_learning_rate(flag: str, value: Any) -> None:
  """Raises a ValueError naming `flag` unless `value` is a finite number > 0."""
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
      math.isfinite(value) and value > 0
  if not ok:
    raise ValueError(f"{flag}={value!r}: expected a finite learning rate > 0")



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
  # with that step's metrics (None or absent: none);
  # `checkpoint_meta() -> dict`, JSON saved with every checkpoint's metadata (e.g. the
  # layout the state was written in); `restore_checkpoint(ckpt, step, state) -> (state,
  # meta)`, the checkpoint read into `state`'s shardings, converting a state written in
  # another layout (absent: `ckpt.restore` with the shapes and shardings of `state`).


class Evaluator(Protocol):
  def update(self, outputs: Any, host_batch: Any) -> None: ...
  def result(self) -> dict[str, float]: ...



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



class Run:
  """One training run in progress: its state and bookkeeping, read and driven by the
  hooks (`core.hooks`). `step`, `state`, `host` and `metrics` are those of the step just
  dispatched; `pause()` marks a hook's time (an evaluation, a checkpoint) as outside the
  training rates after waiting for the steps in flight; `drain()` fetches and checks the
  metrics of the steps not yet checked."""

  def __init__(self, task: Task, cfg: TrainConfig, eval_batches, signals: _StopSignals):
    self.task, self.cfg, self.eval_batches, self.signals = task, cfg, eval_batches, signals
    self.settings = run_settings(cfg)
    self.ckpt = ckpt_lib.Checkpointer(cfg.workdir, cfg.max_to_keep)
    self.writer = self.watchdog = self.eval_fn = None
    self.end = cfg.steps if cfg.stop_at_step is None else min(cfg.steps, cfg.stop_at_step)
    self.one_process = jax.process_count() == 1
    self.host = self.metrics = None
    self.pending: list[tuple[int, dict[str, jax.Array]]] = []   # (step, metrics on device)
    self.in_flight: collections.deque = collections.deque()      # metrics of unfinished steps
    self.fetched: list[tuple[int, dict[str, float]]] = []       # checked, not yet logged
    self.train_time = 0.0   # seconds of training steps after the first, hooks' pauses excluded
    self.t_last = 0.0       # when the current stretch of training time began
    self.paused = False
    self.skip_run = 0
    self.save_error: ckpt_lib.CheckpointWriteError | None = None

  def restore(self, latest: int | None) -> None:
    """The initial state, or the checkpoint at step `latest` with its metadata."""
    cfg = self.cfg
    self.state = self.task.init_state(cfg.seed)
    self.start, self.meta = 0, {}
    if latest is not None:
      restore = getattr(self.task, "restore_checkpoint", None)
      self.state, self.meta = (
          restore(self.ckpt, latest, self.state) if restore is not None else
          self.ckpt.restore(latest, ckpt_lib.abstract_like(self.state)))
      self.start = int(self.meta["step"])
      if self.meta.get("steps") not in (None, cfg.steps):
        logging.warning("resuming a run planned for %s steps with --steps=%d",
                        self.meta["steps"], cfg.steps)
      print(f"resumed from {self.ckpt.directory}/{latest} at step {self.start}", flush=True)
    elif cfg.resume:
      print(f"--resume: no checkpoint under {self.ckpt.directory}; starting from step 0",
            flush=True)
    self.step = self.start
    self.writer = MetricWriter(cfg.workdir, self.start if latest is not None else None,
                               cfg.tensorboard)
    self.progress = Progress(cfg.steps, self.start, getattr(self.task, "example_unit", "ex"))
    self.last_eval: dict[str, float] = dict(self.meta.get("last_eval", {}))
    self.eval_step = self.meta.get("eval_step")   # the step last_eval was measured at
    self.skipped = int(self.meta.get("skipped_steps", 0))
    self.skip_run = int(self.meta.get("skipped_in_a_row", 0))
    # Metrics of the steps after the last log line: the next line averages them as the
    # uninterrupted run's does.
    self.fetched = [(int(s), dict(v)) for s, v in self.meta.get("unlogged", [])]
    # The last checkpoint written (the one resumed from is on disk already), and when.
    self.saved_step = self.start if latest is not None else None
    self.saved_at = _clock()
    self.saved_here = False   # whether this process wrote a checkpoint in this run

  def clock(self) -> float:
    return _clock()

  def pause(self) -> None:
    """Waits for the steps in flight and ends the current stretch of training time (once
    per step, however many hooks pause)."""
    if not self.paused:
      jax.block_until_ready(self.state)
      self.train_time += time.perf_counter() - self.t_last
      self.paused = True

  def resume_clock(self) -> None:
    if self.paused:
      self.t_last = time.perf_counter()
      self.paused = False

  def interrupt(self) -> None:
    raise Interrupted(self.step, self.signals.signum or signal.SIGTERM)

  def stop_message(self, step: int, what: str) -> str:
    good = [s for s in self.ckpt.all_steps() if s < step]
    where = (f"the last good checkpoint is {self.ckpt.directory}/{max(good)} (step "
             f"{max(good)}); continue from it with --resume" if good else
             "no checkpoint precedes it; a new run starts from step 0")
    return (f"training stopped: {what}. No checkpoint of the state after it was written; "
            f"{where}. What to try: {self.cfg.nonfinite_hint}; look for bad values in batch "
            f"{step - 1} (the batch of step {step}); or --nonfinite=skip to skip such steps "
            "and count them (changing a setting on resume needs --resume_allow=NAME).")

  def check(self, step: int, values: dict[str, float]) -> None:
    """Counts a skipped step (NonFiniteError after max_skipped_in_a_row in a row); a
    non-finite loss or gradient norm is a NonFiniteError."""
    if values.get("skipped", 0.0) > 0:
      self.skipped += 1
      self.skip_run += 1
      if self.skip_run >= self.cfg.max_skipped_in_a_row:
        first = step - self.skip_run + 1
        raise NonFiniteError(self.stop_message(
            first, f"steps {first} to {step} were all skipped for a non-finite loss or "
            f"gradient norm ({self.skip_run} in a row, "
            f"max_skipped_in_a_row={self.cfg.max_skipped_in_a_row})"))
      return
    self.skip_run = 0
    bad = _nonfinite(values)
    if bad:
      shown = ", ".join(f"{k} {v}" for k, v in bad.items())
      raise NonFiniteError(self.stop_message(
          step, f"step {step} is the first with a non-finite loss or gradient norm ({shown})"))

  def drain(self, keep_last: int = 0) -> None:
    """Fetches and checks the metrics of all pending steps but the newest `keep_last`
    (leaving the step just dispatched to run while the host waits for older ones)."""
    n = len(self.pending) - keep_last
    if n <= 0:
      return
    take = self.pending[:n]
    del self.pending[:n]
    for (s, _), vals in zip(take, jax.device_get([m for _, m in take])):
      values = {k: float(np.mean(v)) for k, v in vals.items()}
      self.check(s, values)
      self.fetched.append((s, values))

  def log_scalars(self) -> dict[str, float]:
    """The mean metrics of the steps fetched since the last log (skipped steps left out;
    under nonfinite="skip", how many were skipped)."""
    fetched = self.fetched
    kept = [v for _, v in fetched if not v.get("skipped", 0.0)]
    keys = dict.fromkeys(k for _, v in fetched for k in v)
    scalars = {k: float(np.mean([v[k] for v in kept])) for k in keys
               if k != "skipped" and kept}
    if self.cfg.nonfinite == "skip":
      scalars["skipped"] = float(sum(v.get("skipped", 0.0) for _, v in fetched))
    fetched.clear()
    return scalars

  def meta_of(self, step: int) -> dict[str, Any]:
    extra = getattr(self.task, "checkpoint_meta", None)
    return {**(extra() if extra is not None else {}),
            "step": step, "steps": self.cfg.steps, "last_eval": self.last_eval,
            "eval_step": self.eval_step, "skipped_steps": self.skipped,
            "skipped_in_a_row": self.skip_run, "unlogged": self.fetched,
            "settings": self.settings, "changeable": _changeable(self.cfg)}

  def eval_missed(self) -> bool:
    """Whether the resumed step is a periodic evaluation's whose evaluation did not
    complete (a stop or a failure during it): the uninterrupted run evaluated there."""
    cfg = self.cfg
    return (self.eval_batches is not None and cfg.eval_every > 0 and "eval_step" in self.meta
            and 0 < self.start < cfg.steps and self.start % cfg.eval_every == 0
            and self.meta["eval_step"] != self.start)

  def record_eval(self, step: int) -> None:
    """Puts the evaluation just run at `step` into that checkpoint's metadata. A checkpoint
    this run did not write keeps its own metadata but for the evaluation: the task's part
    describes the arrays as written (e.g. an embedding layout the run resharded from)."""
    meta = (self.meta_of(step) if self.saved_here else
            {**self.meta, "last_eval": self.last_eval, "eval_step": self.eval_step})
    self.ckpt.update_meta(step, meta)

  def save(self) -> None:
    """Checks the pending steps and the state, then checkpoints the current step."""
    step = self.step
    self.drain()
    bad_leaf = _first_nonfinite_leaf(self.state)
    if bad_leaf is not None:
      raise NonFiniteError(self.stop_message(
          step, f"the state after step {step} holds non-finite values (first: {bad_leaf}) "
          "although the losses and gradient norms checked so far were finite"))
    self.ckpt.save(step, self.state, self.meta_of(step))
    self.saved_step, self.saved_at, self.saved_here = step, _clock(), True

  def evaluate(self) -> None:
    """Evaluates the current state, writes and prints the result. A stop request during it
    saves and raises Interrupted; a failing evaluation saves the training first."""
    if self.eval_batches is None:
      return
    step = self.step
    self.drain()
    t = time.perf_counter()
    try:
      # One process stops an evaluation between batches; several finish it (a process
      # leaving its eval collectives would leave the others waiting).
      stop = (lambda: self.signals.signum is not None) if self.one_process else None
      self.last_eval = evaluate(self.task, self.state, self.eval_batches(), self.eval_fn,
                                stop=stop)
      self.eval_step = step
    except _EvalStopped:
      if self.save_error is not None:
        raise self.save_error from None
      if self.saved_step != step:
        self.save()
      raise Interrupted(step, self.signals.signum) from None
    except Exception:
      # A bad eval batch (a corrupt shard, a malformed line) must not lose the training
      # before it: the state is checked and saved first, then the error goes on. With
      # several processes a save needs all of them, and the others may be waiting in an
      # eval collective: there the failure is reported (core.distributed) instead.
      if self.one_process:
        if step not in self.ckpt.all_steps():
          self.save()
        print(f"evaluation at step {step} failed; the training so far is saved in "
              f"{self.ckpt.directory}/{step} (continue with --resume)", flush=True)
      raise
    self.writer.write(step, "eval", self.last_eval)
    shown = " ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items() if isinstance(v, float))
    print(f"eval @ step {step}: {shown} ({time.perf_counter() - t:.1f}s)", flush=True)

  def finish(self) -> None:
    """After the loop: the final checkpoint, then the final evaluation (whose result goes
    into that checkpoint's metadata); a failed final write is kept in `save_error` and the
    evaluation still runs. A finished run whose final evaluation did not complete runs it."""
    jax.block_until_ready(self.state)
    self.drain()
    step, cfg = self.step, self.cfg
    finished_unevaluated = (step >= cfg.steps and self.eval_batches is not None and
                            self.meta.get("eval_step", step) != step)
    if step > self.start:  # a resumed run that had already finished has nothing new to record
      try:
        self.save()
      except ckpt_lib.CheckpointWriteError as e:
        self.save_error = e
      if step >= cfg.steps:
        self.evaluate()
        if self.save_error is None and self.eval_batches is not None:
          self.record_eval(step)
    elif finished_unevaluated:   # its final evaluation was interrupted: run it now
      self.evaluate()
      self.record_eval(step)
    else:
      print(f"nothing to do: the run is at step {step} of {cfg.steps}", flush=True)

  def close(self) -> None:
    if self.watchdog is not None:
      self.watchdog.close()
    if self.writer is not None:
      self.writer.close()
    self.ckpt.close()

  def summary(self) -> dict[str, Any]:
    """What `train` returns (or raises, with a failed final checkpoint's error)."""
    if self.skipped:
      print(f"{self.skipped} step(s) skipped for a non-finite loss or gradient norm",
            flush=True)
    out = {
        "state": self.state,
        "step": self.step,
        "finished": self.step >= self.cfg.steps,
        "eval": self.last_eval,
        "skipped_steps": self.skipped,
        "train_seconds": self.train_time,
        "examples_per_sec": (self.progress.examples / self.train_time
                             if self.train_time > 0 else 0.0),
    }
    if self.save_error is not None:
      self.save_error.summary = out
      raise self.save_error
    return out


def check_stop_at_step(stop_at_step: int | None, steps: int) -> None:
  """--stop_at_step past a run's last step would never stop it: refused, not ignored."""
  if stop_at_step is not None and stop_at_step > steps:
    raise errors.expected(f"--stop_at_step={stop_at_step}", f"after the run's last step "
                          f"({steps})", f"a step <= {steps}")


def train(task: Task, train_batches: Callable[[int], Iterator[Any]],
          eval_batches: Callable[[], Iterable[Any]] | None, cfg: TrainConfig,
          hooks: Sequence[Hook] = ()) -> dict[str, Any]:
  """Runs (or resumes) training; returns a summary with the last eval metrics and rates.

  `train_batches(start)` yields host batches from batch number `start` on. `hooks`: the
  caller's `Hook(fn, every=N)`s, run after the loop's own (see the module docstring).
  Raises RunSettingsError (see `check_resume`), checkpoint.CheckpointMismatchError (a
  checkpoint whose arrays do not fit the state), NonFiniteError or Interrupted (see the
  module docstring), a UserError when another run holds the workdir, or
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
  check_stop_at_step(cfg.stop_at_step, cfg.steps)
  if cfg.nonfinite == "skip" and (
      "skip_nonfinite" not in inspect.signature(task.train_step).parameters):
    raise ValueError(f"--nonfinite=skip: {type(task).__name__}.train_step takes no "
                     "skip_nonfinite argument; use --nonfinite=stop")
  with workdir_lib.held(cfg.workdir), _StopSignals() as signals:
    return _train(task, train_batches, eval_batches, cfg, signals, hooks)


def _train(task: Task, train_batches: Callable[[int], Iterator[Any]],
           eval_batches: Callable[[], Iterable[Any]] | None, cfg: TrainConfig,
           signals: _StopSignals, hooks: Sequence[Hook]) -> dict[str, Any]:
  """`train` with the workdir held and the stop signals noted in `signals`: one jitted
  step per batch, then the hooks due at that step; after the loop, `Run.finish`."""
  os.makedirs(cfg.workdir, exist_ok=True)
  latest = check_resume(cfg)
  train_step = task.train_step
  if cfg.nonfinite == "skip":   # (`train` checked that the task's step takes it)
    train_step = functools.partial(task.train_step, skip_nonfinite=True)
  run = Run(task, cfg, eval_batches, signals)
  batches = None
  try:
    run.restore(latest)
    step_fn = jax.jit(train_step, donate_argnums=0)
    run.eval_fn = jax.jit(task.eval_step)
    all_hooks = builtin_hooks(run, hooks)
    batches = _prefetch(train_batches(run.start), task.device_batch, cfg.prefetch)
    run.t_last = time.perf_counter()
    run.watchdog = distributed.Watchdog(distributed.hang_timeout_s() if cfg.hang_timeout_s
                                        is None else cfg.hang_timeout_s)
    if run.eval_missed():   # resumed at an evaluation that a stop or an error cut short
      run.pause()
      run.evaluate()
      run.record_eval(run.start)
      run.resume_clock()
    while run.step < run.end:
      run.host, dev = next(batches)
      run.state, run.metrics = step_fn(run.state, dev)
      run.step += 1
      run_hooks(all_hooks, run)
      run.resume_clock()
    run.finish()
  finally:
    if batches is not None:
      # Now, not when the generator is collected: a raised error's traceback holds it, and
      # with it the prefetch thread and the source (a loader's worker processes).
      batches.close()
    run.close()
  return run.summary()
