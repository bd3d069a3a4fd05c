"""The train loop's hooks (core.hooks) and the shared dense update (core.update), on a toy
least-squares task: a caller's hook runs at its steps and sees the state of that step; the
non-finite guard skips a poisoned step and the loop counts it; the metric writer keeps a
breakdown (NE by slice) in metrics.jsonl and only numbers in TensorBoard."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

from core import hooks as hooks_lib
from core import train as train_lib
from core import update as update_lib

W = np.array([1.0, -2.0, 0.5], np.float32)


class _Mse:
  def __init__(self):
    self.sum = self.n = 0.0

  def update(self, outputs, host):
    self.sum += float(outputs) * len(host["y"])
    self.n += len(host["y"])

  def result(self):
    return {"mse": self.sum / self.n}


class _Toy:
  """y = x @ W by SGD; batch k is a draw of seed k (batch `poison` holds a NaN)."""

  def __init__(self, poison: int | None = None):
    self.tx, self.poison = optax.sgd(0.1), poison

  def batches(self, start):
    k = start
    while True:
      x = np.random.default_rng(k).normal(size=(16, 3)).astype(np.float32)
      y = x @ W
      if k == self.poison:
        y[0] = np.nan
      yield {"x": x, "y": y}
      k += 1

  def init_state(self, seed):
    params = {"w": jnp.zeros(3)}
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": self.tx.init(params)}

  def train_step(self, state, batch, skip_nonfinite=False):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state["params"])
    dense = update_lib.dense_update(self.tx, state["params"], state["opt"], grads, loss,
                                    skip_nonfinite=skip_nonfinite)
    return {"step": state["step"] + 1, "params": dense.params, "opt": dense.opt}, dense.metrics

  def eval_step(self, state, batch):
    return jnp.mean((batch["x"] @ state["params"]["w"] - batch["y"]) ** 2)

  def device_batch(self, host):
    return jax.tree.map(jnp.asarray, host)

  def new_evaluator(self):
    return _Mse()

  def examples_in(self, host):
    return len(host["y"])


def _loop(tmp_path, **kw):
  return train_lib.TrainConfig(workdir=str(tmp_path), steps=10, log_every=5,
                               tensorboard=False, **kw)


def test_hook_due_at_its_steps_and_the_last():
  seen = []
  hook = hooks_lib.Hook(lambda run: seen.append(run.step), every=3, last=True)
  off = hooks_lib.Hook(lambda run: seen.append(-run.step), every=0)
  for step in range(1, 11):
    hooks_lib.run_hooks([hook, off], types.SimpleNamespace(step=step, end=10))
  assert seen == [3, 6, 9, 10]


def test_a_callers_hook_sees_each_of_its_steps(tmp_path):
  task = _Toy()
  seen = []

  def probe(run):
    run.pause()
    seen.append((run.step, int(run.state["step"])))
    run.writer.write(run.step, "probe", {"w0": float(run.state["params"]["w"][0])})

  out = train_lib.train(task, task.batches, lambda: [next(task.batches(100))], _loop(tmp_path),
                        hooks=[train_lib.Hook(probe, every=4)])
  assert seen == [(4, 4), (8, 8)] and out["step"] == 10
  assert out["eval"]["mse"] < float(np.mean(W ** 2))   # it trained
  with open(tmp_path / "metrics.jsonl") as f:
    probes = [line for line in f if '"probe"' in line]
  assert len(probes) == 2


def test_dense_update_skips_a_nonfinite_step_and_the_loop_counts_it(tmp_path):
  task = _Toy(poison=6)   # the batch of step 7
  out = train_lib.train(task, task.batches, None, _loop(tmp_path, nonfinite="skip"))
  assert out["skipped_steps"] == 1 and out["step"] == 10
  assert np.isfinite(np.asarray(out["state"]["params"]["w"])).all()
  clean = _Toy()
  state = clean.init_state(0)
  batch = clean.device_batch(next(_Toy(poison=0).batches(0)))
  new, metrics = jax.jit(lambda s, b: clean.train_step(s, b, skip_nonfinite=True))(state, batch)
  assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
  np.testing.assert_array_equal(np.asarray(new["params"]["w"]), np.zeros(3))
  assert int(new["step"]) == 1


def _tb_scalars(logdir):
  """{tag: [value, ...]} of the TensorBoard event files under `logdir` (TFRecord framing:
  length u64, its crc u32, the Event proto, its crc u32)."""
  import glob
  import struct
  from tensorboardX.proto import event_pb2
  out: dict[str, list[float]] = {}
  for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      for v in ev.summary.value:
        out.setdefault(v.tag, []).append(v.simple_value)
      i += 12 + n + 4
  return out


def test_metric_writer_keeps_breakdowns_in_jsonl_and_numbers_in_tensorboard(tmp_path):
  import json
  w = hooks_lib.MetricWriter(str(tmp_path), None)
  slices = [{"group": 7, "impressions": 3, "ne": 0.9}, {"group": "other", "ne": float("nan")}]
  w.write(4, "eval", {"auc": np.float32(0.75), "calibration": 1.25, "gauc": 0.5,
                      "gauc_groups": {"counted": 2, "skipped": 1}, "ne_by_slice": slices})
  w.close()
  rec = json.loads(open(tmp_path / "metrics.jsonl").read())
  assert rec["auc"] == 0.75 and rec["gauc_groups"] == {"counted": 2, "skipped": 1}
  assert rec["ne_by_slice"][0] == slices[0] and rec["step"] == 4
  assert _tb_scalars(tmp_path / "tb") == {"eval/auc": [0.75], "eval/calibration": [1.25],
                                          "eval/gauc": [0.5]}


def test_a_resumed_writer_hides_in_tensorboard_what_metrics_jsonl_drops(tmp_path):
  # Resumed from checkpoint 10: the records up to step 10 stay (metrics.jsonl keeps them,
  # the resumed run does not write them again), those after it go. TensorBoard hides the
  # loaded events whose step is >= the step of a later SessionLog START (tensorboardX's
  # `purge_step`), which this test replays over the event files in TensorBoard's order.
  import glob
  import json
  import os
  import struct
  from tensorboardX.proto import event_pb2
  w = hooks_lib.MetricWriter(str(tmp_path), None)
  for step in (5, 10, 15):
    w.write(step, "train", {"loss": float(step)})
  w.close()
  for i, path in enumerate(glob.glob(f"{tmp_path}/tb/events.out.tfevents.*")):
    # the first run's file sorts first (the same second would give both runs one name)
    os.rename(path, f"{tmp_path}/tb/events.out.tfevents.0000000000.first{i}")
  w = hooks_lib.MetricWriter(str(tmp_path), 10)
  w.write(15, "train", {"loss": 150.0})
  w.close()
  shown: list[tuple[int, float]] = []
  for path in sorted(glob.glob(f"{tmp_path}/tb/events.out.tfevents.*")):
    data, i = open(path, "rb").read(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
        shown = [(s, v) for s, v in shown if s < ev.step]
      shown += [(ev.step, v.simple_value) for v in ev.summary.value]
  with open(tmp_path / "metrics.jsonl") as f:
    kept = [(r["step"], r["loss"]) for r in map(json.loads, f)]
  assert shown == kept == [(5, 5.0), (10, 10.0), (15, 150.0)]


def test_a_resumed_writer_drops_a_torn_last_line_and_names_a_bad_one(tmp_path, capsys):
  # A crash can cut the last write short (part of a line; after a power loss, zero bytes):
  # the resume keeps the whole records up to its checkpoint and says what it dropped. A bad
  # line with records after it is no torn write: refused naming the file and line.
  import json

  import pytest
  path = tmp_path / "metrics.jsonl"
  recs = [json.dumps({"step": s, "split": "train", "loss": float(s)}) for s in (5, 10, 15)]
  for tail in (b'{"step": 20, "split": "tr', b"\0" * 64, recs[2][:-3].encode()):
    path.write_bytes("\n".join(recs).encode() + b"\n" + tail)
    w = hooks_lib.MetricWriter(str(tmp_path), 10, tensorboard=False)
    w.write(15, "train", {"loss": 150.0})
    w.close()
    with open(path) as f:
      assert [(r["step"], r["loss"]) for r in map(json.loads, f)] == [
          (5, 5.0), (10, 10.0), (15, 150.0)]
    out = capsys.readouterr().out
    assert (f"{path}:4: dropped a last line that is not a whole record" in out) == (
        tail != b"\0" * 64)
  path.write_text(recs[0] + "\n" + recs[1])   # the last record whole, its newline not written
  w = hooks_lib.MetricWriter(str(tmp_path), 10, tensorboard=False)
  w.write(15, "train", {"loss": 150.0})
  w.close()
  assert [json.loads(l)["step"] for l in open(path)] == [5, 10, 15]
  path.write_text(recs[0] + "\n" + recs[1][:-3] + "\n" + recs[2] + "\n")
  with pytest.raises(ValueError, match=f"^{path}:2: .* is not a metrics record; expected one "
                     "JSON object with an integer 'step' per line"):
    hooks_lib.MetricWriter(str(tmp_path), 10, tensorboard=False)
