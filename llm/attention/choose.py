"""Which attention implementation runs a call: the one chooser and the one device probe.

    impl = choose_impl(q_BTHK, k_BSGK, q_segment_ids=..., q_positions=..., kv_positions=...)
    kernel = choose_kernel(dtype, head_dim, scale, causal)      # "pallas_mgpu" | "pallas_triton"

"auto" (llm.attention) runs `choose_impl`'s answer; "pallas" runs `choose_kernel`'s. Both
decide from a call's structure (shapes, dtype, which optional arguments are given), never
from values, and from `DeviceInfo`: the backend, the GPU's compute capability, the CUDA
runtime and whether cuDNN flash attention is usable, probed once per process
(`device_info()`); tests and ahead-of-time lowering pass a DeviceInfo instead.

    decode (T <= DECODE_MAX_T, T < S):
      a GPU, bf16 / fp16, head dim a power   "pallas_decode" (kernels/decode_attention.py:
        of two in [16, 256], no segment ids    one kernel reads the cache in place, split
        (an explicit mask comes as segment     over the keys)
        ids: llm/attention/masked.py)
      otherwise                              "xla_decode" (one read of the cache in place; on
                                              CPU its sums as matrix products: decode.py)
    not a GPU                               "xla"
    no segment ids, no positions,           "cudnn" (cuDNN's causal / no mask is then exactly
      bf16 / fp16, cuDNN usable                the shared rule: nothing data-dependent)
    otherwise                               the Pallas kernel of `choose_kernel`:
      Hopper, bf16 / fp16, head dim 64/128    "pallas_mgpu" (Mosaic GPU)
      anything else                           "pallas_triton" (fp32, other GPUs, other dims)

CUDA runtimes 12.8.0 to 12.9.0 miscompile masked wgmma attention in ptxas (JAX's
attention_mgpu.py refuses causal masks there), so causal calls take Triton on them. Off a
GPU `choose_kernel` answers "pallas_triton": its interpreter is the faster one.

Letters: B batch, T query length, S key length, H query heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

# Calls of up to this many queries against a longer key axis are decode steps for "auto":
# memory-bound, one pass over the KV cache ("xla_decode", llm/attention/decode.py).
DECODE_MAX_T = 16
# ptxas of these CUDA runtimes miscompiles masked wgmma attention.
_BAD_PTXAS = (12080, 12091)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the choice depends on besides the call: the default device as probed."""
  backend: str                          # jax.default_backend(): "cpu", "gpu", "tpu"
  compute_capability: str | None = None  # "9.0" for H100 / H200; None off a CUDA GPU
  cuda_runtime: int | None = None       # e.g. 12080 for 12.8.0; None when unknown
  cudnn: bool = False                   # cuDNN flash attention usable (found, sm >= 8.0)

  @property
  def hopper(self) -> bool:
    return self.backend == "gpu" and self.compute_capability == "9.0"


def _cuda_runtime_version() -> int | None:
  try:
    from jax._src.lib import cuda_versions
    return cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else None
  except Exception:  # noqa: BLE001 - no CUDA plugin, or an API change: no constraint known
    return None


def cudnn_capable(compute_capability: str | None) -> bool:
  """cuDNN flash attention runs on this GPU generation: Ampere (8.0) or newer."""
  if compute_capability is None:
    return False
  return tuple(int(x) for x in str(compute_capability).split(".")) >= (8, 0)


def _cudnn_found() -> bool:
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    fa.check_cudnn_version()
  except (ImportError, RuntimeError):
    return False
  return True


@functools.lru_cache(maxsize=None)
def device_info() -> DeviceInfo:
  """The probe: the default backend and, on a CUDA GPU, its capability, runtime and cuDNN."""
  backend = jax.default_backend()
  if backend != "gpu":
    return DeviceInfo(backend)
  cc = getattr(jax.devices()[0], "compute_capability", None)
  cc = None if cc is None else str(cc)
  return DeviceInfo(backend, cc, _cuda_runtime_version(), cudnn_capable(cc) and _cudnn_found())


def choose_kernel(dtype, head_dim: int, scale: float | None = None, causal: bool = True,
                  device: DeviceInfo | None = None) -> str:
  """The Pallas kernel for these inputs: "pallas_mgpu" or "pallas_triton"."""
  device = device_info() if device is None else device
  if device.hopper:
    from kernels.flash_attention_mgpu import supports   # Pallas: loaded only on a GPU
    runtime = device.cuda_runtime if causal else None
    if supports(dtype, head_dim, scale) and (
        runtime is None or not _BAD_PTXAS[0] <= runtime < _BAD_PTXAS[1]):
      return "pallas_mgpu"
  return "pallas_triton"


def choose_impl(q_BTHK, k_BSGK, *, causal: bool = True, q_segment_ids=None,
                kv_segment_ids=None, q_positions=None, kv_positions=None, scale=None,
                device: DeviceInfo | None = None) -> str:
  """The implementation "auto" runs for this call (module docstring). The model passes no
  positions when they are the default arange, so its calls without a cache take cuDNN."""
  del kv_segment_ids
  device = device_info() if device is None else device
  t, s = q_BTHK.shape[1], k_BSGK.shape[1]
  if t <= DECODE_MAX_T and t < s:
    if device.backend == "gpu" and q_segment_ids is None and k_BSGK.dtype == q_BTHK.dtype:
      from kernels.decode_attention import supports as decode_kernel_supports
      if decode_kernel_supports(q_BTHK.dtype, q_BTHK.shape[-1]) is None:
        return "pallas_decode"
    return "xla_decode"
  if device.backend != "gpu":
    return "xla"
  from llm.attention.cudnn import supports as cudnn_supports
  if (device.cudnn and q_segment_ids is None and q_positions is None and kv_positions is None
      and cudnn_supports(q_BTHK.dtype, q_BTHK.shape[-1]) is None
      and k_BSGK.dtype == q_BTHK.dtype):
    return "cudnn"
  return choose_kernel(q_BTHK.dtype, q_BTHK.shape[-1], scale, causal, device)


__all__ = ["DECODE_MAX_T", "DeviceInfo", "choose_impl", "choose_kernel", "cudnn_capable",
           "device_info"]
