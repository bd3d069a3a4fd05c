r"""DLRM vs logistic regression on the same hashed Criteo features (arXiv 1906.00091).

  python -m experiments.criteo_baselines --data=criteo:../shared/data/criteo_kaggle_sample

Trains each model on train.txt (the DLRM Kaggle preset: dim 16, bottom 13-512-256-64-16,
top 512-256-1; logistic regression: one weight per hashed id plus a dense linear part),
evaluates on valid.txt + test.txt, and prints a table of AUC, log loss and NE for every
(model, epochs) pair (--epochs: the epoch counts, each trained). Same hashing, batches,
optimizers and learning rates for both (--learning_rate: the dense and the embedding one,
Adagrad).
Writes results.json and a PNG to --workdir; the last stdout line is JSON. A --workdir
holding an earlier run of a (model, epochs) pair is refused before anything trains.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from core import results as results_lib
from core import settings
from rec import settings as rec_settings

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  from rec import configs
  config.define_flags(None, configs.NUM_ROWS, settings.SEED, settings.DATA,
                      settings.BATCH_SIZE, rec_settings.MODELS, settings.EPOCHS.several(),
                      settings.LEARNING_RATE, settings.WORKDIR, num_rows=100_000, seed=0, data=None,
                      batch_size=128, models=["logreg", "dlrm"],
                      epochs=["1", "3"], learning_rate=0.05, workdir="runs/criteo_baselines")
  flags.mark_flag_as_required("data")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import errors
  from core import train as train_lib
  from rec import configs, runs
  from rec.data import sources

  if sources.synthetic_options(FLAGS.data) is not None:   # --epochs needs an end
    raise errors.expected(f"--data={FLAGS.data}", "generated data, which has no epochs",
                          "files to train on for --epochs, e.g. criteo:DIR")
  # Every list and model checked now, not after the models before it have trained.
  for flag in ("models", "epochs"):
    values = [float(v) for v in FLAGS[flag].value] if flag == "epochs" else FLAGS[flag].value
    text = ",".join(FLAGS[flag].value)
    if not values:
      raise errors.expected(f"--{flag}={text}", "empty", "at least one value")
    if len(set(values)) != len(values):
      raise errors.expected(f"--{flag}={text}", "a value twice", "each value once")
  zero = [e for e in FLAGS.epochs if float(e) <= 0]
  if zero:   # steps_for's floor of one step would be reported as 0 epochs
    raise errors.expected(f"--epochs={','.join(FLAGS.epochs)}", f"{zero[0]} epochs",
                          "epoch counts > 0")
  for model in FLAGS.models:
    try:
      configs.model_config(configs.make_run(model=model, num_rows=FLAGS.num_rows),
                           runs.CRITEO_SHAPED)
    except ValueError as e:
      raise errors.UserError(f"--models={','.join(FLAGS.models)}: {model}: {e}") from None
  run_dir = lambda model, ep: os.path.join(FLAGS.workdir, f"{model}_e{ep}")
  # An earlier run in --workdir is refused before the first model trains (core.train would
  # refuse its checkpoints only when that model's turn came, naming flags this entry point
  # does not have).
  runs.check_fresh([run_dir(m, ep) for m in FLAGS.models for ep in FLAGS.epochs],
                   resume_flag=False)
  rows = []
  for model in FLAGS.models:
    for ep in FLAGS.epochs:
      cfg = configs.make_run(model=model, data=FLAGS.data, num_rows=FLAGS.num_rows,
                             batch_size=FLAGS.batch_size, eval_batch_size=1024, mesh="-1",
                             learning_rate=FLAGS.learning_rate,
                             embedding_learning_rate=FLAGS.learning_rate, seed=FLAGS.seed)
      task, train_src, eval_src, _, _ = configs.build_run(cfg)
      steps = configs.steps_for(float(ep), train_src)
      workdir = run_dir(model, ep)
      print(f"== {model}, {ep} epoch(s): {steps} steps of {cfg.train.batch_size}", flush=True)
      out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                            train_lib.TrainConfig(workdir=workdir, steps=steps, log_every=max(1, steps // 4),
                                                  resume=False, seed=cfg.seed, tensorboard=False))
      ev = out["eval"]
      rows.append({"model": model, "epochs": float(ep), "steps": steps, "auc": ev["auc"],
                   "logloss": ev["logloss"], "ne": ev["ne"], "accuracy": ev["accuracy"],
                   "eval_examples": ev["num_examples"]})
  print(f"\n{'model':8} {'epochs':>6} {'steps':>6} {'AUC':>7} {'logloss':>8} {'NE':>7} {'acc':>6}")
  for r in rows:
    print(f"{r['model']:8} {r['epochs']:>6g} {r['steps']:>6} {r['auc']:7.4f} {r['logloss']:8.4f} "
          f"{r['ne']:7.4f} {r['accuracy']:6.3f}")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  results_lib.write_results(FLAGS.workdir, {
      "data": FLAGS.data, "num_rows": FLAGS.num_rows, "batch_size": FLAGS.batch_size,
      "learning_rate": FLAGS.learning_rate, "results": rows})
  from core import plot as plot_lib
  with plot_lib.figure(os.path.join(FLAGS.workdir, "criteo_baselines.png"), 1, 2,
                       figsize=(8, 3.3)) as (fig, axes):
    for model in FLAGS.models:
      rs = [r for r in rows if r["model"] == model]
      axes[0].plot([r["epochs"] for r in rs], [r["auc"] for r in rs], "o-", label=model)
      axes[1].plot([r["epochs"] for r in rs], [r["ne"] for r in rs], "o-", label=model)
    axes[0].set(xlabel="epochs", title="eval AUC")
    axes[1].set(xlabel="epochs", title="eval NE (lower is better)")
    for a in axes:
      a.grid(alpha=0.3)
      a.legend()
  results_lib.print_summary({"results": rows})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
