"""core.benchmark: dense peak FLOP/s by device kind (NVIDIA's datasheets, sparsity halved)."""

from __future__ import annotations

import pytest

from core import benchmark


@pytest.mark.parametrize("kind,dtype,want", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),      # SXM: 989.4 TFLOP/s dense
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA GH200 480GB", "float32", 494e12),
    # names holding a shorter name are matched before it
    ("NVIDIA H200 NVL", "bfloat16", 835e12),            # 1671 with sparsity
    ("NVIDIA L40", "bfloat16", 181e12),                 # not an L4's 121
    ("NVIDIA L40S", "bfloat16", 362e12),
    ("NVIDIA L4", "float32", 60e12),
    ("cpu", "bfloat16", None),
])
def test_peak_flops_by_device_kind(kind, dtype, want):
  assert benchmark.peak_flops(kind, dtype) == want


def test_no_table_name_is_shadowed_by_an_earlier_one():
  names = [name for name, _ in benchmark.PEAK_FLOPS]
  for i, name in enumerate(names):
    assert not any(earlier.lower() in name.lower() for earlier in names[:i]), name


def test_time_interleaved_takes_turns_and_threads_each_state(monkeypatch):
  """On a fake clock that each call advances by its step's cost: after one warmup call each,
  the repeats alternate A B A B ..., each of `steps` calls of its own state."""
  clock, order = [0.0], []
  monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])

  def step(name, cost):
    def fn(state):
      order.append(name)
      clock[0] += cost
      return state + 1
    return fn

  times, states = benchmark.time_interleaved({"a": (step("a", 1.0), 0),
                                              "b": (step("b", 3.0), 100)}, steps=2, repeats=3)
  assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
  assert times == {"a": [1.0] * 3, "b": [3.0] * 3}     # seconds per step of each repeat
  assert states == {"a": 7, "b": 107}


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"),
                    reason="no CPU affinity call on this OS")
def test_pin_cpus_pins_this_process_and_its_children_and_refuses_too_many():
  # In a child process: pinning this one would narrow the rest of the test session.
  import os
  import subprocess
  import sys
  from tests.experiments.entry import REPO
  code = ("import os, subprocess, sys\n"
          "from core import benchmark, errors\n"
          "n = len(os.sched_getaffinity(0))\n"
          "try:\n"
          "  benchmark.pin_cpus(n + 1)\n"
          "except errors.UserError as e:\n"
          "  print(e)\n"
          "got = benchmark.pin_cpus(1)\n"
          "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted("
          "os.sched_getaffinity(0)))'], capture_output=True, text=True).stdout.strip()\n"
          "print(n, got, sorted(os.sched_getaffinity(0)), child)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr
  refusal, last = out.stdout.strip().splitlines()
  n = len(os.sched_getaffinity(0))
  first = sorted(os.sched_getaffinity(0))[0]
  assert refusal == (f"--threads={n + 1}: {n} CPUs available to this process; expected 1 "
                     f"to {n}")
  assert last == f"{n} [{first}] [{first}] [{first}]"
