"""experiments/fp8_probe.py end to end on a tiny DLRM: probe table, trained variants,
step times, results.json, plot and the JSON summary line. Slow (it compiles a train step
per variant): CI skips it; tests/rec/test_fp8.py covers the library fast."""

import json
import os

import pytest

from tests.experiments.entry import run_entry


@pytest.mark.slow
def test_runs_end_to_end(tmp_path):
  stdout, summary = run_entry(
      "experiments.fp8_probe",
      [f"--workdir={tmp_path}", "--models=dlrm:small", "--steps=4", "--batch_size=64",
       "--eval_batch_size=128", "--eval_batches=1", "--num_rows=200",
       "--variants=fp32,bf16,fp8_delayed", "--probe_recipes=row", "--probe_batches=1",
       "--timing_steps=1", "--timing_repeats=1", "--max_logloss_increase=1.0"])
  (label, m), = summary["models"].items()
  assert label == "dlrm:small"
  # A threshold of 100% makes every layer safe, so no fp8_safe variant is added.
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  model = res["models"][0]
  names = model["fp8_layer_names"]
  assert m["safe_layers"] == ",".join(names)
  assert set(model["variants"]) == {"fp32", "bf16", "fp8_delayed"}
  assert {f"{v}_auc" for v in model["variants"]} <= set(m)
  probe, = model["probes"]
  assert [r["layer"] for r in probe["layers"]] == names and probe["recipe"] == "row"
  assert set(model["step_times"]["variants"]) == {"fp32", "bf16", "fp8_delayed"}
  assert os.path.getsize(tmp_path / "fp8_probe.png") > 10_000
  assert "out SQNR" in stdout and "FP8 emulated" in stdout
