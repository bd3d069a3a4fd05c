"""Autoregressive generation for the Llama decoder: jitted prefill, then a jitted decode loop.

Prompts of different lengths share one batch: they are right-padded, the prefill writes only
each row's real tokens into the KV cache (`Llama.hidden(..., lengths_B=...)`), and every
decode step writes one token per row at that row's own next slot. Decoding runs inside one
`jax.lax.while_loop` with static shapes, so it compiles once per (batch, cache size,
max_new_tokens, greedy or not, number of stop tokens): the sampling settings and the stop ids
are traced values. The prefill compiles once per padded prompt length. The loop stops early
when every row has emitted a stop token.

Context parallelism (arXiv 2411.01783): give `generate(..., mesh=mesh)` (or call it under
`jax.set_mesh(mesh)`) a mesh with a `cp` axis of N > 1 ranks and a model whose
cfg.context_parallel is "pass_kv" | "pass_q" | "auto". The model then runs CP by itself
(llm/model.py): the prompts, padded to a multiple of 2N, are prefilled in the
load-balanced layout with that variant, the cache's slots are split over cp,
and every decode step (one query token per row) attends with replicated queries against
each rank's KV shard, merged exactly (pass-Q's route for T < N), its KV placed round robin.
Greedy tokens equal those without CP. `prefill` / `decode` below need no change for it.

Requests are checked, padded and cut at stop ids by `check_request`, `pad_prompts` and
`cut_rows`, which `llm.speculative.speculative_generate` uses too, so both take the same
requests, refuse the same ones with the same messages and return rows the same way.

Sampling (`sample_logits`): greedy at temperature 0, else softmax(logits / temperature)
restricted to the top_k tokens and to the smallest set whose probability reaches top_p
(nucleus sampling, arXiv 1904.09751), with an explicit PRNG key.

Letters: B batch, T prompt length (padded), N new tokens, V vocab.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm.model import Llama, cp_ranks


def sample_logits(logits, key, temperature=0.0, top_k=0, top_p=1.0) -> jax.Array:
  """Samples token ids [...] from logits [..., V]; a pure function.

  temperature, top_k and top_p are scalars or per-row arrays [...], and may be traced (one
  compiled program serves every setting). Rows with temperature 0 take the argmax. Otherwise
  the distribution is softmax(logits / temperature), restricted to the top_k tokens (0: all)
  and then to the nucleus: tokens in decreasing probability (renormalized over the top_k)
  while the probability before each is < top_p (top_p = 1: all of them); the most likely
  token is always kept, and tokens tied with the last kept logit are kept too.
  """
  logits = jnp.asarray(logits, jnp.float32)
  for name, x, ok in (("temperature", temperature, lambda x: x >= 0),
                      ("top_k", top_k, lambda x: x >= 0),
                      ("top_p", top_p, lambda x: 0 < x <= 1)):
    if isinstance(x, (int, float)) and not ok(x):
      raise ValueError(f"sample_logits: {name}={x}; expected temperature >= 0, top_k >= 0 "
                       "and 0 < top_p <= 1")
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if isinstance(temperature, (int, float)) and temperature == 0:
    return greedy            # static shortcut: no sort
  t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:-1])
  sampled = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p),
                                   axis=-1)
  return jnp.where(t > 0, sampled.astype(jnp.int32), greedy)


def filtered_logits(logits, temperature, top_k=0, top_p=1.0) -> jax.Array:
  """The logits `sample_logits` draws from at temperature > 0: logits / temperature, -inf
  outside the top_k and the nucleus; their softmax is the sampling distribution (exact
  rejection sampling in `llm.speculative` needs it). Rows with temperature 0 are not
  scaled (`sample_logits` takes their argmax instead)."""
  logits = jnp.asarray(logits, jnp.float32)
  v = logits.shape[-1]
  batch = logits.shape[:-1]
  t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch)[..., None]
  k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), batch)[..., None]
  p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), batch)[..., None]
  scaled = logits / jnp.where(t > 0, t, 1.0)

  def restricted(scaled):
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    in_top_k = jnp.arange(v) < jnp.where((k > 0) & (k < v), k, v)
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p = 1 cuts nothing (transformers adds no TopPLogitsWarper then): the float32 mass
    # before a tail token rounds to 1.0 once the head holds all but ~6e-8 of it, so `< p`
    # alone would cut a confident row's tail whenever any row of the batch takes this branch.
    in_nucleus = (mass_before < p) | (p >= 1.0)
    n_keep = jnp.maximum(jnp.sum(in_top_k & in_nucleus, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    return jnp.where(scaled < threshold, -jnp.inf, scaled)

  # Without top-k / top-p nothing is cut: skip the sort over the vocabulary, most of a
  # sampled step's cost at batch 32 on CPU (the settings are traced, hence a cond).
  unrestricted = jnp.all(((k <= 0) | (k >= v)) & (p >= 1.0))
  return jax.lax.cond(unrestricted, lambda s: s, restricted, scaled)


def _sample(logits, key, sampling):
  # sampling = None (greedy, static) or a (temperature, top_k, top_p) tuple of arrays.
  return sample_logits(logits, key) if sampling is None else sample_logits(logits, key, *sampling)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "with_hidden", "rolling"))
def prefill(graphdef, state, tokens_BT, lengths_B, key, sampling, *, max_len,
            with_hidden=False, rolling=False):
  """Writes the prompts into a fresh cache (`rolling`: a rolling one, `KVCache`); samples
  each row's first new token. with_hidden: also returns the final hidden states [B,T,D] of
  the prompt tokens."""
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(tokens_BT.shape[0], max_len, rolling)
  h_BTD, cache = model.hidden(model.embed_tokens(tokens_BT), cache=cache, lengths_B=lengths_B,
                              fresh_cache=True)
  # Only the last real token of each row needs logits (a [B,T,V] tensor can be huge).
  h_last_B1D = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)
  key, sub = jax.random.split(key)
  tok_B = _sample(model.logits(h_last_B1D)[:, 0], sub, sampling)
  if with_hidden:
    return tok_B, cache, key, h_BTD
  return tok_B, cache, key


@functools.partial(jax.jit, static_argnames=("graphdef", "n_new", "with_hidden"))
def decode(graphdef, state, cache, tok_B, key, sampling, stop_tokens, *, n_new,
           with_hidden=False):
  """Feeds each sampled token back until n_new tokens per row or every row has stopped.

  with_hidden: also returns hidden [B, n_new, D], the final hidden state of each new token
  (new token j is fed at step j + 1). The loop then runs until every new token a row keeps
  has been fed: one step past the n_new-th token or the last row's stop token (that step's
  sample is dropped; the cache needs one slot more)."""
  model = nnx.merge(graphdef, state)
  is_stop = lambda t: jnp.any(t[:, None] == stop_tokens[None, :], axis=-1)
  b = tok_B.shape[0]
  n_out = n_new + 1 if with_hidden else n_new
  out_BN = jnp.zeros((b, n_out), jnp.int32).at[:, 0].set(tok_B)
  hid_BND = jnp.zeros((b, n_out if with_hidden else 0, model.cfg.dim), jnp.float32)

  def cond(carry):
    i, _, _, _, done_B, fed_done_B, _, _ = carry
    # fed_done: rows whose stop token has been fed too (with_hidden) or sampled.
    return (i < n_out) & ~jnp.all(fed_done_B if with_hidden else done_B)

  def body(carry):
    i, cache, tok_B, out_BN, done_B, _, hid_BND, key = carry
    h_B1D, cache = model.hidden(model.embed_tokens(tok_B[:, None]), cache=cache)
    if with_hidden:
      hid_BND = jax.lax.dynamic_update_slice(hid_BND, h_B1D.astype(jnp.float32), (0, i - 1, 0))
    key, sub = jax.random.split(key)
    new_B = _sample(model.logits(h_B1D)[:, 0], sub, sampling)
    out_BN = jax.lax.dynamic_update_slice(out_BN, new_B[:, None], (0, i))
    return i + 1, cache, new_B, out_BN, done_B | is_stop(new_B), done_B, hid_BND, key

  first_done = is_stop(tok_B)
  carry = (jnp.int32(1), cache, tok_B, out_BN, first_done, jnp.zeros_like(first_done), hid_BND,
           key)
  n_done, _, _, out_BN, _, _, hid_BND, _ = jax.lax.while_loop(cond, body, carry)
  if with_hidden:
    return out_BN[:, :n_new], jnp.minimum(n_done, n_new), hid_BND[:, :n_new]
  return out_BN, n_done


def check_prompts(prompts, vocab_size: int, where: str) -> None:
  """At least one prompt, none empty, every id in [0, vocab_size); errors name `where`."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError(f"{where}: prompt lengths {[len(p) for p in prompts]}; expected at least "
                     "one prompt and no empty prompt")
  for i, p in enumerate(prompts):
    bad = [t for t in p if not 0 <= int(t) < vocab_size]
    if bad:
      raise ValueError(f"{where}: prompt {i} has token ids {bad[:5]} outside [0, {vocab_size})")


def check_request(cfg, prompts, max_new_tokens: int, *, temperature: float, top_k: int,
                  top_p: float, stop_tokens, rng, where: str) -> tuple[int, ...]:
  """Every check a generation request gets before anything is traced (`generate` and
  `llm.speculative.speculative_generate` share it): the prompts (`check_prompts`),
  max_new_tokens >= 0, prompt + new tokens within cfg.max_seq_len, the sampling settings,
  a key when sampling, stop ids in [0, vocab). Returns the stop ids as ints."""
  check_prompts(prompts, cfg.vocab_size, where)
  if max_new_tokens < 0:
    raise ValueError(f"{where}: max_new_tokens={max_new_tokens}, expected >= 0")
  longest = max(len(p) for p in prompts)
  if max_new_tokens > 0 and longest + max_new_tokens > cfg.max_seq_len:
    raise ValueError(
        f"{where}: the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} "
        f"makes {longest + max_new_tokens} tokens, beyond the model's max_seq_len="
        f"{cfg.max_seq_len} (positions it was trained or configured for); ask for at most "
        f"{max(cfg.max_seq_len - longest, 0)} new tokens")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
    raise ValueError(f"{where}: top_k={top_k!r}; expected an integer (0: no top-k), not "
                     "rounded down to one")
  if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
    raise ValueError(f"{where}: temperature={temperature}, top_k={top_k}, top_p={top_p}; "
                     "expected temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
  if temperature > 0 and rng is None:
    raise ValueError(f"{where}: temperature={temperature} samples; pass rng=jax.random.key(...)")
  stop = tuple(int(s) for s in stop_tokens)
  bad = [s for s in stop if not 0 <= s < cfg.vocab_size]
  if bad:
    raise ValueError(f"{where}: stop_tokens {bad} outside [0, {cfg.vocab_size}): the model "
                     "never emits them (a tokenizer of another vocabulary?)")
  return stop


def pad_prompts(prompts, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [B, T] int32, lengths [B] int32): the prompts right-padded with 0 to T = width
  (default: the longest prompt)."""
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  t = int(lengths.max()) if width is None else int(width)
  if t < lengths.max():
    raise ValueError(f"pad_prompts: width={t}, but the longest prompt has {lengths.max()} tokens")
  tokens_BT = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    tokens_BT[i, :len(p)] = p
  return tokens_BT, lengths


def sampling_settings(temperature: float, top_k: int, top_p: float):
  """What the jitted programs take: None (greedy, a static branch) or traced scalars, so that
  changing temperature, top_k or top_p does not recompile."""
  if temperature == 0:
    return None
  return jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)


def stop_array(stop: tuple[int, ...]) -> jax.Array:
  """Stop ids as a traced int32 vector (changing them does not recompile); -1 pads an empty
  list and matches no token."""
  return jnp.asarray(stop or (-1,), jnp.int32)


def cut_rows(rows_BN: np.ndarray, counts_B, stop: tuple[int, ...]) -> list[list[int]]:
  """Each row's first counts_B[b] tokens, ending at (and including) its first stop id."""
  stop = set(stop)
  out = []
  for row, n in zip(np.asarray(rows_BN).tolist(), np.broadcast_to(counts_B, len(rows_BN))):
    row = row[:int(n)]
    hit = next((j for j, tok in enumerate(row) if tok in stop), None)
    out.append(row if hit is None else row[:hit + 1])
  return out


def generate(model: Llama, prompts: list[list[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_tokens=(), rng: jax.Array | None = None,
             max_len: int | None = None, mesh: jax.sharding.Mesh | None = None
             ) -> list[list[int]]:
  """New tokens for each prompt: up to max_new_tokens, ending at (and including) the first
  stop token. Greedy when temperature == 0; sampling needs an explicit `rng` key. Prompt
  plus new tokens must fit in the model's cfg.max_seq_len.
  `max_len` is the cache size in slots (default: longest prompt + max_new_tokens; for a
  model with a sliding window W in every layer, W slots when that is fewer: a rolling
  cache, `KVCache`); giving a fixed one lets calls with different prompt lengths share the
  compiled decode loop.
  `mesh`: run under `jax.set_mesh(mesh)`. With N > 1 context-parallel ranks (module
  docstring) prompts are padded to T, a multiple of 2N, and the cache holds C slots per rank:
  by default C = T/N + ceil((max_new_tokens - 1) / N); a given max_len must be N * C or more
  with N dividing it."""
  stop = check_request(model.cfg, prompts, max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, rng=rng,
                       where="generate")
  if max_new_tokens == 0:
    return [[] for _ in prompts]
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    return _generate(model, prompts, max_new_tokens, temperature, top_k, top_p, stop, rng,
                     max_len)


def generate_with_hidden(model: Llama, prompts: list[list[int]], max_new_tokens: int, *,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         stop_tokens=(), rng: jax.Array | None = None,
                         max_len: int | None = None
                         ) -> tuple[list[list[int]], list[np.ndarray]]:
  """`generate`'s rows (the same tokens) and, per row, the model's final hidden states of
  the prompt and the new tokens, [len(prompt) + len(row), D] float32: what it computed while
  generating them (the prefill's for the prompt, each decode step's for the token it fed),
  so a caller needing them (draft-head distillation) runs no second forward pass. The
  cache needs one slot more than `generate`'s (default longest prompt + max_new_tokens + 1).
  One device, no context parallelism."""
  stop = check_request(model.cfg, prompts, max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, rng=rng,
                       where="generate_with_hidden")
  if cp_ranks(model.cfg) > 1:
    raise ValueError("generate_with_hidden: context-parallel models are not supported; use "
                     "generate")
  if max_new_tokens == 0:
    return [[] for _ in prompts], [np.zeros((0, model.cfg.dim), np.float32) for _ in prompts]
  return _generate(model, prompts, max_new_tokens, temperature, top_k, top_p, stop, rng,
                   max_len, with_hidden=True)


def _generate(model, prompts, max_new_tokens, temperature, top_k, top_p, stop, rng, max_len,
              with_hidden=False):
  t = max(len(p) for p in prompts)
  n = cp_ranks(model.cfg)
  rolling = False
  if with_hidden:
    # Every new token is fed back (its hidden state is wanted): t + max_new_tokens slots.
    need = t + max_new_tokens
    max_len = need if max_len is None else int(max_len)
    if max_len < need:
      raise ValueError(f"generate_with_hidden: max_len={max_len} slots, but the longest "
                       f"prompt ({t} tokens) plus {max_new_tokens} new tokens, each fed back, "
                       f"need {need}")
  elif n == 1:
    # The last new token is never fed back, so the cache needs t + max_new_tokens - 1 slots.
    need = t + max_new_tokens - 1
    w = model.cfg.sliding_window
    if max_len is None and w is not None and model.cfg.window_layers is None and need > w:
      rolling, max_len = True, w      # decode steps (1 token) need S >= W only
    max_len = t + max_new_tokens if max_len is None else int(max_len)
    if max_len < need and not rolling:
      raise ValueError(f"generate: max_len={max_len} slots, but the longest prompt ({t} "
                       f"tokens) plus {max_new_tokens} new tokens needs {need}")
  else:
    # Load-balanced prefill: T a multiple of 2N, T/N prompt slots on every rank; the decode
    # tokens fed back fill the ranks round robin (at most ceil(d / N) more on any rank).
    t = -(-t // (2 * n)) * 2 * n
    per_rank = t // n - (-(max_new_tokens - 1) // n)
    max_len = n * per_rank if max_len is None else int(max_len)
    if max_len % n or max_len // n < per_rank:
      raise ValueError(f"generate: max_len={max_len} slots on {n} context-parallel ranks; "
                       f"prompts padded to {t} tokens plus {max_new_tokens} new tokens need "
                       f"{per_rank} slots per rank: a multiple of {n} that is >= {n * per_rank}")
  tokens_BT, lengths = pad_prompts(prompts, t)
  graphdef, state = nnx.split(model)
  sampling = sampling_settings(temperature, top_k, top_p)
  key = jax.random.key(0) if rng is None else rng
  first = prefill(graphdef, state, jnp.asarray(tokens_BT), jnp.asarray(lengths), key, sampling,
                  max_len=max_len, with_hidden=with_hidden, rolling=rolling)
  tok_B, cache, key = first[:3]
  out = decode(graphdef, state, cache, tok_B, key, sampling, stop_array(stop),
               n_new=max_new_tokens, with_hidden=with_hidden)
  rows = cut_rows(np.asarray(out[0]), int(out[1]), stop)
  if not with_hidden:
    return rows
  h_BTD, hid_BND = np.asarray(first[3], np.float32), np.asarray(out[2])
  return rows, [np.concatenate([h_BTD[i, :len(p)], hid_BND[i, :len(r)]])
                for i, (p, r) in enumerate(zip(prompts, rows))]
