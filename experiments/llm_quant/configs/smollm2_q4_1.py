"""Weight-only int8 / int4 against float32 and the GGUF's own Q4_1 / Q8_0 blocks on
SmolLM2-135M-Instruct: perplexity on heldout.txt (548 tokens, windows of 512) and greedy
decode tokens/s at batch 1 (32-token prompt, 32 new tokens, 3 rounds x 3 runs, median).

Command: python -m experiments.llm_quant
  --config=experiments/llm_quant/configs/smollm2_q4_1.py --workdir=runs/llm_quant_quiet
Same as: python -m experiments.llm_quant
  --checkpoint=gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  --repeats=3 --rounds=3
Hardware: the 2-core AMD EPYC CPU (Zen 4, AVX-512) with no other job running (load average
  0.87 before, 1.34 after), fp32 compute
Time: 3 minutes (2026-11-27, jax 0.11.2)
Prints: perplexity float32 24.9231, int8 24.9904, int4 25.9192, gguf 24.9231; decode 34.8 /
  34.0 / 37.8 / 37.9 tokens/s (1.00 / 0.98 / 1.09 / 1.09x float32); 538.1 / 143.0 / 84.2 /
  96.6 MB held (BENCHMARKS.md "Weight-only int8 / int4 inference")
"""

SMOLLM2 = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def get_config():
  return {
      "checkpoint": f"gguf:{SMOLLM2}",
      "window": 512,
      "prompt_len": 32,
      "new_tokens": 32,
      "repeats": 3,
      "rounds": 3,
      "dtype": "float32",
  }
