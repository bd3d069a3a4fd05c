"""The EAGLE draft head (arXiv 2401.15077): one decoder layer over the target's features.

Pair i of a sequence x_0 x_1 ... is (f_i, x_{i+1}): f_i is the target's last hidden state at
token i (after its final norm, the vector its LM head reads) and x_{i+1} the next token. The
head maps

    f^_{i+1} = RMSNorm(Block(fc([embed(x_{i+1}); f_i])))

a prediction of the target's feature at token i+1, from which the target's own LM head gives
a distribution over x_{i+2}. One `llm.model.Block` (the target's attention, RoPE and SwiGLU,
through the same `llm.attention` implementations) at the target's width; pair i sits at
position i. Embedding and LM head are the target's (frozen; never copied: callers pass the
target, or its weights). Differences from EAGLE-1's released head: the block keeps its input
RMSNorm and a final RMSNorm follows it (the regressed features are post-norm).

Fused features (EAGLE-3, arXiv 2503.01840): with `taps` (target block indices, e.g. a low,
a middle and a high one) the head also reads the target's residual stream after those blocks
at token i, each RMS-normalized (no weight): fc([embed(x_{i+1}); f_i; l_i; m_i; h_i]). The
target gives them wherever it gives f_i (the prompt, the verified tokens); inside a draft
tree, where the head feeds itself its own f^, they are zeros, and training drops them on a
share of the pairs (`llm.speculative.distill`) so that the head knows both cases.

The head keeps its own KV cache (`llm.model.KVCache` with one layer, slot = pair index in
committed pairs); `__call__` writes a call's keys at explicit slots and takes an explicit
mask, which tree drafting needs (`llm.speculative.decode`).

Heads train in float32 (`draft_config`); `cast_head` gives a trained head the dtype it
decodes in (a bfloat16 copy for a bfloat16 target: faster on XLA:CPU, BENCHMARKS.md).

Letters: B batch, T pairs in the call, S cache slots, D model dim, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from llm import model as model_lib
from llm.config import LlamaConfig
from llm.model import KVCache


def draft_config(target_cfg: LlamaConfig, dtype="float32") -> LlamaConfig:
  """The head's block config: the target's sizes, one layer (with the sliding window of the
  target's last layer, if any), no remat, its weights and arithmetic in `dtype`. Heads
  train in float32 whatever the target's dtype; `cast_head` gives a trained head another
  dtype for decoding (a bfloat16 target's head decodes faster in bfloat16 on XLA:CPU: its
  calls run 2-5 rows, and bfloat16 products cost about the same for 2 to 8 rows where
  float32 ones grow with them, BENCHMARKS.md)."""
  window = target_cfg.layer_window(target_cfg.n_layers - 1)
  return target_cfg.replace(n_layers=1, sliding_window=window, window_layers=None,
                            remat=False, dtype=jnp.dtype(dtype).name,
                            param_dtype=jnp.dtype(dtype).name, cache_dtype=None)


def write_slots(buf_BS, slots_BT, new_BT):
  """buf[b, slots[b, t]] = new[b, t]; slots >= S are dropped (padding, rejected nodes)."""
  return jax.vmap(lambda b, s, u: b.at[s].set(u.astype(b.dtype), mode="drop"))(
      buf_BS, slots_BT, new_BT)


class DraftHead(nnx.Module):
  """fc([embed(next token); feature (; taps)]) -> one Llama block -> RMSNorm: the next
  feature."""

  def __init__(self, target_cfg: LlamaConfig, rngs: nnx.Rngs, taps: tuple[int, ...] = (),
               dtype="float32"):
    self.cfg = cfg = draft_config(target_cfg, dtype)
    self.taps = tuple(int(i) for i in taps)
    self.target_layers = target_cfg.n_layers
    if any(not 0 <= i < target_cfg.n_layers for i in self.taps):
      raise ValueError(f"DraftHead: taps={self.taps}; expected block indices of the target "
                       f"in [0, {target_cfg.n_layers})")
    d, pd = cfg.dim, cfg.param_dtype
    n_in = (2 + len(self.taps)) * d
    self.fc = nnx.Param(jax.random.normal(rngs.params(), (n_in, d), pd) * n_in ** -0.5,
                        out_sharding=(None, "embed"), eager_sharding=False)
    self.fc_bias = nnx.Param(jnp.zeros((d,), pd), out_sharding=("norm",), eager_sharding=False)
    self.block = model_lib.Block(cfg, rngs)
    self.norm = model_lib.RMSNorm(cfg)

  def tap_input(self, taps_BTK, lead) -> jax.Array:
    """The taps as the head reads them: each tap RMS-normalized (float32); zeros for None."""
    d, k = self.cfg.dim, len(self.taps)
    if taps_BTK is None:
      return jnp.zeros((*lead, k * d), jnp.float32)
    if taps_BTK.shape[-1] != k * d:
      raise ValueError(f"DraftHead: taps of width {taps_BTK.shape[-1]}; expected "
                       f"{k} taps x {d} = {k * d}")
    x = taps_BTK.astype(jnp.float32).reshape(*taps_BTK.shape[:-1], k, d)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
    return x.reshape(*taps_BTK.shape[:-1], k * d)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.init(self.cfg, batch, max_len)

  def __call__(self, feats_BTD, next_emb_BTD, *, positions_BT=None, cache: KVCache | None = None,
               slots_BT=None, mask_BTS=None, taps_BTK=None):
    """(predicted features f^_BTD, new cache or None).

    feats_BTD: target features f_i (or the head's own predictions inside a draft tree);
    next_emb_BTD: embeddings of x_{i+1} (the target's embedding); taps_BTK: the target's
    states at `taps` ([B,T,len(taps)*D], `Llama.hidden(taps=...)`; None: zeros, as inside a
    draft tree; ignored by a head without taps). Without a cache: causal
    over the call (positions default to arange(T)). With a cache: this call's keys go to
    `slots_BT` (>= S: not written) tagged with `positions_BT`, then every query attends to
    the cached slots at positions <= its own, narrowed by `mask_BTS` [B,T,S] when given.
    `cache.length` is left to the caller (tree slots are scratch, not committed pairs).
    """
    dt = self.cfg.dtype
    parts = [next_emb_BTD.astype(dt), feats_BTD.astype(dt)]
    if self.taps:
      parts.append(self.tap_input(taps_BTK, feats_BTD.shape[:-1]).astype(dt))
    x_BTD = (jnp.concatenate(parts, axis=-1) @ self.fc[...].astype(dt)
             + self.fc_bias[...].astype(dt))
    if cache is None:
      h_BTD, _ = self.block(x_BTD, positions_BT, None, mask_BTS=mask_BTS)
      return self.norm(h_BTD), None
    kv_pos_BS = write_slots(cache.pos, slots_BT, positions_BT)
    h_BTD, (k, v) = self.block(x_BTD, positions_BT, None, (cache.k[0], cache.v[0]), kv_pos_BS,
                               slots_BT, mask_BTS)
    return self.norm(h_BTD), KVCache(k=(k,), v=(v,), pos=kv_pos_BS, length=cache.length)


def cast_head(draft: DraftHead, dtype) -> DraftHead:
  """The same head with its weights and arithmetic in `dtype` (weights cast once; `draft`
  itself is unchanged; returned as is when already in `dtype`)."""
  name = jnp.dtype(dtype).name
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"cast_head: dtype={name}; expected float32 or bfloat16")
  if name == draft.cfg.dtype == draft.cfg.param_dtype:
    return draft
  graphdef, shapes = nnx.split(nnx.eval_shape(
      lambda: DraftHead(draft.cfg.replace(n_layers=draft.target_layers), nnx.Rngs(0),
                        draft.taps, dtype=name)))
  _, state = nnx.split(draft)
  return nnx.merge(graphdef, jax.tree.map(lambda a, x: x.astype(a.dtype), shapes, state))
