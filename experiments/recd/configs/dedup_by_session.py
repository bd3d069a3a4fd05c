"""RecD (arXiv 2211.05239): lookup and train-step throughput of the deduplicated path
against the plain one, by the user features' duplication rate (sessions of 1-32 samples).

Command: python -m experiments.recd --config=experiments/recd/configs/dedup_by_session.py
Same as: python -m experiments.recd
Hardware: the 2-core AMD EPYC CPU (1 XLA CPU device), shared (load average 2.4-3.9), run
  under nice -n 19
Time: 2 min 12 s wall (2026-11-27, jax 0.11.2)
Prints: speedup plain / dedup at duplication 0 / 0.75 / 0.875 / 0.97 (S = 1, 4, 8, 32):
  lookup 1.12 / 6.62 / 6.44 / 8.76x, train step 1.00 / 1.51 / 6.00 / 7.60x; single ratios
  moved up to 2x in a second run (BENCHMARKS.md "RecD in-batch deduplication")
"""


def get_config():
  return {
      "session_lens": ["1", "2", "4", "8", "16", "32"],
      "batch_size": 2048,
      "num_user": 8,
      "num_item": 8,
      "user_bag": 32,
      "num_rows": 100000,
      "dim": 32,
      "steps": 5,
      "repeats": 5,
  }
