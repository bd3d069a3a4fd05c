"""Rankitect's search methods under one space and one budget (arXiv 2311.08430).

- random / evolution: Optuna's RandomSampler / NSGAIISampler (multi-objective evolution;
  with the same search seed its first generation is the random sampler's first draws, a
  paired start) over one categorical choice per layer; every candidate trained from scratch
  through `rec.runs.train_run` (RecTask, the collection, core.train) as `--model=searched:FILE`;
  objectives (eval NE, forward MFLOPs/example). Trials live in an Optuna journal file in
  the workdir, so a killed search continues where it stopped.
- oneshot: a weight-sharing supernet (supernet.py) trained with one uniform path per step,
  then candidates scored with inherited weights (one compile: one-hot mixing weights are
  an argument), the best retrained from scratch.
- dnas: Gumbel-softmax mixing with a FLOP-cost term per cost weight; the argmax
  architecture retrained from scratch.
Every from-scratch training is one row of `<workdir>/trials.jsonl` (what a resumed run
skips); the hand-designed models (space.BASELINES) are rows too. NE is the eval split's
normalized entropy (log loss over the entropy of the positive rate); FLOPs are XLA's count
of the dense model's forward pass per example (rec.configs.model_stats). The searcher's
randomness (samplers, oneshot's paths, supernets) comes from `Study.search_seed`, the data
and every trained model's initial weights from `base.seed`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
from typing import Any, Sequence

import jax
import numpy as np

from core import flops as flops_lib
from core.errors import UserError
from core import results as results_lib
from core import train as train_lib
from rec import configs, runs
from rec import metrics as metrics_lib
from rec.models import searched

from experiments.rankitect import supernet as supernet_lib
from experiments.rankitect.space import BASELINES, Space

METHODS = ("random", "evolution", "oneshot", "dnas")


class TrialLog:
  """Rows of finished trainings, one JSON object a line, appended as each finishes."""

  def __init__(self, path: str):
    self.path = path
    self.rows: list[dict[str, Any]] = []
    if not os.path.exists(path):
      return
    with open(path, "rb") as f:
      data = f.read()
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    start = 0   # of line i in the file
    for i, line in enumerate(lines):
      if line.strip():
        try:
          self.rows.append(json.loads(line))
        except ValueError:
          if i != last:
            raise UserError(f"{path}:{i + 1}: not a JSON row; expected one per line") from None
          # A line cut by a kill: dropped (the run redoes it), so that the next row starts
          # a line of its own.
          with open(path, "r+b") as f:
            f.truncate(start)
          return
      start += len(line) + 1
    if data and not data.endswith(b"\n"):
      with open(path, "ab") as f:
        f.write(b"\n")

  def get(self, label: str) -> dict[str, Any] | None:
    return next((r for r in self.rows if r["label"] == label), None)

  def add(self, row: dict[str, Any]) -> dict[str, Any]:
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    self.rows.append(row)
    return row


@dataclasses.dataclass
class Study:
  """One workdir: the space, the base run config (data, optimizers, sizes) and the budget."""

  workdir: str
  space: Space
  base: configs.RecRunConfig
  steps: int = 300
  # Candidates of the space train through one compiled supernet program (CandidateTask);
  # False: each through its own stand-alone program (runs.train_run of the JSON file).
  shared_program: bool = True
  # Seeds the searcher (Optuna's samplers, oneshot's paths, supernet init and path / Gumbel
  # draws) apart from the data and the candidates' initial weights (base.seed); None: base.seed.
  search_seed: int | None = None
  log: TrialLog | None = None
  started: float = dataclasses.field(default_factory=time.perf_counter)
  _space_run: tuple | None = dataclasses.field(default=None, repr=False)
  _program: Any = dataclasses.field(default=None, repr=False)   # the first CandidateTask

  def __post_init__(self):
    if self.search_seed is None:
      self.search_seed = self.base.seed
    os.makedirs(self.workdir, exist_ok=True)
    self.check_settings()
    self.log = TrialLog(os.path.join(self.workdir, "trials.jsonl"))

  def check_settings(self) -> None:
    """Every method run in one workdir shares the space, data, budget and search seed (their
    rows are compared, and a search resumes its journal): the first run writes them to
    settings.json, later runs must match."""
    run = {f"run.{k}": v for k, v in self.base.run_settings().items()
           if k not in ("model", "preset", "embedding_dim")}
    space = {f"space.{k}": v for k, v in dataclasses.asdict(self.space).items()}
    now = json.loads(json.dumps({**space, **run, "steps": self.steps,
                                 "search_seed": self.search_seed}))
    path = os.path.join(self.workdir, "settings.json")
    if not os.path.exists(path):
      with open(path, "w") as f:
        json.dump(now, f, indent=1)
      return
    with open(path) as f:
      saved = json.load(f)
    saved.setdefault("search_seed", saved.get("run.seed"))   # absent: the default, run.seed
    default = json.loads(json.dumps(configs.make_run().run_settings()))
    for n in configs.LATER_FIELDS:   # absent: the default (float32, one bound; no groups)
      saved.setdefault(f"run.{n}", default[n])
    diff = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]
    if diff:
      raise UserError(f"{path}: this workdir's searches ran with other settings "
                      f"({'; '.join(diff)}); "
                      "expected the same space, data, budget and search seed (or another "
                      "--workdir)")

  # --- one training

  def space_run(self):
    """(config, configs.build_run result) of the space (its first point): the sources,
    collection and mesh every candidate and supernet of the study shares, built once."""
    if self._space_run is None:
      space = self.space
      path = searched.save_arch(space.arch([space.names[0]] * space.num_layers),
                                os.path.join(self.workdir, "archs", "_space.json"))
      cfg = configs.replace_run(self.base, model=searched_model(path), preset="kaggle",
                                embedding_dim=0)
      self._space_run = (cfg, configs.build_run(cfg))
    return self._space_run

  def _row(self, run, label: str, method: str, extra: dict[str, Any],
           model_fn=None) -> dict[str, Any]:
    # FLOPs and parameters of the model itself (model_fn; default the task's).
    owner = run.task if model_fn is None else types.SimpleNamespace(
        model_fn=model_fn, collection=run.task.collection)
    stats = configs.model_stats(owner, run.train_src.spec)
    return {"label": label, "method": method, "ne": run.eval["ne"], "auc": run.eval["auc"],
            "logloss": run.eval["logloss"], "mflops": stats["gflops_per_example"] * 1e3,
            "dense_params": stats["dense_params"], "wall_s": run.wall_seconds,
            "steps": run.steps, **extra}

  def train_arch(self, choices: Sequence[str], label: str, method: str,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Trains the space's architecture of `choices` from scratch (or returns its row from
    the log); its JSON file is what train_rec --model=searched:FILE trains again."""
    done = self.log.get(label)
    if done is not None:
      return done
    space = self.space
    path = searched.save_arch(space.arch(choices),
                              os.path.join(self.workdir, "archs", f"{label}.json"))
    wd = os.path.join(self.workdir, "runs", label)
    extra = {"arch_file": path, "choices": list(choices), **(extra or {})}
    if not self.shared_program:
      cfg = configs.replace_run(self.base, model=searched_model(path), preset="kaggle",
                                embedding_dim=0)
      run = runs.train_run(cfg, wd, steps=self.steps, log_every=self.steps,
                           overwrite=True)   # not in the log: unfinished
      return self.log.add(self._row(run, label, method, {**extra, "program": "standalone"}))
    cfg, (task0, train_src, eval_src, _, _) = self.space_run()
    spec = train_src.spec
    nd, ns, rows = spec.num_dense, len(spec.sparse_features), tuple(spec.rows_per_feature)
    mine = supernet_lib.arch_config(space, choices, nd, ns, rows)
    standalone_fn = lambda r: searched.SearchedModel(mine, r)
    task = supernet_lib.CandidateTask(
        lambda r: supernet_lib.Supernet(space, nd, ns, rows, r, mode="path"), task0.collection,
        task0.dense_tx, task0.mesh, choices=choices, standalone_fn=standalone_fn,
        program=self._program)
    self._program = self._program or task
    run = runs.train_run(cfg, wd, steps=self.steps, log_every=self.steps,
                         built=(task, train_src, eval_src), overwrite=True)
    return self.log.add(self._row(run, label, method, {**extra, "program": "shared"},
                                  model_fn=standalone_fn))

  def train_baseline(self, model: str, preset: str) -> dict[str, Any]:
    label = f"{model}:{preset}"
    done = self.log.get(label)
    if done is not None:
      return done
    cfg = configs.replace_run(self.base, model=model, preset=preset,
                              embedding_dim=self.space.embedding_dim)
    run = runs.train_run(cfg, os.path.join(self.workdir, "runs", label.replace(":", "_")),
                         steps=self.steps, log_every=self.steps, overwrite=True)
    return self.log.add(self._row(run, label, "hand-designed", {"model": model, "preset": preset}))

  def begin(self, method: str) -> None:
    """Marks the start of a method's part of the run (its progress line's ETA)."""
    self.method_started = time.perf_counter()

  def progress(self, method: str, i: int, n: int, row: dict[str, Any]) -> None:
    el = time.perf_counter() - self.started
    part = time.perf_counter() - getattr(self, "method_started", self.started)
    eta = part / (i + 1) * (n - i - 1)
    print(f"[{method}] {i + 1}/{n} {row['label']}: NE {row['ne']:.4f} MFLOPs "
          f"{row['mflops']:.3f} ({row['wall_s']:.0f}s) | elapsed {el:.0f}s, ETA {eta:.0f}s",
          flush=True)


def searched_model(path: str) -> str:
  return configs.SEARCHED + path


# --------------------------------------------------------------------------- sampling-based


def sampling_search(study: Study, method: str, trials: int) -> list[dict[str, Any]]:
  """Random or evolutionary search with Optuna (sampler seeded by study.search_seed):
  `trials` candidates trained in all (those in the journal count), objectives (NE, MFLOPs)
  both minimized."""
  import optuna
  from optuna.storages import JournalStorage
  from optuna.storages.journal import JournalFileBackend
  from optuna.trial import TrialState

  optuna.logging.set_verbosity(optuna.logging.WARNING)
  seed = study.search_seed
  sampler = (optuna.samplers.RandomSampler(seed=seed) if method == "random" else
             optuna.samplers.NSGAIISampler(population_size=max(2, min(8, trials // 2)), seed=seed))
  storage = JournalStorage(JournalFileBackend(os.path.join(study.workdir, "optuna.journal")))
  st = optuna.create_study(study_name=method, storage=storage, sampler=sampler,
                           directions=["minimize", "minimize"], load_if_exists=True)
  for t in st.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
    st.tell(t.number, state=TrialState.FAIL)   # killed mid-training: trained again below
  rows = []
  study.begin(method)
  while True:
    complete = st.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) >= trials:
      break
    trial = st.ask()
    space = study.space
    choices = [trial.suggest_categorical(f"layer{l}", list(space.names))
               for l in range(space.num_layers)]
    label = f"{method}_{'-'.join(choices)}"
    row = study.train_arch(choices, label, method)
    st.tell(trial, [row["ne"], row["mflops"]])
    study.progress(method, len(complete), trials, row)
  for t in st.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
    choices = [t.params[f"layer{l}"] for l in range(study.space.num_layers)]
    rows.append(study.log.get(f"{method}_{'-'.join(choices)}"))
  return [r for r in rows if r is not None]


# --------------------------------------------------------------------------- supernets


def candidate_flops(space: Space, spec) -> tuple[float, list[list[float]]]:
  """(base, F) per example from XLA's count of whole stand-alone models: F[l][k] is what
  candidate k at layer l adds over the cheapest candidate there. The layers' ops are
  independent, so an architecture's FLOPs are base + sum_l F[l][k_l], up to XLA's
  simplifications of each whole graph (under 1% in tests/experiments/rankitect); the
  reported FLOPs of trained candidates are whole-model counts."""
  nd, ns, rows = spec.num_dense, len(spec.sparse_features), tuple(spec.rows_per_feature)

  def flops(choices):
    cfg = supernet_lib.arch_config(space, choices, nd, ns, rows)
    return flops_lib.model_flops_per_example(lambda r: searched.SearchedModel(cfg, r), cfg,
                                             batch=8)

  first = [space.names[0]] * space.num_layers
  ref = flops(first)
  delta = [[0.0 if k == space.names[0] else
            flops(first[:l] + [k] + first[l + 1:]) - ref for k in space.names]
           for l in range(space.num_layers)]
  lows = [min(row) for row in delta]
  return ref + sum(lows), [[f - lo for f in row] for row, lo in zip(delta, lows)]


def _supernet_run(study: Study, name: str, mode: str, steps: int, cost_weight: float,
                  flops_LK, seed: int):
  """Trains a supernet through RecTask / core.train (resumed from its checkpoints); `seed`
  draws its initial weights and its paths / Gumbel noise."""
  space = study.space
  _, (task0, train_src, eval_src, _, _) = study.space_run()
  spec = train_src.spec
  nd, ns, rows = spec.num_dense, len(spec.sparse_features), tuple(spec.rows_per_feature)
  model_fn = lambda r: supernet_lib.Supernet(space, nd, ns, rows, r, mode=mode, flops_LK=flops_LK)
  task = supernet_lib.SupernetTask(model_fn, task0.collection, task0.dense_tx, task0.mesh,
                                   seed=seed, cost_weight=cost_weight)
  wd = os.path.join(study.workdir, name)
  resume = os.path.isdir(os.path.join(wd, "checkpoints"))
  done = max((int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()),
             default=0) if resume else 0
  if done > steps:   # its weights (and the cost reported) would be another budget's
    raise UserError(f"{wd}: a supernet trained for {done} steps; expected at most "
                    f"--supernet_steps={steps} (the same budget, or another --workdir)")
  # The supernet's training time over every run that trained it (wall.json): a run resumed
  # after a stop adds its part, a rerun of a finished supernet (restore only) adds none.
  wall_path = os.path.join(wd, "wall.json")
  prior = {"wall_s": 0.0, "step": 0}
  if resume and os.path.exists(wall_path):
    with open(wall_path) as f:
      prior = json.load(f)
  t0, out, wall = time.perf_counter(), None, prior["wall_s"]
  try:
    out = train_lib.train(task, train_src.batches, None, train_lib.TrainConfig(
        workdir=wd, steps=steps, log_every=max(1, steps // 5), seed=seed, resume=resume,
        checkpoint_every=max(1, steps // 4), tensorboard=False))
  finally:
    if out is None or out["step"] > prior["step"]:
      wall += time.perf_counter() - t0
      results_lib.write_json({"wall_s": wall, "step": prior["step"] if out is None
                              else out["step"]}, wall_path)
  return task, out["state"], eval_src, wall, spec


def score_inherited(task, state, eval_src, space: Space, paths: Sequence[Sequence[int]]):
  """Eval NE and AUC of each path (candidate index per layer) with the supernet's weights."""
  step = jax.jit(task.weighted_eval_step)
  batches = [task.device_batch(b) for b in eval_src.batches(0)]
  out = []
  for path in paths:
    w = np.zeros((space.num_layers, len(space.names)), np.float32)
    w[np.arange(space.num_layers), list(path)] = 1.0
    parts = [step(state, b, w) for b in batches]
    cat = {k: np.concatenate([np.asarray(p[k]).reshape(-1) for p in parts]) for k in parts[0]}
    out.append(metrics_lib.device_metrics(cat["logits"], cat["labels"], cat["mask"]))
  return out


def pareto(rows: Sequence[dict[str, Any]], x: str = "mflops",
           y: str = "ne") -> list[dict[str, Any]]:
  """Rows no other row beats on both x and y (lower is better), sorted by x."""
  front = [r for r in rows
           if not any((o[x] <= r[x] and o[y] <= r[y]) and (o[x] < r[x] or o[y] < r[y])
                      for o in rows)]
  return sorted(front, key=lambda r: r[x])


def oneshot_search(study: Study, supernet_steps: int, num_candidates: int,
                   retrain: int) -> dict[str, Any]:
  space = study.space
  seed = study.search_seed
  study.begin("oneshot")
  task, state, eval_src, wall, spec = _supernet_run(study, "supernet_oneshot", "path",
                                                    supernet_steps, 0.0, None, seed)
  base, table = candidate_flops(space, spec)
  rng = np.random.default_rng(seed)
  K, L = len(space.names), space.num_layers
  if space.size() <= num_candidates:
    paths = [tuple(int(i) for i in np.unravel_index(j, (K,) * L)) for j in range(space.size())]
  else:
    paths = sorted({tuple(int(i) for i in rng.integers(0, K, L)) for _ in range(num_candidates)})
  t0 = time.perf_counter()
  scores = score_inherited(task, state, eval_src, space, paths)
  scored = [{"choices": [space.names[k] for k in p], "ne": s["ne"], "auc": s["auc"],
             "mflops": (base + sum(table[l][k] for l, k in enumerate(p))) / 1e6}
            for p, s in zip(paths, scores)]
  score_wall = time.perf_counter() - t0
  # Retrain the inherited-weight Pareto front, best NE first, up to `retrain`.
  picks = sorted(pareto(scored), key=lambda r: r["ne"])[:retrain]
  rows = []
  for i, p in enumerate(picks):
    label = f"oneshot_{'-'.join(p['choices'])}"
    row = study.train_arch(p["choices"], label, "oneshot", {"inherited_ne": p["ne"]})
    rows.append(row)
    study.progress("oneshot", i, len(picks), row)
  return {"rows": rows, "scored": scored, "supernet_steps": supernet_steps,
          "supernet_wall_s": wall, "score_wall_s": score_wall,
          "candidates_evaluated": len(scored)}


def dnas_search(study: Study, supernet_steps: int,
                cost_weights: Sequence[float]) -> dict[str, Any]:
  space = study.space
  seed = study.search_seed
  rows, alphas, walls = [], {}, 0.0
  study.begin("dnas")
  flops_table = None
  for i, lam in enumerate(cost_weights):
    if flops_table is None:
      flops_table = candidate_flops(space, study.space_run()[1][1].spec)[1]
    task, state, _, wall, _ = _supernet_run(study, f"supernet_dnas_{lam:g}", "gumbel",
                                            supernet_steps, lam, flops_table, seed)
    walls += wall
    alpha = np.asarray(state["params"]["alpha"])
    choices = [space.names[int(k)] for k in alpha.argmax(axis=1)]
    alphas[f"{lam:g}"] = alpha.tolist()
    label = f"dnas{lam:g}_{'-'.join(choices)}"
    row = study.train_arch(choices, label, "dnas", {"cost_weight": lam})
    rows.append(row)
    study.progress("dnas", i, len(cost_weights), row)
  return {"rows": rows, "alpha": alphas, "supernet_steps": supernet_steps * len(cost_weights),
          "supernet_wall_s": walls, "candidates_evaluated": 0}


def baselines(study: Study, which: Sequence[tuple[str, str]] = BASELINES) -> list[dict[str, Any]]:
  rows = []
  study.begin("hand-designed")
  for i, (m, p) in enumerate(which):
    rows.append(study.train_baseline(m, p))
    study.progress("hand-designed", i, len(which), rows[-1])
  return rows


# --------------------------------------------------------------------------- report


def cost_of(method: str, rows: Sequence[dict[str, Any]], extra: dict[str, Any] | None = None):
  """Search cost: candidates trained from scratch, their wall time, supernet steps / time."""
  e = extra or {}
  trained = [r for r in rows if r["method"] == method]
  return {"candidates_trained": len(trained),
          "train_wall_s": sum(r["wall_s"] for r in trained),
          "supernet_steps": e.get("supernet_steps", 0),
          "supernet_wall_s": e.get("supernet_wall_s", 0.0),
          "candidates_evaluated_inherited": e.get("candidates_evaluated", 0),
          "total_wall_s": sum(r["wall_s"] for r in trained) + e.get("supernet_wall_s", 0.0)
                          + e.get("score_wall_s", 0.0)}


def table(rows: Sequence[dict[str, Any]]) -> str:
  lines = [f"{'method':<14} {'model':<44} {'NE':>7} {'AUC':>7} {'MFLOPs':>8}"]
  for r in sorted(rows, key=lambda r: (r["method"], r["mflops"])):
    lines.append(f"{r['method']:<14} {r['label'][:44]:<44} {r['ne']:7.4f} {r['auc']:7.4f} "
                 f"{r['mflops']:8.3f}")
  return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> str:
  """NE against MFLOPs/example: every trained candidate, each method's Pareto front, and
  the hand-designed models labelled."""
  from core import plot as plot_lib
  with plot_lib.figure(path, figsize=(8, 5), dpi=120) as (fig, ax):
    by: dict[str, list] = {}
    for r in rows:
      by.setdefault(r["method"], []).append(r)
    for i, (m, rs) in enumerate(sorted(by.items())):
      c = f"C{i}"
      marker = "s" if m == "hand-designed" else "o"
      ax.scatter([r["mflops"] for r in rs], [r["ne"] for r in rs], c=c, marker=marker, s=22,
                 alpha=0.6, label=m)
      front = pareto(rs)
      ax.plot([r["mflops"] for r in front], [r["ne"] for r in front], "-", c=c, lw=1.2)
      if m == "hand-designed":
        for r in rs:
          ax.annotate(r["label"], (r["mflops"], r["ne"]), fontsize=6, xytext=(3, 3),
                      textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("forward MFLOPs / example (XLA)")
    ax.set_ylabel("eval NE (lower is better)")
    ax.set_title("Rankitect search: NE vs FLOPs, Pareto fronts per method")
    ax.legend(fontsize=8)
  return path
