"""DMT (arXiv 2403.00877): towers of 2 and 4 against flat DLRM, test quality and the
global all-to-all bytes per step.

Command: python -m experiments.dmt --config=experiments/dmt/configs/towers.py
Same as: python -m experiments.dmt
Hardware: the 2-core CPU of BENCHMARKS.md, shared (load average ~10)
Time: 5.5 min (jax 0.11.2)
Prints: test AUC flat DLRM 0.6796, DMT T=2 0.6792 (similarity) / 0.6784 (random), T=4
  0.6801 / 0.6812; global all-to-all 123.5 MB per step flat, 43.5 (2.84x less) at T=2,
  67.5 (1.83x less) at T=4 (BENCHMARKS.md "DMT towers vs flat DLRM")
"""


def get_config():
  return {
      "towers": ["2", "4"],
      "tower_k": 2,
      "steps": 600,
      "batch_size": 512,
      "num_rows": 5000,
      "dim": 16,
      "teacher": "deep",
      "comm_batch": 65536,
      "h100_only": False,
  }
