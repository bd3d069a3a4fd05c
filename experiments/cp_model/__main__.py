r"""Analytic model vs the measured prefill latencies of arXiv 2411.01783 (Llama 3 405B, H100).

  python -m experiments.cp_model                          # paper constants, runs/cp_model
  python -m experiments.cp_model --sendrecv_eff=0.8 --all2all_eff=0.8   # other links

Runs on a CPU in about a second (no JAX). Predicts with the analytic model (perf_model.py
beside this file; peaks and achieved fractions in `core.hardware`, FLOP and byte counts in
`llm.cost`), after fitting its one free constant (GEMM efficiency) to the TP8 128K full
prefill (42.01 s), every other latency the paper reports for Llama 3 405B prefill on GTT
hosts (8 H100 + RDMA):
  full prefill, 128K tokens, TP8 and CP2/4/8/16 (Table 7, Fig. 6a, §4.2.3),
  full prefill, 1M tokens on CP16 (§4.2.3), 8K and 32K on TP8 and CP2 (Table 6),
  partial prefill on CP4 with P + T = 128000, pass-KV and pass-Q, all 14 rows of Table 4,
and where pass-KV starts to beat pass-Q, next to Algorithms 1 and 5
(`llm.attention.cp_select`) evaluated with peak and with achieved C and BW.
"128K" and "1M" are taken as 2^17 and 2^20 tokens (--tokens_128k, --tokens_1m): Table 6's
TP8 times for 8K/32K/128K fit a + b*T^2 with powers of two to 0.5%, with 128000 to 3.6%.
Table 4 states P + T = 128000 itself.

Prints a table of paper vs model with the relative error of every point; writes
results.json, full_prefill.png and partial_prefill.png to --workdir; the last stdout line
is JSON (errors, fitted constant, crossover miss rates).

With the defaults (any CPU, ~1 s plus imports) it prints GEMM efficiency 0.571 and:
- full prefill, 9 predicted points: median |rel err| 4.3%; 128K CP2/4/8/16 +0.1%, -3.7%,
  -9.5%, -29.8%; 1M CP16 +2.3% (78.8 s vs 77 s; with --tokens_1m=1000000, 72.2 s, -6.2%).
  The model scales 128K linearly; the paper's CP8 and CP16 do not (5.85 s, 3.8 s).
- partial prefill, 28 points: every TTFT is low by 0.5-1.6 s (median 0.75 s; -80% at 1%
  miss rate, -9..-14% at 100%): the paper's partial-prefill runs carry a cost common to
  both variants that no FLOP or byte here accounts for (its own CP4 128K full prefill is
  10.95 s in Table 7 but 11.46 s in Table 4's 100% row, with fewer tokens). The
  pass-KV minus pass-Q differences, where that cost cancels, agree to within 55 ms at 1%,
  2.5% and 10-60% (136 ms at 100%); at 3.25-5% the model's sign is wrong by 30-80 ms; at
  70-90% the paper's own differences jump (-969, -547, -435 ms).
- crossover: the model has pass-KV faster from 3.08% miss rate; the paper's Table 4 from
  between 5% and 10% (5.14% interpolated). Algorithm 1 / 5 with peak C, BW: 3.12% / 2.50%;
  with achieved C = 540 TF/s, BW = 28.4 GB/s: 3.71% / 2.86%.
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from core import hardware
from core import settings  # noqa: F401  (the shared settings by name)

from experiments.common.report import Report
from experiments.cp_model import study

FLAGS = flags.FLAGS
_HW, _EFF = hardware.Hardware(), hardware.Efficiency()  # defaults, documented in core/hardware.py


BF16_TFLOPS = config.setting(
    "bf16_tflops", "float", "Peak BF16 TF/s per GPU (paper App. A).")
FP8_TFLOPS = config.setting(
    "fp8_tflops", "float", "Peak FP8 TF/s per GPU (assumed 2x BF16).")
HBM_TBPS = config.setting(
    "hbm_tbps", "float", "HBM TB/s per GPU (paper §4.1).")
NVLINK_GBPS = config.setting(
    "nvlink_gbps", "float", "NVLink GB/s per GPU per direction (H100 SXM spec).")
NET_GBPS = config.setting(
    "net_gbps", "float", "Inter-host GB/s per GPU (400 Gb/s RDMA, paper §4.1).")
ATTN_EFF = config.setting(
    "attn_eff", "float", "Attention fraction of BF16 peak (App. A: 540/800).")
HBM_EFF = config.setting(
    "hbm_eff", "float", "Achieved fraction of HBM bandwidth (assumed).")
NVLINK_EFF = config.setting(
    "nvlink_eff", "float", "Achieved fraction of NVLink bandwidth (assumed).")
SENDRECV_EFF = config.setting(
    "sendrecv_eff", "float", "Ring SendRecv fraction of net_gbps (Table 5).")
SENDRECV_LATENCY_US = config.setting(
    "sendrecv_latency_us", "float", "Ring SendRecv latency, us (Table 5).", lower=0.0)
ALL2ALL_EFF = config.setting(
    "all2all_eff", "float", "pass-Q All2All fraction of net_gbps (Table 5).")
ALL2ALL_LATENCY_US = config.setting(
    "all2all_latency_us", "float", "pass-Q All2All latency, us (Table 5).", lower=0.0)
GEMM_EFF = config.setting(
    "gemm_eff", "float", "GEMM fraction of peak, in (0, 1]; unset: fit it to --calib_s.",
    none_ok=True)
CALIB_S = config.setting(
    "calib_s", "float", "Measured TP8 full prefill of --tokens_128k (Table 6).")
TOKENS_128K = config.setting(
    "tokens_128k", "integer", "Tokens of the paper's '128K' full prefill.", lower=1)
TOKENS_1M = config.setting(
    "tokens_1m", "integer", "Tokens of the paper's '1M' full prefill.", lower=1)
CURVE_POINTS = config.setting(
    "curve_points", "integer", "Points per predicted curve in the plots (>= 2).", lower=2)


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names; `flag_values`: where, default
  absl's FLAGS); every setting but --workdir may come from a --config file (configs/)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  config.define_flags(None, "workdir", flag_values=fv, workdir="runs/cp_model")
  config.define_flags(
      None, BF16_TFLOPS, FP8_TFLOPS, HBM_TBPS, NVLINK_GBPS, NET_GBPS, ATTN_EFF,
      HBM_EFF, NVLINK_EFF, SENDRECV_EFF, SENDRECV_LATENCY_US, ALL2ALL_EFF, ALL2ALL_LATENCY_US,
      GEMM_EFF, CALIB_S, TOKENS_128K, TOKENS_1M, CURVE_POINTS, in_config=True, flag_values=fv,
      bf16_tflops=_HW.bf16_flops / 1e12, fp8_tflops=_HW.fp8_flops / 1e12,
      hbm_tbps=_HW.hbm_bytes_per_s / 1e12, nvlink_gbps=_HW.nvlink_bytes_per_s / 1e9,
      net_gbps=_HW.net_bytes_per_s / 1e9, attn_eff=_EFF.attn, hbm_eff=_EFF.hbm,
      nvlink_eff=_EFF.nvlink, sendrecv_eff=_EFF.sendrecv,
      sendrecv_latency_us=_EFF.sendrecv_latency_s * 1e6, all2all_eff=_EFF.all2all,
      all2all_latency_us=_EFF.all2all_latency_s * 1e6, gemm_eff=None, calib_s=42.01,
      tokens_128k=131072, tokens_1m=1048576, curve_points=200)
  for name in ("bf16_tflops", "fp8_tflops", "hbm_tbps", "nvlink_gbps", "net_gbps", "attn_eff",
               "hbm_eff", "nvlink_eff", "sendrecv_eff", "all2all_eff", "calib_s"):
    flags.register_validator(name, lambda v: v > 0, message="expected a value > 0",
                             flag_values=fv)
  flags.register_validator("gemm_eff", lambda v: v is None or 0 < v <= 1,
                           message="expected a fraction in (0, 1]", flag_values=fv)


# The LM run the paper's tables time: Llama 3 405B (an LMRunConfig; the settings it
# changes from train_lm's defaults).
LM_RUN = dict(preset="llama3_405b")


def build_constants(flag_values) -> tuple:
  """(cfg, Hardware, Efficiency before the GEMM fit) from the flags; cfg is the model of
  the LM run `LM_RUN`."""
  from llm.run_config import LMRunConfig

  f = flag_values
  hw = hardware.Hardware(bf16_flops=f.bf16_tflops * 1e12, fp8_flops=f.fp8_tflops * 1e12,
                         hbm_bytes_per_s=f.hbm_tbps * 1e12,
                         nvlink_bytes_per_s=f.nvlink_gbps * 1e9,
                         net_bytes_per_s=f.net_gbps * 1e9)
  eff = hardware.Efficiency(attn=f.attn_eff, hbm=f.hbm_eff, nvlink=f.nvlink_eff,
                            sendrecv=f.sendrecv_eff,
                            sendrecv_latency_s=f.sendrecv_latency_us * 1e-6,
                            all2all=f.all2all_eff, all2all_latency_s=f.all2all_latency_us * 1e-6)
  return config.replace(LMRunConfig(), **LM_RUN).preset_config(), hw, eff


def main(argv):
  del argv
  cfg, hw, eff = build_constants(FLAGS)
  res = study.evaluate(cfg, hw, eff, tokens_128k=FLAGS.tokens_128k, tokens_1m=FLAGS.tokens_1m,
                       calib_s=FLAGS.calib_s, gemm_eff=FLAGS.gemm_eff,
                       curve_points=FLAGS.curve_points)
  print(study.format_table(res))
  report = Report(FLAGS.workdir)
  study.plot(res, report.path())
  report.finish(res, res["summary"])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
