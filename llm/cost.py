"""FLOP and byte counts of the Llama 3 decoder (arXiv 2407.21783) for analytic time models:
per layer, per prefill, and per message of context-parallel ring attention (arXiv 2411.01783).

Counts take any object with the Llama sizes (`LlamaConfig`, or `llm.packing.cost.Shape` for
the per-layer ones): dim D, ffn_dim F, n_heads H, n_kv_heads G, head_dim K (and n_layers for
whole-model counts; training counts are 3x the forward: the backward computes gradients of
inputs and of weights). A matmul of m x k by k x n is 2 m k n FLOPs; causal attention over T new
tokens after P cached ones computes T P + T (T + 1) / 2 (query, key) pairs, each 4 K FLOPs per
query head (QK^T and PV). Under tensor parallelism over `tp` GPUs every GPU holds H / tp query
heads and max(G / tp, 1) KV heads (past G GPUs the KV heads are replicated, arXiv 2411.01783
§4.2.2; `tp_heads` where neither of G and tp divides the other); under context parallelism
over N ranks each holds T / N new tokens and (T + P) / N KV entries (load-balanced sharding,
padding ignored).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Numerics:
  """Bytes per element of weights, activations and the KV cache (defaults: arXiv 2411.01783
  §4.1, row-wise FP8 FFN weights and BF16 everything else)."""

  ffn_weight_bytes: int = 1         # row-wise FP8 FFN weights (and FP8 activations into them)
  attn_weight_bytes: int = 2        # BF16 Q/K/V/O projections
  act_bytes: int = 2                # BF16 activations
  kv_bytes: int = 2                 # BF16 KV cache and ring messages


def tp_heads(cfg, tp: int) -> tuple[float, float]:
  """(query heads, KV heads) on each GPU of a `tp`-way tensor-parallel group: H / tp query
  heads, and the KV heads they read (G / tp when tp divides G, 1 when G divides tp; when
  neither divides the other a GPU's query heads straddle groups, and the busiest GPU's
  count is taken: H = 24, G = 8, tp = 6 reads 2 KV heads per GPU, not 8 / 6)."""
  if tp < 1 or cfg.n_heads % tp:
    raise ValueError(f"llm.cost: tp={tp}; expected a divisor of n_heads={cfg.n_heads}")
  h, group = cfg.n_heads // tp, cfg.n_heads // cfg.n_kv_heads
  g = max((r * h + h - 1) // group - r * h // group + 1 for r in range(tp))
  return cfg.n_heads / tp, float(g)


def layer_linear_params(cfg) -> dict[str, int]:
  """Weights of one decoder layer's projections: {"attn": Q,K,V,O, "ffn": w1,w2,w3}."""
  d, k = cfg.dim, cfg.head_dim
  return {"attn": d * k * (2 * cfg.n_heads + 2 * cfg.n_kv_heads), "ffn": 3 * d * cfg.ffn_dim}


def linear_flops_per_token(cfg) -> int:
  """Forward matmul FLOPs per token of one layer: Q, K, V, O projections and SwiGLU."""
  return 2 * sum(layer_linear_params(cfg).values())


def attention_pairs(new_tokens: int, cached_tokens: int) -> float:
  """(query, key) pairs a causal prefill of T new tokens over P cached ones computes."""
  return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


def prefill_flops(cfg, new_tokens: int, cached_tokens: int = 0) -> dict[str, float]:
  """Total model FLOPs of one prefill, all layers: {"gemm", "attn"} (LM head excluded)."""
  gemm = linear_flops_per_token(cfg) * new_tokens * cfg.n_layers
  attn = 4 * cfg.head_dim * cfg.n_heads * attention_pairs(new_tokens, cached_tokens) * cfg.n_layers
  return {"gemm": float(gemm), "attn": float(attn)}


def train_layer_flops(cfg, seq_len: int) -> dict[str, float]:
  """FLOPs of one decoder layer's forward and backward (3x forward) on one causal sequence of
  `seq_len` tokens: {"gemm": projections and SwiGLU, "attn": QK^T and PV}."""
  return {"gemm": 3.0 * linear_flops_per_token(cfg) * seq_len,
          "attn": 3.0 * 4 * cfg.head_dim * cfg.n_heads * attention_pairs(seq_len, 0)}


def ring_message_bytes(cfg, new_tokens: int, cached_tokens: int, *, cp: int, tp: int = 8,
                       num: Numerics = Numerics()) -> dict[str, float]:
  """Bytes one GPU sends per layer: per ring step ("kv": its K and V block under pass-KV,
  "q": its query block under pass-Q) and in pass-Q's All2All of partial outputs and
  log-sum-exps back to their owners ("all2all")."""
  h_tp, g_tp = tp_heads(cfg, tp)
  t, kv, k = new_tokens / cp, (new_tokens + cached_tokens) / cp, cfg.head_dim
  return {"kv": 2 * kv * g_tp * k * num.kv_bytes, "q": t * h_tp * k * num.act_bytes,
          "all2all": (cp - 1) * t * h_tp * (k * num.act_bytes + 4)}


__all__ = ["Numerics", "attention_pairs", "layer_linear_params", "linear_flops_per_token",
           "prefill_flops", "ring_message_bytes", "tp_heads", "train_layer_flops"]
