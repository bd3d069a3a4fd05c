"""Flash attention (arXiv 2205.14135, 2307.08691, 2407.08608): reference, masking rule, dispatch.

    out_BTHK, lse_BTH = flash_attention(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                        q_segment_ids=None, kv_segment_ids=None,
                                        q_positions=None, kv_positions=None, scale=None)

One signature for every attention implementation in this repository: q [B,T,H,K] and k, v
[B,S,G,K] with H a multiple of G (grouped-query attention; K/V are never repeated), optional
segment ids and positions; returns out [B,T,H,K] (q's dtype) and lse [B,T,H] (fp32, natural
log). Masking rule: query t may attend key s iff

    q_segment_ids[b,t] == kv_segment_ids[b,s]     (when segment ids are given)
    and kv_positions[b,s] <= q_positions[b,t]     (when causal)

with positions defaulting to arange(T) and arange(S); positions only matter when causal. A
query with no allowed key gets out 0 and lse -inf, so partial results over disjoint key sets
merge exactly by their lse (ring attention). Gradients flow to q, k, v from out and lse.

This file holds the pure-jnp `flash_attention_reference` (the semantics), the shape check
and mask helpers every implementation shares, and `flash_attention`, which picks a kernel:

  * "mgpu" (`kernels/flash_attention_mgpu.py`): Pallas on Mosaic GPU, FlashAttention-3
    style (TMA, wgmma, warp-specialized pipelining); Hopper (sm_90) only, bf16 / fp16,
    head dims that are multiples of 64 up to 256.
  * "triton" (`kernels/flash_attention_triton.py`): Pallas on the Triton lowering,
    FlashAttention-2 style; any CUDA GPU, fp32 / bf16 / fp16, any head dim.

`implementation=None` takes "mgpu" where it applies (a GPU of compute capability 9.0, bf16 or
fp16, a supported head dim, a positive scale) and "triton" otherwise; off a GPU both run in
their Pallas interpreters (the Triton kernel's HLO interpreter by default, being the faster).
The kernel modules are imported on first call, so importing this file loads no Pallas code.

Letters: B batch, T query length, S key length, H query heads, G key/value heads
(H = G * R), K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
IMPLEMENTATIONS = ("mgpu", "triton")


def default_positions(batch: int, length: int, offset: int = 0) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) + offset, (batch, length))


def check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_positions=None) -> tuple[int, int, int, int, int, int]:
  """Validates the shared signature; returns (B, T, S, H, G, K)."""
  if q_BTHK.ndim != 4 or k_BSGK.ndim != 4 or v_BSGK.shape != k_BSGK.shape:
    raise ValueError(f"attention: q {q_BTHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}; "
                     "expected q [B,T,H,K] and k, v [B,S,G,K] of equal shape")
  b, t, h, kd = q_BTHK.shape
  bk, s, g, kk = k_BSGK.shape
  if bk != b or kk != kd or h % g:
    raise ValueError(f"attention: q {q_BTHK.shape} vs k {k_BSGK.shape}; expected the same batch "
                     "and head dim, and query heads a multiple of key/value heads")
  for name, arr, n in (("q_segment_ids", q_segment_ids, t), ("kv_segment_ids", kv_segment_ids, s),
                       ("q_positions", q_positions, t), ("kv_positions", kv_positions, s)):
    if arr is not None and arr.shape != (b, n):
      raise ValueError(f"attention: {name} shape {arr.shape}, expected {(b, n)}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention: give both q_segment_ids and kv_segment_ids, or neither")
  return b, t, s, h, g, kd


def attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal: bool,
                   b: int, t: int, s: int):
  """Boolean [B,T,S] mask of allowed (query, key) pairs, or None when all are allowed."""
  mask = None
  if q_segment_ids is not None:
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  if causal:
    qp = q_positions if q_positions is not None else default_positions(b, t)
    kp = kv_positions if kv_positions is not None else default_positions(b, s)
    c = kp[:, None, :] <= qp[:, :, None]
    mask = c if mask is None else mask & c
  return mask


def flash_attention_reference(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True,
                              q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                              kv_positions=None, scale: float | None = None):
  """Softmax(q k^T * scale, masked) v in jnp with an fp32 softmax; p is cast to v's dtype
  before p @ v, as the kernels do. Returns (out like q, lse [B,T,H] fp32)."""
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  scale = kd ** -0.5 if scale is None else scale
  q_BTGRK = q_BTHK.reshape(b, t, g, h // g, kd)
  logits_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK,
                            preferred_element_type=jnp.float32) * scale
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, b, t, s)
  if mask is not None:
    logits_BGRTS = jnp.where(mask[:, None, None], logits_BGRTS, NEG_INF)
  m = jnp.max(logits_BGRTS, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits_BGRTS - m_safe)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  lse_BGRT = jnp.where(denom[..., 0] > 0, m_safe[..., 0] + jnp.log(denom[..., 0]), NEG_INF)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out_BTGRK = jnp.einsum("bgrts,bsgk->btgrk", p.astype(v_BSGK.dtype), v_BSGK,
                         preferred_element_type=jnp.float32)
  out = out_BTGRK.reshape(b, t, h, kd).astype(q_BTHK.dtype)
  lse = lse_BGRT.transpose(0, 3, 1, 2).reshape(b, t, h)
  return out, lse


def _gpu_compute_capability() -> str | None:
  """"9.0" for an H100 / H200 as the default device, None off a CUDA GPU."""
  if jax.default_backend() != "gpu":
    return None
  return getattr(jax.devices()[0], "compute_capability", None)


def _cuda_runtime_version() -> int | None:
  try:
    from jax._src.lib import cuda_versions
    return cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else None
  except Exception:  # noqa: BLE001 - no CUDA plugin, or an API change: no constraint known
    return None


def choose_implementation(dtype, head_dim: int, scale: float | None = None,
                          compute_capability: str | None = None, causal: bool = True) -> str:
  """The kernel `flash_attention` runs for these inputs: "mgpu" or "triton".

  compute_capability: the GPU's ("9.0" for Hopper); None reads the default device's (and
  is None off a GPU, where the Triton kernel's interpreter is the faster one). CUDA
  runtimes 12.8.0 to 12.9.0 miscompile masked wgmma attention in ptxas (JAX's
  attention_mgpu.py refuses causal masks there), so causal calls take Triton on them.
  """
  if compute_capability is None:
    compute_capability = _gpu_compute_capability()
  from kernels import flash_attention_mgpu
  if (compute_capability == "9.0"
      and flash_attention_mgpu.supports(dtype, head_dim, scale)):
    runtime = _cuda_runtime_version() if causal else None
    if runtime is None or not 12080 <= runtime < 12091:
      return "mgpu"
  return "triton"


def flash_attention(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, q_segment_ids=None,
                    kv_segment_ids=None, q_positions=None, kv_positions=None,
                    scale: float | None = None, implementation: str | None = None,
                    interpret=None, **tuning):
  """Flash attention by the fastest kernel that applies here; returns (out, lse).

  implementation: "mgpu", "triton" or None (`choose_implementation`). interpret: None runs
  the kernel's Pallas interpreter unless the default backend is a GPU. tuning: the chosen
  kernel's block sizes and launch parameters (see its docstring).
  """
  if implementation is None:
    implementation = choose_implementation(q_BTHK.dtype, q_BTHK.shape[-1], scale,
                                           causal=causal)
  kw = dict(causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            q_positions=q_positions, kv_positions=kv_positions, scale=scale,
            interpret=interpret, **tuning)
  if implementation == "mgpu":
    from kernels.flash_attention_mgpu import flash_attention_mgpu
    return flash_attention_mgpu(q_BTHK, k_BSGK, v_BSGK, **kw)
  if implementation == "triton":
    from kernels.flash_attention_triton import flash_attention_triton
    return flash_attention_triton(q_BTHK, k_BSGK, v_BSGK, **kw)
  raise ValueError(f"flash_attention: implementation={implementation!r}, expected one of "
                   f"{IMPLEMENTATIONS} or None")
