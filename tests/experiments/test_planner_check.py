"""experiments/planner_check: the planner's estimate against the compiled program.

The entry point end to end at the grid's tiny point on 8 devices, every sharding kind: the
estimate's collectives (result bytes per device) and memory per device within 10% of what
the compiled step's HLO moves and what the devices hold (the model is exact, so each
collective matches too). The default suite compiles the collection's phases alone (the
same embedding collectives as the train step in about half the compile time); the train
step of every kind is the slow test.
"""

from __future__ import annotations

import json
import sys

import pytest

from experiments.planner_check import study
from tests import cpu_env, forkserver
from tests.experiments.entry import REPO


def _run(tmp_path, *args):
  out = forkserver.run(
      [sys.executable, "-m", "experiments.planner_check", "--planner_grid=tiny",
       f"--workdir={tmp_path}", *args],
      cwd=REPO, env=cpu_env.cpu_env(8), capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  results = json.loads((tmp_path / "results.json").read_text())
  assert (tmp_path / "planner_check.png").exists()
  return summary, results


def _check(summary, results, step):
  assert summary["cases"] == len(study.KINDS) and summary["within_target"], summary
  assert [r["kind"] for r in results["rows"]] == list(study.KINDS)
  for r in results["rows"]:
    assert r["step"] == step and r["devices"] == 8
    assert r["bytes_hlo"] > 0 and r["memory"] > 0
    assert abs(r["bytes_ratio"] - 1) <= study.TARGET, r
    assert abs(r["memory_ratio"] - 1) <= study.TARGET, r
    assert r["collectives_est"].keys() == r["collectives_hlo"].keys(), r["kind"]
    for k, v in r["collectives_hlo"].items():
      assert r["collectives_est"][k] == pytest.approx(v, rel=study.TARGET), (r["kind"], k)
    assert len(set(r["memory_per_device"])) == 1     # every device holds padded buffers
    assert any(line.startswith(f"| {r['kind']} |") for line in results["table"])
  rows = {r["kind"]: r for r in results["rows"]}
  # Four tables on eight devices: the all-to-all gives every device a slot, twice what the
  # per-table sums count.
  assert rows["tw"]["table_sum_wire_ratio"] == pytest.approx(0.5)
  return rows


def test_every_kind_is_within_ten_percent_of_the_compiled_collection(tmp_path):
  summary, results = _run(tmp_path, "--planner_step=embedding")
  rows = _check(summary, results, "embedding")
  assert all(r["dense_all_reduce"] == 0 for r in rows.values())


@pytest.mark.slow   # six train steps (DLRM; DMT for sptt) compiled in a fresh process
def test_every_kind_is_within_ten_percent_of_the_compiled_train_step(tmp_path):
  summary, results = _run(tmp_path)
  rows = _check(summary, results, "train")
  assert all(r["dense_all_reduce"] > 0 for r in rows.values())


@pytest.mark.parametrize("devices,args,line", [
    (6, [], "6 cpu devices: --planner_grid=tiny has batches [32] that they do not divide; "
     "expected a device count dividing every batch of the grid"),
    (8, ["--sharding_kinds=tw,rw,tw"], "--sharding_kinds=tw,rw,tw: a kind twice; expected "
     "each kind once"),
])
def test_flags_refused_before_the_first_compile(tmp_path, devices, args, line):
  """Refused before the first compile. Unchecked, a device count that does not divide a
  grid point's batch stops the run at that point (after every point before it compiled),
  as a study ValueError naming neither the devices nor the grid; a kind given twice is
  measured twice."""
  out = forkserver.run(
      [sys.executable, "-m", "experiments.planner_check", "--planner_grid=tiny",
       f"--workdir={tmp_path}", *args],
      cwd=REPO, env=cpu_env.cpu_env(devices), capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == "error: " + line
  assert "grid points" not in out.stdout and not (tmp_path / "results.json").exists()
