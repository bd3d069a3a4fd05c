"""Our Wukong (rec.models.wukong) against FuxiCTR's WuKong layers with the same weights.

experiments/peers/fuxictr_wukong.py runs FuxiCTR's own `WuKongLayer` and `MLP_Block` in a
PyTorch environment outside the project; this test writes our weights and an input X_0
there and compares, per layer, the optimized FM, FMB, LCB and layer outputs and the logits.
Skipped unless that environment exists: FUXICTR_PEER_PYTHON (default: bin/python of the
Python 3.11 peer environment, experiments/peers/README.md, with torch and fuxictr, at
../peer311 or ../peer beside the checkout) and FUXICTR_WUKONG_SRC (FuxiCTR's
model_zoo/WuKong/src/WuKong.py; default: fuxictr_model_zoo/WuKong.py in that environment).
"""

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rec.models.wukong import Wukong, WukongConfig
from tests.peer_env import RUN_CODE, peer_python

REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PEER = peer_python("FUXICTR_PEER_PYTHON")   # the Python 3.11 peer environment's interpreter
PEER_ENV = os.path.dirname(os.path.dirname(PEER))
SRC = os.environ.get("FUXICTR_WUKONG_SRC",
                     os.path.join(PEER_ENV, "fuxictr_model_zoo", "WuKong.py"))
SCRIPT = os.path.join(REPO, "experiments", "peers", "fuxictr_wukong.py")


# Marked peer: the peer process imports torch and fuxictr (tens of seconds on a shared CPU).
pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(not (os.path.exists(PEER) and os.path.exists(SRC)),
                                 reason=f"FuxiCTR peer env absent ({PEER}, {SRC})")]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
  r = subprocess.run([PEER, *RUN_CODE, "import torch, fuxictr.pytorch.layers"], capture_output=True,
                     text=True, timeout=300)
  if r.returncode != 0:
    pytest.skip(f"{PEER} cannot import torch and fuxictr: {r.stderr.strip()[-300:]}")
  # Layer 0 maps 6 -> 5 embeddings (residual projection), layer 1 5 -> 5 (identity).
  cfg = WukongConfig(num_dense=0, num_sparse=6, embedding_dim=8, rows_per_feature=(10,) * 6,
                     num_layers=2, num_fm=3, num_lcb=2, fm_rank=4, fm_mlp=(16, 12),
                     top_mlp=(16, 1), fm_output_relu=True)
  model = Wukong(cfg, nnx.Rngs(0))
  # Biases are drawn non-zero so that a missed bias copy shows.
  x_BND = np.asarray(jax.random.normal(jax.random.key(1), (5, 6, 8)), np.float32)
  ours = {}
  h = jnp.asarray(x_BND)
  for i, layer in enumerate(model.layers):
    fm = layer.fmb.fm(h)
    ours[f"fm.{i}"] = np.asarray(fm.reshape(fm.shape[0], -1))
    ours[f"fmb.{i}"] = np.asarray(layer.fmb(h))
    ours[f"lcb.{i}"] = np.asarray(layer.lcb(h))
    h = layer(h)
    ours[f"layer.{i}"] = np.asarray(h)
  ours["logits"] = np.asarray(model(None, jnp.asarray(x_BND)))
  weights = {}
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    weights["w:" + ".".join(str(p) for p in path)] = np.asarray(v[...])
  sizes = dict(num_inputs=cfg.num_inputs, embedding_dim=8, num_layers=2, num_fm=3, num_lcb=2,
               fm_rank=4, fm_mlp=list(cfg.fm_mlp), top_mlp=list(cfg.top_mlp))
  d = tmp_path_factory.mktemp("fuxictr")
  np.savez(d / "in.npz", x_BND=x_BND, sizes_json=json.dumps(sizes), **weights)
  r = subprocess.run([PEER, SCRIPT, "--wukong_src", SRC, "--inputs", str(d / "in.npz"),
                      "--outputs", str(d / "out.npz")], capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  peer = dict(np.load(d / "out.npz"))
  return ours, peer


@pytest.mark.parametrize("name", ["fm.0", "fmb.0", "lcb.0", "layer.0", "fm.1", "fmb.1",
                                  "lcb.1", "layer.1", "logits"])
def test_equal_to_fuxictr(compared, name):
  ours, peer = compared
  assert ours[name].shape == peer[name].shape, (ours[name].shape, peer[name].shape)
  scale = max(1.0, float(np.abs(peer[name]).max()))
  np.testing.assert_allclose(ours[name], peer[name], rtol=1e-5, atol=2e-5 * scale)


def test_outputs_not_trivial(compared):
  # Equality of zeros would prove nothing: the FMB after its ReLU, the layers and logits
  # must carry signal.
  ours, _ = compared
  for name in ("fmb.0", "layer.1", "logits"):
    assert np.abs(ours[name]).max() > 1e-3 and np.std(ours[name]) > 1e-3, name


def test_side_by_side_training_learns(tmp_path):
  # Both sides trained on the same 30 batches of planted-signal data: finite losses that
  # fall, and eval AUC well above chance on the same eval examples.
  from experiments.wukong_scaling import fuxictr
  from rec import configs
  r = subprocess.run([PEER, *RUN_CODE, "import torch, fuxictr.pytorch.layers"], capture_output=True,
                     text=True, timeout=300)
  if r.returncode != 0:
    pytest.skip(f"{PEER} cannot import torch and fuxictr: {r.stderr.strip()[-300:]}")
  cfg = configs.make_run(model="wukong", preset="small", data="synthetic_deep", num_rows=20,
                             batch_size=256, eval_batch_size=1024,
                             eval_batches=2, dense_optimizer="adam", learning_rate=1e-3,
                             sparse_optimizer="adagrad", embedding_learning_rate=0.1)
  res = fuxictr.side_by_side(cfg, [0], str(tmp_path), peer_python=PEER, peer_src=SRC, steps=30,
                             log_every=10, threads=1)
  assert res["data"] == {"train_examples": 30 * 256, "eval_examples": 2 * 1024}
  for row in res["rows"]:
    loss = [l for _, l in row["curve"]]
    assert len(loss) == 3 and np.all(np.isfinite(loss)), row
    assert loss[-1] < loss[0] - 0.02, (row["side"], loss)
    assert row["auc"] > 0.65 and np.isfinite(row["ne"]), row
  # FuxiCTR's examples/s is over the steps after the first, as ours (whose first compiles).
  out = np.load(tmp_path / "fuxictr_s0.npz")
  assert int(out["timed_steps"]) == 29
  np.testing.assert_allclose(float(out["examples_per_sec"]),
                             29 * 256 / float(out["train_seconds"]), rtol=1e-12)
