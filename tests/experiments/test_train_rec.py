"""experiments.train_rec end to end: flags -> training -> results.json and the JSON last line."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("REC_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
SMALL = ["--preset=small", "--num_rows=1000", "--batch_size=64", "--eval_batch_size=64",
         "--log_every=5"]


def _run(args, cwd=REPO):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.train_rec", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()


def test_synthetic_run_writes_results(tmp_path):
  lines = _run(SMALL + ["--steps=10", "--eval_batches=2", "--mesh=data:2,model:4",
                        "--sharding=rw", f"--workdir={tmp_path}"])
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


def test_bad_mesh_fails_clearly(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.train_rec", *SMALL, "--mesh=data:3",
                        f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True)
  assert out.returncode != 0
  assert "needs 3 devices, but 8 are available" in out.stderr


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "criteo_kaggle_sample")),
                    reason="Criteo sample not found (set REC_DATA_DIR)")
def test_criteo_sample_epoch(tmp_path):
  lines = _run(SMALL + [f"--data=criteo:{os.path.join(DATA, 'criteo_kaggle_sample')}",
                        "--epochs=1", f"--workdir={tmp_path}"])
  summary = json.loads(lines[-1])
  assert summary["steps"] == 7200 // 64
  assert summary["test_examples"] == 409 + 391
  assert summary["test_auc"] > 0.6   # real signal is learned even by the small preset


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "avazu_sample")),
                    reason="Avazu sample not found (set REC_DATA_DIR)")
def test_avazu_logreg_has_no_dense_features(tmp_path):
  # Avazu has no dense features: no bottom MLP / no dense weight, and checkpoints still save.
  lines = _run(["--model=logreg", f"--data=avazu:{os.path.join(DATA, 'avazu_sample')}",
                "--num_rows=1000", "--batch_size=256", "--eval_batch_size=256", "--epochs=1",
                f"--workdir={tmp_path}"])
  summary = json.loads(lines[-1])
  assert summary["steps"] == 8087 // 256 and summary["test_examples"] == 480 + 432
  assert os.listdir(tmp_path / "checkpoints")
