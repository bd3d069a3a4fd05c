"""Packed micro-batches as token rows: segment ids, positions, targets (arXiv 2503.17924).

`to_lm_batch(docs, rows, seq_len)` lays each row's documents end to end:
  inputs       the documents' tokens, then padding (token 0)
  targets      the next token of the same document; the last token of a document has none
  mask         1 where a target exists (never across documents, never on padding)
  segment_ids  1, 2, ... per document in row order; 0 on padding
  positions    0 .. l-1 within each document (RoPE and the causal rule restart per
               document); padding counts 0 .. on as if it were one more document
With document masking (query t sees key s iff same segment and position s <= t, the rule of
every `llm.attention` implementation) a packed row computes each document exactly as if it
were alone, so the loss sum and its gradients equal those of the documents one by one.
`unpack_rows` reads the documents back; `row_documents` gives a row's (segment, length) runs;
`row_segments` gives a row's segment ids and positions from document lengths alone.

Letters: B rows, T tokens per row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from llm.data import LMBatch


def to_lm_batch(docs: Sequence[np.ndarray], rows: Sequence[Sequence[int]],
                seq_len: int) -> LMBatch:
  """One row per micro-batch of `rows` (document indices into `docs`, in placement order)."""
  b = len(rows)
  inputs = np.zeros((b, seq_len), np.int32)
  targets = np.zeros((b, seq_len), np.int32)
  mask = np.zeros((b, seq_len), np.float32)
  seg = np.zeros((b, seq_len), np.int32)
  pos = np.zeros((b, seq_len), np.int32)
  for r, row in enumerate(rows):
    total = sum(len(docs[i]) for i in row)
    if total > seq_len:
      raise ValueError(f"to_lm_batch: row {r} holds documents {list(row)[:8]} of "
                       f"{total} tokens, more than seq_len={seq_len}")
    o = 0
    for s, i in enumerate(row, start=1):
      d = np.asarray(docs[i])
      l = len(d)
      if l == 0:
        raise ValueError(f"to_lm_batch: document {i} (row {r}) is empty")
      inputs[r, o:o + l] = d
      targets[r, o:o + l - 1] = d[1:]
      mask[r, o:o + l - 1] = 1.0
      seg[r, o:o + l] = s
      pos[r, o:o + l] = np.arange(l)
      o += l
    pos[r, o:] = np.arange(seq_len - o)
  return LMBatch(inputs=inputs, targets=targets, mask=mask, positions=pos, segment_ids=seg)


def row_segments(doc_lengths: Sequence[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment ids [T], positions [T]) of a row holding documents of these lengths, as
  `to_lm_batch` lays it out."""
  lengths = np.asarray(doc_lengths, np.int64)
  total = int(lengths.sum())
  if total > seq_len or np.any(lengths < 1):
    raise ValueError(f"row_segments: documents of lengths {lengths[:8].tolist()}... ({total} "
                     f"tokens) in a row of {seq_len}; expected lengths >= 1 summing to <= it")
  seg = np.zeros(seq_len, np.int32)
  seg[:total] = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
  starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
  pos = np.empty(seq_len, np.int32)
  pos[:total] = np.arange(total) - starts
  pos[total:] = np.arange(seq_len - total)
  return seg, pos


def row_documents(segment_ids_T: np.ndarray) -> list[tuple[int, int]]:
  """[(segment id, length)] of a packed row's documents in order (padding, id 0, left out);
  a segment id in two separate runs is an error naming it."""
  s = np.asarray(segment_ids_T)
  if s.size == 0:
    return []
  starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
  ends = np.concatenate([starts[1:], [s.size]])
  runs = [(int(s[a]), int(e - a)) for a, e in zip(starts, ends) if s[a] != 0]
  ids = [i for i, _ in runs]
  if len(set(ids)) != len(ids):
    dup = next(i for i in ids if ids.count(i) > 1)
    raise ValueError(f"row_documents: segment id {dup} appears in two separate runs; expected "
                     "each document's tokens contiguous (a packed row in natural order)")
  return runs


def unpack_rows(batch: LMBatch) -> list[list[np.ndarray]]:
  """Per row, each document's tokens (ordered by position), in order of segment id."""
  out = []
  for r in range(batch.inputs.shape[0]):
    seg, pos, tok = (np.asarray(batch.segment_ids[r]), np.asarray(batch.positions[r]),
                     np.asarray(batch.inputs[r]))
    docs = []
    for s in sorted(set(seg[seg != 0].tolist())):
      idx = np.flatnonzero(seg == s)
      docs.append(tok[idx[np.argsort(pos[idx], kind="stable")]])
    out.append(docs)
  return out
