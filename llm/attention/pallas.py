"""The Pallas flash-attention kernels behind the shared attention signature.

  "pallas"         `pallas_attention`: the kernel `choose.choose_kernel` picks for the call
                   (Mosaic GPU on Hopper for bf16 / fp16 and head dims 64 / 128, Triton
                   otherwise); the kernels' Pallas interpreters off a GPU.
  "pallas_mgpu"    `kernels.flash_attention_mgpu` whatever the backend (interpreted off a GPU).
  "pallas_triton"  `kernels.flash_attention_triton` whatever the backend (interpreted off a GPU).

All take the shared signature and return (out, lse), so ring attention can use them as its
inner block. The registry (`llm.attention`) loads this module on first use of these names.
"""

from __future__ import annotations

from kernels.flash_attention_mgpu import flash_attention_mgpu
from kernels.flash_attention_triton import flash_attention_triton
from llm.attention.choose import choose_kernel

KERNELS = {"pallas_mgpu": flash_attention_mgpu, "pallas_triton": flash_attention_triton}


def pallas_attention(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, scale=None, interpret=None,
                     **kwargs):
  """Flash attention by the Pallas kernel that applies to this call; returns (out, lse).

  interpret: None runs the kernel's Pallas interpreter unless the backend is a GPU. kwargs:
  segment ids, positions and the chosen kernel's tuning (block sizes; see its docstring).
  """
  kernel = choose_kernel(q_BTHK.dtype, q_BTHK.shape[-1], scale, causal)
  return KERNELS[kernel](q_BTHK, k_BSGK, v_BSGK, causal=causal, scale=scale,
                         interpret=interpret, **kwargs)


__all__ = ["KERNELS", "pallas_attention"]
