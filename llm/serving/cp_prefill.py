"""Context-parallel prefill of long prompts for the serving engine (`EngineConfig.cp_prefill_min`;
ring attention, arXiv 2411.01783): a request whose prompt still to prefill has at least
cp_prefill_min tokens is prefilled in one engine step over a mesh's `cp` axis instead of in
prefill_chunk-sized chunks over the paged pool.

    engine = Engine(model, EngineConfig(cp_prefill_min=256), mesh=mesh_for("cp:4"))

The prompt, right-padded to a bucketed length T (one of `widths`: powers of two >=
cp_prefill_min, each a multiple of 2N so the causal load-balanced layout applies, the
largest covering max_model_len), runs through the model's own context-parallel path under
`jax.set_mesh(mesh)` (`Llama.hidden` with a fresh dense `KVCache` of T slots, T/N per rank;
the variant is the model's cfg.context_parallel, "pass_kv" for a model without one). The
dense cache's `pos` says which position each slot holds, so every slot holding a prompt
token maps to its page slot through the request's block table (slot = position); the
keys and values of every layer go to the pool's device and `commit_pages` writes them there.
The first new token is sampled from the last prompt token's logits as the engine's own
prefill samples it (per-row key fold_in(key(seed), i), `programs._sample_rows`), and the
request goes on as a decode row. One program per width (and greedy / sampled) compiles.

The mesh holds its own copy of the weights (replicated over its devices), next to the
engine's on the pool's device. Not with speculative_tree (the draft head would also need
the prompt's pairs).

Letters: T padded prompt tokens, S dense cache slots (= T), M pages per row (the engine's
most), N cp ranks, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llm.model import CP_AXIS
from llm.serving.paged import NULL_BLOCK, PagedCache, commit_pages, flat_slots
from llm.serving.programs import _sample_rows


def mesh_for(spec: str):
  """The mesh of a --mesh setting over the first devices it needs ("" : None)."""
  if not spec:
    return None
  from core import mesh as mesh_lib
  axes = mesh_lib.parse_mesh(spec)
  devices = jax.devices()
  if all(n != -1 for _, n in axes):
    devices = devices[:min(len(devices), math.prod(n for _, n in axes))]
  return mesh_lib.make_mesh(spec, devices)


def cp_widths(minimum: int, max_len: int, n: int) -> tuple[int, ...]:
  """Padded prompt lengths: powers of two from `minimum` up, each rounded up to a multiple of
  2n, the last the first that holds max_len tokens."""
  up = lambda w: -(-w // (2 * n)) * 2 * n  # noqa: E731
  widths, w = [], 1
  while w < max(minimum, 1):
    w *= 2
  while not widths or widths[-1] < max_len:
    widths.append(min(up(w), up(max_len)))
    w *= 2
  return tuple(sorted(set(widths)))


def _prefill(graphdef, state, tokens_1T, length_1, table_1M, sampling, *, block_size: int,
             num_blocks: int, sample: bool, with_logits: bool):
  """One prompt through the model (context parallel under the caller's mesh) into a fresh
  dense cache of T slots. Returns ((keys, values per layer [1, S, G, K], their flat pool
  slots [1, S]: N*P for an empty slot), token [1], logits [1, V] or None)."""
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(1, tokens_1T.shape[1])
  h_1TD, cache = model.hidden(model.embed_tokens(tokens_1T), cache=cache, lengths_B=length_1,
                              fresh_cache=True)
  last = jnp.maximum(length_1 - 1, 0)[:, None, None]
  logits_1V = model.logits(jnp.take_along_axis(h_1TD, last, axis=1))[:, 0]
  tok_1 = (_sample_rows(logits_1V, *sampling) if sample
           else jnp.argmax(logits_1V, axis=-1).astype(jnp.int32))
  slots_1S = flat_slots(table_1M, cache.pos, cache.pos < length_1[:, None], block_size,
                        num_blocks)
  return (cache.k, cache.v, slots_1S), tok_1, (logits_1V if with_logits else None)


prefill = jax.jit(_prefill, static_argnames=("graphdef", "block_size", "num_blocks", "sample",
                                              "with_logits"))


class CPPrefill:
  """The engine's context-parallel prefill: the model over `mesh` (its variant, its own copy
  of the weights), the widths, and `run` (one request's prompt into its pages)."""

  def __init__(self, model, mesh, *, minimum: int, max_len: int, max_pages: int,
               with_logits: bool):
    cfg = model.cfg
    variant = cfg.context_parallel if cfg.context_parallel != "none" else "pass_kv"
    cp_model = nnx.merge(*nnx.split(model))       # new modules, the same arrays
    cp_cfg = cfg.replace(context_parallel=variant)
    for _, module in nnx.iter_modules(cp_model):
      if getattr(module, "cfg", None) is not None:
        module.cfg = cp_cfg
    self.graphdef, state = nnx.split(cp_model)
    self.state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    self.mesh, self.n, self.variant = mesh, mesh.shape[CP_AXIS], variant
    self.widths = cp_widths(minimum, max_len, self.n)
    self.max_pages, self.with_logits = max_pages, with_logits
    self.vocab_size = cfg.vocab_size      # top_k past it: every token (engine._run's clip)
    self.calls = 0

  def _launch(self, cache: PagedCache, tokens, blocks, sampling, sample: bool, t: int = 0):
    n = len(tokens)
    t = t or next(w for w in self.widths if w >= n)
    tokens_1T = np.zeros((1, t), np.int32)
    tokens_1T[0, :n] = tokens
    table_1M = np.full((1, self.max_pages), NULL_BLOCK, np.int32)
    table_1M[0, :len(blocks)] = blocks
    with jax.set_mesh(self.mesh):
      (k, v, slots), tok, logits = prefill(
          self.graphdef, self.state, tokens_1T, np.asarray([n], np.int32), table_1M,
          sampling, block_size=cache.block_size, num_blocks=cache.num_blocks, sample=sample,
          with_logits=self.with_logits)
    # The pool's device takes the keys and values (every layer's) and their slots.
    to_pool = lambda x: jax.device_put(x, cache.k[0].sharding)  # noqa: E731
    cache = commit_pages(cache, to_pool(slots), to_pool(k), to_pool(v))
    return cache, tok, logits

  def run(self, cache: PagedCache, tokens, blocks, params, counter: int):
    """Prefills `tokens` (positions 0..) into the pages `blocks` (enough for all of them)
    and samples the next token (the request's token `counter`) with SamplingParams
    `params`. Returns (cache, device token [1], device logits [1, V] or None)."""
    sampling = (np.asarray([params.temperature], np.float32),
                np.asarray([min(params.top_k, self.vocab_size)], np.int32),
                np.asarray([params.top_p], np.float32),
                np.asarray([params.seed % 2 ** 32], np.uint32),
                np.asarray([counter], np.int32))
    self.calls += 1
    return self._launch(cache, tokens, blocks, sampling, params.temperature > 0)

  def warmup(self, cache: PagedCache, sample: bool = False) -> tuple[PagedCache, int]:
    """Compiles every width (greedy, and sampled too with `sample`) on an empty prompt
    (nothing written); returns (cache, the number of programs)."""
    n = 0
    sampling = (np.zeros((1,), np.float32), np.zeros((1,), np.int32),
                np.ones((1,), np.float32), np.zeros((1,), np.uint32), np.zeros((1,), np.int32))
    for t in self.widths:
      for s in ((False, True) if sample else (False,)):
        cache, tok, _ = self._launch(cache, [], [], sampling, s, t)
        np.asarray(tok)
        n += 1
    return cache, n


def make(model, config, mesh, *, max_len: int, max_pages: int) -> CPPrefill | None:
  """The engine's `CPPrefill` for EngineConfig `config` and `mesh` (None without
  cp_prefill_min); raises ValueError for a setting it cannot serve."""
  m = config.cp_prefill_min
  if not m:
    if mesh is not None:
      raise ValueError("Engine: mesh= without cp_prefill_min; the mesh serves only the "
                       "context-parallel prefill of long prompts (set cp_prefill_min > 0)")
    return None
  if config.speculative_tree:
    raise ValueError(f"Engine: cp_prefill_min={m} with speculative_tree="
                     f"{config.speculative_tree!r}; the context-parallel prefill does not "
                     "feed the draft head the prompt's pairs (set cp_prefill_min=0)")
  n = 0 if mesh is None or CP_AXIS not in mesh.axis_names else mesh.shape[CP_AXIS]
  if n < 2:
    got = "no mesh" if mesh is None else f"a mesh of axes {dict(mesh.shape)}"
    raise ValueError(f"Engine: cp_prefill_min={m} needs mesh=, a jax Mesh with a {CP_AXIS!r} "
                     f"axis of N > 1 devices (e.g. core.mesh.make_mesh('cp:4', "
                     f"jax.devices()[:4]); --mesh=cp:4); got {got}")
  return CPPrefill(model, mesh, minimum=m, max_len=max_len, max_pages=max_pages,
                   with_logits=config.record_logits)
