"""Error-bounded lossy compression of the embedding exchange (arXiv 2407.04272).

"Accelerating Communication in Deep Learning Recommendation Model Training with
Dual-Level Adaptive Lossy Compression" compresses the pooled embeddings of DLRM's
all-to-all (and the gradients going back) with an error-bounded lossy compressor whose
bound adapts per table and per iteration. This module is that idea in static shapes, for
`EmbeddingCollection(a2a_compression=...)`:

  encode   rows x_RW -> payload_RP uint8: a row base (float32, the midrange), a step
           (bfloat16, rounded down from 2 * eb so |x - x'| <= step / 2 < eb), and codes
           q = round((x - base) / step), clipped to [-Q, Q], Q = 2^(bits-1) - 1, stored
           biased in `bits` = 4 | 8 | 16 bits (two 4-bit codes per byte)
  decode   x' = base + q * step: q * step is exact in float32 (|q| < 2^15, an 8-bit step
           significand), so the one rounding of the add gives the same bits on every
           backend, fused or not
  check    the sender decodes its own payload and tests every value against the bound
           (with a margin for the rounding of the test itself); one pmin over the devices
           agrees whether the whole exchange goes compressed or falls back to float32.
           Values that cannot meet the bound at this rate (a row wider than 2 Q steps, a
           bound below float32's resolution at that magnitude, inf, NaN) therefore never
           arrive lossy: such an exchange is the uncompressed one, bit for bit.

Bounds: `abs` (every decompressed value within `bound` of the sent one) or `rel` (within
`bound` times its row's value range max - min, SZ's value-range-relative bound, which
makes the rate fixed: a row always fits in Q >= 1 / (4 bound) codes). The fixed-rate
payload is what the collective sends (`payload_bytes`); an entropy coder's size of the
same codes is measured on the host (`entropy_bytes`, zstandard).

Dual-level adaptive bound: `table_factors` scales the bound per table (from a measured
sensitivity, `table_factors_from_sensitivity`), `schedule` scales it per iteration
(`Schedule`), each optional. A reduce-scatter (row-wise tables) is compressed as an
all-to-all of each device's contributions then a local sum, so a pooled rw value is
within N_shards * bound of the exact sum; its gradient (an all-gather) is compressed too.
The backward pass compresses the gradients with `grad_bound` (None: sent in float32).

Letters: R rows (one pooled vector of one bag and table), W row width, P payload bytes
per row, N devices on the exchange axes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from core import hlo
from core.errors import expected

MODES = ("abs", "rel")
BITS = (4, 8, 16)
SCHEDULES = ("constant", "linear", "cosine", "step")
HEADER_BYTES = 6            # float32 base + bfloat16 step
_STEP_MARGIN = 1.0 - 2.0 ** -7   # the step sits below 2 * eb before its bf16 rounding down
_CHECK_MARGIN = 1.0 - 2.0 ** -20  # covers the rounding of |x - x'| in the check
_MIN_EB = 2.0 ** -100       # a bound this small is tested only by exact equality (FTZ-safe)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Iteration-wise factor of the bound: start -> end over `steps` (then end)."""

  kind: str = "constant"      # constant | linear | cosine | step (start until steps, then end)
  start: float = 1.0
  end: float = 1.0
  steps: int = 1

  def factor(self, step) -> jax.Array:
    """The factor at train step `step` (traced or int)."""
    t = jnp.clip(jnp.asarray(step, jnp.float32) / max(self.steps, 1), 0.0, 1.0)
    if self.kind == "constant":
      return jnp.float32(self.start)
    if self.kind == "linear":
      w = t
    elif self.kind == "cosine":
      w = 0.5 * (1.0 - jnp.cos(jnp.pi * t))
    else:
      w = (t >= 1.0).astype(jnp.float32)
    return jnp.float32(self.start) + (self.end - self.start) * w


def parse_schedule(text: str, flag: str = "--a2a_schedule") -> Schedule:
  """"constant" | "KIND:START:END:STEPS" (KIND linear, cosine or step), factors > 0."""
  if text in ("", "constant"):
    return Schedule()
  parts = text.split(":")
  want = "constant or KIND:START:END:STEPS with KIND in linear|cosine|step, factors > 0, STEPS >= 1"
  if len(parts) != 4 or parts[0] not in SCHEDULES[1:]:
    raise expected(f"{flag}={text!r}", "not a schedule", want)
  try:
    start, end, steps = float(parts[1]), float(parts[2]), int(parts[3])
  except ValueError:
    raise expected(f"{flag}={text!r}", "a number does not parse", want) from None
  if not (math.isfinite(start) and math.isfinite(end) and start > 0 and end > 0 and steps >= 1):
    raise expected(f"{flag}={text!r}", f"start {start}, end {end}, steps {steps}", want)
  return Schedule(parts[0], start, end, steps)


def parse_table_factors(text: str, flag: str = "--a2a_table_factors") -> dict[str, float]:
  """"" | "NAME=FACTOR,..." (e.g. "C1=0.5,C3=2"), each table once, factors finite and > 0;
  the table names are checked against the collection's in `A2ACompression.check`."""
  want = "NAME=FACTOR,... (e.g. C1=0.5,C3=2), each table once, factors > 0"
  out: dict[str, float] = {}
  for part in (p.strip() for p in text.split(",") if p.strip()):
    name, eq, value = (s.strip() for s in part.partition("="))
    if not (name and eq):
      raise expected(f"{flag}={text!r}", f"{part!r} is not NAME=FACTOR", want)
    try:
      f = float(value)
    except ValueError:
      raise expected(f"{flag}={text!r}", f"the factor of {name} does not parse", want) from None
    if not (math.isfinite(f) and f > 0):
      raise expected(f"{flag}={text!r}", f"the factor of {name} is {f}", want)
    if name in out:
      raise expected(f"{flag}={text!r}", f"{name} is given twice", want)
    out[name] = f
  return out


@dataclasses.dataclass(frozen=True)
class A2ACompression:
  """The compression setting of a collection's exchange, validated once (`check`)."""

  mode: str = "abs"                       # abs | rel
  bound: float = 1e-3                     # forward (pooled embeddings)
  grad_bound: float | None = None         # backward (their gradients); None: float32
  bits: int = 8                           # code width: 4 | 8 | 16
  table_factors: Mapping[str, float] = dataclasses.field(default_factory=dict)
  schedule: Schedule = Schedule()

  def check(self, tables: Sequence[str] = ()) -> A2ACompression:
    """Raises a UserError naming the flag of the first bad setting; returns self."""
    if self.mode not in MODES:
      raise expected(f"--a2a_mode={self.mode!r}", "unknown mode", f"one of {list(MODES)}")
    if self.bits not in BITS:
      raise expected(f"--a2a_bits={self.bits}", "unsupported code width", f"one of {list(BITS)}")
    for flag, b in (("--a2a_error_bound", self.bound), ("--a2a_grad_error_bound", self.grad_bound)):
      if b is None and flag == "--a2a_grad_error_bound":
        continue
      if b is None or not math.isfinite(b) or b <= 0:
        raise expected(f"{flag}={b}", "not a finite error bound > 0",
                       "a number > 0 (abs: the largest |x - x'|; rel: a fraction of each "
                       "row's value range)")
      if self.mode == "abs" and b < 1e-30:
        raise expected(f"{flag}={b}", "below float32's useful range", "an absolute bound >= 1e-30")
      if self.mode == "rel":
        smallest = (b * min([1.0] + list(self.table_factors.values())) *
                    min(self.schedule.start, self.schedule.end))
        need, q = rel_codes_needed(smallest), 2 ** (self.bits - 1) - 1
        if b >= 0.5 or need > q:
          raise expected(f"{flag}={b}", f"a relative bound needing {need} codes "
                         f"each side at the smallest scaled bound (--a2a_bits={self.bits} "
                         f"holds {q})", "a larger bound or more bits")
    given = ",".join(f"{t}={f:g}" for t, f in self.table_factors.items())
    bad = [t for t, f in self.table_factors.items() if not (math.isfinite(f) and f > 0)]
    if bad:
      raise expected(f"--a2a_table_factors={given}", f"the factors of {bad} are not > 0",
                     "finite factors > 0")
    unknown = [t for t in self.table_factors if tables and t not in tables]
    if unknown:
      raise expected(f"--a2a_table_factors={given}", f"no table is named {unknown}",
                     f"names of the tables {list(tables)}")
    return self

  def factors(self, names: Sequence[str]) -> np.ndarray:
    """Table-wise factor per table name (1 where none is given)."""
    return np.asarray([self.table_factors.get(n, 1.0) for n in names], np.float32)


def rel_codes_needed(eps: float) -> int:
  """Codes each side of the base that a rel bound eps needs: |x - base| <= range / 2 and
  step >= 2 eps range (1 - 2^-7) * (1 - 2^-8) after the bf16 rounding down, plus one for
  the rounding of the row's base."""
  return int(math.ceil(1.0 / (4.0 * eps * _STEP_MARGIN * (1 - 2.0 ** -8)))) + 1


def payload_bytes(width: int, bits: int) -> int:
  """Bytes per row of the fixed-rate payload."""
  return HEADER_BYTES + (width * bits + 7) // 8


# --------------------------------------------------------------------------- codec


def _bf16_down(x):
  """float32 x >= 0 rounded toward zero to bfloat16: (its bf16 bits as uint16, the value as
  float32)."""
  u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & np.uint32(0xFFFF0000)
  return (u >> 16).astype(jnp.uint16), jax.lax.bitcast_convert_type(u, jnp.float32)


def _bytes(x, dtype):
  """[..., K] of `dtype` -> [..., K * itemsize] uint8."""
  b = jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint8)
  return b.reshape(x.shape[:-1] + (-1,))


def _from_bytes(b, dtype, n):
  """Inverse of `_bytes`: [..., n * itemsize] uint8 -> [..., n] `dtype`."""
  size = jnp.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(b.reshape(b.shape[:-1] + (n, size)), dtype)


def row_bound(x_RW, eb_R, mode: str):
  """Absolute bound per row: eb (abs), or eb times the row's value range (rel)."""
  if mode == "abs":
    return eb_R.astype(jnp.float32)
  rng = jnp.max(x_RW, axis=-1) - jnp.min(x_RW, axis=-1)
  return eb_R.astype(jnp.float32) * rng


def encode(x_RW, eb_R, mode: str, bits: int):
  """(payload_RP uint8, ok_R bool): ok where every decoded value of the row is within its
  bound (`row_bound`); a row that is not ok must not be sent lossy."""
  x = x_RW.astype(jnp.float32)
  R, W = x.shape
  ebr = row_bound(x, eb_R, mode)
  base = 0.5 * jnp.max(x, axis=-1) + 0.5 * jnp.min(x, axis=-1)      # no overflow of max + min
  step_u16, step = _bf16_down(jnp.maximum(2.0 * ebr * _STEP_MARGIN, 0.0))
  Q = 2 ** (bits - 1) - 1
  use = step > 0
  q = jnp.where(use[:, None], jnp.round((x - base[:, None]) / jnp.where(use, step, 1.0)[:, None]), 0.0)
  q = jnp.clip(jnp.nan_to_num(q), -Q, Q).astype(jnp.int32)
  x_dec = _decode_values(base, step, q)
  # Bit patterns, not float compares: under flush-to-zero a subnormal compares equal to 0
  # (and XLA:CPU may fold an equality of two bitcasts back into a float compare; the xor
  # keeps it integer). +0 and -0 count as equal.
  bx, bd = (jax.lax.bitcast_convert_type(v, jnp.uint32) for v in (x, x_dec))
  xor = bx ^ bd
  exact = jnp.all((xor == 0) | ((xor == np.uint32(0x80000000)) &
                                ((bx & np.uint32(0x7FFFFFFF)) == 0)), axis=-1)
  within = jnp.all(jnp.abs(x - x_dec) <= (ebr * _CHECK_MARGIN)[:, None], axis=-1)
  ok = exact | (within & (ebr >= _MIN_EB))
  u = (q + 2 ** (bits - 1)).astype(jnp.uint32)                      # biased: 1 .. 2^bits - 1
  if bits == 4:
    if W % 2:
      u = jnp.pad(u, ((0, 0), (0, 1)))
    codes = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(jnp.uint8)
  elif bits == 8:
    codes = u.astype(jnp.uint8)
  else:
    codes = _bytes(u.astype(jnp.uint16), jnp.uint16)
  header = jnp.concatenate([_bytes(base[:, None], jnp.float32),
                            _bytes(step_u16[:, None], jnp.uint16)], axis=-1)
  return jnp.concatenate([header, codes], axis=-1), ok


def _decode_values(base_R, step_R, q_RW):
  # q * step is exact (|q| < 2^15, step has 8 significant bits): one rounding in the add.
  return base_R[:, None] + q_RW.astype(jnp.float32) * step_R[:, None]


def decode(payload_RP, width: int, bits: int):
  """payload_RP uint8 -> x_RW float32."""
  base = _from_bytes(payload_RP[:, 0:4], jnp.float32, 1)[:, 0]
  step_u16 = _from_bytes(payload_RP[:, 4:6], jnp.uint16, 1)[:, 0]
  step = jax.lax.bitcast_convert_type(step_u16.astype(jnp.uint32) << 16, jnp.float32)
  c = payload_RP[:, HEADER_BYTES:]
  if bits == 4:
    c = c.astype(jnp.int32)
    u = jnp.stack([c & 0xF, c >> 4], axis=-1).reshape(c.shape[0], -1)[:, :width]
  elif bits == 8:
    u = c.astype(jnp.int32)
  else:
    u = _from_bytes(c, jnp.uint16, width).astype(jnp.int32)
  return _decode_values(base, step, u - 2 ** (bits - 1))


# --------------------------------------------------------------------------- collectives


def _all_ok(ok_R, axes):
  ok = jnp.all(ok_R).astype(jnp.int32)
  return (jax.lax.pmin(ok, axes) if axes else ok) > 0


def _a2a(x, axes):
  """all_to_all over the leading (device) dim as a 2-D [N, rest] buffer (XLA:CPU's
  verifier rejects some unit-dim layouts; the bytes are the same)."""
  return jax.lax.all_to_all(x.reshape(x.shape[0], -1), axes, 0, 0).reshape(x.shape)


def _send_a2a(x_NXW, eb_NX, mode, bits, axes):
  """Compressed all_to_all of x [N, ..., W] over the leading dim, or the float32 one when
  some row anywhere cannot meet its bound."""
  shape = x_NXW.shape
  x_RW = x_NXW.reshape(-1, shape[-1])
  payload, ok = encode(x_RW, eb_NX.reshape(-1), mode, bits)

  def compressed(_):
    p = _a2a(payload.reshape(shape[:-1] + payload.shape[-1:]), axes)
    return decode(p.reshape(-1, p.shape[-1]), shape[-1], bits).reshape(shape)

  def plain(_):
    return _a2a(x_NXW.astype(jnp.float32), axes)

  return jax.lax.cond(_all_ok(ok, axes), compressed, plain, None)


def _send_all_gather(x_XW, eb_X, mode, bits, axes):
  """Compressed tiled all_gather over the leading dim (or the float32 one)."""
  shape = x_XW.shape
  payload, ok = encode(x_XW.reshape(-1, shape[-1]), eb_X.reshape(-1), mode, bits)
  n = jax.lax.psum(1, axes)

  def compressed(_):
    p = jax.lax.all_gather(payload.reshape(shape[:-1] + payload.shape[-1:]), axes, axis=0,
                           tiled=True)
    return decode(p.reshape(-1, p.shape[-1]), shape[-1], bits).reshape(
        (shape[0] * n,) + shape[1:])

  def plain(_):
    return jax.lax.all_gather(x_XW.astype(jnp.float32), axes, axis=0, tiled=True)

  return jax.lax.cond(_all_ok(ok, axes), compressed, plain, None)


def all_to_all(x_NXW, eb_fwd, eb_bwd, cfg: A2ACompression, axes):
  """all_to_all(x, axes, 0, 0) inside shard_map, compressed with per-row bounds eb_fwd
  [N, ...] (rows of x); its transpose (the same all_to_all of the cotangent) compressed
  with eb_bwd [N, ...] (rows of the cotangent) or, eb_bwd None, sent in float32."""

  none = eb_bwd is None
  eb_bwd = jnp.zeros((), jnp.float32) if none else eb_bwd

  @jax.custom_vjp
  def f(x, eb_f, eb_b):
    return _send_a2a(x, eb_f, cfg.mode, cfg.bits, axes)

  def fwd(x, eb_f, eb_b):
    return f(x, eb_f, eb_b), (eb_f, eb_b)

  def bwd(res, g):
    eb_f, eb_b = res
    gx = _a2a(g, axes) if none else _send_a2a(g, eb_b, cfg.mode, cfg.bits, axes)
    return gx, jnp.zeros_like(eb_f), jnp.zeros_like(eb_b)

  f.defvjp(fwd, bwd)
  return f(x_NXW, eb_fwd, eb_bwd)


def reduce_scatter(x_BXW, eb_fwd, eb_bwd, cfg: A2ACompression, axes):
  """psum_scatter(x, axes, scatter_dimension=0, tiled=True) inside shard_map, as a
  compressed all_to_all of the N contributions and a local sum (eb_fwd [B, ...], rows of
  x); the transpose, an all_gather of the cotangent, compressed with eb_bwd [B / N, ...]."""
  n = jax.lax.psum(1, axes)
  none = eb_bwd is None
  eb_bwd = jnp.zeros((), jnp.float32) if none else eb_bwd

  @jax.custom_vjp
  def f(x, eb_f, eb_b):
    parts = x.reshape((n, -1) + x.shape[1:])
    return jnp.sum(_send_a2a(parts, eb_f.reshape((n, -1) + eb_f.shape[1:]), cfg.mode,
                             cfg.bits, axes), axis=0)

  def fwd(x, eb_f, eb_b):
    return f(x, eb_f, eb_b), (eb_f, eb_b)

  def bwd(res, g):
    eb_f, eb_b = res
    if none:
      gx = jax.lax.all_gather(g, axes, axis=0, tiled=True)
    else:
      gx = _send_all_gather(g, eb_b, cfg.mode, cfg.bits, axes)
    return gx, jnp.zeros_like(eb_f), jnp.zeros_like(eb_b)

  f.defvjp(fwd, bwd)
  return f(x_BXW, eb_fwd, eb_bwd)


# --------------------------------------------------------------------------- measuring


def entropy_bytes(payload_RP: np.ndarray, level: int = 3) -> int:
  """Bytes zstandard makes of a payload (host side): headers and codes as separate
  streams, the variable-rate size an entropy-coded scheme of the same codes reaches."""
  import zstandard
  p = np.ascontiguousarray(np.asarray(payload_RP, np.uint8))
  c = zstandard.ZstdCompressor(level=level)
  return (len(c.compress(np.ascontiguousarray(p[:, :HEADER_BYTES]).tobytes())) +
          len(c.compress(np.ascontiguousarray(p[:, HEADER_BYTES:]).tobytes())))


# The named scope of the collectives that carry pooled partials and their gradients
# (`sharding.base.Send` and `sharding.compressed.CompressedSend` run them under it).
EXCHANGE_SCOPE = "emb_exchange"
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MESH_GROUP = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_LIST_GROUP = re.compile(r"replica_groups=\{\{([^}]*)\}")
_IOTA_GROUP = re.compile(r"replica_groups=\[([0-9,]+)\]<=")


def _group_size(line: str) -> int:
  """Devices in each replica group of a collective's HLO line."""
  m = _MESH_GROUP.search(line)
  if m:
    sizes = {a.strip().strip("'"): int(n) for a, n in
             (kv.split("=") for kv in m.group(1).split(",") if kv.strip())}
    return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
  m = _LIST_GROUP.search(line)
  if m:
    return len([d for d in m.group(1).split(",") if d.strip()])
  m = _IOTA_GROUP.search(line)
  if m:
    return int(m.group(1).split(",")[-1])
  raise ValueError(f"exchange_bytes: no replica groups read in the HLO line {line.strip()!r}; "
                   "expected mesh[...] {axes}, {{...}} or [G,N]<=[...] groups")


def exchange_bytes(hlo_text: str) -> dict[str, int]:
  """Per-device bytes of a compiled program's embedding exchanges (the pooled partials and
  their gradients: the collectives under EXCHANGE_SCOPE; the ids, per-id weights and dp
  gradients the step also gathers are not counted), split by what they carry: "payload"
  (uint8 all-to-all / all-gather results: the compressed form) and "float32" (float32
  all-to-alls, reduce-scatters and all-gathers: uncompressed exchanges and, inside a
  compressed exchange's conditional, its fallback branch). A reduce-scatter counts its
  operand (each device's contribution to every shard: group size x its result), what its
  compressed form, an all-to-all of those contributions, sends as payload."""
  out = {"payload": 0, "float32": 0}
  for kind, result, line in hlo.collectives(hlo_text):
    if kind not in ("all-to-all", "all-gather", "reduce-scatter"):
      continue
    name = _OP_NAME.search(line)
    if name is None or EXCHANGE_SCOPE not in name.group(1).split("/"):
      continue
    n = hlo.shape_bytes(result) * (_group_size(line) if kind == "reduce-scatter" else 1)
    if result.lstrip("(").startswith("u8["):
      out["payload"] += n
    elif result.lstrip("(").startswith("f32["):
      out["float32"] += n
  return out


def table_factors_from_sensitivity(sensitivity: Mapping[str, float], lo: float = 0.25,
                                   hi: float = 4.0) -> dict[str, float]:
  """Table-wise factors: the bound scales with the geometric mean sensitivity over the
  table's own (a table twice as sensitive gets half the bound), clipped to [lo, hi]."""
  vals = {t: max(float(s), 1e-30) for t, s in sensitivity.items()}
  if not vals:
    return {}
  g = math.exp(sum(math.log(v) for v in vals.values()) / len(vals))
  return {t: float(min(hi, max(lo, g / v))) for t, v in vals.items()}


__all__ = ["A2ACompression", "BITS", "EXCHANGE_SCOPE", "HEADER_BYTES", "MODES", "Schedule", "all_to_all",
           "decode", "encode", "entropy_bytes", "exchange_bytes", "parse_schedule",
           "parse_table_factors", "payload_bytes", "reduce_scatter", "rel_codes_needed",
           "row_bound", "table_factors_from_sensitivity"]
