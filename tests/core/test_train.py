"""The shared train loop: exact resume, data parallel on 8 devices equals 1 device, run
settings checked on resume, optimizer settings validated, non-finite steps stopped or skipped."""

import dataclasses
import errno
import functools
import itertools
import json
import os
import re
import shutil
import signal
import threading

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


@pytest.mark.devices(8)
def test_resume_is_bit_exact(tmp_path):
  cfg = _cfg(mesh="data:2,model:4", sharding="tw")
  # 10 steps logged every 5, stopped after step 5: two loss records per run, one each side
  # of the stop.
  task, straight = _train(cfg, tmp_path / "a", steps=10, eval_every=5)
  _, first = _train(cfg, tmp_path / "b", steps=10, eval_every=5, stop_at_step=5)
  assert first["step"] == 5 and not first["finished"]
  with pytest.raises(ValueError, match="already holds a checkpoint at step 5"):
    _train(cfg, tmp_path / "b", steps=10, eval_every=5)
  task_b, resumed = _train(cfg, tmp_path / "b", steps=10, eval_every=5, resume=True)
  assert resumed["step"] == 10 and resumed["finished"]
  a, b = _leaves(task, straight["state"]), _leaves(task_b, resumed["state"])
  assert a["step"] == b["step"] == 10
  for key in ("params", "opt", "emb_opt"):
    for x, y in zip(a[key], b[key]):
      np.testing.assert_array_equal(x, y)
  for n in a["tables"]:
    np.testing.assert_array_equal(a["tables"][n], b["tables"][n])
  assert straight["eval"] == resumed["eval"]
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")   # same batches, same losses
  # Resuming a finished run changes nothing and records nothing new.
  _, again = _train(cfg, tmp_path / "b", steps=10, eval_every=5, resume=True)
  assert again["step"] == 10 and again["eval"] == resumed["eval"]
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
@pytest.mark.devices(8)
def test_eight_devices_equal_one(tmp_path, sharding, sparse_optimizer):
  one = jax.devices()[:1]
  kw = dict(sharding=sharding, sparse_optimizer=sparse_optimizer)
  task1, out1 = _train(_cfg(mesh="data:1", **kw), tmp_path / "one", steps=4, devices=one)
  task8, out8 = _train(_cfg(mesh="data:8", **kw), tmp_path / "eight", steps=4)
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


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A finished 4-step run on data:8 with its settings recorded, trained once for the tests
  below: (its workdir, to copy; its summary)."""
  if jax.device_count() < 8:
    pytest.skip(f"needs 8 devices, found {jax.device_count()}")
  workdir = tmp_path_factory.mktemp("finished_run") / "run"
  cfg = _cfg(mesh="data:8")
  _, out = _train(cfg, workdir, steps=4, settings=_settings(cfg))
  return workdir, out


def _copy_of(finished_run, tmp_path):
  """A copy of the finished run's workdir, for a test to resume or overwrite."""
  shutil.copytree(finished_run[0], tmp_path, dirs_exist_ok=True)


@pytest.mark.devices(8)
def test_resume_with_other_settings_is_one_error(tmp_path, finished_run):
  cfg = _cfg(mesh="data:8")
  _copy_of(finished_run, tmp_path)
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
  with pytest.raises(train_lib.RunSettingsError, match=r"a finished run of 4 steps\); pass "
                     r"--resume .* --overwrite"):
    train_lib.train(_NotBuilt(), None, None, dataclasses.replace(loop, resume=False))


@pytest.mark.devices(8)
def test_allowed_change_that_breaks_the_arrays_is_one_clear_error(tmp_path, capfd,
                                                                  finished_run):
  cfg = _cfg(mesh="data:8")
  _copy_of(finished_run, tmp_path)
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


@pytest.mark.devices(8)
def test_overwrite_starts_afresh(tmp_path, finished_run):
  cfg = _cfg(mesh="data:8")
  _copy_of(finished_run, tmp_path)
  first = finished_run[1]
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
  loop = train_lib.TrainConfig(workdir=str(tmp_path), steps=10, log_every=100, check_every=3,
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
  _, resumed = _train(_one_device(), tmp_path, steps=10, devices=devices, resume=True,
                      checkpoint_every=5)
  _, straight = _train(_one_device(), tmp_path / "straight", steps=10, devices=devices)
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


@pytest.mark.devices(8)
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
  task = lm_train_lib.LMTask(llm_config.get_config("tiny", vocab_size=64, max_seq_len=16,
                                                                n_layers=1),
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


# --- the loop's own paths, on a task of two numbers (compiles in a moment)


class _Counter:
  """Each step adds batch k's [k, k] to `w` (loss = sum(w), finite); a batch whose `aux` is
  inf puts it in the state's `aux`, which no loss or gradient norm shows. Its evaluation:
  the sum of w . x over the eval batches."""

  def init_state(self, seed):
    return {"w": jnp.zeros(2), "aux": jnp.zeros(())}

  def train_step(self, state, batch):
    w = state["w"] + batch["x"]
    return ({"w": w, "aux": state["aux"] + batch["aux"]},
            {"loss": jnp.sum(w), "grad_norm": jnp.float32(1.0)})

  def eval_step(self, state, batch):
    return jnp.sum(state["w"] * batch["x"])

  def device_batch(self, host):
    return jax.tree.map(jnp.asarray, host)

  def new_evaluator(self):
    class Sum:
      total = 0.0

      def update(self, out, host):
        self.total += float(out)

      def result(self):
        return {"sum": self.total}
    return Sum()

  def examples_in(self, host):
    return 1


def _counter_batches(bad=()):
  def batches(start):
    k = start
    while True:
      yield {"x": np.full(2, k, np.float32), "aux": np.float32(np.inf if k in bad else 0.0)}
      k += 1
  return batches


def _loop(workdir, **kw):
  return train_lib.TrainConfig(**{**dict(workdir=str(workdir), steps=6, log_every=3,
                                         tensorboard=False), **kw})


def test_settings_the_loop_refuses_before_touching_the_workdir(tmp_path):
  w = tmp_path / "w"
  for kw, want in [
      (dict(nonfinite="maybe"), "--nonfinite='maybe': expected 'stop' or 'skip'"),
      (dict(checkpoint_every_minutes=-1.0),
       "--checkpoint_every_minutes=-1.0: expected >= 0 (0: no time-based checkpoints)"),
      (dict(checkpoint_every_minutes=float("nan")),
       "--checkpoint_every_minutes=nan: expected >= 0 (0: no time-based checkpoints)"),
      (dict(stop_at_step=7), "--stop_at_step=7: after the run's last step (6); expected a "
                             "step <= 6"),
      (dict(nonfinite="skip"), "--nonfinite=skip: _Counter.train_step takes no skip_nonfinite "
                               "argument; use --nonfinite=stop")]:
    with pytest.raises(ValueError) as e:
      train_lib.train(_Counter(), _counter_batches(), None, _loop(w, **kw))
    assert str(e.value) == want
  assert not w.exists()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_without_a_checkpoint_starts_at_zero(tmp_path, capsys, prefetch):
  # a first run that never finished its first checkpoint: orbax's temporary directory only
  os.makedirs(tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1")
  assert train_lib.check_resume(_loop(tmp_path)) is None   # nothing to resume or refuse
  out = train_lib.train(_Counter(), _counter_batches(), None,
                        _loop(tmp_path, resume=True, prefetch=prefetch))
  assert (f"--resume: no checkpoint under {tmp_path}/checkpoints; starting from step 0"
          in capsys.readouterr().out.splitlines())
  np.testing.assert_array_equal(out["state"]["w"], [15.0, 15.0])   # batches 0..5, in order
  assert out["step"] == 6 and out["finished"]
  assert list(train_lib._prefetch(iter(range(3)), lambda x: 10 * x, prefetch)) == [
      (0, 0), (1, 10), (2, 20)]   # a source that ends, ends the batches


def test_a_state_gone_non_finite_is_never_checkpointed(tmp_path):
  with pytest.raises(train_lib.NonFiniteError) as e:
    train_lib.train(_Counter(), _counter_batches(bad={2}), None,
                    _loop(tmp_path, checkpoint_every=2))
  assert str(e.value) == (
      "training stopped: the state after step 4 holds non-finite values (first: ['aux']) "
      "although the losses and gradient norms checked so far were finite. No checkpoint of "
      f"the state after it was written; the last good checkpoint is {tmp_path}/checkpoints/2 "
      "(step 2); continue from it with --resume. What to try: lower the learning rate; look "
      "for bad values in batch 3 (the batch of step 4); or --nonfinite=skip to skip such steps "
      "and count them (changing a setting on resume needs --resume_allow=NAME).")
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [2]
  ckpt.close()


def _checkpoint(workdir, step, meta, state=None):
  ckpt = ckpt_lib.Checkpointer(str(workdir))
  ckpt.save(step, state or _Counter().init_state(0), {"step": step, **meta})
  ckpt.close()


def test_resume_checks_of_checkpoints_with_less_recorded(tmp_path, caplog):
  # written by an older version: no planned steps, no settings
  _checkpoint(tmp_path / "old", 3, {})
  with pytest.raises(train_lib.RunSettingsError) as e:
    train_lib.check_resume(_loop(tmp_path / "old"))
  assert str(e.value).startswith(f"workdir '{tmp_path}/old' already holds a checkpoint at "
                                 "step 3; pass --resume to continue that run")
  with caplog.at_level("WARNING"):
    assert train_lib.check_resume(_loop(tmp_path / "old", resume=True)) == 3
  assert (f"{tmp_path}/old/checkpoints/3 holds no run settings (written by an older version): "
          "resuming without checking them") in caplog.text
  # settings recorded, but not one the run has now
  saved = train_lib.run_settings(_loop(tmp_path / "new", settings={"lr": 0.1}))
  _checkpoint(tmp_path / "new", 3, {"steps": 6, "settings": saved})
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert train_lib.check_resume(_loop(tmp_path / "new", resume=True,
                                        settings={"lr": 0.1, "dropout": 0.2})) == 3
  assert (f"settings ['dropout'] are not recorded in {tmp_path}/new/checkpoints/3 (written by "
          "an older version); not checked") in caplog.text
  # a deliberate change of a setting no run has
  with pytest.raises(train_lib.RunSettingsError) as e:
    train_lib.check_resume(_loop(tmp_path / "new", resume=True, settings={"lr": 0.1},
                                 resume_allow=("lr", "l_r")))
  assert str(e.value) == ("--resume_allow names unknown settings ['l_r']; the run's settings "
                          f"are {sorted(saved)}")


def test_a_second_signal_stops_at_once():
  before = {s: signal.getsignal(s) for s in train_lib._StopSignals.SIGNALS}
  with pytest.raises(KeyboardInterrupt):
    with train_lib._StopSignals() as signals:
      signal.raise_signal(signal.SIGTERM)
      assert signals.signum == signal.SIGTERM   # the first is noted only
      signal.raise_signal(signal.SIGINT)
  assert {s: signal.getsignal(s) for s in before} == before


def _eval_with_sigterm(n_batches=3):
  def batches():
    for k in range(n_batches):
      if k == 1:
        signal.raise_signal(signal.SIGTERM)   # noted; the eval stops before this batch
      yield {"x": np.ones(2, np.float32), "aux": np.float32(0.0)}
  return batches


def test_a_stop_during_a_periodic_eval_saves_that_step(tmp_path):
  with pytest.raises(train_lib.Interrupted) as e:
    train_lib.train(_Counter(), _counter_batches(), _eval_with_sigterm(),
                    _loop(tmp_path, eval_every=2, checkpoint_every=4))
  assert str(e.value) == "stopped at step 2; checkpoint 2 kept; continue with --resume"
  assert e.value.exit_status == 143
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [2] and ckpt.restore_meta(2)["eval_step"] is None
  ckpt.close()


def test_a_stop_during_the_final_eval_after_a_failed_final_write(tmp_path, monkeypatch):
  # "checkpoint 6 kept" would be false: the write's own error is what the run ends with
  real_save = ckpt_lib.Checkpointer.save

  def save(self, step, state, meta):
    if step == 6:
      raise ckpt_lib.write_error(self.directory, step,
                                 OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return real_save(self, step, state, meta)
  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    train_lib.train(_Counter(), _counter_batches(), _eval_with_sigterm(),
                    _loop(tmp_path, checkpoint_every=3))
  assert str(e.value).startswith(f"checkpoint {tmp_path}/checkpoints/6: writing "
                                 f"{tmp_path}/checkpoints failed: No space left on device")
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  assert ckpt.all_steps() == [3]
  ckpt.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failed_run_closes_its_batch_source(tmp_path, prefetch):
  # the error's traceback outlives `train` (here in pytest.raises): the source and the
  # prefetch thread must not live on with it
  closed = []

  def batches(start):
    k = start
    try:
      while True:
        yield {"x": np.full(2, k, np.float32), "aux": np.float32(np.inf if k == 2 else 0.0)}
        k += 1
    finally:
      closed.append(k)
  with pytest.raises(train_lib.NonFiniteError) as e:
    train_lib.train(_Counter(), batches, None,
                    _loop(tmp_path, checkpoint_every=2, prefetch=prefetch))
  assert "holds non-finite values" in str(e.value)
  assert len(closed) == 1 and closed[0] >= 3   # batches 0..3 taken, maybe more prefetched
  # the prefetch thread (named after its target, `work`) has ended
  assert not [t.name for t in threading.enumerate() if t.name.endswith("(work)")]


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


def _eval_batches():
  for _ in range(3):
    yield {"x": np.ones(2, np.float32), "aux": np.float32(0.0)}


def test_a_resume_runs_the_evaluation_a_stop_cut_short(tmp_path):
  # A stop during the periodic evaluation at step 2 keeps checkpoint 2 without it: the
  # resumed run evaluates at step 2 first, as the uninterrupted run did, and records it.
  straight = train_lib.train(_Counter(), _counter_batches(), _eval_batches,
                             _loop(tmp_path / "a", eval_every=2, log_every=1))
  with pytest.raises(train_lib.Interrupted):
    train_lib.train(_Counter(), _counter_batches(), _eval_with_sigterm(),
                    _loop(tmp_path / "b", eval_every=2, log_every=1))
  resumed = train_lib.train(_Counter(), _counter_batches(), _eval_batches,
                            _loop(tmp_path / "b", eval_every=2, log_every=1, resume=True))
  assert _records(tmp_path / "b") == _records(tmp_path / "a")
  assert [r["step"] for r in _records(tmp_path / "a") if r["split"] == "eval"] == [2, 4, 6]
  assert resumed["eval"] == straight["eval"]
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "b"))
  assert ckpt.restore_meta(2)["eval_step"] == 2   # a second resume from 2 does not redo it
  ckpt.close()


class _Skipping(_Counter):
  """_Counter whose step skips a batch with an inf `aux` (loss NaN, `skipped` 1)."""

  def train_step(self, state, batch, skip_nonfinite=False):
    new, m = super().train_step(state, batch)
    ok = jnp.isfinite(batch["aux"])
    return ({"w": jnp.where(ok, new["w"], state["w"]), "aux": state["aux"]},
            {"loss": jnp.where(ok, m["loss"], jnp.nan), "grad_norm": m["grad_norm"],
             "skipped": (~ok).astype(jnp.float32)})


def _stopping_batches(bad, stop_before=None):
  """_counter_batches(bad) that sends SIGTERM before yielding batch `stop_before` (with
  prefetch 0: while the loop waits for that batch, so the run stops at its step)."""
  def batches(start):
    for k in itertools.count(start):
      if k == stop_before:
        signal.raise_signal(signal.SIGTERM)
      yield {"x": np.full(2, k, np.float32), "aux": np.float32(np.inf if k in bad else 0.0)}
  return batches


@pytest.mark.parametrize("bad,limit", [({3}, 10), ({2, 3, 4}, 3)])
def test_a_stop_between_log_steps_resumes_the_same_records(tmp_path, bad, limit):
  # Stopped at step 4 or 5 (log_every=3): the steps after the last log line, a skipped one
  # among them, are averaged into the next line and counted as the uninterrupted run does;
  # skips in a row continue across the stop ({2, 3, 4}: steps 3..5 end both runs).
  kw = dict(steps=9, log_every=3, prefetch=0, nonfinite="skip", max_skipped_in_a_row=limit)
  stop_before = max(bad) + 1 if limit == 10 else 3

  def run(workdir, batches, **more):
    try:
      return train_lib.train(_Skipping(), batches, None, _loop(workdir, **kw, **more))
    except train_lib.NonFiniteError as e:
      return str(e).split(". No checkpoint")[0]
  straight = run(tmp_path / "a", _stopping_batches(bad))
  with pytest.raises(train_lib.Interrupted) as e:
    run(tmp_path / "b", _stopping_batches(bad, stop_before))
  assert e.value.step == stop_before + 1
  resumed = run(tmp_path / "b", _stopping_batches(bad), resume=True)
  assert _records(tmp_path / "b") == _records(tmp_path / "a")
  if limit == 3:
    assert straight == resumed == ("training stopped: steps 3 to 5 were all skipped for a "
                                   "non-finite loss or gradient norm (3 in a row, "
                                   "max_skipped_in_a_row=3)")
  else:
    assert straight["skipped_steps"] == resumed["skipped_steps"] == 1
    np.testing.assert_array_equal(resumed["state"]["w"], straight["state"]["w"])
    assert [r["skipped"] for r in _records(tmp_path / "a")] == [0.0, 1.0, 0.0]


def test_an_evaluation_after_a_resume_keeps_the_checkpoint_s_own_metadata(tmp_path):
  # A finished run whose final evaluation was cut short, resumed by a task that would write
  # its checkpoints in another layout (a resharded embedding): the evaluation goes into
  # checkpoint 6's metadata, whose layout still describes its arrays.
  class Laid(_Counter):
    def __init__(self, layout):
      self.layout = layout

    def checkpoint_meta(self):
      return {"layout": self.layout}
  with pytest.raises(train_lib.Interrupted):
    train_lib.train(Laid("a"), _counter_batches(), _eval_with_sigterm(), _loop(tmp_path))
  out = train_lib.train(Laid("b"), _counter_batches(), _eval_batches,
                        _loop(tmp_path, resume=True))
  assert out["eval"] == {"sum": 3 * 30.0}   # w = [15, 15] . [1, 1] over three batches
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  meta = ckpt.restore_meta(6)
  ckpt.close()
  assert meta["layout"] == "a" and meta["eval_step"] == 6 and meta["last_eval"] == out["eval"]
