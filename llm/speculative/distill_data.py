"""Data for training the EAGLE draft head by self-distillation (arXiv 2401.15077).

Sequences the target itself generates (`generate_sequences`: sampled from given prompts,
by default the BOS token, e.g. chat requests, ending at stop ids), so the head learns the
target's own continuations. The target's features f_i (final hidden states, post-norm) are
captured as it generates the sequences (`llm.generate.generate_with_hidden`: no second
forward pass), or computed once per sequence (`target_features`) for sequences made without
them, and ride with the batches (`SequenceSource`: resumable train batches, padded eval
batches). `draft_vocab`: the draft's output vocabulary (EAGLE-3, arXiv 2503.01840), the
most frequent tokens of the training sequences.

Letters: B batch, T tokens, D model dim.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm.generate import generate, generate_with_hidden
from llm.model import Llama


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
  fn = jax.jit(split_target_features, static_argnums=(0, 3))
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


def split_target_features(graphdef, state, tokens_BT, taps=()):
  """The target's features [B,T,D] of tokens_BT (and, with `taps`, its states after those
  blocks), from the target split into graphdef and state (jit with both static: 0, 3)."""
  target = nnx.merge(graphdef, state)
  out = target.hidden(target.embed_tokens(tokens_BT), taps=taps)
  return (out[0], out[2]) if taps else out[0]

