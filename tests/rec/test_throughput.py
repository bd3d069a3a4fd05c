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


def test_generated_ids_follow_the_bounded_zipf_law(tmp_path):
  """Every row of a table drawn with its bounded Zipf share (exponent 1.2 over 50 rows, the
  shares sorted since the hot ranks are scattered): no row holds the law's tail (clipping
  numpy's unbounded zipf at the last row gives that row 41% of the ids and row 0 none); a
  directory of another seed is written again, not reused."""
  d = throughput.synthetic_bin_dir(str(tmp_path / "gen"), 4096, 50)
  src = criteo_bin.CriteoBinSource(d, "train", 4096, shuffle=False, repeat=False)
  ids = np.asarray(next(src.batches(0)).ids).ravel()
  share = np.sort(np.bincount(ids, minlength=50))[::-1] / ids.size
  pmf = np.arange(1, 51, dtype=np.float64) ** -1.2
  # 106,496 draws: a share's standard deviation is at most sqrt(0.3 * 0.7 / 106496) = 0.0014
  np.testing.assert_allclose(share, pmf / pmf.sum(), rtol=0, atol=0.01)
  assert throughput.synthetic_bin_dir(d, 4096, 50, seed=1) == d
  other = np.asarray(next(criteo_bin.CriteoBinSource(d, "train", 4096, shuffle=False,
                                                     repeat=False).batches(0)).ids).ravel()
  assert not np.array_equal(other, ids)
