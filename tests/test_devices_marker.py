"""The `devices(n)` mark (tests/conftest.py): skips with a reason when fewer devices exist.

Runs pytest in a subprocess on a scratch test file beside a copy of the conftest, with the
simulated device count set by XLA_FLAGS, so the count differs from this process's 8.
"""

import os
import shutil
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests import forkserver

SCRATCH = '''
import jax
import pytest


@pytest.mark.devices(2)
def test_two():
  assert jax.device_count() >= 2


@pytest.mark.parametrize("n", [1, pytest.param(4, marks=pytest.mark.devices(4))])
def test_param(n):
  assert jax.device_count() >= n


def test_unmarked():
  pass
'''


def run_scratch(tmp_path, device_count: int) -> str:
  shutil.copy(os.path.join(REPO_ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
  (tmp_path / "test_scratch.py").write_text(SCRATCH)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={device_count}")
  proc = forkserver.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                         str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def test_skips_with_reason_when_too_few_devices(tmp_path):
  out = run_scratch(tmp_path, 1)
  assert "2 passed, 2 skipped" in out, out
  assert "needs 2 devices, found 1 (cpu)" in out, out
  assert "needs 4 devices, found 1 (cpu)" in out, out


def test_runs_when_enough_devices(tmp_path):
  out = run_scratch(tmp_path, 2)
  assert "3 passed, 1 skipped" in out, out
  assert "needs 4 devices, found 2 (cpu)" in out, out


def test_rejects_a_malformed_mark(tmp_path):
  shutil.copy(os.path.join(REPO_ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
  (tmp_path / "test_bad.py").write_text(
      "import pytest\n\n@pytest.mark.devices('8')\ndef test_bad():\n  pass\n")
  proc = forkserver.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "devices mark takes one int >= 1" in proc.stdout + proc.stderr
