"""experiments/exfm: the drifting synthetic periods against the source they come from, the
verticals as a partition, the Criteo sample in file order, the stream's period ends; a tiny
end-to-end run (slow) whose students read the DAS files and whose baseline gain is 0."""

import os

import numpy as np
import pytest

from core.errors import UserError
from experiments.exfm import study
from rec.data.synthetic import SyntheticCriteo
from tests.conftest import SHARED_DATA

CRITEO = os.path.join(SHARED_DATA, "criteo_kaggle_raw", "train.txt")


def test_synthetic_periods_drift_only_the_chosen_features():
  periods, spec = study.synthetic_periods(3, 2048, 500, drift_features=4, seed=0)
  src = SyntheticCriteo(2048, 500, seed=0, teacher="deep")
  shift = 500 // 7 + 1
  for p, rows in enumerate(periods):
    ids = src.batch(p).ids[:, :, 0]     # one chunk of 2048 rows per period here
    np.testing.assert_array_equal(rows.ids[:, 4:], ids[:, 4:])
    np.testing.assert_array_equal(rows.ids[:, :4], (ids[:, :4] + p * shift) % 500)
    assert 0.1 < rows.labels.mean() < 0.45
  # the popular ids of a drifting feature move; those of a fixed one stay
  top = lambda r, f: np.bincount(r.ids[:, f], minlength=500).argmax()
  assert top(periods[0], 0) != top(periods[1], 0)
  assert top(periods[0], 10) == top(periods[1], 10)
  assert spec.rows_per_feature == (500,) * 26


def test_synthetic_periods_logit_scale_is_the_sources():
  rows = study.synthetic_periods(1, 2048, 500, 0, logit_scale=3.0)[0][0]
  src = SyntheticCriteo(2048, 500, seed=0, teacher="deep", logit_scale=3.0)
  logit = src.true_logits(src.batch(0))
  u = np.random.default_rng([0, 2025, 0, 0]).random(2048)
  np.testing.assert_array_equal(rows.labels, (u < 1 / (1 + np.exp(-logit))).astype(np.float32))
  # the labels of the default scale are other draws
  assert (study.synthetic_periods(1, 2048, 500, 0)[0][0].labels != rows.labels).any()


def test_route_is_a_partition_by_the_vertical_feature():
  rows = study.synthetic_periods(1, 1000, 300, 0)[0][0]
  parts = study.route(rows, 3, feature=2)
  assert sum(len(p) for p in parts) == len(rows)
  for k, p in enumerate(parts):
    assert (p.ids[:, 2] % 3 == k).all()
  got = np.sort(np.concatenate([p.labels + 2 * p.ids[:, 0] for p in parts]))
  np.testing.assert_array_equal(got, np.sort(rows.labels + 2 * rows.ids[:, 0]))


def test_stream_ends_and_resume():
  rows = study.synthetic_periods(1, 700, 300, 0)[0][0]
  b = study.to_batches(rows, 100)
  assert len(b) == 7
  s = study.Stream([b[:3], b[3:4], b[4:]], None, 100)
  assert s.ends == [3, 4, 7]
  assert [x.labels[0] for x in s.batches(4)] == [x.labels[0] for x in b[4:]]


@pytest.mark.skipif(not os.path.exists(CRITEO), reason=f"{CRITEO} absent")
def test_criteo_periods_keep_file_order():
  periods, _ = study.criteo_periods(CRITEO, 4, 1000)
  with open(CRITEO) as f:
    labels = np.array([float(line.split("\t", 1)[0]) for line in f])
  n = len(labels) // 4
  assert [len(p) for p in periods] == [n] * 4
  np.testing.assert_array_equal(np.concatenate([p.labels for p in periods]), labels[:4 * n])
  with pytest.raises(UserError, match="nope/train.txt: Criteo file not found"):
    study.criteo_periods("nope/train.txt", 4, 1000)


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
  res = study.run("synthetic", 2, periods=3, history=1, teacher_every=2, batch_size=64,
                  batches_per_period=2, num_rows=200, drift_features=4, teacher_sizes=["S"],
                  main_teacher="S", vertical_feature=0, lr=0.05, seed=0,
                  workdir=str(tmp_path), log=lambda s: None)
  assert res["eval_periods"] == [2, 3]
  alone = [r for r in res["rows"] if r["variant"] == "alone"]
  assert all(g == 0.0 for r in alone for g in r["ne_gain_pct"])
  assert {r["variant"] for r in res["rows"]} == set(study.VARIANTS)
  assert all(np.isfinite(r["ne"]).all() and len(r["ne"]) == 2 for r in res["rows"])
  assert os.path.exists(tmp_path / "teacher_S" / "das" / "s1_p3.npy")
  # the teacher check: its column's NE against each student alone on the evaluated periods
  for c in res["teacher_check"]:
    ne = np.array(next(r["ne"] for r in alone if r["student"] == c["student"]))
    np.testing.assert_allclose(c["alone_ne"], ne)
    np.testing.assert_allclose(c["margin_pct"], 100 * (ne - c["teacher_ne"]) / ne)
  # the teacher trained on more examples than any student (history, union, extra rows)
  assert res["scaling"][0]["train_examples"] > res["student_train_examples"]
  # the students read the DAS files: with one gone, a distilled student stops naming it
  os.remove(tmp_path / "teacher_S" / "das" / "s0_p1.npy")
  rows, spec = study.synthetic_periods(1, 640, 200, 0)
  with pytest.raises(UserError, match="s0_p1.npy: teacher column file not found"):
    study.train_student(0, "aux_head", [study.to_batches(rows[0], 64)[:2]] * 4, spec, 1,
        {(0, p): str(tmp_path / "teacher_S" / "das" / f"s0_p{p}.npy") for p in range(4)},
        0.05, 0, str(tmp_path / "x"))


def test_an_earlier_runs_teachers_and_students_are_refused_before_training(tmp_path):
  """A rerun into the same --workdir keeps the earlier run's teachers and students: one
  error names a run directory that holds one, before any data is made or anything trains;
  through the entry point, a later data set's runs are found before the first data set
  trains."""
  from core.errors import UserError
  from tests.experiments.entry import run_refused
  teacher = tmp_path / "teacher_M" / "train"
  (teacher / "checkpoints" / "4").mkdir(parents=True)
  with pytest.raises(UserError) as e:
    study.run("synthetic", 2, periods=3, history=1, teacher_every=2, batch_size=64,
              batches_per_period=2, num_rows=200, drift_features=4, teacher_sizes=["S", "M"],
              main_teacher="S", vertical_feature=0, lr=0.05, seed=0, workdir=str(tmp_path),
              log=lambda s: None)
  assert str(e.value).startswith(f"{teacher}: holds an earlier run (checkpoints); expected a "
                                 "fresh run directory")
  assert "choose a fresh --workdir" in str(e.value) and "--resume" not in str(e.value)
  assert sorted(os.listdir(tmp_path)) == ["teacher_M"]
  # The scaling runs are directories of the run too: student 1's kd with teacher M.
  assert str(tmp_path / "students" / "s1_kd_M") in study.run_dirs(str(tmp_path), 2, ["S", "M"],
                                                                  "S")
  wd = tmp_path / "w"
  student = wd / "criteo" / "students" / "s1_aux_head+adapter_L"
  student.mkdir(parents=True)
  (student / "metrics.jsonl").write_text('{"step": 2, "split": "eval", "ne": 0.9}\n')
  out = run_refused("experiments.exfm", ["--data=synthetic,criteo:" + str(tmp_path / "none"),
                                         f"--workdir={wd}"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {student}: holds an earlier run (metrics.jsonl); expected a fresh run "
      "directory (one run per workdir, never replaced): choose a fresh --workdir, or delete "
      "it to train again")
  assert "== synthetic" not in out.stdout and sorted(os.listdir(wd)) == ["criteo"]
  assert (student / "metrics.jsonl").read_text().startswith('{"step": 2')


def test_entry_point_refuses_a_teacher_size_given_twice(tmp_path):
  """--teacher_sizes=S,S,L is refused before any work: it would train S twice and count its
  teacher check twice, doubling the summary's teacher margin for --main_teacher=S."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.exfm", ["--data=synthetic", "--teacher_sizes=S,S,L",
                                         "--main_teacher=S", f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --teacher_sizes=S,S,L: ['S'] given more than once; expected distinct sizes")
  assert "teacher S" not in out.stdout
