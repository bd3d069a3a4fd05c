"""Bit-flip fault injection and the parameter vulnerability factor (PVF, arXiv 2405.01741).

PVF of a group of values = the probability that one fault in one of its values (a silent
data corruption: bits flipped in the stored number) changes the model's output on one
input, under a stated criterion. It is estimated by Monte-Carlo trials: each trial draws a
value of the group uniformly, a bit mask from a `FaultModel` (one chosen or random bit;
k distinct random bits; a burst of k adjacent bits) and one input, runs the model with that
value corrupted and compares the output with the fault-free output of the same input.
Trials are Bernoulli and independent, so the estimate's confidence interval is Wilson's
score interval on the number of trials.

Values are flipped in the format they are stored in (`encode` / `decode`):
  fp32  the float32 bits (sign 31, exponent 30..23, mantissa 22..0)
  bf16  the bfloat16 bits (sign 15, exponent 14..7, mantissa 6..0)
  int8  the two's-complement code of symmetric row-wise int8 (a float32 scale per row of
        the last axis, amax / 127, never faulted); bit 7 is the sign bit
The fault-free reference runs on decode(encode(x)), so a trial differs from its reference
by the flipped bits only.

`estimate` takes the model as `faulty(data, elem, mask, example) -> output` for one trial (the
caller decides how a corrupted value reaches the output: a copy of a small weight with one
element changed, or only the rows an input reads for a big embedding table; an output of
several values changed when the criterion says so of any of them) and runs the
trials vmapped and jitted in chunks; each chunk's reference outputs come from the same
compiled function on the same elements and examples in the same lanes with mask 0 (xor 0
changes no bit), so a value the output does not depend on has PVF exactly 0 even under
|change| > 0. `exhaustive` runs every single-bit fault of a group instead (every value, bit
and example once): the exact PVF that `estimate` samples, for small groups and checks.

Letters: N trials in a chunk, X examples.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("fp32", "bf16", "int8")
_WIDTH = {"fp32": 32, "bf16": 16, "int8": 8}
_UINT = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}


def bit_width(fmt: str) -> int:
  """Bits of one stored value of format `fmt`."""
  if fmt not in _WIDTH:
    raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
  return _WIDTH[fmt]


def flip_bits(x: jax.Array, mask: jax.Array) -> jax.Array:
  """x with the bits set in `mask` (an unsigned int, broadcast against x) flipped: xor on
  x's own bit pattern (float32, bfloat16, float16, int8, uint8, int32, ...)."""
  x = jnp.asarray(x)
  u = _UINT.get(x.dtype.itemsize)
  if u is None:
    raise ValueError(f"flip_bits: dtype {x.dtype} of {x.dtype.itemsize} bytes; expected 1, 2 or 4")
  bits = jax.lax.bitcast_convert_type(x, u)
  return jax.lax.bitcast_convert_type(bits ^ jnp.asarray(mask).astype(u), x.dtype)


def flip_element(v: jax.Array, elem: jax.Array, mask: jax.Array) -> jax.Array:
  """v with the bits `mask` of its flat element `elem` flipped (no change for mask 0)."""
  flat = v.reshape(-1)
  return flat.at[elem].set(flip_bits(flat[elem], mask)).reshape(v.shape)


def flip_in_group(encs: list[dict[str, jax.Array]], elem: jax.Array,
                  mask: jax.Array) -> list[dict[str, jax.Array]]:
  """Stored forms of a group's arrays with the bits `mask` of the group's flat element
  `elem` flipped; the elements are numbered array after array in list order."""
  out, off = [], 0
  for e in encs:
    n = int(np.size(e["v"]))
    local = elem - off
    inside = (local >= 0) & (local < n)
    new = dict(e)
    new["v"] = flip_element(e["v"], jnp.clip(local, 0, n - 1), jnp.where(inside, mask, 0))
    out.append(new)
    off += n
  return out


def group_size(encs: list[dict[str, jax.Array]]) -> int:
  return int(sum(np.size(e["v"]) for e in encs))


# ------------------------------------------------------------------ stored formats

def encode(x: jax.Array, fmt: str) -> dict[str, jax.Array]:
  """The stored form of float values x: {"v": values} (+ {"scale": [rows]} for int8, one
  scale per row of the last axis; a 0-d or 1-d x is one row)."""
  x = jnp.asarray(x, jnp.float32)
  if fmt == "fp32":
    return {"v": x}
  if fmt == "bf16":
    return {"v": x.astype(jnp.bfloat16)}
  if fmt == "int8":
    rows = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    amax = jnp.max(jnp.abs(rows), axis=1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(rows / scale[:, None]), -127, 127).astype(jnp.int8)
    return {"v": q.reshape(x.shape), "scale": scale}
  raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")


def decode(enc: dict[str, jax.Array]) -> jax.Array:
  """float32 values of a stored form (`encode`'s output, possibly with flipped bits)."""
  v = enc["v"]
  if "scale" not in enc:
    return v.astype(jnp.float32)
  rows = v.reshape(-1, v.shape[-1] if v.ndim else 1).astype(jnp.float32)
  return (rows * enc["scale"].reshape(-1)[:, None]).reshape(v.shape)


# ------------------------------------------------------------------ fault models

@dataclasses.dataclass(frozen=True)
class FaultModel:
  """Which bits one fault flips.

  single: one bit, `bit` (None: uniform over the value's bits);
  multi:  `bits` distinct bits, uniform (bit must be None);
  burst:  `bits` adjacent bits starting at `bit` (None: a uniform start that fits).
  """

  kind: str = "single"
  bit: int | None = None
  bits: int = 1

  def __post_init__(self):
    if self.kind not in ("single", "multi", "burst"):
      raise ValueError(f"FaultModel.kind={self.kind!r}: expected single, multi or burst")
    if self.bits < 1:
      raise ValueError(f"FaultModel.bits={self.bits}: expected >= 1")
    if self.kind == "multi" and self.bit is not None:
      raise ValueError(f"FaultModel: kind=multi picks its bits at random; got bit={self.bit}")

  @classmethod
  def parse(cls, text: str) -> FaultModel:
    """"single" | "single:<bit>" | "multi:<k>" | "burst:<k>" | "burst:<k>:<start bit>"."""
    kind, *args = text.split(":")
    try:
      nums = [int(a) for a in args]
    except ValueError:
      nums = None
    if nums is None or len(nums) not in {"single": (0, 1), "multi": (1,),
                                         "burst": (1, 2)}.get(kind, ()):
      raise ValueError(f"fault model {text!r}: expected single, single:<bit>, multi:<k>, "
                       "burst:<k> or burst:<k>:<start bit>")
    if kind != "single" and nums[0] < 1:
      raise ValueError(f"fault model {text!r}: k={nums[0]}; expected k >= 1 bits")
    if kind == "single":
      return cls("single", nums[0] if nums else None)
    if kind == "multi":
      return cls("multi", None, nums[0])
    return cls("burst", nums[1] if len(nums) == 2 else None, nums[0])

  @property
  def label(self) -> str:
    if self.kind == "single":
      return "single" if self.bit is None else f"single:{self.bit}"
    if self.kind == "multi":
      return f"multi:{self.bits}"
    return f"burst:{self.bits}" + ("" if self.bit is None else f":{self.bit}")

  def check(self, width: int) -> None:
    k = 1 if self.kind == "single" else self.bits
    top = (self.bit or 0) + (k if self.kind == "burst" else 1)
    if k > width or (self.bit is not None and not (0 <= self.bit and top <= width)):
      raise ValueError(f"fault {self.label}: does not fit a {width}-bit value")

  def masks(self, key: jax.Array, width: int, n: int) -> jax.Array:
    """[n] uint32 bit masks (bits below `width`)."""
    self.check(width)
    one = jnp.uint32(1)
    if self.kind == "single":
      b = (jnp.full((n,), self.bit, jnp.uint32) if self.bit is not None
           else jax.random.randint(key, (n,), 0, width).astype(jnp.uint32))
      return one << b
    if self.kind == "multi":   # k smallest of `width` uniforms: a uniform k-subset of bits
      order = jnp.argsort(jax.random.uniform(key, (n, width)), axis=1)[:, :self.bits]
      return jnp.sum(one << order.astype(jnp.uint32), axis=1, dtype=jnp.uint32)
    start = (jnp.full((n,), self.bit, jnp.uint32) if self.bit is not None
             else jax.random.randint(key, (n,), 0, width - self.bits + 1).astype(jnp.uint32))
    run = jnp.uint32((1 << self.bits) - 1) if self.bits < 32 else jnp.uint32(0xFFFFFFFF)
    return run << start


# ------------------------------------------------------------------ criteria

def threshold_criterion(threshold: float = 0.5) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """A probability crossing the decision threshold (or turning non-finite) is a change."""
  def changed(ref, out):
    return ((ref >= threshold) != (out >= threshold)) | ~jnp.isfinite(out)
  return changed


def tolerance_criterion(tol: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """|out - ref| > tol (or a non-finite out) is a change."""
  def changed(ref, out):
    return ~(jnp.abs(out - ref) <= tol)
  return changed


def top1_criterion() -> Callable[[jax.Array, jax.Array], jax.Array]:
  """Logits [..., V]: the argmax changing (or any logit turning non-finite) is a change."""
  def changed(ref, out):
    return ((jnp.argmax(ref, -1) != jnp.argmax(out, -1))
            | ~jnp.all(jnp.isfinite(out), axis=-1))
  return changed


def make_criterion(text: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """"threshold[:t]" (default 0.5) | "tol:<x>" (x >= 0) | "top1". A NaN t or x, under
  which every comparison is false, is refused."""
  name, _, arg = text.partition(":")
  try:
    value = float(arg) if arg else None
  except ValueError:
    value = math.nan
  if name == "threshold" and not (value is not None and math.isnan(value)):
    return threshold_criterion(0.5 if value is None else value)
  if name == "tol" and value is not None and value >= 0:
    return tolerance_criterion(value)
  if name == "top1" and not arg:
    return top1_criterion()
  raise ValueError(f"criterion {text!r}: expected threshold[:t], tol:<x> with x >= 0, or "
                   "top1")


# ------------------------------------------------------------------ estimation

def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """Wilson score interval for k successes in n Bernoulli trials (95% for z = 1.96)."""
  if n <= 0:
    return 0.0, 1.0
  p = k / n
  den = 1 + z * z / n
  mid = (p + z * z / (2 * n)) / den
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
  return max(0.0, mid - half), min(1.0, mid + half)


@functools.lru_cache(maxsize=8)
def _trials(faulty: Callable[..., Any], criterion: Callable[[jax.Array, jax.Array], jax.Array],
            chunk: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """trials(data, elem [chunk], mask [chunk], example [chunk]) -> (changed, nonfinite) [chunk]
  bools: `faulty` vmapped and jitted, judged against the same call with mask 0 in the same
  lanes (XLA may round a lane differently by its position). Kept for the same (faulty,
  criterion, chunk), so several fault models of one group compile once."""
  run = jax.jit(jax.vmap(faulty, in_axes=(None, 0, 0, 0)))
  zeros_m = jnp.zeros((chunk,), jnp.uint32)

  @jax.jit
  def judge(ref_out, out):
    # One verdict per trial: a trial whose output holds several values (a probability per
    # task, a logit row per position) changed when any of them did.
    ch = criterion(ref_out, out)
    ch = jnp.any(ch.reshape(ch.shape[0], -1), axis=1)
    bad = jax.tree.map(lambda o: ~jnp.all(jnp.isfinite(o).reshape(o.shape[0], -1), axis=1), out)
    return ch, bad

  def trials(data, elem, mask, ex):
    return judge(run(data, elem, zeros_m, ex), run(data, elem, mask, ex))
  return trials


def _check_sizes(where: str, size: int, num_examples: int, trials: int) -> None:
  if size < 1 or num_examples < 1 or trials < 1:
    raise ValueError(f"{where}: size={size}, num_examples={num_examples}, trials={trials}; "
                     "expected >= 1 each")
  if size >= 2**31:
    raise ValueError(f"{where}: size={size} values; int32 element indices need < 2**31")


def estimate(faulty: Callable[..., Any], data: Any, size: int, num_examples: int, width: int,
             fault: FaultModel, criterion: Callable[[jax.Array, jax.Array], jax.Array],
             trials: int, key: jax.Array, chunk: int = 256,
             record: bool = False) -> dict[str, Any]:
  """PVF of a group of `size` values: `trials` faults, each on a uniform value and example.

  faulty(data, elem, mask, example) -> output of one trial (`data`: the arrays it reads,
  passed to the jitted function as arguments, never baked in as constants; int32 elem in
  [0, size), uint32 mask, int32 example in [0, num_examples)); mask 0 must give the
  fault-free output. Returns {trials, changed, nonfinite, pvf, ci_low, ci_high}; with
  `record`, also "records": {elem, mask, example, changed} numpy arrays [trials], each
  trial as drawn (so an independent computation can replay it).
  """
  _check_sizes("estimate", size, num_examples, trials)
  fault.check(width)
  chunk = max(1, min(chunk, trials))
  run = _trials(faulty, criterion, chunk)
  changed = nonfinite = done = 0
  records: dict[str, list[np.ndarray]] = {"elem": [], "mask": [], "example": [], "changed": []}
  k_e, k_m, k_x = jax.random.split(key, 3)
  for i, s in enumerate(range(0, trials, chunk)):
    n = min(chunk, trials - s)
    elem = jax.random.randint(jax.random.fold_in(k_e, i), (chunk,), 0, size, jnp.int32)
    mask = fault.masks(jax.random.fold_in(k_m, i), width, chunk)
    ex = jax.random.randint(jax.random.fold_in(k_x, i), (chunk,), 0, num_examples, jnp.int32)
    ch, bad = run(data, elem, mask, ex)
    changed += int(np.asarray(ch)[:n].sum())
    nonfinite += int(np.asarray(bad)[:n].sum())
    done += n
    if record:
      for k, v in (("elem", elem), ("mask", mask), ("example", ex), ("changed", ch)):
        records[k].append(np.asarray(v)[:n])
  lo, hi = wilson(changed, done)
  out = {"trials": done, "changed": changed, "nonfinite": nonfinite, "pvf": changed / done,
         "ci_low": lo, "ci_high": hi}
  if record:
    out["records"] = {k: np.concatenate(v) for k, v in records.items()}
  return out


def exhaustive(faulty: Callable[..., Any], data: Any, size: int, num_examples: int, width: int,
               criterion: Callable[[jax.Array, jax.Array], jax.Array],
               bits: tuple[int, ...] | None = None, chunk: int = 256) -> dict[str, Any]:
  """The exact single-bit PVF of a group: every (value, bit, example) once, so PVF is the
  fraction of them that change the output (what `estimate` with FaultModel("single")
  samples uniformly; a check of it, or the answer itself for a small group).

  `bits` (default every bit below `width`) restricts the flipped bit positions. Returns
  {trials, changed, nonfinite, pvf, ci_low = ci_high = pvf} and "changed_VBX": the verdict
  of every fault, a bool array [size, len(bits), num_examples].
  """
  bits = tuple(range(width)) if bits is None else tuple(bits)
  if not bits or any(not 0 <= b < width for b in bits):
    raise ValueError(f"exhaustive: bits={bits}; expected bit positions in [0, {width})")
  total = size * len(bits) * num_examples
  _check_sizes("exhaustive", size, num_examples, total)
  if total >= 2**31:
    raise ValueError(f"exhaustive: {total} faults; expected < 2**31 (use estimate)")
  chunk = max(1, min(chunk, total))
  run = _trials(faulty, criterion, chunk)
  bit_arr = jnp.asarray(bits, jnp.uint32)
  changed = np.zeros(total, bool)
  nonfinite = 0
  for s in range(0, total, chunk):
    n = min(chunk, total - s)
    i = jnp.minimum(s + jnp.arange(chunk, dtype=jnp.int32), total - 1)   # padded lanes repeat
    ex = i % num_examples
    b = (i // num_examples) % len(bits)
    elem = i // (num_examples * len(bits))
    ch, bad = run(data, elem, jnp.uint32(1) << bit_arr[b], ex)
    changed[s:s + n] = np.asarray(ch)[:n]
    nonfinite += int(np.asarray(bad)[:n].sum())
  k = int(changed.sum())
  return {"trials": total, "changed": k, "nonfinite": nonfinite, "pvf": k / total,
          "ci_low": k / total, "ci_high": k / total,
          "changed_VBX": changed.reshape(size, len(bits), num_examples)}
