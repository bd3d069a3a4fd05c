"""DLRM / Llama PVF (rec/pvf.py, llm/pvf.py): the per-example forward equals the modules,
a fault nothing reads has PVF 0, faults that matter are counted."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import faults
from rec import pvf
from rec.data.batch import SparseBatch
from rec.models.dlrm import DLRM, DLRMConfig

CFG = DLRMConfig(num_dense=3, num_sparse=3, embedding_dim=4, bottom_mlp=(8, 4),
                 top_mlp=(8, 1), rows_per_feature=(11, 7, 5))


def _target(lengths_value=None):
  rng = np.random.default_rng(0)
  model = DLRM(CFG, nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model))
  tables = {n: rng.standard_normal((r, 4)).astype(np.float32)
            for n, r in zip(CFG.feature_names, CFG.rows_per_feature)}
  B, L = 24, 2
  ids = np.stack([rng.integers(0, r, (B, L)) for r in CFG.rows_per_feature], 1).astype(np.int32)
  lengths = rng.integers(0, L + 1, (B, 3)).astype(np.int32)
  if lengths_value is not None:
    lengths[:] = lengths_value
  batch = SparseBatch(rng.standard_normal((B, 3)).astype(np.float32), ids, lengths,
                      np.zeros(B, np.float32), np.ones(B, np.float32),
                      rng.uniform(0.5, 2, (B, 3, L)).astype(np.float32))
  return model, tables, batch, pvf.dlrm_target(CFG, params, tables, [batch])


def test_forward_equals_dlrm_module():
  model, tables, batch, target = _target()
  L = batch.ids.shape[2]
  live = np.arange(L)[None, None] < batch.lengths[..., None]
  emb = np.stack([np.einsum("bl,bld->bd", np.where(live[:, f], batch.weights[:, f], 0),
                            tables[n][batch.ids[:, f]])
                  for f, n in enumerate(CFG.feature_names)], 1)
  want = jax.nn.sigmoid(model(jnp.asarray(batch.dense), jnp.asarray(emb)))
  np.testing.assert_allclose(pvf.dlrm_probabilities(target), want, rtol=1e-5, atol=1e-6)


def test_pvf_zero_where_output_does_not_depend():
  # Empty bags: no example reads any table row, whatever the bits (NaN, inf) become.
  _, _, _, target = _target(lengths_value=0)
  for fmt, group in (("fp32", "emb"), ("bf16", "emb_read"), ("int8", "emb_read")):
    rows = pvf.dlrm_pvf(target, fmt, faults.FaultModel("burst", bits=6),
                        faults.tolerance_criterion(0.0), 200, jax.random.key(0),
                        groups=[group], chunk=100)
    assert rows[0]["changed"] == 0 and rows[0]["trials"] == 200, (fmt, rows)


def test_pvf_counts_faults_that_matter():
  _, _, _, target = _target()
  # The logit's bias: a sign flip changes every probability (bias != 0).
  b = target.params["top_mlp"]["layers"][1]["bias"]
  assert abs(float(b[0])) > 0
  crit = faults.tolerance_criterion(0.0)
  rows = pvf.dlrm_pvf(target, "fp32", faults.FaultModel("single", 31), crit, 64,
                      jax.random.key(1), groups=["top_mlp.1"], chunk=64)
  # 9 values (8 kernel + 1 bias): kernel faults change p unless the ReLU input is 0.
  assert rows[0]["values"] == 9 and rows[0]["changed"] > 32
  # Exponent MSB of an embedding value a bag reads: inf / huge -> threshold crossings.
  rows = pvf.dlrm_pvf(target, "fp32", faults.FaultModel("single", 30), faults.threshold_criterion(),
                      200, jax.random.key(2), groups=["emb_read", "interaction"], chunk=100)
  assert all(r["changed"] > 0 for r in rows), rows
  assert set(pvf.dlrm_groups(CFG)) == {"emb", "emb_read", "bottom_mlp.0", "bottom_mlp.1",
                                       "interaction", "top_mlp.0", "top_mlp.1"}


def test_llama_pvf_tiny():
  from llm import pvf as llm_pvf
  from llm.config import PRESETS
  from llm.model import Llama
  model = Llama(PRESETS["tiny"], nnx.Rngs(0))
  toks = llm_pvf.sample_sequences(model, 4, 8, jax.random.key(0))
  assert toks.shape == (4, 8) and (toks[:, 0] == 1).all()
  groups = llm_pvf.llama_groups(model)
  assert "layers.1.mlp" in groups and len(groups["norms"]) == 5
  # Mantissa LSB flips of the MLP hardly matter; exponent-MSB flips of the norms do.
  lsb, msb = (llm_pvf.llama_pvf(model, toks, "fp32", faults.FaultModel("single", bit), 64,
                                jax.random.key(1), groups=[g], chunk=64)[0]
              for bit, g in ((0, "layers.0.mlp"), (30, "norms")))
  assert lsb["changed"] == 0 and msb["changed"] > 0, (lsb, msb)
