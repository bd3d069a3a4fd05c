"""Rankitect (arXiv 2311.08430) random search on the Avazu sample: one epoch of its train
rows (32 steps of 256), 20 trials beside the hand-designed models, eval on the sample's
held-out split (under 1,000 examples: NE differences below about 0.02 are noise).

Command: python -m experiments.rankitect
  --config=experiments/rankitect/configs/avazu_sample.py --workdir=runs/rankitect_avazu
Same as: python -m experiments.rankitect --method=random
  --data=avazu:../shared/data/avazu_sample --num_rows=20000 --steps=32
Hardware: the 2-core CPU of BENCHMARKS.md, load average about 5
Time: 3 min 22 s wall, 135 s user CPU (2026-11-27, jax 0.11.2)
Prints: best hand-designed dcnv2 x3_r16_w256 NE 0.9060 @ 0.395 MFLOPs/example; random
  search's best (20 trials, 18 distinct) fmb-wukong 0.9026 @ 0.102 (BENCHMARKS.md
  "Rankitect architecture search", real data)
"""


def get_config():
  return {
      "method": "random",
      "data": "avazu:../shared/data/avazu_sample",
      "num_rows": 20000,
      "steps": 32,
  }
