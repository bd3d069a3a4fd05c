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


__all__ = ["Efficiency", "Hardware", "alpha_beta", "roofline"]
