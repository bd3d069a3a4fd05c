"""Training runs of a `RecRunConfig` that hand back what they trained: the helper studies
and notebooks share (experiments.compare_rec, wukong_scaling, mp_embedding, fp8_probe, pvf).

    run = train_run(configs.make_run(preset="small"), "runs/x", steps=300)
    run.state, run.eval["auc"]                          # the trained state, its eval metrics
    row = train_seeds(cfg, seeds=(0, 1), run_prefix="runs/y", steps=300)  # mean, std over seeds
    res = train_models(base, parse_models(["dlrm", "wukong:l2_n8"]), seeds=(0, 1), steps=300,
                       workdir="runs/z")
    print(format_runs(res))

A long study resumes: every finished run leaves `<its workdir>/run.json` (its settings and
metrics), and `train_models(..., reuse_finished=True)` takes a run from there instead of
training it again when the settings, steps and seed are the ones recorded; a recorded run
with other settings is an error naming them (`finished_run`). A run never replaces another:
a workdir holding an earlier run (its record, metrics or checkpoints) is refused before
anything trains (`check_fresh`: a study's --resume reuses it, or a fresh --workdir), except
where the caller says that run is unfinished and to be trained again (`overwrite=True`).

Everything trains through `configs.build_run` and `core.train.train`; nothing here is a
second loop. A seed sets the parameter initialization (dense and embedding) only: the data
is the config's (`RecRunConfig.seed` picks the synthetic hidden model and the batch
stream), so a spread over seeds is initialization noise. `train_models` gives every model
the same data, batch size, embedding dim (logistic regression keeps its dim-1 tables),
optimizers, learning rates and number of steps (or epochs); on synthetic data it adds the
metrics of the true planted logits on the same eval examples (`reference_metrics`, the
Bayes ceiling).

`ModelSpec` is the `model[:preset]` setting of the studies' --models flags, parsed once by
`parse_models`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from core import results as results_lib
from core import train as train_lib
from core.errors import UserError
from rec import configs
from rec.data import sources as sources_lib
from rec.data.batch import DataSpec
from rec.metrics import RecMetrics

METRICS = ("auc", "logloss", "ne", "accuracy")
# Data shaped like Criteo (13 dense, 26 sparse features): presets are checked against it
# before anything trains.
CRITEO_SHAPED = DataSpec(num_dense=13, sparse_features=tuple(f"C{i + 1}" for i in range(26)),
                         rows_per_feature=(10,) * 26, max_ids_per_bag=1)


# --------------------------------------------------------------------------- one run


@dataclasses.dataclass
class TrainedRun:
  """A finished run: its config, task and sources, the final train state and eval metrics."""

  cfg: configs.RecRunConfig
  task: Any                       # rec.train_lib.RecTask
  train_src: Any
  eval_src: Any
  state: dict[str, Any]           # step, params (pure dict), opt, emb (collection layout)
  eval: dict[str, Any]            # the eval metrics at the end (rec.metrics; grouped: dicts)
  steps: int
  seed: int
  workdir: str
  wall_seconds: float
  train_seconds: float
  examples_per_sec: float

  @property
  def model_config(self):
    """The model config the run trained (configs.model_config on its data)."""
    return configs.model_config(self.cfg, self.train_src.spec)


def _check_budget(where: str, steps, epochs) -> None:
  if (steps is None) == (epochs is None):
    raise ValueError(f"{where}: steps={steps}, epochs={epochs}; give exactly one")


RUN_RECORD = "run.json"
# What a run leaves in its workdir: its record (train_seeds), core.train's metrics,
# checkpoints and TensorBoard events.
RUN_OUTPUTS = (RUN_RECORD, "metrics.jsonl", "checkpoints", "tb")


def earlier_run(workdir: str) -> list[str]:
  """What an earlier run left in `workdir` (RUN_OUTPUTS present), [] for none."""
  return [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(workdir, n))]


def check_fresh(workdirs: Iterable[str], resume_flag: bool = True) -> None:
  """Raises one UserError naming the run directories of `workdirs` that hold an earlier
  run (`earlier_run`), before anything trains: one run per workdir, and a run never
  replaces another's results. `resume_flag`: the study has --resume (reuse_finished) to
  take finished runs from there."""
  held = [(d, found) for d in workdirs if (found := earlier_run(d))]
  if not held:
    return
  (first, found), more = held[0], len(held) - 1
  where = f"{first}" + (f" (and {more} more run director{'ies' if more > 1 else 'y'})"
                        if more else "")
  how = ("reuse its finished runs with --resume (where the study has it; "
         "reuse_finished=True), or choose a fresh --workdir" if resume_flag
         else "choose a fresh --workdir")
  raise UserError(f"{where}: holds an earlier run ({', '.join(found)}); expected a fresh "
                  f"run directory (one run per workdir, never replaced): {how}, or delete "
                  "it to train again")


def train_run(cfg: configs.RecRunConfig, workdir: str, *, steps: int | None = None,
              epochs: float | None = None, seed: int = 0, log_every: int = 100,
              keep_checkpoints: bool = False, built: tuple | None = None,
              overwrite: bool = False) -> TrainedRun:
  """Builds `cfg` (or takes `built`, a `configs.build_run(cfg)` result, to train the same
  build again) and trains it for `steps` or `epochs` from initialization seed `seed` in
  `workdir`. A workdir holding an earlier run is refused before anything is built
  (`check_fresh`) unless `overwrite`: the caller knows that run to be unfinished, and its
  outputs are deleted (core.train's --overwrite, and its run record). Its checkpoints are
  deleted unless keep_checkpoints; the final state comes back in memory either way."""
  _check_budget("train_run", steps, epochs)
  if not overwrite:
    check_fresh([workdir], resume_flag=False)
  task, train_src, eval_src = (built or configs.build_run(cfg))[:3]
  n_steps = configs.steps_for(epochs, train_src) if epochs is not None else int(steps)
  if overwrite and os.path.exists(os.path.join(workdir, RUN_RECORD)):
    os.remove(os.path.join(workdir, RUN_RECORD))
  t0 = time.perf_counter()
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                        train_lib.TrainConfig(workdir=workdir, steps=n_steps,
                                              log_every=max(1, log_every), seed=int(seed),
                                              tensorboard=False, overwrite=overwrite))
  wall = time.perf_counter() - t0
  if not keep_checkpoints:
    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
  return TrainedRun(cfg, task, train_src, eval_src, out["state"],
                    {k: v if isinstance(v, (dict, list)) or np.ndim(v) else float(v)
                     for k, v in out["eval"].items()},
                    n_steps, int(seed), workdir, wall, out["train_seconds"],
                    out["examples_per_sec"])


# --------------------------------------------------------------------------- seeds


def _settings(cfg: configs.RecRunConfig, steps: int, seed: int) -> dict[str, Any]:
  return json.loads(json.dumps({"config": cfg.flat_settings(), "steps": int(steps),
                                "seed": int(seed)}, default=str))


def finished_run(cfg: configs.RecRunConfig, workdir: str, *, steps: int,
                 seed: int) -> dict[str, Any] | None:
  """The result recorded in `<workdir>/run.json` by an earlier run of `cfg` for `steps` from
  seed `seed`, or None when there is none. A record of other settings raises UserError
  naming every field that differs (recorded value -> asked value)."""
  path = os.path.join(workdir, RUN_RECORD)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      rec = json.load(f)
    recorded, result = {k: rec[k] for k in ("config", "steps", "seed")}, rec["result"]
  except (OSError, ValueError, KeyError) as e:
    raise UserError(f"{path}: {e}; expected a run record written by rec.runs (delete it to "
                    "train the run again)") from e
  asked = _settings(cfg, steps, seed)
  # A record without some a2a fields or group_by ran with their defaults (float32, one
  # bound throughout; no groups).
  later = {n: v for n, v in _settings(configs.make_run(), 0, 0)["config"].items()
           if n in configs.LATER_FIELDS}
  recorded["config"] = {**later, **recorded["config"]}
  flat = lambda d: {**{f"config.{k}": v for k, v in d["config"].items()},
                    "steps": d["steps"], "seed": d["seed"]}
  a, r = flat(asked), flat(recorded)
  diff = [f"{k}: {r.get(k, '(absent)')!r} -> {a.get(k, '(absent)')!r}"
          for k in sorted(set(a) | set(r)) if a.get(k) != r.get(k)]
  if diff:
    raise UserError(f"{path}: this run finished with other settings ({'; '.join(diff)}); "
                    "use another workdir, or delete the run to train it again")
  return result


def seed_dirs(run_prefix: str, seeds: Iterable[int]) -> list[str]:
  """The run directories of `train_seeds`: `<run_prefix>_s<seed>`."""
  return [f"{run_prefix}_s{seed}" for seed in seeds]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for one value)."""
  v = np.asarray(values, np.float64)
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def train_seeds(cfg: configs.RecRunConfig, seeds: Sequence[int], run_prefix: str, *,
                steps: int | None = None, epochs: float | None = None, log_every: int = 100,
                keep_checkpoints: bool = False, built: tuple | None = None,
                label: str = "", note: str = "",
                keep: Callable[[TrainedRun], Any] | None = None,
                reuse_finished: bool = False) -> dict[str, Any]:
  """`cfg` built once and trained once per seed, in `<run_prefix>_s<seed>`; each run's
  progress line starts with `label` (default model:preset) and ends with `note`. `keep`
  is called with each finished `TrainedRun` (its state is dropped afterwards otherwise).
  Each finished run is recorded in its workdir (`RUN_RECORD`); reuse_finished: a seed whose
  record holds these settings (`finished_run`) is taken from it, not trained again (the
  state is not recorded, so not with `keep`), and one without a record (unfinished) is
  trained again; without it a seed directory holding an earlier run is refused before
  anything trains (`check_fresh`).

  Returns {steps, examples, num_seeds, runs: [{seed, METRICS..., eval_examples,
  wall_seconds, train_seconds, examples_per_sec, workdir}], <metric>_mean / _std for
  METRICS, wall_seconds and examples_per_sec}.
  """
  _check_budget("train_seeds", steps, epochs)
  if not seeds:
    raise ValueError("train_seeds: no seeds")
  if reuse_finished and keep is not None:
    raise ValueError("train_seeds: reuse_finished=True with keep: a reused run has no state")
  if not reuse_finished:
    check_fresh(seed_dirs(run_prefix, seeds))
  built = built or configs.build_run(cfg)
  n_steps = configs.steps_for(epochs, built[1]) if epochs is not None else int(steps)
  runs = []
  name = label or cfg.model.model + ":" + cfg.model.preset
  if reuse_finished:   # a record of other settings is refused before any seed trains
    done_by_seed = {seed: finished_run(cfg, d, steps=n_steps, seed=seed)
                    for seed, d in zip(seeds, seed_dirs(run_prefix, seeds))}
  for seed, workdir in zip(seeds, seed_dirs(run_prefix, seeds)):
    done = done_by_seed[seed] if reuse_finished else None
    if done is not None:
      print(f"== {name} seed {seed}: finished earlier ({os.path.join(workdir, RUN_RECORD)}), "
            f"NE {done['ne']:.4f}", flush=True)
      runs.append(done)
      continue
    print(f"== {name} seed {seed}: {n_steps} steps of "
          f"{cfg.train.batch_size}" + (f" | {note}" if note else ""), flush=True)
    # Without a record the run did not finish (checked above when not reusing): trained
    # again from the start.
    run = train_run(cfg, workdir, steps=n_steps, seed=seed, log_every=log_every,
                    keep_checkpoints=keep_checkpoints, built=built, overwrite=True)
    if keep is not None:
      keep(run)
    result = {"seed": int(seed), **{k: run.eval[k] for k in METRICS},
              "eval_examples": int(run.eval["num_examples"]),
              "wall_seconds": run.wall_seconds, "train_seconds": run.train_seconds,
              "examples_per_sec": float(run.examples_per_sec), "workdir": run.workdir}
    results_lib.write_json({**_settings(cfg, n_steps, seed), "result": result},
                           os.path.join(workdir, RUN_RECORD))
    runs.append(result)
    del run   # its state: one run's arrays alive at a time
  row: dict[str, Any] = {"steps": n_steps, "examples": n_steps * cfg.train.batch_size,
                         "num_seeds": len(runs)}
  for k in METRICS + ("wall_seconds", "examples_per_sec"):
    row[f"{k}_mean"], row[f"{k}_std"] = mean_std([r[k] for r in runs])
  row["runs"] = runs
  return row


# --------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One model to train: a family (configs.MODEL_PRESETS key, or logreg) and its preset."""

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
  """--models entries 'dlrm' or 'wukong:l3_n16' -> specs. An entry without a preset takes
  the model's preset from `presets` ('wukong=l2_n8,...'), else 'kaggle'. Presets are
  checked when the model is built (configs.model_config)."""
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


def for_model(base: configs.RecRunConfig, spec: ModelSpec) -> configs.RecRunConfig:
  """`base` for `spec`'s model and preset. Logistic regression keeps its dim-1 tables (one
  weight per id) whatever the shared embedding dim."""
  dim = 0 if spec.model == "logreg" else base.model.embedding_dim
  return configs.replace_run(base, model=spec.model, preset=spec.preset, embedding_dim=dim)


def reference_metrics(eval_src) -> dict[str, float] | None:
  """Metrics of the true logits on the eval set of a synthetic source (the Bayes ceiling of
  AUC and floor of log loss / NE on exactly these examples); None for file data."""
  if not hasattr(eval_src, "true_logits"):
    return None
  m = RecMetrics()
  for batch in eval_src.batches(0):
    m.update(eval_src.true_logits(batch), batch.labels, batch.mask)
  return m.result()


def _model_prefix(workdir: str, spec: ModelSpec) -> str:
  return os.path.join(workdir, "runs", f"{spec.model}_{spec.preset}")


def model_run_dirs(workdir: str, spec: ModelSpec, seeds: Iterable[int]) -> list[str]:
  """The run directories `train_model` trains `spec` in, one per seed."""
  return seed_dirs(_model_prefix(workdir, spec), seeds)


def train_model(base: configs.RecRunConfig, spec: ModelSpec, seeds: Sequence[int],
                workdir: str, steps: int | None = None, epochs: float | None = None,
                log_every: int = 100, keep_checkpoints: bool = False,
                keep: Callable[[TrainedRun], Any] | None = None,
                reuse_finished: bool = False) -> dict[str, Any]:
  """`spec` on `base`'s data and settings, once per seed (`train_seeds`, `keep` and
  `reuse_finished` as there),
  in `<workdir>/runs/<model>_<preset>_s<seed>`; the row adds model, preset, label and the
  parameter counts / GFLOPs per example (configs.model_stats)."""
  _check_budget("train_model", steps, epochs)
  cfg = for_model(base, spec)
  built = configs.build_run(cfg)
  stats = configs.model_stats(built[0], built[1].spec)
  note = (f"dense params {stats['dense_params']:,} | {stats['gflops_per_example']:.6f} "
          "GFLOPs/example")
  row = train_seeds(cfg, seeds, _model_prefix(workdir, spec),
                    steps=steps, epochs=epochs, log_every=log_every,
                    keep_checkpoints=keep_checkpoints, built=built, label=spec.label,
                    note=note, keep=keep, reuse_finished=reuse_finished)
  return {"model": spec.model, "preset": spec.preset, "label": spec.label, **stats, **row}


def train_models(base: configs.RecRunConfig, specs: Sequence[ModelSpec],
                 seeds: Sequence[int] = (0,), steps: int | None = None,
                 epochs: float | None = None, workdir: str = "runs/compare_rec",
                 log_every: int = 100, keep_checkpoints: bool = False,
                 reuse_finished: bool = False) -> dict[str, Any]:
  """Every spec under the same budget (module docstring; reuse_finished: `train_seeds`'s);
  returns {"config", "seeds",
  "steps", "epochs", "rows" (one per spec, `train_model`), "reference" (true-logit metrics
  on synthetic data, else None), "wall_seconds"}."""
  if not specs:
    raise ValueError("train_models: no models to train")
  if not seeds:
    raise ValueError("train_models: no seeds")
  _check_budget("train_models", steps, epochs)
  for spec in specs:  # unknown presets fail now, not after the first models have trained
    configs.model_config(for_model(base, spec), CRITEO_SHAPED)
  if not reuse_finished:   # and so do earlier runs in the workdir
    check_fresh([d for spec in specs for d in model_run_dirs(workdir, spec, seeds)])
  t0 = time.perf_counter()
  reference = None
  if sources_lib.synthetic_options(base.data.data) is not None:
    _, eval_src = sources_lib.make_sources(
        base.data.data, base.train.batch_size, eval_batch_size=base.train.eval_batch_size,
        num_rows=base.data.num_rows, seed=base.seed, eval_batches=base.data.eval_batches)
    reference = reference_metrics(eval_src)
  rows = [train_model(base, s, seeds, workdir, steps=steps, epochs=epochs, log_every=log_every,
                      keep_checkpoints=keep_checkpoints, reuse_finished=reuse_finished)
          for s in specs]
  return {"config": base.flat_settings(), "seeds": [int(s) for s in seeds], "steps": steps,
          "epochs": epochs, "rows": rows, "reference": reference,
          "wall_seconds": time.perf_counter() - t0}


def _pm(row: Mapping[str, Any], key: str, digits: int = 4) -> str:
  mean, std = row[f"{key}_mean"], row[f"{key}_std"]
  return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if row["num_seeds"] > 1 else "")


def format_runs(results: Mapping[str, Any]) -> str:
  """The table of `train_models`' results: one line per model (mean ± std over seeds),
  and the Bayes line on synthetic data."""
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
