"""rec.throughput: the three rates of a tiny run, and the generated binary directory."""

import numpy as np

from rec import configs, throughput
from rec.data import criteo_bin


def test_generated_bin_dir_is_reused_and_measured(tmp_path):
  d = throughput.synthetic_bin_dir(str(tmp_path / "gen"), 4096, 50)
  m = criteo_bin.load_manifest(d)
  assert m["splits"]["train"]["rows"] == 4096 and m["rows_per_feature"] == [50] * 26
  t = (tmp_path / "gen" / "manifest.json").stat().st_mtime_ns
  throughput.synthetic_bin_dir(d, 4096, 50)                  # same settings: kept as is
  assert (tmp_path / "gen" / "manifest.json").stat().st_mtime_ns == t
  cfg = configs.make_run(model="dlrm", preset="small", data=f"criteo_bin:{d}", mesh="-1",
                             batch_size=256, eval_batch_size=256)
  task, src, _, _, _ = configs.build_run(cfg)
  b = src.batch(0)
  assert b.ids.shape == (256, 26, 1) and np.all(b.ids < 50)
  out = throughput.measure(task, src, steps=6, repeats=2, source_batches=3,
                           profile_dir=str(tmp_path / "prof"))
  prof = out.pop("profile")    # one more loop run, traced: the device's ops during it
  assert prof["kernels"] > 0 and 0 < prof["busy_ms"] <= prof["span_ms"] + 1e-6
  assert set(out) == {"source_examples_per_sec", "step_examples_per_sec",
                      "end_to_end_examples_per_sec", "end_to_end_over_step"}
  assert all(v > 0 for v in out.values())
