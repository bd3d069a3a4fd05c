"""experiments.serve_bench: the load statistics on hand-made request records (TTFT, TPOT,
throughput, goodput against the SLOs), the request mixes, and (slow) a whole run on a tiny
random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.benchmarks import serving as S
from tests import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rec(submitted, first, last, tokens, prompt_len=8):
  return S.Record(prompt_len, tokens, submitted, first, last, tokens, "length")


def test_summary_of_known_records():
  recs = [_rec(0.0, 0.5, 1.5, 11),       # TTFT 0.5, TPOT 0.1
          _rec(1.0, 1.2, 4.2, 7),        # TTFT 0.2, TPOT 0.5 (misses the TPOT SLO)
          _rec(2.0, 4.0, 4.0, 1)]        # TTFT 2.0 (misses the TTFT SLO); one token
  out = S.summary(recs, slo_ttft_s=1.0, slo_tpot_s=0.2)
  assert out["seconds"] == 4.2 and out["output_tokens"] == 19
  assert out["throughput_tok_s"] == pytest.approx(19 / 4.2)
  assert out["ttft_p50_s"] == pytest.approx(0.5)
  assert out["tpot_p50_s"] == pytest.approx(0.3)              # the two with a second token
  assert out["goodput_req_s"] == pytest.approx(1 / 4.2) and out["slo_attainment"] == 1 / 3
  assert out["latency_p99_s"] == pytest.approx(np.percentile([1.5, 3.2, 2.0], 99))


def test_request_mixes_are_seeded_and_drawn_from_the_lists():
  a = S.make_requests(50, 100, (4, 9), (3, 5), seed=1, low_id=10)
  assert a == S.make_requests(50, 100, (4, 9), (3, 5), seed=1, low_id=10)
  assert {len(p) for p, _ in a} == {4, 9} and {n for _, n in a} == {3, 5}
  assert min(min(p) for p, _ in a) >= 10 and max(max(p) for p, _ in a) < 100


@pytest.mark.slow   # a 30 s run; the statistics are tested above, the engine in tests/llm/serving
def test_a_whole_run_on_a_tiny_model(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", "--preset=tiny", "--num_requests=4",
       "--concurrency=1,4", "--rates=50", "--prompt_lens=5,20", "--output_lens=3,9",
       "--max_slots=4", "--max_model_len=32", "--block_size=8", "--prefill_chunk=16",
       f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  results = json.load(open(tmp_path / "results.json"))
  assert summary["speedup"] == results["speedup"] > 0 and len(results["points"]) == 3
  assert all(p["failed"] == 0 and p["output_tokens"] > 0 for p in results["points"])
  assert os.path.exists(tmp_path / "serve_bench.png")
