"""experiments.benchmarks.embedding_bag's mixed-precision rows (int4, int8 / int4 with an fp32
cache) at toy sizes on CPU, the GPU check bypassed: every implementation runs and the
cached formats report their hit rate (the numbers themselves need a GPU)."""

from __future__ import annotations

import os

import pytest

from experiments.benchmarks import embedding_bag as bk
from tests.experiments.entry import run_refused


@pytest.mark.slow   # ~1-2 min: the Pallas kernel in its interpreter, several compiles
def test_mixed_precision_formats_run():
  out = bk.bench_embedding_bag(gpu_only=False, num_rows=64, dim=16, batch=8, features=2, bag_len=3,
                               dtypes=("int4", "int4_cache"), impls=("pallas", "xla"),
                               repeats=1, zipf_alpha=1.2, cache_fraction=0.25)
  rows = {(r["dtype"], r["impl"]): r for r in out["results"]}
  assert set(rows) == {("int4", "pallas"), ("int4", "xla"), ("int4_cache", "pallas"),
                       ("int4_cache", "pallas_kernel"), ("int4_cache", "xla")}
  assert not [r for r in rows.values() if "error" in r]
  assert 0 < rows[("int4_cache", "xla")]["hit_rate"] <= 1
  # int4 rows are charged D / 2 + 4 bytes, cached ones 4 D: a full hit rate moves more.
  assert rows[("int4", "xla")]["bytes"] < rows[("int4_cache", "xla")]["bytes"]


def test_unknown_impl_refused_before_measuring(tmp_path):
  """An --impls name the benchmark does not know (else nothing is timed for it, silently)
  is one line naming it, before the GPU check and before the workdir is written."""
  out = run_refused("experiments.bench_kernels_embedding",
                    ["--impls=pallas,palas", f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --impls=pallas,palas: unknown ['palas']; expected some of ['pallas', 'xla', "
      "'triton']")
  assert os.listdir(tmp_path) == []
