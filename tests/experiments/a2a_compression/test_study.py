"""experiments/a2a_compression/study.py: the H100 step model against a hand computation,
table-wise factors from sensitivities, and the entry point end to end at a toy size."""

import json
import os
import sys

import pytest

from core import hardware
from experiments.a2a_compression import study
from rec.embedding import a2a_compression as ac
from tests import cpu_env
from tests.experiments.entry import REPO
from tests import forkserver


def test_h100_model_matches_hand_computation():
  hw, eff = hardware.Hardware(), hardware.Efficiency()
  link, hbm = hw.net_bytes_per_s * eff.all2all, hw.hbm_bytes_per_s * eff.hbm
  ratio, codec = 3.0, 4.0
  # Seconds to move 1 GB of float32 values: over the link, or compressed plus the codec
  # (codec = 4 copies, each reading and writing the 1 GB).
  t32 = 1e9 / link
  tc = 1e9 / ratio / link + 4 * 2e9 / hbm
  out = study.h100_speedup(ratio, codec, fractions=(0.5,))
  assert out["time_ratio_exchange"] == pytest.approx(tc / t32)
  assert out["by_comm_fraction"]["0.5"] == pytest.approx(1 / (0.5 + 0.5 * tc / t32))
  f = out["comm_fraction_for_paper_speedup"]
  assert 1 / (1 - f + f * tc / t32) == pytest.approx(study.PAPER_SPEEDUP)
  # No compression and a free codec: no gain, and the paper's speedup is out of reach.
  same = study.h100_speedup(1.0, 0.0, fractions=(0.9,))
  assert same["by_comm_fraction"]["0.9"] == pytest.approx(1.0)
  assert same["comm_fraction_for_paper_speedup"] is None


def test_table_factors_follow_sensitivity():
  f = ac.table_factors_from_sensitivity({"a": 1.0, "b": 4.0, "c": 1e6})
  g = (1.0 * 4.0 * 1e6) ** (1 / 3)              # geometric mean
  assert f["a"] == pytest.approx(min(4.0, g / 1.0))
  assert f["b"] == pytest.approx(min(4.0, g / 4.0))
  assert f["c"] == pytest.approx(0.25)          # clipped: the most sensitive, tightest bound
  assert f["a"] >= f["b"] >= f["c"]


def _run_8(args, timeout=1200):
  """`python -m experiments.a2a_compression *args` on 8 simulated CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(8))
  return forkserver.run([sys.executable, "-m", "experiments.a2a_compression", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow   # six short trainings (compiles) in a fresh process
def test_entry_point_end_to_end(tmp_path):
  # The shared rec run flags: --batch_size, --num_rows and the --a2a_* bounds.
  out = _run_8(["--datasets=synthetic", "--steps=4", "--batch_size=64", "--num_rows=500",
                "--probe_batches=1", "--a2a_mode=abs", "--a2a_error_bound=0.02",
                f"--workdir={tmp_path}"])
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["experiment"] == "a2a_compression"
  assert summary["best_fixed_ratio"] > 1.0
  assert (tmp_path / "results.json").exists() and (tmp_path / "a2a_compression.png").exists()
  res = json.load(open(tmp_path / "results.json"))
  fixed = res["raw"]["synthetic"]["runs"]["fixed"]["setting"]
  assert fixed["mode"] == "abs" and fixed["bound"] == 0.02 and fixed["grad_bound"] == 0.001


@pytest.mark.slow   # fresh processes (jax imports)
@pytest.mark.parametrize("args,msg", [
    (["--a2a_mode=none"], "--a2a_mode=none: this study compares"),
    (["--a2a_bits=5"], "--a2a_bits=5: unsupported code width"),
    (["--a2a_error_bound=-1"], "--a2a_error_bound=-1.0: not a finite error bound > 0")])
def test_bad_flags_name_them(tmp_path, args, msg):
  out = _run_8(["--datasets=synthetic", f"--workdir={tmp_path}", *args], timeout=300)
  last = out.stderr.strip().splitlines()[-1]
  assert out.returncode == 2 and last.startswith("error: ") and msg in last, out.stderr[-2000:]


def test_gradients_in_float32_are_refused_before_training(tmp_path):
  """--a2a_grad_error_bound unset (a --config file's None) sends the backward exchange in
  float32, which the study's ratios would leave out: they count the forward payload only
  (8 devices, batch 64: "hlo x" 5.82 = 32768 / 5632 float32 / payload bytes, though the step
  also sends 16384 float32 bytes of gradients, 1.49x in all), and the H100 model would take
  2.91x for the whole exchange. Refused before training."""
  from tests.experiments.entry import run_refused
  cfg = tmp_path / "nograd.py"
  cfg.write_text("def get_config():\n  return {'a2a_grad_error_bound': None}\n")
  out = run_refused("experiments.a2a_compression", ["--datasets=synthetic", f"--config={cfg}",
                                                    f"--workdir={tmp_path / 'run'}"])
  assert out.stderr.strip().splitlines()[-1].startswith(
      "error: --a2a_grad_error_bound unset (the gradients' exchange in float32)")
  assert not (tmp_path / "run" / "synthetic").exists()

@pytest.mark.parametrize("datasets, error", [
    ("synthetic,synthetic:bad=1", "error: --datasets entry 'synthetic:bad=1': option 'bad=1'"),
    ("synthetic,criteo:/absent,avazu:/absent",
     "error: --datasets entry 'avazu:/absent': '/absent' is not a directory")])
def test_entry_point_checks_every_dataset_before_training(tmp_path, datasets, error):
  """A bad later --datasets entry is one line before the first dataset trains (a missing
  criteo:DIR is skipped, as the study's default names the sample that may be absent)."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.a2a_compression", [f"--datasets={datasets}",
                                                    f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1].startswith(error)
  assert "synthetic" not in os.listdir(tmp_path)   # no run of the first dataset


def test_an_earlier_run_is_refused_before_the_first_dataset_trains(tmp_path):
  """A rerun into the same --workdir: one line names the run directory before anything
  trains (else the first dataset's baseline and variants train, then the run stops at the
  later dataset's run left by the earlier study, which rec.runs.train_run refuses, the
  first dataset's work lost with no results.json)."""
  from tests.experiments.entry import run_refused
  (tmp_path / "sample").mkdir()
  old = tmp_path / "w" / "criteo" / "adaptive"
  old.mkdir(parents=True)
  (old / "metrics.jsonl").write_text("{}\n")
  out = run_refused("experiments.a2a_compression", [
      f"--datasets=synthetic,criteo:{tmp_path / 'sample'}", f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {old}: holds an earlier run (metrics.jsonl); expected a fresh run directory "
      "(one run per workdir, never replaced): choose a fresh --workdir, or delete it to train "
      "again"), out.stderr[-2000:]
  assert sorted(os.listdir(tmp_path / "w")) == ["criteo"] and "baseline" not in out.stdout
