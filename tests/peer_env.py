"""Where the Python 3.11 peer environment (experiments/peers/README.md) is: the interpreter the
peer-marked tests run peer scripts with."""

from __future__ import annotations

import os

from experiments import peers


def peer_python(variable: str) -> str:
  """$`variable` when set, else bin/python of ../peer311 or ../peer beside the checkout (the
  first that exists; ../peer311 when neither does, for the skip reason)."""
  if os.environ.get(variable):
    return os.environ[variable]
  tried = peers.environments()
  return next((path for path in tried if os.path.exists(path)), tried[0])
