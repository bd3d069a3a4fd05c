r"""Embedding-bag kernels against the GPU's memory bandwidth, by row format.

  python -m experiments.bench_kernels_embedding                     # on a GPU; refuses on CPU
  python -m experiments.bench_kernels_embedding --sweep             # + Pallas launch configs
  python -m experiments.bench_kernels_embedding --rows=500000 --dtypes=int8,int8_split

The measuring is `experiments.benchmarks.embedding_bag.bench_embedding_bag` (shared with
experiments.gpu_report; its docstring says how bytes are counted): the Pallas kernel
(`kernels.embedding_bag`), the XLA gather + einsum the collection uses by default, and for
split int8 rows the jax-triton kernel, each against a device-to-device copy measured in
the same run (read + write counted: ~3.0 TB/s on an H100). Default size: 26 tables x 1M
rows x dim 128, batch 8192, 20 uniform ids per bag (nearly every row read a cache miss;
Zipf ids, `--zipf_alpha`, hit L2 and can exceed 1).

Row formats (`--dtypes`): float32, bfloat16, int8 (FBGEMM row-wise int8 packed with scale
and bias inline), int8_split (codes, scale and bias in three arrays), int4 (FBGEMM N-bit,
dequantized in the kernel), int8_cache / int4_cache (the mixed-precision tables of arXiv
2010.11305 with `--cache_fraction` of the rows in an fp32 LFU cache, by default int8 0.05
and int4 0.01: "pallas" and "xla" time the whole lookup with the cache search,
"pallas_kernel" the kernel alone; the hit rate goes into the results). `--sweep` adds a
few Pallas launch configurations per format (rows in flight `unroll`, bags per program,
warps) beside the default one.

Every implementation runs in its own try: one that fails to compile or runs out of
memory is reported with its error and the others go on. Prints a table, writes
results.json to --workdir; the last stdout line is JSON. Not yet run on a GPU.

Letters: B batch, F features (tables), L ids per bag, R rows per table, D dim.
"""

from __future__ import annotations

import sys

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings
from experiments.benchmarks import embedding_bag as eb_bench
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

FEATURES = config.setting("features", "integer", "Tables (features) in the flat buffer.",
                          lower=1)
BAG_LEN = config.setting("bag_len", "integer", "Ids per bag.", lower=1)
DTYPES = config.setting("dtypes", "list", f"Row formats, some of {eb_bench.FORMATS}.",
                        item=config.Setting("dtypes", "enum", "A row format.",
                                            choices=eb_bench.FORMATS))
IMPL_NAMES = ("pallas", "xla", "triton")   # what --impls may name here
SWEEP = config.setting("sweep", "bool", "Also time a few Pallas launch configs per format.")


def define_flags() -> None:
  """The entry point's flags, defined only when run as a script: experiments.bench_kernels
  imports this module and has flags of the same names."""
  from rec import configs
  config.define_flags(
      None, rec_settings.ROWS.narrowed(lower=1), rec_settings.DIM, settings.BATCH, FEATURES,
      BAG_LEN, DTYPES, settings.IMPLS, rec_settings.ZIPF_ALPHA, settings.REPEATS, SWEEP,
      configs.CACHE_FRACTION, settings.WORKDIR,
      rows=1_000_000, dim=128, batch=8192, features=26, bag_len=20,
      dtypes=list(eb_bench.FORMATS), impls=list(IMPL_NAMES), zipf_alpha=0.0,
      repeats=20, sweep=False, cache_fraction=None, workdir="runs/bench_kernels_embedding")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark
  from core import results as results_lib
  for flag, known in (("dtypes", eb_bench.FORMATS), ("impls", IMPL_NAMES)):
    values = FLAGS[flag].value
    unknown = [v for v in values if v not in known]
    if not values or unknown:
      raise errors.expected(f"--{flag}={','.join(values)}",
                            f"unknown {unknown}" if unknown else "nothing to time",
                            f"some of {list(known)}")
  report = Report(FLAGS.workdir)
  try:
    out = eb_bench.bench_embedding_bag(
        FLAGS.rows, FLAGS.dim, FLAGS.batch, FLAGS.features, FLAGS.bag_len, tuple(FLAGS.dtypes),
        tuple(FLAGS.impls), FLAGS.zipf_alpha or None, FLAGS.repeats, FLAGS.sweep,
        cache_fraction=FLAGS.cache_fraction)
  except RuntimeError as e:
    print(str(e), file=sys.stderr)
    results_lib.print_summary({"refused": str(e)})
    sys.exit(2)
  report.table(eb_bench.format_table(out))
  report.finish({**out, "machine": benchmark.machine()}, eb_bench.summary(out))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
