"""Test setup: 8 simulated CPU devices (XLA's CPU backend at -O0: tests/cpu_env.py), set before
jax is imported anywhere; `devices(n)`.

`@pytest.mark.devices(n)` marks a test that needs at least n devices (a mesh over them, a
sharded-vs-single comparison); with fewer it skips with a reason naming both counts and the
platform, so a one-GPU machine (`JAX_PLATFORMS=cuda`) or a run with
`XLA_FLAGS=--xla_force_host_platform_device_count=1` skips those tests instead of failing.

A persistent compilation cache is shared by all processes of one pytest run (the xdist
workers and the entry points the tests start inherit its directory through
JAX_COMPILATION_CACHE_DIR): tests build fresh models and tasks, so equal programs are
compiled again and again under new Python closures, and the cache hands XLA's executable back
by the program's fingerprint instead. Executables are the same bytes either way, so no
result changes; the directory is a temporary one removed when the run ends. A run that sets
JAX_COMPILATION_CACHE_DIR itself keeps its setting (empty: no cache).

Python's cyclic garbage collector walks every tracked object on each full collection, and a
pytest process holds the imported test modules and jax's caches of every program traced so
far: late in the suite one full collection took seconds (`core.cli` collects once before an
error's last line). What survives the collection and each test file is frozen (`gc.freeze`),
so later collections walk only the objects made since; a file's own garbage is collected
before the freeze, so nothing of it is kept.
"""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "XLA_FLAGS" not in os.environ:
  from tests import cpu_env  # noqa: E402  (before jax)
  os.environ["XLA_FLAGS"] = (cpu_env.xla_flags(8) if os.environ["JAX_PLATFORMS"] == "cpu"
                             else "--xla_force_host_platform_device_count=8")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="metasys-tests-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)   # the process that made it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "float32")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.environ.get(
    "REC_DATA_DIR", os.path.join(os.path.dirname(REPO_ROOT), "shared", "data"))


def required_devices(item) -> int:
  """The largest n of the test's `devices(n)` marks (a parametrized case may add its own)."""
  need = 0
  for mark in item.iter_markers("devices"):
    if len(mark.args) != 1 or mark.kwargs or isinstance(mark.args[0], bool) or not (
        isinstance(mark.args[0], int) and mark.args[0] >= 1):
      raise pytest.UsageError(
          f"{item.nodeid}: devices mark takes one int >= 1 (the devices the test needs), "
          f"got args={mark.args!r} kwargs={mark.kwargs!r}")
    need = max(need, mark.args[0])
  return need


def pytest_collection_finish(session):
  gc.collect()
  gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  yield   # the file's module-scoped fixtures are torn down when the next test is elsewhere
  if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
    gc.collect()
    gc.freeze()


def pytest_runtest_setup(item):
  need = required_devices(item)
  if need > 1:
    have = jax.device_count()
    if have < need:
      pytest.skip(f"needs {need} devices, found {have} ({jax.default_backend()})")
