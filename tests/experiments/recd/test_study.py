"""experiments/recd: the throughput study runs end to end at a toy size on the library's
fixed-length session data (its duplication rates: tests/rec/test_recd.py)."""

import pytest

from tests.experiments.entry import run_entry


@pytest.mark.slow   # two compiled steps per session length in a fresh process
def test_study_runs_end_to_end(tmp_path):
  out = run_entry("experiments.recd", ["--session_lens=1,8", "--batch_size=128",
                                       "--num_user=2", "--num_item=2", "--user_bag=8",
                                       "--num_rows=1000", "--dim=8", "--steps=1",
                                       "--repeats=1", f"--workdir={tmp_path}"])[1]
  assert out["s1"]["dup"] == 0.0 and out["s8"]["dup"] == pytest.approx(0.875)
  assert all(out[s][k] > 0 for s in ("s1", "s8") for k in ("lookup_x", "step_x"))
  assert (tmp_path / "results.json").exists() and (tmp_path / "recd.png").exists()
