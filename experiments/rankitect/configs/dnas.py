"""Rankitect (arXiv 2311.08430) differentiable search (DNAS): one Gumbel-softmax supernet
of 1500 steps with FLOP-cost weight 0.3, its argmax retrained for 300 steps, in the workdir
of configs/random.py.

Command: python -m experiments.rankitect --config=experiments/rankitect/configs/dnas.py
Same as: python -m experiments.rankitect --method=dnas --nobaselines
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average 18-38)
Time: 38.4 min wall at that load, 165.6 s CPU (user + sys), 1.4-2.8 min estimated on an idle
  machine (2026-11-27, jax 0.11.2)
Prints: dnas (cost weight 0.3) best lcb-skip NE 0.8138 @ 0.037 MFLOPs/example, the cheapest
  point of all methods (BENCHMARKS.md "Rankitect architecture search", seed 0)
"""


def get_config():
  return {
      "method": "dnas",
      "supernet_steps": 1500,
      "dnas_cost_weights": ["0.3"],
      "steps": 300,
      "baselines": False,
      "data": "synthetic_deep",
      "num_rows": 20,
      "batch_size": 256,
      "embedding_dim": 16,
  }
