r"""Train a recommendation model end to end: DLRM (arXiv 1906.00091), DCN-v2 (2008.13535),
DHEN (2203.11014), Wukong (2403.02545) or logistic regression.

  python -m experiments.train_rec                       # DLRM on synthetic Criteo-shaped data
  python -m experiments.train_rec --model=wukong --preset=l2_n16 --steps=200
  python -m experiments.train_rec --model=dhen --preset=dhen_4l --embedding_dim=32
  python -m experiments.train_rec --data=criteo:../shared/data/criteo_kaggle_sample \
      --num_rows=100000 --batch_size=128 --epochs=3 --workdir=/tmp/dlrm_criteo
  python -m experiments.train_rec --workdir=/tmp/run --resume   # continue a stopped run
  python -m experiments.train_rec --config=/tmp/run/config.py --workdir=/tmp/run2   # replay it
  python -m experiments.train_rec --data=criteo:TB_DIR --days=0-2   # 3 Terabyte days, as downloaded
  python -m experiments.train_rec --dedup_features=C1,C2   # RecD: lookups on distinct bags
  python -m experiments.train_rec --data=sessions:dup=0.875 --dedup_features=C1,C2,C3,C4,C5,C6,C7,C8 \
      --data_workers=2   # RecD's session data; batches and their dedup made in Grain workers
  python -m experiments.train_rec --model=searched:runs/rankitect/best_random.json  # a found arch
  python -m experiments.train_rec --mesh=data:8 --sharding=tw --a2a_mode=abs \
      --a2a_error_bound=0.005 --a2a_grad_error_bound=0.001 --a2a_bits=8   # compressed exchange
  python -m experiments.train_rec --data=avazu:DIR --group_by=site_id   # gAUC, NE by site
  python -m experiments.train_rec --host_memory_gb=64   # tables the devices cannot hold: host
  python -m experiments.train_rec --storage=fp32_cache:lfu:0.05@host   # every table on host
  python -m experiments.train_rec --storage=fp32_cache:lru:0.05@host --host_prefetch   # + lookahead

Writes `<workdir>/results.json`, metrics.jsonl, TensorBoard events and checkpoints (default
workdir: a new runs/train_rec_<model>_<date-time> per run); the last stdout line is a JSON
summary with model, steps, test_auc, test_logloss, test_ne, test_calibration (mean
prediction / mean label; with --group_by also test_gauc), examples_per_sec, and the
model's dense / embedding parameter counts and forward GFLOPs per example (XLA's count for
the dense part). `--resume` checks the flags against those saved with the checkpoint; a
non-finite loss or gradient norm stops the run (or, with --nonfinite=skip, skips the step).
One run per workdir (`core.workdir`: a second run there is refused naming the first).
SIGTERM / SIGINT finish the step, keep a checkpoint of it and end with the line `stopped at
step N; checkpoint N kept; continue with --resume` and status 143 / 130; besides
--checkpoint_every, a checkpoint is written every --checkpoint_every_minutes (default 10).
A checkpoint that cannot be written (disk full, file-size limit) ends the run in one line
naming it, after results.json when training and evaluation finished. `--resume` may change
--mesh, the device count, --sharding, --sharding_overrides, --memory_budget_gb and
--host_memory_gb: a checkpoint of another embedding layout is resharded (one line says so:
`resharded checkpoint 4: 8 devices tw -> 4 devices rw`).

The host tier (rec/embedding/host_tier.py): with --host_memory_gb=G (GiB per device) the
auto planner moves the tables the device budget cannot hold, biggest and least looked-up
first, to host memory (rows and optimizer state in pinned_host, the hot rows in a device
cache: fp32 tables become fp32_cache:lfu:0.05@host and train bit for bit as fp32, a
*_cache --storage keeps its cache and arithmetic; bf16 / intN tables become fp32_cache /
intN_cache, which the cache changes); the plan's table shows each table's tier and the host
bytes per device. --storage=KIND_cache...@host puts every table there. --host_prefetch
ends each train step by bringing the rows of the next batch into those tables' device caches
(evicting by the cache policy), so the next step's lookups read no host memory where the
rows fit; fp32_cache trains bit for bit as without it; refused without a table on the tier.

Evaluation reports AUC, log loss, NE, accuracy and calibration (mean prediction / mean
label); --group_by=FEATURE (a sparse feature of the data: Avazu's site_id / app_id, a
Criteo C1..C26, a session's user feature) adds gAUC (the impression-weighted mean of the
per-group AUCs; groups of one label skipped and counted) and NE by slice (the biggest
groups and the rest) over that feature's values: results.json's `eval` holds gauc,
gauc_groups and ne_by_slice, metrics.jsonl the same per evaluation, TensorBoard
eval/calibration and eval/gauc, and the end of the output a table of the slices.
--group_by may change on --resume (it changes no training).

The run's settings are one typed config (`TrainRecConfig`: the `rec.configs.RecRunConfig`
and the train loop's `core.settings.LoopConfig`, plus --epochs and --data_workers); the
workdir keeps them resolved as `config.py`, and `--config=<workdir>/config.py` replays the
run (flags given on the command line win over the file, each such flag printed in one line
and noted in the new config.py); it is written once the settings have built a run, so
settings that do not (a --group_by the data lacks) leave an earlier config.py as it was.

--a2a_mode=abs|rel compresses the embedding exchange (arXiv 2407.04272; the all-to-all of
tw / cw / twrw tables and the reduce-scatter of rw ones, their gradients with
--a2a_grad_error_bound); a sharding with no exchange (one device, dp tables) is refused. At
the end the run measures it (`rec.embedding.a2a_report`): payload vs float32 bytes per device
per step from the step's HLO, and the largest pooled-embedding and gradient errors against
their bounds on the first two train batches; results.json holds it under `a2a_compression`, the
summary line its bytes and error ratios.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import shlex
import sys
import time

from absl import flags

from core import cli
from core import config
from core import results as results_lib
from core import settings as core_settings
from rec import configs
from rec import settings as rec_settings

FLAGS = flags.FLAGS
CONFIG_FILE = "config.py"   # the resolved settings in the workdir; --config replays them


@dataclasses.dataclass(frozen=True)
class TrainRecConfig:
  """A train_rec run: the rec run's settings, the train loop's, and how long / how fed."""
  run: configs.RecRunConfig = config.section(configs.RecRunConfig)
  loop: core_settings.LoopConfig = config.section(core_settings.LoopConfig)
  epochs: float | None = core_settings.EPOCHS.field(None)   # instead of --steps
  data_workers: int = rec_settings.DATA_WORKERS.field(0)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  configs.define_run_flags(*configs.RUN_FIELDS)   # at RecRunConfig's defaults
  config.define_flags(TrainRecConfig)
  config.define_flags(None, *core_settings.RUN_FLAGS, resume=False, resume_allow=[],
                      overwrite=False)


def from_flags(flag_values=None) -> TrainRecConfig:
  """The run's config from the flags (and --config), the cache flags folded into
  --storage (`rec.configs.fold_cache_flags`)."""
  cfg = config.from_flags(TrainRecConfig, flag_values)
  return dataclasses.replace(cfg, run=configs.fold_cache_flags(cfg.run, flag_values))


# Settings besides the loop's (steps, cadences, paths) that --resume may change: they
# change neither the state nor the batches the run sees (the layout settings only where
# the state lies: a checkpoint of another layout is resharded).
RESUME_CHANGEABLE = ("epochs", "eval_batch_size", "bad_lines",
                     "group_by") + configs.LAYOUT_SETTINGS


def default_workdir(model: str) -> str:
  """A new runs/train_rec_<model>_<YYYYmmdd-HHMMSS> (suffixed -2, -3, ... if taken); a
  searched:FILE model is named after the file."""
  from core import workdir as workdir_lib
  if model.startswith("searched:"):
    model = "searched_" + os.path.splitext(os.path.basename(model))[0]
  return workdir_lib.dated(f"train_rec_{model}")


def main(argv):
  del argv
  tcfg = from_flags()
  cfg = tcfg.run
  if FLAGS.resume and not FLAGS.workdir:
    runs = sorted(glob.glob(os.path.join("runs", f"train_rec_{cfg.model.model}_*")),
                  key=os.path.getmtime)
    newest = f" (the newest here: --workdir={runs[-1]})" if runs else ""
    sys.exit(f"train_rec: --resume needs --workdir, the run to continue{newest}")
  overridden = config.command_line_overrides(TrainRecConfig)
  for name, (was, now) in overridden.items():
    print(f"--{name}={now!s} overrides {FLAGS.config}'s {was!s}", flush=True)
  cli.quiet_library_logs()
  from core import checkpoint as ckpt_lib
  from core import mesh as mesh_lib
  from core import plot as plot_lib
  from core import train as train_lib
  from rec import metrics as metrics_lib
  from rec.embedding import planner as planner_lib

  cfg.validate()
  from core import errors
  from rec.data import sources as sources_lib
  if tcfg.epochs is not None:   # before the workdir is written or the data read
    if tcfg.epochs <= 0:
      raise errors.expected(f"--epochs={tcfg.epochs:g}", "no pass over the data",
                            "a number > 0 (or no --epochs: train --steps)")
    if sources_lib.synthetic_options(cfg.data.data or "") is not None:
      raise errors.expected(f"--epochs={tcfg.epochs:g}", f"--data={cfg.data.data} is "
                            "generated without end", "--steps, or --epochs with a --data of files")
  import jax
  if jax.process_count() > 1 and not FLAGS.workdir:
    sys.exit(f"train_rec: a run of {jax.process_count()} processes needs --workdir (the same "
             "directory on shared storage for every process)")
  from core import workdir as workdir_lib
  workdir = FLAGS.workdir or default_workdir(cfg.model.model)
  workdir_lib.claim(workdir)   # for the run's life (cli.run holds a --workdir given already)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
  settings = configs.checkpoint_settings(
      cfg, mesh_lib.make_mesh(cfg.mesh, rules=mesh_lib.REC_RULES), epochs=tcfg.epochs)
  loop_cfg = core_settings.loop_config(
      tcfg.loop, workdir=workdir, seed=cfg.seed, settings=settings,
      changeable=RESUME_CHANGEABLE, normalize_settings=configs.normalize_settings,
      nonfinite_hint="lower --learning_rate (dense part) or --embedding_learning_rate "
                     "(embedding tables)")
  try:
    train_lib.check_resume(loop_cfg)  # before any data is read or state built
  except train_lib.RunSettingsError as e:
    sys.exit(f"train_rec: {e}")
  task, train_src, eval_src, plan, mesh = configs.build_run(cfg, data_workers=tcfg.data_workers)
  steps = configs.steps_for(tcfg.epochs, train_src) if tcfg.epochs else tcfg.loop.steps
  train_lib.check_stop_at_step(tcfg.loop.stop_at_step, steps)   # before config.py is written
  if jax.process_index() == 0:   # settings that build: the workdir's config.py replays them
    config.write_file(tcfg, os.path.join(workdir, CONFIG_FILE), overridden=overridden,
                      command="python -m experiments.train_rec " + shlex.join(sys.argv[1:]))
  sources_lib.check_splits(eval_src)   # a bad eval line stops the run before step 0
  loop_cfg = dataclasses.replace(loop_cfg, steps=steps, overwrite=False, settings={
      **settings, "features": sources_lib.spec_settings(train_src.spec)})
  m, batch_size = cfg.model, cfg.train.batch_size
  print(f"workdir {workdir} | mesh {dict(mesh.shape)} | model {m.model} ({m.preset}) | "
        f"data {cfg.data.data} | {steps} steps of {batch_size}", flush=True)
  budget, budget_source = configs.plan_budget(cfg)
  cost = configs.plan_cost_params(train_src.spec)
  tier = configs.host_tier(cfg)
  print(planner_lib.format_plan(plan, task.collection.tables, task.collection.num_devices,
                                batch_size, budget, cost, budget_source=budget_source,
                                host_budget_bytes=tier and tier.host_budget_bytes,
                                host_source=tier.source if tier else ""), flush=True)
  stats = configs.model_stats(task, train_src.spec)
  print(f"params: dense {stats['dense_params']:,} + embedding {stats['embedding_params']:,} = "
        f"{stats['dense_params'] + stats['embedding_params']:,} | forward "
        f"{stats['gflops_per_example']:.6f} GFLOPs/example (dense part)", flush=True)
  t0 = time.time()
  write_failed = None
  try:
    out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0), loop_cfg)
  except (train_lib.RunSettingsError, train_lib.NonFiniteError,
          ckpt_lib.CheckpointMismatchError) as e:
    sys.exit(f"train_rec: {e}")
  except ckpt_lib.CheckpointWriteError as e:
    if getattr(e, "summary", None) is None:
      raise
    out, write_failed = e.summary, e   # trained and evaluated: results.json first
  ev = out["eval"]
  a2a = None
  if task.collection.a2a_compression is not None:   # what the compressed exchange sent, its error
    from rec.embedding import a2a_report as a2a_report_lib
    a2a = a2a_report_lib.a2a_report(task, out["state"],
                                    list(itertools.islice(train_src.batches(0), 2)))
    print(a2a_report_lib.format_a2a_report(a2a), flush=True)
  summary = {
      "model": m.model, "preset": m.preset, "data": cfg.data.data, "mesh": dict(mesh.shape),
      "steps": out["step"], "finished": out["finished"], "batch_size": batch_size,
      "test_auc": ev.get("auc"), "test_logloss": ev.get("logloss"), "test_ne": ev.get("ne"),
      "test_accuracy": ev.get("accuracy"), "test_examples": ev.get("num_examples"),
      "test_calibration": ev.get("calibration"),
      **({"test_gauc": ev["gauc"]} if "gauc" in ev else {}),
      "examples_per_sec": out["examples_per_sec"], "wall_seconds": time.time() - t0,
      "bad_lines_skipped": getattr(train_src, "bad_line_count", 0),
      "nonfinite_steps_skipped": out["skipped_steps"], "workdir": workdir, **stats,
  }
  if a2a is not None:
    summary.update({"a2a_payload_bytes": a2a["bytes"]["payload"],
                    "a2a_float32_bytes": a2a["bytes"]["float32"],
                    "a2a_max_error_over_bound": a2a["max_error_over_bound"],
                    "a2a_max_grad_error_over_bound": a2a["max_grad_error_over_bound"]})
  results = {"summary": summary, "config": cfg.flat_settings(), "steps_planned": steps,
             "plan": planner_lib.plan_summary(plan, task.collection.tables,
                                              task.collection.num_devices, batch_size, cost),
             "embedding_groups": task.collection.describe(), "eval": ev}
  if a2a is not None:
    results["a2a_compression"] = a2a
  results_lib.write_results(workdir, results)
  try:
    plot_lib.plot_run(workdir)
  except Exception as e:  # noqa: BLE001 - the numbers and the summary line matter more
    print(f"plot skipped: {e}", file=sys.stderr)
  if ev:
    print(f"test AUC {ev['auc']:.4f} | logloss {ev['logloss']:.4f} | NE {ev['ne']:.4f} | "
          f"calibration {ev['calibration']:.4f} | {out['examples_per_sec']:,.0f} train "
          "examples/s", flush=True)
  if "gauc" in ev:
    print(metrics_lib.format_groups(ev, cfg.data.group_by), flush=True)
  if write_failed is not None:
    raise write_failed
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
