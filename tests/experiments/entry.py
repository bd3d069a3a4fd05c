"""Running an entry point as a user would: `python -m experiments.<name> --flags` in a fresh
process on one CPU device, from the repository root."""

from __future__ import annotations

import glob
import json
import os
import sys

from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("REC_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
# Entry points: flat modules (experiments/<name>.py) and study packages whose __main__.py is
# the entry point (experiments/<name>/__main__.py, run as `python -m experiments.<name>`).
ENTRY_POINTS = sorted(
    [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "experiments", "*.py"))
     if not p.endswith("__init__.py")]
    + [os.path.basename(os.path.dirname(p))
       for p in glob.glob(os.path.join(REPO, "experiments", "*", "__main__.py"))])
# The module that defines each entry point's flags (`define_flags()`).
MODULES = [f"experiments.{n}" if os.path.exists(os.path.join(REPO, "experiments", n + ".py"))
           else f"experiments.{n}.__main__" for n in ENTRY_POINTS]


def run_entry(module: str, args, timeout: int = 600):
  """Runs `python -m module *args`; asserts it exits 0 and returns (stdout, the JSON of its
  last stdout line). One CPU device (tests/cpu_env.py)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


def run_refused(module: str, args, timeout: int = 120):
  """Runs `python -m module *args` as `run_entry` does, expecting a refusal: asserts a
  nonzero exit and returns the CompletedProcess (its last stderr line is the error)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode != 0, out.stdout[-3000:]
  return out
