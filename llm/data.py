"""Token sources for language-model training: byte-level text files.

`ByteTextSource` turns a local text (or any) file into byte tokens (vocab 256) and serves
fixed-length windows. Like the rec sources it is resumable: batch k is a deterministic
function of (seed, k), so `batches(start=k)` after a restart yields exactly the batches the
uninterrupted run would have seen. The last `eval_fraction` of the file is held out and
served as contiguous, non-overlapping windows for evaluation.

Letters: B batch, T sequence length.
"""

from __future__ import annotations

import dataclasses
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


class ByteTextSource:
  """Random windows of `seq_len + 1` bytes from the train part of a file (resumable)."""

  def __init__(self, path: str, seq_len: int, batch_size: int, *, split: str = "train",
               eval_fraction: float = 0.05, seed: int = 0, eval_batches: int | None = None):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--text={path!r}: no such file")
    if split not in ("train", "eval"):
      raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
    if not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"eval_fraction={eval_fraction}: expected a value in (0, 1)")
    data = np.fromfile(path, dtype=np.uint8)
    cut = int(len(data) * (1.0 - eval_fraction))
    self.tokens = data[:cut] if split == "train" else data[cut:]
    if len(self.tokens) < seq_len + 2:
      raise ValueError(
          f"{path}: the {split} part has {len(self.tokens)} bytes, fewer than seq_len + 2 = "
          f"{seq_len + 2}; use a longer file or a shorter --seq_len")
    self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
    self.split, self.seed, self.eval_batches = split, seed, eval_batches
    self.vocab_size = BYTE_VOCAB

  def batch(self, k: int) -> LMBatch:
    """Train batch number k: uniform random windows drawn from (seed, k)."""
    rng = np.random.default_rng([self.seed, k])
    starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
    idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
    return _batch_from_windows(self.tokens[idx])

  def batches(self, start: int = 0) -> Iterator[LMBatch]:
    if self.split == "train":
      k = start
      while True:
        yield self.batch(k)
        k += 1
    else:
      yield from self._eval_batches()

  def _eval_batches(self) -> Iterator[LMBatch]:
    """Contiguous windows covering the held-out bytes; the last batch is padded and masked."""
    t1 = self.seq_len + 1
    n_win = (len(self.tokens) - 1) // self.seq_len
    windows = [self.tokens[i * self.seq_len:i * self.seq_len + t1] for i in range(n_win)
               if i * self.seq_len + t1 <= len(self.tokens)]
    if self.eval_batches is not None:
      windows = windows[:self.eval_batches * self.batch_size]
    for i in range(0, len(windows), self.batch_size):
      chunk = windows[i:i + self.batch_size]
      real = len(chunk)
      win = np.stack(chunk + [np.zeros(t1, np.uint8)] * (self.batch_size - real))
      mask = np.zeros((self.batch_size, self.seq_len), np.float32)
      mask[:real] = 1.0
      yield _batch_from_windows(win, mask)


def encode_text(text: str) -> list[int]:
  return list(text.encode("utf-8"))


def decode_bytes(ids) -> str:
  return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
