"""core.flops: XLA's FLOP count against hand counts, cost-analysis return forms, params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from core import flops as flops_lib
from rec.layers.mlp import MLP
from rec.models.dlrm import DLRM, DLRMConfig


def test_matmul_flops_are_2mkn():
  a = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  b = jax.ShapeDtypeStruct((16, 32), jnp.float32)
  assert flops_lib.xla_flops(lambda x, y: x @ y, a, b) == 2 * 8 * 16 * 32


def test_cost_analysis_forms():
  assert flops_lib._flops_of({"flops": 10.0, "bytes accessed": 4.0}) == 10.0
  assert flops_lib._flops_of([{"flops": 10.0}, {"flops": 5.0}, {}]) == 15.0   # older jax: a list
  with pytest.raises(ValueError, match="no cost analysis"):
    flops_lib._flops_of(None)
  # XLA leaves zero counts out: data movement alone is 0 FLOPs, not an error
  t = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  assert flops_lib.xla_flops(lambda x: x.T, t) == 0.0
  assert flops_lib.xla_flops(lambda x: x * 2.0, t) == 16 * 8
  assert flops_lib._flops_of({"bytes accessed": 4.0}) == 0.0
  with pytest.raises(ValueError, match="an empty cost analysis"):
    flops_lib._flops_of([{}])


def test_count_params_concrete_and_abstract():
  want = 5 * 7 + 7 + 7 * 3 + 3
  assert flops_lib.count_params(MLP(5, (7, 3), nnx.Rngs(0))) == want
  assert flops_lib.count_params(nnx.eval_shape(lambda: MLP(5, (7, 3), nnx.Rngs(0)))) == want


def test_dlrm_kaggle_forward_flops_per_example():
  """2 FLOPs per MLP multiply-add plus the 27 x 27 x 16 dot products, and XLA's few
  elementwise extras (bias adds, ReLUs): within 1%."""
  cfg = DLRMConfig.criteo_kaggle(1000)
  macs = (13 * 512 + 512 * 256 + 256 * 64 + 64 * 16) + (367 * 512 + 512 * 256 + 256 * 1)
  want = 2 * macs + 2 * 27 * 27 * 16
  for spec in (cfg, (13, 26, 16)):
    got = flops_lib.model_flops_per_example(lambda r: DLRM(cfg, r), spec, batch=8)
    assert got == pytest.approx(want, rel=0.01)
  # Per example: independent of the batch it was measured at.
  assert flops_lib.model_flops_per_example(lambda r: DLRM(cfg, r), cfg, batch=32) == \
      pytest.approx(want, rel=0.01)
