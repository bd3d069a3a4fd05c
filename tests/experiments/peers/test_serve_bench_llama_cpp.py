"""experiments.serve_bench against llama.cpp's server (llama-cpp-python[server], marker
`peer`) on SmolLM2-135M-Instruct's GGUF: the server script's settings (logits of the last
position only, as our engine computes them; no interrupts, no pings, no extra buffers); with
the driver's request fields (greedy, repeat_penalty 1, the stop and control tokens biased
away) a streamed reply is one SSE event per token, as many as max_tokens, and its text is the
non-streamed reply's; llama.cpp's /extras/tokenize gives the word-token prompts' ids back;
a short serve_bench run has no failed request and leaves no server behind.

The peer Python: LLAMA_CPP_PEER_PYTHON, else the peer environment beside the checkout
(tests/peer_env.py); skipped where it is absent or cannot import llama_cpp.server, or where
the GGUF is absent. Alone:
  .venv/bin/python -m pytest -p no:cacheprovider -q -m peer \
      tests/experiments/peers/test_serve_bench_llama_cpp.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from experiments.benchmarks import serving as S
from tests.peer_env import RUN_CODE, peer_python
from tests.real_models import smollm2_gguf_or_skip

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SCRIPT = os.path.join(REPO, "experiments", "peers", "llama_cpp_server.py")
PEER = peer_python("LLAMA_CPP_PEER_PYTHON")
pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(not os.path.exists(PEER),
                                 reason=f"llama.cpp peer environment absent ({PEER})")]


@pytest.fixture(scope="module")
def gguf():
  path = smollm2_gguf_or_skip()
  r = subprocess.run([PEER, *RUN_CODE, "import llama_cpp.server.app"], capture_output=True,
                     text=True, timeout=300)
  if r.returncode:
    pytest.skip(f"{PEER} cannot import llama_cpp.server (pip install "
                f"'llama-cpp-python[server]'; experiments/peers/README.md): "
                f"{r.stderr.strip()[-200:]}")
  return path


def _sse(url, body):
  req = urllib.request.Request(url, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
  events = []
  with urllib.request.urlopen(req, timeout=300) as resp:
    for line in resp:
      line = line.strip()
      if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
        events.append(json.loads(line[5:]))
  return events


def test_server_settings(gguf):
  # logits_all off: llama-cpp-python's server default (on) computes and copies the logits of
  # every prompt position, work our engine's prefill does not do; the rest as the docstring.
  code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import llama_cpp_server as s; "
          "import llama_cpp.llama_cpp as low; "
          "server, model = s.settings(['--gguf_file', sys.argv[2], '--threads', '3']); "
          "print(json.dumps({**{k: getattr(model, k) for k in ('logits_all', 'n_threads', "
          "'n_threads_batch', 'n_ctx', 'model_alias', 'flash_attn', 'type_k')}, "
          "**{k: getattr(server, k) for k in ('interrupt_requests', 'disable_ping_events')}, "
          "'extra_bufts': bool(low.llama_model_default_params().use_extra_bufts)}))")
  r = subprocess.run([PEER, *RUN_CODE, code, os.path.dirname(SCRIPT), gguf], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.strip().splitlines()[-1]) == {
      "logits_all": False, "n_threads": 3, "n_threads_batch": 3, "n_ctx": 2048,
      "model_alias": os.path.basename(gguf), "flash_attn": False, "type_k": None,
      "interrupt_requests": False, "disable_ping_events": True, "extra_bufts": False}


def test_one_event_per_token_and_the_prompts_ids(gguf, tmp_path):
  from llm.checkpoints import find_tokenizer, load_config
  cfg = load_config(f"gguf:{gguf}")
  tok = find_tokenizer(f"gguf:{gguf}", None, cfg.vocab_size)
  pool = S.word_tokens(tok, 32)
  (ids, _), = S.make_requests(1, cfg.vocab_size, [40], [24], seed=0, pool=pool)
  port = S.free_port()
  with S.Server([PEER, SCRIPT, "--gguf_file", gguf, "--port", str(port), "--threads", "2",
                 "--n_ctx", "256"], port, "llama_cpp", str(tmp_path / "server.log"),
                env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE")) as server:
    server.wait_ready(120)
    runner = S.HTTPRunner(server.url, timeout_s=300)
    assert runner.post("/extras/tokenize", {"input": tok.decode(ids)})["tokens"] == ids
    body = {"prompt": tok.decode(ids), "max_tokens": 24, "temperature": 0.0,
            "repeat_penalty": 1.0, "logit_bias": {str(i): -1e4 for i in range(17)}}
    whole = runner.post("/v1/completions", body)
    assert whole["usage"] == {"prompt_tokens": 40, "completion_tokens": 24, "total_tokens": 64}
    assert whole["choices"][0]["finish_reason"] == "length"
    events = _sse(server.url + "/v1/completions", {**body, "stream": True})
    tokens = [e for e in events if e["choices"][0]["finish_reason"] is None]
    assert len(tokens) == 24 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]


def test_serve_bench_against_llama_cpp(gguf, tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", f"--checkpoint=gguf:{gguf}",
       "--dtype=bfloat16", "--targets=llama_cpp", "--threads=2", "--concurrency=1,2",
       "--rates=8", "--num_requests=3", "--prompt_lens=16,40", "--output_lens=8,12",
       "--max_model_len=256", f"--peer_python={PEER}", f"--workdir={tmp_path}"],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  results = json.load(open(tmp_path / "results.json"))
  points = results["points"]
  assert [(p["target"], p["mode"]) for p in points] == [("llama_cpp", "closed")] * 2 + [
      ("llama_cpp", "poisson")]
  assert all(p["failed"] == 0 and p["output_tokens"] >= 24 and p["events_per_token"] == 1
             and len(p["load_before"]) == 3 for p in points)
  assert results["per_target"]["llama_cpp"]["speedup"] > 0
  server = results["servers"]["llama_cpp"]
  assert server["exit_code"] is not None and os.path.exists(server["log"])
  assert "--threads" in server["cmd"] and results["llama_cpp_logit_bias_ids"] == list(range(17))
