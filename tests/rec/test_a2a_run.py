"""The compressed embedding exchange (arXiv 2407.04272) as a run setting: the shared rec run
flags --a2a_mode / --a2a_error_bound / --a2a_grad_error_bound / --a2a_bits and the
dual-level adaptive bound's --a2a_table_factors / --a2a_schedule (errors name the flag), the
refusal of a sharding with no exchange, the resume rule over them, a train_rec run whose
schedule and table factors set the bound at the steps and tables they say, and (slow) a
train_rec run on 8 devices against the float32 one: step 1's loss within the first-order
bound of the arithmetic, bit-identical losses when every exchange falls back to float32,
and `rec.embedding.a2a_report`'s bytes and errors against the layout and the bounds (also,
fast, on a tiny two-device task at its initial state, with the line train_rec prints)."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags

from core import checkpoint as ckpt_lib
from core import train as train_lib
from core.errors import UserError
from rec import configs
from rec import runs
from rec.embedding import a2a_compression as ac
from rec.embedding import a2a_report
from tests import cpu_env
from tests.experiments.entry import REPO
from tests import forkserver

SMALL = dict(preset="small", num_rows=1000, batch_size=64, eval_batch_size=64, eval_batches=1)


def _cfg(flag_args):
  """The config train_rec builds from these flags (all rec run flags at their defaults)."""
  fv = flags.FlagValues()
  configs.define_run_flags(*configs.RUN_FIELDS, flag_values=fv)
  fv(["prog", *flag_args])
  return configs.run_from_flags(fv)


def test_flags_parse_into_the_setting():
  assert _cfg([]).a2a_spec() is None
  spec = _cfg(["--a2a_mode=rel", "--a2a_error_bound=0.05", "--a2a_grad_error_bound=0.08",
               "--a2a_bits=4"]).a2a_spec()
  assert spec == ac.A2ACompression("rel", 0.05, 0.08, 4)
  assert _cfg(["--a2a_mode=abs"]).a2a_spec() == ac.A2ACompression("abs", 1e-3, None, 8)
  spec = _cfg(["--a2a_mode=abs", "--a2a_table_factors=C1=0.5, C3=2",
               "--a2a_schedule=cosine:2:0.5:100"]).a2a_spec(["C1", "C2", "C3"])
  assert spec == ac.A2ACompression("abs", 1e-3, None, 8, {"C1": 0.5, "C3": 2.0},
                                   ac.Schedule("cosine", 2.0, 0.5, 100))


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
    (["--a2a_schedule=linear:2:1:10"], r"--a2a_schedule=linear:2:1:10 with --a2a_mode=none"),
    (["--a2a_table_factors=C1=2"], r"--a2a_table_factors=C1=2 with --a2a_mode=none"),
    (["--a2a_mode=abs", "--a2a_schedule=exp:1:2:3"],
     r"--a2a_schedule='exp:1:2:3': not a schedule; expected constant or KIND:START:END:STEPS"),
    (["--a2a_mode=abs", "--a2a_schedule=linear:1:2"], r"--a2a_schedule='linear:1:2': not a "
                                                      r"schedule"),
    (["--a2a_mode=abs", "--a2a_schedule=linear:1:x:5"], r"--a2a_schedule='linear:1:x:5': a "
                                                        r"number does not parse"),
    (["--a2a_mode=abs", "--a2a_schedule=step:1:0:5"], r"--a2a_schedule='step:1:0:5': start "
                                                      r"1.0, end 0.0, steps 5"),
    (["--a2a_mode=abs", "--a2a_schedule=step:1:2:0"], r"--a2a_schedule='step:1:2:0': start "),
    (["--a2a_mode=abs", "--a2a_table_factors=C1"], r"--a2a_table_factors='C1': 'C1' is not "
                                                   r"NAME=FACTOR; expected NAME=FACTOR,"),
    (["--a2a_mode=abs", "--a2a_table_factors==2"], r"--a2a_table_factors='=2': '=2' is not "
                                                   r"NAME=FACTOR"),
    (["--a2a_mode=abs", "--a2a_table_factors=C1=x"], r"--a2a_table_factors='C1=x': the factor "
                                                     r"of C1 does not parse"),
    (["--a2a_mode=abs", "--a2a_table_factors=C1=0"], r"--a2a_table_factors='C1=0': the factor "
                                                     r"of C1 is 0.0; expected .* factors > 0"),
    (["--a2a_mode=abs", "--a2a_table_factors=C1=nan"], r"the factor of C1 is nan"),
    (["--a2a_mode=abs", "--a2a_table_factors=C1=1,C1=2"], r"--a2a_table_factors='C1=1,C1=2': "
                                                          r"C1 is given twice"),
    # rel: the smallest scaled bound (0.05 x 0.01) needs more codes than 8 bits hold
    (["--a2a_mode=rel", "--a2a_error_bound=0.05", "--a2a_schedule=linear:1:0.01:10"],
     r"--a2a_error_bound=0.05: a relative bound needing 507 codes each side at the smallest "
     r"scaled bound"),
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
  cfg = configs.make_run(**SMALL, a2a_mode="abs", **over)
  devices = jax.devices()[:1] if over.get("mesh") == "data:1" else None
  with pytest.raises(ValueError, match=msg):
    configs.build_run(cfg, devices=devices)


@pytest.mark.devices(8)
def test_build_run_takes_the_setting_once():
  cfg = configs.make_run(**SMALL, sharding="rw", a2a_mode="abs", a2a_error_bound=0.01)
  task = configs.build_run(cfg)[0]
  assert task.collection.a2a_compression == ac.A2ACompression("abs", 0.01)
  with pytest.raises(ValueError, match="build_run: a2a_compression=.* and --a2a_mode=abs; "
                     "expected one of the two"):
    configs.build_run(cfg, a2a_compression=ac.A2ACompression("abs", 0.02))
  assert cfg.without_a2a() == configs.replace_run(cfg, a2a_mode="none", a2a_error_bound=1e-3)


@pytest.mark.devices(8)
def test_table_factors_name_tables_of_the_run():
  cfg = _cfg(["--preset=small", "--num_rows=1000", "--batch_size=64", "--eval_batch_size=64",
              "--sharding=tw", "--a2a_mode=abs", "--a2a_table_factors=C1=2,C99=0.5"])
  cfg.validate()   # the names are the data's: checked once the tables are known
  with pytest.raises(UserError, match=r"^--a2a_table_factors=C1=2,C99=0.5: no table is named "
                     r"\['C99'\]; expected names of the tables \['C1', 'C2', "):
    configs.build_run(cfg)


def test_train_rec_refuses_a_bad_schedule_in_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run([sys.executable, "-m", "experiments.train_rec", "--a2a_mode=abs",
                        "--a2a_schedule=linear:2:0.5", f"--workdir={tmp_path / 'w'}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines() == [
      "error: --a2a_schedule='linear:2:0.5': not a schedule; expected constant or "
      "KIND:START:END:STEPS with KIND in linear|cosine|step, factors > 0, STEPS >= 1"]


def _resume(workdir, saved: dict, now: configs.RecRunConfig):
  ckpt = ckpt_lib.Checkpointer(workdir)
  loop = dict(workdir=workdir, steps=1, normalize_settings=configs.normalize_settings)
  ckpt.save(1, {"x": np.zeros(2, np.float32)}, {"step": 1, "steps": 1, "settings": {
      **train_lib.run_settings(train_lib.TrainConfig(**loop)), **saved}})
  ckpt.close()
  return train_lib.check_resume(train_lib.TrainConfig(**loop, resume=True,
                                                      settings=now.run_settings()))


def test_resume_with_other_a2a_settings_names_them(tmp_path):
  plain, comp = configs.make_run(), configs.make_run(a2a_mode="abs", a2a_bits=4)
  with pytest.raises(train_lib.RunSettingsError) as e:
    _resume(str(tmp_path / "a"), plain.run_settings(), comp)
  assert "a2a_mode: 'none' (checkpoint) -> 'abs' (now)" in str(e.value)
  assert "a2a_bits: 8 (checkpoint) -> 4 (now)" in str(e.value)
  # Settings saved without the a2a fields are a float32 run: compression is refused...
  old = {k: v for k, v in plain.run_settings().items() if not k.startswith("a2a_")}
  with pytest.raises(train_lib.RunSettingsError, match="a2a_mode: 'none' .checkpoint. -> "
                     "'abs' .now."):
    _resume(str(tmp_path / "b"), old, comp)
  # ... and the float32 run resumes as before.
  assert _resume(str(tmp_path / "c"), old, plain) == 1


def test_resume_without_the_adaptive_fields_reads_them_as_constant(tmp_path):
  """Settings saved with a2a_mode but without a2a_table_factors / a2a_schedule mean one
  bound for every table and step: they resume as that, and a schedule or factors given at
  resume is refused naming them."""
  comp = configs.make_run(a2a_mode="abs", a2a_error_bound=0.01)
  saved = {k: v for k, v in comp.run_settings().items()
           if k not in ("a2a_table_factors", "a2a_schedule")}
  assert _resume(str(tmp_path / "a"), saved, comp) == 1
  now = configs.replace_run(comp, a2a_schedule="linear:2:0.5:100", a2a_table_factors="C1=2")
  with pytest.raises(train_lib.RunSettingsError) as e:
    _resume(str(tmp_path / "b"), saved, now)
  assert "a2a_schedule: 'constant' (checkpoint) -> 'linear:2:0.5:100' (now)" in str(e.value)
  assert "a2a_table_factors: '' (checkpoint) -> 'C1=2' (now)" in str(e.value)


def test_a_run_record_without_the_a2a_fields_is_the_float32_run(tmp_path):
  """`rec.runs.finished_run`: a record written without the a2a fields (a float32 run, one
  bound throughout) is reused for today's float32 config, not for a compressed one."""
  cfg = configs.make_run(**SMALL)
  rec = runs._settings(cfg, 3, 0)
  rec["config"] = {k: v for k, v in rec["config"].items() if not k.startswith("a2a_")}
  with open(tmp_path / runs.RUN_RECORD, "w") as f:
    json.dump({**rec, "result": {"ne": 0.9}}, f)
  assert runs.finished_run(cfg, str(tmp_path), steps=3, seed=0) == {"ne": 0.9}
  with pytest.raises(UserError, match=r"config.a2a_schedule: 'constant' -> 'linear:2:1:3'"):
    runs.finished_run(configs.replace_run(cfg, a2a_mode="abs", a2a_schedule="linear:2:1:3"),
                      str(tmp_path), steps=3, seed=0)


# --------------------------------------------------------------------------- training


def _train(cfg, workdir, steps=3, devices=None):
  task, train_src, eval_src, plan, _ = configs.build_run(cfg, devices=devices)
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
  base = configs.make_run(**SMALL, sharding="tw", mesh="data:8")
  task0, src, plan, _, loss0 = _train(base, tmp_path / "f32")
  comp = configs.replace_run(base, a2a_mode="abs", a2a_error_bound=eb, a2a_grad_error_bound=geb)
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
  rep = a2a_report.a2a_report(task, out["state"], [first, first])
  N, B_l = 8, 64 // 8
  S = max(sum(1 for p in plan.values() if p.devices == (d,)) for d in range(N))
  rows = N * B_l * S
  assert rep["bytes"]["payload"] == 2 * rows * ac.payload_bytes(16, 8)
  assert rep["bytes"]["float32"] == 2 * rows * 16 * 4
  assert 0.5 < rep["max_error_over_bound"] <= 1.0 + 1e-6
  assert 0.5 < rep["max_grad_error_over_bound"] <= 1.0 + 1e-6
  assert all(t["partials"] == 1 and t["bound"] == eb for t in rep["tables"].values())
  # A bound below float32's resolution: every exchange falls back to float32, bit for bit.
  exact = configs.replace_run(base, a2a_mode="abs", a2a_error_bound=1e-30,
                              a2a_grad_error_bound=1e-30, a2a_bits=16)
  task_x, _, _, out_x, loss_x = _train(exact, tmp_path / "exact")
  np.testing.assert_array_equal(loss_x, loss0)
  rep = a2a_report.a2a_report(task_x, out_x["state"], [first])
  assert rep["max_error_over_bound"] == 0 and rep["max_grad_error_over_bound"] == 0


@pytest.mark.devices(2)
def test_schedule_and_table_factors_set_the_bound_of_each_step_and_table(tmp_path):
  """A train_rec run with --a2a_schedule=step:1e-27:1:2 and --a2a_table_factors: steps 0
  and 1 run at a bound below float32's resolution (every exchange falls back to float32, so
  their losses are the float32 run's, bit for bit), step 2 on at the flagged bound (its loss
  moves). At the final state, the pooled embeddings at steps 0-3 against a float32 copy of
  the collection: each table's largest error is 0 at steps 0 and 1, and from step 2 within
  the flagged bound x its factor and near it (a factor left out would put C1's error below
  half its bound and C2's above it). 16-bit codes: every row meets even C2's bound, so no
  exchange of steps 2 on falls back."""
  args = ["--preset=small", "--num_rows=1000", "--batch_size=64", "--eval_batch_size=64",
          "--eval_batches=1", "--sharding=tw", "--mesh=data:2"]
  base = _cfg(args)
  cfg = _cfg(args + ["--a2a_mode=abs", "--a2a_error_bound=1e-3", "--a2a_grad_error_bound=1e-4",
                     "--a2a_bits=16", "--a2a_table_factors=C1=4,C2=0.25",
                     "--a2a_schedule=step:1e-27:1:2"])
  two = jax.devices()[:2]   # train_rec on two devices: an exchange at the least cost
  _, src, _, _, loss0 = _train(base, tmp_path / "f32", devices=two)
  task, _, _, out, loss = _train(cfg, tmp_path / "adaptive", devices=two)
  np.testing.assert_array_equal(loss[:2], loss0[:2])
  assert loss[2] != loss0[2]
  plain = a2a_report._float32_task(task)   # the same layout and state, the exchange in float32
  batch = task.device_batch(next(iter(src.batches(0))))

  @jax.jit
  def error(emb, batch, step):   # [F]: the largest |compressed - float32| per table
    lookup = task.gather(emb, batch)
    e = task.collection.pool(lookup, step=step) - plain.collection.pool(lookup, step=step)
    return jnp.max(jnp.abs(e), axis=(0, 2))

  names = [t.name for t in task.collection.tables]
  factor = np.asarray([{"C1": 4.0, "C2": 0.25}.get(n, 1.0) for n in names])
  for step in range(4):
    err = np.asarray(error(out["state"]["emb"], batch, jnp.int32(step)), np.float64)
    if step < 2:
      np.testing.assert_array_equal(err, 0.0)
    else:
      ratio = err / (1e-3 * factor)
      assert np.all((ratio > 0.5) & (ratio <= 1.0 + 1e-6)), (step, dict(zip(names, ratio)))


@pytest.mark.devices(2)
def test_a2a_report_of_a_tiny_two_device_task():
  """train_rec's --a2a report at the initial state of a two-device tw run (no training): the
  payload bytes of the layout's rows (forward + backward), each table's bound its flagged
  bound x table factor x the schedule's factor at step 0, errors within and near it, and the
  one line that prints them."""
  cfg = configs.make_run(preset="small", num_rows=100, batch_size=16, eval_batch_size=16,
                         eval_batches=1, sharding="tw", mesh="data:2", a2a_mode="abs",
                         a2a_error_bound=1e-3, a2a_grad_error_bound=1e-4,
                         a2a_table_factors="C1=4", a2a_schedule="linear:2:1:10")
  task, src, _, plan, _ = configs.build_run(cfg, devices=jax.devices()[:2])
  state = task.init_state(0)
  batch = next(iter(src.batches(0)))
  with pytest.raises(ValueError, match=r"^a2a_report: no batches$"):
    a2a_report.a2a_report(task, state, [])
  with pytest.raises(ValueError, match=r"^a2a_report: the task's collection has no "
                     r"a2a_compression$"):
    a2a_report.a2a_report(a2a_report._float32_task(task), state, [batch])
  rep = a2a_report.a2a_report(task, state, [batch])
  D = task.collection.tables[0].dim
  S = max(sum(1 for p in plan.values() if p.devices == (d,)) for d in range(2))
  rows = 2 * (16 // 2) * S                       # N devices x local batch x tables per device
  assert rep["bytes"]["payload"] == 2 * rows * ac.payload_bytes(D, 8)
  assert rep["bytes"]["float32"] == 2 * rows * D * 4   # the same rows (not the ids' weights)
  assert (rep["step"], rep["batches"]) == (0, 1)
  factor = lambda name: 4.0 if name == "C1" else 1.0
  for name, t in rep["tables"].items():
    assert (t["kind"], t["partials"]) == ("tw", 1)
    assert t["bound"] == pytest.approx(1e-3 * factor(name) * 2.0, rel=1e-12), name
    assert 0.5 < t["error_over_bound"] <= 1 + 1e-6, (name, t)
  for g in rep["groups"].values():
    assert g["grad_bound"] == pytest.approx(1e-4 * 2.0 * max(map(factor, g["tables"])))
    assert 0 < g["error_over_bound"] <= 1 + 1e-6, g
  worst = max(t["error_over_bound"] for t in rep["tables"].values())
  assert rep["max_error_over_bound"] == worst
  assert a2a_report.format_a2a_report(rep) == (
      f"a2a compression (abs 0.001, 8 bits): {rep['bytes']['payload']:,} payload bytes per "
      f"device per step (the step uncompressed: {rep['bytes']['float32']:,} float32 bytes of "
      f"exchanges); pooled error <= {worst:.3f} x its bound, gradient error <= "
      f"{rep['max_grad_error_over_bound']:.3f} x its bound (step 0, 1 batch)")
  exact = dict(rep, setting=dict(rep["setting"], grad_bound=None), max_error_over_bound=0.0,
               batches=2)
  assert a2a_report.format_a2a_report(exact).endswith(
      "pooled error <= 0.000 x its bound (exact: the exchanges fell back to float32), "
      "gradients sent in float32 (step 0, 2 batches)")
  # A collection built by hand whose exchange compresses no table (build_run refuses one).
  none = dict(rep, max_error_over_bound=None, max_grad_error_over_bound=None)
  assert a2a_report.format_a2a_report(none).endswith(
      "no pooled exchange compressed (one device, or no table exchanged), gradients sent in "
      "float32 (step 0, 1 batch)")


@pytest.mark.devices(2)
def test_a2a_report_measures_a_rel_bound_against_each_rows_range():
  """--a2a_mode=rel bounds each sent row's error by eb x the row's value range (max - min),
  so the report measures each error in those units: under tw the row sent is the pooled
  row (forward) and its gradient row (backward). At 8 bits and eb 0.05 rows use a few of
  their codes, so the largest error sits near the bound, not at |error| / eb."""
  eb = 0.05
  cfg = configs.make_run(preset="small", num_rows=100, batch_size=16, eval_batch_size=16,
                         eval_batches=1, sharding="tw", mesh="data:2", a2a_mode="rel",
                         a2a_error_bound=eb, a2a_grad_error_bound=eb)
  task, src, _, _, _ = configs.build_run(cfg, devices=jax.devices()[:2])
  state = task.init_state(0)
  batch = next(iter(src.batches(0)))
  rep = a2a_report.a2a_report(task, state, [batch])
  lookup = task.gather(state["emb"], task.device_batch(batch))
  ef = np.asarray(a2a_report._float32_task(task).collection.pool(lookup), np.float64)
  ec = np.asarray(task.collection.pool(lookup), np.float64)
  ratio = (np.abs(ec - ef).max(-1) / (eb * (ef.max(-1) - ef.min(-1)))).max(0)    # [F]
  for f, (name, t) in enumerate(rep["tables"].items()):
    assert t["bound"] == eb and t["max_abs_error"] == pytest.approx(np.abs(ec - ef)[:, f].max())
    # float32 rounding of the ratio's terms only
    assert t["error_over_bound"] == pytest.approx(ratio[f], rel=1e-5), name
    assert 0.5 < t["error_over_bound"] <= 1 + 1e-6, (name, t)
  for g in rep["groups"].values():
    assert 0.5 < g["error_over_bound"] <= 1 + 1e-6, g
