"""The PVF report: one table per model (PVF per group with Wilson intervals) and the plot."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
  """A table: group, values, format, fault, trials, changed, PVF [95% CI], non-finite."""
  lines = [f"{'group':<16}{'values':>10}  {'fmt':<5}{'fault':<10}{'trials':>7}{'changed':>8}"
           f"  {'PVF':>9}  {'95% CI (Wilson)':<21}{'nonfinite':>9}"]
  for r in rows:
    lines.append(f"{r['group']:<16}{r['values']:>10,}  {r['fmt']:<5}{r['fault']:<10}"
                 f"{r['trials']:>7}{r['changed']:>8}  {r['pvf']:>9.5f}  "
                 f"[{r['ci_low']:.5f}, {r['ci_high']:.5f}]  {r['nonfinite']:>7}")
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> str:
  """One panel per model: PVF per group, one bar per (format, fault), Wilson 95% CIs."""
  from core import plot as plot_lib
  plt = plot_lib.pyplot()

  models = [m for m in results["models"] if m["rows"]]
  fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.8 * len(models)), squeeze=False)
  for ax, m in zip(axes[:, 0], models):
    groups = list(dict.fromkeys(r["group"] for r in m["rows"]))
    series = list(dict.fromkeys((r["fmt"], r["fault"]) for r in m["rows"]))
    x = np.arange(len(groups))
    w = 0.8 / len(series)
    for s, (fmt, fault) in enumerate(series):
      by = {r["group"]: r for r in m["rows"] if (r["fmt"], r["fault"]) == (fmt, fault)}
      p = np.array([by[g]["pvf"] for g in groups])
      err = np.array([[by[g]["pvf"] - by[g]["ci_low"] for g in groups],
                      [by[g]["ci_high"] - by[g]["pvf"] for g in groups]])
      ax.bar(x + (s - (len(series) - 1) / 2) * w, p, w, yerr=err, capsize=2,
             label=f"{fmt} {fault}")
    ax.set_xticks(x, groups, rotation=30, fontsize=8)
    ax.set(ylabel="PVF (95% Wilson CI)", title=f"{m['label']}: {m['criterion']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
