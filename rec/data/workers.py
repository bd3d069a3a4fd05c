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
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

from rec.data.batch import SparseBatch

DEFAULT_PREFETCH = 2   # finished batches buffered per worker


class _Draw:
  """k -> transform(src.batch(k)); a picklable callable (it travels to the workers)."""

  def __init__(self, src, transform):
    self.src, self.transform = src, transform

  def __call__(self, k: int) -> SparseBatch:
    b = self.src.batch(int(k))
    return b if self.transform is None else self.transform(b)


class WorkerSource:
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
    self.src, self.transform = src, transform
    self.num_workers, self.prefetch = int(num_workers), int(prefetch)
    self.spec, self.batch_size = src.spec, src.batch_size
    self._draw = _Draw(src, transform)

  def __getattr__(self, name: str) -> Any:   # bag_sizes, describe, ... of the wrapped source
    if name == "src":
      raise AttributeError(name)
    return getattr(self.src, name)

  @property
  def num_batches(self) -> int | None:
    return self.src.num_batches

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
                                                       per_worker_buffer_size=self.prefetch))
    yield from it
