r"""Every GPU target the project states, measured in one run on one H100 / H200 (issue 23),
each as a ratio to its reference taken in the same run; writes DIR/report.md (one row per
target: figure, target, met or not) and DIR/report.json after every part.

  python -m experiments.gpu_report --out=/tmp/gpu_report          # one GPU, ~10 min
  python -m experiments.gpu_report --parts=attention,decode        # some parts only
  python -m experiments.gpu_report --dry_run --out=/tmp/dry        # CPU, toy sizes
  python -m experiments.gpu_report --parts=decode,lm_train --profile   # + kernel profiles

On the lent GPU machine (its $OUT returns at most 8 files, so logs travel as one archive):
  PYTHONUNBUFFERED=1 python -m experiments.gpu_report --out=/tmp/r; cp /tmp/r/report.* $OUT;
  tar -C /tmp/r -czf $OUT/logs.tgz logs

Parts (--parts, in this order by default; parts.py says what each measures):
  attention      flash attention forward / backward TFLOP/s, bf16, head dims 128 and 64,
                 causal and not, 4K / 8K / 16K tokens (batch x seq = 16K): Mosaic GPU with
                 the fused and the split backward, Triton, cuDNN; targets: best Mosaic GPU
                 >= 0.9x cuDNN forward, >= 0.8x backward
  lm_train       Llama 3.2 1B train step at seq 8192, attention_impl auto / cudnn /
                 pallas_mgpu, the fastest remat policy of --lm_remats; target MFU >= 50%
  decode         bf16 decode ms per step, batch 1 and 8, prompt 1K, against the bandwidth
                 floor (weights + KV cache over the copy bandwidth); target <= 1.3x at batch 1
  embedding_bag  the Pallas embedding bag per row format (fp32, bf16, int8, int4, int8 with
                 an fp32 cache) at buffers over 4 GiB, against the copy bandwidth and XLA's
                 gather; targets fp32 / bf16 >= 70%, int8 >= 60% and faster than XLA
  rec_pipeline   DLRM `core.train.train` end to end against its jitted step (bench_dlrm's),
                 batch 16384, synthetic and generated criteo_bin rows (read in process and
                 in 8 Grain workers, train_rec's --data_workers); target >= 0.8x
  mlperf         DCNv2 MLPerf preset examples/s per GPU against NVIDIA's 1.7M per H100
  fp8            DCNv2 MLPerf preset step with FP8 on the probe's safe layers against bf16
  pytest_gpu     `JAX_PLATFORMS=cuda python -m pytest -m gpu tests` (a subprocess)
  pytest_suite   the default suite on the GPU (a subprocess; partial counts at its limit)

Each part runs under its time budget (--part_budgets; all under --budget_s): it starts no
new case once its budget is spent and reports those cases as skipped. A part that fails is
reported as failed with its error, one that runs out of GPU memory as "oom", and the report
goes on. Each part's compile time (jax.monitoring's compile events) and run time are
logged; its log is DIR/logs/<part>.log. The measuring parts share one process (and the
persistent compilation cache of --compilation_cache_dir, so a rerun on the same machine
skips compiles); the pytest parts run in subprocesses with XLA_PYTHON_CLIENT_PREALLOCATE
off, in the GPU memory this process leaves.

--profile also traces one timed case of decode (per batch size), lm_train (per case),
rec_pipeline (the loop, per source), mlperf and fp8 (core.profiling): how busy the device
was over the traced steps, kernels per step, and the kernels that took the time, in each
part's log and report.md tables; the traces stay under DIR/logs/profile_* (in logs.tgz).

--dry_run runs every part at toy sizes on CPU: Pallas kernels in interpret mode (the Mosaic
GPU kernel in Pallas's GPU interpreter), cuDNN replaced by XLA, pytest on one file. Its
figures mean nothing; it keeps the report from rotting between GPU sessions (the default
test suite runs it; 2-4 minutes on the 2-core CPU, nearly all of it compilation). Without
--dry_run the report refuses to run off a GPU.

The last stdout line is a JSON summary (the report's path, targets by status, parts).
"""

from __future__ import annotations

import os

# Pallas's GPU interpreter (the dry run's Mosaic GPU kernel) runs each warpgroup on its own
# XLA CPU thread; the CPU client's pool must have more threads than a 2-core machine gives
# by default. Only read when the CPU client starts.
os.environ.setdefault("PJRT_NPROC", "16")

import sys  # noqa: E402

from absl import app, flags  # noqa: E402

from core import cli  # noqa: E402
from core import results as results_lib  # noqa: E402

FLAGS = flags.FLAGS
DRY_RUN_BUDGET_S = 3600.0


def define_flags() -> None:
  from experiments.gpu_report import parts
  flags.DEFINE_string("out", "", "Report directory (default runs/gpu_report_<date>_<time>).")
  flags.DEFINE_list("parts", list(parts.PARTS), f"Parts to run, in order: {list(parts.PARTS)}.")
  flags.DEFINE_bool("dry_run", False, "Every part at toy sizes on CPU (numbers meaningless).")
  flags.DEFINE_float("budget_s", float(sum(parts.DEFAULT_BUDGETS.values())),
                     "Wall-clock budget of the whole report in seconds (the dry run has none "
                     "unless this is given).")
  flags.DEFINE_list("part_budgets", [],
                    "Per-part budgets in seconds, PART:SECONDS (default "
                    + ",".join(f"{k}:{v}" for k, v in parts.DEFAULT_BUDGETS.items()) + ").")
  flags.DEFINE_string("compilation_cache_dir", "runs/jax_compilation_cache",
                      "JAX's persistent compilation cache ('' : off; the dry run leaves it "
                      "off unless given).")
  flags.DEFINE_bool("profile", False,
                    "Also trace one timed case of decode, lm_train, rec_pipeline, mlperf and "
                    "fp8 (jax.profiler): device busy / span, kernels per step and the top "
                    "kernels in each part's details and log; traces under "
                    "DIR/logs/profile_*.")
  flags.DEFINE_list("lm_remats", ["none", "attention"],
                    "Remat policies of the lm_train part (none, full, dots, attention): every "
                    "attention_impl at the first, then at the next as the budget allows; each "
                    "impl's fastest counts.")
  flags.DEFINE_list("fp8_layers", list(parts.FP8_PROBE_SAFE),
                    "FP8 layers of the fp8 part (default: the FP8 probe's safe set for DCN-v2; "
                    "names the MLPerf preset lacks are dropped).")
  flags.DEFINE_enum("fp8_recipe", "tensor", ["tensor", "row"], "FP8 scaling of the fp8 part.")
  flags.DEFINE_integer("mlperf_rows", None, "Rows per table cap of the mlperf part (default "
                       "4M on a GPU; 0: the reference's 204M rows, ~60 GB).", lower_bound=0)


def parse_budgets(items: list[str], known) -> dict[str, float]:
  """["attention:90", ...] -> {"attention": 90.0}; a bad entry is a UsageError naming it."""
  out = {}
  for item in items:
    name, sep, value = item.partition(":")
    try:
      seconds = float(value) if sep else None
    except ValueError:
      seconds = None
    if name not in known or seconds is None or seconds <= 0:
      raise app.UsageError(f"--part_budgets: {item!r}, expected PART:SECONDS with PART one of "
                           f"{list(known)} and SECONDS > 0")
    out[name] = seconds
  return out


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax
  if FLAGS.dry_run:
    jax.config.update("jax_platforms", "cpu")
  from experiments.gpu_report import parts
  from experiments.gpu_report import report as report_lib

  unknown = [p for p in FLAGS.parts if p not in parts.PARTS]
  if unknown:
    raise app.UsageError(f"--parts: {unknown} unknown, expected some of {list(parts.PARTS)}")
  bad_remat = [r for r in FLAGS.lm_remats if r not in ("none", "full", "dots", "attention")]
  if bad_remat or not FLAGS.lm_remats:
    raise app.UsageError(f"--lm_remats: {FLAGS.lm_remats}, expected some of none, full, "
                         "dots, attention")
  if FLAGS.budget_s <= 0:
    raise app.UsageError(f"--budget_s={FLAGS.budget_s}, expected > 0")
  if FLAGS.mlperf_rows is not None and FLAGS.mlperf_rows < 0:
    raise app.UsageError(f"--mlperf_rows={FLAGS.mlperf_rows}, expected >= 0")
  budgets = parse_budgets(FLAGS.part_budgets, parts.PARTS)
  budget_s = FLAGS.budget_s
  if FLAGS.dry_run and not FLAGS["budget_s"].present:
    # The dry run checks that every part runs, not how fast a loaded CPU is: no budget
    # unless one is asked for.
    budget_s = DRY_RUN_BUDGET_S
    budgets = {**{p: DRY_RUN_BUDGET_S for p in parts.PARTS}, **budgets}
  if not FLAGS.dry_run and jax.default_backend() != "gpu":
    msg = (f"gpu_report: JAX's default backend is {jax.default_backend()!r}, not a GPU; the "
           "report measures GPU targets. Run it on an H100 / H200, or pass --dry_run to run "
           "every part at toy sizes on CPU.")
    print(msg, file=sys.stderr)
    results_lib.print_summary({"refused": msg})
    sys.exit(2)
  cache = FLAGS.compilation_cache_dir if (not FLAGS.dry_run
                                          or FLAGS["compilation_cache_dir"].present) else ""
  if cache:
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  over = dict(lm_remats=tuple(FLAGS.lm_remats), fp8_layers=tuple(FLAGS.fp8_layers),
              fp8_recipe=FLAGS.fp8_recipe)
  for name in ("lm_remats", "fp8_layers"):     # the dry run keeps its own unless asked
    if FLAGS.dry_run and not FLAGS[name].present:
      over.pop(name)
  if FLAGS.mlperf_rows is not None:
    over["ml_rows"] = FLAGS.mlperf_rows
  sizes = (parts.Sizes.dry_run if FLAGS.dry_run else parts.Sizes.gpu)(**over)
  out_dir = FLAGS.out or report_lib.default_out_dir()
  settings = {k: FLAGS[k].value for k in ("parts", "dry_run", "budget_s", "part_budgets",
                                          "profile",
                                          "compilation_cache_dir", "lm_remats", "fp8_layers",
                                          "fp8_recipe", "mlperf_rows")}
  report = parts.run_report(sizes, FLAGS.parts, out_dir, dry_run=FLAGS.dry_run,
                            budget_s=budget_s, budgets=budgets, settings=settings,
                            profile=FLAGS.profile)
  md = report_lib.to_markdown(report)
  print("\n" + md.split("\n## ")[0])
  by_status: dict[str, int] = {}
  for t in report["targets"]:
    by_status[t["status"]] = by_status.get(t["status"], 0) + 1
  results_lib.print_summary({"report": os.path.join(out_dir, "report.md"), "dry_run": FLAGS.dry_run,
                             "wall_s": report["wall_s"], "targets": by_status,
                             "parts": {k: v["status"] for k, v in report["parts"].items()}})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
