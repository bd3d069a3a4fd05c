"""Synthetic document lengths with a long tail, the shape of the corpora of WLB-LLM
(arXiv 2503.17924, Fig. 3): most documents short, a few as long as the context window.

`LengthDist.sample(n, seed)` draws n lengths: a log-normal body (median, sigma) with
probability 1 - tail_prob, else a Pareto tail from tail_min with exponent tail_alpha; all
rounded and clipped to [min_len, context]. Deterministic in (n, seed).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class LengthDist:
  """Document lengths: log-normal body (median, sigma) with probability 1 - tail_prob, else a
  Pareto tail from tail_min with exponent tail_alpha; all clipped to [min_len, context]."""

  context: int = 131072
  median: float = 1024.0
  sigma: float = 1.0
  tail_prob: float = 0.002
  tail_min: float = 16384.0
  tail_alpha: float = 1.0
  min_len: int = 16

  def __post_init__(self):
    if not (0 <= self.tail_prob <= 1 and self.sigma >= 0 and self.tail_alpha > 0
            and 1 <= self.min_len <= self.context and self.median > 0 and self.tail_min > 0):
      raise ValueError(f"LengthDist: {self} has a value out of range (tail_prob in [0, 1], "
                       "sigma >= 0, tail_alpha > 0, 1 <= min_len <= context, median and "
                       "tail_min > 0)")

  def sample(self, n: int, seed: int = 0) -> np.ndarray:
    """[n] int64 document lengths."""
    rng = np.random.default_rng(seed)
    body = self.median * np.exp(self.sigma * rng.standard_normal(n))
    tail = self.tail_min * rng.uniform(size=n) ** (-1.0 / self.tail_alpha)
    x = np.where(rng.uniform(size=n) < self.tail_prob, tail, body)
    return np.clip(np.round(x), self.min_len, self.context).astype(np.int64)
