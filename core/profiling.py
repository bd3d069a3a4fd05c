"""A jax.profiler trace of a region, summarized without TensorBoard: how busy the device
was over the region, how many kernels it ran, and which took the time.

`trace(dir)` records a region (`jax.profiler.trace` with its Perfetto JSON export);
`summarize(dir)` reads that export back: the device lines of a GPU (its streams' kernels),
or XLA:CPU's ops on a CPU. "busy" is the union of the lines' event intervals,
"span" the region from the first event's start to the last one's end: busy / span far
under 1 says the device waited on the host (launch gaps, dispatch, input), a large kernel
count per step says the step is many small launches.

    with profiling.trace(d):
      run_three_steps()
    print(profiling.format_summary(profiling.summarize(d, steps=3)))
"""

from __future__ import annotations

import collections
import contextlib
import errno
import glob
import gzip
import json
import os
from typing import Any, Callable, Iterator

# Markers of XLA:CPU's thread pools and the executor spans that enclose the ops, not ops.
_CPU_NOISE = ("ThreadpoolListener::", "SlinkyThreadPool::", "ThunkExecutor::", "end: ")


@contextlib.contextmanager
def trace(out_dir: str) -> Iterator[str]:
  """Profiles the block into `out_dir` (its Perfetto JSON is what `summarize` reads)."""
  import jax
  os.makedirs(out_dir, exist_ok=True)
  with jax.profiler.trace(out_dir, create_perfetto_trace=True):
    yield out_dir


def _trace_file(out_dir: str) -> str:
  found = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(errno.ENOENT, "no perfetto_trace.json.gz under it (expected the "
                            "output of profiling.trace)", out_dir)
  return found[-1]


def _union_us(intervals: list[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def device_events(events: list[dict]) -> tuple[str, list[dict]]:
  """(what the lines are, their complete events): a GPU's stream lines when the trace has a
  device process (its "XLA Ops" line if no stream line is named), else the XLA:CPU
  threads' ops."""
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  dev_pids = {p for p, n in procs.items() if n.startswith("/device:")}
  if dev_pids:
    lines = {k: n for k, n in threads.items() if k[0] in dev_pids}
    for want in ("Stream", "XLA Ops"):
      chosen = {k for k, n in lines.items() if want in n}
      if chosen:
        break
    else:
      chosen = set(lines)
    what = ", ".join(sorted({procs[k[0]] for k in chosen})) + " (" + ", ".join(
        sorted({lines[k] for k in chosen})) + ")"
    return what, [e for e in complete if (e["pid"], e.get("tid")) in chosen]
  # XLA:CPU runs ops on its client / execute threads and their pools ("tf_XLAPjRtCpuClient",
  # "tf_XLAExecute", "tf_XLAEigen", by jax version); the pools' markers are dropped.
  chosen = {k for k, n in threads.items() if n.startswith("tf_XLA")}
  return "XLA:CPU threads", [
      e for e in complete if (e["pid"], e.get("tid")) in chosen
      and not e["name"].startswith(_CPU_NOISE)]


def summarize(out_dir: str, steps: int = 1, top: int = 12) -> dict[str, Any]:
  """{lines, span_ms, busy_ms, busy_fraction, kernels, kernels_per_step, top} of the
  newest trace under `out_dir`; `top` lists the names that took the most time (count,
  total ms, share of the events' summed time: events of several lines overlap, so busy time
  can be less), `steps` the region's step count (for per-step figures)."""
  with gzip.open(_trace_file(out_dir), "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  what, evs = device_events(events)
  if not evs:
    return {"lines": what, "span_ms": 0.0, "busy_ms": 0.0, "busy_fraction": None,
            "kernels": 0, "kernels_per_step": 0.0, "top": []}
  iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]
  span = max(b for _, b in iv) - min(a for a, _ in iv)
  busy = _union_us(iv)
  per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  for e in evs:
    rec = per_name[e["name"]]
    rec[0] += 1
    rec[1] += float(e["dur"])
  ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
  total = sum(v[1] for v in per_name.values()) or 1.0
  return {"lines": what, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
          "busy_fraction": busy / span if span > 0 else None, "kernels": len(evs),
          "kernels_per_step": len(evs) / max(steps, 1),
          "top": [{"name": n[:100], "count": c, "ms": d / 1e3, "share": d / total}
                  for n, (c, d) in ranked]}


def profiled(out_dir: str, fn: Callable[[], Any], steps: int = 1) -> tuple[Any, dict[str, Any]]:
  """(fn's result, the summary of its trace): runs `fn` under `trace(out_dir)`. The
  profile is a by-product of a measurement taken before it, so a profiler that cannot
  trace or a trace that cannot be read is no failure of the measurement: the summary is
  then {"error": what went wrong} (fn's own errors still raise). fn's result is None when
  the trace did not start and fn did not run."""
  try:
    tracer = trace(out_dir)
    tracer.__enter__()
  except Exception as e:  # noqa: BLE001 - no profiler here; the measurement stands
    return None, {"error": f"the trace did not start: {type(e).__name__}: {e}"}
  try:
    result = fn()
  except BaseException:
    with contextlib.suppress(Exception):
      tracer.__exit__(None, None, None)
    raise
  try:
    tracer.__exit__(None, None, None)
    return result, summarize(out_dir, steps=steps)
  except Exception as e:  # noqa: BLE001
    return result, {"error": f"the trace could not be read: {type(e).__name__}: {e}"}


class StepWindow:
  """A train-loop hook (`core.hooks.Hook(window, every=1)`) that traces the steps after
  `first` up to `last` of a run: the loop as it runs steadily, without the state's
  initialization, the first step's compilation or the final checkpoint (a trace of the
  whole run shows mostly those). The steps before the window and those in it are waited
  for at its two ends (`Run.pause`). After the run: `close()`, then `summary()`, the
  `summarize` of the window, or {"error": ...} when it could not be taken (no profiler, a
  run that ended before `last`)."""

  def __init__(self, out_dir: str, first: int, last: int):
    if not 0 < first < last:
      raise ValueError(f"StepWindow: steps ({first}, {last}]; expected 0 < first < last")
    self.out_dir, self.first, self.last = out_dir, int(first), int(last)
    self._tracing = self._done = False
    self._error: str | None = None

  def __call__(self, run) -> None:
    import jax
    if run.step == self.first and not (self._tracing or self._done or self._error):
      run.pause()
      try:
        os.makedirs(self.out_dir, exist_ok=True)
        jax.profiler.start_trace(self.out_dir, create_perfetto_trace=True)
        self._tracing = True
      except Exception as e:  # noqa: BLE001 - no profiler here; the run goes on
        self._error = f"the trace did not start: {type(e).__name__}: {e}"
    elif run.step == self.last and self._tracing:
      run.pause()
      self.close()
      self._done = True

  def close(self) -> None:
    """Stops a trace still running (a run that ended inside the window)."""
    if self._tracing:
      import jax
      self._tracing = False
      jax.profiler.stop_trace()

  def summary(self) -> dict[str, Any]:
    if self._error:
      return {"error": self._error}
    if not self._done:
      return {"error": f"the run ended before step {self.last}, the window's end"}
    try:
      return summarize(self.out_dir, steps=self.last - self.first)
    except Exception as e:  # noqa: BLE001
      return {"error": f"the trace could not be read: {type(e).__name__}: {e}"}


def format_summary(s: dict[str, Any]) -> str:
  """A few lines for a log: busy / span, kernel count, the top names (or the error of a
  profile that could not be taken)."""
  if "error" in s:
    return f"no profile: {s['error']}"
  frac = "-" if s["busy_fraction"] is None else f"{s['busy_fraction']:.0%}"
  out = [f"{s['lines']}: busy {s['busy_ms']:.2f} of {s['span_ms']:.2f} ms ({frac}), "
         f"{s['kernels']} events ({s['kernels_per_step']:.0f} per step)"]
  out += [f"  {t['share']:6.1%} {t['ms']:9.3f} ms {t['count']:6d}x  {t['name']}"
          for t in s["top"]]
  return "\n".join(out)


__all__ = ["StepWindow", "device_events", "format_summary", "profiled", "summarize", "trace"]
