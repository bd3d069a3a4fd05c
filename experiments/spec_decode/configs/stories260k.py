"""EAGLE speculative decoding (arXiv 2508.08192, tree attention of EAGLE-2, arXiv
2406.16858) on stories260K: a one-layer draft head distilled for 600 steps, then
speculative against plain decoding per tree shape at batch 1 and 8.

Command: python -m experiments.spec_decode
  --config=experiments/spec_decode/configs/stories260k.py --overwrite
Same as: python -m experiments.spec_decode --draft_steps=600
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average ~14)
Time: 20.5 min wall (2026-11-24, jax 0.11.2): ~16.5 min distilling, ~3.5 min measuring;
  generating the 1024 target sequences takes ~4 min more when they are not in the workdir
Prints: draft eval top1 0.217; greedy output equal to plain decoding in every row; accept
  length at batch 1 for trees 1:4:4 / 2:4:8 / 4:5:24 / 8:6:48: 1.49 / 1.59 / 1.81 / 2.19,
  speedup 0.29 / 0.32 / 0.13 / 0.07 (slower on this CPU) (BENCHMARKS.md "EAGLE speculative
  decoding on stories260K")
"""


def get_config():
  return {
      "target": "llama2c:../shared/data/llama2c/stories260K.bin",
      "draft_steps": 600,
      "num_sequences": 1024,
      "seq_len": 128,
      "trees": ["chain:4", "2:4:8", "4:5:24", "8:6:48"],
      "batch_sizes": ["1", "8"],
      "max_new_tokens": 128,
      "prompt_len": 16,
  }
