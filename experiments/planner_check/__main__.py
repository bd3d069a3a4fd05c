r"""The embedding planner checked against the compiled program: per sharding kind, the
planner's bytes moved per step and memory per device beside what the compiled train step's
HLO moves (core.hlo) and what the devices hold, over a grid of tables and batch sizes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.planner_check
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.planner_check \
      --planner_grid=tiny --sharding_kinds=tw,rw --planner_step=embedding

For every grid point (study.GRIDS: tables' rows, dim and bag size, storage, global batch)
and kind (dp, tw, rw, cw, twrw, sptt), the run is built as train_rec builds it (DLRM on
synthetic Criteo-shaped data, `rec.configs.make_plan` for the kind; sptt: DMT's towers on
`planner.tower_plan`), its train step compiled, the embedding collectives read from the
HLO (result bytes per device; the dense gradients' all-reduce apart) and the embedding
state's bytes per device taken from its shards; the planner's estimate
(rec/embedding/planner/estimate.py: the collection's layout) beside them, with the
per-table sums the greedy adds up. Prints the table (markdown), writes results.json and
planner_check.png under --workdir; last line JSON (worst |estimate / measured - 1| per
kind, and whether every case is within 10%).

Measured (`python -m experiments.planner_check`, configs/full_grid.py; 2-core Intel Xeon
CPU with 8 simulated devices, shared (load 3-11), jax 0.11.2, 13 min 43 s; the table in
BENCHMARKS.md "Planner checked against the program"): bytes and memory estimate / measured
1.000 for every kind at every point (60 cases); before the layout terms the planner's
bytes were 0.33-1.00 of the program's (padded bags, weights and lengths, dp's valid flags,
all-to-all slots, sptt's tower outputs) and cw with int8 rows held 2x its memory estimate.
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings

FLAGS = flags.FLAGS

PLANNER_GRID = config.setting("planner_grid", "enum", "Grid of table sets and batch sizes "
                              "(experiments/planner_check/study.py GRIDS).",
                              choices=("tiny", "full"))
SHARDING_KINDS = config.setting("sharding_kinds", "list", "Sharding kinds to check: dp, tw, "
                                "rw, cw, twrw, sptt (DMT's towers).")
PLANNER_STEP = config.setting("planner_step", "enum", "What to compile: the run's train step, "
                              "or the embedding collection's phases alone (the same embedding "
                              "collectives, no dense model; sptt without a tower module).",
                              choices=("train", "embedding"))


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting
  but --workdir may come from a --config file (configs/ beside this file)."""
  from experiments.planner_check import study
  config.define_flags(None, PLANNER_GRID, SHARDING_KINDS, PLANNER_STEP, in_config=True,
                      flag_values=flag_values, planner_grid="full",
                      sharding_kinds=list(study.KINDS), planner_step="train")
  config.define_flags(None, settings.WORKDIR, flag_values=flag_values,
                      workdir="runs/planner_check")


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax

  from core import benchmark
  from experiments.common.report import Report
  from experiments.planner_check import study

  kinds = [k.strip().lower() for k in FLAGS.sharding_kinds if k.strip()]
  bad = [k for k in kinds if k not in study.KINDS]
  if not kinds or bad:
    raise errors.expected(f"--sharding_kinds={','.join(FLAGS.sharding_kinds)}",
                          f"unknown kinds {bad}" if bad else "empty",
                          f"some of {','.join(study.KINDS)}")
  if len(set(kinds)) != len(kinds):
    raise errors.expected(f"--sharding_kinds={','.join(FLAGS.sharding_kinds)}", "a kind twice",
                          "each kind once")
  devices = jax.devices()
  if len(devices) < 2 or len(devices) % 2:
    raise errors.expected(f"{len(devices)} {jax.default_backend()} device(s)", "too few to shard "
                          "over", "an even count >= 2 (on the CPU: XLA_FLAGS="
                          "--xla_force_host_platform_device_count=8)")
  points = study.GRIDS[FLAGS.planner_grid]
  # Every grid point's batch is cut over the devices: checked now, not at the first point
  # that does not divide after the ones before it have compiled.
  batches = sorted({p.batch for p in points if p.batch % len(devices)})
  if batches:
    raise errors.expected(f"{len(devices)} {jax.default_backend()} devices",
                          f"--planner_grid={FLAGS.planner_grid} has batches {batches} that they "
                          "do not divide", "a device count dividing every batch of the grid")
  report = Report(FLAGS.workdir)
  report.log(f"{len(points)} grid points x {len(kinds)} kinds on {len(devices)} "
             f"{jax.default_backend()} devices")
  rows = study.run(points, kinds, devices, FLAGS.planner_step, log=report.log)
  out = {"machine": benchmark.machine(), "grid": FLAGS.planner_grid, "kinds": kinds,
         "step": FLAGS.planner_step, "devices": len(devices), "rows": rows,
         "table": report.table(study.format_table(rows), lead="\n")}
  out["plot"] = report.path("planner_check.png")   # drawn after results.json is written
  summary = study.summary(rows)
  out["summary"] = summary
  report.finish(out, summary, wall="wall_seconds",
                plots=[(study.plot, (rows,), "planner_check.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
