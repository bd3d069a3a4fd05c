"""The training-side grid of WLB-LLM (arXiv 2503.17924): packing x CP layout, measured on the
batches `experiments.train_lm --packing=... --cp_sharding=...` feeds the model.

For each packing (original, fixed-length greedy, WLB-LLM) and CP layout (per sequence, per
document, adaptive) it builds the LM run train_lm would (`llm.run_config.LMRunConfig`:
`--seq_len` the context, `--batch_size` the micro-batches, `--packing`, `--cp_sharding`;
`lm_run` holds the settings the study changes from train_lm's defaults), runs its packed
source (`llm.packing.source.from_run`: Pile-shaped documents drawn at the context,
`CorpusLengths`) for `steps` global batches and reads every batch with the work
meter (`llm.packing.meter`), exactly as train_lm logs it: attention-pair imbalance across
micro-batches and across CP ranks, the tile model's slowest rank, and the cost model's step
time (the slowest micro-batch x rank, n_layers layers). Throughput is real tokens over the
modelled time, and the modelled speedup of each cell is its throughput over the original
packing with per-sequence sharding, beside the paper's 1.23x end-to-end speedup on GPUs
(not measured here). Host only: no model runs, so the paper's 128K context
fits on a CPU.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np

from core import config
from llm.packing import cp_shard
from llm.packing import source as source_lib
from llm.packing.cost import CostModel
from llm.packing.source import LAYOUTS, PACKINGS
from llm.run_config import LMRunConfig

PAPER_SPEEDUP = 1.23   # WLB-LLM's end-to-end training speedup on GPUs (the paper)


def lm_run(*, context: int, micro_batches: int, cp: int, seed: int = 0, fixed_window: int = 2,
           wlb_queues: int = 2, preset: str = "tiny") -> LMRunConfig:
  """The LM run of the grid, before its packing and CP layout: train_lm's settings at the
  study's context, micro-batches, CP ranks (ring attention, pass-KV) and seed, documents
  drawn at the context itself."""
  return config.replace(LMRunConfig(), preset=preset, seq_len=context,
                        batch_size=micro_batches, seed=seed, mesh=f"cp:{cp}",
                        context_parallel="pass_kv", doc_context=0, fixed_window=fixed_window,
                        wlb_queues=wlb_queues)


def train_grid(*, context: int, micro_batches: int, cp: int, steps: int, cost: CostModel,
               n_layers: int, tile: cp_shard.TileModel, fixed_window: int = 2,
               wlb_queues: int = 2, seed: int = 0, preset: str = "tiny",
               progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
  """One row per (packing, layout): means over `steps` global batches of the meter's numbers,
  modelled throughput and speedup over (original, sequence). `preset`: the model the runs
  train (the one `n_layers` and `cost` describe)."""
  say = progress or (lambda msg: None)
  first = lm_run(context=context, micro_batches=micro_batches, cp=cp, seed=seed,
                fixed_window=fixed_window, wlb_queues=wlb_queues, preset=preset)
  tokens = np.zeros(context + 1, np.int32)      # the meter reads lengths, not token values
  sharding = {v: k for k, v in source_lib.CP_SHARDINGS.items()}
  rows = []
  for packing, layout in itertools.product(PACKINGS, LAYOUTS):
    say(f"training grid: {packing} packing, {layout} CP layout over {cp} ranks, {steps} steps")
    run = config.replace(first, packing=packing, cp_sharding=sharding[layout])
    src = source_lib.from_run(run, tokens, cp, n_layers=n_layers, cost=cost, tile_model=tile)
    for batch in itertools.islice(src.batches(0), steps):
      src.step_metrics(batch)
    recs = src.records
    row = {"packing": packing, "layout": layout,
           **{k[len("pack_"):]: float(np.mean([r[k] for r in recs])) for k in recs[0]},
           "throughput": float(sum(r["pack_tokens"] for r in recs)
                               / sum(r["pack_model_step"] for r in recs))}
    rows.append(row)
  base = rows[0]["throughput"]
  for r in rows:
    r["speedup"] = r["throughput"] / base
  return rows


def format_grid(rows, cp: int, unit: str) -> str:
  lines = [f"{'packing':<10}{'CP layout':<11}{'mb imb':>8}{'CP imb':>8}{'row CP':>8}"
           f"{'tile max':>12}{'step (' + unit + ')':>16}{'speedup':>9}{'doc %':>7}"]
  for r in rows:
    lines.append(f"{r['packing']:<10}{r['layout']:<11}{r['imbalance_mb']:>8.3f}"
                 f"{r['imbalance_cp']:>8.3f}{r['imbalance_cp_row']:>8.3f}"
                 f"{r.get('tile_step', float('nan')):>12.0f}{r['model_step']:>16.4g}"
                 f"{r['speedup']:>9.3f}{100 * r['layout_document']:>6.0f}%")
  lines.append(f"mb / CP imb: max / mean of attention pairs over micro-batches / the {cp} CP "
               "ranks; step: cost model, slowest micro-batch x rank; speedup: modelled "
               f"tokens per time over original + per-sequence (paper, end to end on GPUs: "
               f"{PAPER_SPEEDUP}x)")
  return "\n".join(lines)


def plot_grid(rows, path: str) -> None:
  """Modelled speedup and CP rank imbalance per (packing, layout), the paper's 1.23x marked."""
  from core import plot as plot_lib
  with plot_lib.figure(path, 1, 2, figsize=(10, 3.6), dpi=120) as (fig, axes):
    x = np.arange(len(PACKINGS))
    for k, layout in enumerate(LAYOUTS):
      cells = [next(r for r in rows if r["packing"] == p and r["layout"] == layout)
               for p in PACKINGS]
      axes[0].bar(x + (k - 1) * 0.27, [c["speedup"] for c in cells], 0.27, label=layout)
      axes[1].bar(x + (k - 1) * 0.27, [c["imbalance_cp"] for c in cells], 0.27, label=layout)
    axes[0].axhline(PAPER_SPEEDUP, color="k", ls="--", lw=1, label="paper (GPU, end to end)")
    axes[0].set_ylabel("modelled speedup over original + sequence")
    axes[1].set_ylabel("CP rank imbalance (attention pairs)")
    for ax in axes:
      ax.set_xticks(x, PACKINGS)
      ax.set_ylim(bottom=0.9)
      ax.legend(fontsize=7)
