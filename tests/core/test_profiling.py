"""core.profiling: a trace's device busy time, kernel count and top kernels, on a hand-made
GPU-shaped Perfetto trace (exact figures) and on a real XLA:CPU trace."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from core import profiling


def _write(tmp_path, events) -> str:
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  return str(tmp_path)


def _meta(pid, pname, threads):
  out = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": pname}}]
  out += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": n}}
          for tid, n in threads.items()]
  return out


def _x(pid, tid, name, ts, dur):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_gpu_streams_busy_span_and_top(tmp_path):
  """Kernels on two streams (one overlap), an "XLA Ops" line that repeats them and host
  events, none of which may count: busy is the union of the stream intervals."""
  events = (_meta(1, "/host:CPU", {10: "python"})
            + _meta(2, "/device:GPU:0", {20: "Stream #13(Compute)", 21: "Stream #14",
                                          22: "XLA Ops"})
            + [_x(1, 10, "PjitFunction(step)", 0, 1000),
               _x(2, 20, "gemm", 100, 300),        # 100-400
               _x(2, 21, "fusion.1", 350, 100),    # 350-450, overlaps the gemm by 50
               _x(2, 20, "gemm", 600, 300),        # 600-900
               _x(2, 22, "gemm", 100, 300),        # the ops line: not counted
               _x(2, 20, "fusion.2", 950, 50)])    # 950-1000
  s = profiling.summarize(_write(tmp_path, events), steps=2, top=2)
  assert s["lines"] == "/device:GPU:0 (Stream #13(Compute), Stream #14)"
  assert s["kernels"] == 4 and s["kernels_per_step"] == 2.0
  assert s["span_ms"] == pytest.approx(0.9)            # 100 .. 1000 us
  assert s["busy_ms"] == pytest.approx(0.7)            # 350 + 300 + 50 us
  assert s["busy_fraction"] == pytest.approx(0.7 / 0.9)
  assert [(t["name"], t["count"]) for t in s["top"]] == [("gemm", 2), ("fusion.1", 1)]
  assert s["top"][0]["ms"] == pytest.approx(0.6)
  assert s["top"][0]["share"] == pytest.approx(600 / 750)
  text = profiling.format_summary(s)
  assert "busy 0.70 of 0.90 ms (78%)" in text and "gemm" in text


def test_ops_line_when_no_stream_line(tmp_path):
  events = (_meta(2, "/device:GPU:0", {22: "XLA Ops", 23: "XLA Modules"})
            + [_x(2, 22, "dot", 0, 10), _x(2, 23, "jit_step", 0, 10)])
  s = profiling.summarize(_write(tmp_path, events))
  assert s["lines"] == "/device:GPU:0 (XLA Ops)" and s["kernels"] == 1


def test_a_real_cpu_trace(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((256, 256))
  f(x).block_until_ready()
  with profiling.trace(str(tmp_path / "t")):
    for _ in range(3):
      f(x).block_until_ready()
  s = profiling.summarize(str(tmp_path / "t"), steps=3)
  assert s["lines"] == "XLA:CPU threads"
  assert s["kernels"] >= 3 and 0 < s["busy_ms"] <= s["span_ms"] + 1e-9
  assert all("Threadpool" not in t["name"] for t in s["top"])


def test_no_trace_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz"):
    profiling.summarize(str(tmp_path))


def test_profiled_returns_the_result_and_the_summary(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((128, 128))
  f(x).block_until_ready()
  out, s = profiling.profiled(str(tmp_path / "t"), lambda: f(x).block_until_ready(), steps=1)
  assert float(out) == float(f(x)) and s["kernels"] >= 1 and "error" not in s


def test_profiled_keeps_the_measurement_when_no_trace_starts(tmp_path, monkeypatch):
  def broken(out_dir):
    raise RuntimeError("profiler already running")
  monkeypatch.setattr(profiling, "trace", broken)
  called = []
  out, s = profiling.profiled(str(tmp_path), lambda: called.append(1), steps=1)
  assert out is None and not called
  assert s == {"error": "the trace did not start: RuntimeError: profiler already running"}
  assert profiling.format_summary(s).startswith("no profile: the trace did not start")


def test_profiled_says_why_a_trace_cannot_be_read(tmp_path, monkeypatch):
  def unreadable(out_dir, steps=1, top=12):
    raise ValueError("no device lines")
  monkeypatch.setattr(profiling, "summarize", unreadable)
  out, s = profiling.profiled(str(tmp_path / "t"), lambda: 7, steps=1)
  assert out == 7 and s == {"error": "the trace could not be read: ValueError: no device lines"}


def test_profiled_raises_the_functions_own_error(tmp_path):
  def fails():
    raise ZeroDivisionError("in the step")
  with pytest.raises(ZeroDivisionError, match="in the step"):
    profiling.profiled(str(tmp_path / "t"), fails)
  # the profiler was stopped: a second trace starts
  out, s = profiling.profiled(str(tmp_path / "u"), lambda: 3)
  assert out == 3 and "error" not in s


class _Run:
  """What StepWindow reads of core.train.Run: the step, the state, pause()."""

  def __init__(self):
    self.step, self.state, self.pauses = 0, None, 0

  def pause(self):
    self.pauses += 1
    jax.block_until_ready(self.state)


def test_step_window_traces_only_its_steps(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  g = jax.jit(lambda x: jnp.sin(x) * 2.0)       # only before the window
  run, window = _Run(), profiling.StepWindow(str(tmp_path / "w"), 2, 5)
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  g(x).block_until_ready()
  for step in range(1, 7):
    run.step = step
    run.state = (f if 2 < step <= 5 else g)(x)
    window(run)
  window.close()
  s = window.summary()
  assert run.pauses == 2 and s["kernels"] >= 3 and s["kernels_per_step"] == s["kernels"] / 3
  assert not any("sin" in t["name"] for t in s["top"])


def test_step_window_says_why_there_is_no_profile(tmp_path):
  run, window = _Run(), profiling.StepWindow(str(tmp_path / "w"), 1, 9)
  for step in (1, 2):                            # the run ends inside the window
    run.step = step
    window(run)
  window.close()
  assert window.summary() == {"error": "the run ended before step 9, the window's end"}
  with pytest.raises(ValueError, match=r"steps \(3, 3\]; expected 0 < first < last"):
    profiling.StepWindow(str(tmp_path), 3, 3)
