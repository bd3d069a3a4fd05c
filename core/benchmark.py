"""Timing helpers for benchmark scripts: warm up, repeat, take medians."""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any, Callable

import jax


def time_steps(step: Callable[[Any], Any], state: Any, steps: int, repeats: int,
               warmup: int = 1) -> tuple[list[float], Any]:
  """Seconds per step for each repeat of `steps` calls of `state = step(state)`.

  The state is threaded through (donation-friendly); each repeat ends with a block.
  """
  for _ in range(warmup):
    state = step(state)
  jax.block_until_ready(state)
  per_step = []
  for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(steps):
      state = step(state)
    jax.block_until_ready(state)
    per_step.append((time.perf_counter() - t) / steps)
  return per_step, state


def median(xs):
  return statistics.median(xs)


def machine() -> dict[str, Any]:
  """What the numbers were measured on."""
  import os
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
          "backend": dev.platform, "device": getattr(dev, "device_kind", str(dev)),
          "num_devices": jax.device_count(), "python": platform.python_version()}
