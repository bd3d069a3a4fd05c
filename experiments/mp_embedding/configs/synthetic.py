"""Mixed-precision embeddings with an fp32 cache of the hot rows (arXiv 2010.11305): int8 +
5% and int4 + 1% LFU / LRU caches against fp32 tables, DLRM on synthetic Zipf data.

Command: python -m experiments.mp_embedding
  --config=experiments/mp_embedding/configs/synthetic.py
Same as: python -m experiments.mp_embedding --seeds=0,1 --steps=300
Hardware: the 2-core CPU of BENCHMARKS.md, shared (load average ~13), one CPU device
Time: 22.8 min wall (2026-11-24, jax 0.11.2)
Prints: fp32 AUC 0.7485, 158.69 table MB; int8 + 5% LFU dAUC -0.0002, 2.04x less memory,
  hit rate 79.5%; int8 + 5% LRU -0.0003, 2.32x, 73.1%; int4 + 1% LFU +0.0006, 3.84x,
  68.4%; int4 + 1% LRU -0.0003, 5.03x, 58.4% (BENCHMARKS.md "Mixed-precision embeddings
  with an fp32 cache")
"""


def get_config():
  return {
      "data": "synthetic",
      "seeds": ["0", "1"],
      "steps": 300,
      "batch_size": 1024,
      "num_rows": 100000,
      "formats": ["fp32", "int8_cache:lfu:0.05", "int8_cache:lru:0.05",
                  "int4_cache:lfu:0.01", "int4_cache:lru:0.01"],
  }
