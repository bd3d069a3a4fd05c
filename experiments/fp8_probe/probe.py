"""Where FP8 is safe in a recommendation model's dense part: LoKA's "Probe" ("Low-precision
Kernel Applications for Recommendation Models At Scale"), and FP8 training against fp32
and bf16.

The study of `experiments.fp8_probe` (the FP8 layer itself is rec/layers/fp8.py); a
notebook can call it too:

    cfg = configs.make_run(model="dcnv2", preset="small", data="synthetic")
    trained = train_reference(cfg, steps=300, workdir="runs/fp8")     # fp32, kept
    report = probe(trained, recipe="tensor", max_batches=4)
    print(format_probe(report))
    safe = report["safe_layers"]                                        # "top_mlp.0,..."

`probe` runs a trained model on real (eval) batches once in fp32 and once per layer with
only that layer's matmuls in FP8 (E4M3 forward, E5M2 backward, rec/layers/fp8.py), the
embeddings looked up once and shared, and reports per layer:
  out_sqnr_db    the layer's output against its float32 matmul on the same input (the
                 input is the fp32 model's, as every other layer is fp32): local error
  grad_sqnr_db   the gradient of the loss w.r.t. the layer's kernels against fp32's
                 (the E5M2 backward and the forward error together)
  logit_sqnr_db  the model's logits against fp32's
  logloss, auc   on the batches, and their change against fp32
then the same for every layer in FP8 at once. A layer is "safe" when its log loss grows
by at most `max_logloss_increase` (relative); `safe_layers` lists them as an fp8_layers
pattern. The per-layer changes are not additive: `all` shows what they add up to.

`train_variants` trains the same model from scratch as fp32, bf16 and FP8 variants
(through `rec.runs.train_model`, same data, seeds and budget) for the quality table.
`step_times` times one train step per variant; off a GPU the FP8 formats are emulated
(the quantizers are integer bit arithmetic and the float8 dot is upcast), so CPU times
say nothing about FP8 speed: the same code on an H100 runs float8 dots (see
rec/layers/fp8.py).

Letters: B batch, F sparse features, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core import benchmark
from core import config
from rec import configs
from rec import metrics as metrics_lib
from rec import runs
from rec.layers import fp8

KERNEL_KEYS = ("kernel", "down", "up")

# The study's own settings (its entry point's flags).
VARIANTS_SETTING = config.setting(
    "variants", "list", "Training variants (probe.VARIANTS); fp8_safe is added when the "
    "probe's safe layers are some but not all.")
PROBE_RECIPES = config.setting("probe_recipes", "list", "Scalings the probe tries.")
MAX_LOGLOSS_INCREASE = config.setting(
    "max_logloss_increase", "float", "A layer is safe in FP8 when eval log loss grows by at "
    "most this fraction with that layer alone in FP8.")
TIMING_STEPS = config.setting("timing_steps", "integer", "Train steps per timing repeat (0: "
                              "no timing).", lower=0)
TIMING_REPEATS = config.setting("timing_repeats", "integer", "Timing repeats (median "
                                "reported).", lower=1)

# The training variants of the quality table: RecRunConfig overrides.
VARIANTS: dict[str, dict[str, str]] = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "fp8_tensor": {"fp8_layers": "all", "fp8_recipe": "tensor"},
    "fp8_row": {"fp8_layers": "all", "fp8_recipe": "row"},
    "fp8_delayed": {"fp8_layers": "all", "fp8_recipe": "delayed"},
}


@dataclasses.dataclass
class Trained:
  """A trained fp32 run: its config, model config, task, state and eval batches' sources."""

  cfg: configs.RecRunConfig
  model_cfg: Any
  task: Any
  state: dict[str, Any]
  eval_src: Any
  row: dict[str, Any]          # rec.runs.train_model's row (metrics, steps, timings)


def train_reference(cfg: configs.RecRunConfig, workdir: str, steps: int | None = None,
                    epochs: float | None = None, seed: int = 0, log_every: int = 100) -> Trained:
  """Trains `cfg` (fp32 dense part) once and keeps its final state for the probe."""
  cfg = configs.replace_run(cfg, dtype="float32", fp8_layers="")
  kept = []
  row = runs.train_model(cfg, runs.ModelSpec(cfg.model.model, cfg.model.preset), [seed],
                         os.path.join(workdir, "fp32"), steps=steps, epochs=epochs,
                         log_every=log_every, keep=kept.append)
  run, = kept
  return Trained(cfg, run.model_config, run.task, run.state, run.eval_src, row)


def eval_inputs(trained: Trained, max_batches: int | None = None) -> list[tuple]:
  """[(dense_BD, emb_BFD, labels_B, mask_B)] on device: the eval batches with their pooled
  embeddings looked up once from the trained tables, the padding rows (mask 0: a last
  partial batch) dropped, so that the SQNRs (which no mask weighs) and FP8's per-tensor
  scales see only real examples."""
  task = trained.task
  lookup = jax.jit(task.collection.lookup)
  out = []
  for host in trained.eval_src.batches(0):
    keep = np.flatnonzero(np.asarray(host.mask) > 0)
    if keep.size == 0:
      continue
    b = task.device_batch(host)
    row = (b.dense, lookup(trained.state["emb"], b.ids, b.lengths, b.weights), b.labels,
           b.mask)
    if keep.size < len(host.mask):
      row = tuple(None if x is None else x[keep] for x in row)
    out.append(row)
    if max_batches is not None and len(out) >= max_batches:
      break
  if not out:
    raise ValueError("fp8_probe.eval_inputs: the eval source gave no batch")
  return out


def _model(mcfg, layers: str, recipe: str):
  cfg = dataclasses.replace(mcfg, fp8_layers=layers, fp8_recipe=recipe)
  return nnx.eval_shape(lambda: configs.MODELS[type(cfg)](cfg, nnx.Rngs(0)))


def _layer_path(name: str) -> tuple:
  """"top_mlp.1" -> ("top_mlp", "layers", 1): where a layer sits in the params dict."""
  mod, _, idx = name.rpartition(".")
  return (mod, "layers", int(idx))


def _kernels(tree: dict, name: str) -> list[jax.Array]:
  node = tree
  for k in _layer_path(name):
    node = node[k]
  return [node[k] for k in KERNEL_KEYS if k in node]


def _variant_fn(mcfg, layers: str, recipe: str):
  """jit(params, batch) -> (logits, {layer: [err, ref]} of the FP8 layers, grads)."""
  graphdef = nnx.split(_model(mcfg, layers, recipe))[0]

  def run(params, dense, emb, labels, mask):
    def loss_fn(p):
      model = nnx.merge(graphdef, p)
      with fp8.capture_errors():
        logits, inter = nnx.capture(model, nnx.Intermediate)(dense, emb)
      per_ex = optax.sigmoid_binary_cross_entropy(logits, labels)
      loss = jnp.sum(per_ex * mask) / jnp.maximum(jnp.sum(mask), 1.0)
      errs = {}
      for path, v in nnx.to_flat_state(inter):
        if path[-1] == "fp8_error":
          errs[f"{path[0]}.{path[2]}"] = v.get_value()[0] if hasattr(v, "get_value") else v.value[0]
      return loss, (logits, errs)
    (_, (logits, errs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return logits, errs, grads

  return jax.jit(run)


def _sqnr_db(err: float, ref: float) -> float:
  if err == 0:
    return float("inf")
  if ref == 0:
    return float("-inf")
  return float(10 * np.log10(ref / err))


def _metrics(logits: list[np.ndarray], inputs) -> dict[str, float]:
  m = metrics_lib.RecMetrics()
  for lg, (_, _, labels, mask) in zip(logits, inputs):
    m.update(np.asarray(lg), np.asarray(labels), np.asarray(mask))
  r = m.result()
  return {"logloss": float(r["logloss"]), "auc": float(r["auc"])}


def probe(trained: Trained, recipe: str = "tensor", layers: Sequence[str] | None = None,
          max_batches: int | None = 8, max_logloss_increase: float = 1e-3,
          inputs: list[tuple] | None = None, progress=print) -> dict[str, Any]:
  """Per-layer FP8 errors of a trained model on its eval batches (module docstring).

  recipe: "tensor" or "row" (current scaling: the trained fp32 state loads unchanged).
  Returns {recipe, batches, examples, fp32: {logloss, auc}, layers: [rows], all: row,
  safe_layers: pattern, max_logloss_increase}.
  """
  if fp8.get_recipe(recipe).delayed:
    raise ValueError("fp8_probe.probe: recipe='delayed' needs a trained amax history; probe "
                     "with 'tensor' or 'row' (current scaling)")
  mcfg = dataclasses.replace(trained.model_cfg, fp8_layers="")
  names = list(layers) if layers else list(mcfg.fp8_layer_names)
  inputs = inputs if inputs is not None else eval_inputs(trained, max_batches)
  params = trained.state["params"]

  def run(layer_pattern):
    fn = _variant_fn(mcfg, layer_pattern, recipe)
    logits, errs, grads = [], {}, []
    for dense, emb, labels, mask in inputs:
      lg, e, g = fn(params, dense, emb, labels, mask)
      logits.append(np.asarray(lg))
      for k, v in e.items():
        errs[k] = errs.get(k, 0.0) + np.asarray(v, np.float64)
      grads.append(g)
    return logits, errs, grads

  t0 = time.perf_counter()
  base_logits, _, base_grads = run("")
  base = _metrics(base_logits, inputs)
  ref_logit = sum(float(np.sum(np.asarray(l, np.float64) ** 2)) for l in base_logits)

  def row_for(name, pattern):
    logits, errs, grads = run(pattern)
    m = _metrics(logits, inputs)
    lerr = sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2))
               for a, b in zip(logits, base_logits))
    row = {"layer": name, **m, "d_logloss": m["logloss"] - base["logloss"],
           "rel_logloss": (m["logloss"] - base["logloss"]) / base["logloss"],
           "d_auc": m["auc"] - base["auc"], "logit_sqnr_db": _sqnr_db(lerr, ref_logit)}
    touched = names if pattern == "all" else [name]
    gerr = gref = 0.0
    for g, g0 in zip(grads, base_grads):
      for n in touched:
        for a, b in zip(_kernels(g, n), _kernels(g0, n)):
          a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
          gerr += float(np.sum((a - b) ** 2))
          gref += float(np.sum(b ** 2))
    row["grad_sqnr_db"] = _sqnr_db(gerr, gref)
    if pattern != "all":
      e = errs[name]
      row["out_sqnr_db"] = _sqnr_db(float(e[0]), float(e[1]))
    else:
      row["out_sqnr_db_by_layer"] = {n: _sqnr_db(float(errs[n][0]), float(errs[n][1]))
                                     for n in names}
    return row

  rows = []
  for name in names:
    rows.append(row_for(name, name))
    r = rows[-1]
    progress(f"  probe {name}: out {r['out_sqnr_db']:.1f} dB, grad {r['grad_sqnr_db']:.1f} dB, "
             f"logloss {r['rel_logloss']:+.2e} (rel)")
  every = row_for("all", "all")
  safe = [r["layer"] for r in rows if r["rel_logloss"] <= max_logloss_increase]
  return {"recipe": recipe, "batches": len(inputs),
          "examples": int(sum(float(np.sum(np.asarray(m))) for *_, m in inputs)),
          "fp32": base, "layers": rows, "all": every, "safe_layers": ",".join(safe),
          "max_logloss_increase": max_logloss_increase,
          "seconds": time.perf_counter() - t0}


def format_probe(report: dict[str, Any]) -> str:
  b = report["fp32"]
  lines = [f"FP8 probe ({report['recipe']} scaling, {report['examples']} eval examples): fp32 "
           f"logloss {b['logloss']:.5f}, AUC {b['auc']:.5f}",
           f"{'layer':<14} {'out SQNR':>9} {'grad SQNR':>10} {'logit SQNR':>11} "
           f"{'d logloss':>11} {'rel':>10} {'d AUC':>9} {'safe':>5}"]
  safe = set(report["safe_layers"].split(",")) if report["safe_layers"] else set()
  for r in report["layers"] + [report["all"]]:
    out = f"{r['out_sqnr_db']:9.2f}" if "out_sqnr_db" in r else f"{'-':>9}"
    mark = "yes" if r["layer"] in safe else ("" if r["layer"] == "all" else "no")
    lines.append(f"{r['layer']:<14} {out} {r['grad_sqnr_db']:10.2f} {r['logit_sqnr_db']:11.2f} "
                 f"{r['d_logloss']:+11.2e} {r['rel_logloss']:+10.2e} {r['d_auc']:+9.5f} "
                 f"{mark:>5}")
  return "\n".join(lines)


# --------------------------------------------------------------------------- training


def train_variants(cfg: configs.RecRunConfig, variants: dict[str, dict[str, str]],
                   workdir: str, seeds: Sequence[int] = (0,), steps: int | None = None,
                   epochs: float | None = None, log_every: int = 100,
                   done: dict[str, dict] | None = None) -> dict[str, dict[str, Any]]:
  """Trains `cfg` once per variant (RecRunConfig overrides) and seed; {variant: the row of
  rec.runs.train_model} (test AUC, log loss, NE and accuracy: mean and std over seeds).
  `done`: rows already trained (e.g. the probe's fp32 run), reused by name."""
  rows = dict(done or {})
  spec = runs.ModelSpec(cfg.model.model, cfg.model.preset)
  for name, over in variants.items():
    if name in rows:
      continue
    v = configs.replace_run(cfg, **over)
    rows[name] = runs.train_model(v, spec, seeds, os.path.join(workdir, name), steps=steps,
                                  epochs=epochs, log_every=log_every)
  return {name: rows[name] for name in variants}


def format_variants(rows: dict[str, dict[str, Any]], ref: str = "fp32") -> str:
  base = rows.get(ref)
  lines = [f"{'variant':<16} {'AUC':>17} {'logloss':>17} {'d AUC':>9} {'d logloss':>10} "
           f"{'s/run':>7}"]
  for name, r in rows.items():
    da = f"{r['auc_mean'] - base['auc_mean']:+9.5f}" if base else ""
    dl = f"{r['logloss_mean'] - base['logloss_mean']:+10.5f}" if base else ""
    lines.append(f"{name:<16} {r['auc_mean']:.5f} ± {r['auc_std']:.5f} "
                 f"{r['logloss_mean']:.5f} ± {r['logloss_std']:.5f} {da} {dl} "
                 f"{r['wall_seconds_mean']:7.1f}")
  return "\n".join(lines)


def step_times(cfg: configs.RecRunConfig, variants: dict[str, dict[str, str]], steps: int = 10,
               repeats: int = 3) -> dict[str, Any]:
  """Median seconds per train step of each variant on one fixed batch (compile excluded),
  with the device they ran on. Every variant is built and compiled first; then the timed
  repeats take turns (`benchmark.time_interleaved`), so a change in the machine's load
  falls on every variant alike and their ratios hold."""
  out: dict[str, Any] = {"device": jax.devices()[0].device_kind,
                         "platform": jax.default_backend(), "variants": {}}
  runs_by_name = {}
  for name, over in variants.items():
    task, train_src, _, _, _ = configs.build_run(configs.replace_run(cfg, **over))
    batch = task.device_batch(next(iter(train_src.batches(0))))
    step = jax.jit(task.train_step, donate_argnums=0)
    runs_by_name[name] = ((lambda s, step=step, batch=batch: step(s, batch)[0]),
                          task.init_state(0))
  per_step, _ = benchmark.time_interleaved(runs_by_name, steps, repeats)
  for name in variants:
    out["variants"][name] = {"median_s": benchmark.median(per_step[name]),
                             "per_repeat_s": per_step[name]}
  return out


def plot(results: dict[str, Any], path: str) -> str:
  """Per model: the probe's per-layer output and gradient SQNR (first recipe), and each
  training variant's log loss change against fp32 (its log loss where no fp32 variant
  trained)."""
  from core import plot as plot_lib
  models = results["models"]
  with plot_lib.figure(path, len(models), 2, figsize=(12, 3.6 * len(models)),
                       squeeze=False) as (fig, axes):
    for (a, b), m in zip(axes, models):
      rep = m["probes"][0] if m["probes"] else None
      if rep:
        names = [r["layer"] for r in rep["layers"]]
        x = np.arange(len(names))
        a.bar(x - 0.2, [r["out_sqnr_db"] for r in rep["layers"]], 0.4, label="layer output")
        a.bar(x + 0.2, [r["grad_sqnr_db"] for r in rep["layers"]], 0.4, label="kernel gradient")
        a.set_xticks(x, names, rotation=30, fontsize=8)
        a.set(ylabel="SQNR vs fp32 (dB)",
              title=f"{m['label']}: probe, one layer in FP8 ({rep['recipe']} scaling)")
        a.legend(fontsize=8)
      rows = m["variants"]
      names = list(rows)
      # Without an fp32 variant (--variants) there is nothing to subtract: the log loss
      # itself, labelled so.
      base = rows["fp32"]["logloss_mean"] if "fp32" in rows else 0.0
      b.bar(names, [rows[n]["logloss_mean"] - base for n in names],
            yerr=[rows[n]["logloss_std"] for n in names], capsize=3)
      b.axhline(0, color="k", lw=0.8)
      b.set(ylabel="test log loss - fp32's" if "fp32" in rows else "test log loss",
            title=f"{m['label']}: trained from scratch")
      b.tick_params(axis="x", rotation=30, labelsize=8)
      for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
  return path
