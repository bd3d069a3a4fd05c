"""Rankitect (arXiv 2311.08430) random search on the Criteo Kaggle sample: one epoch of its
7,200 train rows (28 steps of 256), 20 trials beside the hand-designed models, eval on the
sample's held-out split (under 1,000 examples: NE differences below about 0.02 are noise).

Command: python -m experiments.rankitect
  --config=experiments/rankitect/configs/criteo_sample.py --workdir=runs/rankitect_criteo
Same as: python -m experiments.rankitect --method=random
  --data=criteo:../shared/data/criteo_kaggle_sample --num_rows=20000 --steps=28
Hardware: the 2-core CPU of BENCHMARKS.md, load average about 5
Time: 2 min 49 s wall, 86 s user CPU (2026-11-27, jax 0.11.2)
Prints: best hand-designed dcnv2 x2_r8_w64 NE 0.8987 @ 0.094 MFLOPs/example; random
  search's best (20 trials, 18 distinct) mlp_wide-mlp 0.9041 @ 0.350 (BENCHMARKS.md
  "Rankitect architecture search", real data)
"""


def get_config():
  return {
      "method": "random",
      "data": "criteo:../shared/data/criteo_kaggle_sample",
      "num_rows": 20000,
      "steps": 28,
  }
