"""kernels.flash_attention: kernel choice by backend, the registry names, and the layering
(kernels import no model family; llm.attention registers them)."""

from __future__ import annotations

import os
import subprocess
import sys

# GPU interpret mode ("pallas_mgpu" off a GPU) runs one XLA CPU thread per warpgroup; see
# tests/kernels/test_flash_attention_mgpu.py.
_PJRT_NPROC_PRESET = os.environ.get("PJRT_NPROC")
os.environ.setdefault("PJRT_NPROC", "16")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from kernels import flash_attention as fa  # noqa: E402
from llm.attention import attention, get_attention  # noqa: E402

_POOL_THREADS = int(os.environ["PJRT_NPROC"] if _PJRT_NPROC_PRESET is not None
                    or not xla_bridge.backends_are_initialized() else os.cpu_count())

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("dtype,kd,scale,cc,want", [
    (jnp.bfloat16, 128, None, "9.0", "mgpu"),
    (jnp.float16, 64, 0.5, "9.0", "mgpu"),
    (jnp.float32, 128, None, "9.0", "triton"),    # fp32: Mosaic GPU kernel is 16-bit only
    (jnp.bfloat16, 96, None, "9.0", "triton"),    # head dim not a wgmma multiple
    (jnp.bfloat16, 128, -1.0, "9.0", "triton"),   # negative scale
    (jnp.bfloat16, 128, None, "8.0", "triton"),   # A100: no wgmma / TMA
    (jnp.bfloat16, 128, None, "10.0", "triton"),  # Blackwell: no wgmma
])
def test_choose_implementation(dtype, kd, scale, cc, want):
  assert fa.choose_implementation(dtype, kd, scale, compute_capability=cc) == want


def test_cuda_12_8_causal_takes_triton(monkeypatch):
  """ptxas of CUDA 12.8.0 - 12.9.0 miscompiles masked wgmma attention (JAX's kernel refuses)."""
  monkeypatch.setattr(fa, "_cuda_runtime_version", lambda: 12080)
  assert fa.choose_implementation(jnp.bfloat16, 128, compute_capability="9.0") == "triton"
  assert fa.choose_implementation(jnp.bfloat16, 128, compute_capability="9.0",
                                  causal=False) == "mgpu"
  monkeypatch.setattr(fa, "_cuda_runtime_version", lambda: 13000)
  assert fa.choose_implementation(jnp.bfloat16, 128, compute_capability="9.0") == "mgpu"


def test_choose_implementation_off_gpu_is_triton():
  # The CPU test backend: the Triton kernel's HLO interpreter is the fast one.
  assert fa.choose_implementation(jnp.bfloat16, 128) == "triton"


def test_rejects_unknown_implementation():
  q = jnp.zeros((1, 16, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="implementation='cuda'"):
    fa.flash_attention(q, q[:, :, :1], q[:, :, :1], implementation="cuda")


def test_registry_names():
  assert get_attention("pallas") is fa.flash_attention
  assert get_attention("pallas_mgpu").keywords == {"implementation": "mgpu"}
  assert get_attention("pallas_triton").keywords == {"implementation": "triton"}
  from llm.attention import reference
  assert reference.attention_reference is fa.flash_attention_reference


@pytest.mark.parametrize("impl", ["pallas", "pallas_mgpu"])
def test_registered_impls_match_xla(impl):
  """Both names run here (interpreted) and agree with the reference, forward only."""
  if impl == "pallas_mgpu" and _POOL_THREADS < 4:
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


def test_kernels_do_not_import_llm():
  code = ("import sys; import kernels.flash_attention as f, kernels.flash_attention_triton, "
          "kernels.flash_attention_mgpu; "
          "bad = sorted(m for m in sys.modules if m == 'llm' or m.startswith('llm.')); "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_reference_module_loads_no_pallas():
  """Importing the model's attention registry must not pull Pallas in (lazy kernels)."""
  code = ("import sys; import llm.attention; "
          "assert 'jax.experimental.pallas' not in sys.modules, 'pallas imported'")
  subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
