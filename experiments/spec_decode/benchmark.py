"""EAGLE speculative decoding (arXiv 2508.08192) against plain decoding, side by side:
accepted length, tokens per target call, wall-clock per token and speedup, per tree shape,
for one batch of prompts.

Both run their whole `generate` call (prefill, the jitted decode loop, the host-side result)
after one warm-up call that compiles them; repeats alternate plain and speculative runs so
that drift on a shared machine hits both, and medians are taken. With temperature 0 the
speculative tokens are checked against the plain ones (`greedy_match`). Each row also keeps
what the counts come from: per prompt, the new tokens and the drafted tokens accepted in
each round.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax

from llm.generate import generate
from llm.model import Llama
from llm.speculative.decode import speculative_generate
from llm.speculative.draft import DraftHead
from llm.speculative.tree import TreeShape


def _seconds(fn: Callable[[], object]) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def compare(target: Llama, draft: DraftHead, prompts: list[list[int]], max_new_tokens: int,
            shapes: Sequence[TreeShape], *, repeats: int = 3, temperature: float = 0.0,
            seed: int = 0, progress: Callable[[str], None] | None = print) -> list[dict]:
  """One row per tree shape (dicts: tree, batch, accept_length, tokens_per_call,
  plain_ms_per_token, spec_ms_per_token, speedup, greedy_match, and per prompt new_tokens
  and accepted_per_round). ms per token: wall time of the call / max_new_tokens (every row
  generates that many: no stop tokens)."""
  kw = dict(temperature=temperature, rng=jax.random.key(seed))
  plain = lambda: generate(target, prompts, max_new_tokens, **kw)
  want = plain()
  rows = []
  for shape in shapes:
    spec = lambda: speculative_generate(target, draft, prompts, max_new_tokens, shape=shape,
                                        **kw)
    res = spec()
    t_plain, t_spec = [], []
    for _ in range(repeats):
      t_plain.append(_seconds(plain))
      t_spec.append(_seconds(spec))
    p, s = statistics.median(t_plain), statistics.median(t_spec)
    row = {"tree": str(shape), "top_k": shape.top_k, "depth": shape.depth,
           "budget": shape.budget, "batch": len(prompts),
           "accept_length": res.accept_length, "tokens_per_call": res.tokens_per_call,
           "plain_ms_per_token": 1e3 * p / max_new_tokens,
           "spec_ms_per_token": 1e3 * s / max_new_tokens, "speedup": p / s,
           "greedy_match": (res.tokens == want) if temperature == 0 else None,
           "plain_seconds": t_plain, "spec_seconds": t_spec,
           "new_tokens": [len(t) for t in res.tokens],
           "accepted_per_round": res.accepted_per_round}
    rows.append(row)
    if progress:
      progress(f"  batch {len(prompts)} tree {shape}: accept length {row['accept_length']:.2f}, "
               f"{row['tokens_per_call']:.2f} tokens/target call, speedup {row['speedup']:.2f}x")
  return rows


def plot(rows: list[dict], path: str) -> str:
  """Speedup and accepted length per tree shape, one line per batch size."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  trees = list(dict.fromkeys(r["tree"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for b in sorted({r["batch"] for r in rows}):
    by = {r["tree"]: r for r in rows if r["batch"] == b}
    xs = [i for i, t in enumerate(trees) if t in by]
    axes[0].plot(xs, [by[trees[i]]["speedup"] for i in xs], "o-", label=f"batch {b}")
    axes[1].plot(xs, [by[trees[i]]["accept_length"] for i in xs], "o-", label=f"batch {b}")
  for ax, title in zip(axes, ("wall-clock speedup over plain decoding",
                              "mean accepted length (tokens per round)")):
    ax.set_xticks(range(len(trees)), trees)
    ax.set_xlabel("tree top_k:depth:budget")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
  axes[0].axhline(1.0, color="gray", lw=0.8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
