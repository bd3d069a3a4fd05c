"""experiments.gpu_report: the dry run end to end at toy sizes on CPU (in the default suite
the GPU code paths the CPU could leave unchecked, parts.SUITE_DRY_RUN, failing on any row's
error; every part, slow-marked), the refusal off a GPU, and the report's machinery (target
statuses, row errors, pytest counts, failures and out-of-memory told apart, the budget)
against hand-made cases."""

from __future__ import annotations

import json
import os
import sys
import time
import types

import jax
import pytest

from experiments.gpu_report import parts
from experiments.gpu_report import report as report_lib
from tests.experiments.entry import REPO
from tests.experiments.entry import run_entry
from tests import forkserver

PYTEST_DONE = """\
tests/a.py::test_x PASSED                                                 [ 25%]
tests/a.py::test_y FAILED                                                 [ 50%]
tests/b.py::TestK::test_z[case-1] SKIPPED (needs a GPU)                   [ 75%]
tests/b.py::test_w ERROR                                                  [100%]
==== 1 failed, 1 passed, 1 skipped, 3 deselected, 1 error in 2.31s ====
"""


PYTEST_XDIST_CUT = """\
[gw1] [ 25%] PASSED tests/a.py::test_x
[gw0] [ 50%] FAILED tests/a.py::test_y
[gw1] [ 75%] SKIPPED tests/b.py::test_z
"""


def test_parse_pytest_counts():
  """The final summary line wins; a run cut short is counted from its -v lines."""
  assert report_lib.parse_pytest_counts(PYTEST_DONE) == {
      "passed": 1, "failed": 1, "skipped": 1, "errors": 1, "deselected": 3}
  cut = "\n".join(PYTEST_DONE.splitlines()[:3])
  assert report_lib.parse_pytest_counts(cut) == {"passed": 1, "failed": 1, "skipped": 1,
                                                 "errors": 0}
  assert report_lib.parse_pytest_counts("=== 12 passed in 1.0s ===")["passed"] == 12
  assert report_lib.parse_pytest_counts(PYTEST_XDIST_CUT) == {
      "passed": 1, "failed": 1, "skipped": 1, "errors": 0}


def test_a_pytest_run_cut_short_keeps_each_failure_reason(tmp_path):
  """pytest prints failures only at the end; the report's pytest parts stop the run at
  their limit, so each failure's reason is written as it happens (the plugin)."""
  tests = tmp_path / "t"
  tests.mkdir()
  (tests / "test_cut.py").write_text(
      "import time\n"
      "def test_fails():\n  assert 1 + 1 == 3, 'arithmetic is off'\n"
      "def test_passes():\n  pass\n"
      "def test_hangs():\n  time.sleep(600)\n")
  env = dict(os.environ, PYTHONPATH=REPO)
  t0 = time.monotonic()
  res = report_lib.run_pytest(["-p", "no:xdist", "-o", "addopts=", str(tests)], env,
                              timeout_s=8.0, log_path=str(tmp_path / "out.log"), cwd=REPO)
  assert res["timed_out"] and time.monotonic() - t0 < 120
  assert res["counts"]["failed"] == 1 and res["counts"]["passed"] == 1
  [fail] = res["failures"]
  assert fail["test"].endswith("test_cut.py::test_fails (call)")
  assert "arithmetic is off" in fail["text"]
  assert parts._last_error_line(fail["text"]).startswith("AssertionError: arithmetic is off")


def test_failures_are_written_by_the_xdist_controller_only(tmp_path, monkeypatch):
  """Under xdist (the GPU report's pytest parts) a failure's report reaches the hook in
  its worker and again in the controller: only the controller writes it."""
  from experiments.gpu_report import pytest_failures as plugin
  path = tmp_path / "failures"
  monkeypatch.setenv(plugin.ENV, str(path))
  monkeypatch.setattr(plugin, "_WORKER", plugin._WORKER)   # restored after the test
  report = types.SimpleNamespace(failed=True, nodeid="t.py::test_x", when="call",
                                 longreprtext="E   AssertionError: no")
  for config in (types.SimpleNamespace(workerinput={}), types.SimpleNamespace()):
    plugin.pytest_configure(config)           # a worker, then the controller
    plugin.pytest_runtest_logreport(report)
  assert plugin.read_failures(str(path)) == [{"test": "t.py::test_x (call)",
                                              "text": "E   AssertionError: no"}]


def test_judged_statuses():
  j = report_lib.judged
  assert j("p", "n", 0.95, at_least=0.9).status == "met"
  assert j("p", "n", 0.85, at_least=0.9).status == "missed"
  assert j("p", "n", 1.31, at_most=1.3).status == "missed"
  t = j("p", "n", 0.5, at_least=0.5, fmt="{:.1%}")
  assert (t.status, t.text, t.target) == ("met", "50.0%", ">= 50.0%")
  assert j("p", "n", 2.0).status == "info"
  assert j("p", "n", None, at_least=1, error="XlaRuntimeError: RESOURCE_EXHAUSTED: Out of "
           "memory while trying to allocate 17.2GiB").status == "oom"
  assert j("p", "n", None, at_least=1, error="ValueError: bad").status == "failed"
  assert j("p", "n", None, at_least=1, skipped="budget").status == "skipped"
  assert j("p", "n", None, at_least=1).status == "unmeasured"
  with pytest.raises(ValueError, match="status 'great'"):
    report_lib.Target("p", "n", "-", status="great")


def _ctx(tmp_path):
  return report_lib.Context(sizes=None, dry_run=True, out_dir=str(tmp_path))


def test_failed_and_oom_parts_are_reported_and_timed(tmp_path):
  """A part that raises becomes one row with its error; out of memory is its own status;
  compile time comes from jax.monitoring's compile events."""
  def oom(ctx):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.0GiB")

  def broken(ctx):
    raise ValueError("--fp8_layers: no such layer")

  def compiles(ctx):
    f = jax.jit(lambda x: x * 3.0 + float(time.time() % 1))  # a fresh program: compiled
    return {"targets": [report_lib.judged("c", "x", float(f(1.0)) > 0, at_least=1)]}

  rec = report_lib.run_part(report_lib.Part("oom", oom, "-"), _ctx(tmp_path), 10)
  assert rec["status"] == "oom" and rec["targets"][0].status == "oom"
  assert "80.0GiB" in rec["targets"][0].detail
  rec = report_lib.run_part(report_lib.Part("broken", broken, "-"), _ctx(tmp_path), 10)
  assert rec["status"] == "failed" and "no such layer" in rec["error"]
  rec = report_lib.run_part(report_lib.Part("compiles", compiles, "-"), _ctx(tmp_path), 10)
  assert rec["status"] == "ok" and rec["targets"][0].status == "met"
  assert 0 < rec["compile_s"] <= rec["wall_s"]


def test_markdown_has_one_row_per_target(tmp_path):
  report = {"dry_run": False, "machine": {"device": "NVIDIA H100", "backend": "gpu",
                                          "num_devices": 1, "jax": "x", "cpu": "c", "cores": 16},
            "started": "now", "wall_s": 1.0, "targets": [
                report_lib.judged("a", "fwd | T4096", 0.93, at_least=0.9).__dict__,
                report_lib.judged("b", "mfu", None, at_least=0.5, skipped="budget").__dict__],
            "parts": {"a": {"status": "ok", "details": {"tables": {"t": [{"x": 1.5}]}}},
                      "b": {"status": "ok"}}}
  report_lib.write_report(str(tmp_path), report)
  md = (tmp_path / "report.md").read_text()
  assert "| a | fwd \\| T4096 | 0.93x | >= 0.90x | met |" in md
  assert "| b | mfu | - | >= 0.50x | skipped | budget |" in md
  assert "## a: t" in md and "DRY RUN" not in md
  assert json.loads((tmp_path / "report.json").read_text())["targets"][0]["figure"] == 0.93


def test_budget_skips_parts_that_do_not_fit(tmp_path, monkeypatch):
  """A part whose report budget is spent is reported as skipped, not run."""
  ran = []
  fake = {n: report_lib.Part(n, lambda ctx, n=n: ran.append(n) or {"targets": []}, "-")
          for n in ("one", "two")}
  monkeypatch.setattr(parts, "PARTS", fake)
  monkeypatch.setattr(parts, "DEFAULT_BUDGETS", {"one": 1, "two": 1})
  rep = parts.run_report(parts.Sizes.dry_run(), ["one", "two"], str(tmp_path), dry_run=True,
                         budget_s=4.0)
  assert ran == [] and {p["status"] for p in rep["parts"].values()} == {"skipped"}
  assert [t["status"] for t in rep["targets"]] == ["skipped", "skipped"]
  with pytest.raises(ValueError, match="--parts"):
    parts.run_report(parts.Sizes.dry_run(), ["nope"], str(tmp_path), dry_run=True, budget_s=9)


def test_lm_train_order_reuse_and_fastest_remat(tmp_path, monkeypatch):
  """As on a GPU: every impl at the first remat before the next, "cudnn" reusing "auto"'s
  program when auto resolves to it, each impl judged at its fastest remat; a budget that
  runs out skips the remaining cases, never the first remat of an impl."""
  ms = {("auto", "none"): 200.0, ("auto", "attention"): 150.0,
        ("pallas_mgpu", "none"): 300.0, ("pallas_mgpu", "attention"): 400.0}
  calls = []

  def fake(cfg, **kw):
    key = (cfg.attention_impl, "attention" if cfg.remat else "none")
    calls.append(key)
    return {"step_ms": ms[key], "mfu": 100.0 / ms[key], "attention_resolved":
            "cudnn" if key[0] == "auto" else key[0], "tokens_per_s": 1.0,
            "model_tflops_per_s": 1.0, "peak_tflops_per_device": 989.0,
            "device_kind": "NVIDIA H100", "compile_s": 0.0}

  monkeypatch.setattr(parts.lm_train, "run_benchmark", fake)
  sizes = parts.Sizes.gpu(lm_preset="tiny", lm_seq=32, lm_min_case_s=0.0)
  out = parts.part_lm_train(report_lib.Context(sizes=sizes, dry_run=False,
                                               out_dir=str(tmp_path)))
  assert calls == [("auto", "none"), ("pallas_mgpu", "none"), ("auto", "attention"),
                   ("pallas_mgpu", "attention")]
  assert out["details"]["best_remat"] == {"auto": "attention", "cudnn": "attention",
                                          "pallas_mgpu": "none"}
  assert sizes.lm_impls == ("auto", "cudnn", "pallas_mgpu")
  assert [(t.figure, t.status) for t in out["targets"]] == [
      (100 / 150, "met"), (100 / 150, "met"), (100 / 300, "missed")]
  assert "auto (-> cudnn), remat attention (fastest of none, attention)" in out["targets"][0].name
  assert "the program of auto" in out["targets"][1].detail
  calls.clear()
  ctx = report_lib.Context(sizes=parts.Sizes.gpu(lm_preset="tiny", lm_min_case_s=10.0),
                           dry_run=False, out_dir=str(tmp_path), deadline=time.monotonic() + 5)
  out = parts.part_lm_train(ctx)
  assert calls == [] and {t.status for t in out["targets"]} == {"skipped"}


def test_decode_floor_counts_the_keys_each_step_reads(monkeypatch):
  """The decode part's floor by hand: after a prompt of P tokens, decode step j (1 .. n - 1
  of n new tokens; the prefill samples the first) reads P + j cached tokens in each layer,
  at most W in a sliding-window layer; every weight once, of an untied embedding table only
  the B rows looked up."""
  from flax import nnx

  from experiments.benchmarks import decode
  from llm import model as model_lib
  from llm.config import get_config
  cfg = get_config("tiny_mistral", window_layers=(1,))   # layer 0 full, layer 1 window 8
  # The floor reads shapes and dtypes only (the timing is faked): an abstract model, no init.
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
  monkeypatch.setattr(decode, "time_decode", lambda *a: ([0.002], [0.004], None))
  r = decode.measure_decode(model, 2, prompt_len=10, new_tokens=6, repeats=1,
                            copy_bytes_per_s=1e9)
  # Steps 1..5 see 11..15 keys: layer 0 reads their mean, 13; layer 1 its window, 8.
  g, k, d, v = cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.vocab_size
  kv = 2 * 2 * (13 + 8) * g * k * 4                       # k and v, batch 2, fp32 cache
  layer = 2 * d * cfg.n_heads * k + 2 * d * g * k + 3 * d * cfg.ffn_dim + 2 * d
  weights = 4 * (cfg.n_layers * layer + d + v * d + 2 * d)   # + output, + 2 embedding rows
  # Byte counts are integers well inside float64's exact range: equal, not close.
  assert (r["weight_bytes_per_step"], r["kv_bytes_per_step"]) == (weights, kv)
  assert r["decode_ms_per_step"] == pytest.approx(4.0 / 5, rel=1e-12)   # 4 ms over 5 steps
  assert r["decode_floor_ms"] == pytest.approx((weights + kv) / 1e9 * 1e3, rel=1e-12)
  with pytest.raises(ValueError, match="new_tokens=1"):
    decode.decode_kv_tokens(cfg, 10, 1)


def test_refuses_without_gpu(tmp_path):
  out = forkserver.run([sys.executable, "-m", "experiments.gpu_report", f"--out={tmp_path}",
                        "--parts=decode"], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert out.returncode == 2 and "--dry_run" in out.stderr
  assert "refused" in json.loads(out.stdout.strip().splitlines()[-1])
  assert not (tmp_path / "report.md").exists()


def test_dry_run_takes_the_gpu_code_paths(tmp_path):
  """The default suite's dry run (parts.SUITE_DRY_RUN, about 50 s of CPU): Mosaic GPU with
  the fused and the split backward, Triton and the cuDNN row; the cudnn (emulated) and
  pallas_mgpu train steps; decode; float32 and int4 bags through Pallas and XLA; the DLRM
  loop on the device-side generator. Any row with an error fails it (the entry point
  exits 1, and every row is checked here)."""
  stdout, summary = run_entry("experiments.gpu_report",
                              ["--dry_run", f"--out={tmp_path}", *parts.SUITE_DRY_RUN],
                              timeout=600)
  rep = json.loads((tmp_path / "report.json").read_text())
  assert report_lib.row_errors(rep) == [] and summary["errors"] == 0, summary
  assert summary["parts"] == {p: "ok" for p in ("attention", "lm_train", "decode",
                                                 "embedding_bag", "rec_pipeline")}
  for t in rep["targets"]:   # a figure, or (MFU on CPU) the reason there is none
    assert t["status"] in ("met", "missed", "info") or (
        t["part"] == "lm_train" and t["status"] == "unmeasured" and "no peak" in t["detail"]), t
  details = {name: p["details"] for name, p in rep["parts"].items()}
  timed = lambda r: "fwd_ms" in r and "bwd_ms" in r
  rows = {r["impl"]: r for r in details["attention"]["rows"] if timed(r)}
  assert set(rows) == {"cudnn", "mgpu[64x128x2:fused]", "mgpu[64x128x2:split]", "triton"}
  assert {r["head_dim"] for r in rows.values()} == {128} and rows["cudnn"]["stand_in"] == "xla"
  lm = details["lm_train"]["results"]
  assert lm["cudnn/none"]["attention_resolved"] == parts.CUDNN_STAND_IN
  assert lm["pallas_mgpu/none"]["attention_resolved"] == "pallas_mgpu"
  assert all(r["step_ms"] > 0 for r in lm.values()) and len(lm) == 2
  bags = {(r["dtype"], r["impl"]) for r in details["embedding_bag"]["tables"]["lookups"]
          if "ms" in r}
  assert bags == {(f, i) for f in ("float32", "int4") for i in ("pallas", "xla")}
  [loop] = details["rec_pipeline"]["tables"]["examples/s"]
  assert loop["data"] == "synthetic:gen=device" and loop["source"] == "DeviceSynthetic"
  # decode: auto (xla_decode on CPU) and the split-key kernel (interpreted), side by side
  assert [t["part"] for t in rep["targets"]].count("decode") == 2
  assert [r["attention_impl"] for r in details["decode"]["tables"]["decode"]] == [
      "auto", "pallas_decode"]
  assert "== attention" in stdout


def test_help_says_what_the_suite_runs():
  """The entry point's docstring (its --help) gives the default suite's dry run exactly."""
  import experiments.gpu_report.__main__ as entry
  doc = " ".join(entry.__doc__.replace("\\\n", " ").split())
  assert ("python -m experiments.gpu_report --dry_run " + " ".join(parts.SUITE_DRY_RUN)) in doc


def test_row_errors_finds_every_error():
  """Errors in rows no target is judged on (a Triton row, an XLA gather) count too."""
  rep = {"parts": {"attention": {"status": "ok", "details": {"rows": [
      {"impl": "cudnn", "fwd_ms": 1.0}, {"impl": "triton", "head_dim": 128,
                                         "error": "ValueError: no"}]}},
                   "fp8": {"status": "failed", "error": "KeyError: x", "details": {}}},
         "targets": [report_lib.judged("decode", "b1", None, error="RuntimeError: y").__dict__,
                     report_lib.judged("decode", "b8", None, skipped="budget").__dict__]}
  assert report_lib.row_errors(rep) == [
      "attention: details/rows[1] impl=triton, head_dim=128: ValueError: no",
      "fp8: the part failed: KeyError: x", "decode: b1: failed: RuntimeError: y"]
  rep["parts"] = {"a": {"status": "ok", "details": {"rows": [{"impl": "x", "ms": 1.0}]}}}
  rep["targets"] = []
  assert report_lib.row_errors(rep) == []


def test_a_bad_case_flag_ends_in_one_line(tmp_path):
  """A case flag naming nothing the part runs is refused before any part starts."""
  out = forkserver.run([sys.executable, "-m", "experiments.gpu_report", "--dry_run",
                        f"--out={tmp_path}", "--pipeline_data=synthetic,synthetic:gen=gpu"],
                       cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
      "error: --pipeline_data: 'synthetic:gen=gpu'; expected synthetic forms (synthetic, "
      "synthetic_deep, with options such as gen=device), criteo_bin:gen or criteo_bin:DIR")
  assert not (tmp_path / "report.md").exists()


def test_a_nan_budget_is_refused(tmp_path):
  """A budget of nan (every comparison with it false) would turn the budget checks off: the
  report's and a part's are refused like 0, naming the flag."""
  import experiments.gpu_report.__main__ as entry
  from core import errors
  with pytest.raises(errors.UserError, match="--part_budgets: 'decode:nan'; expected"):
    entry.parse_budgets(["decode:nan"], parts.PARTS)
  out = forkserver.run([sys.executable, "-m", "experiments.gpu_report", "--dry_run",
                        f"--out={tmp_path}", "--parts=decode", "--budget_s=nan"],
                       cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == "error: --budget_s: nan; expected > 0"
  assert not (tmp_path / "report.md").exists()


@pytest.mark.slow   # about 4 minutes of CPU; test_dry_run_takes_the_gpu_code_paths is its
# default-suite part. Run it (`pytest -m slow tests/experiments/test_gpu_report.py`)
# before a GPU round.
def test_dry_run_runs_every_part(tmp_path):
  """The whole report at toy sizes on CPU: every part runs, every target row has a figure
  or the reason it has none, report.md / report.json / logs are written."""
  stdout, summary = run_entry("experiments.gpu_report",
                              ["--dry_run", "--profile", f"--out={tmp_path}"], timeout=900)
  assert summary["dry_run"] and set(summary["parts"]) == set(parts.PARTS)
  assert set(summary["parts"].values()) == {"ok"}, summary
  rep = json.loads((tmp_path / "report.json").read_text())
  by_part = {}
  for t in rep["targets"]:
    by_part.setdefault(t["part"], []).append(t)
  assert set(by_part) == set(parts.PARTS)
  # What CPU can measure is measured; what it cannot says why.
  for t in rep["targets"]:
    assert t["status"] in ("met", "missed", "info") or (
        t["part"] == "lm_train" and t["status"] == "unmeasured" and "no peak" in t["detail"]), t
  assert report_lib.row_errors(rep) == [] and summary["errors"] == 0
  assert len(by_part["attention"]) == 2 and len(by_part["lm_train"]) == 4
  assert "the program of auto" in rep["parts"]["lm_train"]["details"]["results"]["xla/none"][
      "note"]
  assert len(by_part["decode"]) == 2 and len(by_part["embedding_bag"]) == 10
  assert len(by_part["quant_decode"]) == 2 and all(        # int8 and int4, each a ratio
      t["status"] in ("met", "missed") for t in by_part["quant_decode"])
  loops = rep["parts"]["rec_pipeline"]["details"]["tables"]["examples/s"]
  assert [r["source"] for r in loops][0] == "DeviceSynthetic" and len(loops) == 2
  # The fp8 part's bf16 step is the mlperf part's step (same batch, tables, dtype).
  assert rep["parts"]["fp8"]["details"]["times"]["bf16"]["step_ms"] == pytest.approx(
      rep["parts"]["mlperf"]["details"]["step_ms"])
  assert {t["status"] for t in by_part["pytest_suite"]} == {"met"}
  assert rep["parts"]["pytest_suite"]["details"]["pytest"]["counts"]["passed"] == 1
  assert rep["parts"]["pytest_gpu"]["details"]["pytest"]["counts"]["skipped"] == 1
  md = (tmp_path / "report.md").read_text()
  assert "DRY RUN" in md and md.count("\n| ") >= len(rep["targets"])
  for name in parts.PARTS:
    assert (tmp_path / "logs" / f"{name}.log").exists()
    assert rep["parts"][name]["wall_s"] >= rep["parts"][name]["compile_s"] >= 0
  assert "== attention" in stdout
  # --profile: a traced case of each profiling part, summarized (XLA:CPU ops here).
  prof = [rep["parts"]["decode"]["details"]["profiles"]["batch 1"],
          rep["parts"]["lm_train"]["details"]["results"]["auto/none"]["profile"],
          rep["parts"]["rec_pipeline"]["details"]["profiles"]["criteo_bin:gen, 1 data worker"],
          rep["parts"]["mlperf"]["details"]["profile"],
          rep["parts"]["fp8"]["details"]["times"]["fp8"]["profile"]]
  for p in prof:
    assert p["kernels"] > 0 and p["top"] and 0 < p["busy_ms"] <= p["span_ms"] + 1e-6, p
  assert "## decode: profile batch 1" in md and "## mlperf: profile bf16 step" in md
  assert list((tmp_path / "logs").glob("profile_decode_b1/**/perfetto_trace.json.gz"))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_attention_part_on_gpu(tmp_path):
  """On a GPU: the attention part at a small shape compiles and times Mosaic GPU, Triton and
  cuDNN, and judges the Mosaic GPU kernel against cuDNN."""
  sizes = parts.Sizes.gpu(fa_head_dims=(128,), fa_seq_lens=(1024,), fa_tokens=2048,
                          fa_causal=(True,))
  ctx = report_lib.Context(sizes=sizes, dry_run=False, out_dir=str(tmp_path))
  out = parts.part_attention(ctx)
  rows = out["details"]["rows"]
  assert not [r for r in rows if "error" in r], rows
  assert {t["status"] if isinstance(t, dict) else t.status for t in out["targets"]} <= {
      "met", "missed"}
