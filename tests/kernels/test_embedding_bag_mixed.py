"""The embedding-bag kernel on mixed-precision tables: N-bit rows (int4 / int2, FBGEMM
SBHalf) dequantized in the kernel, and an fp32 cache of hot rows read per position.

Against the jnp reference and a numpy brute force; run in Pallas' interpreter on CPU, as a
`gpu`-marked compiled class (skips without a GPU), and lowered ahead of time for an H100
(Triton modules verified by MLIR); then through the embedding collection, where
lookup_impl="pallas" must give the XLA path's numbers on a cached int4 table.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import quant
from kernels import embedding_bag as eb
from tests.kernels.test_embedding_bag import _lower_for_gpu
from tests import peer_env
from tests.peer_env import peer_python

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


  @pytest.mark.parametrize("bits", [4, 2])
  def test_gradients_in_nbit_scale_and_bias(self, bits):
    """The float16 scale and bias of N-bit rows get autodiff's gradients of the reference
    (not silently zero): sum over a row's positions of <codes, id grad> and of the
    id grad, in float32, rounded once to float16. Tolerance: that rounding (2^-11 relative)
    on top of float32 sums added in another order."""
    table, flat, _, _, coef, _ = _case("multihot", bits, False)
    g = np.random.default_rng(4).normal(size=coef.shape[:-1] + (12,)).astype(np.float32)

    def loss(fn):
      return lambda s, b: jnp.sum(fn(dataclasses.replace(table, scale=s, bias=b), flat, coef) * g)

    kernel = jax.grad(loss(lambda *a: eb.embedding_bag(*a, interpret=self.interpret)),
                      (0, 1))(table.scale, table.bias)
    want = jax.grad(loss(eb.embedding_bag_reference), (0, 1))(table.scale, table.bias)
    for a, b in zip(kernel, want):
      assert a.dtype == b.dtype == jnp.float16
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      assert np.abs(b).max() > 1.0
      np.testing.assert_allclose(a, b, rtol=2.0 ** -10, atol=2.0 ** -10 * np.abs(b).max())

  def test_bags_of_length_zero(self):
    """ids [..., 0] (every bag empty: a batch whose longest bag is empty) pool to zeros, for
    the kernel and the reference, with gradients of the right shapes (not a crash in a
    reshape, nor a kernel that traces a load of an empty id tile)."""
    table, _, _, _, _, kw = _case("multihot", 4, True)
    ids = np.zeros((6, 3, 0), np.int32)
    coef = np.zeros((6, 3, 0), np.float32)
    slots = np.zeros((6, 3, 0), np.int32)
    kw = dict(cache_rows=kw["cache_rows"], cache_slots=slots)
    got = eb.embedding_bag(table, ids, coef, interpret=self.interpret, **kw)
    np.testing.assert_array_equal(got, np.zeros((6, 3, 12), np.float32))
    np.testing.assert_array_equal(eb.embedding_bag_reference(table, ids, coef, **kw), got)
    d_coef, d_scale = jax.grad(
        lambda c, s: jnp.sum(eb.embedding_bag(dataclasses.replace(table, scale=s), ids, c,
                                              interpret=self.interpret, **kw)),
        (0, 1))(coef, table.scale)
    assert d_coef.shape == (6, 3, 0) and not np.asarray(d_scale).any()
    np.testing.assert_array_equal(
        eb.embedding_bag_id_grads(coef, np.ones((6, 3, 12)), interpret=self.interpret),
        np.zeros((0, 12)))


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
  # Layouts the kernel would read wrong without a word: int4 codes with float32 scales
  # (read as one code per column), int8 codes narrower than D, a scale per row missing.
  wide = dataclasses.replace(table, scale=table.scale.astype(jnp.float32),
                             bias=table.bias.astype(jnp.float32))
  with pytest.raises(ValueError, match="int4 codes with float32 scale and bias, expected float16"):
    eb.embedding_bag(wide, flat, coef, interpret=True)
  int8 = quant.quantize_rowwise_int8(np.ones((70, 12), np.float32))
  with pytest.raises(ValueError, match=r"int8 codes \(70, 8\).*expected \[R, 12\], \[R\] and \[R\]"):
    eb.embedding_bag(dataclasses.replace(int8, q=int8.q[:, :8]), flat, coef, interpret=True)
  with pytest.raises(ValueError, match=r"scale \(69,\).*expected \[R, 6\], \[R\] and \[R\]"):
    eb.embedding_bag(dataclasses.replace(table, scale=table.scale[:-1]), flat, coef,
                     interpret=True)


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


# ------------------------------------------------------------- FBGEMM (peer environment)

_FBGEMM_TBE = r'''
import sys
import numpy as np, torch, fbgemm_gpu
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
    IntNBitTableBatchedEmbeddingBagsCodegen)
inp = dict(np.load(sys.argv[1]))
kind = {8: SparseType.INT8, 4: SparseType.INT4, 2: SparseType.INT2}
specs = [(f"t{i}", inp[f"q{i}"].shape[0], int(inp[f"dim{i}"]), kind[int(b)],
          EmbeddingLocation.HOST) for i, b in enumerate(inp["bits"])]
tbe = IntNBitTableBatchedEmbeddingBagsCodegen(specs, output_dtype=SparseType.FP32, device="cpu")
tbe.fill_random_weights()
for i, (codes, sb, _) in enumerate(tbe.split_embedding_weights_with_scale_bias(1)):
    codes.copy_(torch.from_numpy(inp[f"q{i}"]))
    sb.copy_(torch.from_numpy(np.stack([inp[f"s{i}"], inp[f"b{i}"]], 1).view(np.uint8)))
out = tbe(torch.from_numpy(inp["indices"]), torch.from_numpy(inp["offsets"]),
          torch.from_numpy(inp["weights"]))
np.save(sys.argv[2], out.numpy())
'''


@pytest.mark.peer
def test_pooled_nbit_bags_equal_fbgemm_tbe(tmp_path):
  """FBGEMM's own CPU inference TBE (IntNBitTableBatchedEmbeddingBagsCodegen, SUM pooling,
  per-sample weights) on the same SBHalf rows: int8 / int4 / int2 tables of widths 6, 12, 8
  (not all multiples of 8 codes), bags of lengths 0, 1, 2 and full, the last row looked up.
  Both dequantize q * scale + bias in float32 and add up to 4 terms: a few float32 ulps of
  the largest term apart."""
  peer = peer_python("TORCHREC_PEER_PYTHON")
  if not os.path.exists(peer):
    pytest.skip(f"peer environment absent ({peer})")
  rng = np.random.default_rng(0)
  b, L = 5, 4
  lengths = np.array([0, L, 1, 2, L])
  live = np.arange(L) < lengths[:, None]
  tables, inp, indices, weights = [], {}, [], []
  for i, (bits, rows, dim) in enumerate([(8, 17, 6), (4, 11, 12), (2, 9, 8)]):
    t = quant.quantize_rowwise_nbit(rng.normal(size=(rows, dim)).astype(np.float32), bits)
    ids = rng.integers(0, rows, (b, L)).astype(np.int32)
    ids[1] = rows - 1
    w = rng.uniform(-1, 1, (b, L)).astype(np.float32)
    tables.append((t, ids, np.where(live, w, 0.0).astype(np.float32)))
    inp.update({f"q{i}": np.asarray(t.q), f"s{i}": np.asarray(t.scale),
                f"b{i}": np.asarray(t.bias), f"dim{i}": np.array(dim)})
    indices.append(ids[live])
    weights.append(w[live])
  inp["bits"] = np.array([8, 4, 2])
  inp["indices"] = np.concatenate(indices).astype(np.int32)
  inp["weights"] = np.concatenate(weights).astype(np.float32)
  inp["offsets"] = np.concatenate([[0], np.cumsum(np.tile(lengths, 3))]).astype(np.int32)
  np.savez(tmp_path / "in.npz", **inp)
  peer_env.run_script(peer, _FBGEMM_TBE, tmp_path, "fbgemm_gpu", out="out.npy")
  fb = np.load(tmp_path / "out.npy")
  col = 0
  for t, ids, coef in tables:
    want = fb[:, col:col + t.dim]
    col += t.dim
    got = eb.embedding_bag(t, ids, coef, interpret=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2.0 ** -23 * np.abs(want).max(),
                               err_msg=f"int{t.bits}")
    assert not np.asarray(got[0]).any()              # the empty bag
  assert col == fb.shape[1]
