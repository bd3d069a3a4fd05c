"""cuDNN flash attention (arXiv 2205.14135, 2307.08691) behind the shared attention signature.

    out_BTHK, lse_BTH = cudnn_attention(q_BTHK, k_BSGK, v_BSGK, causal=True,
                                        q_segment_ids=None, kv_segment_ids=None,
                                        q_positions=None, kv_positions=None, scale=None)

The kernel is cuDNN's fused SDPA as `jax.nn.dot_product_attention(implementation="cudnn")`
runs it, called one level lower (`jax._src.cudnn.fused_attention_stablehlo`'s forward with
statistics and its backward rule, adapted to jax 0.11's and 0.12's signatures) for what the public function does not give: the softmax statistics in fp32
(it casts them to the output dtype) and a backward that takes a cotangent on the lse (it drops
it). Ring attention merges partial blocks by their lse, so both matter there. The backward
folds d(lse) into the one cuDNN backward call: cuDNN computes D = rowsum(dO * O) from the O it
is given, and dS = P (dP - D + dlse) is what the lse adds, so it is given
O' = O - dlse * dO / |dO|^2 (rows whose dO vanishes take a second, correcting call). When
the lse is unused (the model) the cotangent is a symbolic zero and nothing extra runs.

cuDNN's masks: none, causal (key s <= query t, top-left), per-row lengths (q_seqlen,
kv_seqlen: the rest is padding) and packed segments (offsets + lengths, Hopper only). The
shared rule (query t sees key s iff segment ids match and kv_pos <= q_pos) maps onto them:

Self-attention calls: T == S and each of positions / segment ids is None or the same array
for queries and keys (the model's calls without a KV cache).
  - no segment ids, no positions: CAUSAL or no mask. Exact, nothing checked.
  - positions (causal): index order equals position order iff positions strictly increase
    along each row (within each segment): checked at run time.
  - segment ids: each run of equal ids is one segment, so an id may not come back after
    another one (checked). `max_segments=1` (the "cudnn" registry entry) asks every row to be
    one segment, which then needs no mask; `max_segments=M > 1` packs up to M segments per
    row into cuDNN's ragged layout.
Other calls (a KV cache, ring attention's blocks): segment ids are refused (ValueError).
Non-causal: no mask. Causal: the positions pick one of two cuDNN forms at run time
(`lax.switch`, same choice for every row):
  - prefix-full: every query sees all or none of a prefix of the keys, kv_len_b keys long,
    and the queries that see them are a suffix from q_start_b on (decode steps; ring blocks
    wholly before the queries, or half of them);
  - prefix-causal: the first kv_len_b keys are the first queries' own tokens, in order
    (prefill into an empty cache; ring attention's diagonal block).
A call (or row) that fits none of these, e.g. a chunked prefill onto a filled cache, cannot
raise inside jit: it gets NaN outputs and gradients instead of wrong numbers.
attention_impl="pallas" or "xla" take any positions; "auto" (llm.attention) uses cuDNN
where the call's structure alone makes it exact.

`implementation="xla"` runs the same mapping, lse and backward logic on a jnp emulation of
cuDNN's kernel (its masks, its statistics layout, a backward that recomputes P from the
statistics and D from the O it is given), so CPU tests cover everything but the kernel.

Letters: B batch, T query length, S key length, H query heads, G key/value heads, K head dim,
M segments per row.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from llm.attention.reference import NEG_INF, check_shapes

IMPLEMENTATIONS = ("cudnn", "xla")
MASKS = ("none", "causal", "padding", "padding_causal")
# Rows whose |dO|^2 is below this take the correcting call in the backward (|dO| ~ 1e-15).
_TINY = 1e-30


@dataclasses.dataclass(frozen=True)
class _Call:
  """Static description of one kernel call."""
  mask: str            # one of MASKS
  scale: float
  implementation: str  # one of IMPLEMENTATIONS
  segments: int        # M > 1: packed layout with seqlens [B,M] and offsets [B,M+1]


# ----------------------------------------------------------------------------- kernels
# Both take q [B,T,H,K], k / v [B,S,G,K] and lens = (q_seqlen, kv_seqlen, q_offsets,
# kv_offsets) (None where unused); forward returns (out, stats) with stats as cuDNN lays
# them out: [B,H,T] fp32, or for packed segments [B*M,H,T] whose first B*T*H values are
# token-major [B,T,H] (cuDNN's ragged statistics: one value per (token, head)).


def _fa():
  from jax._src.cudnn import fused_attention_stablehlo as fa
  return fa


def _cudnn_args(call: _Call, fa, q, k, v, lens):
  none = jnp.zeros(0, q.dtype)
  q_seqlen, kv_seqlen, q_off, kv_off = (none if x is None else x for x in lens)
  mask = {"none": fa.MaskType.NO_MASK, "causal": fa.MaskType.CAUSAL,
          "padding": fa.MaskType.PADDING, "padding_causal": fa.MaskType.PADDING_CAUSAL}
  version = fa.check_cudnn_version()
  return dict(query=q, key=k, value=v, bias=none, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen,
              q_offsets=q_off, kv_offsets=kv_off, page_table_k=none, page_table_v=none,
              score_mod_args=(), scale=call.scale, seed=42, dropout_rate=0.0,
              variadic_args=(False, False), mask_type=mask[call.mask],
              layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None,
              score_mod=None, cudnn_version=version,
              # jax 0.11 names the cudnn_version slot of its backward rule `is_training`.
              is_training=version, return_residual=True)


def _call_rule(rule, values: dict, *tail):
  """rule(*values by the rule's parameter names, *tail): jax 0.11 and 0.12 differ in them."""
  params = list(inspect.signature(rule).parameters)
  names = params[:len(params) - len(tail)]
  missing = [n for n in names if n not in values]
  if missing:
    raise NotImplementedError(f"cudnn attention: the installed jax's {rule.__name__} takes "
                              f"{missing}, which llm/attention/cudnn.py does not know")
  return rule(*[values[n] for n in names], *tail)


def _cudnn_fwd(call, q, k, v, lens):
  # The inference entry with return_residual=True: the kernel with statistics, without the
  # training rule's check that refuses odd T or S (meant for a real bias, which we never pass).
  fa = _fa()
  out, stats = _call_rule(fa._dot_product_attention_fwd, _cudnn_args(call, fa, q, k, v, lens))
  return out, stats


def _cudnn_bwd(call, q, k, v, lens, stats, out, dout):
  fa = _fa()
  args = _cudnn_args(call, fa, q, k, v, lens)
  args["return_residual"] = False
  rule = fa._dot_product_attention_bwd_rule
  res = [args[n] for n in ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen",
                           "q_offsets", "kv_offsets", "page_table_k", "page_table_v")]
  if "score_mod" in inspect.signature(rule).parameters:   # jax >= 0.12
    res.append(())
  res += [stats, out]
  grads = _call_rule(rule, args, tuple(res), dout)
  return grads[0], grads[1], grads[2]


def _emulated_mask(call: _Call, lens, b: int, t: int, s: int):
  """[B,T,S] bool: what cuDNN's mask type, lengths and offsets let through."""
  q_seqlen, kv_seqlen, q_off, kv_off = lens
  ti = jnp.arange(t, dtype=jnp.int32)
  si = jnp.arange(s, dtype=jnp.int32)
  causal = call.mask in ("causal", "padding_causal")
  if call.segments > 1:
    m = call.segments

    def seg_of(idx, off, length):     # [B,L]: segment of each token (-1: none), its start
      inside = ((idx[None, None] >= off[:, :m, None]) & (off[:, :m, None] >= 0)
                & (idx[None, None] < off[:, :m, None] + length[:, :, None]))
      seg = jnp.where(jnp.any(inside, 1), jnp.argmax(inside, 1), -1)
      start = jnp.take_along_axis(off, jnp.maximum(seg, 0), 1)
      return seg, start

    qs, q0 = seg_of(ti, q_off, q_seqlen)
    ks, k0 = seg_of(si, kv_off, kv_seqlen)
    mask = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] >= 0)
    if causal:
      mask &= (si[None, None] - k0[:, None]) <= (ti[None, :, None] - q0[:, :, None])
    return mask
  mask = jnp.ones((b, t, s), bool)
  if call.mask in ("padding", "padding_causal"):
    mask &= (ti[None, :, None] < q_seqlen[:, None, None]) & (si[None, None] < kv_seqlen[:, None, None])
  if causal:
    mask &= si[None, None] <= ti[None, :, None]
  return mask


def _emulated_logits(call, q, k, lens):
  b, t, h, kd = q.shape
  s, g = k.shape[1], k.shape[2]
  q5 = q.reshape(b, t, g, h // g, kd)
  logits = jnp.einsum("btgrk,bsgk->bgrts", q5, k, preferred_element_type=jnp.float32)
  mask = _emulated_mask(call, lens, b, t, s)[:, None, None]
  return jnp.where(mask, logits * call.scale, NEG_INF), mask


def _stats_layout(call, lse_BTH):
  b, t, h = lse_BTH.shape
  if call.segments > 1:
    flat = jnp.zeros(b * call.segments * h * t, jnp.float32).at[:b * t * h].set(lse_BTH.ravel())
    return flat.reshape(b * call.segments, h, t)
  return lse_BTH.transpose(0, 2, 1)


def _emulated_fwd(call, q, k, v, lens):
  b, t, h, kd = q.shape
  logits, _ = _emulated_logits(call, q, k, lens)
  lse = jax.nn.logsumexp(logits, axis=-1)                       # [B,G,R,T], -inf: no key
  p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  out = jnp.einsum("bgrts,bsgk->btgrk", p, v.astype(jnp.float32)).reshape(b, t, h, kd)
  lse_BTH = lse.transpose(0, 3, 1, 2).reshape(b, t, h)
  return out.astype(q.dtype), _stats_layout(call, lse_BTH)


def _emulated_bwd(call, q, k, v, lens, stats, out, dout):
  b, t, h, kd = q.shape
  g = k.shape[2]
  f32 = lambda x: x.astype(jnp.float32)
  logits, _ = _emulated_logits(call, q, k, lens)
  lse_BTH = _lse_from_stats(call, stats, b, t, h)
  lse = lse_BTH.reshape(b, t, g, h // g).transpose(0, 2, 3, 1)[..., None]
  p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0))   # [B,G,R,T,S]
  do5 = f32(dout).reshape(b, t, g, h // g, kd)
  d = jnp.sum(do5 * f32(out).reshape(b, t, g, h // g, kd), -1)   # D from the O given
  dp = jnp.einsum("btgrk,bsgk->bgrts", do5, f32(v))
  ds = p * (dp - d.transpose(0, 2, 3, 1)[..., None])
  dq = call.scale * jnp.einsum("bgrts,bsgk->btgrk", ds, f32(k)).reshape(q.shape)
  dk = call.scale * jnp.einsum("bgrts,btgrk->bsgk", ds, f32(q).reshape(b, t, g, h // g, kd))
  dv = jnp.einsum("bgrts,btgrk->bsgk", p, do5)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _kernel(call):
  if call.implementation == "cudnn":
    return _cudnn_fwd, _cudnn_bwd
  if call.implementation == "xla":
    return _emulated_fwd, _emulated_bwd
  raise ValueError(f"cudnn attention: implementation={call.implementation!r}, expected one "
                   f"of {IMPLEMENTATIONS}")


def _lse_from_stats(call, stats, b, t, h):
  if call.segments > 1:
    return stats.reshape(-1)[:b * t * h].reshape(b, t, h)
  return stats.transpose(0, 2, 1)


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, lens, call: _Call):
  """(out [B,T,H,K], lse [B,T,H] fp32) of one kernel call; lse differentiable."""
  out, stats = _kernel(call)[0](call, q, k, v, lens)
  return out, _lse_from_stats(call, stats, *q.shape[:3]).astype(jnp.float32)


def _flash_fwd(q, k, v, lens, call):
  q, k, v = q.value, k.value, v.value
  lens = jax.tree.map(lambda p: p.value, lens, is_leaf=lambda p: hasattr(p, "perturbed"))
  out, stats = _kernel(call)[0](call, q, k, v, lens)
  # Names for remat policies: saving these two keeps the backward from re-running the kernel.
  out = checkpoint_name(out, "attention_out")
  stats = checkpoint_name(stats, "attention_stats")
  lse = _lse_from_stats(call, stats, *q.shape[:3]).astype(jnp.float32)
  return (out, lse), (q, k, v, lens, stats, out)


def _flash_bwd(call, res, cts):
  q, k, v, lens, stats, out = res
  dout, dlse = cts
  bwd = _kernel(call)[1]
  if isinstance(dout, SymbolicZero):
    dout = jnp.zeros(out.shape, out.dtype)
  if isinstance(dlse, SymbolicZero):
    dq, dk, dv = bwd(call, q, k, v, lens, stats, out, dout)
  else:
    dq, dk, dv = _bwd_with_lse(call, bwd, q, k, v, lens, stats, out, dout, dlse)
  return dq, dk, dv, jax.tree.map(lambda _: None, lens)


def _bwd_with_lse(call, bwd, q, k, v, lens, stats, out, dout, dlse):
  """The backward of (out, lse) with one kernel backward call: dS = P (dP - D + dlse).

  The kernel computes D = rowsum(dO * O) from the O it is given, so it gets O shifted along
  dO by -dlse / |dO|^2. A row whose dO vanishes cannot be shifted that way: there dO gets a
  unit e_0 added (c = 1) and a second call with dO = c e_0, O = 0 removes what e_0 adds."""
  f32 = lambda x: x.astype(jnp.float32)
  dlse = jnp.where(jnp.isfinite(dlse), f32(dlse), 0.0)
  dout32, out32 = f32(dout), f32(out)
  sq = jnp.sum(dout32 * dout32, -1)
  c = ((sq <= _TINY) & (dlse != 0)).astype(jnp.float32)          # [B,T,H]
  e0 = jnp.zeros(dout.shape[-1], jnp.float32).at[0].set(1.0)
  dout_a = dout32 + c[..., None] * e0
  alpha = -dlse - c * out32[..., 0]                                # dO_a . O_a = D - dlse
  u = dout_a / jnp.maximum(jnp.sum(dout_a * dout_a, -1), _TINY)[..., None]
  out_a = (out32 + alpha[..., None] * u).astype(out.dtype)
  dq, dk, dv = bwd(call, q, k, v, lens, stats, out_a, dout_a.astype(dout.dtype))

  def correction():
    return bwd(call, q, k, v, lens, stats, jnp.zeros_like(out),
               (c[..., None] * e0).astype(dout.dtype))

  zero = lambda: (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
  cq, ck, cv = jax.lax.cond(jnp.any(c > 0), correction, zero)
  return dq - cq, dk - ck, dv - cv


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- the mapping


def _poison(x, ok_B):
  """x where the row's call is expressible, NaN elsewhere (fuses into x's producer)."""
  nan = jnp.where(ok_B, 1.0, jnp.nan).astype(x.dtype)
  return x * nan.reshape((-1,) + (1,) * (x.ndim - 1))


def _runs(seg_BT, m: int):
  """Runs of equal ids as cuDNN segments: (ok_B, seqlen [B,M], offsets [B,M+1]) where ok
  says every id is one run and there are at most M runs."""
  b, t = seg_BT.shape
  start_BT = jnp.concatenate([jnp.ones((b, 1), bool), seg_BT[:, 1:] != seg_BT[:, :-1]], 1)
  n_runs = jnp.sum(start_BT, 1)
  srt = jnp.sort(seg_BT, 1)
  n_ids = 1 + jnp.sum(srt[:, 1:] != srt[:, :-1], 1)
  ok = (n_runs == n_ids) & (n_runs <= m)
  if m == 1:
    return ok, start_BT, None, None
  idx = jnp.sort(jnp.where(start_BT, jnp.arange(t, dtype=jnp.int32), t), 1)
  starts = jnp.concatenate([idx, jnp.full((b, 1), t, jnp.int32)], 1)[:, :m + 1]  # [B,M+1]
  valid = starts < t
  nxt = jnp.where(valid[:, 1:], starts[:, 1:], t)
  seqlen = jnp.where(valid[:, :m], nxt - starts[:, :m], -1).astype(jnp.int32)
  offsets = jnp.where(valid, starts, -1).astype(jnp.int32)
  return ok, start_BT, seqlen, offsets


def _self_attention(q, k, v, causal, seg, pos, scale, max_segments, implementation):
  b = q.shape[0]
  ok = jnp.ones((b,), bool)
  lens, segments = (None, None, None, None), 1
  if seg is not None:
    ok, start_BT, seqlen, offsets = _runs(jnp.asarray(seg), max_segments)
    if max_segments > 1:
      lens, segments = (seqlen, seqlen, offsets, offsets), max_segments
  if causal and pos is not None:
    pos = jnp.asarray(pos)
    rise = pos[:, 1:] > pos[:, :-1]
    if seg is not None:
      rise |= start_BT[:, 1:]
    ok &= jnp.all(rise, 1)
  if seg is not None or (causal and pos is not None):
    q = _poison(q, ok)
  mask = ("padding_causal" if causal else "padding") if segments > 1 else (
      "causal" if causal else "none")
  return _flash(q, k, v, lens, _Call(mask, scale, implementation, segments))


def _cross_kinds(q_pos, kv_pos):
  """Per row: (full_ok, causal_ok, kv_len, q_start) for causal cross attention by position."""
  t = q_pos.shape[1]
  qmax = jnp.max(q_pos, 1, keepdims=True)
  seen = kv_pos <= qmax                                             # by the last query
  kv_len = jnp.sum(seen, 1).astype(jnp.int32)
  prefix = jnp.all(seen[:, :-1] >= seen[:, 1:], 1)
  big = jnp.iinfo(jnp.int32).max
  kmax = jnp.max(jnp.where(seen, kv_pos, -big), 1, keepdims=True)
  kmin = jnp.min(jnp.where(seen, kv_pos, big), 1, keepdims=True)
  sees_all, sees_none = q_pos >= kmax, q_pos < kmin
  full_ok = (prefix & jnp.all(sees_all | sees_none, 1)
             & jnp.all(sees_none[:, :-1] >= sees_none[:, 1:], 1))
  q_start = jnp.sum(sees_none & ~sees_all, 1).astype(jnp.int32)
  n = min(t, kv_pos.shape[1])
  first = jnp.arange(n) < kv_len[:, None]
  causal_ok = (prefix & (kv_len <= t) & jnp.all(~first | (kv_pos[:, :n] == q_pos[:, :n]), 1)
               & jnp.all(q_pos[:, 1:] > q_pos[:, :-1], 1))
  return full_ok, causal_ok, kv_len, q_start


def _cross_attention(q, k, v, q_pos, kv_pos, scale, implementation):
  b, t = q.shape[:2]
  s = k.shape[1]
  q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if q_pos is None else q_pos
  kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)) if kv_pos is None else kv_pos
  full_ok, causal_ok, kv_len, q_start = _cross_kinds(jnp.asarray(q_pos), jnp.asarray(kv_pos))
  kv_seqlen = jnp.maximum(kv_len, 1)
  ti = jnp.arange(t, dtype=jnp.int32)

  def finish(out, lse, active_BT, ok_B):
    out = jnp.where(active_BT[..., None, None], out, 0).astype(q.dtype)
    lse = jnp.where(active_BT[..., None], lse, NEG_INF)
    return _poison(out, ok_B), _poison(lse, ok_B)

  def full():
    # Queries that see the keys are rows q_start.. : rotate them to the front, where
    # cuDNN's q_seqlen keeps them, and back.
    idx = (ti[None] + q_start[:, None]) % t
    qr = q if t == 1 else jnp.take_along_axis(q, idx[..., None, None], 1)
    call = _Call("padding", scale, implementation, 1)
    o, l = _flash(qr, k, v, (jnp.maximum(t - q_start, 1), kv_seqlen, None, None), call)
    if t > 1:
      back = (ti[None] - q_start[:, None]) % t
      o = jnp.take_along_axis(o, back[..., None, None], 1)
      l = jnp.take_along_axis(l, back[..., None], 1)
    active = (ti[None] >= q_start[:, None]) & (kv_len[:, None] > 0)
    return finish(o, l, active, full_ok)

  def causal():
    call = _Call("padding_causal", scale, implementation, 1)
    o, l = _flash(q, k, v, (jnp.full((b,), t, jnp.int32), kv_seqlen, None, None), call)
    return finish(o, l, jnp.broadcast_to(kv_len[:, None] > 0, (b, t)), causal_ok)

  if t == 1:
    return full()         # one query: prefix-causal is a case of prefix-full
  kind = jnp.where(jnp.all(full_ok), 0, jnp.where(jnp.all(causal_ok), 1, 0))
  return jax.lax.switch(kind, [full, causal])


def supports(dtype, head_dim: int) -> str | None:
  """None if cuDNN flash attention takes this dtype and head dim, else the reason."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name}: cuDNN flash attention takes bfloat16 or float16"
  if head_dim % 8 or head_dim > 256:
    return f"head dim {head_dim}: cuDNN flash attention needs a multiple of 8, at most 256"
  return None


def is_self_attention(q_BTHK, k_BSGK, q_segment_ids=None, kv_segment_ids=None,
                      q_positions=None, kv_positions=None) -> bool:
  """Whether a call is self-attention in the sense above (decided from its structure)."""
  return (q_BTHK.shape[1] == k_BSGK.shape[1] and q_positions is kv_positions
          and q_segment_ids is kv_segment_ids)


def cudnn_attention(q_BTHK, k_BSGK, v_BSGK, *, causal: bool = True, q_segment_ids=None,
                    kv_segment_ids=None, q_positions=None, kv_positions=None,
                    scale: float | None = None, max_segments: int = 1,
                    implementation: str = "cudnn"):
  """cuDNN flash attention by the shared rule; returns (out like q, lse [B,T,H] fp32).

  max_segments: packed documents per row (self-attention with segment ids; M > 1 uses
  cuDNN's packed layout, Hopper only). implementation: "cudnn", or "xla" for the jnp
  emulation of the kernel (tests on CPU). See the module docstring for what is expressible.
  """
  b, t, s, h, g, kd = check_shapes(q_BTHK, k_BSGK, v_BSGK, q_segment_ids, kv_segment_ids,
                                   q_positions, kv_positions)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"cudnn attention: implementation={implementation!r}, expected one of "
                     f"{IMPLEMENTATIONS}")
  if max_segments < 1:
    raise ValueError(f"cudnn attention: max_segments={max_segments}, expected >= 1")
  if q_BTHK.dtype != k_BSGK.dtype or k_BSGK.dtype != v_BSGK.dtype:
    raise ValueError(f"cudnn attention: q, k, v dtypes {q_BTHK.dtype}, {k_BSGK.dtype}, "
                     f"{v_BSGK.dtype}; expected one dtype")
  if implementation == "cudnn":
    reason = supports(q_BTHK.dtype, kd)
    if reason:
      raise ValueError(f"attention_impl='cudnn': {reason}; use 'pallas', 'xla' or 'auto'")
  scale = float(kd ** -0.5 if scale is None else scale)
  if q_segment_ids is None and q_positions is None and kv_positions is None:
    # Default positions (arange T, arange S): the rule is cuDNN's top-left causal mask.
    return _flash(q_BTHK, k_BSGK, v_BSGK, (None, None, None, None),
                  _Call("causal" if causal else "none", scale, implementation, 1))
  if is_self_attention(q_BTHK, k_BSGK, q_segment_ids, kv_segment_ids, q_positions,
                       kv_positions):
    return _self_attention(q_BTHK, k_BSGK, v_BSGK, causal, q_segment_ids, q_positions, scale,
                           max_segments, implementation)
  if q_segment_ids is not None:
    raise ValueError(
        "attention_impl='cudnn': segment ids on a call whose queries and keys are not the same "
        f"tokens (T={t}, S={s}, or different position / segment-id arrays: a KV cache or a "
        "ring attention block) are not expressible with cuDNN's masks; use 'pallas' or 'xla'")
  if not causal:
    return _flash(q_BTHK, k_BSGK, v_BSGK, (None, None, None, None),
                  _Call("none", scale, implementation, 1))
  return _cross_attention(q_BTHK, k_BSGK, v_BSGK, q_positions, kv_positions, scale,
                          implementation)


__all__ = ["cudnn_attention", "is_self_attention", "supports"]
