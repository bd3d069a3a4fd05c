"""Triton int8 dequantize-and-pool kernel (through jax-triton) against its reference.

The module and its reference import and run without triton; the kernel itself runs
  - compiled on a GPU through jax_triton (`-m gpu`, skipped when triton, jax_triton or a
    GPU backend are missing);
  - in Triton's own interpreter on CPU when triton and torch are installed (the
    interpreter takes torch tensors), skipped otherwise.
"""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest

from core import quant
from kernels import triton_int8_pool as tp

# (rows, dim, leading bag dims, ids per bag): one-hot, multi-hot with padding, tails of
# bag and column blocks, the collection's a2a layout.
CASES = [(37, 16, (8,), 1), (70, 12, (6, 3), 5), (29, 40, (7, 2), 3), (17, 3, (2, 4, 2), 2)]


def _case(rows, dim, lead, bag_len, seed=0):
  rng = np.random.default_rng(seed)
  table = quant.quantize_rowwise_int8(rng.normal(size=(rows, dim)).astype(np.float32))
  ids = rng.integers(0, rows, (*lead, bag_len)).astype(np.int32)
  ids[..., 0] %= 3                                           # duplicate ids
  lengths = rng.integers(0, bag_len + 1, lead)
  live = np.arange(bag_len) < lengths[..., None]
  ids = np.where(live, ids, rng.choice([-5, rows, 10**6, 0], size=ids.shape)).astype(np.int32)
  coef = np.where(live, rng.uniform(0.5, 1.5, ids.shape), 0.0).astype(np.float32)
  return table, ids, coef


def _numpy_pool(table, ids, coef):
  rows = (np.asarray(table.q, np.float64) * np.asarray(table.scale, np.float64)[:, None]
          + np.asarray(table.bias, np.float64)[:, None])
  out = np.zeros((*ids.shape[:-1], rows.shape[1]))
  for pos in np.ndindex(*ids.shape):
    if coef[pos] != 0 and 0 <= ids[pos] < rows.shape[0]:
      out[pos[:-1]] += coef[pos] * rows[ids[pos]]
  return out


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_numpy(case):
  table, ids, coef = _case(*case)
  got = tp.int8_pool_reference(table, ids, coef)
  assert got.shape == (*case[2], case[1])
  np.testing.assert_allclose(got, _numpy_pool(table, ids, coef), rtol=1e-5, atol=1e-5)


def test_imports_without_triton_and_checks_inputs():
  table, ids, coef = _case(*CASES[1])
  with pytest.raises(ValueError, match="expected an int8 core.quant.RowwiseQuantized"):
    tp.int8_pool(quant.quantize_rowwise_int4(np.ones((4, 4), np.float32)), ids, coef)
  with pytest.raises(ValueError, match="expected the same shape"):
    tp.int8_pool(table, ids, coef[..., :1])
  if not tp.available():
    with pytest.raises(ImportError, match="install the gpu extra"):
      tp.int8_pool(table, ids, coef)


def test_mismatched_jax_triton_is_a_clear_error(monkeypatch):
  """jax-triton 0.4 beside triton 3.6 stubs out Triton's NVIDIA backend (the failure seen
  on the GPU image); int8_pool must say which versions clash instead of failing inside."""
  import sys
  import types

  class _Stub:
    pass

  lib = types.SimpleNamespace(_Stub=_Stub, cb=types.SimpleNamespace(GPUTarget=_Stub))
  monkeypatch.setitem(sys.modules, "jax_triton",
                      types.SimpleNamespace(__version__="0.4.1", triton_lib=lib))
  monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
  table, ids, coef = _case(*CASES[0])
  with pytest.raises(RuntimeError, match=r"jax-triton 0\.4\.1 could not load .* triton 3\.6\.0"):
    tp.int8_pool(table, ids, coef)


def _has(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not (_has("triton") and _has("torch")),
                    reason="Triton's interpreter needs triton and torch")
@pytest.mark.parametrize("block", [(16, 16), (4, 8)])
@pytest.mark.parametrize("case", CASES)
def test_kernel_in_triton_interpreter(case, block, monkeypatch):
  import torch
  monkeypatch.setenv("TRITON_INTERPRET", "1")
  kernel = tp._kernel.__wrapped__()          # a fresh @triton.jit, built in interpreter mode
  table, ids, coef = _case(*case)
  ids2, coef2 = ids.reshape(-1, ids.shape[-1]), coef.reshape(-1, ids.shape[-1])
  (num_bags, bag_len), (num_rows, dim) = ids2.shape, table.q.shape
  out = torch.full((num_bags, dim), float("nan"))
  bm, bd = block
  kernel[(-(-num_bags // bm), -(-dim // bd))](
      *(torch.from_numpy(np.array(a)) for a in (table.q, table.scale, table.bias, ids2, coef2)),
      out, NUM_BAGS=num_bags, NUM_ROWS=num_rows, DIM=dim, BAG_LEN=bag_len, BLOCK_M=bm,
      BLOCK_D=bd)
  want = np.asarray(tp.int8_pool_reference(table, ids, coef)).reshape(num_bags, dim)
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
class TestInt8PoolCompiled:
  """The kernel compiled by Triton for this GPU, launched through jax_triton."""

  @pytest.fixture(autouse=True)
  def _needs_gpu_and_triton(self):
    if not tp.available():
      pytest.skip("triton / jax_triton not installed (pip install -e '.[gpu]')")
    if jax.default_backend() != "gpu":
      pytest.skip("needs a GPU backend")

  @pytest.mark.parametrize("case", CASES)
  def test_matches_reference(self, case):
    table, ids, coef = _case(*case)
    got = jax.jit(tp.int8_pool)(table, ids, coef)
    np.testing.assert_allclose(got, tp.int8_pool_reference(table, ids, coef),
                               rtol=1e-5, atol=1e-5)

  def test_matches_pallas_kernel(self):
    from kernels import embedding_bag
    table, ids, coef = _case(*CASES[1], seed=1)
    np.testing.assert_allclose(tp.int8_pool(table, ids, coef, block_bags=8, block_dim=8),
                               embedding_bag.embedding_bag(table, ids, coef),
                               rtol=1e-5, atol=1e-5)
