"""EAGLE speculative decoding (arXiv 2508.08192) against plain decoding, side by side:
accepted length, tokens per target call, wall-clock per token and speedup, per tree shape,
over several batches of prompts.

Both run their whole `generate` call (prefill, the jitted decode loop, the host-side result)
after one warm-up call per batch that compiles them; repeats alternate plain and speculative runs so
that drift on a shared machine hits both, and medians are taken. With temperature 0 the
speculative tokens are checked against the plain ones, per prompt (`greedy_rows_equal`, and
`greedy_match` when every prompt's are). Each row also keeps
what the counts come from: per prompt, the new tokens and the drafted tokens accepted in
each round.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Sequence

import jax

from llm.generate import generate
from llm.model import Llama
from llm.speculative.decode import cache_slots, speculative_generate
from llm.speculative.draft import DraftHead
from llm.speculative.tree import TreeShape


def _seconds(fn: Callable[[], object]) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def round_counts(results) -> dict[str, float]:
  """{accept_length, tokens_per_call} of speculative results (SpecResult per batch), both
  pooled over every prompt: accepted drafts + the bonus per draft-verify round (EAGLE's
  tau), and new tokens per target call (the prefill and each round). Pooled, as the
  speedup's times and tokens are (tokens per call then never exceeds tau once a round
  ran); a mean of per-prompt ratios would weigh a prompt of a few rounds (a short reply)
  like a long one."""
  rounds = sum(int(r.rounds.sum()) for r in results)
  accepted = sum(int(r.accepted.sum()) for r in results)
  tokens = sum(len(t) for r in results for t in r.tokens)
  calls = sum(len(r.tokens) + int(r.rounds.sum()) for r in results)
  return {"accept_length": (accepted + rounds) / max(rounds, 1),
          "tokens_per_call": tokens / max(calls, 1)}


def compare(target: Llama, draft: DraftHead, prompts: list[list[int]], max_new_tokens: int,
            shapes: Sequence[TreeShape], *, batch: int | None = None, repeats: int = 3,
            temperature: float = 0.0, seed: int = 0, stop_tokens=(),
            progress: Callable[[str], None] | None = print, draft_vocab=None) -> list[dict]:
  """One row per tree shape, over the prompts in consecutive batches of `batch` (default:
  all of them in one batch; a trailing partial batch is dropped). Each batch runs plain and
  speculative decoding `repeats` times, alternated; a row sums the batches' median times
  and their new tokens: ms per token = summed seconds / summed new tokens (each decoder its
  own tokens: equal for greedy, its own samples at temperature > 0), speedup = plain ms per
  token / speculative ms per token; accepted length and tokens per target call pooled over
  the prompts (`round_counts`). Decoding ends at max_new_tokens or a stop token (a chat
  reply's end of turn). Row keys: tree, batch, prompts, accept_length, tokens_per_call,
  plain_ms_per_token, spec_ms_per_token, speedup, greedy_rows_equal (how many prompts'
  greedy tokens equal plain decoding's; None at temperature > 0), greedy_match (all of
  them), and per prompt new_tokens and accepted_per_round."""
  batch = len(prompts) if batch is None else int(batch)
  groups = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
  if not groups:
    raise ValueError(f"compare: {len(prompts)} prompts, batch={batch}; expected at least one "
                     "full batch")
  longest = max(len(p) for p in prompts)
  # One cache size for every batch: the decode loops compile once (the prefill once per
  # padded prompt length), in the untimed first call of each batch.
  plain_len = longest + max_new_tokens
  spec_len = max(cache_slots(longest, max_new_tokens, s) for s in shapes)
  kw = dict(temperature=temperature, rng=jax.random.key(seed), stop_tokens=stop_tokens)
  plains = [functools.partial(generate, target, g, max_new_tokens, max_len=plain_len, **kw)
            for g in groups]
  wants = [fn() for fn in plains]
  rows = []
  for shape in shapes:
    specs = [functools.partial(speculative_generate, target, draft, g, max_new_tokens,
                               shape=shape, draft_vocab=draft_vocab, max_len=spec_len, **kw)
             for g in groups]
    results = [fn() for fn in specs]
    t_plain, t_spec = [[] for _ in groups], [[] for _ in groups]
    for _ in range(repeats):
      for i in range(len(groups)):
        t_plain[i].append(_seconds(plains[i]))
        t_spec[i].append(_seconds(specs[i]))
    p = sum(statistics.median(t) for t in t_plain)
    s = sum(statistics.median(t) for t in t_spec)
    n_plain = sum(len(t) for w in wants for t in w)
    n_spec = sum(len(t) for r in results for t in r.tokens)
    per_prompt = [t for r in results for t in r.tokens]
    equal = (sum(s_t == p_t for r, w in zip(results, wants) for s_t, p_t in zip(r.tokens, w))
             if temperature == 0 else None)
    row = {"tree": str(shape), "top_k": shape.top_k, "depth": shape.depth,
           "budget": shape.budget, "batch": batch, "prompts": len(per_prompt),
           "temperature": temperature, **round_counts(results),
           "plain_ms_per_token": 1e3 * p / n_plain, "spec_ms_per_token": 1e3 * s / n_spec,
           "speedup": (p / n_plain) / (s / n_spec),
           "greedy_rows_equal": equal, "greedy_match": (None if equal is None
                                                         else equal == len(per_prompt)),
           "plain_seconds": t_plain, "spec_seconds": t_spec,
           "plain_new_tokens": [len(t) for w in wants for t in w],
           "new_tokens": [len(t) for t in per_prompt],
           "accepted_per_round": [a for r in results for a in r.accepted_per_round]}
    rows.append(row)
    if progress:
      progress(f"  T {temperature:g} batch {batch} x {len(groups)} tree {shape}: accept length "
               f"{row['accept_length']:.2f}, "
               f"{row['tokens_per_call']:.2f} tokens/target call, speedup {row['speedup']:.2f}x")
  return rows


def plot(rows: list[dict], path: str) -> str:
  """Speedup and accepted length per tree shape, one line per (temperature, batch size)."""
  from core import plot as plot_lib
  trees = list(dict.fromkeys(r["tree"] for r in rows))
  with plot_lib.figure(path, 1, 2, figsize=(11, 4)) as (fig, axes):
    for temp, b in sorted({(r.get("temperature", 0.0), r["batch"]) for r in rows}):
      by = {r["tree"]: r for r in rows
            if r["batch"] == b and r.get("temperature", 0.0) == temp}
      xs = [i for i, t in enumerate(trees) if t in by]
      label = f"batch {b}, " + ("greedy" if temp == 0 else f"T={temp:g}")
      style = "o-" if temp == 0 else "s--"
      axes[0].plot(xs, [by[trees[i]]["speedup"] for i in xs], style, label=label)
      axes[1].plot(xs, [by[trees[i]]["accept_length"] for i in xs], style, label=label)
    for ax, title in zip(axes, ("wall-clock speedup over plain decoding",
                                "mean accepted length (tokens per round)")):
      ax.set_xticks(range(len(trees)), trees)
      ax.set_xlabel("tree top_k:depth:budget")
      ax.set_title(title)
      ax.grid(alpha=0.3)
      ax.legend()
    axes[0].axhline(1.0, color="gray", lw=0.8)
  return path


def profile_round(target: Llama, draft: DraftHead, prompt: list[int], shape: TreeShape, *,
                  draft_vocab=None, repeats: int = 5, context: int = 96) -> dict:
  """Where a round's time goes at batch 1, greedy: each piece jitted alone on a cache holding
  `context` tokens of the prompt's continuation: a plain decode step (one target token and
  its argmax), the target verifying the shape's N nodes with the tree mask (and without it,
  `verify_nomask`: what the mask costs), the draft expanding the tree (its LM-head top-k
  included), the draft head catching up on depth + 1 pairs, acceptance and the KV commit.
  Every timed call of a piece follows a timed plain step, so a shared machine's load swings
  hit both: `<piece>_ms` is the piece's median, `<piece>_x` the median of its ratio to the
  plain step timed just before it, and round_x the sum of the ratios (the accept length a
  round needs to break even with plain decoding)."""
  import dataclasses
  import functools

  import jax.numpy as jnp
  from flax import nnx

  from llm.speculative import accept as accept_lib
  from llm.speculative import decode as dec
  from llm.speculative import tree as tree_lib

  tg, ts = nnx.split(target)
  dg, ds = nnx.split(draft)
  n, j = shape.nodes, shape.depth + 1
  s = context + dec.cache_slots(1, 1, shape)
  tcache = dataclasses.replace(target.init_cache(1, s), length=jnp.full((1,), context,
                                                                         jnp.int32))
  dcache = dataclasses.replace(draft.init_cache(1, s), length=tcache.length)
  head = dec.vocab_head(target, draft_vocab, draft.cfg.dtype)
  start = tcache.length

  def once(fn, *args):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t

  @functools.partial(jax.jit, static_argnums=0)
  def plain_step(tg, ts, cache, tok_B):
    logits, cache = nnx.merge(tg, ts)(tok_B[:, None], cache=cache)
    return jnp.argmax(logits[:, 0], -1), cache

  @functools.partial(jax.jit, static_argnums=(0, 6))
  def verify(tg, ts, cache, tokens_BN, parents_BN, depths_BN, masked=True):
    t = nnx.merge(tg, ts)
    vis = tree_lib.ancestors(parents_BN, shape.depth)
    h, cache, *_ = t.hidden(t.embed_tokens(tokens_BN), positions_BT=start[:, None] + depths_BN,
                            cache=cache, taps=draft.taps,
                            mask_BTS=tree_lib.slot_mask(vis, start, s) if masked else None)
    return jnp.argmax(t.logits(h), -1), cache

  @functools.partial(jax.jit, static_argnums=(0, 2))
  def expand(tg, ts, dg, ds, dcache, h_BD, root_B, head):
    return dec.draft_tree(nnx.merge(tg, ts), nnx.merge(dg, ds), dcache, h_BD, root_B, start,
                          shape, head)

  @functools.partial(jax.jit, static_argnums=(0, 2))
  def catch_up(tg, ts, dg, ds, dcache, h_BJD, tok_BJ):
    t, d = nnx.merge(tg, ts), nnx.merge(dg, ds)
    pos = start[:, None] + jnp.arange(j)
    taps = jnp.zeros((1, j, len(d.taps) * d.cfg.dim)) if d.taps else None
    return d(h_BJD, t.embed_tokens(tok_BJ), positions_BT=pos, cache=dcache, slots_BT=pos,
             taps_BTK=taps)

  accept = jax.jit(lambda p, t, c, k: accept_lib.accept_tree(p, t, c, k, depth=shape.depth,
                                                             greedy=True))
  commit = jax.jit(dec.commit_path)
  root = jnp.asarray([prompt[-1]], jnp.int32)
  h = jnp.zeros((1, target.cfg.dim), jnp.float32)
  (tokens, parents, depths), _ = expand(tg, ts, dg, ds, dcache, h, root, head)
  pieces = {
      "verify": (verify, tg, ts, tcache, tokens, parents, depths),
      "verify_nomask": (verify, tg, ts, tcache, tokens, parents, depths, False),
      "draft_tree": (expand, tg, ts, dg, ds, dcache, h, root, head),
      "draft_catch_up": (catch_up, tg, ts, dg, ds, dcache, jnp.zeros((1, j, target.cfg.dim)),
                         jnp.zeros((1, j), jnp.int32)),
      "accept": (accept, jax.nn.one_hot(tokens, target.cfg.vocab_size), tokens,
                 tree_lib.children(parents, shape.top_k), jax.random.key(0)),
      "commit": (commit, tcache, start, jnp.zeros((1, j), jnp.int32),
                 jnp.ones((1,), jnp.int32)),
  }
  plain = (plain_step, tg, ts, tcache, root)
  for fn, *args in (plain, *pieces.values()):     # compile
    jax.block_until_ready(fn(*args))
  plain_s, times = [], {k: [] for k in pieces}
  for _ in range(repeats):
    for k, (fn, *args) in pieces.items():
      plain_s.append(once(*plain))
      times[k].append((once(fn, *args), plain_s[-1]))
  out = {"tree": str(shape), "nodes": n, "repeats": repeats,
         "plain_step_ms": 1e3 * statistics.median(plain_s)}
  for k, pairs in times.items():
    out[f"{k}_ms"] = 1e3 * statistics.median(t for t, _ in pairs)
    out[f"{k}_x"] = statistics.median(t / p for t, p in pairs)
  parts = ("verify", "draft_tree", "draft_catch_up", "accept", "commit")
  out["round_ms"] = sum(out[f"{k}_ms"] for k in parts)
  # Accepted length a round needs to match plain decoding's speed (round / plain step).
  out["round_x"] = sum(out[f"{k}_x"] for k in parts)
  out["break_even_accept_length"] = out["round_x"]
  return out
