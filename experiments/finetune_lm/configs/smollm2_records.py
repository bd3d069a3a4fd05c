"""Fine-tuning SmolLM2-135M-Instruct (the GGUF's Q4_1 weights dequantized to float32) on a
skill it lacks, the fixed-format record task of tasks.py: full fine-tuning and LoRA (rank
16, alpha 32, every projection), 40 steps of 8 rows x 128 tokens each, held-out exact match
on 100 requests whose 10 surnames never occur in the 2000 training examples.

Command: python -m experiments.finetune_lm
  --config=experiments/finetune_lm/configs/smollm2_records.py
Same as: python -m experiments.finetune_lm
  --init=gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
Hardware: Intel Xeon (AVX512-BF16 / AMX), 2 cores, with targeted test runs beside it part of
  the time
Time: 1655 s wall for the whole study; training 667 s (full), 735 s (LoRA) (2026-12-02, jax
  0.11.2)
Prints: held-out exact match base 0.00, full 0.85, LoRA 0.84; final eval loss (assistant
  tokens) full 0.0008, LoRA 0.0014 (BENCHMARKS.md "Fine-tuning SmolLM2-135M-Instruct on a
  skill it lacks")
"""


def get_config():
  return {
      "init": "gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
      "train_examples": 2000,
      "held_out": 100,
      "methods": ["full", "lora"],
      "steps": 40,
      "seq_len": 128,
      "batch_size": 8,
      "learning_rate": 1e-4,
      "lora_learning_rate": 2e-3,
      "lora_rank": 16,
      "reply_tokens": 32,
      "seed": 0,
  }
