"""One device mesh for every model family: the `--mesh` flag, logical-axis rules, placement.

`--mesh=data:8`, `--mesh=data:2,model:4`, `--mesh=-1` (every device on one `data` axis) or
`--mesh=data:-1,model:2` (-1 takes the remaining devices). Parameters, activations and
batches carry logical names such as ("batch", "embed"); one rules table maps each name to
mesh axes (MaxText's logical_axis_rules, big_vision's sharding_rules). Names whose axes the
mesh lacks are replicated, so the same rules serve a 1-device and an 8-device mesh.
`make_mesh` checks the flag's axis names against the rules in use, so `--mesh=dta:8` is an
error rather than a mesh on which no logical name lands (every device doing all the work).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# A rules table: (logical name, mesh axis | tuple of mesh axes | None), first match wins.
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# A rules entry under this name maps no logical axis: it declares mesh axes the table
# accepts on purpose although no rule uses them (e.g. an axis that only a shard_map names),
# as in `(EXTRA_AXES, ("stage",))`.
EXTRA_AXES = "__extra_axes__"

# Recommendation models: every device takes a slice of the batch (data parallel dense
# part); embedding shards spread over every device, as in TorchRec / Neo (arXiv 2104.05158).
REC_RULES: Rules = (
    ("batch", ("data", "model")),
    ("emb_shard", ("data", "model")),
    # DMT's SPTT (arXiv 2403.00877): tower groups across "data" (hosts), a tower's row
    # shards within one group over "model" (a host's devices, the fast links)
    ("emb_tower", "data"),
    ("emb_tower_shard", "model"),
    ("embed", None),
    ("mlp_in", None),       # dense MLP weights: replicated (data-parallel dense part)
    ("mlp_out", None),
)

# LLMs (MaxText-style): mesh axes `data` (pure data parallel), `fsdp` (batch + parameter
# sharding), `tp` (tensor parallel: heads and MLP hidden), `cp` (context parallel: the
# sequence, ring attention). Parameter names first, then activation names ("act_*").
LLM_RULES: Rules = (
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("norm", None),
    ("act_batch", ("data", "fsdp")),
    ("act_seq", "cp"),
    ("act_embed", None),
    ("act_heads", "tp"),
    ("act_kv_heads", "tp"),
    ("act_mlp", "tp"),
    ("act_vocab", "tp"),
    ("cache_batch", ("data", "fsdp")),
    ("cache_seq", None),
    ("cache_kv_heads", "tp"),
)

_TABLE_NAMES = {id(REC_RULES): "REC_RULES", id(LLM_RULES): "LLM_RULES"}


def rules_axes(rules: Rules) -> tuple[str, ...]:
  """The mesh axes a rules table knows (those its rules map to, and its EXTRA_AXES), in
  order of first appearance."""
  out: list[str] = []
  for _, axes in rules:
    for a in (axes,) if isinstance(axes, str) else tuple(axes or ()):
      if a not in out:
        out.append(a)
  return tuple(out)


def check_axes(spec: str, names: Sequence[str], rules: Rules, table: str | None = None) -> None:
  """Raises a ValueError naming the known axes when `names` (of --mesh=`spec`) holds an
  axis that no rule of `rules` maps to; `table` names the rules in the message."""
  known = rules_axes(rules)
  unknown = [a for a in names if a not in known]
  if unknown:
    table = table or _TABLE_NAMES.get(id(rules), "the rules table in use")
    raise ValueError(
        f"--mesh={spec!r}: unknown axis {', '.join(map(repr, unknown))}; {table} knows "
        f"{', '.join(known)} (a table may declare more with an EXTRA_AXES entry)")


def parse_mesh(spec: str) -> list[tuple[str, int]]:
  """Parses `data:2,model:4` / `-1` into [(axis, size)]; a size of -1 is resolved later."""
  spec = spec.strip()
  if spec in ("-1", ""):
    return [("data", -1)]
  axes = []
  for part in spec.split(","):
    name, sep, size = part.partition(":")
    name = name.strip()
    try:
      n = int(size) if sep else None
    except ValueError:
      n = None
    if not name or not name.isidentifier() or n is None or (n < 1 and n != -1):
      raise ValueError(
          f"--mesh={spec!r}: bad axis {part!r}; expected name:size with size >= 1 or -1, "
          "e.g. 'data:8', 'data:2,model:4' or '-1'")
    if name in dict(axes):
      raise ValueError(f"--mesh={spec!r}: axis {name!r} appears twice")
    axes.append((name, n))
  if sum(n == -1 for _, n in axes) > 1:
    raise ValueError(f"--mesh={spec!r}: at most one axis may have size -1")
  return axes


def make_mesh(spec: str, devices: Sequence[jax.Device] | None = None,
              rules: Rules | None = None) -> Mesh:
  """Builds the mesh for `spec` over `devices` (default: all); the sizes must use all of them.

  Axis names must be known to `rules`, the table the run places arrays with (default: any
  table of this module, REC_RULES or LLM_RULES).
  """
  devices = list(jax.devices() if devices is None else devices)
  axes = parse_mesh(spec)
  if rules is None:
    check_axes(spec, [a for a, _ in axes], tuple(REC_RULES) + tuple(LLM_RULES),
               "REC_RULES + LLM_RULES")
  else:
    check_axes(spec, [a for a, _ in axes], rules)
  known = math.prod(n for _, n in axes if n != -1)
  if any(n == -1 for _, n in axes):
    if len(devices) % known:
      raise ValueError(
          f"--mesh={spec!r}: the fixed axes take {known} devices, which does not divide the "
          f"{len(devices)} devices available")
    axes = [(a, len(devices) // known if n == -1 else n) for a, n in axes]
  needed = math.prod(n for _, n in axes)
  if needed != len(devices):
    raise ValueError(
        f"--mesh={spec!r} needs {needed} devices, but {len(devices)} are available "
        f"({devices[0].platform}); use sizes whose product is {len(devices)}, or -1 for one axis")
  names = tuple(a for a, _ in axes)
  shape = tuple(n for _, n in axes)
  return Mesh(np.asarray(devices).reshape(shape), names,
              axis_types=(AxisType.Auto,) * len(names))


def logical_to_spec(logical: Sequence[str | None], rules: Rules, mesh: Mesh) -> P:
  """Maps logical dimension names to a PartitionSpec, dropping axes the mesh lacks."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in logical:
    if name is None:
      out.append(None)
      continue
    if name not in table or name == EXTRA_AXES:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    axes = table[name]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a in mesh.shape and a not in used)
    used.update(axes)
    out.append(axes if len(axes) > 1 else (axes[0] if axes else None))
  return P(*out)


def logical_sharding(logical: Sequence[str | None], rules: Rules, mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical, rules, mesh))


def mesh_axes(name: str, rules: Rules, mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes (present in `mesh`) that logical axis `name` maps to."""
  spec = logical_to_spec((name,), rules, mesh)[0]
  return () if spec is None else ((spec,) if isinstance(spec, str) else tuple(spec))


def axis_size(name: str, rules: Rules, mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in mesh_axes(name, rules, mesh))


def shardings_for(logical_specs: Any, rules: Rules, mesh: Mesh) -> Any:
  """NamedShardings for a pytree of logical PartitionSpecs (e.g. from
  `nnx.get_partition_spec`); None or an empty spec means replicated."""
  def one(spec):
    return NamedSharding(mesh, P() if spec is None else logical_to_spec(tuple(spec), rules, mesh))
  return jax.tree.map(one, logical_specs, is_leaf=lambda x: x is None or isinstance(x, P))


def process_batch_share(mesh: Mesh, rules: Rules, batch_axis: str = "batch") -> tuple[int, int]:
  """(index, count): this process feeds slice `index` of `count` equal slices of the global
  batch, the rows its devices hold under `rules` (count 1 when the batch dimension is not
  split across processes: then every process feeds the whole batch)."""
  n = axis_size(batch_axis, rules, mesh)
  sharding = NamedSharding(mesh, logical_to_spec((batch_axis,), rules, mesh))
  spans = {(ix[0].start or 0, n if ix[0].stop is None else ix[0].stop)
           for ix in sharding.addressable_devices_indices_map((n,)).values()}
  lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
  if sum(b - a for a, b in spans) != hi - lo or n % (hi - lo) or lo % (hi - lo):
    raise ValueError(f"process {jax.process_index()} holds batch slices {sorted(spans)} of "
                     f"{n} under mesh {dict(mesh.shape)}: expected one contiguous, equal share "
                     "(order the mesh's devices by process)")
  return lo // (hi - lo), n // (hi - lo)


def shard_batch(batch: Any, mesh: Mesh, rules: Rules, batch_axis: str = "batch") -> Any:
  """Places a host batch (pytree of numpy arrays, leading dim = global batch) on the mesh.

  Leading dimensions are split over the mesh axes of `batch_axis`. In a multi-process run
  each process passes its own share of the global batch (`process_batch_share`), through
  make_array_from_process_local_data.
  """
  n = axis_size(batch_axis, rules, mesh)
  # A process passes its share, 1/count of the global batch, to n / count of the devices.
  count = process_batch_share(mesh, rules, batch_axis)[1] if jax.process_count() > 1 else 1
  local = n // count

  def put(x):
    if x is None:
      return None
    x = np.asarray(x)
    if x.shape[0] % local:
      share = "" if count == 1 else f" (this process's share, 1/{count} of the global batch)"
      raise ValueError(
          f"batch dimension {x.shape[0]}{share} is not divisible by the {local} devices of "
          f"logical axis {batch_axis!r} ({mesh_axes(batch_axis, rules, mesh)})"
          + ("" if count == 1 else f" that this process feeds ({n} in all)"))
    spec = logical_to_spec((batch_axis,) + (None,) * (x.ndim - 1), rules, mesh)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

  return jax.tree.map(put, batch)
