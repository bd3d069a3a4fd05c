"""EAGLE speculative decoding on SmolLM2-135M-Instruct in bfloat16: a one-layer draft head
over 4096 tokens distilled on 4928 greedy chat replies (two unrolled steps), trees
re-ranked to 5 nodes, decoding over 1024 tokens; greedy rows equal to plain decoding.

Command: python -m experiments.spec_decode
  --config=experiments/spec_decode/configs/smollm2_lossless.py --workdir=runs/spec_exact
Same as: python -m experiments.spec_decode
  --target=gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  --chat_prompts --num_sequences=4928 --eval_sequences=32 --seq_len=160 --gen_batch=32
  --gen_temperature=0 --draft_vocab=4096 --draft_steps=2000 --draft_batch=8
  --warmup_steps=50 --unroll=2 --unroll_decay=0.5 --dtype=bfloat16 --draft_dtype=bfloat16
  --decode_vocab=1024 --trees=3:4:5,2:4:5 --batch_sizes=1,4 --bench_prompts=16
  --max_new_tokens=64 --repeats=3 --temperatures=0,1 --profile
Hardware: the 2-core AMD EPYC CPU (Zen 4), no other job
Time: not recorded in BENCHMARKS.md (2026-11-28, jax 0.11.2; the draft head of an earlier
  run was reused, not retrained)
Prints: greedy (temperature 0) at batch 1: speedup 1.61 for trees 3:4:5 and 2:4:5 (accept
  length 2.38 / 2.33), greedy_match true in every greedy row; batch 4 0.99 / 0.97;
  temperature 1 at batch 1 0.98 / 0.95 (BENCHMARKS.md "Lossless in bfloat16: 1.61x at
  batch 1")
"""

SMOLLM2 = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def get_config():
  return {
      "target": f"gguf:{SMOLLM2}",
      "chat_prompts": True,
      "num_sequences": 4928,
      "eval_sequences": 32,
      "seq_len": 160,
      "gen_batch": 32,
      "gen_temperature": 0.0,
      "draft_vocab": 4096,
      "draft_steps": 2000,
      "draft_batch": 8,
      "warmup_steps": 50,
      "unroll": 2,
      "unroll_decay": 0.5,
      "dtype": "bfloat16",
      "draft_dtype": "bfloat16",
      "decode_vocab": 1024,
      "trees": ["3:4:5", "2:4:5"],
      "batch_sizes": ["1", "4"],
      "bench_prompts": 16,
      "max_new_tokens": 64,
      "repeats": 3,
      "temperatures": ["0", "1"],
      "profile": True,
  }
