"""Hugging Face directories of Llama, Qwen2 / Qwen2.5 and Mistral: config.json and
safetensors, read and written.

`load_hf` reads config.json (`config_from_hf`: every key that changes the arithmetic
understood, or an error naming it) and the tensors of model.safetensors, of a sharded
index's files or of any *.safetensors, one at a time, into the contract dict
(`llm.weights_layout`); `save_hf` writes one, sharded by size, as the architecture
`llm.config.family` names. model_type "llama" (LlamaForCausalLM), "qwen2"
(Qwen2ForCausalLM: q / k / v biases, `use_sliding_window` in the layers `layer_types` or
`max_window_layers` give) and "mistral" (MistralForCausalLM: `sliding_window`) are read, with
RoPE default, llama3 or yarn; any other model_type or rope type is refused naming it. A file
whose size disagrees with its header (a truncated download), a NaN or Inf, an unexpected or
missing tensor and a JSON error are errors naming the file and the tensor or key.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import re

import numpy as np

from core import errors
from llm.config import LlamaConfig, RopeScaling, YarnScaling, family
from llm.weights_layout import (DTYPES, Weights, cast_for_export, check_finite, check_weights,
                                in_out, out_in, param_shapes)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# The architectures read and written, by config.json model_type (`llm.config.FAMILIES`).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
_BIASES = ("bq", "bk", "bv")


def _hf_names(cfg: LlamaConfig) -> dict[str, str]:
  """HF tensor name -> contract name."""
  names = {"model.embed_tokens.weight": "embed"}
  for i in range(cfg.n_layers):
    hf, p = f"model.layers.{i}.", f"layers.{i}."
    names.update({hf + "input_layernorm.weight": p + "attn_norm",
                  hf + "self_attn.q_proj.weight": p + "wq",
                  hf + "self_attn.k_proj.weight": p + "wk",
                  hf + "self_attn.v_proj.weight": p + "wv",
                  hf + "self_attn.o_proj.weight": p + "wo",
                  hf + "post_attention_layernorm.weight": p + "mlp_norm",
                  hf + "mlp.gate_proj.weight": p + "w_gate",
                  hf + "mlp.up_proj.weight": p + "w_up",
                  hf + "mlp.down_proj.weight": p + "w_down"})
    if cfg.qkv_bias:
      names.update({hf + "self_attn.q_proj.bias": p + "bq",
                    hf + "self_attn.k_proj.bias": p + "bk",
                    hf + "self_attn.v_proj.bias": p + "bv"})
  names["model.norm.weight"] = "final_norm"
  if not cfg.tie_embeddings:
    names["lm_head.weight"] = "lm_head"
  return names


def _hf_shape(cfg: LlamaConfig, name: str) -> tuple[int, ...]:
  """The HF [out, in] shape of the tensor that holds contract parameter `name`."""
  shape = param_shapes(cfg)[name]
  if len(shape) == 1 or name == "embed":
    return shape
  if name.rsplit(".", 1)[-1] in _BIASES:
    return (math.prod(shape),)
  if name.endswith(".wo"):
    return (shape[2], shape[0] * shape[1])
  return (math.prod(shape[1:]), shape[0])


def _to_contract(cfg: LlamaConfig, name: str, t: np.ndarray) -> np.ndarray:
  """HF tensor -> contract array (HF q/k are already half-split: no permutation)."""
  short = name.rsplit(".", 1)[-1]
  if short in ("wq", "wk", "wv"):
    heads = cfg.n_heads if short == "wq" else cfg.n_kv_heads
    return in_out(t, heads, cfg.head_dim)
  if short in _BIASES:
    return np.ascontiguousarray(t).reshape(-1, cfg.head_dim)
  if short == "wo":
    return np.ascontiguousarray(t.T).reshape(cfg.n_heads, cfg.head_dim, cfg.dim)
  if short in ("w_gate", "w_up", "w_down", "lm_head"):
    return in_out(t)
  return t


def _from_contract(name: str, w: np.ndarray) -> np.ndarray:
  short = name.rsplit(".", 1)[-1]
  if short == "wo":
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)
  if short in _BIASES:
    return np.ascontiguousarray(w).reshape(-1)
  if short in ("wq", "wk", "wv", "w_gate", "w_up", "w_down", "lm_head"):
    return out_in(w)
  return w


# config.json keys this loader reads (or checks), and keys that never change a causal LM's
# arithmetic: PretrainedConfig's generic fields (names and paths, token ids, dtype, generation
# defaults, labels, output flags) in transformers 4.x and 5.x, Llama's training-only fields,
# and markers other writers leave (nanotron's is_llama_config, transformers.js settings).
# `_`-prefixed keys (transformers' bookkeeping: _name_or_path, _model_name_or_path,
# _commit_hash, _attn_implementation, ...), `*_token_id(s)` and `initializer_*` are harmless
# by pattern. Any other key is refused: it may change the arithmetic (quantization_config,
# sliding_window on a Llama, softcapping, experts, multipliers, ...).
_HF_READ = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rope_interleaved",
    "tie_word_embeddings", "max_position_embeddings", "attention_bias", "mlp_bias",
    "pruned_heads", "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder"})
# What each family reads besides (Qwen2's window settings, Mistral's window).
_FAMILY_READ = {"llama": frozenset(),
                "qwen2": frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                                    "layer_types"}),
                "mistral": frozenset({"sliding_window"})}
_HF_HARMLESS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_bfloat16",
    "torchscript", "use_cache", "attention_dropout", "pretraining_tp",
    "chunk_size_feed_forward", "attn_implementation", "bad_words_ids",
    "begin_suppress_tokens", "suppress_tokens", "forced_decoder_ids", "diversity_penalty",
    "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty", "length_penalty", "max_length", "min_length",
    "max_new_tokens", "min_new_tokens", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores",
    "remove_invalid_values", "repetition_penalty", "return_dict", "return_dict_in_generate",
    "temperature", "top_k", "top_p", "typical_p", "id2label", "label2id", "problem_type",
    "finetuning_task", "prefix", "task_specific_params", "tokenizer_class", "tf_legacy_loss",
    "is_decoder", "cross_attention_hidden_size", "name_or_path", "model_name",
    "keys_to_ignore_at_inference", "is_llama_config", "transformers.js_config"})


def _harmless_key(key: str) -> bool:
  return (key in _HF_HARMLESS or key.startswith("_") or key.startswith("initializer_")
          or key.endswith("_token_id") or key.endswith("_token_ids"))


# Keys each rope type needs, and those it may have besides (transformers' validation).
_ROPE_KEYS = {"default": frozenset(),
              "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings"}),
              "yarn": frozenset({"factor"})}
_ROPE_OPTIONAL = {"yarn": frozenset({"original_max_position_embeddings", "beta_fast",
                                     "beta_slow", "attention_factor", "mscale",
                                     "mscale_all_dim", "truncate"})}


def _rope_from_hf(hf: dict, where: str) -> tuple[float, RopeScaling | YarnScaling | None]:
  """(theta, scaling) from either layout: transformers 4.x's top-level `rope_theta` and
  `rope_scaling`, or transformers 5's `rope_parameters` (theta and type nested)."""
  params = hf.get("rope_parameters")
  legacy = hf.get("rope_scaling")
  if params is not None and legacy is not None and params != legacy:
    raise ValueError(f"{where}: both rope_parameters={params} and rope_scaling={legacy}; "
                     "expected one of them (transformers 5 writes rope_parameters)")
  rope = params if params is not None else legacy
  if rope is None:
    rope, source = {}, "rope_theta"
  else:
    source = "rope_parameters" if params is not None else "rope_scaling"
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
      raise ValueError(f"{where}: {source}={rope!r}; expected one flat dict (per-layer-type "
                       "RoPE is not a Llama setting)")
  theta = rope.get("rope_theta")
  if theta is not None:
    _number(theta, f"{source}.rope_theta", where, above=1)
  if "rope_theta" in hf:
    _number(hf["rope_theta"], "rope_theta", where, above=1)
    if theta is not None and float(theta) != float(hf["rope_theta"]):
      raise ValueError(f"{where}: rope_theta={hf['rope_theta']} disagrees with {source}."
                       f"rope_theta={theta}")
    theta = hf["rope_theta"]
  if theta is None:
    raise ValueError(f"{where}: no rope_theta (top level or in rope_parameters); the RoPE base "
                     "changes every attention score, so it is not defaulted")
  kind = rope.get("rope_type", rope.get("type", "default"))
  if not isinstance(kind, str) or kind not in _ROPE_KEYS:
    raise ValueError(f"{where}: {source} rope type {kind!r}; expected one of "
                     f"{sorted(_ROPE_KEYS)} (others change the RoPE frequencies)")
  for name, value in ((f"{source}.partial_rotary_factor", rope.get("partial_rotary_factor")),
                      ("partial_rotary_factor", hf.get("partial_rotary_factor"))):
    if value is not None and _number(value, name, where) != 1.0:
      raise ValueError(f"{where}: {name}={value}; only full rotary dims (1.0) are supported")
  known = (_ROPE_KEYS[kind] | _ROPE_OPTIONAL.get(kind, frozenset())
           | {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
  unknown = sorted(set(rope) - known)
  if unknown:
    raise ValueError(f"{where}: {source} keys {unknown} are not understood for rope type "
                     f"{kind!r} (expected only {sorted(known)})")
  missing = sorted(_ROPE_KEYS[kind] - set(rope))
  if missing:
    raise ValueError(f"{where}: {source} with rope type {kind!r} lacks {missing}")
  if kind == "default":
    return float(theta), None
  num = lambda key: _number(rope[key], f"{source}.{key}", where)  # noqa: E731
  if kind == "yarn":
    return float(theta), _yarn_from_hf(hf, rope, source, where)
  values = dict(factor=num("factor"), low_freq_factor=num("low_freq_factor"),
                high_freq_factor=num("high_freq_factor"),
                original_max_position=_count(rope["original_max_position_embeddings"],
                                             f"{source}.original_max_position_embeddings",
                                             where))
  try:   # RopeScaling checks its values: named here by the file's keys
    scaling = RopeScaling(**values)
  except errors.UserError:
    raise ValueError(f"{where}: {source}={rope}; expected factor > 0, 0 < low_freq_factor < "
                     "high_freq_factor and original_max_position_embeddings > 0") from None
  return float(theta), scaling


def _yarn_from_hf(hf: dict, rope: dict, source: str, where: str) -> YarnScaling:
  """YaRN's settings as transformers reads them: original_max_position_embeddings defaulting
  to max_position_embeddings, beta_fast / beta_slow to 32 / 1 when absent or 0."""
  def opt(key, default=None):
    v = rope.get(key)
    return default if v is None else _number(v, f"{source}.{key}", where)

  orig = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
  if orig is None:
    raise errors.expected(where, f"{source} of rope type 'yarn' without "
                          "original_max_position_embeddings or max_position_embeddings",
                          "the pretraining context length in one of them")
  truncate = rope.get("truncate", True)
  if not isinstance(truncate, bool):
    raise errors.expected(where, f"{source}.truncate={truncate!r}", "true or false")
  factor = _number(rope["factor"], f"{source}.factor", where)
  if not factor >= 1:
    raise errors.expected(where, f"{source}.factor={factor}", "a YaRN factor >= 1")
  return YarnScaling(factor=factor, original_max_position=_count(
      orig, f"{source}.original_max_position_embeddings", where),
      beta_fast=opt("beta_fast") or 32.0, beta_slow=opt("beta_slow") or 1.0,
      attention_factor=opt("attention_factor"), mscale=opt("mscale"),
      mscale_all_dim=opt("mscale_all_dim"), truncate=truncate)


def _rope_to_hf(rs: RopeScaling | YarnScaling | None) -> dict | None:
  """config.json's rope_scaling of `rs` (4.x layout, which transformers 5 reads too)."""
  if rs is None:
    return None
  if isinstance(rs, YarnScaling):
    out = {"rope_type": "yarn", "factor": rs.factor,
           "original_max_position_embeddings": rs.original_max_position,
           "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow}
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
      if getattr(rs, key) is not None:
        out[key] = getattr(rs, key)
    if not rs.truncate:
      out["truncate"] = False
    return out
  return {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
          "high_freq_factor": rs.high_freq_factor,
          "original_max_position_embeddings": rs.original_max_position}


def _supported() -> str:
  return ", ".join(f"{t!r} ({a})" for t, a in ARCHITECTURES.items())


def config_from_hf(hf: dict, where: str = "config.json") -> LlamaConfig:
  """LlamaConfig from a HF `config.json` dict of a Llama, Qwen2 or Mistral as transformers
  4.x or 5 writes it (runtime fields keep their defaults). A key that would change the
  arithmetic and is not understood (another model_type, a rope type other than default /
  llama3 / yarn, a missing rope_theta, biases other than Qwen2's, another activation, an
  unknown key) is an error, never a silent default."""
  if not isinstance(hf, dict):
    raise errors.expected(where, f"a JSON {_json_kind(hf)}", "a JSON object of a model's "
                          "settings (transformers' config.json)")
  model_type = hf.get("model_type", "llama")
  if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
    arch = hf.get("architectures")
    shown = f" (architectures {arch})" if arch else ""
    raise errors.expected(where, f"model_type={model_type!r}{shown}, an architecture this "
                          "loader does not read", f"one of {_supported()}")

  def need(key):
    if key not in hf:
      raise errors.expected(where, f"missing key {key!r}", f"it in a {model_type!r} "
                            f"config.json ({ARCHITECTURES[model_type]})")
    return hf[key]

  def count(key, default=None):
    if default is None:
      return _count(need(key), key, where)
    v = hf.get(key)
    return default if v is None else _count(v, key, where)

  read = _HF_READ | _FAMILY_READ[model_type]
  unknown = sorted(k for k in hf if k not in read and not _harmless_key(k))
  if unknown:
    raise ValueError(f"{where}: keys {unknown} are not understood by this {model_type} loader "
                     "and may change the model's arithmetic; remove them from the file if they "
                     "do not")
  for key in ("attention_bias", "mlp_bias", "is_encoder_decoder", "add_cross_attention",
              "tie_encoder_decoder", "pruned_heads"):
    if hf.get(key):
      raise ValueError(f"{where}: {key}={hf[key]!r}; the model here has no biases besides "
                       "Qwen2's q / k / v ones, no cross-attention and no pruned heads")
  if hf.get("rope_interleaved"):
    raise ValueError(f"{where}: rope_interleaved={hf['rope_interleaved']!r}; transformers' "
                     "Llama rotates half-split pairs (j, j + K/2), so interleaved RoPE weights "
                     "would be read with the wrong rotation")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act={hf['hidden_act']!r}, expected 'silu'")
  theta, scaling = _rope_from_hf(hf, where)
  dim, n_heads = count("hidden_size"), count("num_attention_heads")
  n_kv_heads = count("num_key_value_heads", n_heads)
  if n_heads % n_kv_heads:
    raise errors.expected(where, f"num_attention_heads={n_heads}, num_key_value_heads="
                          f"{n_kv_heads}", "a number of heads that is a multiple of the key / "
                          "value heads")
  if hf.get("head_dim") is None and dim % n_heads:
    raise errors.expected(where, f"hidden_size={dim}, num_attention_heads={n_heads} and no "
                          "head_dim", "hidden_size a multiple of num_attention_heads")
  head_dim = count("head_dim", dim // n_heads)
  if head_dim % 2:
    raise errors.expected(where, f"head_dim={head_dim}", "an even head size (RoPE rotates "
                          "pairs)")
  tie = hf.get("tie_word_embeddings", False)
  if not isinstance(tie, bool):
    raise errors.expected(where, f"tie_word_embeddings={tie!r}", "true or false")
  eps = _number(need("rms_norm_eps"), "rms_norm_eps", where)
  if not eps > 0:
    raise errors.expected(where, f"rms_norm_eps={eps!r}", "a number > 0")
  n_layers = count("num_hidden_layers")
  window, window_layers = _window_from_hf(hf, model_type, n_layers, where)
  return LlamaConfig(
      vocab_size=count("vocab_size"), dim=dim, n_layers=n_layers,
      n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=count("intermediate_size"),
      head_dim=head_dim, norm_eps=eps, rope_theta=theta, rope_scaling=scaling,
      tie_embeddings=tie, max_seq_len=count("max_position_embeddings", 2048),
      qkv_bias=model_type == "qwen2",
      sliding_window=window, window_layers=window_layers)


# transformers' MistralConfig / Qwen2Config default when config.json has no sliding_window.
_DEFAULT_WINDOW = 4096


def _window_from_hf(hf: dict, model_type: str, n_layers: int, where: str
                    ) -> tuple[int | None, tuple[int, ...] | None]:
  """(sliding window, the layers it applies to: None for every layer). Mistral:
  `sliding_window` in every layer (null: none). Qwen2 as transformers 5 reads it:
  `use_sliding_window` off means none whatever `sliding_window` says; on, the layers
  `layer_types` marks "sliding_attention" (without layer_types: those from
  `max_window_layers` on, default 28) take the window. An absent `sliding_window` is
  transformers' default for both, 4096 (MistralConfig, Qwen2Config), not "none"."""
  if model_type == "llama":
    return None, None
  w = hf.get("sliding_window", _DEFAULT_WINDOW)
  if model_type == "mistral":
    return (None if w is None else _count(w, "sliding_window", where)), None
  use = hf.get("use_sliding_window", False)
  if not isinstance(use, bool):
    raise errors.expected(where, f"use_sliding_window={use!r}", "true or false")
  types = hf.get("layer_types")
  if types is not None:
    kinds = ("full_attention", "sliding_attention")
    if (not isinstance(types, list) or len(types) != n_layers
        or any(t not in kinds for t in types)):
      shown = repr(types) if len(repr(types)) <= 80 else repr(types)[:77] + "..."
      raise errors.expected(where, f"layer_types={shown}", f"a list of {n_layers} entries "
                            "(num_hidden_layers), each 'full_attention' or 'sliding_attention'")
  if not use or w is None:
    return None, None
  w = _count(w, "sliding_window", where)
  if types is not None:
    windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
  else:
    first = hf.get("max_window_layers", 28)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
      raise errors.expected(where, f"max_window_layers={first!r}", "an integer >= 0")
    windowed = list(range(first, n_layers))
  if not windowed:
    return None, None
  return w, (None if len(windowed) == n_layers else tuple(windowed))


def _json_kind(v) -> str:
  return {dict: "object", list: "list", str: "string", bool: "boolean",
          type(None): "null"}.get(type(v), "number")


def _count(v, key: str, where: str) -> int:
  """A config.json size: a JSON integer >= 1 (an error naming `where` and `key` otherwise)."""
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise errors.expected(where, f"{key}={v!r}", "an integer >= 1")
  return v


def _number(v, key: str, where: str, above: float | None = None) -> float:
  """A config.json number (finite; > `above` when given)."""
  f = math.nan
  if isinstance(v, (int, float)) and not isinstance(v, bool):
    try:
      f = float(v)
    except OverflowError:   # an integer beyond float64
      f = math.inf
  if not math.isfinite(f) or (above is not None and not f > above):
    raise errors.expected(where, f"{key}={v!r}", "a number" + (
        "" if above is None else f" > {above:g}"))
  return float(v)


def config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict:
  """A transformers-loadable `config.json` dict for `cfg` as the architecture
  `llm.config.family` names (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM), in
  the 4.x layout (top-level rope_theta / rope_scaling), which transformers 4.x and 5 both
  read. A Qwen2 window is written as layer_types (transformers 5) and max_window_layers, its
  first layer (transformers 4.x windows every layer from it on: the same layers when they
  are the last ones, as Qwen2's own configs have them); only Qwen2 writes a window in some
  layers."""
  kind = family(cfg)
  if cfg.window_layers is not None and kind != "qwen2":
    raise errors.expected("config_to_hf", f"window_layers={cfg.window_layers} on a {kind} "
                          "config (no qkv_bias)", "a window in every layer (Mistral) or a "
                          "Qwen2 config (qkv_bias=True), whose layer_types say it per layer")
  if kind == "llama":
    extra = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
  elif kind == "mistral":
    extra = {"sliding_window": cfg.sliding_window}
  else:
    windowed = [i for i in range(cfg.n_layers) if cfg.layer_window(i) is not None]
    extra = {"use_sliding_window": bool(windowed), "sliding_window": cfg.sliding_window,
             "max_window_layers": windowed[0] if windowed else cfg.n_layers,
             "layer_types": ["sliding_attention" if i in windowed else "full_attention"
                             for i in range(cfg.n_layers)]}
  return {
      "architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_act": "silu",
      **extra, "attention_dropout": 0.0, "use_cache": True, "initializer_range": 0.02,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
      "rope_scaling": _rope_to_hf(cfg.rope_scaling),
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_seq_len, "torch_dtype": dtype,
  }


def check_safetensors_file(path: str) -> None:
  """Raises ValueError naming `path` when it is not a whole safetensors file: the size that
  its header implies (8 + header bytes + the end of the last tensor) must be the file size.
  safetensors' own error for a truncated download names neither the file nor the sizes."""
  size = os.path.getsize(path)
  if size < 8:
    raise ValueError(f"{path}: {size} bytes, too short for safetensors (an 8-byte header "
                     "length comes first); the file is truncated")
  with open(path, "rb") as fh:
    n = int.from_bytes(fh.read(8), "little")
    if 8 + n > size:
      raise ValueError(f"{path}: {size} bytes, but its first 8 bytes give a {n}-byte "
                       "safetensors header; the file is truncated or not safetensors")
    try:
      header = json.loads(fh.read(n))
      ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
      raise ValueError(f"{path}: the {n}-byte safetensors header is not a valid tensor table "
                       f"({type(e).__name__}: {e})") from None
  expected = 8 + n + max(ends, default=0)
  if size != expected:
    what = "truncated" if size < expected else "longer than its header says"
    raise ValueError(f"{path}: {size} bytes, expected {expected} (8 + {n} header bytes + "
                     f"{expected - 8 - n} tensor bytes): the file is {what}")


def _safe_open(path: str):
  """safe_open(path) after `check_safetensors_file`; its errors name the file."""
  from safetensors import safe_open
  check_safetensors_file(path)
  try:
    return safe_open(path, framework="numpy")
  except Exception as e:  # safetensors_rust.SafetensorError does not name the file
    raise ValueError(f"{path}: cannot read as safetensors: {e}") from e


def _hf_files(d: str) -> dict[str, str] | None:
  """HF tensor name -> file from the shard index, or None when there is no index."""
  index = os.path.join(d, _INDEX)
  if not os.path.exists(index):
    return None
  index_json = read_json(index)
  weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
  if not isinstance(weight_map, dict):
    raise ValueError(f"{index}: no 'weight_map' object")
  bad = next(((n, f) for n, f in weight_map.items() if not isinstance(f, str) or not f), None)
  if bad is not None:
    raise errors.expected(index, f"weight_map[{bad[0]!r}]={bad[1]!r}", "a safetensors file name")
  return {n: os.path.join(d, f) for n, f in weight_map.items()}


def read_json(path: str):
  """The JSON value in `path`; a file that is not UTF-8 JSON is an error naming it and the
  line and column."""
  with open(path, "rb") as fh:
    data = fh.read()
  try:
    return json.loads(data.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise errors.expected(path, f"byte {e.start} (0x{data[e.start]:02X}) is not UTF-8",
                          "a UTF-8 JSON file") from None
  except json.JSONDecodeError as e:
    raise errors.expected(f"{path}:{e.lineno}:{e.colno}", f"not JSON ({e.msg})",
                          "a JSON file") from None
  except RecursionError:
    raise errors.expected(path, "JSON nested too deeply", "a JSON file") from None


def hf_config(d: str) -> LlamaConfig:
  """The LlamaConfig of a HF Llama / Qwen2 / Mistral directory, from its config.json alone."""
  cfg_path = os.path.join(d, "config.json")
  if not os.path.exists(cfg_path):
    found = "no config.json" if os.path.isdir(d) else "no such directory"
    raise FileNotFoundError(errno.ENOENT, f"{found}; expected a Hugging Face model directory "
                            "(config.json and safetensors)", d)
  return config_from_hf(read_json(cfg_path), cfg_path)


def load_hf(d: str, dtype: str | None = "float32") -> tuple[LlamaConfig, Weights]:
  """Reads a HF Llama / Qwen2 / Mistral directory (config.json + safetensors) into the
  contract dict.

  `dtype` casts every array ("float32" default: exact for bf16/fp16 files); None keeps the
  stored dtype. Tensors are read one at a time, so peak memory is about the result's size.
  A truncated file, or a NaN or Inf in any tensor, is an error naming the file and tensor.
  """
  cfg_path = os.path.join(d, "config.json")
  cfg = hf_config(d)
  # transformers' order: model.safetensors when there is one (an index beside it is not
  # read), else the shard index, else every *.safetensors.
  single = os.path.join(d, _SINGLE)
  files = None if os.path.exists(single) else _hf_files(d)
  if files is not None:
    source = os.path.join(d, _INDEX)
  else:
    paths = ([single] if os.path.exists(single)
             else sorted(glob.glob(os.path.join(d, "*.safetensors"))))
    if not paths:
      raise FileNotFoundError(errno.ENOENT, f"no {_INDEX}, {_SINGLE} or *.safetensors "
                              "files", d)
    files = {}
    for p in paths:
      with _safe_open(p) as f:
        for n in f.keys():
          if n in files:
            raise ValueError(f"{d}: tensor {n!r} is in both {files[n]} and {p}")
          files[n] = p
    source = d
  # More layers than the files hold is a config.json error, found before the names of
  # num_hidden_layers layers are listed.
  held = {int(m.group(1)) for m in map(re.compile(r"model\.layers\.(\d+)\.").match, files)
          if m}
  if cfg.n_layers > len(held):
    raise errors.expected(cfg_path, f"num_hidden_layers={cfg.n_layers}", f"the {len(held)} "
                          f"layers whose tensors {source} holds")
  want = _hf_names(cfg)
  # Tensors HF ignores: old checkpoints stored the RoPE inverse frequencies, and some tied
  # checkpoints still carry a copy of the embedding as lm_head (checked to be one below).
  ignored = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|lm_head\.weight")
  extra = [n for n in files if n not in want and not ignored.fullmatch(n)]
  if extra:
    raise ValueError(f"{d}: unexpected tensor {extra[0]!r} in {files[extra[0]]} "
                     f"({len(extra)} unexpected) for the config in {cfg_path}")
  missing = [n for n in want if n not in files]
  if missing:
    raise ValueError(f"{d}: missing tensor {missing[0]!r} ({len(missing)} missing) in {source}")

  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"load_hf: dtype={dtype!r}, expected None or one of {sorted(DTYPES)}")
  cast = None if dtype is None else DTYPES[dtype]
  by_file: dict[str, list[str]] = {}
  for n in want:
    by_file.setdefault(files[n], []).append(n)
  weights = {}
  for path, names in by_file.items():
    if not os.path.exists(path):
      raise FileNotFoundError(errno.ENOENT, f"listed in {source} but absent", path)
    with _safe_open(path) as f:
      present = set(f.keys())
      for n in names:
        if n not in present:
          raise ValueError(f"{path}: missing tensor {n!r} (listed in {source})")
        t = f.get_tensor(n)
        short = want[n]
        if tuple(t.shape) != _hf_shape(cfg, short):
          raise ValueError(f"{path}: tensor {n!r} has shape {tuple(t.shape)}, expected "
                           f"{_hf_shape(cfg, short)} from {cfg_path}")
        check_finite(n, t, path)
        if cast is not None and t.dtype != cast:
          # only float16 can overflow (beyond 65504): refused naming the tensor, not Inf
          t = (cast_for_export(n, t, cast, path, wider="load_hf dtype float32 or bfloat16")
               if dtype == "float16" else t.astype(cast))
        weights[short] = _to_contract(cfg, short, t)
  if cfg.tie_embeddings and "lm_head.weight" in files:
    _check_tied_copy(files, cfg_path)
  return cfg, weights


def _check_tied_copy(files: dict[str, str], cfg_path: str) -> None:
  """A tied checkpoint's lm_head.weight must be a copy of the embedding: transformers 4.x
  ties them whatever the tensor holds, transformers 5 reads a differing lm_head.weight as an
  untied output layer (with a warning), so a different tensor has no one meaning."""
  def stored(name):
    with _safe_open(files[name]) as f:
      if name not in set(f.keys()):
        raise ValueError(f"{files[name]}: missing tensor {name!r}")
      return f.get_tensor(name)

  head, embed = stored("lm_head.weight"), stored("model.embed_tokens.weight")
  shown = [f"{tuple(a.shape)} {a.dtype}" for a in (head, embed)]
  if head.dtype != embed.dtype:   # the same values in two formats are still a copy
    head, embed = head.astype(np.float32), embed.astype(np.float32)
  if head.shape != embed.shape or not np.array_equal(head, embed):
    raise errors.expected(files["lm_head.weight"], f"tensor 'lm_head.weight' {shown[0]} "
                          f"differs from 'model.embed_tokens.weight' {shown[1]} while "
                          f"{cfg_path} has tie_word_embeddings=true (transformers 4.x then uses "
                          "the embedding, 5.x lm_head.weight)", "a copy of the embedding, or "
                          "tie_word_embeddings=false to use it as the output layer (or the "
                          "tensor removed to tie)")


def save_hf(d: str, cfg: LlamaConfig, weights: Weights, dtype: str = "float32",
            max_shard_bytes: int | None = None) -> str:
  """Writes `cfg` and `weights` as a HF directory of `family(cfg)`; returns `d`.

  Shards into model-0000i-of-0000n.safetensors plus model.safetensors.index.json when the
  tensors exceed `max_shard_bytes` (greedy, in layer order; a bigger tensor gets a shard of
  its own), else one model.safetensors. Model files an earlier save left in `d` are removed
  so that the index and the files always agree.
  """
  from safetensors.numpy import save_file

  if dtype not in DTYPES:
    raise ValueError(f"save_hf: dtype={dtype!r}, expected one of {sorted(DTYPES)}")
  check_weights(cfg, weights, f"save_hf({d})")
  names = _hf_names(cfg)
  if dtype == "float16":   # a value float16 cannot hold is refused before anything is written
    for hf, c in names.items():
      cast_for_export(hf, _from_contract(c, np.asarray(weights[c])), DTYPES[dtype],
                      f"save_hf({d})")
  os.makedirs(d, exist_ok=True)
  for name in os.listdir(d):
    if name in (_INDEX, _SINGLE) or _SHARD_RE.fullmatch(name):
      os.remove(os.path.join(d, name))
  cast = DTYPES[dtype]
  nbytes = {hf: int(np.prod(np.shape(weights[c]))) * cast.itemsize for hf, c in names.items()}
  # Plan the shards from sizes alone, then convert one shard at a time: peak extra memory is
  # one shard, not the model.
  shards: list[list[str]] = [[]]
  size = 0
  for n in names:
    if max_shard_bytes is not None and shards[-1] and size + nbytes[n] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(n)
    size += nbytes[n]

  def tensors(shard):
    return {n: np.ascontiguousarray(cast_for_export(
        n, _from_contract(names[n], np.asarray(weights[names[n]])), cast, f"save_hf({d})"))
        for n in shard}

  meta = {"format": "pt"}   # transformers refuses safetensors files without it
  if len(shards) == 1:
    save_file(tensors(shards[0]), os.path.join(d, _SINGLE), metadata=meta)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(tensors(shard), os.path.join(d, fname), metadata=meta)
      weight_map.update({n: fname for n in shard})
    with open(os.path.join(d, _INDEX), "w") as fh:
      json.dump({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map},
                fh, indent=2)
  with open(os.path.join(d, "config.json"), "w") as fh:
    json.dump(config_to_hf(cfg, dtype), fh, indent=2)
  # safetensors writes through a private temp file (mode 0600); give the weights the mode
  # any other new file gets (0666 less the umask: 0644 under the usual 022), so the group
  # that shares a model directory can read them.
  mask = os.umask(0)
  os.umask(mask)
  for name in os.listdir(d):
    if name == _SINGLE or _SHARD_RE.fullmatch(name):
      os.chmod(os.path.join(d, name), 0o666 & ~mask)
  return d
