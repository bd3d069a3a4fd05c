"""Context-parallel ring attention: pass-KV and pass-Q (arXiv 2411.01783).

The sequence is sharded over a `cp` mesh axis of N ranks. Two exact variants:
  pass-KV  each rank keeps its queries; the KV blocks (only the G KV heads, plus their
           positions / segment ids) travel the ring in N-1 `ppermute` steps; every step's
           block attention (out, lse) is merged into a running result (paper Eq. 4).
  pass-Q   each rank keeps its KV; the query blocks (with positions / segment ids) travel
           the ring; every rank computes a partial (out, lse) of each visiting query block
           against its local KV, one `all_to_all` brings the N partials of a block back to
           its owner, which merges them exactly.
The block attention is `llm.attention.attention(..., impl=inner_impl)` (default "xla"),
so a Pallas kernel or cuDNN can be dropped in; the Llama model passes its attention_impl.
Masking is by explicit positions and segment ids (reference.py's rule), so any token
placement is exact; `layout.load_balance` gives the paper's causal load balancing (rank i
holds chunks i and 2N-1-i).

Phases (all with segment ids and positions):
  full prefill        q, k, v sharded over cp (load-balanced when causal).
  persistent-KV       T new tokens attend to P cached tokens plus themselves; pass the cache
  prefill             as `k_cache/v_cache` (sharded over cp, left where it is): each rank's
                      local KV is (its cache shard, its new-token shard); pass-KV rotates that,
                      pass-Q rotates the new queries.
  decode              pass-Q with a few query tokens per sequence; the KV of decode tokens is
                      placed round robin (`layout.decode_placement`). When the query length is
                      not a multiple of N (e.g. T=1), queries are not split: every rank attends
                      all of them to its local KV and the N partials merge with one pmax and
                      two psums (the all-to-all of pass-Q with nothing to scatter).
                      Any variant takes this route when T % N != 0.
Choosing: variant="auto" asks `llm.attention.cp_select.choose_variant` (the paper's rule)
with new_tokens = T and cached_tokens = P + max(S - T, 0), at trace time (static shapes).

The ring is a Python loop unrolled over the N steps (N is static and small; XLA can then
overlap step i's transfer with step i-1's block). jax.grad goes through both variants
(ppermute and all_to_all transpose to their inverses); the backward keeps the visited
blocks as residuals rather than running a second ring.

Entry point: `ring_attention(q, k, v, *, mesh, axis="cp", variant=..., inner_impl=...)`,
every setting an argument (the Llama model calls it when `LlamaConfig.context_parallel` is
not "none" and the `jax.set_mesh` mesh has a cp axis of more than one rank).
`write_slots` writes new keys / values into a KV cache whose slot axis is split over cp,
each rank into its own shard (the Llama model's context-parallel cache write);
`load_balance_sharded` reorders a cp-sharded sequence into the load-balanced layout (and
back) with two half-shard ppermutes.
Batch dims may also be sharded over data/fsdp and heads over tp: shard_map specs come from
the rules table (`act_batch`, `act_heads`, `act_kv_heads` of core.mesh.LLM_RULES); an axis
that does not divide its dimension is left replicated.

Letters: B batch, T query length, S key length, P cached length, H query heads, G KV heads,
K head dim, N ranks on the cp axis; a trailing `_l` marks a per-rank (local) block.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.mesh import LLM_RULES, Rules, mesh_axes
from llm.attention import attention, check_impl
from llm.attention.reference import NEG_INF, check_shapes, merge_partials

VARIANTS = ("pass_kv", "pass_q", "auto")
# Defaults of the auto rule: one H100 (dense bf16) and 400 Gb/s RDMA per GPU (paper Sec. 4).
DEFAULT_PEAK_FLOPS = 989e12
DEFAULT_BANDWIDTH = 50e9


def select_variant(variant: str, *, new_tokens: int, cached_tokens: int, n_ranks: int,
                   n_heads: int, n_kv_heads: int, bytes_per_elem: int = 2,
                   peak_flops: float = DEFAULT_PEAK_FLOPS,
                   bandwidth: float = DEFAULT_BANDWIDTH, algorithm: str = "alltoall") -> str:
  """"pass_kv" | "pass_q": `variant` itself, or for "auto" the paper's rule (cp_select)."""
  if variant in ("pass_kv", "pass_q"):
    return variant
  if variant != "auto":
    raise ValueError(f"ring attention: variant={variant!r}, expected one of {VARIANTS}")
  # Lazy: cp_select is a separate module and only the auto path needs it.
  from llm.attention.cp_select import choose_variant
  choice = choose_variant(new_tokens, cached_tokens, n_ranks=n_ranks, n_heads=n_heads,
                          n_kv_heads=n_kv_heads, peak_flops=peak_flops, bandwidth=bandwidth,
                          bytes_per_elem=bytes_per_elem, algorithm=algorithm)
  if choice not in ("pass_kv", "pass_q"):
    raise ValueError(f"cp_select.choose_variant returned {choice!r}, expected pass_kv|pass_q")
  return choice


# ----------------------------------------------------------------------------- specs


def _divisible_axes(axes: tuple[str, ...], mesh, dim: int) -> tuple[str, ...]:
  """Longest prefix of `axes` whose total size divides `dim`."""
  kept: list[str] = []
  for a in axes:
    if dim % (math.prod(mesh.shape[x] for x in kept) * mesh.shape[a]):
      break
    kept.append(a)
  return tuple(kept)


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _dim_specs(mesh, axis: str, rules: Rules, b: int, h: int, g: int):
  """Mesh axes (spec entries) for the batch, query-head and KV-head dims."""
  def axes_of(name):
    table = dict(rules)
    return tuple(a for a in mesh_axes(name, rules, mesh) if a != axis) if name in table else ()
  batch = _divisible_axes(axes_of("act_batch"), mesh, b)
  heads = axes_of("act_heads")
  kv_heads = axes_of("act_kv_heads") if "act_kv_heads" in dict(rules) else heads
  size = math.prod(mesh.shape[a] for a in heads)
  # Query head j*H/tp.. must meet KV head j*G/tp..: shard both by the same axes or neither.
  if heads != kv_heads or h % size or g % size:
    heads = ()
  return _entry(batch), _entry(heads)


# ----------------------------------------------------------------------------- local bodies


def _block(q_l, q_pos, q_seg, kv, *, causal, scale, inner_impl):
  return attention(q_l, kv["k"], kv["v"], impl=inner_impl, causal=causal,
                   q_segment_ids=q_seg, kv_segment_ids=kv.get("seg"),
                   q_positions=q_pos, kv_positions=kv.get("pos"), scale=scale)


def _local_kv(x: dict) -> dict:
  """This rank's KV block: its cache shard (if any) followed by its new-token shard."""
  kv = {"k": x["k"], "v": x["v"]}
  if "kv_pos" in x:
    kv["pos"] = x["kv_pos"]
  if "kv_seg" in x:
    kv["seg"] = x["kv_seg"]
  if "k_cache" in x:
    cache = {"k": x["k_cache"], "v": x["v_cache"]}
    if "pos" in kv:
      cache["pos"] = x["cache_pos"]
    if "seg" in kv:
      cache["seg"] = x["cache_seg"]
    kv = {name: jnp.concatenate([cache[name], kv[name]], axis=1) for name in kv}
  return kv


def _ring_perm(n: int):
  return [(i, (i + 1) % n) for i in range(n)]


def _pass_kv_body(x: dict, *, axis, n, causal, scale, inner_impl):
  q_l, q_pos, q_seg = x["q"], x.get("q_pos"), x.get("q_seg")
  kv = _local_kv(x)
  out = lse = None
  for step in range(n):
    # Send before computing so that XLA can overlap the transfer with this step's block.
    nxt = jax.lax.ppermute(kv, axis, _ring_perm(n)) if step < n - 1 else None
    o, l = _block(q_l, q_pos, q_seg, kv, causal=causal, scale=scale, inner_impl=inner_impl)
    o = o.astype(jnp.float32)
    out, lse = (o, l) if out is None else merge_partials([out, o], [lse, l])
    kv = nxt
  return out.astype(q_l.dtype), lse


def _pass_q_body(x: dict, *, axis, n, causal, scale, inner_impl):
  kv = _local_kv(x)
  qb = {name: x[name] for name in ("q", "q_pos", "q_seg") if name in x}
  outs, lses = [], []
  for step in range(n):
    nxt = jax.lax.ppermute(qb, axis, _ring_perm(n)) if step < n - 1 else None
    o, l = _block(qb["q"], qb.get("q_pos"), qb.get("q_seg"), kv, causal=causal, scale=scale,
                  inner_impl=inner_impl)
    outs.append(o)
    lses.append(l)
    qb = nxt
  # At step s rank i held the queries of rank (i - s) mod N: reorder to index = owner rank,
  # then one all_to_all sends partial j to rank j (which receives index = KV rank).
  owner_step = (jax.lax.axis_index(axis) - jnp.arange(n)) % n
  out_s = jnp.take(jnp.stack(outs), owner_step, axis=0)
  lse_s = jnp.take(jnp.stack(lses), owner_step, axis=0)
  out_s, lse_s = jax.lax.all_to_all((out_s, lse_s), axis, 0, 0, tiled=True)
  out, lse = merge_partials([out_s[j] for j in range(n)], [lse_s[j] for j in range(n)])
  return out.astype(x["q"].dtype), lse


def _replicated_q_body(x: dict, *, axis, n, causal, scale, inner_impl):
  """Every rank holds all queries: local partial, then an exact cross-rank merge (Eq. 4)."""
  del n
  kv = _local_kv(x)
  o, l = _block(x["q"], x.get("q_pos"), x.get("q_seg"), kv, causal=causal, scale=scale,
                inner_impl=inner_impl)
  m = jax.lax.pmax(l, axis)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(l - m_safe)                                  # 0 where this rank saw no key
  total = jax.lax.psum(w, axis)
  num = jax.lax.psum(w[..., None] * o.astype(jnp.float32), axis)
  out = num / jnp.where(total > 0, total, 1.0)[..., None]
  lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), NEG_INF)
  return out.astype(x["q"].dtype), lse


# ----------------------------------------------------------------------------- entry points


def _positions(b: int, n: int, offset: int = 0):
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + offset, (b, n))


def ring_attention(q_BTHK, k_BSGK, v_BSGK, *, mesh, axis: str = "cp", variant: str = "pass_kv",
                   causal: bool = True, q_segment_ids=None, kv_segment_ids=None,
                   q_positions=None, kv_positions=None, scale: float | None = None,
                   k_cache=None, v_cache=None, cache_segment_ids=None, cache_positions=None,
                   inner_impl: str = "xla", rules: Rules = LLM_RULES,
                   peak_flops: float = DEFAULT_PEAK_FLOPS, bandwidth: float = DEFAULT_BANDWIDTH,
                   algorithm: str = "alltoall"):
  """Exact attention of global q [B,T,H,K] against k, v [B,S,G,K] sharded over `axis`.

  Sequence dims are split contiguously over the N ranks of `axis` (T and S multiples of N;
  T may be any length for the replicated-query route, used when T % N != 0). Optional
  persistent-KV cache k_cache / v_cache [B,P,G,K] (P a multiple of N), with
  cache_positions / cache_segment_ids [B,P]: rank r attends its queries to (cache shard r,
  new-KV shard r) of every rank. Default positions: arange for q and kv (as in
  attention_reference), or P + arange for q and new kv and arange(P) for the cache.
  Returns (out [B,T,H,K] in q's dtype, lse [B,T,H] fp32), sharded like q.
  """
  check_impl(inner_impl, "ring attention: inner_impl")
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  if axis not in mesh.shape:
    raise ValueError(f"ring attention: mesh axes {dict(mesh.shape)} lack axis {axis!r}")
  n = mesh.shape[axis]
  p = 0
  if (k_cache is None) != (v_cache is None):
    raise ValueError("ring attention: give both k_cache and v_cache, or neither")
  if k_cache is not None:
    if k_cache.shape[:1] + k_cache.shape[2:] != (b, g, kd) or v_cache.shape != k_cache.shape:
      raise ValueError(f"ring attention: k_cache {k_cache.shape}, v_cache {v_cache.shape}; "
                       f"expected [B={b}, P, G={g}, K={kd}] both")
    p = k_cache.shape[1]
    if (cache_segment_ids is None) != (q_segment_ids is None):
      raise ValueError("ring attention: with a cache, give cache_segment_ids exactly when "
                       "q_segment_ids / kv_segment_ids are given")
    for name, arr in (("cache_segment_ids", cache_segment_ids),
                      ("cache_positions", cache_positions)):
      if arr is not None and arr.shape != (b, p):
        raise ValueError(f"ring attention: {name} shape {arr.shape}, expected {(b, p)}")
  for name, length in (("key length S", s), ("cache length P", p)):
    if length % n:
      raise ValueError(f"ring attention: {name} = {length} is not a multiple of the {n} "
                       f"ranks of mesh axis {axis!r}")

  variant = select_variant(variant, new_tokens=t, cached_tokens=p + max(s - t, 0), n_ranks=n,
                           n_heads=h, n_kv_heads=g, bytes_per_elem=q_BTHK.dtype.itemsize,
                           peak_flops=peak_flops, bandwidth=bandwidth, algorithm=algorithm)
  shard_q = t % n == 0
  bspec, hspec = _dim_specs(mesh, axis, rules, b, h, g)
  qaxis = axis if shard_q else None
  x: dict[str, Any] = {"q": q_BTHK, "k": k_BSGK, "v": v_BSGK}
  specs: dict[str, Any] = {"q": P(bspec, qaxis, hspec, None), "k": P(bspec, axis, hspec, None),
                           "v": P(bspec, axis, hspec, None)}
  if causal:  # positions only matter for the causal rule
    x["q_pos"] = _positions(b, t, p) if q_positions is None else q_positions
    x["kv_pos"] = _positions(b, s, p) if kv_positions is None else kv_positions
    specs["q_pos"], specs["kv_pos"] = P(bspec, qaxis), P(bspec, axis)
  if q_segment_ids is not None:
    x["q_seg"], x["kv_seg"] = q_segment_ids, kv_segment_ids
    specs["q_seg"], specs["kv_seg"] = P(bspec, qaxis), P(bspec, axis)
  if k_cache is not None:
    x["k_cache"], x["v_cache"] = k_cache, v_cache
    specs["k_cache"] = specs["v_cache"] = P(bspec, axis, hspec, None)
    if causal:
      x["cache_pos"] = _positions(b, p) if cache_positions is None else cache_positions
      specs["cache_pos"] = P(bspec, axis)
    if q_segment_ids is not None:
      x["cache_seg"] = cache_segment_ids
      specs["cache_seg"] = P(bspec, axis)

  body = (_pass_kv_body if variant == "pass_kv" else _pass_q_body) if shard_q else \
      _replicated_q_body
  fn = jax.shard_map(
      lambda xs: body(xs, axis=axis, n=n, causal=causal, scale=scale, inner_impl=inner_impl),
      mesh=mesh, in_specs=(specs,),
      out_specs=(P(bspec, qaxis, hspec, None), P(bspec, qaxis, hspec)),
      # Pallas kernels (inner_impl="pallas") give outputs without varying-axis types,
      # which shard_map's check rejects; the specs above already say how outputs vary.
      check_vma=inner_impl == "xla")
  return fn(x)


def write_slots(buf_BS, slots_BT, new_BT, *, mesh, spec: P, axis: str = "cp"):
  """buf[b, slots[b, t]] = new[b, t] for a KV-cache buffer [B, S, ...] whose slot axis is
  split contiguously over the N ranks of `axis` (`spec`, the buffer's PartitionSpec, has
  `axis` at dim 1; its other entries also shard `new`). Slots outside [0, S) are dropped.

  When T is a multiple of N, slots / new are taken as split over `axis` like the queries,
  and each rank writes only its own tokens, which must target its own slots (a token aimed
  at another rank is dropped): `layout.cache_slots(sharded=True)` guarantees it, and nothing
  moves between ranks. Otherwise (a decode step) they are replicated and every rank writes
  the tokens that land in its slots.
  """
  n = mesh.shape[axis]
  s, t = buf_BS.shape[1], slots_BT.shape[1]
  spec = tuple(spec) + (None,) * (buf_BS.ndim - len(tuple(spec)))
  if spec[1] != axis or s % n:
    raise ValueError(f"ring.write_slots: buffer of {s} slots with spec {spec}; expected the "
                     f"slot axis split over {axis!r} ({n} ranks, S a multiple of {n})")
  cap = s // n
  tax = axis if t % n == 0 else None

  def body(buf_l, slots_l, new_l):
    local = slots_l - jax.lax.axis_index(axis) * cap
    local = jnp.where((local >= 0) & (local < cap), local, cap)
    return jax.vmap(lambda bb, ss, uu: bb.at[ss].set(uu.astype(bb.dtype), mode="drop"))(
        buf_l, local, new_l)

  return jax.shard_map(body, mesh=mesh,
                       in_specs=(P(*spec), P(spec[0], tax), P(spec[0], tax, *spec[2:])),
                       out_specs=P(*spec))(buf_BS, slots_BT, new_BT)


def load_balance_sharded(x, *, mesh, spec: P, axis: str = "cp", inverse: bool = False):
  """`layout.load_balance(x, N, axis=1)` (or `unload_balance` with inverse=True) of an array
  [B, T, ...] split over the N ranks of `axis` (`spec` has `axis` at dim 1), as two
  point-to-point transfers of half a shard each, instead of gathering the sequence.

  Rank r holds natural chunks 2r, 2r+1 and must hold chunks r, 2N-1-r: chunk c goes to rank
  c (c < N, first place) or 2N-1-c (second place), so first halves and second halves each
  follow a permutation of the ranks.
  """
  n = mesh.shape[axis]
  spec = tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))
  if spec[1] != axis or x.shape[1] % (2 * n):
    raise ValueError(f"ring.load_balance_sharded: shape {x.shape}, spec {spec}; expected dim 1 "
                     f"split over {axis!r} and a multiple of 2 * {n}")
  dest = lambda c: c if c < n else 2 * n - 1 - c       # natural chunk c -> its rank
  perm_a = [(r, dest(2 * r)) for r in range(n)]       # first halves (chunks 2r)
  perm_b = [(r, dest(2 * r + 1)) for r in range(n)]   # second halves (chunks 2r + 1)
  if inverse:
    perm_a, perm_b = [(d, s) for s, d in perm_a], [(d, s) for s, d in perm_b]

  def body(x_l):
    first, second = jnp.split(x_l, 2, axis=1)
    # Even ranks hold (chunk r, chunk 2N-1-r) = (a first half, a second half); odd ranks
    # (a second half, a first half); the inverse undoes the same pairing.
    even = jax.lax.axis_index(axis) % 2 == 0
    if inverse:
      first, second = (jnp.where(even, first, second), jnp.where(even, second, first))
      return jnp.concatenate([jax.lax.ppermute(first, axis, perm_a),
                              jax.lax.ppermute(second, axis, perm_b)], axis=1)
    got_a, got_b = jax.lax.ppermute(first, axis, perm_a), jax.lax.ppermute(second, axis, perm_b)
    return jnp.concatenate([jnp.where(even, got_a, got_b), jnp.where(even, got_b, got_a)],
                           axis=1)

  return jax.shard_map(body, mesh=mesh, in_specs=P(*spec), out_specs=P(*spec))(x)


__all__ = ["load_balance_sharded", "ring_attention", "select_variant", "write_slots"]
