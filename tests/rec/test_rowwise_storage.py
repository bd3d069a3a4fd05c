"""Mixed-precision rows with an fp32 cache (rec/embedding/rowwise_storage.py) and bf16 with
stochastic rounding (storage.py), built from their specs (storage_spec.py).

The cache against a plain-Python replay of its policy (LFU, LRU: which rows each set holds,
counters, after every step, alone and on every device of a sharded collection); a cache
holding every row against fp32 tables (one device, and every sharding kind on 8);
a partial cache sharded against one device where the devices hold the same rows; stochastic
rounding unbiased where nearest rounding is not; a resumed run equal to an uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from core import quant
from rec.embedding import optimizers as so
from rec.embedding import rowwise_storage as rs
from rec.embedding import storage as st
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import TableConfig
from rec.embedding.planner import TablePlacement
from rec.embedding.storage_spec import StorageSpec, make_storage


def _storage(name: str, seed: int = 0):
  return make_storage(StorageSpec.parse(name), seed)


class CacheReference:
  """Plain-Python replay of the cache policy of rowwise_storage's module docstring."""

  def __init__(self, num_rows: int, fraction: float, ways: int, policy: str):
    self.r, self.policy = num_rows, policy
    self.s, self.a = rs.cache_geometry(num_rows, fraction, ways)
    self.sets = [set() for _ in range(self.s)]
    for r in range(min(num_rows, self.s * self.a)):
      self.sets[r % self.s].add(r)
    self.counts = collections.Counter()
    self.last = {r: 0 for ways_ in self.sets for r in ways_}

  def cached(self) -> set[int]:
    return set().union(*self.sets)

  def step(self, touched: dict[int, int], step: int) -> tuple[set[int], set[int]]:
    """Rows looked up this step ({row: ids}) -> (evicted, admitted)."""
    if self.policy == "lfu":
      self.counts.update(touched)
    cached = self.cached()
    for r in touched:
      if r in cached and self.policy == "lru":
        self.last[r] = step + 1
    score = (lambda r: self.counts[r]) if self.policy == "lfu" else (lambda r: self.last[r])
    by_set = collections.defaultdict(list)
    for r in touched:
      if r not in cached:
        by_set[r % self.s].append(r)
    evicted, admitted = set(), set()
    for s, cands in by_set.items():
      res = sorted(self.sets[s])
      entries = ([(-score(r), 0, r) for r in res]
                 + [(1, 0, self.r + k) for k in range(self.a - len(res))]        # empty: -1
                 + [(-(self.counts[r] if self.policy == "lfu" else step + 1), 1, r)
                    for r in cands])
      keep = {e[2] for e in sorted(entries)[:self.a] if e[2] < self.r}
      evicted |= set(res) - keep
      admitted |= keep - set(res)
      self.sets[s] = keep
    for r in admitted:
      self.last[r] = step + 1
    for r in evicted:
      self.last.pop(r, None)
    return evicted, admitted

  def check(self, block: dict[str, np.ndarray]) -> None:
    """The storage state of one block holds exactly this replay's sets and counters."""
    tags = np.asarray(block["cache_tags"]).reshape(self.s, self.a)
    for s in range(self.s):
      assert set(tags[s][tags[s] >= 0].tolist()) == self.sets[s], (s, tags[s], self.sets[s])
    if self.policy == "lfu":
      counts = np.asarray(block["counts"])
      want = np.zeros(self.r, np.int64)
      for r, c in self.counts.items():
        want[r] = c
      np.testing.assert_array_equal(counts, want)
    else:
      last = np.asarray(block["cache_last"])
      for slot, r in enumerate(tags.reshape(-1)):
        if r >= 0:
          assert last[slot] == self.last[int(r)], (slot, r)


def _touched(idx, valid):
  return collections.Counter(int(i) for i, v in zip(np.ravel(idx), np.ravel(valid)) if v)


def _zipf_batch(rng, rows, m, dim):
  idx = (rng.zipf(1.3, m) - 1) % rows
  perm = np.random.default_rng(99).permutation(rows)       # hot rows scattered over sets
  idx = perm[idx].astype(np.int32)
  valid = rng.random(m) < 0.9
  return idx, rng.normal(size=(m, dim)).astype(np.float32), valid


@pytest.mark.parametrize("bits,policy", [
    (8, "lfu"), pytest.param(4, "lru", marks=pytest.mark.slow),
    pytest.param(4, "lfu", marks=pytest.mark.slow), pytest.param(8, "lru", marks=pytest.mark.slow)])
def test_policy_matches_plain_python(bits, policy):
  """30 optimizer steps of Zipf ids (duplicates, padding) on a 60-row table with a 20%
  3-way cache: the sets, counts and times equal the replay after every step."""
  rows, dim = 60, 8
  storage = rs.CachedQuantizedStorage(bits=bits, policy=policy, fraction=0.2, ways=3)
  table = storage.init(jax.random.key(0), rows, dim, 0.5)
  opt = so.SGD(0.1)
  state = opt.init_state(rows, dim)
  apply = jax.jit(lambda t, o, i, g, v, s: opt.apply(storage, t, o, i, g, v, s))
  ref = CacheReference(rows, 0.2, 3, policy)
  assert (ref.s, ref.a) == (4, 3)
  ref.check(table)
  rng = np.random.default_rng(1)
  moved = 0
  for step in range(30):
    idx, grads, valid = _zipf_batch(rng, rows, 24, dim)
    table, state = apply(table, state, idx, grads, valid, jnp.int32(step))
    evicted, admitted = ref.step(_touched(idx, valid), step)
    moved += len(evicted) + len(admitted)
    ref.check(table)
  assert moved > 10                          # the test exercised evictions and admissions


@pytest.mark.parametrize("policy", ["lru", pytest.param("lfu", marks=pytest.mark.slow)])
def test_admission_and_eviction_values(policy):
  """prepare_update changes no row's value but the evicted ones (written back quantized:
  within one quantization step of their cached value, FBGEMM's scale) and moves admitted
  rows' dequantized values into the cache exactly."""
  rows, dim = 40, 6
  storage = rs.CachedQuantizedStorage(bits=8, policy=policy, fraction=0.25, ways=2)
  rng = np.random.default_rng(2)
  x = rng.normal(size=(rows, dim)).astype(np.float32)
  table = storage.from_float(x)
  ref = CacheReference(rows, 0.25, 2, policy)
  prep = jax.jit(lambda t, u, c, s: storage.prepare_update(t, u, c, s))
  for step in range(6):
    before = np.asarray(storage.to_float(table))
    uniq = np.unique(rng.integers(0, rows, 12)).astype(np.int32)
    counts = rng.integers(1, 4, uniq.size).astype(np.int32)
    pad = np.full(16 - uniq.size, rows, np.int32)      # padding slots hold the sentinel
    table = prep(table, np.concatenate([uniq, pad]), np.concatenate([counts, pad * 0 + 9]),
                 jnp.int32(step))
    evicted, admitted = ref.step(dict(zip(uniq.tolist(), counts.tolist())), step)
    ref.check(table)
    after = np.asarray(storage.to_float(table))
    untouched = np.setdiff1d(np.arange(rows), list(evicted))
    np.testing.assert_array_equal(after[untouched], before[untouched])
    if evicted:
      ev = sorted(evicted)
      scale = np.asarray(table["scale"])[ev][:, None]
      assert (np.abs(after[ev] - before[ev]) <= scale * (1 + 1e-5) + 1e-7).all()
    assert set(admitted) <= ref.cached()


@pytest.mark.parametrize("bits", [8, 4])
def test_eviction_writes_back_the_updated_row(bits):
  """A one-slot LRU cache: an fp32 update of the cached row lives only in the cache; when a
  newer row takes the slot, the updated row is written back quantized (within one step of
  the new value, far from the old), and the newcomer's cached value is its dequantized row."""
  storage = rs.CachedQuantizedStorage(bits=bits, policy="lru", fraction=0.25, ways=1)
  rng = np.random.default_rng(11)
  x = rng.uniform(-1, 1, (4, 8)).astype(np.float32)
  table = storage.from_float(x)
  assert np.asarray(table["cache_tags"]).tolist() == [0]
  new_row = (x[0] + 0.5).astype(np.float32)
  table = jax.jit(storage.scatter)(table, jnp.array([0]), jnp.asarray(new_row[None]),
                                   step=jnp.int32(0))
  np.testing.assert_array_equal(table["cache_rows"][0], new_row)
  before_q = jax.tree.map(np.asarray, {k: table[k] for k in ("q", "scale", "bias")})
  np.testing.assert_allclose(  # the codes of row 0 still hold its initial value
      quant.dequantize_rowwise(quant.RowwiseQuantized(
          before_q["q"][:1], before_q["scale"][:1], before_q["bias"][:1], bits, 8))[0], x[0],
      atol=float(np.asarray(before_q["scale"][0], np.float32)) + 1e-6)
  table = jax.jit(storage.prepare_update)(table, jnp.array([1, 4, 4], jnp.int32), None,
                                          jnp.int32(1))
  assert np.asarray(table["cache_tags"]).tolist() == [1]
  back = np.asarray(jax.jit(storage.to_float)(table))
  step_0 = float(np.asarray(table["scale"][0], np.float32))
  assert np.abs(back[0] - new_row).max() <= step_0 * (1 + 1e-5) + 1e-6
  assert np.abs(back[0] - x[0]).max() > 0.4
  deq1 = quant.dequantize_rowwise(quant.quantize_rowwise(x[1:2], bits))[0]
  np.testing.assert_array_equal(table["cache_rows"][0], deq1)
  np.testing.assert_array_equal(back[2:], np.asarray(
      quant.dequantize_rowwise(quant.quantize_rowwise(x[2:], bits))))


def test_lfu_counts_saturate_instead_of_wrapping():
  """A hot row's LFU count near 2^31 (a multi-hot feature's hot row within one epoch of
  Criteo 1TB) saturates at 2^31 - 1: a wrapped, negative count would evict the hottest row
  for a cold one and never let it back. The lookahead's scores (count + the next step's
  lookups) saturate too."""
  big = np.iinfo(np.int32).max
  storage = rs.CachedQuantizedStorage(bits=8, policy="lfu", fraction=0.25, ways=1)
  x = np.random.default_rng(12).uniform(-1, 1, (8, 8)).astype(np.float32)
  table = storage.from_float(x)
  assert np.asarray(table["cache_tags"]).tolist() == [0, 1]      # 2 sets of 1 way
  table["counts"] = table["counts"].at[0].set(big - 5).at[2].set(1000)
  # Row 0 (set 0's resident) looked up 10 more times, row 2 (set 0, not cached) once.
  out = jax.jit(storage.prepare_update)(table, jnp.array([0, 2, 8, 8], jnp.int32),
                                        jnp.array([10, 1, 0, 0], jnp.int32), jnp.int32(0))
  assert np.asarray(out["counts"])[[0, 2]].tolist() == [big, 1001]
  assert np.asarray(out["cache_tags"]).tolist() == [0, 1]
  # Prefetch: row 2 at big - 3 with 10 lookups ahead outranks row 0 at big - 5.
  table["counts"] = table["counts"].at[2].set(big - 3)
  out = jax.jit(storage.prefetch)(table, jnp.array([2, 8], jnp.int32),
                                  jnp.array([10, 0], jnp.int32), jnp.int32(0))
  assert np.asarray(out["cache_tags"]).tolist() == [2, 1]
  np.testing.assert_array_equal(out["counts"], table["counts"])   # prefetch counts nothing


@pytest.mark.parametrize("name", ["int4_cache:lru:1:4",
                                  pytest.param("int8_cache:lfu:1", marks=pytest.mark.slow)])
def test_full_cache_equals_fp32(name):
  """A cache of every row: 5 lazy-Adam steps equal fp32 storage (lookups before each step,
  rows and state after; the two jitted programs may fuse the update differently, so to
  float32 rounding)."""
  rows, dim = 50, 8
  cached, fp32 = _storage(name), st.Fp32Storage()
  x = jax.random.uniform(jax.random.key(3), (rows, dim), jnp.float32, -0.5, 0.5)
  a, b = cached.from_float(x), fp32.from_float(x)
  opt = so.Adam(0.05)
  oa, ob = opt.init_state(rows, dim), opt.init_state(rows, dim)
  apply = jax.jit(opt.apply, static_argnums=0)
  gather = jax.jit(lambda s, t, i: s.gather(t, i), static_argnums=0)
  rng = np.random.default_rng(4)
  for step in range(5):
    idx, grads, valid = _zipf_batch(rng, rows, 32, dim)
    lookup = np.concatenate([idx, [-1, rows]]).astype(np.int32)   # out of range: zeros
    np.testing.assert_allclose(gather(cached, a, lookup), gather(fp32, b, lookup), rtol=1e-6,
                               atol=1e-7)
    a, oa = apply(cached, a, oa, idx, grads, valid, jnp.int32(step))
    b, ob = apply(fp32, b, ob, idx, grads, valid, jnp.int32(step))
  np.testing.assert_allclose(cached.to_float(a), b["rows"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(oa["m"], ob["m"], rtol=1e-6, atol=1e-7)
  assert not np.array_equal(b["rows"], x)


# ------------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_stochastic_quantization_unbiased(bits):
  """Rows [lo, hi, x...]: the mean of 4096 stochastic roundings of each x is x (within 5
  standard errors of the step-size Bernoulli), where nearest rounding is off by a fixed
  fraction of a step."""
  x = np.array([[-1.0, 1.0, 0.1234, -0.3817, 0.0071, 0.9]], np.float32)
  n = 4096
  rows = np.repeat(x, n, axis=0)
  u24 = jax.random.bits(jax.random.key(5), rows.shape, jnp.uint32) >> 8
  qr = jax.jit(rs.quantize_rowwise_stochastic, static_argnums=1)(rows, bits, u24)
  deq = np.asarray(quant.dequantize_rowwise(qr), np.float64)
  step = float(np.asarray(qr.scale, np.float32)[0])
  # min and max come back up to the format's own error (int4: its fp16 scale).
  bound = float(np.asarray(quant.rowwise_error_bound(qr))[0])
  np.testing.assert_allclose(deq[:, :2], np.broadcast_to(x[:, :2], (n, 2)), atol=bound)
  err = deq.mean(0)[2:] - x[0, 2:]
  assert (np.abs(err) < 5 * step / 2 / np.sqrt(n)).all(), (err, step)
  nearest = np.asarray(quant.dequantize_rowwise(quant.quantize_rowwise(x, bits)))[0, 2:]
  assert np.abs(nearest - x[0, 2:]).max() > 20 * np.abs(err).max()
  # The codes are the floor of the position or one above (clamped to the format's range).
  codes = np.asarray(quant.unpack_nbit(qr.q, bits, 6) if bits != 8 else qr.q).astype(float)
  v = (x[0] - np.float32(np.asarray(qr.bias, np.float32)[0])) * np.float32(1 / np.float32(step))
  lo = np.clip(np.floor(v), 0, 2**bits - 1)
  assert ((codes == lo) | (codes == np.minimum(lo + 1, 2**bits - 1))).all()


@pytest.mark.parametrize("name", ["bf16_sr", "int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_small_updates_survive_in_expectation(name):
  """The same small update on 4096 distinct rows (a quarter of a storage step, which
  nearest rounding loses entirely): the mean change is the update with stochastic
  rounding; each element lands on one of its two neighbours."""
  n, dim = 4096, 8
  storage = _storage(name, seed=7)
  rng = np.random.default_rng(6)
  x = rng.uniform(0.55, 0.95, (n, dim)).astype(np.float32)
  x[:, 0], x[:, 1] = 0.5, 1.0     # a fixed row range (min, max): the same grid before and after
  table = storage.from_float(x)
  old = np.asarray(storage.gather(table, jnp.arange(n)), np.float64)
  ulp = {"bf16_sr": 2.0 ** -8, "int8": 0.5 / 255, "int4": 0.5 / 15}[name]
  delta = np.zeros(dim, np.float32)
  delta[2:] = ulp / 4
  new = storage.scatter(table, jnp.arange(n), jnp.asarray(old + delta, jnp.float32),
                        step=jnp.int32(3))
  got = np.asarray(storage.gather(new, jnp.arange(n)), np.float64) - old
  sem = ulp / 2 / np.sqrt(n)
  np.testing.assert_allclose(got[:, 2:].mean(), ulp / 4, atol=5 * sem / np.sqrt(dim - 2))
  # The updated columns lie in [0.55, 0.95], on a grid of spacing `ulp` in every format
  # (bf16's in [0.5, 1) too): each moves by 0 or 1 ulp; columns 0, 1 (min, max) stay.
  assert np.isin(np.round(got[:, 2:] / ulp, 3), [0.0, 1.0]).all()
  np.testing.assert_array_equal(got[:, :2], 0.0)
  # Deterministic: same seed, step and rows -> the same bits; another step -> other bits.
  again = storage.scatter(table, jnp.arange(n), jnp.asarray(old + delta, jnp.float32),
                          step=jnp.int32(3))
  jax.tree.map(np.testing.assert_array_equal, again, new)
  other = storage.scatter(table, jnp.arange(n), jnp.asarray(old + delta, jnp.float32),
                          step=jnp.int32(4))
  assert not np.array_equal(np.asarray(storage.gather(other, jnp.arange(n))),
                            np.asarray(storage.gather(new, jnp.arange(n))))
  if name == "bf16_sr":      # nearest rounding drops the update
    rne = _storage("bf16").scatter(table, jnp.arange(n), jnp.asarray(old + delta,
                                                                          jnp.float32))
    np.testing.assert_array_equal(rne["rows"], table["rows"])
    assert new["rows"].dtype == jnp.bfloat16


def test_sr_bits_depend_on_the_row_not_its_position():
  old = np.random.default_rng(8).normal(size=(5, 4)).astype(np.float32)
  a = np.asarray(st.sr_bits(old, jnp.int32(2), 0, 1))
  b = np.asarray(st.sr_bits(old[::-1], jnp.int32(2), 0, 1))
  np.testing.assert_array_equal(a, b[::-1])
  assert len(np.unique(a)) == a.size
  for other in (st.sr_bits(old, jnp.int32(3), 0, 1), st.sr_bits(old, jnp.int32(2), 1, 1),
                st.sr_bits(old, jnp.int32(2), 0, 2)):
    assert (np.asarray(other) != a).mean() > 0.99
  # Bits are uniform: each of the 32 bits set about half the time over many rows.
  big = np.asarray(st.sr_bits(np.random.default_rng(9).normal(size=(4096, 8)).astype(
      np.float32), jnp.int32(0), 0, 1))
  frac = ((big[..., None] >> np.arange(32, dtype=np.uint32)) & 1).mean(axis=(0, 1))
  assert np.abs(frac - 0.5).max() < 0.02


# ------------------------------------------------------------------------- storage API


def test_names_sizes_and_errors():
  s = _storage("int8_cache")
  assert (s.bits, s.policy, s.fraction, s.ways) == (8, "lfu", 0.05, 16)
  assert _storage("int4_cache").fraction == 0.01
  s = _storage("int4_cache:lru:0.2:4")
  assert (s.bits, s.policy, s.fraction, s.ways) == (4, "lru", 0.2, 4)
  assert str(StorageSpec.parse("int4_cache:lru:0.2:4")) == "int4_cache:lru:0.2:4"
  assert str(StorageSpec.parse("int8")) == "int8" and not _storage("int8").cached
  assert _storage("int8").bits == 8
  assert str(StorageSpec.parse("bf16_sr")) == "bf16_sr"
  assert _storage("bf16_sr", seed=3) == st.Bf16Storage(rounding="stochastic", seed=3)
  for bad, msg in [("int3", "storage='int3': expected one of"),
                   ("int8:lru", "storage='int8:lru': expected one of"),
                   ("int8_cache:mru", "cache policy 'mru'"),
                   ("int8_cache:lfu:2", "cache fraction 2.0"),
                   ("int8_cache:lfu:x", "not a number")]:
    with pytest.raises(ValueError, match=msg):
      StorageSpec.parse(bad)
  with pytest.raises(ValueError, match="table 't' storage='int3'"):
    TableConfig("t", 10, 8, storage="int3")
  with pytest.raises(ValueError, match="width 5 in int4 need"):
    _storage("int4").from_float(jnp.zeros((4, 5)))
  # Bytes: state arrays against the per-row model (the cache rounds up to whole sets).
  for name, per_row in [("int8", 16 + 8), ("int4", 8 + 4),
                        ("int8_cache:lru:0.25:5", 16 + 8 + 0.25 * (64 + 8)),
                        ("int4_cache:lfu:0.25:5", 8 + 4 + 0.25 * (64 + 4) + 4)]:
    s = _storage(name)
    assert s.bytes_per_row(16) == per_row
    assert st.state_bytes(s.from_float(jnp.zeros((100, 16)))) == 100 * per_row


def test_component_bytes_split_the_state():
  """Bytes by component, counted by hand: 100 rows at dim 16, int8 with a 25% LRU cache
  of 5 ways (25 rows -> 5 sets x 5 ways), and fp32 rows."""
  s = _storage("int8_cache:lru:0.25:5")
  state = s.from_float(jnp.zeros((100, 16)))
  got = s.component_bytes(state)
  assert got == {"values": 100 * 16, "scales_biases": 100 * 8, "cache": 25 * 64,
                 "tags": 25 * 4, "counters": 25 * 4}
  assert sum(got.values()) == st.state_bytes(state)
  fp32 = _storage("fp32")
  assert fp32.component_bytes(fp32.from_float(jnp.zeros((10, 4)))) == {
      "values": 160, "scales_biases": 0, "cache": 0, "tags": 0, "counters": 0}
  with pytest.raises(ValueError, match="state key 'extra' is not one of"):
    fp32.component_bytes({"rows": jnp.zeros((2, 2)), "extra": jnp.zeros(3)})


@pytest.mark.parametrize("name", ["int8_cache:lfu:0.3:2", pytest.param("int4", marks=pytest.mark.slow)])
def test_gather_scatter_conventions(name):
  """Out-of-range ids gather zeros (clip=True reads a clamped row) and are dropped by
  scatter; a scattered cached row reads back exactly, an uncached one within a step."""
  storage = _storage(name)
  n, d = 20, 4
  table = jax.jit(storage.init, static_argnums=(1, 2, 3))(jax.random.key(10), n, d, 0.5)
  assert storage.num_rows(table) == n and storage.dim(table) == d
  to_float, gather = jax.jit(storage.to_float), jax.jit(storage.gather, static_argnames="clip")
  full = np.asarray(to_float(table))
  out = np.asarray(gather(table, jnp.array([[0, n - 1], [n, -1]])))
  np.testing.assert_array_equal(out[0], full[[0, n - 1]])
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_array_equal(gather(table, jnp.array([n + 3]), clip=True)[0], full[n - 1])
  vals = np.arange(3 * d, dtype=np.float32).reshape(3, d) / 10
  new = jax.jit(storage.scatter)(table, jnp.array([n, 2, -1]), jnp.asarray(vals),
                                 step=jnp.int32(0))
  back = np.asarray(to_float(new))
  keep = np.arange(n) != 2
  np.testing.assert_array_equal(back[keep], full[keep])
  if storage.cached:   # row 2 starts in the cache (rows 0 .. C-1 do)
    np.testing.assert_array_equal(back[2], vals[1])
  else:
    assert np.abs(back[2] - vals[1]).max() <= 0.3 / 15 + 1e-6


# -------------------------------------------------------------------- in the collection

TABLES = [TableConfig(f"t{i}", r, 8, pooling=("mean" if i % 2 else "sum"))
          for i, r in enumerate([37, 50, 13, 64, 29])]
B, L = 16, 3
KINDS = {
    "dp": lambda i: TablePlacement("dp", tuple(range(8))),
    "tw": lambda i: TablePlacement("tw", ((3 * i) % 8,)),
    "rw": lambda i: TablePlacement("rw", tuple(range(8))),
    "cw": lambda i: TablePlacement("cw", (i % 8, (i + 2) % 8, (i + 5) % 8)),
    "twrw": lambda i: TablePlacement("twrw", tuple(range(4 * (i % 2), 4 * (i % 2) + 4))),
}
KINDS["mixed"] = lambda i: KINDS[list(KINDS)[i % 5]](i)   # table i: kind i, one run for all


def _batches(steps, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    ids = np.stack([(rng.zipf(1.2, (B, L)) - 1) % t.num_rows for t in TABLES], 1).astype(np.int32)
    lengths = rng.integers(0, L + 1, (B, len(TABLES))).astype(np.int32)
    ids = np.where(np.arange(L) < lengths[..., None], ids, 0)
    weights = rng.uniform(0.5, 1.5, (B, len(TABLES), L)).astype(np.float32)
    target = rng.normal(size=(B, len(TABLES), 8)).astype(np.float32)
    out.append((ids, lengths, weights, target))
  return out


def _train(mesh, plan, storage, steps=4, seed=0):
  """Tables after `steps` sparse Adagrad steps, and each step's per-device lookups."""
  tables = [dataclasses.replace(t, storage=storage) for t in TABLES]
  coll = EmbeddingCollection(tables, plan, mesh, so.get_sparse_optimizer("adagrad", 0.1))
  state = coll.init(jax.random.key(0))

  @jax.jit
  def step(state, s, ids, lengths, weights, target):
    lk = coll.gather(state, ids, lengths, weights)

    def loss(partial):
      return jnp.sum((coll.pool(lk, partial) - target) ** 2)

    return coll.apply_gradients(state, lk, jax.grad(loss)(lk.partial), s), lk

  lookups = []
  for s, batch in enumerate(_batches(steps, seed)):
    state, lk = step(state, jnp.int32(s), *mesh_lib.shard_batch(batch, mesh, mesh_lib.REC_RULES))
    lookups.append(jax.device_get((lk.index, lk.valid)))
  return coll, state, lookups


@pytest.fixture(scope="module")
def mesh8():
  return mesh_lib.make_mesh("data:2,model:4")


@pytest.fixture(scope="module")
def mesh1():
  return mesh_lib.make_mesh("data:1", jax.devices()[:1])


@pytest.fixture(scope="module")
def fp32_reference(mesh1):
  coll, state, _ = _train(mesh1, {t.name: TablePlacement("tw", (0,)) for t in TABLES}, "fp32")
  return coll.to_tables(state)


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind", ["rw"] + [pytest.param(k, marks=pytest.mark.slow)
                                           for k in KINDS if k != "rw"])
def test_full_cache_sharded_equals_fp32_single_device(kind, mesh8, fp32_reference):
  """Every sharding kind (mixed: one table of each) with a cache of every row: the tables
  after sparse Adagrad steps are those of fp32 tables on one device."""
  storage = "int4_cache:lru:1:4" if kind in ("rw", "twrw") else "int8_cache:lfu:1"
  coll, state, _ = _train(mesh8, {t.name: KINDS[kind](i) for i, t in enumerate(TABLES)}, storage)
  tables = coll.to_tables(state)
  for n, want in fp32_reference.items():
    np.testing.assert_allclose(tables[n], want, rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind", ["tw", pytest.param("dp", marks=pytest.mark.slow)])
def test_partial_cache_sharded_equals_single_device(kind, mesh8, mesh1):
  """A 30% LFU cache: replicated tables, or all tables on device 5 of 8, hold the rows one
  device holds, so the caches decide alike and the tables agree."""
  storage = "int8_cache:lfu:0.3:2"
  one = _train(mesh1, {t.name: TablePlacement("tw", (0,)) for t in TABLES}, storage)
  place = (lambda i: TablePlacement("tw", (5,))) if kind == "tw" else KINDS["dp"]
  eight = _train(mesh8, {t.name: place(i) for i, t in enumerate(TABLES)}, storage)
  a, b = one[0].to_tables(one[1]), eight[0].to_tables(eight[1])
  init = one[0].init_tables(jax.random.key(0))
  for n in a:
    np.testing.assert_allclose(b[n], a[n], rtol=1e-5, atol=1e-6, err_msg=n)
    assert np.abs(a[n] - init[n]).max() > 1e-3
  for name in eight[0].groups:     # the same rows cached (tags of the one block)
    tags8 = np.asarray(eight[1][name]["table"]["cache_tags"]).reshape(eight[0].shards(name), -1)
    tags1 = np.asarray(next(iter(one[1].values()))["table"]["cache_tags"])
    np.testing.assert_array_equal(tags8[5 if kind == "tw" else 0], tags1)


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind,policy", [
    pytest.param("rw", "lfu", marks=pytest.mark.slow),
    pytest.param("twrw", "lru", marks=pytest.mark.slow),
    pytest.param("cw", "lru", marks=pytest.mark.slow)])
def test_every_device_cache_follows_the_policy(kind, policy, mesh8):
  """Row-sharded caches live per device: each device's sets and counters equal the plain
  Python replay of the rows that device's lookups touched, step by step."""
  storage = f"int8_cache:{policy}:0.3:2"
  coll, state, lookups = _train(mesh8, {t.name: KINDS[kind](i) for i, t in enumerate(TABLES)},
                                storage, steps=5)
  (name, g), = coll.groups.items()
  rows = g.rows_per_device
  refs = [CacheReference(rows, 0.3, 2, policy) for _ in range(8)]
  for s, (index, valid) in enumerate(lookups):
    for d in range(8):
      idx = np.split(np.asarray(index[name]), 8)[d]
      ok = np.split(np.asarray(valid[name]), 8)[d]
      refs[d].step(_touched(idx, ok), s)
  tbl = jax.device_get(state[name]["table"])
  moved = 0
  for d in range(8):
    block = {k: np.split(v, 8)[d] for k, v in tbl.items()}
    refs[d].check(block)
    moved += len(refs[d].cached() - set(range(refs[d].s * refs[d].a)))
  assert moved > 0


@pytest.mark.devices(8)
def test_bf16_sr_sharded_equals_single_device(mesh8, mesh1):
  """Stochastic rounding seeded by each row's value, not its position: rw over 8 devices
  rounds as one device does (fp32 sums may differ in the last bit, so a rounding may
  flip: allowed on at most 0.5% of elements, by one bf16 ulp)."""
  one = _train(mesh1, {t.name: TablePlacement("tw", (0,)) for t in TABLES}, "bf16_sr", steps=5)
  eight = _train(mesh8, {t.name: KINDS["rw"](i) for i, t in enumerate(TABLES)}, "bf16_sr",
                 steps=5)
  a, b = one[0].to_tables(one[1]), eight[0].to_tables(eight[1])
  diff = np.concatenate([(a[n] != b[n]).ravel() for n in a])
  assert diff.mean() <= 0.005, diff.mean()
  for n in a:
    np.testing.assert_allclose(b[n], a[n], rtol=2 ** -7, err_msg=n)


@pytest.mark.slow   # ~50 s: two DLRM runs through core.train and orbax
@pytest.mark.devices(2)
@pytest.mark.parametrize("storage", ["int4_cache", "bf16_sr"])
def test_resume_is_exact(storage, tmp_path):
  """DLRM on 2 devices (row-wise tables) through core.train: 6 straight steps == 3,
  checkpoint (orbax), resume, 3 more, every array of the state bit for bit."""
  from core import train as train_lib
  from rec import configs
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=300, batch_size=64,
                             eval_batch_size=64, eval_batches=1, storage=storage,
                             cache_policy="lru", cache_fraction=0.1, sharding="rw",
                             mesh="data:2")
  outs = []
  for name, stops in (("straight", [None]), ("resumed", [3, None])):
    for stop in stops:
      task, train_src, eval_src, _, _ = configs.build_run(cfg, devices=jax.devices()[:2])
      out = train_lib.train(task, train_src.batches, None, train_lib.TrainConfig(
          workdir=str(tmp_path / name), steps=6, stop_at_step=stop, resume=stop is None
          and name == "resumed", log_every=100, tensorboard=False))
    outs.append(jax.device_get(out["state"]))
  assert outs[0]["step"] == outs[1]["step"] == 6
  jax.tree.map(np.testing.assert_array_equal, outs[0], outs[1])
  emb = next(iter(outs[0]["emb"].values()))["table"]
  assert set(emb) >= ({"q", "cache_tags", "cache_last"} if storage == "int4_cache" else {"rows"})
