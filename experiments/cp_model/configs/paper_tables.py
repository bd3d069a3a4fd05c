"""arXiv 2411.01783, Llama 3 405B prefill on H100 hosts (Tables 4, 6, 7, Fig. 6a): every
TTFT the paper reports beside the analytic model, GEMM efficiency fitted to TP8 128K.

Command: python -m experiments.cp_model
  --config=experiments/cp_model/configs/paper_tables.py
Same as: python -m experiments.cp_model
Hardware: the 2-core CPU of BENCHMARKS.md (2-vCPU Intel Xeon VM); no JAX computation
Time: about 2 s (2026-11-21)
Prints: GEMM efficiency 0.571; 128K full prefill CP2 / CP4 / CP8 / CP16 +0.1% / -3.7% /
  -9.5% / -29.8% (21.06 / 10.55 / 5.29 / 2.67 s against 21.0 / 10.95 / 5.85 / 3.8 s); 1M
  CP16 78.8 s against 77 s (+2.3%); pass-KV faster than pass-Q from a 3.08% miss rate
  (paper: between 5% and 10%) (BENCHMARKS.md "Context parallelism: the paper's latency
  tables vs an analytic model")
"""


def get_config():
  return {
      "calib_s": 42.01,           # Table 6: TP8 full prefill of 128K tokens, the one fit
      "tokens_128k": 131072,      # "128K" and "1M" as powers of two
      "tokens_1m": 1048576,
      "gemm_eff": None,           # fitted to calib_s
  }
