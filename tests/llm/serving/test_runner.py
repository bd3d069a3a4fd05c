"""The engine in its background thread (`llm.serving.runner`): outputs reach the callers,
the queue is bounded, shutdown drains or cancels; and the HTTP app's answers to a full
queue (429), a closed runner (503) and bad requests, in process (FastAPI's TestClient)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from llm.config import get_config
from llm.serving.config import EngineConfig
from llm.serving.engine import Engine, SamplingParams
from llm.serving.runner import Closed, EngineRunner, QueueFull
from llm.serving.server import make_app
from llm.tokenizer import ByteTokenizer
from tests.llm.test_model import make_model

CONFIG = EngineConfig(max_slots=2, block_size=8, prefill_chunk=16, max_model_len=48,
                      num_blocks=13, batch_widths=(2,), table_widths=(6,))


@pytest.fixture(scope="module")
def tiny():
  return make_model(get_config("tiny"))[0]


def test_outputs_reach_each_caller_and_shutdown_drains(tiny):
  engine = Engine(tiny, CONFIG, ByteTokenizer())
  runner = EngineRunner(engine, max_queue=8).start()
  handles = [runner.submit(list(b"hello"), SamplingParams(max_tokens=n)) for n in (3, 5, 4)]
  outs = [list(h) for h in handles]
  assert [len(o) for o in outs] == [3, 5, 4]
  assert all(o[-1].finished and o[-1].finish_reason == "length" for o in outs)
  # The same prompt, greedy: every reply is a prefix of the longest.
  assert outs[0][-1].token_ids == outs[1][-1].token_ids[:3]
  # shutdown lets the in-flight request finish (within drain_s), then refuses new ones.
  h = runner.submit(list(b"abc"), SamplingParams(max_tokens=6))
  runner.shutdown(drain_s=60)
  assert h.result().finish_reason == "length"
  with pytest.raises(Closed, match="shutting down"):
    runner.submit([1], SamplingParams())
  assert engine.pool.num_used == 0


def test_shutdown_past_its_drain_time_aborts_and_cancel_frees(tiny):
  engine = Engine(tiny, CONFIG)
  runner = EngineRunner(engine).start()
  a = runner.submit([1, 2, 3], SamplingParams(max_tokens=40))
  next(iter(a))
  a.cancel()
  assert a.result().finish_reason == "abort"
  b = runner.submit([1, 2, 3], SamplingParams(max_tokens=40))
  runner.shutdown(drain_s=0)
  assert b.result().finish_reason in ("abort", "length")
  assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_the_queue_is_bounded_and_bad_requests_are_refused_at_once(tiny):
  runner = EngineRunner(Engine(tiny, CONFIG), max_queue=2)      # not started: nothing moves
  runner.submit([1], SamplingParams())
  runner.submit([2], SamplingParams())
  with pytest.raises(QueueFull, match="2 requests are waiting .* at most 2"):
    runner.submit([3], SamplingParams())
  with pytest.raises(ValueError, match="beyond the engine's context of 48"):
    runner.submit([3] * 40, SamplingParams(max_tokens=9))


def test_http_errors_in_openai_form(tiny):
  runner = EngineRunner(Engine(tiny, CONFIG, ByteTokenizer()), max_queue=1)   # not started
  client = TestClient(make_app(runner, ByteTokenizer(), "tiny"))
  ok = {"model": "tiny", "prompt": "hi", "max_tokens": 4}

  def error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body

  assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
  runner.submit([1], SamplingParams())                           # the queue is now full
  e = error(client.post("/v1/completions", json=ok), 429)
  assert e["code"] == "queue_full" and "at most 1" in e["message"]
  e = error(client.post("/v1/completions", json={**ok, "max_tokens": 47}), 400)
  assert e["param"] == "max_tokens" and "beyond the model's context of 48" in e["message"]
  e = error(client.post("/v1/completions", json={**ok, "model": "gpt-4"}), 404)
  assert e["code"] == "model_not_found" and "`gpt-4` does not exist" in e["message"]
  e = error(client.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                        headers={"Content-Type": "application/json"}), 400)
  assert "not valid JSON" in e["message"]
  e = error(client.post("/v1/completions", json={"model": "tiny"}), 400)
  assert e["param"] == "prompt" and "Field required" in e["message"]
  e = error(client.post("/v1/completions", json={**ok, "n": 2}), 400)
  assert e["param"] == "n" and e["code"] == "unsupported_parameter"
  e = error(client.post("/v1/completions", json={**ok, "temperature": -1}), 400)
  assert "temperature=-1.0" in e["message"]
  e = error(client.post("/v1/chat/completions", json={
      "model": "tiny", "messages": [{"role": "user", "content": "hi"}]}), 400)
  assert "has no chat template" in e["message"]
  error(client.get("/nowhere"), 404)
  runner.close()
  assert client.get("/health").status_code == 503
  e = error(client.post("/v1/completions", json=ok), 503)
  assert "shutting down" in e["message"]
