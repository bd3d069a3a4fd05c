"""Document packing: original, fixed-length greedy, WLB-LLM (arXiv 2503.17924, Sec. 4).

Every packer sees documents as (id, length) and returns micro-batches as lists of ids, in
placement order; `llm.packing.batch.to_lm_batch` turns them into token rows with segment ids
and positions. Documents are never split, so a document's tokens stay together and in order.

  original_packing   the data loader's order: next-fit into sequences of `seq_len` tokens
                     (a document that does not fit starts the next sequence); M consecutive
                     sequences form a global batch (training step). This defines when each
                     document arrives.
  FixedGreedyPacker  fixed-length packing balanced by workload over a window of k global
                     batches: the window's documents, longest first, each into the
                     micro-batch of smallest estimated workload W that still has room
                     (seq_len); the k*M micro-batches, heaviest first, are dealt to the k
                     steps M at a time, so each step holds micro-batches of similar W.
  WLBPacker          WLB-LLM's variable-length packing (the paper's Algorithm 1): the same
                     greedy over the M micro-batches of one global batch, but a micro-batch
                     may hold up to `max_len` tokens, so ones with short documents take more
                     tokens and balance ones with a long document; plus outlier delay:
                     documents of at least thresholds[0] tokens wait in queue i (the last
                     threshold they reach) until it holds M of them, then all M join the
                     same global batch; being its longest documents they are placed first,
                     one per micro-batch (when two queues release together the greedy
                     balances the 2M by workload).

W is `cost.CostModel.total`: sum over documents of a l^2 + b l + c, plus d tokens (fitted
kernel times). A document that fits no micro-batch waits for the next global batch (window).
`simulate` runs a packer over a document stream in global batches and returns what it
placed where; `step_imbalance` is the paper's imbalance degree (max over a step's
micro-batches of W over the mean).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from llm.packing.cost import CostModel


def _check_lengths(ids, lengths, cap: int, where: str):
  bad = np.flatnonzero((lengths < 1) | (lengths > cap))
  if bad.size:
    i = bad[0]
    raise ValueError(f"{where}: document {int(ids[i])} has {int(lengths[i])} tokens, expected "
                     f"1..{cap} (documents are never split)")


def next_fit(lengths: Iterable[int], *, seq_len: int,
             micro_batches: int) -> Iterator[list[list[int]]]:
  """The loader's packing as a stream: documents (ids 0, 1, ... in arrival order) filled
  next-fit into sequences of `seq_len` tokens (a document that does not fit starts the next
  sequence); yields each global batch of `micro_batches` sequences once it is full."""
  step: list[list[int]] = []
  seq: list[int] = []
  used = 0
  for i, l in enumerate(lengths):
    l = int(l)
    if not 1 <= l <= seq_len:
      raise ValueError(f"original_packing: document {i} has {l} tokens, expected 1..{seq_len} "
                       "(documents are never split)")
    if used + l > seq_len:
      step.append(seq)
      seq, used = [], 0
      if len(step) == micro_batches:
        yield step
        step = []
    seq.append(i)
    used += l


def original_packing(lengths: np.ndarray, *, seq_len: int, micro_batches: int,
                     steps: int | None = None) -> list[list[list[int]]]:
  """Global batches (steps) of `micro_batches` sequences, each a list of document ids (their
  index in `lengths`), filled next-fit in arrival order. Stops after `steps` global batches
  (None: as many full ones as the documents fill); unused documents are left out."""
  lengths = np.asarray(lengths, np.int64)
  _check_lengths(np.arange(len(lengths)), lengths, seq_len, "original_packing")
  return list(itertools.islice(next_fit(lengths.tolist(), seq_len=seq_len,
                                        micro_batches=micro_batches), steps))


def balanced_pack(ids: Sequence[int], lengths: Sequence[int], *, bins: int, capacity: int,
                  doc_cost: Callable[[np.ndarray], np.ndarray]
                  ) -> tuple[list[list[int]], list[int]]:
  """Greedy workload balancing with a token capacity: documents longest first (ties: in the
  given order), each into the bin of smallest summed doc_cost among bins with room for it.
  Returns (bins of ids in placement order, ids that fit nowhere, in the order tried)."""
  ids = np.asarray(ids, np.int64)
  lengths = np.asarray(lengths, np.int64)
  if ids.shape != lengths.shape:
    raise ValueError(f"balanced_pack: {ids.shape[0]} ids but {lengths.shape[0]} lengths")
  order = np.argsort(-lengths, kind="stable")
  costs = np.asarray(doc_cost(lengths), np.float64)
  load = np.zeros(bins)
  used = np.zeros(bins, np.int64)
  out: list[list[int]] = [[] for _ in range(bins)]
  left: list[int] = []
  for k in order.tolist():
    l = lengths[k]
    room = used + l <= capacity
    if not room.any():
      left.append(int(ids[k]))
      continue
    j = int(np.argmin(np.where(room, load, np.inf)))
    out[j].append(int(ids[k]))
    load[j] += costs[k]
    used[j] += l
  return out, left


class FixedGreedyPacker:
  """Fixed-length (`seq_len`) greedy balancing over windows of `window` global batches."""

  def __init__(self, *, seq_len: int, micro_batches: int, window: int, cost: CostModel):
    if window < 1 or micro_batches < 1:
      raise ValueError(f"FixedGreedyPacker: window={window}, micro_batches={micro_batches}, "
                       "expected both >= 1")
    self.seq_len, self.micro_batches, self.window, self.cost = (seq_len, micro_batches, window,
                                                                cost)
    self.carry: list[int] = []

  def pack_window(self, ids: Sequence[int], lengths_of: Callable) -> list[list[list[int]]]:
    """`window` global batches of micro-batches from the window's documents (plus those
    carried from the last window); documents that fit nowhere are carried to the next."""
    ids = list(self.carry) + [int(i) for i in ids]
    lengths = lengths_of(ids)
    _check_lengths(ids, np.asarray(lengths), self.seq_len, "FixedGreedyPacker")
    n = self.window * self.micro_batches
    bins, self.carry = balanced_pack(ids, lengths, bins=n, capacity=self.seq_len,
                                     doc_cost=self.cost.doc_total)
    w = [self.cost.total(lengths_of(b)) if b else 0.0 for b in bins]
    bins = [bins[j] for j in np.argsort(-np.asarray(w), kind="stable")]
    m = self.micro_batches
    return [bins[s * m:(s + 1) * m] for s in range(self.window)]

  def pending(self) -> list[int]:
    return list(self.carry)


class WLBPacker:
  """WLB-LLM variable-length packing with multi-level outlier queues, one global batch a call."""

  def __init__(self, *, micro_batches: int, max_len: int, cost: CostModel,
               outlier_thresholds: Sequence[int] = ()):
    thr = [int(t) for t in outlier_thresholds]
    if sorted(thr) != thr or len(set(thr)) != len(thr) or any(t < 1 for t in thr):
      raise ValueError(f"WLBPacker: outlier_thresholds={thr}, expected increasing positive "
                       "token counts")
    if micro_batches < 1 or max_len < 1:
      raise ValueError(f"WLBPacker: micro_batches={micro_batches}, max_len={max_len}, "
                       "expected both >= 1")
    self.micro_batches, self.max_len, self.cost = micro_batches, max_len, cost
    self.thresholds = thr
    self.queues: list[list[int]] = [[] for _ in thr]
    self.carry: list[int] = []

  def level(self, length: int) -> int:
    """Outlier queue of a document of this length (-1: not an outlier)."""
    return int(np.searchsorted(self.thresholds, length, side="right")) - 1

  def pack(self, ids: Sequence[int], lengths_of: Callable) -> list[list[int]]:
    """The M micro-batches of the next global batch, given the documents that arrived."""
    ids = [int(i) for i in ids]
    _check_lengths(ids, np.asarray(lengths_of(ids)), self.max_len, "WLBPacker")
    now = list(self.carry)
    for i, l in zip(ids, np.asarray(lengths_of(ids)).tolist()):
      q = self.level(l)
      (now if q < 0 else self.queues[q]).append(i)
    released: list[int] = []
    for q in self.queues:
      if len(q) >= self.micro_batches:
        released += q[:self.micro_batches]
        del q[:self.micro_batches]
    # Released outliers are the longest documents here, so the greedy places them first,
    # the M of a lone release each into its own (still empty) micro-batch.
    docs = released + now
    bins, self.carry = balanced_pack(docs, lengths_of(docs), bins=self.micro_batches,
                                     capacity=self.max_len, doc_cost=self.cost.doc_total)
    return bins

  def pending(self) -> list[int]:
    """Documents waiting: carried (no room) and queued outliers."""
    return list(self.carry) + [i for q in self.queues for i in q]


# ----------------------------------------------------------------------------- simulation


@dataclasses.dataclass
class PackRun:
  """What a packer did with a document stream: steps -> micro-batches -> document ids."""

  name: str
  steps: list[list[list[int]]]
  placed_step: np.ndarray          # [docs] the step a document was trained in, -1: not yet
  pack_seconds: list[float]        # wall time per global batch
  pending: int                     # documents still waiting at the end


def simulate(name: str, lengths: np.ndarray, arrivals: list[list[int]], *,
             packer: FixedGreedyPacker | WLBPacker | None = None,
             original: list[list[list[int]]] | None = None) -> PackRun:
  """Runs `packer` over the stream in global batches (`arrivals[g]`: the documents of the
  loader's batch g); packer None replays `original` (the loader's own sequences)."""
  lengths = np.asarray(lengths, np.int64)
  lengths_of = lambda ids: lengths[np.asarray(ids, np.int64)] if len(ids) else np.zeros(0, np.int64)
  placed = np.full(len(lengths), -1, np.int64)
  steps: list[list[list[int]]] = []
  seconds: list[float] = []
  if packer is None:
    if original is None:
      raise ValueError("simulate: give a packer or the original packing")
    steps = original
    seconds = [0.0] * len(steps)
    pending = 0
  elif isinstance(packer, FixedGreedyPacker):
    k = packer.window
    for g in range(0, len(arrivals) - k + 1, k):
      t = time.perf_counter()
      steps += packer.pack_window([i for a in arrivals[g:g + k] for i in a], lengths_of)
      seconds += [(time.perf_counter() - t) / k] * k
    pending = len(packer.pending())
  else:
    for a in arrivals:
      t = time.perf_counter()
      steps.append(packer.pack(a, lengths_of))
      seconds.append(time.perf_counter() - t)
    pending = len(packer.pending())
  for s, mbs in enumerate(steps):
    for mb in mbs:
      placed[np.asarray(mb, np.int64)] = s
  return PackRun(name, steps, placed, seconds, pending)


def arrival_steps(original: list[list[list[int]]], n_docs: int) -> np.ndarray:
  """[docs] the global batch each document arrives in (-1: beyond the stream)."""
  out = np.full(n_docs, -1, np.int64)
  for s, mbs in enumerate(original):
    for mb in mbs:
      out[np.asarray(mb, np.int64)] = s
  return out


def step_imbalance(run: PackRun, lengths: np.ndarray, cost: CostModel,
                   what: str = "total") -> np.ndarray:
  """[steps] max over a step's micro-batches of the workload over their mean; `what`:
  "total" (W = Wa + Wl), "attention" (Wa) or "tokens"."""
  lengths = np.asarray(lengths, np.int64)
  fn = {"total": cost.total, "attention": cost.attention,
        "tokens": lambda ls: float(np.sum(ls))}[what]
  out = []
  for mbs in run.steps:
    w = np.array([fn(lengths[np.asarray(mb, np.int64)]) if mb else
                  (cost.lin_const if what == "total" else 0.0) for mb in mbs])
    out.append(w.max() / w.mean() if w.mean() > 0 else 1.0)
  return np.asarray(out)


def token_delay(run: PackRun, lengths: np.ndarray, arrival: np.ndarray) -> dict[str, float]:
  """Delays in global batches (placed step - arrival step; moved earlier counts 0),
  token-weighted, over the documents that arrived during the run; those still waiting at
  its end count the steps up to the end."""
  lengths = np.asarray(lengths, np.float64)
  end = len(run.steps)
  seen = (arrival >= 0) & (arrival < end)
  placed = np.where(run.placed_step >= 0, run.placed_step, end)
  delay = np.maximum(placed - arrival, 0)[seen]
  w = lengths[seen]
  late = delay > 0
  return {"mean_delay_steps": float(np.sum(delay * w) / np.sum(w)),
          "delayed_token_fraction": float(np.sum(w[late]) / np.sum(w)),
          "mean_delay_of_delayed_steps": float(np.sum((delay * w)[late]) / max(np.sum(w[late]), 1)),
          "max_delay_steps": int(delay.max()) if delay.size else 0}
