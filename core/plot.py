"""Plots: pyplot on the Agg backend (`pyplot()`, every plot's start), `figure(path)` (a
figure laid out, written and closed when its block ends), a run's metrics.jsonl (train loss,
eval metrics) as a PNG beside results.json, plain tick labels for log axes."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Sequence


def pyplot():
  """matplotlib.pyplot on the Agg backend (PNG files, no display), as every plot of the
  project starts; matplotlib is imported on first use only."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


@contextlib.contextmanager
def figure(path: str, *grid: int, dpi: int = 110, tight: bool | tuple = True,
           bbox_inches: str | None = None, **subplots: Any) -> Iterator[tuple[Any, Any]]:
  """`with figure(path, figsize=(6, 4)) as (fig, ax):` draws into `plt.subplots(*grid,
  **subplots)` (Agg); when the block ends the figure is laid out (`tight`: True, False, or
  the rect tight_layout fills), written to `path` (its folder made) at `dpi` and closed. A
  block that raises writes nothing, and the figure is closed all the same."""
  plt = pyplot()
  fig, axes = plt.subplots(*grid, **subplots)
  try:
    yield fig, axes
    if tight is True:
      fig.tight_layout()
    elif tight:
      fig.tight_layout(rect=tight)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi, **({"bbox_inches": bbox_inches} if bbox_inches else {}))
  finally:
    plt.close(fig)


def plot_run(workdir: str, eval_keys: Sequence[str] = ("auc", "ne"), out_name: str = "curves.png") -> str | None:
  """Writes `<workdir>/<out_name>` with train loss and the chosen eval metrics over steps
  (process 0 of a multi-process run; None elsewhere or without metrics)."""
  import jax
  path = os.path.join(workdir, "metrics.jsonl")
  if jax.process_index() != 0 or not os.path.exists(path):
    return None
  with open(path) as f:
    recs = [json.loads(l) for l in f if l.strip()]
  train = [r for r in recs if r["split"] == "train" and "loss" in r]
  evals = [r for r in recs if r["split"] == "eval"]
  keys = [k for k in eval_keys if any(k in r for r in evals)]
  out = os.path.join(workdir, out_name)
  with figure(out, 1, 1 + len(keys), figsize=(4.5 * (1 + len(keys)), 3.4),
              squeeze=False) as (fig, axes):
    ax = axes[0][0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1.2)
    ax.set(title="train loss", xlabel="step")
    for a, k in zip(axes[0][1:], keys):
      pts = [(r["step"], r[k]) for r in evals if k in r]
      a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", lw=1.2)
      a.set(title=f"eval {k}", xlabel="step")
    for a in axes[0]:
      a.grid(alpha=0.3)
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
