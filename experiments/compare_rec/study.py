"""The comparison's report: the JSON summary and the plot of `rec.runs.train_models`'
results (every model under one budget, mean ± std over seeds)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from core import config
from core import plot as plot_lib

# The study's own settings (its entry point's flags).
PRESETS = config.setting("presets", "string", "Per-model presets, e.g. wukong=l2_n8,dhen=dhen_2l "
                         "(default: each model's kaggle preset).")
KEEP_CHECKPOINTS = config.setting("keep_checkpoints", "bool", "Keep each run's final "
                                  "checkpoint.")


def summary(results: Mapping[str, Any]) -> dict[str, Any]:
  """The one-line JSON summary: per model mean AUC / NE / GFLOPs, the best by NE."""
  rows = results["rows"]
  best = min(rows, key=lambda r: r["ne_mean"] if not math.isnan(r["ne_mean"]) else math.inf)
  out = {"data": results["config"]["data"], "seeds": results["seeds"],
         "steps": rows[0]["steps"], "batch_size": results["config"]["batch_size"],
         "models": {r["label"]: {"auc": r["auc_mean"], "auc_std": r["auc_std"],
                                 "ne": r["ne_mean"], "ne_std": r["ne_std"],
                                 "gflops_per_example": r["gflops_per_example"],
                                 "wall_seconds": r["wall_seconds_mean"]} for r in rows},
         "best_by_ne": best["label"], "wall_seconds": results["wall_seconds"]}
  if results.get("reference"):
    out["bayes_auc"] = results["reference"]["auc"]
    out["bayes_ne"] = results["reference"]["ne"]
  return out


def plot_comparison(results: Mapping[str, Any], path: str) -> str:
  """AUC and NE bars (error bars: std over seeds; dashed: the Bayes ceiling on synthetic
  data) and NE against forward GFLOPs/example (log x)."""
  rows = results["rows"]
  ref = results.get("reference")
  labels = [r["label"] for r in rows]
  x = np.arange(len(rows))
  colors = [f"C{i}" for i in range(len(rows))]
  with plot_lib.figure(path, 1, 3, figsize=(13, 3.8)) as (fig, axes):
    for ax, key, title in ((axes[0], "auc", "test AUC (higher is better)"),
                           (axes[1], "ne", "test NE (lower is better)")):
      means = [r[f"{key}_mean"] for r in rows]
      stds = [r[f"{key}_std"] for r in rows]
      ax.bar(x, means, yerr=stds, color=colors, capsize=4)
      if ref:
        ax.axhline(ref[key], ls="--", c="k", lw=1, label="true logits (Bayes)")
        ax.legend(loc="lower right", fontsize=8)
      # Zoom on the differences: bars from just below the lowest mean - std.
      ends = [m - s for m, s in zip(means, stds)] + [m + s for m, s in zip(means, stds)]
      ends += [ref[key]] if ref else []
      lo, hi = min(ends), max(ends)
      pad = 0.15 * (hi - lo) + 0.005
      ax.set_ylim(max(0.0, lo - pad), hi + pad)
      ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
      ax.set_title(title)
    ax = axes[2]
    for r, c in zip(rows, colors):
      ax.errorbar(r["gflops_per_example"], r["ne_mean"], yerr=r["ne_std"], fmt="o", c=c,
                  capsize=3, label=r["label"])
    if ref:
      ax.axhline(ref["ne"], ls="--", c="k", lw=1)
    ax.set_xscale("log")
    plot_lib.plain_log_labels(ax, "x")
    ax.set(xlabel="forward GFLOPs / example (dense part)", ylabel="test NE", title="NE vs compute")
    ax.legend(fontsize=7)
    for a in axes:
      a.grid(alpha=0.3)
    cfg = results["config"]
    fig.suptitle(f"{cfg['data']}: {rows[0]['steps']} steps x {cfg['batch_size']}, dim "
                 f"{cfg['embedding_dim'] or 'preset'}, seeds {results['seeds']}", fontsize=10)
  return path
