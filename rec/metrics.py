"""Evaluation metrics for click-through-rate models: exact AUC, log loss, NE, calibration,
and by a grouping column per-group AUC (gAUC) and NE by slice.

Everything here is mergeable: evaluate batches (or hosts) separately, merge the
accumulators, and read the same numbers a single pass over all examples would give.
For a multi-host run, each host calls `to_arrays()`, the arrays are all-gathered
(padded with zero-count rows where lengths differ), and `from_arrays()` rebuilds one
accumulator from the concatenation.

NE (normalized entropy) is the log loss divided by the entropy of the label base rate
(He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook", 2014): a model
that always predicts the base rate has NE exactly 1, lower is better. Calibration is the
mean predicted probability over the mean label (sum of probabilities / positives): 1 for a
model whose predictions add up to the clicks, above 1 when it over-predicts.

Grouped (`group_metrics`, the production teams' view: a user, a session, a site): gAUC is
the impression-weighted mean of the per-group AUCs, over the groups that hold both labels
(a group of one class has no AUC: it is skipped and counted); NE by slice is NE,
calibration and AUC of each of the `top_k` groups with the most impressions and of all the
others together.
"""

from __future__ import annotations

import math

import numpy as np


def _select(mask, n: int) -> np.ndarray | None:
  """Boolean selector of the real examples, or None when every example is real."""
  if mask is None:
    return None
  mask = np.asarray(mask).reshape(-1)
  if mask.shape[0] != n:
    raise ValueError(f"mask has {mask.shape[0]} entries, expected {n} (one per example)")
  return mask > 0


def _check_finite(logits: np.ndarray, sel: np.ndarray | None, where: str) -> None:
  """Raises for a NaN or infinite logit among the real examples (sel; None: all), naming
  its index in the batch as given."""
  bad = ~np.isfinite(logits) if sel is None else sel & ~np.isfinite(logits)
  if np.any(bad):
    i = int(np.argmax(bad))
    raise ValueError(f"{where}: logit {logits[i].item()!r} at index {i}, expected finite logits "
                     f"({int(bad.sum())} NaN or infinite among the real examples)")


def _check_labels(labels: np.ndarray, where: str) -> np.ndarray:
  bad = (labels != 0) & (labels != 1)
  if np.any(bad):
    raise ValueError(
        f"{where}: label {labels[np.argmax(bad)].item()!r} at index {int(np.argmax(bad))}, "
        "expected 0 or 1")
  return labels == 1


class AUCAccumulator:
  """Exact ROC AUC over a stream of (score, label) pairs, ties counted as 1/2.

  State: the sorted distinct scores seen so far, and per score the number of positive
  and negative examples. It is compacted with `np.unique` on every update, so memory is
  O(number of distinct scores) regardless of how many examples were seen. The state is
  canonical (it depends only on the multiset of examples), so `result()` is the same bit
  for bit whatever the batching or merge order.

  `result()` is the Mann-Whitney statistic U / (P * N): the probability that a random
  positive scores above a random negative, with ties contributing 1/2 (what
  sklearn.metrics.roc_auc_score returns). It is nan when there are no positives or no
  negatives (AUC is undefined then).

  Scores may be logits or probabilities (AUC is invariant under monotone maps); prefer
  logits, since float32 sigmoids of large logits collapse into spurious ties.
  """

  def __init__(self):
    self.scores = np.zeros((0,), np.float64)
    self.pos = np.zeros((0,), np.int64)
    self.neg = np.zeros((0,), np.int64)

  def _absorb(self, scores: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> None:
    """Adds per-score counts (unsorted, repeats and zero counts allowed) and compacts."""
    all_scores = np.concatenate([self.scores, scores])
    uniq, inverse = np.unique(all_scores, return_inverse=True)
    pos = np.bincount(inverse, np.concatenate([self.pos, pos]), minlength=uniq.size)
    neg = np.bincount(inverse, np.concatenate([self.neg, neg]), minlength=uniq.size)
    # bincount sums in float64, exact for counts below 2**53.
    keep = (pos > 0) | (neg > 0)
    self.scores = uniq[keep]
    self.pos = pos[keep].astype(np.int64)
    self.neg = neg[keep].astype(np.int64)

  def update(self, scores, labels, mask=None) -> None:
    """Adds one batch. scores, labels: [B]; mask: [B] or None, entries <= 0 are skipped."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if labels.shape != scores.shape:
      raise ValueError(f"AUCAccumulator.update: labels shape {labels.shape} != scores shape "
                       f"{scores.shape}")
    sel = _select(mask, scores.shape[0])
    if sel is not None:
      scores, labels = scores[sel], labels[sel]
    if np.any(np.isnan(scores)):
      bad = int(np.argmax(np.isnan(scores)))
      raise ValueError(f"AUCAccumulator.update: NaN score at index {bad} (after masking), "
                       "expected finite scores")
    is_pos = _check_labels(labels, "AUCAccumulator.update")
    self._absorb(scores, is_pos.astype(np.int64), (~is_pos).astype(np.int64))

  def merge(self, other: AUCAccumulator) -> AUCAccumulator:
    """Returns a NEW accumulator holding both; neither self nor other is modified."""
    out = AUCAccumulator()
    out.scores, out.pos, out.neg = self.scores, self.pos, self.neg
    out._absorb(other.scores, other.pos, other.neg)
    return out

  def to_arrays(self) -> dict[str, np.ndarray]:
    """The state as flat arrays: scores float64 [K], pos int64 [K], neg int64 [K]."""
    return {"scores": self.scores.copy(), "pos": self.pos.copy(), "neg": self.neg.copy()}

  @classmethod
  def from_arrays(cls, scores, pos, neg) -> AUCAccumulator:
    """Rebuilds from (possibly concatenated, unsorted, zero-padded) state arrays."""
    out = cls()
    out._absorb(np.asarray(scores, np.float64).reshape(-1),
                np.asarray(pos, np.int64).reshape(-1), np.asarray(neg, np.int64).reshape(-1))
    return out

  @property
  def num_examples(self) -> int:
    return int(self.pos.sum() + self.neg.sum())

  def result(self) -> float:
    """AUC in [0, 1]; nan when all examples seen so far have the same label."""
    num_pos, num_neg = int(self.pos.sum()), int(self.neg.sum())
    if num_pos == 0 or num_neg == 0:
      return float("nan")
    # Scores ascend, so a positive at score s beats every negative strictly below s and
    # ties with the negatives at s. 2U = sum_s pos_s * (2 * neg_below_s + neg_s), exact in
    # integers; python ints take over where int64 could overflow (P * N >= 2**62).
    pos, neg = self.pos, self.neg
    if num_pos * num_neg >= 2**62:
      pos, neg = pos.astype(object), neg.astype(object)
    neg_below = np.cumsum(neg) - neg
    two_u = int(np.sum(pos * (2 * neg_below + neg)))
    return two_u / (2 * num_pos * num_neg)


class RecMetrics:
  """AUC, log loss, normalized entropy, accuracy, base rate and calibration over masked
  batches.

  Log loss is computed from logits in float64 as softplus(x) - y * x, which is stable for
  any logit (no clipping needed); calibration is sum(sigmoid(x)) / positives (nan without
  positives). Accuracy thresholds the probability at 0.5, counting
  logit > 0 as a positive prediction. NE = logloss / H(p), p the base rate of the same
  examples; NE is nan when p is 0 or 1 (H(p) = 0). Sums are float64 so merge order
  changes results only at the 1e-15 relative level; AUC is exact. A NaN or infinite logit
  among the real examples raises a ValueError (as `device_metrics`) and leaves the
  accumulator as it was.
  """

  def __init__(self):
    self.sum_logloss = 0.0
    self.sum_prob = 0.0
    self.num_positive = 0
    self.num_correct = 0
    self.num_examples = 0
    self.auc = AUCAccumulator()

  def update(self, logits, labels, mask=None) -> None:
    """Adds one batch. logits, labels: [B]; mask: [B] or None, entries <= 0 are padding."""
    logits = np.asarray(logits, np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if labels.shape != logits.shape:
      raise ValueError(f"RecMetrics.update: labels shape {labels.shape} != logits shape "
                       f"{logits.shape}")
    sel = _select(mask, logits.shape[0])
    # Checked before any sum moves: the log loss of an infinite logit is nan (inf - inf), and
    # a batch refused halfway would leave the sums and the AUC counting different examples.
    _check_finite(logits, sel, "RecMetrics.update")
    if sel is not None:
      logits, labels = logits[sel], labels[sel]
    is_pos = _check_labels(labels, "RecMetrics.update")
    y = is_pos.astype(np.float64)
    # softplus(x) - y x = max(x, 0) - y x + log1p(exp(-|x|)).
    self.sum_logloss += float(np.sum(_logloss(logits, y)))
    self.sum_prob += float(np.sum(_sigmoid(logits)))
    self.num_positive += int(is_pos.sum())
    self.num_correct += int(np.sum((logits > 0) == is_pos))
    self.num_examples += int(logits.shape[0])
    self.auc.update(logits, y)

  def merge(self, other: RecMetrics) -> RecMetrics:
    """Returns a NEW RecMetrics holding both; neither input is modified."""
    out = RecMetrics()
    out.sum_logloss = self.sum_logloss + other.sum_logloss
    out.sum_prob = self.sum_prob + other.sum_prob
    out.num_positive = self.num_positive + other.num_positive
    out.num_correct = self.num_correct + other.num_correct
    out.num_examples = self.num_examples + other.num_examples
    out.auc = self.auc.merge(other.auc)
    return out

  def to_arrays(self) -> dict[str, np.ndarray]:
    """State as arrays: scalars as shape-[1] arrays plus the AUC arrays (prefixed auc_)."""
    out = {
        "sum_logloss": np.array([self.sum_logloss], np.float64),
        "sum_prob": np.array([self.sum_prob], np.float64),
        "counts": np.array([self.num_positive, self.num_correct, self.num_examples], np.int64),
    }
    out.update({f"auc_{k}": v for k, v in self.auc.to_arrays().items()})
    return out

  @classmethod
  def from_arrays(cls, sum_logloss, sum_prob, counts, auc_scores, auc_pos,
                  auc_neg) -> RecMetrics:
    """Rebuilds from `to_arrays()` output; several hosts' arrays may be concatenated
    (sum_logloss and sum_prob [H], counts [H * 3] or [H, 3])."""
    out = cls()
    out.sum_logloss = float(np.sum(np.asarray(sum_logloss, np.float64)))
    out.sum_prob = float(np.sum(np.asarray(sum_prob, np.float64)))
    counts = np.asarray(counts, np.int64).reshape(-1, 3).sum(axis=0)
    out.num_positive, out.num_correct, out.num_examples = (int(c) for c in counts)
    out.auc = AUCAccumulator.from_arrays(auc_scores, auc_pos, auc_neg)
    return out

  def result(self) -> dict[str, float]:
    """{auc, logloss, ne, accuracy, num_examples, base_rate, calibration}; rates are nan
    when empty."""
    n = self.num_examples
    if n == 0:
      return _empty_result()
    logloss = self.sum_logloss / n
    return {
        "auc": self.auc.result(),
        "logloss": logloss,
        "ne": _ne(self.sum_logloss, self.num_positive, n),
        "accuracy": self.num_correct / n,
        "num_examples": n,
        "base_rate": self.num_positive / n,
        "calibration": _calibration(self.sum_prob, self.num_positive),
    }


def _logloss(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """softplus(x) - y x = max(x, 0) - y x + log1p(exp(-|x|)), per example, float64."""
  return np.maximum(x, 0.0) - y * x + np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return np.exp(-np.logaddexp(0.0, -x))


def _entropy(p: float) -> float:
  return 0.0 if p in (0.0, 1.0) else -(p * math.log(p) + (1 - p) * math.log1p(-p))


def _ne(sum_logloss: float, num_positive: int, n: int) -> float:
  """Log loss over the entropy of the base rate; nan when n is 0 or every label is one."""
  entropy = _entropy(num_positive / n) if n else 0.0
  return sum_logloss / n / entropy if entropy > 0 else float("nan")


def _calibration(sum_prob: float, num_positive: int) -> float:
  """Mean prediction / mean label = sum of probabilities / positives; nan without positives."""
  return sum_prob / num_positive if num_positive else float("nan")


def _empty_result() -> dict[str, float]:
  nan = float("nan")
  return {"auc": nan, "logloss": nan, "ne": nan, "accuracy": nan, "num_examples": 0,
          "base_rate": nan, "calibration": nan}


# --- by group ------------------------------------------------------------------------------
#
# One pass of sorts over the whole eval set on the host: examples sorted by (group, score),
# runs of equal (group, score) counted, and each group's Mann-Whitney 2U summed over its runs
# with np.add.reduceat (exact int64): no Python loop over groups or examples.

TOP_SLICES = 10   # groups reported one by one in ne_by_slice (the others as one "other")


def group_index(groups) -> tuple[np.ndarray, np.ndarray]:
  """(index of each example's group [N] int64, the groups' keys in ascending order [G] or
  [G, L]): `groups` [N] (ids) or [N, L] (a bag of ids per example, compared whole)."""
  g = np.asarray(groups)
  if g.ndim == 2 and g.shape[1] == 1:
    g = g[:, 0]
  if g.ndim == 1:
    keys, inverse = np.unique(g, return_inverse=True)
  elif g.ndim == 2:
    keys, inverse = np.unique(g, axis=0, return_inverse=True)
  else:
    raise ValueError(f"group_index: groups of shape {g.shape}; expected [N] or [N, L]")
  return inverse.reshape(-1).astype(np.int64), keys


def group_aucs(scores, labels, groups, num_groups: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-group AUC (ties 1/2, as `AUCAccumulator`): (auc [G] float64, nan for a group
  without both labels; positives [G] int64; negatives [G] int64). groups: [N] int indices
  in [0, G) (`group_index`); G = num_groups or max + 1."""
  x = np.asarray(scores, np.float64).reshape(-1) + 0.0      # -0 -> +0: ties as everywhere
  is_pos = _check_labels(np.asarray(labels).reshape(-1), "group_aucs")
  g = np.asarray(groups, np.int64).reshape(-1)
  if not x.shape == is_pos.shape == g.shape:
    raise ValueError(f"group_aucs: scores {x.shape}, labels {is_pos.shape}, groups {g.shape}; "
                     "expected one of each per example")
  if np.any(np.isnan(x)):
    raise ValueError(f"group_aucs: NaN score at index {int(np.argmax(np.isnan(x)))}, "
                     "expected finite scores")
  G = int(num_groups if num_groups is not None else (g.max() + 1 if g.size else 0))
  pos, neg = np.zeros(G, np.int64), np.zeros(G, np.int64)
  auc = np.full(G, np.nan)
  if g.size == 0:
    return auc, pos, neg
  order = np.lexsort((x, g))
  x, g, y = x[order], g[order], is_pos[order].astype(np.int64)
  n = x.size
  run = np.ones(n, bool)                                     # a new (group, score) run
  run[1:] = (g[1:] != g[:-1]) | (x[1:] != x[:-1])
  starts = np.flatnonzero(run)
  run_pos = np.add.reduceat(y, starts)
  run_neg = np.diff(np.append(starts, n)) - run_pos
  run_g = g[starts]
  first = np.ones(starts.size, bool)                         # a run that starts its group
  first[1:] = run_g[1:] != run_g[:-1]
  heads = np.flatnonzero(first)
  below = np.cumsum(run_neg) - run_neg                       # negatives before the run ...
  below -= np.repeat(below[heads], np.diff(np.append(heads, starts.size)))  # ... in its group
  two_u = np.add.reduceat(run_pos * (2 * below + run_neg), heads)
  gids = run_g[heads]
  pos[gids] = np.add.reduceat(run_pos, heads)
  neg[gids] = np.add.reduceat(run_neg, heads)
  both = (pos[gids] > 0) & (neg[gids] > 0)
  auc[gids[both]] = two_u[both] / (2.0 * pos[gids[both]] * neg[gids[both]])
  return auc, pos, neg


def _group_label(key) -> int | list[int]:
  key = np.asarray(key)
  return int(key) if key.ndim == 0 else [int(k) for k in key]


def group_metrics(logits, labels, groups, mask=None, top_k: int = TOP_SLICES
                  ) -> dict[str, object]:
  """gAUC and NE by slice of the examples (mask > 0) grouped by `groups` ([N] ids or
  [N, L] bags, `group_index`):

    gauc         sum_g n_g AUC_g / sum_g n_g over the groups with both labels (n_g:
                 impressions); nan when no group has both
    gauc_groups  {counted, skipped (groups of one label), counted_impressions}
    ne_by_slice  [{group, impressions, positives, ne, logloss, calibration, auc}]: the
                 `top_k` groups by impressions (most first, ties by key), then "other"
                 (every other group, when there is one; its `groups` says how many)

  `group` is the group's key: an id, or a bag's ids (padding slots as given)."""
  x = np.asarray(logits, np.float64).reshape(-1)
  y = np.asarray(labels).reshape(-1)
  g = np.asarray(groups)
  if y.shape[0] != x.shape[0] or g.ndim == 0 or g.shape[0] != x.shape[0]:
    raise ValueError(f"group_metrics: logits {x.shape}, labels {y.shape}, groups {g.shape}; "
                     "expected one label and one group per example")
  g = g.reshape(x.shape[0], -1) if g.ndim > 1 else g.reshape(-1)
  sel = _select(mask, x.shape[0])
  _check_finite(x, sel, "group_metrics")   # an infinite logit's log loss is nan
  if sel is not None:
    x, y, g = x[sel], y[sel], g[sel]
  gidx, keys = group_index(g)
  G = keys.shape[0]
  auc, pos, neg = group_aucs(x, y, gidx, G)
  n_g = pos + neg
  counted = ~np.isnan(auc)
  weight = int(n_g[counted].sum())
  gauc = float(np.sum(n_g[counted] * auc[counted]) / weight) if weight else float("nan")
  # slices: the top_k groups by impressions (ties: the smaller key first), then the rest
  by_size = np.argsort(-n_g, kind="stable")[:top_k]
  slice_of = np.full(G, by_size.size, np.int64)
  slice_of[by_size] = np.arange(by_size.size)
  S = by_size.size + (G > by_size.size)
  s_idx = slice_of[gidx]
  y01 = _check_labels(y, "group_metrics").astype(np.float64)
  s_auc, s_pos, s_neg = group_aucs(x, y01, s_idx, S)
  s_loss = np.bincount(s_idx, _logloss(x, y01), minlength=S)
  s_prob = np.bincount(s_idx, _sigmoid(x), minlength=S)
  slices = []
  for s in range(S):
    n, p = int(s_pos[s] + s_neg[s]), int(s_pos[s])
    row: dict[str, object] = {"group": _group_label(keys[by_size[s]]) if s < by_size.size
                              else "other"}
    if s == by_size.size:
      row["groups"] = int(G - by_size.size)
    row.update(impressions=n, positives=p, ne=_ne(float(s_loss[s]), p, n),
               logloss=float(s_loss[s]) / n, calibration=_calibration(float(s_prob[s]), p),
               auc=float(s_auc[s]))
    slices.append(row)
  return {"gauc": gauc,
          "gauc_groups": {"counted": int(counted.sum()), "skipped": int(G - counted.sum()),
                          "counted_impressions": weight},
          "ne_by_slice": slices}


def format_groups(result: dict, name: str = "group") -> str:
  """`group_metrics`' numbers (within `result`) as lines: gAUC and its groups, then one row
  per slice; `name` is the grouping column's."""
  c = result["gauc_groups"]
  lines = [f"gAUC {result['gauc']:.4f} over {c['counted']:,} {name} groups with both labels "
           f"({c['counted_impressions']:,} impressions; {c['skipped']:,} groups of one label "
           "skipped)"]
  label = lambda r: (f"other ({r['groups']:,} groups)" if r["group"] == "other" else
                     f"row {r['group']}" if isinstance(r["group"], int) else
                     "rows " + " ".join(str(i) for i in r["group"] if i >= 0))
  rows = [(label(r), r) for r in result["ne_by_slice"]]
  w = max([len(name) + 6] + [len(t) for t, _ in rows])
  lines.append(f"{name + ' slice':<{w}} {'impressions':>11} {'positives':>9} {'NE':>7} "
               f"{'calibration':>11} {'AUC':>7}")
  lines += [f"{t:<{w}} {r['impressions']:>11,} {r['positives']:>9,} {r['ne']:>7.4f} "
            f"{r['calibration']:>11.4f} {r['auc']:>7.4f}" for t, r in rows]
  return "\n".join(lines)


# --- on device -----------------------------------------------------------------------------
#
# The same metrics computed where the logits are, in one jitted pass over the whole eval
# set: no per-batch transfer, and one sort instead of a host-side merge per batch (which
# grows with every batch). Counts are exact integers; the sums that need more than
# int32 / float32 (the AUC's 2U, the log loss and the probabilities) are reduced on device
# in chunks small enough to be exact (2U) or accurate to float32 rounding of a chunk (log
# loss, probabilities), and the chunk sums are added on the host in Python ints / float64.

_CHUNK = 1 << 15   # 2U parts: 16-bit halves of values < 2^32, 2^15 of them fit in uint32


def _device_parts(logits, labels, mask):
  import jax
  import jax.numpy as jnp
  x = jnp.asarray(logits, jnp.float32).reshape(-1) + 0.0   # -0 -> +0: ties as on the host
  y = jnp.asarray(labels).reshape(-1)
  real = jnp.asarray(mask).reshape(-1) > 0
  pos = real & (y == 1)
  neg = real & (y == 0)
  bad_label = jnp.sum(real & (y != 0) & (y != 1))
  nonfinite = jnp.sum(real & ~jnp.isfinite(x))
  # AUC (Mann-Whitney with ties as 1/2): per positive, 2 * #negatives below + #negatives
  # tied, against the sorted negative scores (+inf fills the other slots; finite scores
  # never reach them: non-finite scores are an error above).
  ns = jnp.sort(jnp.where(neg, x, jnp.inf))
  below = jnp.searchsorted(ns, x, side="left", method="sort")
  upto = jnp.searchsorted(ns, x, side="right", method="sort")
  two_u = jnp.where(pos, 2 * below.astype(jnp.uint32) + (upto - below).astype(jnp.uint32),
                    jnp.uint32(0))
  pad = (-two_u.shape[0]) % _CHUNK
  two_u = jnp.pad(two_u, (0, pad)).reshape(-1, _CHUNK)
  u_lo = jnp.sum(two_u & 0xFFFF, axis=1, dtype=jnp.uint32)
  u_hi = jnp.sum(two_u >> 16, axis=1, dtype=jnp.uint32)
  # log loss softplus(x) - y x and probabilities sigmoid(x), summed in float32 chunks
  yf = pos.astype(jnp.float32)
  loss = jnp.maximum(x, 0.0) - yf * x + jnp.log1p(jnp.exp(-jnp.abs(x)))
  loss = jnp.where(real, loss, 0.0)
  prob = jnp.where(real, jax.nn.sigmoid(x), 0.0)
  pad = (-loss.shape[0]) % 4096
  chunks = lambda v: jnp.pad(v, (0, pad)).reshape(-1, 4096).sum(axis=1)
  counts = jnp.stack([jnp.sum(real), jnp.sum(pos), jnp.sum(neg),
                      jnp.sum(real & ((x > 0) == pos)), bad_label, nonfinite]).astype(jnp.int32)
  return counts, u_lo, u_hi, chunks(loss), chunks(prob)


_device_parts_jit = None


def replicated(x):
  """`x` whole on every device of its mesh (the sort wants every score in one place, a few
  bytes per example; a multi-process array so becomes readable by every process)."""
  import jax
  sh = getattr(x, "sharding", None)
  if isinstance(sh, jax.sharding.NamedSharding) and not sh.is_fully_replicated:
    return jax.device_put(x, jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec()))
  return x


def device_metrics(logits, labels, mask=None) -> dict[str, float]:
  """`RecMetrics.result()` of the examples (mask > 0), computed on the logits' devices.

  logits, labels, mask: arrays of any layout with one entry per example (device arrays,
  sharded or not, or numpy). AUC is exact (ties 1/2), as `AUCAccumulator`; log loss and
  the probabilities of calibration are float32 per-example values summed in float64 across
  4096-example chunks. Raises a ValueError for a label other than 0 / 1 or a non-finite
  logit among the real examples. At most 2^31 - 1 examples.
  """
  import jax
  import jax.numpy as jnp
  global _device_parts_jit
  if _device_parts_jit is None:
    _device_parts_jit = jax.jit(_device_parts)
  if mask is None:
    mask = jnp.ones(jnp.shape(logits), jnp.float32)

  logits, labels, mask = replicated(logits), replicated(labels), replicated(mask)
  counts, u_lo, u_hi, loss_sums, prob_sums = jax.device_get(
      _device_parts_jit(logits, labels, mask))
  n, n_pos, n_neg, n_correct, bad_label, nonfinite = (int(c) for c in counts)
  if bad_label:
    raise ValueError(f"device_metrics: {bad_label} labels are not 0 or 1")
  if nonfinite:
    raise ValueError(f"device_metrics: {nonfinite} logits are NaN or infinite, expected finite "
                     "scores")
  if n == 0:
    return _empty_result()
  two_u = int(np.asarray(u_hi, np.int64).sum()) * 65536 + int(np.asarray(u_lo, np.int64).sum())
  auc = two_u / (2 * n_pos * n_neg) if n_pos and n_neg else float("nan")
  sum_logloss = float(np.sum(np.asarray(loss_sums, np.float64)))
  sum_prob = float(np.sum(np.asarray(prob_sums, np.float64)))
  return {"auc": auc, "logloss": sum_logloss / n, "ne": _ne(sum_logloss, n_pos, n),
          "accuracy": n_correct / n, "num_examples": n, "base_rate": n_pos / n,
          "calibration": _calibration(sum_prob, n_pos)}
