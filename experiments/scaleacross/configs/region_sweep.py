"""Llama 3 405B over two regions, the region egress link swept from 0.8 to 204.8 Tb/s.

Command: python -m experiments.scaleacross
  --config=experiments/scaleacross/configs/region_sweep.py
Same as: python -m experiments.scaleacross --sweep_outer_gbps=800,3200,12800,51200,204800
Hardware: the 2-core CPU of BENCHMARKS.md, shared; no JAX computation
Time: 83 s (2026-11-27)
Prints: best plan over the baseline at 0.8 / 3.2 / 12.8 / 51.2 / 204.8 Tb/s 3.32x / 2.01x /
  1.52x / 1.31x / 1.32x; placement + network alone 3.02x / 1.72x / 1.24x / 1.06x / 1.06x
  (BENCHMARKS.md "ScaleAcross", region egress sweep)
"""


def get_config():
  return {
      "sweep_outer_gbps": ["800", "3200", "12800", "51200", "204800"],
  }
