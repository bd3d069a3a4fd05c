"""The shared train loop: exact resume, data parallel on 8 devices equals 1 device, run
settings checked on resume, optimizer settings validated, non-finite steps stopped or skipped."""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import checkpoint as ckpt_lib
from core import mesh as mesh_lib
from core import train as train_lib
from llm import train_lib as lm_train_lib
from rec import configs
from rec.embedding import optimizers as opt_lib


def _cfg(**kw):
  base = dict(model="dlrm", preset="small", data="synthetic", num_rows=1000, mesh="-1",
              batch_size=64, eval_batch_size=64, eval_batches=2, sharding="dp")
  base.update(kw)
  return configs.make_run(**base)


def _train(cfg, workdir, steps=20, devices=None, **loop):
  task, train_src, eval_src, _, _ = configs.build_run(cfg, devices)
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                        train_lib.TrainConfig(workdir=str(workdir), steps=steps, log_every=5,
                                              tensorboard=False, **loop))
  return task, out


def _leaves(task, state):
  return {"params": jax.tree.leaves(jax.device_get(state["params"])),
          "opt": jax.tree.leaves(jax.device_get(state["opt"])),
          "tables": task.collection.to_tables(state["emb"]),
          "emb_opt": jax.tree.leaves(jax.device_get({k: v["opt"] for k, v in state["emb"].items()})),
          "step": int(state["step"])}


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f) if r["split"] == "train"]


def test_resume_is_bit_exact(tmp_path):
  cfg = _cfg(mesh="data:2,model:4", sharding="tw")
  task, straight = _train(cfg, tmp_path / "a", eval_every=10)
  _, first = _train(cfg, tmp_path / "b", eval_every=10, stop_at_step=10)
  assert first["step"] == 10 and not first["finished"]
  with pytest.raises(ValueError, match="already holds a checkpoint at step 10"):
    _train(cfg, tmp_path / "b", eval_every=10)
  task_b, resumed = _train(cfg, tmp_path / "b", eval_every=10, resume=True)
  assert resumed["step"] == 20 and resumed["finished"]
  a, b = _leaves(task, straight["state"]), _leaves(task_b, resumed["state"])
  assert a["step"] == b["step"] == 20
  for key in ("params", "opt", "emb_opt"):
    for x, y in zip(a[key], b[key]):
      np.testing.assert_array_equal(x, y)
  for n in a["tables"]:
    np.testing.assert_array_equal(a["tables"][n], b["tables"][n])
  assert straight["eval"] == resumed["eval"]
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")   # same batches, same losses
  # Resuming a finished run changes nothing and records nothing new.
  _, again = _train(cfg, tmp_path / "b", eval_every=10, resume=True)
  assert again["step"] == 20 and again["eval"] == resumed["eval"]
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
  # It trained: the loss moved and the tables changed.
  losses = [l for _, l in _losses(tmp_path / "a")]
  assert losses[-1] != losses[0]


# Row-wise Adagrad keeps one accumulator per row per column chunk under cw (as TorchRec
# does), and the planner picks cw for some tables, so "auto" runs with element-wise Adagrad.
# "auto" mixes kinds in one run; single kinds are slow-marked here, each kind and optimizer
# being checked against one device by tests/rec/test_embedding_collection.py.
@pytest.mark.parametrize("sharding,sparse_optimizer", [
    pytest.param("dp", "rowwise_adagrad", marks=pytest.mark.slow),
    pytest.param("tw", "rowwise_adagrad", marks=pytest.mark.slow), ("auto", "adagrad")])
def test_eight_devices_equal_one(tmp_path, sharding, sparse_optimizer):
  one = jax.devices()[:1]
  kw = dict(sharding=sharding, sparse_optimizer=sparse_optimizer)
  task1, out1 = _train(_cfg(mesh="data:1", **kw), tmp_path / "one", steps=8, devices=one)
  task8, out8 = _train(_cfg(mesh="data:8", **kw), tmp_path / "eight", steps=8)
  assert task8.collection.num_devices == 8
  a, b = _leaves(task1, out1["state"]), _leaves(task8, out8["state"])
  # Embedding optimizer state is stored in the device layout, comparable only under dp.
  for key in ("params", "opt") + (("emb_opt",) if sharding == "dp" else ()):
    for x, y in zip(a[key], b[key]):
      np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
  # Tables hold values near 0.03 moved by steps of lr = 0.05; the 8-device reduction order
  # differs from 1 device's, which Adagrad's 1/sqrt(accumulator) can amplify to a few 1e-6.
  for n in a["tables"]:
    np.testing.assert_allclose(a["tables"][n], b["tables"][n], rtol=2e-5, atol=1e-5)
  for k in ("auc", "logloss"):
    assert out1["eval"][k] == pytest.approx(out8["eval"][k], rel=1e-5)


# --- run settings: stored with the checkpoint, compared on resume


class _NotBuilt:
  """A task whose state must never be built: a settings error has to come first."""

  def __getattr__(self, name):
    raise AssertionError(f"the task was used ({name}) before the settings were checked")


def _settings(cfg):
  return cfg.flat_settings()


def test_resume_with_other_settings_is_one_error(tmp_path):
  cfg = _cfg(mesh="data:8")
  _train(cfg, tmp_path, steps=6, settings=_settings(cfg))
  other = configs.replace_run(cfg, num_rows=2000, data="synthetic_deep", learning_rate=0.01)
  loop = train_lib.TrainConfig(workdir=str(tmp_path), steps=12, eval_every=3, log_every=2,
                               resume=True, settings=_settings(other), changeable=("eval_batch_size",),
                               tensorboard=False)
  with pytest.raises(train_lib.RunSettingsError) as e:
    train_lib.train(_NotBuilt(), None, None, loop)
  msg = str(e.value)
  assert "  data: 'synthetic' (checkpoint) -> 'synthetic_deep' (now)" in msg
  assert "  learning_rate: 0.05 (checkpoint) -> 0.01 (now)" in msg
  assert "  num_rows: 1000 (checkpoint) -> 2000 (now)" in msg
  assert msg.count("(checkpoint) ->") == 3          # steps, eval_every differ too: allowed
  assert "--resume_allow=data,learning_rate,num_rows" in msg
  allowed = msg.split("Settings that may change on resume: ")[1]
  for k in ("steps", "eval_every", "checkpoint_every", "log_every", "stop_at_step", "workdir",
            "eval_batch_size"):
    assert k in allowed
  # Without --resume: how to resume or overwrite.
  with pytest.raises(train_lib.RunSettingsError, match=r"a finished run of 6 steps\); pass "
                     r"--resume .* --overwrite"):
    train_lib.train(_NotBuilt(), None, None, dataclasses.replace(loop, resume=False))


def test_allowed_change_that_breaks_the_arrays_is_one_clear_error(tmp_path, capfd):
  cfg = _cfg(mesh="data:8")
  _train(cfg, tmp_path, steps=4, settings=_settings(cfg))
  capfd.readouterr()
  bigger = configs.replace_run(cfg, num_rows=2000)
  with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
    _train(bigger, tmp_path, steps=8, resume=True, settings=_settings(bigger),
           resume_allow=("num_rows",))
  msg = str(e.value)
  assert "2 of 19 arrays differ" in msg
  assert "emb/dp_fp32_d16_w16/table/rows: checkpoint float32[26000, 16], new state " \
         "float32[52000, 16]" in msg
  err = capfd.readouterr().err
  assert "Event loop is closed" not in err    # orbax never started reading
  # The same check names a model that is not the checkpoint's, leaf by leaf.
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="params/cross/layers/0/bias: in "
                     "the new state float32"):
    other = configs.replace_run(cfg, model="dcnv2")
    _train(other, tmp_path, steps=8, resume=True, settings=_settings(other),
           resume_allow=("model",))


def test_overwrite_starts_afresh(tmp_path):
  cfg = _cfg(mesh="data:8")
  _, first = _train(cfg, tmp_path, steps=4, settings=_settings(cfg))
  (tmp_path / "notes.txt").write_text("kept")
  _, again = _train(cfg, tmp_path, steps=4, settings=_settings(cfg), overwrite=True)
  assert again["step"] == 4 and again["eval"] == first["eval"]
  assert [s for s, _ in _losses(tmp_path)] == [4]   # the second run's records only
  assert (tmp_path / "notes.txt").read_text() == "kept"
  with pytest.raises(train_lib.RunSettingsError, match="pass one"):
    _train(cfg, tmp_path, steps=4, overwrite=True, resume=True)


# --- optimizer settings and non-finite training


def test_optimizer_settings_are_validated_with_the_flag():
  for kw, flag in [(dict(learning_rate=-0.05), "--learning_rate=-0.05"),
                   (dict(learning_rate=float("nan")), "--learning_rate=nan"),
                   (dict(embedding_learning_rate=0.0), "--embedding_learning_rate=0.0"),
                   (dict(embedding_learning_rate=float("inf")), "--embedding_learning_rate=inf"),
                   (dict(dense_optimizer="lamb"), "--dense_optimizer='lamb'"),
                   (dict(sparse_optimizer="ftrl"), "--sparse_optimizer='ftrl'")]:
    cfg = _cfg()   # built field by field: build_run's own check, not make_run's
    with pytest.raises(ValueError, match=re.escape(flag)):
      configs.build_run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **kw)))
  with pytest.raises(ValueError, match=r"RowWiseAdagrad: learning_rate=-1.0"):
    opt_lib.get_sparse_optimizer("rowwise_adagrad", -1.0)
  with pytest.raises(ValueError, match=r"Adam: eps=-1e-08"):
    opt_lib.get_sparse_optimizer("adam", 0.1, eps=-1e-8)
  for kw in [dict(peak_lr=-3e-4), dict(peak_lr=float("nan")), dict(warmup_steps=-1),
             dict(total_steps=0), dict(b2=1.0), dict(weight_decay=-0.1), dict(clip_norm=0.0),
             dict(final_lr_fraction=2.0)]:
    with pytest.raises(ValueError, match=f"OptimConfig: {next(iter(kw))}="):
      lm_train_lib.OptimConfig(**kw)


def _one_device(**kw):
  return _cfg(mesh="data:1", **kw)


class _Poisoned:
  """The task, with NaN dense features in the batches numbered in `bad` (the source yields
  (number, batch) pairs)."""

  def __init__(self, task, bad):
    self.task, self.bad = task, set(bad)

  def __getattr__(self, name):
    return getattr(self.task, name)

  def device_batch(self, item):
    k, host = item if isinstance(item, tuple) else (None, item)
    dev = self.task.device_batch(host)
    return dataclasses.replace(dev, dense=dev.dense * jnp.nan) if k in self.bad else dev

  def examples_in(self, item):
    return self.task.examples_in(item[1] if isinstance(item, tuple) else item)


def _numbered(src, skip=()):
  def batches(start):
    k = start
    for b in src.batches(start):
      if k not in skip:
        yield k, b
      k += 1
  return batches


def test_nonfinite_loss_stops_at_its_step(tmp_path):
  devices = jax.devices()[:1]
  task, train_src, eval_src, _, _ = configs.build_run(_one_device(), devices)
  loop = train_lib.TrainConfig(workdir=str(tmp_path), steps=20, log_every=100, check_every=3,
                               checkpoint_every=5, tensorboard=False)
  with pytest.raises(train_lib.NonFiniteError) as e:
    train_lib.train(_Poisoned(task, {7}), _numbered(train_src), lambda: eval_src.batches(0), loop)
  msg = str(e.value)
  assert "step 8 is the first with a non-finite loss or gradient norm (loss nan, grad_norm nan)" in msg
  assert f"last good checkpoint is {tmp_path}/checkpoints/5 (step 5)" in msg
  assert "lower the learning rate" in msg and "--nonfinite=skip" in msg and "batch 7" in msg
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [5]   # found at the step-9 check, before any later checkpoint
  ckpt.close()
  # The last good checkpoint continues on clean data exactly as a clean run would.
  _, resumed = _train(_one_device(), tmp_path, steps=20, devices=devices, resume=True,
                      checkpoint_every=5)
  _, straight = _train(_one_device(), tmp_path / "straight", steps=20, devices=devices)
  assert resumed["eval"] == straight["eval"]


def test_nonfinite_skip_leaves_the_state_and_counts(tmp_path):
  devices = jax.devices()[:1]
  task, train_src, eval_src, _, _ = configs.build_run(_one_device(), devices)
  loop = train_lib.TrainConfig(workdir=str(tmp_path / "skip"), steps=12, log_every=4,
                               nonfinite="skip", tensorboard=False)
  out = train_lib.train(_Poisoned(task, {2, 7}), _numbered(train_src),
                        lambda: eval_src.batches(0), loop)
  assert out["skipped_steps"] == 2 and out["finished"]
  with open(tmp_path / "skip" / "metrics.jsonl") as f:
    train_recs = [r for r in map(json.loads, f) if r["split"] == "train"]
  assert [r["skipped"] for r in train_recs] == [1.0, 1.0, 0.0]
  assert all(np.isfinite(r["loss"]) for r in train_recs)
  # Reference: the same steps without the two bad batches (Adagrad and row-wise Adagrad do
  # not depend on the step count, so only the skipped batches' updates are missing); the same
  # compiled step, so the comparison is exact.
  ref_loop = dataclasses.replace(loop, workdir=str(tmp_path / "ref"), steps=10)
  ref = train_lib.train(_Poisoned(task, ()), _numbered(train_src, skip={2, 7}),
                        lambda: eval_src.batches(0), ref_loop)
  a, b = _leaves(task, out["state"]), _leaves(task, ref["state"])
  assert a["step"] == 12 and b["step"] == 10
  for key in ("params", "opt", "emb_opt"):
    for x, y in zip(a[key], b[key]):
      np.testing.assert_array_equal(x, y)
  for n in a["tables"]:
    np.testing.assert_array_equal(a["tables"][n], b["tables"][n])
  # Every step bad: skipping stops after max_skipped_in_a_row.
  with pytest.raises(train_lib.NonFiniteError, match=r"steps 4 to 6 were all skipped"):
    train_lib.train(_Poisoned(task, range(3, 100)), _numbered(train_src), None,
                    dataclasses.replace(loop, workdir=str(tmp_path / "all"), max_skipped_in_a_row=3))


def test_skip_step_touches_no_row_on_eight_devices():
  cfg = _cfg(mesh="data:2,model:4", sharding="tw")
  task, train_src, _, _, _ = configs.build_run(cfg)
  state = task.init_state(0)
  host = next(train_src.batches(0))
  good = task.device_batch(host)
  bad = dataclasses.replace(good, dense=good.dense * jnp.nan)
  step = jax.jit(functools.partial(task.train_step, skip_nonfinite=True))
  plain = jax.jit(task.train_step)
  before = _leaves(task, state)
  new, m = step(state, bad)
  assert float(m["skipped"]) == 1.0 and not np.isfinite(float(m["loss"]))
  after = _leaves(task, new)
  assert after["step"] == before["step"] + 1
  for key in ("params", "opt", "emb_opt"):
    for x, y in zip(before[key], after[key]):
      np.testing.assert_array_equal(x, y)
  for n in before["tables"]:
    np.testing.assert_array_equal(before["tables"][n], after["tables"][n])
  # On a finite batch the guarded step is the plain step (two compiled programs: XLA may
  # fuse the fp32 arithmetic differently, a few ulps after one step).
  g_new, g_m = step(new, good)
  p_new, p_m = plain(new, good)
  assert float(g_m["skipped"]) == 0.0
  assert float(g_m["grad_norm"]) == pytest.approx(float(p_m["grad_norm"]), rel=1e-6)
  g, p = _leaves(task, g_new), _leaves(task, p_new)
  assert g["step"] == p["step"]
  for key in ("params", "opt", "emb_opt"):
    for x, y in zip(g[key], p[key]):
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  for n in g["tables"]:
    np.testing.assert_allclose(g["tables"][n], p["tables"][n], rtol=1e-6, atol=1e-7)
  assert any(not np.array_equal(g["tables"][n], after["tables"][n]) for n in g["tables"])


def test_lm_skip_step_keeps_params():
  from llm import config as llm_config
  from llm.data import LMBatch
  mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.LLM_RULES)
  task = lm_train_lib.LMTask(llm_config.get_config("tiny", vocab_size=64, max_seq_len=16),
                             lm_train_lib.OptimConfig(warmup_steps=0, total_steps=10), mesh)
  state = task.init_state(0)
  x = np.arange(32, dtype=np.int32).reshape(2, 16) % 64
  batch = task.device_batch(LMBatch(inputs=x, targets=(x + 1) % 64, mask=np.ones_like(x, np.float32),
                                    positions=np.broadcast_to(np.arange(16, dtype=np.int32), x.shape),
                                    segment_ids=np.zeros_like(x)))
  step = jax.jit(functools.partial(task.train_step, skip_nonfinite=True))
  _, m = step(state, batch)
  assert float(m["skipped"]) == 0.0
  poisoned = dict(state, params=jax.tree.map(lambda p: p.at[(0,) * p.ndim].set(jnp.inf),
                                             state["params"]))
  new, m = step(poisoned, batch)
  assert float(m["skipped"]) == 1.0
  for x, y in zip(jax.tree.leaves(poisoned["params"]), jax.tree.leaves(new["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert int(new["step"]) == 1


def test_nonfinite_state_is_never_checkpointed():
  state = {"a": jnp.ones(3), "b": {"c": jnp.array([1.0, jnp.inf]), "n": jnp.arange(3)}}
  assert train_lib._first_nonfinite_leaf(state) == "['b']['c']"
  assert train_lib._first_nonfinite_leaf({"a": jnp.ones(3)}) is None


@pytest.mark.parametrize("max_in_flight", [0, 2])
def test_steps_in_flight_are_bounded(tmp_path, monkeypatch, max_in_flight):
  """With max_in_flight=2 the host waits on step s-2's metrics right after dispatching step
  s (so at most two steps are queued on the devices); with 0 only the first (compiling)
  step is waited on until the logging point."""
  devices = jax.devices()[:1]
  task, train_src, eval_src, _, _ = configs.build_run(_one_device(), devices)
  waited = []
  real = jax.block_until_ready

  def spy(x):
    if isinstance(x, dict) and "loss" in x:
      waited.append(x)
    return real(x)

  monkeypatch.setattr(train_lib.jax, "block_until_ready", spy)
  loop = train_lib.TrainConfig(workdir=str(tmp_path), steps=10, log_every=100, check_every=0,
                               eval_every=0, checkpoint_every=0, tensorboard=False,
                               max_in_flight=max_in_flight)
  train_lib.train(task, train_src.batches, lambda: eval_src.batches(0), loop)
  # step 1 (compile) and, with the bound, steps 1..8 once steps 3..10 are dispatched
  assert len(waited) == (1 + 8 if max_in_flight else 1)
  with pytest.raises(ValueError, match="max_in_flight=-1"):
    train_lib.train(task, train_src.batches, None,
                    dataclasses.replace(loop, max_in_flight=-1))
