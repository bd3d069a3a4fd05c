"""core/quant/qsnr.py: the QSNR measure by hand, the issue's numbers on fewer samples, the
block sweep's bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from core.quant import qsnr


def test_qsnr_db_by_hand():
  x = np.float32([3.0, 4.0])                       # sum x^2 = 25
  assert qsnr.qsnr_db(x, np.float32([3.0, 4.5])) == pytest.approx(-10 * np.log10(0.25 / 25))
  assert qsnr.qsnr_db(x, x) == float("inf")


def test_table_matches_the_issue_on_fewer_samples():
  """65,536 samples: the sampling error of QSNR is ~0.03 dB, so 0.1 dB is a real check."""
  x = qsnr.gaussian_samples(16 * qsnr.ROW, seed=1)
  names = list(qsnr.ISSUE_QSNR_DB) + ["mx9"]
  rows = qsnr.qsnr_table(x, names)
  assert [r["format"] for r in rows] == names
  for r in rows[:-1]:
    assert abs(r["diff_db"]) < 0.1, r
  assert rows[-1]["bits_per_value"] == 9.0 and rows[-1]["qsnr_db"] > rows[0]["qsnr_db"] + 3
  assert "mxint8" in qsnr.format_table(rows)


def test_block_sweep_rows():
  x = qsnr.gaussian_samples(qsnr.ROW, seed=2)
  rows = qsnr.block_sweep(x, ["mxint8", "mx6"], [8, 64])
  assert [(r["format"], r["block_size"]) for r in rows] == [
      ("mxint8", 8), ("mxint8", 64), ("mx6", 8), ("mx6", 64)]
  assert rows[0]["bits_per_value"] == 8 + 1 and rows[3]["bits_per_value"] == 5 + (8 + 32) / 64
  assert rows[0]["qsnr_db"] > rows[1]["qsnr_db"]           # smaller blocks, finer scales
  with pytest.raises(ValueError, match="does not divide"):
    qsnr.block_sweep(x, ["mxint8"], [48])
  with pytest.raises(ValueError, match="format 'bf16', expected an MX or BDR format"):
    qsnr.block_sweep(x, ["bf16"], [32])
  with pytest.raises(ValueError, match="multiple of 4096"):
    qsnr.gaussian_samples(100)
