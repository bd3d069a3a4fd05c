"""experiments.train_rec end to end: flags -> training -> results.json and the JSON last line;
workdirs, resume checks, diverging runs, a --group_by the data lacks, and the flags' help."""

import csv
import json
import os
import re
import sys

import numpy as np
import pytest
from tests import cpu_env
from tests import forkserver
from tests.rec import in_process_pool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("REC_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
BASE = ["--preset=small", "--num_rows=1000", "--batch_size=64", "--eval_batch_size=64",
        "--log_every=5"]   # the default mesh: every device on the data axis
# One mesh and sharding for every run of 8 devices, so the runs after the first reuse its
# compiled programs from the persistent compilation cache (a test may pass its own --mesh:
# the last value of a flag counts).
SMALL = BASE + ["--mesh=data:2,model:4", "--sharding=rw"]


def _run(args, cwd=REPO):
  out = forkserver.run([sys.executable, "-m", "experiments.train_rec", *args], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()


def test_synthetic_run_writes_results(tmp_path):
  lines = _run(SMALL + ["--steps=10", "--eval_batches=2", f"--workdir={tmp_path}"])
  summary = json.loads(lines[-1])
  for key in ("model", "steps", "test_auc", "test_logloss", "test_ne", "examples_per_sec"):
    assert key in summary
  assert summary["steps"] == 10 and summary["mesh"] == {"data": 2, "model": 4}
  assert 0.0 <= summary["test_auc"] <= 1.0 and summary["test_examples"] == 128
  results = json.load(open(tmp_path / "results.json"))
  assert results["summary"] == summary
  assert results["plan"]["kinds"] == {"rw": 26}
  assert (tmp_path / "curves.png").exists() and (tmp_path / "metrics.jsonl").exists()
  assert any(l.startswith("step 10/10") for l in lines)


def _fail(args, cwd=REPO):
  out = forkserver.run([sys.executable, "-m", "experiments.train_rec", *args], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode != 0, out.stdout[-2000:]
  return out


def _env():
  return dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8),
              JAX_PLATFORMS="cpu", PYTHONPATH=cpu_env.python_path(REPO))


@pytest.mark.parametrize("mesh,msg", [
    ("data:3", "needs 3 devices, but 8 are available"),
    ("dta:8", "--mesh='dta:8': unknown axis 'dta'; REC_RULES knows data, model"),
])
def test_bad_mesh_fails_clearly(tmp_path, mesh, msg):
  out = _fail(SMALL + [f"--mesh={mesh}", f"--workdir={tmp_path}"])
  assert msg in out.stderr


def test_help_lists_every_data_form():
  out = forkserver.run([sys.executable, "-m", "experiments.train_rec", "--help"], cwd=REPO,
                       env=_env(),   # the fork server of the other runs here
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0
  text = " ".join(out.stdout.split())
  for form in ("synthetic", "synthetic_deep", "criteo:DIR", "criteo_bin:DIR", "avazu:DIR",
               "libfm:DIR", "csv:DIR"):
    assert form in text, form


def test_second_run_gets_a_new_workdir(tmp_path, monkeypatch):
  # The default workdir is new and dated, so running the main job twice just works.
  _run(SMALL + ["--steps=2", "--eval_batches=1"], cwd=tmp_path)
  first = os.listdir(tmp_path / "runs")
  assert len(first) == 1 and re.fullmatch(r"train_rec_dlrm_\d{8}-\d{6}", first[0]), first
  from experiments import train_rec
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(train_rec.time, "strftime", lambda fmt: first[0][len("train_rec_dlrm_"):])
  assert train_rec.default_workdir("dlrm") == os.path.join("runs", first[0] + "-2")
  out = _fail(["--resume", "--steps=4"], cwd=tmp_path)
  assert "--resume needs --workdir" in out.stderr and first[0] in out.stderr


def test_finished_workdir_resume_overwrite_and_settings(tmp_path):
  args = SMALL + ["--eval_batches=1", f"--workdir={tmp_path}"]
  _run(args + ["--steps=4"])
  out = _fail(args + ["--steps=4"])
  assert "already holds a checkpoint at step 4 (a finished run of 4 steps); pass --resume" \
         in out.stderr and "--overwrite" in out.stderr
  assert len(out.stderr.strip().splitlines()) == 1      # one message, no traceback
  # Other settings on resume: one message naming each, before anything is built.
  out = _fail(args + ["--steps=8", "--resume", "--data=synthetic_deep", "--num_rows=2000",
                      "--embedding_dim=32"])
  assert "  data: 'synthetic' (checkpoint) -> 'synthetic_deep' (now)" in out.stderr
  assert "  num_rows: 1000 (checkpoint) -> 2000 (now)" in out.stderr
  assert "  embedding_dim: 16 (checkpoint) -> 32 (now)" in out.stderr
  assert "params:" not in out.stdout
  # Cadence and steps may change; --embedding_dim=16 is the small preset's dim, the value
  # the default 0 stands for, so it is the same setting.
  lines = _run(args + ["--steps=6", "--resume", "--eval_every=3", "--embedding_dim=16"])
  assert json.loads(lines[-1])["steps"] == 6
  lines = _run(args + ["--steps=3", "--overwrite"])
  assert json.loads(lines[-1])["steps"] == 3 and not any(l.startswith("resumed") for l in lines)


@pytest.mark.slow   # two 8-device trainings in fresh processes
def test_compressed_exchange_run_and_resume(tmp_path):
  """--a2a_mode on 8 devices: results.json and the summary hold the payload bytes and the
  errors against their bounds; a resume with the exchange in float32 is refused naming the
  setting, and the float32 run of the same data and seed ends at another loss."""
  args = SMALL + ["--steps=3", "--eval_batches=1", "--sharding=tw", "--mesh=data:8"]
  lines = _run(args + ["--a2a_mode=abs", "--a2a_error_bound=0.002", "--a2a_bits=16",
                       f"--workdir={tmp_path / 'c'}"])
  summary = json.loads(lines[-1])
  assert any(l.startswith("a2a compression (abs 0.002, 16 bits): 9,728 payload bytes")
             for l in lines)
  # tw on 8 devices: 8 x 8 rows of 4 table slots per exchange, forward only (gradients float32)
  assert summary["a2a_payload_bytes"] == 8 * 8 * 4 * (6 + 16 * 2) == 9728
  assert 0.5 < summary["a2a_max_error_over_bound"] <= 1.0 + 1e-6
  assert summary["a2a_max_grad_error_over_bound"] is None
  rep = json.load(open(tmp_path / "c" / "results.json"))["a2a_compression"]
  assert rep["setting"] == {"mode": "abs", "bound": 0.002, "grad_bound": None, "bits": 16,
                            "table_factors": {}, "schedule": rep["setting"]["schedule"]}
  assert rep["bytes"]["payload"] == summary["a2a_payload_bytes"] < rep["bytes"]["float32"]
  out = _fail(args + ["--steps=4", "--resume", f"--workdir={tmp_path / 'c'}"])
  assert "  a2a_mode: 'abs' (checkpoint) -> 'none' (now)" in out.stderr
  assert "  a2a_error_bound: 0.002 (checkpoint) -> 0.001 (now)" in out.stderr
  assert "  a2a_bits: 16 (checkpoint) -> 8 (now)" in out.stderr
  plain = json.loads(_run(args + [f"--workdir={tmp_path / 'p'}"])[-1])
  assert "a2a_payload_bytes" not in plain and plain["test_logloss"] != summary["test_logloss"]


def test_diverging_run_stops(tmp_path):
  out = _fail(SMALL + ["--learning_rate=1e6", "--embedding_learning_rate=1e6", "--steps=30",
                       "--eval_batches=1", f"--workdir={tmp_path}"])
  err = out.stderr.strip().splitlines()
  assert len(err) == 1 and "is the first with a non-finite loss or gradient norm" in err[0]
  assert "lower --learning_rate" in err[0] and "no checkpoint precedes it" in err[0]
  assert not os.listdir(tmp_path / "checkpoints")
  out = _fail(SMALL + ["--learning_rate=-0.05", f"--workdir={tmp_path}"])
  assert "--learning_rate=-0.05: expected a finite learning rate > 0" in out.stderr


def test_group_by_column_that_does_not_exist_is_one_line(tmp_path):
  """A --group_by the data lacks: status 2, one line naming the flag, the value and the
  features there are, and the workdir's config.py left as it was."""
  (tmp_path / "config.py").write_text("# an earlier run's settings\n")
  out = _fail(SMALL + ["--group_by=site_id", "--steps=2", f"--workdir={tmp_path}"])
  err = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
  names = ", ".join(f"C{i}" for i in range(1, 27))
  assert err[0] == (f"error: --group_by='site_id': not a sparse feature of --data=synthetic; "
                    f"expected one of {names} (or empty: no groups)")
  assert (tmp_path / "config.py").read_text() == "# an earlier run's settings\n"
  assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("args,line", [
    (["--epochs=0"], "error: --epochs=0: no pass over the data; expected a number > 0 (or no "
     "--epochs: train --steps)"),
    (["--epochs=1", "--data=sessions:dup=0.5"], "error: --epochs=1: --data=sessions:dup=0.5 is "
     "generated without end; expected --steps, or --epochs with a --data of files"),
    (["--steps=2", "--stop_at_step=5"], "error: --stop_at_step=5: after the run's last step "
     "(2); expected a step <= 2"),
])
def test_run_length_refused_before_the_workdir_is_written(tmp_path, args, line):
  """--epochs=0 (not accepted and ignored, --steps running), --epochs on generated data (not
  refused after config.py is written) and a --stop_at_step the run never reaches (not
  ignored): one line, nothing written."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.train_rec", BASE + args + [f"--workdir={tmp_path}"])
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == line
  assert os.listdir(tmp_path) == []


@pytest.mark.slow   # 112 steps; a real-data epoch learning: compare_rec's criteo sample test
@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "criteo_kaggle_sample")),
                    reason="Criteo sample not found (set REC_DATA_DIR)")
def test_criteo_sample_epoch(tmp_path):
  lines = _run(BASE + [f"--data=criteo:{os.path.join(DATA, 'criteo_kaggle_sample')}",
                        "--epochs=1", f"--workdir={tmp_path}"])
  summary = json.loads(lines[-1])
  assert summary["steps"] == 7200 // 64
  assert summary["test_examples"] == 409 + 391
  assert summary["test_auc"] > 0.6   # real signal is learned even by the small preset


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "avazu_sample")),
                    reason="Avazu sample not found (set REC_DATA_DIR)")
def test_avazu_logreg_has_no_dense_features(tmp_path):
  """Avazu has no dense features: no bottom MLP / no dense weight, and checkpoints still
  save. Grouped by site (--group_by=site_id): results.json's eval holds calibration, gauc,
  gauc_groups and ne_by_slice; predict on the labeled valid split reports them too, its gAUC
  that of scikit-learn's roc_auc_score per site over the CSV's probabilities; a feature the
  data lacks is refused before the run is built."""
  avazu = os.path.join(DATA, "avazu_sample")
  lines = _run(["--model=logreg", f"--data=avazu:{avazu}", "--num_rows=100000",
                "--batch_size=256", "--eval_batch_size=256", "--epochs=1",
                "--group_by=site_id", f"--workdir={tmp_path}"])
  summary = json.loads(lines[-1])
  assert summary["steps"] == 8087 // 256 and summary["test_examples"] == 480 + 432
  assert os.listdir(tmp_path / "checkpoints")
  ev = json.load(open(tmp_path / "results.json"))["eval"]
  assert summary["test_gauc"] == ev["gauc"] and summary["test_calibration"] == ev["calibration"]
  sites = {f: [line.split(",")[5] for line in open(os.path.join(avazu, f)).read().splitlines()]
           for f in ("dev.csv", "test.csv")}
  groups = ev["gauc_groups"]   # 100,000 rows: no two of the 117 sites share one
  assert groups["counted"] + groups["skipped"] == len(set(sites["dev.csv"] + sites["test.csv"]))
  assert len(ev["ne_by_slice"]) == 11 and ev["ne_by_slice"][-1]["group"] == "other"
  assert sum(s["impressions"] for s in ev["ne_by_slice"]) == ev["num_examples"]
  last = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][-1]
  assert last["split"] == "eval" and last["gauc"] == ev["gauc"]
  assert any(l.startswith("gAUC ") for l in lines)

  out = forkserver.run([sys.executable, "-m", "experiments.predict", f"--checkpoint={tmp_path}",
                        "--split=valid"], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.load(open(tmp_path / "predictions_valid.json"))
  rows = list(csv.reader(open(tmp_path / "predictions_valid.csv")))[1:]
  probs = np.array([float(r[1]) for r in rows])
  labels = np.array([int(r[2]) for r in rows])
  gauc, counted, skipped = _site_gauc(probs, labels, np.array(sites["dev.csv"]))
  m = got["metrics"]
  assert m["gauc_groups"]["counted"] == counted and m["gauc_groups"]["skipped"] == skipped
  assert m["gauc"] == pytest.approx(gauc, abs=1e-3)   # the CSV's probabilities have 6 digits
  assert got["summary"]["gauc"] == m["gauc"]
  assert m["calibration"] == pytest.approx(probs.sum() / labels.sum(), rel=1e-4)
  from core.errors import UserError
  from rec import predict as predict_lib
  with pytest.raises(UserError, match=r"^--group_by='site': not a sparse feature of "
                                      r"--data=avazu:.*; expected one of hour_of_day, "):
    predict_lib.load_run(str(tmp_path), split="valid", group_by="site")


def _site_gauc(probs, labels, sites) -> tuple[float, int, int]:
  """(gAUC, groups with both labels, groups of one label), scikit-learn's roc_auc_score on
  each site's rows."""
  from sklearn.metrics import roc_auc_score
  weighted = total = counted = skipped = 0
  for site in np.unique(sites):
    sel = sites == site
    if len(np.unique(labels[sel])) < 2:
      skipped += 1
      continue
    counted += 1
    weighted += sel.sum() * roc_auc_score(labels[sel], probs[sel])
    total += sel.sum()
  return weighted / total, counted, skipped


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "criteo_kaggle_raw")),
                    reason="Criteo Kaggle raw sample not found (set REC_DATA_DIR)")
def test_converted_data_is_checked_before_training_and_on_resume(tmp_path, monkeypatch):
  """A run records its conversion's fingerprint: a resume on a reconverted directory is
  refused; a changed byte in a validation shard stops the next run before its first step.
  The conversions run their units in this process (the spawned worker pool:
  tests/rec/test_criteo_bin.py)."""
  from rec.data import criteo_bin

  in_process_pool.use(monkeypatch)
  raw = os.path.join(DATA, "criteo_kaggle_raw")
  d = tmp_path / "bin"
  criteo_bin.convert(raw, str(d), num_rows=1000, workers=2)
  env = dict(_env(), XLA_FLAGS=cpu_env.xla_flags(1))   # one device
  args = ["--model=logreg", f"--data=criteo_bin:{d}", "--batch_size=256",
          "--eval_batch_size=256", "--log_every=2"]
  run = lambda *a: forkserver.run([sys.executable, "-m", "experiments.train_rec", *args, *a],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  out = run("--steps=2", f"--workdir={tmp_path / 'r'}")
  assert out.returncode == 0, out.stderr[-3000:]
  # the same directory converted again from other source files
  other = tmp_path / "other"
  other.mkdir()
  lines = open(os.path.join(raw, "train.txt")).read().splitlines(keepends=True)
  (other / "train.txt").write_text("".join(lines[100:] + lines[:100]))
  criteo_bin.convert(str(other), str(d), num_rows=1000, workers=2, overwrite=True)
  out = run("--steps=4", "--resume", f"--workdir={tmp_path / 'r'}")
  assert out.returncode == 2 and "  data_fingerprint: '" in out.stderr, out.stderr[-3000:]
  # one byte of a validation shard changed: the run stops before step 0, naming the file
  shard = sorted((d / "valid").glob("*.sparse.npy"))[0]
  data = bytearray(shard.read_bytes())
  data[-7] ^= 1
  shard.write_bytes(bytes(data))
  out = run("--steps=4", f"--workdir={tmp_path / 'r2'}")
  assert out.returncode == 2 and not any(l.startswith("step ") for l in out.stdout.splitlines())
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {shard}: CRC-32 ") and "the file changed after conversion" in last
