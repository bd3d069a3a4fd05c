"""experiments/mx_qsnr.py end to end on few samples: table, sweep, results.json, plot, JSON."""

import json
import os

from tests.experiments.entry import run_entry


def test_runs_end_to_end(tmp_path):
  stdout, summary = run_entry(
      "experiments.mx_qsnr",
      [f"--workdir={tmp_path}", "--samples=65536", "--formats=mxint8,bf16,mx6",
       "--sweep_formats=mxfp4,mx4", "--block_sizes=16,32"], timeout=300)
  assert set(summary["qsnr_db"]) == {"mxint8", "bf16", "mx6"}
  assert summary["max_abs_diff_vs_issue_db"] < 0.1
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  assert len(res["table"]) == 3 and len(res["sweep"]) == 4
  assert os.path.getsize(tmp_path / "qsnr.png") > 10_000
  assert "format / block" in stdout and "issue dB" in stdout
