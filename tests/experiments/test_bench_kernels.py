"""experiments.bench_kernels' flash-attention table (its measuring in
experiments.benchmarks.attention): failures reported per implementation, ratios to cuDNN,
and the Mosaic GPU targets, run on CPU at toy sizes (numbers need a GPU)."""

from __future__ import annotations

import os
import types

import pytest
from absl import app

from experiments import bench_kernels as bk
from experiments.benchmarks import attention
from tests.experiments.entry import run_refused


def _cfg(**kw):
  base = dict(dtype="bfloat16", impls=["mgpu", "cudnn", "xla"], mgpu_configs=["64x128x2"],
              heads=2, kv_heads=0, head_dims=["64"], seq_lens=["128"], tokens=128,
              causal=["true"], block_q=64, block_k=64, steps=1, repeats=1)
  base.update(kw)
  return types.SimpleNamespace(**base)


def test_failed_impls_are_reported_and_the_rest_runs(capsys):
  """On CPU the Mosaic GPU kernel cannot compile and cuDNN is absent: both rows carry their
  error, XLA still gets timed, and the table and summary say so."""
  rows = attention.bench_flash_attention(_cfg())
  by_impl = {r["impl"]: r for r in rows}
  assert set(by_impl) == {"mgpu", "cudnn", "xla"}
  assert "error" in by_impl["mgpu"] and "error" in by_impl["cudnn"]
  assert by_impl["xla"]["fwd_tflops"] > 0 and by_impl["xla"]["bwd_tflops"] > 0
  bk.table_flash_attention(rows)
  printed = capsys.readouterr().out
  assert "failed:" in printed and "unmeasured" in printed
  summary = bk.summary_flash_attention(rows)
  assert "error" in summary["mgpu/T128/causal/hd64"]
  assert summary["mgpu_targets"]["T128/causal/hd64"] == {"fwd": "unmeasured",
                                                          "bwd": "unmeasured"}


def _row(impl, fwd, bwd, causal=True, t=4096, kd=128):
  return {"impl": impl, "seq_len": t, "causal": causal, "head_dim": kd,
          "fwd_tflops": fwd, "bwd_tflops": bwd}


def test_ratios_and_targets():
  rows = [_row("cudnn", 600.0, 500.0), _row("mgpu[64x128x2]", 500.0, 420.0),
          _row("mgpu[64x64x3]", 560.0, 380.0), _row("triton", 400.0, 300.0),
          _row("cudnn", 600.0, 500.0, causal=False), _row("mgpu", 300.0, 450.0, causal=False),
          _row("mgpu", 1.0, 1.0, t=8192)]                      # no cuDNN number at 8K
  attention.add_cudnn_ratios(rows)
  assert rows[1]["fwd_vs_cudnn"] == pytest.approx(500 / 600)
  assert rows[3]["bwd_vs_cudnn"] == pytest.approx(300 / 500)
  assert "fwd_vs_cudnn" not in rows[-1]
  targets = attention.mgpu_targets(rows)
  causal = targets["T4096/causal/hd128"]
  assert causal["fwd"] == {"ratio": round(560 / 600, 3), "target": 0.9, "status": "met",
                           "impl": "mgpu[64x64x3]"}
  assert causal["bwd"] == {"ratio": round(420 / 500, 3), "target": 0.8, "status": "met",
                           "impl": "mgpu[64x128x2]"}
  full = targets["T4096/full/hd128"]
  assert full["fwd"]["status"] == "missed" and full["bwd"]["status"] == "met"
  assert targets["T8192/causal/hd128"]["fwd"]["status"] == "unmeasured"


def test_mgpu_config_flag():
  parse = attention.parse_mgpu_config
  assert parse("64x128x2") == {"block_q": 64, "block_kv": 128, "stages": 2}
  assert parse("64x64x3:split") == {"block_q": 64, "block_kv": 64, "stages": 3,
                                    "bwd": "split"}
  assert attention.impl_label("mgpu", parse("64x64x3:split"), 2) == "mgpu[64x64x3:split]"
  with pytest.raises(app.UsageError, match="BLOCK_QxBLOCK_KVxSTAGES"):
    attention.parse_mgpu_config("64x128")
  with pytest.raises(app.UsageError, match="split or fused"):
    attention.parse_mgpu_config("64x128x2:both")
  with pytest.raises(app.UsageError, match="split or fused"):   # a ':' with nothing after
    attention.parse_mgpu_config("64x128x2:")
  for zero in ("0x128x2", "64x0x2", "64x128x0"):
    with pytest.raises(app.UsageError, match="of positive integers"):
      attention.parse_mgpu_config(zero)
  with pytest.raises(app.UsageError, match="--impls"):
    attention.bench_flash_attention(_cfg(impls=["flash"]))


@pytest.mark.parametrize("args,line", [
    (["--impls=flash"], "error: --impls=flash: unknown ['flash']; expected some of ['mgpu', "
     "'triton', 'pallas', 'cudnn', 'xla']"),
    (["--kernels="], "error: --kernels=: no kernel family; expected some of ['embedding_bag', "
     "'flash_attention']"),
    (["--causal=maybe"], "flag --causal=['maybe']: 'maybe': not true or false; expected true "
     "or false"),
])
def test_bad_lists_refused_before_anything_runs(tmp_path, args, line):
  """One line naming the flag, before the GPU check and before the workdir is written: not
  --causal=maybe run as not causal, an unknown --impls failing only when its family runs
  (after the families before it), or an empty list timing nothing."""
  out = run_refused("experiments.bench_kernels", args + [f"--workdir={tmp_path}"])
  assert any(l.endswith(line) for l in out.stderr.strip().splitlines()), out.stderr[-2000:]
  assert os.listdir(tmp_path) == []
