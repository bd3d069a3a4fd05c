"""The engine in its background thread (`llm.serving.runner`): outputs reach the callers,
the queue is bounded, shutdown drains or cancels, an engine failure reaches every caller;
and the HTTP app in process (FastAPI's TestClient): completions (token ids, several
prompts streamed) and chat equal to the engine's greedy rows, and its answers to a full
queue (429), a closed runner (503), a failed engine (500 / 503), a shutdown mid-request
and bad requests (400 naming the field)."""

from __future__ import annotations

import json

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
  # The shutdown comes from inside b's first step (no race with the engine thread: b
  # cannot run its 40 tokens first), with no time to drain: b is aborted after that step.
  _failing(engine, after=10 ** 9, hook=lambda: runner.shutdown(drain_s=0, wait=False))
  steps = engine.steps
  b = runner.submit([1, 2, 3], SamplingParams(max_tokens=40))
  runner._thread.join()
  out = b.result()
  assert out.finish_reason == "abort" and len(out.token_ids) == 1
  assert engine.steps == steps + 1
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
  # A completion's logprobs=0 asks for the sampled tokens' logprobs (OpenAI: "up to
  # logprobs+1 elements"): refused as unsupported, not taken for "none" and answered with
  # logprobs null.
  e = error(client.post("/v1/completions", json={**ok, "logprobs": 0}), 400)
  assert e["param"] == "logprobs" and e["code"] == "unsupported_parameter"
  e = error(client.post("/v1/completions", json={**ok, "temperature": -1}), 400)
  assert e["param"] == "temperature" and e["message"] == "temperature=-1.0; expected >= 0"
  e = error(client.post("/v1/completions", json={**ok, "top_p": 2}), 400)
  assert e["param"] == "top_p" and e["message"] == "top_p=2.0; expected in (0, 1]"
  e = error(client.post("/v1/completions", json={**ok, "max_tokens": 0}), 400)
  assert e["param"] == "max_tokens" and e["message"] == "max_tokens=0; expected >= 1"
  e = error(client.post("/v1/completions", json={**ok, "prompt": [7] * 48}), 400)
  assert e["param"] == "prompt" and e["code"] == "context_length_exceeded"
  assert "the prompt has 48 tokens, which leaves no room in the model's context of 48" in (
      e["message"])
  e = error(client.post("/v1/completions", json={**ok, "stop": list("abcde")}), 400)
  assert e["param"] == "stop" and "expected up to 4 non-empty strings" in e["message"]
  e = error(client.post("/v1/completions", json={**ok, "stop": 5}), 400)
  assert e["param"] == "stop" and e["message"] == (
      "stop=5: expected a string or a list of strings")
  e = error(client.post("/v1/completions", json={**ok, "prompt": ""}), 400)
  assert e["param"] == "prompt" and "the prompt is empty" in e["message"]
  e = error(client.post("/v1/completions", json={**ok, "prompt": []}), 400)   # (not 200)
  assert e["param"] == "prompt" and "prompt=[]: no prompt" in e["message"]
  e = error(client.post("/v1/completions", json={**ok, "prompt": [3, 256, -1]}), 400)
  assert e["param"] == "prompt" and "prompt token ids [256, -1] outside [0, 256)" in (
      e["message"])
  # A union field: one message for the field, not one per member type (as "prompt.str").
  for bad in (5, [True, 2], ["a", [1]]):
    e = error(client.post("/v1/completions", json={**ok, "prompt": bad}), 400)
    assert e["param"] == "prompt" and e["message"].startswith(f"prompt={bad!r}: expected a "
                                                              "string, a list of strings")
  e = error(client.post("/v1/completions", json={**ok, "max_tokens": "many"}), 400)
  assert e["param"] == "max_tokens" and e["message"].endswith("(got 'many')")
  e = error(client.post("/v1/completions", json={**ok, "stream": "yes"}), 400)
  assert e["param"] == "stream" and "valid boolean" in e["message"]
  e = error(client.post("/v1/chat/completions", json={
      "model": "tiny", "messages": [{"role": "user", "content": "hi"}]}), 400)
  assert "has no chat template" in e["message"]
  error(client.get("/nowhere"), 404)
  runner.close()
  assert client.get("/health").status_code == 503
  e = error(client.post("/v1/completions", json=ok), 503)
  assert "shutting down" in e["message"]


def test_a_refusal_inside_the_engine_reaches_its_caller(tiny):
  """The engine already holds request id "x" (added directly): the runner's "x" passes the
  runner's checks, is refused on the engine thread, and its handle raises the ValueError;
  the stray request's outputs reach no one. A duplicate id among the runner's own is
  refused at once."""
  engine = Engine(tiny, CONFIG)
  engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="x")
  runner = EngineRunner(engine)
  # Submitted before the thread starts, so its add comes before the engine's first step (a
  # started thread might finish the engine's "x" first, and the id would be free again).
  h = runner.submit([3], SamplingParams(max_tokens=2), request_id="x")
  runner.start()
  with pytest.raises(ValueError, match="request id 'x' is already in use"):
    h.result()
  runner.shutdown(drain_s=60)
  assert engine.finished == 1 and runner.stats()["in_flight"] == 0
  idle = EngineRunner(Engine(tiny, CONFIG))
  idle.submit([1], SamplingParams(), request_id="a")
  with pytest.raises(ValueError, match="request id 'a' is already in use"):
    idle.submit([2], SamplingParams(), request_id="a")


def test_a_request_accepted_as_shutdown_begins_is_served(tiny):
  """A request accepted after the thread found its inbox empty, just before shutdown: the
  thread serves it (else it sees no unfinished request, stops, and the caller waits
  forever)."""
  runner = EngineRunner(Engine(tiny, CONFIG))
  drain, handles = runner._drain_inbox, []

  def drain_then_race(block):
    drain(block)
    if not handles:
      handles.append(runner.submit([1, 2], SamplingParams(max_tokens=3)))
      runner.shutdown(drain_s=60, wait=False)

  runner._drain_inbox = drain_then_race
  runner.start()._thread.join()
  assert not handles[0]._q.empty()               # (read only once the thread has put it)
  assert handles[0].result().finish_reason == "length"


def _failing(engine, after: int = 0, error=RuntimeError("boom"), hook=None):
  """engine.step raises `error` once it has run `after` steps (or calls `hook` first)."""
  step, n = engine.step, [0]

  def failing():
    n[0] += 1
    if hook is not None:
      hook()
    if n[0] > after:
      raise error
    return step()
  engine.step = failing
  return engine


def _events(resp):
  assert resp.status_code == 200, resp.text
  data = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
  assert data[-1] == "[DONE]"
  return [json.loads(d) for d in data[:-1]]


def test_an_engine_failure_ends_every_request_and_the_server_says_so(tiny):
  runner = EngineRunner(_failing(Engine(tiny, CONFIG))).start()
  h = runner.submit([1, 2], SamplingParams(max_tokens=4))
  with pytest.raises(RuntimeError, match=r"the engine failed: RuntimeError\('boom'\)"):
    h.result()
  assert runner.failed is not None and not runner.accepting
  with pytest.raises(Closed, match=r"the engine failed: RuntimeError\('boom'\)"):
    runner.submit([1], SamplingParams())
  # Over HTTP: 500 for the request that was running, then 503 and /health "failed".
  tok = ByteTokenizer()
  ok = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
  runner = EngineRunner(_failing(Engine(tiny, CONFIG, tok))).start()
  with TestClient(make_app(runner, tok, "tiny")) as client:
    resp = client.post("/v1/completions", json=ok)
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert resp.json()["error"]["message"] == "the engine failed: RuntimeError('boom')"
    assert client.get("/health").json() == {"status": "failed"}
    resp = client.post("/v1/completions", json=ok)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"
  # Streamed, two prompts: what the first step gave, then the error as an event.
  runner = EngineRunner(_failing(Engine(tiny, CONFIG, tok), after=1)).start()
  with TestClient(make_app(runner, tok, "tiny")) as client:
    events = _events(client.post("/v1/completions", json={**ok, "prompt": ["hi", "yo"],
                                                           "stream": True}))
  assert all(e["choices"][0]["index"] in (0, 1) for e in events[:-1])
  assert events[-1]["error"]["message"] == "the engine failed: RuntimeError('boom')"
  # Anything unexpected: a 500 with its message, not a traceback.
  app = make_app(EngineRunner(Engine(tiny, CONFIG, tok)), tok, "tiny")

  def broken(prompt):
    raise KeyError("vocab")
  app.state.server._prompts = broken
  resp = TestClient(app, raise_server_exceptions=False).post("/v1/completions", json=ok)
  assert resp.status_code == 500 and resp.json()["error"] == {
      "message": "internal error: KeyError: 'vocab'", "type": "server_error", "param": None,
      "code": None}
  with pytest.raises(ValueError, match="needs a tokenizer"):
    make_app(runner, None, "tiny")


def test_a_shutdown_past_its_drain_time_cancels_requests_over_http(tiny):
  tok = ByteTokenizer()
  ok = {"model": "tiny", "prompt": "hi", "max_tokens": 20, "temperature": 0}
  for stream in (False, True):
    engine = Engine(tiny, CONFIG, tok)
    runner = EngineRunner(engine)
    # After the first step the server shuts down with no time to drain.
    _failing(engine, after=10 ** 9, hook=lambda: runner.shutdown(drain_s=0, wait=False))
    runner.start()
    with TestClient(make_app(runner, tok, "tiny")) as client:
      resp = client.post("/v1/completions", json={**ok, "stream": stream})
    err = _events(resp)[-1]["error"] if stream else resp.json()["error"]
    assert (resp.status_code, err["code"]) == ((200 if stream else 503), "cancelled")
    assert err["message"] == "the request was cancelled: the server is shutting down"
    assert engine.pool.num_used == 0 and engine.steps == 1


def test_a_refused_later_prompt_cancels_the_earlier_ones(tiny):
  tok = ByteTokenizer()
  engine = Engine(tiny, CONFIG, tok)
  runner = EngineRunner(engine, max_queue=1)                     # not started yet
  with TestClient(make_app(runner, tok, "tiny")) as client:
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": [[1], [2]]})
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
    assert resp.headers["Retry-After"] == "1"
    runner.start().shutdown(drain_s=60)
  # The first prompt was queued, then cancelled before it ran a step.
  assert engine.finished == 1 and engine.steps == 0 and engine.pool.num_used == 0


class ChatBytes(ByteTokenizer):
  chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def test_completions_and_chat_equal_the_engines_greedy_rows(tiny):
  tok = ChatBytes()
  want = Engine(tiny, CONFIG).generate([[5, 6, 7], list(b"hi"), list(b"yo")],
                                       SamplingParams(max_tokens=6))
  runner = EngineRunner(Engine(tiny, CONFIG, tok)).start()
  with TestClient(make_app(runner, tok, "tiny")) as client:
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["in_flight"] == 0 and health["pages_used"] == 0
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    out = client.post("/v1/completions", json={**base, "prompt": [5, 6, 7]}).json()
    assert out["choices"][0]["text"] == tok.decode(want[0].token_ids)
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    # Two prompts streamed: the chunks of each choice add up to its text.
    events = _events(client.post("/v1/completions", json={
        **base, "prompt": ["hi", "yo"], "stream": True,
        "stream_options": {"include_usage": True}}))
    for i in (0, 1):
      chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
      assert "".join(c["text"] for c in chunks) == tok.decode(want[i + 1].token_ids)
      assert chunks[-1]["finish_reason"] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 12,
                                   "total_tokens": 16}
    # Chat: text parts joined; max_tokens defaults to the rest of the context.
    messages = [{"role": "user", "content": [{"type": "text", "text": "h"},
                                             {"type": "text", "text": "i"}]}]
    prompt = list(b"user: hi\nassistant: ")
    reply = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "temperature": 0}).json()
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == 48 - len(prompt)
    assert reply["choices"][0]["finish_reason"] == "length"
    bad = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == (
        "messages[0].content: only text parts are supported, got ['image_url']")
    bad = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "max_completion_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_completion_tokens"
    assert bad.json()["error"]["message"] == "max_completion_tokens=0; expected >= 1"
  want_chat = Engine(tiny, CONFIG).generate([prompt], SamplingParams(max_tokens=48 - len(prompt)))
  assert reply["choices"][0]["message"]["content"] == tok.decode(want_chat[0].token_ids)


def test_a_tokenizer_larger_than_the_model_is_refused_by_the_engine(tiny):
  class Wide(ByteTokenizer):
    vocab_size = 300
  runner = EngineRunner(Engine(tiny, CONFIG))
  resp = TestClient(make_app(runner, Wide(), "tiny")).post(
      "/v1/completions", json={"model": "tiny", "prompt": [280]})
  assert resp.status_code == 400
  assert "prompt token ids [280] outside [0, 256)" in resp.json()["error"]["message"]
