"""Predictions of a trained recommendation run on one split of a data set.

    run = load_run("runs/dlrm_criteo", data="criteo:DIR", split="predict")
    for ids, probs, labels in predictions(run):   # in file order, padding dropped
      ...
    ev = run.task.new_evaluator()                   # metrics in the same pass (labeled rows;
    for _ in predictions(run, ev): ...              # with --group_by: gAUC, NE by slice)
    ev.result()

`load_run` reads the settings saved with the workdir's latest checkpoint (the train_rec
flags, the features the model was built for, the criteo_bin conversion it saw), checks the
data against them before anything is built, then builds the run with `configs.build_run`
on the split's source and restores the state through `core.checkpoint` (the train loop's
own pieces: nothing here is a second model or loader), on any device count and mesh (the
checkpoint resharded, `RecTask.restore_checkpoint`). A difference that would make the
ids or features mean something else (another vocabulary --min_count, other rows per
feature, another number of dense features) is a `UserError` naming the data file, the
value found and the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterator

import jax
import numpy as np

from core import checkpoint as ckpt_lib
from core import config
from core import mesh as mesh_lib
from core.errors import UserError
from rec import configs
from rec.data import sources as sources_lib

SPLITS = ("train", "valid", "test", "predict")
# The settings of a prediction (experiments.predict's flags, beside --checkpoint, --data,
# --days and --mesh).
SPLIT = config.setting("split", "enum", "Which rows: predict = the unlabeled ones (Kaggle's "
                       "test file); train / valid / test = labeled rows, with metrics.",
                       choices=SPLITS)
OUTPUT = config.setting("output", "string", "CSV to write (default: "
                        "<checkpoint>/predictions_<split>.csv).")


@dataclasses.dataclass
class LoadedRun:
  """A trained run rebuilt on one split: its config, task, restored state and the split."""

  cfg: configs.RecRunConfig
  task: Any                       # rec.train_lib.RecTask
  state: dict[str, Any]
  step: int
  split: sources_lib.Split
  settings: dict[str, Any]        # the checkpoint's saved settings


def saved_settings(workdir: str) -> tuple[int, dict[str, Any]]:
  """(step, settings) of the workdir's latest checkpoint; reads no array."""
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise UserError(f"--checkpoint={workdir}: no checkpoints/ directory; expected the "
                    "--workdir of a train_rec run")
  ckpt = ckpt_lib.Checkpointer(workdir)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise UserError(f"--checkpoint={workdir}: no finished checkpoint in "
                      f"{ckpt.directory}; expected the --workdir of a train_rec run")
    settings = ckpt.restore_meta(step).get("settings")
  finally:
    ckpt.close()
  if not settings or "model" not in settings or "preset" not in settings:
    raise UserError(f"--checkpoint={workdir}: checkpoint {step} holds no recommendation "
                    "run's settings; expected a checkpoint written by experiments.train_rec")
  return step, settings


def check_conversion(settings: dict, data: str, workdir: str) -> None:
  """The ids of `data` must mean what they meant in training: a criteo_bin conversion with
  the same id settings (hash rows / vocabulary --min_count) as the one the run saw."""
  now = sources_lib.data_settings(data).get("data_conversion")
  then = settings.get("data_conversion")
  d = data.partition(":")[2]
  if now is None and then is None:
    return
  if then is None:
    raise UserError(f"{d}/manifest.json: a criteo_bin conversion ({now['ids']} ids); expected "
                    f"data like the checkpoint's (--data={settings.get('data')}, its ids hashed "
                    "by the text reader)")
  if now is None:
    raise UserError(f"--data={data}: text data with hashed ids; expected a criteo_bin "
                    f"conversion like the checkpoint's ({settings.get('data')}, "
                    f"{then['ids']} ids)")
  for key, flag in (("ids", "--ids"), ("min_count", "--min_count"), ("num_rows", "--num_rows")):
    if now.get(key) != then.get(key):
      what = "vocabulary built" if key == "min_count" else "converted"
      raise UserError(f"{d}/manifest.json: {what} with {flag}={now.get(key)}; expected "
                      f"{flag}={then.get(key)} as the data of the checkpoint {workdir} "
                      f"({settings.get('data')})")


def check_features(settings: dict, spec, where: str, workdir: str) -> None:
  """The split's features must be those the model was built for (its saved `features`)."""
  then = settings.get("features")
  if then is None:
    return
  now = sources_lib.spec_settings(spec)
  if now["num_dense"] != then["num_dense"]:
    raise UserError(f"{where}: {now['num_dense']} dense features; expected "
                    f"{then['num_dense']} as the model of {workdir} was built for")
  if now["sparse_features"] != then["sparse_features"]:
    raise UserError(f"{where}: sparse features {', '.join(now['sparse_features'][:4])}...; "
                    f"expected {', '.join(then['sparse_features'][:4])}... as the model of "
                    f"{workdir} was built for")
  for name, a, b in zip(now["sparse_features"], now["rows_per_feature"],
                        then["rows_per_feature"]):
    if a != b:
      raise UserError(f"{where}: feature {name} has {a:,} rows; expected {b:,} as the model of "
                      f"{workdir} was built for (the same --num_rows or vocabulary)")


def load_run(workdir: str, data: str | None = None, split: str = "test", *,
             days: str | None = None, batch_size: int | None = None,
             mesh: str | None = None, devices=None, group_by: str | None = None) -> LoadedRun:
  """The run trained in `workdir`, rebuilt on `split` of `data` (default: the run's own
  data) with its latest checkpoint restored; see the module docstring. `mesh` (default:
  the run's where `devices`, default all, are as many, else every device on one axis) and
  `devices` may differ from the run's: its checkpoint is resharded. `group_by` (default:
  the run's --group_by): the sparse feature whose groups the task's evaluator reports
  (gAUC, NE by slice); a feature the split lacks is a UserError naming it."""
  step, settings = saved_settings(workdir)
  fields = set(configs.RUN_FIELDS) | {"cache_ways"}
  cfg = configs.make_run(**{k: v for k, v in settings.items() if k in fields})
  # A compressed exchange (--a2a_mode) saved bytes in training; predictions take the exact
  # float32 exchange, on any mesh.
  cfg = cfg.without_a2a()
  new_data = data or cfg.data.data
  if sources_lib.synthetic_options(new_data) is not None:
    # Generated batches have no rows of their own to predict on; the model still predicts
    # on files whose features match it (a synthetic run's are Criteo-shaped).
    where = f"--data={data}" if data else f"--checkpoint={workdir}"
    found = ("generated data" if data else
             f"a run trained on generated data (--data={cfg.data.data})")
    raise UserError(f"{where}: {found}, with no rows to predict on; expected --data naming "
                    "files to predict on (criteo:DIR, avazu:DIR or criteo_bin:DIR) with the "
                    "features the model was built for")
  over = {"data": new_data, "bad_lines": "error",
          "days": days if days is not None else (
              cfg.data.days if new_data == cfg.data.data else "")}
  n = len(jax.devices() if devices is None else devices)
  if mesh:
    over["mesh"] = mesh
  elif mesh_size(cfg.mesh) != n:   # trained on another device count: all of these
    over["mesh"] = "-1"
  b = batch_size or cfg.train.eval_batch_size
  if not batch_size:   # the run's, on another device count: up to a multiple of these
    b = -(-b // n) * n
  over.update(batch_size=b, eval_batch_size=b, host_prefetch=False)   # no train steps here
  if group_by:
    over["group_by"] = group_by
  cfg = configs.replace_run(cfg, **over)
  d = cfg.data
  check_conversion(settings, d.data, workdir)
  part = sources_lib.split_source(d.data, split, b, d.num_rows, d.days or None)
  check_features(settings, part.source.spec, f"--data={d.data} split {split}", workdir)
  task, _, _, _, _ = configs.build_run(cfg, devices, sources=(part.source, part.source))
  ckpt = ckpt_lib.Checkpointer(workdir)
  try:
    state = task.init_state(cfg.seed)
    state, _ = task.restore_checkpoint(ckpt, step, state)
  finally:
    ckpt.close()
  return LoadedRun(cfg, task, state, step, part, settings)


def mesh_size(spec: str) -> int | None:
  """Devices a --mesh needs (None: it takes whatever there is, an axis of -1)."""
  sizes = [n for _, n in mesh_lib.parse_mesh(spec)]
  return None if -1 in sizes else math.prod(sizes)


def predictions(run: LoadedRun, evaluator=None
                ) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
  """(row ids, probabilities [n], labels [n]) per batch, in the split's order, padding
  dropped (labels are 0 for an unlabeled split). The eval step is the run's own; an
  `evaluator` (`task.new_evaluator()`) sees every batch, for metrics in the same pass."""
  eval_step = jax.jit(run.task.eval_step)
  ids = run.split.row_ids()
  for host in run.split.source.batches(0):
    out = eval_step(run.state, run.task.device_batch(host))
    if evaluator is not None:
      evaluator.update(out, host)
    keep = np.asarray(host.mask) > 0
    logits = np.asarray(out["logits"]).reshape(-1)[keep]
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    yield [next(ids) for _ in range(len(probs))], probs, np.asarray(host.labels)[keep]
