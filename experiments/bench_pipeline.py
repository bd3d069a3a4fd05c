r"""Is the accelerator fed? Input pipeline alone, train step alone, and end to end.

  python -m experiments.bench_pipeline                                  # synthetic on device
  python -m experiments.bench_pipeline --data=synthetic:gen=host        # synthetic on the host
  python -m experiments.bench_pipeline --data=criteo_bin:/path/to/converted
  python -m experiments.bench_pipeline --data=criteo_bin:gen            # a generated binary dir
  python -m experiments.bench_pipeline --recd_repeats=1,2,4,8 --batch_size=2048 \
      --data_workers=2                      # RecD: plain vs dedup end to end, session data

For each --data (measured by `experiments.benchmarks.rec.pipeline_rates`): examples/s of
the source alone (`batches()`, host or device), of the jitted train step alone over batches
already on the devices (as experiments.bench_dlrm times it), and of `core.train.train` end
to end (prefetch, placement, metrics; no eval; --steps steps, which the step timing splits
into --repeats repeats), and the ratio end to end / step, which the target asks to be at
least 0.8 at batch 16384 on a GPU.
`criteo_bin:gen` writes --gen_rows random rows in the `rec.data.criteo_bin` layout under
--workdir once (`rec.throughput.synthetic_bin_dir`) and reads them back through Grain.
The model is DLRM's Criteo Kaggle architecture with --num_rows rows per table.

--recd_repeats (RecD, arXiv 2211.05239; `experiments.benchmarks.rec.recd_rates`) measures
instead, per mean session length x, `--data=sessions:dup=1-1/x` (rec.data.sessions:
--num_user user features of --user_bag ids repeat over each session) trained plain and with
the user features deduplicated (--dedup_features, a fixed capacity 6 sigma above the
expected distinct bags), the train batches drawn and deduplicated in --data_workers Grain
worker processes: examples/s of the step alone and end to end (medians of --repeats runs,
plain and dedup alternating), and their ratio beside the paper's up to 2.48x. --data,
--source_batches and --gen_rows belong to the first mode, --data_workers, --num_user and
--user_bag to this one: given to the other, they are refused. Measured
(2026-11-27, 2-core CPU shared at load 25-43, batch 2048; BENCHMARKS.md "RecD end to end"):
end to end dedup / plain 0.80 / 1.13 / 1.59 / 1.72x at mean sessions of 1 / 2 / 4 / 8.

Prints a table, writes results.json and bench_pipeline.png under --workdir, and one JSON line.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from core import settings
from experiments.benchmarks import rec as rec_bench
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

SOURCE_BATCHES = config.setting("source_batches", "integer", "Batches timed for the source "
                                "alone.", lower=1)
GEN_ROWS = config.setting("gen_rows", "integer", "Rows of the generated criteo_bin directory.",
                          lower=1)
RECD_REPEATS = config.setting(
    "recd_repeats", "list", "RecD: mean session lengths of session data to measure plain vs "
    "dedup end to end, e.g. 1,2,4,8 (instead of --data); empty: off.")


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  from rec import configs
  config.define_flags(
      None, configs.NUM_ROWS, configs.MODEL, settings.PRESET, settings.MESH,
      settings.BATCH_SIZE, settings.DATA.several(), settings.STEPS, SOURCE_BATCHES, GEN_ROWS,
      settings.WORKDIR, RECD_REPEATS, rec_settings.DATA_WORKERS, settings.REPEATS,
      rec_settings.NUM_USER.narrowed(upper=26), rec_settings.USER_BAG,
      num_rows=100_000, model="dlrm", preset="kaggle", mesh="-1", batch_size=16384,
      data=["synthetic:gen=device", "synthetic:gen=host", "criteo_bin:gen"],
      steps=60, source_batches=60, gen_rows=4_000_000, workdir="runs/bench_pipeline",
      recd_repeats=[], data_workers=2, repeats=3, num_user=8, user_bag=32)


def check_run_flags() -> None:
  """--model, --preset, --mesh and --batch_size against the devices, before anything is
  generated or measured (criteo_bin:gen writes --gen_rows rows first)."""
  from core import errors
  from core import mesh as mesh_lib
  from rec import configs, runs
  cfg = configs.make_run(model=FLAGS.model, preset=FLAGS.preset, mesh=FLAGS.mesh,
                         num_rows=FLAGS.num_rows, batch_size=FLAGS.batch_size,
                         eval_batch_size=FLAGS.batch_size)
  configs.model_config(cfg, runs.CRITEO_SHAPED)
  mesh = mesh_lib.make_mesh(cfg.mesh, rules=mesh_lib.REC_RULES)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  if FLAGS.batch_size % n:
    raise errors.expected(f"--batch_size={FLAGS.batch_size}",
                          f"not divisible by the {n} devices of --mesh={FLAGS.mesh}",
                          f"a multiple of {n}")


def check_distinct(flag: str, values) -> None:
  """A list flag that names nothing, or one value twice (one row and summary key each)."""
  from core import errors
  text = ",".join(str(v) for v in FLAGS[flag].value or [])
  if not values:
    raise errors.expected(f"--{flag}={text}", "empty", "at least one value")
  twice = [f"{v:g}" if isinstance(v, float) else v
           for v in sorted({v for v in values if list(values).count(v) > 1})]
  if twice:
    raise errors.expected(f"--{flag}={text}", f"{', '.join(twice)} twice", "each value once")


# Flags one mode reads and the other does not: given to the other, refused (not ignored).
PIPELINE_FLAGS = ("data", "source_batches", "gen_rows")
RECD_FLAGS = ("data_workers", "num_user", "user_bag")


def check_mode_flags(recd: bool) -> None:
  from core import errors
  given = [n for n in (PIPELINE_FLAGS if recd else RECD_FLAGS) if FLAGS[n].present]
  if given:
    names = ", ".join(f"--{n}" for n in given)
    raise errors.expected(names, f"given {'with' if recd else 'without'} --recd_repeats",
                          f"{', '.join(f'--{n}' for n in RECD_FLAGS)} only with "
                          f"--recd_repeats, {', '.join(f'--{n}' for n in PIPELINE_FLAGS)} "
                          "only without it")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark
  repeats = parse_recd_repeats() if FLAGS.recd_repeats else None
  check_mode_flags(recd=repeats is not None)
  if repeats is None:
    check_distinct("data", FLAGS.data)
  check_run_flags()
  report = Report(FLAGS.workdir)
  report.path()
  if repeats is not None:
    return recd_main(report, repeats)
  rows = []
  from rec.data import sources
  for data in FLAGS.data:   # every form checked before the first is measured
    if data != "criteo_bin:gen":   # (generated when its turn comes)
      sources.check_form(data)
  for data in FLAGS.data:
    print(f"measuring {data} ...", flush=True)
    r = rec_bench.pipeline_rates(data, FLAGS.batch_size, FLAGS.num_rows, FLAGS.model,
                                 FLAGS.preset, FLAGS.mesh, FLAGS.steps, FLAGS.source_batches,
                                 os.path.join(FLAGS.workdir, "criteo_bin_gen"), FLAGS.gen_rows,
                                 repeats=FLAGS.repeats)
    rows.append({"data": data, **r})
  print(f"\n{'data':24}{'source ex/s':>14}{'step ex/s':>14}{'end-to-end':>14}{'e2e/step':>10}")
  for r in rows:
    print(f"{r['data']:24}{r['source_examples_per_sec']:>14,.0f}{r['step_examples_per_sec']:>14,.0f}"
          f"{r['end_to_end_examples_per_sec']:>14,.0f}{r['end_to_end_over_step']:>10.2f}")
  machine = benchmark.machine()
  results = {
      "rows": rows, "machine": machine,
      "config": {k: FLAGS[k].value for k in ("batch_size", "num_rows", "model", "preset", "mesh",
                                             "steps", "source_batches", "gen_rows",
                                             "repeats")}}
  title = f"{FLAGS.model} {FLAGS.preset}, batch {FLAGS.batch_size}, {machine['device']}"
  report.finish(results, {"device": machine["device"], "batch_size": FLAGS.batch_size,
                          **{r["data"]: {k: _rounded(k, v) for k, v in r.items() if k != "data"}
                             for r in rows}},
                plots=[(plot_rates, (rows, title), "bench_pipeline.png")])


def plot_rates(rows, title: str, path: str) -> None:
  """Source, step and end-to-end examples/s per data source (nothing without matplotlib)."""
  try:
    from core import plot as plot_lib
    import numpy as np
    with plot_lib.figure(path, figsize=(7, 3.5)) as (fig, ax):
      x = np.arange(len(rows))
      for i, (key, label) in enumerate((("source_examples_per_sec", "source alone"),
                                        ("step_examples_per_sec", "step alone"),
                                        ("end_to_end_examples_per_sec", "end to end"))):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
      ax.set_xticks(x, [r["data"] for r in rows], fontsize=8)
      ax.set(yscale="log", ylabel="examples / s", title=title)
      ax.legend(fontsize=8)
      ax.grid(alpha=0.3, axis="y")
  except ImportError:
    pass


def _rounded(key, value):
  """A summary number: ratios to 3 places, rates whole; other values (the source's name) as
  they are."""
  if not isinstance(value, (int, float)):
    return value
  return round(value, 3) if key.endswith("step") else round(value)


# RecD's end-to-end training throughput gain, "up to 2.48x" (arXiv 2211.05239v4 and the
# MLSys 2023 abstract: training and preprocessing throughput and storage efficiency up to
# 2.48x, 1.79x and 3.71x; Meta's publication page states 2.49x), on an industry-scale DLRM.
PAPER_TRAIN_SPEEDUP = 2.48


def parse_recd_repeats() -> list[float]:
  """--recd_repeats as mean session lengths, each >= 1 and given once."""
  from core import errors
  try:
    repeats = [float(x) for x in FLAGS.recd_repeats]
  except ValueError:
    raise errors.UserError(f"--recd_repeats={','.join(FLAGS.recd_repeats)}: expected mean "
                           "session lengths (numbers >= 1), e.g. 1,2,4,8") from None
  if any(not x >= 1 for x in repeats):
    raise errors.UserError(f"--recd_repeats={','.join(FLAGS.recd_repeats)}: expected mean "
                           "session lengths >= 1 (1: no repeats)")
  check_distinct("recd_repeats", repeats)
  return repeats


def recd_main(report: Report, repeats: list[float]):
  from core import benchmark
  rows = rec_bench.recd_rates(repeats, FLAGS.batch_size, FLAGS.num_rows, FLAGS.model,
                              FLAGS.preset, FLAGS.mesh, FLAGS.steps, FLAGS.repeats,
                              FLAGS.data_workers, FLAGS.num_user, FLAGS.user_bag,
                              log=lambda s: print(s, flush=True))
  print(f"\n{'repeats':>7}{'dup':>7}{'measured':>9}{'C_l':>6}{'step plain':>12}{'dedup':>10}"
        f"{'x':>6}{'e2e plain':>11}{'dedup':>10}{'x':>6}   paper (training)")
  for r in rows:
    print(f"{r['repeats']:>7g}{r['dup_rate']:>7.3f}{r['dup_rate_measured']:>9.3f}"
          f"{r['capacity_per_shard']:>6}{r['plain_step_ex_s']:>12,.0f}{r['dedup_step_ex_s']:>10,.0f}"
          f"{r['step_speedup']:>6.2f}{r['plain_e2e_ex_s']:>11,.0f}{r['dedup_e2e_ex_s']:>10,.0f}"
          f"{r['e2e_speedup']:>6.2f}   up to {PAPER_TRAIN_SPEEDUP}x")
  machine = benchmark.machine()
  config = {k: FLAGS[k].value for k in ("batch_size", "num_rows", "model", "preset", "mesh",
                                        "steps", "repeats", "data_workers", "num_user",
                                        "user_bag", "recd_repeats")}
  out = {"recd_rows": rows, "machine": machine, "config": config,
         "paper_train_speedup_max": PAPER_TRAIN_SPEEDUP}
  out["plot"] = report.path("recd_end_to_end.png")
  report.finish(out, {
      "device": machine["device"], "batch_size": FLAGS.batch_size,
      **{f"x{r['repeats']:g}": {"step_x": round(r["step_speedup"], 3),
                                "e2e_x": round(r["e2e_speedup"], 3),
                                "dedup_e2e_ex_s": round(r["dedup_e2e_ex_s"])} for r in rows}},
                plots=[(plot_recd, (rows, machine["device"]), "recd_end_to_end.png")])


def plot_recd(rows, device: str, path: str) -> None:
  """RecD's step and end-to-end speedups by mean session length, beside the paper's."""
  from core import plot as plot_lib
  with plot_lib.figure(path, figsize=(6, 4)) as (fig, ax):
    x = [r["repeats"] for r in rows]
    ax.plot(x, [r["step_speedup"] for r in rows], "s-", label="train step alone")
    ax.plot(x, [r["e2e_speedup"] for r in rows], "o-", label="end to end (Grain workers)")
    ax.axhline(PAPER_TRAIN_SPEEDUP, color="r", ls="--", lw=1,
               label=f"paper: up to {PAPER_TRAIN_SPEEDUP}x (training)")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="mean session length (samples per user-feature bag)",
           ylabel="examples/s, dedup / plain", title=f"RecD, {device}")
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
