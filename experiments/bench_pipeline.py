r"""Is the accelerator fed? Input pipeline alone, train step alone, and end to end.

  python -m experiments.bench_pipeline                                  # synthetic on device
  python -m experiments.bench_pipeline --data=synthetic:gen=host        # synthetic on the host
  python -m experiments.bench_pipeline --data=criteo_bin:/path/to/converted
  python -m experiments.bench_pipeline --data=criteo_bin:gen            # a generated binary dir

For each --data (measured by `experiments.benchmarks.rec.pipeline_rates`): examples/s of
the source alone (`batches()`, host or device), of the jitted train step alone over batches
already on the devices (as experiments.bench_dlrm times it), and of `core.train.train` end
to end (prefetch, placement, metrics; no eval), and the ratio end to end / step, which
the target asks to be at least 0.8 at batch 16384 on a GPU.
`criteo_bin:gen` writes --gen_rows random rows in the `rec.data.criteo_bin` layout under
--workdir once (`rec.throughput.synthetic_bin_dir`) and reads them back through Grain.
The model is DLRM's Criteo Kaggle architecture with --num_rows rows per table.

Prints a table, writes results.json and bench_pipeline.png under --workdir, and one JSON line.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import results as results_lib
from experiments.benchmarks import rec as rec_bench

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  from rec import configs
  configs.define_rec_run_flags("num_rows", "model", "preset", "mesh", batch_size=16384)
  flags.DEFINE_list("data", ["synthetic:gen=device", "synthetic:gen=host", "criteo_bin:gen"],
                    "Sources to measure (train_rec's --data forms; criteo_bin:gen = generated).")
  flags.DEFINE_integer("steps", 60, "End-to-end steps (also split into the step timing's repeats).",
                       lower_bound=1)
  flags.DEFINE_integer("source_batches", 60, "Batches timed for the source alone.", lower_bound=1)
  flags.DEFINE_integer("gen_rows", 4_000_000, "Rows of the generated criteo_bin directory.",
                       lower_bound=1)
  flags.DEFINE_string("workdir", "runs/bench_pipeline", "results.json, plot, generated data.")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark
  os.makedirs(FLAGS.workdir, exist_ok=True)
  rows = []
  for data in FLAGS.data:
    print(f"measuring {data} ...", flush=True)
    r = rec_bench.pipeline_rates(data, FLAGS.batch_size, FLAGS.num_rows, FLAGS.model,
                                 FLAGS.preset, FLAGS.mesh, FLAGS.steps, FLAGS.source_batches,
                                 os.path.join(FLAGS.workdir, "criteo_bin_gen"), FLAGS.gen_rows)
    rows.append({"data": data, **r})
  print(f"\n{'data':24}{'source ex/s':>14}{'step ex/s':>14}{'end-to-end':>14}{'e2e/step':>10}")
  for r in rows:
    print(f"{r['data']:24}{r['source_examples_per_sec']:>14,.0f}{r['step_examples_per_sec']:>14,.0f}"
          f"{r['end_to_end_examples_per_sec']:>14,.0f}{r['end_to_end_over_step']:>10.2f}")
  machine = benchmark.machine()
  results_lib.write_results(FLAGS.workdir, {
      "rows": rows, "machine": machine,
      "config": {k: FLAGS[k].value for k in ("batch_size", "num_rows", "model", "preset", "mesh",
                                             "steps", "source_batches", "gen_rows")}})
  try:
    from core import plot as plot_lib
    plt = plot_lib.pyplot()
    import numpy as np
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("source_examples_per_sec", "source alone"),
                                      ("step_examples_per_sec", "step alone"),
                                      ("end_to_end_examples_per_sec", "end to end"))):
      ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, [r["data"] for r in rows], fontsize=8)
    ax.set(yscale="log", ylabel="examples / s",
           title=f"{FLAGS.model} {FLAGS.preset}, batch {FLAGS.batch_size}, {machine['device']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.workdir, "bench_pipeline.png"), dpi=110)
    plt.close(fig)
  except ImportError:
    pass
  results_lib.print_summary({"device": machine["device"], "batch_size": FLAGS.batch_size,
                             **{r["data"]: {k: round(v, 3) if k.endswith("step") else round(v)
                                            for k, v in r.items() if k != "data"} for r in rows}})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
