"""Rankitect (arXiv 2311.08430) random search at the default budget: 20 Optuna trials of the
121-architecture space (2 stack layers of 8 embeddings, dim 16) beside the 8 hand-designed
DLRM / DCN-v2 / DHEN / Wukong points, every model 300 steps of 256 on synthetic_deep.

Command: python -m experiments.rankitect --config=experiments/rankitect/configs/random.py
Same as: python -m experiments.rankitect --method=random
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average 10-40)
Time: 60.0 min wall at that load, 390.1 s CPU (user + sys), 3.3-6.5 min estimated on an idle
  machine (2026-11-27, jax 0.11.2)
Prints: best hand-designed dlrm:w256 NE 0.8072 @ 0.359 MFLOPs/example; random (20 trials, 18
  distinct) best dhen-skip 0.8071 @ 0.102, Pareto front skip-lcb 0.8153 @ 0.039, dcn-skip
  0.8118 @ 0.066, dcn-dcn 0.8116 @ 0.075, dhen-skip 0.8071 @ 0.102 (BENCHMARKS.md "Rankitect
  architecture search", seed 0)
"""


def get_config():
  return {
      "method": "random",
      "trials": 20,
      "steps": 300,
      "layers": 2,
      "width": 8,
      "baselines": True,
      "data": "synthetic_deep",
      "num_rows": 20,
      "batch_size": 256,
      "eval_batches": 4,
      "embedding_dim": 16,
      "dense_optimizer": "adam",
      "learning_rate": 1e-3,
      "embedding_learning_rate": 0.1,
  }
