r"""ExFM (arXiv 2502.17494, "External Large Foundation Model: How to Efficiently Serve Trillions
of Parameters for Online Ads Recommendation"): one foundation-model teacher serving several
vertical students by external distillation, on streaming data.

  python -m experiments.exfm                         # synthetic drift + the Criteo sample
  python -m experiments.exfm --data=synthetic --students=3 --periods=8
  python -m experiments.exfm --data=criteo:../shared/data/criteo_kaggle_raw

1. Data in time order, cut into --history + --periods periods: synthetic Criteo-shaped
   data (rec.data.synthetic, the deep hidden model with planted high-order interactions,
   hidden-logit std --logit_scale, --num_rows rows per feature) whose first
   --drift_features features move to new ids every period, and/or the Criteo sample's
   train.txt in file order (Kaggle's train.txt is in time order). Each student owns a
   vertical: the rows whose id of feature --vertical_feature is congruent to its index mod
   --students, of which it trains on the first --batches_per_period batches per period.
2. The foundation model sees far more data than any student, as in the paper: Wukong
   teachers (sizes --teacher_sizes) train on every row of a period (synthetic periods hold
   --teacher_data times the students' union, so most rows are the teacher's only; on
   Criteo the teacher has the whole period, the students their vertical's share), from
   the --history periods on, then every --teacher_every periods on the periods since
   their last update (the paper's slower cadence). For each student period the DAS
   (rec.distill.augment) runs the then-current teacher once over each student's rows and
   writes its logits to a file; students read that column, never the teacher.
3. Students (DLRM; DCN-v2 for odd indices) stream through RecTask and core.train: train
   on period p, evaluate the serving head on p + 1, continue (resume). First alone; then
   the check that each teacher's column beats every student alone on the evaluated
   periods (printed with both NEs and the margin); then kd (plain distillation into the
   serving head), aux_head (the auxiliary head) and aux_head+adapter (plus the student
   adapter) with the --main_teacher, and kd and aux_head+adapter with every other teacher
   size (NE gain against teacher size).
--data: synthetic and/or criteo:DIR (a criteo:DIR that is absent is skipped when it is the
default); --learning_rate: Adagrad's, of the dense part and the rows.
Prints the tables per data set, writes results.json, exfm_gains.png, exfm_scaling.png; the
last line is JSON. One run per --workdir: a workdir holding an earlier run's teachers or
students is refused before anything trains (the study does not resume; choose a fresh
--workdir, or delete them). The paper's own NE gains are "n/a": the public text searched (its
abstract and summaries) states "significant performance gain" without per-variant numbers.

Measured (BENCHMARKS.md "ExFM"; the defaults, 2026-11-27, 2-core CPU at load 24-41: 33.8
min wall, 486 s CPU time, about 4-8 min on an idle machine): the teachers beat both
students alone on synthetic data by 4.6-8.4 % NE (Criteo sample 7.5-10.8 %); students'
mean NE gain with teacher L, synthetic: kd +2.59 / +0.65 (DLRM / DCN-v2), aux_head +0.46 /
+0.23, aux_head+adapter +0.43 / +0.26; the smallest teacher (S) has the largest margin, and
the gains follow the margin, not the teacher's size.
"""

from __future__ import annotations

import os

from absl import flags, logging

from core import cli
from core import config
from core import settings
from core.errors import UserError
from experiments.common.report import Report

FLAGS = flags.FLAGS
DEFAULT_CRITEO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "..", "shared", "data", "criteo_kaggle_raw")

STUDENTS = config.setting("students", "integer", "Students (vertical models) per teacher, "
                          "2-3.", lower=1)
PERIODS = config.setting("periods", "integer", "Student periods (each but the last is "
                         "trained on, each but the first evaluated).", lower=2)
HISTORY = config.setting("history", "integer", "Periods before the students start (teacher "
                         "only).", lower=1)
TEACHER_EVERY = config.setting("teacher_every", "integer", "Teacher update cadence in "
                               "periods.", lower=1)
CRITEO_BATCH_SIZE = config.setting("criteo_batch_size", "integer", "Batch size on the Criteo "
                                   "sample.", lower=1)
BATCHES_PER_PERIOD = config.setting(
    "batches_per_period", "integer", "Batches per student and period (fewer where a vertical "
    "holds fewer: the Criteo sample).", lower=1)
DRIFT_FEATURES = config.setting("drift_features", "integer", "Synthetic features whose ids "
                                "drift.", lower=0, upper=26)
TEACHER_DATA = config.setting(
    "teacher_data", "float", "Synthetic rows per period for the teacher, in units of the "
    "students' union (students x batches_per_period x batch_size); each student trains on its "
    "vertical's first batches only.", lower=1.0)
LOGIT_SCALE = config.setting("logit_scale", "float", "Std of the synthetic hidden logit "
                             "(signal strength).", lower=0.0)
TEACHER_SIZES = config.setting("teacher_sizes", "list", "Teacher sizes (Wukong): S, M, L.")
MAIN_TEACHER = config.setting("main_teacher", "string", "The teacher of the variant "
                              "comparison.")
VERTICAL_FEATURE = config.setting("vertical_feature", "integer", "Feature whose id picks a "
                                  "row's student.", lower=0, upper=25)


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting
  but --workdir may come from a --config file (configs/ beside this file)."""
  from rec import configs
  config.define_flags(
      None, settings.DATA.several(), STUDENTS, PERIODS, HISTORY, TEACHER_EVERY,
      settings.BATCH_SIZE, configs.NUM_ROWS, CRITEO_BATCH_SIZE, BATCHES_PER_PERIOD,
      DRIFT_FEATURES, TEACHER_DATA, LOGIT_SCALE, TEACHER_SIZES, MAIN_TEACHER, VERTICAL_FEATURE,
      settings.LEARNING_RATE, settings.SEED, in_config=True, flag_values=flag_values,
      data=["synthetic", "criteo:" + os.path.normpath(DEFAULT_CRITEO)], students=2, periods=6,
      history=3, teacher_every=2, batch_size=256, num_rows=500, criteo_batch_size=32,
      batches_per_period=16, drift_features=4, teacher_data=4.0, logit_scale=3.0,
      teacher_sizes=["S", "M", "L"], main_teacher="L", vertical_feature=0, learning_rate=0.05,
      seed=0)
  config.define_flags(None, settings.WORKDIR, flag_values=flag_values, workdir="runs/exfm")


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from experiments.exfm import study

  bad = [s for s in FLAGS.teacher_sizes if s not in study.TEACHERS]
  if bad or not FLAGS.teacher_sizes:
    raise UserError(f"--teacher_sizes={','.join(FLAGS.teacher_sizes)}: unknown {bad}; "
                    f"expected some of {sorted(study.TEACHERS)}")
  twice = sorted({s for s in FLAGS.teacher_sizes if FLAGS.teacher_sizes.count(s) > 1})
  if twice:   # a size given twice counts twice in the teacher check and the means over sizes
    raise UserError(f"--teacher_sizes={','.join(FLAGS.teacher_sizes)}: {twice} given more than "
                    "once; expected distinct sizes")
  if FLAGS.main_teacher not in FLAGS.teacher_sizes:
    raise UserError(f"--main_teacher={FLAGS.main_teacher}: not in --teacher_sizes="
                    f"{','.join(FLAGS.teacher_sizes)}; expected one of them")
  datasets = []
  for d in FLAGS.data:
    if d == "synthetic":
      datasets.append((d, "synthetic", FLAGS.batch_size))
    elif d.startswith("criteo:"):
      path = os.path.join(d[len("criteo:"):], "train.txt")
      if not os.path.isfile(path) and not FLAGS["data"].present:
        print(f"skipping {d}: {path} not found", flush=True)
        continue
      datasets.append((d, path, FLAGS.criteo_batch_size))
    else:
      raise UserError(f"--data={d}: expected synthetic or criteo:DIR")
  # An earlier run's teachers or students of any data set are refused before the first
  # trains (one run per workdir; the study does not resume).
  from rec import runs
  runs.check_fresh([d for name, _, _ in datasets for d in study.run_dirs(
      os.path.join(FLAGS.workdir, name.split(":")[0]), FLAGS.students, FLAGS.teacher_sizes,
      FLAGS.main_teacher)], resume_flag=False)
  report = Report(FLAGS.workdir)
  results = []
  for name, data, batch in datasets:
    res = study.run(data, FLAGS.students, FLAGS.periods, FLAGS.history, FLAGS.teacher_every,
                    batch, FLAGS.batches_per_period, FLAGS.num_rows, FLAGS.drift_features,
                    FLAGS.teacher_sizes, FLAGS.main_teacher, FLAGS.vertical_feature,
                    FLAGS.learning_rate, FLAGS.seed,
                    os.path.join(FLAGS.workdir, name.split(":")[0]),
                    log=lambda s: print(s, flush=True), teacher_data=FLAGS.teacher_data,
                    logit_scale=FLAGS.logit_scale)
    res["data"] = name
    report.table(study.format_table(res))
    results.append(res)
  out = {"results": results, "settings": {k: FLAGS[k].value for k in (
      "students", "periods", "history", "teacher_every", "batch_size", "criteo_batch_size",
      "batches_per_period", "num_rows", "drift_features", "teacher_data", "logit_scale",
      "teacher_sizes", "main_teacher", "vertical_feature", "learning_rate", "seed")},
         "paper_ne_gain_pct": study.PAPER_NE_GAIN,
         "plots": [report.plot(study.plot_gains, results, name="exfm_gains.png"),
                   report.plot(study.plot_scaling, results, name="exfm_scaling.png")]}
  summary = {r["data"].split(":")[0]: {
      "teacher_margin_pct": round(sum(c["mean_margin_pct"] for c in r["teacher_check"]
                                      if c["teacher"] == FLAGS.main_teacher) / FLAGS.students, 3),
      **{v: round(sum(x["mean_ne_gain_pct"] for x in r["rows"]
                      if x["variant"] == v and x["teacher_ne"] is not None) / FLAGS.students, 3)
         for v in study.VARIANTS if v != "alone"}} for r in results}
  report.finish(out, summary, wall="wall_seconds")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
