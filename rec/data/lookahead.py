"""A batch source whose batches carry the next batch's ids: the lookahead of the host
tier's prefetch (`--host_prefetch`; `EmbeddingCollection.prefetch`, TorchRec's
PrefetchTrainPipelineSparseDist and FBGEMM's TBE prefetch are the models).

`LookaheadSource(src).batches(start)` yields `src`'s batches from `start` on, each with
`lookahead` set to the following batch's ids and lengths (`batch.Lookahead`), read one
batch ahead of the consumer. The last batch of a finite source (and a batch whose
successor has another size) gets empty bags of its own shape: its step prefetches nothing.
A resumed run's `batches(start)` attaches the same lookahead as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from rec.data.batch import Lookahead, SparseBatch, WrappedSource


def with_lookahead(batch: SparseBatch, following: SparseBatch | None) -> SparseBatch:
  """`batch` carrying the ids and lengths of `following` (None: empty bags)."""
  if following is None or np.shape(following.ids) != np.shape(batch.ids):
    ahead = Lookahead(np.zeros(np.shape(batch.ids), np.int32),
                      np.zeros(np.shape(batch.lengths), np.int32))
  else:
    ahead = Lookahead(following.ids, following.lengths)
  return dataclasses.replace(batch, lookahead=ahead)


class LookaheadSource(WrappedSource):
  """`src`'s batches, each carrying the next one's ids and lengths (module docstring)."""

  def batch(self, k: int) -> SparseBatch:
    """Batch `k` with batch k + 1's ids (a random-access source's; two draws)."""
    n = self.num_batches
    return with_lookahead(self.src.batch(k), None if n is not None and k + 1 >= n
                          else self.src.batch(k + 1))

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    it = iter(self.src.batches(start))
    try:
      cur = next(it, None)
      while cur is not None:
        nxt = next(it, None)
        yield with_lookahead(cur, nxt)
        cur = nxt
    finally:
      if hasattr(it, "close"):   # a generator's cleanup (e.g. Grain's workers) runs now
        it.close()
