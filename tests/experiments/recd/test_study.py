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


def test_paths_are_timed_in_turns(monkeypatch):
  """The plain and dedup paths take turns repeat by repeat (after one untimed call each),
  so load that changes during the study reaches both medians alike; timed in two blocks, a
  slowdown during one block skews the speedup. A fake clock that slows down half-way
  through shows the difference: in turns, the ratio of the medians stays 1."""
  import types

  from experiments.recd import study
  clock, calls = [0.0], []

  def fn(name):
    def call(s):
      calls.append(name)
      clock[0] += 1.0 if len(calls) <= 10 else 3.0   # the machine gets busier
      return s
    return call

  fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0])
  monkeypatch.setattr(study.benchmark, "time", fake_time)
  times, _ = study.side_by_side({"plain": fn("plain"), "dedup": fn("dedup")}, 0, 2, 4)
  assert calls[:2] == ["plain", "dedup"]                      # one untimed call each
  assert calls[2:] == ["plain", "plain", "dedup", "dedup"] * 4
  assert {k: len(v) for k, v in times.items()} == {"plain": 4, "dedup": 4}
  assert study.benchmark.median(times["plain"]) == study.benchmark.median(times["dedup"])
