"""experiments.cp_prefill end to end on 8 simulated CPU devices: CP vs no-CP logits,
timings, the variant "auto" runs, results.json and the JSON last line."""

import json
import os
import sys
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, ok=True):
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "-m", "experiments.cp_prefill", "--repeats=2", *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert (out.returncode == 0) == ok, out.stderr[-3000:]
  return out


def test_full_prefill_cp8(tmp_path):
  out = _run(["--mesh=cp:8", "--seq_len=64", "--variant=pass_q", f"--workdir={tmp_path}"])
  lines = out.stdout.strip().splitlines()
  s = json.loads(lines[-1])
  assert s["mesh"] == {"cp": 8} and s["phase"] == "full" and s["seq_len"] == 64
  assert s["variant_used"] == "pass_q" and s["passed"] and s["tol"] == 1e-4
  assert 0 < s["max_abs_diff"] < 1e-4 < 1 < s["max_abs_logit"]
  assert s["cp_ms"] > 0 and s["no_cp_ms"] > 0
  res = json.load(open(tmp_path / "results.json"))
  assert res["summary"] == s and len(res["cp_s"]) == len(res["no_cp_s"]) == 2
  assert any(l.startswith("CP8 pass_q") for l in lines)
  assert any(l.startswith("max |logits CP - no CP|") and l.endswith("PASS") for l in lines)


def test_persistent_kv_auto_on_mixed_mesh(tmp_path):
  # T = 16 new tokens after P = 48: with the default H100 / 400 Gb/s constants the rule picks
  # pass-Q (Eq. 2 needs T >= 4 * 989e12 * 2 * 4 / (2 * 4 * 50e9) = 79120; miss rate
  # 0.25 < 2 * 2 / 4 - 4 * 16 * 50e9 / (4 * 989e12 * 4)), and that is what runs.
  out = _run(["--mesh=data:2,cp:4", "--batch=2", "--seq_len=16", "--cached_len=48",
              "--variant=auto", f"--workdir={tmp_path}"])
  s = json.loads(out.stdout.strip().splitlines()[-1])
  assert s["phase"] == "persistent_kv" and s["mesh"] == {"data": 2, "cp": 4}
  assert s["variant_rule"] == s["variant_used"] == "pass_q" and s["passed"]
  assert "CP4 auto (picked pass_q)" in out.stdout
  # Fast links (C = 1 TF/s, BW = 1 TB/s): Eq. 2's threshold is 4 tokens, so pass-KV runs.
  # An impossible tolerance fails the check: exit 1, the JSON line still last.
  out = _run(["--mesh=cp:4", "--seq_len=16", "--cached_len=48", "--variant=auto",
              "--peak_tflops=1", "--bandwidth_gbps=1000", "--tol=1e-12",
              f"--workdir={tmp_path}"], ok=False)
  s = json.loads(out.stdout.strip().splitlines()[-1])
  assert s["variant_rule"] == s["variant_used"] == "pass_kv"
  assert not s["passed"] and 0 < s["max_abs_diff"] < 1e-4
  assert out.stdout.strip().splitlines()[-2].endswith("FAIL")


def test_bad_lengths_fail_clearly(tmp_path):
  out = _run(["--mesh=cp:4", "--seq_len=12", f"--workdir={tmp_path}"], ok=False)
  assert "--seq_len=12: expected a positive multiple of 2 * cp = 8" in out.stderr


def test_one_cp_rank_is_refused(tmp_path):
  # One rank runs no ring: the "CP" run would be the no-CP model again, reported as a PASS.
  out = _run(["--mesh=data:4,cp:1", "--seq_len=16", f"--workdir={tmp_path}"], ok=False)
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --mesh=data:4,cp:1: a cp axis of 1 rank on 8 device(s); expected cp >= 2 ranks "
      "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N first)")
  assert os.listdir(tmp_path) == []
