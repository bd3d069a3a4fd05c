"""A train_rec checkpoint written on 8 simulated devices, resumed, predicted and evaluated on
any device count, mesh and sharding plan (RecTask.restore_checkpoint, rec/embedding/reshard.py).

The runs are train_rec's own (rec.configs.build_run, core.train.train with train_rec's
checkpoint settings and resume rules), in-process; `experiments.predict` runs once as a user
would, on one device. Data: Criteo-format text files with one id per bag (a custom split).

Tolerances, per what changes (measured: DLRM small, 4 + 4 steps of 64, fp32):
- 8 -> 2x4 devices (the same count, another mesh, any kind): the resumed run's state and
  metrics equal the uninterrupted run's bit for bit.
- 8 -> 4 or 1 devices, tw / rw / twrw (row-wise Adagrad) and cw (Adagrad): the resharded
  state is the checkpoint's bit for bit (tests/rec/test_reshard.py), but the dense gradient
  is a mean over each device's partial sum, which regroups with the device count: after 4
  more steps tables differ by at most 1e-7 (cw, Adagrad: 6e-7), dense parameters by 6e-8,
  AUC by 0 and log loss by < 1e-7. Asserted: tables 2e-6, dense 1e-6, AUC and log loss 1e-6.
- Predictions of the 8-device checkpoint on 1 device: bit for bit for every kind here (one id
  per bag: a rw / twrw bag sum has one nonzero partial, so regrouping the row shards'
  partials adds only zeros; with multi-hot bags rw / twrw lookups agree within float32
  summation order, tests/rec/test_reshard.py).
- cw under row-wise Adagrad into another chunk count (4 chunks on 8 devices -> 1 on one
  device) changes the optimizer (one accumulator per row per chunk): its accumulators are
  merged exactly, but the continued run is another run (not asserted equal).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from core import checkpoint as ckpt_lib
from core import train as train_lib
from experiments import train_rec
from rec import configs
from rec import predict as predict_lib
from tests import cpu_env
from tests.experiments.entry import REPO

pytestmark = pytest.mark.devices(8)


def write_criteo(d: str, seed: int = 0) -> None:
  """Criteo-format train / valid / test files whose labels depend on a few categories."""
  rng = np.random.default_rng(seed)
  os.makedirs(d, exist_ok=True)
  effect = rng.normal(size=(26, 64))
  for name, n in (("train.txt", 1024), ("valid.txt", 128), ("test.txt", 128)):
    lines = []
    for _ in range(n):
      ints, cats = rng.integers(0, 20, 13), rng.zipf(1.5, 26) % 64
      z = effect[np.arange(26), cats].sum() / 3 + (ints[0] - 10) / 10
      y = int(rng.random() < 1 / (1 + np.exp(-z)))
      lines.append("\t".join([str(y), *map(str, ints), *(f"{c:08x}" for c in cats)]))
    with open(os.path.join(d, name), "w") as f:
      f.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("criteo"))
  write_criteo(d)
  return f"criteo:{d}"


def train(data: str, workdir: str, mesh: str, devices: int, kind: str, steps: int = 8,
          opt: str = "rowwise_adagrad", resume: bool = False, allow=(), model="logreg", **over):
  """A train_rec run (its checkpoint settings and resume rules) of logistic regression (the
  default suite's: it compiles in half DLRM's time) or DLRM small, checkpoints every 4
  steps; (summary, task)."""
  cfg = configs.make_run(**{**dict(
      model=model, preset="small", data=data, num_rows=500, batch_size=64,
      eval_batch_size=128, sharding=kind, mesh=mesh, memory_budget_gb=1.0,
      sparse_optimizer=opt), **over})
  task, tr, ev, _, m = configs.build_run(cfg, jax.devices()[:devices])
  loop = train_lib.TrainConfig(
      workdir=workdir, steps=steps, checkpoint_every=4, log_every=100, resume=resume,
      tensorboard=False, max_to_keep=5, settings=configs.checkpoint_settings(cfg, m, tr.spec),
      changeable=train_rec.RESUME_CHANGEABLE, normalize_settings=configs.normalize_settings,
      resume_allow=allow)
  return train_lib.train(task, tr.batches, lambda: ev.batches(0), loop), task


def from_step(src: str, dst: str, step: int = 4) -> str:
  """A workdir holding `src`'s checkpoint `step` only (a run stopped there)."""
  os.makedirs(os.path.join(dst, "checkpoints"))
  shutil.copytree(os.path.join(src, "checkpoints", str(step)),
                  os.path.join(dst, "checkpoints", str(step)))
  return dst


def max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def predictions(workdir: str, devices: int) -> np.ndarray:
  run = predict_lib.load_run(workdir, split="test", devices=jax.devices()[:devices])
  return np.concatenate([p for _, p, _ in predict_lib.predictions(run)])


def check_resumed(full, task, resumed, rtask, bitwise: bool, table_tol: float = 2e-6):
  tables = task.collection.to_tables(full["state"]["emb"])
  rtables = rtask.collection.to_tables(resumed["state"]["emb"])
  if bitwise:
    for n in tables:
      np.testing.assert_array_equal(rtables[n], tables[n], err_msg=n)
    assert max_diff(full["state"]["params"], resumed["state"]["params"]) == 0
    assert resumed["eval"] == full["eval"]
    return
  assert max_diff(tables, rtables) <= table_tol
  assert max_diff(full["state"]["params"], resumed["state"]["params"]) <= 1e-6
  for k in ("auc", "logloss"):
    assert resumed["eval"][k] == pytest.approx(full["eval"][k], abs=1e-6), k


@pytest.fixture(scope="module")
def rw8(data, tmp_path_factory):
  """8 steps of a rw run on 8 devices, checkpoints at 4 and 8."""
  d = str(tmp_path_factory.mktemp("rw8"))
  full, task = train(data, d, "data:8", 8, "rw")
  return d, full, task


def test_resume_on_4_devices_with_another_sharding(data, rw8, tmp_path, capsys):
  """The rw checkpoint of step 4 continued on 4 devices as tw (another device count and
  kind, a flag train_rec lets change on resume) ends where the 8-device run did."""
  src, full, task = rw8
  capsys.readouterr()
  resumed, rtask = train(data, from_step(src, str(tmp_path / "r4")), "data:4", 4, "tw",
                         resume=True)
  assert "resharded checkpoint 4: 8 devices rw -> 4 devices tw\n" in capsys.readouterr().out
  check_resumed(full, task, resumed, rtask, bitwise=False)


def test_predict_on_one_device(rw8):
  """predict (rec.predict.load_run, the library of experiments.predict) on 1 device of the
  8-device checkpoint (not refused as "needs 8 devices, but 1 are available"): the
  probabilities equal the 8-device ones bit for bit."""
  src = rw8[0]
  np.testing.assert_array_equal(predictions(src, 1), predictions(src, 8))
  # 3 devices do not divide the run's eval batch of 128: the batch is 129 (not refused,
  # naming a --batch_size / --mesh predict is never given). Batches of 43 rows per device
  # may group the logit's float32 sum of 26 terms otherwise (jax 0.12's XLA:CPU does): a
  # few float32 ulps.
  np.testing.assert_allclose(predictions(src, 3), predictions(src, 8), rtol=1e-6, atol=0)


@pytest.mark.slow   # the default suite: test_predict_on_one_device (load_run, in-process)
def test_predict_entry_point_on_one_device(rw8):
  """`python -m experiments.predict` in a 1-device process writes the 8-device run's
  predictions."""
  src = rw8[0]
  p8 = predictions(src, 8)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1),
             PYTHONPATH=cpu_env.python_path(REPO))
  out_csv = os.path.join(src, "p1.csv")
  out = subprocess.run([sys.executable, "-m", "experiments.predict", f"--checkpoint={src}",
                        "--split=test", f"--output={out_csv}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resharded checkpoint 8: 8 devices rw -> 1 device rw" in out.stdout
  rows = list(csv.reader(open(out_csv)))
  assert rows[0] == ["row", "probability", "label"] and len(rows) == 1 + len(p8)
  np.testing.assert_allclose([float(r[1]) for r in rows[1:]], p8, rtol=1e-5)


def test_other_table_sizes_are_refused_in_one_line(data, rw8, tmp_path):
  """A resume that builds tables of other rows (here allowed past the settings check) is
  refused naming the table and both shapes."""
  with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
    train(data, from_step(rw8[0], str(tmp_path / "r")), "data:4", 4, "tw", resume=True,
          num_rows=400, allow=("num_rows", "features"))
  msg = str(e.value)
  assert "\n" not in msg and (
      "checkpoints/4: table C1 is [500, 1] (rows, dim) there and [400, 1] in the model built "
      "now; expected the same table sizes (--num_rows, the data's vocabulary) and embedding "
      "dim (") in msg


@pytest.mark.slow   # the default suite: the rw -> 4 x tw resume and 1-device predictions above
@pytest.mark.parametrize("kind,opt", [("tw", "rowwise_adagrad"), ("rw", "rowwise_adagrad"),
                                      ("twrw", "rowwise_adagrad"), ("cw", "adagrad")])
def test_every_kind_resumes_on_4_2x4_and_1_and_predicts_on_1(kind, opt, data, tmp_path, capsys):
  """DLRM small (embedding dim 16: cw cuts 4 chunks on 8 and 4 devices, 1 on one)."""
  full, task = train(data, str(tmp_path / "full"), "data:8", 8, kind, opt=opt, model="dlrm")
  # The same weights on 1 and on 8 devices: the MLPs' products over 128 rows and over 16 may
  # group their sums otherwise (jax 0.12's XLA:CPU does, by a unit in the last place).
  np.testing.assert_allclose(predictions(str(tmp_path / "full"), 1),
                             predictions(str(tmp_path / "full"), 8), rtol=1e-5)
  for mesh, n in (("data:2,model:4", 8), ("data:4", 4), ("data:1", 1)):
    capsys.readouterr()
    wd = from_step(str(tmp_path / "full"), str(tmp_path / f"r_{mesh}"))
    resumed, rtask = train(data, wd, mesh, n, kind, opt=opt, resume=True, model="dlrm")
    assert "resharded checkpoint 4: 8 devices" in capsys.readouterr().out
    check_resumed(full, task, resumed, rtask, bitwise=n == 8)


@pytest.mark.slow   # the default suite: the in-process resume with train_rec's RESUME_CHANGEABLE
def test_train_rec_resume_on_one_device(data, rw8, tmp_path):
  """`python -m experiments.train_rec --resume` on 1 device continues the 8-device run (its
  --mesh and --sharding changed), to the 8-device run's metrics."""
  src, full, _ = rw8
  wd = from_step(src, str(tmp_path / "r1"))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1),
             PYTHONPATH=cpu_env.python_path(REPO))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.train_rec", "--model=logreg", "--preset=small",
       f"--data={data}", "--num_rows=500", "--batch_size=64", "--eval_batch_size=128",
       "--sharding=tw", "--memory_budget_gb=1", "--steps=8", "--checkpoint_every=4",
       "--log_every=100", f"--workdir={wd}", "--resume"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resharded checkpoint 4: 8 devices rw -> 1 device tw" in out.stdout
  import json
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["test_auc"] == pytest.approx(full["eval"]["auc"], abs=1e-6)
  assert summary["test_logloss"] == pytest.approx(full["eval"]["logloss"], abs=1e-6)


@pytest.mark.slow   # several processes; one process's resharding: the tests above
def test_resume_on_two_processes_of_two_devices(tmp_path):
  """An 8-device tw checkpoint of one process continued by 2 processes of 2 devices each as
  rw (every process reads the checkpoint on the host and places its shards) ends where the
  uninterrupted run does (metrics within float32 regrouping of the gradient sums)."""
  from tests.core.test_distributed import REC, _run
  args = REC + ["--data=synthetic", "--checkpoint_every=4"]
  straight = _run("experiments.train_rec", args + ["--steps=6", "--sharding=tw",
                                                   f"--workdir={tmp_path / 's6'}"], 1, 8, tmp_path)
  _run("experiments.train_rec", args + ["--steps=4", "--sharding=tw",
                                        f"--workdir={tmp_path / 'r'}"], 1, 8, tmp_path)
  out = _run("experiments.train_rec", args + ["--steps=6", "--sharding=rw", "--resume",
                                              f"--workdir={tmp_path / 'r'}"], 2, 2, tmp_path)
  assert out["steps"] == 6 and out["mesh"] == {"data": 4}
  assert out["test_auc"] == pytest.approx(straight["test_auc"], abs=1e-6)
  assert out["test_logloss"] == pytest.approx(straight["test_logloss"], abs=1e-6)
