"""Dense scaling of recommendation models: quality against compute, with power-law fits.

The study of `experiments.wukong_scaling` (the shape of Figure 1 of Wukong, arXiv
2403.02545; the runs train through `rec.runs.train_models`): families of model sizes per
architecture (GRIDS; Wukong grows depth l, n_F = n_L, rank k and MLP width, as
`wukong.SCALING_LADDER` does; DLRM grows its MLP widths; DCN-v2 its cross layers, cross
rank and deep MLP widths), each size trained for the same
number of examples on data with planted high-order interactions (`--data=synthetic_deep`,
`rec.data.synthetic`), then per architecture a power law

    quality gap = a * (forward GFLOPs / example)^b

fitted by least squares in log space (`fit_power_law`). The primary quality is test NE and
its gap is NE - NE_floor, the floor being the NE of the true planted logits on the same
eval examples (0 on file data, where no floor is known); the secondary fit uses the AUC gap
to the true logits' AUC. `findings` turns the fits and points into sentences.

Beside the paper (`PAPER`): its Figure 1 shows Wukong's LogLoss on Meta's internal data
falling by about 0.1% (relative) per quadrupling of compute, from about 1 to 100+
GFLOP/example, while the baselines flatten. `per_quadrupling` puts ours on that scale: NE
itself fitted as NE = a * GFLOPs^c per architecture (to the seed means, and per seed), its
relative change per 4x compute 4^c - 1. NE is logloss over the entropy of the base rate, a
constant of the eval set, so its relative change is the logloss's.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from core import config
from core import plot as plot_lib
from rec import runs

# The study's own settings (its entry point's flags).
GRID = config.setting("grid", "enum", "Size grid (study.GRIDS).", choices=("cpu", "large"))
ARCHS = config.setting("archs", "list", "Architectures of the grid to train.")
SIZES = config.setting("sizes", "integer", "Sizes per architecture, spread over the grid (0: "
                       "all).", lower=0)
STUDY = config.setting(
    "study", "enum", "scaling: the size grid and its power laws; fuxictr: the one --models "
    "Wukong and FuxiCTR's WuKong trained side by side on the same examples (fuxictr.py); "
    "profile: source / step / end-to-end examples/s of the grid's models under each "
    "--profile_data (profile.py).", choices=("scaling", "fuxictr", "profile"))
FROM_RESULTS = config.setting("from_results", "string", "A results.json of an earlier run: "
                              "redo the fits, findings and plot from its points (no "
                              "training) into --workdir.")
PROFILE_DATA = config.setting("profile_data", "list", "--study=profile: data forms to "
                              "measure (replace --data).")
FUXICTR_PYTHON = config.setting(
    "fuxictr_python", "string", "--study=fuxictr: the Python 3.11 peer environment's python, "
    "with torch and fuxictr (experiments/peers/README.md; default: beside the checkout).")
FUXICTR_SRC = config.setting("fuxictr_src", "string", "--study=fuxictr: FuxiCTR's "
                             "model_zoo/WuKong/src/WuKong.py.")
FUXICTR_BATCH_NORM = config.setting("fuxictr_batch_norm", "bool", "--study=fuxictr: BatchNorm "
                                    "in FuxiCTR's head (its default; ours has none).")
FUXICTR_MAX_GRAD_NORM = config.setting(
    "fuxictr_max_grad_norm", "float", "--study=fuxictr: FuxiCTR's gradient clipping (0: off, "
    "as ours; its fit() default is 10).", lower=0)
FUXICTR_THREADS = config.setting("fuxictr_threads", "integer", "--study=fuxictr: torch CPU "
                                 "threads.", lower=1)

# Sizes per architecture, as preset patterns of rec.configs (dim 16 unless --embedding_dim).
# "cpu" at dim 16, 26 sparse + 13 dense features, forward GFLOPs/example: Wukong 0.00015 to
# 0.0068, DLRM 0.00016 to 0.0029, DCN-v2 0.0002 to 0.0043. "large": for accelerators,
# dim 64 or more (Wukong rungs 0-5 of wukong.SCALING_LADDER).
GRIDS: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {
        "wukong": ("l1_n4_k8_w64", "l2_n8_k16_w128", "l2_n16_k24_w256", "l3_n16_k32_w512"),
        "dlrm": ("w128", "w256", "w512", "w1024"),
        "dcnv2": ("x1_r32_w128", "x2_r64_w256", "x3_r128_w512", "x3_r256_w1024"),
    },
    "large": {
        "wukong": tuple(f"scaled{i}" for i in range(6)),
        "dlrm": ("w512", "w1024", "w2048", "w4096", "w8192"),
        "dcnv2": ("x2_r64_w512", "x3_r128_w1024", "x3_r256_w2048", "x4_r512_w4096",
                  "x4_r1024_w8192"),
    },
}


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
  """Least-squares fit of y = a * x^b in log space (log y = log a + b log x).

  Returns {a, b, r2, n}: r2 is the coefficient of determination of the log-space fit (1.0
  when log y is constant and fitted exactly). Needs at least two distinct positive x and
  positive y.
  """
  x = np.asarray(x, np.float64).reshape(-1)
  y = np.asarray(y, np.float64).reshape(-1)
  if x.shape != y.shape:
    raise ValueError(f"fit_power_law: {x.size} x values and {y.size} y values; expected equal")
  bad = ~((x > 0) & (y > 0) & np.isfinite(x) & np.isfinite(y))
  if bad.any():
    i = int(np.argmax(bad))
    raise ValueError(f"fit_power_law: point {i} is (x={x[i]}, y={y[i]}); expected positive, "
                     "finite values (a power law is fitted in log space)")
  if np.unique(x).size < 2:
    raise ValueError(f"fit_power_law: x={x.tolist()}; expected at least two distinct values")
  lx, ly = np.log(x), np.log(y)
  b, log_a = np.polyfit(lx, ly, 1)
  ss_res = float(np.sum((ly - (log_a + b * lx)) ** 2))
  ss_tot = float(np.sum((ly - ly.mean()) ** 2))
  r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res < 1e-24 else 0.0)
  return {"a": float(math.exp(log_a)), "b": float(b), "r2": float(r2), "n": int(x.size)}


# Wukong (arXiv 2403.02545), Figure 1: Wukong's relative LogLoss change per quadrupling of
# compute on the paper's internal dataset (146B examples, 720 features), over the range of
# compute it covers.
PAPER = {"arch": "wukong", "rel_per_4x": -0.001, "gflops": (1.0, 100.0),
         "source": "Wukong (arXiv 2403.02545) Figure 1: internal data, 146B examples, "
                   "about 1 to 100+ GFLOP/example"}


def per_quadrupling(results: Mapping[str, Any]) -> dict[str, Any]:
  """Per architecture with at least two sizes: NE = a * GFLOPs^c fitted to the seed means
  ("c", "r2", "rel_per_4x" = 4^c - 1) and to each seed's runs ("seed_rel_per_4x", mean,
  std); `PAPER`'s figure beside them under "paper"."""
  by_arch: dict[str, list] = {}
  for r in results["rows"]:
    by_arch.setdefault(r["model"], []).append(r)
  out: dict[str, Any] = {}
  for arch, rows in by_arch.items():
    if len({r["gflops_per_example"] for r in rows}) < 2:
      continue
    f = fit_power_law([r["gflops_per_example"] for r in rows], [r["ne_mean"] for r in rows])
    per_seed: dict[int, list] = {}
    for r in rows:
      for run in r.get("runs", ()):
        per_seed.setdefault(int(run["seed"]), []).append((r["gflops_per_example"], run["ne"]))
    seeds = [4.0 ** fit_power_law([g for g, _ in pts], [y for _, y in pts])["b"] - 1.0
             for _, pts in sorted(per_seed.items()) if len({g for g, _ in pts}) >= 2]
    out[arch] = {"c": f["b"], "r2": f["r2"], "rel_per_4x": 4.0 ** f["b"] - 1.0,
                 "seed_rel_per_4x": seeds,
                 "seed_mean": float(np.mean(seeds)) if seeds else None,
                 "seed_std": float(np.std(seeds, ddof=1)) if len(seeds) > 1 else 0.0}
  return {"archs": out, "paper": dict(PAPER)}


def default_specs(grid: str = "cpu", archs: Sequence[str] = ("wukong", "dlrm", "dcnv2"),
                  sizes: int = 0) -> list[runs.ModelSpec]:
  """The sizes of `archs` in GRIDS[grid]; sizes > 0 keeps that many, spread evenly (more
  than an architecture's grid holds is an error)."""
  if grid not in GRIDS:
    raise ValueError(f"--grid={grid!r}: expected one of {sorted(GRIDS)}")
  specs = []
  for arch in archs:
    if arch not in GRIDS[grid]:
      raise ValueError(f"--archs entry {arch!r}: expected one of {sorted(GRIDS[grid])}")
    presets = GRIDS[grid][arch]
    if sizes > len(presets):
      raise ValueError(f"--sizes={sizes}: more than the {len(presets)} sizes of --grid={grid}'s "
                       f"{arch}; expected at most {len(presets)} (0: all)")
    if 0 < sizes < len(presets):
      presets = tuple(presets[round(i)] for i in np.linspace(0, len(presets) - 1, sizes))
    specs += [runs.ModelSpec(arch, p) for p in presets]
  return specs


def _gap_points(rows, key: str, floor: float, sign: float):
  """(gflops, gap, preset) per size; gap = sign * (metric - floor); non-positive gaps are
  dropped (a power law cannot pass through them) and listed."""
  pts, dropped = [], []
  for r in sorted(rows, key=lambda r: r["gflops_per_example"]):
    gap = sign * (r[f"{key}_mean"] - floor)
    (pts if gap > 0 else dropped).append((r["gflops_per_example"], gap, r["preset"]))
  return pts, dropped


def scaling_fits(results: Mapping[str, Any]) -> dict[str, Any]:
  """Per architecture: the NE-gap fit (primary) and the AUC-gap fit (secondary).

  Returns {"floor": {"ne", "auc", "source"}, "fits": {arch: {"ne": fit, "auc": fit,
  "ne_points" / "auc_points": [{gflops, gap, preset}], "ne_dropped" / "auc_dropped":
  [presets whose gap <= 0]}}}; a fit is None with fewer than two distinct sizes left.
  """
  ref = results.get("reference")
  floor = ({"ne": ref["ne"], "auc": ref["auc"], "source": "true logits on the eval set"} if ref
           else {"ne": 0.0, "auc": 1.0, "source": "none known (file data): NE itself, 1 - AUC"})
  by_arch: dict[str, list] = {}
  for r in results["rows"]:
    by_arch.setdefault(r["model"], []).append(r)
  fits = {}
  for arch, rows in by_arch.items():
    entry: dict[str, Any] = {}
    for key, sign in (("ne", 1.0), ("auc", -1.0)):
      pts, dropped = _gap_points(rows, key, floor[key], sign)
      ok = len({p[0] for p in pts}) >= 2
      entry[key] = fit_power_law([p[0] for p in pts], [p[1] for p in pts]) if ok else None
      entry[f"{key}_points"] = [{"gflops": g, "gap": y, "preset": p} for g, y, p in pts]
      entry[f"{key}_dropped"] = [p for _, _, p in dropped]
    fits[arch] = entry
  return {"floor": floor, "fits": fits, "seed_fits": seed_fits(results, floor),
          "per_quadrupling": per_quadrupling(results)}


def seed_fits(results: Mapping[str, Any], floor: Mapping[str, Any]) -> dict[str, Any]:
  """Per architecture, the NE-gap power law fitted separately to each seed's runs (sizes
  trained with the same seed); the spread of the exponents b over seeds is the fit's
  seed noise. Returns {arch: {"b": [per seed], "b_mean", "b_std", "seeds"}}; an
  architecture is left out when no seed has two sizes with a positive gap."""
  out = {}
  by_arch: dict[str, list] = {}
  for r in results["rows"]:
    by_arch.setdefault(r["model"], []).append(r)
  for arch, rows in by_arch.items():
    per_seed: dict[int, list] = {}
    for r in rows:
      for run in r.get("runs", ()):
        gap = run["ne"] - floor["ne"]
        if gap > 0:
          per_seed.setdefault(int(run["seed"]), []).append((r["gflops_per_example"], gap))
    bs, seeds = [], []
    for seed, pts in sorted(per_seed.items()):
      if len({g for g, _ in pts}) >= 2:
        bs.append(fit_power_law([g for g, _ in pts], [y for _, y in pts])["b"])
        seeds.append(seed)
    if bs:
      out[arch] = {"b": bs, "seeds": seeds, "b_mean": float(np.mean(bs)),
                   "b_std": float(np.std(bs, ddof=1)) if len(bs) > 1 else 0.0}
  return out


def findings(results: Mapping[str, Any], fit: Mapping[str, Any]) -> list[str]:
  """What the points and fits show, as sentences computed from the numbers."""
  out = []
  floor = fit["floor"]
  by_arch: dict[str, list] = {}
  for r in results["rows"]:
    by_arch.setdefault(r["model"], []).append(r)
  slopes = {}
  for arch, rows in by_arch.items():
    rows = sorted(rows, key=lambda r: r["gflops_per_example"])
    lo, hi = rows[0], rows[-1]
    best = min(rows, key=lambda r: r["ne_mean"])
    f = fit["fits"][arch]["ne"]
    s = (f"{arch}: NE {lo['ne_mean']:.4f} -> {hi['ne_mean']:.4f} from "
         f"{lo['gflops_per_example']:.2g} to {hi['gflops_per_example']:.2g} GFLOPs/example "
         f"({hi['gflops_per_example'] / lo['gflops_per_example']:.3g}x)")
    if f is not None:
      slopes[arch] = f["b"]
      s += (f"; NE - floor = {f['a']:.4g} * GFLOPs^{f['b']:+.4f} (R^2 {f['r2']:.2f}, "
            f"{f['n']} sizes)")
    if len(rows) > 1:
      if best is hi:
        # How much of the architecture's total gain the last size step brought.
        last = rows[-2]["ne_mean"] - hi["ne_mean"]
        total = max(r["ne_mean"] for r in rows) - hi["ne_mean"]
        s += (f"; best at the largest size ({best['preset']}), {last:.4f} below the next "
              f"smaller: " + ("still improving at this budget" if last >= 0.1 * total else
                              f"flattening (the last size step gave {100 * last / total:.0f}% "
                              f"of the {total:.4f} gained over the range)"))
      else:
        worse = [r["preset"] for r in rows if r["gflops_per_example"] > best["gflops_per_example"]]
        s += (f"; best NE {best['ne_mean']:.4f} at {best['preset']} "
              f"({best['gflops_per_example']:.2g} GFLOPs/example), larger sizes "
              f"({', '.join(worse)}) do not improve on it: within this range quality "
              f"saturates at NE {best['ne_mean']:.4f} at this budget")
    noise = max(r["ne_std"] for r in rows)
    if rows[0].get("num_seeds", 1) > 1:
      s += f"; NE std over {rows[0]['num_seeds']} seeds up to {noise:.4f}"
    out.append(s + ".")
  if slopes:
    order = sorted(slopes, key=lambda a: slopes[a])
    out.append("NE-gap exponents b (more negative = more gain per FLOP): "
               + ", ".join(f"{a} {slopes[a]:+.4f}" for a in order)
               + (f"; steepest: {order[0]}" if len(order) > 1 else "")
               + (f"; exponents with b >= 0 (no gain from compute): "
                  f"{', '.join(a for a in order if slopes[a] >= 0)}"
                  if any(slopes[a] >= 0 for a in order) else "") + ".")
  per_seed = fit.get("seed_fits") or {}
  if any(len(v["b"]) > 1 for v in per_seed.values()):
    out.append("NE-gap exponent b fitted per seed, mean ± std (n seeds): " + ", ".join(
        f"{a} {v['b_mean']:+.4f} ± {v['b_std']:.4f} ({len(v['b'])})"
        for a, v in sorted(per_seed.items(), key=lambda kv: kv[1]["b_mean"])) + ".")
  quad = fit.get("per_quadrupling") or {}
  if quad.get("archs"):
    paper = quad["paper"]
    def one(a, q):
      s = f"{a} {100 * q['rel_per_4x']:+.2f}%"
      if len(q["seed_rel_per_4x"]) > 1:
        s += (f" (per seed {100 * q['seed_mean']:+.2f}% ± {100 * q['seed_std']:.2f}%, "
              f"{len(q['seed_rel_per_4x'])} seeds)")
      return s
    out.append("Relative NE change per 4x compute (NE = a * GFLOPs^c): "
               + ", ".join(one(a, q) for a, q in sorted(quad["archs"].items(),
                                                         key=lambda kv: kv[1]["rel_per_4x"]))
               + f"; the paper's {paper['arch']}: {100 * paper['rel_per_4x']:+.1f}% per 4x "
               f"({paper['source']}).")
  matched = _matched_compute(by_arch, fit)
  if matched:
    out.append(matched)
  rows = results["rows"]
  best = min(rows, key=lambda r: r["ne_mean"])
  worst = max(rows, key=lambda r: r["ne_mean"])
  line = (f"Best NE overall {best['ne_mean']:.4f} ({best['label']}, "
          f"{best['gflops_per_example']:.2g} GFLOPs/example); spread over all sizes "
          f"{worst['ne_mean'] - best['ne_mean']:.4f}")
  if results.get("reference"):
    closed = (worst["ne_mean"] - best["ne_mean"]) / max(worst["ne_mean"] - floor["ne"], 1e-12)
    line += (f"; floor (true logits) NE {floor['ne']:.4f}, AUC {floor['auc']:.4f}: the best "
             f"model closes {100 * closed:.1f}% of the worst model's NE gap and leaves "
             f"{best['ne_mean'] - floor['ne']:.4f}")
  out.append(line + ".")
  return out


def _matched_compute(by_arch: Mapping[str, list], fit: Mapping[str, Any]) -> str | None:
  """The fitted NE of every architecture at one compute inside all their ranges (the
  geometric middle of the overlap), or None when the ranges do not overlap."""
  fitted = {a: fit["fits"][a]["ne"] for a in by_arch if fit["fits"][a]["ne"] is not None}
  if len(fitted) < 2:
    return None
  lo = max(min(r["gflops_per_example"] for r in by_arch[a]) for a in fitted)
  hi = min(max(r["gflops_per_example"] for r in by_arch[a]) for a in fitted)
  if lo > hi:
    return None
  x = math.sqrt(lo * hi)
  ne = {a: fit["floor"]["ne"] + f["a"] * x ** f["b"] for a, f in fitted.items()}
  order = sorted(ne, key=ne.get)
  return (f"At matched compute, {x:.2g} GFLOPs/example (inside every architecture's range), "
          f"the fits give NE " + ", ".join(f"{a} {ne[a]:.4f}" for a in order)
          + f": lowest {order[0]}.")


def plot_scaling(results: Mapping[str, Any], fit: Mapping[str, Any], path: str) -> str:
  """Left: NE - floor against GFLOPs/example (log-log) with the fitted power laws; middle:
  AUC against GFLOPs/example (log x) with the true logits' AUC; right (with two sizes of
  an architecture): the relative NE change per 4x compute beside the paper's (`PAPER`)."""

  floor = fit["floor"]
  quad = fit.get("per_quadrupling") or {}
  panels = 3 if quad.get("archs") else 2
  with plot_lib.figure(path, 1, panels, figsize=(5.5 * panels, 4.2)) as (fig, axes):
    ax0, ax1 = axes[0], axes[1]
    by_arch: dict[str, list] = {}
    for r in results["rows"]:
      by_arch.setdefault(r["model"], []).append(r)
    for i, (arch, rows) in enumerate(by_arch.items()):
      c = f"C{i}"
      rows = sorted(rows, key=lambda r: r["gflops_per_example"])
      f = fit["fits"][arch]
      pts = f["ne_points"]
      xs = np.array([p["gflops"] for p in pts])
      label = arch
      if f["ne"] is not None:
        label += f": b={f['ne']['b']:+.3f}, R²={f['ne']['r2']:.2f}"
        xx = np.geomspace(xs.min(), xs.max(), 50)
        ax0.plot(xx, f["ne"]["a"] * xx ** f["ne"]["b"], "-", c=c, lw=1.2)
      ax0.errorbar(xs, [p["gap"] for p in pts],
                   yerr=[next(r["ne_std"] for r in rows if r["preset"] == p["preset"]) for p in pts],
                   fmt="o", c=c, capsize=3, label=label)
      ax1.errorbar([r["gflops_per_example"] for r in rows], [r["auc_mean"] for r in rows],
                   yerr=[r["auc_std"] for r in rows], fmt="o-", c=c, capsize=3, label=arch)
    ax0.set_xscale("log")
    ax0.set_yscale("log")
    plot_lib.plain_log_labels(ax0, "y")
    ax0.set(xlabel="forward GFLOPs / example", ylabel="test NE - NE floor",
            title=f"NE gap vs compute (floor {floor['ne']:.4f}: {floor['source']})")
    ax0.title.set_fontsize(9)
    if results.get("reference"):
      ax1.axhline(floor["auc"], ls="--", c="k", lw=1, label="true logits (Bayes)")
    ax1.set_xscale("log")
    ax1.set(xlabel="forward GFLOPs / example", ylabel="test AUC", title="AUC vs compute")
    for a in (ax0, ax1):
      plot_lib.plain_log_labels(a, "x")
      a.grid(alpha=0.3, which="both")
      a.legend(fontsize=8)
    if panels == 3:
      ax2, paper = axes[2], quad["paper"]
      names = list(quad["archs"])
      vals = [100 * quad["archs"][a]["rel_per_4x"] for a in names]
      errs = [100 * quad["archs"][a]["seed_std"] for a in names]
      ax2.bar(range(len(names)), vals, yerr=errs, capsize=3,
              color=[f"C{i}" for i in range(len(names))])
      ax2.bar(len(names), 100 * paper["rel_per_4x"], color="none", edgecolor="k", hatch="//")
      ax2.set_xticks(range(len(names) + 1),
                     [f"{a}\n(ours)" for a in names] + [f"{paper['arch']}\n(paper, "
                                                         f"{paper['gflops'][0]:g}-"
                                                         f"{paper['gflops'][1]:g}+ GFLOPs)"],
                     fontsize=8)
      ax2.axhline(0, c="k", lw=0.8)
      ax2.set(ylabel="relative NE change per 4x compute (%)",
              title="ours (seed std) beside the paper's Figure 1")
      ax2.title.set_fontsize(9)
      ax2.grid(alpha=0.3, axis="y")
    cfg = results["config"]
    fig.suptitle(f"{cfg['data']}: {results['rows'][0]['examples']:,} train examples per model "
                 f"(batch {cfg['batch_size']}), dim {cfg['embedding_dim']}, seeds {results['seeds']}",
                 fontsize=10)
  return path


def format_fits(fit: Mapping[str, Any]) -> str:
  """One line per architecture: the NE-gap and AUC-gap power laws."""
  lines = [f"power-law fits, gap = a * GFLOPs^b (least squares in log space; floor NE "
           f"{fit['floor']['ne']:.4f}, AUC {fit['floor']['auc']:.4f}: {fit['floor']['source']})"]
  for arch, f in fit["fits"].items():
    parts = []
    for key, name in (("ne", "NE - floor"), ("auc", "AUC floor - AUC")):
      g = f[key]
      parts.append(f"{name}: " + ("n/a (fewer than 2 sizes)" if g is None else
                                  f"a={g['a']:.4g} b={g['b']:+.4f} R^2={g['r2']:.3f}"))
      if f[f"{key}_dropped"]:
        parts[-1] += f" (dropped, gap <= 0: {', '.join(f[f'{key}_dropped'])})"
    sf = (fit.get("seed_fits") or {}).get(arch)
    if sf is not None:
      parts.append("NE b per seed " + ", ".join(f"{b:+.4f}" for b in sf["b"])
                   + f" (mean {sf['b_mean']:+.4f} ± {sf['b_std']:.4f})")
    lines.append(f"  {arch:8} " + " | ".join(parts))
  return "\n".join(lines)
