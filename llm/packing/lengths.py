"""Synthetic document lengths with a long tail, the shape of the corpora of WLB-LLM
(arXiv 2503.17924, Fig. 3): most documents short, a few as long as the context window.

`LengthDist.sample(n, seed)` draws n lengths: a log-normal body (median, sigma) with
probability 1 - tail_prob, else a Pareto tail from tail_min with exponent tail_alpha; all
rounded and clipped to [min_len, context]. Deterministic in (n, seed). Its parameters are
free (the packing study picks them so the original packing lands near the paper's 1.44).

`CorpusLengths` is the shape of a real corpus: the Pile (arXiv 2101.00027, Table 1), a
mixture of its 22 components, each drawn in proportion to its documents as training sees
them (effective size / mean document size) with the component's published mean document
size. Only the means are published, so within a component lengths are log-normal with an
assumed sigma (1.0 by default) around that mean, and bytes become tokens at an assumed 4
bytes per token: a fit with stated parameters, not the corpus' measured histogram. A
document longer than the context is cut into context-sized pieces (the remainder last), as
a loader that never truncates does; the pieces are the documents the packers see.
`scale` then multiplies every piece (rounded, at least min_len): drawn at the paper's 128K
context and scaled by T / 128K, a run with a short context T sees the 128K shape shrunk.
Mean 5.91 KiB over the Pile (Table 1's total) is ~1.5K tokens; most documents are a few
hundred tokens, while Books3 (538 KiB), Ubuntu IRC (545 KiB), Gutenberg (399 KiB) and
BookCorpus2 (370 KiB) are ~100K-tokens long: the paper's long tail up to the context.
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


# The Pile, arXiv 2101.00027, Table 1: (component, effective size GiB, mean document KiB).
PILE_TABLE1 = (
    ("Pile-CC", 227.12, 4.33), ("PubMed Central", 180.55, 30.55), ("Books3", 151.44, 538.36),
    ("OpenWebText2", 125.54, 3.85), ("ArXiv", 112.42, 46.61), ("Github", 95.16, 5.25),
    ("FreeLaw", 76.73, 15.06), ("StackExchange", 64.39, 2.16),
    ("USPTO Backgrounds", 45.81, 4.08), ("PubMed Abstracts", 38.53, 1.30),
    ("Gutenberg (PG-19)", 27.19, 398.73), ("OpenSubtitles", 19.47, 30.48),
    ("Wikipedia (en)", 19.13, 1.11), ("DM Mathematics", 15.49, 8.00),
    ("Ubuntu IRC", 11.03, 545.48), ("BookCorpus2", 9.45, 369.87), ("EuroParl", 9.17, 68.87),
    ("HackerNews", 7.80, 4.92), ("YoutubeSubtitles", 7.47, 22.55), ("PhilPapers", 4.76, 73.37),
    ("NIH ExPorter", 3.79, 2.11), ("Enron Emails", 1.76, 1.78))


@dataclasses.dataclass(frozen=True)
class CorpusLengths:
  """Document lengths in tokens with the Pile's shape (module docstring): a mixture of
  log-normals with the components' published mean sizes (KiB) and an assumed sigma, at an
  assumed bytes_per_token, cut into pieces of at most `context` tokens."""

  context: int = 131072
  sigma: float = 1.0
  bytes_per_token: float = 4.0
  min_len: int = 1
  scale: float = 1.0
  components: tuple = PILE_TABLE1

  def __post_init__(self):
    if not (self.context >= 1 and self.sigma >= 0 and self.bytes_per_token > 0 and self.scale > 0
            and 1 <= self.min_len <= self.context and self.components
            and all(g > 0 and kib > 0 for _, g, kib in self.components)):
      raise ValueError(f"CorpusLengths: context={self.context}, sigma={self.sigma}, "
                       f"bytes_per_token={self.bytes_per_token}, min_len={self.min_len}, "
                       f"scale={self.scale}; expected context >= 1, sigma >= 0, "
                       "bytes_per_token > 0, scale > 0, 1 <= min_len <= context and "
                       "components of positive sizes")

  def weights(self) -> np.ndarray:
    """[components] probability that a document comes from each: documents per component
    (effective GiB / mean KiB), normalized."""
    docs = np.array([g / kib for _, g, kib in self.components], np.float64)
    return docs / docs.sum()

  def mean_tokens(self) -> np.ndarray:
    """[components] mean document length in tokens (before cutting at the context)."""
    return np.array([kib * 1024 / self.bytes_per_token for _, _, kib in self.components])

  def documents(self, n: int, seed=0) -> np.ndarray:
    """[n] int64 whole-document lengths (not cut), >= min_len."""
    rng = np.random.default_rng(seed)
    comp = rng.choice(len(self.components), size=n, p=self.weights())
    # Log-normal with mean m: mu = ln m - sigma^2 / 2.
    mu = np.log(self.mean_tokens()[comp]) - self.sigma ** 2 / 2
    x = np.exp(mu + self.sigma * rng.standard_normal(n))
    return np.maximum(np.round(x), self.min_len).astype(np.int64)

  def sample(self, n: int, seed=0) -> np.ndarray:
    """[n] int64 lengths of the first n pieces (documents cut at the context) times
    `scale`, in order; seed: an int or a sequence of ints. Documents are drawn in blocks
    of 1024, block k from `documents(1024, [*seed, k])`."""
    out, have, k = [], 0, 0
    while have < n:
      docs = self.documents(1024, [*np.atleast_1d(seed).tolist(), k])   # block k
      full, rest = np.divmod(docs, self.context)
      counts = full + (rest > 0)
      pieces = np.full(int(counts.sum()), self.context, np.int64)
      ends = np.cumsum(counts) - 1
      has_rest = rest > 0
      pieces[ends[has_rest]] = rest[has_rest]
      out.append(pieces)
      have += pieces.size
      k += 1
    x = np.concatenate(out)[:n]
    if self.scale != 1.0:
      x = np.maximum(np.round(x * self.scale), self.min_len).astype(np.int64)
    return x
