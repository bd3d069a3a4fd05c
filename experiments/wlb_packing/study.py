"""The imbalance study of arXiv 2503.17924 (WLB-LLM), Table 2 and the CP-level comparison.

On a synthetic document stream with a long tail of lengths (`llm.packing.lengths`), packs
the same global batches with: the original (loader-order) packing; fixed-length greedy
balancing over windows of 1 / 2 / 4 / 8 global batches; WLB-LLM's variable-length packing
with 1 / 2 / 3 outlier queues. For each it reports the imbalance degree (max over a step's
micro-batches of the workload over their mean, averaged over steps) of the whole layer
W = Wa + Wl and of attention alone (Wa), the packing time per global batch, and the token
delay the reordering causes. Then, on the first `cp_steps` global batches of the original
packing and of WLB-LLM, the CP-level imbalance of per-sequence vs per-document sharding
(exact visible pairs per rank), and the tile-model estimates behind the adaptive choice
(`cp_shard`). `format_table` and `plot` show it; `python -m experiments.wlb_packing` runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from llm.packing import cp_shard
from llm.packing import packers as P
from llm.packing.batch import row_segments
from llm.packing.cost import CostModel
from llm.packing.lengths import LengthDist

# Table 2 of the paper (Llama 7B, 128K context): imbalance degree per packing.
PAPER_TABLE2 = {"original": 1.44, "fixed_greedy_1": 1.41, "fixed_greedy_2": 1.22,
                "fixed_greedy_4": 1.11, "fixed_greedy_8": 1.08, "wlb_1q": 1.24, "wlb_2q": 1.05,
                "wlb_3q": 1.05}
PAPER_WLB_PACK_MS = (8.0, 23.0)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
  """One run of the study; `outlier_fractions` are the queue thresholds as fractions of the
  context, and WLB with q queues uses the q largest."""

  dist: LengthDist = LengthDist()
  micro_batches: int = 4
  steps: int = 512
  max_len_factor: float = 1.0
  windows: tuple[int, ...] = (1, 2, 4, 8)
  queues: tuple[int, ...] = (1, 2, 3)
  outlier_fractions: tuple[float, ...] = (0.125, 0.25, 0.5)
  cp: int = 8
  cp_steps: int = 4
  tile_q: int = 128
  tile_kv: int = 128
  seed: int = 0

  def __post_init__(self):
    counts = {"micro_batches": self.micro_batches, "steps": self.steps, "cp": self.cp,
              "cp_steps": self.cp_steps, "tile_q": self.tile_q, "tile_kv": self.tile_kv}
    bad = {k: v for k, v in counts.items() if v < 1}
    bad.update({f"windows[{i}]": k for i, k in enumerate(self.windows) if k < 1})
    if bad:
      raise ValueError(f"StudyConfig: {bad}; expected every count >= 1")
    off = [k for k in self.windows if self.steps % k]
    if off:
      raise ValueError(f"StudyConfig: steps={self.steps} is not a multiple of windows {off}")
    if not self.max_len_factor * self.dist.context >= 1:
      raise ValueError(f"StudyConfig: max_len_factor={self.max_len_factor}; expected a "
                       f"micro-batch cap of at least one token ({self.dist.context} tokens "
                       "of context)")
    thr = [int(f * self.dist.context) for f in sorted(self.outlier_fractions)]
    if any(not 0 < f <= 1 for f in self.outlier_fractions) or len(set(thr)) != len(thr) \
        or (thr and thr[0] < 1):
      raise ValueError(f"StudyConfig: outlier_fractions={self.outlier_fractions}; expected "
                       "distinct fractions in (0, 1] that give distinct thresholds >= 1 "
                       f"token of the {self.dist.context}-token context")
    for q in self.queues:
      self.thresholds(q)

  def thresholds(self, q: int) -> tuple[int, ...]:
    if not 0 <= q <= len(self.outlier_fractions):
      raise ValueError(f"StudyConfig: {q} outlier queues, but outlier_fractions has "
                       f"{len(self.outlier_fractions)} thresholds")
    fr = sorted(self.outlier_fractions)[len(self.outlier_fractions) - q:]
    return tuple(int(f * self.dist.context) for f in fr)

  @property
  def max_len(self) -> int:
    return int(self.max_len_factor * self.dist.context)


def stream(cfg: StudyConfig) -> tuple[np.ndarray, list[list[list[int]]]]:
  """(document lengths, original packing of cfg.steps global batches) from enough documents:
  an estimate from the mean length, doubled until the stream fills cfg.steps batches."""
  mean = float(np.mean(cfg.dist.sample(20000, cfg.seed + 1)))
  n = int(1.3 * cfg.steps * cfg.micro_batches * cfg.dist.context / mean) + 1000
  # A sequence holds at most context // min_len documents, so this many always fill the
  # steps (StudyConfig holds steps and micro_batches >= 1): the doubling ends.
  enough = cfg.steps * cfg.micro_batches * (cfg.dist.context // cfg.dist.min_len) + 1
  while True:
    lengths = cfg.dist.sample(n, cfg.seed)
    orig = P.original_packing(lengths, seq_len=cfg.dist.context,
                              micro_batches=cfg.micro_batches, steps=cfg.steps)
    if len(orig) == cfg.steps:
      return lengths, orig
    if n >= enough:
      raise RuntimeError(f"stream: {n} documents filled {len(orig)} of {cfg.steps} global "
                         f"batches of {cfg.micro_batches} x {cfg.dist.context} tokens")
    n *= 2


def _row_stats(run: P.PackRun, lengths, arrival, cost: CostModel, paper: float | None):
  tot = P.step_imbalance(run, lengths, cost, "total")
  att = P.step_imbalance(run, lengths, cost, "attention")
  tok = P.step_imbalance(run, lengths, cost, "tokens")
  ms = np.asarray(run.pack_seconds) * 1e3
  return {"name": run.name, "imbalance": float(tot.mean()), "imbalance_p90": float(
      np.percentile(tot, 90)), "imbalance_attention": float(att.mean()),
          "imbalance_tokens": float(tok.mean()), "paper": paper,
          "pack_ms_mean": float(ms.mean()), "pack_ms_max": float(ms.max()),
          "pending_docs": run.pending, "steps": len(run.steps),
          **P.token_delay(run, lengths, arrival)}


def cp_compare(rows: list[np.ndarray], n: int, model: cp_shard.TileModel) -> dict[str, Any]:
  """Per micro-batch (documents' lengths, natural order): rank imbalance of exact visible
  pairs under per-sequence and per-document sharding, and the tile-model estimates of the
  slowest rank for both and the adaptive pick (summed over micro-batches)."""
  out = {"pairs_imbalance": {"sequence": [], "document": []},
         "tile_time": {"sequence": 0.0, "document": 0.0, "adaptive": 0.0},
         "tile_imbalance": {"sequence": [], "document": []}, "chosen": {"sequence": 0,
                                                                        "document": 0}}
  for lengths in rows:
    t = int(np.ceil(max(int(np.sum(lengths)), 1) / (2 * n)) * 2 * n)
    seg, pos = row_segments(lengths, t)
    est = {}
    for mode in ("sequence", "document"):
      order = cp_shard.row_layout(seg, t, n, mode)
      out["pairs_imbalance"][mode].append(cp_shard.imbalance(cp_shard.rank_pairs(seg, pos,
                                                                                 order, n)))
      tiles = cp_shard.rank_tile_costs(seg, pos, order, n, model)
      out["tile_imbalance"][mode].append(cp_shard.imbalance(tiles))
      est[mode] = float(tiles.max())
      out["tile_time"][mode] += est[mode]
    pick = min(est, key=lambda m: (est[m], m != "sequence"))
    out["chosen"][pick] += 1
    out["tile_time"]["adaptive"] += est[pick]
  for key in ("pairs_imbalance", "tile_imbalance"):
    out[key] = {m: float(np.mean(v)) for m, v in out[key].items()}
  out["micro_batches"] = len(rows)
  return out


def run_study(cfg: StudyConfig, cost: CostModel,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Every Table 2 row and the CP comparison; a dict ready for results.json."""
  say = progress or (lambda msg: None)
  lengths, orig = stream(cfg)
  arrival = P.arrival_steps(orig, len(lengths))
  arrivals = [[i for mb in step for i in mb] for step in orig]
  ctx, m = cfg.dist.context, cfg.micro_batches
  runs = [P.simulate("original", lengths, arrivals, original=orig)]
  for k in cfg.windows:
    say(f"fixed-length greedy over {k} global batch(es)")
    runs.append(P.simulate(f"fixed_greedy_{k}", lengths, arrivals, packer=P.FixedGreedyPacker(
        seq_len=ctx, micro_batches=m, window=k, cost=cost)))
  for q in cfg.queues:
    say(f"WLB-LLM with {q} outlier queue(s), thresholds {cfg.thresholds(q)}")
    runs.append(P.simulate(f"wlb_{q}q", lengths, arrivals, packer=P.WLBPacker(
        micro_batches=m, max_len=cfg.max_len, cost=cost,
        outlier_thresholds=cfg.thresholds(q))))
  rows = [_row_stats(r, lengths, arrival, cost, PAPER_TABLE2.get(r.name)) for r in runs]
  used = lengths[arrival >= 0]
  res: dict[str, Any] = {
      "config": dataclasses.asdict(cfg), "rows": rows, "paper_wlb_pack_ms": PAPER_WLB_PACK_MS,
      "documents": {"count": int(used.size), "mean": float(used.mean()),
                    "median": float(np.median(used)), "p99": float(np.percentile(used, 99)),
                    "max": int(used.max()),
                    "tokens_in_docs_over_half_context": float(
                        used[used >= ctx // 2].sum() / used.sum())},
      "attention_share": float(np.mean([cost.attention(lengths[np.asarray(mb)]) /
                                        cost.total(lengths[np.asarray(mb)])
                                        for step in orig for mb in step if mb])),
  }
  tile = cp_shard.TileModel(cfg.tile_q, cfg.tile_kv)
  cp = {}
  wlb_name = f"wlb_{max(cfg.queues)}q" if cfg.queues else None
  for r in runs:
    if r.name in ("original", wlb_name) and cfg.cp > 1:
      say(f"CP sharding over {cfg.cp} ranks: {r.name}, {cfg.cp_steps} global batches")
      mbs = [lengths[np.asarray(mb, np.int64)] for step in r.steps[:cfg.cp_steps]
             for mb in step if mb]
      cp[r.name] = cp_compare(mbs, cfg.cp, tile)
  res["cp"] = cp
  return res


def format_table(res) -> str:
  """The Table 2 rows (ours beside the paper's) and one line per CP comparison."""
  lines = [f"{'packing':<16}{'imbalance':>10}{'paper':>7}{'attn':>7}{'tokens':>8}"
           f"{'pack ms':>9}{'delay':>7}{'delayed':>9}"]
  for r in res["rows"]:
    paper = f"{r['paper']:.2f}" if r["paper"] is not None else "-"
    lines.append(f"{r['name']:<16}{r['imbalance']:>10.3f}{paper:>7}"
                 f"{r['imbalance_attention']:>7.2f}{r['imbalance_tokens']:>8.2f}"
                 f"{r['pack_ms_mean']:>9.2f}{r['mean_delay_steps']:>7.2f}"
                 f"{100 * r['delayed_token_fraction']:>8.1f}%")
  lo, hi = res.get("paper_wlb_pack_ms", PAPER_WLB_PACK_MS)
  lines.append("imbalance: max/mean of W = Wa + Wl over a step's micro-batches (mean over "
               "steps); attn: of Wa alone; delay: token-weighted global batches; paper's "
               f"WLB-LLM packing time: {lo:g}-{hi:g} ms per global batch")
  for name, c in res["cp"].items():
    lines.append(
        f"CP{res['config']['cp']} on {name} ({c['micro_batches']} micro-batches): rank "
        f"imbalance of attention pairs per-sequence {c['pairs_imbalance']['sequence']:.3f}, "
        f"per-document {c['pairs_imbalance']['document']:.3f}; tile model (slowest rank, "
        f"summed) sequence {c['tile_time']['sequence']:.0f}, document "
        f"{c['tile_time']['document']:.0f}, adaptive {c['tile_time']['adaptive']:.0f} "
        f"(picked document {c['chosen']['document']}x, sequence {c['chosen']['sequence']}x)")
  return "\n".join(lines)


def plot(res, path: str) -> None:
  """Imbalance per packing beside the paper's, imbalance vs token delay, CP rank imbalance."""
  from core import plot as plot_lib

  rows = res["rows"]
  with plot_lib.figure(path, 1, 3, figsize=(14, 3.8), dpi=120) as (fig, axes):
    x = np.arange(len(rows))
    ax = axes[0]
    ax.bar(x - 0.2, [r["imbalance"] for r in rows], 0.4, label="ours, W = Wa + Wl")
    ax.bar(x + 0.2, [r["imbalance_attention"] for r in rows], 0.4, label="ours, Wa only",
           alpha=0.6)
    ax.plot(x, [r["paper"] or np.nan for r in rows], "k*", ms=10, label="paper Table 2")
    ax.set_xticks(x, [r["name"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_ylim(bottom=0.9)
    ax.set_ylabel("imbalance degree (max / mean)")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot([r["mean_delay_steps"] for r in rows], [r["imbalance"] for r in rows], "o")
    for r in rows:
      ax.annotate(r["name"], (r["mean_delay_steps"], r["imbalance"]), fontsize=7)
    ax.set_xlabel("mean token delay (global batches)")
    ax.set_ylabel("imbalance degree")
    ax = axes[2]
    names = list(res["cp"])
    for k, mode in enumerate(("sequence", "document")):
      ax.bar(np.arange(len(names)) + (k - 0.5) * 0.4,
             [res["cp"][n]["pairs_imbalance"][mode] for n in names], 0.4, label=f"per-{mode}")
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylim(bottom=0.9)
    ax.set_ylabel(f"CP{res['config']['cp']} rank imbalance (attention pairs)")
    ax.legend(fontsize=7)
