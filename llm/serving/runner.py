"""The engine in one background thread, for callers on other threads or an asyncio loop.

    runner = EngineRunner(engine, max_queue=64).start()
    handle = runner.submit(prompt_ids, params)          # QueueFull past the bound
    for out in handle: ...                              # RequestOutputs, on this thread
    stream = runner.submit_async(prompt_ids, params)    # on an asyncio loop
    async for out in stream: ...                        # stream.aclose() cancels
    runner.shutdown(drain_s=30)                         # finish in-flight, then stop

Only the runner's thread touches the engine: submissions and cancellations are handed over
through a queue and applied between steps, and outputs go back through each request's own
queue (a `queue.Queue`, or an asyncio queue fed with `call_soon_threadsafe`). The queue is
bounded: at most `max_queue` requests may wait for a slot (submitted, not yet admitted);
one more raises `QueueFull` (a server answers 429). `close` stops taking requests
(`Closed`); `shutdown` also lets the in-flight ones finish for up to `drain_s` seconds,
aborts the rest (finish_reason "abort") and ends the thread. An exception inside a step ends every
in-flight request (its handle raises RuntimeError "the engine failed: ...") and the runner
refuses new ones (`failed`; `Closed`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Sequence

from llm.serving.engine import Engine, RequestOutput, SamplingParams


class QueueFull(RuntimeError):
  """The runner's queue holds `max_queue` waiting requests already."""


class Closed(RuntimeError):
  """The runner is shutting down (or failed) and takes no new requests."""


@dataclasses.dataclass
class _Pending:
  request_id: str
  prompt: list[int]
  params: SamplingParams
  deliver: Callable[[RequestOutput | BaseException], None]
  submitted: float


class Handle:
  """One submitted request: iterate it for its outputs (blocking; ends after the last)."""

  def __init__(self, runner: EngineRunner, request_id: str):
    self.runner, self.request_id = runner, request_id
    self._q: queue.Queue = queue.Queue()

  def _deliver(self, item) -> None:
    self._q.put(item)

  def __iter__(self):
    while True:
      item = self._q.get()
      if isinstance(item, BaseException):
        raise item
      yield item
      if item.finished:
        return

  def result(self) -> RequestOutput:
    """The final output (blocking)."""
    last = None
    for last in self:
      pass
    return last

  def cancel(self) -> None:
    self.runner.cancel(self.request_id)


class AsyncHandle:
  """One submitted request on an asyncio loop: `async for` its outputs; `aclose()` cancels
  it unless it finished (a client that went away)."""

  def __init__(self, runner: EngineRunner, q):
    self.runner, self.request_id, self._q, self.done = runner, "", q, False

  def __aiter__(self):
    return self._outputs()

  async def _outputs(self):
    while not self.done:
      item = await self._q.get()
      if isinstance(item, BaseException):
        self.done = True
        raise item
      self.done = item.finished
      yield item

  async def aclose(self) -> None:
    if not self.done:
      self.done = True
      self.runner.cancel(self.request_id)


class EngineRunner:
  """Runs `engine.step()` in a background thread (module docstring)."""

  def __init__(self, engine: Engine, max_queue: int = 64, idle_wait_s: float = 0.05):
    self.engine = engine
    self.max_queue = max_queue
    self.idle_wait_s = idle_wait_s
    self._inbox: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._inbox_adds = 0           # submitted, not yet handed to the engine
    self._live: dict[str, _Pending] = {}
    self._ids = itertools.count()
    self._closed = False                 # no new requests
    self._drain_deadline: float | None = None   # set by shutdown: stop by then
    self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
    self.failed: BaseException | None = None

  def start(self) -> EngineRunner:
    self._thread.start()
    return self

  # --- callers' side (any thread)

  @property
  def accepting(self) -> bool:
    return not self._closed and self.failed is None

  def _submit(self, prompt, params, deliver, request_id=None) -> str:
    prompt = [int(t) for t in prompt]
    self.engine.check_request(prompt, params)      # pure: safe off the engine thread
    with self._lock:
      if self.failed is not None:
        raise Closed(f"the engine failed: {self.failed!r}")
      if self._closed:
        raise Closed("the server is shutting down")
      waiting = self._inbox_adds + self.engine.num_waiting
      if waiting >= self.max_queue:
        raise QueueFull(f"{waiting} requests are waiting for the engine (the queue holds at "
                        f"most {self.max_queue}); retry later")
      rid = request_id or f"req-{next(self._ids)}"
      if rid in self._live:
        raise ValueError(f"request id {rid!r} is already in use")
      self._inbox_adds += 1
      pending = _Pending(rid, prompt, params, deliver, time.perf_counter())
      self._live[rid] = pending
      # Queued under the lock: once `close` returns, every accepted request is in the inbox
      # ahead of shutdown's wake-up, so the thread adds it before it may stop.
      self._inbox.put(("add", pending))
    return rid

  def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
             request_id: str | None = None,
             on_output: Callable[[RequestOutput | BaseException], None] | None = None
             ) -> Handle:
    """Queues a request; its outputs come through the returned Handle, or, with
    `on_output`, are handed to it on the engine's thread as they come (a benchmark's
    timestamps). Raises ValueError (a bad request), QueueFull or Closed."""
    handle = Handle(self, "")
    handle.request_id = self._submit(prompt, params, on_output or handle._deliver, request_id)
    return handle

  def submit_async(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                   request_id: str | None = None) -> AsyncHandle:
    """Queues a request now (call it on the running asyncio loop); its outputs come
    through the returned AsyncHandle. Raises as `submit` does."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    handle = AsyncHandle(self, q)
    handle.request_id = self._submit(
        prompt, params, lambda item: loop.call_soon_threadsafe(q.put_nowait, item), request_id)
    return handle

  def cancel(self, request_id: str) -> None:
    self._inbox.put(("cancel", request_id))

  def stats(self) -> dict:
    with self._lock:
      return {"in_flight": len(self._live),
              "accepting": self.accepting, **self.engine.stats()}

  def close(self) -> None:
    """Stops taking requests (they raise Closed); in-flight ones go on."""
    with self._lock:
      self._closed = True

  def shutdown(self, drain_s: float = 30.0, wait: bool = True) -> None:
    """Stops taking requests; in-flight ones finish for up to drain_s seconds, the rest are
    aborted; then the thread ends (joined when `wait`)."""
    self.close()
    self._drain_deadline = time.perf_counter() + drain_s
    self._inbox.put(("wake", None))
    if wait and self._thread.is_alive():
      self._thread.join()

  # --- the engine thread

  def _deliver(self, out: RequestOutput) -> None:
    pending = self._live.get(out.request_id)
    if pending is None:
      return
    if out.finished:
      with self._lock:
        self._live.pop(out.request_id, None)
    pending.deliver(out)

  def _apply(self, kind, item) -> None:
    eng = self.engine
    if kind == "add":
      with self._lock:
        self._inbox_adds -= 1
      try:
        eng.add_request(item.prompt, item.params, item.request_id)
      except ValueError as e:
        with self._lock:
          self._live.pop(item.request_id, None)
        item.deliver(e)
    elif kind == "cancel":
      out = eng.abort(item)
      if out is not None:
        self._deliver(out)

  def _drain_inbox(self, block: bool) -> None:
    try:
      item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      self._apply(*item)
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _loop(self) -> None:
    eng = self.engine
    while True:
      self._drain_inbox(block=not eng.has_unfinished())
      deadline = self._drain_deadline
      if deadline is not None and ((not eng.has_unfinished() and not self._inbox_adds)
                                   or time.perf_counter() > deadline):
        self._drain_inbox(block=False)      # accepted before `close`: added, then aborted
        for rid in list(eng.requests):
          out = eng.abort(rid)
          if out is not None:
            self._deliver(out)
        return
      if not eng.has_unfinished():
        continue
      try:
        outs = eng.step()
      except BaseException as e:      # noqa: BLE001  (every request hears of it)
        self._fail(e)
        return
      for out in outs:
        self._deliver(out)

  def _fail(self, e: BaseException) -> None:
    with self._lock:
      self.failed = e
      live, self._live = list(self._live.values()), {}
    for pending in live:
      pending.deliver(RuntimeError(f"the engine failed: {e!r}"))
