"""core.hardware's link terms: Link, ring collectives against step-by-step sums."""

import pytest

from core import hardware


def test_link_time_and_checks():
  link = hardware.Link(bytes_per_s=1e9, latency_s=1e-5)
  assert link.time(2e6) == pytest.approx(1e-5 + 2e-3)
  for bad in (dict(bytes_per_s=0, latency_s=0), dict(bytes_per_s=-1, latency_s=0),
              dict(bytes_per_s=1, latency_s=-1)):
    with pytest.raises(ValueError, match="hardware.Link"):
      hardware.Link(**bad)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_ring_collectives_are_their_steps(n):
  link = hardware.Link(5e9, 2e-6)
  b = 3e6
  step = 2e-6 + b / n / 5e9
  assert hardware.ring_collective_s("all_reduce", b, n, link) == pytest.approx(2 * (n - 1) * step)
  assert hardware.ring_collective_s("all_gather", b, n, link) == pytest.approx((n - 1) * step)
  assert hardware.ring_collective_s("reduce_scatter", b, n, link) == pytest.approx((n - 1) * step)
  assert hardware.ring_collective_s("send_recv", b, n, link) == pytest.approx(2e-6 + b / 5e9)
  # The bandwidth term is Thakur et al.'s 2 (n - 1) / n * bytes.
  slow = hardware.Link(5e9, 0.0)
  assert hardware.ring_collective_s("all_reduce", b, n, slow) == pytest.approx(
      2 * (n - 1) / n * b / 5e9)


def test_ring_collective_rejects_bad_kind_and_n():
  with pytest.raises(ValueError, match="kind='broadcast'"):
    hardware.ring_collective_s("broadcast", 1.0, 2, hardware.Link(1.0, 0.0))
  with pytest.raises(ValueError, match="n=0"):
    hardware.ring_collective_s("all_reduce", 1.0, 0, hardware.Link(1.0, 0.0))


def test_efficiency_links_are_the_cp_papers_lines():
  eff, hw = hardware.Efficiency(), hardware.Hardware()
  assert eff.sendrecv_link(hw).time(16.4e6) == pytest.approx(627e-6, rel=0.02)   # Table 5
  assert eff.all2all_link(hw).time(39.9e6) == pytest.approx(1023e-6, rel=0.02)
  assert eff.nvlink_link(hw).bytes_per_s == eff.nvlink * hw.nvlink_bytes_per_s
