"""Bit flips per dtype, fault masks, stored formats, Wilson intervals (core/faults.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from core import faults

_VIEW = {np.dtype(np.float32): np.uint32, np.dtype(ml_dtypes.bfloat16): np.uint16,
         np.dtype(np.int8): np.uint8}


@pytest.mark.parametrize("dtype,width", [(np.float32, 32), (ml_dtypes.bfloat16, 16),
                                         (np.int8, 8)])
def test_flip_bits_flips_exactly_the_bit(dtype, width):
  rng = np.random.default_rng(0)
  if dtype == np.int8:
    x = rng.integers(-128, 128, 64).astype(np.int8)
  else:
    x = rng.standard_normal(64).astype(dtype)
  before = x.view(_VIEW[np.dtype(dtype)]).astype(np.uint64)
  for b in range(width):
    y = np.asarray(faults.flip_bits(jnp.asarray(x), jnp.uint32(1 << b)))
    assert y.dtype == np.dtype(dtype)
    diff = before ^ y.view(_VIEW[np.dtype(dtype)]).astype(np.uint64)
    np.testing.assert_array_equal(diff, np.uint64(1 << b), err_msg=f"bit {b}")
  # Named bits: the sign bit negates, fp32 bit 30 (exponent MSB) of 1.0 makes inf.
  if dtype != np.int8:
    np.testing.assert_array_equal(
        np.asarray(faults.flip_bits(jnp.asarray(x), jnp.uint32(1 << (width - 1)))), -x)
  assert float(faults.flip_bits(jnp.float32(1.0), jnp.uint32(1 << 30))) == np.inf
  assert int(faults.flip_bits(jnp.int8(5), jnp.uint32(1 << 7))) == 5 - 128


def test_flip_element_changes_one_element_only():
  v = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  out = np.asarray(faults.flip_element(v, jnp.int32(6), jnp.uint32(1 << 31)))
  want = np.arange(12, dtype=np.float32).reshape(3, 4)
  want[1, 2] = -6.0
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(np.asarray(faults.flip_element(v, jnp.int32(6), jnp.uint32(0))), v)
  encs = [{"v": v}, {"v": jnp.ones(5, jnp.float32)}]
  out = faults.flip_in_group(encs, jnp.int32(12 + 3), jnp.uint32(1 << 31))
  np.testing.assert_array_equal(np.asarray(out[0]["v"]), v)
  np.testing.assert_array_equal(np.asarray(out[1]["v"]), [1, 1, 1, -1, 1])


def _popcount(m):
  return np.array([bin(int(x)).count("1") for x in m])


def test_fault_masks():
  key = jax.random.key(0)
  m = np.asarray(faults.FaultModel("single").masks(key, 16, 2000))
  assert (_popcount(m) == 1).all() and m.max() < 1 << 16
  assert len(np.unique(m)) == 16       # every bit drawn
  assert (np.asarray(faults.FaultModel("single", 3).masks(key, 8, 10)) == 8).all()
  m = np.asarray(faults.FaultModel("multi", bits=3).masks(key, 8, 500))
  assert (_popcount(m) == 3).all() and m.max() < 256
  m = np.asarray(faults.FaultModel("burst", bits=4).masks(key, 32, 500))
  assert (_popcount(m) == 4).all()
  low = np.array([int(x) & -int(x) for x in m])        # lowest set bit
  np.testing.assert_array_equal(m, low * 15)           # 4 adjacent bits
  m = np.asarray(faults.FaultModel("burst", bit=28, bits=4).masks(key, 32, 3))
  assert (m == np.uint32(0xF0000000)).all()
  with pytest.raises(ValueError, match="does not fit"):
    faults.FaultModel("burst", bit=6, bits=4).masks(key, 8, 1)
  assert faults.FaultModel.parse("burst:2:5") == faults.FaultModel("burst", 5, 2)
  with pytest.raises(ValueError, match="fault model"):
    faults.FaultModel.parse("double")


def test_encode_decode_int8_rowwise():
  x = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
  enc = faults.encode(x, "int8")
  scale = np.abs(x).max(1) / 127
  np.testing.assert_allclose(np.asarray(enc["scale"]), scale, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(enc["v"]), np.round(x / scale[:, None]).astype(np.int8))
  np.testing.assert_allclose(np.asarray(faults.decode(enc)), x, atol=scale.max() / 2 + 1e-7)
  bf = faults.decode(faults.encode(x, "bf16"))
  np.testing.assert_array_equal(np.asarray(bf), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_wilson_known_values():
  lo, hi = faults.wilson(0, 100)
  assert lo == 0 and hi == pytest.approx(0.03699, abs=1e-5)
  lo, hi = faults.wilson(50, 100)
  assert lo == pytest.approx(0.40383, abs=1e-5) and hi == pytest.approx(0.59617, abs=1e-5)


def test_estimate_unused_values_pvf_zero_and_used_values_counted():
  w = jnp.asarray(np.random.default_rng(2).standard_normal(8), jnp.float32)
  xs = jnp.asarray(np.random.default_rng(3).standard_normal((16, 8)), jnp.float32)

  # Group = 4 values the output never reads (burst of 8 bits: NaNs and infs included).
  def unused(d, elem, mask, x):
    spare = faults.flip_element(d["spare"], elem, mask)
    del spare
    return d["x"][x] @ d["w"]
  data = {"w": w, "x": xs, "spare": jnp.ones(4, jnp.float32)}
  res = faults.estimate(unused, data, 4, 16, 32, faults.FaultModel("burst", bits=8),
                        faults.tolerance_criterion(0.0), 300, jax.random.key(0), chunk=64)
  assert res["changed"] == 0 and res["trials"] == 300 and res["pvf"] == 0

  # Sign-bit flips of the weights themselves: every one changes the output (x_i != 0).
  def used(d, elem, mask, x):
    return d["x"][x] @ faults.flip_element(d["w"], elem, mask)
  res = faults.estimate(used, data, 8, 16, 32, faults.FaultModel("single", 31),
                        faults.tolerance_criterion(0.0), 100, jax.random.key(0), chunk=64)
  assert res["changed"] == 100 and res["ci_low"] > 0.96


def test_a_trial_with_several_outputs_is_one_verdict():
  # Each trial outputs three values, [w0 * x, w1 * x, sum(w) * x]: a fault in w0 changes
  # two of them, so a count per output value would exceed the trials (PVF > 1).
  w = jnp.asarray([1.0, -2.0], jnp.float32)
  xs = jnp.asarray([1.0, 0.0], jnp.float32)     # example 1 reads nothing: no change

  def faulty(d, elem, mask, x):
    v = faults.flip_element(d["w"], elem, mask)
    return jnp.stack([v[0], v[1], jnp.sum(v)]) * d["x"][x]
  data = {"w": w, "x": xs}
  res = faults.exhaustive(faulty, data, 2, 2, 32, faults.tolerance_criterion(0.0), chunk=40)
  # numpy replay: a trial changed when any of its three outputs differs
  want = np.zeros((2, 32, 2), bool)
  w0 = np.asarray(w)
  with np.errstate(invalid="ignore", over="ignore"):
    for e in range(2):
      for b in range(32):
        v = w0.copy()
        v.view(np.uint32)[e] ^= np.uint32(1 << b)
        for x in range(2):
          ref = np.asarray([w0[0], w0[1], w0[0] + w0[1]]) * xs[x]
          out = np.asarray([v[0], v[1], v[0] + v[1]]) * xs[x]
          want[e, b, x] = not np.all(np.abs(out - ref) <= 0)
  np.testing.assert_array_equal(res["changed_VBX"], want)
  # every flip changes example 0; example 1 (x = 0) only through inf * 0 = NaN: exponent
  # bit 30 of 1.0 or of -2.0 (0xC0000000 -> 0x80000000 = -0.0: no), so one fault
  assert want[:, :, 1].sum() == 1 and res["changed"] == 64 + 1 <= res["trials"] == 128
  est = faults.estimate(faulty, data, 2, 2, 32, faults.FaultModel("single"),
                        faults.tolerance_criterion(0.0), 200, jax.random.key(0), chunk=64,
                        record=True)
  rec = est["records"]
  bit = np.log2(rec["mask"]).astype(int)
  np.testing.assert_array_equal(rec["changed"], want[rec["elem"], bit, rec["example"]])
  assert est["changed"] == int(rec["changed"].sum()) <= est["trials"] == 200


# ------------------------------------------------------------------ exact enumeration

def _read_own_value(fmt):
  """A group of two values w = [1.0, 3.0] stored in `fmt`; example e outputs its value w[e]."""
  enc = faults.encode(jnp.asarray([1.0, 3.0]), fmt)

  def faulty(d, elem, mask, x):
    e = dict(d)
    e["v"] = faults.flip_element(d["v"], elem, mask)
    return faults.decode(e)[x]
  return faulty, enc


# The single-bit faults that move a value across the 0.5 decision, worked out by hand from
# the bit patterns (value, bits), examples reading only their own value:
#   fp32 1.0 = 0x3F800000: the sign, exponent bits 24..29 (2^-1 .. 2^-63 are < 0.5 except
#        bit 23's 0.5), bit 30 (exponent 255: inf); 3.0 = 0x40400000: the sign and bit 30
#        (exponent 0: a subnormal); every other flip keeps the value >= 0.5.
#   bf16 the same fields, 16 bits lower: 1.0 bits 8..15, 3.0 bits 14, 15.
#   int8 one row, scale 3 / 127: codes 42 (0b00101010) and 127; 42 -> 10 (bit 5) and
#        -86 (bit 7) fall below 0.5 * 127 / 3 = 21.2; 127 only by its sign bit.
_HAND = {"fp32": ({24, 25, 26, 27, 28, 29, 30, 31}, {30, 31}, 1),
         "bf16": ({8, 9, 10, 11, 12, 13, 14, 15}, {14, 15}, 1),
         "int8": ({5, 7}, {7}, 0)}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_exhaustive_equals_hand_enumeration(fmt):
  width = faults.bit_width(fmt)
  faulty, enc = _read_own_value(fmt)
  res = faults.exhaustive(faulty, enc, 2, 2, width, faults.threshold_criterion(0.5), chunk=48)
  bits0, bits1, inf = _HAND[fmt]
  want = np.zeros((2, width, 2), bool)
  want[0, sorted(bits0), 0] = True
  want[1, sorted(bits1), 1] = True        # a value the example does not read changes nothing
  np.testing.assert_array_equal(res["changed_VBX"], want)
  assert res["trials"] == 2 * width * 2 and res["changed"] == len(bits0) + len(bits1)
  assert res["pvf"] == (len(bits0) + len(bits1)) / (4 * width) and res["nonfinite"] == inf
  # Uniform single-bit trials estimate that fraction: it lies in their Wilson interval at
  # z = 4 (a draw outside it has probability 6e-5; z = 1.96 would miss 1 seed in 20).
  est = faults.estimate(faulty, enc, 2, 2, width, faults.FaultModel("single"),
                        faults.threshold_criterion(0.5), 3000, jax.random.key(5), chunk=1000)
  lo, hi = faults.wilson(est["changed"], est["trials"], z=4.0)
  assert lo <= res["pvf"] <= hi, (est, res["pvf"])
  sub = faults.exhaustive(faulty, enc, 2, 2, width, faults.threshold_criterion(0.5),
                          bits=(width - 1,))
  assert sub["changed"] == 2 and sub["pvf"] == 0.5        # sign flips, read by one example
  with pytest.raises(ValueError, match="bits"):
    faults.exhaustive(faulty, enc, 2, 2, width, faults.threshold_criterion(), bits=(width,))


@pytest.mark.parametrize("k,n", [(0, 100), (3, 10), (17, 2000), (1999, 2000), (40, 40)])
def test_wilson_is_the_score_test_inversion(k, n):
  # The interval's ends are the roots in p of (k/n - p)^2 = z^2 p (1 - p) / n.
  z, ph = 1.96, k / n
  roots = np.sort(np.roots([1 + z * z / n, -(2 * ph + z * z / n), ph * ph]).real)
  lo, hi = faults.wilson(k, n)
  np.testing.assert_allclose([lo, hi], np.clip(roots, 0, 1), atol=1e-12)


# ------------------------------------------------------------------ settings and their errors

def test_fault_model_texts_and_their_errors():
  assert [faults.FaultModel.parse(t) for t in ("single", "single:3", "multi:2", "burst:4")] == [
      faults.FaultModel("single"), faults.FaultModel("single", 3),
      faults.FaultModel("multi", bits=2), faults.FaultModel("burst", bits=4)]
  for m in (faults.FaultModel("single"), faults.FaultModel("single", 3),
            faults.FaultModel("multi", bits=2), faults.FaultModel("burst", bits=4),
            faults.FaultModel("burst", 5, 2)):
    assert faults.FaultModel.parse(m.label) == m   # a label is its text
  forms = "expected single, single:<bit>, multi:<k>, burst:<k> or burst:<k>:<start bit>"
  for text in ("single:x", "single:1:2", "multi", "burst", "burst:1:2:3", "double:2", ""):
    with pytest.raises(ValueError) as e:
      faults.FaultModel.parse(text)
    assert str(e.value) == f"fault model {text!r}: {forms}"
  for text in ("multi:0", "burst:-1:4"):   # the form is right, k is not
    with pytest.raises(ValueError) as e:
      faults.FaultModel.parse(text)
    assert str(e.value) == f"fault model {text!r}: k={text.split(':')[1]}; expected k >= 1 bits"
  with pytest.raises(ValueError, match=r"^FaultModel.kind='flip': expected single, multi or "
                                       r"burst$"):
    faults.FaultModel("flip")
  with pytest.raises(ValueError, match=r"^FaultModel.bits=0: expected >= 1$"):
    faults.FaultModel("burst", bits=0)
  with pytest.raises(ValueError, match=r"^FaultModel: kind=multi picks its bits at random; got "
                                       r"bit=3$"):
    faults.FaultModel("multi", 3, 2)
  with pytest.raises(ValueError, match=r"^fault multi:9: does not fit a 8-bit value$"):
    faults.FaultModel("multi", bits=9).check(8)
  with pytest.raises(ValueError, match=r"^fault single:-1: does not fit a 32-bit value$"):
    faults.FaultModel("single", -1).check(32)


def test_criteria_from_text():
  ref = jnp.asarray([0.2, 0.6, 0.2, 0.6])
  out = jnp.asarray([0.4, 0.55, np.nan, 0.7])
  np.testing.assert_array_equal(faults.make_criterion("threshold")(ref, out), [0, 0, 1, 0])
  np.testing.assert_array_equal(faults.make_criterion("threshold:0.3")(ref, out), [1, 0, 1, 0])
  np.testing.assert_array_equal(faults.make_criterion("tol:0.1")(ref, out), [1, 0, 1, 0])
  np.testing.assert_array_equal(faults.make_criterion("tol:0")(ref, out), [1, 1, 1, 1])
  logits = jnp.asarray([[0.0, 1.0], [2.0, 1.0]])
  np.testing.assert_array_equal(
      faults.make_criterion("top1")(logits, jnp.asarray([[1.0, 0.0], [2.0, np.inf]])), [1, 1])
  # NaN bounds would make every comparison false: no change ever counted, or every one
  for text in ("threshold:nan", "threshold:x", "tol", "tol:", "tol:-0.1", "tol:nan", "top1:3",
               "exact"):
    with pytest.raises(ValueError) as e:
      faults.make_criterion(text)
    assert str(e.value) == (f"criterion {text!r}: expected threshold[:t], tol:<x> with x >= 0, "
                            "or top1")


def test_bad_formats_and_sizes_are_refused_before_any_trial():
  with pytest.raises(ValueError, match=r"^format 'fp16': expected one of \('fp32', 'bf16', "
                                       r"'int8'\)$"):
    faults.bit_width("fp16")
  with pytest.raises(ValueError, match=r"^format 'fp16': expected one of"):
    faults.encode(jnp.ones(3), "fp16")
  with pytest.raises(ValueError, match=r"^flip_bits: dtype complex64 of 8 bytes; expected 1, 2 or "
                                       r"4$"):
    faults.flip_bits(jnp.ones(2, jnp.complex64), jnp.uint32(1))
  assert faults.wilson(0, 0) == (0.0, 1.0)   # no trials: nothing known

  def never(*a):
    raise AssertionError("a trial ran")
  crit = faults.tolerance_criterion(0.0)
  with pytest.raises(ValueError, match=r"^estimate: size=0, num_examples=4, trials=10; expected "
                                       r">= 1 each$"):
    faults.estimate(never, {}, 0, 4, 32, faults.FaultModel(), crit, 10, jax.random.key(0))
  with pytest.raises(ValueError, match=r"^estimate: size=2147483648 values; int32 element indices "
                                       r"need < 2\*\*31$"):
    faults.estimate(never, {}, 2**31, 4, 32, faults.FaultModel(), crit, 10, jax.random.key(0))
  with pytest.raises(ValueError, match=r"^exhaustive: 2147483648 faults; expected < 2\*\*31 \(use "
                                       r"estimate\)$"):
    faults.exhaustive(never, {}, 2**20, 2**6, 32, crit)
