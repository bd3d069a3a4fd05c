"""experiments.bench_lm_train: the tiny preset end to end on CPU, and the peak table
(core.benchmark.PEAK_FLOPS)."""

import json
import os
import subprocess
import sys

import pytest

from core import benchmark
from tests import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_peak_table():
  assert benchmark.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
  assert benchmark.peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert benchmark.peak_flops("NVIDIA H200", "bfloat16") == 989e12
  assert benchmark.peak_flops("cpu", "bfloat16") is None


@pytest.mark.slow   # an entry point end to end; CI's default suite keeps to its time
def test_tiny_preset_runs_with_breakdown(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=cpu_env.xla_flags(2))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.bench_lm_train", "--preset=tiny", "--seq_len=32",
       "--batch=2", "--mesh=data:2", "--remat=dots", "--steps=1", "--repeats=1", "--warmup=0",
       "--mu_dtype=bfloat16", "--xla_dump", f"--workdir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  summary = json.loads(lines[-1])
  assert summary["mfu"] is None and summary["attention_resolved"] == "xla"
  assert summary["remat"] == "dots" and summary["tokens_per_s"] > 0
  assert any("MFU: no peak FLOP/s known for 'cpu'" in line for line in lines)
  res = json.loads((tmp_path / "results.json").read_text())
  parts = res["breakdown_ms"]
  assert {"forward", "forward+backward", "no-attention forward+backward", "optimizer",
          "loss head forward+backward"} <= set(parts)
  assert all(v > 0 for k, v in parts.items() if k != "attention (by difference)")
  assert (tmp_path / "step.hlo.txt").exists() and (tmp_path / "xla_dump").is_dir()
