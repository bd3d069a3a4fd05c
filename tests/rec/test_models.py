"""DCN-v2, DHEN and Wukong: forward passes against numpy references, gradients reaching
every parameter, preset sizes, the --model / --preset wiring, 8-device data parallel
equal to 1 device, and a train_rec run."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from core import flops as flops_lib
from rec import configs
from rec.data.batch import DataSpec
from rec.models.dcnv2 import DCNv2, DCNv2Config
from rec.models.dhen import DHEN, DHENConfig
from rec.models.dlrm import DLRMConfig
from rec.models.wukong import SCALING_LADDER, Wukong, WukongConfig
from tests import cpu_env
from tests import forkserver
from tests import peer_env
from tests.peer_env import peer_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# float32 models against float64 numpy: sums of <= 21 terms through <= 12 layers (layer
# norms included) on O(1) values; the rounding of such sums grows like sqrt(terms * layers)
# * 2^-24 of the terms' size, about 1e-6 (seen: 1.6e-7 absolute, 1.3e-6 relative), in any
# summation order. A wrong or missing term of the model moves outputs far more.
TOL = dict(rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------------- numpy reference

def _np(p):
  return np.asarray(p[...], np.float64)


def np_mlp(mlp, x, activate_last):
  for i, layer in enumerate(mlp.layers):
    x = x @ _np(layer.kernel) + _np(layer.bias)
    if i < len(mlp.layers) - 1 or activate_last:
      x = np.maximum(x, 0.0)
  return x


def np_layer_norm(x, norm, eps=1e-6):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * _np(norm.scale) + _np(norm.bias)


def np_compress(x_BND, lc):
  return np.einsum("bnd,nm->bmd", x_BND, _np(lc.kernel))


def np_dcnv2(model, dense, emb):
  cfg = model.config
  d = np_mlp(model.bottom_mlp, dense, True) if model.bottom_mlp is not None else dense
  x0 = np.concatenate([d, emb.reshape(len(emb), -1)], axis=1)
  x = x0
  for layer in model.cross.layers:
    w = _np(layer.kernel) if layer.rank is None else _np(layer.down) @ _np(layer.up)
    x = x0 * (x @ w + _np(layer.bias)) + x
  if cfg.structure == "stacked":
    h = np_mlp(model.deep_mlp, x, True) if model.deep_mlp is not None else x
  else:
    h = np.concatenate([x, np_mlp(model.deep_mlp, x0, True)], axis=1)
  return np_mlp(model.top_mlp, h, False)[:, 0]


def np_dhen(model, dense, emb):
  """DHEN with 'dot' (AdvancedDLRM) and 'linear' modules, written out with loops."""
  cfg = model.config
  x = np.concatenate([np_mlp(model.bottom_mlp, dense, False)[:, None], emb], axis=1)
  for layer in model.layers:
    outs = []
    for module in layer.interactions:
      if module.kind == "dot":
        n = x.shape[1]
        pairs = np.stack([np.einsum("bd,bd->b", x[:, i], x[:, j])
                          for i in range(n) for j in range(i)], axis=1)
        outs.append(np_mlp(module.inner.proj, pairs, False).reshape(len(x), cfg.width, -1))
      else:
        assert module.kind == "linear"
        outs.append(np_compress(x, module.inner))
    if cfg.ensemble == "concat":
      y = np.concatenate(outs, axis=1)
    else:
      w = _np(layer.weights) if cfg.ensemble == "weighted_sum" else np.ones(len(outs))
      y = sum(wi * o for wi, o in zip(w, outs))
    skip = x if layer.shortcut is None else np_compress(x, layer.shortcut)
    x = np_layer_norm(y + skip, layer.norm)
  return np_mlp(model.top_mlp, x.reshape(len(x), -1), False)[:, 0]


def np_wukong(model, dense, emb):
  cfg = model.config
  b = len(emb)
  d = np_mlp(model.bottom_mlp, dense, False).reshape(b, cfg.num_dense_embeddings, -1)
  x = np.concatenate([d, emb], axis=1)
  for layer in model.layers:
    y = _np(layer.fmb.fm.projection)
    fm = np.stack([x[i] @ x[i].T @ y for i in range(b)]).reshape(b, -1)
    f = np_mlp(layer.fmb.mlp, np_layer_norm(fm, layer.fmb.norm), False).reshape(b, cfg.num_fm, -1)
    lcb = np_compress(x, layer.lcb)
    skip = x if layer.residual is None else np_compress(x, layer.residual)
    x = np_layer_norm(np.concatenate([f, lcb], axis=1) + skip, layer.norm)
  return np_mlp(model.top_mlp, x.reshape(b, -1), False)[:, 0]


def _inputs(cfg, batch=4, seed=0):
  rng = np.random.default_rng(seed)
  dense = rng.normal(size=(batch, cfg.num_dense)).astype(np.float32)
  emb = (rng.normal(size=(batch, cfg.num_sparse, cfg.embedding_dim)) * 0.5).astype(np.float32)
  return dense, emb


def _build(cls, cfg, seed=0):
  """cls(cfg) with every Param drawn from numpy: shapes from nnx.eval_shape, so no init
  program is compiled (that compile costs seconds per model on CPU)."""
  model = nnx.eval_shape(lambda: cls(cfg, nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for _, p in nnx.iter_graph(model):
    if isinstance(p, nnx.Param):
      std = 1.0 / np.sqrt(p.shape[0]) if len(p.shape) >= 2 else 0.5
      p.set_value(jnp.asarray(rng.normal(size=p.shape) * std, jnp.float32))
  return model


def _check_forward(model, ref):
  dense, emb = _inputs(model.config)
  got = nnx.jit(lambda m, d, e: m(d, e))(model, jnp.asarray(dense), jnp.asarray(emb))
  assert got.dtype == jnp.float32 and got.shape == (4,)
  np.testing.assert_allclose(got, ref(model, dense.astype(np.float64), emb.astype(np.float64)), **TOL)


# ---------------------------------------------------------------------------- forward

SMALL = dict(num_dense=3, num_sparse=4, embedding_dim=4, rows_per_feature=(7, 8, 9, 10))


@pytest.mark.parametrize("structure,rank", [("stacked", 0), ("parallel", 3)])
def test_dcnv2_forward_matches_numpy(structure, rank):
  cfg = DCNv2Config(**SMALL, bottom_mlp=(6, 5), num_cross_layers=2, cross_rank=rank,
                    deep_mlp=(7,), structure=structure, top_mlp=(5, 1))
  assert cfg.cross_dim == 5 + 4 * 4
  _check_forward(_build(DCNv2, cfg), np_dcnv2)


@pytest.mark.parametrize("ensemble", ["concat", "sum", "weighted_sum"])
def test_dhen_forward_matches_numpy(ensemble):
  cfg = DHENConfig(**SMALL, bottom_mlp=(6, 4), layers=(("dot", "linear"),) * 2, width=3,
                   ensemble=ensemble, top_mlp=(5, 1))
  model = _build(DHEN, cfg)
  if ensemble == "concat":
    # N_0 = 5 -> 6 (the shortcut projects) -> 6 (identity shortcut)
    assert cfg.layer_sizes() == [(5, 6), (6, 6)]
    assert model.layers[0].shortcut is not None and model.layers[1].shortcut is None
  else:
    assert cfg.layer_sizes() == [(5, 3), (3, 3)]
  _check_forward(model, np_dhen)


@pytest.mark.parametrize("layers,n_fm,n_lcb", [(2, 3, 2), (1, 4, 2)])
def test_wukong_forward_matches_numpy(layers, n_fm, n_lcb):
  # bottom ends at 8 = 2 * D: two dense embeddings; N_0 = 6 = n_F + n_L for (4, 2): identity residual.
  cfg = WukongConfig(**SMALL, bottom_mlp=(6, 8), num_layers=layers, num_fm=n_fm, num_lcb=n_lcb,
                     fm_rank=3, fm_mlp=(7,), top_mlp=(5, 1))
  model = _build(Wukong, cfg)
  assert cfg.num_inputs == 6
  assert (model.layers[0].residual is None) == (n_fm + n_lcb == 6)
  _check_forward(model, np_wukong)


# TorchRec's DLRM_DCN parts (the MLPerf DLRM-DCNv2 model): DenseArch (ReLU after every
# layer), InteractionDCNArch over LowRankCrossNet (x0 = [dense, embeddings]), OverArch (ReLU
# MLP, then a linear layer to the logit); kernels [in, out] here, torch's weights [out, in].
_TORCHREC_DCN = r'''
import sys
import numpy as np, torch
from torchrec.models.dlrm import DenseArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet
z = dict(np.load(sys.argv[1]))
T = lambda k: torch.tensor(z[k], dtype=torch.float64)
bottom, deep, layers, rank = (list(z[k]) for k in ("bottom", "deep", "layers", "rank"))
F, D = z["emb"].shape[1:]
dense_arch = DenseArch(z["dense"].shape[1], [int(s) for s in bottom]).double()
cross = LowRankCrossNet((F + 1) * D, int(layers[0]), int(rank[0])).double()
over = OverArch((F + 1) * D, [int(s) for s in deep] + [1]).double()
lin = lambda m: [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
with torch.no_grad():
  names = ([f"bottom_mlp.layers.{i}" for i in range(len(bottom))]
           + [f"deep_mlp.layers.{i}" for i in range(len(deep))] + ["top_mlp.layers.0"])
  for layer, name in zip(lin(dense_arch) + lin(over), names):
    layer.weight.copy_(T(name + ".kernel").T)
    layer.bias.copy_(T(name + ".bias"))
  for l in range(int(layers[0])):
    cross.V_kernels[l].copy_(T(f"cross.layers.{l}.down").T)
    cross.W_kernels[l].copy_(T(f"cross.layers.{l}.up").T)
    cross.bias[l].copy_(T(f"cross.layers.{l}.bias"))
  x = InteractionDCNArch(F, cross)(dense_arch(T("dense")), T("emb"))
  np.savez(sys.argv[2], logits=over(x)[:, 0].numpy())
'''


@pytest.mark.peer
def test_dcnv2_matches_torchrec_dlrm_dcn(tmp_path):
  """Our stacked low-rank DCN-v2 with the bottom MLP ending at D is TorchRec's DLRM_DCN:
  the same weights give the same logits. Both sides in float64 (the peer in torch, ours in
  the numpy reference np_dcnv2, checked against the model above), so 1e-10 is summation order."""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  cfg = DCNv2Config(**SMALL, bottom_mlp=(6, 4), num_cross_layers=2, cross_rank=3,
                    deep_mlp=(7, 5), top_mlp=(1,))
  model = _build(DCNv2, cfg)   # random non-zero biases, so a missed bias copy shows
  dense, emb = _inputs(cfg)
  weights = {".".join(map(str, k)): np.asarray(v[...], np.float64)
             for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  np.savez(tmp_path / "in.npz", dense=dense.astype(np.float64), emb=emb.astype(np.float64),
           bottom=cfg.bottom_mlp, deep=cfg.deep_mlp, layers=[2], rank=[3], **weights)
  peer_env.run_script(peer, _TORCHREC_DCN, tmp_path, "torchrec")
  want = np.load(tmp_path / "out.npz")["logits"]
  np.testing.assert_allclose(np_dcnv2(model, dense.astype(np.float64), emb.astype(np.float64)),
                             want, rtol=1e-10, atol=1e-10)
  _check_forward(model, lambda m, d, e: want)


SPEC = DataSpec(num_dense=13, sparse_features=tuple(f"C{i}" for i in range(1, 27)),
                rows_per_feature=(50,) * 26)


# ---------------------------------------------------------------------------- presets

def test_wukong_criteo_preset_parameter_count():
  cfg = WukongConfig.criteo(1000, layers=2, n_fm=8, n_lcb=8)
  assert cfg.num_dense_embeddings == 2 and cfg.layer_sizes() == [(28, 16), (16, 16)]
  assert all(t.dim == 128 for t in cfg.tables())

  def mlp(*sizes):
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))

  def layer(n):   # Y, FMB LN, FMB MLP, LCB, residual, layer LN
    return (n * 24 + 2 * n * 24 + mlp(n * 24, 512, 512, 8 * 128) + n * 8
            + (n * 16 if n != 16 else 0) + 2 * 128)

  want = mlp(13, 512, 256) + layer(28) + layer(16) + mlp(16 * 128, 512, 512, 1)
  model = nnx.eval_shape(lambda: Wukong(cfg, nnx.Rngs(0)))
  assert flops_lib.count_params(model) == want
  # The ladder grows: every rung has more parameters than the one before.
  counts = [flops_lib.count_params(nnx.eval_shape(lambda: Wukong(WukongConfig.scaled(10, i),
                                                                 nnx.Rngs(0))))
            for i in range(len(SCALING_LADDER))]
  assert counts == sorted(counts) and len(set(counts)) == len(counts)


def test_dhen_and_dcnv2_presets():
  for n, make in ((2, DHENConfig.dhen_2l), (4, DHENConfig.dhen_4l), (8, DHENConfig.dhen_8l)):
    cfg = make(1000)
    assert cfg.layers == (("dot", "linear"),) * n and cfg.ensemble == "concat"
    assert cfg.layer_sizes()[0] == (27, 32) and cfg.layer_sizes()[-1] == (32, 32)
  dcn = DCNv2Config.criteo(1000)
  assert dcn.cross_dim == 128 + 26 * 128
  model = nnx.eval_shape(lambda: DCNv2(dcn, nnx.Rngs(0)))
  cross = 3 * (2 * dcn.cross_dim * 512 + dcn.cross_dim)
  assert flops_lib.count_params(model.cross) == cross


def test_config_errors_name_the_bad_value():
  with pytest.raises(ValueError, match=r"bottom_mlp=\(6, 5\) must end at a multiple of embedding_dim=4"):
    WukongConfig(**SMALL, bottom_mlp=(6, 5))
  with pytest.raises(ValueError, match=r"layer 0 has unknown interaction\(s\) \['dott'\]"):
    DHENConfig(**SMALL, bottom_mlp=(4,), layers=(("dott",),))
  with pytest.raises(ValueError, match="expected a tuple of tuples"):
    DHENConfig(**SMALL, bottom_mlp=(4,), layers=("dot", "linear"))
  with pytest.raises(ValueError, match="'parallel' needs a deep_mlp"):
    DCNv2Config(**SMALL, structure="parallel")
  with pytest.raises(ValueError, match=r"top_mlp=\(4,\) must end at 1"):
    DCNv2Config(**SMALL, top_mlp=(4,))
  with pytest.raises(ValueError, match=r"ensemble='mean'"):
    DHENConfig(**SMALL, bottom_mlp=(4,), ensemble="mean")
  model = _build(Wukong, WukongConfig(**SMALL, bottom_mlp=(4,), fm_mlp=(), top_mlp=(1,)))
  with pytest.raises(ValueError, match=r"emb_BFD shape \(2, 4, 5\), expected \[B, 4, 4\]"):
    model(jnp.ones((2, 3)), jnp.ones((2, 4, 5)))


# ---------------------------------------------------------------------------- --model / --preset

def test_model_presets_wiring():
  rows = SPEC.rows_per_feature
  # DLRM's default is unchanged: the reference Kaggle config.
  assert configs.model_config(configs.make_run(), SPEC) == DLRMConfig.criteo_kaggle(
      rows, num_dense=13, num_sparse=26, feature_names=SPEC.sparse_features)
  w = configs.model_config(configs.make_run(model="wukong", preset="l3_n16"), SPEC)
  assert (w.num_layers, w.num_fm, w.num_lcb, w.fm_rank, w.embedding_dim) == (3, 16, 16, 24, 128)
  s = configs.model_config(configs.make_run(model="wukong", preset="scaled2"), SPEC)
  assert (s.num_layers, s.num_fm, s.fm_rank, s.fm_mlp) == (2, 16, 24, (1024, 1024))
  d = configs.model_config(configs.make_run(model="dhen", preset="dhen_4l"), SPEC)
  assert len(d.layers) == 4
  # --embedding_dim reaches the tables; bottom MLPs that feed embeddings follow it.
  for model, preset in (("dlrm", "kaggle"), ("dcnv2", "kaggle"), ("dhen", "small"),
                        ("wukong", "kaggle")):
    cfg = configs.make_run(model=model, preset=preset, embedding_dim=32)
    mcfg = configs.model_config(cfg, SPEC)
    _, tables, _ = configs.build_model_fn(cfg, SPEC)
    assert mcfg.embedding_dim == 32 and {t.dim for t in tables} == {32}, model
  assert configs.model_config(configs.make_run(model="wukong", embedding_dim=32),
                              SPEC).num_dense_embeddings == 2
  # No dense features (Avazu): no bottom MLP.
  avazu = DataSpec(num_dense=0, sparse_features=("a", "b", "c"), rows_per_feature=(5, 6, 7))
  for model in ("dcnv2", "dhen", "wukong"):
    mcfg = configs.model_config(configs.make_run(model=model, preset="small"), avazu)
    assert mcfg.bottom_mlp == () and mcfg.feature_names == ("a", "b", "c")
  with pytest.raises(ValueError, match=r"--preset='terabyte' for --model=wukong: expected one of"):
    configs.model_config(configs.make_run(model="wukong", preset="terabyte"), SPEC)
  with pytest.raises(ValueError, match=r"--model='xdeepfm'"):
    configs.model_config(configs.make_run(model="xdeepfm"), SPEC)


@pytest.mark.parametrize("model,preset,msg", [
    ("wukong", "scaled9", r"WukongConfig\.scaled: size_index=9, expected 0\.\.7"),
    ("wukong", "l0_n8", r"WukongConfig: num_layers=0"),
    ("dlrm", "w0", r"DLRMConfig: bottom_mlp=\(0, 16\), top_mlp=\(0, 0, 1\); expected positive"),
    ("dcnv2", "x0_r0_w8", r"DCNv2Config: num_cross_layers=0")])
def test_size_pattern_errors_name_the_flag(model, preset, msg):
  """A size pattern's numbers come from --preset: its errors say so."""
  with pytest.raises(ValueError, match=rf"^--preset='{preset}' for --model={model}: {msg}"):
    configs.model_config(configs.make_run(model=model, preset=preset), SPEC)


# ---------------------------------------------------------------------------- data parallel

def _task(model_name, mesh, devices=None):
  cfg = configs.make_run(model=model_name, preset="small", num_rows=100, mesh=mesh,
                             batch_size=16, eval_batch_size=16, eval_batches=1, sharding="dp")
  task, train_src, _, _, _ = configs.build_run(cfg, devices)
  return task, train_src


def _train(task, train_src, state, steps=2):
  step = jax.jit(task.train_step)
  losses = []
  for _, batch in zip(range(steps), train_src.batches(0)):
    state, metrics = step(state, task.device_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, losses


@pytest.mark.devices(8)
@pytest.mark.parametrize("model_name", ["dcnv2", "dhen", "wukong"])
def test_train_steps_eight_devices_equal_one(model_name):
  """Train steps through configs.build_run / RecTask (as train_rec runs them): 8-way data
  parallel equals 1 device from the same initial state, and a gradient reaches every
  dense parameter (each one moved)."""
  task1, src1 = _task(model_name, "data:1", jax.devices()[:1])
  task8, src8 = _task(model_name, "data:8")
  # Dense parameters drawn on the host (no init program is compiled: that compile costs
  # seconds per model on CPU): kernels random, biases 0 and other vectors (norm scales) 1
  # as flax initializes them; the dense optimizer's own initial state and the tables of
  # collection.init; the same state placed on both meshes (init_state's placement: dense
  # state replicated under REC_RULES).
  abstract = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(task1.model_fn(nnx.Rngs(0)))))
  rng = np.random.default_rng(0)

  def draw(path, p):
    if len(p.shape) >= 2:
      return (rng.normal(size=p.shape) / np.sqrt(np.prod(p.shape[:-1]))).astype(p.dtype)
    bias = jax.tree_util.keystr(path).endswith("['bias']")
    return np.full(p.shape, 0.0 if bias else 1.0, p.dtype)

  params = jax.tree_util.tree_map_with_path(draw, abstract)
  host = jax.device_get({"step": np.zeros((), np.int32), "params": params,
                         "opt": task1.dense_tx.init(params)})
  init1 = jax.device_put(host, NamedSharding(task1.mesh, jax.P()))
  init1["emb"] = task1.collection.init(jax.random.key(1))
  init8 = jax.device_put(host, NamedSharding(task8.mesh, jax.P()))
  init8["emb"] = task8.collection.from_tables(task1.collection.to_tables(init1["emb"]))
  state1, loss1 = _train(task1, src1, init1)
  state8, loss8 = _train(task8, src8, init8)
  assert np.all(np.isfinite(loss1)) and loss1[-1] != loss1[0]
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  p1, p8 = jax.device_get(state1["params"]), jax.device_get(state8["params"])
  for (path, a), b, a0 in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p8),
                              jax.tree.leaves(host["params"])):
    where = jax.tree_util.keystr(path)
    assert np.all(np.isfinite(a)) and np.any(a != a0), f"no gradient reached {where}"
    np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6, err_msg=where)
  leaf = jax.tree.leaves(state8["params"])[0]
  assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8
  # What train_rec prints at start-up.
  stats = configs.model_stats(task1, src1.spec, batch=8)
  assert stats["dense_params"] == sum(x.size for x in jax.tree.leaves(host["params"]))
  assert stats["embedding_params"] == sum(t.num_rows * t.dim for t in task1.collection.tables)
  assert 0 < stats["gflops_per_example"] < 1e-2


# ---------------------------------------------------------------------------- train_rec

def test_train_rec_runs_and_reports_size(tmp_path):
  # The CLI path once (the cheapest model to compile); the step tests above cover each model.
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  args = ["--model=dcnv2", "--preset=small", "--num_rows=100", "--batch_size=32",
          "--eval_batch_size=32", "--eval_batches=1", "--steps=2", "--log_every=1",
          "--mesh=data:8", f"--workdir={tmp_path}"]
  out = forkserver.run([sys.executable, "-m", "experiments.train_rec", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  summary = json.loads(lines[-1])
  assert summary["model"] == "dcnv2" and summary["steps"] == 2
  model_fn, _, _ = configs.build_model_fn(
      configs.make_run(model="dcnv2", preset="small", num_rows=100), SPEC)
  dense = flops_lib.count_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
  assert summary["dense_params"] == dense
  assert summary["embedding_params"] == 26 * 100 * 16
  assert summary["gflops_per_example"] > 0
  assert any(l.startswith(f"params: dense {dense:,} + embedding {26 * 100 * 16:,}") for l in lines)
