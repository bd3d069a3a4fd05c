"""Attention implementations behind one signature, chosen by a config string.

    out, lse = attention(q_BTHK, k_BSGK, v_BSGK, impl="xla", causal=True,
                         q_segment_ids=None, kv_segment_ids=None,
                         q_positions=None, kv_positions=None, scale=None, mask=None)

`impl` names: "xla" (the jnp reference, `reference.attention_reference`), "xla_decode" (the
same rule reading a KV cache in place, `decode.py`), "cudnn" (cuDNN flash attention,
`cudnn.py`), "pallas" (the Pallas kernels), "ring_pass_kv" / "ring_pass_q" /
"ring_auto" (context parallelism, `ring.py`), and "auto": per call, the fastest
implementation that is exact for it (`choose_impl`). Modules register more with `register`.
Models and ring attention call `attention(..., impl=cfg.attention_impl)` and never branch on
the name. `mask` ([B,T,S] bool, for tree attention) narrows the rule further; it is applied
by `masked.per_query_masked` through the implementations' own segment-id rule, for the
implementations in `masked.MASK_IMPLS` (others raise). Implementations never see `mask`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from llm.attention.reference import attention_reference, merge_partials

AttentionFn = Callable[..., tuple]

_REGISTRY: dict[str, AttentionFn] = {"xla": attention_reference}
# Modules that register an implementation on import; loaded on first use so that importing
# the model does not pull in Pallas or shard_map code it does not need.
_LAZY = {"pallas": "llm.attention.pallas", "pallas_mgpu": "llm.attention.pallas",
         "pallas_triton": "llm.attention.pallas", "ring_pass_kv": "llm.attention.ring",
         "ring_pass_q": "llm.attention.ring", "ring_auto": "llm.attention.ring",
         "cudnn": "llm.attention.cudnn", "xla_decode": "llm.attention.decode"}
# Calls of up to this many queries against a longer key axis are decode steps for "auto":
# memory-bound, one pass over the KV cache ("xla_decode", llm/attention/decode.py).
DECODE_MAX_T = 16


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


def attention(q_BTHK, k_BSGK, v_BSGK, *, impl: str = "xla", mask=None, **kwargs):
  fn = get_attention(impl)
  if mask is None:
    return fn(q_BTHK, k_BSGK, v_BSGK, **kwargs)
  from llm.attention import masked
  masked.check_mask_impl(impl)
  return masked.per_query_masked(fn, q_BTHK, k_BSGK, v_BSGK, mask, **kwargs)


@functools.lru_cache(maxsize=None)
def cudnn_available(compute_capability: str | None = None) -> bool:
  """cuDNN flash attention can run: jax found cuDNN and the GPU is Ampere (8.0) or newer.
  compute_capability: the GPU's; None reads the default device's (False off a CUDA GPU)."""
  if compute_capability is None:
    if jax.default_backend() != "gpu":
      return False
    compute_capability = getattr(jax.devices()[0], "compute_capability", None)
    if compute_capability is None:
      return False
    try:
      from jax._src.cudnn import fused_attention_stablehlo as fa
      fa.check_cudnn_version()
    except (ImportError, RuntimeError):
      return False
  return tuple(int(x) for x in str(compute_capability).split(".")) >= (8, 0)


def choose_impl(q_BTHK, k_BSGK, *, causal: bool = True, q_segment_ids=None,
                kv_segment_ids=None, q_positions=None, kv_positions=None,
                backend: str | None = None, cudnn: bool | None = None) -> str:
  """The implementation "auto" runs for this call, from its structure (shapes, dtype, which
  optional arguments are given), never from values:

    decode (T <= DECODE_MAX_T, T < S) "xla_decode" (one read of the cache, any backend)
    not a GPU                        "xla"
    no segment ids, no positions,    "cudnn"  (cuDNN's causal / no mask is then exactly the
      bf16 / fp16, cuDNN usable                shared rule: nothing data-dependent)
    otherwise                        "pallas" (any segment ids and positions, fp32 too)

  backend / cudnn: override jax.default_backend() and `cudnn_available()` (tests, AOT).
  The model passes no positions when they are the default arange, so its training and
  prefill calls without a cache take cuDNN.
  """
  del causal, kv_segment_ids
  backend = jax.default_backend() if backend is None else backend
  t, s = q_BTHK.shape[1], k_BSGK.shape[1]
  if t <= DECODE_MAX_T and t < s:
    return "xla_decode"
  if backend != "gpu":
    return "xla"
  from llm.attention.cudnn import supports
  usable = cudnn_available() if cudnn is None else cudnn
  if (usable and q_segment_ids is None and q_positions is None and kv_positions is None
      and supports(q_BTHK.dtype, q_BTHK.shape[-1]) is None and k_BSGK.dtype == q_BTHK.dtype):
    return "cudnn"
  return "pallas"


def auto_attention(q_BTHK, k_BSGK, v_BSGK, **kwargs):
  """Registry entry "auto": `choose_impl`'s pick, called with the same arguments."""
  impl = choose_impl(q_BTHK, k_BSGK, **{n: kwargs.get(n) for n in (
      "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")})
  return get_attention(impl)(q_BTHK, k_BSGK, v_BSGK, **kwargs)


_REGISTRY["auto"] = auto_attention

__all__ = ["DECODE_MAX_T", "attention", "attention_reference", "auto_attention", "choose_impl",
           "cudnn_available", "get_attention", "merge_partials", "register"]
