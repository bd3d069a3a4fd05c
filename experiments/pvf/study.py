"""The PVF report (arXiv 2405.01741): one table per model (PVF per group with Wilson
intervals, the paper's finding beside each group it names), PVF by bit field of the
single-bit faults, the check of the paper's ordering of DLRM components, and the plot.

What the paper reports, as far as it could be read here (its abstract, arXiv HTML v3, and
summaries of it; the body with its figures and tables was not available offline, so no
per-component number of the paper is quoted): PVF of a parameter = the probability that
a corruption in it makes the output incorrect, estimated by fault injection as D / N
(incorrect outputs / injections); fault models SBF (one random bit of the parameter),
MBF (several random bits, a fixed number or a bit error rate) and MBBF (a burst of two
or more adjacent bits); models DLRM (recommendation), a CNN (LeNet) and BERT (Tiny
BERT); in DLRM the top-MLP layers are the most vulnerable component and the embedding
tables comparatively less vulnerable. Press reports of the paper quote "about 4 in 1,000
inferences" made incorrect under one setup, which they do not describe.
"""

from __future__ import annotations

import textwrap
from typing import Any, Sequence

import numpy as np

from core import faults

# The paper's statement per DLRM group, where it makes one (n/a elsewhere).
PAPER_DLRM = {
    "top_mlp": "most vulnerable component",
    "emb": "lower than the MLPs",
}
PAPER_NOTE = ("paper (arXiv 2405.01741, abstract): top-MLP layers are the most vulnerable "
              "DLRM component, embedding tables comparatively less vulnerable; no "
              "per-component number could be read offline (press: ~4 in 1,000 inferences "
              "incorrect under one undescribed setup)")

# Bit fields of a stored value: (name, lowest bit, highest bit + 1).
FIELDS = {"fp32": (("mantissa", 0, 23), ("exponent", 23, 31), ("sign", 31, 32)),
          "bf16": (("mantissa", 0, 7), ("exponent", 7, 15), ("sign", 15, 16)),
          "int8": (("magnitude", 0, 7), ("sign", 7, 8))}


def _ci(changed: int, trials: int) -> dict[str, Any]:
  lo, hi = faults.wilson(changed, trials)
  return {"trials": trials, "changed": changed, "pvf": changed / trials if trials else 0.0,
          "ci_low": lo, "ci_high": hi}


def by_field(row: dict[str, Any]) -> dict[str, Any]:
  """Pops a single-bit row's "records" and returns its PVF per bit field of the format
  (sign / exponent / mantissa; int8: sign / magnitude), each with its Wilson interval:
  which bits of a value make the faults that matter."""
  rec = row.pop("records")
  bit = np.log2(rec["mask"].astype(np.float64)).astype(int)
  if np.any(rec["mask"] != (1 << bit).astype(rec["mask"].dtype)):
    raise ValueError(f"by_field: group {row['group']} fault {row['fault']}: expected one "
                     "flipped bit per trial")
  out = {}
  for name, lo, hi in FIELDS[row["fmt"]]:
    sel = (bit >= lo) & (bit < hi)
    out[name] = _ci(int(rec["changed"][sel].sum()), int(sel.sum()))
  return out


def ordering_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per (format, fault): the paper's DLRM ordering, top MLP above the bottom MLP and
  above the embedding tables, tested on our component rows. `verdict` is "agrees" or
  "disagrees" where the two Wilson intervals are apart, "not resolved" where they
  overlap."""
  checks = []
  for fmt, fault in dict.fromkeys((r["fmt"], r["fault"]) for r in rows):
    by = {r["group"]: r for r in rows if (r["fmt"], r["fault"]) == (fmt, fault)}
    top = by.get("top_mlp")
    for other in ("bottom_mlp", "emb", "emb_read"):
      if top is None or other not in by:
        continue
      o = by[other]
      if top["ci_low"] > o["ci_high"]:
        verdict = "agrees"
      elif top["ci_high"] < o["ci_low"]:
        verdict = "disagrees"
      else:
        verdict = "not resolved"
      checks.append({"fmt": fmt, "fault": fault, "claim": f"top_mlp > {other}",
                     "top_mlp": top["pvf"], other: o["pvf"], "verdict": verdict})
  return checks


def format_rows(rows: Sequence[dict[str, Any]], paper: dict[str, str] | None = None) -> str:
  """A table: group, values, format, fault, trials, changed, PVF [95% CI], non-finite and
  the paper's finding (n/a where it states none)."""
  paper = paper or {}
  lines = [f"{'group':<16}{'values':>10}  {'fmt':<5}{'fault':<10}{'trials':>7}{'changed':>8}"
           f"  {'PVF':>9}  {'95% CI (Wilson)':<21}{'nonfinite':>9}  paper"]
  for r in rows:
    lines.append(f"{r['group']:<16}{r['values']:>10,}  {r['fmt']:<5}{r['fault']:<10}"
                 f"{r['trials']:>7}{r['changed']:>8}  {r['pvf']:>9.5f}  "
                 f"[{r['ci_low']:.5f}, {r['ci_high']:.5f}]  {r['nonfinite']:>7}  "
                 f"{paper.get(r['group'], 'n/a')}")
  return "\n".join(lines)


def format_fields(rows: Sequence[dict[str, Any]]) -> str:
  """PVF by bit field of the single-bit rows: `group fmt field trials changed PVF [CI]`."""
  lines = [f"{'group':<16}{'fmt':<6}{'field':<10}{'trials':>7}{'changed':>8}  {'PVF':>8}  "
           "95% CI (Wilson)"]
  for r in rows:
    for name, f in r.get("by_field", {}).items():
      lines.append(f"{r['group']:<16}{r['fmt']:<6}{name:<10}{f['trials']:>7}{f['changed']:>8}"
                   f"  {f['pvf']:>8.4f}  [{f['ci_low']:.4f}, {f['ci_high']:.4f}]")
  return "\n".join(lines)


def format_checks(checks: Sequence[dict[str, Any]]) -> str:
  lines = ["paper's ordering (top-MLP most vulnerable), ours by (format, fault):"]
  for c in checks:
    other = c["claim"].split(" > ")[1]
    lines.append(f"  {c['fmt']:<5}{c['fault']:<10}{c['claim']:<22}{c['top_mlp']:.5f} vs "
                 f"{c[other]:.5f}: {c['verdict']}")
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> str:
  """One panel per model: PVF per group, one bar per (format, fault), Wilson 95% CIs; the
  paper's finding under the groups it names; then PVF by bit field of the single-bit
  faults."""
  from core import plot as plot_lib
  models = [m for m in results["models"] if m["rows"]]
  field_models = [m for m in models if any("by_field" in r for r in m["rows"])]
  n = len(models) + len(field_models)
  with plot_lib.figure(path, n, 1, figsize=(13, 3.9 * n), squeeze=False,
                       tight=(0, 0.025, 1, 1)) as (fig, axes):
    for ax, m in zip(axes[:len(models), 0], models):
      paper = m.get("paper", {})
      groups = list(dict.fromkeys(r["group"] for r in m["rows"]))
      series = list(dict.fromkeys((r["fmt"], r["fault"]) for r in m["rows"]))
      x = np.arange(len(groups))
      w = 0.8 / len(series)
      for s, (fmt, fault) in enumerate(series):
        by = {r["group"]: r for r in m["rows"] if (r["fmt"], r["fault"]) == (fmt, fault)}
        p = np.array([by[g]["pvf"] for g in groups])
        err = np.maximum(0, [[by[g]["pvf"] - by[g]["ci_low"] for g in groups],
                             [by[g]["ci_high"] - by[g]["pvf"] for g in groups]])
        ax.bar(x + (s - (len(series) - 1) / 2) * w, p, w, yerr=err, capsize=2,
               label=f"{fmt} {fault}")
      labels = [g + (f"\n[paper: {paper[g]}]" if g in paper else "") for g in groups]
      ax.set_xticks(x, labels, rotation=30, fontsize=7)
      ax.set(ylabel="PVF (95% Wilson CI)", title=f"{m['label']}: {m['criterion']}")
      ax.grid(alpha=0.3, axis="y")
      ax.legend(fontsize=7, ncol=3)
    for ax, m in zip(axes[len(models):, 0], field_models):
      rows = [r for r in m["rows"] if "by_field" in r]
      keys = [(r["group"], r["fmt"]) for r in rows]
      names = list(dict.fromkeys(f for r in rows for f in r["by_field"]))
      x = np.arange(len(keys))
      w = 0.8 / len(names)
      for s, name in enumerate(names):
        p = np.array([r["by_field"].get(name, {}).get("pvf", np.nan) for r in rows])
        lo = np.array([r["by_field"].get(name, {}).get("ci_low", np.nan) for r in rows])
        hi = np.array([r["by_field"].get(name, {}).get("ci_high", np.nan) for r in rows])
        ax.bar(x + (s - (len(names) - 1) / 2) * w, p, w,
               yerr=np.maximum(0, np.nan_to_num([p - lo, hi - p])), capsize=2, label=name)
      ax.set_xticks(x, [f"{g}\n{f}" for g, f in keys], rotation=90, fontsize=6)
      ax.set(ylabel="PVF of single-bit faults", title=f"{m['label']}: by bit field")
      ax.grid(alpha=0.3, axis="y")
      ax.legend(fontsize=7)
    fig.text(0.01, 0.003, textwrap.fill(PAPER_NOTE, 180), fontsize=7)
  return path
