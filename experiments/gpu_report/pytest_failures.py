"""A pytest plugin (`-p experiments.gpu_report.pytest_failures`) that appends each failing
test's report to the file named by $GPU_REPORT_FAILURES the moment the test fails.

pytest prints its failure section only at the end of the session; the report's pytest
parts stop the run at their time limit, which would lose every failure's reason. With this
plugin a run cut short still says why each failed test failed."""

from __future__ import annotations

import os

ENV = "GPU_REPORT_FAILURES"
SEPARATOR = "\n=== FAILED "


_WORKER = False


def pytest_configure(config) -> None:
  global _WORKER
  _WORKER = hasattr(config, "workerinput")   # an xdist worker: its controller writes


def pytest_runtest_logreport(report) -> None:
  path = os.environ.get(ENV)
  if _WORKER or not path or not report.failed:
    return
  with open(path, "a") as f:
    f.write(f"{SEPARATOR}{report.nodeid} ({report.when})\n{report.longreprtext}\n")
    f.flush()


def read_failures(path: str, max_chars: int = 4000) -> list[dict[str, str]]:
  """[{test, text}] from a file this plugin wrote (each text cut to its last `max_chars`,
  where the assertion or the exception is)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    chunks = f.read().split(SEPARATOR)[1:]
  out = []
  for chunk in chunks:
    head, _, text = chunk.partition("\n")
    out.append({"test": head.strip(), "text": text.rstrip()[-max_chars:]})
  return out
