r"""Rankitect (arXiv 2311.08430): ranking architecture search over low-level blocks, with
sampling-based (random, evolution), one-shot and differentiable (DNAS) search under one
space and budget, against the hand-designed DLRM / DCN-v2 / DHEN / Wukong.

  python -m experiments.rankitect --method=random        # the 20-minute budget on 2 CPU cores
  python -m experiments.rankitect --method=evolution
  python -m experiments.rankitect --method=random --seed=1 --nobaselines --workdir=runs/rankitect_s1
  python -m experiments.rankitect --method=random --search_seed=1 --nobaselines \
      --workdir=runs/rankitect_ss1          # another search on seed 0's data
  python -m experiments.rankitect --method=oneshot --supernet_steps=1500 --retrain=3
  python -m experiments.rankitect --method=dnas --dnas_cost_weights=0.1,1.0
  python -m experiments.rankitect --method=random --data=criteo:../shared/data/criteo_kaggle_sample \
      --num_rows=20000 --steps=28 --workdir=runs/rankitect_criteo   # one epoch of the sample
  python -m experiments.rankitect --method=random --data=avazu:../shared/data/avazu_sample \
      --num_rows=20000 --steps=32 --workdir=runs/rankitect_avazu     # one epoch of the sample
  python -m experiments.train_rec --model=searched:runs/rankitect/best_random.json --steps=300

The space (space.py): --layers stack layers of --width embeddings (dim --embedding_dim),
each one candidate of space.candidates (skip, LCB, dot, FMB, wide FMB, attention, DCN,
MLP, wide MLP, Wukong's FMB + LCB, DHEN's dot + LCB) with residual and LayerNorm, a bottom
MLP into the stack and a flatten -> MLP top. Data: --data=synthetic_deep (planted high-
order interactions; the default, with --num_rows=20 rows per feature as in
experiments.wukong_scaling), criteo:DIR, avazu:DIR (rec.data.sources). Every candidate and
hand-designed model trains --steps steps of --batch_size through rec.runs.train_run.
Seeds: --seed draws the synthetic data and every trained model's initial weights;
--search_seed (default --seed) the searcher alone, so searches with several search seeds on
one data set measure the spread of what the search finds (a workdir keeps one of each).

Budget: random / evolution train --trials candidates; oneshot trains a supernet for
--supernet_steps, scores up to --candidates paths with inherited weights, retrains the
best --retrain; dnas trains one supernet per --dnas_cost_weights value and retrains each
argmax. --baselines trains the hand-designed points once per workdir. A killed run
continues with the same command (Optuna journal, trials.jsonl, supernet checkpoints).
Candidates of the space train through one compiled supernet program whose path is an
argument (--shared_program; supernet.CandidateTask: the stand-alone model's training up to
float rounding), so only the first candidate compiles; the persistent compilation cache
(--compilation_cache_dir) keeps programs for later runs. BENCHMARKS.md's Rankitect section
has the measured costs.

Writes `<workdir>/results.json`, `<workdir>/rankitect.png` (NE vs MFLOPs, Pareto front per
method, hand-designed models labelled), `<workdir>/best_<method>.json` (the method's
lowest-NE architecture, for train_rec --model=searched:FILE) and every candidate's JSON
under `<workdir>/archs/`. Prints a table, each method's search cost, and a JSON line last.
"""

from __future__ import annotations

import json
import math
import os

from absl import flags, logging

from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

METHOD = config.setting("method", "enum", "Search method.",
                        choices=("random", "evolution", "oneshot", "dnas"))
SUPERNET_STEPS = config.setting("supernet_steps", "integer", "oneshot / dnas: supernet train "
                                "steps.", lower=1)
CANDIDATES = config.setting("candidates", "integer", "oneshot: paths scored with inherited "
                            "weights (all of the space when it is smaller).", lower=1)
RETRAIN = config.setting("retrain", "integer", "oneshot: Pareto candidates retrained from "
                         "scratch.", lower=1)
DNAS_COST_WEIGHTS = config.setting("dnas_cost_weights", "list", "dnas: FLOP-cost weights, one "
                                   "supernet each.")
LAYERS = config.setting("layers", "integer", "Stack layers of the space.", lower=1)
WIDTH = config.setting("width", "integer", "Embeddings per stack layer.", lower=2)
BASELINES = config.setting("baselines", "bool", "Train the hand-designed models (once per "
                           "workdir).")
SHARED_PROGRAM = config.setting(
    "shared_program", "bool", "Train candidates of the space through one compiled supernet "
    "program, the path an argument (false: each candidate compiles its own stand-alone "
    "program).")
SEARCH_SEED = config.setting(
    "search_seed", "integer", "Seeds the searcher (random / evolution proposals, oneshot's "
    "paths, the supernets' initial weights and path / Gumbel draws) apart from the data and "
    "the candidates' initial weights (--seed); default: --seed.", lower=0, none_ok=True)


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (`flag_values`: where,
  default absl's FLAGS); every setting but --workdir / --compilation_cache_dir may come from
  a --config file (configs/ beside this file)."""
  from rec import configs
  config.define_flags(
      None, METHOD, rec_settings.TRIALS, settings.STEPS, SUPERNET_STEPS, CANDIDATES, RETRAIN,
      DNAS_COST_WEIGHTS, LAYERS, WIDTH, BASELINES, SHARED_PROGRAM, SEARCH_SEED,
      in_config=True, flag_values=flag_values,
      method="random", trials=20, steps=300, supernet_steps=1500, candidates=60, retrain=3,
      dnas_cost_weights=["0.3"], layers=2, width=8, baselines=True, shared_program=True,
      search_seed=None)
  config.define_flags(None, settings.WORKDIR, settings.COMPILATION_CACHE_DIR,
                      flag_values=flag_values, workdir="runs/rankitect",
                      compilation_cache_dir="runs/jax_compilation_cache")
  configs.define_run_flags(
      "eval_batch_size", "sparse_optimizer", "seed", flag_values=flag_values,
      dense_optimizer="adam",
      data="synthetic_deep", num_rows=20, batch_size=256, eval_batches=4, embedding_dim=16,
      learning_rate=1e-3, embedding_learning_rate=0.1)


def cost_weights(texts) -> list[float]:
  """--dnas_cost_weights as numbers: one or more, each finite, >= 0 and distinct (a supernet,
  its workdir and its row each, named by the weight)."""
  texts = [str(t) for t in texts or ()]
  where = f"--dnas_cost_weights={','.join(texts)}"
  want = "one or more distinct finite numbers >= 0"
  if not texts:
    raise errors.expected(where, "no weights", want)
  out = []
  for text in texts:
    try:
      w = float(text)
    except ValueError:
      raise errors.expected(where, f"{text!r} is not a number", want) from None
    if not (math.isfinite(w) and w >= 0):
      raise errors.expected(where, f"{text!r} is out of range", want)
    if f"{w:g}" in {f"{v:g}" for v in out}:
      raise errors.expected(where, f"{text!r} twice", want)
    out.append(w)
  return out


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from rec import configs
  from rec.data import sources
  from experiments.rankitect import study as study_lib
  from experiments.rankitect.space import Space

  report = Report(FLAGS.workdir)
  weights = cost_weights(FLAGS.dnas_cost_weights)
  if FLAGS.embedding_dim < 1:
    raise ValueError(f"--embedding_dim={FLAGS.embedding_dim}: expected >= 1 (the space's dim)")
  settings.use_compilation_cache(FLAGS.compilation_cache_dir, min_compile_time_s=0.5)
  space = Space(num_layers=FLAGS.layers, width=FLAGS.width, embedding_dim=FLAGS.embedding_dim)
  # Settings without a flag here keep RecRunConfig's defaults; each candidate sets `model`.
  base = configs.run_from_flags(model="dlrm")
  base.validate()
  # --data checked before the workdir's settings.json records it (later runs must match).
  sources.check_form(base.data.data)
  if base.data.data.split(":", 1)[0] in ("criteo", "avazu"):
    sources.layout(base.data.data, base.data.days or None)   # its files are there
  st = study_lib.Study(FLAGS.workdir, space, base, steps=FLAGS.steps,
                       shared_program=FLAGS.shared_program, search_seed=FLAGS.search_seed)
  print(f"workdir {FLAGS.workdir} | method {FLAGS.method} | space {space.size()} architectures "
        f"({len(space.names)} candidates ^ {space.num_layers} layers) | data {base.data.data} "
        f"(seed {base.seed}) | search seed {st.search_seed}", flush=True)

  extra = {}
  if FLAGS.baselines:
    study_lib.baselines(st)
  if FLAGS.method in ("random", "evolution"):
    study_lib.sampling_search(st, FLAGS.method, FLAGS.trials)
  elif FLAGS.method == "oneshot":
    extra = study_lib.oneshot_search(st, FLAGS.supernet_steps, FLAGS.candidates, FLAGS.retrain)
  else:
    extra = study_lib.dnas_search(st, FLAGS.supernet_steps, weights)

  rows = st.log.rows
  mine = [r for r in rows if r["method"] == FLAGS.method]
  best = min(mine, key=lambda r: r["ne"])
  best_path = os.path.join(FLAGS.workdir, f"best_{FLAGS.method}.json")
  from rec.models import searched
  with open(best["arch_file"]) as f:
    searched.save_arch(json.load(f), best_path)
  # The supernet part of a method's cost, kept so a later method's run in this workdir
  # reports every method run here side by side.
  results_lib.write_json({k: v for k, v in extra.items() if k not in ("rows", "scored", "alpha")},
                         os.path.join(FLAGS.workdir, f"cost_{FLAGS.method}.json"))

  def supernet_cost(m):
    path = os.path.join(FLAGS.workdir, f"cost_{m}.json")
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  costs = {m: study_lib.cost_of(m, rows, supernet_cost(m))
           for m in sorted({r["method"] for r in rows})}
  report.table(study_lib.table(rows))
  for m, c in costs.items():
    print(f"search cost {m}: {c['candidates_trained']} trained ({c['train_wall_s']:.0f}s), "
          f"supernet {c['supernet_steps']} steps ({c['supernet_wall_s']:.0f}s), "
          f"{c['candidates_evaluated_inherited']} scored with inherited weights")
  fronts = {m: [r["label"] for r in study_lib.pareto([r for r in rows if r["method"] == m])]
            for m in costs}
  results = {
      "method": FLAGS.method, "space": {"layers": space.num_layers, "width": space.width,
                                        "embedding_dim": space.embedding_dim,
                                        "candidates": list(space.names)},
      "data": base.data.data, "seed": base.seed, "search_seed": st.search_seed,
      "steps": FLAGS.steps, "rows": rows, "cost": costs, "pareto": fronts,
      "best": best, "best_file": best_path, "plot": report.path("rankitect.png"),
      **{k: v for k, v in extra.items() if k in ("scored", "alpha")}}
  summary = {"method": FLAGS.method, "search_seed": st.search_seed,
             "best": best["label"], "best_ne": best["ne"],
             "best_mflops": best["mflops"], "best_file": best_path,
             "candidates_trained": costs[FLAGS.method]["candidates_trained"],
             "search_wall_s": costs[FLAGS.method]["total_wall_s"]}
  hand = [r for r in rows if r["method"] == "hand-designed"]
  if hand:
    summary["best_hand_designed"] = min(hand, key=lambda r: r["ne"])["label"]
    summary["best_hand_designed_ne"] = min(r["ne"] for r in hand)
  report.finish(results, summary, plots=[(study_lib.plot, (rows,), "rankitect.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
