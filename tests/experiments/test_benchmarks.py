"""Benchmark entry points run end to end at toy sizes (the numbers live in BENCHMARKS.md)."""

import json
import os
import sys

import pytest

from tests.experiments.entry import DATA
from tests.experiments.entry import REPO
from tests.experiments.entry import run_refused
from tests.experiments.entry import run_entry
from tests import forkserver


def _run(module, args):
  return run_entry(module, args)[1]


def test_bench_embedding_toy(tmp_path):
  out = _run("experiments.bench_embedding", ["--rows=1000,5000", "--pooling=1,4", "--dim=8",
                                             "--batch_size=64", "--steps=2", "--naive_steps=2",
                                             "--repeats=2", f"--workdir={tmp_path}"])
  assert set(out["median_ms"]) == {f"R{r}_P{p}_{k}" for r in (1000, 5000) for p in (1, 4)
                                   for k in ("sparse", "naive")}
  assert all(v > 0 for v in out["median_ms"].values())
  assert (tmp_path / "results.json").exists() and (tmp_path / "bench_embedding.png").exists()


def test_bench_dlrm_toy(tmp_path):
  out = _run("experiments.bench_dlrm", ["--batch_size=256", "--rows=1000", "--steps=2",
                                        "--repeats=1", "--rounds=1", f"--workdir={tmp_path}"])
  assert out["ours_examples_per_sec_median"] > 0 and "torchrec_examples_per_sec_median" not in out


@pytest.mark.parametrize("args,line", [
    (["--pooling=0"], "flag --pooling=['0']: 0: out of range; expected an integer >= 1"),
    (["--paths=sparce"], "flag --paths=['sparce']: 'sparce': not a choice; expected one of "
     "['sparse', 'naive']"),
    (["--rows="], "error: --rows=: nothing to time; expected at least one value"),
])
def test_bench_embedding_refuses_bad_lists_before_timing(tmp_path, args, line):
  """A pooling factor of 0 (else a traceback from inside JAX), an unknown path (else nothing
  timed and an empty results.json written) or an empty list: one line naming the flag and
  the value, nothing written."""
  out = run_refused("experiments.bench_embedding", args + [f"--workdir={tmp_path}"])
  assert any(l.endswith(line) for l in out.stderr.strip().splitlines()), out.stderr[-2000:]
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args,line", [
    (["--rows=0"], "--rows=0 with --model=dlrm --preset=kaggle; expected an integer >= 1 (0, "
     "the reference's full rows, is for --model=dcnv2 --preset=mlperf)"),
    (["--peer_python=/absent/python"], "--peer_python='/absent/python': no such executable; "
     "expected the peer environment's python (experiments/peers/README.md)"),
    (["--plan_storage=fp32"], "--plan_storage=fp32 without --show_plan; expected it only with "
     "--show_plan (the timed step keeps every table on the devices; --compare_host_prefetch "
     "puts them on the host)"),
    (["--model=wukong", "--peer_python=python3"], "--peer_python with --model=wukong "
     "--preset=kaggle; expected --model=dlrm --preset=kaggle (the TorchRec peer is the Criteo "
     "Kaggle DLRM)"),
    (["--compare_host_prefetch=fp32_cache:lru:0.05@host", "--memory_budget_gb=2"],
     "--memory_budget_gb=2 with --compare_host_prefetch; expected no budget (every table is on "
     "the host tier there)"),
    (["--threads=4"], "--threads=4 without a timed peer; expected it with --peer_python (the "
     "TorchRec peer's CPU threads) and without --show_plan"),
])
def test_bench_dlrm_refuses_bad_flags_before_timing(tmp_path, args, line):
  """One line naming the flag, before timing: not --rows=0 named as --num_rows, not a
  missing --peer_python failing after our first round is timed, and not --plan_storage
  without --show_plan, the peer beside another model, --memory_budget_gb with
  --compare_host_prefetch or --threads without the peer accepted and ignored."""
  out = run_refused("experiments.bench_dlrm", args + ["--batch_size=32", "--steps=1",
                                                      f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == "error: " + line
  assert "round 0" not in out.stdout and os.listdir(tmp_path) == []


@pytest.mark.slow   # the prefetch itself: tests/rec/test_host_prefetch.py
def test_bench_dlrm_compare_host_prefetch_toy(tmp_path):
  out = _run("experiments.bench_dlrm", ["--compare_host_prefetch=fp32_cache:lru:0.05@host",
                                        "--batch_size=128", "--rows=1000", "--steps=2",
                                        "--repeats=1", "--rounds=1", f"--workdir={tmp_path}"])
  assert out["plain_ms_per_step"] > 0 and out["prefetch_ms_per_step"] > 0
  assert out["prefetch_host_ids_per_step"] < out["plain_host_ids_per_step"]


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "criteo_kaggle_sample")),
                    reason="Criteo sample not found (set REC_DATA_DIR)")
def test_criteo_baselines_toy(tmp_path):
  out = _run("experiments.criteo_baselines", [
      f"--data=criteo:{os.path.join(DATA, 'criteo_kaggle_sample')}", "--epochs=1",
      "--num_rows=1000", "--batch_size=512", f"--workdir={tmp_path}"])
  assert [r["model"] for r in out["results"]] == ["logreg", "dlrm"]
  assert all(r["eval_examples"] == 800 and 0.5 < r["auc"] < 1 for r in out["results"])


def test_criteo_baselines_refuses_unknown_model_before_training(tmp_path):
  """A typo in --models is one line naming the flag before any model trains (not after the
  models before it, as --model)."""
  out = run_refused("experiments.criteo_baselines", [
      f"--data=criteo:{tmp_path}", "--models=logreg,dlrn", f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1].startswith("error: --models=logreg,dlrn: dlrn: ")
  assert "epoch(s)" not in out.stdout


def test_criteo_baselines_refuses_an_earlier_run_before_training(tmp_path):
  """A rerun into the same --workdir: one line names the run directory first (else the
  models before the first one an earlier run left train, then the run stops there with
  core.train's error naming --resume / --overwrite, flags this entry point does not have)."""
  old = tmp_path / "w" / "dlrm_e3"
  (old / "checkpoints" / "40").mkdir(parents=True)
  out = run_refused("experiments.criteo_baselines", [
      f"--data=criteo:{tmp_path}", "--epochs=1,3", f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {old}: holds an earlier run (checkpoints); expected a fresh run directory (one "
      "run per workdir, never replaced): choose a fresh --workdir, or delete it to train again")
  assert "epoch(s)" not in out.stdout and sorted(os.listdir(tmp_path / "w")) == ["dlrm_e3"]


@pytest.mark.parametrize("args,line", [
    (["--epochs=0.5,0"], "--epochs=0.5,0: 0 epochs; expected epoch counts > 0"),
    (["--epochs="], "--epochs=: empty; expected at least one value"),
    (["--models="], "--models=: empty; expected at least one value"),
    (["--epochs=1,1.0"], "--epochs=1,1.0: a value twice; expected each value once"),
    (["--data=synthetic"], "--data=synthetic: generated data, which has no epochs; expected "
     "files to train on for --epochs, e.g. criteo:DIR"),
])
def test_criteo_baselines_refuses_bad_lists_before_training(tmp_path, args, line):
  """One line naming the flag, before training. Unchecked, --epochs=0 trains one step and
  reports it as 0 epochs; an empty --models or --epochs trains nothing and writes an empty
  table, results.json and plot; a value given twice trains into the workdir of the first,
  refused only after that one has trained; generated data is refused asking for --steps,
  which this entry point does not have."""
  out = run_refused("experiments.criteo_baselines", [f"--data=criteo:{tmp_path}", *args,
                                                     f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1] == "error: " + line
  assert "epoch(s)" not in out.stdout and not (tmp_path / "w" / "results.json").exists()


@pytest.mark.slow   # an entry point end to end; CI's default suite keeps to its time
def test_bench_kernels_interpret_check(tmp_path):
  out = _run("experiments.bench_kernels", ["--interpret_check", f"--workdir={tmp_path}"])
  assert out["interpret_check"] == "ok"
  assert set(out["rel_err"]) == {"flash_attention", "embedding_bag"}
  assert json.load(open(tmp_path / "results.json"))["checks"]["embedding_bag"]["int8"]["ok"]


def test_bench_kernels_refuses_without_gpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "-m", "experiments.bench_kernels",
                        f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True)
  assert out.returncode == 2 and "need a GPU" in out.stderr
  assert "refused" in json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args,line", [
    (["--data="], "--data=: empty; expected at least one value"),
    (["--data=synthetic:gen=host,synthetic:gen=host"], "--data=synthetic:gen=host,"
     "synthetic:gen=host: synthetic:gen=host twice; expected each value once"),
    (["--recd_repeats=2,2.0"], "--recd_repeats=2,2.0: 2 twice; expected each value once"),
    (["--data=criteo_bin:gen", "--gen_rows=1000", "--preset=bogus"], "--preset='bogus' for "
     "--model=dlrm: expected one of ['kaggle', 'small', 'terabyte', 'w<W>[_d<depth>]']"),
    (["--recd_repeats=2", "--data=synthetic"], "--data: given with --recd_repeats; expected "
     "--data_workers, --num_user, --user_bag only with --recd_repeats, --data, "
     "--source_batches, --gen_rows only without it"),
    (["--data_workers=0"], "--data_workers: given without --recd_repeats; expected "
     "--data_workers, --num_user, --user_bag only with --recd_repeats, --data, "
     "--source_batches, --gen_rows only without it"),
])
def test_bench_pipeline_refuses_bad_flags_before_measuring(tmp_path, args, line):
  """One line naming the flag, before measuring. Unchecked, an empty --data measures
  nothing and writes an empty results.json; a value given twice is measured twice under one
  summary key; a bad --preset (or --model, --mesh) fails after criteo_bin:gen has written
  its --gen_rows rows; --data with --recd_repeats and --data_workers without it are
  accepted and ignored."""
  out = run_refused("experiments.bench_pipeline", args + [
      "--batch_size=64", "--steps=2", f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == "error: " + line
  assert "measuring" not in out.stdout and os.listdir(tmp_path) == []


def test_bench_pipeline_checks_every_form_before_measuring(tmp_path):
  """A bad later --data form is one line before the first form is measured."""
  out = run_refused("experiments.bench_pipeline", [
      "--data=synthetic:gen=host,criteo:/absent", f"--workdir={tmp_path}"])
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --data='criteo:/absent': '/absent' is not a directory")
  assert "measuring" not in out.stdout
