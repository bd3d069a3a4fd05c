"""Attention implementations behind one signature, chosen by a config string.

    out, lse = attention(q_BTHK, k_BSGK, v_BSGK, impl="xla", causal=True,
                         q_segment_ids=None, kv_segment_ids=None,
                         q_positions=None, kv_positions=None, scale=None)

`impl` names: "xla" (the jnp reference, `reference.attention_reference`); later modules
register more ("pallas", "ring_pass_kv", "ring_pass_q", ...) with `register`. Models and
ring attention call `attention(..., impl=cfg.attention_impl)` and never branch on the name.
"""

from __future__ import annotations

from typing import Callable

from llm.attention.reference import attention_reference, merge_partials

AttentionFn = Callable[..., tuple]

_REGISTRY: dict[str, AttentionFn] = {"xla": attention_reference}
# Modules that register an implementation on import; loaded on first use so that importing
# the model does not pull in Pallas or shard_map code it does not need.
_LAZY = {"pallas": "llm.attention.pallas", "pallas_mgpu": "llm.attention.pallas",
         "pallas_triton": "llm.attention.pallas", "ring_pass_kv": "llm.attention.ring",
         "ring_pass_q": "llm.attention.ring", "ring_auto": "llm.attention.ring"}


def register(name: str, fn: AttentionFn) -> None:
  _REGISTRY[name] = fn


def get_attention(name: str) -> AttentionFn:
  if name not in _REGISTRY and name in _LAZY:
    import importlib
    importlib.import_module(_LAZY[name])
  if name not in _REGISTRY:
    raise ValueError(f"attention_impl={name!r}: expected one of "
                     f"{sorted(set(_REGISTRY) | set(_LAZY))}")
  return _REGISTRY[name]


def attention(q_BTHK, k_BSGK, v_BSGK, *, impl: str = "xla", **kwargs):
  return get_attention(impl)(q_BTHK, k_BSGK, v_BSGK, **kwargs)


__all__ = ["attention", "attention_reference", "get_attention", "merge_partials", "register"]
