"""experiments/peers/torchrec_dlrm.py (bench_dlrm's TorchRec peer) in the peer environment
(marker `peer`), at tiny sizes on both embedding paths: it builds TorchRec's DLRM on FBGEMM's
fused CPU TBE with EXACT_ROWWISE_ADAGRAD (its own checks, which fail the run otherwise,
include that the first step updates exactly the rows the batch touched), and its JSON line
reports the run; a pool whose labels are all alike (a batch of 2, one batch) still runs.

The peer Python: TORCHREC_PEER_PYTHON, else the peer environment beside the checkout
(tests/peer_env.py); skipped where it is absent or lacks torchrec / fbgemm_gpu. Alone:
  .venv/bin/python -m pytest -p no:cacheprovider -q -m peer \\
      tests/experiments/peers/test_torchrec_dlrm.py
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.peer_env import peer_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SCRIPT = os.path.join(REPO, "experiments", "peers", "torchrec_dlrm.py")
PEER = peer_python("TORCHREC_PEER_PYTHON")
pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(not os.path.exists(PEER),
                                 reason=f"TorchRec peer environment absent ({PEER})")]


def _run(*args: str) -> dict:
  r = subprocess.run([PEER, SCRIPT, "--rows", "50", "--num_tables", "2", "--bottom", "8,16",
                      "--top", "8,1", "--steps", "2", "--warmup", "1", "--repeats", "1",
                      "--threads", "1", *args], capture_output=True, text=True, timeout=600)
  if r.returncode and "No module named" in r.stderr:
    pytest.skip(f"{PEER} lacks torchrec / fbgemm_gpu: {r.stderr.strip()[-200:]}")
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", ["fused_ebc", "dmp"])
def test_tiny_run(path):
  out = _run("--batch_size", "16", "--embedding_path", path)
  assert out["embedding_optimizer"] == "EXACT_ROWWISE_ADAGRAD" and out["num_tbe_modules"] == 1
  assert len(out["examples_per_sec_all"]) == 1 and out["examples_per_sec_median"] > 0
  assert out["loss_constant_predictor"] > 0


def test_labels_all_alike():
  # Seed 0's one batch of 2 has no positive label (Bernoulli(0.25)): the constant
  # predictor's loss is 0 there, not a math domain error.
  out = _run("--batch_size", "2", "--pool", "1", "--embedding_path", "fused_ebc")
  assert out["loss_constant_predictor"] == 0.0
