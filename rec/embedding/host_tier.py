"""The host-memory tier of embedding rows: a table's full rows and its optimizer state in
host memory, the hot rows in a device cache (`rowwise_storage.CachedQuantizedStorage` with
`host=True`, named `..._cache...@host` by a `StorageSpec`).

Placement: the arrays of a state that `RowStorage.host_keys` names, and the table's
optimizer state, are placed in the host memory kind HOST_MEMORY ("pinned_host": on a GPU
page-locked host memory that the device copies by DMA; XLA:CPU devices offer the same
memory kinds, "device", "pinned_host", "unpinned_host", so on the CPU the same program
runs with the arrays in a separate memory space of the same RAM). The collection gives
those leaves `host_sharding(...)` (`EmbeddingCollection.state_shardings`), so the train
step takes and returns them in host memory.

Access: inside the step every read and write of a host array goes through `take` and
`put`: the indices (and written values) are copied to host memory, the gather / scatter
runs on the host (`compute_on("device_host")`), and only the rows gathered come back to
the device. Nothing else of a host array moves. `take` / `put` look at the array's memory
space, so the same storage code indexes device arrays directly (a host-tier state fetched
to the device, e.g. by `jax.device_get`, is read as it is). The storage calls them inside a
`lax.cond` that skips them when every row is in the device cache, and
`EmbeddingCollection.prefetch` (`--host_prefetch`) admits a step's rows to the cache one
step ahead, so that on a hit the step moves no rows of a host array (the optimizer state of
the rows it updates still goes through take / put).

Letters: U rows read or written.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

HOST_MEMORY = "pinned_host"
_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device


def host_sharding(sharding: NamedSharding) -> NamedSharding:
  """`sharding` in host memory."""
  return sharding.with_memory_kind(HOST_MEMORY)


def is_host(x: Any) -> bool:
  """Whether the array (or tracer) `x` lives in host memory."""
  try:
    return jax.typeof(x).memory_space == _HOST
  except (TypeError, AttributeError):
    return False


@compute_on(compute_type="device_host", out_memory_spaces=_HOST)
def _host_take(a, idx_U):
  return a.at[idx_U].get(mode="promise_in_bounds")


@compute_on(compute_type="device_host", out_memory_spaces=_HOST)
def _host_put(a, idx_U, v):
  return a.at[idx_U].set(v, mode="drop")


def take(a: jax.Array, idx_U: jax.Array) -> jax.Array:
  """Rows `idx_U` (in range) of `a`, on the device; from host memory when `a` is there."""
  if not is_host(a):
    return a.at[idx_U].get(mode="promise_in_bounds")
  out = _host_take(a, jax.device_put(idx_U, _HOST))
  return jax.device_put(out, _DEVICE)


def put(a: jax.Array, idx_U: jax.Array, v: jax.Array) -> jax.Array:
  """`a` with rows `idx_U` set to `v` (ids outside [0, rows) dropped); a host array is
  written on the host, with only `idx_U` and `v` copied there."""
  v = v.astype(a.dtype)
  # `.at[]` wraps negative ids numpy-style (-1 would write the last row); send them past
  # the end so that they are dropped like any other out-of-range id.
  idx_U = jnp.where(idx_U < 0, a.shape[0], idx_U)
  if not is_host(a):
    return a.at[idx_U].set(v, mode="drop")
  return _host_put(a, jax.device_put(idx_U, _HOST), jax.device_put(v, _HOST))


def check_prefetch(coll) -> None:
  """--host_prefetch needs a table of the collection `coll` on the host tier; else a
  ValueError of one line."""
  if not coll.host_groups():
    storages = sorted({str(g.storage) for g in coll.groups.values()})
    raise ValueError(
        f"--host_prefetch: no embedding table is on the host tier (storages {storages}); "
        "expected --storage=KIND_cache...@host (e.g. fp32_cache:lru:0.05@host), or "
        "--host_memory_gb with a device budget that moves a table there")


def fetch(state: dict[str, Any]) -> dict[str, Any]:
  """A state's concrete host-memory arrays as numpy arrays (for reads outside a step);
  tracers and device arrays unchanged."""
  return {k: (jax.device_get(v) if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)
              and is_host(v) else v) for k, v in state.items()}


def state_bytes_by_memory(state: Any) -> dict[str, int]:
  """{"device": bytes, "host": bytes} of a state's concrete arrays, by memory kind."""
  out = {"device": 0, "host": 0}
  for x in jax.tree.leaves(state):
    n = x.size * jnp.dtype(x.dtype).itemsize
    out["host" if getattr(x.sharding, "memory_kind", None) == HOST_MEMORY else "device"] += n
  return out
