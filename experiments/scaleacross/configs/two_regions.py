"""Llama 3 405B training over two regions (arXiv 2605.24326's setting; compute efficiency
fitted to Llama 3's Table 4, arXiv 2407.21783): every plan searched, the best against the
baseline.

Command: python -m experiments.scaleacross
  --config=experiments/scaleacross/configs/two_regions.py
Same as: python -m experiments.scaleacross
Hardware: the 2-core CPU of BENCHMARKS.md, shared; no JAX computation
Time: about 10 s (2026-11-27)
Prints: compute efficiency 0.672 (fitted to the 8,192-GPU row); Table 4's other rows
  -12.0% (16,384 GPUs, seq 8K) and +2.8% (seq 128K); baseline 7.83 s per step (330
  TF/GPU), best single change v=4 1.15x, best plan 1.31x (tp4 cp2 pp16 fsdp128 v4, PP
  across the regions, hierarchical, 4 flows), placement + network only 1.06x
  (BENCHMARKS.md "ScaleAcross")
"""


def get_config():
  return {
      "compute_efficiency": None,   # fitted to Llama 3's Table 4
      "sweep_outer_gbps": [],
  }
