"""Attention implementations behind one signature, chosen by a config string.

    out, lse = attention(q_BTHK, k_BSGK, v_BSGK, impl="xla", causal=True,
                         q_segment_ids=None, kv_segment_ids=None,
                         q_positions=None, kv_positions=None, scale=None, mask=None)

`impl` names: "xla" (the jnp reference, `reference.attention_reference`), "xla_decode" (the
same rule reading a KV cache in place, `decode.py`), "cudnn" (cuDNN flash attention,
`cudnn.py`), "pallas" (the Pallas kernel `choose.choose_kernel` picks, `pallas.py`),
"pallas_mgpu" / "pallas_triton" (one kernel), "pallas_decode" (the split-key decode kernel,
`kernels/decode_attention.py`), and "auto": per call, the fastest
implementation that is exact for it (`choose.choose_impl`; one device probe for both
choices). `register` adds more. Models call `attention(..., impl=cfg.attention_impl)` and
never branch on the name; context parallelism is not an implementation but a setting of the
model (`LlamaConfig.context_parallel`), whose ring (`ring.ring_attention`) runs an
implementation from here on each block. `mask` ([B,T,S] bool, for tree attention) narrows
the rule further; `masked.per_query_masked` applies it through the implementations' own
segment-id rule, for those in `masked.MASK_IMPLS` (others raise); calls longer than a decode
step under "xla" / "auto" take the reference with the mask (`masked.dense_masked`). The
other implementations never see `mask`, and none imports this registry: it imports them, on
first use of their name, so that importing the model pulls in no Pallas or cuDNN code it
does not run.
"""

from __future__ import annotations

import importlib
from typing import Callable

from llm.attention.choose import DECODE_MAX_T, DeviceInfo, choose_impl, choose_kernel
from llm.attention.reference import attention_reference, merge_partials

AttentionFn = Callable[..., tuple]

_REGISTRY: dict[str, AttentionFn] = {"xla": attention_reference}
# Implementations loaded on first use: name -> (module, function).
_LAZY = {"xla_decode": ("llm.attention.decode", "decode_attention"),
         "cudnn": ("llm.attention.cudnn", "cudnn_attention"),
         "pallas": ("llm.attention.pallas", "pallas_attention"),
         "pallas_mgpu": ("kernels.flash_attention_mgpu", "flash_attention_mgpu"),
         "pallas_triton": ("kernels.flash_attention_triton", "flash_attention_triton"),
         "pallas_decode": ("kernels.decode_attention", "decode_attention")}
# Ring attention is context parallelism, a model setting of its own.
CONTEXT_PARALLEL = ("pass_kv", "pass_q", "auto")


def register(name: str, fn: AttentionFn) -> None:
  _REGISTRY[name] = fn


def names() -> list[str]:
  """Every implementation name `attention` takes now ("auto" and the registered ones)."""
  return sorted(set(_REGISTRY) | set(_LAZY))


def check_impl(name: str, where: str = "attention_impl") -> str:
  """`name` if it names an implementation, else a ValueError naming `where` and the choices
  (a ring_* name says which setting context parallelism is)."""
  if name in _REGISTRY or name in _LAZY:
    return name
  if isinstance(name, str) and name.startswith("ring_") and name[5:] in CONTEXT_PARALLEL:
    raise ValueError(
        f"{where}={name!r}: context parallelism is its own setting, "
        f"context_parallel={name[5:]!r} (LlamaConfig.context_parallel, --context_parallel), "
        f"and the ring's inner kernel is attention_impl (one of {names()}); or call "
        f"llm.attention.ring.ring_attention(..., variant={name[5:]!r}, inner_impl=...)")
  raise ValueError(f"{where}={name!r}: expected one of {names()}")


def get_attention(name: str) -> AttentionFn:
  if name not in _REGISTRY:
    check_impl(name)
    module, attr = _LAZY[name]
    _REGISTRY[name] = getattr(importlib.import_module(module), attr)
  return _REGISTRY[name]


def attention(q_BTHK, k_BSGK, v_BSGK, *, impl: str = "xla", mask=None, **kwargs):
  fn = get_attention(impl)
  if mask is None:
    return fn(q_BTHK, k_BSGK, v_BSGK, **kwargs)
  from llm.attention import masked
  return masked.masked_attention(impl, fn, q_BTHK, k_BSGK, v_BSGK, mask, **kwargs)


def auto_attention(q_BTHK, k_BSGK, v_BSGK, **kwargs):
  """Registry entry "auto": `choose_impl`'s pick, called with the same arguments."""
  impl = choose_impl(q_BTHK, k_BSGK, **{n: kwargs.get(n) for n in (
      "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "scale")},
      causal=kwargs.get("causal", True))
  return get_attention(impl)(q_BTHK, k_BSGK, v_BSGK, **kwargs)


_REGISTRY["auto"] = auto_attention

__all__ = ["CONTEXT_PARALLEL", "DECODE_MAX_T", "DeviceInfo", "attention", "attention_reference",
           "auto_attention", "check_impl", "choose_impl", "choose_kernel", "get_attention",
           "merge_partials", "names", "register"]
