"""Element grids, bf16, FP8 and MX / BDR (core/quant/formats.py, floats.py, mx.py): bit-exact
against ml_dtypes and numpy references, hand-computed vectors, microxcaling's own test
vectors (microsoft/microxcaling mx/tests at 7bc41952), edge cases (zeros, NaN, Inf,
subnormals, saturation) and stochastic rounding's bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from core import quant
from core.quant import formats as F
from core.quant import mx

FLOAT_FORMATS = ["bf16", "fp16", "e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]
_round = jax.jit(F.round_to_format, static_argnames=("fmt", "saturate", "ties"))


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same(a, b):
  """Same float32 bits, NaN matching any NaN."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert a.shape == b.shape, (a.shape, b.shape)
  nan = np.isnan(a)
  np.testing.assert_array_equal(nan, np.isnan(b))
  np.testing.assert_array_equal(_bits(a[~nan]), _bits(b[~nan]))


def _ml_dtype(name):
  return np.float16 if name == "fp16" else getattr(ml_dtypes, F.ML_DTYPES[name])


def _probe_values(name, n=20_000, seed=0):
  """Random float32 bit patterns (every exponent, subnormals, NaN payloads), each grid
  value, the midpoints between neighbours and their float32 neighbours, specials."""
  rng = np.random.default_rng(seed)
  rand = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  dt = _ml_dtype(name)
  width = np.uint16 if np.dtype(dt).itemsize == 2 else np.uint8
  codes = np.arange(2 ** (16 if width == np.uint16 else 8), dtype=np.int64).astype(width)
  if name in ("e3m2", "e2m3"):
    codes = codes[codes < 64]
  if name == "e2m1":
    codes = codes[codes < 16]
  with np.errstate(all="ignore"):
    grid = np.unique(codes.view(dt).astype(np.float32))
    grid = grid[np.isfinite(grid)]
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf))])
    if len(near) > 40_000:
      near = rng.choice(near, 40_000, replace=False)
    spec = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3.4e38,
                     grid.max() * 1.0625, grid.max() * 1.03, grid.max() * 4], np.float32)
  return np.concatenate([rand, grid[:: max(1, len(grid) // 20_000)], near, spec])


# ------------------------------------------------------------------------------- grids


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_round_to_format_is_ml_dtypes_conversion(name):
  """Round to nearest even, overflow to Inf (bf16, fp16, E5M2), NaN (E4M3) or the largest
  value (FP6 / FP4, which ml_dtypes saturates): bit for bit with ml_dtypes, NaN kept NaN
  (ml_dtypes turns NaN into 0 in FP6 / FP4, which cannot store it)."""
  x = _probe_values(name)
  got = np.asarray(_round(x, name))
  with np.errstate(all="ignore"):
    want = x.astype(_ml_dtype(name)).astype(np.float32)
  if name in ("e3m2", "e2m3", "e2m1"):
    want = np.where(np.isnan(x), np.float32(np.nan), want)
  _same(got, want)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_codes_are_the_ocp_encodings(name):
  """encode / decode against ml_dtypes' storage bits for every code of the format."""
  f = F.get_format(name)
  dt = _ml_dtype(name)
  n = 1 << f.bits
  codes = np.arange(n, dtype=np.uint8)
  want = codes.view(dt).astype(np.float32)
  got = np.asarray(jax.jit(lambda c: F.to_float(F.decode(c, f), f))(codes))
  _same(got, want)
  finite = np.isfinite(want)
  back = np.asarray(jax.jit(lambda v: F.encode(F.round_fields(v, f), f))(want[finite]))
  np.testing.assert_array_equal(back, codes[finite])


def test_saturation_and_specials_by_hand():
  e4m3, e5m2, e2m1 = F.E4M3, F.E5M2, F.E2M1
  x = np.array([464.0, 465.0, 1e9, -np.inf, np.nan, 2.0 ** -10, 3 * 2.0 ** -11], np.float32)
  # 464 is the midpoint of 448 (mantissa 110) and 480 (111, E4M3's NaN slot): to even 448.
  # 465 rounds to 480, which E4M3 cannot hold: NaN without saturation, 448 with it.
  # 2^-10 is half the smallest subnormal 2^-9: ties to even 0; 3 * 2^-11 rounds up to 2^-9.
  _same(_round(x, e4m3), [448, np.nan, np.nan, np.nan, np.nan, 0, 2.0 ** -9])
  _same(_round(x, e4m3, saturate=True),
        [448, 448, 448, -448, np.nan, 0, 2.0 ** -9])
  _same(_round(x, e5m2), [448, 448, np.inf, -np.inf, np.nan, 2.0 ** -10,
                                     3 * 2.0 ** -11])
  _same(_round(np.float32([61440.0, 1e9]), e5m2, saturate=True), [57344, 57344])
  # E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6. 5 is a tie of 4 and 6: even mantissa is 4; 0.25
  # ties 0 and 0.5 (to 0); 0.75 ties 0.5 and 1 (to 1); ties="away" takes the larger.
  v = np.float32([5.0, 0.25, 0.75, 2.5, 7.0, -100.0])
  _same(_round(v, e2m1), [4, 0, 1, 2, 6, -6])
  _same(_round(v, e2m1, ties="away"), [6, 0.5, 1, 3, 6, -6])


# -------------------------------------------------------------------------------- bf16


def test_to_bf16_bit_exact_with_ml_dtypes():
  rng = np.random.default_rng(1)
  x = np.concatenate([
      rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
      np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                0x00008000, 0x00018000, 0x80008001, 0x3F808000, 0x3F818000, 1],
               np.uint32).view(np.float32)])
  got = np.asarray(quant.to_bf16(x))
  with np.errstate(all="ignore"):
    want = x.astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(_bits(got), _bits(want))    # NaNs included, bit for bit


def test_to_bf16_by_hand():
  u = np.array([0x3F808000,   # 1 + 2^-8: a tie, to even 1.0
                0x3F818000,   # 1 + 3 * 2^-8: a tie, to even 1 + 2^-6
                0x3F808001,   # just above the tie: up
                0x7F7FFFFF,   # float32 max: past bf16's max, to Inf
                0x00008000,   # subnormal tie: to 0
                0x00018000,   # subnormal tie: to even 0x0002
                0xFFC00001],  # NaN: the quiet NaN with its sign
               np.uint32)
  got = _bits(quant.to_bf16(u.view(np.float32)))
  np.testing.assert_array_equal(got, [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x0000, 0x0002, 0xFFC0])


def test_stochastic_rounding_bits_against_reference():
  rng = np.random.default_rng(2)
  x = np.concatenate([
      rng.integers(0, 2 ** 32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
      np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.3895e38, -3.3895e38, 1e-40])])
  rb = rng.integers(0, 2 ** 16, x.shape, dtype=np.uint32)
  got = np.asarray(quant.stochastic_round_bf16_bits(x, rb))
  want = quant.stochastic_round_bf16_bits_reference(x, rb)
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_stochastic_rounding_is_exactly_unbiased_over_all_random_values():
  """Over all 2^16 random values, x rounds up exactly low16 times: the mean of SR(x) is x,
  for normal, subnormal and negative x (exact sums in float64)."""
  x = np.array([1 + 2.0 ** -9, -(1 + 2.0 ** -9), 3.14159, 1e-3, 7e-39, 1e-41, -2.5e-40,
                2.0 ** 100 * 1.2345], np.float32)
  rb = np.arange(2 ** 16, dtype=np.uint32)
  sr = np.asarray(quant.stochastic_round_bf16_bits(x[:, None], rb[None, :]), np.float64)
  np.testing.assert_array_equal(sr.mean(axis=1), x.astype(np.float64))
  assert (np.asarray(quant.to_bf16(x), np.float64) != x).any()   # RNE does lose something


def test_stochastic_rounding_mean_error_tends_to_zero():
  """With random keys the mean error over n draws shrinks like 1 / sqrt(n) (a bound of 5
  standard errors), while nearest rounding keeps its bias; small updates survive."""
  x = np.float32(1 + 2.0 ** -9)                  # a quarter ulp above a bf16 value
  ulp = 2.0 ** -7
  xs = jnp.full((1 << 16,), x)
  draws = np.asarray(quant.stochastic_round_bf16(xs, jax.random.key(0)), np.float64)
  sd = ulp * np.sqrt(0.25 * 0.75)                # one draw: Bernoulli(1/4) * ulp
  for n in (1 << 8, 1 << 12, 1 << 16):
    err = draws[:n].mean() - float(x)
    assert abs(err) < 5 * sd / np.sqrt(n), (n, err)
  assert abs(float(quant.to_bf16(x)) - float(x)) == ulp / 4     # RNE's error stays
  # 1000 additions of 2^-10 to a bf16 1.0 (an eighth of its ulp): nearest rounding loses
  # every one, stochastic rounding keeps them in expectation.
  def add(w, key):
    return quant.stochastic_round_bf16(w.astype(jnp.float32) + 2.0 ** -10, key), None
  keys = jax.random.split(jax.random.key(1), 1000)
  w, _ = jax.lax.scan(add, jnp.ones((256,), jnp.bfloat16), keys)
  mean = float(np.asarray(w, np.float64).mean())
  assert abs(mean - (1 + 1000 * 2.0 ** -10)) < 0.02, mean
  assert float(quant.to_bf16(np.float32(1 + 2.0 ** -10))) == 1.0


# --------------------------------------------------------------------------------- FP8


def _fp8_inputs():
  rng = np.random.default_rng(3)
  x = (rng.normal(size=(24, 40)) * 10.0 ** rng.uniform(-6, 6, (24, 1))).astype(np.float32)
  x[0] = 0.0                                    # zero row: scale 1
  x[1, 3] = np.nan                              # NaN row
  x[2, 5] = np.inf                              # Inf row: unscaled, saturates
  x[3] = np.float32(1e-40) * np.arange(40)      # subnormal row: amax below 2^-90
  x[4] = np.float32(2.0 ** -80) * rng.normal(size=40)   # tiny but scaled
  x[4, :5] = np.float32(1e-42)                  # subnormals in a scaled row
  x[5] = 3.0e38 * rng.uniform(-1, 1, 40)        # near float32's max
  x[6] = 1.0
  x[6, 0] = 2.0 ** -20                          # far below the row's scale
  return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_bit_exact_with_reference(fmt, granularity):
  x = _fp8_inputs()
  if granularity == "tensor":
    x = x[np.isfinite(x).all(axis=1)]           # one NaN would make the whole tensor NaN
  t = quant.quantize_fp8(x, fmt, granularity)
  values, scale_inv = quant.quantize_fp8_reference(x, fmt, granularity)
  assert t.values.dtype == quant.FP8_FORMATS[fmt][1]
  np.testing.assert_array_equal(_bits(t.values), _bits(values))
  np.testing.assert_array_equal(_bits(t.scale_inv), _bits(scale_inv))
  deq = np.asarray(quant.dequantize_fp8(t))
  with np.errstate(all="ignore"):
    want = values.astype(np.float32) * scale_inv
  _same(deq, want)
  nz = deq[np.isfinite(deq) & (deq != 0)]
  assert (np.abs(nz) >= 2.0 ** -126).all()          # never a subnormal: see floats.py
  if granularity == "row":
    # The NaN row (scale 1) keeps its one NaN; its other values stay numbers.
    np.testing.assert_array_equal(np.isnan(deq[1]), np.isnan(x[1]))
    np.testing.assert_array_equal(np.asarray(t.scale_inv)[[0, 1, 2, 3], 0], 1.0)


def test_fp8_by_hand():
  # amax 2: scale 448 / 2 = 224 exactly, values 448, -224, 112, 0; scale_inv 2 / 448.
  t = quant.quantize_fp8(np.float32([2.0, -1.0, 0.5, 0.0]), "e4m3")
  np.testing.assert_array_equal(np.asarray(t.values, np.float32), [448, -224, 112, 0])
  assert np.asarray(t.scale_inv) == np.float32(2.0) / np.float32(448.0)
  # Row-wise E5M2, row [1, 3]: scale 57344 / 3; 1 * scale = 19114.67 lies between the E5M2
  # values 16384 and 20480 (step 4096): nearer 20480. Row [0, 0]: scale 1.
  t = quant.quantize_fp8(np.float32([[1.0, 3.0], [0.0, -0.0]]), "e5m2", "row")
  np.testing.assert_array_equal(np.asarray(t.values, np.float32), [[20480, 57344], [0, 0]])
  np.testing.assert_array_equal(np.asarray(t.scale_inv)[:, 0],
                                [np.float32(3.0) / np.float32(57344.0), 1.0])
  assert _bits(t.values)[1, 1] == 0x80                        # -0 keeps its sign
  # A given (delayed) amax below the data saturates: amax 1, x 4 -> 448 (not NaN).
  t = quant.quantize_fp8(np.float32([4.0, 0.5, -8.0]), "e4m3", amax=jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(t.values, np.float32), [448, 224, -448])
  with pytest.raises(ValueError, match=r"amax shape \(3,\), expected \(2, 1\)"):
    quant.quantize_fp8(np.zeros((2, 3), np.float32), "e4m3", "row", amax=jnp.ones(3))
  with pytest.raises(ValueError, match="fp8 format 'e3m4'"):
    quant.quantize_fp8(np.zeros(3, np.float32), "e3m4")


@pytest.mark.parametrize("fmt,rel", [("e4m3", 2.0 ** -4), ("e5m2", 2.0 ** -3)])
def test_fp8_round_trip_error(fmt, rel):
  """Normal-range values: |x - deq| <= half an FP8 ulp (relative 2^-(m+1)) plus float32
  roundings of the scale; the bound is nearly reached."""
  rng = np.random.default_rng(4)
  x = rng.normal(size=(64, 128)).astype(np.float32)
  deq = np.asarray(quant.dequantize_fp8(quant.quantize_fp8(x, fmt, "row")))
  scale_inv = np.asarray(quant.quantize_fp8(x, fmt, "row").scale_inv)
  normal = np.abs(x) >= 2.0 ** F.get_format(fmt).emin * scale_inv
  r = np.abs(deq - x)[normal] / np.abs(x)[normal]
  assert r.max() <= rel * (1 + 1e-5) and r.max() > 0.8 * rel


# ---------------------------------------------------------------------------------- MX


def _mx_inputs():
  rng = np.random.default_rng(5)
  x = (rng.normal(size=(40, 96)) * 10.0 ** rng.uniform(-40, 38, (40, 1))).astype(np.float32)
  x[0, :5] = [np.nan, 0, 1, 2, 3]                       # NaN block
  x[1, 40] = np.inf                                     # Inf block
  x[2] = 0.0                                            # zero blocks
  x[3] = 1e-42                                          # subnormal blocks
  x[4] = rng.integers(-3, 4, 96) * 2.0 ** rng.integers(-150, -120, 96)   # mixed tiny
  x[5] = rng.integers(-16, 17, 96) * 2.0 ** rng.integers(-8, 8, 96) / 8  # many ties
  x[6] = 3.0e38 * rng.uniform(-1, 1, 96)                # near float32's max
  x[7] = np.where(np.arange(96) % 7 == 0, 7.9, 0.01)    # saturating blocks
  return x


@pytest.mark.parametrize("fmt", sorted(quant.MX_FORMATS))
def test_mx_bit_exact_with_reference(fmt):
  x = _mx_inputs()
  for block in (32, 7):                                 # 96 = 3 x 32; 7: a partial block
    got = np.asarray(quant.mx_round(x, fmt, block))
    _same(got, mx.mx_round_reference(x, fmt, block))
    m = quant.quantize_mx(x, fmt, block)
    _same(quant.dequantize_mx(m), got)
    assert m.scales.shape == (40, -(-96 // block)) and m.elements.shape[-1] == block
  assert np.isnan(got[0, :7]).all() and np.isnan(got[1, 35:42]).all()
  _same(quant.mx_round(x, fmt, ties="away"), mx.mx_round_reference(x, fmt, ties="away"))


def test_mx_by_hand():
  # MXFP4 block [6, -0.5, 1.75, 7.9, 0, ...] (32 values): amax 7.9, floor(log2) = 2 = emax of
  # E2M1, so X = 2^0; 7.9 saturates to 6, 1.75 ties 1.5 / 2 (to even 2), -0.5 exact.
  x = np.zeros(32, np.float32)
  x[:4] = [6.0, -0.5, 1.75, 7.9]
  m = quant.quantize_mx(x, "mxfp4")
  np.testing.assert_array_equal(m.scales, [127])
  np.testing.assert_array_equal(np.asarray(m.elements)[0, :4], [0b0111, 0b1001, 0b0100, 0b0111])
  np.testing.assert_array_equal(np.asarray(quant.dequantize_mx(m))[:4], [6, -0.5, 2, 6])
  # The same block times 2^-130 (subnormal float32 inputs): X = 2^-130 is below E8M0's
  # 2^-127, so the scale clamps at 2^-127 and the elements lose 3 binades: 6 * 2^-130 =
  # 0.75 * 2^-127 -> 1 (ties 0.5 / 1 to even), 1.75 * 2^-130 -> 0, 7.9 * 2^-130 -> 1.
  xs = (x.astype(np.float64) * 2.0 ** -130).astype(np.float32)
  m = quant.quantize_mx(xs, "mxfp4")
  np.testing.assert_array_equal(m.scales, [0])
  np.testing.assert_array_equal(np.asarray(quant.dequantize_mx(m))[:4] * 2.0 ** 127,
                                [1, -0.0, 0, 1])
  # MXINT8: k / 64 with |k| <= 127, X = 2^floor(log2 amax). amax 3 -> X = 2; 3 -> 1.5
  # exactly (k = 96); -0.0 has no two's complement encoding: +0.
  m = quant.quantize_mx(np.float32([3.0, -1.0 / 3.0, -0.0, 0.01]), "mxint8")
  np.testing.assert_array_equal(m.scales, [128])
  np.testing.assert_array_equal(np.asarray(m.elements)[0, :4], [96, -11, 0, 0])
  _same(quant.dequantize_mx(m), [3.0, -11 / 32, 0.0, 0.0])
  # Specials: a NaN or Inf anywhere makes the block's scale NaN (E8M0 0xFF), every value
  # NaN; an all-zero block has scale 2^-127 (floor(log2 0) read as -126) and decodes to 0.
  m = quant.quantize_mx(np.float32([[1, np.inf] + [0] * 30, [0] * 32]), "mxfp8_e5m2")
  np.testing.assert_array_equal(m.scales[:, 0], [255, 0])
  deq = np.asarray(quant.dequantize_mx(m))
  assert np.isnan(deq[0]).all() and (deq[1] == 0).all()
  assert m.bits_per_value == 8 + 8 / 32


# microxcaling's tests: mx/tests/test_corners_mx.py (test_mx_hw_test, test_mx_rounding,
# test_mx_nans) and test_fp8_e4m3_fix.py. Its default round="nearest" is ties away.
_HW_X = [[1.0] * 10, [1.0] * 5 + [2.0] * 5, [-1.0] * 5 + [-2.0] * 5, [1.0] * 5 + [-2.0] * 5,
         [1.015625, 1.0234375, 1.03125, 1.0390625, 1.25, 1.2578125, 1.9375, 1.9453125,
          1.984375, 1.9921875],
         [-1.984375, -1.9765625, -1.96875, -1.9609375, -1.9375, -1.9296875, -1.75,
          -1.7421875, -1.0, -1.9921875],
         [1.99609375, 1.98828125, 0.0, 0.00390625, 0.0078125, 0.01171875, -0.015625,
          -0.01171875, -0.0078125, -0.00390625]]
_HW_Y = [[1.0] * 10, [1.0] * 5 + [2.0] * 5, [-1.0] * 5 + [-2.0] * 5, [1.0] * 5 + [-2.0] * 5,
         [1.015625, 1.03125, 1.03125, 1.046875, 1.25, 1.265625, 1.9375, 1.953125, 1.984375,
          1.984375],
         [-1.984375, -1.984375, -1.96875, -1.96875, -1.9375, -1.9375, -1.75, -1.75, -1.0,
          -1.984375],
         [1.984375, 1.984375, 0.0, 0.0, 0.015625, 0.015625, -0.015625, -0.015625, -0.015625,
          0.0]]


def test_microxcaling_vectors():
  got = np.asarray(quant.mx_round(np.float32(_HW_X), "mxint8", 10, ties="away"))
  np.testing.assert_array_equal(got, np.float32(_HW_Y))
  got = np.asarray(quant.mx_round(np.float32([[-1.0, -1.75, -1.99, 1.99],
                                              [1.0, -1.75, -1.99, 1.99]]), "mxint4", 4))
  np.testing.assert_array_equal(got, [[-1.0, -1.75, -1.75, 1.75], [1.0, -1.75, -1.75, 1.75]])
  x = np.float32([485, 475, 400, -485, -475, -450, 2 ** -6, -(2 ** -6)])
  got = np.asarray(quant.mx_round(x, "mxfp8_e4m3", 8, ties="away"))
  np.testing.assert_array_equal(got, [448, 448, 416, -448, -448, -448, 2 ** -6, -(2 ** -6)])
  # 400 is a tie of 384 and 416: to even gives 384 (microxcaling's round="even").
  assert float(quant.mx_round(x, "mxfp8_e4m3", 8)[2]) == 384.0
  for fmt in ("mxfp8_e4m3", "mxfp4", "mxint4"):
    for val in (np.nan, np.inf, -np.inf):
      got = np.asarray(quant.mx_round(np.float32([val, 0, 2.0 ** 127, 0]), fmt, 4))
      assert np.isnan(got).all(), (fmt, val, got)


# --------------------------------------------------------------------------------- BDR


@pytest.mark.parametrize("fmt", sorted(quant.BDR_FORMATS))
def test_bdr_bit_exact_with_reference(fmt):
  x = _mx_inputs()
  got = np.asarray(quant.bdr_round(x, fmt))
  _same(got, mx.bdr_round_reference(x, fmt))
  b = quant.quantize_bdr(x, fmt)
  _same(quant.dequantize_bdr(b), got)
  assert b.elements.shape == (40, 6, 16) and b.micro.shape == (40, 6, 8)
  assert b.bits_per_value == {"mx9": 9, "mx6": 6, "mx4": 4}[fmt]
  _same(quant.bdr_round(x, fmt, ties="away"), mx.bdr_round_reference(x, fmt, ties="away"))


def test_bdr_by_hand():
  # MX4 (sign + 2-bit magnitude r, value r * 2^(E - t - 1)): block max 1.5 -> E = 0.
  # Pair (1.5, 0.3): its max has exponent 0 = E, t = 0, step 0.5: 3, 1 (0.3 -> 0.6 -> 1).
  # Pair (0.2, -0.1): exponent -3 < E, t = 1, step 0.25: 0.2 -> 0.8 -> 1; -0.1 -> -0.4 -> 0.
  # Pair (0.9, 0.0): exponent -1 < E, t = 1: 0.9 / 0.25 = 3.6 -> 4 saturates to 3 (0.75).
  x = np.zeros(16, np.float32)
  x[:6] = [1.5, 0.3, 0.2, -0.1, 0.9, 0.0]
  b = quant.quantize_bdr(x, "mx4")
  np.testing.assert_array_equal(np.asarray(b.shared), [127])
  np.testing.assert_array_equal(np.asarray(b.micro)[0, :3], [0, 1, 1])
  np.testing.assert_array_equal(np.asarray(b.elements)[0, :6], [3, 1, 1, 0, 3, 0])
  np.testing.assert_array_equal(np.asarray(quant.dequantize_bdr(b))[:6],
                                [1.5, 0.5, 0.25, 0.0, 0.75, 0.0])
  # MX9 (7-bit magnitude, step 2^(E - t - 6)) keeps 0.3 to 1/128: 0.3 * 64 = 19.2 -> 19.
  assert float(quant.bdr_round(x, "mx9")[1]) == 19 / 64
  # NaN / Inf blocks: shared exponent 255, all NaN.
  b = quant.quantize_bdr(np.float32([np.inf] + [1.0] * 15 + [2.0] * 16), "mx6")
  np.testing.assert_array_equal(np.asarray(b.shared)[:, ], [255, 128])
  assert np.isnan(np.asarray(quant.dequantize_bdr(b))[:16]).all()


def test_errors():
  with pytest.raises(ValueError, match="MX format 'mxfp5'"):
    quant.mx_round(np.zeros(32, np.float32), "mxfp5")
  with pytest.raises(ValueError, match="BDR format 'mx7'"):
    quant.bdr_round(np.zeros(16, np.float32), "mx7")
  with pytest.raises(ValueError, match="sub_block=3 must divide block_size=16"):
    quant.bdr_round(np.zeros(16, np.float32), "mx9", sub_block=3)
  with pytest.raises(ValueError, match="unknown format 'e6m1'"):
    F.get_format("e6m1")


def test_fp8_granularity_is_checked_with_a_given_amax():
  """A misspelt granularity with a given (delayed) amax is refused, not read as 'row'."""
  x = np.ones((2, 4), np.float32)
  for bad in ("rows", "Tensor"):
    with pytest.raises(ValueError, match=rf"quantize_fp8: granularity='{bad}', expected "
                       r"'tensor' or 'row'"):
      quant.quantize_fp8(x, "e4m3", bad, amax=np.ones((2, 1), np.float32))
  with pytest.raises(ValueError, match=r"fp8_amax: granularity='row' needs x.ndim >= 1"):
    quant.fp8_amax(np.float32(1), "row")
  with pytest.raises(ValueError, match=r"quantize_fp8: granularity='row' needs x.ndim >= 1"):
    quant.quantize_fp8(np.float32(1), "e4m3", "row", amax=np.ones((1,), np.float32))
