"""Peak rates of an accelerator host and the fractions of them that real kernels and links
achieve, for analytic time models: every op a roofline, every message latency + bytes / rate.

The defaults describe one GPU of the H100 hosts of "Context Parallelism for Scalable
Million-Token Inference" (arXiv 2411.01783, §4.1 and App. A: "GTT" hosts, 8 H100 over NVLink,
hosts joined by 400 Gb/s RDMA per GPU). Each value says where it comes from; "assumption"
marks a value the paper does not give.

  Hardware    peaks: BF16 / FP8 FLOP/s, HBM, NVLink and inter-host bytes/s per GPU
  Efficiency  achieved fractions of those peaks (GEMM, attention, HBM, NVLink) and the
              inter-host SendRecv / All2All lines (latency, fraction of the link peak)
  roofline    max(FLOPs / rate, bytes / bandwidth)
  alpha_beta  the line time = latency + bytes / rate through two timings of a link
  Link        one link's achieved bytes/s and latency: time(bytes) = latency + bytes / rate
  ring_collective_s  a ring all-reduce / all-gather / reduce-scatter / send-recv on a Link

The inter-host lines are the paper's Table 5 per-op timings (CP4, P + T = 128000) fitted two
points per op; `experiments.cp_model` refits them from the table and checks these values.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Peak rates of one GPU of an H100 host and of its links."""

  bf16_flops: float = 800e12        # paper App. A: power-limited H100, BF16 dense peak
  fp8_flops: float = 1600e12        # assumption: 2x BF16
  hbm_bytes_per_s: float = 2.4e12   # paper §4.1: 96 GB HBM2e
  nvlink_bytes_per_s: float = 450e9  # assumption: H100 SXM NVLink, 900 GB/s both directions
  net_bytes_per_s: float = 50e9     # paper §4.1: GTT, RDMA 400 Gb/s per GPU


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of the `Hardware` peaks and fixed per-message latencies."""

  gemm: float = 0.6                 # placeholder: fit it to a measured time (calibrate_gemm)
  attn: float = 0.675               # paper App. A: FA3 540 of 800 TF/s
  hbm: float = 0.8                  # assumption
  nvlink: float = 0.8               # assumption (NCCL all-reduce bus bandwidth ~360 GB/s)
  nvlink_latency_s: float = 10e-6   # assumption, per intra-host all-reduce
  # Inter-host links, alpha + bytes / (fraction * peak), each fitted to two rows of the
  # paper's Table 5 (CP4, P + T = 128000):
  sendrecv: float = 0.5686          # ring SendRecv: 16.4 MB in 627 us, 3.28 MB in 166 us
  sendrecv_latency_s: float = 50.75e-6
  all2all: float = 1.0              # pass-Q All2All: 9.98 MB in 424 us, 39.9 MB in 1023 us
  all2all_latency_s: float = 224.33e-6

  def nvlink_link(self, hw: Hardware) -> Link:
    """The achieved intra-host link, one latency per collective."""
    return Link(self.nvlink * hw.nvlink_bytes_per_s, self.nvlink_latency_s)

  def sendrecv_link(self, hw: Hardware) -> Link:
    """The inter-host ring SendRecv line (Table 5 fit)."""
    return Link(self.sendrecv * hw.net_bytes_per_s, self.sendrecv_latency_s)

  def all2all_link(self, hw: Hardware) -> Link:
    """The inter-host All2All line (Table 5 fit)."""
    return Link(self.all2all * hw.net_bytes_per_s, self.all2all_latency_s)


@dataclasses.dataclass(frozen=True)
class Link:
  """Achieved bytes/s of one sender on a link and the fixed latency of one message."""

  bytes_per_s: float
  latency_s: float

  def __post_init__(self):
    if not self.bytes_per_s > 0 or not self.latency_s >= 0:
      raise ValueError(f"hardware.Link: bytes_per_s={self.bytes_per_s}, "
                       f"latency_s={self.latency_s}; expected bytes_per_s > 0, latency_s >= 0")

  def time(self, bytes_: float) -> float:
    """Seconds of one message: latency + bytes / rate."""
    return self.latency_s + bytes_ / self.bytes_per_s


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def ring_collective_s(kind: str, bytes_: float, n: int, link: Link) -> float:
  """Seconds of a ring collective over `n` ranks, `bytes_` the full buffer per rank.

  all_reduce: 2 (n - 1) steps of bytes / n; all_gather / reduce_scatter: n - 1 steps of
  bytes / n (bytes: the gathered size); send_recv: one message of bytes. Every step pays the
  link latency (NCCL's ring; Thakur et al. 2005's bandwidth term 2 (n - 1) / n * bytes).
  """
  if kind not in COLLECTIVES:
    raise ValueError(f"hardware.ring_collective_s: kind={kind!r}; expected one of {COLLECTIVES}")
  if n < 1:
    raise ValueError(f"hardware.ring_collective_s: n={n}; expected n >= 1")
  if kind == "send_recv":
    return link.time(bytes_)
  if n == 1:
    return 0.0
  steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
  return steps * link.time(bytes_ / n)


def roofline(flops: float, bytes_: float, flops_per_s: float, bytes_per_s: float) -> float:
  """Seconds of an op bound by compute or by memory traffic, whichever is slower."""
  return max(flops / flops_per_s, bytes_ / bytes_per_s)


def alpha_beta(bytes_a: float, s_a: float, bytes_b: float, s_b: float) -> tuple[float, float]:
  """(latency s, bytes/s) of the line time = latency + bytes / rate through two timings."""
  if bytes_a == bytes_b or (s_b - s_a) * (bytes_b - bytes_a) <= 0:
    raise ValueError(f"hardware.alpha_beta: ({bytes_a} B, {s_a} s), ({bytes_b} B, {s_b} s); "
                     "expected two timings whose time grows with size")
  rate = (bytes_b - bytes_a) / (s_b - s_a)
  return s_a - bytes_a / rate, rate


__all__ = ["COLLECTIVES", "Efficiency", "Hardware", "Link", "alpha_beta", "ring_collective_s",
           "roofline"]
