"""The serving engine's settings, each defined once (`core.config.setting`), and
`EngineConfig`, the typed config `experiments.serve` and `experiments.serve_bench` build
from their flags (`core.config.define_flags(EngineConfig)` / `from_flags`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from core import config

MAX_SLOTS = config.setting(
    "max_slots", "integer", "Requests the serving engine decodes together: the rows of its "
    "decode step (a fixed batch width; requests join and leave it at every step).", lower=1)
BLOCK_SIZE = config.setting(
    "block_size", "integer", "Token slots per page of the paged KV cache (the Pallas kernel "
    "takes powers of two >= 16).", lower=1)
NUM_BLOCKS = config.setting(
    "num_blocks", "integer", "Pages in the KV cache pool, shared by all requests (default: "
    "enough for --max_slots requests of --max_model_len tokens, and the padding page).",
    lower=2, none_ok=True)
MAX_MODEL_LEN = config.setting(
    "max_model_len", "integer", "Most tokens (prompt + reply) of one request (default: the "
    "model's max_seq_len).", lower=1, none_ok=True)
PREFILL_CHUNK = config.setting(
    "prefill_chunk", "integer", "Prompt tokens of one request prefilled per engine step "
    "(chunked prefill, interleaved with the running requests' decode steps).", lower=1)
PREFILL_ROWS = config.setting(
    "prefill_rows", "integer", "Requests whose prompt chunks are prefilled together in one "
    "engine step.", lower=1)
PAGED_ATTENTION = config.setting(
    "paged_attention", "enum", "Attention over the KV cache pages: xla (each row's pages "
    "gathered, then the jnp reference), pallas (the kernel of kernels/paged_attention.py), "
    "auto (pallas on a GPU, else xla).", choices=("auto", "xla", "pallas"))
MIXED_BATCH = config.setting(
    "mixed_batch", "bool", "Run a step's decode rows and its prefill chunk as one forward pass "
    "(one read of the weights; vLLM / Sarathi's mixed batch) instead of two.")
SPECULATIVE_TREE = config.setting(
    "speculative_tree", "string", "EAGLE draft-tree shape TOP_K:DEPTH:BUDGET (or chain:D) of "
    "a speculative engine: each running request drafts its tree with the draft head and the "
    "batch verifies all trees in one pass (greedy requests only); empty: plain decoding.")

CP_PREFILL_MIN = config.setting(
    "cp_prefill_min", "integer", "Prompts with at least this many tokens to prefill are "
    "prefilled in one engine step through the model's context-parallel path (ring "
    "attention, arXiv 2411.01783) over --mesh (a cp axis of more than one device; variant: "
    "the model's context_parallel, else pass_kv), padded to a power of two (a multiple of "
    "2 * cp), instead of in --prefill_chunk chunks; 0: off. Not with --speculative_tree.",
    lower=0)


def _widths_text(text: str) -> tuple[int, ...]:
  try:
    widths = tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    raise ValueError("not a comma-separated list of integers") from None
  if any(w < 1 for w in widths):
    raise ValueError("widths must be >= 1")
  return widths


CHUNK_WIDTHS = config.setting(
    "chunk_widths", "string", "Prefill chunk widths (tokens) the steps compile for, "
    "comma-separated, the largest >= --prefill_chunk; a chunk runs in the narrowest that holds "
    "it (empty: powers of two from 16 up to --prefill_chunk).", parse=_widths_text,
    format=lambda widths: ",".join(str(w) for w in widths))
DRAFT = config.setting(
    "draft", "string", "EAGLE draft head of a speculative engine (--speculative_tree): a "
    "draft-head training run's workdir (experiments.spec_decode's <workdir>/draft), or "
    "'random' for an untrained head (nothing accepted: the rounds' cost alone).")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Shapes and limits of a serving engine (`llm.serving.engine.Engine`). Every jitted
  shape follows from them: a decode step of [W, 1] tokens, W one of `batch_widths` (default:
  powers of two up to max_slots, so a lightly loaded engine runs narrow steps) and a prefill
  step of [prefill_rows, C], C one of `chunk_widths` (default: powers of two from 16 up to
  prefill_chunk, so a short prompt is not padded to a whole chunk), each with block tables
  of one of `table_widths` pages (default: powers of two from 4 up to a request's most
  pages, so short requests gather few); with `mixed_batch`, a step of decode rows and a
  prefill chunk is one program per (W, C, table width). `speculative_tree`: decode rows run
  EAGLE rounds of that tree shape (the engine then needs a draft head). `cp_prefill_min`: a
  prompt of at least that many tokens is prefilled whole in one context-parallel program
  (the engine then needs a mesh with a cp axis; one program per padded length: powers of
  two from cp_prefill_min up to max_model_len, multiples of 2 * cp)."""

  max_slots: int = MAX_SLOTS.field(8)
  block_size: int = BLOCK_SIZE.field(16)
  num_blocks: int | None = NUM_BLOCKS.field(None)
  max_model_len: int | None = MAX_MODEL_LEN.field(None)
  prefill_chunk: int = PREFILL_CHUNK.field(64)
  prefill_rows: int = PREFILL_ROWS.field(1)
  paged_attention: str = PAGED_ATTENTION.field("auto")
  mixed_batch: bool = MIXED_BATCH.field(True)
  speculative_tree: str = SPECULATIVE_TREE.field("")
  cp_prefill_min: int = CP_PREFILL_MIN.field(0)
  chunk_widths: tuple[int, ...] = CHUNK_WIDTHS.field(())
  # Not flags: decode batch widths and table widths (pages per row) the steps compile for
  # (empty: powers of two), and whether each sampled token's logits come back to the host
  # (tests, studies).
  batch_widths: tuple[int, ...] = ()
  table_widths: tuple[int, ...] = ()
  record_logits: bool = False


def chunk_widths_for(prompt_lens: Sequence[int], prefill_chunk: int) -> tuple[int, ...]:
  """The prefill chunk widths that the default ones (powers of two from 16 up to
  prefill_chunk) give the chunks of prompts of these lengths, and prefill_chunk: an
  EngineConfig.chunk_widths that compiles only the programs those prompts use."""
  buckets, w = [], min(16, prefill_chunk)
  while w < prefill_chunk:
    buckets.append(w)
    w *= 2
  buckets.append(prefill_chunk)
  sizes = {min(prefill_chunk, p - k) for p in prompt_lens for k in range(0, p, prefill_chunk)}
  return tuple(sorted({next(b for b in buckets if b >= n) for n in sizes} | {prefill_chunk}))
