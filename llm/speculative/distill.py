"""Training the EAGLE draft head by self-distillation (arXiv 2401.15077), through core.train.

Data: sequences the target itself generates (`generate_sequences`: sampled from given prompts,
by default the BOS token, e.g. chat requests, ending at stop ids), so the head learns the
target's own continuations. The target's features f_i (final hidden states, post-norm) are
captured as it generates the sequences (`llm.generate.generate_with_hidden`: no second
forward pass), or computed once per sequence (`target_features`) for sequences made without
them, and ride with the batches; without them
`DistillTask.device_batch` runs the frozen target (a separate jit, in the loop's prefetch
thread). Either way the train step holds only the head, its optimizer and the target's
embedding and LM head. Sequences and features are kept in the workdir and saved chunk by
chunk (`cached_sequences`, `cached_features`), so a killed run continues where it stopped;
the train loop checkpoints and resumes by itself.

Draft vocabulary (EAGLE-3, arXiv 2503.01840): with `draft_vocab` ids (`draft_vocab()`: the
most frequent tokens of the training sequences) the head's LM head is the target's rows of
those tokens, and the cross-entropy is against the target's distribution renormalized over
them (`top1` then compares argmaxes within that vocabulary). A draft step then costs Vd / V
of the full LM head, which on a 135M target with a 49152-token vocabulary is most of it.

Loss over pairs i (f_i, x_{i+1}) -> f^_{i+1}, as EAGLE's:
    SmoothL1(f^_{i+1}, f_{i+1})  +  w_cls * CE(softmax(LMHead(f_{i+1})), LMHead(f^_{i+1}))
feature regression plus the cross-entropy of the draft's token distribution against the
target's (soft labels). Input features get uniform noise U(-noise, noise) (EAGLE's, for
robustness to the draft's own errors when it feeds itself deeper in the tree). As EAGLE's,
the loss covers the replies only (`DistillConfig.prompt_loss=False`): the pairs from the
last prompt token on, the ones the draft predicts from while decoding; the prompt's pairs
still fill the head's attention context. Reported: `top1`, how often the draft's argmax
equals the target's over those pairs, the teacher-forced rate at which the target accepts
the draft's first token (greedy).
`unroll` > 1 adds the head's own deeper draft steps to the loss (EAGLE-3's training-time
test, arXiv 2503.01840; `unrolled_predictions`), step s weighted `unroll_decay`**(s-1).
`taps` (EAGLE-3's fused features): the head also reads the target's residual stream after
those blocks (`llm.speculative.draft`); they come from a forward pass (`cached_features`, kept
in float16 beside the features; generation does not capture them) and are zeroed on a
`tap_dropout` share of the training pairs, since inside a draft tree the head has none.
AdamW with warmup + cosine from `llm.train_lib`. The [B,T,V] logits are materialized (fine
for small vocabularies; a Llama 3 vocabulary would want the loss chunked over tokens).

Letters: B batch, T tokens, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import mesh as mesh_lib
from llm import model as model_lib
from llm.generate import generate, generate_with_hidden
from llm.model import Llama
from llm.speculative.decode import vocab_head
from llm.speculative.draft import DraftHead
from llm.train_lib import OptimConfig, make_optimizer, make_schedule


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SeqBatch:
  """Target-generated token ids; mask 1 on real tokens (0 on padding)."""

  tokens: np.ndarray    # [B, T] int32
  mask: np.ndarray      # [B, T] float32
  feats: np.ndarray | None = None   # [B, T, D] the target's features, when precomputed
  loss_from: np.ndarray | None = None  # [B] int32: the first pair in the loss (None: pair 0)
  taps: np.ndarray | None = None    # [B, T, K*D] the target's states at the head's taps


def generate_sequences(target: Llama, num: int, length: int, *, prompts=((1,),),
                       temperature: float = 1.0, batch_size: int = 64, seed: int = 0,
                       progress: bool = False, stop_tokens=(), start: int = 0,
                       out=None, on_chunk=None, feats_out: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [num, length] int32, mask [num, length]) sampled from the target: sequence i
  continues prompts[i % len(prompts)] to `length` tokens or through its first stop token
  (the mask is 0 after it). Deterministic in seed. Resuming: `out` holds (tokens, mask) of
  rows < start, made by the same call; on_chunk(rows done) is called after each chunk.
  feats_out [num, length, D]: filled with the target's features of each sequence as it
  generated them (`llm.generate.generate_with_hidden`; 0 past the mask), the same tokens,
  so no second forward pass is needed (`target_features`)."""
  if num < 1 or length < 2:
    raise ValueError(f"generate_sequences: num={num}, length={length}; expected >= 1 and >= 2")
  prompts = [list(p) for p in prompts]
  if not prompts or any(not 1 <= len(p) < length for p in prompts):
    raise ValueError(f"generate_sequences: prompt lengths {[len(p) for p in prompts]}; "
                     f"expected 1 .. {length - 1}")
  if out is None:
    out = (np.zeros((num, length), np.int32), np.zeros((num, length), np.float32))
  tokens, mask = out
  t0, done0 = time.perf_counter(), start
  # One n_new and cache size for every chunk: the decode loop compiles once.
  n_new = length - min(len(p) for p in prompts)
  max_len = max(len(p) for p in prompts) + n_new
  for first in range(start, num, batch_size):
    rows = range(first, min(num, first + batch_size))
    chunk = [prompts[i % len(prompts)] for i in rows]
    kw = dict(temperature=temperature, stop_tokens=stop_tokens,
              rng=jax.random.key(seed * 1_000_003 + first))
    if feats_out is None:
      new = generate(target, chunk, n_new, max_len=max_len, **kw)
      hidden = [None] * len(chunk)
    else:
      new, hidden = generate_with_hidden(target, chunk, n_new, max_len=max_len + 1, **kw)
    for i, p, o, h in zip(rows, chunk, new, hidden):
      seq = (p + o)[:length]
      tokens[i], mask[i] = 0, 0.0
      tokens[i, :len(seq)] = seq
      mask[i, :len(seq)] = 1.0
      if h is not None:
        feats_out[i] = 0.0
        feats_out[i, :len(seq)] = h[:len(seq)]
    if on_chunk is not None:
      on_chunk(rows.stop)
    if progress:
      _progress("generated", rows.stop, num, done0, t0, "sequences")
  return tokens, mask


def _progress(what: str, done: int, total: int, done0: int, t0: float, unit: str) -> None:
  """One progress line: count, rate over this process's part, ETA."""
  rate = (done - done0) / max(time.perf_counter() - t0, 1e-9)
  eta = (total - done) / rate if rate > 0 else float("nan")
  print(f"  {what} {done}/{total} {unit} | {rate:.2f} {unit}/s | ETA {eta / 60:.1f} min",
        flush=True)


def draft_vocab(tokens: np.ndarray, mask: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
  """The `size` tokens most frequent among the sequences' real tokens (ties: lower id first),
  sorted: the draft's output vocabulary (EAGLE-3, arXiv 2503.01840, keeps the most frequent
  tokens of its training data). Tokens it lacks are never drafted, only ever the bonus."""
  if not 1 <= size <= vocab_size:
    raise ValueError(f"draft_vocab: size={size}; expected 1 .. vocab_size={vocab_size}")
  real = np.asarray(tokens)[np.asarray(mask) > 0]
  counts = np.bincount(real.astype(np.int64), minlength=vocab_size)[:vocab_size]
  order = np.lexsort((np.arange(vocab_size), -counts))
  return np.sort(order[:size]).astype(np.int32)


def target_features(target: Llama, tokens: np.ndarray, *, batch_size: int = 8, start: int = 0,
                    out: np.ndarray | None = None, on_chunk=None,
                    progress: bool = False, taps: tuple[int, ...] = (),
                    taps_out: np.ndarray | None = None) -> np.ndarray:
  """The target's features [N, T, D] float32 (final hidden states, post-norm) of every
  sequence, computed `batch_size` rows at a time (rows < start taken from `out`). With
  `taps`, the states after those blocks go to `taps_out` [N, T, len(taps)*D] as well."""
  n, t = tokens.shape
  feats = np.zeros((n, t, target.cfg.dim), np.float32) if out is None else out
  if taps and (taps_out is None or taps_out.shape != (n, t, len(taps) * target.cfg.dim)):
    raise ValueError(f"target_features: taps={tuple(taps)} need taps_out of shape "
                     f"{(n, t, len(taps) * target.cfg.dim)}, got "
                     f"{None if taps_out is None else taps_out.shape}")
  graphdef, state = nnx.split(target)
  fn = jax.jit(_target_features, static_argnums=(0, 3))
  t0 = time.perf_counter()
  for first in range(start, n, batch_size):
    rows = tokens[first:first + batch_size]
    pad = batch_size - len(rows)
    batch = np.concatenate([rows, np.zeros((pad, t), np.int32)]) if pad else rows
    got = fn(graphdef, state, jnp.asarray(batch), tuple(taps))
    if taps:
      got, tapped = got
      taps_out[first:first + len(rows)] = np.asarray(tapped, taps_out.dtype)[:len(rows)]
    feats[first:first + len(rows)] = np.asarray(got, np.float32)[:len(rows)]
    if on_chunk is not None:
      on_chunk(first + len(rows))
    if progress:
      _progress("target features of", first + len(rows), n, start, t0, "sequences")
  return feats


class SequenceSource:
  """Batches of generated sequences: train batch k is a deterministic draw of (seed, k)
  (resumable); eval yields the sequences in order, the last batch padded and masked."""

  def __init__(self, tokens: np.ndarray, mask: np.ndarray, batch_size: int, *,
               split: str = "train", seed: int = 0, feats: np.ndarray | None = None,
               loss_from: np.ndarray | None = None, taps: np.ndarray | None = None):
    if split not in ("train", "eval"):
      raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
    if tokens.shape != mask.shape or tokens.ndim != 2 or len(tokens) == 0:
      raise ValueError(f"SequenceSource: tokens {tokens.shape}, mask {mask.shape}; expected "
                       "the same non-empty [N, T]")
    if feats is not None and feats.shape[:2] != tokens.shape:
      raise ValueError(f"SequenceSource: feats {feats.shape}; expected [N, T, D] with [N, T] "
                       f"= {tokens.shape}")
    if taps is not None and (feats is None or taps.shape[:2] != tokens.shape):
      raise ValueError(f"SequenceSource: taps {taps.shape}; expected [N, T, K*D] with [N, T] "
                       f"= {tokens.shape}, beside feats")
    if loss_from is not None and np.shape(loss_from) != tokens.shape[:1]:
      raise ValueError(f"SequenceSource: loss_from of shape {np.shape(loss_from)}; expected "
                       f"[N] = {tokens.shape[:1]}, one first pair per sequence")
    self.tokens, self.mask = tokens.astype(np.int32), mask.astype(np.float32)
    self.feats, self.taps = feats, taps
    self.loss_from = None if loss_from is None else np.asarray(loss_from, np.int32)
    self.batch_size, self.split, self.seed = batch_size, split, seed

  def batch(self, k: int) -> SeqBatch:
    idx = np.random.default_rng([self.seed, k]).integers(0, len(self.tokens), self.batch_size)
    pick = lambda x: None if x is None else x[idx]
    return SeqBatch(self.tokens[idx], self.mask[idx], pick(self.feats), pick(self.loss_from),
                    pick(self.taps))

  def batches(self, start: int = 0) -> Iterator[SeqBatch]:
    if self.split == "train":
      k = start
      while True:
        yield self.batch(k)
        k += 1
    n, b = len(self.tokens), self.batch_size
    for i in range(0, n, b):
      tok, m = self.tokens[i:i + b], self.mask[i:i + b]
      pad = b - len(tok)
      padded = lambda x: np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
      part = lambda x: None if x is None else padded(x[i:i + b])
      yield SeqBatch(padded(tok), padded(m), part(self.feats), part(self.loss_from),
                     part(self.taps))


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
    self._features = jax.jit(_target_features, static_argnums=(0, 3))
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
    updates, opt = self.tx.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    grad_norm = optax.tree.norm(grads)
    metrics = {"loss": loss, "reg": sums["reg"] / n, "cls": sums["cls"] / n,
               "top1": sums["top1"] / n, "grad_norm": grad_norm,
               "lr": make_schedule(self.optim)(state["step"])}
    if skip_nonfinite:
      ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      params = jax.tree.map(lambda a, b: jnp.where(ok, a, b), params, state["params"])
      opt = jax.tree.map(lambda a, b: jnp.where(ok, a, b), opt, state["opt"])
      metrics["skipped"] = (~ok).astype(jnp.float32)
    return {"step": state["step"] + 1, "params": params, "opt": opt}, metrics

  def eval_step(self, state, batch):
    return self._sums(state["params"], batch)

  def new_evaluator(self) -> DistillEvaluator:
    return DistillEvaluator()


def _target_features(graphdef, state, tokens_BT, taps=()):
  target = nnx.merge(graphdef, state)
  out = target.hidden(target.embed_tokens(tokens_BT), taps=taps)
  return (out[0], out[2]) if taps else out[0]


def load_draft(workdir: str, target_cfg, step: int | None = None) -> DraftHead:
  """The DraftHead of a DistillTask run's checkpoint at `step` (default: the latest), with
  the taps its run's settings name."""
  from core import checkpoint as ckpt_lib
  ckpt = ckpt_lib.Checkpointer(workdir)
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(errno.ENOENT, "no draft-head checkpoint to load",
                              f"{workdir}/checkpoints")
    mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
    rep = NamedSharding(mesh, P())
    meta = ckpt.restore_meta(step) or {}
    taps = tuple(meta.get("settings", {}).get("distill.taps") or ())
    abstract_draft = nnx.eval_shape(lambda: DraftHead(target_cfg, nnx.Rngs(0), taps))
    graphdef, abstract_params = nnx.split(abstract_draft)
    params = nnx.to_pure_dict(abstract_params)
    tx = make_optimizer(OptimConfig())
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                "opt": jax.eval_shape(tx.init, params)}
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), abstract)
    state, _ = ckpt.restore(step, abstract)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, state["params"])


# DistillConfig fields that are the loop's (free to change on resume, as core.train's own).
_LOOP_FIELDS = ("steps", "eval_every", "log_every", "checkpoint_every")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Self-distillation run: data the target generates, then the train loop's settings."""

  num_sequences: int = 1024       # generated sequences (the last eval_sequences held out)
  seq_len: int = 128              # tokens per sequence, prompt included
  eval_sequences: int = 64
  gen_temperature: float = 1.0    # the target samples its training sequences at this (0: greedy)
  gen_batch: int = 64             # sequences generated per generate call
  draft_vocab: int = 0            # tokens the draft proposes from (0: the whole vocabulary)
  prompt_loss: bool = False       # pairs inside the prompts count in the loss (EAGLE: replies only)
  cache_features: bool = True     # the target's features computed once, kept in the workdir
  batch_size: int = 32
  steps: int = 1500
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  weight_decay: float = 0.0
  w_cls: float = 0.1
  noise: float = 0.1
  unroll: int = 1                 # draft steps the loss unrolls (`unrolled_predictions`)
  unroll_decay: float = 1.0       # weight of unrolled step s: decay**(s-1)
  taps: tuple[int, ...] = ()      # target blocks whose states the head also reads (EAGLE-3)
  tap_dropout: float = 0.3        # share of pairs trained with the taps zeroed (draft trees)
  eval_every: int = 0
  log_every: int = 100
  checkpoint_every: int = 0
  seed: int = 0

  def __post_init__(self):
    if not 0 < self.eval_sequences < self.num_sequences:
      raise ValueError(f"DistillConfig: eval_sequences={self.eval_sequences}, expected "
                       f"0 < eval_sequences < num_sequences={self.num_sequences}")
    if not (math.isfinite(self.gen_temperature) and self.gen_temperature >= 0):
      raise ValueError(f"DistillConfig: gen_temperature={self.gen_temperature}, expected a "
                       "finite temperature >= 0 (0: greedy)")


def _load_partial(path: str, key: str):
  """(arrays, rows done) of `path` (.npz) when it was made with `key`, else None."""
  import os
  if not os.path.exists(path):
    return None
  with np.load(path) as f:
    if str(f["key"]) != key:
      return None
    return {k: f[k] for k in f.files if k not in ("key", "done")}, int(f["done"])


def _save_partial(path: str, key: str, done: int, **arrays) -> None:
  import os
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  np.savez(path + ".tmp.npz", key=np.asarray(key), done=np.asarray(done), **arrays)
  os.replace(path + ".tmp.npz", path)


def _features_key(tokens: np.ndarray, dim: int) -> str:
  """What `cached_features` keys a features file by: a hash of the tokens, and the width."""
  import hashlib
  return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest() + f":{dim}"


def cached_sequences(target: Llama, path: str, prompts, dcfg: DistillConfig, stop_tokens=(),
                     feats_path: str | None = None, save_every_s: float = 120.0):
  """`generate_sequences` for dcfg, kept in `path` (.npz) with the settings that made it
  (regenerated when they differ); saved after every chunk, so a killed run continues from
  the last one.

  feats_path: the target's features are captured while generating (`feats_out`) and kept
  there: every `save_every_s` seconds under the sequences' settings (a killed run continues
  from the last rows saved with their features) and, once every sequence is made, under the
  key `cached_features` reads, which then finds them made. Sequences made earlier without
  capture leave their features to `cached_features`."""
  import json
  import time as time_lib
  key = json.dumps({"num": dcfg.num_sequences, "len": dcfg.seq_len, "seed": dcfg.seed,
                    "temperature": dcfg.gen_temperature, "prompts": [list(map(int, p))
                                                                      for p in prompts],
                    "stop": [int(t) for t in stop_tokens], "batch": dcfg.gen_batch,
                    "vocab": target.cfg.vocab_size}, sort_keys=True)
  saved = _load_partial(path, key)
  out, start = (None, 0) if saved is None else ((saved[0]["tokens"], saved[0]["mask"]),
                                                saved[1])
  if start < dcfg.num_sequences:
    n = dcfg.num_sequences
    feats, fkey = None, "generated:" + key
    if feats_path is not None:
      fsaved = _load_partial(feats_path, fkey)
      if fsaved is not None and fsaved[1] <= start:
        # Rows are a function of (seed, chunk): regenerate those saved without features.
        feats, start = fsaved[0]["feats"], fsaved[1]
      elif start == 0:
        feats = np.zeros((n, dcfg.seq_len, target.cfg.dim), np.float32)
    holder, last = {}, [time_lib.perf_counter()]

    def save(done):
      _save_partial(path, key, done, tokens=holder["out"][0], mask=holder["out"][1])
      if feats is None:
        return
      if done == n:
        _save_partial(feats_path, _features_key(holder["out"][0], target.cfg.dim), n,
                      feats=feats)
      elif time_lib.perf_counter() - last[0] > save_every_s:
        _save_partial(feats_path, fkey, done, feats=feats)
        last[0] = time_lib.perf_counter()

    if out is None:
      out = (np.zeros((n, dcfg.seq_len), np.int32), np.zeros((n, dcfg.seq_len), np.float32))
    holder["out"] = out
    if start:
      print(f"  continuing the target's sequences from {start}/{n}", flush=True)
    generate_sequences(target, n, dcfg.seq_len, prompts=prompts,
                       temperature=dcfg.gen_temperature, seed=dcfg.seed, progress=True,
                       batch_size=dcfg.gen_batch, stop_tokens=stop_tokens, start=start,
                       out=out, on_chunk=save, feats_out=feats)
  return out


def cached_features(target: Llama, path: str, tokens: np.ndarray, batch_size: int = 8,
                    taps: tuple[int, ...] = ()):
  """`target_features` of `tokens`, kept in `path` (.npz) keyed by a hash of the tokens;
  saved every few chunks, so a killed run continues. With `taps`: (features, the states at
  those blocks in float16, [N, T, len(taps)*D]), kept together."""
  taps = tuple(int(i) for i in taps)
  key = _features_key(tokens, target.cfg.dim) + (f":taps={list(taps)}" if taps else "")
  saved = _load_partial(path, key)
  feats, start = (None, 0) if saved is None else (saved[0]["feats"], saved[1])
  tapped = None if saved is None or not taps else saved[0]["taps"]
  if start < len(tokens):
    if feats is None:
      feats = np.zeros(tokens.shape + (target.cfg.dim,), np.float32)
      if taps:
        tapped = np.zeros(tokens.shape + (len(taps) * target.cfg.dim,), np.float16)
    last = [time.perf_counter(), 0.0]     # (end of the last save, its duration)

    def save(done):
      # At most every minute, and at most a tenth of the time in saving (large files).
      since = time.perf_counter() - last[0]
      if done == len(tokens) or (since > 60 and since > 10 * last[1]):
        t = time.perf_counter()
        _save_partial(path, key, done, feats=feats, **({"taps": tapped} if taps else {}))
        last[:] = [time.perf_counter(), time.perf_counter() - t]

    feats = target_features(target, tokens, batch_size=batch_size, start=start, out=feats,
                            on_chunk=save, progress=True, taps=taps, taps_out=tapped)
  return (feats, tapped) if taps else feats


def loop_config(workdir: str, dcfg: DistillConfig, *, overwrite: bool = False, settings=None,
                resume_allow=()):
  """The core.train loop settings of a draft-head run in `workdir`: resumed when it holds
  checkpoints (unless `overwrite`); the run's settings are every DistillConfig field but the
  loop's own, as distill.NAME, plus `settings`; those in `resume_allow` may change."""
  import os
  from core import train as train_lib
  return train_lib.TrainConfig(
      workdir=workdir, steps=dcfg.steps, eval_every=dcfg.eval_every,
      checkpoint_every=dcfg.checkpoint_every, log_every=dcfg.log_every, seed=dcfg.seed,
      resume=not overwrite and os.path.isdir(os.path.join(workdir, "checkpoints")),
      overwrite=overwrite, tensorboard=False, resume_allow=tuple(resume_allow),
      settings={**{f"distill.{k}": v for k, v in dataclasses.asdict(dcfg).items()
                   if k not in _LOOP_FIELDS}, **(settings or {})},
      nonfinite_hint="lower the draft learning rate")


def _latest_step(workdir: str) -> int:
  import os
  from core import checkpoint as ckpt_lib
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    return -1
  ckpt = ckpt_lib.Checkpointer(workdir)
  try:
    step = ckpt.latest_step()
  finally:
    ckpt.close()
  return -1 if step is None else step


def train_draft(target: Llama, workdir: str, dcfg: DistillConfig, *, prompts=((1,),),
                stop_tokens=(), mesh: Mesh | None = None, overwrite: bool = False,
                settings=None, resume_allow=()):
  """Generates (or reuses) the sequences (`cached_sequences`, ending at `stop_tokens`), the
  draft vocabulary (`draft_vocab` of the training sequences, when dcfg.draft_vocab) and the
  target's features (`cached_features`, when dcfg.cache_features and training remains),
  trains a DraftHead in `workdir` through core.train (`loop_config`: an existing run with
  the same settings is resumed, a finished one just loaded; settings named in
  `resume_allow`, e.g. "distill.learning_rate", may differ from the run's) and returns
  (draft, train summary, (tokens, mask), draft vocabulary ids or None)."""
  import os
  from core import train as train_lib
  if dcfg.gen_temperature == 0:
    distinct = len({tuple(int(t) for t in p) for p in prompts})
    if distinct < dcfg.num_sequences:
      raise ValueError(f"train_draft: gen_temperature=0 (greedy) with {distinct} distinct "
                       f"prompts for num_sequences={dcfg.num_sequences}: greedy sequences "
                       "from the same prompt are the same sequence; give one prompt per "
                       "sequence or sample (gen_temperature > 0)")
  train_more = overwrite or _latest_step(workdir) < dcfg.steps
  feats_path = os.path.join(workdir, "features_taps.npz" if dcfg.taps else "features.npz")
  # Generation captures the final features only: with taps they come from a forward pass.
  capture = dcfg.cache_features and train_more and not dcfg.taps
  tokens, mask = cached_sequences(target, os.path.join(workdir, "sequences.npz"), prompts, dcfg,
                                  stop_tokens, feats_path=feats_path if capture else None)
  n_train = dcfg.num_sequences - dcfg.eval_sequences
  vocab = None
  if dcfg.draft_vocab:
    vocab = draft_vocab(tokens[:n_train], mask[:n_train], dcfg.draft_vocab,
                        target.cfg.vocab_size)
  loss_from = None
  if not dcfg.prompt_loss:
    # Pair p predicts the feature whose argmax is token p + 2; the draft proposes tokens
    # from the second new one on (the first comes from the target's prefill), so the
    # pairs it is used on start at p = len(prompt) - 1.
    loss_from = np.asarray([len(prompts[i % len(prompts)]) - 1
                            for i in range(dcfg.num_sequences)], np.int32)
  feats = taps = None
  if dcfg.cache_features and train_more:
    feats = cached_features(target, feats_path, tokens, taps=dcfg.taps)
    if dcfg.taps:
      feats, taps = feats
  mesh = mesh or mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  optim = OptimConfig(peak_lr=dcfg.learning_rate, warmup_steps=dcfg.warmup_steps,
                      total_steps=dcfg.steps, weight_decay=dcfg.weight_decay)
  task = DistillTask(target, optim, mesh, w_cls=dcfg.w_cls, noise=dcfg.noise,
                     draft_vocab=vocab, unroll=dcfg.unroll, taps=dcfg.taps,
                     tap_dropout=dcfg.tap_dropout, unroll_decay=dcfg.unroll_decay)
  split = lambda x, a, b: None if x is None else x[a:b]
  train_src = SequenceSource(tokens[:n_train], mask[:n_train], dcfg.batch_size, seed=dcfg.seed,
                             feats=split(feats, 0, n_train),
                             loss_from=split(loss_from, 0, n_train),
                             taps=split(taps, 0, n_train))
  eval_src = SequenceSource(tokens[n_train:], mask[n_train:], dcfg.batch_size, split="eval",
                            feats=split(feats, n_train, None),
                            loss_from=split(loss_from, n_train, None),
                            taps=split(taps, n_train, None))
  loop = loop_config(workdir, dcfg, overwrite=overwrite, settings=settings,
                     resume_allow=resume_allow)
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0), loop)
  return task.draft(out["state"]["params"]), out, (tokens, mask), vocab
