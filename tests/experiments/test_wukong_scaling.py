"""experiments.wukong_scaling end to end, the power-law fit against known exponents and a
closed-form reference, the `synthetic_deep` data form and the size-pattern presets."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from experiments.wukong_scaling import study as scaling
from rec import configs, runs
from rec.data import sources, synthetic
from rec.data.batch import DataSpec
from rec.models.dcnv2 import DCNv2Config
from rec.models.dlrm import DLRMConfig
from rec.models.wukong import WukongConfig
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = DataSpec(num_dense=13, sparse_features=tuple(f"C{i + 1}" for i in range(26)),
                rows_per_feature=(100,) * 26, max_ids_per_bag=1)


# ---------------------------------------------------------------------------- the fit

def test_fit_recovers_known_exponent_exactly():
  x = np.geomspace(1e-4, 1e-1, 6)
  fit = scaling.fit_power_law(x, 0.3 * x ** -0.12)
  assert fit["b"] == pytest.approx(-0.12, abs=1e-10)
  assert fit["a"] == pytest.approx(0.3, rel=1e-9)
  assert fit["r2"] == pytest.approx(1.0, abs=1e-12) and fit["n"] == 6


def test_fit_with_noise_matches_closed_form_least_squares():
  rng = np.random.default_rng(0)
  x = np.geomspace(1e-4, 1e-1, 9)
  y = 0.05 * x ** 0.3 * np.exp(0.05 * rng.standard_normal(x.size))
  fit = scaling.fit_power_law(x, y)
  # Reference: the normal equations of log y = c + b log x, and R^2 = corr(log x, log y)^2.
  lx, ly = np.log(x), np.log(y)
  b = np.sum((lx - lx.mean()) * (ly - ly.mean())) / np.sum((lx - lx.mean()) ** 2)
  c = ly.mean() - b * lx.mean()
  assert fit["b"] == pytest.approx(b, rel=1e-9) and fit["a"] == pytest.approx(np.exp(c), rel=1e-9)
  assert fit["r2"] == pytest.approx(np.corrcoef(lx, ly)[0, 1] ** 2, rel=1e-9)
  assert abs(fit["b"] - 0.3) < 0.03 and 0.9 < fit["r2"] < 1.0


def test_fit_rejects_bad_points():
  with pytest.raises(ValueError, match=r"point 1 is \(x=2.0, y=-1.0\); expected positive"):
    scaling.fit_power_law([1.0, 2.0], [1.0, -1.0])
  with pytest.raises(ValueError, match="at least two distinct values"):
    scaling.fit_power_law([3.0, 3.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="3 x values and 2 y values"):
    scaling.fit_power_law([1.0, 2.0, 3.0], [1.0, 2.0])


def _row(model, preset, gflops, ne, auc):
  return {"model": model, "preset": preset, "label": f"{model}:{preset}",
          "gflops_per_example": gflops, "ne_mean": ne, "ne_std": 0.0, "auc_mean": auc,
          "auc_std": 0.0, "examples": 1024}


def test_findings_state_a_narrow_compute_range_as_it_is():
  """Sizes 1.32x apart in compute: the findings say 1.32x, not a range rounded to "1x"."""
  rows = [_row("wukong", "a", 1e-4, 0.70, 0.80), _row("wukong", "b", 1.32e-4, 0.69, 0.81)]
  res = {"rows": rows, "seeds": [0], "reference": {"ne": 0.5, "auc": 0.9},
         "config": {"data": "synthetic_deep", "batch_size": 64, "embedding_dim": 16}}
  notes = scaling.findings(res, scaling.scaling_fits(res))
  assert "from 0.0001 to 0.00013 GFLOPs/example (1.32x)" in notes[0]


def test_scaling_fits_recover_planted_exponents_and_findings():
  floor_ne, ceil_auc = 0.5, 0.9
  xs = [1e-4, 4e-4, 1.6e-3, 6.4e-3]
  rows = [_row("wukong", f"s{i}", x, floor_ne + 0.2 * x ** -0.1 / 10, ceil_auc - 0.01 * x ** -0.2)
          for i, x in enumerate(xs)]
  # DLRM: best at its second size, the largest one worse, and one AUC above the ceiling.
  rows += [_row("dlrm", "w1", 1e-4, 0.70, 0.80), _row("dlrm", "w2", 1e-3, 0.65, 0.95),
           _row("dlrm", "w3", 1e-2, 0.66, 0.85)]
  # DCN-v2: best at its largest size, but the last step gives 0.001 of the 0.051 gained.
  rows += [_row("dcnv2", "x1", 1e-4, 0.70, 0.80), _row("dcnv2", "x2", 1e-3, 0.65, 0.82),
           _row("dcnv2", "x3", 5e-3, 0.649, 0.83)]
  res = {"rows": rows, "seeds": [0], "reference": {"ne": floor_ne, "auc": ceil_auc},
         "config": {"data": "synthetic_deep", "batch_size": 64, "embedding_dim": 16}}
  fit = scaling.scaling_fits(res)
  w = fit["fits"]["wukong"]
  assert w["ne"]["b"] == pytest.approx(-0.1, abs=1e-9) and w["ne"]["a"] == pytest.approx(0.02)
  assert w["auc"]["b"] == pytest.approx(-0.2, abs=1e-9)
  d = fit["fits"]["dlrm"]
  assert d["auc_dropped"] == ["w2"] and d["auc"]["n"] == 2 and d["ne"]["n"] == 3
  notes = scaling.findings(res, fit)
  # Wukong's NE over its sizes: gaps 0.02 * x^-0.1, still falling by a factor 4^-0.1 a step.
  ne_w = [floor_ne + 0.02 * x ** -0.1 for x in xs]
  assert f"{ne_w[-2] - ne_w[-1]:.4f} below the next smaller: still improving" in notes[0]
  assert "NE - floor = 0.02 * GFLOPs^-0.1000 (R^2 1.00" in notes[0]
  assert "best NE 0.6500 at w2" in notes[1] and "(w3) do not improve on it" in notes[1]
  assert "0.0010 below the next smaller: flattening (the last size step gave 2% of the " \
         "0.0510 gained" in notes[2]
  assert notes[3].startswith("NE-gap exponents b") and "steepest: wukong" in notes[3]
  # Matched compute: the overlap of [1e-4, 6.4e-3], [1e-4, 1e-2], [1e-4, 5e-3] is centred at
  # sqrt(1e-4 * 5e-3).
  x = np.sqrt(1e-4 * 5e-3)
  dl = d["ne"]
  assert notes[4].startswith("Relative NE change per 4x compute")
  assert notes[5].startswith(f"At matched compute, {x:.2g} GFLOPs/example")
  assert f"wukong {floor_ne + 0.02 * x ** -0.1:.4f}" in notes[5]
  assert f"dlrm {floor_ne + dl['a'] * x ** dl['b']:.4f}" in notes[5]
  assert notes[6].startswith("Best NE overall 0.5")
  text = scaling.format_fits(fit)
  assert "dropped, gap <= 0: w2" in text


def test_seed_fits_recover_per_seed_exponents():
  # Seed 0 planted at b = -0.1, seed 1 at b = -0.3: the per-seed fits find each exactly,
  # the spread is their sample std; the mean-of-seeds fit is a different number.
  floor_ne, xs = 0.5, [1e-4, 1e-3, 1e-2]
  rows = []
  for i, x in enumerate(xs):
    runs = [{"seed": s, "ne": floor_ne + 0.02 * x ** b} for s, b in ((0, -0.1), (1, -0.3))]
    r = _row("wukong", f"s{i}", x, float(np.mean([u["ne"] for u in runs])), 0.8)
    rows.append({**r, "runs": runs, "num_seeds": 2})
  res = {"rows": rows, "seeds": [0, 1], "reference": {"ne": floor_ne, "auc": 0.9}}
  fit = scaling.scaling_fits(res)
  sf = fit["seed_fits"]["wukong"]
  assert sf["seeds"] == [0, 1]
  np.testing.assert_allclose(sf["b"], [-0.1, -0.3], atol=1e-9)
  assert sf["b_mean"] == pytest.approx(-0.2) and sf["b_std"] == pytest.approx(np.std([-0.1, -0.3], ddof=1))
  assert any("fitted per seed" in n and "wukong -0.2000 ± 0.1414 (2)" in n
             for n in scaling.findings(res, fit))
  assert "NE b per seed -0.1000, -0.3000" in scaling.format_fits(fit)


def test_per_quadrupling_beside_the_paper():
  # NE itself planted as 0.7 * x^c per seed (c = -0.01, -0.03): per-seed relative changes per
  # 4x compute are 4^c - 1 exactly; the seed-mean fit is a different number.
  xs = [1e-4, 1e-3, 1e-2]
  rows = []
  for i, x in enumerate(xs):
    runs = [{"seed": s, "ne": 0.7 * x ** c} for s, c in ((0, -0.01), (1, -0.03))]
    rows.append({**_row("wukong", f"s{i}", x, float(np.mean([u["ne"] for u in runs])), 0.8),
                 "runs": runs, "num_seeds": 2})
  rows.append(_row("dlrm", "w1", 1e-3, 0.7, 0.8))   # one size: no fit
  res = {"rows": rows, "seeds": [0, 1], "reference": {"ne": 0.5, "auc": 0.9}}
  q = scaling.per_quadrupling(res)
  assert set(q["archs"]) == {"wukong"} and q["paper"] == scaling.PAPER
  w = q["archs"]["wukong"]
  np.testing.assert_allclose(w["seed_rel_per_4x"], [4 ** -0.01 - 1, 4 ** -0.03 - 1], rtol=1e-9)
  assert w["seed_std"] == pytest.approx(np.std(w["seed_rel_per_4x"], ddof=1))
  mean_c = scaling.fit_power_law(xs, [r["ne_mean"] for r in rows[:3]])["b"]
  assert w["rel_per_4x"] == pytest.approx(4 ** mean_c - 1) and -0.03 < mean_c < -0.01
  notes = scaling.findings(res, scaling.scaling_fits(res))
  line = next(n for n in notes if n.startswith("Relative NE change per 4x compute"))
  assert f"wukong {100 * w['rel_per_4x']:+.2f}% (per seed" in line
  assert "the paper's wukong: -0.1% per 4x" in line


def test_default_specs():
  specs = scaling.default_specs("cpu", ["wukong", "dlrm"], sizes=2)
  g = scaling.GRIDS["cpu"]
  assert specs == [runs.ModelSpec("wukong", g["wukong"][0]),
                   runs.ModelSpec("wukong", g["wukong"][-1]),
                   runs.ModelSpec("dlrm", g["dlrm"][0]),
                   runs.ModelSpec("dlrm", g["dlrm"][-1])]
  with pytest.raises(ValueError, match="--grid='huge'"):
    scaling.default_specs("huge")
  with pytest.raises(ValueError, match="--archs entry 'dhen'"):
    scaling.default_specs("cpu", ["dhen"])
  # More sizes than the grid holds: an error, not the whole grid silently.
  with pytest.raises(ValueError, match=r"--sizes=5: more than the 4 sizes of --grid=cpu's "
                     r"wukong; expected at most 4 \(0: all\)"):
    scaling.default_specs("cpu", ["wukong"], sizes=5)
  # Every grid entry is a valid preset, and sizes grow with the index.
  for grid in scaling.GRIDS.values():
    for arch, presets in grid.items():
      for p in presets:
        configs.model_config(configs.make_run(model=arch, preset=p), SPEC)


# ---------------------------------------------------------------------------- data and presets

def test_synthetic_deep_form():
  train, evals = sources.make_sources("synthetic_deep", 32, num_rows=50, eval_batches=2, seed=3)
  assert (train.teacher, train.logit_scale, evals.num_batches) == ("deep", 3.0, 2)
  ref = synthetic.SyntheticCriteo(32, 50, seed=3, teacher="deep", logit_scale=3.0)
  b, r = train.batch(1), ref.batch(1)
  np.testing.assert_array_equal(b.ids, r.ids)
  np.testing.assert_array_equal(b.labels, r.labels)
  t2, _ = sources.make_sources("synthetic_deep:logit_scale=1.5", 32, num_rows=50)
  assert t2.logit_scale == 1.5
  lin, _ = sources.make_sources("synthetic", 32, num_rows=50)
  assert (lin.teacher, lin.logit_scale) == ("linear", synthetic.LOGIT_SCALE)
  with pytest.raises(ValueError, match=r"option 'scale=2' of a synthetic form; expected 'synth"):
    sources.make_sources("synthetic_deep:scale=2", 32)
  with pytest.raises(ValueError, match=r"option 'logit_scale=0'"):
    sources.make_sources("synthetic:logit_scale=0", 32)
  # The train_rec path builds on it.
  cfg = configs.make_run(data="synthetic_deep", model="wukong", preset="l1_n2_k4_w16",
                             embedding_dim=8, num_rows=50, batch_size=32, eval_batch_size=32)
  _, train_src, _, _, _ = configs.build_run(cfg)
  assert train_src.teacher == "deep"


def test_size_pattern_presets():
  rows = SPEC.rows_per_feature
  d = configs.model_config(configs.make_run(model="dlrm", preset="w256_d3"), SPEC)
  assert (d.bottom_mlp, d.top_mlp, d.embedding_dim) == ((256, 16), (256, 256, 256, 1), 16)
  d32 = configs.model_config(configs.make_run(model="dlrm", preset="w64", embedding_dim=32),
                             SPEC)
  assert (d32.bottom_mlp, d32.top_mlp, d32.embedding_dim) == ((64, 32), (64, 64, 1), 32)
  assert isinstance(d32, DLRMConfig)
  c = configs.model_config(configs.make_run(model="dcnv2", preset="x2_r32_w128"), SPEC)
  assert isinstance(c, DCNv2Config)
  assert (c.bottom_mlp, c.num_cross_layers, c.cross_rank, c.deep_mlp, c.top_mlp) == (
      (), 2, 32, (128, 128), (1,))
  w = configs.model_config(configs.make_run(model="wukong", preset="l2_n8_k16_w128"), SPEC)
  assert w == WukongConfig.family(rows, 2, 8, 8, 16, 128, num_dense=13, num_sparse=26,
                                  feature_names=SPEC.sparse_features)
  # The older l<l>_n<n> form is unchanged: the paper's Criteo search space.
  old = configs.model_config(configs.make_run(model="wukong", preset="l3_n16"), SPEC)
  assert old == WukongConfig.criteo(rows, 3, 16, 16, num_dense=13, num_sparse=26,
                                    feature_names=SPEC.sparse_features)
  with pytest.raises(ValueError, match=r"--preset='w64' for --model=dcnv2: expected one of .*x<la"):
    configs.model_config(configs.make_run(model="dcnv2", preset="w64"), SPEC)


# ---------------------------------------------------------------------------- end to end

@pytest.mark.slow   # an entry point end to end; CI's default suite keeps to its time
def test_experiment_end_to_end(tmp_path):
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  args = ["--models=dlrm:w16,dlrm:w64,wukong:l1_n2_k4_w16,wukong:l1_n4_k4_w32", "--steps=4",
          "--batch_size=64", "--eval_batch_size=64", "--eval_batches=2", "--num_rows=100",
          "--embedding_dim=8", "--log_every=4", f"--workdir={tmp_path}"]
  out = forkserver.run([sys.executable, "-m", "experiments.wukong_scaling", *args], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  summary = json.loads(lines[-1])
  res = json.load(open(tmp_path / "results.json"))
  assert res["summary"] == summary and res["primary_metric"] == "ne"
  assert set(summary["fits"]) == {"dlrm", "wukong"}
  assert summary["floor"]["ne"] == res["reference"]["ne"]
  for arch in ("dlrm", "wukong"):
    pts = res["fits"][arch]["ne_points"]
    assert len(pts) == 2 and pts[0]["gflops"] < pts[1]["gflops"]
    rows = {r["preset"]: r for r in res["rows"] if r["model"] == arch}
    # The fit goes through both points exactly (two points, two parameters).
    f = summary["fits"][arch]["ne"]
    for p in pts:
      assert f["a"] * p["gflops"] ** f["b"] == pytest.approx(p["gap"], rel=1e-6)
      assert p["gap"] == pytest.approx(rows[p["preset"]]["ne_mean"] - res["reference"]["ne"])
  # Per architecture, the range and fit; the exponents; per 4x compute beside the paper;
  # matched compute; the best overall against the floor.
  assert summary["findings"] == res["findings"] and len(res["findings"]) == 6
  quad = res["per_quadrupling"]["archs"]
  for arch in ("dlrm", "wukong"):
    lo, hi = sorted((r for r in res["rows"] if r["model"] == arch),
                    key=lambda r: r["gflops_per_example"])
    c = (np.log(hi["ne_mean"] / lo["ne_mean"])
         / np.log(hi["gflops_per_example"] / lo["gflops_per_example"]))
    assert quad[arch]["rel_per_4x"] == pytest.approx(4.0 ** c - 1, rel=1e-6)
    assert f"{arch} {100 * quad[arch]['rel_per_4x']:+.2f}%" in res["findings"][3]
  assert any(l.startswith("  dlrm ") and "b=" in l for l in lines)
  assert sum(l.startswith(("dlrm:w", "wukong:l")) for l in lines) == 4
  assert (tmp_path / "wukong_scaling.png").stat().st_size > 10_000


@pytest.mark.parametrize("args,line", [
    (["--study=profile", "--profile_data=synthetic,bogus"], "error: --profile_data entry "
     "'bogus': expected 'synthetic'"),
    (["--study=profile", "--models=dlrm:w16,dlrm:zz"], "error: --models entry 'dlrm:zz': "
     "--preset='zz' for --model=dlrm: expected one of"),
    (["--seeds="], "error: --seeds=: nothing to run; expected at least a seed"),
    (["--study=fuxictr", "--from_results=x.json"], "error: --from_results=x.json with "
     "--study=fuxictr; expected --from_results alone"),
])
def test_bad_flags_refused_before_anything_runs(tmp_path, args, line):
  """Refused before anything runs: not a bad later --profile_data form or --models preset
  failing (naming --data or --preset) after the first is profiled, --seeds= failing naming
  no flag, or --from_results ignored by the other studies."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.wukong_scaling", args + [f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1].startswith(line), out.stderr[-2000:]
  assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- side by side

def test_fuxictr_data_is_the_runs_batches_in_order(tmp_path):
  # The .npz the FuxiCTR peer trains on holds our source's first batches, in order.
  from experiments.wukong_scaling import fuxictr
  train, evals = sources.make_sources("synthetic_deep", 16, num_rows=20, eval_batches=2, seed=1)
  counts = fuxictr.write_data(str(tmp_path / "d.npz"), train, evals, steps=3)
  assert counts == {"train_examples": 48, "eval_examples": 32}
  d = np.load(tmp_path / "d.npz")
  for k in range(3):
    b = train.batch(k)
    np.testing.assert_array_equal(d["train_ids"][16 * k:16 * (k + 1)], b.ids[:, :, 0])
    np.testing.assert_array_equal(d["train_dense"][16 * k:16 * (k + 1)], b.dense)
    np.testing.assert_array_equal(d["train_labels"][16 * k:16 * (k + 1)], b.labels)
  np.testing.assert_array_equal(d["eval_labels"][16:], list(evals.batches(0))[1].labels)


def test_fuxictr_settings_checked():
  from core.errors import UserError
  from experiments.wukong_scaling import fuxictr
  mcfg = configs.model_config(configs.make_run(model="wukong", preset="small"), SPEC)
  cfg = configs.make_run(model="wukong", preset="small", dense_optimizer="adam")
  with pytest.raises(UserError, match="--sparse_optimizer=rowwise_adagrad with --study=fuxictr"):
    fuxictr.peer_config(mcfg, cfg, 10, 0, True, 0.0)
  train, _ = sources.make_sources("synthetic", 4, num_rows=20, eval_batches=1)
  b = train.batch(0)
  two = dataclasses.replace(b, ids=np.repeat(b.ids, 2, axis=2), lengths=b.lengths * 2)

  class TwoIdBags:
    def batches(self, start=0):
      yield two

  with pytest.raises(UserError, match=r"train data batch 0: bags of 2 slots, lengths \[2\]; "
                     "expected one id per bag"):
    fuxictr.write_data("unused.npz", TwoIdBags(), TwoIdBags(), steps=1)
