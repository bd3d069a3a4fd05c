"""Batched speculative decoding with an EAGLE draft head and tree attention (arXiv 2508.08192).

Prefill (once): the target writes the prompts into its KV cache and samples the first new
token, the root of the first tree; the draft head reads the pairs (f_i, x_{i+1}) of every
prompt token into its own cache, and its output at the last one predicts the root's feature.

Round (a `lax.while_loop` iteration, every shape static, `TreeShape` fixed):
  1. draft: expand the tree (`tree.py`): depth 1 from the root's predicted feature, then
     depth - 1 draft calls of top_k tokens each (the frontier), each node at position
     start + depth - 1 seeing the committed pairs and its ancestors (an explicit mask over
     the draft's scratch slots); re-rank the pool to the `budget` best nodes;
  2. verify: one target forward over the N = budget + 1 nodes at positions start + depth,
     written into cache slots start + `node_slots` (each congruent to its position modulo
     the attention product's partial sums, so a node's sums are a plain step's), with the
     ancestor mask (`slot_mask`);
  3. accept (`accept.py`): the longest path the target agrees with, greedy or by rejection
     sampling, plus a bonus token from the target;
  4. commit: the path's keys and values move to slots start .. start + a in every layer,
     every slot past them is emptied (position 2**30), length = start + a + 1;
  5. catch up: the draft head reads the a + 1 new pairs (target features along the path,
     next tokens ending with the bonus) into its cache; the bonus is the next root.
Rows move independently: each has its own length, accepted count and stop state; the loop
ends when every row has max_new_tokens tokens or a stop token. Both caches hold
prompt + max_new_tokens + max(`slot_span`, (depth - 1) * top_k, depth + 1) slots.

Draft vocabulary (`draft_vocab=`, EAGLE-3's, arXiv 2503.01840): the draft's top-k at every
depth is taken over the target's output rows of those ids only (`vocab_head`, gathered once
per call), its log-softmax over them; the target verifies with its full vocabulary, so
greedy output and the sampling distribution are unchanged.

A head with taps (EAGLE-3's fused features, `llm.speculative.draft`) gets the target's
states at those blocks wherever it gets the target's features: the prefill and, along the
accepted path, the verification pass (step 5); its tree steps read zeros there.

Every attention call (target prefill and verification, draft prefill, tree and catch-up) goes
through `llm.attention` with the models' `attention_impl`; the tree mask through its `mask`
argument ("auto" runs it as per-query decode steps, "xla_decode").

Counting: a row's accepted length per round is a + 1 (accepted drafted tokens and the bonus,
EAGLE's tau); tokens per target call = new tokens / (1 + rounds) (the prefill counts; plain
decoding makes exactly 1).

Letters: B batch, T prompt length (padded), N tree nodes, K top_k, J = depth + 1, S cache
slots, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm import generate as gen_lib
from llm.generate import _sample, filtered_logits
from llm.model import SENTINEL_POS, KVCache, Llama
from llm.speculative import accept as accept_lib
from llm.speculative import tree as tree_lib
from llm.speculative.draft import DraftHead, write_slots
from llm.speculative.tree import TreeShape


def cache_slots(prompt_len: int, max_new_tokens: int, shape: TreeShape) -> int:
  """Slots both caches need: a row still decoding has start <= prompt + max_new - 2."""
  scratch = max(tree_lib.slot_span(shape), (shape.depth - 1) * shape.top_k, shape.depth + 1)
  return prompt_len + max_new_tokens + scratch


def vocab_head(target: Llama, vocab_ids, dtype=None) -> tuple[jax.Array, jax.Array] | None:
  """The draft's output head over a reduced vocabulary (EAGLE-3, arXiv 2503.01840): the
  target's own output rows of `vocab_ids` [Vd] in `dtype` (default the target's compute
  dtype; decoding takes the draft's: gathered once per call, outside the decode loop) and the
  ids. None: the full vocabulary."""
  if vocab_ids is None:
    return None
  ids_Vd = jnp.asarray(vocab_ids, jnp.int32)
  return target.output_rows(ids_Vd, dtype), ids_Vd


def _draft_top_k(target: Llama, head, h_BXD, k: int):
  """(log-probs, token ids) of the draft's k most likely next tokens at each feature: the
  target's LM head over the full vocabulary, or over the draft vocabulary `head` (its
  log-softmax taken there)."""
  if head is None:
    return jax.lax.top_k(jax.nn.log_softmax(target.logits(h_BXD), axis=-1), k)
  w_VdD, ids_Vd = head
  logits = jnp.einsum("bxd,vd->bxv", h_BXD.astype(w_VdD.dtype), w_VdD,
                      preferred_element_type=jnp.float32)
  val, idx = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
  return val, ids_Vd[idx]


def draft_tree(target: Llama, draft: DraftHead, dcache: KVCache, h_root_BD, root_B, start_B,
               shape: TreeShape, head=None):
  """Expands the tree (module docstring, step 1); returns ((tokens, parents, depths) [B,N],
  the draft cache with its scratch slots [start, start + (depth-1)*top_k) used). head: the
  draft vocabulary (`vocab_head`) or None."""
  k, depth = shape.top_k, shape.depth
  b = root_B.shape[0]
  s = dcache.max_len
  scratch = (depth - 1) * k
  val_BK, tok_BK = (x[:, 0] for x in _draft_top_k(target, head, h_root_BD[:, None], k))
  pool_tok, pool_val = [tok_BK], [val_BK]
  pool_par = [jnp.full((b, k), -1, jnp.int32)]
  # The frontier: nodes fed to the draft at this depth, with their pool index, value, token,
  # parent's predicted feature and the scratch slots of their ancestors.
  front_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
  front_val, front_tok = val_BK, tok_BK
  front_feat = jnp.broadcast_to(h_root_BD[:, None], (b, k, h_root_BD.shape[-1]))
  front_vis = jnp.zeros((b, k, scratch), bool)
  offset = k
  for d in range(1, depth):
    own = jnp.arange(scratch)[None, :] == ((d - 1) * k + jnp.arange(k))[:, None]
    vis_BKR = front_vis | own
    h_BKD, dcache = draft(front_feat, target.embed_tokens(front_tok),
                          positions_BT=jnp.broadcast_to(start_B[:, None] + d - 1, (b, k)),
                          cache=dcache, slots_BT=start_B[:, None] + (d - 1) * k + jnp.arange(k),
                          mask_BTS=tree_lib.slot_mask(vis_BKR, start_B, s))
    cval_BKK, ctok_BKK = _draft_top_k(target, head, h_BKD, k)
    cval_BKK = front_val[..., None] + cval_BKK
    pool_tok.append(ctok_BKK.reshape(b, k * k))
    pool_val.append(cval_BKK.reshape(b, k * k))
    pool_par.append(jnp.repeat(front_idx, k, axis=1))
    if d < depth - 1:
      front_val, pick_BK = jax.lax.top_k(cval_BKK.reshape(b, k * k), k)
      parent_BK = pick_BK // k
      front_idx = offset + pick_BK
      front_tok = jnp.take_along_axis(ctok_BKK.reshape(b, k * k), pick_BK, axis=1)
      front_feat = jnp.take_along_axis(h_BKD, parent_BK[..., None], axis=1)
      front_vis = jnp.take_along_axis(vis_BKR, parent_BK[..., None], axis=1)
    offset += k * k
  tree = tree_lib.select_tree(root_B, jnp.concatenate(pool_tok, 1), jnp.concatenate(pool_val, 1),
                              jnp.concatenate(pool_par, 1), shape)
  return tree, dcache


def commit_path(cache: KVCache, start_B, path_BJ, accepted_B, offsets_BN=None) -> KVCache:
  """Moves the accepted nodes' keys, values and positions (slots start + offsets[path[j]],
  default offsets arange(N)) to slots start + j, j <= accepted, in every layer; empties
  every later slot."""
  s = cache.max_len
  j = jnp.arange(path_BJ.shape[1], dtype=jnp.int32)
  if offsets_BN is not None:
    path_BJ = jnp.take_along_axis(offsets_BN, path_BJ, axis=1)
  src_BJ = start_B[:, None] + path_BJ
  dst_BJ = jnp.where(j[None] <= accepted_B[:, None], start_B[:, None] + j[None], s)
  gather = jax.vmap(lambda buf, idx: jnp.take(buf, idx, axis=0, mode="clip"))
  move = lambda buf: write_slots(buf, dst_BJ, gather(buf, src_BJ))
  length_B = start_B + accepted_B + 1
  pos_BS = move(cache.pos)
  pos_BS = jnp.where(jnp.arange(s)[None] < length_B[:, None], pos_BS, SENTINEL_POS)
  return KVCache(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v),
                 pos=pos_BS, length=length_B)


def _truncate(cache: KVCache, length_B) -> KVCache:
  """Empties the slots from `length` on (the draft's scratch) and sets the length."""
  keep = jnp.arange(cache.max_len)[None] < length_B[:, None]
  return dataclasses.replace(cache, pos=jnp.where(keep, cache.pos, SENTINEL_POS),
                             length=length_B)


def _target_probs(logits_BNV, sampling):
  if sampling is None:
    return jax.nn.one_hot(jnp.argmax(logits_BNV, axis=-1), logits_BNV.shape[-1])
  return jax.nn.softmax(filtered_logits(logits_BNV, *sampling), axis=-1)


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "max_len"))
def prefill(tgraph, tstate, dgraph, dstate, tokens_BT, lengths_B, key, sampling, *, max_len):
  """Target and draft caches after the prompts, the first new token (the first root) and
  the draft's predicted feature for it."""
  target, draft = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
  b, t = tokens_BT.shape
  tcache = target.init_cache(b, max_len)
  h_BTD, tcache, *taps = target.hidden(target.embed_tokens(tokens_BT), cache=tcache,
                                       lengths_B=lengths_B, taps=draft.taps, fresh_cache=True)
  last_B11 = (lengths_B - 1)[:, None, None]
  key, sub = jax.random.split(key)
  root_B = _sample(target.logits(jnp.take_along_axis(h_BTD, last_B11, axis=1))[:, 0], sub,
                   sampling)
  # Pairs (f_i, x_{i+1}) for i < length; x_length is the root.
  arange_T = jnp.arange(t, dtype=jnp.int32)
  next_BT = jnp.concatenate([tokens_BT[:, 1:], tokens_BT[:, :1]], axis=1)
  next_BT = jnp.where(arange_T[None] == lengths_B[:, None] - 1, root_B[:, None], next_BT)
  positions_BT = jnp.broadcast_to(arange_T, (b, t))
  slots_BT = jnp.where(arange_T[None] < lengths_B[:, None], positions_BT, max_len)
  hd_BTD, dcache = draft(h_BTD, target.embed_tokens(next_BT), positions_BT=positions_BT,
                         cache=draft.init_cache(b, max_len), slots_BT=slots_BT,
                         taps_BTK=taps[0] if taps else None)
  dcache = dataclasses.replace(dcache, length=lengths_B.astype(jnp.int32))
  h_root_BD = jnp.take_along_axis(hd_BTD, last_B11, axis=1)[:, 0]
  return root_B, h_root_BD, tcache, dcache, key


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "shape", "n_new"))
def decode(tgraph, tstate, dgraph, dstate, root_B, h_root_BD, tcache, dcache, key, sampling,
           stop_tokens, head, *, shape: TreeShape, n_new: int):
  """Rounds until every row has n_new tokens or a stop token. Returns (tokens [B, n_new + J],
  tokens per row [B], rounds per row [B], accepted drafted tokens per row [B], loop rounds,
  the accepted drafted tokens of each round [B, n_new] (-1 where the row was not decoding:
  a round yields at least one token, so at most n_new - 1 rounds run))."""
  target, draft = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
  b = root_B.shape[0]
  s = tcache.max_len
  j_J = jnp.arange(shape.depth + 1, dtype=jnp.int32)
  is_stop = lambda t: jnp.any(t[..., None] == stop_tokens, axis=-1)
  out_BX = jnp.zeros((b, n_new + shape.depth + 1), jnp.int32).at[:, 0].set(root_B)
  zeros_B = jnp.zeros((b,), jnp.int32)

  def cond(c):
    return (c["i"] < n_new) & ~jnp.all(c["done"])

  def body(c):
    tcache, dcache, root_B, start_B = c["tcache"], c["dcache"], c["root"], c["tcache"].length
    (tokens_BN, parents_BN, depths_BN), dcache = draft_tree(
        target, draft, dcache, c["h_root"], root_B, start_B, shape, head)
    visible_BNN = tree_lib.ancestors(parents_BN, shape.depth)
    offsets_BN = tree_lib.node_slots(depths_BN)
    h_BND, tcache, *taps = target.hidden(
        target.embed_tokens(tokens_BN), positions_BT=start_B[:, None] + depths_BN,
        cache=tcache, slots_BT=start_B[:, None] + offsets_BN, taps=draft.taps,
        mask_BTS=tree_lib.slot_mask(visible_BNN, start_B, s, offsets_BN))
    key, sub = jax.random.split(c["key"])
    path_BJ, acc_B, bonus_B = accept_lib.accept_tree(
        _target_probs(target.logits(h_BND), sampling), tokens_BN,
        tree_lib.children(parents_BN, shape.top_k), sub, depth=shape.depth,
        greedy=sampling is None)
    tcache = commit_path(tcache, start_B, path_BJ, acc_B, offsets_BN)
    # New tokens of the round: the accepted path after the root, then the bonus. They are
    # also the draft's next tokens for the pairs (target feature along the path, next token).
    path_tok_BJ = jnp.take_along_axis(tokens_BN, path_BJ, axis=1)
    new_BJ = jnp.where(j_J[None] < acc_B[:, None], jnp.roll(path_tok_BJ, -1, axis=1),
                       bonus_B[:, None])
    valid_BJ = j_J[None] <= acc_B[:, None]
    dcache = _truncate(dcache, start_B)
    along = lambda x: jnp.take_along_axis(x, path_BJ[..., None], axis=1)
    hd_BJD, dcache = draft(along(h_BND), target.embed_tokens(new_BJ),
                           positions_BT=start_B[:, None] + j_J, cache=dcache,
                           slots_BT=jnp.where(valid_BJ, start_B[:, None] + j_J, s),
                           taps_BTK=along(taps[0]) if taps else None)
    dcache = dataclasses.replace(dcache, length=start_B + acc_B + 1)
    h_root_BD = jnp.take_along_axis(hd_BJD, acc_B[:, None, None], axis=1)[:, 0]
    active_B = ~c["done"]
    out_BX = write_slots(c["out"], jnp.where(valid_BJ, c["n_out"][:, None] + j_J, 10 ** 9),
                         new_BJ)
    n_out_B = c["n_out"] + acc_B + 1
    done_B = c["done"] | (n_out_B >= n_new) | jnp.any(is_stop(new_BJ) & valid_BJ, axis=1)
    log_BR = jax.lax.dynamic_update_slice(
        c["log"], jnp.where(active_B, acc_B, -1)[:, None], (0, c["i"]))
    return dict(i=c["i"] + 1, tcache=tcache, dcache=dcache, root=bonus_B, h_root=h_root_BD,
                out=out_BX, n_out=n_out_B, done=done_B, key=key,
                rounds=c["rounds"] + active_B,
                accepted=c["accepted"] + jnp.where(active_B, acc_B, 0), log=log_BR)

  carry = dict(i=jnp.int32(0), tcache=tcache, dcache=dcache, root=root_B, h_root=h_root_BD,
               out=out_BX, n_out=jnp.ones((b,), jnp.int32),
               done=is_stop(root_B) | (n_new <= 1), key=key, rounds=zeros_B, accepted=zeros_B,
               log=jnp.full((b, n_new), -1, jnp.int32))
  c = jax.lax.while_loop(cond, body, carry)
  return c["out"], c["n_out"], c["rounds"], c["accepted"], c["i"], c["log"]


@dataclasses.dataclass
class SpecResult:
  """Tokens per prompt (as `llm.generate.generate` returns them) and per-row counts."""

  tokens: list[list[int]]
  rounds: np.ndarray          # [B] draft-verify rounds while the row was decoding
  accepted: np.ndarray        # [B] drafted tokens accepted over those rounds
  loop_rounds: int            # rounds the batch ran (the slowest row's)
  accepted_per_round: list[list[int]]  # per row, the drafted tokens accepted in each round

  @property
  def accept_length(self) -> float:
    """Mean tokens per round per row (accepted drafted tokens + the bonus; EAGLE's tau)."""
    return float((self.accepted.sum() + self.rounds.sum()) / max(self.rounds.sum(), 1))

  @property
  def tokens_per_call(self) -> float:
    """New tokens per target forward call (the prefill and each round), pooled over the rows
    as `accept_length` is (a mean of per-row ratios weighed a row of a few rounds like a
    long one, and could exceed tau)."""
    calls = len(self.tokens) + int(self.rounds.sum())
    return float(sum(len(t) for t in self.tokens) / max(calls, 1))


def speculative_generate(target: Llama, draft: DraftHead, prompts: list[list[int]],
                         max_new_tokens: int, *, shape: TreeShape, temperature: float = 0.0,
                         top_k: int = 0, top_p: float = 1.0, stop_tokens=(),
                         rng: jax.Array | None = None, max_len: int | None = None,
                         draft_vocab=None) -> SpecResult:
  """`llm.generate.generate`'s contract (same tokens for greedy, same distribution when
  sampling), decoded by draft trees of `shape`. max_len: cache slots (default
  `cache_slots(longest prompt, max_new_tokens, shape)`). draft_vocab: token ids [Vd] the
  draft proposes from (`distill.draft_vocab`; default: the whole vocabulary); the target
  still scores every token, so the output's contract is unchanged. "Same tokens" holds bit
  for bit on XLA:CPU with a bfloat16 target: a verified node computes the logits of the
  plain step at its position (the prefill attends within the prompt, decode attention sums
  in matrix products whose partial sums the tree's slot layout respects, norms sum in one
  fixed order: `Llama.hidden`'s fresh_cache, llm/attention/decode.py, `tree.node_slots`,
  `model.sum_last`). A float32 plain step's one-row products run another routine than the
  tree's rows, so there the logits agree to about 1e-6 and greedy rows part only at ties
  that close (none in BENCHMARKS.md's runs)."""
  cfg = target.cfg
  stop = gen_lib.check_request(cfg, prompts, max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, rng=rng,
                               where="speculative_generate")
  if draft.cfg.dim != cfg.dim or draft.cfg.vocab_size != cfg.vocab_size:
    raise ValueError(f"speculative_generate: draft head for dim {draft.cfg.dim}, vocab "
                     f"{draft.cfg.vocab_size}; the target has dim {cfg.dim}, vocab "
                     f"{cfg.vocab_size}")
  if draft_vocab is not None:
    ids = np.asarray(draft_vocab)
    if (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or len(ids) < shape.top_k
        or ids.min() < 0 or ids.max() >= cfg.vocab_size or len(np.unique(ids)) != len(ids)):
      raise ValueError(f"speculative_generate: draft_vocab of shape {ids.shape}, dtype "
                       f"{ids.dtype}; expected at least top_k={shape.top_k} distinct integer "
                       f"ids in [0, {cfg.vocab_size})")
  zeros = np.zeros((len(prompts),), np.int64)
  if max_new_tokens == 0:
    return SpecResult([[] for _ in prompts], zeros, zeros, 0, [[] for _ in prompts])
  tokens_BT, lengths = gen_lib.pad_prompts(prompts)
  t = tokens_BT.shape[1]
  need = cache_slots(t, max_new_tokens, shape)
  max_len = need if max_len is None else int(max_len)
  if max_len < need:
    raise ValueError(f"speculative_generate: max_len={max_len} slots; a {t}-token prompt, "
                     f"{max_new_tokens} new tokens and tree {shape} need {need}")
  tgraph, tstate = nnx.split(target)
  dgraph, dstate = nnx.split(draft)
  sampling = gen_lib.sampling_settings(temperature, top_k, top_p)
  key = jax.random.key(0) if rng is None else rng
  root, h_root, tcache, dcache, key = prefill(tgraph, tstate, dgraph, dstate,
                                              jnp.asarray(tokens_BT), jnp.asarray(lengths), key,
                                              sampling, max_len=max_len)
  out, n_out, rounds, accepted, loop_rounds, log = decode(
      tgraph, tstate, dgraph, dstate, root, h_root, tcache, dcache, key, sampling,
      gen_lib.stop_array(stop), vocab_head(target, draft_vocab, draft.cfg.dtype), shape=shape,
      n_new=max_new_tokens)
  result = gen_lib.cut_rows(np.asarray(out), np.minimum(np.asarray(n_out), max_new_tokens),
                            stop)
  per_round = [[a for a in row if a >= 0] for row in np.asarray(log).tolist()]
  return SpecResult(result, np.asarray(rounds), np.asarray(accepted), int(loop_rounds), per_round)
