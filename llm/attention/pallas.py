"""Registers the Pallas flash-attention kernels (`kernels/flash_attention*.py`) as attention impls.

  "pallas"         `kernels.flash_attention.flash_attention`: Mosaic GPU on Hopper for bf16 /
                   fp16 and head dims that are multiples of 64, the Triton kernel otherwise
                   (fp32, other GPUs); the kernels' Pallas interpreters off a GPU.
  "pallas_mgpu"    the Mosaic GPU kernel, whatever the backend (interpreted off a GPU).
  "pallas_triton"  the Triton kernel, whatever the backend (interpreted off a GPU).

All take the shared signature and return (out, lse), so ring attention can use them as its
inner block. Loaded by `llm.attention.get_attention` on first use of one of these names.
"""

from __future__ import annotations

import functools

from kernels.flash_attention import flash_attention
from llm.attention import register

register("pallas", flash_attention)
register("pallas_mgpu", functools.partial(flash_attention, implementation="mgpu"))
register("pallas_triton", functools.partial(flash_attention, implementation="triton"))
