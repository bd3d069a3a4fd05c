"""Row storage: how one embedding table's rows live in memory, behind one lookup / update API.

Lookups and the sparse optimizers (`rec/embedding/optimizers.py`) read rows only through
`RowStorage.gather` (always float32 out) and write them only through `RowStorage.scatter`
(float32 in), so a table can change its number format without touching either.

A storage object is a frozen dataclass (hashable, a static argument under jit) that holds
configuration only; the rows themselves live in a *state* pytree (a dict of arrays) that the
caller owns, donates and checkpoints. Today the state is `{"rows": [N, D]}` in float32 or
bfloat16. Formats planned next fit the same shape of API:
  - row-wise int8 / int4 (FBGEMM): `{"q": [N, D or D/2] int8/uint8, "scale": [N], "bias": [N]}`,
    gather dequantizes, scatter requantizes the written rows only;
  - a full-precision cache of hot rows: `{"q": ..., "cache_rows": [C, D] f32, "cache_ids": [C]}`,
    gather looks in the cache first, scatter writes through.

Index conventions shared by every storage (N = num_rows):
  - gather: an index outside [0, N) yields a row of zeros (`mode="fill"`, fill 0; negative
    indices are out of range too, never wrapped). Callers pass in-range ids or mask the result.
  - scatter: an index outside [0, N), in particular the sentinel N that
    `optimizers.dedup_gradients` uses for padding, is dropped (`mode="drop"`), never written.

Letters: N rows, D embedding dim, U rows written by one scatter.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

StorageState = dict[str, jax.Array]


class RowStorage(abc.ABC):
  """Interface of a table's row storage: init, gather (to f32), scatter (from f32), sizes."""

  name: ClassVar[str]

  @abc.abstractmethod
  def init(self, key: jax.Array, num_rows: int, dim: int, scale: float) -> StorageState:
    """Rows drawn from uniform(-scale, scale) in float32, then converted to this format."""

  @abc.abstractmethod
  def from_float(self, rows_ND: jax.Array) -> StorageState:
    """State holding the float32 rows `rows_ND` converted to this format (traceable)."""

  @abc.abstractmethod
  def gather(self, state: StorageState, idx: jax.Array, *, clip: bool = False) -> jax.Array:
    """Rows at `idx` (any shape) as float32 `[*idx.shape, D]`; out-of-range ids give zeros.

    clip=True clamps ids into [0, N) instead (so an out-of-range id reads a real row):
    for callers whose out-of-range ids are padding they mask themselves. It skips the
    per-element bounds select, which on CPU costs as much as the gather.
    """

  @abc.abstractmethod
  def scatter(self, state: StorageState, idx: jax.Array, rows_UD: jax.Array, *,
              indices_are_sorted: bool = False) -> StorageState:
    """Overwrites the rows at `idx` with float32 `rows_UD`; ids outside [0, N) are dropped.

    Duplicate in-range ids get one of their rows (unspecified which), as in XLA scatter;
    the optimizers deduplicate first so this never happens there.
    """

  @abc.abstractmethod
  def num_rows(self, state: StorageState) -> int:
    """Number of rows N (static)."""

  @abc.abstractmethod
  def dim(self, state: StorageState) -> int:
    """Embedding dim D (static)."""

  @abc.abstractmethod
  def bytes_per_row(self, dim: int) -> int:
    """Device bytes one row of width `dim` takes (the planner's memory model)."""


@dataclasses.dataclass(frozen=True)
class _DenseRowStorage(RowStorage):
  """Rows kept as one `[N, D]` array of a float dtype; state `{"rows": [N, D]}`."""

  dtype: ClassVar[Any] = jnp.float32

  def init(self, key: jax.Array, num_rows: int, dim: int, scale: float) -> StorageState:
    if num_rows <= 0 or dim <= 0:
      raise ValueError(
          f"{type(self).__name__}.init: num_rows={num_rows}, dim={dim}, expected both > 0")
    # The sentinel id num_rows must fit in int32 (ids are int32 everywhere).
    if num_rows >= jnp.iinfo(jnp.int32).max:
      raise ValueError(
          f"{type(self).__name__}.init: num_rows={num_rows}, expected < 2**31 - 1 (int32 ids)")
    rows = jax.random.uniform(key, (num_rows, dim), jnp.float32, -scale, scale)
    return self.from_float(rows)

  def from_float(self, rows_ND: jax.Array) -> StorageState:
    return {"rows": self._from_f32(jnp.asarray(rows_ND, jnp.float32))}

  def gather(self, state: StorageState, idx: jax.Array, *, clip: bool = False) -> jax.Array:
    rows = state["rows"]
    n = rows.shape[0]
    if clip:
      out = rows.at[jnp.clip(idx, 0, n - 1)].get(mode="promise_in_bounds")
      return out.astype(jnp.float32)
    # jnp.take wraps negative ids numpy-style even in "fill" mode (-1 would read row N-1);
    # send them to N so that they read zeros like any other out-of-range id.
    idx = jnp.where(idx < 0, n, idx)
    out = jnp.take(rows, idx, axis=0, mode="fill", fill_value=0)
    return out.astype(jnp.float32)

  def scatter(self, state: StorageState, idx: jax.Array, rows_UD: jax.Array, *,
              indices_are_sorted: bool = False) -> StorageState:
    rows = state["rows"]
    n, d = rows.shape
    if rows_UD.shape != (*idx.shape, d):
      raise ValueError(
          f"{type(self).__name__}.scatter: rows shape {rows_UD.shape}, expected "
          f"{(*idx.shape, d)} for idx shape {idx.shape} and table dim {d}")
    # `.at[]` wraps negative ids numpy-style; send them to the sentinel so they are dropped.
    idx = jnp.where(idx < 0, n, idx)
    new = rows.at[idx].set(self._from_f32(rows_UD), mode="drop",
                           indices_are_sorted=indices_are_sorted)
    return {**state, "rows": new}

  def num_rows(self, state: StorageState) -> int:
    return state["rows"].shape[0]

  def dim(self, state: StorageState) -> int:
    return state["rows"].shape[1]

  def bytes_per_row(self, dim: int) -> int:
    return dim * jnp.dtype(self.dtype).itemsize

  def _from_f32(self, rows: jax.Array) -> jax.Array:
    return rows.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Fp32Storage(_DenseRowStorage):
  """Float32 rows: gather and scatter are exact."""

  name: ClassVar[str] = "fp32"
  dtype: ClassVar[Any] = jnp.float32


@dataclasses.dataclass(frozen=True)
class Bf16Storage(_DenseRowStorage):
  """Bfloat16 rows, updated in float32 and rounded to nearest even on write."""

  name: ClassVar[str] = "bf16"
  dtype: ClassVar[Any] = jnp.bfloat16

  def _from_f32(self, rows: jax.Array) -> jax.Array:
    # Round to nearest even (XLA's convert). Hook for stochastic rounding: small updates
    # (|lr * g| < half an ulp of w) vanish under nearest rounding; SR keeps them in
    # expectation. It needs a key, so it will come as a `rounding="stochastic"` field plus a
    # key in the scatter call, using core/quant's bf16 stochastic rounding.
    return rows.astype(jnp.bfloat16)


_STORAGES: dict[str, type[RowStorage]] = {
    Fp32Storage.name: Fp32Storage,
    Bf16Storage.name: Bf16Storage,
}


def get_storage(name: str) -> RowStorage:
  """The storage registered under `name` ("fp32" | "bf16"), e.g. `TableConfig.storage`."""
  try:
    return _STORAGES[name]()
  except KeyError:
    raise ValueError(
        f"rec/embedding/storage.py get_storage: unknown storage {name!r}, expected one of "
        f"{sorted(_STORAGES)}") from None
