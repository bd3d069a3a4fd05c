"""Rankitect (arXiv 2311.08430) evolutionary search: 20 trials of Optuna's NSGA-II
(population 8) over the same space and budget as configs/random.py, in its workdir (the
hand-designed models trained there once, by the random run).

Command: python -m experiments.rankitect --config=experiments/rankitect/configs/evolution.py
Same as: python -m experiments.rankitect --method=evolution --nobaselines
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average 18-38)
Time: 38.7 min wall at that load, 207.6 s CPU (user + sys), 1.7-3.5 min estimated on an idle
  machine (2026-11-27, jax 0.11.2)
Prints: evolution (20 trials, 17 distinct) best dhen-skip NE 0.8071 @ 0.102 MFLOPs/example,
  Pareto front skip-dcn 0.8132 @ 0.046, lcb-attention 0.8130 @ 0.058, dcn-skip 0.8118 @
  0.066, dcn-dcn 0.8116 @ 0.075, dhen-skip 0.8071 @ 0.102 (BENCHMARKS.md "Rankitect
  architecture search", seed 0)
"""


def get_config():
  return {
      "method": "evolution",
      "trials": 20,
      "steps": 300,
      "layers": 2,
      "width": 8,
      "baselines": False,
      "data": "synthetic_deep",
      "num_rows": 20,
      "batch_size": 256,
      "eval_batches": 4,
      "embedding_dim": 16,
  }
