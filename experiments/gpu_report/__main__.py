r"""Every GPU target the project states, measured in one run on one H100 / H200 (issue 23),
each as a ratio to its reference taken in the same run; writes DIR/report.md (one row per
target: figure, target, met or not) and DIR/report.json after every part.

  python -m experiments.gpu_report --out=/tmp/gpu_report          # one GPU, ~10 min
  python -m experiments.gpu_report --parts=attention,decode        # some parts only
  python -m experiments.gpu_report --dry_run --out=/tmp/dry        # CPU, toy sizes
  python -m experiments.gpu_report --parts=decode,lm_train --profile   # + kernel profiles

On the lent GPU machine (its $OUT returns at most 8 files, so logs travel as one archive):
  PYTHONUNBUFFERED=1 python -m experiments.gpu_report --out=/tmp/r; cp /tmp/r/report.* $OUT;
  tar -C /tmp/r --exclude='profile_*' -czf $OUT/logs.tgz logs   # traces: 70 MB, over the limit

Parts (--parts, in this order by default; parts.py says what each measures):
  attention      flash attention forward / backward TFLOP/s, bf16, head dims 128 and 64,
                 causal and not, 4K / 8K / 16K tokens (batch x seq = 16K): Mosaic GPU with
                 the fused and the split backward, Triton, cuDNN; targets: best Mosaic GPU
                 >= 0.9x cuDNN forward, >= 0.8x backward
  lm_train       Llama 3.2 1B train step at seq 8192, attention_impl auto / cudnn /
                 pallas_mgpu, the fastest remat policy of --lm_remats; target MFU >= 50%
  decode         bf16 decode ms per step, batch 1 and 8, prompt 1K, against the bandwidth
                 floor (weights + KV cache over the copy bandwidth); target <= 1.3x at batch 1
                 with attention auto (the split-key kernel, kernels/decode_attention.py),
                 beside the same weights with xla_decode (the jnp sums)
  quant_decode   weight-only int8 / int4 decode ms per step at batch 1 against bf16 (random
                 codes drawn on the device); targets int8 <= 0.6x, int4 <= 0.4x
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
rec_pipeline (the loop's middle steps, per source), mlperf and fp8 (core.profiling): how
busy the device was over the traced steps, kernels per step, and the kernels that took the
time, in each part's log and report.md tables; the traces stay under DIR/logs/profile_*
(too large to travel back from the lent machine: the line above leaves them out).

--dry_run runs the parts on CPU at toy sizes (`parts.Sizes.dry_run`), each code path of
the GPU run once: Pallas kernels interpreted (the Mosaic GPU kernels in Pallas's GPU
interpreter, Triton in its own), the attention part's cuDNN rows on XLA's attention, the
lm_train part's cudnn case on llm.attention.cudnn's jnp emulation of the kernel (the same
mask mapping, lse and backward; cuDNN itself needs a GPU), "synthetic" as gen=device (the
device-side generator, what it is on a GPU), pytest on one file. Its figures mean
nothing; it fails (exit 1) on any row with an error, and keeps the report from rotting
between GPU sessions. The default test suite runs, in about 50 s of CPU:
  python -m experiments.gpu_report --dry_run \
      --parts=attention,lm_train,decode,embedding_bag,rec_pipeline \
      --lm_impls=cudnn,pallas_mgpu --bag_formats=float32,int4 \
      --pipeline_data=synthetic:gen=device
(Mosaic GPU fused and split backward, Triton and cuDNN at head dim 128; the cudnn and
pallas_mgpu train steps; decode; float32 and int4 bags; the DLRM loop on the device-side
generator). The whole dry run (every part, --profile: the auto / xla train cases, the
bfloat16 / int8 / int8_cache bags, criteo_bin in a Grain worker, mlperf, fp8, the pytest
parts) is `pytest -m slow tests/experiments/test_gpu_report.py`, about 4 minutes of CPU:
run it before a GPU round. Without --dry_run the report refuses to run off a GPU.

The last stdout line is a JSON summary (the report's path, targets by status, parts, and
"errors": how many rows hold an error, each listed on stderr).
"""

from __future__ import annotations

import os

# Pallas's GPU interpreter (the dry run's Mosaic GPU kernel) runs each warpgroup on its own
# XLA CPU thread; the CPU client's pool must have more threads than a 2-core machine gives
# by default. Only read when the CPU client starts.
os.environ.setdefault("PJRT_NPROC", "16")

import sys  # noqa: E402

from absl import flags  # noqa: E402

from core import cli  # noqa: E402
from core import config  # noqa: E402
from core import errors  # noqa: E402
from core import results as results_lib  # noqa: E402
from core import settings as _settings  # noqa: E402  (the shared settings by name)

FLAGS = flags.FLAGS
DRY_RUN_BUDGET_S = 3600.0


OUT = _settings.OUT   # default: runs/gpu_report_<date>_<time>
PARTS = config.setting("parts", "list", "Parts to run, in order (parts.PARTS).")
DRY_RUN = config.setting("dry_run", "bool", "Every part at toy sizes on CPU (numbers "
                         "meaningless).")
BUDGET_S = config.setting(
    "budget_s", "float", "Wall-clock budget of the whole report in seconds (the dry run has "
    "none unless this is given).")
PART_BUDGETS = config.setting(
    "part_budgets", "list", "Per-part budgets in seconds, PART:SECONDS (default: "
    "parts.DEFAULT_BUDGETS).")
LM_IMPLS = config.setting(
    "lm_impls", "list", "attention_impl cases of the lm_train part, in order (an impl that the "
    "first, auto, resolves to reuses its program; the dry run has its own default).")
LM_REMATS = config.setting(
    "lm_remats", "list", "Remat policies of the lm_train part (none, full, dots, attention): "
    "every attention_impl at the first, then at the next as the budget allows; each impl's "
    "fastest counts.")
BAG_FORMATS = config.setting(
    "bag_formats", "list", "Row formats of the embedding_bag part (some of float32, bfloat16, "
    "int8, int8_split, int4, int8_cache, int4_cache; the dry run's default: the same).")
PIPELINE_DATA = config.setting(
    "pipeline_data", "list", "--data sources of the rec_pipeline part: synthetic forms (on a "
    "GPU 'synthetic' is drawn on the device, gen=device) and criteo_bin:gen (rows generated in "
    "the criteo_bin layout, read through Grain); the dry run has its own default.")
MLPERF_ROWS = config.setting(
    "mlperf_rows", "integer", "Rows per table cap of the mlperf part (default 4M on a GPU; 0: "
    "the reference's 204M rows, ~60 GB).", lower=0, none_ok=True)


def define_flags() -> None:
  """The report's flags; --fp8_layers / --fp8_recipe are the rec settings (rec.configs),
  here the fp8 part's (layers comma-separated; recipe tensor or row)."""
  from rec import configs  # noqa: F401  (defines the fp8 settings)

  from experiments.gpu_report import parts
  config.define_flags(
      None, OUT, PARTS, DRY_RUN, BUDGET_S, PART_BUDGETS, "compilation_cache_dir", "profile",
      LM_IMPLS, LM_REMATS, BAG_FORMATS, PIPELINE_DATA, "fp8_layers", "fp8_recipe", MLPERF_ROWS,
      out="", parts=list(parts.PARTS), dry_run=False,
      budget_s=float(sum(parts.DEFAULT_BUDGETS.values())), part_budgets=[],
      compilation_cache_dir="runs/jax_compilation_cache", profile=False,
      lm_impls=list(parts.Sizes.gpu().lm_impls), lm_remats=["none", "attention"],
      bag_formats=list(parts.Sizes.gpu().eb_formats),
      pipeline_data=list(parts.Sizes.gpu().rp_data),
      fp8_layers=",".join(parts.FP8_PROBE_SAFE), fp8_recipe="tensor", mlperf_rows=None)
  flags.register_validator("fp8_recipe", lambda v: v in ("tensor", "row"),
                           message="expected tensor or row (the fp8 part's scalings)")


def fp8_layers() -> tuple[str, ...]:
  """--fp8_layers as names (the rec setting is one comma-separated string)."""
  return tuple(n.strip() for n in (FLAGS.fp8_layers or "").split(",") if n.strip())


def parse_budgets(items: list[str], known) -> dict[str, float]:
  """["attention:90", ...] -> {"attention": 90.0}; a bad entry is a UserError naming it."""
  out = {}
  for item in items:
    name, sep, value = item.partition(":")
    try:
      seconds = float(value) if sep else None
    except ValueError:
      seconds = None
    if name not in known or seconds is None or not seconds > 0:   # nan too
      raise errors.expected("--part_budgets", repr(item), f"PART:SECONDS with PART one of "
                            f"{', '.join(known)} and SECONDS > 0")
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
  if unknown or not FLAGS.parts:
    raise errors.expected("--parts", f"{','.join(FLAGS.parts)!r}",
                          f"some of {', '.join(parts.PARTS)}")
  bad_remat = [r for r in FLAGS.lm_remats if r not in ("none", "full", "dots", "attention")]
  if bad_remat or not FLAGS.lm_remats:
    raise errors.expected("--lm_remats", f"{','.join(FLAGS.lm_remats)!r}",
                          "some of none, full, dots, attention")
  bad_impl = [i for i in FLAGS.lm_impls if i not in parts.LM_IMPLS]
  if bad_impl or not FLAGS.lm_impls:
    raise errors.expected("--lm_impls", f"{','.join(FLAGS.lm_impls)!r}",
                          f"some of {', '.join(parts.LM_IMPLS)}")
  bad_format = [f for f in FLAGS.bag_formats if f not in parts.eb_bench.FORMATS]
  if bad_format or not FLAGS.bag_formats:
    raise errors.expected("--bag_formats", f"{','.join(FLAGS.bag_formats)!r}",
                          f"some of {', '.join(parts.eb_bench.FORMATS)}")
  bad_data = [d for d in FLAGS.pipeline_data if not parts.is_pipeline_data(d)]
  if bad_data or not FLAGS.pipeline_data:
    raise errors.expected("--pipeline_data", f"{','.join(bad_data) or 'nothing'!r}",
                          "synthetic forms (synthetic, synthetic_deep, with options such as "
                          "gen=device), criteo_bin:gen or criteo_bin:DIR")
  if not FLAGS.budget_s > 0:      # nan too: it would turn every budget check off
    raise errors.expected("--budget_s", str(FLAGS.budget_s), "> 0")
  if FLAGS.mlperf_rows is not None and FLAGS.mlperf_rows < 0:
    raise errors.expected("--mlperf_rows", str(FLAGS.mlperf_rows), ">= 0")
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
  _settings.use_compilation_cache(cache)
  over = dict(lm_impls=tuple(FLAGS.lm_impls), lm_remats=tuple(FLAGS.lm_remats),
              eb_formats=tuple(FLAGS.bag_formats), rp_data=tuple(FLAGS.pipeline_data),
              fp8_layers=fp8_layers(), fp8_recipe=FLAGS.fp8_recipe)
  for flag, field in (("lm_impls", "lm_impls"), ("lm_remats", "lm_remats"),
                      ("bag_formats", "eb_formats"), ("pipeline_data", "rp_data"),
                      ("fp8_layers", "fp8_layers")):
    if FLAGS.dry_run and not FLAGS[flag].present:   # the dry run keeps its own unless asked
      over.pop(field)
  if FLAGS.mlperf_rows is not None:
    over["ml_rows"] = FLAGS.mlperf_rows
  sizes = (parts.Sizes.dry_run if FLAGS.dry_run else parts.Sizes.gpu)(**over)
  out_dir = FLAGS.out or report_lib.default_out_dir()
  settings = {k: FLAGS[k].value for k in ("parts", "dry_run", "budget_s", "part_budgets",
                                          "profile", "compilation_cache_dir", "lm_impls",
                                          "lm_remats", "bag_formats", "pipeline_data",
                                          "fp8_layers", "fp8_recipe", "mlperf_rows")}
  settings["fp8_layers"] = list(fp8_layers())
  report = parts.run_report(sizes, FLAGS.parts, out_dir, dry_run=FLAGS.dry_run,
                            budget_s=budget_s, budgets=budgets, settings=settings,
                            profile=FLAGS.profile)
  md = report_lib.to_markdown(report)
  print("\n" + md.split("\n## ")[0])
  by_status: dict[str, int] = {}
  for t in report["targets"]:
    by_status[t["status"]] = by_status.get(t["status"], 0) + 1
  bad_rows = report_lib.row_errors(report)
  if bad_rows:
    print(f"\n{len(bad_rows)} row(s) with an error:\n  " + "\n  ".join(bad_rows),
          file=sys.stderr)
  results_lib.print_summary({"report": os.path.join(out_dir, "report.md"), "dry_run": FLAGS.dry_run,
                             "wall_s": report["wall_s"], "targets": by_status,
                             "parts": {k: v["status"] for k, v in report["parts"].items()},
                             "errors": len(bad_rows)})
  if FLAGS.dry_run and bad_rows:
    sys.exit(1)     # the dry run checks that every case runs: any error fails it


if __name__ == "__main__":
  define_flags()
  cli.run(main)
