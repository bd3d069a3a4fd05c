"""experiments.predict and rec.predict: a run trained by train_rec on Criteo Kaggle as
downloaded (converted by preprocess), predictions for its unlabeled test file in Kaggle's
submission format, metrics on the labeled halves of day 7 that agree with the run's own
evaluation (an AUC recomputed here from the CSVs), and data that does not fit the model
refused with the difference named."""

from __future__ import annotations

import csv
import json
import os
import sys

import numpy as np
import pytest

from core import checkpoint as ckpt_lib
from core.errors import UserError
from rec import predict as predict_lib
from rec.data import criteo_bin
from tests.experiments.entry import DATA, REPO
from tests import cpu_env
from tests import forkserver

RAW = os.path.join(DATA, "criteo_kaggle_raw")
AVAZU = os.path.join(DATA, "avazu_sample")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(RAW, "train.txt")),
                                reason=f"Criteo Kaggle raw sample not found at {RAW}")


def _entry(module, args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=cpu_env.python_path(REPO),
             XLA_FLAGS=cpu_env.xla_flags(8))
  return forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def _auc(scores, labels) -> float:
  """Mann-Whitney AUC by average ranks (ties shared)."""
  scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
  order = np.argsort(scores, kind="mergesort")
  ranks = np.empty(len(scores))
  s = scores[order]
  i = 0
  while i < len(s):
    j = i
    while j + 1 < len(s) and s[j + 1] == s[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  pos = labels == 1
  n_pos, n_neg = pos.sum(), (~pos).sum()
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_train_then_predict_kaggle_test_and_refuse_other_data(tmp_path):
  bin_dir = tmp_path / "bin"
  m = criteo_bin.convert(RAW, str(bin_dir), ids="vocab", min_count=2, workers=2)
  run = tmp_path / "run"
  out = _entry("experiments.train_rec", [
      "--model=logreg", f"--data=criteo_bin:{bin_dir}", "--batch_size=512",
      "--eval_batch_size=512", "--steps=12", "--log_every=6", f"--workdir={run}"])
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  # the run recorded the conversion it trained on
  ckpt = ckpt_lib.Checkpointer(str(run))
  settings = ckpt.restore_meta(ckpt.latest_step())["settings"]
  ckpt.close()
  assert settings["data_fingerprint"] == criteo_bin.data_fingerprint(m)
  assert settings["data_conversion"]["min_count"] == 2
  assert settings["features"]["rows_per_feature"] == m["rows_per_feature"]

  # Kaggle's unlabeled test file: Kaggle's submission format
  out = _entry("experiments.predict", [f"--checkpoint={run}", "--split=predict"])
  assert out.returncode == 0, out.stderr[-3000:]
  rows = list(csv.reader(open(run / "predictions_predict.csv")))
  assert rows[0] == ["Id", "Predicted"] and len(rows) == 1 + 391
  assert [int(r[0]) for r in rows[1:]] == list(range(60_000_000, 60_000_391))
  assert all(0 < float(r[1]) < 1 for r in rows[1:])
  assert json.loads(out.stdout.strip().splitlines()[-1])["rows"] == 391

  # the labeled halves of day 7, here through the library: the run's own evaluation (valid
  # then test) is the AUC of the two prediction sets together, recomputed from them
  probs, labels = [], []
  for split in ("valid", "test"):
    loaded = predict_lib.load_run(str(run), split=split)
    ev = loaded.task.new_evaluator()
    got = list(predict_lib.predictions(loaded, ev))
    p = np.concatenate([g[1] for g in got])
    y = np.concatenate([g[2] for g in got])
    assert len(p) == 571 and ev.result()["auc"] == pytest.approx(_auc(p, y), abs=1e-9)
    probs.append(p)
    labels.append(y)
  assert summary["test_examples"] == 1142
  assert _auc(np.concatenate(probs), np.concatenate(labels)) == pytest.approx(
      summary["test_auc"], abs=1e-6)

  # a vocabulary built with another --min_count: refused, naming the file and both values
  other = tmp_path / "other"
  criteo_bin.convert(RAW, str(other), ids="vocab", min_count=3, workers=2)
  with pytest.raises(UserError) as e:
    predict_lib.load_run(str(run), f"criteo_bin:{other}", "predict")
  assert str(e.value) == (f"{other}/manifest.json: vocabulary built with --min_count=3; expected "
                          f"--min_count=2 as the data of the checkpoint {run} "
                          f"(criteo_bin:{bin_dir})")
  # the same refusal from the entry point: one line, status 2
  out = _entry("experiments.predict", [f"--checkpoint={run}", f"--data=criteo_bin:{other}"])
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == f"error: {e.value}"
  # text data with the hashed ids of another --num_rows, or Avazu rows for a Criteo model
  with pytest.raises(UserError, match=r"text data with hashed ids; expected a criteo_bin "
                                      r"conversion like the checkpoint's"):
    predict_lib.load_run(str(run), f"criteo:{RAW}", "test")
  if os.path.isdir(AVAZU):
    from rec.data import sources
    av = sources.split_source(f"avazu:{AVAZU}", "valid", 64, 1000)
    with pytest.raises(UserError, match=r"--data=avazu:.* split valid: 0 dense features; "
                                        r"expected 13 as the model of w was built for"):
      predict_lib.check_features({"features": settings["features"]}, av.source.spec,
                                 f"--data=avazu:{AVAZU} split valid", "w")


def test_synthetic_run_names_what_to_give(monkeypatch, tmp_path):
  """A run trained on generated data has no rows of its own: the one line says so and asks
  for --data (files whose features fit the model); --data=synthetic is refused the same way."""
  from core import cli
  settings = {"model": "logreg", "preset": "kaggle", "data": "synthetic", "num_rows": 1000}
  monkeypatch.setattr(predict_lib, "saved_settings", lambda workdir: (2, settings))
  for data, where, found in ((None, f"--checkpoint={tmp_path}",
                              "a run trained on generated data (--data=synthetic)"),
                             ("synthetic_deep", "--data=synthetic_deep", "generated data")):
    with pytest.raises(UserError) as e:
      predict_lib.load_run(str(tmp_path), data, "test")
    assert cli.is_user_error(e.value)
    assert str(e.value) == (f"{where}: {found}, with no rows to predict on; expected --data "
                            "naming files to predict on (criteo:DIR, avazu:DIR or "
                            "criteo_bin:DIR) with the features the model was built for")
    assert "expected 'synthetic'" not in str(e.value)


@pytest.mark.parametrize("case", ["checkpoint_file", "json_output", "directory_output"])
def test_bad_checkpoint_or_output_refused_before_loading(tmp_path, case):
  """A --checkpoint that is a file is named as that (not as an unwritable --output, the
  default CSV lying in it); an --output ending in .json (else written as the CSV, then
  overwritten by the summary <output>.json: every prediction lost) or naming a directory
  (else a traceback after the predictions) is refused before the checkpoint is read."""
  from tests.experiments.entry import run_refused
  afile = tmp_path / "afile"
  afile.write_text("")
  out_dir = tmp_path / "out"
  out_dir.mkdir()
  args, line = {
      "checkpoint_file": ([f"--checkpoint={afile}"],
                          f"--checkpoint={afile}: no checkpoints/ directory; expected the "
                          "--workdir of a train_rec run"),
      "json_output": ([f"--checkpoint={tmp_path / 'absent'}", f"--output={out_dir}/p.json"],
                      f"--output={out_dir}/p.json: a .json path, where the summary "
                      "<output>.json would overwrite the CSV; expected a CSV path such as "
                      "predictions.csv"),
      "directory_output": ([f"--checkpoint={tmp_path / 'absent'}", f"--output={out_dir}"],
                           f"--output={out_dir}: a directory; expected the path of the CSV "
                           "to write, such as predictions.csv"),
  }[case]
  out = run_refused("experiments.predict", args)
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == "error: " + line
  assert os.listdir(out_dir) == []


def test_bad_line_leaves_no_partial_csv(tmp_path):
  """A malformed line in the split stops the predictions with its file and line; the CSV's
  temporary file is removed (no <output>.tmp is left with the rows before it)."""
  run = tmp_path / "run"
  out = _entry("experiments.train_rec", [
      "--model=logreg", f"--data=criteo:{RAW}", "--num_rows=1000", "--batch_size=128",
      "--eval_batch_size=128", "--steps=2", "--log_every=1", f"--workdir={run}"])
  assert out.returncode == 0, out.stderr[-3000:]
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in ("train.txt", "test.txt"):
    lines = open(os.path.join(RAW, name)).read().splitlines(True)
    if name == "test.txt":
      lines[300] = "garbage line\n"
    (bad / name).write_text("".join(lines))
  out_dir = tmp_path / "out"
  out = _entry("experiments.predict", [f"--checkpoint={run}", f"--data=criteo:{bad}",
                                       f"--output={out_dir}/p.csv"])
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      f"error: {bad}/test.txt:301: 1 tab-separated fields; expected 39")
  assert not out_dir.exists() or os.listdir(out_dir) == []
