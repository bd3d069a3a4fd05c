"""experiments.serve_bench: the load statistics on hand-made request records (TTFT, TPOT,
throughput, goodput against the SLOs), the request mixes, the prefill chunk widths of a mix,
the HTTP driver on a fake SSE server streaming as ours and as llama.cpp's do (token counts,
a short reply counted as failed), a server child's start, CPU pinning and stop, and (slow) a
whole run on a tiny random model. The driver against our own server: tests/experiments/
test_serve.py; against llama.cpp's: tests/experiments/peers/test_serve_bench_llama_cpp.py."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from experiments.benchmarks import serving as S
from tests import cpu_env
from tests import forkserver

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


def test_engine_flags_for_the_server_child():
  from experiments import serve_bench as B
  from llm.serving.config import EngineConfig
  got = B.engine_flags(EngineConfig(max_model_len=256, chunk_widths=(32, 64)))
  assert "--chunk_widths=32,64" in got and "--max_model_len=256" in got
  assert "--mixed_batch=true" in got and not any(f.startswith("--num_blocks") for f in got)


def test_ratios_over_a_point_without_tokens_are_none():
  """A point whose every request failed (0 tokens/s) gives no ratio, not a ZeroDivisionError
  after the whole benchmark: n/a in its round, left out of the median."""
  from experiments import serve_bench as B
  thr = {("engine", 0, 1): 10.0, ("engine", 0, 4): 30.0, ("engine", 1, 1): 10.0,
         ("engine", 1, 4): 20.0, ("llama_cpp", 0, 1): 0.0, ("llama_cpp", 0, 4): 10.0,
         ("llama_cpp", 1, 1): 5.0, ("llama_cpp", 1, 4): 0.0}
  points = [{"target": t, "round": r, "concurrency": c, "mode": "closed",
             "throughput_tok_s": v} for (t, r, c), v in thr.items()]
  per_target, ratios = B._ratios(points, ["engine", "llama_cpp"], [1, 4], rounds=2)
  assert per_target["engine"]["speedup_per_round"] == [3.0, 2.0]
  assert per_target["engine"]["speedup"] == 2.5
  assert per_target["llama_cpp"]["speedup_per_round"] == [None, 0.0]
  assert per_target["llama_cpp"]["speedup"] == 0.0
  assert ratios["engine"]["1"] == {"median": 2.0, "per_round": [None, 2.0]}
  assert ratios["engine"]["4"] == {"median": 3.0, "per_round": [3.0, None]}


def test_no_plot_when_every_point_is_at_rate_inf(tmp_path):
  from experiments import serve_bench as B
  points = [{"target": "engine", "mode": "poisson", "rate": float("inf"), "round": 0}]
  assert B.plot(points, str(tmp_path / "p.png")) is None
  assert not os.path.exists(tmp_path / "p.png")


def test_preset_weights_are_quantized(capsys):
  """--weights=int8 with --preset quantizes the random weights (not ignored while
  results.json says int8)."""
  import jax
  from flax import nnx
  from experiments import serve_bench as B
  from llm import quantized
  model, vocab, low = B.load(None, "tiny", "float32", "int8")
  assert "weights int8: {" in capsys.readouterr().out and (vocab, low) == (256, 0)
  leaves = jax.tree.leaves(nnx.state(model),
                           is_leaf=lambda x: isinstance(x, quantized.QuantizedParam))
  assert sum(isinstance(x, quantized.QuantizedParam) for x in leaves) == 16   # the matrices


@pytest.mark.parametrize("args,where,found,want", [
    (["--concurrency=1,1"], "--concurrency=1,1", "'1' twice", "client counts >= 1, each once"),
    (["--concurrency=1,8", "--num_requests=4"], "--concurrency=1,8",
     "8 clients for --num_requests=4", "at most 4 clients"),
    (["--concurrency=", "--rates=2", "--rounds=2"], "--rounds=2", "no --concurrency to repeat",
     "--rounds=1"),
    (["--rates=0"], "--rates=0", "'0' is out of range", "rates > 0 (requests per second) or inf"),
    (["--decode_vocab=8"], "--decode_vocab=8", "no --draft", "--decode_vocab=0"),
    (["--draft=random", "--speculative_tree=2:2:3", "--decode_vocab=300"], "--decode_vocab=300",
     "more tokens than the model's vocabulary of 256", "at most 256"),
    (["--weights=gguf"], "--weights=gguf", "the checkpoint is random weights",
     "--weights=int8 or int4"),
    (["--checkpoint=gguf:/no/such.gguf", "--preset=tiny"], "--preset=tiny",
     "given with --checkpoint=gguf:/no/such.gguf", "one of them"),
    (["--checkpoint=gguf:/no/such.gguf", "--targets=llama_cpp", "--peer_python=/no/python"],
     "--peer_python=/no/python", "no such file", "the Python of the peer environment"),
], ids=["clients_twice", "clients_over_requests", "rounds_without_clients", "rate_0",
        "decode_vocab_without_draft", "decode_vocab_over_the_vocabulary",
        "gguf_weights_of_a_preset", "preset_and_checkpoint", "missing_peer_python"])
def test_bad_settings_are_refused_before_the_model_loads(tmp_path, args, where, found, want):
  """Refused with one line naming the flag, the value and what was expected, before any
  weights load or the workdir is made (not accepted, nor failing after loading)."""
  from tests.experiments.entry import run_refused
  wd = tmp_path / "wd"
  out = run_refused("experiments.serve_bench", [
      "--num_requests=4", "--concurrency=1", "--rates=", "--prompt_lens=4", "--output_lens=2",
      "--max_model_len=16", f"--workdir={wd}", *args])
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith(f"error: {where}") and found in line and want in line, line
  assert "Traceback" not in out.stderr and os.listdir(wd) == []


class _FakeSSE(http.server.BaseHTTPRequestHandler):
  """POST /v1/completions streaming as `model` says: ours (text per token, the last token in
  the finishing event, then usage), llama (one event per token, empty text included, then
  an empty finishing event), short (stops after 2 tokens)."""
  bodies: list = []

  def log_message(self, *args):
    pass

  def do_GET(self):
    self._send(200, json.dumps({"data": [{"id": "fake"}]}).encode(), "application/json")

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    _FakeSSE.bodies.append(body)
    n, style = body["max_tokens"], body["model"]
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.end_headers()

    def event(obj):
      self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
      self.wfile.flush()
      time.sleep(0.002)

    if style == "ours":
      for i in range(n - 1):
        event({"choices": [{"text": f" t{i}", "finish_reason": None}]})
      event({"choices": [{"text": " end", "finish_reason": "length"}]})
      event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                      "completion_tokens": n}})
    else:
      for i in range(2 if style == "short" else n):
        event({"choices": [{"text": "" if i == 1 else f" t{i}", "finish_reason": None}]})
      event({"choices": [{"text": "", "finish_reason": "stop" if style == "short"
                          else "length"}]})
    self.wfile.write(b"data: [DONE]\n\n")

  def _send(self, code, data, kind):
    self.send_response(code)
    self.send_header("Content-Type", kind)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)


@pytest.fixture
def fake_server():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeSSE)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  _FakeSSE.bodies = []
  yield f"http://127.0.0.1:{server.server_address[1]}"
  server.shutdown()


def test_http_runner_counts_the_tokens_of_both_streaming_styles(fake_server):
  reqs = S.make_requests(6, 50, (3, 5), (4, 7), seed=0)
  for style in ("ours", "llama"):
    runner = S.HTTPRunner(fake_server, style, body={"ignore_eos": True})
    recs = S.run_closed(runner, reqs, 3)
    assert sorted(r.max_tokens for r in recs) == sorted(n for _, n in reqs)
    assert all(r.error is None and r.tokens == r.max_tokens == r.events for r in recs), recs
    assert all(r.submitted < r.first <= r.last for r in recs)
    out = S.summary(recs, 1.0, 1.0)
    assert out["failed"] == 0 and out["events_per_token"] == 1.0
  sent = _FakeSSE.bodies[0]
  assert sent["stream"] and sent["temperature"] == 0.0 and sent["ignore_eos"] is True
  assert sorted(len(b["prompt"]) for b in _FakeSSE.bodies[:6]) == sorted(len(p) for p, _ in reqs)
  # Text prompts, and a reply shorter than max_tokens counted as failed.
  runner = S.HTTPRunner(fake_server, "short", to_text=lambda ids: " ".join(map(str, ids)))
  recs = S.run_poisson(runner, reqs[:2], float("inf"))
  assert all(r.error.startswith("2 output tokens (finish_reason 'stop'); expected exactly")
             for r in recs)
  assert isinstance(_FakeSSE.bodies[-1]["prompt"], str)
  assert S.summary(recs, 1.0, 1.0)["failed"] == 2


def test_server_child_answers_on_its_cpus_and_is_stopped(tmp_path, monkeypatch):
  port = S.free_port()
  code = ("import http.server, json, signal, sys\n"
          "signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[2] == 'stubborn' else 0\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "  def do_GET(self):\n"
          "    d = json.dumps({'data': [{'id': 'm'}]}).encode()\n"
          "    self.send_response(200); self.send_header('Content-Length', str(len(d)))\n"
          "    self.end_headers(); self.wfile.write(d)\n"
          "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
  cpu = sorted(os.sched_getaffinity(0))[0]
  with S.Server([sys.executable, "-c", code, str(port), "plain"], port, "fake",
                str(tmp_path / "a.log"), cpus=[cpu]) as server:
    assert server.wait_ready(30)["data"][0]["id"] == "m"
    assert os.sched_getaffinity(server.proc.pid) == {cpu}
  assert server.proc.returncode == -15
  port = S.free_port()
  server = S.Server([sys.executable, "-c", code, str(port), "stubborn"], port, "fake",
                    str(tmp_path / "b.log"))
  server.wait_ready(30)
  assert server.stop(grace_s=0.5) == -9
  server = S.Server([sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"],
                    S.free_port(), "fake", str(tmp_path / "c.log"))
  with pytest.raises(RuntimeError, match="exited with 3 before answering.*no model"):
    server.wait_ready(30)
  server.stop()
  # A child that cannot start (no such working directory) leaves no log file open.
  opened = []
  real_open = open

  def spy(*args, **kwargs):
    f = real_open(*args, **kwargs)
    opened.append(f)
    return f

  monkeypatch.setattr("builtins.open", spy)
  with pytest.raises(FileNotFoundError):
    S.Server([sys.executable, "-c", "pass"], S.free_port(), "fake", str(tmp_path / "d.log"),
             cwd=str(tmp_path / "missing"))
  assert [f.name for f in opened] == [str(tmp_path / "d.log")] and opened[0].closed


def test_a_killed_benchmark_takes_its_server_child_along(tmp_path):
  """kill -9 of the process that started a Server: the child gets SIGTERM (parent-death
  signal) and is gone within 10 s."""
  # forked from the fork server that the refused runs above use (its imports done)
  parent = forkserver.popen([sys.executable, "-c", (
      "import sys, time\n"
      "from experiments.benchmarks import serving as S\n"
      "s = S.Server([sys.executable, '-c', 'import time; time.sleep(600)'], S.free_port(), "
      f"'sleeper', {str(tmp_path / 'child.log')!r})\n"
      "print(s.proc.pid, flush=True)\n"
      "time.sleep(600)\n")], fork=True, stdout=subprocess.PIPE, text=True, cwd=REPO,
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1)))
  child = int(parent.stdout.readline())
  time.sleep(0.5)   # the child has set its parent-death signal and exec'd
  parent.kill()
  parent.wait()
  deadline = time.time() + 10
  while time.time() < deadline and _alive(child):
    time.sleep(0.1)
  assert not _alive(child), f"server child {child} outlived its killed parent"


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.mark.parametrize("draft", [[], ["--draft=random", "--speculative_tree=2:2:3",
                                         "--decode_vocab=64"]], ids=["plain", "eagle"])
def test_a_whole_run_on_a_tiny_model(tmp_path, draft):
  """The entry point end to end: closed-loop and Poisson points, results.json, plot; plain,
  and with an untrained draft head over a decode vocabulary. Two slots (batch widths 1 and
  2, two clients at most) keep the programs the engine compiles to a few. The statistics
  are tested above, the engine in tests/llm/serving."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run(
      [sys.executable, "-m", "experiments.serve_bench", "--preset=tiny", "--num_requests=4",
       "--concurrency=1,2", "--rates=50", "--prompt_lens=5,20", "--output_lens=3,9",
       "--max_slots=2", "--max_model_len=32", "--block_size=8", "--prefill_chunk=16", *draft,
       f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  results = json.load(open(tmp_path / "results.json"))
  assert summary["speedup"] == results["speedup"] > 0 and len(results["points"]) == 3
  # Every point serves the same four requests to their full lengths (random weights without
  # a tokenizer have no stop ids); the preset's vocabulary is 256 ids from 0.
  want = sum(n for _, n in S.make_requests(4, 256, [5, 20], [3, 9], 0))
  assert all(p["failed"] == 0 and p["output_tokens"] == want for p in results["points"])
  assert os.path.exists(tmp_path / "serve_bench.png")
  assert (results["draft"], results["decode_vocab"]) == (("random", 64) if draft else (None, 0))
  if draft:
    assert all(p["accept_length"] >= 1 for p in results["points"])


@pytest.mark.slow   # two engines compile (in process and the server child): 8-30 s
def test_engine_and_our_server_side_by_side(tmp_path):
  from tests.experiments.test_serve import make_checkpoint
  d = str(tmp_path / "hf")
  os.makedirs(d)
  make_checkpoint(d)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.serve_bench", f"--checkpoint=hf:{d}",
       "--targets=engine,ours_http", "--threads=1", "--num_requests=3", "--concurrency=1,2",
       "--rates=", "--prompt_lens=5,12", "--output_lens=3,6", "--max_slots=2",
       "--max_model_len=32", "--block_size=8", "--prefill_chunk=16",
       f"--workdir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = json.load(open(tmp_path / "run" / "results.json"))
  assert [(p["target"], p["concurrency"]) for p in results["points"]] == [
      ("engine", 1), ("engine", 2), ("ours_http", 1), ("ours_http", 2)]
  assert all(p["failed"] == 0 and p["output_tokens"] > 0 for p in results["points"])
  assert results["engine"]["chunk_widths"] == "16"
  server = results["servers"]["ours_http"]
  assert server["exit_code"] == 0 and "--warmup_tables=all" in server["cmd"]
  assert "--chunk_widths=16" in server["cmd"] and "programs compiled" in server["engine"]
  assert results["ratios_to_llama_cpp"] == {}
