"""Row storage: how one embedding table's rows live in memory, behind one lookup / update API.

Lookups and the sparse optimizers (`rec/embedding/optimizers.py`) read rows only through
`RowStorage.gather` (always float32 out) and write them only through `RowStorage.scatter`
(float32 in), so a table can change its number format without touching either.

A storage object is a frozen dataclass (hashable, a static argument under jit) that holds
configuration only; the rows themselves live in a *state* pytree (a dict of arrays) that the
caller owns, donates and checkpoints. Formats (named by a `storage_spec.StorageSpec`, which
`storage_spec.make_storage` turns into a storage):
  - "fp32", "bf16" (round to nearest even), "bf16_sr" (stochastic rounding, arXiv
    1905.12322): `{"rows": [N, D]}`, here;
  - "int8", "int4", "int8_cache[:lfu|lru[:fraction[:ways]]]", "int4_cache[...]":
    FBGEMM row-wise codes with an fp32 cache of hot rows (arXiv 2010.11305), in
    `rec/embedding/rowwise_storage.py`.
Host tier: `host_keys` names the state arrays that live in host memory (the rows of a
`..._cache...@host` storage; `rec/embedding/host_tier.py`), with the table's optimizer state.
Memory: `state_bytes` counts every array of a state; `RowStorage.component_bytes` splits it
by what the arrays hold (COMPONENTS: values, scales and biases, cache rows, cache tags,
counters).

The embedding collection keeps one buffer per group that concatenates its devices' blocks;
`from_float(rows, shards)` / `to_float(state, shards)` build and read such a buffer as
`shards` equal blocks, each a state of its own (every leaf's leading dim is a multiple of
`shards`), so inside `shard_map` each device holds exactly the state of its block. Formats
whose state is only per-row arrays ignore `shards`.

The update protocol (`SparseOptimizer.apply_unique`): `prepare_update(state, uniq, counts,
step)` (cache admission and eviction; a no-op for plain formats), `gather`, the optimizer
rule, `scatter(..., step=step)`. `prefetch(state, uniq, counts, step)` admits a later
step's rows into a cache ahead of that step (the host tier's lookahead; a no-op without a
cache).

Stochastic rounding is deterministic: the random bits of a row come from a hash of (seed,
step, the row's previous stored value, column) (`sr_bits`), never from a key carried in the
state. A run therefore resumes bit for bit from a checkpoint (the step and the stored rows
are in it), replicas of a data-parallel table round alike, and a row rounds the same way
whatever device or buffer offset holds it, so sharded runs match one device.

Resharding (rec/embedding/reshard.py) reads and writes a buffer's state as arrays of one
entry per row (`to_rows` / `from_rows`; a cache's slots resolved to the rows they hold), and
converts through float32 where a table's columns are cut otherwise (`rows_to_float`,
`rows_from_float`).

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
import numpy as np

from core import quant

StorageState = dict[str, jax.Array]


# What the arrays of a storage state hold, in report order (`RowStorage.components`).
COMPONENTS = ("values", "scales_biases", "cache", "tags", "counters")


class RowStorage(abc.ABC):
  """Interface of a table's row storage: init, gather (to f32), scatter (from f32), sizes."""

  # State key -> its component (one of COMPONENTS), for every key the state may hold.
  components: ClassVar[dict[str, str]]

  @abc.abstractmethod
  def init(self, key: jax.Array, num_rows: int, dim: int, scale: float) -> StorageState:
    """Rows drawn from uniform(-scale, scale) in float32, then converted to this format."""

  @abc.abstractmethod
  def from_float(self, rows_ND: jax.Array, shards: int = 1) -> StorageState:
    """State holding the float32 rows `rows_ND` converted to this format (traceable), as
    `shards` equal blocks of rows (see the module docstring)."""

  def to_float(self, state: StorageState, shards: int = 1) -> jax.Array:
    """Every row as float32 `[N, D]` (the inverse of `from_float` up to rounding)."""
    return self.gather(state, jnp.arange(self.num_rows(state)))

  @abc.abstractmethod
  def gather(self, state: StorageState, idx: jax.Array, *, clip: bool = False,
             live: jax.Array | None = None) -> jax.Array:
    """Rows at `idx` (any shape) as float32 `[*idx.shape, D]`; out-of-range ids give zeros.

    clip=True clamps ids into [0, N) instead (so an out-of-range id reads a real row):
    for callers whose out-of-range ids are padding they mask themselves. It skips the
    per-element bounds select, which on CPU costs as much as the gather.
    `live` (bool, idx's shape; None: every position): the positions whose rows the caller
    uses; at the others a storage may return zeros instead of the row (the host tier then
    skips its host read when every live row is in the device cache). Callers multiply
    those rows by 0 or drop them.
    """

  @abc.abstractmethod
  def scatter(self, state: StorageState, idx: jax.Array, rows_UD: jax.Array, *,
              indices_are_sorted: bool = False, step: jax.Array | None = None) -> StorageState:
    """Overwrites the rows at `idx` with float32 `rows_UD`; ids outside [0, N) are dropped.

    Duplicate in-range ids get one of their rows (unspecified which), as in XLA scatter;
    the optimizers deduplicate first so this never happens there. `step` (the optimizer
    step) seeds stochastic rounding; formats that round to nearest ignore it, and
    stochastic formats take None as step 0.
    """

  def prepare_update(self, state: StorageState, uniq_U: jax.Array, counts_U: jax.Array | None,
                     step: jax.Array) -> StorageState:
    """Called once per optimizer step before the touched rows are gathered: `uniq_U` are the
    distinct touched ids (padding slots hold N), `counts_U` how many looked-up ids each
    stands for. Formats with a cache admit and evict rows here; others return `state`."""
    del uniq_U, counts_U, step
    return state

  def prefetch(self, state: StorageState, uniq_U: jax.Array, counts_U: jax.Array | None,
               step: jax.Array) -> StorageState:
    """Brings the rows `uniq_U` (distinct, padding slots N) that step `step`'s lookups will
    read into a cache before that step (`counts_U`: looked-up ids per row, as
    `prepare_update` gets them); best effort. Formats without a cache return `state`."""
    del uniq_U, counts_U, step
    return state

  counts_accesses: ClassVar[bool] = False   # prepare_update needs counts_U

  @property
  def host_keys(self) -> tuple[str, ...]:
    """State keys placed in host memory (the host tier, rec/embedding/host_tier.py); a
    storage with any also keeps its table's optimizer state there."""
    return ()

  def pallas_pool(self, state: StorageState, idx: jax.Array, coef: jax.Array) -> jax.Array:
    """Bag sums [..., D] of rows `idx` [..., L] (in range) weighted by `coef` [..., L],
    through the Pallas embedding-bag kernel (`kernels/embedding_bag.py`)."""
    from kernels import embedding_bag   # kernels import core only; rec imports kernels
    return embedding_bag.embedding_bag(state["rows"], idx, coef)

  @abc.abstractmethod
  def num_rows(self, state: StorageState) -> int:
    """Number of rows N (static)."""

  @abc.abstractmethod
  def dim(self, state: StorageState) -> int:
    """Embedding dim D (static)."""

  @abc.abstractmethod
  def bytes_per_row(self, dim: int) -> float:
    """Device bytes one row of width `dim` takes (the planner's memory model); formats with
    per-table parts (a cache) give their average over the rows."""

  # Resharding (rec/embedding/reshard.py): a buffer's state as arrays of one entry per row
  # (leading dim: the buffer's rows), so rows can move between buffers of any layout.

  def to_rows(self, state: StorageState, shards: int = 1) -> dict[str, np.ndarray]:
    """The state of a buffer of `shards` blocks as host arrays with one entry per row (a
    cache's slots resolved to the rows they hold). Formats whose state is per-row already
    return it as it is."""
    del shards
    return {k: np.asarray(jax.device_get(v)) for k, v in state.items()}

  def from_rows(self, rows: dict[str, np.ndarray], shards: int = 1,
                step: int = 0) -> StorageState:
    """The inverse of `to_rows` for a buffer of `shards` blocks (host arrays); `step` seeds
    the stochastic rounding of what a format has to round (a cache's overflow)."""
    del shards, step
    return {k: np.asarray(v) for k, v in rows.items()}

  def zero_rows(self, num_rows: int, dim: int, shards: int = 1) -> dict[str, np.ndarray]:
    """The `to_rows` dict of `from_float(zeros [num_rows, dim], shards)` (a fresh buffer:
    what padding holds), made on the host from one row."""
    del shards
    one = self.rows_from_float(np.zeros((1, dim), np.float32))
    return {k: np.broadcast_to(v, (num_rows,) + v.shape[1:]).copy() for k, v in one.items()}

  @abc.abstractmethod
  def rows_to_float(self, rows: dict[str, np.ndarray]) -> np.ndarray:
    """Every row of a `to_rows` dict as float32 `[R, D]` (what lookups read)."""

  @abc.abstractmethod
  def rows_from_float(self, values_RD: np.ndarray,
                      like: tuple[dict[str, np.ndarray], ...] = ()) -> dict[str, np.ndarray]:
    """A `to_rows` dict holding the float32 rows `values_RD` in this format (rounded to
    nearest); `like`: `to_rows` dicts of the same rows whose per-row bookkeeping (a cache's
    residency and counters) carries over."""


  def component_bytes(self, state: StorageState) -> dict[str, int]:
    """Bytes of `state` by component, every one of COMPONENTS (0 where the format has
    none); they sum to `state_bytes(state)`. A key this storage does not declare is an
    error, never dropped from the count."""
    out = dict.fromkeys(COMPONENTS, 0)
    for key, arr in state.items():
      if key not in self.components:
        raise ValueError(f"{type(self).__name__}.component_bytes: state key {key!r} is not "
                         f"one of this storage's {sorted(self.components)}")
      out[self.components[key]] += state_bytes({key: arr})
    return out


def state_bytes(state: StorageState) -> int:
  """Bytes of every array of a storage state: the honest memory of a table."""
  return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape))
                 for a in jax.tree.leaves(state)))


# ------------------------------------------------------------------- stochastic rounding

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_GOLDEN = np.uint32(0x9E3779B9)


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
  h = h ^ (h >> 16)
  h = h * _M1
  h = h ^ (h >> 13)
  h = h * _M2
  return h ^ (h >> 16)


def sr_bits(old_UD: jax.Array, step: jax.Array | None, seed: int, salt: int) -> jax.Array:
  """Random uint32 bits `[U, D]` for stochastically rounding new values of the rows whose
  current stored value (as float32) is `old_UD`.

  Element (u, c) gets fmix(row_u + (c + 1) * golden), with row_u = fmix(fmix(seed, salt,
  step) ^ sum_c fmix(bits(old[u, c]) ^ c * m1)): a function of the row's previous value,
  never of its index, and a wrapping integer sum, so any reduction order gives the same
  bits. Given the previous value the bits do not depend on the new one, so rounding up
  with probability frac is unbiased; a different step, seed or `salt` (one per purpose)
  gives fresh bits.
  """
  u, d = old_UD.shape
  base = np.uint32(_fmix32_np((seed * 0x9E3779B9 + salt * 0x632BE5AB) & 0xFFFFFFFF))
  step_u = jnp.asarray(0 if step is None else step).astype(jnp.uint32)
  h0 = _fmix32(jnp.uint32(base) ^ _fmix32(step_u + _GOLDEN))
  col = jnp.arange(d, dtype=jnp.uint32)
  bits = quant.exact.f32_bits(old_UD)
  row = jnp.sum(_fmix32(bits ^ (col * _M1)), axis=1, dtype=jnp.uint32)     # wraps mod 2^32
  row = _fmix32(row ^ h0)
  return _fmix32(row[:, None] + (col + np.uint32(1)) * _GOLDEN)


def _fmix32_np(h: int) -> int:
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF
  return h ^ (h >> 16)


# ------------------------------------------------------------------------ float rows


@dataclasses.dataclass(frozen=True)
class _DenseRowStorage(RowStorage):
  """Rows kept as one `[N, D]` array of a float dtype; state `{"rows": [N, D]}`."""

  dtype: ClassVar[Any] = jnp.float32
  components: ClassVar[dict[str, str]] = {"rows": "values"}

  def init(self, key: jax.Array, num_rows: int, dim: int, scale: float) -> StorageState:
    check_size(type(self).__name__, num_rows, dim)
    rows = jax.random.uniform(key, (num_rows, dim), jnp.float32, -scale, scale)
    return self.from_float(rows)

  def from_float(self, rows_ND: jax.Array, shards: int = 1) -> StorageState:
    return {"rows": self._from_f32(jnp.asarray(rows_ND, jnp.float32), None, None)}

  def to_float(self, state: StorageState, shards: int = 1) -> jax.Array:
    return state["rows"].astype(jnp.float32)

  def gather(self, state: StorageState, idx: jax.Array, *, clip: bool = False,
             live: jax.Array | None = None) -> jax.Array:
    del live   # every row is read where it lies
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
              indices_are_sorted: bool = False, step: jax.Array | None = None) -> StorageState:
    rows = state["rows"]
    n, d = rows.shape
    if rows_UD.shape != (*idx.shape, d):
      raise ValueError(
          f"{type(self).__name__}.scatter: rows shape {rows_UD.shape}, expected "
          f"{(*idx.shape, d)} for idx shape {idx.shape} and table dim {d}")
    # `.at[]` wraps negative ids numpy-style; send them to the sentinel so they are dropped.
    idx = jnp.where(idx < 0, n, idx)
    new = rows.at[idx].set(self._from_f32(rows_UD, lambda: self.gather(state, idx, clip=True),
                                          step),
                           mode="drop", indices_are_sorted=indices_are_sorted)
    return {**state, "rows": new}

  def num_rows(self, state: StorageState) -> int:
    return state["rows"].shape[0]

  def dim(self, state: StorageState) -> int:
    return state["rows"].shape[1]

  def bytes_per_row(self, dim: int) -> float:
    return dim * jnp.dtype(self.dtype).itemsize

  def rows_to_float(self, rows: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(rows["rows"]).astype(np.float32)

  def rows_from_float(self, values_RD, like=()):
    del like
    return {"rows": np.asarray(jnp.asarray(values_RD, jnp.float32).astype(self.dtype))}

  def _from_f32(self, rows: jax.Array, old, step) -> jax.Array:
    """`rows` in this dtype; `old()` gives the rows' previous values (for stochastic
    rounding), None when there are none (init)."""
    del old, step
    return rows.astype(self.dtype)


def check_size(where: str, num_rows: int, dim: int) -> None:
  if num_rows <= 0 or dim <= 0:
    raise ValueError(f"{where}.init: num_rows={num_rows}, dim={dim}, expected both > 0")
  # The sentinel id num_rows must fit in int32 (ids are int32 everywhere).
  if num_rows >= jnp.iinfo(jnp.int32).max:
    raise ValueError(f"{where}.init: num_rows={num_rows}, expected < 2**31 - 1 (int32 ids)")


@dataclasses.dataclass(frozen=True)
class Fp32Storage(_DenseRowStorage):
  """Float32 rows: gather and scatter are exact."""

  dtype: ClassVar[Any] = jnp.float32


@dataclasses.dataclass(frozen=True)
class Bf16Storage(_DenseRowStorage):
  """Bfloat16 rows, updated in float32 and rounded on write: to nearest even ("bf16"), or
  stochastically ("bf16_sr", FBGEMM's default for half-precision tables): a small update
  (|lr * g| under half an ulp of w) that nearest rounding loses survives in expectation.

  Initial rows (`from_float`) are rounded to nearest in both modes; stochastic rounding
  uses `sr_bits` (seeded by `seed`, the step and each row's previous value)."""

  rounding: str = "nearest"      # "nearest" | "stochastic"
  seed: int = 0
  dtype: ClassVar[Any] = jnp.bfloat16

  def __post_init__(self):
    if self.rounding not in ("nearest", "stochastic"):
      raise ValueError(f"Bf16Storage: rounding={self.rounding!r}, expected 'nearest' or "
                       "'stochastic'")

  def _from_f32(self, rows: jax.Array, old, step) -> jax.Array:
    if self.rounding == "nearest" or old is None:
      return rows.astype(jnp.bfloat16)          # XLA's convert: round to nearest even
    flat = rows.reshape(-1, rows.shape[-1])
    bits = sr_bits(old().reshape(flat.shape), step, self.seed, salt=1) >> 16
    return quant.stochastic_round_bf16_bits(flat, bits).reshape(rows.shape)

