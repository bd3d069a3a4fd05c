"""experiments/recd/study.py: session data repeats the user features within a session and
nowhere else; the throughput study runs end to end at a toy size."""

import itertools

import numpy as np
import pytest

from experiments.recd import study
from rec.data import dedup as dedup_lib
from tests.experiments.entry import run_entry


def test_session_batches_repeat_user_features_per_session():
  b0, b1 = itertools.islice(study.session_batches(64, 8, num_user=2, num_item=3, user_bag=16,
                                                  num_rows=10_000, seed=3), 2)
  assert b0.ids.shape == (64, 5, 16) and (b0.lengths == [16, 16, 1, 1, 1]).all()
  # User bags: 8 sessions of 8 samples, one bag each (16 Zipf ids: no two sessions alike).
  assert dedup_lib.duplication_rate(b0, [0, 1]) == pytest.approx(1 - 8 / 64)
  for f in (0, 1):
    assert (b0.ids[:, f] == np.repeat(b0.ids[::8, f], 8, axis=0)).all()
  assert dedup_lib.duplication_rate(b0, [2, 3, 4]) < 0.5      # items: per sample (Zipf repeats)
  resumed = next(study.session_batches(64, 8, num_user=2, num_item=3, user_bag=16,
                                       num_rows=10_000, seed=3, start=1))
  np.testing.assert_array_equal(resumed.ids, b1.ids)
  with pytest.raises(ValueError, match="batch_size=60 not divisible by session_len=8"):
    next(study.session_batches(60, 8))


@pytest.mark.slow   # two compiled steps per session length in a fresh process
def test_study_runs_end_to_end(tmp_path):
  out = run_entry("experiments.recd", ["--session_lens=1,8", "--batch_size=128",
                                       "--num_user=2", "--num_item=2", "--user_bag=8",
                                       "--num_rows=1000", "--dim=8", "--steps=1",
                                       "--repeats=1", f"--workdir={tmp_path}"])[1]
  assert out["s1"]["dup"] == 0.0 and out["s8"]["dup"] == pytest.approx(0.875)
  assert all(out[s][k] > 0 for s in ("s1", "s8") for k in ("lookup_x", "step_x"))
  assert (tmp_path / "results.json").exists() and (tmp_path / "recd.png").exists()
