"""The one train loop every model family uses.

A `Task` owns the model: it builds the state, the pure train and eval steps and the
evaluation metrics. The loop owns the run: jit with donated state, a background thread
that prepares batches, eval every N steps, metrics to JSONL and TensorBoard, a progress
line with rate and ETA, orbax checkpoints every N steps and at the end, and `resume`,
which continues the same run exactly: the state, its RNG and optimizer state come from
the checkpoint, and batch k of the resumed run is batch k of the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import jax
import numpy as np
from absl import logging

from core import checkpoint as ckpt_lib


@dataclasses.dataclass
class TrainConfig:
  workdir: str
  steps: int
  eval_every: int = 0            # 0: evaluate only at the end
  checkpoint_every: int = 0      # 0: checkpoint only at the end
  log_every: int = 50
  resume: bool = False
  stop_at_step: int | None = None  # stop (with a checkpoint) before `steps`, as a preemption would
  max_to_keep: int = 3
  seed: int = 0
  prefetch: int = 2
  tensorboard: bool = True


class Task(Protocol):
  """What the loop needs from a model family."""

  def init_state(self, seed: int) -> Any: ...
  def train_step(self, state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]: ...
  def eval_step(self, state: Any, batch: Any) -> Any: ...
  def device_batch(self, host_batch: Any) -> Any: ...
  def new_evaluator(self) -> "Evaluator": ...
  def examples_in(self, host_batch: Any) -> int: ...


class Evaluator(Protocol):
  def update(self, outputs: Any, host_batch: Any) -> None: ...
  def result(self) -> dict[str, float]: ...


class MetricWriter:
  """Scalars to `<workdir>/metrics.jsonl` and TensorBoard event files under `<workdir>/tb`."""

  def __init__(self, workdir: str, resume_step: int | None, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
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
    rec = {"step": step, "split": split, **{k: float(v) for k, v in scalars.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(f"{split}/{k}", float(v), step)

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def _fmt_time(s: float) -> str:
  s = int(max(s, 0))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
  """One line every `log_every` steps: step, steps/s, examples/s, loss, ETA."""

  def __init__(self, total: int, start: int):
    self.total, self.start = total, start
    self.t0 = None
    self.step0 = start
    self.examples = 0

  def begin(self, step: int) -> None:  # after the first (compiling) step
    self.t0, self.step0, self.examples = time.perf_counter(), step, 0

  def line(self, step: int, scalars: dict[str, float]) -> str:
    if self.t0 is None or step == self.step0:
      rate, ex_rate, eta = 0.0, 0.0, "?"
    else:
      dt = time.perf_counter() - self.t0
      rate = (step - self.step0) / dt
      ex_rate = self.examples / dt
      eta = _fmt_time((self.total - step) / rate)
    vals = " ".join(f"{k} {v:.4f}" for k, v in scalars.items())
    return (f"step {step}/{self.total} ({100 * step / self.total:.0f}%) | {rate:.2f} steps/s | "
            f"{ex_rate:,.0f} ex/s | {vals} | ETA {eta}")


def _prefetch(it: Iterator[Any], fn: Callable[[Any], Any], depth: int) -> Iterator[Any]:
  """Runs `fn` over `it` in a background thread, `depth` items ahead."""
  if depth <= 0:
    for x in it:
      yield x, fn(x)
    return
  q: queue.Queue = queue.Queue(maxsize=depth)
  done = object()
  stop = threading.Event()

  def work():
    try:
      for x in it:
        if stop.is_set():
          return
        q.put((x, fn(x)))
      q.put(done)
    except BaseException as e:  # surfaced in the consumer
      q.put(e)

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


def evaluate(task: Task, state: Any, batches: Iterable[Any], eval_step=None) -> dict[str, float]:
  eval_step = eval_step or jax.jit(task.eval_step)
  ev = task.new_evaluator()
  for host, dev in _prefetch(iter(batches), task.device_batch, 2):
    ev.update(eval_step(state, dev), host)
  return ev.result()


def train(task: Task, train_batches: Callable[[int], Iterator[Any]],
          eval_batches: Callable[[], Iterable[Any]] | None, cfg: TrainConfig) -> dict[str, Any]:
  """Runs (or resumes) training; returns a summary with the last eval metrics and rates.

  `train_batches(start)` yields host batches from batch number `start` on.
  """
  os.makedirs(cfg.workdir, exist_ok=True)
  ckpt = ckpt_lib.Checkpointer(cfg.workdir, cfg.max_to_keep)
  latest = ckpt.latest_step()
  state = task.init_state(cfg.seed)
  start = 0
  meta: dict[str, Any] = {}
  if latest is not None:
    if not cfg.resume:
      raise ValueError(
          f"workdir {cfg.workdir!r} already holds a checkpoint at step {latest}; pass "
          "--resume to continue that run, or choose an empty --workdir")
    state, meta = ckpt.restore(latest, ckpt_lib.abstract_like(state))
    start = int(meta["step"])
    if meta.get("steps") not in (None, cfg.steps):
      logging.warning("resuming a run planned for %s steps with --steps=%d", meta["steps"], cfg.steps)
    print(f"resumed from {ckpt.directory}/{latest} at step {start}", flush=True)
  elif cfg.resume:
    print(f"--resume: no checkpoint under {ckpt.directory}; starting from step 0", flush=True)

  writer = MetricWriter(cfg.workdir, start if latest is not None else None, cfg.tensorboard)
  step_fn = jax.jit(task.train_step, donate_argnums=0)
  eval_fn = jax.jit(task.eval_step)
  end = cfg.steps if cfg.stop_at_step is None else min(cfg.steps, cfg.stop_at_step)
  progress = Progress(cfg.steps, start)
  last_eval: dict[str, float] = dict(meta.get("last_eval", {}))
  pending: list[dict[str, jax.Array]] = []
  train_time = 0.0   # seconds of training steps after the first, eval and checkpoints excluded

  def save(step):
    ckpt.save(step, state, {"step": step, "steps": cfg.steps, "last_eval": last_eval})

  def run_eval(step):
    nonlocal last_eval
    if eval_batches is None:
      return
    t = time.perf_counter()
    last_eval = evaluate(task, state, eval_batches(), eval_fn)
    writer.write(step, "eval", last_eval)
    shown = " ".join(f"{k} {v:.4f}" for k, v in last_eval.items() if isinstance(v, float))
    print(f"eval @ step {step}: {shown} ({time.perf_counter() - t:.1f}s)", flush=True)

  step = start
  batches = _prefetch(train_batches(start), task.device_batch, cfg.prefetch)
  t_last = time.perf_counter()
  try:
    while step < end:
      host, dev = next(batches)
      state, metrics = step_fn(state, dev)
      step += 1
      n = task.examples_in(host)
      pending.append(metrics)
      if step == start + 1:
        jax.block_until_ready(metrics)  # first step compiles: keep it out of the rates
        progress.begin(step)
        t_last = time.perf_counter()
      else:
        progress.examples += n
      if step % cfg.log_every == 0 or step == end:
        vals = jax.device_get(pending)
        scalars = {k: float(np.mean([v[k] for v in vals])) for k in vals[0]}
        pending.clear()
        now = time.perf_counter()
        train_time += now - t_last
        writer.write(step, "train", scalars)
        print(progress.line(step, scalars), flush=True)
        t_last = now
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
      if boundary:
        t_last = time.perf_counter()
    jax.block_until_ready(state)
    if step > start:  # a resumed run that had already finished has nothing new to record
      if step >= cfg.steps:
        run_eval(step)
      save(step)
    else:
      print(f"nothing to do: the run is at step {step} of {cfg.steps}", flush=True)
  finally:
    writer.close()
    ckpt.close()
  return {
      "state": state,
      "step": step,
      "finished": step >= cfg.steps,
      "eval": last_eval,
      "train_seconds": train_time,
      "examples_per_sec": progress.examples / train_time if train_time > 0 else 0.0,
  }
