"""Token sources for language-model training: a text file as one stream of tokens.

`TextSource` turns a local file into tokens, its bytes (vocab 256) or the ids of a
`llm.tokenizer` tokenizer (the whole file encoded as one text, no BOS), and serves
fixed-length windows. Like the rec sources it is resumable: batch k is a deterministic
function of (seed, k), so `batches(start=k)` after a restart yields exactly the batches the
uninterrupted run would have seen. The last `eval_fraction` of the tokens is held out and
served as contiguous, non-overlapping windows for evaluation.

Letters: B batch, T sequence length.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Iterator

import jax
import numpy as np

BYTE_VOCAB = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LMBatch:
  """Next-token training batch: predict targets_BT from inputs_BT; mask_BT marks real targets."""

  inputs: np.ndarray        # [B, T] int32
  targets: np.ndarray       # [B, T] int32
  mask: np.ndarray          # [B, T] float32 (0 on padding)
  positions: np.ndarray     # [B, T] int32
  segment_ids: np.ndarray   # [B, T] int32 (documents in a packed row; one segment here)


def _batch_from_windows(win_BT1: np.ndarray, mask_BT: np.ndarray | None = None) -> LMBatch:
  b, t1 = win_BT1.shape
  t = t1 - 1
  return LMBatch(
      inputs=win_BT1[:, :-1].astype(np.int32), targets=win_BT1[:, 1:].astype(np.int32),
      mask=np.ones((b, t), np.float32) if mask_BT is None else mask_BT,
      positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
      segment_ids=np.ones((b, t), np.int32))


class TextSource:
  """Random windows of `seq_len + 1` tokens from the train part of a file (resumable).

  `tokenizer` None: the file's bytes are the tokens (any file). Otherwise the file must be
  UTF-8 text, encoded once with `tokenizer.encode` (vocab_size = tokenizer.vocab_size).
  """

  def __init__(self, path: str, seq_len: int, batch_size: int, *, tokenizer=None,
               split: str = "train", eval_fraction: float = 0.05, seed: int = 0,
               eval_batches: int | None = None, shard_index: int = 0, num_shards: int = 1):
    if not os.path.isfile(path):
      raise FileNotFoundError(errno.ENOENT, "no such file (--text)", path)
    if split not in ("train", "eval"):
      raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
    if not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"eval_fraction={eval_fraction}: expected a value in (0, 1)")
    if tokenizer is None:
      data, unit, self.vocab_size = np.fromfile(path, dtype=np.uint8), "bytes", BYTE_VOCAB
    else:
      data = np.asarray(tokenizer.encode(read_text(path)), np.int32)
      unit, self.vocab_size = "tokens", tokenizer.vocab_size
    cut = int(len(data) * (1.0 - eval_fraction))
    self.tokens = data[:cut] if split == "train" else data[cut:]
    if len(self.tokens) < seq_len + 1:
      raise ValueError(
          f"{path}: the {split} part has {len(self.tokens)} {unit}, fewer than seq_len + 1 = "
          f"{seq_len + 1} (one window); use a longer file or a shorter --seq_len")
    if num_shards < 1 or not 0 <= shard_index < num_shards or batch_size % num_shards:
      raise ValueError(f"TextSource: shard {shard_index} of {num_shards} with batch_size="
                       f"{batch_size}: expected 0 <= shard < num_shards dividing the batch")
    self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
    self.split, self.seed, self.eval_batches = split, seed, eval_batches
    self.shard_index, self.num_shards = shard_index, num_shards

  def _share(self, b: LMBatch) -> LMBatch:
    """This shard's rows [i * n, (i + 1) * n) of a global batch (n = batch / shards)."""
    if self.num_shards == 1:
      return b
    n = self.batch_size // self.num_shards
    rows = slice(self.shard_index * n, (self.shard_index + 1) * n)
    return jax.tree.map(lambda x: x[rows], b)

  def batch(self, k: int) -> LMBatch:
    """Train batch number k: uniform random windows drawn from (seed, k) (this shard's
    rows of it)."""
    rng = np.random.default_rng([self.seed, k])
    # Windows of seq_len + 1 tokens start at 0 .. len - seq_len - 1, the last one ending on
    # the last token (integers' high is exclusive).
    starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
    idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
    return self._share(_batch_from_windows(self.tokens[idx]))

  def batches(self, start: int = 0) -> Iterator[LMBatch]:
    if self.split == "train":
      k = start
      while True:
        yield self.batch(k)
        k += 1
    else:
      yield from self._eval_batches()

  def _eval_batches(self) -> Iterator[LMBatch]:
    """Contiguous windows covering the held-out tokens: every token after the first is a
    target exactly once (up to `eval_batches` batches). The last window may be short and
    the last batch may have empty rows: both are padded with zeros and masked."""
    t1, n = self.seq_len + 1, len(self.tokens)
    windows = [self.tokens[s:s + t1] for s in range(0, n - 1, self.seq_len)]
    if self.eval_batches is not None:
      windows = windows[:self.eval_batches * self.batch_size]
    for i in range(0, len(windows), self.batch_size):
      win = np.zeros((self.batch_size, t1), self.tokens.dtype)
      mask = np.zeros((self.batch_size, self.seq_len), np.float32)
      for r, w in enumerate(windows[i:i + self.batch_size]):
        win[r, :len(w)] = w
        mask[r, :len(w) - 1] = 1.0
      yield self._share(_batch_from_windows(win, mask))


# Byte-level text: a TextSource without a tokenizer.
ByteTextSource = TextSource


def read_text(path: str) -> str:
  """The file as UTF-8 text; an invalid byte is an error naming the file and offset."""
  with open(path, "rb") as fh:
    data = fh.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: byte {e.start} (0x{data[e.start]:02X}) is not UTF-8 "
                     f"({e.reason}); a tokenizer needs UTF-8 text") from None
