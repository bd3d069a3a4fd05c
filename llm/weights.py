"""Llama weight loaders and exporters: llama2.c legacy `.bin` and Hugging Face safetensors
(Llama, Qwen2 / Qwen2.5 and Mistral directories: `llm.weights_hf`).

Everything meets in one flat dict of numpy arrays (the contract `llm.model` loads):

    embed [V, D]; per layer i: layers.{i}.attn_norm [D], layers.{i}.wq [D, H, K],
    layers.{i}.wk [D, G, K], layers.{i}.wv [D, G, K], layers.{i}.wo [H, K, D],
    layers.{i}.mlp_norm [D], layers.{i}.w_gate [D, F], layers.{i}.w_up [D, F],
    layers.{i}.w_down [F, D]; final_norm [D]; lm_head [D, V] (absent when tied);
    with cfg.qkv_bias (Qwen2) also layers.{i}.bq [H, K], layers.{i}.bk / bv [G, K].

V: vocab, D: model dim, H: query heads, G: key/value heads, K: head dim, F: FFN hidden.

RoPE layout: the model rotates the pairs (j, j + K/2) within each head (the Hugging Face
"half-split" convention). Meta and llama2.c checkpoints rotate (2j, 2j + 1) ("interleaved"),
so their q and k output features are permuted on load (`interleaved_to_half`, which is
`permute` in HF's convert_llama_weights_to_hf.py) and permuted back on export.

    cfg, weights = load_checkpoint("llama2c:/path/stories260K.bin")
    cfg, weights = load_checkpoint("hf:/path/Llama-3.2-1B")
    save_hf("/tmp/out", cfg, weights, dtype="bfloat16", max_shard_bytes=2**30)

Modules: `llm.weights_layout` (the contract, its checks and RoPE permutations),
`llm.weights_llama2c`, `llm.weights_hf`; this one picks a format by its spec and gives every
public name of the three.

Loading checks what it reads: a file whose size disagrees with its header (a truncated
download), a NaN or Inf in any tensor, a config.json that is not a JSON object, a size that is
not an integer >= 1 (or more layers than the tensors hold), and a config.json key that would
change the arithmetic and is not understood are errors naming the file and the tensor or key.
"""

from __future__ import annotations

from llm.config import LlamaConfig
# The private names are the HF <-> contract conversions llm.gguf and the tests use.
from llm.weights_hf import (_from_contract, _hf_names, _hf_shape, _to_contract,
                            check_safetensors_file, config_from_hf, config_to_hf, hf_config,
                            load_hf, read_json, save_hf)
from llm.weights_layout import (Weights, check_finite, check_weights, half_to_interleaved,
                                interleaved_to_half, param_shapes)
from llm.weights_llama2c import llama2c_config, load_llama2c, save_llama2c

__all__ = ["Weights", "check_finite", "check_safetensors_file", "check_weights",
           "config_from_hf", "config_to_hf", "half_to_interleaved", "hf_config",
           "interleaved_to_half", "llama2c_config", "load_checkpoint", "load_hf",
           "load_llama2c", "param_shapes", "read_json", "save_hf", "save_llama2c"]

_FORMS = ("llama2c:PATH (llama2.c legacy .bin)", "hf:DIR (Hugging Face config.json + "
          "safetensors)", "workdir:DIR (a training run; restored by the train loop)")


def load_checkpoint(spec: str) -> tuple[LlamaConfig, Weights]:
  """`llama2c:PATH` or `hf:DIR` -> (config, contract weights)."""
  kind, sep, path = spec.partition(":")
  if sep and path and kind == "llama2c":
    return load_llama2c(path)
  if sep and path and kind == "hf":
    return load_hf(path)
  if kind == "workdir":
    raise ValueError(f"checkpoint {spec!r}: workdir checkpoints are restored by the train "
                     "loop, not by llm.weights.load_checkpoint")
  raise ValueError(f"checkpoint {spec!r}: expected one of {', '.join(_FORMS)}")
