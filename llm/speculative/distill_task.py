"""The EAGLE draft head's self-distillation loss and `DistillTask` (a core.train Task).

Loss over pairs i (f_i, x_{i+1}) -> f^_{i+1}, as EAGLE's (arXiv 2401.15077):
    SmoothL1(f^_{i+1}, f_{i+1})  +  w_cls * CE(softmax(LMHead(f_{i+1})), LMHead(f^_{i+1}))
feature regression plus the cross-entropy of the draft's token distribution against the
target's (soft labels). Input features get uniform noise U(-noise, noise) (EAGLE's, for
robustness to the draft's own errors when it feeds itself deeper in the tree). As EAGLE's,
the loss covers the replies only (`loss_from`: the pairs from the last prompt token on, the
ones the draft predicts from while decoding); the prompt's pairs still fill the head's
attention context. Reported: `top1`, how often the draft's argmax equals the target's over
those pairs, the teacher-forced rate at which the target accepts the draft's first token
(greedy).
`unroll` > 1 adds the head's own deeper draft steps to the loss (EAGLE-3's training-time
test, arXiv 2503.01840; `unrolled_predictions`), step s weighted `unroll_decay`**(s-1).
`taps` (EAGLE-3's fused features): the head also reads the target's residual stream after
those blocks (`llm.speculative.draft`), zeroed on a `tap_dropout` share of the training
pairs, since inside a draft tree the head has none.
Draft vocabulary (EAGLE-3): with `draft_vocab` ids the head's LM head is the target's rows
of those tokens, and the cross-entropy is against the target's distribution renormalized
over them (`top1` then compares argmaxes within that vocabulary). A draft step then costs
Vd / V of the full LM head, which on a 135M target with a 49152-token vocabulary is most of
it.
The train step holds only the head, its optimizer and the target's embedding and LM head;
the target's features come with the batch, else `DistillTask.device_batch` runs the frozen
target (a separate jit, in the loop's prefetch thread). AdamW with warmup + cosine from
`llm.train_lib`, one `core.update.dense_update`. The [B,T,V] logits are materialized (fine
for small vocabularies; a Llama 3 vocabulary would want the loss chunked over tokens).

Letters: B batch, T tokens, P pairs (T-1), D model dim, V vocab, K tap width.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import mesh as mesh_lib
from core import update as update_lib
from llm import model as model_lib
from llm.model import Llama
from llm.speculative.decode import vocab_head
from llm.speculative.distill_data import SeqBatch, split_target_features
from llm.speculative.draft import DraftHead
from llm.train_lib import OptimConfig, applied_lr, make_optimizer


def smooth_l1(x, y):
  """Elementwise Huber loss with delta 1 (PyTorch's SmoothL1Loss, beta 1)."""
  d = jnp.abs(x - y)
  return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def unrolled_predictions(draft: DraftHead, feats_in_BPD, next_emb_BPD, steps: int,
                         taps_in_BPK=None):
  """The head's predicted features at each of `steps` unrolled draft steps, [steps][B,P,D],
  over P pairs (f_p, x_{p+1}) of each sequence (EAGLE-3's training-time test, arXiv
  2503.01840: the head is trained on its own predictions, as it drafts deeper in a tree).

  Step 1 is the head over the target's features (causal). At step s > 1, pair p takes the
  step s-1 prediction of pair p-1 in place of f_p, and attends as at draft depth s after
  committing pairs <= p-s+1: to the step-1 keys of pairs <= p-s+1, then to the step-m key
  of pair p-(s-m) for m = 2..s. Its target is still f_{p+1}; pairs p < s-1 have no such
  chain (`unrolled_mask`). The keys of every step sit in one cache of steps * P slots,
  and one [B,P,steps*P] mask per step says which each query sees. A head with taps reads
  `taps_in_BPK` at step 1 and zeros deeper, as in a draft tree."""
  b, p, _ = feats_in_BPD.shape
  cache = draft.init_cache(b, steps * p)
  pos_BP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  q_P1 = jnp.arange(p)[:, None]
  key_step_S = jnp.repeat(jnp.arange(1, steps + 1), p)     # step m of each slot
  key_pos_S = jnp.tile(jnp.arange(p), steps)                # pair q of each slot
  lag_PS = q_P1 - key_pos_S[None]                           # p - q
  preds, feats_BPD = [], feats_in_BPD
  for s in range(1, steps + 1):
    visible_PS = (((key_step_S == 1)[None] & (lag_PS >= s - 1))
                  | ((key_step_S > 1)[None] & (key_step_S <= s)[None]
                     & (lag_PS == s - key_step_S[None])))
    pred_BPD, cache = draft(feats_BPD, next_emb_BPD, positions_BT=pos_BP, cache=cache,
                            slots_BT=(s - 1) * p + pos_BP,
                            mask_BTS=jnp.broadcast_to(visible_PS, (b, p, steps * p)),
                            taps_BTK=taps_in_BPK if s == 1 else None)
    preds.append(pred_BPD)
    # Pair p of the next step reads pair p-1's prediction (pair 0: a placeholder, masked).
    feats_BPD = jnp.concatenate([feats_in_BPD[:, :1], pred_BPD[:, :-1]], axis=1)
  return preds


def unrolled_mask(mask_BP, step: int):
  """Pairs with a step-`step` prediction: p >= step - 1 (pair mask [B,P] otherwise)."""
  return mask_BP * (jnp.arange(mask_BP.shape[1]) >= step - 1).astype(mask_BP.dtype)


def distill_losses(draft: DraftHead, embed_VD, head, vocab_major: bool, tokens_BT, mask_BT,
                   feats_BTD, noise_BTD=None, unroll: int = 1, per_step: bool = False,
                   loss_from_B=None, taps_BTK=None, tap_keep_BP=None,
                   unroll_decay: float = 1.0):
  """Per-pair (regression, cross-entropy, top1 agreement) [B,T-1] and the pair mask [B,T-1].
  loss_from_B [B]: pairs before it are left out of the mask (they still feed attention).
  unroll > 1: `unrolled_predictions` of that many steps; each term is then the mean over
  the pair's steps, step s weighted unroll_decay**(s-1), and the mask sums the weights of
  the steps the pair has (so sum(term * mask) / sum(mask) is the weighted mean over every
  (pair, step); decay 1: the plain mean). per_step: also [(top1, mask)] per step.
  taps_BTK: the target's states at the head's taps; tap_keep_BP [B,T-1] (0 / 1) zeroes
  them on the pairs where it is 0 (training's tap dropout)."""
  dt = draft.cfg.dtype
  emb_next = jnp.take(embed_VD, tokens_BT[:, 1:], axis=0).astype(dt)
  f_in = feats_BTD[:, :-1].astype(jnp.float32)
  if noise_BTD is not None:
    f_in = f_in + noise_BTD[:, :-1]
  pair_BP = mask_BT[:, 1:] * mask_BT[:, :-1]
  if loss_from_B is not None:
    p_P = jnp.arange(pair_BP.shape[1], dtype=jnp.int32)
    pair_BP = pair_BP * (p_P[None] >= loss_from_B[:, None]).astype(pair_BP.dtype)
  taps_in = None
  if draft.taps:
    if taps_BTK is None:
      raise ValueError(f"distill_losses: the head reads taps {draft.taps}; pass taps_BTK")
    taps_in = taps_BTK[:, :-1].astype(jnp.float32)
    if tap_keep_BP is not None:
      taps_in = taps_in * tap_keep_BP[..., None].astype(taps_in.dtype)
  if unroll == 1:
    preds = [draft(f_in, emb_next, taps_BTK=taps_in)[0]]
  else:
    preds = unrolled_predictions(draft, f_in, emb_next, unroll, taps_in)
  want_BTD = feats_BTD[:, 1:]
  eq = "btd,vd->btv" if vocab_major else "btd,dv->btv"
  logits = lambda h: jnp.einsum(eq, h.astype(dt), head.astype(dt),
                                preferred_element_type=jnp.float32)
  want_logits = logits(want_BTD)
  p_want = jax.nn.softmax(want_logits, axis=-1)
  want_top = jnp.argmax(want_logits, -1)
  terms, masks = [], []
  for s, pred_BTD in enumerate(preds, start=1):
    reg_s = jnp.mean(smooth_l1(pred_BTD.astype(jnp.float32), want_BTD.astype(jnp.float32)),
                     axis=-1)
    pred_logits = logits(pred_BTD)
    ce_s = -jnp.sum(p_want * jax.nn.log_softmax(pred_logits, axis=-1), axis=-1)
    top1_s = (jnp.argmax(pred_logits, -1) == want_top).astype(jnp.float32)
    terms.append((reg_s, ce_s, top1_s))
    masks.append(unrolled_mask(pair_BP, s))
  if len(preds) == 1:
    out = (*terms[0], pair_BP)
  else:
    # Weighted means over every (pair, step) that exists: term * m sums the pair's steps'
    # weighted terms.
    w = [unroll_decay ** (s - 1) for s in range(1, len(preds) + 1)]
    m = sum(w_s * m_s for w_s, m_s in zip(w, masks))
    mean = lambda i: (sum(w_s * t[i] * m_s for w_s, t, m_s in zip(w, terms, masks))
                      / jnp.maximum(m, 1e-9))
    out = (mean(0), mean(1), mean(2), m)
  if per_step:
    return out, [(t[2], m_s) for t, m_s in zip(terms, masks)]
  return out


class DistillEvaluator:
  """Pair-weighted means of the loss terms and top1 over eval batches."""

  def __init__(self):
    self.sums = {"reg": 0.0, "cls": 0.0, "top1": 0.0}
    self.pairs = 0.0

  def update(self, outputs, host) -> None:
    sums, n = jax.device_get(outputs)
    for k, v in sums.items():
      self.sums[k] = self.sums.get(k, 0.0) + float(v)
    self.pairs += float(n)

  def result(self) -> dict[str, float]:
    """Means over the pairs (over every (pair, step) when unrolled); top1_dS: agreement at
    unrolled step S alone, over the pairs that have one (its own count, pairs_dS)."""
    n = max(self.pairs, 1.0)
    out = {k: v / n for k, v in self.sums.items() if not k.startswith(("top1_d", "pairs_d"))}
    for k, v in self.sums.items():
      if k.startswith("top1_d"):
        out[k] = v / max(self.sums["pairs_d" + k[len("top1_d"):]], 1.0)
    return {**out, "pairs": self.pairs}


class DistillTask:
  """Self-distillation of a DraftHead for a frozen target (a core.train Task)."""

  def __init__(self, target: Llama, optim: OptimConfig, mesh: Mesh, *, w_cls: float = 0.1,
               noise: float = 0.1, rules: mesh_lib.Rules = mesh_lib.LLM_RULES,
               draft_vocab=None, unroll: int = 1, taps: tuple[int, ...] = (),
               tap_dropout: float = 0.0, unroll_decay: float = 1.0):
    if not (math.isfinite(w_cls) and w_cls >= 0 and math.isfinite(noise) and noise >= 0):
      raise ValueError(f"DistillTask: w_cls={w_cls}, noise={noise}; expected finite and >= 0")
    if not (isinstance(unroll, (int, np.integer)) and unroll >= 1):
      raise ValueError(f"DistillTask: unroll={unroll!r}; expected an integer >= 1 (draft "
                       "steps the loss unrolls)")
    if not (math.isfinite(unroll_decay) and 0 < unroll_decay <= 1):
      raise ValueError(f"DistillTask: unroll_decay={unroll_decay}; expected 0 < decay <= 1 "
                       "(the weight of unrolled step s is decay**(s-1))")
    self.unroll_decay = float(unroll_decay)
    self.cfg, self.optim, self.mesh, self.rules = target.cfg, optim, mesh, rules
    if not 0.0 <= tap_dropout < 1.0:
      raise ValueError(f"DistillTask: tap_dropout={tap_dropout}; expected 0 <= p < 1")
    self.w_cls, self.noise, self.unroll = w_cls, noise, int(unroll)
    self.taps, self.tap_dropout = tuple(int(i) for i in taps), float(tap_dropout)
    self.tx = make_optimizer(optim)
    rep = NamedSharding(mesh, P())
    tgraph, tstate = nnx.split(target)
    self._target = (tgraph, jax.device_put(tstate, rep))
    # With a draft vocabulary the head is the target's rows of those tokens, and the
    # cross-entropy is against the target's distribution renormalized over them.
    head = vocab_head(target, draft_vocab)
    if head is None:
      w, self.vocab_major = target.output_weight()
    else:
      w, self.vocab_major = head[0], True
    self._shared = {"embed": jax.device_put(model_lib._weight(target.embed), rep),
                    "head": jax.device_put(w, rep)}
    abstract = nnx.eval_shape(lambda: DraftHead(self.cfg, nnx.Rngs(0), self.taps))
    self.graphdef, abstract_state = nnx.split(abstract)
    self.param_shardings = nnx.to_pure_dict(
        model_lib.param_shardings(abstract_state, mesh, rules))
    self._features = jax.jit(split_target_features, static_argnums=(0, 3))
    self.seed = 0

  def init_state(self, seed: int) -> dict[str, Any]:
    self.seed = seed
    rep = NamedSharding(self.mesh, P())
    init = jax.jit(lambda k: nnx.to_pure_dict(nnx.state(DraftHead(self.cfg, nnx.Rngs(k),
                                                                  self.taps))),
                   out_shardings=self.param_shardings)
    params = init(jax.random.key(seed))
    opt = jax.jit(self.tx.init, out_shardings=optax.tree_map_params(
        self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, params), self.param_shardings,
        transform_non_params=lambda _: rep))(params)
    return {"step": jax.device_put(jnp.zeros((), jnp.int32), rep), "params": params, "opt": opt}

  def draft(self, params) -> DraftHead:
    return nnx.merge(self.graphdef, params)

  def device_batch(self, host: SeqBatch) -> dict[str, Any]:
    """Places the ids and the target's features (precomputed with the batch, else computed
    here by the frozen target in its own jit); the shared embedding and LM head ride along
    (the target's buffers, not copies)."""
    dev = mesh_lib.shard_batch(host, self.mesh, self.rules, batch_axis="act_batch")
    feats, taps = dev.feats, dev.taps
    if feats is None or (self.taps and taps is None):
      feats = self._features(self._target[0], self._target[1], dev.tokens, self.taps)
      if self.taps:
        feats, taps = feats
    out = {"tokens": dev.tokens, "mask": dev.mask, "feats": feats, **self._shared}
    if self.taps:
      out["taps"] = taps
    if dev.loss_from is not None:
      out["loss_from"] = dev.loss_from
    return out

  @staticmethod
  def examples_in(host: SeqBatch) -> int:
    return int(np.sum(host.mask))

  def _sums(self, params, batch, noise_key=None):
    noise = None
    if noise_key is not None and self.noise > 0:
      noise = jax.random.uniform(noise_key, batch["feats"].shape, jnp.float32, -self.noise,
                                 self.noise)
    keep = None
    if noise_key is not None and self.taps and self.tap_dropout > 0:
      b, t = batch["tokens"].shape
      keep = jax.random.bernoulli(jax.random.fold_in(noise_key, 1), 1.0 - self.tap_dropout,
                                  (b, t - 1))
    (reg, ce, top1, m), steps = distill_losses(
        self.draft(params), batch["embed"], batch["head"], self.vocab_major, batch["tokens"],
        batch["mask"], batch["feats"], noise, unroll=self.unroll, per_step=True,
        unroll_decay=self.unroll_decay,
        loss_from_B=batch.get("loss_from"), taps_BTK=batch.get("taps"), tap_keep_BP=keep)
    sums = {"reg": jnp.sum(reg * m), "cls": jnp.sum(ce * m), "top1": jnp.sum(top1 * m)}
    if self.unroll > 1:
      for s, (top1_s, m_s) in enumerate(steps, start=1):
        sums[f"top1_d{s}"], sums[f"pairs_d{s}"] = jnp.sum(top1_s * m_s), jnp.sum(m_s)
    return sums, jnp.sum(m)

  def train_step(self, state, batch, skip_nonfinite: bool = False):
    key = jax.random.fold_in(jax.random.key(self.seed), state["step"])

    def loss_fn(params):
      sums, n = self._sums(params, batch, key)
      n = jnp.maximum(n, 1.0)
      return (sums["reg"] + self.w_cls * sums["cls"]) / n, (sums, n)

    (loss, (sums, n)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    dense = update_lib.dense_update(self.tx, state["params"], state["opt"], grads, loss,
                                    skip_nonfinite=skip_nonfinite)
    metrics = {**dense.metrics, "reg": sums["reg"] / n, "cls": sums["cls"] / n,
               "top1": sums["top1"] / n, "lr": applied_lr(self.optim, state["opt"])}
    return {"step": state["step"] + 1, "params": dense.params, "opt": dense.opt}, metrics

  def eval_step(self, state, batch):
    return self._sums(state["params"], batch)

  def new_evaluator(self) -> DistillEvaluator:
    return DistillEvaluator()
