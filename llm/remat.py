"""Rematerialization policies of the Llama blocks (`LlamaConfig.remat_policy`, used when
`LlamaConfig.remat`): what a block keeps from its forward pass for the backward pass."""

from __future__ import annotations

import jax

# Residuals the attention kernels name (llm/attention/cudnn.py, and the Pallas kernels'
# custom_vjp forward rules): saving them keeps a rematerialized block from running the
# attention forward again in its backward pass.
ATTENTION_RESIDUALS = ("attention_out", "attention_stats")


def remat_policy(name: str):
  """jax.checkpoint policy of LlamaConfig.remat_policy (used when cfg.remat):
    "full"       save nothing: every block is recomputed in the backward (least memory);
    "dots"       save matmul outputs without batch dims (q/k/v/o projections, the MLP) and
                 the attention kernel's outputs; recompute the cheap elementwise parts
                 (RMSNorm, RoPE, SwiGLU's gate), as MaxText's default policies do;
    "attention"  save only the attention kernel's outputs; recompute the matmuls.
  """
  cp = jax.checkpoint_policies
  names = cp.save_only_these_names(*ATTENTION_RESIDUALS)
  if name == "full":
    return None
  if name == "dots":
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, names)
  if name == "attention":
    return names
  raise ValueError(f"remat_policy={name!r}: expected one of {REMAT_POLICIES}")


REMAT_POLICIES = ("full", "dots", "attention")
