"""experiments/mx_qsnr.py end to end on few samples: table, sweep, results.json, plot, JSON."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_runs_end_to_end(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, "-m", "experiments.mx_qsnr", f"--workdir={tmp_path}", "--samples=65536",
       "--formats=mxint8,bf16,mx6", "--sweep_formats=mxfp4,mx4", "--block_sizes=16,32"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(summary["qsnr_db"]) == {"mxint8", "bf16", "mx6"}
  assert summary["max_abs_diff_vs_issue_db"] < 0.1
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  assert len(res["table"]) == 3 and len(res["sweep"]) == 4
  assert os.path.getsize(tmp_path / "qsnr.png") > 10_000
  assert "format / block" in out.stdout and "issue dB" in out.stdout
