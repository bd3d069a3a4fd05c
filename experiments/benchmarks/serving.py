"""Load on the serving engine (`llm.serving`), in process through its runner, or on any
OpenAI-compatible server over HTTP (`HTTPRunner`: ours, llama.cpp's): requests arrive
open-loop (Poisson at a rate) or closed-loop (N clients, each sending its next request
when the last one finished), with prompt and output lengths drawn from mixes; per request the
time to first token (TTFT), time per output token after it (TPOT) and end-to-end latency are
stamped on the engine's thread as its outputs come out (over HTTP: on the client's thread as
the events arrive).

    reqs = make_requests(n, vocab, prompt_lens=(32, 128), output_lens=(32, 128), seed=0)
    recs = run_poisson(runner, reqs, rate=4.0, seed=0)     # or run_closed(runner, reqs, 8)
    summary(recs, slo_ttft_s=1.0, slo_tpot_s=0.1)          # p50 / p99, tokens/s, goodput

    with Server([python, "-m", "experiments.serve", ...], port, "ours", log) as server:
      runner = HTTPRunner(server.url, to_text=tok.decode, body={"ignore_eos": True})
      recs = run_closed(runner, reqs, 8)                   # the same drivers over HTTP

`HTTPRunner` has the in-process runner's `submit`: each request is a streaming POST to an
OpenAI-compatible `/v1/completions` (server-sent events), stamped on its client thread as
the events arrive. An event carries a token when it has text or no finish_reason yet (our
server sends no empty deltas and puts the last token in the finishing event; llama.cpp's
sends one event per token, empty text included, then an empty finishing one); the count is
the server's usage (`stream_options.include_usage`) where it reports one, else the events,
and a request that did not produce exactly its max_tokens (finish_reason "length") counts
as failed: llama.cpp stops once it has generated max_tokens, so there the events equal the
tokens when none fails. `Server` runs a server as a child process (on chosen CPUs), waits
for GET /v1/models to answer, and stops it (SIGTERM, then SIGKILL).

Output lengths are exact for `make_requests`' requests: they carry no stop ids (the usual
"ignore EOS" of serving benchmarks), so a rate's work is the same whatever the model says. A
request given as (prompt ids, SamplingParams) with stop ids or strings ends at them instead
(at most max_tokens; the in-process runner then records the reply's ids, `Record.ids`, so
two engines' replies can be compared: experiments/spec_decode/serving.py). Goodput (DistServe,
arXiv 2401.09670): requests per second that met both SLOs (TTFT and TPOT).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any, Callable, Sequence

import numpy as np

from llm.serving.engine import SamplingParams


@dataclasses.dataclass
class Record:
  prompt_len: int
  max_tokens: int
  submitted: float = 0.0
  first: float | None = None
  last: float | None = None
  tokens: int = 0
  finish_reason: str | None = None
  error: str | None = None
  events: int = 0                   # outputs (SSE events) that carried tokens
  ids: list = dataclasses.field(default_factory=list)   # the reply's ids (in process)
  index: int = 0                    # the request's place in the list the driver was given
  exact: bool = True                # no stop ids / strings: exactly max_tokens expected

  @property
  def ttft(self) -> float:
    return self.first - self.submitted

  @property
  def tpot(self) -> float | None:
    return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None

  @property
  def latency(self) -> float:
    return self.last - self.submitted


def make_requests(n: int, vocab_size: int, prompt_lens: Sequence[int],
                  output_lens: Sequence[int], seed: int = 0, low_id: int = 0,
                  pool: Sequence[int] | None = None):
  """n (prompt ids, max_tokens): lengths drawn uniformly from each mix, ids uniformly from
  [low_id, vocab_size), or from `pool` when given."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p = int(rng.choice(prompt_lens))
    ids = (rng.integers(low_id, vocab_size, p).tolist() if pool is None
           else [int(pool[i]) for i in rng.integers(0, len(pool), p)])
    out.append((ids, int(rng.choice(output_lens))))
  return out


def word_tokens(tok, low_id: int = 0, limit: int = 4096) -> list[int]:
  """Up to `limit` ids (from low_id up) of tokens that are a space and 2+ ASCII letters and
  encode back to themselves alone: any sequence of them decodes to a text that encodes to
  the same ids (each word is a pre-token of a GPT-2 / Llama 3 style split), so a text prompt
  has the mix's length on every server with this vocabulary."""
  out = []
  for i in range(low_id, tok.vocab_size):
    text = tok.decode([i])
    if (len(text) >= 3 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
        and tok.encode(text) == [i]):
      out.append(i)
      if len(out) == limit:
        break
  return out


def _submit(runner, prompt, params, done: threading.Semaphore, index: int = 0) -> Record:
  """Submits one request (`params`: its max_tokens, or its SamplingParams) and returns its
  Record, stamped as the outputs arrive; `done` is released when it finished or failed. A
  request without stop ids or strings must produce exactly max_tokens tokens; one with
  them, at most max_tokens, ending at a stop ("stop") or at the limit ("length")."""
  if not isinstance(params, SamplingParams):
    params = SamplingParams(max_tokens=int(params))
  max_tokens = params.max_tokens
  rec = Record(len(prompt), max_tokens, index=index,
               exact=not (params.stop_token_ids or params.stop))

  def on_output(out):
    now = time.perf_counter()
    if isinstance(out, BaseException):
      rec.error = repr(out)
      done.release()
      return
    if out.new_token_ids:
      rec.first = now if rec.first is None else rec.first
      rec.last = now
      rec.tokens += len(out.new_token_ids)
      rec.events += 1
      rec.ids.extend(int(t) for t in out.new_token_ids)
    if out.finished:
      rec.finish_reason = out.finish_reason
      if getattr(out, "completion_tokens", None) is not None:
        rec.tokens = out.completion_tokens
      served_prompt = getattr(out, "prompt_tokens", None)
      if rec.error is None and rec.exact and (rec.tokens != max_tokens
                                              or out.finish_reason != "length"):
        rec.error = (f"{rec.tokens} output tokens (finish_reason {out.finish_reason!r}); "
                     f"expected exactly max_tokens={max_tokens} (finish_reason 'length')")
      elif rec.error is None and not rec.exact and (rec.tokens > max_tokens or
                                                    out.finish_reason not in ("stop", "length")):
        rec.error = (f"{rec.tokens} output tokens (finish_reason {out.finish_reason!r}); "
                     f"expected at most max_tokens={max_tokens}, ending 'stop' or 'length'")
      elif rec.error is None and served_prompt not in (None, len(prompt), len(prompt) + 1):
        rec.error = (f"the server read a prompt of {served_prompt} tokens; expected the "
                     f"{len(prompt)} it was made of (+1 for a BOS)")
      done.release()

  rec.submitted = time.perf_counter()
  runner.submit(prompt, params, on_output=on_output)
  return rec


@dataclasses.dataclass(frozen=True)
class StreamOutput:
  """One SSE event of a streamed completion, as the drivers read an engine output."""
  new_token_ids: tuple[int, ...]
  finished: bool = False
  finish_reason: str | None = None
  completion_tokens: int | None = None     # the server's usage, on the finishing output
  prompt_tokens: int | None = None


class HTTPRunner:
  """The in-process runner's `submit` over HTTP: a streaming POST /v1/completions per request
  (module docstring), on a thread of its own. `to_text` turns the prompt ids into the text
  sent (None: the ids are sent, for servers that take them); `body` adds request fields
  (sampling, ignore-EOS); greedy (temperature 0) unless `body` says otherwise."""

  def __init__(self, url: str, model: str | None = None,
               to_text: Callable[[Sequence[int]], str] | None = None,
               body: dict[str, Any] | None = None, timeout_s: float = 600.0):
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
      raise ValueError(f"HTTPRunner: url={url!r}; expected http://HOST:PORT")
    self.host, self.port = parts.hostname, parts.port or 80
    self.model, self.to_text, self.timeout_s = model, to_text, timeout_s
    self.body = {"temperature": 0.0, **(body or {})}

  def request_body(self, prompt: Sequence[int], params: SamplingParams) -> dict:
    if params.stop_token_ids:
      raise ValueError(f"HTTPRunner: stop_token_ids={params.stop_token_ids}; an OpenAI "
                       "completion request takes stop strings only (SamplingParams.stop)")
    body = {"prompt": self.to_text(prompt) if self.to_text else [int(t) for t in prompt],
            "max_tokens": int(params.max_tokens), "stream": True,
            "stream_options": {"include_usage": True}, **self.body}
    if params.stop:
      body["stop"] = list(params.stop)
    if self.model is not None:
      body["model"] = self.model
    return body

  def get(self, path: str) -> dict:
    return self._json("GET", path)

  def post(self, path: str, body: dict) -> dict:
    return self._json("POST", path, body)

  def _json(self, method: str, path: str, body: dict | None = None) -> dict:
    """The JSON answer to one request; an HTTP status other than 200 raises, naming it."""
    conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
    try:
      if body is None:
        conn.request(method, path)
      else:
        conn.request(method, path, json.dumps(body), {"Content-Type": "application/json"})
      resp = conn.getresponse()
      text = resp.read().decode("utf-8", "replace")
      if resp.status != 200:
        raise RuntimeError(f"{method} http://{self.host}:{self.port}{path}: HTTP "
                           f"{resp.status}: {text[:300]}")
      return json.loads(text)
    finally:
      conn.close()

  def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
             on_output: Callable[[Any], None] | None = None) -> None:
    body = self.request_body(prompt, params)
    threading.Thread(target=self._stream, args=(body, on_output), daemon=True).start()

  def _stream(self, body: dict, on_output) -> None:
    where = f"POST http://{self.host}:{self.port}/v1/completions"
    conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
    try:
      conn.request("POST", "/v1/completions", json.dumps(body),
                   {"Content-Type": "application/json", "Accept": "text/event-stream"})
      resp = conn.getresponse()
      if resp.status != 200:
        raise RuntimeError(f"{where}: HTTP {resp.status}: "
                           f"{resp.read().decode('utf-8', 'replace')[:300]}")
      finish, usage = None, {}
      while True:
        line = resp.readline()
        if not line:
          raise RuntimeError(f"{where}: the stream ended without data: [DONE]")
        line = line.strip()
        if not line.startswith(b"data:"):
          continue                 # blank separators, comments (": ping"), event: lines
        data = line[5:].strip()
        if data == b"[DONE]":
          break
        event = json.loads(data)
        if "error" in event:
          raise RuntimeError(f"{where}: error event {event['error']}")
        if event.get("usage"):
          usage = event["usage"]
        for choice in event.get("choices") or ():
          reason = choice.get("finish_reason")
          if choice.get("text") or reason is None:
            on_output(StreamOutput((0,)))
          finish = reason or finish
      on_output(StreamOutput((), True, finish, usage.get("completion_tokens"),
                             usage.get("prompt_tokens")))
    except BaseException as e:          # noqa: BLE001  (handed to the record)
      on_output(RuntimeError(f"{where}: {type(e).__name__}: {e}"))
    finally:
      conn.close()


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


# A server child's first step: on Linux it asks for SIGTERM when the benchmark's process
# dies (PR_SET_PDEATHSIG, kept across exec), so no server outlives a killed run; then its CPUs,
# then the server's own command in place of this one.
_CHILD = ("import ctypes, os, signal, sys\n"
          "if sys.platform.startswith('linux'):\n"
          "  ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, int(signal.SIGTERM))\n"
          "  if os.getppid() != {parent}:\n"
          "    sys.exit('serve_bench ended before its server started')\n"
          "{pin}os.execvp(sys.argv[1], sys.argv[1:])\n")


class Server:
  """A server child process: started with `cmd` (on `cpus` when given; SIGTERM when this
  process dies, `_CHILD`), its output to
  `log`; `wait_ready` polls GET /v1/models until it answers (or the child exits), `stop`
  sends SIGTERM and, after `grace_s`, SIGKILL. A context manager (stops on any exit)."""

  def __init__(self, cmd: Sequence[str], port: int, name: str, log: str,
               env: dict[str, str] | None = None, cpus: Sequence[int] | None = None,
               host: str = "127.0.0.1", cwd: str | None = None):
    self.cmd, self.name, self.log, self.url = list(cmd), name, log, f"http://{host}:{port}"
    self.runner = HTTPRunner(self.url, timeout_s=10)
    pin = f"os.sched_setaffinity(0, {sorted(set(cpus))})\n" if cpus else ""
    self._log = open(log, "w")
    try:
      self.proc = subprocess.Popen(
          [sys.executable, "-c", _CHILD.format(parent=os.getpid(), pin=pin), *self.cmd],
          stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    except BaseException:   # no child to stop: the log is closed here
      self._log.close()
      raise

  def wait_ready(self, timeout_s: float) -> dict:
    """GET /v1/models once it answers; raises if the child exits or `timeout_s` passes."""
    t0 = time.time()
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"{self.name} server ({' '.join(self.cmd)}) exited with "
                           f"{self.proc.returncode} before answering; its log {self.log} "
                           f"ends: {self.tail()}")
      try:
        return self.runner.get("/v1/models")
      except (OSError, RuntimeError, http.client.HTTPException):
        pass
      if time.time() - t0 > timeout_s:
        raise RuntimeError(f"{self.name} server ({' '.join(self.cmd)}): no answer on "
                           f"{self.url}/v1/models within {timeout_s:g} s; log {self.log}")
      time.sleep(0.25)

  def tail(self, chars: int = 2000) -> str:
    self._log.flush()
    with open(self.log, errors="replace") as f:
      return f.read()[-chars:]

  def stop(self, grace_s: float = 20.0) -> int | None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(grace_s)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()
    return self.proc.returncode

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def run_poisson(runner, requests, rate: float, seed: int = 0) -> list[Record]:
  """Open loop: request i is submitted at the i-th arrival of a Poisson process of `rate`
  per second (all at once for rate inf); returns when all finished. `requests`: (prompt
  ids, max_tokens or SamplingParams) pairs."""
  rng = np.random.default_rng(seed + 1)
  gaps = (np.zeros(len(requests)) if np.isinf(rate)
          else rng.exponential(1.0 / rate, len(requests)))
  done = threading.Semaphore(0)
  recs = []
  t0 = time.perf_counter()
  at = 0.0
  for i, ((prompt, params), gap) in enumerate(zip(requests, gaps)):
    at += gap
    wait = t0 + at - time.perf_counter()
    if wait > 0:
      time.sleep(wait)
    recs.append(_submit(runner, prompt, params, done, i))
  for _ in recs:
    done.acquire()
  return recs


def run_closed(runner, requests, concurrency: int) -> list[Record]:
  """Closed loop: `concurrency` clients, each submitting its next request as soon as its
  previous one finished, until all requests are done."""
  lock = threading.Lock()
  todo = list(enumerate(requests))
  recs: list[Record] = []

  def client():
    while True:
      with lock:
        if not todo:
          return
        i, (prompt, params) = todo.pop(0)
      done = threading.Semaphore(0)
      rec = _submit(runner, prompt, params, done, i)
      with lock:
        recs.append(rec)
      done.acquire()

  threads = [threading.Thread(target=client) for _ in range(concurrency)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return recs


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def summary(recs: Sequence[Record], slo_ttft_s: float, slo_tpot_s: float) -> dict:
  """Throughput, TTFT / TPOT / latency p50 and p99 (seconds), goodput and SLO attainment."""
  ok = [r for r in recs if r.error is None and r.first is not None]
  start = min(r.submitted for r in recs)
  end = max(r.last for r in ok) if ok else start
  span = max(end - start, 1e-9)
  ttft = [r.ttft for r in ok]
  tpot = [r.tpot for r in ok if r.tpot is not None]
  good = [r for r in ok if r.ttft <= slo_ttft_s and (r.tpot is None or r.tpot <= slo_tpot_s)]
  tokens = sum(r.tokens for r in ok)
  errors = sorted({r.error for r in recs if r.error is not None})
  return {
      "requests": len(recs), "failed": len(recs) - len(ok), "seconds": span,
      "output_tokens": tokens, "prompt_tokens": sum(r.prompt_len for r in ok),
      "throughput_tok_s": tokens / span, "throughput_req_s": len(ok) / span,
      "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
      "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
      "latency_p50_s": _pct([r.latency for r in ok], 50),
      "latency_p99_s": _pct([r.latency for r in ok], 99),
      "goodput_req_s": len(good) / span, "slo_attainment": len(good) / max(len(recs), 1),
      "events_per_token": sum(r.events for r in ok) / max(tokens, 1),
      "errors": errors[:3]}
