"""An experiment's results: results.json written atomically (temp file + rename), numpy
and jax scalars as numbers, their arrays as nested lists, anything else JSON cannot hold as
its str(), once per job (process 0); the one-line JSON summary printed last (`finish` does
both). Both are strict JSON: a non-finite float (a diverged loss, an AUC without positives)
is the string "NaN", "Infinity" or "-Infinity", which every JSON reader takes (the bare
tokens Python writes are refused by jq, JavaScript and most other parsers)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _plain(o: Any) -> Any:
  if hasattr(o, "tolist") and hasattr(o, "shape"):   # numpy / jax arrays and scalars
    # every value (an array's str() elides the middle of a large one)
    return _with_json_keys(o.tolist())
  return _with_json_keys(o.item()) if hasattr(o, "item") else str(o)


def _json_key(k: Any) -> Any:
  """A dict key JSON can hold: numpy / jax scalars as their number, other non-JSON keys (a
  tuple, a path) as their str(); json.dump refuses them whole, losing the file."""
  if k is None or isinstance(k, (str, int, float, bool)):
    return k
  if hasattr(k, "item") and getattr(k, "shape", None) == ():
    return _json_key(k.item())
  return str(k)


def _with_json_keys(o: Any, seen: frozenset = frozenset()) -> Any:
  """`o` with every dict's keys made `_json_key`s (json.dump refuses the others whole); a
  container met again inside itself is left as it is, for json's circular-reference error;
  a non-finite float is its string ("NaN", "Infinity", "-Infinity")."""
  if isinstance(o, float) and not math.isfinite(o):
    return _NON_FINITE[repr(float(o))]
  if not isinstance(o, (dict, list, tuple)) or id(o) in seen:
    return o
  seen = seen | {id(o)}
  if isinstance(o, dict):
    out = {_json_key(k): _with_json_keys(v, seen) for k, v in o.items()}
    if len(out) != len(o):
      clash = sorted(map(repr, o))[:6]
      raise ValueError(f"dict keys {clash} give the same JSON key; expected distinct keys")
    return out
  return [_with_json_keys(v, seen) for v in o]


def write_json(obj: Any, path: str) -> str:
  """Writes `obj` as indented JSON to `path` through a temporary file; returns the path.
  In a multi-process run only process 0 writes."""
  import jax
  if jax.process_index() != 0:
    return path
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(_with_json_keys(obj), f, indent=2, default=_plain, allow_nan=False)
      f.flush()
      os.fsync(f.fileno())   # the rename must not outlive the bytes after a crash
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):   # a value json could not write: no half file left behind
      os.remove(tmp)
  return path


def write_results(workdir: str, obj: Any) -> str:
  """`<workdir>/results.json`."""
  return write_json(obj, os.path.join(workdir, "results.json"))


def print_summary(summary: Any) -> None:
  """Prints `summary` as one JSON line (numpy scalars as numbers, arrays as lists, anything
  else JSON cannot hold as its str()): an experiment's last stdout line, which scripts and
  CI read."""
  print(json.dumps(_with_json_keys(summary), default=_plain, allow_nan=False), flush=True)


def finish(workdir: str, results: Any, summary: Any) -> str:
  """How an experiment ends: `<workdir>/results.json` written (`write_results`), then the
  one-line JSON `summary` printed last (`print_summary`). Returns the file's path."""
  path = write_results(workdir, results)
  print_summary(summary)
  return path
