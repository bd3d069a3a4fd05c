"""experiments.train_rec and experiments.predict with the embedding host tier
(--host_memory_gb, rec/embedding/host_tier.py): a device budget one table short puts that
table's rows and optimizer state in host memory; the run checkpoints, resumes to the same
state as an uninterrupted run, predicts, and resumes resharded into device memory."""

import csv
import json
import os
import sys

import pytest
from tests import cpu_env
from tests import forkserver
from tests.experiments.entry import DATA, REPO

SAMPLE = os.path.join(DATA, "criteo_kaggle_sample")
# 26 tables of 1000 x 16 fp32 + row-wise Adagrad on 2 devices need 884,000 bytes on the
# fullest; 0.0008 GiB (858,993 bytes) holds all but one, which goes to host memory.
ARGS = ["--preset=small", "--num_rows=1000", "--batch_size=64", "--eval_batch_size=64",
        "--log_every=1", f"--data=criteo:{SAMPLE}", "--checkpoint_every=2",
        "--memory_budget_gb=0.0008", "--host_memory_gb=1"]


def _run(module, args):
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(2), JAX_PLATFORMS="cpu",
             PYTHONPATH=cpu_env.python_path(REPO))
  out = forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()


def _train_records(workdir):
  return [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl")))
          if r["split"] == "train"]


@pytest.mark.slow   # three short trainings and two predictions in fresh processes (~2 min)
@pytest.mark.skipif(not os.path.isdir(SAMPLE), reason="Criteo sample not found (set REC_DATA_DIR)")
def test_host_tier_run_resumes_exactly_and_predicts(tmp_path):
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  lines = _run("experiments.train_rec", ARGS + ["--steps=4", f"--workdir={straight}"])
  assert any(l.startswith("host tier: 1 tables") for l in lines)
  res = json.load(open(os.path.join(straight, "results.json")))
  on_host = {n: t["storage"] for n, t in res["plan"]["tables"].items() if "storage" in t}
  assert list(on_host.values()) == ["fp32_cache:lfu:0.05@host"], on_host
  assert res["config"]["host_memory_gb"] == 1.0 and res["config"]["storage"] == "fp32"

  _run("experiments.train_rec", ARGS + ["--steps=2", f"--workdir={resumed}"])
  lines = _run("experiments.train_rec", ARGS + ["--steps=4", "--resume", f"--workdir={resumed}"])
  assert any(l.startswith(f"resumed from {resumed}/checkpoints/2 at step 2") for l in lines)
  assert not any(l.startswith("resharded") for l in lines)   # the same layout, host tier too
  again = json.load(open(os.path.join(resumed, "results.json")))
  assert again["eval"] == res["eval"]
  assert _train_records(resumed) == _train_records(straight)   # every step's loss

  csvs = []
  for workdir in (straight, resumed):
    lines = _run("experiments.predict", [f"--checkpoint={workdir}", "--split=test"])
    summary = json.loads(lines[-1])
    assert summary["step"] == 4 and summary["labeled"] and summary["rows"] > 0
    csvs.append(list(csv.reader(open(summary["output"]))))
  assert csvs[0] == csvs[1] and len(csvs[0]) == summary["rows"] + 1

  # Without the tier (a budget that holds every table) the checkpoint is resharded into
  # device memory and training goes on.
  lines = _run("experiments.train_rec", ARGS[:-2] + ["--memory_budget_gb=1", "--steps=6",
                                                     "--resume", f"--workdir={resumed}"])
  assert any(l.startswith("resharded checkpoint 4: 2 devices") for l in lines), lines
  assert json.loads(lines[-1])["steps"] == 6
