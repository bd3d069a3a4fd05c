"""Llama 3 405B training over two buildings of 8,192 GPUs (1:8 campus link): every plan
searched, the best against the baseline.

Command: python -m experiments.scaleacross
  --config=experiments/scaleacross/configs/two_buildings.py
Same as: python -m experiments.scaleacross
  --cluster=experiments/scaleacross/clusters/two_buildings.json
Hardware: the 2-core CPU of BENCHMARKS.md, shared; no JAX computation
Time: about 10 s (2026-11-27)
Prints: baseline 7.39 s per step (350 TF/GPU), best single change (degrees) 1.18x, best
  plan 1.26x (tp4 cp2 pp16 fsdp128 v4, PP across the buildings), placement + network only
  1.01x (BENCHMARKS.md "ScaleAcross")
"""


def get_config():
  return {
      "cluster": "experiments/scaleacross/clusters/two_buildings.json",
      "compute_efficiency": None,
  }
