"""Error-bounded compression of the embedding exchange (rec/embedding/a2a_compression.py).

The codec against float64 errors on adversarial rows (extremes, ties at bin edges,
denormals, constant rows, inf / NaN); the collection's compressed exchange on 8 devices
against the uncompressed one (forward values and backward gradients within the bound,
table-wise and iteration-wise factors) and against a 1-device compressed reference;
bounds <= 0 refused naming the flag; payload bytes read from the compiled HLO.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from core.errors import UserError
from rec.embedding import a2a_compression as ac
from rec.embedding import optimizers as opt_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import TableConfig
from rec.embedding.planner import TablePlacement

W = 8


def _adversarial_rows(eb, rng):
  """Rows [R, W] float32 that stress an error-bounded quantizer of bound eb."""
  f32 = np.float32
  step = float(ac._bf16_down(jnp.float32(2 * eb * ac._STEP_MARGIN))[1])
  base = f32(0.25)
  rows = [
      base + rng.uniform(-3, 3, W) * step,                     # ordinary, within 2 Q steps
      base + (np.arange(W) - 3.5) * step,                      # exactly on bin centres
      base + (np.arange(W) - 3.5 + 0.5) * step,                # ties at bin edges
      np.full(W, 0.7),                                         # constant row
      np.array([0.0, -0.0] * (W // 2)),                        # signed zeros
      np.full(W, 1e-41) * np.arange(W),                        # denormals
      np.array([f32(3.4e38), f32(-3.4e38)] * (W // 2)),        # extremes
      np.where(np.arange(W) % 2, f32(1e6), np.nextafter(f32(1e6), f32(2e6))),  # eb < ulp
      np.array([np.inf, 1.0] * (W // 2)),                      # inf
      np.array([np.nan] + [0.5] * (W - 1)),                    # NaN
      np.linspace(-1, 1, W) * 1e4,                             # wide: more than 2 Q steps
      np.nextafter(f32(1.0), f32(2.0)) + np.arange(W) * np.finfo(np.float32).eps,
  ]
  return np.stack([np.asarray(r, np.float32) for r in rows])


@pytest.mark.parametrize("mode,eb,bits", [("abs", 1e-3, 8), ("abs", 1e-2, 4), ("abs", 1e-5, 16),
                                          ("rel", 0.01, 8), ("rel", 0.1, 4), ("rel", 1e-4, 16)])
def test_codec_bound_on_adversarial_rows(mode, eb, bits):
  x = _adversarial_rows(eb, np.random.default_rng(0))
  payload, ok = jax.jit(lambda x: ac.encode(x, jnp.full(x.shape[:1], eb), mode, bits))(x)
  payload, ok = np.asarray(payload), np.asarray(ok)
  assert payload.shape == (len(x), ac.payload_bytes(W, bits)) and payload.dtype == np.uint8
  y = np.asarray(jax.jit(lambda p: ac.decode(p, W, bits))(payload))
  x64 = x.astype(np.float64)
  bound = eb if mode == "abs" else eb * (x64.max(1) - x64.min(1))
  with np.errstate(invalid="ignore"):
    err = np.abs(y.astype(np.float64) - x64)
    within = np.all(err <= np.broadcast_to(np.asarray(bound), (len(x),))[:, None], axis=1)
  # What the encoder declares sendable is within the bound, in float64.
  assert np.all(within[ok]), (mode, eb, bits, np.where(ok & ~within))
  finite = np.all(np.isfinite(x), axis=1)
  assert not ok[~finite].any()                      # inf / NaN rows never go lossy
  assert ok[[0, 1, 2, 3, 4]].all()                  # ordinary, bin centres, ties, constant, zeros
  if mode == "abs":
    assert not ok[10]                               # wider than 2 Q steps
  # Decoding is base + q * step with q * step exact: recompute it from the payload in numpy.
  base = payload[:, :4].copy().view(np.float32)[:, 0]
  step = (payload[:, 4:6].copy().view(np.uint16)[:, 0].astype(np.uint32) << 16).view(np.float32)
  codes = payload[:, 6:]
  if bits == 4:
    u = np.stack([codes & 0xF, codes >> 4], -1).reshape(len(x), -1)[:, :W].astype(np.int64)
  elif bits == 8:
    u = codes.astype(np.int64)
  else:
    u = codes.copy().view(np.uint16).astype(np.int64)
  with np.errstate(invalid="ignore", over="ignore"):
    ref = (base[:, None] + (u - 2 ** (bits - 1)).astype(np.float32) * step[:, None]).astype(np.float32)
  np.testing.assert_array_equal(y[ok], ref[ok])


def test_bad_settings_name_the_flag():
  for bound in (0.0, -1e-3, float("nan"), float("inf")):
    with pytest.raises(UserError, match="--a2a_error_bound"):
      ac.A2ACompression("abs", bound).check()
  with pytest.raises(UserError, match="--a2a_grad_error_bound"):
    ac.A2ACompression("abs", 1e-3, grad_bound=0.0).check()
  with pytest.raises(UserError, match="--a2a_bits=5"):
    ac.A2ACompression("abs", 1e-3, bits=5).check()
  with pytest.raises(UserError, match="--a2a_error_bound=0.001.*codes"):
    ac.A2ACompression("rel", 1e-3, bits=8).check()     # needs ~250 codes each side
  with pytest.raises(UserError, match="--a2a_table_factors"):
    ac.A2ACompression("abs", 1e-3, table_factors={"nope": 1.0}).check(["t0"])
  with pytest.raises(UserError, match="--a2a_schedule='linear:1:0:5'"):
    ac.parse_schedule("linear:1:0:5")
  assert ac.parse_schedule("cosine:2:0.5:100") == ac.Schedule("cosine", 2.0, 0.5, 100)
  s = ac.Schedule("linear", 2.0, 0.5, 10)
  assert float(s.factor(0)) == 2.0 and float(s.factor(5)) == 1.25 and float(s.factor(99)) == 0.5


# --------------------------------------------------------------------------- collection

TABLES = [TableConfig(f"t{i}", r, W) for i, r in enumerate([37, 50, 13, 101, 5, 64])]
B, L = 16, 3


def _batch():
  rng = np.random.default_rng(0)
  ids = np.stack([rng.integers(0, t.num_rows, (B, L)) for t in TABLES], 1).astype(np.int32)
  lengths = rng.integers(0, L + 1, (B, len(TABLES))).astype(np.int32)
  weights = rng.uniform(0.5, 1.5, (B, len(TABLES), L)).astype(np.float32)
  target = rng.normal(size=(B, len(TABLES), W)).astype(np.float32)
  return ids, lengths, weights, target


PLANS = {"tw": lambda i: TablePlacement("tw", ((3 * i) % 8,)),
         "rw": lambda i: TablePlacement("rw", tuple(range(8))),
         "mixed": lambda i: [TablePlacement("tw", (i,)), TablePlacement("rw", tuple(range(8))),
                             TablePlacement("twrw", (0, 1, 2, 3)),
                             TablePlacement("cw", (i % 8, (i + 3) % 8))][i % 4]}
# Row shards summed per table after the exchange: each adds at most one bound.
SHARDS = {"tw": lambda i: 1, "rw": lambda i: 8, "mixed": lambda i: [1, 8, 4, 1][i % 4]}


def _pool_and_grad(mesh, plan, comp, step):
  coll = EmbeddingCollection(TABLES, plan, mesh, opt_lib.get_sparse_optimizer("sgd", 0.1),
                             a2a_compression=comp)
  state = coll.init(jax.random.key(0))
  ids, lengths, weights, target = _batch()
  bi, bl, bw, bt = mesh_lib.shard_batch((ids, lengths, weights, target), mesh, mesh_lib.REC_RULES)

  @jax.jit
  def run(state, step):
    lk = coll.gather(state, bi, bl, bw)
    emb, vjp = jax.vjp(lambda p: coll.pool(lk, p, step=step), lk.partial)
    return emb, vjp(bt)[0], lk

  emb, g, lk = run(state, jnp.int32(step))
  return coll, np.asarray(emb), coll.dense_gradients(lk, g), run, state


@pytest.fixture(scope="module")
def mesh8():
  return mesh_lib.make_mesh("data:2,model:4")


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind", ["mixed"])    # tw, rw, twrw and cw groups in one collection
def test_sharded_exchange_within_bound(kind, mesh8):
  plan = {t.name: PLANS[kind](i) for i, t in enumerate(TABLES)}
  eb, geb = 1e-2, 5e-2
  comp = ac.A2ACompression("abs", eb, geb, bits=8, table_factors={"t0": 0.25, "t4": 2.0},
                           schedule=ac.Schedule("linear", 2.0, 0.5, 10))
  _, emb0, grad0, _, _ = _pool_and_grad(mesh8, plan, None, 0)
  _, emb, grad, _, _ = _pool_and_grad(mesh8, plan, comp, 5)    # schedule factor 1.25
  assert not np.array_equal(emb, emb0)                          # it did compress
  for i, t in enumerate(TABLES):
    f = comp.table_factors.get(t.name, 1.0) * 1.25
    fwd_err = np.abs(emb[:, i].astype(np.float64) - emb0[:, i]).max()
    assert fwd_err <= SHARDS[kind](i) * eb * f, (t.name, fwd_err)
    # Gradients of the bag sums: per id, coefficient (<= 1.5 here) times the bag's gradient.
    g_err = np.abs(grad[t.name].astype(np.float64) - grad0[t.name]).max()
    assert g_err <= 1.5 * L * B * geb * f, (t.name, g_err)
  assert np.abs(grad["t0"] - grad0["t0"]).max() > 0


@pytest.mark.devices(8)
def test_table_factor_reaches_its_table_in_an_a2a_group_not_starting_at_table_0(mesh8):
  # t0 rw, t1..t5 tw: the a2a group's slots hold group-local features 0..4 (t1..t5). The
  # factors are in table order; indexed by the group-local feature, t3's 0.05 would go to
  # t4, and t3 would be sent at 20x its bound. 16 bits meet the tight bound (no
  # fallback); forward errors: one bound per bag sum (tw: one owner), at schedule factor 1.
  plan = {t.name: TablePlacement("rw", tuple(range(8))) if i == 0 else PLANS["tw"](i)
          for i, t in enumerate(TABLES)}
  eb = 1e-3
  comp = ac.A2ACompression("abs", eb, None, bits=16, table_factors={"t3": 0.05})
  _, emb0, _, _, _ = _pool_and_grad(mesh8, plan, None, 0)
  _, emb, _, _, _ = _pool_and_grad(mesh8, plan, comp, 0)
  err = [np.abs(emb[:, i].astype(np.float64) - emb0[:, i]).max() for i in range(len(TABLES))]
  assert err[3] <= 0.05 * eb, err
  assert err[4] > 0.05 * eb, err      # t4 keeps the full bound (it did compress loosely)


@pytest.mark.devices(8)
def test_sharded_equals_single_device_compressed(mesh8):
  """Table-wise: each bag sum is computed whole on its owner, so the compressed exchange on
  8 devices gives the bits of the 1-device compressed lookup."""
  mesh1 = mesh_lib.make_mesh("data:1", jax.devices()[:1])
  comp = ac.A2ACompression("rel", 0.05, 0.05, bits=4)
  plan8 = {t.name: PLANS["tw"](i) for i, t in enumerate(TABLES)}
  plan1 = {t.name: TablePlacement("tw", (0,)) for t in TABLES}
  _, emb8, g8, _, _ = _pool_and_grad(mesh8, plan8, comp, 0)
  _, emb1, g1, _, _ = _pool_and_grad(mesh1, plan1, comp, 0)
  _, emb_plain, _, _, _ = _pool_and_grad(mesh1, plan1, None, 0)
  assert not np.array_equal(emb1, emb_plain)
  np.testing.assert_allclose(emb8, emb1, rtol=0, atol=1e-6)
  for t in TABLES:
    np.testing.assert_allclose(g8[t.name], g1[t.name], rtol=0, atol=1e-6)


@pytest.mark.devices(8)
def test_fallback_is_bit_identical_and_payload_bytes(mesh8):
  """A bound below float32's resolution for these values makes every exchange fall back:
  the result is the uncompressed one bit for bit. The compiled exchange sends the
  fixed-rate payload (uint8) with the float32 form only in the fallback branch."""
  plan = {t.name: PLANS["tw"](i) for i, t in enumerate(TABLES)}
  comp = ac.A2ACompression("abs", 1e-30, 1e-30, bits=16)
  _, emb0, grad0, _, _ = _pool_and_grad(mesh8, plan, None, 0)
  _, emb, grad, run, state = _pool_and_grad(mesh8, plan, comp, 0)
  np.testing.assert_array_equal(emb, emb0)
  for t in TABLES:
    np.testing.assert_array_equal(grad[t.name], grad0[t.name])
  hlo = run.lower(state, jnp.int32(0)).compile().as_text()
  b = ac.exchange_bytes(hlo)
  B_l, N = B // 8, 8
  S = max(sum(1 for i in range(len(TABLES)) if (3 * i) % 8 == d) for d in range(8))
  rows = N * B_l * S                                 # rows one device sends per exchange
  assert b["payload"] == 2 * rows * ac.payload_bytes(W, 16)   # forward + gradient


@pytest.mark.devices(8)
def test_exchange_bytes_count_the_pooled_exchange_only(mesh8):
  """`exchange_bytes` counts the pooled partials' exchanges and their gradients, whatever
  else the train step gathers (ids, per-id weights of multi-id bags, a dp table's
  gradients): float32 is the same rows as the payload at W * 4 bytes a row, so their ratio
  is the compression's. A reduce-scatter counts its operand (every device's contribution),
  which its compressed form, an all-to-all of those contributions, sends as payload."""
  kinds = [TablePlacement("tw", (0,)), TablePlacement("rw", tuple(range(8))),
           TablePlacement("dp", tuple(range(8)))]
  plan = {t.name: kinds[i % 3] if i % 3 else TablePlacement("tw", (i,))
          for i, t in enumerate(TABLES)}
  ids, lengths, weights, target = _batch()
  N, B_l = 8, B // 8
  a2a_rows = N * B_l * 1            # tw tables on devices 0 and 3: one slot each
  rw_rows = N * B_l * 2             # every sample's two rw tables, as contributions
  got = {}
  for comp in (None, ac.A2ACompression("abs", 1e-3, 1e-3, bits=8)):
    coll = EmbeddingCollection(TABLES, plan, mesh8, opt_lib.get_sparse_optimizer("sgd", 0.1),
                               a2a_compression=comp)
    state = coll.init(jax.random.key(0))

    @jax.jit
    def step(state, ids, lengths, weights, target):
      lk = coll.gather(state, ids, lengths, weights)
      emb, vjp = jax.vjp(lambda p: coll.pool(lk, p), lk.partial)
      return emb, coll.apply_gradients(state, lk, vjp(target)[0], jnp.int32(0))

    batch = mesh_lib.shard_batch((ids, lengths, weights, target), mesh8, mesh_lib.REC_RULES)
    lowered = step.lower(state, *batch)
    got[comp is None] = ac.exchange_bytes(lowered.compile().as_text())
    # the lowered program's HLO with its debug info (a2a_report's) counts the same
    assert ac.exchange_bytes(lowered.as_text(dialect="hlo", debug_info=True)) == got[comp is None]
  rows = 2 * (a2a_rows + rw_rows)  # forward + gradient
  assert got[True] == {"payload": 0, "float32": rows * W * 4}
  assert got[False] == {"payload": rows * ac.payload_bytes(W, 8), "float32": rows * W * 4}
