r"""QSNR of every number format in core/quant on N(0, 1) data, and QSNR against block size
(the measure of arXiv 2302.08007; OCP MX v1.0 formats, the paper's BDR MX9 / MX6 / MX4,
bf16, FP8 and FBGEMM row-wise).

  python -m experiments.mx_qsnr                      # 4,194,304 samples, runs/mx_qsnr
  python -m experiments.mx_qsnr --samples=1048576 --block_sizes=16,32,64

QSNR = -10 log10(mean((Q(x) - x)^2) / mean(x^2)), x = numpy PCG64 standard_normal float32
(--seed), blocks along rows of 4096. Prints the table (with the issue's numbers beside
ours), the block-size sweep, writes results.json and qsnr.png to --workdir; the last
stdout line is JSON.

Measured (2-core CPU shared with other jobs, jax 0.11.2, 2026-11-24, defaults: 134 s wall
including compiles, 16 s of user CPU time):

  format                   bits/value   QSNR dB  issue dB    diff
  mxint8                        8.250    41.665     41.66  +0.005
  mxfp8_e4m3                    8.250    30.641     30.65  -0.009
  mxfp8_e5m2                    8.250    25.360     25.36  +0.000
  mxfp6_e2m3                    6.250    30.935     30.94  -0.005
  mxfp6_e3m2                    6.250    25.360     25.36  +0.000
  mxfp4                         4.250    18.791     18.79  +0.001
  mxint4                        4.250    17.556     17.56  -0.004
  mx9                           9.000    46.522
  mx6                           6.000    28.295
  mx4                           4.000    15.709
  bf16                         16.000    55.594     55.59  +0.004
  bf16_stochastic              16.000    52.577
  fp8_e4m3_tensor               8.000    31.545
  fp8_e5m2_tensor               8.000    25.568
  fp8_e4m3_row                  8.008    31.543
  fp8_e5m2_row                  8.008    25.565
  rowwise_int8_d64              9.000    45.555
  rowwise_int4_d64              4.500    20.944
  rowwise_int2_d64              2.500     6.931

Every number of the issue is matched within 0.01 dB, which is the sampling noise of a
4M-sample QSNR (another draw of the samples, numpy's float64 normals cast to float32,
gives 41.662 / 30.651 / 25.357 / 30.942 / 25.357 / 18.789 / 17.557 / 55.589);
ties="even" and microxcaling's ties="away" agree to 3 decimals on this data. The paper
gives no QSNR table for MX9 / MX6 / MX4 to compare with: MX9 has one more magnitude bit
than MXINT8 and a micro-exponent per pair (+4.9 dB for 0.75 more bits per value); MX6
(6.0 bits) lies between MXFP6 E3M2 and E2M3 (6.25 bits); MX4 (4.0 bits) is 3.1 dB below
MXFP4 (4.25 bits). Stochastic rounding costs bf16 3 dB (its error variance is twice
nearest rounding's), the price of being unbiased.

Block-size sweep (QSNR dB; BDR keeps its pairs of micro-exponents; bits per value fall
with the block as 8 / block for MX, 8 / block + 1/2 for BDR):

  format / block       8      16      32      64     128     256    1024
  mxint8           44.11   42.78   41.66   41.01   40.80   40.68   40.11
  mxfp8_e4m3       29.31   29.91   30.64   31.23   31.40   31.41   31.42
  mxfp6_e2m3       31.04   30.99   30.93   30.89   30.86   30.83   30.66
  mxfp4            18.38   18.58   18.79   18.94   18.96   18.94   18.76
  mxint4           19.89   18.63   17.56   16.92   16.72   16.60   16.02
  mx9              46.88   46.52   46.15   45.89   45.79   45.71   45.29
  mx6              28.62   28.29   27.95   27.71   27.62   27.54   27.13
  mx4              15.95   15.71   15.44   15.26   15.18   15.11   14.75

Integer elements lose QSNR as blocks grow (the block maximum sets a fixed step for all);
MXFP8 E4M3 gains: a block's maximum lands in [256, 512) of the scaled grid and, past 464,
saturates at 448, an error that larger blocks share among more values.
"""

from __future__ import annotations

import os
import time

from absl import flags

from core import cli
from core import config
from core import results as results_lib
from core import settings  # noqa: F401  (the shared settings by name)
from core.quant import qsnr

FLAGS = flags.FLAGS

SWEEP_FORMATS = ("mxint8", "mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "mxint4", "mx9", "mx6", "mx4")


SAMPLES = config.setting(
    "samples", "integer", "N(0, 1) samples (a multiple of 4096).", lower=1)
SWEEP_FORMATS_SETTING = config.setting(
    "sweep_formats", "list", "Formats of the block-size sweep.")
BLOCK_SIZES = config.setting(
    "block_sizes", "list", "Block sizes of the sweep (powers of two up to 4096).")


def define_flags() -> None:
  config.define_flags(
      None, "workdir", SAMPLES, "seed", "formats", SWEEP_FORMATS_SETTING, BLOCK_SIZES,
      workdir="runs/mx_qsnr", samples=4_194_304, seed=0, formats=[],
      sweep_formats=list(SWEEP_FORMATS),
      block_sizes=["8", "16", "32", "64", "128", "256", "1024"])


def _settings() -> list[int]:
  """--samples, --formats, --sweep_formats and --block_sizes checked (the block sizes as
  ints): refused before any sample is drawn or quantized, each error naming its flag."""
  from core import errors
  from core.quant import mx
  if FLAGS.samples % qsnr.ROW:
    raise errors.expected(f"--samples={FLAGS.samples}", "not a multiple of the row",
                          f"a positive multiple of {qsnr.ROW}")
  bad = [f for f in FLAGS.formats if f not in qsnr.QUANTIZERS]
  if bad:
    raise errors.expected(f"--formats={','.join(FLAGS.formats)}", f"unknown {bad}",
                          f"some of {','.join(sorted(qsnr.QUANTIZERS))}")
  known = sorted(mx.MX_FORMATS) + sorted(mx.BDR_FORMATS)
  bad = [f for f in FLAGS.sweep_formats if f not in known]
  if bad:
    raise errors.expected(f"--sweep_formats={','.join(FLAGS.sweep_formats)}",
                          f"unknown {bad}", f"MX or BDR formats, some of {','.join(known)}")
  try:
    blocks = [int(b) for b in FLAGS.block_sizes]
  except ValueError:
    blocks = []
  if not blocks or any(b < 1 or qsnr.ROW % b for b in blocks):
    raise errors.expected(f"--block_sizes={','.join(FLAGS.block_sizes)}",
                          "not block sizes of the row",
                          f"integers dividing {qsnr.ROW} (powers of two up to {qsnr.ROW})")
  # A BDR block holds whole pairs (one micro-exponent each); the sweep would leave out a
  # BDR format's row at any other size.
  bdr = [f for f in FLAGS.sweep_formats if f in mx.BDR_FORMATS]
  odd = [b for b in blocks if b % mx.BDR_SUB_BLOCK]
  if bdr and odd:
    raise errors.expected(f"--block_sizes={','.join(FLAGS.block_sizes)}",
                          f"{odd} not whole pairs of the BDR formats {bdr} of --sweep_formats",
                          f"multiples of {mx.BDR_SUB_BLOCK} (or no BDR format in the sweep)")
  return blocks


def main(argv) -> None:
  del argv
  t0 = time.perf_counter()
  blocks = _settings()
  x = qsnr.gaussian_samples(FLAGS.samples, FLAGS.seed)
  say = lambda s: print(f"  {s}", flush=True)
  print(f"QSNR on {x.size:,} N(0, 1) samples (seed {FLAGS.seed})", flush=True)
  table = qsnr.qsnr_table(x, FLAGS.formats or None, progress=say)
  print("block-size sweep", flush=True)
  sweep = qsnr.block_sweep(x, FLAGS.sweep_formats, blocks, progress=say)
  print()
  print(qsnr.format_table(table))
  print()
  print(qsnr.format_sweep(sweep))
  os.makedirs(FLAGS.workdir, exist_ok=True)
  png = qsnr.plot(table, sweep, os.path.join(FLAGS.workdir, "qsnr.png"))
  wall = time.perf_counter() - t0
  out = {"samples": int(x.size), "seed": FLAGS.seed, "table": table, "sweep": sweep,
         "plot": png, "wall_seconds": wall}
  results_lib.write_results(FLAGS.workdir, out)
  diffs = [abs(r["diff_db"]) for r in table if "diff_db" in r]
  summary = {"qsnr_db": {r["format"]: round(r["qsnr_db"], 3) for r in table},
             "max_abs_diff_vs_issue_db": round(max(diffs), 4) if diffs else None,
             "wall_seconds": round(wall, 1)}
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
