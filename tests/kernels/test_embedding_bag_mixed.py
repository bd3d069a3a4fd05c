"""The embedding-bag kernel on mixed-precision tables: N-bit rows (int4 / int2, FBGEMM
SBHalf) dequantized in the kernel, and an fp32 cache of hot rows read per position.

Against the jnp reference and a numpy brute force; run in Pallas' interpreter on CPU, as a
`gpu`-marked compiled class (skips without a GPU), and lowered ahead of time for an H100
(Triton modules verified by MLIR); then through the embedding collection, where
lookup_impl="pallas" must give the XLA path's numbers on a cached int4 table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import quant
from kernels import embedding_bag as eb
from tests.kernels.test_embedding_bag import _lower_for_gpu

# (rows per table, dim, batch, bag length, launch config)
CASES = {
    "multihot": dict(rows=[13, 50, 7], dim=12, batch=6, bag_len=5),
    "blocks": dict(rows=[20, 9], dim=40, batch=7, bag_len=3, block_bags=4, block_dim=16),
}


def _case(name, bits, cached, seed=0):
  """(table, flat ids, local ids, offsets, coef, cache kwargs, dense rows per position)."""
  c = CASES[name]
  rng = np.random.default_rng(seed)
  rows, dim, L = c["rows"], c["dim"], c["bag_len"]
  F = len(rows)
  offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int32)
  full = rng.normal(size=(sum(rows), dim)).astype(np.float32)
  local = np.stack([rng.integers(0, r, (c["batch"], L)) for r in rows], -2).astype(np.int32)
  lengths = rng.integers(0, L + 1, (c["batch"], F))
  live = np.arange(L) < lengths[..., None]
  local = np.where(live, local, rng.choice([-7, 10**6], size=local.shape)).astype(np.int32)
  coef = np.where(live, rng.uniform(0.5, 1.5, local.shape), 0.0).astype(np.float32)
  flat = np.where(live, local + offsets[:, None], local).astype(np.int32)
  table = (quant.quantize_rowwise_nbit(full, bits) if bits != "8f"
           else quant.quantize_rowwise_int8(full))
  kw = {}
  if cached:
    cache = rng.normal(size=(9, dim)).astype(np.float32)
    slots = np.where(rng.random(local.shape) < 0.4, rng.integers(0, 9, local.shape), -1)
    kw = dict(cache_rows=jnp.asarray(cache), cache_slots=jnp.asarray(slots, jnp.int32))
  return table, flat, local, offsets, coef, kw


def _numpy_bags(table, ids, coef, cache_rows=None, cache_slots=None):
  rows = np.asarray(quant.dequantize_rowwise(table), np.float64)
  out = np.zeros((*ids.shape[:-1], rows.shape[1]))
  for pos in np.ndindex(*ids.shape):
    i = ids[pos]
    if not 0 <= i < rows.shape[0]:
      continue
    row = rows[i]
    if cache_slots is not None and np.asarray(cache_slots)[pos] >= 0:
      row = np.asarray(cache_rows, np.float64)[np.asarray(cache_slots)[pos]]
    out[pos[:-1]] += np.float64(coef[pos]) * row
  return out


def _kw(name):
  return {k: CASES[name][k] for k in ("block_bags", "block_dim") if k in CASES[name]}


VARIANTS = [(4, False), (4, True), (2, True), (8, True), ("8f", True)]   # "8f": int8 SBFloat
_FAST = [("multihot", 4, True), ("blocks", 4, False), ("blocks", 2, True), ("multihot", "8f", True)]
FORWARD = _FAST + [pytest.param(n, b, c, marks=pytest.mark.slow) for n in CASES
                   for b, c in VARIANTS if (n, b, c) not in _FAST]


def test_reference_matches_numpy():
  for bits, cached in VARIANTS:
    table, flat, _, _, coef, kw = _case("multihot", bits, cached)
    np.testing.assert_allclose(eb.embedding_bag_reference(table, flat, coef, **kw),
                               _numpy_bags(table, flat, coef, **kw), rtol=1e-5, atol=1e-5)


class MixedCases:
  """Kernel cases; subclasses set `interpret`."""

  interpret: bool = True

  @pytest.mark.parametrize("name,bits,cached", FORWARD)
  def test_forward(self, name, bits, cached):
    table, flat, _, _, coef, kw = _case(name, bits, cached)
    got = eb.embedding_bag(table, flat, coef, interpret=self.interpret, **kw, **_kw(name))
    np.testing.assert_allclose(got, eb.embedding_bag_reference(table, flat, coef, **kw),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got)).max() > 0.1

  def test_offsets_in_kernel(self):
    table, flat, local, offsets, coef, kw = _case("multihot", 4, True)
    got = eb.embedding_bag(table, np.where(coef != 0, local, -1), coef, offsets=offsets,
                           interpret=self.interpret, **kw)
    np.testing.assert_allclose(got, eb.embedding_bag_reference(table, flat, coef, **kw),
                               rtol=1e-5, atol=1e-5)

  def test_gradients_in_coef_and_cache_rows(self):
    table, flat, _, _, coef, kw = _case("multihot", 4, True)
    g = np.random.default_rng(3).normal(size=coef.shape[:-1] + (12,)).astype(np.float32)

    def loss(fn):
      return lambda c, cr: jnp.sum(fn(table, flat, c, cache_rows=cr,
                                      cache_slots=kw["cache_slots"]) * g)

    kernel = jax.grad(loss(lambda *a, **k: eb.embedding_bag(*a, interpret=self.interpret, **k)),
                      (0, 1))(coef, kw["cache_rows"])
    want = jax.grad(loss(eb.embedding_bag_reference), (0, 1))(coef, kw["cache_rows"])
    for a, b in zip(kernel, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


class TestMixedInterpret(MixedCases):
  interpret = True


@pytest.mark.gpu
class TestMixedCompiled(MixedCases):
  interpret = False

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas (Triton) kernels need a GPU backend")


def test_errors():
  table, flat, _, _, coef, kw = _case("multihot", 4, True)
  with pytest.raises(ValueError, match="go together"):
    eb.embedding_bag(table, flat, coef, cache_rows=kw["cache_rows"], interpret=True)
  with pytest.raises(ValueError, match=r"expected float32 \[C, 12\]"):
    eb.embedding_bag(table, flat, coef, cache_rows=kw["cache_rows"][:, :4],
                     cache_slots=kw["cache_slots"], interpret=True)
  with pytest.raises(ValueError, match="ids' shape"):
    eb.embedding_bag(table, flat, coef, cache_rows=kw["cache_rows"],
                     cache_slots=kw["cache_slots"][..., :2], interpret=True)
  packed = eb.pack_int8(quant.quantize_rowwise_int8(np.ones((4, 12), np.float32)))
  with pytest.raises(NotImplementedError, match="a cache with PackedInt8Rows"):
    eb.embedding_bag(packed, flat, coef, interpret=True, **kw)
  with pytest.raises(ValueError, match=r"expected \[R, 6\]"):
    eb.embedding_bag(dataclasses.replace(table, q=table.q[:, :5]), flat, coef, interpret=True)


@pytest.mark.parametrize("bits", [4, "8f"])
def test_lowers_to_triton_for_h100(bits):
  """int4 (byte loads, shifts, fp16 scale / bias) and int8 tables with a cache lower to one
  verified Triton module each."""
  table, flat, local, offsets, coef, kw = _case("multihot", bits, True)
  b = table.bits

  def fn(q, s, bias, i, c, o, cr, sl):
    return eb.embedding_bag(quant.RowwiseQuantized(q, s, bias, b, 12), i, c, offsets=o,
                            cache_rows=cr, cache_slots=sl, interpret=False)

  mods = _lower_for_gpu(fn, table.q, table.scale, table.bias, local, coef, offsets,
                        kw["cache_rows"], kw["cache_slots"])
  assert len(mods) == 1 and "scf.for" in mods[0]
  assert mods[0].count("tt.load") >= 6            # ids, coef, slots, codes, scale/bias, cache
  if bits == 4:
    assert "arith.shrui" in mods[0] and "f16" in mods[0]


# ------------------------------------------------------------- in the embedding collection


@pytest.mark.devices(8)
def test_collection_pallas_equals_xla_on_cached_int4():
  """A 30% LRU int4 cache, row-wise over 8 devices: the Pallas lookups (int4 dequantized in
  the kernel, cached rows read in fp32) equal the XLA path's, every step, and so do the
  tables after the sparse updates."""
  from core import mesh as mesh_lib
  from rec.embedding import optimizers as opt_lib
  from rec.embedding.collection import EmbeddingCollection
  from rec.embedding.config import TableConfig
  from rec.embedding.planner import TablePlacement

  tables = [TableConfig(n, r, 8, pooling=p, storage="int4_cache:lru:0.3:2")
            for n, r, p in [("t0", 37, "sum"), ("t1", 50, "mean"), ("t2", 13, "sum")]]
  plan = {t.name: TablePlacement("rw", tuple(range(8))) for t in tables}
  mesh = mesh_lib.make_mesh("data:2,model:4")
  rng = np.random.default_rng(0)
  B, L, F = 16, 3, len(tables)
  ids = np.stack([(rng.zipf(1.3, (B, L)) - 1) % t.num_rows for t in tables], 1).astype(np.int32)
  lengths = rng.integers(0, L + 1, (B, F)).astype(np.int32)
  ids = np.where(np.arange(L) < lengths[..., None], ids, 0)
  target = rng.normal(size=(B, F, 8)).astype(np.float32)
  batch = mesh_lib.shard_batch((ids, lengths, target), mesh, mesh_lib.REC_RULES)

  def run(impl):
    coll = EmbeddingCollection(tables, plan, mesh, opt_lib.get_sparse_optimizer("adagrad", 0.1),
                               lookup_impl=impl)

    @jax.jit
    def step(state, s, ids, lengths, target):
      lk = coll.gather(state, ids, lengths)
      emb, vjp = jax.vjp(lambda p: coll.pool(lk, p), lk.partial)
      (g,) = vjp(2 * (emb - target))
      return coll.apply_gradients(state, lk, g, s), emb

    state = coll.init(jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(step)(state, jnp.int32(0), *batch))
    embs = []
    for s in range(3):
      state, emb = step(state, jnp.int32(s), *batch)
      embs.append(np.asarray(emb))
    return embs, coll.to_tables(state), jaxpr.count("pallas_call[")

  embs_x, tables_x, n_x = run("xla")
  embs_p, tables_p, n_p = run("pallas")
  assert n_x == 0 and n_p == 2
  for a, b in zip(embs_p, embs_x):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for n in tables_x:
    np.testing.assert_allclose(tables_p[n], tables_x[n], rtol=1e-5, atol=1e-6, err_msg=n)
