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
