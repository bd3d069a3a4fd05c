"""Llama 3 model sizes (arXiv 2407.21783) and tiny test configs; the options that make the
same decoder Qwen2 / Qwen2.5 or Mistral.

Presets follow the released configs: Llama 3.1 8B / 70B / 405B and Llama 3.2 1B / 3B
(tied embeddings, RoPE scaling factor 32). `head_dim` defaults to dim // n_heads.
Two options cover the second family: `qkv_bias` (Qwen2: biases on the q / k / v
projections, added before RoPE) and `sliding_window` (Mistral, arXiv 2310.06825: a token
sees itself and the W - 1 positions before it, in every layer, or in the layers
`window_layers` lists: Qwen2's `max_window_layers` / `layer_types`). RoPE scaling is Llama
3.1's (`RopeScaling`) or YaRN (`YarnScaling`, arXiv 2309.00071: Qwen2.5's long context).
`family(cfg)` names the
checkpoint architecture a config is written back as (HF `architectures`, GGUF
`general.architecture`).
Attention is two settings: `attention_impl`, the single-device implementation
(`llm.attention`: "auto", "xla", "cudnn", "pallas", ...), and `context_parallel`, whether
and how the sequence is split over the mesh's cp axis (ring attention, arXiv 2411.01783,
whose blocks run attention_impl). Both are validated here, once.
"""

from __future__ import annotations

import dataclasses
import math

from absl import logging

from core import errors
from llm.attention import check_impl

CONTEXT_PARALLEL = ("none", "pass_kv", "pass_q", "auto")
# Implementations that apply a sliding window (as an explicit mask, llm/attention/masked.py);
# the kernels' masks are segment ids and positions only.
WINDOW_IMPLS = ("auto", "xla", "xla_decode")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1 RoPE frequency scaling (HF `rope_type: llama3`)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    # The smooth band divides by high - low; a factor <= 0 gives infinite wavelengths.
    if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
            and self.original_max_position >= 1):
      raise errors.expected("RopeScaling", f"factor={self.factor}, low_freq_factor="
                            f"{self.low_freq_factor}, high_freq_factor={self.high_freq_factor}, "
                            f"original_max_position={self.original_max_position}",
                            "factor > 0, 0 < low_freq_factor < high_freq_factor and "
                            "original_max_position >= 1")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling (arXiv 2309.00071; HF `rope_type: yarn`, transformers'
  `_compute_yarn_parameters`): pair j's frequency blends the base one (rotations over
  original_max_position above beta_fast) with it divided by `factor` (below beta_slow),
  linearly between the two; cos / sin scaled by `attention_factor` (None: 0.1 ln(factor) + 1,
  or the ratio of that with `mscale` and `mscale_all_dim` when both are set). `truncate`
  rounds the blend's ends to whole pairs."""

  factor: float
  original_max_position: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True
  rope_type: str = "yarn"   # tells config_from_dict which scaling a dict holds

  def __post_init__(self):
    if self.rope_type != "yarn":
      raise ValueError(f"YarnScaling: rope_type={self.rope_type!r}, expected 'yarn'")
    if not (self.factor >= 1 and self.original_max_position >= 1 and self.beta_fast > 0
            and self.beta_slow > 0):
      raise errors.expected("YarnScaling", f"factor={self.factor}, original_max_position="
                            f"{self.original_max_position}, beta_fast={self.beta_fast}, "
                            f"beta_slow={self.beta_slow}", "factor >= 1, original_max_position "
                            ">= 1 and betas > 0")

  def cos_sin_scale(self) -> float:
    """The factor on cos and sin (so the attention logits get its square)."""
    if self.attention_factor is not None:
      return float(self.attention_factor)

    def mscale(m=1.0):
      return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

    if self.mscale and self.mscale_all_dim:
      return float(mscale(self.mscale) / mscale(self.mscale_all_dim))
    return mscale()


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes and numerics of a Llama decoder."""

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  ffn_dim: int
  head_dim: int | None = None
  norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  rope_scaling: RopeScaling | YarnScaling | None = None
  tie_embeddings: bool = False
  max_seq_len: int = 8192
  dtype: str = "float32"          # compute dtype: "float32" | "bfloat16"
  param_dtype: str = "float32"    # master weights
  cache_dtype: str | None = None  # KV cache; None: the compute dtype
  attention_impl: str = "auto"    # see llm.attention ("auto": the fastest exact one per call)
  # Ring attention over the cp mesh axis (llm.attention.ring), when the jax.set_mesh mesh
  # has one of more than one rank: "pass_kv" | "pass_q" | "auto" (the paper's rule); "none".
  context_parallel: str = "none"
  remat: bool = False             # rematerialize each block in the backward pass
  remat_policy: str = "full"      # what remat keeps: "full" | "dots" | "attention" (llm.model)
  qkv_bias: bool = False          # biases on the q / k / v projections (Qwen2)
  # Mistral's sliding window: query position p sees keys at positions p - W < kv_pos <= p
  # in every layer (transformers' `kv_idx > q_idx - sliding_window`); None: full causal.
  sliding_window: int | None = None
  # The layers the window applies to (sorted indices; Qwen2's layer_types), None: every
  # layer. A tuple covering every layer is kept as None, so equal models compare equal.
  window_layers: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.head_dim is None:
      if self.dim % self.n_heads:
        raise ValueError(f"LlamaConfig: dim={self.dim} not divisible by n_heads={self.n_heads}")
      object.__setattr__(self, "head_dim", self.dim // self.n_heads)
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"LlamaConfig: n_heads={self.n_heads} not a multiple of "
                       f"n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")
    check_impl(self.attention_impl, "LlamaConfig.attention_impl")
    if self.context_parallel not in CONTEXT_PARALLEL:
      raise ValueError(f"LlamaConfig: context_parallel={self.context_parallel!r}, expected one "
                       f"of {CONTEXT_PARALLEL}")
    if self.remat_policy not in ("full", "dots", "attention"):
      raise ValueError(f"LlamaConfig: remat_policy={self.remat_policy!r}, expected 'full', "
                       "'dots' or 'attention'")
    if self.cache_dtype is not None and self.cache_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"LlamaConfig: cache_dtype={self.cache_dtype!r}, expected None, "
                       "'float32' or 'bfloat16'")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(f"LlamaConfig: {name}={getattr(self, name)!r}, expected 'float32' "
                         "or 'bfloat16'")
    self._check_window_layers()
    w = self.sliding_window
    if w is not None:
      if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise errors.expected("LlamaConfig", f"sliding_window={w!r}", "None or an integer >= 1")
      if self.attention_impl not in WINDOW_IMPLS:
        raise errors.expected("LlamaConfig", f"sliding_window={w} with attention_impl="
                              f"{self.attention_impl!r}, which applies no window",
                              f"attention_impl one of {WINDOW_IMPLS} (the jnp paths mask the "
                              "window) or sliding_window=None")
      if self.context_parallel != "none":
        raise errors.expected("LlamaConfig", f"sliding_window={w} with context_parallel="
                              f"{self.context_parallel!r} (ring attention applies no window)",
                              "context_parallel='none' for a sliding-window model")

  def _check_window_layers(self):
    layers = self.window_layers
    if layers is None:
      return
    if (isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__")
        or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)):
      raise errors.expected("LlamaConfig", f"window_layers={layers!r}", "None or layer indices")
    layers = tuple(layers)
    if self.sliding_window is None:
      raise errors.expected("LlamaConfig", f"window_layers={layers} with sliding_window=None",
                            "a sliding_window for the listed layers, or window_layers=None")
    if not layers or list(layers) != sorted(set(layers)) or not (
        0 <= layers[0] and layers[-1] < self.n_layers):
      raise errors.expected("LlamaConfig", f"window_layers={layers}", "increasing layer "
                            f"indices in [0, {self.n_layers}) (sliding_window=None for none)")
    object.__setattr__(self, "window_layers",
                       None if len(layers) == self.n_layers else layers)

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer` (None: full causal attention)."""
    if self.window_layers is None or layer in self.window_layers:
      return self.sliding_window
    return None

  def replace(self, **kw) -> LlamaConfig:
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Parameter count (embeddings included, output counted once when tied)."""
    d, k = self.dim, self.head_dim
    attn = d * k * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += k * (self.n_heads + 2 * self.n_kv_heads)
    ffn = 3 * d * self.ffn_dim
    per_layer = attn + ffn + 2 * d
    out = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.n_layers * per_layer + d + out

  def flops_per_token(self, seq_len: int, training: bool = True, causal: bool = True) -> float:
    """Model FLOPs per token (6N + attention for training; 2N + attention for inference),
    N the parameters without the input embedding (the output projection counted).

    Attention (QK^T and PV, 4 K FLOPs per query head and key, 3x for training): `causal`
    counts the causal half of the square, seq_len / 2 keys per token, 6 L H K seq_len in
    training (the work a causal kernel does); causal=False the whole square, 12 L H K
    seq_len, PaLM's MFU definition (arXiv 2204.02311, appendix B: 6N + 12 L H Q T), so an MFU
    from the default is lower than one by PaLM's count. A causal layer with a sliding window
    W < seq_len counts the keys its window leaves: min(t + 1, W) for token t, less the
    diagonal's half as above. Embedding lookups are not counted.
    """
    n = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
    keys = 0.0                      # keys per token, summed over the layers
    for layer in range(self.n_layers):
      w = self.layer_window(layer)
      if not causal:
        keys += seq_len
      elif w is None or w >= seq_len:
        keys += seq_len / 2
      else:                         # sum_t min(t + 1, w) / seq_len - 1/2
        keys += (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len - 0.5
    attn = 2 * 2 * self.n_heads * self.head_dim * keys
    mult = 3 if training else 1
    return mult * (2 * n + attn)


def _llama31(**kw) -> LlamaConfig:
  base = dict(vocab_size=128256, rope_theta=500000.0, rope_scaling=RopeScaling(),
              max_seq_len=131072, n_kv_heads=8)
  return LlamaConfig(**{**base, **kw})


PRESETS: dict[str, LlamaConfig] = {
    "llama3_8b": _llama31(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336),
    "llama3_70b": _llama31(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672),
    "llama3_405b": _llama31(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248),
    "llama32_1b": _llama31(dim=2048, n_layers=16, n_heads=32, ffn_dim=8192, tie_embeddings=True,
                           rope_scaling=RopeScaling(factor=32.0)),
    "llama32_3b": _llama31(dim=3072, n_layers=28, n_heads=24, ffn_dim=8192, tie_embeddings=True,
                           rope_scaling=RopeScaling(factor=32.0)),
    # ~100M parameters: the CPU benchmark size.
    "llama_100m": LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                              ffn_dim=2048, rope_theta=10000.0, max_seq_len=2048),
    # Tiny configs for tests and the byte-level example.
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        rope_theta=10000.0, max_seq_len=512),
    "tiny_tied": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, rope_theta=10000.0, max_seq_len=512,
                             tie_embeddings=True, rope_scaling=RopeScaling(
                                 factor=4.0, original_max_position=64)),
    # The second family's options at the tiny size: Qwen2 (q / k / v biases, tied, RoPE base
    # 1e6 as Qwen2.5) and Mistral (a sliding window shorter than a test sequence).
    "tiny_qwen2": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=128, norm_eps=1e-6, rope_theta=1000000.0,
                              max_seq_len=512, tie_embeddings=True, qkv_bias=True),
    "tiny_mistral": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=128, rope_theta=1000000.0, max_seq_len=512,
                                sliding_window=8),
    "byte_small": LlamaConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                              ffn_dim=768, rope_theta=10000.0, max_seq_len=1024),
}


def family(cfg: LlamaConfig) -> str:
  """The checkpoint family `cfg` is written as: "qwen2" (q / k / v biases), "mistral" (a
  sliding window), else "llama". A Mistral without a window is Llama's arithmetic and is
  written as Llama; a Qwen2 with a window in some or every layer stays Qwen2
  (use_sliding_window)."""
  if cfg.qkv_bias:
    return "qwen2"
  return "mistral" if cfg.sliding_window is not None else "llama"


def get_config(name: str, **overrides) -> LlamaConfig:
  if name not in PRESETS:
    raise ValueError(f"Llama preset {name!r}: expected one of {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def config_to_dict(cfg: LlamaConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> LlamaConfig:
  """The config `config_to_dict` wrote. A dict naming context parallelism as
  attention_impl "ring_<variant>" (no context_parallel key; its ring ran "xla" blocks) is
  read as context_parallel=<variant>, attention_impl="xla", with a warning."""
  d = dict(d)
  impl = d.get("attention_impl")
  if (isinstance(impl, str) and impl.startswith("ring_") and "context_parallel" not in d
      and impl[5:] in CONTEXT_PARALLEL):
    logging.warning("model config: attention_impl=%r read as context_parallel=%r, "
                    "attention_impl='xla' (the ring's inner kernel it ran)", impl, impl[5:])
    d["attention_impl"], d["context_parallel"] = "xla", impl[5:]
  rs = d.get("rope_scaling")
  if rs is not None:
    d["rope_scaling"] = (YarnScaling if rs.get("rope_type") == "yarn" else RopeScaling)(**rs)
  return LlamaConfig(**d)
