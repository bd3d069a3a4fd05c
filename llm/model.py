"""Llama 3 decoder (arXiv 2407.21783) in Flax NNX, with a slot-addressed KV cache.

Pre-norm blocks: RMSNorm -> grouped-query attention with RoPE (Llama 3.1 frequency scaling,
HF `rope_type: llama3`) -> residual, RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and a
tied or untied output projection. Parameters are kept in `cfg.param_dtype` and cast to
`cfg.dtype` at use; logits come back in float32. Attention goes through
`llm.attention.attention(..., impl=cfg.attention_impl)`, so kernels plug in by config string,
and through ring attention when `cfg.context_parallel` says so (below).

RoPE uses the half-split convention of Hugging Face checkpoints: within each head, entry j is
rotated with entry j + K/2 (`rotate_half`), so q/k weights are stored in that layout. RoPE
and the products and sums whose bits do not depend on the row count are `llm.numerics`.

The parameter tree (names, shapes, logical axes) is a contract shared with `llm.weights`:
  embed [V,D] (vocab, embed); layers[i].{attn_norm,mlp_norm}.scale [D] (norm);
  layers[i].attn.wq [D,H,K], .wk/.wv [D,G,K], .wo [H,K,D]; layers[i].mlp.w_gate/.w_up [D,F],
  .w_down [F,D]; final_norm.scale [D]; lm_head [D,V] (absent when tied: logits = x @ embed.T).

KV cache: every layer keeps k, v [B,S,G,K] in slots (in cfg.cache_dtype, by default the
compute dtype); a shared `pos [B,S]` tags each slot with its token position, SENTINEL_POS
when empty; `length [B]` counts each row's tokens. Masking
is by positions alone (kv_pos <= q_pos), so empty slots are hidden and slot order never
matters: context parallelism (below) places slots on any rank. Calls:
  logits_BTV, _ = model(tokens_BT, positions_BT=..., segment_ids_BT=...)      # no cache
  cache = model.init_cache(B, S)
  logits_BTV, cache = model(tokens_BT, cache=cache, lengths_B=...)           # prefill / decode
`Llama.hidden` (blocks + final norm on embeddings) and `Llama.logits` split the same call,
e.g. to take logits at a few positions only.

Qwen2 and Mistral are options of this model (`llm.config`): `cfg.qkv_bias` adds
layers[i].attn.bq [H,K], .bk/.bv [G,K] to q / k / v before RoPE; `cfg.sliding_window` W
narrows the attention of every layer (or of the layers `cfg.window_layers` lists) to keys
at positions > q_pos - W (`sliding_window_mask`, passed as the explicit `mask` of
`llm.attention`, so the jnp implementations apply it in training, prefill and decode over
the cache alike; the config refuses the kernels and ring attention with a window). YaRN
RoPE scaling multiplies cos and sin by its attention factor. The cache keeps every token,
or, made with `rolling=True` for a window in every layer, its last S tokens in slots
reused in turn (Mistral's rolling buffer: slot = token index mod S; a prefill attends
within the call and writes its last S tokens; later calls of T tokens need S >= W + T - 1,
so that no key a query sees is overwritten by the same call).

Context parallelism (arXiv 2411.01783): with cfg.context_parallel "pass_kv" | "pass_q" |
"auto" and a `jax.set_mesh` mesh with a `cp` axis of N > 1 ranks, the same calls run context
parallel (`ring.ring_attention`, its blocks by cfg.attention_impl) and return the same
logits, in the natural token order:
  - a call of T tokens, T a multiple of 2N, is reordered on entry into the causal
    load-balanced layout (`layout.load_balance`: rank i holds chunks i and 2N-1-i; done by
    `ring.load_balance_sharded`, two half-shard transfers), with its positions and segment
    ids, sharded over cp (`act_seq`), and un-permuted on exit (h_BTD);
    T a multiple of N but not of 2N is split contiguously (exact, not balanced); without a
    cache T must be a multiple of N;
  - the cache's slot axis is split over cp (S a multiple of N; rank r owns slots
    [r*S/N, (r+1)*S/N), filled from the front): a sharded call's tokens go to their own
    rank's next free slots (`layout.cache_slots`), written in place (`ring.write_slots`), so
    a prefill, or a persistent-KV prefill of T new tokens after P cached ones, moves no KV;
    a call whose T is not a multiple of N (a decode step) has replicated queries (ring
    attention's pass-Q route without the scatter) and its tokens go round robin from the
    least-filled rank (`layout.decode_placement` after a balanced prefill). Tokens past a
    rank's capacity are dropped, as tokens past S are without CP; `llm.generate` sizes it.
`cp_ranks(cfg)` says whether (N) or not (1) a call made now would run context parallel.

Letters: B batch, T tokens in this call, S cache slots, D model dim, H query heads,
G key/value heads, K head dim, F MLP hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core.mesh import LLM_RULES, Rules, logical_to_spec, mesh_axes
from llm.attention import attention, layout
from llm.config import LlamaConfig
# CPU_MIN_ROWS, einsum, sum_last and rope_frequencies are also this module's names.
from llm.numerics import (CPU_MIN_ROWS, apply_rope, einsum, rope_frequencies, rope_scale,
                          sum_last)
from llm.lora import LoraWeight
from llm.quantized import QuantizedParam
from llm.remat import remat_policy

# Position of an empty cache slot: above any real position, so `kv_pos <= q_pos` hides it.
SENTINEL_POS = 2 ** 30

# Logical names of activations (LLM_RULES maps them to mesh axes).
X_NAMES = ("act_batch", "act_seq", "act_embed")
Q_NAMES = ("act_batch", "act_seq", "act_heads", None)
KV_NAMES = ("act_batch", "act_seq", "act_kv_heads", None)
MLP_NAMES = ("act_batch", "act_seq", "act_mlp")
LOGIT_NAMES = ("act_batch", "act_seq", "act_vocab")
CACHE_NAMES = ("cache_batch", "cache_seq", "cache_kv_heads", None)
CACHE_POS_NAMES = ("cache_batch", "cache_seq")
# Context parallelism splits sequences over this mesh axis; the cache's slots follow the
# sequence axis (split over cp).
CP_AXIS = "cp"
CP_CACHE_NAMES = ("cache_batch", "act_seq", "cache_kv_heads", None)
CP_CACHE_POS_NAMES = ("cache_batch", "act_seq")


# --- sharding helpers

def _spec(shape: Sequence[int], names: Sequence[str | None], rules: Rules, mesh) -> P:
  """Like `logical_to_spec`, but a dimension its mesh axes do not divide is replicated
  (e.g. 8 kv heads on tp=16), so any config runs on any mesh."""
  spec = logical_to_spec(tuple(names), rules, mesh)
  out = []
  for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    n = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
    out.append(axes if size % n == 0 else None)
  return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None], rules: Rules = LLM_RULES) -> jax.Array:
  """Sharding constraint by logical names under `jax.set_mesh`; a no-op without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, _spec(x.shape, names, rules, mesh))


def param_shardings(model_or_state, mesh: Mesh, rules: Rules = LLM_RULES):
  """NamedShardings for the parameters (a State of the same structure as
  `nnx.state(model, nnx.Param)`), from their logical names through `rules`."""
  state = (nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module)
           else model_or_state)

  def one(var):
    names = var.get_metadata().get("out_sharding") or ()
    return var.replace(NamedSharding(mesh, _spec(var.shape, names, rules, mesh)))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: Llama, mesh: Mesh, rules: Rules = LLM_RULES) -> Llama:
  """Places the model's parameters on `mesh` (in place) and returns the model."""
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
  return model


# --- context parallelism (arXiv 2411.01783)

@dataclasses.dataclass(frozen=True)
class _CP:
  """The ring mesh, its cp axis and rank count, for a call that runs context parallel."""
  mesh: Any
  axis: str
  n: int


def _context_parallel(cfg: LlamaConfig) -> _CP | None:
  """The CP setting of a call traced now: cfg.context_parallel set and a jax.set_mesh mesh
  whose `cp` axis has more than one rank; None otherwise (CP over one rank is plain
  attention, so a context-parallel config also runs on a mesh without cp, or none)."""
  if cfg.context_parallel == "none":
    return None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CP_AXIS not in mesh.axis_names or mesh.shape[CP_AXIS] == 1:
    return None
  seq_axes = mesh_axes("act_seq", LLM_RULES, mesh)
  if seq_axes != (CP_AXIS,):
    raise ValueError(f"llm/model.py: ring attention runs over mesh axis {CP_AXIS!r}, but "
                     f"LLM_RULES shard act_seq over {seq_axes}; they must be the same axis")
  return _CP(mesh, CP_AXIS, mesh.shape[CP_AXIS])


def _balance(x_BT, *, cp: _CP, inverse: bool = False):
  """`layout.load_balance` (or its inverse) of x [B,T] or [B,T,D] sharded over cp."""
  from llm.attention import ring
  names = X_NAMES[:x_BT.ndim]
  x_BT = constrain(x_BT, names)
  spec = _spec(x_BT.shape, names, LLM_RULES, cp.mesh)
  out = ring.load_balance_sharded(x_BT, mesh=cp.mesh, spec=spec, axis=cp.axis, inverse=inverse)
  return constrain(out, names)


def cp_ranks(cfg: LlamaConfig) -> int:
  """Ranks of the cp axis a call of this model traced now would use (1: no CP)."""
  cp = _context_parallel(cfg)
  return 1 if cp is None else cp.n


# --- KV cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer keys/values in slots; each slot tagged with its token position. A rolling
  cache (Mistral's rolling buffer, arXiv 2310.06825) puts a row's i-th token in slot i mod S,
  keeping its last S tokens: for a model whose every layer has a sliding window W <= S."""

  k: tuple[jax.Array, ...]   # per layer [B,S,G,K]
  v: tuple[jax.Array, ...]   # per layer [B,S,G,K]
  pos: jax.Array             # [B,S] int32, SENTINEL_POS for an empty slot
  length: jax.Array          # [B] int32: tokens per row (without CP, also its next slot)
  rolling: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def init(cls, cfg: LlamaConfig, batch: int, max_len: int, rolling: bool = False) -> KVCache:
    """Empty cache; under context parallelism its slots are split over cp (see the module
    docstring), so max_len must be a multiple of the cp ranks. `rolling`: max_len slots
    reused in turn, for a window in every layer of at most max_len, without CP."""
    cp = _context_parallel(cfg)
    if cp is not None and max_len % cp.n:
      raise ValueError(f"KVCache.init: max_len={max_len} slots is not a multiple of the "
                       f"{cp.n} ranks of mesh axis {cp.axis!r}")
    if rolling and (cfg.sliding_window is None or cfg.window_layers is not None
                    or max_len < cfg.sliding_window or cp is not None):
      raise ValueError(f"KVCache.init: rolling=True with sliding_window={cfg.sliding_window}, "
                       f"window_layers={cfg.window_layers}, max_len={max_len}"
                       f"{'' if cp is None else f', {cp.n} context-parallel ranks'}; a rolling "
                       "cache needs a window in every layer of at most max_len slots, no CP")
    names, pos_names = ((CACHE_NAMES, CACHE_POS_NAMES) if cp is None
                        else (CP_CACHE_NAMES, CP_CACHE_POS_NAMES))
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, cfg.cache_dtype or cfg.dtype), names)
    return cls(k=tuple(zeros() for _ in range(cfg.n_layers)),
               v=tuple(zeros() for _ in range(cfg.n_layers)),
               pos=constrain(jnp.full((batch, max_len), SENTINEL_POS, jnp.int32), pos_names),
               length=jnp.zeros((batch,), jnp.int32), rolling=rolling)

  @property
  def max_len(self) -> int:
    return self.pos.shape[1]


def _write_slots(buf_BS, slots_BT, new_BT):
  """buf[b, slots[b, t]] = new[b, t]; slot indices >= S are dropped (padding)."""
  return jax.vmap(lambda b, s, u: b.at[s].set(u.astype(b.dtype), mode="drop"))(
      buf_BS, slots_BT, new_BT)


def _write_cache(buf_BS, slots_BT, new_BT, cp: _CP | None):
  """`_write_slots` on a cache buffer (k / v [B,S,G,K] or pos [B,S]), in place per cp rank
  under context parallelism."""
  if cp is None:
    return constrain(_write_slots(buf_BS, slots_BT, new_BT),
                     CACHE_NAMES if buf_BS.ndim == 4 else CACHE_POS_NAMES)
  from llm.attention import ring
  names = CP_CACHE_NAMES if buf_BS.ndim == 4 else CP_CACHE_POS_NAMES
  spec = _spec(buf_BS.shape, names, LLM_RULES, cp.mesh)
  out = ring.write_slots(buf_BS, slots_BT, new_BT, mesh=cp.mesh, spec=spec, axis=cp.axis)
  return constrain(out, names)


# --- layers

def _param(rngs: nnx.Rngs, shape, names, std: float, dtype) -> nnx.Param:
  value = jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype)
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _zeros(shape, names, dtype) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


def _weight(p: nnx.Param, dtype=None) -> jax.Array:
  """A parameter's value in `dtype` (None: as held); a weight-only quantized one
  (`llm.quantized.QuantizedParam`) is dequantized here, inside the jitted computation, so
  memory holds only its codes; one with a LoRA adapter (`llm.lora.LoraWeight`) is its base
  plus the adapter's product."""
  return _value(p.get_value(), dtype)


def _value(v, dtype=None) -> jax.Array:
  if isinstance(v, LoraWeight):
    base = _value(v.base, jnp.float32)
    return (base + v.delta(jnp.float32)).astype(v.a.dtype if dtype is None else dtype)
  if isinstance(v, QuantizedParam):
    return v.value(jnp.float32 if dtype is None else dtype)
  return v if dtype is None else v.astype(dtype)


def _dense(x, p: nnx.Param, dtype, spec: str, **kw) -> jax.Array:
  """`einsum(spec, x, weight)` in `dtype`; a quantized weight multiplies in its own
  [out, in] layout, dequantized inside the computation (`QuantizedParam.matmul`); a LoRA
  adapter adds its low-rank product (`LoraWeight.low_rank`)."""
  return _dense_value(x, p.get_value(), dtype, spec, **kw)


def _dense_value(x, v, dtype, spec: str, **kw) -> jax.Array:
  if isinstance(v, LoraWeight):
    return _dense_value(x, v.base, dtype, spec, **kw) + v.low_rank(x, dtype)
  if isinstance(v, QuantizedParam):
    return v.matmul(x, dtype, **kw)
  return einsum(spec, x, v.astype(dtype), **kw)


def _take_rows(p: nnx.Param, ids, dtype) -> jax.Array:
  """Rows `ids` of the embedding table in `dtype` (a quantized table dequantizes only them)."""
  v = p.get_value()
  if isinstance(v, QuantizedParam):
    return v.take(ids, dtype)
  return jnp.take(v, ids, axis=0).astype(dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, computed in fp32; the mean square summed in a fixed order
  (`sum_last`), so a row's norm does not depend on the rows computed beside it."""

  def __init__(self, cfg: LlamaConfig):
    self.eps, self.dtype = cfg.norm_eps, cfg.dtype
    self.scale = nnx.Param(jnp.ones((cfg.dim,), cfg.param_dtype), out_sharding=("norm",),
                           eager_sharding=False)

  def __call__(self, x_BTD):
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(sum_last(x * x) / x.shape[-1] + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optionally reading/writing a KV cache."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, layer: int = 0):
    self.cfg = cfg
    self.window = cfg.layer_window(layer)    # this layer's sliding window (None: full)
    d, h, g, k, pd = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
    self.wq = _param(rngs, (d, h, k), ("embed", "heads", "head_dim"), d ** -0.5, pd)
    self.wk = _param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), d ** -0.5, pd)
    self.wv = _param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), d ** -0.5, pd)
    self.wo = _param(rngs, (h, k, d), ("heads", "head_dim", "embed"), (h * k) ** -0.5, pd)
    if cfg.qkv_bias:         # Qwen2: added to q / k / v before RoPE; zero at init
      self.bq = _zeros((h, k), ("heads", "head_dim"), pd)
      self.bk = _zeros((g, k), ("kv_heads", "head_dim"), pd)
      self.bv = _zeros((g, k), ("kv_heads", "head_dim"), pd)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, kv=None, kv_pos_BS=None,
               slots_BT=None, mask_BTS=None, call_seg_BT=None):
    """Without `kv`: attends within the call (segments + causal by position; positions_BT
    None: arange(T), and attention is told so, which lets cuDNN take the call). With
    kv = (k_BSGK, v_BSGK): writes this call's k, v at `slots_BT`, then attends to every slot
    by position (kv_pos_BS already holds the new positions). mask_BTS: an explicit mask on
    top (tree attention; `llm.attention` `mask`). call_seg_BT (with `kv` whose slots were
    all empty): attend within the call instead, token t seeing the earlier tokens of its
    segment (1: written, 0: padding): the same keys as through the cache, and arithmetic
    that does not depend on the cache's size (`Llama.hidden`'s fresh_cache). Returns
    (y_BTD, new kv)."""
    cfg, dt = self.cfg, self.cfg.dtype
    q_BTHK = constrain(_dense(x_BTD, self.wq, dt, "btd,dhk->bthk"), Q_NAMES)
    k_BTGK = constrain(_dense(x_BTD, self.wk, dt, "btd,dgk->btgk"), KV_NAMES)
    v_BTGK = constrain(_dense(x_BTD, self.wv, dt, "btd,dgk->btgk"), KV_NAMES)
    if cfg.qkv_bias:
      q_BTHK = q_BTHK + _weight(self.bq, dt)
      k_BTGK = k_BTGK + _weight(self.bk, dt)
      v_BTGK = v_BTGK + _weight(self.bv, dt)
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope_pos_BT = positions_BT
    if rope_pos_BT is None:
      b, t = x_BTD.shape[:2]
      rope_pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    scale = rope_scale(cfg.rope_scaling)
    q_BTHK = apply_rope(q_BTHK, rope_pos_BT, inv_freq, scale)
    k_BTGK = apply_rope(k_BTGK, rope_pos_BT, inv_freq, scale)
    cp = _context_parallel(cfg)
    if hasattr(kv, "write_and_attend"):   # a paged KV cache (llm/serving/paged.py)
      out_BTHK, kv = kv.write_and_attend(q_BTHK, k_BTGK, v_BTGK, rope_pos_BT)
      return constrain(_dense(out_BTHK.astype(dt), self.wo, dt, "bthk,hkd->btd"), X_NAMES), kv
    if kv is None:
      k_all, v_all, kv_pos, seg = k_BTGK, v_BTGK, positions_BT, segment_ids_BT
    else:
      k_all = _write_cache(kv[0], slots_BT, k_BTGK, cp)
      v_all = _write_cache(kv[1], slots_BT, v_BTGK, cp)
      kv, kv_pos, seg = (k_all, v_all), kv_pos_BS, None
      # A cache kept in another dtype (cfg.cache_dtype) is read in the compute dtype.
      k_all, v_all = k_all.astype(dt), v_all.astype(dt)
      if call_seg_BT is not None:
        # The keys are this call's own, as stored (the same rounding as read back).
        k_all = k_BTGK.astype(kv[0].dtype).astype(dt)
        v_all = v_BTGK.astype(kv[1].dtype).astype(dt)
        kv_pos, seg = positions_BT, call_seg_BT
    kw = dict(causal=True, q_positions=positions_BT, kv_positions=kv_pos, q_segment_ids=seg,
              kv_segment_ids=seg)
    window_BTS = sliding_window_mask(positions_BT, kv_pos, self.window,
                                     x_BTD.shape[0], x_BTD.shape[1], k_all.shape[1])
    if window_BTS is not None:   # LlamaConfig allows a window only on the jnp paths, no CP
      mask_BTS = window_BTS if mask_BTS is None else mask_BTS.astype(bool) & window_BTS
    if cp is None:
      out_BTHK, _ = attention(q_BTHK, k_all, v_all, impl=cfg.attention_impl, mask=mask_BTS, **kw)
    else:                    # Llama.hidden refuses mask_BTS under CP
      from llm.attention import ring
      out_BTHK, _ = ring.ring_attention(q_BTHK, k_all, v_all, mesh=cp.mesh, axis=cp.axis,
                                        variant=cfg.context_parallel,
                                        inner_impl=cfg.attention_impl, **kw)
    y_BTD = _dense(out_BTHK.astype(dt), self.wo, dt, "bthk,hkd->btd")
    return constrain(y_BTD, X_NAMES), kv


def sliding_window_mask(q_pos_BT, kv_pos_BS, window: int | None, b: int, t: int, s: int):
  """[B,T,S] bool: key s is inside query t's window (kv_pos > q_pos - window; the causal
  rule does the rest), positions defaulting to arange; None without a window, or when the
  call's default positions cannot reach past it (no cache, T <= window)."""
  if window is None or (q_pos_BT is None and kv_pos_BS is None and t <= window):
    return None
  arange = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))  # noqa: E731
  q_BT = arange(t) if q_pos_BT is None else q_pos_BT
  kv_BS = arange(s) if kv_pos_BS is None else kv_pos_BS
  return kv_BS[:, None, :] > q_BT[:, :, None] - window


class MLP(nnx.Module):
  """SwiGLU: w_down(silu(x w_gate) * (x w_up))."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    d, f, pd = cfg.dim, cfg.ffn_dim, cfg.param_dtype
    self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), d ** -0.5, pd)
    self.w_up = _param(rngs, (d, f), ("embed", "mlp"), d ** -0.5, pd)
    self.w_down = _param(rngs, (f, d), ("mlp", "embed"), f ** -0.5, pd)

  def __call__(self, x_BTD):
    dt = self.dtype
    gate_BTF = constrain(_dense(x_BTD, self.w_gate, dt, "btd,df->btf"), MLP_NAMES)
    up_BTF = constrain(_dense(x_BTD, self.w_up, dt, "btd,df->btf"), MLP_NAMES)
    return constrain(_dense(nnx.silu(gate_BTF) * up_BTF, self.w_down, dt, "btf,fd->btd"), X_NAMES)


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, layer: int = 0):
    self.attn_norm = RMSNorm(cfg)
    self.attn = Attention(cfg, rngs, layer)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, kv=None, kv_pos_BS=None,
               slots_BT=None, mask_BTS=None, call_seg_BT=None):
    h_BTD, kv = self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT, kv, kv_pos_BS,
                          slots_BT, mask_BTS, call_seg_BT)
    x_BTD = x_BTD + h_BTD
    return x_BTD + self.mlp(self.mlp_norm(x_BTD)), kv


class Llama(nnx.Module):
  """Llama 3 decoder: token ids -> float32 logits, with an optional KV cache."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    v, d, pd = cfg.vocab_size, cfg.dim, cfg.param_dtype
    # Embedding rows and output columns ~ N(0, 1/D): unit-scale logits after the final norm,
    # tied or not.
    self.embed = _param(rngs, (v, d), ("vocab", "embed"), d ** -0.5, pd)
    self.layers = nnx.List([Block(cfg, rngs, i) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), d ** -0.5, pd)

  def init_cache(self, batch: int, max_len: int, rolling: bool = False) -> KVCache:
    return KVCache.init(self.cfg, batch, max_len, rolling)

  def __call__(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None,
               cache: KVCache | None = None, lengths_B=None, mask_BTS=None, slots_BT=None):
    """Returns (logits_BTV float32, new cache or None); see `hidden` for the arguments."""
    h_BTD, cache = self.hidden(self.embed_tokens(tokens_BT), positions_BT=positions_BT,
                               segment_ids_BT=segment_ids_BT, cache=cache, lengths_B=lengths_B,
                               mask_BTS=mask_BTS, slots_BT=slots_BT)
    return self.logits(h_BTD), cache

  def embed_tokens(self, tokens_BT) -> jax.Array:
    x_BTD = _take_rows(self.embed, tokens_BT, self.cfg.dtype)
    return constrain(x_BTD, X_NAMES)

  def hidden(self, x_BTD, *, positions_BT=None, segment_ids_BT=None,
             cache: KVCache | None = None, lengths_B=None, mask_BTS=None,
             slots_BT=None, taps: tuple[int, ...] = (), fresh_cache: bool = False):
    """Blocks and final norm over input embeddings x_BTD; returns (h_BTD, new cache or None).
    With `taps` (block indices), also the residual stream after each of those blocks,
    concatenated: (h_BTD, cache, taps_BT[len(taps)*D]) (EAGLE-3's low / mid / high features
    for a draft head, `llm.speculative.draft`).

    Without a cache: positions default to arange(T); tokens attend to earlier positions of
    the same segment. With a cache: the first lengths_B[b] tokens of row b (default all T;
    the rest are right padding) are written to free slots (without CP slots
    cache.length[b] + t) and tagged with their positions (default cache.length[b] + t);
    padding is never written, so it stays invisible. Each token attends to every cached slot
    at a position <= its own. Under context parallelism (module docstring) the arguments
    and h_BTD keep the natural token order.

    mask_BTS: optional [B,T,S] bool over the cache's slots (S = T without a cache): a token
    sees a key only where it is True, besides the rule above; tree attention for speculative
    decoding (`llm.speculative`). Not under context parallelism.

    slots_BT: with a cache and mask_BTS, the slots the tokens are written to (default
    cache.length[b] + t; >= S: not written); the length still grows by the tokens written
    (a tree's verification, whose caller sets it after committing a path).

    fresh_cache: the cache holds no token yet (a prompt's prefill). The tokens then attend
    among themselves: the same keys as through the cache, in arithmetic that does not
    depend on its size, so a prompt's logits do not change with max_len (with bfloat16
    they would at near ties: reductions over a longer key axis group their sums
    differently), and long caches cost nothing at prefill. Not with mask_BTS; under
    context parallelism the prompt attends through the cache as without it.
    """
    b, t = x_BTD.shape[:2]
    arange_T = jnp.arange(t, dtype=jnp.int32)
    cp = _context_parallel(self.cfg)
    if mask_BTS is not None and cp is not None:
      raise ValueError("Llama.hidden: mask_BTS is not supported under context parallelism "
                       f"(context_parallel={self.cfg.context_parallel!r} over {cp.n} ranks)")
    # Causal load balancing (paper Sec. 3): positions and segment ids travel with the tokens,
    # so masking stays exact in any order.
    balance = cp is not None and t % (2 * cp.n) == 0
    perm = functools.partial(_balance, cp=cp) if balance else (lambda a: a)
    if slots_BT is not None and (cache is None or mask_BTS is None or cp is not None):
      raise ValueError("Llama.hidden: slots_BT needs a cache and mask_BTS, and no context "
                       "parallelism")
    given_slots_BT, kv_pos_BS, slots_BT, call_seg_BT = slots_BT, None, None, None
    if fresh_cache and (cache is None or mask_BTS is not None):
      raise ValueError("Llama.hidden: fresh_cache=True needs a cache and no mask_BTS")
    if cache is None:
      if lengths_B is not None:
        raise ValueError("Llama.hidden: lengths_B is only meaningful with a cache")
      if positions_BT is None and cp is not None:
        positions_BT = jnp.broadcast_to(arange_T, (b, t))   # they travel with the tokens
      if segment_ids_BT is not None:
        segment_ids_BT = perm(jnp.asarray(segment_ids_BT))
      if positions_BT is not None:
        positions_BT = perm(jnp.asarray(positions_BT, jnp.int32))
    else:
      if segment_ids_BT is not None:
        raise ValueError("Llama.hidden: segment_ids_BT with a cache is not supported; cached "
                         "rows are separated by batch and padding by lengths_B")
      positions_BT, n_new_B, slots_BT, kv_pos_BS, call_seg_BT = self._cache_writes(
          cache, b, t, positions_BT, lengths_B, given_slots_BT, fresh_cache, perm, cp)
    x_BTD = constrain(perm(x_BTD), X_NAMES)

    block_fn = Block.__call__
    if self.cfg.remat:
      block_fn = nnx.remat(block_fn, policy=remat_policy(self.cfg.remat_policy))
    taps = tuple(int(i) for i in taps)
    if any(not 0 <= i < self.cfg.n_layers for i in taps):
      raise ValueError(f"Llama.hidden: taps={taps}; expected block indices in "
                       f"[0, {self.cfg.n_layers})")
    new_k, new_v, tapped = [], [], {}
    for i, block in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      x_BTD, kv = block_fn(block, x_BTD, positions_BT, segment_ids_BT, kv, kv_pos_BS, slots_BT,
                           mask_BTS, call_seg_BT)
      x_BTD = constrain(x_BTD, X_NAMES)
      if i in taps:
        tapped[i] = x_BTD
      if kv is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
    h_BTD = self.final_norm(x_BTD)
    unbalance = (lambda a: _balance(a, cp=cp, inverse=True)) if balance else (lambda a: a)
    h_BTD = unbalance(h_BTD)
    if cache is not None:
      cache = KVCache(k=tuple(new_k), v=tuple(new_v), pos=kv_pos_BS,
                      length=cache.length + n_new_B, rolling=cache.rolling)
    if taps:
      return h_BTD, cache, unbalance(jnp.concatenate([tapped[i] for i in taps], axis=-1))
    return h_BTD, cache

  def _cache_writes(self, cache: KVCache, b: int, t: int, positions_BT, lengths_B,
                    given_slots_BT, fresh_cache: bool, perm, cp: _CP | None):
    """`hidden`'s tokens in a cache: (positions_BT, n_new_B, slots_BT, kv_pos_BS,
    call_seg_BT), positions and slots in the call's (under CP, balanced) order, padding sent
    to slot S (dropped), kv_pos_BS the cache's positions after the write."""
    if cache.pos.shape[0] != b or len(cache.k) != self.cfg.n_layers:
      raise ValueError(f"Llama.hidden: cache for batch {cache.pos.shape[0]} and "
                       f"{len(cache.k)} layers, expected batch {b} and {self.cfg.n_layers}")
    arange_T = jnp.arange(t, dtype=jnp.int32)
    n_new_B = (jnp.full((b,), t, jnp.int32) if lengths_B is None
               else jnp.asarray(lengths_B, jnp.int32))
    if positions_BT is None:
      positions_BT = cache.length[:, None] + arange_T
    positions_BT = perm(jnp.asarray(positions_BT, jnp.int32))
    valid_BT = perm(arange_T < n_new_B[:, None])
    if cache.rolling:
      # Token i of a row goes to slot i mod S; of a call longer than S, only its last S
      # tokens are written (no two writes to one slot); padding goes to slot S (dropped).
      s, w = cache.max_len, self.cfg.sliding_window
      if given_slots_BT is not None or cp is not None or (not fresh_cache and t > s - w + 1):
        raise ValueError(f"Llama.hidden: a rolling cache of {s} slots (window {w}) takes "
                         f"prefills (fresh_cache) and calls of up to {s - w + 1} tokens, no "
                         f"given slots, no context parallelism; got {t} tokens"
                         f"{', slots_BT' if given_slots_BT is not None else ''}")
      keep_BT = valid_BT & (arange_T >= n_new_B[:, None] - s)
      slots_BT = jnp.where(keep_BT, (cache.length[:, None] + arange_T) % s, s)
    elif cp is None:
      # Padding goes to slot S, out of range, which the scatter drops.
      default_BT = (cache.length[:, None] + arange_T if given_slots_BT is None
                    else jnp.asarray(given_slots_BT, jnp.int32))
      slots_BT = jnp.where(valid_BT, default_BT, cache.max_len)
    else:
      if cache.max_len % cp.n:
        raise ValueError(f"Llama.hidden: a cache of {cache.max_len} slots cannot be split "
                         f"over the {cp.n} ranks of mesh axis {cp.axis!r}; make max_len a "
                         "multiple of it")
      cap = cache.max_len // cp.n
      fill_BN = jnp.sum((cache.pos != SENTINEL_POS).reshape(b, cp.n, cap), axis=-1,
                        dtype=jnp.int32)
      slots_BT = layout.cache_slots(fill_BN, valid_BT, cap, sharded=t % cp.n == 0)
    kv_pos_BS = _write_cache(cache.pos, slots_BT, positions_BT, cp)
    call_seg_BT = valid_BT.astype(jnp.int32) if fresh_cache and cp is None else None
    return positions_BT, n_new_B, slots_BT, kv_pos_BS, call_seg_BT

  def logits(self, h_BTD) -> jax.Array:
    dt = self.cfg.dtype
    if self.cfg.tie_embeddings:
      out = _dense(h_BTD, self.embed, dt, "btd,vd->btv", preferred_element_type=jnp.float32)
    else:
      out = _dense(h_BTD, self.lm_head, dt, "btd,dv->btv", preferred_element_type=jnp.float32)
    return constrain(out.astype(jnp.float32), LOGIT_NAMES)

  def output_weight(self) -> tuple[jax.Array, bool]:
    """(the output projection's parameter, vocab_major): embed [V,D] when tied (True), else
    lm_head [D,V] (False); for losses that apply it chunk by chunk
    (`llm.train_lib.chunked_cross_entropy`); a weight-only quantized one dequantized whole."""
    if self.cfg.tie_embeddings:
      return _weight(self.embed), True
    return _weight(self.lm_head), False

  def output_rows(self, ids, dtype=None) -> jax.Array:
    """The output projection's rows of token `ids` [..., D] in `dtype` (default the compute
    dtype): the LM head restricted to those tokens; a quantized one dequantizes only them."""
    dt = self.cfg.dtype if dtype is None else dtype
    v = (self.embed if self.cfg.tie_embeddings else self.lm_head).get_value()
    if isinstance(v, QuantizedParam):
      return v.rows.take_rows(ids, dt)        # rows [V, D] (out, in) either way
    if self.cfg.tie_embeddings:
      return jnp.take(v, ids, axis=0).astype(dt)
    return jnp.moveaxis(jnp.take(v, ids, axis=1), 0, -1).astype(dt)


# --- flat weights (the loader contract)

def _flat_params(model: Llama) -> dict[str, nnx.Param]:
  out = {"embed": model.embed}
  for i, blk in enumerate(model.layers):
    p = f"layers.{i}."
    out.update({p + "attn_norm": blk.attn_norm.scale, p + "wq": blk.attn.wq,
                p + "wk": blk.attn.wk, p + "wv": blk.attn.wv, p + "wo": blk.attn.wo,
                p + "mlp_norm": blk.mlp_norm.scale, p + "w_gate": blk.mlp.w_gate,
                p + "w_up": blk.mlp.w_up, p + "w_down": blk.mlp.w_down})
    if model.cfg.qkv_bias:
      out.update({p + "bq": blk.attn.bq, p + "bk": blk.attn.bk, p + "bv": blk.attn.bv})
  out["final_norm"] = model.final_norm.scale
  if not model.cfg.tie_embeddings:
    out["lm_head"] = model.lm_head
  return out


def weights_from_model(model: Llama) -> dict[str, np.ndarray]:
  """Flat dict of numpy arrays ("embed", "layers.{i}.wq", ..., "lm_head")."""
  return {k: np.asarray(jax.device_get(_weight(v))) for k, v in _flat_params(model).items()}


def load_weights(model: Llama, weights: dict[str, np.ndarray]) -> None:
  """Sets every parameter from a flat dict (in place), keeping each parameter's dtype and
  sharding. Checks the full key set and every shape before changing anything. `model` may be
  abstract (`nnx.eval_shape(lambda: Llama(cfg, rngs))`), which skips the random init. A
  `llm.quantized.QuantizedParam` value is held as it is (codes on the default device)."""
  params = _flat_params(model)
  errors = []
  missing = sorted(set(params) - set(weights))
  unexpected = sorted(set(weights) - set(params))
  if missing:
    errors.append(f"missing keys {missing}")
  if unexpected:
    errors.append(f"unexpected keys {unexpected}")
  for key in sorted(set(params) & set(weights)):
    w = weights[key]
    got = w.shape if isinstance(w, QuantizedParam) else tuple(np.shape(w))
    want = tuple(params[key].shape)
    if got != want:
      errors.append(f"{key!r}: got shape {got}, expected {want}")
  if errors:
    raise ValueError(f"load_weights ({model.cfg.n_layers} layers, tie_embeddings="
                     f"{model.cfg.tie_embeddings}): " + "; ".join(errors))
  for key, var in params.items():
    if isinstance(weights[key], QuantizedParam):
      var.set_value(jax.tree.map(jnp.asarray, weights[key]))
      continue
    old = var.get_value()
    value = np.asarray(weights[key]).astype(old.dtype)
    # An abstract model (nnx.eval_shape) has no sharding yet: skip the random init entirely.
    sharding = getattr(old, "sharding", None)
    var.set_value(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))
