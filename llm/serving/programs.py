"""The serving engine's compiled programs (`llm.serving.engine` schedules them): a step of
decode rows and / or prefill chunks over the paged KV cache (`engine_step`, `run_step`:
each group of rows attends over its own pages, the decode rows and a chunk flattened into
one forward pass in a mixed step), an EAGLE round of every running request inside the batch
(`spec_step`: each request drafts its tree, one target pass verifies them all, only the
accepted path's keys and values are committed), per-row sampling, the draft head's dense
per-slot cache, and `load_draft` (a --draft setting -> the head).

Letters as in llm/serving/engine.py: B (or W) decode rows, R prefill rows, C prefill chunk,
M pages per row, V vocab, N tree nodes, J = depth + 1 path slots, S engine slots, D model dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm.generate import filtered_logits
from llm.model import SENTINEL_POS, KVCache
from llm.serving.paged import PagedCache, PagedGroups, PagedLayer, commit_pages, flat_slots
from llm.speculative import accept as accept_lib
from llm.speculative import decode as spec_decode
from llm.speculative import tree as tree_lib


def _sample_rows(logits_BV, temperature_B, top_k_B, top_p_B, seed_B, counter_B):
  """Per-row sampling with per-row keys fold_in(key(seed), counter); greedy at temperature 0."""
  greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  filt = filtered_logits(logits_BV, temperature_B, top_k_B, top_p_B)
  keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed_B, counter_B)
  sampled = jax.vmap(jax.random.categorical)(keys, filt).astype(jnp.int32)
  return jnp.where(temperature_B > 0, sampled, greedy)


def _group_inputs(tokens_BT, start_B, n_valid_B):
  """(positions_BT, valid_BT) of a group's tokens: row b feeds n_valid_B[b] tokens from
  position start_B[b]."""
  arange_T = jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)
  return start_B[:, None] + arange_T, arange_T < n_valid_B[:, None]


def _forward(model, cache: PagedCache, tokens, positions, layer_of, *, impl: str,
             taps: tuple[int, ...] = ()):
  """The model's blocks over the pages: (final-norm states like tokens + [D], the call's keys
  and values per layer, the residual stream after the `taps` blocks, concatenated, or
  None). layer_of(k_pages, v_pages) builds the layer's `PagedLayer` / `PagedGroups`."""
  x = model.embed_tokens(tokens)
  new_k, new_v, tapped = [], [], []
  for i, block in enumerate(model.layers):
    x, layer = block(x, positions, None, kv=layer_of(cache.k[i], cache.v[i]))
    new_k.append(layer.new_k)
    new_v.append(layer.new_v)
    if i in taps:
      tapped.append(x)
  return (model.final_norm(x), tuple(new_k), tuple(new_v),
          jnp.concatenate(tapped, axis=-1) if tapped else None)


def _step(graphdef, state, cache: PagedCache, groups, sampling, draft=None, *, impl: str,
          sample: bool, with_logits: bool):
  """One forward pass over one or more groups of rows (`groups`: (tokens_BT, start_B,
  n_valid_B, tables_BM) each; several: a mixed batch, `PagedGroups`): row b of a group
  feeds n_valid_B[b] tokens at positions start_B[b].., and one token is sampled from each
  row's last fed token (rows of all groups in order; `sampling` per row). Returns ((the
  call's keys and values per layer, their slots), tokens [rows], logits [rows, V] or None,
  draft state or None); `commit_pages` writes the keys and values. Rows with n_valid 0
  change nothing.

  draft: with a speculative engine, (draft graphdef, draft state, draft cache, h_root [S, D],
  and for the last group: slot_B (its rows' draft-cache rows; S: none), next_B (the token
  after each row's chunk, when the chunk does not end the request's known tokens)); the
  draft head then reads the pairs (feature, next token) of the last group's tokens (a
  prompt chunk) and the draft state comes back updated (`_draft_pairs`)."""
  model = nnx.merge(graphdef, state)
  cfg = model.cfg
  layouts = []
  for tokens_BT, start_B, n_valid_B, tables_BM in groups:
    positions_BT, valid_BT = _group_inputs(tokens_BT, start_B, n_valid_B)
    slots_BT = flat_slots(tables_BM, positions_BT, valid_BT, cache.block_size,
                          cache.num_blocks)
    layouts.append((positions_BT, slots_BT, start_B + n_valid_B, tables_BM))

  def layer_of(k_pages, v_pages):
    layers = tuple(PagedLayer(k_pages, v_pages, tables, lengths, slots, impl, cfg.dtype)
                   for _, slots, lengths, tables in layouts)
    return layers[0] if len(layers) == 1 else PagedGroups(layers)

  taps = () if draft is None else nnx.merge(draft[0], draft[1]).taps
  if len(groups) == 1:
    tokens, positions, slots = groups[0][0], layouts[0][0], layouts[0][1]
  else:
    flat = lambda xs: jnp.concatenate([x.reshape(1, -1) for x in xs], axis=1)  # noqa: E731
    tokens = flat([g[0] for g in groups])
    positions, slots = flat([l[0] for l in layouts]), flat([l[1] for l in layouts])
  h, new_k, new_v, tapped = _forward(model, cache, tokens, positions, layer_of, impl=impl,
                                     taps=taps)
  # Each row's last fed token, as an index into the flattened tokens.
  last, at = [], 0
  for tokens_BT, _, n_valid_B, _ in groups:
    b, t = tokens_BT.shape
    last.append(at + t * jnp.arange(b, dtype=jnp.int32) + jnp.maximum(n_valid_B - 1, 0))
    at += b * t
  h_ND = h.reshape(-1, h.shape[-1])
  # Logits group by group: each group's rows through the LM head as in a step of its own
  # (XLA:CPU's product of one row takes another routine than that of several).
  logits_BV = jnp.concatenate([model.logits(h_ND[i][:, None])[:, 0] for i in last])
  if sample:
    tok_B = _sample_rows(logits_BV, *sampling)
  else:
    tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  new_draft = None
  if draft is not None:
    tokens_BT, start_B, n_valid_B, _ = groups[-1]
    b, t = tokens_BT.shape
    h_BTD = h_ND[at - b * t:].reshape(b, t, -1)
    taps_BTK = None if tapped is None else tapped.reshape(-1, tapped.shape[-1])[at - b * t:]
    taps_BTK = None if taps_BTK is None else taps_BTK.reshape(b, t, -1)
    new_draft = _draft_pairs(model, draft, h_BTD, taps_BTK, tokens_BT, start_B, n_valid_B,
                             tok_B[-b:])
  return ((new_k, new_v, slots), tok_B, (logits_BV if with_logits else None), new_draft)


def _truncate(dcache: KVCache, length_B) -> KVCache:
  """The draft cache's rows with every slot from `length` on emptied."""
  keep = jnp.arange(dcache.max_len)[None] < length_B[:, None]
  return dataclasses.replace(dcache, pos=jnp.where(keep, dcache.pos, SENTINEL_POS),
                             length=length_B)


def _rows(dcache: KVCache, slot_B) -> KVCache:
  take = lambda x: jnp.take(x, slot_B, axis=0, mode="clip")  # noqa: E731
  return KVCache(k=tuple(map(take, dcache.k)), v=tuple(map(take, dcache.v)),
                 pos=take(dcache.pos), length=take(dcache.length))


def _put_rows(dcache: KVCache, slot_B, rows: KVCache) -> KVCache:
  put = lambda full, x: full.at[slot_B].set(x, mode="drop")  # noqa: E731
  return KVCache(k=tuple(map(put, dcache.k, rows.k)), v=tuple(map(put, dcache.v, rows.v)),
                 pos=put(dcache.pos, rows.pos), length=put(dcache.length, rows.length))


def _draft_pairs(target, draft, h_BTD, taps_BTK, tokens_BT, start_B, n_valid_B, sampled_B):
  """The draft head reads pairs (f_i, x_{i+1}) of a prompt chunk into its cache rows: x_{i+1}
  is the chunk's next token, after its last one the given next token or, where the chunk
  ends the request's known tokens, the token just sampled (the first root). Returns the
  draft state with those rows updated and their predicted feature for the root."""
  dgraph, dstate, dcache, h_root_SD, slot_B, next_B = draft
  head = nnx.merge(dgraph, dstate)
  b, t = tokens_BT.shape
  arange_T = jnp.arange(t, dtype=jnp.int32)
  last_B = jnp.maximum(n_valid_B - 1, 0)
  follow_B = jnp.where(next_B >= 0, next_B, sampled_B)
  next_BT = jnp.concatenate([tokens_BT[:, 1:], tokens_BT[:, :1]], axis=1)
  next_BT = jnp.where(arange_T[None] == last_B[:, None], follow_B[:, None], next_BT)
  positions_BT = start_B[:, None] + arange_T
  rows = _truncate(_rows(dcache, slot_B), start_B)
  slots_BT = jnp.where(arange_T[None] < n_valid_B[:, None], positions_BT, rows.max_len)
  hd_BTD, rows = head(h_BTD, target.embed_tokens(next_BT), positions_BT=positions_BT,
                      cache=rows, slots_BT=slots_BT, taps_BTK=taps_BTK)
  rows = dataclasses.replace(rows, length=start_B + n_valid_B)
  h_root_BD = jnp.take_along_axis(hd_BTD, last_B[:, None, None], axis=1)[:, 0]
  return (_put_rows(dcache, slot_B, rows),
          h_root_SD.at[slot_B].set(h_root_BD.astype(h_root_SD.dtype), mode="drop"))


def _spec_step(graphdef, state, dgraph, dstate, cache: PagedCache, dcache: KVCache, h_root_SD,
               slot_W, root_W, start_W, limit_W, tables_WM, head, *, impl: str,
               shape: tree_lib.TreeShape, with_logits: bool):
  """One EAGLE round for W rows (greedy; `llm.speculative.decode`'s round over the paged
  cache): each row drafts its tree from its root (the last sampled token, at position
  start_W, not yet in the cache) with the draft head's cache rows slot_W (S: an idle row),
  the target verifies every tree in one pass (the cached pages, then the tree's own keys
  under its ancestor mask), the longest agreeing path is accepted, and its keys and values
  go to slots start .. start + a (positions below limit_W, the row's pages; rejected nodes
  are never written); the draft head reads the a + 1 new pairs. Returns ((keys, values
  per layer, their slots) for `commit_pages`, new tokens [W, depth + 1] (the accepted
  drafts, then the bonus), accepted [W], logits of the new tokens [W, depth + 1, V] or
  None, (draft cache, h_root))."""
  model, draft = nnx.merge(graphdef, state), nnx.merge(dgraph, dstate)
  cfg = model.cfg
  w = root_W.shape[0]
  n = shape.nodes
  active_W = slot_W < dcache.k[0].shape[0]
  rows = _truncate(_rows(dcache, slot_W), start_W)
  h_root_WD = jnp.take(h_root_SD, slot_W, axis=0, mode="clip")
  (tokens_WN, parents_WN, depths_WN), rows = spec_decode.draft_tree(
      model, draft, rows, h_root_WD, root_W, start_W, shape, head)
  visible_WNN = tree_lib.ancestors(parents_WN, shape.depth)
  positions_WN = start_W[:, None] + depths_WN
  valid_WN = jnp.broadcast_to(active_W[:, None], (w, n))
  n_slots = cache.num_blocks * cache.block_size
  # Where the call's keys would go: only which are valid matters to attention.
  slots_WN = jnp.where(valid_WN, 0, n_slots)

  def layer_of(k_pages, v_pages):
    return PagedLayer(k_pages, v_pages, tables_WM, start_W + n * active_W, slots_WN, impl,
                      cfg.dtype, own_mask_BTT=visible_WNN)

  h_WND, new_k, new_v, tapped = _forward(model, cache, tokens_WN, positions_WN, layer_of,
                                         impl=impl, taps=draft.taps)
  logits_WNV = model.logits(h_WND)
  probs_WNV = jax.nn.one_hot(jnp.argmax(logits_WNV, axis=-1), logits_WNV.shape[-1])
  path_WJ, acc_W, bonus_W = accept_lib.accept_tree(
      probs_WNV, tokens_WN, tree_lib.children(parents_WN, shape.top_k), jax.random.key(0),
      depth=shape.depth, greedy=True)
  j_J = jnp.arange(shape.depth + 1, dtype=jnp.int32)
  kept_WJ = (j_J[None] <= acc_W[:, None]) & active_W[:, None]
  # Node path[j] goes to position start + j (kept, and within the row's pages).
  pos_WJ = start_W[:, None] + j_J[None]
  write_WJ = kept_WJ & (pos_WJ < limit_W[:, None])
  dst_WJ = flat_slots(tables_WM, pos_WJ, write_WJ, cache.block_size, cache.num_blocks)
  node_WJ = jnp.where(kept_WJ, path_WJ, n)
  slots_WN = jax.vmap(lambda d, i: jnp.full((n,), n_slots, jnp.int32).at[i].set(
      d, mode="drop"))(dst_WJ, node_WJ)
  path_tok_WJ = jnp.take_along_axis(tokens_WN, path_WJ, axis=1)
  new_WJ = jnp.where(j_J[None] < acc_W[:, None], jnp.roll(path_tok_WJ, -1, axis=1),
                     bonus_W[:, None])
  along = lambda x: jnp.take_along_axis(x, path_WJ[..., None], axis=1)  # noqa: E731
  rows = _truncate(rows, start_W)
  hd_WJD, rows = draft(along(h_WND), model.embed_tokens(new_WJ), positions_BT=pos_WJ,
                       cache=rows, slots_BT=jnp.where(kept_WJ, pos_WJ, rows.max_len),
                       taps_BTK=None if tapped is None else along(tapped))
  rows = dataclasses.replace(rows, length=start_W + acc_W + 1)
  h_root_new = jnp.take_along_axis(hd_WJD, acc_W[:, None, None], axis=1)[:, 0]
  draft_state = (_put_rows(dcache, slot_W, rows),
                 h_root_SD.at[slot_W].set(h_root_new.astype(h_root_SD.dtype), mode="drop"))
  logits = along(logits_WNV) if with_logits else None
  return (new_k, new_v, slots_WN), new_WJ, acc_W, logits, draft_state


# The step reads the pool only; `commit_pages` then writes it in place (llm/serving/paged.py:
# XLA:CPU copied every pool when one program both read and updated them).
engine_step = jax.jit(_step, static_argnames=("graphdef", "impl", "sample", "with_logits"))
spec_step = jax.jit(_spec_step, static_argnames=("graphdef", "dgraph", "impl", "shape",
                                                 "with_logits"))


def run_step(graphdef, state, cache, groups, sampling, draft=None, **kw):
  """One step and its commit: (cache after it, tokens, logits or None, draft state or
  None)."""
  (new_k, new_v, slots), tok, logits, new_draft = engine_step(graphdef, state, cache, groups,
                                                              sampling, draft, **kw)
  return commit_pages(cache, slots, new_k, new_v), tok, logits, new_draft


def load_draft(spec: str, target, decode_vocab: int = 0):
  """(draft head, draft vocabulary ids or None) of a --draft setting for `target`, the head in
  the target's compute dtype: "" (None, None), "random" (an untrained head over the whole
  vocabulary, or the first `decode_vocab` ids) or a draft-head training run's workdir (its
  head, and the `decode_vocab` most frequent tokens of its training sequences: 0, the draft
  vocabulary it trained with; `llm.speculative.distill.load_draft_vocab`)."""
  if not spec:
    if decode_vocab:
      raise ValueError(f"decode_vocab={decode_vocab} without a draft head (draft='')")
    return None, None
  from llm.speculative import DraftHead, cast_head
  if spec == "random":
    if decode_vocab > target.cfg.vocab_size:
      raise ValueError(f"decode_vocab={decode_vocab}: more ids than the target's vocabulary "
                       f"of {target.cfg.vocab_size}; expected at most {target.cfg.vocab_size}")
    head = DraftHead(target.cfg, nnx.Rngs(0))
    vocab = np.arange(decode_vocab, dtype=np.int32) if decode_vocab else None
  else:
    from llm.speculative.distill import load_draft as load, load_draft_vocab
    head = load(spec, target.cfg, where="--draft")
    vocab = load_draft_vocab(spec, target.cfg.vocab_size, decode_vocab, where="--draft",
                             size_flag="--decode_vocab")
  return cast_head(head, target.cfg.dtype), vocab
