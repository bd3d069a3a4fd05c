"""DLRM and LogReg forward passes against an independent numpy reference."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rec.layers.interaction import cat_interaction, dot_interaction
from rec.layers.mlp import MLP
from rec.models.dlrm import DLRM, DLRMConfig
from rec.models.logreg import LogReg, LogRegConfig
from tests import peer_env
from tests.peer_env import peer_python


# ---------------------------------------------------------------------------- numpy reference

def np_embedding_bag(table, ids_BL, lengths_B):
  """Sum pooling of table rows over each bag's first lengths[b] ids, with explicit loops."""
  out = np.zeros((ids_BL.shape[0], table.shape[1]), np.float64)
  for b in range(ids_BL.shape[0]):
    for k in range(lengths_B[b]):
      out[b] += table[ids_BL[b, k]]
  return out


def np_mlp(weights, x, activate_last):
  for i, (w, bias) in enumerate(weights):
    x = x @ w + bias
    if i < len(weights) - 1 or activate_last:
      x = np.maximum(x, 0.0)
  return x


def np_dot_interaction(dense_BD, emb_BFD, self_interaction):
  """Loops over the reference's (i, j) order: i over rows, j < i (or <= i)."""
  vecs = [] if dense_BD is None else [dense_BD]
  vecs += [emb_BFD[:, f] for f in range(emb_BFD.shape[1])]
  batch = emb_BFD.shape[0]
  cols = []
  for i in range(len(vecs)):
    for j in range(i + 1 if self_interaction else i):
      cols.append(np.array([np.dot(vecs[i][b], vecs[j][b]) for b in range(batch)]))
  flat = np.stack(cols, axis=1)
  return flat if dense_BD is None else np.concatenate([dense_BD, flat], axis=1)


def mlp_weights(mlp: MLP):
  return [(np.asarray(l.kernel[...], np.float64), np.asarray(l.bias[...], np.float64))
          for l in mlp.layers]


def np_dlrm(model: DLRM, dense, emb):
  cfg = model.config
  x = None if model.bottom_mlp is None else np_mlp(mlp_weights(model.bottom_mlp), dense, True)
  h = np_dot_interaction(x, emb, cfg.self_interaction)
  return np_mlp(mlp_weights(model.top_mlp), h, False)[:, 0]


def random_bags(rng, tables, batch, max_len):
  """Multi-hot ids [B, F, L] with lengths [B, F] (some zero) and the pooled emb [B, F, D]."""
  num_f = len(tables)
  ids = np.stack([rng.integers(0, t.shape[0], size=(batch, max_len)) for t in tables], axis=1)
  lengths = rng.integers(0, max_len + 1, size=(batch, num_f))
  emb = np.stack([np_embedding_bag(tables[f], ids[:, f], lengths[:, f]) for f in range(num_f)],
                 axis=1)
  return ids, lengths, emb


def small_config(**kw):
  base = dict(num_dense=5, num_sparse=4, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(12, 1),
              rows_per_feature=(11, 7, 23, 5))
  return DLRMConfig(**{**base, **kw})


# ---------------------------------------------------------------------------- tests

@pytest.mark.parametrize("self_interaction", [False, True])
def test_dlrm_forward_matches_numpy(self_interaction):
  cfg = small_config(self_interaction=self_interaction)
  model = DLRM(cfg, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tables = [rng.normal(size=(t.num_rows, t.dim)).astype(np.float32) * 0.5 for t in cfg.tables()]
  batch = 6
  dense = rng.normal(size=(batch, cfg.num_dense)).astype(np.float32)
  _, _, emb = random_bags(rng, tables, batch, max_len=3)
  got = np.asarray(model(jnp.asarray(dense), jnp.asarray(emb, jnp.float32)))
  want = np_dlrm(model, dense.astype(np.float64), emb)
  assert got.dtype == np.float32 and got.shape == (batch,)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The top MLP input has the width the config promises.
  assert model.top_mlp.in_features == cfg.interaction_dim == 8 + (15 if self_interaction else 10)


def test_dlrm_jit_and_grad_run():
  cfg = small_config()
  model = DLRM(cfg, nnx.Rngs(1))
  dense = jnp.ones((3, 5))
  emb = jnp.ones((3, 4, 8)) * 0.1
  eager = model(dense, emb)
  jitted = nnx.jit(lambda m, d, e: m(d, e))(model, dense, emb)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
  grads = nnx.grad(lambda m: m(dense, emb).sum())(model)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_dlrm_without_dense_features():
  cfg = DLRMConfig(num_dense=0, num_sparse=5, embedding_dim=4, bottom_mlp=(), top_mlp=(6, 1),
                   rows_per_feature=50, feature_names=tuple(f"f{i}" for i in range(5)))
  model = DLRM(cfg, nnx.Rngs(2))
  assert model.bottom_mlp is None
  assert cfg.interaction_dim == 10  # 5 * 4 / 2 pairs, no dense vector
  assert [t.name for t in cfg.tables()] == ["f0", "f1", "f2", "f3", "f4"]
  rng = np.random.default_rng(2)
  emb = rng.normal(size=(7, 5, 4)).astype(np.float32)
  got = np.asarray(model(None, jnp.asarray(emb)))
  np.testing.assert_allclose(got, np_dlrm(model, None, emb.astype(np.float64)),
                             rtol=1e-5, atol=1e-5)


def test_dlrm_config_errors():
  with pytest.raises(ValueError, match=r"bottom_mlp=\(16, 6\) must end at embedding_dim=8"):
    small_config(bottom_mlp=(16, 6))
  with pytest.raises(ValueError, match="must end at 1"):
    small_config(top_mlp=(12, 2))
  with pytest.raises(ValueError, match="num_dense=0"):
    small_config(num_dense=0)
  with pytest.raises(ValueError, match="3 row counts"):
    small_config(rows_per_feature=(1, 2, 3))
  model = DLRM(small_config(), nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"emb_BFD shape \(2, 4, 6\)"):
    model(jnp.ones((2, 5)), jnp.ones((2, 4, 6)))
  with pytest.raises(ValueError, match="dense dim 3 != embedding dim 4"):
    dot_interaction(jnp.ones((2, 3)), jnp.ones((2, 5, 4)))


def _num_params(module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_criteo_presets_parameter_counts():
  kaggle = DLRMConfig.criteo_kaggle(num_rows=1000)
  assert [t.name for t in kaggle.tables()] == [f"C{i}" for i in range(1, 27)]
  assert all(t.dim == 16 and t.num_rows == 1000 for t in kaggle.tables())
  # Bottom 13-512-256-64-16; top (16 + 27*26/2 = 367)-512-256-1.
  bottom = 13 * 512 + 512 + 512 * 256 + 256 + 256 * 64 + 64 + 64 * 16 + 16
  top = 367 * 512 + 512 + 512 * 256 + 256 + 256 * 1 + 1
  model = nnx.eval_shape(lambda: DLRM(kaggle, nnx.Rngs(0)))  # shapes only, no compute
  assert _num_params(model.bottom_mlp) == bottom == 155_984
  assert _num_params(model.top_mlp) == top == 320_001
  assert _num_params(model) == bottom + top

  rows = list(range(100, 126))
  tb = DLRMConfig.criteo_terabyte(num_rows=rows)
  assert [t.num_rows for t in tb.tables()] == rows and tb.tables()[0].dim == 64
  # Bottom 13-512-256-64; top (64 + 351 = 415)-512-512-256-1.
  bottom = 13 * 512 + 512 + 512 * 256 + 256 + 256 * 64 + 64
  top = 415 * 512 + 512 + 512 * 512 + 512 + 512 * 256 + 256 + 256 + 1
  model = nnx.eval_shape(lambda: DLRM(tb, nnx.Rngs(0)))
  assert _num_params(model) == bottom + top == 154_944 + 607_233


def test_mlp_init_scale_and_partition_names():
  mlp = MLP(300, (500, 100), nnx.Rngs(0))
  w, b = mlp.layers[0].kernel[...], mlp.layers[0].bias[...]
  assert float(jnp.std(w)) == pytest.approx(np.sqrt(2 / 800), rel=0.02)
  assert float(jnp.std(b)) == pytest.approx(np.sqrt(1 / 500), rel=0.15)
  specs = nnx.get_partition_spec(nnx.state(mlp, nnx.Param))
  assert tuple(specs["layers"][0]["kernel"].get_value()) == ("mlp_in", "mlp_out")
  assert tuple(specs["layers"][1]["bias"].get_value()) == ("mlp_out",)
  # activate_last=False lets negative outputs through; True clips them.
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 300)), jnp.float32)
  assert float(MLP(300, (4,), nnx.Rngs(1), activate_last=False)(x).min()) < 0
  assert float(MLP(300, (4,), nnx.Rngs(1), activate_last=True)(x).min()) >= 0


def test_cat_interaction():
  dense = jnp.arange(6.0).reshape(2, 3)
  emb = jnp.arange(16.0).reshape(2, 4, 2)
  out = cat_interaction(dense, emb)
  np.testing.assert_array_equal(out[1], np.concatenate([np.arange(3.0, 6.0), np.arange(8.0, 16.0)]))


def test_logreg_forward_matches_numpy():
  cfg = LogRegConfig(num_dense=3, num_sparse=4, rows_per_feature=(9, 8, 7, 6))
  assert [(t.name, t.dim, t.num_rows) for t in cfg.tables()] == [
      ("C1", 1, 9), ("C2", 1, 8), ("C3", 1, 7), ("C4", 1, 6)]
  model = LogReg(cfg, nnx.Rngs(0))
  rng = np.random.default_rng(5)
  model.dense_weight[...] = jnp.asarray(rng.normal(size=3), jnp.float32)
  model.bias[...] = jnp.asarray(0.3, jnp.float32)
  tables = [rng.normal(size=(t.num_rows, 1)).astype(np.float32) for t in cfg.tables()]
  dense = rng.normal(size=(5, 3)).astype(np.float32)
  _, _, emb = random_bags(rng, tables, 5, max_len=2)
  got = np.asarray(model(jnp.asarray(dense), jnp.asarray(emb, jnp.float32)))
  want = emb.sum(axis=(1, 2)) + dense.astype(np.float64) @ np.asarray(model.dense_weight[...]) + 0.3
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # No dense features (Avazu).
  sparse_only = LogReg(LogRegConfig(0, 4, 10), nnx.Rngs(0))
  np.testing.assert_allclose(sparse_only(None, jnp.asarray(emb, jnp.float32)), emb.sum(axis=(1, 2)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_gradient_matches_gather_autodiff(self_interaction):
  """take_columns' hand-written VJP equals autodiff through a plain gather."""
  from rec.layers.interaction import dot_interaction, tril_indices
  rng = np.random.default_rng(0)
  d = jnp.asarray(rng.normal(size=(5, 4)).astype(np.float32))
  e = jnp.asarray(rng.normal(size=(5, 3, 4)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(5, 4 + (10 if self_interaction else 6))).astype(np.float32))

  def ref(d, e):
    z = jnp.concatenate([d[:, None], e], 1)
    zz = jnp.einsum("bnd,bmd->bnm", z, z)
    li, lj = tril_indices(4, self_interaction)
    return jnp.concatenate([d, zz[:, li, lj]], 1)

  got = jax.grad(lambda d, e: jnp.sum(dot_interaction(d, e, self_interaction) * w), (0, 1))(d, e)
  want = jax.grad(lambda d, e: jnp.sum(ref(d, e) * w), (0, 1))(d, e)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_dense_input_must_match_the_embeddings_batch():
  """A [1, Dn] or [B, 1, Dn] dense array is refused, not broadcast: broadcast, LogReg would
  return B copies of one example's dense term, or [B, B] logits."""
  lr = LogReg(LogRegConfig(num_dense=2, num_sparse=2, rows_per_feature=5), nnx.Rngs(0))
  emb = jnp.ones((3, 2, 1))
  assert lr(jnp.ones((3, 2)), emb).shape == (3,)
  for bad in ((1, 2), (3, 1, 2), (2,)):
    with pytest.raises(ValueError, match=r"LogReg: dense_BD shape .*expected \[3, 2\]"):
      lr(jnp.ones(bad), emb)
  model = DLRM(small_config(), nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"DLRM: dense_BD shape \(1, 5\), expected \[3, 5\]"):
    model(jnp.ones((1, 5)), jnp.ones((3, 4, 8)))


def test_dlrm_config_refuses_non_positive_layer_sizes():
  """Named at the config (the field), not later by an anonymous MLP."""
  with pytest.raises(ValueError, match=r"DLRMConfig: bottom_mlp=\(16, 8\), top_mlp=\(0, 1\); "
                                       "expected positive layer sizes"):
    small_config(top_mlp=(0, 1))
  with pytest.raises(ValueError, match=r"bottom_mlp=\(-3, 8\)"):
    small_config(bottom_mlp=(-3, 8))


def test_row_counts_are_integers():
  """numpy integers (counts read from arrays) are row counts; a float is refused rather
  than cut by int() (1000.7 rows would become 1000)."""
  assert small_config(rows_per_feature=np.int64(9)).rows_per_feature == (9,) * 4
  assert small_config(rows_per_feature=np.arange(5, 9)).rows_per_feature == (5, 6, 7, 8)
  with pytest.raises(ValueError, match=r"^DLRMConfig: rows_per_feature\[2\]=1000\.7; expected "
                                       r"one int, or one int per feature \(num_sparse=4\)$"):
    small_config(rows_per_feature=(10, 10, 1000.7, 10))
  with pytest.raises(ValueError, match=r"^LogRegConfig: rows_per_feature=100000\.0; expected"):
    LogRegConfig(num_dense=1, num_sparse=2, rows_per_feature=1e5)
  with pytest.raises(ValueError, match=r"rows_per_feature\[0\]=True"):
    small_config(rows_per_feature=(True, 2, 3, 4))


# TorchRec's DLRM parts: DenseArch (ReLU after every layer), InteractionArch ([dense, the
# strict upper triangle of Z = z z^T, row by row]), OverArch (ReLU MLP, then a linear layer
# to the logit). The reference's lower triangle holds the same pairs in another order, so
# the first top-MLP kernel's rows are permuted into TorchRec's order.
_TORCHREC_DLRM = r'''
import sys
import numpy as np, torch
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch
z = dict(np.load(sys.argv[1]))
T = lambda a: torch.tensor(a, dtype=torch.float64)
bottom, top = [int(s) for s in z["bottom"]], [int(s) for s in z["top"]]
F, D = z["emb"].shape[1:]
n = F + 1
tril = [(i, j) for i in range(n) for j in range(i)]
triu = list(zip(*[t.tolist() for t in torch.triu_indices(n, n, offset=1)]))
k0 = z["top_mlp.layers.0.kernel"]
z["top_mlp.layers.0.kernel"] = np.concatenate([k0[:D], k0[D:][[tril.index((j, i)) for i, j in triu]]])
dense_arch = DenseArch(z["dense"].shape[1], bottom).double()
over = OverArch(D + len(tril), top).double()
lin = lambda m: [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
with torch.no_grad():
  names = ([f"bottom_mlp.layers.{i}" for i in range(len(bottom))]
           + [f"top_mlp.layers.{i}" for i in range(len(top))])
  for layer, name in zip(lin(dense_arch) + lin(over), names):
    layer.weight.copy_(T(z[name + ".kernel"]).T)
    layer.bias.copy_(T(z[name + ".bias"]))
  x = InteractionArch(F)(dense_arch(T(z["dense"])), T(z["emb"]))
  np.savez(sys.argv[2], logits=over(x)[:, 0].numpy())
'''


@pytest.mark.peer
def test_dlrm_matches_torchrec(tmp_path):
  """DLRM against TorchRec's DLRM dense part with the same weights (pairs reordered, above).
  Both sides in float64 (ours: the numpy reference, checked against the model in
  test_dlrm_forward_matches_numpy), so 1e-10 is summation order."""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  cfg = small_config()
  model = DLRM(cfg, nnx.Rngs(3))
  rng = np.random.default_rng(4)
  dense = rng.normal(size=(6, cfg.num_dense))
  emb = rng.normal(size=(6, cfg.num_sparse, cfg.embedding_dim))
  weights = {".".join(map(str, k)): np.asarray(v[...], np.float64)
             for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  np.savez(tmp_path / "in.npz", dense=dense, emb=emb, bottom=cfg.bottom_mlp, top=cfg.top_mlp,
           **weights)
  peer_env.run_script(peer, _TORCHREC_DLRM, tmp_path, "torchrec")
  want = np.load(tmp_path / "out.npz")["logits"]
  np.testing.assert_allclose(np_dlrm(model, dense, emb), want, rtol=1e-10, atol=1e-10)
