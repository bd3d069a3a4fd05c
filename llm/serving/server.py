"""An OpenAI-compatible HTTP server over an `EngineRunner` (FastAPI; run by uvicorn).

    app = make_app(runner, tokenizer, model_name="SmolLM2-135M-Instruct")
    serve(app, runner, host="127.0.0.1", port=8000)      # blocks; SIGTERM ends it cleanly

Routes: POST /v1/completions (prompt: text, token ids, or a list of either, each a choice),
POST /v1/chat/completions (messages through the checkpoint's chat template,
`llm.chat.encode_chat`; the reply ends at the template's end-of-turn token), both with
`"stream": true` as server-sent events (`data: {chunk}` lines, then `data: [DONE]`); GET
/v1/models; GET /health (200 while taking requests, 503 while shutting down or after an
engine failure). Sampling fields: max_tokens (completions default 16, as OpenAI's; chat
default: the rest of the context; max_completion_tokens too), temperature (default 1),
top_p, top_k (an extension, as vLLM's), seed, stop (a string or a list of them), ignore_eos
(an extension, as vLLM's: true generates past the end-of-text / end-of-turn tokens, to
max_tokens exactly unless a stop string ends it; for load benchmarks).

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`, never a
traceback: 400 for a malformed body or a bad field (unsupported ones such as n > 1 or
logprobs named), 404 for an unknown model or path, 429 when the runner's queue is full,
503 while shutting down, 500 for anything unexpected (its message only). A streaming
client that disconnects cancels its request.

Shutdown (`serve`): SIGTERM / SIGINT close the runner to new requests (503) and stop
accepting connections; in-flight requests, streams included, finish for up to `drain_s`
seconds, after which uvicorn cancels their handlers (the requests are aborted), and the
engine thread is joined.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from llm import chat as chat_lib
from llm.serving.engine import RequestOutput, SamplingParams
from llm.serving.runner import Closed, EngineRunner, QueueFull


class APIError(Exception):
  """An OpenAI-style error response."""

  def __init__(self, status: int, message: str, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                   param, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def _error_response(e: APIError) -> JSONResponse:
  headers = {"Retry-After": "1"} if e.status == 429 else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _Sampling(BaseModel):
  model_config = ConfigDict(extra="allow")
  model: str
  max_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop: str | list[str] | None = None
  n: int = 1
  stream: StrictBool = False
  stream_options: dict[str, Any] | None = None
  logprobs: Any = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None
  ignore_eos: StrictBool = False


class CompletionRequest(_Sampling):
  prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None


class ChatRequest(_Sampling):
  messages: list[dict[str, Any]]
  max_completion_tokens: int | None = None
  top_logprobs: int | None = None
  tools: list[Any] | None = None


def _unsupported(req: _Sampling) -> None:
  # A completion's logprobs is a count: 0 asks for the sampled tokens' logprobs (OpenAI:
  # "up to logprobs+1 elements"); a chat's is a bool.
  logprobs = (req.logprobs is not None if isinstance(req, CompletionRequest)
              else req.logprobs not in (None, False))
  checks = [("n", req.n != 1, "n > 1 (one choice per prompt)"),
            ("logprobs", logprobs, "logprobs"),
            ("presence_penalty", req.presence_penalty != 0, "presence_penalty"),
            ("frequency_penalty", req.frequency_penalty != 0, "frequency_penalty"),
            ("logit_bias", bool(req.logit_bias), "logit_bias")]
  if isinstance(req, CompletionRequest):
    checks += [("echo", req.echo, "echo"), ("suffix", req.suffix is not None, "suffix"),
               ("best_of", req.best_of not in (None, 1), "best_of > 1")]
  if isinstance(req, ChatRequest):
    checks += [("tools", bool(req.tools), "tools"),
               ("top_logprobs", req.top_logprobs is not None, "top_logprobs")]
  for param, bad, what in checks:
    if bad:
      raise APIError(400, f"{what} is not supported by this server", param=param,
                     code="unsupported_parameter")


class Server:
  """The routes' shared state: runner, tokenizer, the served model's name."""

  def __init__(self, runner: EngineRunner, tokenizer, model_name: str):
    if tokenizer is None:
      raise ValueError("the OpenAI-compatible server needs a tokenizer (text in, text out); "
                       "the checkpoint has none: pass --tokenizer")
    self.runner, self.tok, self.model_name = runner, tokenizer, model_name
    self.created = int(time.time())
    self.max_len = runner.engine.max_len
    self._chat_stop: tuple[int, ...] | None = None
    self._seed = secrets.randbits(31)

  # --- request -> engine

  def _check_model(self, name: str) -> None:
    if name != self.model_name:
      raise APIError(404, f"The model `{name}` does not exist; this server serves "
                     f"`{self.model_name}` (GET /v1/models)", param="model",
                     code="model_not_found")

  def _params(self, req: _Sampling, prompt_len: int, max_tokens: int | None,
              stop_ids, field: str = "max_tokens") -> SamplingParams:
    """`field`: the request's name for max_tokens (chat: max_completion_tokens too)."""
    left = self.max_len - prompt_len
    if left < 1:
      raise APIError(400, f"the prompt has {prompt_len} tokens, which leaves no room in the "
                     f"model's context of {self.max_len} tokens", param="prompt",
                     code="context_length_exceeded")
    if max_tokens is None:
      max_tokens = left
    if max_tokens < 1:
      raise APIError(400, f"{field}={max_tokens}; expected >= 1", param=field)
    if max_tokens > left:
      raise APIError(400, f"{field}={max_tokens} with a prompt of {prompt_len} tokens "
                     f"makes {prompt_len + max_tokens}, beyond the model's context of "
                     f"{self.max_len} tokens; ask for at most {left}", param=field,
                     code="context_length_exceeded")
    for name, value, ok, want in (("temperature", req.temperature, req.temperature >= 0, ">= 0"),
                                  ("top_p", req.top_p, 0 < req.top_p <= 1, "in (0, 1]"),
                                  ("top_k", req.top_k, req.top_k >= 0, ">= 0 (0: off)")):
      if not ok:
        raise APIError(400, f"{name}={value}; expected {want}", param=name)
    stop = req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else []
    if len(stop) > 4 or any(not s for s in stop):
      raise APIError(400, f"stop={req.stop!r}; expected up to 4 non-empty strings",
                     param="stop")
    if req.seed is None:
      self._seed = (self._seed * 1103515245 + 12345) % 2 ** 31
    seed = self._seed if req.seed is None else req.seed
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                          top_p=req.top_p, seed=seed % 2 ** 32, stop=tuple(stop),
                          stop_token_ids=tuple(stop_ids))

  def _prompts(self, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
      prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
      prompts = [prompt]
    else:
      prompts = list(prompt)
    if not prompts:
      raise APIError(400, "prompt=[]: no prompt; expected a string, token ids or a list of "
                     "either", param="prompt")
    out = []
    for p in prompts:
      ids = (self.tok.encode(p, bos=self.tok.add_bos, eos=self.tok.add_eos)
             if isinstance(p, str) else [int(t) for t in p])
      if not ids:
        raise APIError(400, "the prompt is empty (no tokens)", param="prompt")
      bad = [t for t in ids if not 0 <= t < self.tok.vocab_size]
      if bad:
        raise APIError(400, f"prompt token ids {bad[:5]} outside [0, {self.tok.vocab_size})",
                       param="prompt")
      out.append(ids)
    return out

  def chat_stop_ids(self) -> tuple[int, ...]:
    if self._chat_stop is None:
      self._chat_stop = chat_lib.stop_ids(self.tok)
    return self._chat_stop

  def _chat_prompt(self, messages) -> list[int]:
    norm = []
    for i, m in enumerate(messages):
      content = m.get("content")
      if isinstance(content, list):        # content parts: text only
        kinds = {p.get("type") for p in content if isinstance(p, dict)}
        if kinds - {"text"} or not all(isinstance(p, dict) for p in content):
          raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                         f"{sorted(map(str, kinds))}", param="messages")
        content = "".join(str(p.get("text", "")) for p in content)
      norm.append({**m, "content": content} if isinstance(m.get("content"), list) else m)
    try:
      chat_lib.check_messages(norm, "messages")
      return chat_lib.encode_chat(self.tok, norm, where="messages")
    except ValueError as e:
      raise APIError(400, str(e), param="messages") from None

  def _start(self, prompt, params):
    """Submits now, so a full queue is a 429 before any stream starts."""
    try:
      return self.runner.submit_async(prompt, params)
    except ValueError as e:
      raise APIError(400, str(e)) from None

  async def _start_all(self, requests):
    streams = []
    try:
      for prompt, params in requests:
        streams.append(self._start(prompt, params))
    except BaseException:
      for s in streams:            # a later one was refused: cancel the earlier ones
        await s.aclose()
      raise
    return streams

  # --- responses

  def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

  async def completions(self, req: CompletionRequest):
    self._check_model(req.model)
    _unsupported(req)
    prompts = self._prompts(req.prompt)
    params = [self._params(req, len(p), req.max_tokens if req.max_tokens is not None else 16,
                           () if req.ignore_eos else self.tok.stop_ids) for p in prompts]
    rid = "cmpl-" + secrets.token_hex(12)
    streams = await self._start_all(zip(prompts, params))
    base = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name}

    def choice(i, text, finish):
      return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

    if req.stream:
      return self._sse(streams, base, lambda i, out: choice(i, out.text_delta,
                                                            out.finish_reason), None,
                       _include_usage(req))
    finals = await _collect(streams)
    return {**base, "choices": [choice(i, f.text, f.finish_reason) for i, f in enumerate(finals)],
            "usage": self._usage(sum(f.prompt_tokens for f in finals),
                                 sum(len(f.token_ids) for f in finals))}

  async def chat(self, req: ChatRequest):
    self._check_model(req.model)
    _unsupported(req)
    prompt = self._chat_prompt(req.messages)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = self._params(req, len(prompt), getattr(req, field),
                          () if req.ignore_eos else self.chat_stop_ids(), field)
    rid = "chatcmpl-" + secrets.token_hex(12)
    streams = await self._start_all([(prompt, params)])
    base = {"id": rid, "created": int(time.time()), "model": self.model_name}
    if req.stream:
      base = {**base, "object": "chat.completion.chunk"}
      first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
               "finish_reason": None}
      return self._sse(streams, base, lambda i, out: {
          "index": i, "delta": {"content": out.text_delta} if out.text_delta else {},
          "logprobs": None, "finish_reason": out.finish_reason}, first, _include_usage(req))
    final = (await _collect(streams))[0]
    return {**base, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": final.text},
        "logprobs": None, "finish_reason": final.finish_reason}],
        "usage": self._usage(final.prompt_tokens, len(final.token_ids))}

  def _sse(self, streams, base, choice_of, first, include_usage) -> StreamingResponse:
    async def events():
      finals = {}
      try:
        if first is not None:
          yield _event({**base, "choices": [first]})
        async for i, out in _merge(streams):
          if out.finish_reason == "abort":
            err = APIError(503, "the request was cancelled: the server is shutting down",
                           type="server_error", code="cancelled")
            yield _event(err.body())
            break
          if out.text_delta or out.finished:
            yield _event({**base, "choices": [choice_of(i, out)]})
          if out.finished:
            finals[i] = out
        else:
          if include_usage:
            yield _event({**base, "choices": [], "usage": self._usage(
                sum(f.prompt_tokens for f in finals.values()),
                sum(len(f.token_ids) for f in finals.values()))})
        yield "data: [DONE]\n\n"
      except RuntimeError as e:          # the engine failed mid-stream
        yield _event(APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"
      finally:
        for s in streams:
          await s.aclose()
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# Fields whose type is a union: pydantic reports one error per member type.
_UNIONS = {"prompt": "a string, a list of strings, a list of token ids (integers) or a list of "
                     "lists of token ids",
           "stop": "a string or a list of strings"}


def _short(value, n: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= n else text[:n] + "..."


def _include_usage(req: _Sampling) -> bool:
  return bool(req.stream_options and req.stream_options.get("include_usage"))


def _event(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _collect(streams) -> list[RequestOutput]:
  finals = []
  try:
    for s in streams:
      last = None
      async for last in s:
        pass
      if last.finish_reason == "abort":
        raise APIError(503, "the request was cancelled: the server is shutting down",
                       type="server_error", code="cancelled")
      finals.append(last)
  except RuntimeError as e:
    raise APIError(500, str(e), type="server_error") from None
  finally:
    for s in streams:
      await s.aclose()
  return finals


async def _merge(streams):
  """(choice index, output) from several streams as they come (one stream: in order)."""
  import asyncio
  if len(streams) == 1:
    async for out in streams[0]:
      yield 0, out
    return
  q: asyncio.Queue = asyncio.Queue()

  async def pump(i, s):
    try:
      async for out in s:
        await q.put((i, out))
    except BaseException as e:          # noqa: BLE001  (handed to the consumer)
      await q.put((i, e))
    finally:
      await q.put((i, None))

  tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
  open_ = len(streams)
  try:
    while open_:
      i, item = await q.get()
      if item is None:
        open_ -= 1
      elif isinstance(item, BaseException):
        raise item
      else:
        yield i, item
  finally:
    for t in tasks:
      t.cancel()


def make_app(runner: EngineRunner, tokenizer, model_name: str) -> FastAPI:
  """The FastAPI app (module docstring)."""
  server = Server(runner, tokenizer, model_name)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    runner.shutdown(drain_s=0)      # anything still in flight is aborted; join the thread

  app = FastAPI(title="metasys-jax OpenAI-compatible server", lifespan=lifespan)
  app.state.server = server

  @app.exception_handler(APIError)
  async def api_error(request: Request, e: APIError):
    return _error_response(e)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, e: RequestValidationError):
    errs = e.errors()
    if any(err.get("type") == "json_invalid" for err in errs):
      err = errs[0]
      msg = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
      return _error_response(APIError(400, msg))
    parts, params = [], []
    for err in errs:
      loc = [str(x) for x in err.get("loc", ()) if x != "body"]
      if loc and loc[0] in _UNIONS and err.get("type") != "missing":  # one per member type
        if loc[0] in params:
          continue
        params.append(loc[0])
        parts.append(f"{loc[0]}={_short(err.get('input'))}: expected {_UNIONS[loc[0]]}")
      else:
        got = ("" if err.get("type") == "missing" or "input" not in err
               else f" (got {_short(err['input'])})")
        params.append(".".join(loc) or None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}{got}")
      if len(parts) == 3:
        break
    return _error_response(APIError(400, "; ".join(parts), param=params[0]))

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, e: StarletteHTTPException):
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    msg = (f"no route {request.method} {request.url.path}" if e.status_code == 404
           else str(e.detail))
    return _error_response(APIError(e.status_code, msg, type=kind))

  @app.exception_handler(Exception)
  async def unexpected(request: Request, e: Exception):
    return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                    type="server_error"))

  def guard(fn):
    async def run(*args):
      try:
        return await fn(*args)
      except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
      except Closed as e:
        raise APIError(503, str(e), type="server_error", code="unavailable") from None
    return run

  @app.post("/v1/completions")
  async def completions(req: CompletionRequest):
    return await guard(server.completions)(req)

  @app.post("/v1/chat/completions")
  async def chat_completions(req: ChatRequest):
    return await guard(server.chat)(req)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": server.created, "owned_by": "metasys-jax",
                                        "max_model_len": server.max_len}]}

  @app.get("/health")
  async def health():
    if not runner.accepting:
      reason = "failed" if runner.failed is not None else "shutting down"
      return JSONResponse({"status": reason}, status_code=503)
    return {"status": "ok", **runner.stats()}

  return app


def serve(app: FastAPI, runner: EngineRunner, host: str, port: int, drain_s: float = 30.0,
          on_listen=None) -> None:
  """Runs `app` with uvicorn on host:port (0: a free port) until SIGTERM / SIGINT
  (module docstring). on_listen(port) is called once the socket is listening."""
  import socket

  import uvicorn

  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  # Listening before on_listen says so: a client that connects before uvicorn's loop runs
  # waits in the backlog instead of being refused.
  sock.listen(2048)
  config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_s,
                          access_log=False)

  class _Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
      if not self.should_exit:
        print(f"stopping: {runner.stats()['in_flight']} requests in flight may finish "
              f"within {drain_s:g} s", flush=True)
      runner.close()
      super().handle_exit(sig, frame)
      # uvicorn would raise the signal again once it has drained (killing the process
      # with it); the caller returns instead, and exits 0 after its summary.
      self._captured_signals.clear()

  server = _Server(config)
  if on_listen is not None:
    on_listen(sock.getsockname()[1])
  server.run(sockets=[sock])
