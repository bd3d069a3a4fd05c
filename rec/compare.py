"""Train several recommendation models under one budget and compare them.

The library behind `experiments.compare_rec` (and the training half of
`experiments.wukong_scaling`); a notebook can call `compare_models` directly:

    base = configs.RecRunConfig(data="synthetic", embedding_dim=16, batch_size=1024)
    res = compare_models(base, parse_models(["dlrm", "wukong:l2_n8"]), seeds=(0, 1), steps=300,
                         workdir="runs/compare")
    print(format_table(res))

Every model gets the same data (hashing, rows per feature, batches in the same order), the
same batch size, embedding dim (logistic regression keeps its dim-1 tables), dense and
sparse optimizers, learning rates and number of steps (or epochs). Each model is built once
and trained once per seed: a seed sets the parameter initialization (dense and embedding)
only; the data is the same for every seed (synthetic data draws from the hidden model of
`base.seed`), so the spread over seeds is initialization noise. Per model: mean and sample std over seeds of test AUC, log loss and
NE, dense and embedding parameter counts, forward GFLOPs per example of the dense part
(XLA's count, `configs.model_stats`) and wall time per run. On synthetic data the same
metrics of the true planted logits (`reference_metrics`, the Bayes ceiling) come along.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from core import train as train_lib
from rec import configs
from rec.data import sources as sources_lib
from rec.data.batch import DataSpec
from rec.metrics import RecMetrics

METRICS = ("auc", "logloss", "ne", "accuracy")
_CRITEO_SHAPED = DataSpec(num_dense=13, sparse_features=tuple(f"C{i + 1}" for i in range(26)),
                          rows_per_feature=(10,) * 26, max_ids_per_bag=1)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One model to train: a family (configs.MODEL_PRESETS key) and a preset of it."""

  model: str
  preset: str = "kaggle"

  @property
  def label(self) -> str:
    return f"{self.model}:{self.preset}"


def parse_presets(text: str | Mapping[str, str] | Iterable[str]) -> dict[str, str]:
  """'wukong=l2_n8,dhen=dhen_2l' (or a list of 'model=preset', or a dict) -> {model: preset}."""
  if isinstance(text, Mapping):
    return dict(text)
  items = [t for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
  out = {}
  for item in items:
    model, eq, preset = item.strip().partition("=")
    if not eq or not model or not preset:
      raise ValueError(f"--presets item {item!r}: expected model=preset, e.g. wukong=l2_n8")
    out[model] = preset
  return out


def parse_models(models: Sequence[str], presets: str | Mapping[str, str] = "") -> list[ModelSpec]:
  """Model entries 'dlrm' or 'wukong:l3_n16' -> specs. An entry without a preset takes the
  model's preset from `presets` ('wukong=l2_n8,...'), else 'kaggle'. Presets are checked
  when the model is built (configs.model_config)."""
  by_model = parse_presets(presets)
  known = set(configs.MODEL_PRESETS) | {"logreg"}
  unused = set(by_model) - {m.partition(":")[0].strip() for m in models}
  if unused:
    raise ValueError(f"--presets names {sorted(unused)}, which are not in --models={list(models)}")
  specs = []
  for entry in models:
    model, _, preset = entry.strip().partition(":")
    if model not in known:
      raise ValueError(f"--models entry {entry!r}: model {model!r}, expected one of "
                       f"{sorted(known)}")
    specs.append(ModelSpec(model, preset or by_model.get(model, "kaggle")))
  if len(set(specs)) != len(specs):
    raise ValueError(f"--models={list(models)} lists a (model, preset) twice")
  return specs


def reference_metrics(eval_src) -> dict[str, float] | None:
  """Metrics of the true logits on the eval set of a synthetic source (the Bayes ceiling of
  AUC and floor of log loss / NE on exactly these examples); None for file data."""
  if not hasattr(eval_src, "true_logits"):
    return None
  m = RecMetrics()
  for batch in eval_src.batches(0):
    m.update(eval_src.true_logits(batch), batch.labels, batch.mask)
  return m.result()


def run_config(base: configs.RecRunConfig, spec: ModelSpec) -> configs.RecRunConfig:
  """`base` for `spec`'s model and preset. Logistic regression keeps its dim-1 tables (one
  weight per id) whatever the shared embedding dim."""
  dim = 0 if spec.model == "logreg" else base.embedding_dim
  return dataclasses.replace(base, model=spec.model, preset=spec.preset, embedding_dim=dim)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
  v = np.asarray(values, np.float64)
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def train_model(base: configs.RecRunConfig, spec: ModelSpec, seeds: Sequence[int],
                workdir: str, steps: int | None = None, epochs: float | None = None,
                log_every: int = 100, keep_checkpoints: bool = False) -> dict[str, Any]:
  """Builds `spec` on `base`'s data and settings and trains it once per seed.

  Returns the model's row: model, preset, steps, examples, params / GFLOPs, per-seed
  `runs`, and `<metric>_mean` / `<metric>_std` over seeds for METRICS, wall_seconds and
  examples_per_sec. Runs go to `<workdir>/runs/<model>_<preset>_s<seed>` (replaced if
  present); their checkpoints are deleted unless keep_checkpoints.
  """
  if (steps is None) == (epochs is None):
    raise ValueError(f"train_model: steps={steps}, epochs={epochs}; give exactly one")
  cfg = run_config(base, spec)
  task, train_src, eval_src, _, _ = configs.build_run(cfg)
  n_steps = configs.steps_for(epochs, train_src) if epochs is not None else int(steps)
  stats = configs.model_stats(task, train_src.spec)
  runs = []
  for seed in seeds:
    run_dir = os.path.join(workdir, "runs", f"{spec.model}_{spec.preset}_s{seed}")
    if os.path.isdir(run_dir):  # a previous run of this experiment: start it afresh
      shutil.rmtree(run_dir)
    print(f"== {spec.label} seed {seed}: {n_steps} steps of {cfg.batch_size} | dense params "
          f"{stats['dense_params']:,} | {stats['gflops_per_example']:.6f} GFLOPs/example",
          flush=True)
    t0 = time.perf_counter()
    out = train_lib.train(
        task, train_src.batches, lambda: eval_src.batches(0),
        train_lib.TrainConfig(workdir=run_dir, steps=n_steps, log_every=max(1, log_every),
                              seed=int(seed), tensorboard=False))
    wall = time.perf_counter() - t0
    if not keep_checkpoints:
      shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    ev = out["eval"]
    runs.append({"seed": int(seed), **{k: float(ev[k]) for k in METRICS},
                 "eval_examples": int(ev["num_examples"]), "wall_seconds": wall,
                 "train_seconds": out["train_seconds"],
                 "examples_per_sec": out["examples_per_sec"], "workdir": run_dir})
  row: dict[str, Any] = {"model": spec.model, "preset": spec.preset, "label": spec.label,
                         "steps": n_steps, "examples": n_steps * cfg.batch_size, **stats,
                         "num_seeds": len(runs)}
  for k in METRICS + ("wall_seconds", "examples_per_sec"):
    row[f"{k}_mean"], row[f"{k}_std"] = _mean_std([r[k] for r in runs])
  row["runs"] = runs
  return row


def compare_models(base: configs.RecRunConfig, specs: Sequence[ModelSpec],
                   seeds: Sequence[int] = (0,), steps: int | None = None,
                   epochs: float | None = None, workdir: str = "runs/compare_rec",
                   log_every: int = 100, keep_checkpoints: bool = False) -> dict[str, Any]:
  """Trains every spec under the same budget (see the module docstring); returns
  {"config", "seeds", "steps", "epochs", "rows" (one per spec, `train_model`), "reference"
  (true-logit metrics on synthetic data, else None), "wall_seconds"}."""
  if not specs:
    raise ValueError("compare_models: no models to compare")
  if not seeds:
    raise ValueError("compare_models: no seeds")
  for spec in specs:  # unknown presets fail now, not after the first models have trained
    configs.model_config(run_config(base, spec), _CRITEO_SHAPED)
  t0 = time.perf_counter()
  reference = None
  if sources_lib.synthetic_options(base.data) is not None:
    _, eval_src = sources_lib.make_sources(
        base.data, base.batch_size, eval_batch_size=base.eval_batch_size,
        num_rows=base.num_rows, seed=base.seed, eval_batches=base.eval_batches)
    reference = reference_metrics(eval_src)
  rows = [train_model(base, s, seeds, workdir, steps=steps, epochs=epochs, log_every=log_every,
                      keep_checkpoints=keep_checkpoints) for s in specs]
  return {"config": dataclasses.asdict(base), "seeds": [int(s) for s in seeds], "steps": steps,
          "epochs": epochs, "rows": rows, "reference": reference,
          "wall_seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- reporting

def _pm(row: Mapping[str, Any], key: str, digits: int = 4) -> str:
  mean, std = row[f"{key}_mean"], row[f"{key}_std"]
  return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if row["num_seeds"] > 1 else "")


def format_table(results: Mapping[str, Any]) -> str:
  """The human table: one line per model (mean ± std over seeds), and the Bayes line on
  synthetic data."""
  rows = results["rows"]
  multi = any(r["num_seeds"] > 1 for r in rows)
  w = 17 if multi else 8
  head = (f"{'model':26} {'AUC':>{w}} {'logloss':>{w}} {'NE':>{w}} {'dense params':>13} "
          f"{'emb params':>12} {'GFLOPs/ex':>10} {'ex/s':>8} {'wall s':>7}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['label']:26} {_pm(r, 'auc'):>{w}} {_pm(r, 'logloss'):>{w}} "
                 f"{_pm(r, 'ne'):>{w}} {r['dense_params']:>13,} {r['embedding_params']:>12,} "
                 f"{r['gflops_per_example']:>10.6f} {r['examples_per_sec_mean']:>8,.0f} "
                 f"{r['wall_seconds_mean']:>7.1f}")
  ref = results.get("reference")
  if ref:
    lines.append(f"{'true logits (Bayes)':26} {ref['auc']:>{w}.4f} {ref['logloss']:>{w}.4f} "
                 f"{ref['ne']:>{w}.4f}")
  seeds = results["seeds"]
  lines.append(f"{rows[0]['steps']} steps x {results['config']['batch_size']} examples per "
               f"model and seed; seeds {seeds}" + (" (mean ± sample std)" if multi else "")
               + f"; wall time per run; {results['wall_seconds']:.0f} s in all")
  return "\n".join(lines)


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


def plain_log_labels(ax, which: str) -> None:
  """Tick labels of a log axis as plain numbers. Minor ticks are labeled too when the axis
  spans less than a decade, only at 2x and 5x when it spans less than three (else they
  crowd)."""
  from matplotlib import ticker
  lo, hi = ax.get_xlim() if which == "x" else ax.get_ylim()
  axis = ax.xaxis if which == "x" else ax.yaxis

  def minor(v, _):
    mantissa = round(v / 10 ** math.floor(math.log10(v)), 6) if v > 0 else 0
    return f"{v:.3g}" if hi < 10 * lo or (hi < 1000 * lo and mantissa in (2, 5)) else ""

  axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
  axis.set_minor_formatter(ticker.FuncFormatter(minor))


def plot_comparison(results: Mapping[str, Any], path: str) -> str:
  """AUC and NE bars (error bars: std over seeds; dashed: the Bayes ceiling on synthetic
  data) and NE against forward GFLOPs/example (log x)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = results["rows"]
  ref = results.get("reference")
  labels = [r["label"] for r in rows]
  x = np.arange(len(rows))
  colors = [f"C{i}" for i in range(len(rows))]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
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
  plain_log_labels(ax, "x")
  ax.set(xlabel="forward GFLOPs / example (dense part)", ylabel="test NE", title="NE vs compute")
  ax.legend(fontsize=7)
  for a in axes:
    a.grid(alpha=0.3)
  cfg = results["config"]
  fig.suptitle(f"{cfg['data']}: {rows[0]['steps']} steps x {cfg['batch_size']}, dim "
               f"{cfg['embedding_dim'] or 'preset'}, seeds {results['seeds']}", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


