"""Plots: pyplot on the Agg backend (`pyplot()`, every plot's start), a run's metrics.jsonl
(train loss, eval metrics) as a PNG beside results.json, plain tick labels for log axes."""

from __future__ import annotations

import json
import os
from typing import Sequence


def pyplot():
  """matplotlib.pyplot on the Agg backend (PNG files, no display), as every plot of the
  project starts; matplotlib is imported on first use only."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_run(workdir: str, eval_keys: Sequence[str] = ("auc", "ne"), out_name: str = "curves.png") -> str | None:
  """Writes `<workdir>/<out_name>` with train loss and the chosen eval metrics over steps
  (process 0 of a multi-process run; None elsewhere or without metrics)."""
  import jax
  path = os.path.join(workdir, "metrics.jsonl")
  if jax.process_index() != 0 or not os.path.exists(path):
    return None
  plt = pyplot()

  with open(path) as f:
    recs = [json.loads(l) for l in f if l.strip()]
  train = [r for r in recs if r["split"] == "train" and "loss" in r]
  evals = [r for r in recs if r["split"] == "eval"]
  keys = [k for k in eval_keys if any(k in r for r in evals)]
  fig, axes = plt.subplots(1, 1 + len(keys), figsize=(4.5 * (1 + len(keys)), 3.4), squeeze=False)
  ax = axes[0][0]
  ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1.2)
  ax.set(title="train loss", xlabel="step")
  for a, k in zip(axes[0][1:], keys):
    pts = [(r["step"], r[k]) for r in evals if k in r]
    a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", lw=1.2)
    a.set(title=f"eval {k}", xlabel="step")
  for a in axes[0]:
    a.grid(alpha=0.3)
  fig.tight_layout()
  out = os.path.join(workdir, out_name)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def plain_log_labels(ax, which: str) -> None:
  """Tick labels of a log axis (`which` "x" or "y" of matplotlib axes `ax`) as plain
  numbers. Minor ticks are labeled too when the axis spans less than a decade, only at 2x
  and 5x when it spans less than three (else they crowd)."""
  import math

  from matplotlib import ticker
  lo, hi = ax.get_xlim() if which == "x" else ax.get_ylim()
  axis = ax.xaxis if which == "x" else ax.yaxis

  def minor(v, _):
    mantissa = round(v / 10 ** math.floor(math.log10(v)), 6) if v > 0 else 0
    return f"{v:.3g}" if hi < 10 * lo or (hi < 1000 * lo and mantissa in (2, 5)) else ""

  axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
  axis.set_minor_formatter(ticker.FuncFormatter(minor))
