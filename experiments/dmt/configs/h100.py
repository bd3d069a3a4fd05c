"""DMT's step time modelled on hosts of 8 H100 (one tower per host), flat against SPTT,
beside the paper's "up to 1.9x" (arXiv 2403.00877).

Command: python -m experiments.dmt --config=experiments/dmt/configs/h100.py
Same as: python -m experiments.dmt --h100_only
Hardware: the 2-core CPU of BENCHMARKS.md, shared (load average ~27)
Time: 148 s (2026-11-27, jax 0.11.2)
Prints: flat / SPTT with table-wise hosts at 1 / 2 / 4 / 8 / 16 hosts 1.00x / 1.44x / 1.33x
  / 0.95x / 0.57x; SPTT as built (row-wise in the host) 0.13x / 0.54x / 0.61x / 0.54x /
  0.40x (BENCHMARKS.md "DMT step time modelled on H100 hosts")
"""


def get_config():
  return {
      "h100_only": True,
      "h100_hosts": ["1", "2", "4", "8", "16"],
      "h100_local_batch": 4096,
      "h100_dim": 128,
      "tower_k": 2,
  }
