"""Timing helpers for benchmark scripts: warm up, repeat, take medians; the device's copy
bandwidth and its dense peak FLOP/s (the ceilings figures are compared with); `CompileClock`,
the compile time and XLA compiles inside a block (a timed section that compiled measured
the compiler too)."""

from __future__ import annotations

import os
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


def time_interleaved(runs: dict[str, tuple[Callable[[Any], Any], Any]], steps: int,
                     repeats: int, warmup: int = 1
                     ) -> tuple[dict[str, list[float]], dict[str, Any]]:
  """`time_steps` of several (step, state) pairs by name, their timed repeats taking turns
  (A B C A B C ...) after `warmup` untimed calls of each: a change in the machine's speed
  during the measurement reaches every step alike, so the ratio of two medians compares
  the steps, not two stretches of time. Returns ({name: seconds per step of each repeat},
  {name: its final state})."""
  states = {}
  for name, (step, state) in runs.items():
    for _ in range(warmup):
      state = step(state)
    states[name] = jax.block_until_ready(state)
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(repeats):
    for name, (step, _) in runs.items():
      t, states[name] = time_steps(step, states[name], steps, 1, warmup=0)
      times[name] += t
  return times, states


def pin_cpus(n: int, flag: str = "--threads") -> list[int] | None:
  """Pins this process, and the processes it starts later, to the first `n` of the CPUs it
  may run on, so that ours and a peer given `n` threads compete for the same cores (XLA
  sizes its CPU thread pool from the affinity when its backend starts: call this before the
  first jax computation). Returns those CPUs (None where the OS has no affinity call); `n`
  beyond them is refused naming `flag`."""
  if not hasattr(os, "sched_setaffinity"):
    return None
  cpus = sorted(os.sched_getaffinity(0))
  if not 1 <= n <= len(cpus):
    from core import errors
    raise errors.expected(f"{flag}={n}", f"{len(cpus)} CPUs available to this process",
                          f"1 to {len(cpus)}")
  os.sched_setaffinity(0, cpus[:n])
  return cpus[:n]


def median(xs):
  return statistics.median(xs)


def time_call(fn: Callable[[], Any], repeats: int, warmup: int = 2, steps: int = 1) -> float:
  """Median seconds of one call of `fn()` (arguments closed over are not donated), over
  `repeats` repeats of `steps` calls each, after `warmup` untimed calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(steps):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / steps)
  return median(times)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10, steps: int = 10) -> float:
  """Device memory bandwidth in bytes/s: a jitted x + 1 over `nbytes` of float32, counting
  the read and the write of every element. The median over `repeats` of `steps` calls
  queued back to back (one wait per repeat: the host's per-call sync stays out of it),
  after warm-up calls that also bring an idle GPU's clocks up (an H200 idles at 345 MHz:
  with one warm-up call the same 2 GiB copy read 2.6 to 3.3 TB/s in three processes)."""
  import jax.numpy as jnp
  x = jnp.zeros((max(nbytes // 4, 1),), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)      # one read and one write per element, not elided
  return 2 * x.nbytes / time_call(lambda: copy(x), repeats, warmup=2 * steps, steps=steps)


# Dense (no sparsity) tensor-core peak FLOP/s by device kind, per compute dtype; float32 is
# the TF32 rate XLA uses for fp32 matmuls on these GPUs. Matched by substring, first wins, so
# a name that holds another ("H200 NVL" / "H200", "L40" / "L4") comes before it.
PEAK_FLOPS = (
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 378e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 418e12}),
    ("H100", {"bfloat16": 989e12, "float32": 494e12}),       # SXM
    ("H200 NVL", {"bfloat16": 835e12, "float32": 418e12}),   # the PCIe card, H100 NVL's rates
    ("GH200", {"bfloat16": 989e12, "float32": 494e12}),
    ("H200", {"bfloat16": 989e12, "float32": 494e12}),       # SXM
    ("B200", {"bfloat16": 2250e12, "float32": 1100e12}),
    ("A100", {"bfloat16": 312e12, "float32": 156e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 183e12}),
    ("L40", {"bfloat16": 181e12, "float32": 90.5e12}),
    ("L4", {"bfloat16": 121e12, "float32": 60e12}),
)


def peak_flops(device_kind: str, dtype: str) -> float | None:
  """Dense peak FLOP/s of one device of this kind for `dtype` compute; None if unknown."""
  for name, peaks in PEAK_FLOPS:
    if name.lower() in device_kind.lower():
      return peaks.get(dtype)
  return None


def is_out_of_memory(error: BaseException | str) -> bool:
  """Whether an exception (or its text) is the device running out of memory: XLA's
  RESOURCE_EXHAUSTED, the allocator's "Out of memory" / "out of memory"."""
  text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
  low = text.lower()
  return "resource_exhausted" in low or "out of memory" in low or "oom when" in low


def machine() -> dict[str, Any]:
  """What the numbers were measured on (XLA_FLAGS too: they change XLA's code, e.g. which
  routines XLA:CPU's products run through)."""
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
          "num_devices": jax.device_count(), "python": platform.python_version(),
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


# jax.monitoring events whose durations count as compile time: tracing, lowering to MLIR,
# and XLA's backend compile (Pallas / Mosaic GPU kernels compile inside the last).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration", BACKEND_COMPILE_EVENT)


class CompileClock:
  """Inside `with CompileClock() as clock:` (this process, every thread): `seconds`, the
  compile events' durations summed, and `backend_compiles`, how many programs XLA
  compiled (a jax.monitoring listener; a persistent-cache hit compiles nothing)."""

  def __init__(self):
    self.seconds = 0.0
    self.backend_compiles = 0

  def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
    del kwargs
    if event in COMPILE_EVENTS:
      self.seconds += duration_secs
      self.backend_compiles += event == BACKEND_COMPILE_EVENT

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)
