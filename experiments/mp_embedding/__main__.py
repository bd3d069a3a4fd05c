r"""Mixed-precision embedding tables with an fp32 cache of the hot rows (arXiv 2010.11305):
memory and quality against fp32 tables.

  python -m experiments.mp_embedding                                  # synthetic Zipf data
  python -m experiments.mp_embedding --data=criteo:../shared/data/criteo_kaggle_sample \
      --epochs=1 --batch_size=128 --eval_batch_size=1024 --workdir=runs/mp_embedding_criteo
  python -m experiments.mp_embedding --formats=fp32,bf16_sr,int8,int8_cache:lfu:0.05

Each format of `--formats` (the first is the reference; `int8_cache:lfu:0.05` = FBGEMM
row-wise int8 rows, stochastic rounding, an LFU fp32 cache of 5% of each device's rows)
trains the same DLRM on the same batches from the same seeds. Prints per format the test
AUC and log loss, their change against the reference (mean ± std over seeds, paired by
seed), the memory of the tables counted from the arrays of the trained state (values,
scales and biases, cache rows, cache tags, LFU / LRU counters; the sparse optimizer's
state apart) and the share of eval lookups the cache served; then the same memory count for
one table at embedding dims 16-128 (`--memory_dims`). Writes `<workdir>/results.json` and
`<workdir>/mp_embedding.png` (quality change against memory reduction); the last stdout
line is a JSON summary.

The paper reports 3x less memory at int8 + 5% cache "while maintaining accuracy" (DLRM,
Criteo Kaggle) and > 7x at int4 + 1% (industrial model). Counted honestly, the reduction
depends on the dim: an int8 row costs D + 8 bytes (fp32 scale and bias), int4 D / 2 + 4
(fp16 scale and bias), the cache 4 D + 4 per cached row (+ 4 for LRU's time), LFU 4 bytes of
count for every row. At D = 16 (these runs) int8 + 5% is 2.04x (LFU) / 2.32x (LRU); 3x
needs D = 128 with LFU (3.09x; 2.88x at 64) or D = 64 with LRU (3.00x).

Measured 2026-11-24 on the 2-core CPU (shared, load ~13; jax 0.11.2), DLRM kaggle preset at
dim 16, 26 tables of 100,000 hashed rows, row-wise Adagrad 0.05 (tables in BENCHMARKS.md):
  python -m experiments.mp_embedding --seeds=0,1 --steps=300 \
      --workdir=runs/mp_embedding_synthetic                                 # 22.8 min
    format               AUC     dAUC     logloss  dlogloss table MiB  vs fp32  hit rate
    fp32                 0.7485           0.4873             158.69    1.00x
    int8_cache:lfu:0.05  0.7483  -0.0002  0.4869   -0.0005    77.86    2.04x    79.5%
    int8_cache:lru:0.05  0.7482  -0.0003  0.4873   -0.0001    68.44    2.32x    73.1%
    int4_cache:lfu:0.01  0.7491  +0.0006  0.4866   -0.0007    41.36    3.84x    68.4%
    int4_cache:lru:0.01  0.7482  -0.0003  0.4872   -0.0001    31.54    5.03x    58.4%
  python -m experiments.mp_embedding --data=criteo:../shared/data/criteo_kaggle_sample \
      --epochs=1 --batch_size=128 --eval_batch_size=1024 --seeds=0,1,2 \
      --workdir=runs/mp_embedding_criteo                                    # 12.7 min
    fp32                 0.7183           0.4846
    int8_cache:lfu:0.05  0.7185  +0.0002  0.4844   -0.0002    (2.04x, hit rate 87.4%)
    int8_cache:lru:0.05  0.7185  +0.0002  0.4844   -0.0002    (2.32x, 87.4%)
    int4_cache:lfu:0.01  0.7183  -0.0001  0.4838   -0.0008    (3.84x, 85.9%)
    int4_cache:lru:0.01  0.7095  -0.0088  0.4845   -0.0000    (5.03x, 85.5%; 800 eval rows)
  ... the same with --num_rows=10000 and uncached int8 / int4 (7.9 min; BENCHMARKS.md):
    dAUC int8 -0.0026, int4 -0.0071, int8 + 5% LFU -0.0008 / LRU -0.0006 (hit rate 85 / 83%),
    int4 + 1% LFU +0.0000 / LRU -0.0031 (75 / 67%).
Seed-to-seed spreads of dAUC are 0.001-0.002 (synthetic) and 0.001-0.016 (Criteo): the
accuracy is maintained, the memory is 2-2.3x at int8 + 5% and 3.8-5x at int4 + 1%.
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from experiments.common.report import Report

FLAGS = flags.FLAGS


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (`flag_values`: where,
  default absl's FLAGS); every setting but --workdir may come from a --config file
  (configs/ beside this file)."""
  from core import settings  # noqa: F401  (the settings named below)
  from experiments.mp_embedding import study
  from rec import configs
  from rec import settings as rec_settings  # noqa: F401
  configs.define_run_flags("data", "model", "preset", "embedding_dim", "eval_batches",
      "num_rows", "learning_rate", "embedding_learning_rate", "sharding", "mesh",
      flag_values=flag_values, batch_size=1024, eval_batch_size=4096)
  config.define_flags(
      None, "formats", "seeds", "data_seed", "steps", "epochs", "memory_dims", "log_every",
      in_config=True, flag_values=flag_values, formats=list(study.DEFAULT_FORMATS),
      seeds=["0"], data_seed=0, steps=300, memory_dims=["16", "32", "64", "128"],
      log_every=100)
  config.define_flags(None, "workdir", flag_values=flag_values, workdir="runs/mp_embedding")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from experiments.mp_embedding import study
  from rec import configs

  base = configs.run_from_flags(seed=FLAGS.data_seed)
  formats = study.parse_formats(FLAGS.formats)
  results = study.compare_formats(
      base, formats, seeds=[int(s) for s in FLAGS.seeds],
      steps=None if FLAGS.epochs else FLAGS.steps, epochs=FLAGS.epochs, workdir=FLAGS.workdir,
      log_every=FLAGS.log_every)
  by_dim = study.memory_by_dim(formats, [int(d) for d in FLAGS.memory_dims])
  table = study.format_table(results)
  memory = study.format_memory(results)
  dims = sorted({r["dim"] for r in by_dim})
  dim_lines = [f"{'format':24} " + " ".join(f"{'D=' + str(d):>14}" for d in dims)]
  for spec in map(str, formats):
    cells = {r["dim"]: r for r in by_dim if r["format"] == spec}
    dim_lines.append(f"{spec:24} " + " ".join(
        f"{cells[d]['bytes_per_row']:7.1f}B {cells[d]['reduction']:4.2f}x" for d in dims))
  print("\n" + table + "\n\ntable memory by component (MiB)\n" + memory
        + "\n\nbytes per row and reduction vs fp32 rows, one table of 100,000 rows\n"
        + "\n".join(dim_lines), flush=True)
  results.update(table=table.splitlines(), memory_table=memory.splitlines(),
                 memory_by_dim=by_dim)
  summary = {"data": base.data.data, "steps": results["rows"][0]["steps"],
             "seeds": results["seeds"],
             "rows": {r["format"]: {"auc": round(r["auc_mean"], 4),
                                    "d_auc": round(r["auc_delta_mean"], 4),
                                    "logloss": round(r["logloss_mean"], 4),
                                    "d_logloss": round(r["logloss_delta_mean"], 4),
                                    "memory_x": round(r["memory_vs_reference"], 2),
                                    "hit_rate": None if r["cache_hit_rate_mean"] is None
                                    else round(r["cache_hit_rate_mean"], 3)}
                      for r in results["rows"]},
             "wall_seconds": round(results["wall_seconds"], 1)}
  results["summary"] = summary
  report = Report(FLAGS.workdir)
  report.finish(results, summary, plots=[(study.plot, (results,), "mp_embedding.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
