"""FBGEMM row-wise quantized embedding rows with an fp32 cache of the hot rows (arXiv
2010.11305): the storages `int8`, `int4`, `int2` and `int8_cache`, `int4_cache`,
`int2_cache` of `rec/embedding/storage_spec.py`; `fp32_cache` keeps float32 rows behind the
same cache (bits=32: nothing is quantized, so it trains exactly as `fp32` does).

Host tier (`host=True`, a spec's `@host`): the rows (codes, scale, bias, or float32 rows)
live in host memory and only the cache, its tags and the LFU counters on the device
(`rec/embedding/host_tier.py`); every read and write of the rows goes through
`host_tier.take` / `put`, so the arithmetic, the admissions and the evictions are those of
the same storage without the tier, bit for bit. A lookup reads host memory only when some
row it uses (`gather`'s `live`) misses the cache, an update writes it only when some row
it changes is not cached, an admission only when a row is admitted (each a `lax.cond`; a
padding id whose row is not cached then reads zeros, which its zero coefficient makes no
difference to).

Prefetch (`prefetch`, the lookahead of `--host_prefetch`): before step t + 1, the rows its
lookups will read are admitted with `prepare_update`'s ranking, eviction and write-back,
scored as step t + 1's `prepare_update` will score them (LFU: count plus the step's
looked-up ids; LRU: t + 2), with the cached rows the step reads never evicted. Nothing of
step t + 1's accesses is recorded twice: LFU counts are left to that step, LRU times are
set only for the admitted rows, to the t + 2 that step sets again. Rows that do not fit
stay misses for step t + 1's own admission. fp32_cache trains bit for bit as without it;
the int formats then hold other rows in float32, so they round otherwise.

Every row is stored in FBGEMM's row-wise integer format (`core.quant.rowwise`: int8 codes
with float32 scale and bias, or int4 / int2 codes packed low bits first with float16 scale
and bias); the most frequently (LFU) or recently (LRU) used rows are also held in float32 in
a set-associative cache (like FBGEMM's LXU cache) of `fraction` of the rows. Lookups read a
cached row from the cache and dequantize the others; the optimizer updates cached rows in
float32 and the others by dequantize, update, requantize with stochastic rounding; a row
evicted from the cache is written back quantized, stochastically rounded too.

Cache layout, per block of R rows (one per device, see `storage.py` on `shards`): S sets of
A ways (A = min(ways, target), S = ceil(target / A), target = ceil(fraction * R), so the cache
holds C = S * A >= target slots). Row r may live only in set r mod S, at any of its A ways
(slot = set * A + way). The first min(R, C) rows start in the cache (row r at way r div S of
its set): with fraction >= 1 every row is cached from the start, no row ever leaves, and
training is exactly fp32 training.

State (all plain arrays; the counters are part of the memory, `storage.state_bytes`, and
`RowStorage.component_bytes` counts them by component):
  q [R, P] uint8, scale [R], bias [R]      the quantized rows (float32 for int8, float16 N-bit)
  rows [R, D] float32                      instead of q, scale, bias for bits=32
  cache_rows [C, D] float32, cache_tags [C] int32 (the row in each slot, -1 empty)
  counts [R] int32 (LFU: looked-up ids of each row, all rows, as FBGEMM's lfu_state;
                   saturating at 2^31 - 1, where FBGEMM's int64 would go on)
  cache_last [C] int32 (LRU: 1 + the step of the slot's last access, 0 never)

Admission and eviction (`prepare_update`, once per optimizer step, on the step's distinct
touched rows): LFU adds each row's count of looked-up ids to `counts`; LRU stamps the
touched cached rows with step + 1. Then, in every set that a touched uncached row (a
candidate) maps to, the set keeps the A best of its residents and its candidates, ranked
by score (LFU: counts; LRU: last access, candidates step + 1; empty slots -1), then
residents before candidates (a tie never evicts), then lower row id. Each admitted row
takes the slot of a dropped resident (the j-th admitted in rank order the j-th dropped),
after that resident is written back. Computed without a sort of the cache: the candidates
are sorted by (set, -score, row), each touched set's A residents and its A best candidates
ranked by pairwise comparison ([G, 2A, 2A]). `CacheReference` in the tests replays this in plain
Python.

Stochastic rounding (`quantize_rowwise_stochastic`): with FBGEMM's scale and bias for the
new row, code = floor(v) + [u < v - floor(v)] for v = (x - bias) / scale and u uniform in
[0, 1) on a 2^-24 grid, clamped to [0, 2^bits - 1]: E[dequantize] = x up to that grid and
float32 rounding, where round-to-nearest loses updates smaller than half a step (the
clamp of the N-bit format's fp16-rounded range is the one biased case). u comes from
`storage.sr_bits` (seed, step, the row's previous value), so resuming and sharding change
nothing.

Letters: R rows of a block, D embedding dim, P bytes of codes per row, S sets, A ways,
C = S * A cache slots, U distinct touched rows, M looked-up ids, G = min(U, S) sets that a
step may change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from core import quant
from rec.embedding import host_tier
from rec.embedding import storage as storage_lib
from rec.embedding.storage import StorageState

POLICIES = ("lfu", "lru")
DEFAULT_FRACTION = {32: 0.05, 8: 0.05, 4: 0.01, 2: 0.01}   # the paper's int8 + 5%, int4 + 1%
DEFAULT_WAYS = 16


def check_cache(policy, fraction, ways, name: Callable[[str, object], str]) -> None:
  """The one validation of cache settings (StorageSpec's, the --cache_* flags', this
  storage's): `name(field, value)` says where a bad one came from."""
  if policy not in POLICIES:
    raise ValueError(f"{name('cache_policy', policy)}: expected one of {list(POLICIES)}")
  if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
      or not (math.isfinite(fraction) and 0 < fraction <= 1)):
    raise ValueError(f"{name('cache_fraction', fraction)}: expected a number in (0, 1] (the "
                     "share of each device's rows the fp32 cache holds)")
  if isinstance(ways, bool) or not isinstance(ways, int) or ways < 1:
    raise ValueError(f"{name('cache_ways', ways)}: expected an integer >= 1")
_SALT_EVICT, _SALT_UPDATE = 2, 3                  # sr_bits purposes (bf16 uses 1)


def quantize_rowwise_stochastic(x_ND: jax.Array, bits: int, u24_ND: jax.Array
                                ) -> quant.RowwiseQuantized:
  """FBGEMM row-wise `bits` quantization of `x_ND` with stochastic rounding of the codes.

  scale and bias are FBGEMM's (`core.quant.quantize_rowwise`); the codes are floor(v) + 1
  with probability frac(v) (decided by u = u24 * 2^-24, u24 uint32 in [0, 2^24)), v =
  (x - bias) * (1 / scale), clamped to [0, 2^bits - 1]; a row with NaN / Inf keeps
  FBGEMM's NaN scale and codes 0, a constant row codes 0.
  """
  x = jnp.asarray(x_ND, jnp.float32)
  qr = quant.quantize_rowwise(x, bits)
  scale = qr.scale.astype(jnp.float32)
  bias = qr.bias.astype(jnp.float32)
  inv = quant.exact.div_rn(jnp.float32(1.0), scale)           # per row: correctly rounded
  v = (x - bias[:, None]) * inv[:, None]
  fl = jnp.floor(v)
  u = jnp.asarray(u24_ND).astype(jnp.float32) * np.float32(2.0 ** -24)   # exact
  c = jnp.clip(fl + (u < v - fl).astype(jnp.float32), 0, (1 << bits) - 1)
  c = jnp.where(jnp.isnan(c), 0, c).astype(jnp.uint8)
  codes = c if bits == 8 else quant.pack_nbit(c, bits)
  return quant.RowwiseQuantized(codes, qr.scale, qr.bias, bits=bits, dim=x.shape[1])


def cache_geometry(num_rows: int, fraction: float, ways: int) -> tuple[int, int]:
  """(S sets, A ways) of the cache of a block of `num_rows` rows; (0, 0) for no cache."""
  if fraction <= 0:
    return 0, 0
  target = max(1, min(num_rows, math.ceil(fraction * num_rows - 1e-9)))
  a = min(ways, target)
  return -(-target // a), a


@dataclasses.dataclass(frozen=True)
class CachedQuantizedStorage(storage_lib.RowStorage):
  """Row-wise int8 / int4 / int2 rows (or float32, bits=32) plus an fp32 LFU or LRU cache
of `fraction` of them; `host`: the rows in host memory (module docstring)."""

  bits: int = 8
  policy: str = "lfu"
  fraction: float = 0.05          # 0: no cache (int8 / int4 / int2)
  ways: int = DEFAULT_WAYS
  seed: int = 0
  host: bool = False
  components: ClassVar[dict[str, str]] = {
      "q": "values", "scale": "scales_biases", "bias": "scales_biases", "rows": "values",
      "cache_rows": "cache", "cache_tags": "tags", "counts": "counters",
      "cache_last": "counters"}

  def __post_init__(self):
    if self.bits not in (32, 8, 4, 2):
      raise ValueError(f"CachedQuantizedStorage: bits={self.bits}, expected 32, 8, 4 or 2")
    if self.fraction != 0:    # 0: no cache, the other settings unused
      check_cache(self.policy, self.fraction, self.ways,
                  lambda f, v: f"CachedQuantizedStorage: {f.removeprefix('cache_')}={v!r}")
    if (self.host or self.bits == 32) and self.fraction == 0:
      raise ValueError(f"CachedQuantizedStorage: bits={self.bits}, host={self.host} without "
                       "a cache (fraction 0); float32 rows and the host tier need the cache")

  # ------------------------------------------------------------------ configuration

  @property
  def cached(self) -> bool:
    return self.fraction > 0

  @property
  def counts_accesses(self) -> bool:   # type: ignore[override]
    return self.cached and self.policy == "lfu"

  def _per(self) -> int:
    return max(1, 8 // self.bits)

  @property
  def backing_keys(self) -> tuple[str, ...]:
    """The state keys of every row's stored values (the cache aside)."""
    return ("rows",) if self.bits == 32 else ("q", "scale", "bias")

  @property
  def host_keys(self) -> tuple[str, ...]:   # type: ignore[override]
    return self.backing_keys if self.host else ()

  def row_bytes_split(self, dim: int) -> tuple[float, float]:
    """(bytes of a row's stored values, its average share of the cache and counters)."""
    if self.bits == 32:
      rows = 4 * dim
    else:
      rows = quant.packed_width(dim, self.bits) + (8 if self.bits == 8 else 4)
    cache = 0.0
    if self.cached:
      cache += self.fraction * (4 * dim + 4 + (4 if self.policy == "lru" else 0))
      cache += 4 if self.policy == "lfu" else 0
    return rows, cache

  def bytes_per_row(self, dim: int) -> float:
    """Codes + scale and bias (or float32 values), plus per row the average share of the
    cache (row, tag, LRU time; the cache rounds up to whole sets, see `state_bytes` for a
    state's exact size) and the LFU counter; host and device memory together."""
    return sum(self.row_bytes_split(dim))

  # ------------------------------------------------------------------ state

  def init(self, key: jax.Array, num_rows: int, dim: int, scale: float) -> StorageState:
    storage_lib.check_size(type(self).__name__, num_rows, dim)
    return self.from_float(jax.random.uniform(key, (num_rows, dim), jnp.float32, -scale, scale))

  def from_float(self, rows_ND: jax.Array, shards: int = 1) -> StorageState:
    rows = jnp.asarray(rows_ND, jnp.float32)
    n, d = rows.shape
    if n % shards:
      raise ValueError(f"{type(self).__name__}.from_float: {n} rows do not split into "
                       f"{shards} equal blocks")
    self._check_width(d, "from_float")
    st = jax.vmap(self._from_block)(rows.reshape(shards, n // shards, d))
    return {k: v.reshape((-1,) + v.shape[2:]) for k, v in st.items()}

  def _check_width(self, d: int, where: str) -> None:
    if d % self._per():
      raise ValueError(f"{type(self).__name__}.{where}: rows of width {d} in int{self.bits}"
                       f" need a width that is a multiple of {self._per()} (whole bytes of "
                       "codes); pick another dim or column-wise chunking")

  def _from_block(self, rows_RD):
    r_, _ = rows_RD.shape
    if self.bits == 32:
      st = {"rows": rows_RD}
    else:
      qr = quant.quantize_rowwise(rows_RD, self.bits)
      st = {"q": qr.q, "scale": qr.scale, "bias": qr.bias}
    if self.cached:
      s, a = cache_geometry(r_, self.fraction, self.ways)
      tags = np.full(s * a, -1, np.int32)
      r = np.arange(min(r_, s * a))
      tags[(r % s) * a + r // s] = r
      st["cache_rows"] = jnp.where(jnp.asarray(tags >= 0)[:, None],
                                   rows_RD[np.maximum(tags, 0)], 0.0)
      st["cache_tags"] = jnp.asarray(tags)
      if self.policy == "lfu":
        st["counts"] = jnp.zeros((r_,), jnp.int32)
      else:
        st["cache_last"] = jnp.zeros((s * a,), jnp.int32)
    return st

  def to_float(self, state: StorageState, shards: int = 1) -> jax.Array:
    state = host_tier.fetch(state)
    blocks = {k: v.reshape((shards, -1) + v.shape[1:]) for k, v in state.items()}
    out = jax.vmap(self._block_to_float)(blocks)
    return out.reshape(-1, out.shape[-1])

  def _block_to_float(self, st):
    r_ = self.num_rows(st)
    rows = self._dequant(st, jnp.arange(r_))
    if self.cached:
      tags = st["cache_tags"]
      rows = rows.at[jnp.where(tags >= 0, tags, r_)].set(st["cache_rows"], mode="drop")
    return rows

  # ------------------------------------------------------------------ resharding

  def to_rows(self, state: StorageState, shards: int = 1) -> dict[str, np.ndarray]:
    """Per row: codes, scale, bias (bits=32: rows); with a cache also `cached` (bool), `cache_rows` (its
    float32 values where cached, else 0) and the policy's score (`counts` LFU, `last` LRU:
    the slot's last access, 0 where not cached)."""
    st = {k: np.asarray(jax.device_get(v)) for k, v in state.items()}
    out = {k: st[k] for k in self.backing_keys}
    if not self.cached:
      return out
    n, d = st[self.backing_keys[0]].shape[0], st["cache_rows"].shape[1]
    tags = st["cache_tags"].reshape(shards, -1)
    live = tags >= 0
    row = (tags + (np.arange(shards) * (n // shards))[:, None])[live]
    cached = np.zeros(n, bool)
    cached[row] = True
    values = np.zeros((n, d), np.float32)
    values[row] = st["cache_rows"].reshape(shards, -1, d)[live]
    out.update(cached=cached, cache_rows=values)
    if self.policy == "lfu":
      out["counts"] = st["counts"]
    else:
      last = np.zeros(n, np.int32)
      last[row] = st["cache_last"].reshape(shards, -1)[live]
      out["last"] = last
    return out

  def from_rows(self, rows: dict[str, np.ndarray], shards: int = 1,
                step: int = 0) -> StorageState:
    """Each block's cache rebuilt from the rows marked cached: in every set the A best by
    the policy's score (then lower row) stay, at ways in that order; the others are
    written back quantized as an eviction would (stochastic rounding at `step`). With the
    same blocks and geometry every cached row stays (the ways may differ)."""
    st = {k: np.array(rows[k]) for k in self.backing_keys}
    if not self.cached:
      return st
    n, d = rows["cache_rows"].shape
    r_ = n // shards
    s, a = cache_geometry(r_, self.fraction, self.ways)
    g = np.nonzero(rows["cached"])[0]                       # global rows, in order
    blk, r = g // r_, g % r_
    score = rows["counts" if self.policy == "lfu" else "last"][g].astype(np.int64)
    key = blk * s + r % s                                   # (block, set)
    order = np.lexsort((r, -score, key))
    g, r, key = g[order], r[order], key[order]
    rank = np.arange(len(g)) - np.searchsorted(key, key, side="left")
    keep = rank < a
    slot = key[keep] * a + rank[keep]                       # in the concatenated caches
    c = shards * s * a
    tags = np.full(c, -1, np.int32)
    tags[slot] = r[keep]
    values = np.zeros((c, d), np.float32)
    values[slot] = rows["cache_rows"][g[keep]]
    st.update(cache_rows=values, cache_tags=tags)
    if self.policy == "lfu":
      st["counts"] = np.array(rows["counts"])
    else:
      last = np.zeros(c, np.int32)
      last[slot] = rows["last"][g[keep]]
      st["cache_last"] = last
    out = g[~keep]
    if len(out) and self.bits == 32:
      st["rows"][out] = rows["cache_rows"][out]
    elif len(out):    # no room in the new cache: back to the codes, as an eviction writes
      qr = _evict_codes(self, jnp.asarray(_pad_rows(rows["cache_rows"][out])), jnp.int32(step))
      for k, v in (("q", qr.q), ("scale", qr.scale), ("bias", qr.bias)):
        st[k][out] = np.asarray(v)[:len(out)].astype(st[k].dtype)
    return st

  def zero_rows(self, num_rows: int, dim: int, shards: int = 1) -> dict[str, np.ndarray]:
    out = super().zero_rows(num_rows, dim, shards)
    if self.cached:    # from_float caches each block's first rows
      r_ = num_rows // shards
      s, a = cache_geometry(r_, self.fraction, self.ways)
      out["cached"] = np.tile(np.arange(r_) < min(r_, s * a), shards)
    return out

  def rows_to_float(self, rows: dict[str, np.ndarray]) -> np.ndarray:
    if self.bits == 32:
      out = np.array(rows["rows"], np.float32)
    else:
      n = rows["q"].shape[0]
      pad = lambda a: jnp.asarray(_pad_rows(np.asarray(a)))
      qr = quant.RowwiseQuantized(pad(rows["q"]), pad(rows["scale"]), pad(rows["bias"]),
                                  bits=self.bits, dim=rows["q"].shape[1] * self._per())
      out = np.array(quant.dequantize_rowwise(qr), np.float32)[:n]
    if self.cached:
      out[rows["cached"]] = rows["cache_rows"][rows["cached"]]
    return out

  def rows_from_float(self, values_RD, like=()):
    values = np.asarray(values_RD, np.float32)
    n = values.shape[0]
    self._check_width(values.shape[1], "from_float")
    if self.bits == 32:
      out = {"rows": values.copy()}
    else:
      qr = quant.quantize_rowwise(jnp.asarray(_pad_rows(values)), self.bits)
      out = {k: np.asarray(v)[:n] for k, v in (("q", qr.q), ("scale", qr.scale),
                                               ("bias", qr.bias))}
    if not self.cached:
      return out
    n = values.shape[0]
    agg = lambda key, f, dtype: (f([np.asarray(x[key]) for x in like if key in x], axis=0)
                                 if any(key in x for x in like) else np.zeros(n, dtype))
    cached = agg("cached", np.any, bool)
    out.update(cached=cached, cache_rows=np.where(cached[:, None], values, 0.0)
               .astype(np.float32))
    out["counts" if self.policy == "lfu" else "last"] = agg(
        "counts" if self.policy == "lfu" else "last", np.max, np.int32).astype(np.int32)
    return out

  def num_rows(self, state: StorageState) -> int:
    return state[self.backing_keys[0]].shape[0]

  def dim(self, state: StorageState) -> int:
    return state[self.backing_keys[0]].shape[1] * self._per()

  # ------------------------------------------------------------------ lookups

  def _dequant(self, st, r_M):
    """float32 rows [M, D] of the stored rows `r_M` (in range), FBGEMM's dequantization;
    read from host memory under the host tier."""
    take = lambda a: host_tier.take(a, r_M)
    if self.bits == 32:
      return take(st["rows"])
    qr = quant.RowwiseQuantized(take(st["q"]), take(st["scale"]), take(st["bias"]),
                                bits=self.bits, dim=self.dim(st))
    return quant.dequantize_rowwise(qr)

  def _find(self, st, r_M):
    """(hit [M], slot [M]) of rows `r_M` (in range) in the cache."""
    c = st["cache_tags"].shape[0]
    s, a = cache_geometry(self.num_rows(st), self.fraction, self.ways)
    assert s * a == c, (s, a, c)
    set_M = r_M % s
    ways_MA = st["cache_tags"].reshape(s, a).at[set_M].get(mode="promise_in_bounds")
    eq_MA = ways_MA == r_M[:, None]
    return jnp.any(eq_MA, axis=1), set_M * a + jnp.argmax(eq_MA, axis=1).astype(jnp.int32)

  def gather(self, state: StorageState, idx: jax.Array, *, clip: bool = False,
             live: jax.Array | None = None) -> jax.Array:
    r_ = self.num_rows(state)
    flat = idx.reshape(-1)
    r_M = jnp.clip(flat, 0, r_ - 1)
    if not self.cached:
      out = self._dequant(state, r_M)
    else:
      hit, slot = self._find(state, r_M)
      cached = state["cache_rows"].at[slot].get(mode="promise_in_bounds")
      read = lambda: jnp.where(hit[:, None], cached, self._dequant(state, r_M))
      if self.host:   # host memory is read only when a live row misses the cache
        used = hit if live is None else hit | ~live.reshape(-1)
        out = jax.lax.cond(jnp.all(used), lambda: jnp.where(hit[:, None], cached, 0.0), read)
      else:
        out = read()
    if not clip:
      out = jnp.where(((flat >= 0) & (flat < r_))[:, None], out, 0.0)
    return out.reshape(*idx.shape, out.shape[-1])

  def cache_slots(self, state: StorageState, idx: jax.Array) -> jax.Array:
    """The cache slot of each row `idx` (in range), -1 where it is not cached."""
    r_M = jnp.clip(idx.reshape(-1), 0, self.num_rows(state) - 1)
    hit, slot = self._find(state, r_M)
    return jnp.where(hit, slot, -1).reshape(idx.shape)

  def pallas_pool(self, state: StorageState, idx: jax.Array, coef: jax.Array) -> jax.Array:
    if self.host or self.bits == 32:   # the kernel reads neither host memory nor fp32 + cache
      return jnp.einsum("...l,...lw->...w", coef, self.gather(state, idx, clip=True))
    from kernels import embedding_bag   # dequantizes in the kernel, reads cached rows in fp32
    table = quant.RowwiseQuantized(state["q"], state["scale"], state["bias"], bits=self.bits,
                                   dim=self.dim(state))
    if not self.cached:
      return embedding_bag.embedding_bag(table, idx, coef)
    return embedding_bag.embedding_bag(table, idx, coef, cache_rows=state["cache_rows"],
                                       cache_slots=self.cache_slots(state, idx))

  # ------------------------------------------------------------------ updates

  def _quantize_sr(self, x_UD, old_UD, step, salt):
    u24 = storage_lib.sr_bits(old_UD, step, self.seed, salt) >> 8
    return quantize_rowwise_stochastic(x_UD, self.bits, u24)

  def _write_quantized(self, st, target_U, x_UD, old_UD, step, salt):
    """Rows `x_UD` quantized (stochastic rounding) into rows `target_U` (R: dropped);
    bits=32 writes them as they are. `old_UD()` gives the rows' previous values."""
    put = lambda a, v: host_tier.put(a, target_U, v)
    if self.bits == 32:
      return {**st, "rows": put(st["rows"], x_UD)}
    qr = self._quantize_sr(x_UD, old_UD(), step, salt)
    return {**st, "q": put(st["q"], qr.q), "scale": put(st["scale"], qr.scale),
            "bias": put(st["bias"], qr.bias)}

  def scatter(self, state: StorageState, idx: jax.Array, rows_UD: jax.Array, *,
              indices_are_sorted: bool = False, step: jax.Array | None = None) -> StorageState:
    r_, d = self.num_rows(state), self.dim(state)
    if rows_UD.shape != (*idx.shape, d):
      raise ValueError(
          f"{type(self).__name__}.scatter: rows shape {rows_UD.shape}, expected "
          f"{(*idx.shape, d)} for idx shape {idx.shape} and table dim {d}")
    flat = idx.reshape(-1)
    rows = jnp.asarray(rows_UD, jnp.float32).reshape(-1, d)
    valid = (flat >= 0) & (flat < r_)
    r_U = jnp.clip(flat, 0, r_ - 1)
    old = lambda st=state: self.gather(st, r_U, clip=True)   # they seed the rounding
    hit = jnp.zeros_like(valid)
    if self.cached:
      hit, slot = self._find(state, r_U)
      hit = hit & valid
      c = state["cache_tags"].shape[0]
      state = {**state, "cache_rows": state["cache_rows"].at[jnp.where(hit, slot, c)].set(
          rows, mode="drop")}
    target = jnp.where(valid & ~hit, flat, r_)
    if not self.host:
      return self._write_quantized(state, target, rows, old, step, _SALT_UPDATE)
    # Host memory is written (and, for codes, read) only when some row is not cached.
    back = jax.lax.cond(
        jnp.any(valid & ~hit),
        lambda b: self._write_quantized(b, target, rows, old, step, _SALT_UPDATE),
        lambda b: b, {k: state[k] for k in self.backing_keys})
    return {**state, **back}

  def prepare_update(self, state: StorageState, uniq_U: jax.Array, counts_U: jax.Array | None,
                     step: jax.Array) -> StorageState:
    if not self.cached:
      return state
    st = dict(state)
    r_U, valid, hit, slot, step1 = self._lookup(st, uniq_U, step)
    if self.policy == "lfu":
      # uniq_U's valid ids are distinct, so a gather-add-set is the scatter-add.
      st["counts"] = st["counts"].at[jnp.where(valid, uniq_U, self.num_rows(st))].set(
          _add_counts(st["counts"][r_U], _access_counts(counts_U, r_U)), mode="drop")
    if self.policy == "lru":
      c = st["cache_tags"].shape[0]
      st["cache_last"] = st["cache_last"].at[jnp.where(hit, slot, c)].set(step1, mode="drop")
    res_score, cand_score = self._scores(st, r_U, step1)
    return self._admit(st, r_U, valid & ~hit, cand_score, res_score, step, step1)

  def prefetch(self, state: StorageState, uniq_U: jax.Array, counts_U: jax.Array | None,
               step: jax.Array) -> StorageState:
    """Admits the rows `uniq_U` that step `step` will look up (the lookahead of the step
    before it) with `prepare_update`'s admission and eviction, ranked by the scores that
    step's `prepare_update` will see (LFU: the row's count plus `counts_U`; LRU: step + 1).
    Nothing of that step's accesses is recorded here, so nothing counts twice: LFU counts
    stay; LRU times change only for the admitted rows, to step + 1, the time that step
    gives them again. The cached rows that step reads are never evicted; rows that do not
    fit (a full set of them, LFU scores too low) stay where they are, for that step's
    `prepare_update` to admit as before."""
    if not self.cached:
      return state
    st = dict(state)
    r_U, valid, hit, slot, step1 = self._lookup(st, uniq_U, step)
    c = st["cache_tags"].shape[0]
    needed = jnp.zeros((c,), bool).at[jnp.where(hit, slot, c)].set(True, mode="drop")
    res_score, cand_score = self._scores(
        st, r_U, step1, _access_counts(counts_U, r_U) if self.policy == "lfu" else None)
    res_score = jnp.where(needed, jnp.iinfo(jnp.int32).max, res_score)
    return self._admit(st, r_U, valid & ~hit, cand_score, res_score, step, step1)

  def _lookup(self, st, uniq_U, step):
    """(rows r_U with padding at 0, valid, hit, slot, step + 1) of the distinct rows
    `uniq_U` (padding slots N) against the cache."""
    valid = (uniq_U >= 0) & (uniq_U < self.num_rows(st))
    r_U = jnp.where(valid, uniq_U, 0)
    hit, slot = self._find(st, r_U)
    return r_U, valid, hit & valid, slot, jnp.asarray(step, jnp.int32) + 1

  def _scores(self, st, r_U, step1, extra_counts_U=None):
    """(residents' scores [C], candidates' scores [U]) of the policy: LFU the counts
    (candidates' plus `extra_counts_U`), LRU the last access (candidates: step1); empty
    slots -1."""
    tags = st["cache_tags"]
    if self.policy == "lfu":
      cand = st["counts"][r_U]
      return (jnp.where(tags >= 0, st["counts"][jnp.maximum(tags, 0)], -1),
              cand if extra_counts_U is None else _add_counts(cand, extra_counts_U))
    return (jnp.where(tags >= 0, st["cache_last"], -1),
            jnp.broadcast_to(step1, r_U.shape))

  def _admit(self, st, r_U, miss, cand_score, res_score, step, step1):
    """In every set a candidate (`miss`: rows `r_U` not cached) maps to, the A best of its
    residents (scores `res_score` [C]) and candidates (`cand_score` [U]) stay (module
    docstring); each admitted row takes a dropped resident's slot, written back first."""
    r_ = self.num_rows(st)
    c = st["cache_tags"].shape[0]
    s, a = cache_geometry(r_, self.fraction, self.ways)
    u = r_U.shape[0]
    if u == 0:   # no rows (a step without ids): no candidate
      return st
    tags = st["cache_tags"]

    # Candidates sorted by (set, -score, row): a set keeps at most A of them, so its A best
    # candidates decide it, and G = min(U, S) groups of A candidates cover every set.
    g_max = min(u, s)
    big = jnp.iinfo(jnp.int32).max
    c_set, c_neg, c_row = jax.lax.sort(
        (jnp.where(miss, r_U % s, s), jnp.where(miss, -cand_score, big), r_U), num_keys=3)
    pos = jnp.arange(u, dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones((1,), bool), c_set[1:] != c_set[:-1]])
    rank_c = pos - jax.lax.cummax(jnp.where(start, pos, 0))
    grp = jnp.cumsum(start.astype(jnp.int32)) - 1       # < g_max for a real set's entries
    take = (c_set < s) & (rank_c < a)
    gi, ki = jnp.where(take, grp, g_max), jnp.where(take, rank_c, 0)
    gset = jnp.full((g_max,), s, jnp.int32).at[gi].set(c_set, mode="drop")      # [G]
    cand_row = jnp.full((g_max, a), -1, jnp.int32).at[gi, ki].set(c_row, mode="drop")
    cand_sc = jnp.full((g_max, a), -1, jnp.int32).at[gi, ki].set(-c_neg, mode="drop")
    grp_ok = gset < s
    cand_ok = (cand_row >= 0) & grp_ok[:, None]
    res_slot = jnp.where(grp_ok[:, None], gset[:, None] * a + jnp.arange(a), 0)   # [G, A]
    res_tag = tags[res_slot]
    # Entries [G, 2A] (residents, then candidates) ranked by (-score, resident first, row):
    # each entry's rank is the number of entries of its set that beat it, so the set keeps
    # the entries of rank < A. (Empty slots score -1; missing candidates rank last.)
    e_sc = jnp.concatenate([res_score[res_slot], jnp.where(cand_ok, cand_sc, -2)], axis=1)
    e_kind = jnp.concatenate([jnp.zeros((g_max, a), jnp.int32),
                              jnp.where(cand_ok, 1, 2)], axis=1)
    e_id = jnp.concatenate([jnp.where(res_tag >= 0, res_tag, r_ + res_slot),
                            jnp.where(cand_ok, cand_row, r_ + c + jnp.arange(a))], axis=1)
    sj, si = e_sc[:, :, None], e_sc[:, None, :]
    kj, ki_ = e_kind[:, :, None], e_kind[:, None, :]
    beats = (sj > si) | ((sj == si) & ((kj < ki_) | ((kj == ki_)
                                                      & (e_id[:, :, None] < e_id[:, None, :]))))
    rank = jnp.sum(beats, axis=1, dtype=jnp.int32)                                 # [G, 2A]
    kept = rank < a
    dropped = ~kept[:, :a] & grp_ok[:, None]
    admitted = kept[:, a:] & cand_ok

    def ordinal(flag, ranks):   # each flagged entry's index among its set's, by rank
      return jnp.sum(flag[:, :, None] & (ranks[:, :, None] < ranks[:, None, :]), axis=1,
                     dtype=jnp.int32)

    # The j-th admitted candidate (by rank) takes the slot of the j-th dropped resident.
    rows_g = jnp.broadcast_to(jnp.arange(g_max)[:, None], (g_max, a))
    pair = jnp.full((g_max, a), c, jnp.int32).at[
        jnp.where(dropped, rows_g, g_max), ordinal(dropped, rank[:, :a])].set(
            res_slot, mode="drop")
    to_slot = jnp.take_along_axis(pair, jnp.minimum(ordinal(admitted, rank[:, a:]), a - 1),
                                  axis=1)
    # Compacted to at most U admissions (each is a distinct candidate).
    n_out = min(u, g_max * a)
    flat_adm = admitted.reshape(-1)
    dest = jnp.where(flat_adm, jnp.cumsum(flat_adm.astype(jnp.int32)) - 1, n_out)
    new_slot = jnp.full((n_out,), c, jnp.int32).at[dest].set(to_slot.reshape(-1), mode="drop")
    new_row = jnp.zeros((n_out,), jnp.int32).at[dest].set(cand_row.reshape(-1), mode="drop")
    admit = new_slot < c
    slot_n = jnp.minimum(new_slot, c - 1)

    # Evict: write the leaving rows back quantized, then load the admitted rows.
    leave_tag = jnp.where(admit, tags[slot_n], -1)
    leave_rows = st["cache_rows"][slot_n]

    def move(back):
      back = self._write_quantized(back, jnp.where(leave_tag >= 0, leave_tag, r_), leave_rows,
                                   lambda: leave_rows, step, _SALT_EVICT)
      # Admitted rows were not cached, so their codes are current (none was written back).
      return back, self._dequant(back, new_row)

    back = {k: st[k] for k in self.backing_keys}
    if self.host:   # host memory is touched only when some row is admitted
      back, incoming = jax.lax.cond(
          jnp.any(admit), move,
          lambda b: (b, jnp.zeros((n_out, st["cache_rows"].shape[1]), jnp.float32)), back)
    else:
      back, incoming = move(back)
    st.update(back)
    put = jnp.where(admit, new_slot, c)
    st["cache_rows"] = st["cache_rows"].at[put].set(incoming, mode="drop")
    st["cache_tags"] = tags.at[put].set(new_row, mode="drop")
    if self.policy == "lru":
      st["cache_last"] = st["cache_last"].at[put].set(step1, mode="drop")
    return st



_COUNT_MAX = np.iinfo(np.int32).max


def _add_counts(a: jax.Array, b: jax.Array) -> jax.Array:
  """a + b for LFU counts (int32, >= 0), saturating at 2^31 - 1: a count that wrapped
  would turn negative and rank the hottest row below every other, evicting it for good
  (FBGEMM's lfu_state is int64; a hot row of a multi-hot feature passes 2^31 lookups
  within one epoch of Criteo 1TB)."""
  return jnp.where(a > _COUNT_MAX - b, _COUNT_MAX, a + b)


def _access_counts(counts_U, r_U) -> jax.Array:
  """Looked-up ids per row [U] int32 (None: one each)."""
  return (jnp.ones(r_U.shape, jnp.int32) if counts_U is None
          else counts_U.astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _evict_codes(storage: CachedQuantizedStorage, x_UD: jax.Array, step: jax.Array
                 ) -> quant.RowwiseQuantized:
  """The codes an eviction writes for the cached rows `x_UD` (stochastic rounding at `step`)."""
  return storage._quantize_sr(x_UD, x_UD, step, _SALT_EVICT)


def _pad_rows(x: np.ndarray) -> np.ndarray:
  """`x` with zero rows added up to a power of two: the host-side conversions compile once
  per size class, not once per table."""
  n = x.shape[0]
  p = 1 << max(0, (n - 1).bit_length())
  return x if p == n else np.concatenate([x, np.zeros((p - n,) + x.shape[1:], x.dtype)])
