"""Writes the config.json fixtures of tests/llm/test_weights.py with a given transformers release.

Run with a Python that has transformers (no torch needed), e.g.
  python -m venv /tmp/tf5 && /tmp/tf5/bin/pip install "transformers>=5,<6"
  /tmp/tf5/bin/python tests/llm/data/hf_configs/write_configs.py tests/llm/data/hf_configs
Each config is written with LlamaConfig(...).save_pretrained as the release's users would,
to <out>/<name>.transformers-<version>.json. Imports nothing from the project.
"""

import os
import shutil
import sys
import tempfile

import transformers

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# name -> (LlamaConfig sizes, rope_theta, rope scaling or None)
CONFIGS = {
    "llama31_8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=131072, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
                   500000.0, {**LLAMA3_ROPE, "factor": 8.0}),
    "llama32_1b": (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
                   500000.0, {**LLAMA3_ROPE, "factor": 32.0}),
    # Llama 2 7B sizes: plain RoPE (no scaling), theta 10000, rms eps 1e-5.
    "llama2_7b": (dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5),
                  10000.0, None),
}


def make(sizes, theta, scaling):
  if int(transformers.__version__.split(".")[0]) >= 5:
    rope = {"rope_type": "default", "rope_theta": theta} if scaling is None else {
        **scaling, "rope_theta": theta}
    return transformers.LlamaConfig(**sizes, rope_parameters=rope)
  return transformers.LlamaConfig(**sizes, rope_theta=theta, rope_scaling=scaling)


def main(out):
  os.makedirs(out, exist_ok=True)
  for name, (sizes, theta, scaling) in CONFIGS.items():
    with tempfile.TemporaryDirectory() as d:
      make(sizes, theta, scaling).save_pretrained(d)
      path = os.path.join(out, f"{name}.transformers-{transformers.__version__}.json")
      shutil.copyfile(os.path.join(d, "config.json"), path)   # the bytes transformers wrote
    print(path)


if __name__ == "__main__":
  main(sys.argv[1])
