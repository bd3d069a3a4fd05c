"""rec/runs.py: the --models setting, one config per model, same-budget training that
fails on a bad preset before anything trains, and a run that hands back its trained state
(equal to its last checkpoint)."""

import os

import jax
import numpy as np
import pytest

from core import checkpoint as ckpt_lib
from core.errors import UserError
from rec import configs, runs


def test_parse_models_and_presets():
  specs = runs.parse_models(["dlrm", "wukong:l3_n16", "dhen"], "dhen=dhen_2l")
  assert specs == [runs.ModelSpec("dlrm", "kaggle"), runs.ModelSpec("wukong", "l3_n16"),
                   runs.ModelSpec("dhen", "dhen_2l")]
  assert runs.parse_presets(["a=b", "c=d"]) == {"a": "b", "c": "d"}
  assert runs.parse_models(["wukong"], {"wukong": "l2_n8"}) == [runs.ModelSpec("wukong", "l2_n8")]
  with pytest.raises(ValueError, match=r"--presets item 'wukong': expected model=preset"):
    runs.parse_presets("wukong")
  with pytest.raises(ValueError, match=r"--presets names \['dcnv2'\], which are not in"):
    runs.parse_models(["dlrm"], "dcnv2=small")
  with pytest.raises(ValueError, match=r"model 'xdeepfm', expected one of"):
    runs.parse_models(["xdeepfm"])
  with pytest.raises(ValueError, match="lists a \\(model, preset\\) twice"):
    runs.parse_models(["dlrm", "dlrm:kaggle"])


def test_run_config_shares_the_embedding_dim_except_logreg():
  base = configs.make_run(embedding_dim=16, learning_rate=0.3)
  w = runs.for_model(base, runs.ModelSpec("wukong", "l2_n8"))
  assert (w.model.model, w.model.preset, w.model.embedding_dim, w.train.learning_rate) == (
      "wukong", "l2_n8", 16, 0.3)
  lr = runs.for_model(base, runs.ModelSpec("logreg"))
  assert lr.model.embedding_dim == 0 and lr.train.learning_rate == 0.3   # one weight per id


def test_bad_preset_fails_before_any_training(tmp_path):
  base = configs.make_run(num_rows=100, batch_size=64, eval_batch_size=64)
  specs = [runs.ModelSpec("dlrm", "small"), runs.ModelSpec("wukong", "l2")]
  with pytest.raises(ValueError, match=r"--preset='l2' for --model=wukong: expected one of"):
    runs.train_models(base, specs, steps=1, workdir=str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")
  with pytest.raises(ValueError, match="steps=None, epochs=None; give exactly one"):
    runs.train_model(base, specs[0], [0], str(tmp_path))


def test_train_run_hands_back_the_checkpointed_state(tmp_path):
  """The state in memory is the run's last checkpoint, bit for bit; a workdir left by an
  earlier run (a checkpoint that would otherwise be resumed) is refused, and replaced only
  with overwrite=True (the caller's word that it is unfinished)."""
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=50, batch_size=16,
                             eval_batch_size=16, eval_batches=1, mesh="data:1")
  built = configs.build_run(cfg, devices=jax.devices()[:1])
  stale = tmp_path / "a" / "checkpoints" / "7"
  stale.mkdir(parents=True)
  with pytest.raises(UserError) as e:
    runs.train_run(cfg, str(tmp_path / "a"), steps=3, built=built)
  assert str(e.value).startswith(f"{tmp_path / 'a'}: holds an earlier run (checkpoints); "
                                 "expected a fresh run directory")
  assert "choose a fresh --workdir" in str(e.value) and stale.exists()
  run = runs.train_run(cfg, str(tmp_path / "a"), steps=3, seed=2, keep_checkpoints=True,
                       built=built, overwrite=True)
  assert int(run.state["step"]) == 3 and run.steps == 3 and run.seed == 2
  assert set(run.eval) >= set(runs.METRICS) and run.eval["num_examples"] == 16
  assert run.model_config == configs.model_config(cfg, built[1].spec)
  assert not stale.exists()
  ckpt = ckpt_lib.Checkpointer(run.workdir)
  try:
    assert ckpt.latest_step() == 3
    saved, _ = ckpt.restore(3, ckpt_lib.abstract_like(run.state))
  finally:
    ckpt.close()
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(saved),
               jax.device_get(run.state))


def test_a_resumed_study_reuses_finished_runs_and_names_changed_settings(tmp_path, capsys):
  """Each finished run is recorded; reuse_finished takes it from the record (same metrics,
  no training), trains a seed that has none, and refuses a record of other settings."""
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=50, batch_size=16,
                             eval_batch_size=16, eval_batches=1, mesh="data:1")
  built = configs.build_run(cfg, devices=jax.devices()[:1])
  prefix = str(tmp_path / "r")
  first = runs.train_seeds(cfg, [0], prefix, steps=2, built=built)
  assert os.path.exists(os.path.join(prefix + "_s0", runs.RUN_RECORD))
  capsys.readouterr()
  again = runs.train_seeds(cfg, [0, 1], prefix, steps=2, built=built, reuse_finished=True)
  out = capsys.readouterr().out
  assert "seed 0: finished earlier" in out and "seed 1: 2 steps of 16" in out
  assert again["runs"][0] == first["runs"][0]
  assert again["runs"][1]["seed"] == 1 and again["num_seeds"] == 2
  # `keep` sees each run it trains.
  kept = []
  assert "seed 0: 2 steps" in (runs.train_seeds(cfg, [0], prefix + "k", steps=2, built=built,
                                                keep=kept.append),
                               capsys.readouterr().out)[1]
  assert [(r.seed, int(r.state["step"]), r.workdir) for r in kept] == [(0, 2, prefix + "k_s0")]
  other = configs.replace_run(cfg, learning_rate=cfg.train.learning_rate * 2)
  with pytest.raises(UserError, match=r"r_s0/run.json: this run finished with other settings "
                     r"\(config.learning_rate: .* -> .*\)"):
    runs.train_seeds(other, [0], prefix, steps=2, built=built, reuse_finished=True)
  with pytest.raises(UserError, match=r"steps: 2 -> 3"):
    runs.finished_run(cfg, prefix + "_s0", steps=3, seed=0)
  assert runs.finished_run(cfg, prefix + "_s9", steps=2, seed=9) is None


def test_finished_runs_are_never_replaced_without_resume(tmp_path, capsys):
  """A study rerun into the same workdir without --resume is refused before anything
  trains, naming the run directory, --resume and --workdir, and the runs stay (else
  train_run replaces its workdir: every finished run deleted and trained again). A
  seed directory without a record (a run killed before it finished) is trained again under
  --resume."""
  cfg = configs.make_run(model="logreg", preset="kaggle", num_rows=50, batch_size=16,
                         eval_batch_size=16, eval_batches=1)
  specs = [runs.ModelSpec("logreg", "kaggle")]
  wd = str(tmp_path / "study")
  first = runs.train_models(cfg, specs, seeds=[0, 1], steps=1, workdir=wd)
  rec = os.path.join(wd, "runs", "logreg_kaggle_s0", runs.RUN_RECORD)
  before = open(rec).read()
  capsys.readouterr()
  with pytest.raises(UserError) as e:
    runs.train_models(cfg, specs, seeds=[0, 1], steps=2, workdir=wd)
  assert str(e.value) == (
      f"{wd}/runs/logreg_kaggle_s0 (and 1 more run directory): holds an earlier run "
      "(run.json, metrics.jsonl); expected a fresh run directory (one run per workdir, never "
      "replaced): reuse its finished runs with --resume (where the study has it; "
      "reuse_finished=True), or choose a fresh --workdir, or delete it to train again")
  assert "==" not in capsys.readouterr().out and open(rec).read() == before
  # A later model's runs are found before the first model trains.
  two = [runs.ModelSpec("dlrm", "small")] + specs
  with pytest.raises(UserError, match="logreg_kaggle_s0"):
    runs.train_models(cfg, two, seeds=[0], steps=1, workdir=wd)
  assert not os.path.exists(os.path.join(wd, "runs", "dlrm_small_s0"))
  # --resume: seed 0 reused, seed 1 (its record gone: unfinished) trained again.
  os.remove(os.path.join(wd, "runs", "logreg_kaggle_s1", runs.RUN_RECORD))
  again = runs.train_models(cfg, specs, seeds=[0, 1], steps=1, workdir=wd,
                            reuse_finished=True)
  out = capsys.readouterr().out
  assert "seed 0: finished earlier" in out and "seed 1: 1 steps of 16" in out
  assert again["rows"][0]["runs"] == first["rows"][0]["runs"][:1] + again["rows"][0]["runs"][1:]
  assert os.path.exists(os.path.join(wd, "runs", "logreg_kaggle_s1", runs.RUN_RECORD))


def test_a_run_record_that_does_not_read_is_one_line(tmp_path):
  """A run.json cut short or missing a field stops naming the file, what is wrong and what
  to do; bad budgets and seed lists stop before anything is built."""
  cfg = configs.make_run(num_rows=50, batch_size=16, eval_batch_size=16, eval_batches=1)
  path = tmp_path / runs.RUN_RECORD
  path.write_text('{"config": {}, "steps": 2')
  with pytest.raises(UserError) as e:
    runs.finished_run(cfg, str(tmp_path), steps=2, seed=0)
  assert str(e.value).startswith(f"{path}: Expecting ") and str(e.value).endswith(
      "; expected a run record written by rec.runs (delete it to train the run again)")
  path.write_text('{"config": {}, "steps": 2, "seed": 0}')
  with pytest.raises(UserError, match=rf"^{path}: 'result'; expected a run record written by "
                     r"rec.runs \(delete it"):
    runs.finished_run(cfg, str(tmp_path), steps=2, seed=0)
  with pytest.raises(ValueError, match=r"^train_seeds: no seeds$"):
    runs.train_seeds(cfg, [], str(tmp_path / "r"), steps=1)
  with pytest.raises(ValueError, match=r"^train_seeds: reuse_finished=True with keep: a reused "
                     r"run has no state$"):
    runs.train_seeds(cfg, [0], str(tmp_path / "r"), steps=1, keep=print, reuse_finished=True)
  spec = [runs.ModelSpec("logreg")]
  with pytest.raises(ValueError, match=r"^train_models: no models to train$"):
    runs.train_models(cfg, [], steps=1, workdir=str(tmp_path))
  with pytest.raises(ValueError, match=r"^train_models: no seeds$"):
    runs.train_models(cfg, spec, seeds=(), steps=1, workdir=str(tmp_path))
  with pytest.raises(ValueError, match=r"^train_models: steps=1, epochs=1.0; give exactly one$"):
    runs.train_models(cfg, spec, steps=1, epochs=1.0, workdir=str(tmp_path))
  assert not (tmp_path / "runs").exists()


def _auc(scores, labels):
  """Mann-Whitney AUC by all pairs (ties count one half)."""
  pos, neg = scores[labels == 1], scores[labels == 0]
  d = pos[:, None] - neg[None, :]
  return float(np.mean((d > 0) + 0.5 * (d == 0)))


def test_train_models_adds_the_true_logits_on_the_same_eval_examples(tmp_path):
  """On synthetic data the results carry the metrics of the planted logits over exactly the
  eval examples the models are scored on (the Bayes line of the table); file data: none."""
  base = configs.make_run(num_rows=50, batch_size=16, eval_batch_size=32, eval_batches=2,
                          seed=4)
  res = runs.train_models(base, [runs.ModelSpec("logreg")], steps=1, workdir=str(tmp_path))
  ref, row = res["reference"], res["rows"][0]
  assert ref["num_examples"] == row["runs"][0]["eval_examples"] == 64
  _, eval_src = configs.build_run(base)[1:3]
  batches = list(eval_src.batches(0))
  logits = np.concatenate([eval_src.true_logits(b) for b in batches])
  labels = np.concatenate([b.labels for b in batches])
  assert ref["auc"] == pytest.approx(_auc(logits, labels), abs=1e-12)
  assert ref["logloss"] == pytest.approx(
      np.mean(np.logaddexp(0, logits) - labels * logits), rel=1e-12)
  table = runs.format_runs(res).splitlines()
  assert table[3].split() == ["true", "logits", "(Bayes)", f"{ref['auc']:.4f}",
                              f"{ref['logloss']:.4f}", f"{ref['ne']:.4f}"]
  assert table[2].startswith("logreg:kaggle ")
  assert runs.reference_metrics(object()) is None   # no planted logits: file data
