"""Synthetic Criteo-shaped batches generated on the accelerator by one jitted function.

`DeviceSynthetic` draws from the same hidden model as `synthetic.SyntheticCriteo` (the
numpy generator, which stays the reference): the same Zipf law over the same permuted
rows, the same per-row weights (SplitMix64 of seed, feature and row), the same dense
log-normal counts, teacher, calibration and bias. Only the random stream differs (JAX's
threefry instead of numpy's PCG64), so a batch is a different draw of the same
distribution. Batch k is a pure function of (seed, split, k) and does not depend on the
mesh: jax's partitionable threefry gives every device the rows it holds, so the generator
writes each shard where the train step reads it and no data crosses the host.

How each piece matches the reference:
  - Zipf ranks: the reference's law (exact pmf (r+1)^-alpha on the first 1024 ranks, the
    midpoint-rule integral of x^-alpha past them) is cut into segments: one per head rank,
    then tail segments spanning a ratio of 1 + 1/256 of rank and at most 4096 ranks. A
    32-bit uniform picks the segment through cumulative thresholds (each segment's
    probability exact to 2^-32); a float32 uniform (2^23 values, so at least 2048 per rank)
    picks the rank inside a tail segment by the inverse of the integral of x^-alpha over
    it, written as expm1 / log1p of the offset so that float32 keeps the offset exact to
    about 1e-3 of a rank at any table size below 2^31 rows.
  - Row permutation (a * rank + b) mod rows: a sum of precomputed a * 2^i mod rows over
    the bits of rank, reduced after every add, all in uint32 (no 64-bit integers on device).
  - Row weights: SplitMix64 in pairs of uint32 words, the top 24 bits of the 53 the
    reference keeps (so each weight is within 2^-23 of the reference's).
  - Planted logit: float32 with HIGHEST matmul precision; it agrees with the reference's
    float64 `true_logits` to about 1e-5 on the same ids and dense values (tested).

Letters: B batch, Dn dense features, F sparse features, L ids per bag (padded), S live id
slots of an example (sum of bag sizes), K latent components, G Zipf segments.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rec.data import synthetic
from rec.data.batch import SparseBatch

SEGMENTS_PER_E = 256    # tail segments per factor e of rank: each spans a ratio of 1 + 1/256
MAX_SEGMENT_WIDTH = 4096  # ... and at most this many ranks
HIGHEST = jax.lax.Precision.HIGHEST
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def zipf_segments(num_rows: int, alpha: float) -> dict[str, np.ndarray]:
  """Segments of the reference Zipf law of one table size.

  Returns start [G] int64 (first rank), width [G] int64, threshold [G - 1] uint32 (upper
  cumulative probability of segments 0 .. G-2, in units of 2^-32) and coef [G] float64
  (the segment's c in the in-segment inverse; see `_rank_in_segment`).
  """
  head = min(num_rows, synthetic._EXACT_HEAD)
  starts = list(range(head))
  b = head
  while b < num_rows:
    starts.append(b)
    b = min(num_rows, b + MAX_SEGMENT_WIDTH,
            max(b + 1, math.floor(b * (1 + 1 / SEGMENTS_PER_E))))
  start = np.array(starts, np.int64)
  end = np.append(start[1:], num_rows)
  width = end - start
  mass = np.empty(len(start), np.float64)
  mass[:head] = np.arange(1, head + 1, dtype=np.float64) ** -alpha
  if len(start) > head:
    ad = synthetic._antideriv
    mass[head:] = ad(end[head:] + 0.5, alpha) - ad(start[head:] + 0.5, alpha)
  cum = np.cumsum(mass) / mass.sum()
  threshold = np.minimum(np.rint(cum[:-1] * 2.0**32), 2.0**32 - 1).astype(np.uint32)
  rho = width / (start + 0.5)
  coef = np.log1p(rho) if alpha == 1.0 else np.expm1((1.0 - alpha) * np.log1p(rho))
  return {"start": start, "width": width, "threshold": threshold, "coef": coef}


def _rank_in_segment(q, coef, alpha: float):
  """z with x = x0 (1 + z): the inverse, at fraction q of the segment's mass, of the
  integral of x^-alpha from x0 (coef = log1p(rho) for alpha 1, else (1+rho)^(1-alpha) - 1)."""
  if alpha == 1.0:
    return jnp.expm1(q * coef)
  return jnp.expm1(jnp.log1p(q * coef) / (1.0 - alpha))


def _search(thr, lo, hi, u, steps: int):
  """Per element, the first index j in [lo, hi) with thr[j] > u (hi when none).

  A loop, not unrolled: each step uses lo and hi twice, and fusing an unrolled chain of
  such steps makes XLA's compile time explode."""
  def body(_, c):
    lo, hi = c
    mid = (lo + hi) // 2
    go = (mid < hi) & (thr[jnp.minimum(mid, thr.shape[0] - 1)] <= u)
    return jnp.where(go, mid + 1, lo), jnp.where(go, hi, mid)
  return jax.lax.fori_loop(0, steps, body, (lo, hi))[0]


def _u32(x: int) -> jax.Array:
  return jnp.uint32(x & 0xFFFFFFFF)


def _mulhi(a, b):
  """High 32 bits of the 64-bit product of uint32 arrays (Hacker's Delight 8-2)."""
  m = jnp.uint32(0xFFFF)
  a0, a1, b0, b1 = a & m, a >> 16, b & m, b >> 16
  w1 = a1 * b0 + ((a0 * b0) >> 16)
  w2 = a0 * b1 + (w1 & m)
  return a1 * b1 + (w1 >> 16) + (w2 >> 16)


def _mul64(hi, lo, c: int):
  """(hi, lo) * c mod 2^64, a 64-bit value as two uint32 words."""
  ch, cl = _u32(c >> 32), _u32(c)
  return _mulhi(lo, cl) + lo * ch + hi * cl, lo * cl


def _xorshift64(hi, lo, k: int):
  """x ^ (x >> k) for 0 < k < 32."""
  return hi ^ (hi >> k), lo ^ ((lo >> k) | (hi << (32 - k)))


def hash_uniform(salt_hi, salt_lo, ids) -> jax.Array:
  """`synthetic._hash_uniform` on device: [-1, 1) float32 from SplitMix64 of (salt, id)."""
  hi, lo = _mul64(jnp.zeros_like(ids, jnp.uint32), ids.astype(jnp.uint32), _GOLDEN)
  hi, lo = hi ^ salt_hi, lo ^ salt_lo
  hi, lo = _mul64(*_xorshift64(hi, lo, 30), _MIX1)
  hi, lo = _mul64(*_xorshift64(hi, lo, 27), _MIX2)
  hi = hi ^ (hi >> 31)  # the top word of x ^ (x >> 31): all the float keeps
  return (hi >> 8).astype(jnp.float32) * jnp.float32(2.0**-23) - 1.0


def _split64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  x = np.asarray(x).astype(np.uint64)
  return (x >> np.uint64(32)).astype(np.uint32), (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)


class DeviceSynthetic:
  """SyntheticCriteo's distribution, drawn on device: a BatchSource of placed jax batches.

  `sharding(ndim)` (or `mesh`, splitting the batch dimension over `batch_axes`) places
  each output; None puts everything on the default device.
  """

  def __init__(self, batch_size: int, rows_per_feature: int | Sequence[int] = 100_000, *,
               mesh: Mesh | None = None, batch_axes: Sequence[str] | None = None,
               **kwargs):
    if kwargs.get("num_shards", 1) != 1:
      raise ValueError("DeviceSynthetic: num_shards must be 1: each device draws its own rows "
                       "of every global batch")
    self.reference = synthetic.SyntheticCriteo(batch_size, rows_per_feature, **kwargs)
    ref = self.reference
    self.batch_size, self.spec = ref.batch_size, ref.spec
    self.seed, self.split, self.alpha = ref.seed, ref.split, ref.alpha
    self.teacher, self.logit_scale, self.multi_hot = ref.teacher, ref.logit_scale, ref.multi_hot
    self.bag_sizes = ref.bag_sizes
    self._num_batches = ref.num_batches
    if mesh is not None:
      axes = tuple(batch_axes) if batch_axes is not None else tuple(mesh.axis_names)
      self._sharding = lambda ndim: NamedSharding(mesh, P(axes, *([None] * (ndim - 1))))
    else:
      self._sharding = None
    self._build_tables()
    rep = NamedSharding(mesh, P()) if mesh is not None else None
    self._tables_dev = jax.device_put(self._tables, rep)
    self._gen = self._jit(self._generate, static=2)
    self._logits = jax.jit(self._logits_of)

  # --- BatchSource --------------------------------------------------------------------------

  @property
  def num_batches(self) -> int | None:
    return self._num_batches

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    stop = self._num_batches
    for k in (itertools.count(start) if stop is None else range(start, stop)):
      yield self.batch(k)

  def batch(self, k: int) -> SparseBatch:
    """Global batch number k of this split, placed (dispatched asynchronously)."""
    return self._gen(self._tables_dev, np.uint32(k), self.batch_size)

  def true_logits(self, batch: SparseBatch) -> np.ndarray:
    """The logits [B] the labels of `batch` were drawn from (float64 host copy of the
    float32 device values)."""
    return np.asarray(jax.device_get(self._logits(self._tables_dev, batch.ids, batch.dense)),
                      np.float64)

  def bayes_auc(self, num_examples: int = 200_000) -> float:
    return self.reference.bayes_auc(num_examples)

  # --- tables -------------------------------------------------------------------------------

  def _build_tables(self) -> None:
    ref = self.reference
    rows = ref._rows_F
    sizes = np.array(self.multi_hot)
    F, L = len(rows), int(ref.spec.max_ids_per_bag)
    col_f = np.repeat(np.arange(F), sizes)                    # feature of each live slot [S]
    self._S = len(col_f)
    # [F, L] -> slot index in [0, S), or S (a zero column) past a bag's end
    slot = np.full((F, L), len(col_f), np.int64)
    pos = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    for f in range(F):
      slot[f, :sizes[f]] = pos[f] + np.arange(sizes[f])
    self._slot_FL = None if L == 1 and self._S == F else slot.reshape(-1)
    self._col_f = col_f
    # Zipf segments per distinct table size, concatenated; per slot its [lo, hi) range.
    seg_parts, lo_of, hi_of = [], {}, {}
    n = 0
    for r in np.unique(rows):
      s = zipf_segments(int(r), self.alpha)
      seg_parts.append(s)
      lo_of[int(r)], hi_of[int(r)] = n, n + len(s["start"])
      n += len(s["start"])
    cat = {k: np.concatenate([p[k] for p in seg_parts]) for k in ("start", "width", "coef")}
    # Thresholds per segment: a table's last segment gets 2^32 - 1 (never "<= u" except at
    # u = 2^32 - 1, which then falls back to that same last segment through hi).
    thr = np.concatenate([np.append(p["threshold"], np.uint32(2**32 - 1)) for p in seg_parts])
    self._seg_steps = int(math.ceil(math.log2(max(len(p["start"]) for p in seg_parts) + 1)))
    slot_rows = rows[col_f]
    perm_a, perm_b = ref._perm_a_F[col_f], ref._perm_b_F[col_f]
    pow2 = np.array([[(int(a) * (1 << i)) % int(r) for i in range(31)]
                     for a, r in zip(perm_a, slot_rows)], np.int64)
    salt_hi, salt_lo = _split64(ref._salt_F[col_f])
    t = {
        "seg_start": cat["start"].astype(np.int32), "seg_width": cat["width"].astype(np.int32),
        "seg_x0": (cat["start"] + 0.5).astype(np.float32), "seg_coef": cat["coef"].astype(np.float32),
        "seg_thr": thr,
        "slot_lo": np.array([lo_of[int(r)] for r in slot_rows], np.int32),
        "slot_hi": np.array([hi_of[int(r)] for r in slot_rows], np.int32),
        "slot_rows": slot_rows.astype(np.uint32), "slot_b": perm_b.astype(np.uint32),
        "slot_pow2": pow2.T.astype(np.uint32),                # [31, S]
        "salt_hi": salt_hi, "salt_lo": salt_lo,
        "inv_bag": (1.0 / sizes[col_f]).astype(np.float32),
        "dense_mu": ref._dense_mu.astype(np.float32),
        "dense_sigma": ref._dense_sigma.astype(np.float32),
        "w_dense": ref._w_dense.astype(np.float32),
    }
    if self.teacher == "deep":
      lat_hi, lat_lo = _split64(ref._lat_salt_FK[col_f])     # [S, K]
      t.update(lat_hi=lat_hi, lat_lo=lat_lo, t_w1=ref._t_w1.astype(np.float32),
               t_w2=ref._t_w2.astype(np.float32), t_w3=ref._t_w3.astype(np.float32))
    self._tables = {k: np.asarray(v) for k, v in t.items()}
    self._const = {
        "sparse_mean": float(ref._sparse_mean), "sparse_std": float(ref._sparse_std),
        "dense_mean": float(ref._dense_mean), "dense_std": float(ref._dense_std),
        "bias": float(ref._bias),
        "deep_norm": (max(float(np.std(ref._t_w3)) * math.sqrt(synthetic.TEACHER_WIDTH), 1e-12)
                      if self.teacher == "deep" else 1.0),
    }

  def _jit(self, fn, static: int):
    if self._sharding is None:
      return jax.jit(fn, static_argnums=static)
    out = SparseBatch(dense=self._sharding(2), ids=self._sharding(3), lengths=self._sharding(2),
                      labels=self._sharding(1), mask=self._sharding(1))
    return jax.jit(fn, static_argnums=static, out_shardings=out)

  # --- the generator ------------------------------------------------------------------------

  def zipf_ids(self, t, u32, q):
    """Ids [B, S] of every live slot from uniforms: u32 uint32 [B, S] picks the Zipf
    segment, q float32 [B, S] in [0, 1) the rank inside it; then the row permutation.
    t: the tables (`_tables`, as device arrays)."""
    lo = jnp.broadcast_to(t["slot_lo"], u32.shape)
    hi = jnp.broadcast_to(t["slot_hi"], u32.shape)
    seg = _search(t["seg_thr"], lo, hi, u32, self._seg_steps)
    seg = jnp.minimum(seg, hi - 1)
    width = t["seg_width"][seg]
    x0 = t["seg_x0"][seg]
    z = _rank_in_segment(q, t["seg_coef"][seg], self.alpha)
    offset = jnp.clip(jnp.floor(x0 * z).astype(jnp.int32), 0, width - 1)
    rank = t["seg_start"][seg] + offset
    return self._permute(t, rank)

  def _permute(self, t, rank):
    """(a * rank + b) mod rows per slot, exactly, in uint32."""
    rows = t["slot_rows"]
    acc = jnp.broadcast_to(t["slot_b"], rank.shape)
    r = rank.astype(jnp.uint32)

    def body(i, acc):  # a loop for the same reason as `_search`
      acc = acc + ((r >> i.astype(jnp.uint32)) & 1) * t["slot_pow2"][i]
      return jnp.where(acc >= rows, acc - rows, acc)
    return jax.lax.fori_loop(0, 31, body, acc).astype(jnp.int32)

  def _bags(self, v_BS, fill=0):
    """[B, S, ...] live slots -> [B, F, L, ...] padded bags."""
    if self._slot_FL is None:
      return v_BS[:, :, None]
    pad = jnp.full((v_BS.shape[0], 1) + v_BS.shape[2:], fill, v_BS.dtype)
    out = jnp.take(jnp.concatenate([v_BS, pad], axis=1), jnp.asarray(self._slot_FL), axis=1)
    F, L = len(self.multi_hot), int(self.spec.max_ids_per_bag)
    return out.reshape((v_BS.shape[0], F, L) + v_BS.shape[2:])

  def _slots(self, ids_BFL):
    """[B, F, L] padded bags -> [B, S] live slots."""
    if self._slot_FL is None:
      return ids_BFL[:, :, 0]
    flat = ids_BFL.reshape(ids_BFL.shape[0], -1)
    live = np.flatnonzero(self._slot_FL < self._S)
    return flat[:, live]

  def _sparse_score(self, t, ids_BS):
    if self.teacher == "linear":
      w = hash_uniform(t["salt_hi"], t["salt_lo"], ids_BS)
      return jnp.sum(w * t["inv_bag"], axis=1) * jnp.float32(math.sqrt(3.0))
    u_BSK = hash_uniform(t["lat_hi"], t["lat_lo"], ids_BS[:, :, None])
    u_BSK = u_BSK * jnp.float32(math.sqrt(3.0)) * t["inv_bag"][:, None]
    # bag means: sum the slots of each feature (a [S, F] 0/1 matrix, exact in HIGHEST)
    onehot_SF = np.eye(len(self.multi_hot), dtype=np.float32)[self._col_f]
    u_BFK = jnp.einsum("bsk,sf->bfk", u_BSK, onehot_SF, precision=HIGHEST)
    b = u_BFK.shape[0]
    h = jnp.tanh(jnp.dot(u_BFK.reshape(b, -1), t["t_w1"], precision=HIGHEST))
    h = jnp.tanh(jnp.dot(h, t["t_w2"], precision=HIGHEST))
    score = jnp.dot(h, t["t_w3"], precision=HIGHEST) / jnp.float32(self._const["deep_norm"])
    triples = self.reference._triples
    if triples is not None:
      tri = jnp.prod(u_BFK[:, triples, :], axis=2).sum(axis=(1, 2))
      score = score + tri / jnp.float32(math.sqrt(synthetic.NUM_TRIPLES * synthetic.K_LAT))
    return score

  def _logit(self, t, ids_BS, dense_BD):
    c = self._const
    sparse = self._sparse_score(t, ids_BS)
    dense = jnp.sum(dense_BD * t["w_dense"], axis=1)
    share = synthetic.SPARSE_SHARE
    z = (math.sqrt(share) * (sparse - c["sparse_mean"]) / c["sparse_std"]
         + math.sqrt(1.0 - share) * (dense - c["dense_mean"]) / c["dense_std"])
    return self.logit_scale * z + c["bias"]

  def _logits_of(self, t, ids_BFL, dense_BD):
    return self._logit(t, self._slots(jnp.asarray(ids_BFL)), jnp.asarray(dense_BD, jnp.float32))

  def _generate(self, t, k, B: int) -> SparseBatch:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed),
                                                synthetic.SPLITS[self.split]), k)
    k_seg, k_pos, k_dense, k_label = jax.random.split(key, 4)
    S, Dn = self._S, self._tables["dense_mu"].shape[0]
    ids_BS = self.zipf_ids(t, jax.random.bits(k_seg, (B, S), jnp.uint32),
                           jax.random.uniform(k_pos, (B, S), jnp.float32))
    normal = jax.random.normal(k_dense, (B, Dn), jnp.float32)
    counts = jnp.floor(jnp.exp(t["dense_mu"] + t["dense_sigma"] * normal))
    dense_BD = jnp.log1p(counts)
    p = jax.nn.sigmoid(self._logit(t, ids_BS, dense_BD))
    labels = (jax.random.uniform(k_label, (B,), jnp.float32) < p).astype(jnp.float32)
    F = len(self.multi_hot)
    lengths = jnp.broadcast_to(jnp.asarray(np.array(self.multi_hot, np.int32)), (B, F))
    return SparseBatch(dense=dense_BD, ids=self._bags(ids_BS), lengths=lengths, labels=labels,
                       mask=jnp.ones((B,), jnp.float32))
