"""llm.cost's training counts against LlamaConfig.flops_per_token (an independent count)."""

import pytest

from llm import cost
from llm.config import get_config


@pytest.mark.parametrize("name, seq", [("tiny", 16), ("llama3_8b", 8192), ("llama3_405b", 4096)])
def test_train_layer_flops_sum_to_the_model_count(name, seq):
  cfg = get_config(name)
  fl = cost.train_layer_flops(cfg, seq)
  head = 6 * cfg.vocab_size * cfg.dim * seq
  ours = cfg.n_layers * (fl["gemm"] + fl["attn"]) + head
  # flops_per_token counts attention as seq / 2 pairs per token, train_layer_flops as the
  # causal seq (seq + 1) / 2 pairs per sequence: they differ by the diagonal.
  # It also counts the RMSNorm gains as 6 FLOPs per weight per token, like matmul weights.
  diag = 3 * 4 * cfg.head_dim * cfg.n_heads * seq / 2 * cfg.n_layers
  norms = 6 * (2 * cfg.dim * cfg.n_layers + cfg.dim) * seq
  assert ours - diag + norms == pytest.approx(cfg.flops_per_token(seq) * seq, rel=1e-12)


@pytest.mark.parametrize("name, n_params, seq", [("llama32_1b", 1.236e9, 8192),
                                                 ("llama3_8b", 8.03e9, 8192),
                                                 ("llama3_70b", 70.55e9, 8192)])
def test_flops_per_token_against_hand_sums(name, n_params, seq):
  """Training FLOPs per token: 6N (N without the input embedding; a tied one is the output
  projection) plus attention, PaLM's 12 L H K T (arXiv 2204.02311 appendix B) with
  causal=False and half of it by default (the causal square, what the kernels compute)."""
  cfg = get_config(name)
  assert cfg.num_params() == pytest.approx(n_params, rel=5e-4)   # the published sizes
  # Hand count: per layer q, o (D x H K), k, v (D x G K), three D x F; norms; the output.
  d, k, layers = cfg.dim, cfg.head_dim, cfg.n_layers
  layer = 2 * d * cfg.n_heads * k + 2 * d * cfg.n_kv_heads * k + 3 * d * cfg.ffn_dim + 2 * d
  n = layers * layer + d + cfg.vocab_size * d
  palm_attn = 12 * layers * cfg.n_heads * k * seq
  assert cfg.flops_per_token(seq, causal=False) == 6 * n + palm_attn
  assert cfg.flops_per_token(seq) == 6 * n + palm_attn / 2
  assert cfg.flops_per_token(seq, training=False, causal=False) == 2 * n + palm_attn / 3


def test_flops_per_token_counts_the_keys_a_sliding_window_leaves():
  """A layer with a window W < T attends min(t + 1, W) keys from token t (the causal count's
  T (T + 1) / 2 pairs when W >= T), not T / 2 per token."""
  seq, w = 64, 8
  full = get_config("tiny_mistral", sliding_window=None)
  pairs = sum(min(t + 1, w) for t in range(seq))            # per layer and head
  attn_full = 3 * 4 * full.n_heads * full.head_dim * (seq * (seq + 1) / 2 - seq / 2) / seq
  attn_win = 3 * 4 * full.n_heads * full.head_dim * (pairs - seq / 2) / seq
  base = full.flops_per_token(seq) - full.n_layers * attn_full
  windowed = get_config("tiny_mistral", sliding_window=w)
  assert windowed.flops_per_token(seq) == pytest.approx(base + 2 * attn_win, rel=1e-12)
  one_layer = windowed.replace(window_layers=(1,))
  assert one_layer.flops_per_token(seq) == pytest.approx(base + attn_full + attn_win, rel=1e-12)
  assert get_config("tiny_mistral", sliding_window=seq).flops_per_token(seq) == \
      full.flops_per_token(seq)
  assert windowed.flops_per_token(seq, causal=False) == full.flops_per_token(seq, causal=False)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(24, 8), (32, 8), (128, 8), (12, 4)])
def test_tp_heads_are_the_kv_heads_a_gpus_query_heads_read(n_heads, n_kv_heads):
  """Query head q reads KV head q // (H / G); a GPU of a tp group holds H / tp consecutive
  query heads and every KV head they read (counted here head by head), the busiest GPU's
  count: G / tp when tp divides G, 1 past G GPUs, and whole heads when neither divides the
  other (llama32_3b's H = 24, G = 8 on tp = 6: 2 KV heads, not 8 / 6)."""
  cfg = get_config("tiny").replace(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8)
  for tp in [t for t in range(1, n_heads + 1) if n_heads % t == 0]:
    h = n_heads // tp
    read = max(len({q // (n_heads // n_kv_heads) for q in range(r * h, (r + 1) * h)})
               for r in range(tp))
    assert cost.tp_heads(cfg, tp) == (h, read), tp
  assert cost.tp_heads(get_config("llama32_3b"), 6) == (4, 2)
