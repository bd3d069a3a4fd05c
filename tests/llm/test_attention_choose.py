"""llm.attention's one chooser (choose_impl for "auto", choose_kernel for "pallas") and the
registry names: which implementation runs a call on which device, and that the names run."""

from __future__ import annotations

import os
import sys

# GPU interpret mode ("pallas_mgpu" off a GPU) runs one XLA CPU thread per warpgroup; see
# tests/kernels/test_flash_attention_mgpu.py.
_PJRT_NPROC_PRESET = os.environ.get("PJRT_NPROC")
os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from kernels.flash_attention_mgpu import flash_attention_mgpu  # noqa: E402
from kernels.flash_attention_reference import flash_attention_reference  # noqa: E402
from kernels.flash_attention_triton import flash_attention_triton  # noqa: E402
from llm import attention as attn_lib  # noqa: E402
from llm.attention import attention, choose, get_attention  # noqa: E402
from llm.attention.choose import DeviceInfo, choose_impl, choose_kernel  # noqa: E402
from tests import forkserver

_POOL_THREADS = int(os.environ["PJRT_NPROC"] if _PJRT_NPROC_PRESET is not None
                    or not xla_bridge.backends_are_initialized() else os.cpu_count())
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H100 = DeviceInfo("gpu", "9.0", 13000, cudnn=True)
CPU = DeviceInfo("cpu")


@pytest.mark.parametrize("dtype,kd,scale,cc,want", [
    (jnp.bfloat16, 128, None, "9.0", "pallas_mgpu"),
    (jnp.float16, 64, 0.5, "9.0", "pallas_mgpu"),
    (jnp.float32, 128, None, "9.0", "pallas_triton"),   # fp32: Mosaic GPU kernel is 16-bit only
    (jnp.bfloat16, 96, None, "9.0", "pallas_triton"),   # head dim not a wgmma multiple
    (jnp.bfloat16, 128, -1.0, "9.0", "pallas_triton"),  # negative scale
    (jnp.bfloat16, 128, None, "8.0", "pallas_triton"),  # A100: no wgmma / TMA
    (jnp.bfloat16, 128, None, "10.0", "pallas_triton"),  # Blackwell: no wgmma
])
def test_choose_kernel(dtype, kd, scale, cc, want):
  assert choose_kernel(dtype, kd, scale, device=DeviceInfo("gpu", cc, 13000, True)) == want


def test_cuda_12_8_causal_takes_triton():
  """ptxas of CUDA 12.8.0 - 12.9.0 miscompiles masked wgmma attention (JAX's kernel refuses)."""
  old = DeviceInfo("gpu", "9.0", 12080, True)
  assert choose_kernel(jnp.bfloat16, 128, device=old) == "pallas_triton"
  assert choose_kernel(jnp.bfloat16, 128, causal=False, device=old) == "pallas_mgpu"
  assert choose_kernel(jnp.bfloat16, 128, device=DeviceInfo("gpu", "9.0", 12091)) == \
      "pallas_mgpu"
  assert choose_kernel(jnp.bfloat16, 128, device=DeviceInfo("gpu", "9.0", None)) == \
      "pallas_mgpu"


def test_choose_kernel_off_gpu_is_triton():
  # The CPU test backend: the Triton kernel's HLO interpreter is the fast one.
  assert choose_kernel(jnp.bfloat16, 128, device=CPU) == "pallas_triton"
  if jax.default_backend() != "gpu":
    assert choose_kernel(jnp.bfloat16, 128) == "pallas_triton"


def test_choose_impl():
  f = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  q, k = f(1, 4096, 32, 64), f(1, 4096, 8, 64)
  assert choose_impl(q, k, device=CPU) == "xla"
  assert choose_impl(q, k, device=H100) == "cudnn"
  pos = jnp.zeros((1, 4096), jnp.int32)
  # Positions or segment ids: the Pallas kernel the same chooser picks for the device.
  assert choose_impl(q, k, q_positions=pos, kv_positions=pos, device=H100) == "pallas_mgpu"
  assert choose_impl(q, k, q_segment_ids=pos, kv_segment_ids=pos, device=H100) == "pallas_mgpu"
  a100 = DeviceInfo("gpu", "8.0", 13000, cudnn=True)
  assert choose_impl(q, k, q_positions=pos, kv_positions=pos, device=a100) == "pallas_triton"
  no_cudnn = DeviceInfo("gpu", "9.0", 13000, cudnn=False)
  assert choose_impl(q, k, device=no_cudnn) == "pallas_mgpu"
  assert choose_impl(f(1, 4096, 32, 64, dt=jnp.float32), f(1, 4096, 8, 64, dt=jnp.float32),
                     device=H100) == "pallas_triton"
  assert choose_impl(f(1, 4096, 32, 96), f(1, 4096, 8, 96), q_positions=pos,
                     kv_positions=pos, device=H100) == "pallas_triton"
  # Decode steps: the split-key kernel on a GPU for bf16 / fp16 at a power-of-two head dim
  # without segment ids (an explicit mask arrives as segment ids), else the jnp sums.
  assert choose_impl(f(8, 1, 32, 64), f(8, 8192, 8, 64), device=H100) == "pallas_decode"
  assert choose_impl(f(8, 1, 32, 64), f(8, 8192, 8, 64), device=a100) == "pallas_decode"
  assert choose_impl(f(8, 1, 32, 64), f(8, 8192, 8, 64), device=CPU) == "xla_decode"
  seg1, seg_s = jnp.ones((8, 1), jnp.int32), jnp.ones((8, 8192), jnp.int32)
  assert choose_impl(f(8, 1, 32, 64), f(8, 8192, 8, 64), q_segment_ids=seg1,
                     kv_segment_ids=seg_s, device=H100) == "xla_decode"
  assert choose_impl(f(8, 1, 32, 64, dt=jnp.float32), f(8, 8192, 8, 64, dt=jnp.float32),
                     device=H100) == "xla_decode"
  assert choose_impl(f(8, 1, 32, 96), f(8, 8192, 8, 96), device=H100) == "xla_decode"


def test_device_probe():
  d = choose.device_info()
  assert d is choose.device_info()                       # probed once
  assert d.backend == jax.default_backend()
  if d.backend != "gpu":
    assert d == DeviceInfo(d.backend) and not d.cudnn and not d.hopper
  assert choose.cudnn_capable("8.0") and choose.cudnn_capable("9.0")
  assert not choose.cudnn_capable("7.5") and not choose.cudnn_capable(None)


def test_registry_names():
  assert get_attention("pallas_mgpu") is flash_attention_mgpu
  assert get_attention("pallas_triton") is flash_attention_triton
  from llm.attention import pallas, reference
  assert get_attention("pallas") is pallas.pallas_attention
  assert get_attention("xla") is reference.attention_reference is flash_attention_reference
  assert {"auto", "xla", "xla_decode", "cudnn", "pallas", "pallas_mgpu",
          "pallas_triton", "pallas_decode"} <= set(attn_lib.names())


def test_unknown_and_ring_names_are_refused():
  q = jnp.zeros((1, 16, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match=r"attention_impl='cuda': expected one of \[.*'pallas'"):
    attention(q, q[:, :, :1], q[:, :, :1], impl="cuda")
  with pytest.raises(ValueError, match="context_parallel='pass_q'"):
    get_attention("ring_pass_q")


@pytest.mark.parametrize("impl", ["pallas", "pallas_mgpu", "auto"])
def test_registered_impls_match_xla(impl):
  """The names run here (interpreted) and agree with the reference, forward only."""
  if impl == "pallas_mgpu" and jax.default_backend() == "gpu" and not choose.device_info().hopper:
    pytest.skip("the Mosaic GPU kernel compiles for Hopper only")
  if impl == "pallas_mgpu" and jax.default_backend() == "cpu" and _POOL_THREADS < 4:
    pytest.skip("GPU interpret mode needs >= 4 XLA CPU threads (PJRT_NPROC before jax starts)")
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 128, 2, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(1, 128, 1, 64)), jnp.bfloat16)
  seg = jnp.asarray(np.repeat([0, 1], 64)[None], jnp.int32)
  kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  o, l = attention(q, k, k, impl=impl, **kw)
  o_ref, l_ref = attention(q, k, k, impl="xla", **kw)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                             atol=2e-2)
  np.testing.assert_allclose(l, l_ref, rtol=1e-5)


def test_registry_loads_no_pallas():
  """Importing the model's attention registry and config must not pull Pallas in."""
  code = ("import sys; import llm.attention, llm.config, llm.model; "
          "assert 'jax.experimental.pallas' not in sys.modules, 'pallas imported'")
  forkserver.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
