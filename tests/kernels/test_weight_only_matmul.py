"""kernels.weight_only_matmul (int8 / int4 weights dequantized in registers) against
core.quant.groupwise's jnp product, on the Q8_0 / Q4_0 / Q4_1 layouts.

TestWeightOnlyMatmulInterpret runs the Pallas kernel in interpret mode on CPU (in CI) and
lowers it to Triton for an H100 from here; TestWeightOnlyMatmulGpu compiles it and skips
without a GPU: JAX_PLATFORMS=cuda python -m pytest tests/kernels/test_weight_only_matmul.py -m gpu.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.quant import groupwise
from kernels.weight_only_matmul import supports, tiles, weight_only_matmul
from tests.kernels.attention_cases import rel_err

BF16, F16 = jnp.bfloat16, jnp.float16

# (bits, with a minimum (Q4_1) or not, M, N, K, splits, x dtype): one decode row and a few,
# one K split or several, N not a multiple of 128.
CASES = [
    (8, False, 1, 64, 128, None, BF16),
    (8, False, 5, 48, 512, 2, F16),
    (4, True, 1, 256, 512, None, BF16),
    (4, True, 3, 48, 192, 3, BF16),
    (4, False, 2, 32, 128, 1, F16),
]


def _case_id(c):
  bits, minimum, m, n, k, s, dt = c
  return f"int{bits}{'min' if minimum else ''}-M{m}N{n}K{k}S{s}-{jnp.dtype(dt).name}"


def _inputs(case, seed=0):
  bits, minimum, m, n, k, _, dtype = case
  rng = np.random.default_rng(seed)
  gq = groupwise.quantize_groupwise(rng.normal(size=(n, k)).astype(np.float32) * 0.05, bits)
  if bits == 4 and not minimum:                 # Q4_0: no minimum, codes centred by the scale
    gq = groupwise.GroupQuantized(gq.q, gq.scale, None, 4, gq.group)
  gq = jax.tree.map(jnp.asarray, gq)
  return jnp.asarray(rng.normal(size=(m, k)), dtype), gq


class _Cases:
  interpret: bool

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_matches_groupwise_matmul(self, case):
    """In float32 out, the same weights and products as the jnp path (both round each
    weight once to x's dtype): only the order of the float32 sums differs."""
    x, gq = _inputs(case)
    got = weight_only_matmul(x, gq, out_dtype=jnp.float32, splits=case[5],
                             interpret=self.interpret)
    want = groupwise.groupwise_matmul(x, gq, x.dtype, preferred_element_type=jnp.float32)
    assert got.shape == (case[2], case[3]) and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-5

  def test_result_in_x_dtype_by_default(self):
    x, gq = _inputs(CASES[0])
    y = weight_only_matmul(x, gq, interpret=self.interpret)
    want = groupwise.groupwise_matmul(x, gq, x.dtype, preferred_element_type=jnp.float32)
    assert y.dtype == x.dtype and rel_err(y, want) < 1e-2


class TestWeightOnlyMatmulInterpret(_Cases):
  """Pallas interpreter on CPU."""
  interpret = True

  @pytest.mark.parametrize("bits", [8, 4])
  def test_lowers_to_triton_for_hopper(self, bits):
    """AOT-lower a Llama 3.2 1B decode step's MLP up-projection (x [1, 2048], rows [8192,
    2048]) for an H100 from this CPU: the kernel body must lower to Triton IR."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    s = jax.ShapeDtypeStruct
    n, k = 8192, 2048
    q = s((n, k), jnp.int8) if bits == 8 else s((n, k // 2), jnp.uint8)
    gq = groupwise.GroupQuantized(q, s((n, k // 32), F16),
                                  None if bits == 8 else s((n, k // 32), F16), bits, 32)
    run = jax.jit(lambda x, g: weight_only_matmul(x, g, interpret=False))
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)    # the Triton backend's notice
      hlo = run.trace(s((1, k), BF16), gq).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1

  def test_tiles_and_support(self):
    # Llama 3.2 1B at batch 1: a 2048-wide projection is 16 column blocks of 128, each
    # split over K 8 ways (128 programs); the 8192-wide MLP up-projection 64 blocks x 4.
    assert tiles(1, 2048, 2048) == (128, 256, 8)
    assert tiles(1, 8192, 2048) == (128, 256, 4)
    assert tiles(1, 576, 1536) == (64, 256, 6)        # SmolLM2's MLP down: N = 576 = 9 x 64
    with pytest.raises(ValueError, match="splits=4 do not divide"):
      tiles(1, 64, 512, splits=4)                     # 2 tiles of 256
    gq = groupwise.GroupQuantized(jnp.zeros((64, 128), jnp.int8), jnp.zeros((64, 4), F16),
                                  None, 8, 32)
    assert supports(BF16, 1, gq) is None
    assert "float32" in supports(jnp.float32, 1, gq)
    assert "65 rows" in supports(BF16, 65, gq)
    with pytest.raises(ValueError, match="x dtype float32"):
      weight_only_matmul(jnp.zeros((1, 128), jnp.float32), gq, interpret=True)
    with pytest.raises(ValueError, match="expected the same K"):
      weight_only_matmul(jnp.zeros((1, 64), BF16), gq, interpret=True)


@pytest.mark.gpu
class TestWeightOnlyMatmulGpu(_Cases):
  """Compiled (Triton lowering) on a GPU."""
  interpret = False

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("needs a GPU (run with JAX_PLATFORMS=cuda)")
