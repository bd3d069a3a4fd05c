"""Peer scripts: other frameworks on our workloads, run in the Python 3.11 peer environment
(README.md here), importing nothing from the project. `environments()` is where the project
looks for that environment's Python by default."""

from __future__ import annotations

import os

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def environments() -> list[str]:
  """bin/python of ../peer311 and ../peer beside the checkout, in the order they are tried."""
  return [os.path.join(os.path.dirname(_REPO), env, "bin", "python") for env in ("peer311", "peer")]
