"""DLRM, DCN-v2, DHEN and Wukong under one budget on synthetic Criteo-shaped data (the
linear planted signal, whose true logits give the Bayes row), three seeds.

Command: python -m experiments.compare_rec
  --config=experiments/compare_rec/configs/synthetic.py
Same as: python -m experiments.compare_rec
Hardware: the 2-core CPU of BENCHMARKS.md
Time: 659 s wall (2026-11-21)
Prints: test AUC / NE, mean ± std over seeds 0, 1, 2: DLRM 0.7618 ± 0.0003 / 0.8514 ±
  0.0011, DCN-v2 0.7700 ± 0.0002 / 0.8395 ± 0.0010, DHEN 0.7519 ± 0.0044 / 0.8664 ±
  0.0073, Wukong 0.7637 ± 0.0018 / 0.8505 ± 0.0030; true logits 0.8290 / 0.7464
  (BENCHMARKS.md "Every rec model on the Criteo Kaggle sample", synthetic table)
"""


def get_config():
  return {
      "data": "synthetic",
      "models": ["dlrm", "dcnv2", "dhen", "wukong"],
      "seeds": ["0", "1", "2"],
      "steps": 500,
      "batch_size": 1024,
      "embedding_dim": 16,
      "num_rows": 100000,
  }
