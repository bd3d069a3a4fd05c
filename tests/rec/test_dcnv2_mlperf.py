"""The MLPerf Training DLRM-DCNv2 preset: shapes and parameter counts against the MLCommons
reference, the memory it needs (one 80 GB GPU in bf16, not in fp32), its --preset wiring,
the reference's dense Adagrad (and, peer-marked, against torch.optim.Adagrad), the run
settings reaching the task, and train steps on 8 simulated devices equal to 1 device at
reduced rows."""

from __future__ import annotations

import os
import subprocess

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from core import flops as flops_lib
from rec import configs, mlperf, train_lib
from rec.data import synthetic
from rec.data.batch import DataSpec
from rec.data.lookahead import LookaheadSource
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.models import dcnv2
from rec.models.dcnv2 import DCNv2, DCNv2Config
from tests.peer_env import RUN_CODE, peer_python

# From the MLCommons reference (training/recommendation_v2/torchrec_dlrm/README.MD, the
# run on the materialized multi-hot data set): --num_embeddings_per_feature,
# --multi_hot_sizes, --embedding_dim, --dense_arch_layer_sizes, --over_arch_layer_sizes,
# --dcn_num_layers, --dcn_low_rank_dim.
REF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282,
            10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108,
            36]
REF_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
REF_DIM, REF_DENSE_ARCH, REF_OVER_ARCH = 128, [512, 256, 128], [1024, 1024, 512, 256, 1]
REF_DCN_LAYERS, REF_DCN_RANK = 3, 512


def _torchrec_dense_params() -> int:
  """Parameters of TorchRec's DLRM_DCN dense part for the reference sizes: DenseArch MLP
  (Linear + bias per layer), LowRankCrossNet (per layer W [in, r], V [r, in], bias [in])
  over in = dense_out + 26 * dim, OverArch MLP then the final Linear."""
  sizes = [13] + REF_DENSE_ARCH
  dense = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
  x = REF_DENSE_ARCH[-1] + 26 * REF_DIM
  cross = REF_DCN_LAYERS * (2 * x * REF_DCN_RANK + x)
  sizes = [x] + REF_OVER_ARCH
  over = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
  return dense + cross + over


def test_preset_matches_the_reference():
  assert list(dcnv2.MLPERF_ROWS) == REF_ROWS
  assert list(synthetic.MLPERF_MULTI_HOT) == REF_MULTI_HOT
  cfg = DCNv2Config.mlperf()
  assert (cfg.num_dense, cfg.num_sparse, cfg.embedding_dim) == (13, 26, REF_DIM)
  assert list(cfg.bottom_mlp) == REF_DENSE_ARCH
  assert (cfg.num_cross_layers, cfg.cross_rank, cfg.structure) == (3, 512, "stacked")
  assert list(cfg.deep_mlp) + list(cfg.top_mlp) == REF_OVER_ARCH
  tables = cfg.tables()
  assert [t.num_rows for t in tables] == REF_ROWS and {t.dim for t in tables} == {128}
  assert [t.pooling_factor for t in tables] == REF_MULTI_HOT
  assert {t.pooling for t in tables} == {"sum"}
  # Parameter counts: ours against TorchRec's layer arithmetic.
  model = nnx.eval_shape(lambda: DCNv2(cfg, nnx.Rngs(0)))
  dense = flops_lib.count_params(model)
  assert dense == _torchrec_dense_params() == 16_044_545
  assert sum(t.num_rows * t.dim for t in tables) == sum(REF_ROWS) * 128 == 26_135_627_264


def test_preset_fits_one_80gb_gpu_in_bf16_and_shards_over_eight():
  """bf16 big tables + a row-wise Adagrad accumulator fit one 80 GB GPU (with room for the
  dense part and activations); float32 tables do not; 8 devices split them."""
  cfg = DCNv2Config.mlperf()
  tables = cfg.tables()
  assert [str(t.storage) == "bf16" for t in tables] == [r >= 2**20 for r in REF_ROWS]
  assert sum(str(t.storage) == "bf16" for t in tables) == 6
  opt = opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.005)
  total = sum(planner_lib.table_bytes(t, opt.state_bytes_per_row) for t in tables)
  assert 50e9 < total < 60e9                        # 53.4 GB: bf16 rows + 4 bytes per row
  budget = 70 * 2**30
  one = planner_lib.plan(tables, 1, budget, 65536,
                         optimizer_state_bytes_per_row=opt.state_bytes_per_row)
  assert planner_lib.estimate_plan(one, tables, 1, 65536, None,
                                   opt.state_bytes_per_row).max_memory_bytes <= budget
  fp32 = [t.__class__(**{**t.__dict__, "storage": "fp32"}) for t in tables]
  with pytest.raises(planner_lib.PlanError,
                     match=r"budget 75.16 GB \(75,161,927,680 bytes\): over by"):
    planner_lib.plan(fp32, 1, budget, 65536, optimizer_state_bytes_per_row=4)
  eight = planner_lib.plan(tables, 8, budget, 65536,
                           optimizer_state_bytes_per_row=opt.state_bytes_per_row)
  est = planner_lib.estimate_plan(eight, tables, 8, 65536, None, opt.state_bytes_per_row)
  assert est.max_memory_bytes < total / 2           # the 40M-row tables are spread out
  # What bench_dlrm --show_plan prints.
  text = mlperf.plans((1, 8))
  assert "26 tables on 1 device," in text[1] and "26 tables on 8 devices" in text[8]


def test_mlperf_rows_cap_and_preset_wiring():
  assert dcnv2.mlperf_rows(1000) == tuple(min(r, 1000) for r in REF_ROWS)
  with pytest.raises(ValueError, match="max_rows=0"):
    dcnv2.mlperf_rows(0)
  src = synthetic.SyntheticCriteo(8, dcnv2.mlperf_rows(1000), multi_hot=synthetic.MLPERF_MULTI_HOT)
  mcfg = configs.model_config(configs.make_run(model="dcnv2", preset="mlperf"), src.spec)
  assert mcfg.rows_per_feature == dcnv2.mlperf_rows(1000)
  assert mcfg == DCNv2Config.mlperf(dcnv2.mlperf_rows(1000), num_dense=13, num_sparse=26,
                                    feature_names=src.spec.sparse_features)
  assert {str(t.storage) for t in mcfg.tables()} == {"fp32"}        # no table reaches 2^20 rows
  assert src.spec.max_ids_per_bag == 100
  # --storage=bf16 still applies to every table; a data set of other width keeps working.
  avazu = DataSpec(num_dense=0, sparse_features=("a", "b"), rows_per_feature=(5, 2**21))
  a = configs.model_config(configs.make_run(model="dcnv2", preset="mlperf"), avazu)
  assert a.bottom_mlp == () and a.pooling_factors is None and a.table_storage == ("fp32", "bf16")
  with pytest.raises(ValueError, match="pooling_factors has 3 entries, expected one per"):
    DCNv2Config.criteo(10, pooling_factors=(1, 2, 3))


def test_build_run_applies_every_run_setting():
  """mlperf.build_run is configs.build_run on the MLPerf tables: a storage, the host tier's
  prefetch and the delayed FP8 recipe given to run_config reach the task (dropped, the
  tables would keep the preset's storage, the task prefetch nothing and the amax histories
  be left to the dense optimizer)."""
  cfg = mlperf.run_config(8, "data:1", memory_budget_gb=1.0, storage="fp32_cache:lru:0.5@host",
                          host_prefetch=True, fp8_layers="top_mlp.0", fp8_recipe="delayed")
  task, src, plan = mlperf.build_run(cfg, 64, jax.devices()[:1])
  assert task.host_prefetch and isinstance(src, LookaheadSource)
  assert {str(t.storage) for t in task.collection.tables} == {"fp32_cache:lru:0.5@host"}
  ref_task, _, _, ref_plan, _ = configs.build_run(cfg, jax.devices()[:1], sources=(src.src,) * 2)
  assert plan == ref_plan
  assert task.dense_tx.update.__qualname__ == ref_task.dense_tx.update.__qualname__ == (
      "with_fp8_history.<locals>.update")


def _grads(steps=4):
  """A small dense tree's gradients over `steps` steps: entries from 1e-4 to 1 (far below
  sqrt(0.1), where optax's accumulator start would shrink the step), and a zero."""
  rng = np.random.default_rng(3)
  out = []
  for _ in range(steps):
    g = {"w": (rng.standard_normal((3, 4)) * 10.0 ** rng.integers(-4, 1, (3, 4))),
         "b": rng.standard_normal(4) * 1e-3}
    g["w"][0, 0] = 0.0
    out.append(jax.tree.map(lambda x: x.astype(np.float32), g))
  return out


def test_mlperf_dense_optimizer_is_torch_adagrad():
  """The reference's dense optimizer is torch.optim.Adagrad(lr 0.005, initial_accumulator_value
  0, eps 1e-8): A += g^2, w -= lr * g / (sqrt(A) + eps). run_config chooses it, and its
  update is that formula (in float64 here); optax's adagrad (A from 0.1, eps inside the
  root) takes far smaller first steps on small gradients."""
  cfg = mlperf.run_config(8, "data:1")
  assert (cfg.train.dense_optimizer, cfg.train.learning_rate) == ("torch_adagrad", 0.005)
  assert (cfg.train.sparse_optimizer, cfg.train.embedding_learning_rate) == (
      "rowwise_adagrad", 0.005)
  lr, eps = mlperf.LEARNING_RATE, 1e-8
  params = {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}
  tx = train_lib.make_dense_optimizer(cfg.train.dense_optimizer, lr)
  p, state = params, tx.init(params)
  want = jax.tree.map(lambda x: x.astype(np.float64), params)
  acc = jax.tree.map(np.zeros_like, want)
  for g in _grads():
    updates, state = tx.update(g, state, p)
    p = optax.apply_updates(p, updates)
    acc = jax.tree.map(lambda a, x: a + np.float64(x) ** 2, acc, g)
    want = jax.tree.map(lambda w, x, a: w - lr * x / (np.sqrt(a) + eps), want, g, acc)
    # float32 arithmetic of one step: a few ulps of |w| <= 1 and of the step (<= lr)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-7), p, want)
  # The first step moves each weight by lr * g / (|g| + eps): lr wherever g != 0. optax's
  # adagrad moves it by lr * g / sqrt(0.1 + g^2 + 1e-7): under lr / 100 where |g| < 3e-3.
  g = np.array([[0, 1e-4, -3e-4, 1e-3], [-2e-3, 0.05, -0.3, 1.0], [2.0, -1e-4, 0, 5e-4]],
               np.float32)
  step = {name: np.abs(np.asarray(optax.apply_updates(params, t.update(
      {"w": g, "b": 0 * params["b"]}, t.init(params), params)[0])["w"]) - 1.0)
          for name, t in (("torch", tx), ("optax", optax.adagrad(lr)))}
  small = (g != 0) & (np.abs(g) < 3e-3)
  np.testing.assert_allclose(step["torch"][g != 0], lr, rtol=1e-3)   # eps / |g| <= 1e-4
  assert step["torch"][g == 0].max() == 0 and step["optax"][small].max() < lr / 100


_TORCH_ADAGRAD = r'''
import sys
import numpy as np, torch
inp = dict(np.load(sys.argv[1]))
ps = [torch.nn.Parameter(torch.from_numpy(inp["w"]).clone()),
      torch.nn.Parameter(torch.from_numpy(inp["b"]).clone())]
# the MLPerf DLRM-DCNv2 reference's dense optimizer (dlrm_main.py, --adagrad)
opt = torch.optim.Adagrad(ps, lr=float(inp["lr"]), lr_decay=0, weight_decay=0,
                          initial_accumulator_value=0, eps=1e-8)
for t in range(int(inp["steps"])):
    ps[0].grad, ps[1].grad = torch.from_numpy(inp[f"gw{t}"]), torch.from_numpy(inp[f"gb{t}"])
    opt.step()
np.savez(sys.argv[2], w=ps[0].detach().numpy(), b=ps[1].detach().numpy())
'''


@pytest.mark.peer
def test_torch_adagrad_matches_torch_optim_adagrad(tmp_path):
  """`--dense_optimizer=torch_adagrad` against torch.optim.Adagrad itself, as the MLPerf
  reference constructs it, over 4 steps."""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  grads, lr = _grads(), mlperf.LEARNING_RATE
  params = {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}
  np.savez(tmp_path / "in.npz", lr=lr, steps=len(grads), **params,
           **{f"g{k}{t}": g[k] for t, g in enumerate(grads) for k in g})
  r = subprocess.run([peer, *RUN_CODE, _TORCH_ADAGRAD, str(tmp_path / "in.npz"),
                      str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  torch_p = dict(np.load(tmp_path / "out.npz"))
  tx = train_lib.torch_adagrad(lr)
  p, state = params, tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, p)
    p = optax.apply_updates(p, updates)
  # both in float32, in their own order: a few ulps of |w| <= 1 per step
  for k in p:
    np.testing.assert_allclose(np.asarray(p[k]), torch_p[k], rtol=0, atol=1e-6, err_msg=k)


def _train(task, src, state, steps):
  step = jax.jit(task.train_step)
  losses = []
  for k in range(steps):
    state, metrics = step(state, task.device_batch(src.batch(k)))
    losses.append(float(metrics["loss"]))
  return state, losses


@pytest.mark.slow
def test_train_steps_eight_devices_equal_one():
  """The full MLPerf dense model at reduced rows (tables capped at 64 rows, the reference's
  bag sizes): 3 train steps on 8 devices with the planner's auto plan equal 1 device, in
  the loss, the dense parameters and every table. The dense part steps with optax's
  adagrad: the reference's torch_adagrad moves a weight by lr * g / (|g| + 1e-8), so on a
  gradient of float32 noise (|g| ~ 1e-8) the two sums' rounding differences become steps
  of a sizeable part of lr, which says nothing about the sharding."""
  runs = {}
  for mesh, devices in (("data:1", jax.devices()[:1]), ("data:8", None)):
    cfg = mlperf.run_config(32, mesh, memory_budget_gb=1.0, dense_optimizer="adagrad")
    runs[mesh] = mlperf.build_run(cfg, 64, devices)
  (task1, src1, _), (task8, src8, plan8) = runs["data:1"], runs["data:8"]
  assert len({p.kind for p in plan8.values()}) >= 2          # a real mix of shardings
  init1 = task1.init_state(0)
  host = jax.device_get({k: init1[k] for k in ("step", "params", "opt")})
  init8 = jax.device_put(host, NamedSharding(task8.mesh, jax.P()))
  init8["emb"] = task8.collection.from_tables(task1.collection.to_tables(init1["emb"]))
  state1, loss1 = _train(task1, src1, init1, 3)
  state8, loss8 = _train(task8, src8, init8, 3)
  assert np.all(np.isfinite(loss1)) and loss1[-1] != loss1[0]
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  p1, p8 = jax.device_get(state1["params"]), jax.device_get(state8["params"])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p8)):
    np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  t1, t8 = task1.collection.to_tables(state1["emb"]), task8.collection.to_tables(state8["emb"])
  t0 = task1.collection.to_tables(init1["emb"])
  for name in t1:
    np.testing.assert_allclose(t8[name], t1[name], rtol=2e-5, atol=2e-6, err_msg=name)
  assert all(np.any(t1[name] != t0[name]) for name in t1)     # every table trained


def _bag_size_runs():
  cfg = mlperf.run_config(16, "data:1", memory_budget_gb=1.0, dense_optimizer="adagrad")
  task, src, _ = mlperf.build_run(cfg, 64, jax.devices()[:1])
  return cfg, task, src


def test_bags_read_their_own_sizes():
  """The MLPerf source's bags hold 1 to 100 ids, padded to 100: the collection reads each
  table's own size (groups by bag size: 214 id slots per example instead of 26 x 100)."""
  _, task, src = _bag_size_runs()
  assert src.bag_sizes == dict(zip(src.spec.sparse_features, synthetic.MLPERF_MULTI_HOT))
  groups = task.collection.groups
  assert sum(g.bag * len(g.features) for g in groups.values()) == sum(REF_MULTI_HOT) == 214
  assert {g.bag for g in groups.values()} == set(REF_MULTI_HOT)
  # one-hot data keeps one group (no bag sizes: nothing is padded)
  assert synthetic.SyntheticCriteo(8, 100).bag_sizes == {}


@pytest.mark.slow
def test_bags_of_their_own_sizes_train_as_padded():
  """Reading each table's own bag size trains exactly as the padded layout, in the loss and
  every table (3 steps)."""
  cfg, task, src = _bag_size_runs()
  padded_src = synthetic.SyntheticCriteo(16, dcnv2.mlperf_rows(64),
                                         multi_hot=synthetic.MLPERF_MULTI_HOT)
  padded_src.bag_sizes = {}
  ref, _, _, _, _ = configs.build_run(cfg, jax.devices()[:1], sources=(padded_src,) * 2)
  assert [g.bag for g in ref.collection.groups.values()] == [None]
  init = task.init_state(0)
  init_ref = dict(init, emb=ref.collection.from_tables(task.collection.to_tables(init["emb"])))
  state, losses = _train(task, src, init, 3)
  state_ref, losses_ref = _train(ref, padded_src, init_ref, 3)
  assert losses[-1] != losses[0]
  np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
  tables, tables_ref = (task.collection.to_tables(state["emb"]),
                        ref.collection.to_tables(state_ref["emb"]))
  for name in tables_ref:
    np.testing.assert_allclose(tables[name], tables_ref[name], rtol=1e-5, atol=1e-7,
                               err_msg=name)
