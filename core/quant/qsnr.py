"""Quantization signal-to-noise ratio of the number formats (the measure of arXiv 2302.08007,
section 5): QSNR = -10 log10(mean((Q(x) - x)^2) / mean(x^2)) in dB, on N(0, 1) samples.

The library behind `experiments.mx_qsnr`; a notebook can call it directly:

    x = gaussian_samples(1 << 22, seed=0)
    rows = qsnr_table(x)                       # every format in QUANTIZERS
    sweep = block_sweep(x, ("mxint8", "mx6"), (8, 16, 32, 64))

Samples are laid out [rows, 4096] so every block size up to 4096 that is a power of two
tiles a row exactly (no padding); blocks run along the last axis.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from core.quant import floats, mx, rowwise

ROW = 4096
EMBEDDING_DIM = 64    # row length of the FBGEMM row-wise formats (an embedding row)


@dataclasses.dataclass(frozen=True)
class Quantizer:
  """One format: x [..., 4096] float32 -> its quantized values, and its storage cost."""

  name: str
  fn: Callable[[jax.Array], jax.Array]
  bits_per_value: float
  family: str            # "ocp_mx" | "bdr" | "float" | "fp8" | "rowwise"


def _mx(fmt: str, block: int = mx.MX_BLOCK) -> Quantizer:
  bits = mx.MX_FORMATS[fmt].bits + 8 / block
  return Quantizer(fmt, lambda x: mx.mx_round(x, fmt, block), bits, "ocp_mx")


def _bdr(fmt: str, block: int = mx.BDR_BLOCK) -> Quantizer:
  bits = 1 + mx.BDR_FORMATS[fmt] + (8 + block // mx.BDR_SUB_BLOCK) / block
  return Quantizer(fmt, lambda x: mx.bdr_round(x, fmt, block), bits, "bdr")


def _fp8(fmt: str, granularity: str) -> Quantizer:
  def fn(x):
    return floats.dequantize_fp8(floats.quantize_fp8(x, fmt, granularity))
  extra = 32 / ROW if granularity == "row" else 0.0     # one float32 scale_inv per row
  return Quantizer(f"fp8_{fmt}_{granularity}", fn, 8 + extra, "fp8")


def _rowwise(bits: int) -> Quantizer:
  def fn(x):
    rows = x.reshape(-1, EMBEDDING_DIM)
    qr = rowwise.quantize_rowwise(rows, bits)
    return rowwise.dequantize_rowwise(qr).reshape(x.shape)
  sb = 64 if bits == 8 else 32                          # float32 / float16 scale and bias
  return Quantizer(f"rowwise_int{bits}_d{EMBEDDING_DIM}", fn, bits + sb / EMBEDDING_DIM,
                   "rowwise")


def _bf16_sr(x):
  key = jax.random.key(0)
  return floats.stochastic_round_bf16(x, key).astype(jnp.float32)


QUANTIZERS: dict[str, Quantizer] = {q.name: q for q in [
    _mx("mxint8"), _mx("mxfp8_e4m3"), _mx("mxfp8_e5m2"), _mx("mxfp6_e2m3"), _mx("mxfp6_e3m2"),
    _mx("mxfp4"), _mx("mxint4"),
    _bdr("mx9"), _bdr("mx6"), _bdr("mx4"),
    Quantizer("bf16", lambda x: floats.to_bf16(x).astype(jnp.float32), 16, "float"),
    Quantizer("bf16_stochastic", _bf16_sr, 16, "float"),
    _fp8("e4m3", "tensor"), _fp8("e5m2", "tensor"), _fp8("e4m3", "row"), _fp8("e5m2", "row"),
    _rowwise(8), _rowwise(4), _rowwise(2),
]}

# QSNR (dB) on 4,194,304 N(0, 1) samples from an independent implementation verified
# against microxcaling's test vectors (issue 14 of this project).
ISSUE_QSNR_DB = {"mxint8": 41.66, "mxfp8_e4m3": 30.65, "mxfp8_e5m2": 25.36,
                 "mxfp6_e2m3": 30.94, "mxfp6_e3m2": 25.36, "mxfp4": 18.79, "mxint4": 17.56,
                 "bf16": 55.59}


def gaussian_samples(n: int, seed: int = 0) -> np.ndarray:
  """n float32 N(0, 1) samples (numpy's PCG64, `standard_normal`) laid out [n / 4096, 4096]."""
  if n < ROW or n % ROW:
    raise ValueError(f"gaussian_samples: n={n}, expected a positive multiple of {ROW}")
  return np.random.default_rng(seed).standard_normal(n, np.float32).reshape(-1, ROW)


def qsnr_db(x: np.ndarray, xq: np.ndarray) -> float:
  """-10 log10(sum((xq - x)^2) / sum(x^2)), summed in float64; inf when xq == x."""
  x = np.asarray(x, np.float64)
  err = float(np.sum((np.asarray(xq, np.float64) - x) ** 2))
  sig = float(np.sum(x ** 2))
  return float("inf") if err == 0 else -10.0 * np.log10(err / sig)


def qsnr_table(x: np.ndarray, names: Sequence[str] | None = None,
               progress: Callable[[str], None] | None = None) -> list[dict]:
  """One row per format: name, family, bits_per_value, qsnr_db and, where the issue gives
  one, issue_db and diff_db (ours minus the issue's)."""
  rows = []
  xj = jnp.asarray(x)
  for name in names or QUANTIZERS:
    if name not in QUANTIZERS:
      raise ValueError(f"qsnr_table: format {name!r}, expected one of {sorted(QUANTIZERS)}")
    q = QUANTIZERS[name]
    db = qsnr_db(x, jax.device_get(jax.jit(q.fn)(xj)))
    row = {"format": name, "family": q.family, "bits_per_value": q.bits_per_value,
           "qsnr_db": db}
    if name in ISSUE_QSNR_DB:
      row["issue_db"] = ISSUE_QSNR_DB[name]
      row["diff_db"] = db - ISSUE_QSNR_DB[name]
    rows.append(row)
    if progress:
      progress(f"{name}: {db:.3f} dB")
  return rows


def block_sweep(x: np.ndarray, formats: Sequence[str], block_sizes: Sequence[int],
                progress: Callable[[str], None] | None = None) -> list[dict]:
  """QSNR of OCP MX formats (one E8M0 scale per block) and BDR formats (8-bit shared
  exponent per block, a micro-exponent per pair) at each block size: rows of format,
  block_size, bits_per_value, qsnr_db."""
  rows = []
  xj = jnp.asarray(x)
  for name in formats:
    for block in block_sizes:
      if ROW % block:
        raise ValueError(f"block_sweep: block size {block} does not divide the row of {ROW}")
      if name in mx.MX_FORMATS:
        q = _mx(name, block)
      elif name in mx.BDR_FORMATS:
        if block % mx.BDR_SUB_BLOCK:
          continue
        q = _bdr(name, block)
      else:
        raise ValueError(f"block_sweep: format {name!r}, expected an MX or BDR format "
                         f"({sorted(mx.MX_FORMATS) + sorted(mx.BDR_FORMATS)})")
      db = qsnr_db(x, jax.device_get(jax.jit(q.fn)(xj)))
      rows.append({"format": name, "block_size": block, "bits_per_value": q.bits_per_value,
                   "qsnr_db": db})
      if progress:
        progress(f"{name} block {block}: {db:.3f} dB")
  return rows


def format_table(rows: Sequence[dict]) -> str:
  lines = [f"{'format':<24} {'bits/value':>10} {'QSNR dB':>9} {'issue dB':>9} {'diff':>7}"]
  for r in rows:
    issue = f"{r['issue_db']:9.2f}" if "issue_db" in r else f"{'':>9}"
    diff = f"{r['diff_db']:+7.3f}" if "diff_db" in r else f"{'':>7}"
    lines.append(f"{r['format']:<24} {r['bits_per_value']:10.3f} {r['qsnr_db']:9.3f} "
                 f"{issue} {diff}")
  return "\n".join(lines)


def format_sweep(rows: Sequence[dict]) -> str:
  sizes = sorted({r["block_size"] for r in rows})
  names = list(dict.fromkeys(r["format"] for r in rows))
  by = {(r["format"], r["block_size"]): r["qsnr_db"] for r in rows}
  lines = [f"{'format / block':<14}" + "".join(f"{s:>8}" for s in sizes)]
  for n in names:
    cells = "".join(f"{by[(n, s)]:8.2f}" if (n, s) in by else f"{'-':>8}" for s in sizes)
    lines.append(f"{n:<14}{cells}")
  return "\n".join(lines)


def plot(table: Sequence[dict], sweep: Sequence[dict], path: str) -> str:
  """Two panels: QSNR against bits per value (every format), QSNR against block size."""
  from core import plot as plot_lib
  with plot_lib.figure(path, 1, 2, figsize=(12, 4.6)) as (fig, (a, b)):
    marks = {"ocp_mx": "o", "bdr": "s", "float": "^", "fp8": "D", "rowwise": "v"}
    for fam, m in marks.items():
      rows = [r for r in table if r["family"] == fam]
      a.scatter([r["bits_per_value"] for r in rows], [r["qsnr_db"] for r in rows], marker=m,
                label=fam)
      for r in rows:
        a.annotate(r["format"], (r["bits_per_value"], r["qsnr_db"]), fontsize=7,
                   xytext=(3, 2), textcoords="offset points")
    a.set(xlabel="bits per value (elements + shared scales)", ylabel="QSNR (dB)",
          title="QSNR on N(0, 1)")
    a.legend(fontsize=8)
    for name in dict.fromkeys(r["format"] for r in sweep):
      pts = [(r["block_size"], r["qsnr_db"]) for r in sweep if r["format"] == name]
      b.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name, lw=1.2, ms=3)
    b.set_xscale("log", base=2)
    b.set(xlabel="block size", ylabel="QSNR (dB)", title="QSNR against block size")
    b.legend(fontsize=7, ncol=2)
    for ax in (a, b):
      ax.grid(alpha=0.3)
  return path
