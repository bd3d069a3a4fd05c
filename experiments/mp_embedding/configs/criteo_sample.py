"""Mixed-precision embeddings with an fp32 cache (arXiv 2010.11305) on the Criteo Kaggle
sample: one epoch, three seeds.

Command: python -m experiments.mp_embedding
  --config=experiments/mp_embedding/configs/criteo_sample.py
  --workdir=runs/mp_embedding_criteo
Same as: python -m experiments.mp_embedding --data=criteo:../shared/data/criteo_kaggle_sample
  --epochs=1 --batch_size=128 --eval_batch_size=1024 --seeds=0,1,2
Hardware: the 2-core CPU of BENCHMARKS.md, shared (load average ~13), one CPU device
Time: 12.7 min wall (2026-11-24, jax 0.11.2)
Prints: fp32 AUC 0.7183; int8 + 5% LFU / LRU dAUC +0.0002 (hit rate 87.4%); int4 + 1% LFU
  -0.0001, LRU -0.0088 (800 eval rows) (BENCHMARKS.md "Mixed-precision embeddings with an
  fp32 cache")
"""


def get_config():
  return {
      "data": "criteo:../shared/data/criteo_kaggle_sample",
      "epochs": 1.0,
      "batch_size": 128,
      "eval_batch_size": 1024,
      "seeds": ["0", "1", "2"],
  }
