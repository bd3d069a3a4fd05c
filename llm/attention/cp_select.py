"""Pass-KV vs pass-Q selection for ring attention in partial prefill (arXiv 2411.01783).

"Context Parallelism for Scalable Million-Token Inference", §3.4 and Appendix C. With T new
tokens, P cached tokens, N CP ranks, N_H query heads, N_KV key/value heads, C achieved peak
compute (FLOP/s), BW ring link bandwidth (bytes/s) and e bytes per element:

  Eq. (2), pass-KV SendRecv hides under attention iff   T >= N*C*N_KV*e / (2*N_H*BW)
  Eq. (1), KV messages are no larger than Q iff          T/(T+P) >= 2*N_KV/N_H
  Eq. (5), pass-KV's exposed ring time is below pass-Q's final All2All iff
                                                          T/(T+P) >= 2*N_KV/N_H - 4*T*BW/(N*C*e)

  Algorithm 1 ("basic"):     pass-KV if Eq. (2) or Eq. (1), else pass-Q.
  Algorithm 5 ("alltoall"):  pass-KV if Eq. (2) or Eq. (5), else pass-Q.

The paper's §3.4 terms are N times the real per-step quantities on both sides (per-step
attention 4*T*D*(T+P)/(N^2*C) vs per-step KV block 2*(T+P)*D*e*N_KV/(N*N_H*BW)), so the
thresholds hold for the true per-step times too. C and BW are one GPU's numbers when each
CP ring runs over one GPU per host (TP inside the host), as in the paper. Its footnote 2:
start from hardware peaks, then tune C and BW on measurements.

Facts about the two rules (tests/llm/test_cp_select.py checks each):
- Algorithm 5 picks pass-KV wherever Algorithm 1 does (its miss-rate threshold is lower).
- Where Eq. (2) fails, 4*T*BW/(N*C*e) < 2*N_KV/N_H, so Algorithm 5's threshold is positive.
- As C -> inf or BW -> 0 (compute free, or links slow) both rules tend to Eq. (1) alone.
  As BW -> inf both pick pass-KV for every T >= 1 (Eq. (2)'s threshold tends to 0): Algorithm
  5 does not tend to Algorithm 1's second condition in that limit.

Comparisons are exact (`fractions.Fraction` of the given numbers), so boundary cases such
as T = 4000 with the paper's peaks land on the side that `>=` says.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal

Variant = Literal["pass_kv", "pass_q"]
ALGORITHMS = ("basic", "alltoall")


def _check(new_tokens, cached_tokens, n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth,
           bytes_per_elem, algorithm) -> None:
  where = "llm/attention/cp_select.py"
  for name, v, lo in (("new_tokens", new_tokens, 1), ("cached_tokens", cached_tokens, 0),
                      ("n_ranks", n_ranks, 1), ("n_heads", n_heads, 1),
                      ("n_kv_heads", n_kv_heads, 1)):
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
      raise ValueError(f"{where}: {name}={v!r}; expected an int >= {lo}")
  if n_heads % n_kv_heads:
    raise ValueError(f"{where}: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
  for name, v in (("peak_flops", peak_flops), ("bandwidth", bandwidth),
                  ("bytes_per_elem", bytes_per_elem)):
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
      raise ValueError(f"{where}: {name}={v!r}; expected a finite number > 0")
  if algorithm not in ALGORITHMS:
    raise ValueError(f"{where}: algorithm={algorithm!r}; expected one of {ALGORITHMS}")


def _kv_overlap_min_new_tokens(n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth,
                               bytes_per_elem) -> Fraction:
  return (n_ranks * Fraction(peak_flops) * n_kv_heads * Fraction(bytes_per_elem)
          / (2 * n_heads * Fraction(bandwidth)))


def _miss_rate_threshold(new_tokens, n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth,
                         bytes_per_elem, algorithm) -> Fraction:
  size = Fraction(2 * n_kv_heads, n_heads)
  if algorithm == "basic":
    return size
  return size - (4 * new_tokens * Fraction(bandwidth)
                 / (n_ranks * Fraction(peak_flops) * Fraction(bytes_per_elem)))


def kv_overlap_min_new_tokens(*, n_ranks: int, n_heads: int, n_kv_heads: int,
                              peak_flops: float, bandwidth: float,
                              bytes_per_elem: float = 2) -> float:
  """Eq. (2): the T at and above which pass-KV's ring SendRecv hides under attention."""
  _check(None, None, n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth, bytes_per_elem,
         "basic")
  return float(_kv_overlap_min_new_tokens(n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth,
                                          bytes_per_elem))


def miss_rate_threshold(new_tokens: int, *, n_ranks: int, n_heads: int, n_kv_heads: int,
                        peak_flops: float, bandwidth: float, bytes_per_elem: float = 2,
                        algorithm: str = "alltoall") -> float:
  """The T/(T+P) at and above which the rule's second condition picks pass-KV.

  "basic": Eq. (1), 2*N_KV/N_H (independent of T and the hardware). "alltoall": Eq. (5),
  2*N_KV/N_H - 4*T*BW/(N*C*e), which may be negative (then the condition always holds).
  """
  _check(new_tokens, None, n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth, bytes_per_elem,
         algorithm)
  return float(_miss_rate_threshold(new_tokens, n_ranks, n_heads, n_kv_heads, peak_flops,
                                    bandwidth, bytes_per_elem, algorithm))


def pass_q_overlap_min_context(*, n_ranks: int, peak_flops: float, bandwidth: float,
                               bytes_per_elem: float = 2) -> float:
  """Eq. (3): the T+P at and above which pass-Q's ring SendRecv hides under attention.

  Neither algorithm tests it (both assume pass-Q's ring is hidden); exposed for plots.
  """
  _check(None, None, n_ranks, 1, 1, peak_flops, bandwidth, bytes_per_elem, "basic")
  return float(n_ranks * Fraction(bytes_per_elem) * Fraction(peak_flops)
               / (4 * Fraction(bandwidth)))


def choose_variant(new_tokens: int, cached_tokens: int, *, n_ranks: int, n_heads: int,
                   n_kv_heads: int, peak_flops: float, bandwidth: float,
                   bytes_per_elem: float = 2, algorithm: str = "alltoall") -> Variant:
  """Algorithm 1 (`algorithm="basic"`) or Algorithm 5 (`"alltoall"`): "pass_kv" or "pass_q"."""
  _check(new_tokens, cached_tokens, n_ranks, n_heads, n_kv_heads, peak_flops, bandwidth,
         bytes_per_elem, algorithm)
  if new_tokens >= _kv_overlap_min_new_tokens(n_ranks, n_heads, n_kv_heads, peak_flops,
                                              bandwidth, bytes_per_elem):
    return "pass_kv"
  miss_rate = Fraction(new_tokens, new_tokens + cached_tokens)
  if miss_rate >= _miss_rate_threshold(new_tokens, n_ranks, n_heads, n_kv_heads, peak_flops,
                                       bandwidth, bytes_per_elem, algorithm):
    return "pass_kv"
  return "pass_q"


__all__ = ["ALGORITHMS", "choose_variant", "kv_overlap_min_new_tokens", "miss_rate_threshold",
           "pass_q_overlap_min_context"]
