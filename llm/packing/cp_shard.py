"""Per-document context-parallel sharding and the adaptive choice (arXiv 2503.17924, Sec. 5).

Per-sequence sharding (arXiv 2411.01783, `llm.attention.layout.load_balance`) cuts a packed
row into 2N chunks and gives rank i chunks i and 2N-1-i. That balances one causal sequence,
but a packed row of several documents is not one: a rank whose chunks hold the late tokens of
a long document does far more work than one holding short documents. Per-document sharding
cuts every document into 2N chunks and gives rank i chunks i and 2N-1-i of each (head and
tail), so every rank gets the same share of every document's causal work. Chunk sizes differ
by at most one token: the l mod 2N extra tokens of a document go to the ranks with the fewest
tokens so far, so rank token counts never differ by more than one and padding (T - sum l
tokens) fills each rank to T/N.

Layouts are token orders: `order[j]` is the natural-order index of the token in slot j, and a
cp-sharded array split contiguously gives rank r slots [r T/N, (r+1) T/N). Attention masks by
segment ids and positions that travel with the tokens, so any order is exact
(`llm.attention.ring`). The Llama model applies `load_balance` itself when T is a multiple of
2N; `layout_batch` composes with that (`host_order`) so that the ranks end up holding the
chosen layout.

The adaptive choice (the paper's per-batch selection): per-document sharding balances work
but cuts short documents into chunks smaller than a kernel tile, which wastes tile work.
`TileModel` estimates each rank's attention time as the (query tile, key tile) pairs a
block-skipping kernel visits (the rule of `kernels.flash_attention_mgpu.classify_blocks`:
per-tile min / max of segment ids and positions; FULL and PARTIAL tiles cost, EMPTY ones not),
summed over the ring's N key blocks; `choose_layout` takes the layout whose slowest rank is
faster. `rank_pairs` counts exactly visible (query, key) pairs per rank: the FLOP balance.

Letters: B rows, T tokens per row, N cp ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from llm.attention import layout
from llm.data import LMBatch
from llm.packing.batch import row_documents

LAYOUTS = ("sequence", "document", "adaptive")


def per_sequence_order(t: int, n: int) -> np.ndarray:
  """[t] the load-balanced order of a row of t tokens (t a multiple of 2n)."""
  return layout.load_balance(np.arange(t, dtype=np.int64)[None], n, axis=1)[0]


def per_document_order(doc_lengths: Sequence[int], t: int, n: int) -> np.ndarray:
  """[t] per-document order of a row holding documents of these lengths in natural order
  from index 0, then t - sum padding tokens (t a multiple of n, sum <= t)."""
  lengths = [int(l) for l in doc_lengths]
  total = sum(lengths)
  if t % n or total > t or any(l < 1 for l in lengths):
    raise ValueError(f"per_document_order: {len(lengths)} documents of {total} tokens in a row "
                     f"of t={t} over n={n} ranks; expected t a multiple of n, documents of "
                     ">= 1 token and at most t tokens in all")
  per = t // n
  counts = np.zeros(n, np.int64)
  parts: list[list[np.ndarray]] = [[] for _ in range(n)]
  offset = 0
  for l in lengths:
    q, r = divmod(l, 2 * n)
    extra = np.zeros(n, np.int64)
    fewest = np.argsort(counts, kind="stable")
    if r <= n:
      extra[fewest[:r]] = 1
    else:
      extra[:] = 1
      extra[fewest[:r - n]] = 2
    head = q + (extra >= 1)
    tail = q + (extra == 2)
    sizes = np.concatenate([head, tail[::-1]])     # chunks 0..2n-1 in document order
    starts = offset + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for i in range(n):
      parts[i].append(np.arange(starts[i], starts[i] + head[i]))
      c = 2 * n - 1 - i
      parts[i].append(np.arange(starts[c], starts[c] + tail[i]))
    counts += head + tail
    offset += l
  pad = np.arange(total, t)
  out, used = [], 0
  for i in range(n):
    k = per - int(counts[i])
    out += parts[i] + [pad[used:used + k]]
    used += k
  order = np.concatenate(out).astype(np.int64)
  assert order.shape == (t,) and used == pad.size
  return order


def host_order(order: np.ndarray, n: int, model_balances: bool) -> np.ndarray:
  """The order to give a model that applies `layout.load_balance` on entry (when
  model_balances) so that its ranks hold `order`: unload_balance(order)."""
  return layout.unload_balance(order[None], n, axis=1)[0] if model_balances else order


def rank_pairs(seg_T: np.ndarray, pos_T: np.ndarray, order: np.ndarray, n: int) -> np.ndarray:
  """[n] visible (query, key) pairs of each rank's queries under causal document masking
  (pos + 1 per real token; padding, segment 0, does none)."""
  w = np.where(np.asarray(seg_T) != 0, np.asarray(pos_T, np.int64) + 1, 0)[order]
  return w.reshape(n, -1).sum(axis=1)


def imbalance(x) -> float:
  x = np.asarray(x, np.float64)
  return float(x.max() / x.mean()) if x.mean() > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class TileModel:
  """Attention time of a block-skipping kernel, in units of one FULL tile: per rank, the sum
  over the N ring steps of full * #FULL + partial * #PARTIAL (query tile x key tile) pairs.
  Tile sizes are those of the Mosaic GPU kernel's forward (a CTA covers 2 x 64 query rows,
  key blocks of 128); `partial` > 1 charges the mask of partly visible tiles."""

  tile_q: int = 128
  tile_kv: int = 128
  full: float = 1.0
  partial: float = 1.0


def _tiles(x: np.ndarray, tile: int, fill) -> np.ndarray:
  pad = (-x.size) % tile
  return np.concatenate([x, np.full(pad, fill, x.dtype)]).reshape(-1, tile)


def rank_tile_costs(seg_T: np.ndarray, pos_T: np.ndarray, order: np.ndarray, n: int,
                    model: TileModel = TileModel()) -> np.ndarray:
  """[n] estimated attention time of each rank (TileModel units) for a row laid out in
  `order`: its queries against every rank's keys, tiles classified by min / max."""
  seg = np.asarray(seg_T, np.int64)[order].reshape(n, -1)
  pos = np.asarray(pos_T, np.int64)[order].reshape(n, -1)
  big = np.iinfo(np.int64).max // 4
  # Tile padding can never be visible: queries get segment -1, keys -2 and far positions.
  qs, qp = [_tiles(seg[r], model.tile_q, -1) for r in range(n)], [
      _tiles(pos[r], model.tile_q, -big) for r in range(n)]
  ks, kp = [_tiles(seg[r], model.tile_kv, -2) for r in range(n)], [
      _tiles(pos[r], model.tile_kv, big) for r in range(n)]
  k_lo = np.concatenate([k.min(1) for k in ks])[None]
  k_hi = np.concatenate([k.max(1) for k in ks])[None]
  kp_lo = np.concatenate([k.min(1) for k in kp])[None]
  kp_hi = np.concatenate([k.max(1) for k in kp])[None]
  out = np.zeros(n)
  for r in range(n):
    q_lo, q_hi = qs[r].min(1)[:, None], qs[r].max(1)[:, None]
    qp_lo, qp_hi = qp[r].min(1)[:, None], qp[r].max(1)[:, None]
    empty = (k_hi < q_lo) | (k_lo > q_hi) | (kp_lo > qp_hi)
    full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo) & (kp_hi <= qp_lo)
    n_full = int(np.sum(full & ~empty))
    n_part = int(np.sum(~full & ~empty))
    out[r] = model.full * n_full + model.partial * n_part
  return out


def row_layout(seg_T: np.ndarray, t: int, n: int, mode: str) -> np.ndarray:
  """The order of one packed row (natural order) for mode "sequence" | "document"."""
  if mode == "sequence":
    return per_sequence_order(t, n)
  if mode == "document":
    return per_document_order([l for _, l in row_documents(seg_T)], t, n)
  raise ValueError(f"row_layout: mode={mode!r}, expected 'sequence' or 'document'")


def choose_layout(segment_ids_BT: np.ndarray, positions_BT: np.ndarray, n: int,
                  model: TileModel = TileModel()) -> tuple[str, dict[str, float]]:
  """The paper's adaptive selection for one batch: the layout ("sequence" | "document")
  whose slowest rank has the smaller estimated attention time (rows of a batch share the
  kernel call, so rank times add over rows). Returns (choice, {layout: estimate})."""
  seg, pos = np.asarray(segment_ids_BT), np.asarray(positions_BT)
  if seg.shape[1] % (2 * n):
    raise ValueError(f"choose_layout: rows of T={seg.shape[1]} tokens over n={n} ranks; the "
                     f"adaptive choice weighs per-sequence sharding, which needs T a multiple "
                     f"of 2*{n} (use the 'document' layout for this T)")
  est = {}
  for mode in ("sequence", "document"):
    total = np.zeros(n)
    for r in range(seg.shape[0]):
      total += rank_tile_costs(seg[r], pos[r], row_layout(seg[r], seg.shape[1], n, mode), n,
                               model)
    est[mode] = float(total.max())
  return min(est, key=lambda m: (est[m], m != "sequence")), est


def layout_batch(batch: LMBatch, n: int, mode: str = "adaptive", *,
                 model_balances: bool | None = None,
                 tile_model: TileModel = TileModel()) -> tuple[LMBatch, np.ndarray, str]:
  """The packed batch (natural order) reordered for CP over n ranks with `mode`
  ("sequence" | "document" | "adaptive"). model_balances: whether the consumer applies
  `load_balance` on entry (None: T % 2n == 0, the Llama model's rule; False for a direct
  ring_attention call). Returns (batch, orders [B,T] applied to every array, chosen mode);
  `restore_order` puts per-token outputs back in natural order."""
  if mode not in LAYOUTS:
    raise ValueError(f"layout_batch: mode={mode!r}, expected one of {LAYOUTS}")
  seg, pos = np.asarray(batch.segment_ids), np.asarray(batch.positions)
  b, t = seg.shape
  balances = (t % (2 * n) == 0) if model_balances is None else model_balances
  if mode == "adaptive":
    mode, _ = choose_layout(seg, pos, n, tile_model)
  if mode == "sequence" and t % (2 * n):
    raise ValueError(f"layout_batch: per-sequence sharding of T={t} needs a multiple of "
                     f"2*{n}")
  orders = np.stack([host_order(row_layout(seg[r], t, n, mode), n, balances)
                     for r in range(b)])
  take = lambda a: np.take_along_axis(np.asarray(a), orders, axis=1)
  return LMBatch(inputs=take(batch.inputs), targets=take(batch.targets), mask=take(batch.mask),
                 positions=take(batch.positions), segment_ids=take(batch.segment_ids)), \
      orders, mode


def restore_order(x_BT, orders_BT: np.ndarray):
  """Per-token values [B,T,...] of a reordered batch back in natural order."""
  inv = np.argsort(orders_BT, axis=1)
  x = np.asarray(x_BT)
  idx = inv.reshape(inv.shape + (1,) * (x.ndim - 2))
  return np.take_along_axis(x, idx, axis=1)
