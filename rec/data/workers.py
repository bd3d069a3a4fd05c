"""Batches of a random-access source drawn in Grain worker processes, with an optional
per-batch transform that runs there too (RecD's dedup, arXiv 2211.05239: rec/data/dedup.py).

`WorkerSource(src, transform, num_workers)` wraps any BatchSource with `batch(k)` (a pure
function of k: SyntheticCriteo, SessionSource, CriteoBinSource): a Grain MapDataset over
batch numbers maps k -> transform(src.batch(k)) and `mp_prefetch` runs that map in
`num_workers` processes, which hand back finished numpy batches in order. The train loop's
prefetch thread then only places them on the devices (`RecTask.device_batch` skips the dedup
of a batch that carries one), so host work of the input pipeline leaves the training
process. `batches(start)` resumes at batch `start`; `batch(k)` is the same batch in this
process (for step-only timing and tests).

Each worker ends with the process that started it: a thread in the worker waits on
multiprocessing's parent sentinel (a pipe that closes when the parent dies, however it
dies: kill -9, SIGTERM's default action, a crash) and checks `os.getppid()` once a second,
then ends the worker at once, so no worker (and, once they are gone, no resource tracker)
outlives a killed run by more than about a second. prctl(PR_SET_PDEATHSIG) is not used: it
fires when the *thread* that started the worker ends (a Grain prefetch thread), not the
process. A stop is the parent's to make: Ctrl-C in a terminal (SIGINT to the whole process
group) is ignored by the workers, and SIGTERM sent to every process of a job (SLURM) ends a
worker only after TERM_GRACE_S, so the training process can finish its step and save while
its batches still arrive; Grain stops the workers when the run closes its batch iterator.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from typing import Callable, Iterator

from rec.data.batch import SparseBatch, WrappedSource

DEFAULT_PREFETCH = 2   # finished batches buffered per worker


PARENT_POLL_S = 1.0    # the getppid() check's period (the sentinel answers at once)
TERM_GRACE_S = 20.0    # a worker sent SIGTERM ends this long after, if nothing ended it first
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _watch_parent(parent_pid: int) -> None:
  """Ends this process once `parent_pid` is no longer its parent (it died)."""
  import multiprocessing
  from multiprocessing import connection
  parent = multiprocessing.parent_process()
  sentinel = getattr(parent, "sentinel", None)
  while os.getppid() == parent_pid:
    if sentinel is not None:
      try:
        if connection.wait([sentinel], timeout=PARENT_POLL_S):
          break   # the pipe closed: the parent is gone
      except OSError:
        sentinel = None
    else:
      threading.Event().wait(PARENT_POLL_S)
  os._exit(1)   # no cleanup to run: the parent, whose batches these were, is gone


def _term_later(signum, frame) -> None:
  del signum, frame
  timer = threading.Timer(TERM_GRACE_S, os._exit, (1,))
  timer.daemon = True
  timer.start()


def end_with_parent(parent_pid: int, *unused_worker_index_and_count) -> None:
  """A Grain `worker_init_fn`: the worker process ends when `parent_pid` does, and leaves
  SIGINT / SIGTERM to it (see the module docstring)."""
  if os.getppid() != parent_pid:
    os._exit(1)
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # also drops a Ctrl-C held since start-up
  signal.signal(signal.SIGTERM, _term_later)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
  threading.Thread(target=_watch_parent, args=(parent_pid,), name="end-with-parent",
                   daemon=True).start()


class _Draw:
  """k -> transform(src.batch(k)); a picklable callable (it travels to the workers)."""

  def __init__(self, src, transform):
    self.src, self.transform = src, transform

  def __call__(self, k: int) -> SparseBatch:
    b = self.src.batch(int(k))
    return b if self.transform is None else self.transform(b)


class WorkerSource(WrappedSource):
  """`src`'s batches, each passed through `transform`, made in Grain worker processes."""

  def __init__(self, src, transform: Callable[[SparseBatch], SparseBatch] | None = None,
               num_workers: int = 1, prefetch: int = DEFAULT_PREFETCH,
               flag: str = "--data_workers"):
    if not callable(getattr(src, "batch", None)):
      raise ValueError(f"{flag}={num_workers}: the source {type(src).__name__} has no random "
                       "access (batch(k)); expected synthetic, sessions or criteo_bin data")
    if num_workers < 0 or prefetch < 1:
      raise ValueError(f"{flag}={num_workers}: expected >= 0 worker processes (0: the map "
                       f"runs in this process), prefetch {prefetch} >= 1")
    super().__init__(src)
    self.transform = transform
    self.num_workers, self.prefetch = int(num_workers), int(prefetch)
    self._draw = _Draw(src, transform)

  def batch(self, k: int) -> SparseBatch:
    return self._draw(k)

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    import grain
    stop = self.num_batches
    ds = grain.MapDataset.range(start, sys.maxsize if stop is None else stop).map(self._draw)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch))
    if self.num_workers:
      from absl import flags
      if not flags.FLAGS.is_parsed():   # Grain's workers read its absl flags (defaults when
        flags.FLAGS.mark_as_parsed()    # used from a notebook or a test, not an absl app)
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers,
                                                       per_worker_buffer_size=self.prefetch),
                          worker_init_fn=functools.partial(end_with_parent, os.getpid()))
      # SIGINT and SIGTERM blocked in this thread while the Grain threads start (they
      # keep the mask) and spawn the workers (a mask survives fork and exec): a Ctrl-C
      # during a worker's start-up (seconds of imports) then waits for `end_with_parent`,
      # which ignores it. Here it waits for the first batch, then is handled as usual.
      # The resource tracker starts first: starting it unblocks both signals again.
      from multiprocessing import resource_tracker
      resource_tracker.ensure_running()
      old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
      try:
        it = iter(it)
        first = next(it, None)
      finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
      if first is None:
        return
      yield first
    yield from it
