r"""Predictions of a trained recommendation model (`rec.predict`): a CSV of row id and click
probability, and the metrics when the rows have labels.

  python -m experiments.train_rec --data=criteo:DIR --workdir=runs/kaggle ...
  python -m experiments.predict --checkpoint=runs/kaggle --split=predict   # Kaggle's test.txt
      # -> runs/kaggle/predictions_predict.csv: Id,Predicted (Kaggle's submission format)
  python -m experiments.predict --checkpoint=runs/kaggle --split=test      # AUC, log loss too
  python -m experiments.predict --checkpoint=runs/x --data=criteo_bin:OUT --split=predict

--data defaults to the run's own data (and --days to its days); --split is train, valid,
test, or predict (the unlabeled rows: Criteo Kaggle's test.txt, Avazu's test.gz, or a
criteo_bin conversion's predict split). Criteo Kaggle's unlabeled rows get Kaggle's ids
(Id from 60,000,000) and header `Id,Predicted`; Avazu's keep their `id` (`id,click`); other
rows are numbered from 0 (`row,probability,label`). The model, its features and the id
settings come from the checkpoint; data whose features or ids differ from those the model
was trained on (another --num_rows, another vocabulary --min_count, Avazu rows for a Criteo
model) is refused with the difference named. Any device count and --mesh
predict (default: the run's mesh where as many devices are here, else all of them on one
axis); a checkpoint of another layout is resharded. Labeled rows also get calibration
(mean prediction / mean label) and, with --group_by (default: the run's own), gAUC and NE by
slice over that sparse feature's groups (`rec.metrics.group_metrics`; a feature the data
lacks is one line naming it, before anything is written). Writes the CSV, `<output>.json`
with the summary and the metrics, and prints one JSON line last.
"""

from __future__ import annotations

import os
import time

from absl import flags
from core import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script."""
  from core import config
  from core import settings  # noqa: F401  (the settings named below)
  from rec import predict  # noqa: F401  (--split, --output; --group_by: rec.configs)
  config.define_flags(None, "checkpoint", "data", "split", "days", "output", "mesh",
                      "group_by", data="", split="predict", output="", mesh="", group_by="")
  flags.mark_flag_as_required("checkpoint")
  # 0 (the run's --eval_batch_size) sits below the shared --batch_size setting's bound.
  flags.DEFINE_integer("batch_size", 0, "Rows per batch (0: the run's --eval_batch_size).",
                       lower_bound=0)


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax
  from core.errors import UserError
  from core import results as results_lib
  from rec import predict as predict_lib
  if jax.process_count() > 1:
    raise UserError(f"{jax.process_count()} processes; expected one: predictions are written "
                    "in file order by one process")
  from core import workdir as workdir_lib
  output = FLAGS.output or os.path.join(FLAGS.checkpoint, f"predictions_{FLAGS.split}.csv")
  summary_path = os.path.splitext(output)[0] + ".json"
  if os.path.isdir(output):
    raise UserError(f"--output={output}: a directory; expected the path of the CSV to write, "
                    "such as predictions.csv")
  if os.path.abspath(summary_path) == os.path.abspath(output):
    raise UserError(f"--output={output}: a .json path, where the summary <output>.json would "
                    "overwrite the CSV; expected a CSV path such as predictions.csv")
  # A read-only or missing place for the CSV is named now, not after the predictions: a
  # given --output before the checkpoint is read; the default CSV lies in the checkpoint,
  # so there a wrong --checkpoint is named as that, not as an unwritable --output.
  check_output = lambda: workdir_lib.check_writable(  # noqa: E731
      os.path.dirname(os.path.abspath(output)), "--output", output)
  if FLAGS.output:
    check_output()
  predict_lib.saved_settings(FLAGS.checkpoint)
  if not FLAGS.output:
    check_output()
  t0 = time.time()
  run = predict_lib.load_run(FLAGS.checkpoint, FLAGS.data or None, FLAGS.split,
                             days=FLAGS.days, batch_size=FLAGS.batch_size or None,
                             mesh=FLAGS.mesh or None, group_by=FLAGS.group_by or None)
  split = run.split
  m = run.cfg.model
  print(f"checkpoint {FLAGS.checkpoint} (step {run.step}) | model {m.model} ({m.preset}) | "
        f"data {run.cfg.data.data} split {FLAGS.split} | {split.describe}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  evaluator = run.task.new_evaluator() if split.labeled else None
  rows = 0
  tmp = output + ".tmp"
  try:
    with open(tmp, "w") as f:
      header = [split.id_column, split.prob_column] + (["label"] if split.labeled else [])
      f.write(",".join(header) + "\n")
      for ids, probs, labels in predict_lib.predictions(run, evaluator):
        if split.labeled:
          f.writelines(f"{i},{p:.6g},{int(y)}\n" for i, p, y in zip(ids, probs, labels))
        else:
          f.writelines(f"{i},{p:.6g}\n" for i, p in zip(ids, probs))
        rows += len(probs)
  except BaseException:   # a bad data line, a full disk, Ctrl-C: no partial CSV left beside
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  os.replace(tmp, output)
  metrics = evaluator.result() if evaluator is not None else {}
  summary = {"checkpoint": FLAGS.checkpoint, "step": run.step, "data": run.cfg.data.data,
             "split": FLAGS.split, "rows": rows, "labeled": split.labeled, "output": output,
             "wall_seconds": time.time() - t0,
             **{k: metrics.get(k) for k in ("auc", "logloss", "ne", "accuracy", "calibration",
                                            "gauc") if k in metrics}}
  results_lib.write_json({"summary": summary, "metrics": metrics}, summary_path)
  if metrics:
    print(f"{FLAGS.split}: AUC {metrics['auc']:.4f} | log loss {metrics['logloss']:.4f} | "
          f"NE {metrics['ne']:.4f} | calibration {metrics['calibration']:.4f} | {rows:,} rows",
          flush=True)
  if "gauc" in metrics:
    from rec import metrics as metrics_lib
    print(metrics_lib.format_groups(metrics, run.cfg.data.group_by), flush=True)
  print(f"wrote {rows:,} predictions to {output}", flush=True)
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
