"""Pass-KV / pass-Q selection (arXiv 2411.01783, Algorithms 1 and 5) on hand-computed cases."""

import itertools
from fractions import Fraction

import pytest

from llm.attention.cp_select import (choose_variant, kv_overlap_min_new_tokens,
                                     miss_rate_threshold, pass_q_overlap_min_context)

# The paper's setting at hardware peaks: CP4, Llama 3 405B heads, 800 TF/s BF16, 50 GB/s.
# Eq. (2): T >= 4 * 800e12 * 8 * 2 / (2 * 128 * 50e9) = 4000.
# Eq. (5): T/(T+P) >= 1/8 - 4 * T * 50e9 / (4 * 800e12 * 2) = 1/8 - T/32000.
PAPER = dict(n_ranks=4, n_heads=128, n_kv_heads=8, peak_flops=800e12, bandwidth=50e9)


def _both(t, p, **kw):
  kw = {**PAPER, **kw}
  return (choose_variant(t, p, algorithm="basic", **kw),
          choose_variant(t, p, algorithm="alltoall", **kw))


def test_thresholds_hand_computed():
  assert kv_overlap_min_new_tokens(**PAPER) == 4000.0
  assert miss_rate_threshold(3200, algorithm="basic", **PAPER) == 0.125
  assert miss_rate_threshold(3200, algorithm="alltoall", **PAPER) == pytest.approx(0.025, abs=1e-15)
  assert miss_rate_threshold(2000, algorithm="alltoall", **PAPER) == 0.0625
  assert miss_rate_threshold(8000, algorithm="alltoall", **PAPER) == pytest.approx(-0.125)
  # Eq. (3): T + P >= 4 * 2 * 800e12 / (4 * 50e9) = 32000.
  assert pass_q_overlap_min_context(n_ranks=4, peak_flops=800e12, bandwidth=50e9) == 32000.0


def test_eq2_boundary_is_inclusive_and_independent_of_cache():
  for p in (0, 124000, 10**9):
    assert _both(4000, p) == ("pass_kv", "pass_kv")
  # T = 3999 with a huge cache: Eq. (1) fails and Eq. (5)'s threshold 1/8 - 3999/32000 > 0.
  assert _both(3999, 10**9) == ("pass_q", "pass_q")


def test_alg1_message_size_boundary():
  # T/(T+P) = 1000/8000 = 1/8 exactly: pass-KV; one more cached token: pass-Q (T < 4000).
  assert _both(1000, 7000)[0] == "pass_kv"
  assert _both(1000, 7001)[0] == "pass_q"
  assert _both(1, 0) == ("pass_kv", "pass_kv")          # full prefill (miss rate 1)
  assert _both(1, 127999) == ("pass_q", "pass_q")       # decode


def test_alg5_boundary_exact():
  # T = 3200, P = 124800: miss rate 1/40 equals 1/8 - 3200/32000 exactly.
  assert _both(3200, 124800) == ("pass_q", "pass_kv")
  assert _both(3200, 124801) == ("pass_q", "pass_q")
  # T = 2000: threshold 1/16, hit exactly by P = 30000.
  assert _both(2000, 30000) == ("pass_q", "pass_kv")
  assert _both(2000, 30001) == ("pass_q", "pass_q")


def test_mha_full_prefill():
  # N_H = N_KV: Eq. (1)'s threshold is 2 > any miss rate, so Algorithm 1 needs Eq. (2):
  # T >= 4*800e12*2/(2*50e9) = 64000. Algorithm 5 at P = 0 needs 1 >= 2 - T/32000: T >= 32000.
  mha = dict(n_heads=8, n_kv_heads=8)
  assert _both(31999, 0, **mha) == ("pass_q", "pass_q")
  assert _both(32000, 0, **mha) == ("pass_q", "pass_kv")
  assert _both(63999, 0, **mha) == ("pass_q", "pass_kv")
  assert _both(64000, 0, **mha) == ("pass_kv", "pass_kv")


GRID = list(itertools.product(
    (2, 4, 16),                     # N
    (100e12, 800e12),               # C
    (3e9, 50e9, 400e9),             # BW
    (1, 37, 640, 3200, 9000, 40000),  # T
    (0, 1, 5000, 124800, 10**6)))   # P


def test_alg5_passes_kv_wherever_alg1_does():
  differ = 0
  for n, c, bw, t, p in GRID:
    basic, a2a = _both(t, p, n_ranks=n, peak_flops=c, bandwidth=bw)
    assert not (basic == "pass_kv" and a2a == "pass_q"), (n, c, bw, t, p)
    differ += basic != a2a
  assert differ > 0  # and the rules do differ somewhere


def test_alg5_is_appendix_c_inequality():
  """Algorithm 5 == 'pass-Q iff pass-KV's ring is exposed and the exposed time exceeds the
  All2All', computed from Appendix C's latencies (with D + 1 ~ D) in exact arithmetic."""
  nh, nkv, d, e = 128, 8, 16384, 2
  for n, c, bw, t, p in GRID:
    c, bw = Fraction(c), Fraction(bw)
    attn = Fraction(4 * t * d * (t + p)) / (n * c)             # paper's per-step terms
    kv_comm = Fraction(2 * (t + p) * d * e * nkv, nh) / bw
    all2all = Fraction(d * t * e) / bw                          # / (N-1) on both sides
    exposed = kv_comm - attn
    hidden = t >= n * c * nkv * e / (2 * nh * bw)               # Eq. (2)
    want = "pass_q" if (not hidden and exposed > all2all) else "pass_kv"
    got = choose_variant(t, p, n_ranks=n, n_heads=nh, n_kv_heads=nkv, peak_flops=float(c),
                         bandwidth=float(bw), algorithm="alltoall")
    assert got == want, (n, c, bw, t, p)


def test_alg5_threshold_positive_where_eq2_fails():
  for n, c, bw, t, _ in GRID:
    kw = dict(n_ranks=n, n_heads=128, n_kv_heads=8, peak_flops=c, bandwidth=bw)
    if t < kv_overlap_min_new_tokens(**kw):
      assert 0 < miss_rate_threshold(t, algorithm="alltoall", **kw) <= 0.125


@pytest.mark.parametrize("limit", [dict(peak_flops=1e30), dict(bandwidth=1e-6)])
def test_free_compute_or_slow_links_leave_only_message_size(limit):
  for n, _, _, t, p in GRID:
    kw = {**dict(peak_flops=800e12, bandwidth=50e9), **limit, "n_ranks": n}
    want = "pass_kv" if Fraction(t, t + p) >= Fraction(1, 8) else "pass_q"
    assert _both(t, p, **kw) == (want, want), (n, t, p)


def test_fast_links_always_pass_kv():
  # BW -> inf: Eq. (2)'s threshold -> 0, so both rules pick pass-KV even for decode. (Algorithm
  # 5 does NOT tend to Algorithm 1's second condition in this limit.)
  for n, c, _, t, p in GRID:
    assert _both(t, p, n_ranks=n, peak_flops=c, bandwidth=1e30) == ("pass_kv", "pass_kv")


@pytest.mark.parametrize("kw, match", [
    (dict(new_tokens=0), "new_tokens=0"),
    (dict(cached_tokens=-1), "cached_tokens=-1"),
    (dict(n_heads=12), "n_heads=12 is not a multiple"),
    (dict(bandwidth=0.0), "bandwidth=0.0"),
    (dict(peak_flops=float("inf")), "peak_flops=inf"),
    (dict(algorithm="ring"), "algorithm='ring'"),
])
def test_rejects_bad_arguments(kw, match):
  args = {"new_tokens": 10, "cached_tokens": 10, **PAPER, **kw}
  with pytest.raises(ValueError, match=match):
    choose_variant(args.pop("new_tokens"), args.pop("cached_tokens"), **args)
