"""Table-batched embedding-bag kernel against its jnp reference and a numpy brute force.

Every case runs twice (JAX's Pallas test pattern): `TestEmbeddingBagInterpret` through
Pallas' interpreter on CPU, `TestEmbeddingBagCompiled` compiled on a GPU (`-m gpu`). On
CPU, `test_lowers_to_triton_for_h100` also lowers each variant to a verified Triton
module for an H100 target, which catches block-shape and dtype errors without a GPU, and
`test_lowering_addresses_any_size` lowers abstract tables of 2-6 GiB (no memory is
allocated) to check 32-bit pieces and 64-bit offsets where each is needed.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import quant
from kernels import embedding_bag as eb

# Several tables of uneven sizes in one flat buffer; multi-hot bags with padding.
CASES = {
    # one table, one-hot, power-of-two dim
    "onehot": dict(rows=[37], dim=16, batch=8, bag_len=1),
    # three tables, bags of up to 5 ids with padding, dim not a power of two
    "multihot": dict(rows=[13, 50, 7], dim=12, batch=6, bag_len=5),
    # bags and dim both spill over several blocks (tails masked)
    "blocks": dict(rows=[20, 9], dim=40, batch=7, bag_len=3, block_bags=4, block_dim=16),
    # the collection's a2a layout: leading dims [N, B, S], a column chunk of width 3
    "a2a": dict(rows=[11, 6], dim=3, batch=4, bag_len=2, lead=(2,)),
}
DTYPES = ["float32", "bfloat16", "int8", "packed8"]


def _case(name, dtype, seed=0):
  """(table, flat ids, local ids, offsets [F], coef, lengths, bag grads) for a case."""
  c = CASES[name]
  rng = np.random.default_rng(seed)
  rows, dim, L = c["rows"], c["dim"], c["bag_len"]
  F = len(rows)
  lead = (*c.get("lead", ()), c["batch"])
  offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int32)
  full = rng.normal(size=(sum(rows), dim)).astype(np.float32)
  local = np.stack([rng.integers(0, r, (*lead, L)) for r in rows], -2).astype(np.int32)
  local[..., 0] %= 3                                       # duplicates within a batch
  lengths = rng.integers(0, L + 1, (*lead, F))
  live = np.arange(L) < lengths[..., None]
  # Padding holds garbage: ids outside every table, negative, or inside another table.
  garbage = rng.choice([-7, 10**6, 1], size=local.shape)
  local = np.where(live, local, garbage).astype(np.int32)
  weights = rng.uniform(0.5, 1.5, local.shape).astype(np.float32)
  mean = np.arange(F) % 2 == 1                             # odd features mean-pooled
  coef = np.where(live, weights, 0.0) / np.where(mean, np.maximum(lengths, 1), 1)[..., None]
  coef = coef.astype(np.float32)
  flat = np.where(live, local + offsets[:, None], local).astype(np.int32)
  grad = rng.normal(size=(*lead, F, dim)).astype(np.float32)
  if dtype == "int8":
    table = quant.quantize_rowwise_int8(full)
  elif dtype == "packed8":
    table = eb.pack_int8(quant.quantize_rowwise_int8(full))
  else:
    table = jnp.asarray(full, dtype)
  return table, flat, local, offsets, coef, lengths, grad


def _dense_rows(table) -> np.ndarray:
  if isinstance(table, eb.PackedInt8Rows):
    table = eb.unpack_int8(table)
  if isinstance(table, quant.RowwiseQuantized):
    return np.asarray(quant.dequantize_rowwise(table))
  return np.asarray(table.astype(jnp.float32))


def _numpy_bags(rows, ids, coef):
  """Brute force: loop over every bag and position."""
  out = np.zeros((*ids.shape[:-1], rows.shape[1]), np.float64)
  for pos in np.ndindex(*ids.shape):
    i = ids[pos]
    if 0 <= i < rows.shape[0]:
      out[pos[:-1]] += np.float64(coef[pos]) * rows[i]
  return out


def _kw(name):
  c = CASES[name]
  return {k: c[k] for k in ("block_bags", "block_dim") if k in c}


def _tol(dtype):
  # The kernel adds ids in order l = 0..L-1; the reference's einsum may not. int8 also
  # folds the bias as sum(c * bias) rather than row by row.
  return dict(rtol=2e-6, atol=2e-6) if "8" not in dtype else dict(rtol=1e-5, atol=1e-5)


_reference = jax.jit(eb.embedding_bag_reference)
# Forward combinations: every case in float32, the narrower rows on the harder cases.
FORWARD = ([(n, "float32") for n in CASES]
           + [(n, d) for d in ("bfloat16", "int8", "packed8") for n in ("multihot", "blocks")]
           + [("a2a", "int8"), ("a2a", "packed8"), ("onehot", "packed8")])


@pytest.mark.parametrize("name,dtype", [(n, "float32") for n in CASES]
                         + [("multihot", "bfloat16"), ("multihot", "int8"),
                            ("multihot", "packed8")])
def test_reference_matches_numpy(name, dtype):
  table, flat, local, offsets, coef, _, _ = _case(name, dtype)
  want = _numpy_bags(_dense_rows(table), flat, coef)
  np.testing.assert_allclose(_reference(table, flat, coef), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      _reference(table, np.where(coef != 0, local, -1), coef, offsets=offsets),
      want, rtol=1e-5, atol=1e-5)


class EmbeddingBagCases:
  """Kernel cases; subclasses set `interpret`."""

  interpret: bool = True

  @pytest.mark.parametrize("name,dtype", FORWARD)
  def test_forward(self, name, dtype):
    table, flat, _, _, coef, _, _ = _case(name, dtype)
    got = eb.embedding_bag(table, flat, coef, interpret=self.interpret, **_kw(name))
    assert got.shape == coef.shape[:-1] + (_dense_rows(table).shape[1],)
    assert got.dtype == jnp.float32
    want = _reference(table, flat, coef)
    np.testing.assert_allclose(got, want, **_tol(dtype))
    assert np.abs(np.asarray(got)).max() > 0.1     # bags are not all empty

  @pytest.mark.parametrize("dtype", ["float32", "int8", "packed8"])
  def test_offsets_in_kernel(self, dtype):
    """Per-feature offsets added in the kernel equal ids offset beforehand."""
    table, flat, local, offsets, coef, _, _ = _case("multihot", dtype, seed=1)
    # Padding positions carry coef 0; give them in-range local ids so only coef masks them.
    local = np.where(coef != 0, local, 0)
    got = eb.embedding_bag(table, local, coef, offsets=offsets, interpret=self.interpret)
    want = eb.embedding_bag(table, flat, coef, interpret=self.interpret)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if dtype == "float32":   # the backward maps gradients through the same offsets
      grad = lambda i, o: jax.grad(lambda t: jnp.sum(eb.embedding_bag(
          t, i, coef, offsets=o, interpret=self.interpret) ** 2))(table)
      np.testing.assert_allclose(grad(local, offsets), grad(flat, None), rtol=1e-6, atol=1e-6)

  def test_padding_is_never_read(self):
    """Rows seen only by padding (coef 0) or out-of-range ids are never read: NaN there
    cannot leak into a bag, unlike a gather-then-multiply."""
    table, flat, _, _, coef, _, _ = _case("multihot", "float32", seed=2)
    rows = np.asarray(table).copy()
    used = np.unique(flat[(coef != 0) & (flat >= 0) & (flat < rows.shape[0])])
    unused = np.setdiff1d(np.arange(rows.shape[0]), used)
    flat = np.where(coef != 0, flat, unused[0])          # padding points at a NaN row
    assert unused.size
    poisoned = rows.copy()
    poisoned[unused] = np.nan
    got = eb.embedding_bag(jnp.asarray(poisoned), flat, coef, interpret=self.interpret)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, _reference(jnp.asarray(rows), flat, coef),
                               rtol=2e-6, atol=2e-6)

  @pytest.mark.parametrize("name", ["multihot", "blocks", "a2a"])
  def test_id_grads(self, name):
    _, _, _, _, coef, _, grad = _case(name, "float32")
    got = eb.embedding_bag_id_grads(coef, grad, interpret=self.interpret, **_kw(name))
    want = np.einsum("...l,...d->...ld", coef, grad).reshape(-1, grad.shape[-1])
    np.testing.assert_array_equal(got, want)             # one product each: exact
    np.testing.assert_array_equal(got, eb.embedding_bag_id_grads_reference(coef, grad))

  @pytest.mark.parametrize("dtype", DTYPES)
  def test_gradients(self, dtype):
    """custom_vjp grads (rows / int8 scale and bias, coef) equal autodiff of the reference."""
    table, flat, _, _, coef, _, grad = _case("multihot", dtype, seed=3)

    if dtype == "int8":   # the codes are integers: differentiate scale and bias
      params = (table.scale, table.bias)
      make = lambda p: quant.RowwiseQuantized(table.q, p[0], p[1], 8, table.dim)
    elif dtype == "packed8":   # integer words: only coef is differentiable
      params = ()
      make = lambda p: table
    else:
      params = (table,)
      make = lambda p: p[0]

    def loss(fn, params, coef):
      return jnp.sum(fn(make(params), flat, coef) * grad)

    kernel = lambda t, i, c: eb.embedding_bag(t, i, c, interpret=self.interpret)
    got = jax.jit(jax.grad(lambda p, c: loss(kernel, p, c), argnums=(0, 1)))(params, coef)
    # The reference in float32: autodiff of a bf16 gather would add the row gradients in
    # bf16, where the kernel's backward adds in float32 and rounds once.
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    want = jax.jit(jax.grad(lambda p, c: loss(eb.embedding_bag_reference, p, c),
                            argnums=(0, 1)))(params32, coef)
    rtol = 2.0 ** -8 if dtype == "bfloat16" else 1e-5     # one bf16 rounding
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert g.shape == w.shape
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-5 * np.abs(w).max())
    assert len(jax.tree.leaves(got)) == len(params) + 1
    # Rows never looked up get no gradient; the ones looked up do.
    if dtype in ("float32", "bfloat16"):
      d_rows = np.asarray(got[0][0], np.float32)
      hit = np.zeros(d_rows.shape[0], bool)
      hit[flat[(coef != 0) & (flat >= 0) & (flat < d_rows.shape[0])]] = True
      assert (d_rows[~hit] == 0).all() and (np.abs(d_rows[hit]).sum(1) > 0).all()

  @pytest.mark.parametrize("dtype", DTYPES)
  @pytest.mark.parametrize("kw", [dict(unroll=1), dict(unroll=2, block_bags=2),
                                  dict(unroll=8, block_dim=4), dict(unroll=4, block_bags=1)])
  def test_launch_configs_agree(self, dtype, kw):
    """Rows in flight (unroll, also past L), bag and column blocks change nothing but speed:
    each config equals the default one (same additions in the same order per column)."""
    table, flat, _, _, coef, _, _ = _case("multihot", dtype, seed=4)
    base = eb.embedding_bag(table, flat, coef, interpret=self.interpret)
    got = eb.embedding_bag(table, flat, coef, interpret=self.interpret, **kw)
    np.testing.assert_allclose(got, base, rtol=1e-6, atol=1e-6)

  @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
  def test_pieces(self, dtype, monkeypatch):
    """A buffer past the 32-bit offset limit is read as pieces that are each under it:
    with the limit lowered to 240 elements the 70-row buffer (dim 12) becomes pieces of
    20, 20, 20 and 10 rows, and every bag, offsets and gradients included, is unchanged."""
    table, flat, local, offsets, coef, _, grad = _case("multihot", dtype, seed=5)
    rows = table.q if dtype == "int8" else table
    want = eb.embedding_bag(table, flat, coef, interpret=self.interpret)
    monkeypatch.setattr(eb, "_I32_MAX_ELEMENTS", 240)
    pieces, starts = eb._pieces(rows)
    assert starts == (0, 20, 40, 60, 70) and starts[-1] == rows.shape[0]
    assert len(pieces) == 4 and all(p.size <= 240 for p in pieces)
    got = eb.embedding_bag(table, flat, coef, interpret=self.interpret)
    # Bit for bit in interpret mode. On a GPU the backward's scatter-add of repeated ids
    # lands in any order (atomics), and the pieces compile to another kernel: equal there up
    # to the fp32 rounding of a few summed terms.
    same = (np.testing.assert_array_equal if self.interpret else
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6))
    same(got, want)
    local = np.where(coef != 0, local, 0)
    np.testing.assert_allclose(   # offsets added in the kernel (as in test_offsets_in_kernel)
        eb.embedding_bag(table, local, coef, offsets=offsets, interpret=self.interpret), want,
        rtol=1e-6, atol=1e-6)
    if dtype == "float32":
      loss = lambda t: jnp.sum(eb.embedding_bag(t, flat, coef, interpret=self.interpret) * grad)
      g = jax.grad(loss)(table)
      monkeypatch.setattr(eb, "_I32_MAX_ELEMENTS", 2**31 - 1)
      same(g, jax.grad(loss)(table))

  def test_jit_and_empty_bags(self):
    table, flat, _, _, coef, _, _ = _case("onehot", "float32")
    coef = np.zeros_like(coef)
    got = jax.jit(lambda t, i, c: eb.embedding_bag(t, i, c, interpret=self.interpret))(
        table, flat, coef)
    np.testing.assert_array_equal(got, np.zeros(got.shape, np.float32))


class TestEmbeddingBagInterpret(EmbeddingBagCases):
  interpret = True


@pytest.mark.gpu
class TestEmbeddingBagCompiled(EmbeddingBagCases):
  interpret = False

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("compiled Pallas (Triton) kernels need a GPU backend")


def test_errors():
  table, flat, _, offsets, coef, _, _ = _case("multihot", "float32")
  with pytest.raises(ValueError, match="same shape"):
    eb.embedding_bag(table, flat, coef[..., :-1], interpret=True)
  with pytest.raises(ValueError, match="one offset per feature"):
    eb.embedding_bag(table, flat, coef, offsets=offsets[:2], interpret=True)
  with pytest.raises(ValueError, match="block_bags=6, expected a power of two"):
    eb.embedding_bag(table, flat, coef, block_bags=6, interpret=True)
  with pytest.raises(ValueError, match="unroll=3, expected a power of two"):
    eb.embedding_bag(table, flat, coef, unroll=3, interpret=True)
  packed = eb.pack_int8(quant.quantize_rowwise_int8(np.asarray(table)))
  with pytest.raises(ValueError, match="block_dim=2, expected a multiple of 4"):
    eb.embedding_bag(packed, flat, coef, block_dim=2, interpret=True)
  with pytest.raises(ValueError, match=r"expected int32 \[R, 8\]"):
    eb.embedding_bag(eb.PackedInt8Rows(packed.words[:, :4], 12), flat, coef, interpret=True)
  with pytest.raises(ValueError, match="pack_int8: bits=4"):
    eb.pack_int8(quant.quantize_rowwise_int4(np.asarray(table)))


@pytest.mark.parametrize("dim", [1, 3, 4, 12, 128])
def test_pack_int8_round_trip(dim):
  """Packed rows hold FBGEMM's codes, scale and bias bit for bit, rows of 16-byte multiples,
  and dequantize to the same floats as the split layout."""
  rng = np.random.default_rng(dim)
  qr = quant.quantize_rowwise_int8(rng.normal(size=(9, dim)).astype(np.float32))
  packed = eb.pack_int8(qr)
  w = eb.packed_words_per_row(dim)
  assert packed.words.shape == (9, w) and packed.words.dtype == jnp.int32 and w % 4 == 0
  assert 4 * w >= dim + 8 and 4 * w - 16 < -(-dim // 4) * 4 + 8
  back = eb.unpack_int8(packed)
  for a, b in ((back.q, qr.q), (back.scale, qr.scale), (back.bias, qr.bias)):
    np.testing.assert_array_equal(a, b)
  # Word j of row r holds codes 4j..4j+3 little-endian, then the scale's and bias' bits.
  words = np.asarray(packed.words).view(np.uint32)
  q = np.asarray(qr.q)
  j = (dim - 1) // 4
  want = sum(int(q[2, c]) << (8 * (c - 4 * j)) for c in range(4 * j, dim))
  assert words[2, j] == want
  d4 = -(-dim // 4)
  assert words[2, d4] == np.asarray(qr.scale).view(np.uint32)[2]
  assert words[2, d4 + 1] == np.asarray(qr.bias).view(np.uint32)[2]
  assert (words[:, d4 + 2:] == 0).all()


def test_default_interpret_on_cpu():
  """interpret=None runs the interpreter on a CPU backend (a compiled call would fail)."""
  assert jax.default_backend() == "cpu"
  table, flat, _, _, coef, _, _ = _case("onehot", "float32")
  np.testing.assert_allclose(eb.embedding_bag(table, flat, coef),
                             _reference(table, flat, coef), rtol=1e-6)


H100 = "NVIDIA H100 80GB HBM3"


def _lower_for_gpu(fn, *args):
  """Lowers `fn` for a CUDA H100 target on this CPU-only machine; returns the Triton
  modules Pallas built (each verified by MLIR)."""
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
  except ImportError as e:      # private module: moved in this jax version
    pytest.skip(f"Pallas Triton lowering not importable: {e}")
  built = []
  original = triton_lowering.lower_jaxpr_to_triton_module

  def verified(*a, **k):
    result = original(*a, **k)
    assert result.module.operation.verify()
    built.append(result.module.operation.get_asm())
    return result

  mesh = jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(H100, None, "gpu"))
  triton_lowering.lower_jaxpr_to_triton_module = verified
  try:
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)   # Triton backend deprecation
      jax.export.export(
          jax.jit(fn), platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
      )(*args)
  finally:
    triton_lowering.lower_jaxpr_to_triton_module = original
  return built


def _table_fn(table, **kw):
  """(fn of the table's arrays + ids, coef, offsets, those arrays) for lowering."""
  if isinstance(table, quant.RowwiseQuantized):
    return (lambda q, s, b, i, c, o: eb.embedding_bag(
        quant.RowwiseQuantized(q, s, b, 8, table.dim), i, c, offsets=o, interpret=False, **kw),
            (table.q, table.scale, table.bias))
  if isinstance(table, eb.PackedInt8Rows):
    return (lambda w, i, c, o: eb.embedding_bag(eb.PackedInt8Rows(w, table.dim), i, c,
                                                offsets=o, interpret=False, **kw),
            (table.words,))
  return (lambda t, i, c, o: eb.embedding_bag(t, i, c, offsets=o, interpret=False, **kw),
          (table,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowers_to_triton_for_h100(dtype):
  table, flat, local, offsets, coef, _, grad = _case("multihot", dtype)
  fn, arrays = _table_fn(table)
  mods = _lower_for_gpu(fn, *arrays, local, coef, offsets)
  assert len(mods) == 1 and "tt.load" in mods[0] and "scf.for" in mods[0]
  if dtype == "int8":
    assert "uitofp" in mods[0]             # codes read as unsigned bytes
  if dtype == "packed8":                   # codes unpacked from words; scale / bias split off
    assert "arith.shrui" in mods[0] and "tt.split" in mods[0] and "tt.join" in mods[0]
  # Forward and backward kernels of the differentiable op both lower (value_and_grad: with
  # grad alone jax 0.12 drops the forward kernel, whose output the gradient does not need).
  mods = _lower_for_gpu(lambda t, c: jax.value_and_grad(
      lambda t, c: jnp.sum(eb.embedding_bag(t, flat, c, interpret=False) * grad),
      argnums=(0, 1))(t, c), np.asarray(_dense_rows(table)), coef)
  assert len(mods) == 2


def _row_address_widths(module: str, args: tuple[str, ...]) -> set[str]:
  """Offset integer types of the 2-D tile addresses built on kernel arguments `args` (the
  row buffers: %arg0, ...): their pointer splats, then the tt.addptr ops on those."""
  import re
  bases = {m for a in args
           for m in re.findall(rf"(%\S+) = tt\.splat {a} : !tt\.ptr<\w+> -> tensor<\d+x\d+x", module)}
  widths = set()
  for base in bases:
    widths |= set(re.findall(rf"tt\.addptr {base}, %\S+ : tensor<\d+x\d+x!tt\.ptr<\w+>>, "
                             rf"tensor<\d+x\d+x(i\d+)>", module))
  assert widths, f"no tile addresses on {args}"
  return widths


SIZES = {   # (rows, dim, layout) of 2-6 GiB buffers, lowered abstractly (nothing allocated)
    "int8_3.3GB_pieces": (26_000_000, 128, "int8"),     # 1-byte codes in (2^31, 2^32]
    "packed_3.7GB": (26_000_000, 128, "packed8"),       # 4-byte words, 32-bit offsets
    "packed_5.8GB": (40_000_000, 128, "packed8"),       # over 2^32 bytes: 64-bit
    "fp32_5.1GB": (10_000_000, 128, "float32"),
    "bf16_4GB": (2**24, 128, "bfloat16"),               # exactly 2^32 bytes: 32-bit, fits
}


@pytest.mark.parametrize("case", list(SIZES))
def test_lowering_addresses_any_size(case):
  """Big buffers lower with addresses that cannot overflow: a 1-byte code buffer between
  2^31 and 2^32 bytes (where Pallas would use 32-bit offsets past 2^31) becomes two
  pieces under 2^31 elements; packed words stay one operand (32-bit offsets up to 4 GiB,
  64-bit above); float rows over 4 GiB get 64-bit offsets."""
  rows, dim, layout = SIZES[case]
  sds = jax.ShapeDtypeStruct
  if layout == "int8":
    table = quant.RowwiseQuantized(sds((rows, dim), jnp.uint8), sds((rows,), jnp.float32),
                                   sds((rows,), jnp.float32), 8, dim)
  elif layout == "packed8":
    table = eb.PackedInt8Rows(sds((rows, eb.packed_words_per_row(dim)), jnp.int32), dim)
  else:
    table = sds((rows, dim), jnp.dtype(layout))
  fn, arrays = _table_fn(table)
  ids, coef = sds((64, 26, 4), jnp.int32), sds((64, 26, 4), jnp.float32)
  mods = _lower_for_gpu(fn, *arrays, ids, coef, sds((26,), jnp.int32))
  assert len(mods) == 1
  mod = mods[0]
  head = next(line for line in mod.splitlines() if "tt.func" in line)   # its signature
  elem = {"int8": "i8", "packed8": "i32", "float32": "f32", "bfloat16": "bf16"}[layout]
  nbytes = (rows * eb.packed_words_per_row(dim) * 4 if layout == "packed8"
            else rows * dim * jnp.dtype(layout if layout != "int8" else "uint8").itemsize)
  if layout == "int8":
    assert head.count("!tt.ptr<i8>") == 2              # two pieces
    assert _row_address_widths(mod, ("%arg0", "%arg1")) == {"i32"}
  else:
    assert head.count(f"!tt.ptr<{elem}>") >= 1
    want = "i64" if nbytes > 2**32 else "i32"
    assert _row_address_widths(mod, ("%arg0",)) == {want}, (nbytes, want)


# ------------------------------------------------------------- in the embedding collection

COLL_TABLES = [("t0", 37, "sum"), ("t1", 50, "mean"), ("t2", 13, "sum"), ("t3", 101, "mean")]
COLL_PLANS = {
    "dp": lambda i: ("dp", tuple(range(8))),
    "tw": lambda i: ("tw", ((3 * i) % 8,)),
    "rw": lambda i: ("rw", tuple(range(8))),
    "cw": lambda i: ("cw", (i % 8, (i + 2) % 8, (i + 5) % 8)),   # chunks of width 3, 3, 2
}


def _collection_run(kind, impl, steps=3):
  """Embeddings per step and final tables of a few sparse Adagrad steps on 8 devices."""
  from core import mesh as mesh_lib
  from rec.embedding import optimizers as opt_lib
  from rec.embedding.collection import EmbeddingCollection
  from rec.embedding.config import TableConfig
  from rec.embedding.planner import TablePlacement

  tables = [TableConfig(n, r, 8, pooling=p) for n, r, p in COLL_TABLES]
  plan = {t.name: TablePlacement(*COLL_PLANS[kind](i)) for i, t in enumerate(tables)}
  mesh = mesh_lib.make_mesh("data:2,model:4")
  coll = EmbeddingCollection(tables, plan, mesh, opt_lib.get_sparse_optimizer("adagrad", 0.1),
                             lookup_impl=impl)
  rng = np.random.default_rng(0)
  B, L, F = 16, 3, len(tables)
  ids = np.stack([rng.integers(0, t.num_rows, (B, L)) for t in tables], 1).astype(np.int32)
  ids[:, :, 0] %= 3
  lengths = rng.integers(0, L + 1, (B, F)).astype(np.int32)
  ids = np.where(np.arange(L) < lengths[..., None], ids, 0)
  weights = rng.uniform(0.5, 1.5, (B, F, L)).astype(np.float32)
  target = rng.normal(size=(B, F, 8)).astype(np.float32)
  batch = mesh_lib.shard_batch((ids, lengths, weights, target), mesh, mesh_lib.REC_RULES)

  @jax.jit
  def step(state, s, ids, lengths, weights, target):
    lk = coll.gather(state, ids, lengths, weights)

    def loss(partial):
      emb = coll.pool(lk, partial)
      return jnp.sum((emb - target) ** 2), emb

    (_, emb), g = jax.value_and_grad(loss, has_aux=True)(lk.partial)
    return coll.apply_gradients(state, lk, g, s), emb

  state = coll.init(jax.random.key(0))
  jaxpr = str(jax.make_jaxpr(step)(state, jnp.int32(0), *batch))
  kernels = (jaxpr.count("pallas_call["), len(coll.groups))
  embs = []
  for s in range(steps):
    state, emb = step(state, jnp.int32(s), *batch)
    embs.append(np.asarray(emb))
  return embs, coll.to_tables(state), coll.init_tables(jax.random.key(0)), kernels


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind", list(COLL_PLANS))
def test_collection_pallas_equals_xla(kind):
  """lookup_impl='pallas' (interpreted on CPU) gives the XLA path's embeddings at every step
  and its tables after sparse Adagrad steps, on 8 simulated devices."""
  embs_x, tables_x, init, kernels_x = _collection_run(kind, "xla")
  embs_p, tables_p, _, kernels_p = _collection_run(kind, "pallas")
  # One forward and one id-gradient launch per group, and none on the XLA path.
  assert kernels_x[0] == 0 and kernels_p[0] == 2 * kernels_p[1], (kernels_x, kernels_p)
  for a, b in zip(embs_p, embs_x):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for n in tables_x:
    np.testing.assert_allclose(tables_p[n], tables_x[n], rtol=1e-5, atol=1e-6, err_msg=n)
  assert any(not np.allclose(tables_p[n], init[n]) for n in init)     # it trained


def test_bench_refuses_on_cpu():
  from experiments.benchmarks import embedding_bag as bench_eb
  with pytest.raises(RuntimeError, match="default backend is 'cpu'"):
    bench_eb.bench_embedding_bag(num_rows=10, batch=2, features=1, bag_len=1)


@pytest.mark.slow   # a benchmark end to end; CI's default suite keeps to its time
def test_bench_runs_every_format_and_isolates_failures(monkeypatch):
  """The GPU benchmark's own logic on CPU at a toy size (kernels interpreted, the GPU
  check and the copy timing stubbed): every format and sweep config gives a row, and an
  implementation that raises is reported while the others still run."""
  from experiments.benchmarks import embedding_bag as bench
  from kernels import triton_int8_pool
  monkeypatch.setattr(bench, "require_gpu", lambda what: None)
  monkeypatch.setattr(triton_int8_pool, "available", lambda: True)

  def broken(*args):
    raise RuntimeError("triton failed to compile\nsecond line")
  monkeypatch.setattr(triton_int8_pool, "int8_pool", broken)
  out = bench.bench_embedding_bag(num_rows=40, dim=8, batch=4, features=2, bag_len=3,
                                  repeats=1, sweep=True, copy_bytes_per_s=1e9)
  rows = {(r["dtype"], r["impl"]): r for r in out["results"]}
  for fmt in bench.FORMATS:
    assert rows[(fmt, "pallas")]["of_copy"] > 0 and rows[(fmt, "xla")]["of_copy"] > 0
    assert sum(d == fmt and i.startswith("pallas[") for d, i in rows) == len(bench.SWEEP[fmt])
  assert rows[("int8_split", "triton")]["error"] == "RuntimeError: triton failed to compile"
  # 4 bags x 2 features x 3 ids of D + 8 = 16 bytes (int8) + 8 bytes of id and coef each,
  # plus 8 pooled float32 rows of 8.
  assert rows[("int8", "pallas")]["bytes"] == 24 * 24 + 8 * 8 * 4
  assert "failed: RuntimeError" in bench.format_table(out)
  assert bench.summary(out)["of_copy"]["int8_split/triton"].startswith("RuntimeError")
