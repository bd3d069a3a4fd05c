"""experiments.spec_decode end to end on stories260K at toy sizes (slow: a subprocess that
distills a draft head and compiles every tree shape)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("LLM_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
STORIES = os.path.join(DATA, "llama2c", "stories260K.bin")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(STORIES), reason=f"{STORIES} not found")
def test_spec_decode_entry(tmp_path):
  args = [f"--target=llama2c:{STORIES}", f"--workdir={tmp_path}", "--draft_steps=30",
          "--num_sequences=48", "--eval_sequences=8", "--seq_len=48", "--draft_batch=8",
          "--trees=chain:2,2:3:6", "--batch_sizes=1,2", "--max_new_tokens=12", "--repeats=1"]
  run = lambda: subprocess.run([sys.executable, "-m", "experiments.spec_decode", *args],
                               cwd=REPO, capture_output=True, text=True, timeout=900,
                               env=dict(os.environ, JAX_PLATFORMS="cpu"))
  out = run()
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["greedy_match"] is True and set(summary["best"]) == {"1", "2"}
  res = json.load(open(tmp_path / "results.json"))
  assert len(res["rows"]) == 4 and all(r["tokens_per_call"] >= 1.0 for r in res["rows"])
  assert (tmp_path / "spec_decode.png").exists()
  assert (tmp_path / "draft" / "checkpoints").is_dir()
  # A second run reuses the trained head (resumes a finished run: no training steps).
  again = run()
  assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-3000:]
