"""Where the Python 3.11 peer environment (experiments/peers/README.md) is: the interpreter the
peer-marked tests run peer scripts with."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peer_python(variable: str) -> str:
  """$`variable` when set, else bin/python of ../peer311 or ../peer beside the checkout (the
  first that exists; ../peer311 when neither does, for the skip reason)."""
  if os.environ.get(variable):
    return os.environ[variable]
  for env in ("peer311", "peer"):
    path = os.path.join(os.path.dirname(REPO), env, "bin", "python")
    if os.path.exists(path):
      return path
  return os.path.join(os.path.dirname(REPO), "peer311", "bin", "python")
