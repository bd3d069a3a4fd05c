"""experiments.compare_rec end to end (flags -> runs -> table, results.json, PNG, JSON last
line) and its report (rec.runs' table, study.summary) against hand-computed values."""

import json
import os
import sys

import numpy as np
import pytest

from experiments.compare_rec import study
from rec import runs
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("REC_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
TINY = ["--num_rows=1000", "--embedding_dim=8", "--batch_size=64", "--eval_batch_size=64",
        "--log_every=5"]


def _run(args):
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "-m", "experiments.compare_rec", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()


@pytest.mark.slow   # an entry point end to end; CI's default suite keeps to its time
def test_synthetic_two_models_two_seeds(tmp_path):
  lines = _run(TINY + ["--models=dlrm:small,wukong", "--presets=wukong=small", "--seeds=0,1",
                       "--steps=6", "--eval_batches=2", f"--workdir={tmp_path}"])
  summary = json.loads(lines[-1])
  res = json.load(open(tmp_path / "results.json"))
  assert res["summary"] == summary
  assert [r["label"] for r in res["rows"]] == ["dlrm:small", "wukong:small"]
  assert summary["best_by_ne"] in ("dlrm:small", "wukong:small")
  for row in res["rows"]:
    # One embedding dim for every model: 26 tables x 1000 rows x 8.
    assert row["embedding_params"] == 26 * 1000 * 8
    assert row["dense_params"] > 0 and row["gflops_per_example"] > 0
    assert row["steps"] == 6 and row["examples"] == 6 * 64 and row["num_seeds"] == 2
    runs = row["runs"]
    assert [r["seed"] for r in runs] == [0, 1]
    assert all(r["eval_examples"] == 128 and r["wall_seconds"] > 0 for r in runs)
    for k in ("auc", "logloss", "ne"):
      vals = [r[k] for r in runs]
      np.testing.assert_allclose(row[f"{k}_mean"], np.mean(vals), rtol=1e-12)
      np.testing.assert_allclose(row[f"{k}_std"], np.std(vals, ddof=1), rtol=1e-9)
    # Seeds change the initialization, so the two runs differ.
    assert runs[0]["logloss"] != runs[1]["logloss"]
    assert not os.path.exists(os.path.join(runs[0]["workdir"], "checkpoints"))
  ref = res["reference"]
  assert 0.5 < ref["auc"] <= 1.0 and ref["num_examples"] == 128
  # The table: a header, one line per model with mean ± std, the Bayes line.
  table = [l for l in lines if l.startswith(("dlrm:small", "wukong:small", "true logits"))]
  assert len(table) == 3 and all("±" in l for l in table[:2])
  assert f"{res['rows'][1]['dense_params']:,}" in table[1]
  assert res["table"][0].split()[:4] == ["model", "AUC", "logloss", "NE"]
  assert (tmp_path / "compare_rec.png").stat().st_size > 10_000
  # A second run into the same workdir takes the finished runs with --resume (none trains).
  again = _run(TINY + ["--models=dlrm:small", "--seeds=0,1", "--steps=6", "--eval_batches=2",
                       f"--workdir={tmp_path}", "--resume"])
  assert sum("finished earlier" in l for l in again) == 2
  assert json.load(open(tmp_path / "results.json"))["rows"][0]["runs"] == res["rows"][0]["runs"]


def test_a_rerun_without_resume_is_refused_before_training(tmp_path):
  """Rerunning the study in the same --workdir without --resume is one line naming the run
  directory and the flags, and nothing is trained or deleted (else rec.runs.train_run
  replaces each run directory: the finished runs are deleted and trained again)."""
  from tests.experiments.entry import run_refused
  run_dir = tmp_path / "runs" / "dlrm_small_s0"
  run_dir.mkdir(parents=True)
  (run_dir / runs.RUN_RECORD).write_text("{}")
  out = run_refused("experiments.compare_rec", TINY + [
      "--models=dlrm:small", "--seeds=0", "--steps=2", "--eval_batches=1",
      f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {run_dir}: holds an earlier run (run.json); expected a fresh run directory "
      "(one run per workdir, never replaced): reuse its finished runs with --resume (where "
      "the study has it; reuse_finished=True), or choose a fresh --workdir, or delete it to "
      "train again")
  assert "==" not in out.stdout and (run_dir / runs.RUN_RECORD).read_text() == "{}"
  assert sorted(os.listdir(run_dir)) == [runs.RUN_RECORD]


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "criteo_kaggle_sample")),
                    reason="Criteo sample not found (set REC_DATA_DIR)")
def test_criteo_sample_one_epoch(tmp_path):
  lines = _run(["--data=criteo:" + os.path.join(DATA, "criteo_kaggle_sample"), "--epochs=1",
                "--batch_size=128", "--eval_batch_size=1024", "--num_rows=1000",
                "--embedding_dim=8", "--models=dcnv2:small", "--seeds=0",
                f"--workdir={tmp_path}"])
  res = json.load(open(tmp_path / "results.json"))
  row = res["rows"][0]
  assert row["steps"] == 7200 // 128 and row["runs"][0]["eval_examples"] == 409 + 391
  assert res["reference"] is None and "bayes_auc" not in json.loads(lines[-1])
  assert row["auc_mean"] > 0.6


def _row(label, aucs, nes):
  model, _, preset = label.partition(":")
  row = {"model": model, "preset": preset, "label": label, "steps": 10, "num_seeds": len(aucs),
         "dense_params": 1234, "embedding_params": 5678, "gflops_per_example": 0.001,
         "wall_seconds_mean": 1.5, "examples_per_sec_mean": 1000.0}
  for k, vals in (("auc", aucs), ("ne", nes), ("logloss", nes)):
    row[f"{k}_mean"], row[f"{k}_std"] = runs.mean_std(vals)
  return row


def test_table_and_summary_from_hand_made_rows():
  res = {"rows": [_row("dlrm:kaggle", [0.70, 0.72], [0.90, 0.86]),
                  _row("wukong:kaggle", [0.74, 0.74], [0.80, 0.82])],
         "seeds": [0, 1], "config": {"batch_size": 64, "data": "synthetic"},
         "reference": {"auc": 0.83, "ne": 0.75, "logloss": 0.42}, "wall_seconds": 9.0}
  # mean 0.71, sample std of (0.70, 0.72) = 0.01414...
  assert res["rows"][0]["auc_std"] == pytest.approx(0.02 / np.sqrt(2), rel=1e-12)
  table = runs.format_runs(res).splitlines()
  assert "0.7100 ± 0.0141" in table[2] and "0.8800 ± 0.0283" in table[2]
  assert table[4].startswith("true logits (Bayes)") and "0.8300" in table[4]
  s = study.summary(res)
  assert s["best_by_ne"] == "wukong:kaggle" and s["bayes_ne"] == 0.75
  assert s["models"]["dlrm:kaggle"]["ne"] == pytest.approx(0.88)


@pytest.mark.parametrize("args,line", [
    (["--seeds="], "--seeds=: empty; expected at least one value"),
    (["--models="], "--models=: empty; expected at least one value"),
    (["--seeds=0,0"], "--seeds=0,0: a seed twice; expected each seed once"),
    (["--epochs=0"], "--epochs=0: no training; expected a number of passes > 0 (or --steps)"),
    (["--steps=10", "--epochs=1"], "--steps=10 --epochs=1: both given; expected one budget: "
     "--steps, or --epochs over file data"),
])
def test_bad_lists_and_budget_refused_before_training(tmp_path, args, line):
  """Refused before training, naming the flag. Unchecked, an empty list is refused as
  rec.runs' argument (`train_models: no seeds`); --epochs=0 counts as no --epochs beside
  --steps and is refused as `train_models: steps=500, epochs=0.0`; a seed given twice trains
  twice into one run directory and reports the mean ± std of the two (std 0); --steps
  beside --epochs is ignored."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.compare_rec", args + [f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == "error: " + line
  assert "==" not in out.stdout and os.listdir(tmp_path) == []
