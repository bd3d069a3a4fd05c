"""The environment of the CPU processes the tests run: N simulated devices and XLA's CPU
backend at -O0.

The tests compile hundreds of small distinct programs and run each only a few times, so the
backend's compile (LLVM at -O3 by default) is most of the suite's time; -O0 takes about a
quarter off the suite's CPU time. Results stay IEEE arithmetic at either level (no fast-math),
so equalities between programs compiled here hold as at -O3. Benchmarks and entry points run
outside the tests keep XLA's default.
"""

from __future__ import annotations

import os

OPT_FLAG = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a CPU process of the tests with `devices` simulated devices."""
  return f"--xla_force_host_platform_device_count={devices} {OPT_FLAG}"


def python_path(repo: str) -> str:
  """PYTHONPATH for a subprocess that imports the project from `repo`: the repository
  first, then whatever PYTHONPATH this process has (packages installed with --target, as on
  a GPU machine whose missing wheels are carried, stay importable)."""
  rest = os.environ.get("PYTHONPATH", "")
  return repo + (os.pathsep + rest if rest else "")


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
  """os.environ for a subprocess on the CPU with `devices` simulated devices."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", **extra)
