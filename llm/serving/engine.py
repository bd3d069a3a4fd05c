"""A serving engine: continuous batching over a paged KV cache (Orca, OSDI'22; vLLM, arXiv
2309.06180), with chunked prefill interleaved with decoding (Sarathi, arXiv 2308.16369).

    engine = Engine(model, EngineConfig(max_slots=8), tokenizer)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, stop=("\\n\\n",)))
    while engine.has_unfinished():
      for out in engine.step():            # RequestOutput: new tokens and text, finished?
        ...
    engine.generate([prompt, ...], params)   # the same, for a list of prompts at once

Requests join and leave the running batch at every step. A request holds a slot (a row of
the decode step) and pages of the shared pool (`llm.serving.paged`): its block table grows a
page at a time and its pages go back to the pool when it finishes. Each step:
  1. admission: waiting requests take free slots (first come, first served) while the pool
     has pages for their first chunk;
  2. every request with one token left to feed (its last sampled token, or a one-token
     remainder of a prompt) is a decode row, fed in one jitted step [W, 1], W the narrowest
     of `EngineConfig.batch_widths` that holds them all (rows past them idle);
     a request short of a page for it preempts the most recently admitted one, whose pages
     are freed and which later recomputes its prompt and reply (vLLM's recompute);
  3. up to `prefill_rows` requests still reading their prompt prefill their next
     `prefill_chunk` tokens in one jitted step [R, C], C the narrowest of
     `EngineConfig.chunk_widths` that holds them (a short prompt is not padded to a whole
     chunk); the chunk that ends a prompt samples the first new token;
  4. each row's token is checked against the request's stop ids, stop strings, max_tokens
     and the context; finished requests free their slot and pages.
With `EngineConfig.mixed_batch` (the default) a step with both runs them as one forward
pass (vLLM / Sarathi's mixed batch): the decode rows' and the chunk's tokens go through
the weights together, flattened to [1, W + R*C], each group attending over its own pages
(`paged.PagedGroups`), so the weights are read once per step, not twice.
Every step has fixed shapes (idle rows write nothing and see nothing), so joining and
leaving never recompiles; the decode step's batch width, the prefill chunk's width and the
block tables' width take a few fixed values (`EngineConfig.batch_widths`, `chunk_widths`,
`table_widths`), compiled once each, and each pair of a batch and a chunk width once more as
a mixed step (`programs`, `warmup`).

Speculative mode (`EngineConfig.speculative_tree`, a draft head given as `draft=`: EAGLE,
arXiv 2401.15077 / 2406.16858, `llm.speculative`): the decode rows run a round instead of a
step (`llm.serving.programs.spec_step`): each running request drafts its own tree from its last token with the
head (whose KV cache is one dense row per slot, `[max_slots, max_model_len + scratch]`),
the batch verifies every tree in one target pass over the paged cache (each node attends to
its row's cached pages and, among the tree's own keys, to its ancestors), the longest path
the target's argmax agrees with is accepted with a bonus token, only the accepted nodes'
keys and values are written (to slots start .. start + a: rejected nodes never reach the
pool), and the head reads the a + 1 new pairs. Prompt chunks run as plain prefill steps
that also feed the head the chunk's pairs (`llm.serving.programs`). Greedy requests only (a
sampled one is refused); the rows equal plain greedy decoding.

Context-parallel prefill (`EngineConfig.cp_prefill_min` > 0, a mesh with a `cp` axis of
N > 1 devices given as `mesh=`; `llm.serving.cp_prefill`): a request whose prompt still to
prefill (none of it yet) has at least cp_prefill_min tokens takes pages for all of it at
admission and is prefilled in one step through the model's ring attention (arXiv
2411.01783; the model's cfg.context_parallel variant, "pass_kv" when it has none) into a
dense cache, whose keys and values go to its pages; its first token is sampled as a
chunk's would be, and it goes on as a decode row (at most one such prefill per step, beside
the step's decode rows and chunk). Not with speculative_tree.

Sampling settings are per row (temperature, top_k, top_p, a seed): a request's token i draws
with key fold_in(key(seed), i), whatever its batch.

Numerics: a step runs the model's own blocks (`llm.model.Block`) with a `PagedLayer` as
their cache, attending over the rows' gathered pages ("xla") or through the Pallas kernel,
so greedy outputs equal `llm.generate.generate` run one request at a time, and logits agree
to float32 rounding (another order of the attention's sums; XLA:CPU also runs products of
one row and of many through different routines). A row's bits depend on the step's shapes
only, not on the other rows' values, so a request gives the same bits alone or among others
at the same batch width and table width (fix both to compare); in a mixed step the shapes
include the chunk riding along, and XLA:CPU's products over more rows may group a sum
otherwise (float32 at the model's widths; the tiny test model's bits stay equal, and the LM
head runs group by group for that reason).

Letters: B (or W) decode rows, R prefill rows, C prefill chunk, M pages per row, V vocab,
N tree nodes, J = depth + 1 path slots, S engine slots (max_slots), D model dim.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from llm.serving import cp_prefill
from llm.serving.config import EngineConfig
from llm.serving.paged import (NULL_BLOCK, BlockPool, PagedCache, blocks_for,
                               choose_paged_impl, commit_pages)
from llm.serving.programs import load_draft, run_step, spec_step
from llm.serving.text import ReplyText
from llm.speculative import decode as spec_decode
from llm.speculative.tree import TreeShape

__all__ = ["Engine", "RequestOutput", "SamplingParams", "load_draft"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's generation settings: greedy at temperature 0; stop_token_ids end the
  reply with that token (kept in its ids, not in its text), stop strings end it before the
  string. A single stop string may be given as a str (as vLLM's `stop`)."""
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    # A str is one stop string, not a sequence of one-character ones (stop="\n\n" would
    # end the reply at its first "\n"); None is none.
    stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
    object.__setattr__(self, "stop", stop)
    ids = self.stop_token_ids
    object.__setattr__(self, "stop_token_ids", (ids,) if isinstance(ids, (int, np.integer))
                       else tuple(ids or ()))

  def check(self, where: str = "SamplingParams") -> None:
    for name in ("max_tokens", "top_k", "seed"):
      x = getattr(self, name)
      if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{where}: {name}={x!r}; expected an integer")
    if self.max_tokens < 1:
      raise ValueError(f"{where}: max_tokens={self.max_tokens}; expected >= 1")
    # A stop id given as text ("2") never equals a sampled token: it would never stop.
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer))
           for t in self.stop_token_ids):
      raise ValueError(f"{where}: stop_token_ids={list(self.stop_token_ids)!r}; expected "
                       "integer token ids")
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise ValueError(f"{where}: stop={list(self.stop)!r}; expected non-empty strings")
    if not (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1):
      raise ValueError(f"{where}: temperature={self.temperature}, top_k={self.top_k}, "
                       f"top_p={self.top_p}; expected temperature >= 0, top_k >= 0 and "
                       "0 < top_p <= 1")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """What one step did for one request: the tokens it added (and their text, safe to
  stream), all of its reply so far, and whether it finished ("stop" | "length" | "abort")."""
  request_id: str
  new_token_ids: tuple[int, ...]
  token_ids: tuple[int, ...]
  text_delta: str
  text: str
  finished: bool
  finish_reason: str | None
  prompt_tokens: int
  logits: tuple[np.ndarray, ...] = ()     # with EngineConfig.record_logits: one per new token


@dataclasses.dataclass(eq=False)
class _Request:
  id: str
  prompt: list[int]
  params: SamplingParams
  reply: ReplyText | None
  arrival: float
  output: list[int] = dataclasses.field(default_factory=list)
  blocks: list[int] = dataclasses.field(default_factory=list)
  num_computed: int = 0           # tokens whose keys and values are in the pages
  slot: int | None = None
  finish_reason: str | None = None
  logits: list[np.ndarray] = dataclasses.field(default_factory=list)
  preempted: int = 0

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def remaining(self) -> int:
    """Tokens still to feed before the next sample (1: a decode row)."""
    return len(self.prompt) + len(self.output) - self.num_computed


def _widths(given: Sequence[int], most: int, first: int, name: str, what: str
            ) -> tuple[int, ...]:
  """Sorted widths covering 1..most: `given`, or powers of two from `first` and `most`."""
  if given:
    widths = tuple(sorted(set(int(w) for w in given)))
    if widths[-1] < most or widths[0] < 1:
      raise ValueError(f"Engine: {name}={list(given)}; expected positive widths, the largest "
                       f">= {most} ({what})")
    return widths
  widths, w = [], first
  while w < most:
    widths.append(w)
    w *= 2
  return tuple(widths) + (most,)


class Engine:
  """Continuous batching over a paged KV cache (module docstring). Not thread-safe: one
  thread calls add_request / abort / step (`llm.serving.runner` runs it in one)."""

  def __init__(self, model, config: EngineConfig = EngineConfig(), tokenizer=None, draft=None,
               draft_vocab=None, mesh=None):
    cfg = model.cfg
    if getattr(cfg, "context_parallel", "none") != "none" and not config.cp_prefill_min:
      raise ValueError(f"Engine: context_parallel={cfg.context_parallel!r}; the engine serves "
                       "one device (context_parallel='none'), or takes the variant for its "
                       "context-parallel prefill (cp_prefill_min > 0 and mesh=)")
    if getattr(cfg, "sliding_window", None):
      raise ValueError(f"Engine: sliding_window={cfg.sliding_window}; the paged cache keeps "
                       "every position (no sliding-window attention yet)")
    self.model, self.cfg, self.config, self.tokenizer = model, cfg, config, tokenizer
    self.impl = choose_paged_impl(config.paged_attention)
    if self.impl == "pallas" and (config.block_size < 16 or
                                  config.block_size & (config.block_size - 1)):
      raise ValueError(f"Engine: block_size={config.block_size} with the Pallas kernel; "
                       "expected a power of two >= 16")
    self.max_len = min(config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
    if (config.max_model_len or 0) > cfg.max_seq_len:
      raise ValueError(f"Engine: max_model_len={config.max_model_len} is beyond the model's "
                       f"max_seq_len={cfg.max_seq_len}")
    bs = config.block_size
    self.max_pages = blocks_for(self.max_len, bs)
    num_blocks = config.num_blocks or config.max_slots * self.max_pages + 1
    if num_blocks - 1 < self.max_pages:
      raise ValueError(f"Engine: num_blocks={num_blocks} pages of {bs} slots (one of them "
                       f"padding) cannot hold one request of max_model_len={self.max_len} "
                       f"tokens; expected >= {self.max_pages + 1}")
    self.cp = cp_prefill.make(model, config, mesh, max_len=self.max_len,
                              max_pages=self.max_pages)
    self.widths = _widths(config.table_widths, self.max_pages, 4, "table_widths",
                          "pages of max_model_len")
    self.batch_widths = _widths(config.batch_widths, config.max_slots, 1, "batch_widths",
                                "max_slots")
    self.chunk_widths = _widths(config.chunk_widths, config.prefill_chunk,
                                min(16, config.prefill_chunk), "chunk_widths", "prefill_chunk")
    self.pool = BlockPool(num_blocks)
    self.graphdef, self.state = nnx.split(model)
    # Every array the steps take is committed to one device (the weights'): a step's outputs
    # (the caches it returns) then have its inputs' placement, so a later call never meets a
    # new one and recompiles (a checkpoint's weights come committed to a mesh, fresh caches
    # uncommitted: the first call's placement would differ from every later one's).
    one = SingleDeviceSharding(next(iter(jax.tree.leaves(self.state)[0].devices())))
    self.put = functools.partial(jax.tree.map, lambda a: jax.device_put(a, one)
                                 if isinstance(a, jax.Array) else a)
    self.state = self.put(self.state)
    self.cache = self.put(PagedCache.init(cfg, num_blocks, bs))
    self.slots: list[_Request | None] = [None] * config.max_slots
    self.waiting: collections.deque[_Request] = collections.deque()
    self.running: list[_Request] = []          # in admission order
    self.requests: dict[str, _Request] = {}
    self._ids = itertools.count()
    self.steps = 0
    self.preemptions = 0
    self.finished = 0
    self.spec_rounds = 0
    self.spec_accepted = 0
    self.shape = self._speculative(draft, draft_vocab)

  def _speculative(self, draft, draft_vocab) -> TreeShape | None:
    """The tree shape of a speculative engine (its draft state set up), else None."""
    spec = self.config.speculative_tree
    if not spec:
      if draft is not None:
        raise ValueError("Engine: a draft head without speculative_tree; give the tree "
                         "shape (e.g. speculative_tree='2:4:5')")
      return None
    shape = TreeShape.parse(spec)
    if draft is None:
      raise ValueError(f"Engine: speculative_tree={spec!r} needs a draft head (draft=)")
    if draft.cfg.dim != self.cfg.dim or draft.cfg.vocab_size != self.cfg.vocab_size:
      raise ValueError(f"Engine: draft head for dim {draft.cfg.dim}, vocab "
                       f"{draft.cfg.vocab_size}; the model has dim {self.cfg.dim}, vocab "
                       f"{self.cfg.vocab_size}")
    # The draft's scratch slots past a row's start (its tree, then the catch-up's pairs).
    scratch = max((shape.depth - 1) * shape.top_k, shape.depth + 1)
    self.dgraph, self.dstate = nnx.split(draft)
    self.dstate = self.put(self.dstate)
    self.dcache = self.put(draft.init_cache(self.config.max_slots, self.max_len + scratch))
    self.h_root = self.put(jnp.zeros((self.config.max_slots, self.cfg.dim), draft.cfg.dtype))
    self.head = spec_decode.vocab_head(self.model, draft_vocab, draft.cfg.dtype)
    return shape

  # --- requests

  def check_request(self, prompt: Sequence[int], params: SamplingParams,
                    where: str = "request") -> None:
    """The errors add_request raises, before anything is queued (a server answers 400)."""
    params.check(where)
    if not prompt:
      raise ValueError(f"{where}: the prompt is empty; expected at least one token")
    bad = [t for t in prompt if not 0 <= int(t) < self.cfg.vocab_size]
    if bad:
      raise ValueError(f"{where}: prompt token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
    if len(prompt) + params.max_tokens > self.max_len:
      raise ValueError(
          f"{where}: the prompt ({len(prompt)} tokens) plus max_tokens={params.max_tokens} "
          f"makes {len(prompt) + params.max_tokens} tokens, beyond the engine's context of "
          f"{self.max_len} (max_model_len); ask for at most "
          f"{max(self.max_len - len(prompt), 0)} new tokens")
    bad = [t for t in params.stop_token_ids if not 0 <= int(t) < self.cfg.vocab_size]
    if bad:
      raise ValueError(f"{where}: stop_token_ids {bad} outside [0, {self.cfg.vocab_size})")
    if self.shape is not None and params.temperature > 0:
      raise ValueError(f"{where}: temperature={params.temperature} on a speculative engine "
                       "(speculative_tree); it verifies greedy requests only (temperature 0)")
    if params.stop and self.tokenizer is None:
      raise ValueError(f"{where}: stop strings {list(params.stop)} need a tokenizer; this "
                       "engine has none (give stop_token_ids)")

  def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                  request_id: str | None = None) -> str:
    """Queues a request; returns its id. Raises ValueError naming what is wrong with it."""
    rid = request_id if request_id is not None else f"req-{next(self._ids)}"
    if rid in self.requests:
      raise ValueError(f"add_request: request id {rid!r} is already in use")
    self.check_request(prompt, params, where=f"request {rid}")
    reply = (ReplyText(self.tokenizer, params.stop, params.stop_token_ids)
             if self.tokenizer is not None else None)
    req = _Request(rid, [int(t) for t in prompt], params, reply, time.perf_counter())
    self.requests[rid] = req
    self.waiting.append(req)
    return rid

  def abort(self, request_id: str) -> RequestOutput | None:
    """Ends a request now (finish_reason "abort"), freeing its slot and pages."""
    req = self.requests.get(request_id)
    if req is None:
      return None
    if req in self.waiting:
      self.waiting.remove(req)
    req.finish_reason = "abort"
    self._release(req)
    return self._output(req, (), "", [])

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  @property
  def num_waiting(self) -> int:
    return len(self.waiting)

  # --- scheduling

  def _release(self, req: _Request) -> None:
    self.pool.free(req.blocks)
    req.blocks = []
    if req.slot is not None:
      self.slots[req.slot] = None
      req.slot = None
    if req in self.running:
      self.running.remove(req)
    if req.finish_reason is not None and self.requests.pop(req.id, None) is not None:
      self.finished += 1

  def _preempt(self, req: _Request) -> None:
    """Frees a running request's slot and pages; it waits at the front of the queue and
    will recompute its prompt and reply (its sampled tokens are kept)."""
    self._release(req)
    req.num_computed = 0
    req.preempted += 1
    self.preemptions += 1
    self.waiting.appendleft(req)

  def _grow(self, req: _Request, n_tokens: int) -> bool:
    """Pages for req's next n_tokens; False when the pool has too few."""
    need = blocks_for(req.num_computed + n_tokens, self.config.block_size) - len(req.blocks)
    if need <= 0:
      return True
    got = self.pool.allocate(need)
    if got is None:
      return False
    req.blocks.extend(got)
    return True

  def _is_decode(self, req: _Request) -> bool:
    """A decode row: one token left to feed (and, speculative, the draft has read the rest)."""
    return req.remaining == 1 and (self.shape is None or req.num_computed > 0)

  def _decode_tokens(self, req: _Request) -> int:
    """Slots a decode row may write this step: 1, or a tree's accepted path."""
    if self.shape is None:
      return 1
    return max(1, min(self.shape.depth + 1, self.max_len - req.num_computed))

  def _is_cp(self, req: _Request) -> bool:
    """Prefilled whole through the context-parallel path (none of it computed yet)."""
    return (self.cp is not None and req.num_computed == 0 and not self._is_decode(req)
            and req.remaining >= self.config.cp_prefill_min)

  def _admit(self) -> None:
    free = [i for i, r in enumerate(self.slots) if r is None]
    # Keep a page per running request in hand, so admissions do not preempt at once.
    while free and self.waiting:
      req = self.waiting[0]
      first = req.remaining if self._is_cp(req) else min(req.remaining,
                                                         self.config.prefill_chunk)
      need = blocks_for(first, self.config.block_size)
      if self.pool.num_free < need + len(self.running):
        break
      self.waiting.popleft()
      req.slot = free.pop(0)
      self.slots[req.slot] = req
      self.running.append(req)

  def _pick_cp(self, decode: list[_Request]) -> _Request | None:
    """The request prefilled through the context-parallel path this step (the first
    admitted), its pages allocated; None when there is none or the pool is short."""
    for req in [r for r in self.running if self._is_cp(r)]:
      while not self._grow(req, req.remaining):
        others = [r for r in self.running if r is not req and r not in decode]
        if decode or not others:
          return None
        self._preempt(others[-1])
      return req
    return None

  def _schedule(self) -> tuple[list[_Request], list[_Request], _Request | None]:
    """(decode rows, prefill rows, the context-parallel prefill or None) of this step,
    their pages allocated."""
    self._admit()
    decode: list[_Request] = []
    for req in list(self.running):
      if req not in self.running or not self._is_decode(req):
        continue
      while not self._grow(req, self._decode_tokens(req)):
        # The latest admitted; never one of `decode` (those come before req in running).
        victim = self.running[-1]
        self._preempt(victim)
        if victim is req:
          break
      if req in self.running:
        decode.append(req)
    cp = self._pick_cp(decode)
    prefill: list[_Request] = []
    for req in list(self.running):
      if len(prefill) == self.config.prefill_rows:
        break
      # (req may have been preempted in this loop to make room for an earlier one.)
      if (req not in self.running or req.remaining < 1 or self._is_decode(req)
          or self._is_cp(req)):
        continue
      n = min(req.remaining, self.config.prefill_chunk)
      while not self._grow(req, n):
        # With decode rows running, pages come back as they finish; otherwise make room.
        others = [r for r in self.running if r is not req and r not in decode
                  and r not in prefill and r is not cp]
        if decode or prefill or cp is not None or not others:
          break
        self._preempt(others[-1])
      else:
        prefill.append(req)
    return decode, prefill, cp

  # --- the step

  def _feed(self, req: _Request, n_tokens: int) -> int:
    """Tokens req feeds in a group of n_tokens per row: at most prefill_chunk, what
    `_schedule` grew its pages for (a chunk width may exceed prefill_chunk)."""
    return min(req.remaining, n_tokens, self.config.prefill_chunk)

  def _width(self, rows: Sequence[_Request], n_tokens: int) -> int:
    need = max(blocks_for(min(r.num_computed + n_tokens, self.max_len), self.config.block_size)
               for r in rows)
    return next(w for w in self.widths if w >= need)

  def _run(self, groups: list[tuple[list[_Request | None], int]]):
    """Dispatches one jitted step over `groups` of rows (None: idle), each feeding up to
    n_tokens per row (one group: a decode or prefill step; two: a mixed batch); returns
    (device tokens [rows], device logits or None, [(row, request, n fed)])."""
    m = max(self._width([r for r in rows if r is not None], n) for rows, n in groups
            if any(r is not None for r in rows))
    arrays, fed, at = [], [], 0
    sampling = [[], [], [], [], []]
    for rows, n_tokens in groups:
      b = len(rows)
      tokens = np.zeros((b, n_tokens), np.int32)
      start = np.zeros((b,), np.int32)
      n_valid = np.zeros((b,), np.int32)
      tables = np.full((b, m), NULL_BLOCK, np.int32)
      temp = np.zeros((b,), np.float32)
      top_k = np.zeros((b,), np.int32)
      top_p = np.ones((b,), np.float32)
      seed = np.zeros((b,), np.uint32)
      counter = np.zeros((b,), np.int32)
      for i, r in enumerate(rows):
        if r is None:
          continue
        n = self._feed(r, n_tokens)
        tokens[i, :n] = r.tokens[r.num_computed:r.num_computed + n]
        start[i], n_valid[i] = r.num_computed, n
        tables[i, :len(r.blocks)] = r.blocks
        p = r.params
        # top_k >= the vocabulary keeps every token (as 0 does): clipped so that any integer
        # fits the int32 row (10**10 overflowed inside the step, failing every request).
        temp[i], top_k[i], top_p[i] = p.temperature, min(p.top_k, self.cfg.vocab_size), p.top_p
        seed[i], counter[i] = p.seed % 2 ** 32, len(r.output)
        fed.append((at + i, r, n))
      arrays.append((tokens, start, n_valid, tables))
      for dst, x in zip(sampling, (temp, top_k, top_p, seed, counter)):
        dst.append(x)
      at += b
    sampling = tuple(np.concatenate(x) for x in sampling)
    draft = None
    if self.shape is not None:
      rows, n_tokens = groups[-1]
      slot = np.full((len(rows),), self.config.max_slots, np.int32)
      nxt = np.full((len(rows),), -1, np.int32)
      for i, r in enumerate(rows):
        if r is not None:
          slot[i] = r.slot
          end = r.num_computed + self._feed(r, n_tokens)
          if end < len(r.tokens):
            nxt[i] = r.tokens[end]
      draft = (self.dgraph, self.dstate, self.dcache, self.h_root, slot, nxt)
    self.cache, tok, logits, new_draft = run_step(
        self.graphdef, self.state, self.cache, tuple(arrays), sampling, draft, impl=self.impl,
        sample=bool(np.any(sampling[0] > 0)), with_logits=self.config.record_logits)
    if new_draft is not None:
      self.dcache, self.h_root = new_draft
    return tok, logits, fed

  def _run_spec(self, rows: list[_Request | None]):
    """One speculative round over `rows` (None: idle); returns (device new tokens [W, J],
    device accepted [W], device logits or None, [(row, request)])."""
    w, bs = len(rows), self.config.block_size
    active = [r for r in rows if r is not None]
    m = self._width(active, self.shape.depth + 1)
    slot = np.full((w,), self.config.max_slots, np.int32)
    root = np.zeros((w,), np.int32)
    start = np.zeros((w,), np.int32)
    limit = np.zeros((w,), np.int32)
    tables = np.full((w, m), NULL_BLOCK, np.int32)
    fed = []
    for i, r in enumerate(rows):
      if r is None:
        continue
      slot[i], root[i], start[i] = r.slot, r.tokens[r.num_computed], r.num_computed
      limit[i] = len(r.blocks) * bs
      tables[i, :len(r.blocks)] = r.blocks
      fed.append((i, r))
    (new_k, new_v, slots), new, acc, logits, (self.dcache, self.h_root) = spec_step(
        self.graphdef, self.state, self.dgraph, self.dstate, self.cache, self.dcache,
        self.h_root, slot, root, start, limit, tables, self.head, impl=self.impl,
        shape=self.shape, with_logits=self.config.record_logits)
    self.cache = commit_pages(self.cache, slots, new_k, new_v)
    return new, acc, logits, fed

  def step(self) -> list[RequestOutput]:
    """One engine step (module docstring); returns an output for every request that got
    tokens or finished."""
    decode, prefill, cp = self._schedule()
    outputs = []
    if cp is not None:      # dispatched first; its token is read after the step's
      self.cache, cp_tok, cp_logits = self.cp.run(self.cache, cp.tokens, cp.blocks, cp.params,
                                                  len(cp.output))
    if decode and self.shape is not None:
      width = next(w for w in self.batch_widths if w >= len(decode))
      new, acc, logits, fed = self._run_spec(decode + [None] * (width - len(decode)))
      new, acc = np.asarray(new), np.asarray(acc)
      logits = None if logits is None else np.asarray(logits)
      for i, req in fed:
        a = int(acc[i])
        req.num_computed += a + 1
        self.spec_rounds += 1
        self.spec_accepted += a
        outputs.append(self._after_tokens(
            req, [int(t) for t in new[i, :a + 1]],
            [None] * (a + 1) if logits is None else list(logits[i, :a + 1])))
      decode = []
    groups = []
    if decode:
      width = next(w for w in self.batch_widths if w >= len(decode))
      groups.append((decode + [None] * (width - len(decode)), 1))
    if prefill:
      rows = prefill + [None] * (self.config.prefill_rows - len(prefill))
      n = max(min(r.remaining, self.config.prefill_chunk) for r in prefill)
      groups.append((rows, next(c for c in self.chunk_widths if c >= n)))
    launched = ([self._run(groups)] if groups and (self.config.mixed_batch or len(groups) < 2)
                else [self._run([g]) for g in groups])
    for tok, logits, fed in launched:
      tok = np.asarray(tok)
      logits = None if logits is None else np.asarray(logits)
      for i, req, n in fed:
        req.num_computed += n
        if req.remaining > 0:          # a prompt chunk that does not end the prompt
          continue
        outputs.append(self._after_tokens(req, [int(tok[i])],
                                          [None if logits is None else logits[i]]))
    if cp is not None:
      cp.num_computed += cp.remaining
      outputs.append(self._after_tokens(cp, [int(np.asarray(cp_tok)[0])], [
          None if cp_logits is None else np.asarray(cp_logits)[0]]))
    self.steps += 1
    return outputs

  def _after_tokens(self, req: _Request, new: list[int], new_logits: list) -> RequestOutput:
    """Appends new tokens to a request's reply up to the first that finishes it."""
    p = req.params
    kept, delta, row_logits = [], "", []
    for tok, lg in zip(new, new_logits):
      req.output.append(tok)
      kept.append(tok)
      if lg is not None:
        req.logits.append(lg)
        row_logits.append(lg)
      if tok in p.stop_token_ids:
        req.finish_reason = "stop"
      elif len(req.output) >= p.max_tokens or len(req.tokens) >= self.max_len:
        req.finish_reason = "length"
      if req.reply is not None:
        delta += req.reply.update(req.output, final=req.finish_reason is not None)
        if req.reply.stopped:
          req.finish_reason = "stop"
      if req.finish_reason is not None:
        break
    if req.finish_reason is not None:
      self._release(req)
    return self._output(req, tuple(kept), delta, row_logits)

  def _output(self, req: _Request, new: tuple[int, ...], delta: str, row_logits) -> RequestOutput:
    return RequestOutput(req.id, new, tuple(req.output), delta,
                         req.reply.text if req.reply is not None else "",
                         req.finish_reason is not None, req.finish_reason, len(req.prompt),
                         tuple(row_logits))

  # --- conveniences

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[
      SamplingParams] = SamplingParams()) -> list[RequestOutput]:
    """Adds every prompt, steps until all finish; the final output of each, in order (with
    EngineConfig.record_logits, `logits` holds all of its tokens' logits)."""
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params) != len(prompts):
      raise ValueError(f"Engine.generate: {len(prompts)} prompts but {len(params)} "
                       "SamplingParams; expected one for every prompt (or a single one)")
    ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, logits = {}, {}
    while self.has_unfinished():
      for out in self.step():
        logits.setdefault(out.request_id, []).extend(out.logits)
        if out.finished:
          final[out.request_id] = out
    return [dataclasses.replace(final[i], logits=tuple(logits.get(i, ()))) for i in ids]

  def programs(self) -> list[tuple[tuple[tuple[int, int], ...], str]]:
    """The step shapes the engine runs: ((rows, tokens) per group, kind), kind "step"
    (decode, prefill or a mixed batch of decode rows and a prefill chunk), "spec" (a
    speculative round: rows only) or "cp" (a context-parallel prefill of one padded
    prompt)."""
    r = self.config.prefill_rows
    prefill = [((r, c),) for c in self.chunk_widths]
    if self.shape is not None:
      return [(((b, 1),), "spec") for b in self.batch_widths] + [(g, "step") for g in prefill]
    decode = [((b, 1),) for b in self.batch_widths]
    mixed = ([((b, 1), (r, c)) for b in self.batch_widths for c in self.chunk_widths]
             if self.config.mixed_batch else [])
    cp = [] if self.cp is None else [(((1, t),), "cp") for t in self.cp.widths]
    return [(g, "step") for g in decode + prefill + mixed] + cp

  def warmup(self, sample: bool = False, widths: Sequence[int] | None = None) -> int:
    """Compiles every step shape (`programs`) for every table width (or those given; greedy,
    and sampled too with `sample`) on idle rows, and every context-parallel prefill width;
    returns the number of programs."""
    n = 0
    if self.cp is not None:
      self.cache, n = self.cp.warmup(self.cache, sample)
    idle = self.config.max_slots
    for groups, kind in self.programs():
      for m in (self.widths if widths is None else widths) if kind != "cp" else ():
        rows = sum(b for b, _ in groups)
        if kind == "spec":
          z = np.zeros((rows,), np.int32)
          (new_k, new_v, slots), new, *_, (self.dcache, self.h_root) = spec_step(
              self.graphdef, self.state, self.dgraph, self.dstate, self.cache, self.dcache,
              self.h_root, z + idle, z, z, z, np.zeros((rows, m), np.int32), self.head,
              impl=self.impl, shape=self.shape, with_logits=self.config.record_logits)
          self.cache = commit_pages(self.cache, slots, new_k, new_v)
          np.asarray(new)
          n += 1
          continue
        for s in ((False, True) if sample else (False,)):
          z = np.zeros((rows,), np.int32)
          arrays = tuple((np.zeros((b, t), np.int32), np.zeros((b,), np.int32),
                          np.zeros((b,), np.int32), np.zeros((b, m), np.int32))
                         for b, t in groups)
          b = groups[-1][0]
          draft = (None if self.shape is None else
                   (self.dgraph, self.dstate, self.dcache, self.h_root,
                    np.full((b,), idle, np.int32), np.full((b,), -1, np.int32)))
          self.cache, tok, _, new_draft = run_step(
              self.graphdef, self.state, self.cache, arrays,
              (np.zeros((rows,), np.float32), z, np.ones((rows,), np.float32),
               np.zeros((rows,), np.uint32), z), draft,
              impl=self.impl, sample=s, with_logits=self.config.record_logits)
          if new_draft is not None:
            self.dcache, self.h_root = new_draft
          np.asarray(tok)
          n += 1
    return n

  def stats(self) -> dict:
    return {"running": len(self.running), "waiting": len(self.waiting),
            "pages_used": self.pool.num_used, "pages_free": self.pool.num_free,
            "steps": self.steps, "preemptions": self.preemptions,
            "finished": self.finished, "spec_rounds": self.spec_rounds,
            "spec_accepted": self.spec_accepted}
