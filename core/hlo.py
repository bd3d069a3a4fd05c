"""What a compiled program communicates, read from its HLO text.

`collective_bytes(compiled.as_text())` sums, per collective kind and the mesh axes it runs
over, the bytes of each collective's result on one device (the program is the same on
every device of an SPMD run): an all-to-all's result is what the device receives (its own
chunk included), an all-gather's the gathered array, a reduce-scatter's its shard. Mesh
axes come from the replica groups as XLA prints them for a jax mesh
(`replica_groups=mesh['data'=2,'model'=4] {'model'}`); groups printed another way are keyed
by their text. The count checks communication models against what XLA emits, e.g. the
embedding collection's all-to-all volumes (experiments/dmt). Synchronous collectives only (what XLA:CPU emits); asynchronous
start / done pairs (GPU) are not matched.
"""

from __future__ import annotations

import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_MESH_AXES = re.compile(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}")
_GROUPS = re.compile(r"replica_groups=(\{[^=]*?\}\}|\[[^\s,]*\][^\s,]*)")


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in `text` (a result type, possibly a tuple)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in DTYPE_BYTES:
      raise ValueError(f"collective_bytes: unknown element type {dtype!r} in {text!r}")
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def collectives(hlo_text: str):
  """(kind, result type, line) of every collective of an HLO module, in order."""
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if m:
      yield m.group(2), m.group(1), line


def collective_bytes(hlo_text: str) -> dict[tuple[str, tuple[str, ...] | str], int]:
  """{(kind, mesh axes): result bytes per device} over the collectives of an HLO module."""
  out: dict[tuple[str, tuple[str, ...] | str], int] = {}
  for kind, result, line in collectives(hlo_text):
    axes = _MESH_AXES.search(line)
    if axes:
      key = tuple(a.strip().strip("'") for a in axes.group(1).split(",") if a.strip())
    else:
      groups = _GROUPS.search(line)
      key = groups.group(1) if groups else ""
    out[(kind, key)] = out.get((kind, key), 0) + shape_bytes(result)
  return out
