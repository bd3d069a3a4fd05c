r"""DLRM (arXiv 1906.00091), DCN-v2 (2008.13535), DHEN (2203.11014) and Wukong (2403.02545)
trained under one budget on the same data, compared in one table.

  python -m experiments.compare_rec        # synthetic, 4 models x 3 seeds, ~10-15 min on 2 cores
  python -m experiments.compare_rec --data=criteo:../shared/data/criteo_kaggle_sample \
      --epochs=1 --batch_size=128 --workdir=runs/compare_rec_criteo
  python -m experiments.compare_rec --models=dlrm,wukong:l2_n8,wukong:l3_n16 --presets=dlrm=terabyte
  # bigger (an accelerator, or hours of CPU): longer, wider batches, the presets' own dims
  python -m experiments.compare_rec --steps=5000 --batch_size=4096 --embedding_dim=0 \
      --eval_batches=64 --seeds=0,1,2,3,4 --workdir=runs/compare_rec_big

Every model gets the same data and hashing (`--num_rows` per feature), batch size, embedding
dim (`--embedding_dim`, default 16 for all; 0 keeps each preset's own, e.g. 128 for Wukong's
and DCN-v2's Criteo presets; `logreg` keeps one weight per id), dense and sparse optimizers,
learning rates and number of steps (`--steps`, or `--epochs` over file data). Presets: each
model's `kaggle` (its Criteo default) unless `--presets=wukong=l2_n8,dhen=dhen_2l` or a
`model:preset` entry in `--models` says otherwise (see rec.configs.MODEL_PRESETS). Seeds
(`--seeds=0,1,2`) vary the parameter initialization only; the data is the same for every
seed (`--data_seed` picks the synthetic hidden model), so mean ± std is over
initializations.

Prints a table of test AUC, log loss and NE (mean ± sample std over seeds), dense and
embedding parameters, forward GFLOPs/example of the dense part (XLA's count), train
examples/s and wall seconds per run, plus the true logits' metrics on synthetic data (the
Bayes ceiling). Writes `<workdir>/results.json` and `<workdir>/compare_rec.png` (AUC and NE
bars with std error bars; NE against GFLOPs); per-run metrics under `<workdir>/runs/`. The
last stdout line is a JSON summary. The runs train through `rec.runs.train_models` (the
library's same-budget training of several models); the report is study.py.

Measured 2026-11-21 on the 2-core CPU of BENCHMARKS.md (shared with other jobs), test AUC
and NE as mean ± sample std over seeds 0, 1, 2:
  python -m experiments.compare_rec                                 # 659 s in all
    DLRM 0.7618 ± 0.0003 / 0.8514 ± 0.0011, DCN-v2 0.7700 ± 0.0002 / 0.8395 ± 0.0010,
    DHEN 0.7519 ± 0.0044 / 0.8664 ± 0.0073, Wukong 0.7637 ± 0.0018 / 0.8505 ± 0.0030;
    true logits 0.8290 / 0.7464 (the kaggle presets at dim 16, 500 steps of 1024)
  python -m experiments.compare_rec --data=criteo:../shared/data/criteo_kaggle_sample \
      --epochs=1 --batch_size=128 --eval_batch_size=1024 --workdir=runs/compare_rec_criteo
    72 s; 56 steps, 800 eval rows: DLRM 0.7141 ± 0.0205 / 0.9125 ± 0.0257 (seed 0: 0.7268
    / 0.8946, as experiments.criteo_baselines), DCN-v2 0.7284 ± 0.0043 / 0.9001 ± 0.0042,
    DHEN 0.6663 ± 0.0360 / 0.9745 ± 0.0292, Wukong 0.7010 ± 0.0167 / 0.9373 ± 0.0282
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from experiments.common.report import Report

FLAGS = flags.FLAGS


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names; `flag_values`: where, default
  absl's FLAGS); every setting but --workdir / --resume may come from a --config file
  (configs/ beside this file)."""
  from core import settings  # noqa: F401  (the settings named below)
  from experiments.compare_rec import study  # noqa: F401
  from rec import configs
  from rec import settings as rec_settings  # noqa: F401
  configs.define_run_flags("data", "num_rows", "dense_optimizer", "learning_rate",
      "sparse_optimizer", "embedding_learning_rate", "mesh", "bad_lines", "csv_label",
      "csv_dense", "csv_categorical", flag_values=flag_values, embedding_dim=16,
      batch_size=1024, eval_batch_size=4096, eval_batches=16)
  config.define_flags(
      None, "models", "presets", "seeds", "data_seed", "steps", "epochs", "log_every",
      "keep_checkpoints", in_config=True, flag_values=flag_values,
      models=["dlrm", "dcnv2", "dhen", "wukong"], presets="", seeds=["0", "1", "2"],
      data_seed=0, steps=500, log_every=100, keep_checkpoints=False)
  config.define_flags(None, "workdir", "resume", flag_values=flag_values,
                      workdir="runs/compare_rec", resume=False)


def main(argv):
  del argv
  cli.quiet_library_logs()

  from core import errors
  from experiments.compare_rec import study
  from rec import configs, runs
  from rec.data import sources

  base = configs.run_from_flags(seed=FLAGS.data_seed)
  # The lists and the budget named as flags before anything trains (rec.runs would name
  # its own arguments, or train a seed given twice twice, as two runs of one mean).
  for flag in ("models", "seeds"):
    if not FLAGS[flag].value:
      raise errors.expected(f"--{flag}=", "empty", "at least one value")
  seeds = [int(s) for s in FLAGS.seeds]
  if len(set(seeds)) != len(seeds):
    raise errors.expected(f"--seeds={','.join(FLAGS.seeds)}", "a seed twice", "each seed once")
  if FLAGS.epochs is not None:
    if FLAGS["steps"].present and FLAGS["epochs"].present:
      raise errors.expected(f"--steps={FLAGS.steps} --epochs={FLAGS.epochs:g}", "both given",
                            "one budget: --steps, or --epochs over file data")
    if FLAGS.epochs <= 0:
      raise errors.expected(f"--epochs={FLAGS.epochs:g}", "no training",
                            "a number of passes > 0 (or --steps)")
    if sources.synthetic_options(base.data.data) is not None:
      raise errors.expected(f"--epochs={FLAGS.epochs:g}", f"given with --data="
                            f"{base.data.data}, which is endless", "--steps on generated data")
  specs = runs.parse_models(FLAGS.models, FLAGS.presets)
  results = runs.train_models(
      base, specs, seeds=seeds,
      steps=None if FLAGS.epochs is not None else FLAGS.steps, epochs=FLAGS.epochs,
      workdir=FLAGS.workdir,
      log_every=FLAGS.log_every, keep_checkpoints=FLAGS.keep_checkpoints,
      reuse_finished=FLAGS.resume)
  report = Report(FLAGS.workdir)
  results["table"] = report.table(runs.format_runs(results), lead="\n")
  results["summary"] = summary = study.summary(results)
  report.finish(results, summary,
                plots=[(study.plot_comparison, (results,), "compare_rec.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
