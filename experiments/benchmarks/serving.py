"""Load on the serving engine (`llm.serving`), in process through its runner: requests
arrive open-loop (Poisson at a rate) or closed-loop (N clients, each sending its next request
when the last one finished), with prompt and output lengths drawn from mixes; per request the
time to first token (TTFT), time per output token after it (TPOT) and end-to-end latency are
stamped on the engine's thread as its outputs come out.

    reqs = make_requests(n, vocab, prompt_lens=(32, 128), output_lens=(32, 128), seed=0)
    recs = run_poisson(runner, reqs, rate=4.0, seed=0)     # or run_closed(runner, reqs, 8)
    summary(recs, slo_ttft_s=1.0, slo_tpot_s=0.1)          # p50 / p99, tokens/s, goodput

Output lengths are exact: requests carry no stop ids (the usual "ignore EOS" of serving
benchmarks), so a rate's work is the same whatever the model says. Goodput (DistServe,
arXiv 2401.09670): requests per second that met both SLOs (TTFT and TPOT).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

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
                  output_lens: Sequence[int], seed: int = 0, low_id: int = 0):
  """n (prompt ids, max_tokens): lengths drawn uniformly from each mix, ids uniformly from
  [low_id, vocab_size)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p = int(rng.choice(prompt_lens))
    out.append((rng.integers(low_id, vocab_size, p).tolist(), int(rng.choice(output_lens))))
  return out


def _submit(runner, prompt, max_tokens, done: threading.Semaphore) -> Record:
  rec = Record(len(prompt), max_tokens)

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
    if out.finished:
      rec.finish_reason = out.finish_reason
      done.release()

  rec.submitted = time.perf_counter()
  runner.submit(prompt, SamplingParams(max_tokens=max_tokens), on_output=on_output)
  return rec


def run_poisson(runner, requests, rate: float, seed: int = 0) -> list[Record]:
  """Open loop: request i is submitted at the i-th arrival of a Poisson process of `rate`
  per second (all at once for rate inf); returns when all finished."""
  rng = np.random.default_rng(seed + 1)
  gaps = (np.zeros(len(requests)) if np.isinf(rate)
          else rng.exponential(1.0 / rate, len(requests)))
  done = threading.Semaphore(0)
  recs = []
  t0 = time.perf_counter()
  at = 0.0
  for (prompt, max_tokens), gap in zip(requests, gaps):
    at += gap
    wait = t0 + at - time.perf_counter()
    if wait > 0:
      time.sleep(wait)
    recs.append(_submit(runner, prompt, max_tokens, done))
  for _ in recs:
    done.acquire()
  return recs


def run_closed(runner, requests, concurrency: int) -> list[Record]:
  """Closed loop: `concurrency` clients, each submitting its next request as soon as its
  previous one finished, until all requests are done."""
  lock = threading.Lock()
  todo = list(requests)
  recs: list[Record] = []

  def client():
    while True:
      with lock:
        if not todo:
          return
        prompt, max_tokens = todo.pop(0)
      done = threading.Semaphore(0)
      rec = _submit(runner, prompt, max_tokens, done)
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
  return {
      "requests": len(recs), "failed": len(recs) - len(ok), "seconds": span,
      "output_tokens": tokens, "prompt_tokens": sum(r.prompt_len for r in ok),
      "throughput_tok_s": tokens / span, "throughput_req_s": len(ok) / span,
      "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
      "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
      "latency_p50_s": _pct([r.latency for r in ok], 50),
      "latency_p99_s": _pct([r.latency for r in ok], 99),
      "goodput_req_s": len(good) / span, "slo_attainment": len(good) / max(len(recs), 1)}
