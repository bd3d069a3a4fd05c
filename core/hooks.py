"""What the train loop does besides stepping: hooks run every N steps, and their writers.

A hook is a function of the run (`core.train.Run`: `step`, `state`, `host` and `metrics`
of the step just dispatched, `cfg`, `task`, `writer`, `pause()`, `drain()`), run after
each step whose number `every` divides (levanter's `trainer.add_hook(fn, every=N)`), and
with `last=True` also at the loop's last step. `builtin_hooks` lists the loop's own, in
the order they run: the watchdog's beat, the task's host metrics, the in-flight bound and
rates, the log line with its metrics, the finiteness check, evaluation, checkpoints, then
the hooks `core.train.train(..., hooks=)` adds, then the stop request and the time-based
checkpoint. This module also holds the metric writer (JSONL + TensorBoard) and the
progress line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np

from core import distributed, errors

if TYPE_CHECKING:
  from core.train import Run


@dataclasses.dataclass(frozen=True)
class Hook:
  """`fn(run)` after every step divisible by `every` (0: none), and at the loop's last
  step when `last`."""

  fn: Callable[["Run"], None]
  every: int = 1
  last: bool = False

  def due(self, step: int, end: int) -> bool:
    return bool(self.every and step % self.every == 0) or (self.last and step == end)


def run_hooks(hooks: Sequence[Hook], run: "Run") -> None:
  """Runs the hooks due at `run.step`, in order."""
  for hook in hooks:
    if hook.due(run.step, run.end):
      hook.fn(run)


def _agree(stop: bool, due: bool) -> tuple[bool, bool]:
  """Whether any process asks to stop / to checkpoint now: a collective that every process
  of a multi-process run calls at the same step."""
  from jax.experimental import multihost_utils
  votes = np.asarray(multihost_utils.process_allgather(np.array([stop, due], np.int32)))
  votes = votes.reshape(-1, 2).any(axis=0)
  return bool(votes[0]), bool(votes[1])


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
      keep = [l for _, l, rec in _records(self.path) if rec["step"] <= resume_step]
      with open(self.path + ".tmp", "w") as f:
        f.writelines(keep)
      os.replace(self.path + ".tmp", self.path)
    elif os.path.exists(self.path):
      os.remove(self.path)
    self._f = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      # TensorBoard hides the earlier events of steps >= purge_step: those after the
      # checkpoint, as above (the checkpoint's own step is not written again).
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=(
          None if resume_step is None else resume_step + 1))

  def write(self, step: int, split: str, scalars: dict[str, Any]) -> None:
    """One record: numbers as floats (JSONL and TensorBoard); a dict or list value (a
    breakdown such as NE by slice) goes to the JSONL record only."""
    if self._f is None:
      return
    nums = {k: float(v) for k, v in scalars.items() if not isinstance(v, (dict, list))}
    rec = {"step": step, "split": split, **{k: nums.get(k, v) for k, v in scalars.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in nums.items():
        self._tb.add_scalar(f"{split}/{k}", v, step)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
    if self._tb is not None:
      self._tb.close()


def _records(path: str) -> list[tuple[int, str, dict]]:
  """(line number, line, record) of each record of a metrics.jsonl. A last line that is not
  a whole record (a write cut short by a crash: part of a line, or the zero bytes a file
  system leaves after a power loss) is dropped with one printed line; a bad line before
  others is a UserError naming the file and line."""
  with open(path, "rb") as f:
    lines = [(i, l.decode("utf-8", "replace")) for i, l in enumerate(f, 1)
             if l.strip(b" \t\r\n\x00")]
  out = []
  for j, (i, line) in enumerate(lines):
    try:
      rec = json.loads(line)
      ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
    except ValueError:
      ok = False
    if ok:
      out.append((i, line if line.endswith("\n") else line + "\n", rec))
    elif j == len(lines) - 1:
      print(f"{path}:{i}: dropped a last line that is not a whole record (a write cut short): "
            f"{line[:80]!r}", flush=True)
    else:
      raise errors.expected(f"{path}:{i}", f"{line[:80]!r} is not a metrics record",
                            "one JSON object with an integer 'step' per line (remove the "
                            "line, or resume elsewhere)")
  return out


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


# --- the loop's own hooks


def beat_watchdog(run: "Run") -> None:
  """Publishes the step to the multi-process watchdog (a loop stuck too long ends the job)."""
  run.watchdog.beat(run.step)


def add_host_metrics(run: "Run") -> None:
  """Adds the numbers the task measures on the host batch itself to the step's metrics."""
  run.metrics = {**run.metrics, **run.task.host_metrics(run.host)}


def queue_metrics(run: "Run") -> None:
  """Queues the step's metrics for the next check; waits on the device for the oldest
  step beyond `max_in_flight`; keeps the first (compiling) step out of the rates."""
  n = run.task.examples_in(run.host)
  run.pending.append((run.step, run.metrics))
  if run.cfg.max_in_flight:
    run.in_flight.append(run.metrics)
    if len(run.in_flight) > run.cfg.max_in_flight:
      jax.block_until_ready(run.in_flight.popleft())  # waits on the device, fetches nothing
  if run.step == run.start + 1:
    jax.block_until_ready(run.metrics)
    run.progress.begin(run.step)
    run.t_last = time.perf_counter()
  else:
    run.progress.examples += n


def log_train_metrics(run: "Run") -> None:
  """Checks the pending steps, writes their mean metrics and prints the progress line."""
  run.drain()
  scalars = run.log_scalars()
  now = time.perf_counter()
  run.train_time += now - run.t_last
  run.writer.write(run.step, "train", scalars)
  print(run.progress.line(run.step, scalars, run.watchdog.peers()), flush=True)
  run.t_last = now


def check_finite(run: "Run") -> None:
  """Checks the loss and gradient norm of every pending step but the newest (still
  running while the host waits for the older ones)."""
  run.drain(keep_last=1)


def periodic_eval(run: "Run") -> None:
  """Evaluates, except at the run's last step (the final evaluation follows the loop)."""
  if run.step < run.cfg.steps:
    run.pause()
    run.evaluate()


def periodic_checkpoint(run: "Run") -> None:
  """Saves a checkpoint, except at the loop's last step (saved after the loop)."""
  if run.step < run.end:
    run.pause()
    run.save()


def stop_or_timed_checkpoint(run: "Run") -> None:
  """A stop request (SIGTERM / SIGINT) saves and raises `core.train.Interrupted`; once
  `checkpoint_every_minutes` have passed since the last checkpoint, one is saved. With
  several processes every one decides the same (`_agree`, one small collective)."""
  if run.step >= run.end:
    return
  cfg = run.cfg
  want_stop = run.signals.signum is not None
  due = (cfg.checkpoint_every_minutes > 0 and
         run.clock() - run.saved_at >= 60 * cfg.checkpoint_every_minutes)
  if not run.one_process:
    want_stop, due = _agree(want_stop, due)
  if (want_stop or due) and run.saved_step != run.step:
    run.pause()
    run.save()
  if want_stop:
    run.interrupt()


def builtin_hooks(run: "Run", extra: Sequence[Hook] = ()) -> list[Hook]:
  """The loop's hooks for `run.cfg`, with `extra` (the caller's) before the stop check."""
  cfg = run.cfg
  hooks = [Hook(beat_watchdog)]
  if getattr(run.task, "host_metrics", None) is not None:
    hooks.append(Hook(add_host_metrics))
  hooks += [Hook(queue_metrics), Hook(log_train_metrics, cfg.log_every, last=True),
            Hook(check_finite, cfg.check_every), Hook(periodic_eval, cfg.eval_every),
            Hook(periodic_checkpoint, cfg.checkpoint_every), *extra,
            Hook(stop_or_timed_checkpoint, 1 if run.one_process else cfg.log_every)]
  return hooks
