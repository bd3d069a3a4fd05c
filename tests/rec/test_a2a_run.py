"""The compressed embedding exchange (arXiv 2407.04272) as a run setting: the shared rec run
flags --a2a_mode / --a2a_error_bound / --a2a_grad_error_bound / --a2a_bits (errors name the
flag), the refusal of a sharding with no exchange, the resume rule over them, and (slow) a
train_rec run on 8 devices against the float32 one: step 1's loss within the first-order
bound of the arithmetic, bit-identical losses when every exchange falls back to float32,
and `rec.runs.a2a_report`'s bytes and errors against the layout and the bounds."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags

from core import checkpoint as ckpt_lib
from core import train as train_lib
from rec import configs
from rec import runs
from rec.embedding import a2a_compression as ac

SMALL = dict(preset="small", num_rows=1000, batch_size=64, eval_batch_size=64, eval_batches=1)


def _cfg(flag_args):
  """The config train_rec builds from these flags (all rec run flags at their defaults)."""
  fv = flags.FlagValues()
  configs.define_rec_run_flags(*configs.RUN_FIELDS, flag_values=fv)
  fv(["prog", *flag_args])
  return configs.RecRunConfig.from_flags(fv)


def test_flags_parse_into_the_setting():
  assert _cfg([]).a2a_spec() is None
  spec = _cfg(["--a2a_mode=rel", "--a2a_error_bound=0.05", "--a2a_grad_error_bound=0.08",
               "--a2a_bits=4"]).a2a_spec()
  assert spec == ac.A2ACompression("rel", 0.05, 0.08, 4)
  assert _cfg(["--a2a_mode=abs"]).a2a_spec() == ac.A2ACompression("abs", 1e-3, None, 8)


@pytest.mark.parametrize("args,msg", [
    (["--a2a_mode=abs", "--a2a_bits=5"], r"--a2a_bits=5: unsupported code width; expected one "
                                         r"of \[4, 8, 16\]"),
    (["--a2a_mode=abs", "--a2a_error_bound=0"], r"--a2a_error_bound=0.0: not a finite error "
                                                r"bound > 0"),
    (["--a2a_mode=rel", "--a2a_error_bound=-0.1"], r"--a2a_error_bound=-0.1: not a finite"),
    (["--a2a_mode=abs", "--a2a_error_bound=inf"], r"--a2a_error_bound=inf: not a finite"),
    (["--a2a_mode=abs", "--a2a_grad_error_bound=0"], r"--a2a_grad_error_bound=0.0: not a "
                                                     r"finite error bound > 0"),
    (["--a2a_mode=rel", "--a2a_error_bound=0.001"], r"--a2a_error_bound=0.001: a relative "
                                                    r"bound needing 254 codes .*--a2a_bits=8"),
    (["--a2a_error_bound=0.01"], r"--a2a_error_bound=0.01 with --a2a_mode=none: no exchange "
                                 r"is compressed"),
    (["--a2a_bits=16", "--a2a_grad_error_bound=0.1"],
     r"--a2a_grad_error_bound=0.1, --a2a_bits=16 with --a2a_mode=none"),
])
def test_bad_settings_name_the_flag(args, msg):
  cfg = _cfg(args)
  with pytest.raises(ValueError, match=msg):
    cfg.validate()


def test_bits_below_four_fail_at_parsing():
  with pytest.raises(flags.IllegalFlagValueError, match="flag --a2a_bits=2"):
    _cfg(["--a2a_bits=2"])
  with pytest.raises(flags.IllegalFlagValueError, match="flag --a2a_mode=lossy"):
    _cfg(["--a2a_mode=lossy"])


@pytest.mark.devices(8)
@pytest.mark.parametrize("over,msg", [
    (dict(mesh="data:1"), r"--a2a_mode=abs: --mesh='data:1' gives the embedding tables 1 "
                          r"device, so no embedding exchange exists to compress"),
    (dict(sharding="dp"), r"--a2a_mode=abs: --sharding=dp placed every table dp, so no "
                          r"embedding exchange exists to compress; expected tables placed "
                          r"tw\|cw\|twrw\|rw on 2 or more devices"),
])
def test_no_exchange_is_refused(over, msg):
  cfg = configs.RecRunConfig(**SMALL, a2a_mode="abs", **over)
  devices = jax.devices()[:1] if over.get("mesh") == "data:1" else None
  with pytest.raises(ValueError, match=msg):
    configs.build_run(cfg, devices=devices)


@pytest.mark.devices(8)
def test_build_run_takes_the_setting_once():
  cfg = configs.RecRunConfig(**SMALL, sharding="rw", a2a_mode="abs", a2a_error_bound=0.01)
  task = configs.build_run(cfg)[0]
  assert task.collection.a2a_compression == ac.A2ACompression("abs", 0.01)
  with pytest.raises(ValueError, match="build_run: a2a_compression=.* and --a2a_mode=abs; "
                     "expected one of the two"):
    configs.build_run(cfg, a2a_compression=ac.A2ACompression("abs", 0.02))
  assert cfg.without_a2a() == dataclasses.replace(cfg, a2a_mode="none", a2a_error_bound=1e-3)


def _resume(workdir, saved: dict, now: configs.RecRunConfig):
  ckpt = ckpt_lib.Checkpointer(workdir)
  loop = dict(workdir=workdir, steps=1, normalize_settings=configs.normalize_settings)
  ckpt.save(1, {"x": np.zeros(2, np.float32)}, {"step": 1, "steps": 1, "settings": {
      **train_lib.run_settings(train_lib.TrainConfig(**loop)), **saved}})
  ckpt.close()
  return train_lib.check_resume(train_lib.TrainConfig(**loop, resume=True,
                                                      settings=now.run_settings()))


def test_resume_with_other_a2a_settings_names_them(tmp_path):
  plain, comp = configs.RecRunConfig(), configs.RecRunConfig(a2a_mode="abs", a2a_bits=4)
  with pytest.raises(train_lib.RunSettingsError) as e:
    _resume(str(tmp_path / "a"), plain.run_settings(), comp)
  assert "a2a_mode: 'none' (checkpoint) -> 'abs' (now)" in str(e.value)
  assert "a2a_bits: 8 (checkpoint) -> 4 (now)" in str(e.value)
  # Settings saved before the a2a fields existed ran in float32: compression is refused...
  old = {k: v for k, v in plain.run_settings().items() if not k.startswith("a2a_")}
  with pytest.raises(train_lib.RunSettingsError, match="a2a_mode: 'none' .checkpoint. -> "
                     "'abs' .now."):
    _resume(str(tmp_path / "b"), old, comp)
  # ... and the float32 run resumes as before.
  assert _resume(str(tmp_path / "c"), old, plain) == 1


# --------------------------------------------------------------------------- training


def _train(cfg, workdir, steps=3):
  task, train_src, eval_src, plan, _ = configs.build_run(cfg)
  out = train_lib.train(task, train_src.batches, None, train_lib.TrainConfig(
      workdir=str(workdir), steps=steps, log_every=1, tensorboard=False))
  losses = [json.loads(l)["loss"] for l in open(workdir / "metrics.jsonl")]
  return task, train_src, plan, out, np.asarray(losses, np.float64)


def _first_order_bound(task, batch, eb):
  """sum |dL / d emb| * eb at the initial state: how far errors of at most eb in every
  pooled value can move the step-1 loss, to first order."""
  state = task.init_state(0)
  batch = task.device_batch(batch)

  def loss(emb):
    per = optax.sigmoid_binary_cross_entropy(
        task.logits(state["params"], batch.dense, emb), batch.labels)
    return jnp.sum(per * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)

  emb = task.collection.pool(task.gather(state["emb"], batch))
  return float(jnp.sum(jnp.abs(jax.grad(loss)(emb)))) * eb


@pytest.mark.slow   # three 8-device trainings, each its own compile (~25 s on 2 cores)
@pytest.mark.devices(8)
def test_compressed_training_against_float32(tmp_path):
  eb, geb = 1e-3, 1e-4
  base = configs.RecRunConfig(**SMALL, sharding="tw", mesh="data:8")
  task0, src, plan, _, loss0 = _train(base, tmp_path / "f32")
  comp = dataclasses.replace(base, a2a_mode="abs", a2a_error_bound=eb, a2a_grad_error_bound=geb)
  task, _, _, out, loss = _train(comp, tmp_path / "abs")
  # Step 1 runs the same parameters on embeddings moved by at most eb each (tw: one partial
  # per pooled value): its loss moves by at most the first-order bound (plus second order).
  first = next(iter(src.batches(0)))
  bound1 = _first_order_bound(task0, first, eb)
  assert 0 < abs(loss[0] - loss0[0]) <= 1.05 * bound1 + 1e-7, (loss[0], loss0[0], bound1)
  # Later steps also differ by compressed gradients; they stay close.
  assert np.max(np.abs(loss - loss0)) < 10 * bound1, (loss, loss0, bound1)
  # What the report measures at the final state: bytes from the HLO equal the layout's
  # rows times the fixed-rate payload (forward + backward), errors within their bounds.
  rep = runs.a2a_report(task, out["state"], [first, first])
  N, B_l = 8, 64 // 8
  S = max(sum(1 for p in plan.values() if p.devices == (d,)) for d in range(N))
  rows = N * B_l * S
  assert rep["bytes"]["payload"] == 2 * rows * ac.payload_bytes(16, 8)
  assert rep["bytes"]["float32"] >= 2 * rows * 16 * 4
  assert 0.5 < rep["max_error_over_bound"] <= 1.0 + 1e-6
  assert 0.5 < rep["max_grad_error_over_bound"] <= 1.0 + 1e-6
  assert all(t["partials"] == 1 and t["bound"] == eb for t in rep["tables"].values())
  # A bound below float32's resolution: every exchange falls back to float32, bit for bit.
  exact = dataclasses.replace(base, a2a_mode="abs", a2a_error_bound=1e-30,
                              a2a_grad_error_bound=1e-30, a2a_bits=16)
  task_x, _, _, out_x, loss_x = _train(exact, tmp_path / "exact")
  np.testing.assert_array_equal(loss_x, loss0)
  rep = runs.a2a_report(task_x, out_x["state"], [first])
  assert rep["max_error_over_bound"] == 0 and rep["max_grad_error_over_bound"] == 0
