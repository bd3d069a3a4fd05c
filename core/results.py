"""Writing an experiment's results.json: atomically (temp file + rename), numpy scalars as
numbers, anything else JSON cannot hold as its str(); once per job (process 0)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(obj: Any, path: str) -> str:
  """Writes `obj` as indented JSON to `path` through a temporary file; returns the path.
  In a multi-process run only process 0 writes."""
  import jax
  if jax.process_index() != 0:
    return path
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o))
  os.replace(tmp, path)
  return path


def write_results(workdir: str, obj: Any) -> str:
  """`<workdir>/results.json`."""
  return write_json(obj, os.path.join(workdir, "results.json"))
