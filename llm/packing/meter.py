"""Attention work of a training step, measured on the batch the devices receive (WLB-LLM,
arXiv 2503.17924, Sec. 3: imbalance across micro-batches and across CP ranks).

`step_work` reads a host batch as it goes to the model (segment ids and positions in the
order the source laid them out) and places its tokens as the model does: when the model
load-balances on entry (`layout.load_balance`, T a multiple of 2N), rank r gets slots
[r T/N, (r+1) T/N) of the rebalanced row; otherwise of the row as given. Per row b (a
micro-batch) and rank r it counts
  pairs[b, r]   visible (query, key) pairs of r's queries under causal document masking:
                a real token at position p sees p + 1 keys (its document's tokens up to
                itself, wherever they sit), padding (segment 0) none
  tokens[b, r]  real tokens
  model[b, r]   the cost model's time (`llm.packing.cost.CostModel`, one layer): each
                document's attention cost a l^2 + b l + c split over the ranks in
                proportion to the pairs each holds, plus d * tokens + e
  tiles[r]      with a `cp_shard.TileModel`: r's attention time in tile units as a
                block-skipping kernel visits the (query tile, key tile) pairs of the ring,
                summed over rows (what the adaptive layout choice compares)
`step_metrics` turns them into the logged numbers:
  imbalance_mb        max / mean over micro-batches (rows) of their pairs
  imbalance_cp        max / mean over CP ranks of their pairs summed over the step's rows
                      (each ring step runs all rows of a rank in one call)
  imbalance_cp_row    mean over non-empty rows of each row's max / mean over ranks
  model_step          n_layers x the slowest (micro-batch, rank) time: the step time when
                      every micro-batch runs on its own data-parallel replica and the
                      step waits for the slowest, as in the paper's imbalance degree
  model_ideal         n_layers x the mean (micro-batch, rank) time: perfectly balanced
  tile_step           the slowest rank's tile-model time (with a TileModel)
  tokens              real tokens of the step

Letters: B rows (micro-batches), T tokens per row, N cp ranks, S segments of a row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llm.attention import layout
from llm.packing import cp_shard
from llm.packing.cost import CostModel


@dataclasses.dataclass(frozen=True)
class StepWork:
  """Per (micro-batch, rank): visible pairs, real tokens, modelled time of one layer."""

  pairs: np.ndarray    # [B, N] int64
  tokens: np.ndarray   # [B, N] int64
  model: np.ndarray    # [B, N] float64
  tiles: np.ndarray | None = None   # [N] tile units, summed over rows


def rank_tokens(x_BT: np.ndarray, n: int, model_balances: bool) -> np.ndarray:
  """[B, N, T/N] the values of x each rank holds, as the model places a host batch."""
  x = np.asarray(x_BT)
  if x.shape[1] % n:
    raise ValueError(f"rank_tokens: rows of {x.shape[1]} tokens over {n} ranks; expected a "
                     "multiple")
  if model_balances:
    x = layout.load_balance(x, n, axis=1)
  return x.reshape(x.shape[0], n, -1)


def step_work(segment_ids_BT, positions_BT, n: int, *, model_balances: bool,
              cost: CostModel, tile_model: cp_shard.TileModel | None = None) -> StepWork:
  """The step's attention work per (row, rank), from the batch's own arrays."""
  seg = rank_tokens(np.asarray(segment_ids_BT, np.int64), n, model_balances)
  pos = rank_tokens(np.asarray(positions_BT, np.int64), n, model_balances)
  if np.any(seg < 0):
    raise ValueError("step_work: negative segment ids; expected 0 (padding) or a document id")
  w = np.where(seg != 0, pos + 1, 0)
  pairs = w.sum(-1)
  tokens = (seg != 0).sum(-1)
  b = seg.shape[0]
  model = np.zeros((b, n))
  for r in range(b):
    s, wr = seg[r], w[r]                                                  # [N, T/N]
    m = int(s.max()) + 1
    length = np.bincount(s.ravel(), minlength=m).astype(np.float64)       # [S]
    doc_pairs = length * (length + 1) / 2
    held = np.stack([np.bincount(s[k], weights=wr[k], minlength=m) for k in range(n)])
    share = np.divide(held, doc_pairs, out=np.zeros_like(held), where=doc_pairs > 0)
    share[:, 0] = 0.0                                                     # padding
    attn = share @ cost.doc_attention(length)
    model[r] = attn + cost.lin_per_token * tokens[r] + cost.lin_const
  tiles = None
  if tile_model is not None:
    # The ranks' tokens in rank order are a row whose identity order puts them on the ranks.
    ident = np.arange(seg.shape[1] * seg.shape[2])
    tiles = sum(cp_shard.rank_tile_costs(seg[r].ravel(), pos[r].ravel(), ident, n, tile_model)
                for r in range(b))
  return StepWork(pairs=pairs, tokens=tokens, model=model, tiles=tiles)


def imbalance(x) -> float:
  """max / mean (1.0 when the mean is 0)."""
  x = np.asarray(x, np.float64)
  return float(x.max() / x.mean()) if x.size and x.mean() > 0 else 1.0


def step_metrics(work: StepWork, n_layers: int) -> dict[str, float]:
  """The logged numbers of one step (module docstring)."""
  rows = work.pairs.sum(1)
  per_row = [imbalance(p) for p, t in zip(work.pairs, rows) if t > 0]
  return {"imbalance_mb": imbalance(rows), "imbalance_cp": imbalance(work.pairs.sum(0)),
          "imbalance_cp_row": float(np.mean(per_row)) if per_row else 1.0,
          "model_step": float(n_layers * work.model.max()),
          "model_ideal": float(n_layers * work.model.mean()),
          "tokens": float(work.tokens.sum()),
          **({} if work.tiles is None else {"tile_step": float(np.max(work.tiles))})}
