"""experiments/mx_qsnr.py end to end on few samples: table, sweep, results.json, plot, JSON."""

import json
import os

import pytest

from tests.experiments.entry import run_entry, run_refused


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


@pytest.mark.parametrize("flag, error", [
    ("--samples=5000", "--samples=5000: not a multiple"),
    ("--formats=mxint8,mxint9", "--formats=mxint8,mxint9: unknown ['mxint9']"),
    ("--sweep_formats=mxfp4,bf16", "--sweep_formats=mxfp4,bf16: unknown ['bf16']"),
    ("--block_sizes=16,3x", "--block_sizes=16,3x: not block sizes"),
    ("--block_sizes=16,48", "--block_sizes=16,48: not block sizes"),
    # mx9 / mx6 / mx4 share a micro-exponent per pair: block 1 would drop their rows.
    ("--block_sizes=1,16", "--block_sizes=1,16: [1] not whole pairs of the BDR formats "
                           "['mx9', 'mx6', 'mx4']"),
])
def test_refuses_bad_settings_before_sampling(tmp_path, flag, error):
  """A typo in a format or block size is one line naming the flag, before any QSNR is
  measured (the block sizes and sweep formats too, not after the whole table)."""
  out = run_refused("experiments.mx_qsnr", [f"--workdir={tmp_path}", flag])
  assert out.stderr.strip().splitlines()[-1].startswith("error: " + error)
  assert "QSNR on" not in out.stdout
