"""What a compiled program communicates, read from its HLO text.

`collective_bytes(compiled.as_text())` sums, per collective kind and the mesh axes it runs
over, the bytes of each collective's result on one device (the program is the same on
every device of an SPMD run): an all-to-all's result is what the device receives (its own
chunk included), an all-gather's the gathered array, a reduce-scatter's its shard. Mesh
axes come from the replica groups as XLA prints them for a jax mesh
(`replica_groups=mesh['data'=2,'model'=4] {'model'}`); groups printed another way are keyed
by their text (explicit `{{0,1},{2,3}}` or XLA's iota form `[2,4]<=[8]`, which GSPMD's
own collectives get). The count checks communication models against what XLA emits, e.g. the
embedding collection's all-to-all volumes (experiments/dmt). Synchronous collectives only
(what XLA:CPU emits); asynchronous start / done pairs (GPU) are not matched. An element type
this module does not know is an error, never 0 bytes.
"""

from __future__ import annotations

import math
import re

# Bits per element of XLA's primitive types (sub-byte types packed, as XLA stores them).
DTYPE_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16,
              "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16,
              "f32": 32, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4, "f8e3m4": 8,
              "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8,
              "f8e5m2fnuz": 8, "f8e8m0fnu": 8}
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")\(")
# An element type's name is letters and digits, e.g. f8e4m3fn.
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_MESH_AXES = re.compile(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}")
_GROUPS = re.compile(r"replica_groups=(\{\}|\{[^=]*?\}\}|\[[0-9,]*\]<=\[[0-9,]*\]"
                     r"(?:T\([0-9,]*\))?)")


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in `text` (a result type, possibly a tuple)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in DTYPE_BITS:
      raise ValueError(f"collective_bytes: unknown element type {dtype!r} in {text!r}")
    if not all(d.strip().isdigit() for d in dims.split(",") if d.strip()):
      raise ValueError(f"collective_bytes: dimensions [{dims}] of {dtype!r} in {text!r}; "
                       "expected static sizes")
    bits = DTYPE_BITS[dtype] * math.prod(int(d) for d in dims.split(",") if d.strip())
    total += -(-bits // 8)     # an array of a sub-byte type fills whole bytes
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
