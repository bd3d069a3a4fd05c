"""Wukong's scaling claim (arXiv 2403.02545, Figure 1) at CPU scale: quality against dense
GFLOPs/example for Wukong, DLRM and DCN-v2 at four sizes each, power-law fits of the NE gap
to the floor.

Command: python -m experiments.wukong_scaling
  --config=experiments/wukong_scaling/configs/cpu_grid.py
Same as: python -m experiments.wukong_scaling
Hardware: the 2-core CPU of BENCHMARKS.md
Time: 628 s wall (2026-11-21)
Prints: NE - 0.5237 = a GFLOPs^b: Wukong a 0.191, b -0.029 (R^2 0.81); DLRM a 0.130, b
  -0.047 (0.92); DCN-v2 a 0.094, b -0.105 (0.96); largest sizes' test NE Wukong
  l3_n16_k32_w512 0.7492, DLRM w1024 0.6920, DCN-v2 x3_r256_w1024 0.6928 (BENCHMARKS.md
  "Wukong scaling study")
"""


def get_config():
  return {
      "data": "synthetic_deep",
      "grid": "cpu",
      "archs": ["wukong", "dlrm", "dcnv2"],
      "steps": 800,
      "seeds": ["0"],
      "batch_size": 1024,
      "num_rows": 20,
      "embedding_dim": 16,
  }
