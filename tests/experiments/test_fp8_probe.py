"""experiments.fp8_probe: the probe's bookkeeping on a small model (probe.py), and the
entry point end to end on a tiny DLRM: probe table, trained variants, step times,
results.json, plot and the JSON summary line. The end-to-end run is slow (it compiles a
train step per variant): CI skips it; tests/rec/test_fp8.py covers the FP8 layer fast."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.fp8_probe import probe as fp8_probe
from rec import configs
from rec.models import dlrm
from tests.experiments.entry import run_entry, run_refused


@pytest.mark.slow
def test_runs_end_to_end(tmp_path):
  stdout, summary = run_entry(
      "experiments.fp8_probe",
      [f"--workdir={tmp_path}", "--models=dlrm:small", "--steps=4", "--batch_size=64",
       "--eval_batch_size=128", "--eval_batches=1", "--num_rows=200",
       "--variants=fp32,bf16,fp8_delayed", "--probe_recipes=row", "--probe_batches=1",
       "--timing_steps=1", "--timing_repeats=1", "--max_logloss_increase=1.0"])
  (label, m), = summary["models"].items()
  assert label == "dlrm:small"
  # A threshold of 100% makes every layer safe, so no fp8_safe variant is added.
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  model = res["models"][0]
  names = model["fp8_layer_names"]
  assert m["safe_layers"] == ",".join(names)
  assert set(model["variants"]) == {"fp32", "bf16", "fp8_delayed"}
  assert {f"{v}_auc" for v in model["variants"]} <= set(m)
  probe, = model["probes"]
  assert [r["layer"] for r in probe["layers"]] == names and probe["recipe"] == "row"
  assert set(model["step_times"]["variants"]) == {"fp32", "bf16", "fp8_delayed"}
  assert os.path.getsize(tmp_path / "fp8_probe.png") > 10_000
  assert "out SQNR" in stdout and "FP8 emulated" in stdout


def _small_dlrm():
  """(cfg, model config, task, untrained state, eval source) of a small DLRM on one device."""
  cfg = configs.make_run(model="dlrm", preset="small", data="synthetic", num_rows=200,
                         batch_size=64, eval_batch_size=256, eval_batches=1, mesh="data:1")
  task, train_src, eval_src, _, _ = configs.build_run(cfg, devices=jax.devices()[:1])
  mcfg = dataclasses.replace(configs.model_config(cfg, train_src.spec), top_mlp=(1,),
                             bottom_mlp=(16,), embedding_dim=16)
  task.model_fn = lambda rngs: dlrm.DLRM(mcfg, rngs)
  state = {"params": nnx.to_pure_dict(nnx.state(dlrm.DLRM(mcfg, nnx.Rngs(0)))),
           "emb": task.collection.init(jax.random.key(1))}
  return cfg, mcfg, task, state, eval_src


def test_probe_on_a_small_model():
  """The probe's rows: one per layer plus all, errors in the range FP8 gives; an untrained
  model keeps every layer's log loss within a percent; safe = under the threshold."""
  cfg, mcfg, task, state, eval_src = _small_dlrm()
  trained = fp8_probe.Trained(cfg, mcfg, task, state, eval_src, {})
  inputs = fp8_probe.eval_inputs(trained, 1)
  rep = fp8_probe.probe(trained, "row", inputs=inputs, progress=lambda s: None)
  assert [r["layer"] for r in rep["layers"]] == ["bottom_mlp.0", "top_mlp.0"]
  assert rep["examples"] == 256 and rep["all"]["layer"] == "all"
  for r in rep["layers"]:
    assert 15 < r["out_sqnr_db"] < 45 and 5 < r["grad_sqnr_db"] < 60, r
    assert abs(r["rel_logloss"]) < 0.01
  assert set(rep["all"]["out_sqnr_db_by_layer"]) == {"bottom_mlp.0", "top_mlp.0"}
  safe = [r["layer"] for r in rep["layers"] if r["rel_logloss"] <= rep["max_logloss_increase"]]
  assert rep["safe_layers"] == ",".join(safe)
  assert "bottom_mlp.0" in fp8_probe.format_probe(rep)
  with pytest.raises(ValueError, match="recipe='delayed' needs a trained amax history"):
    fp8_probe.probe(trained, "delayed", inputs=inputs)


@pytest.mark.parametrize("flag, error", [
    ("--probe_recipes=tensor,rwo", "--probe_recipes=tensor,rwo: unknown ['rwo']"),
    ("--probe_recipes=delayed", "--probe_recipes=delayed: unknown ['delayed']"),
    ("--models=dlrm:small,dcnv2:huge", "--models=dlrm:small,dcnv2:huge: dcnv2:huge: "),
])
def test_entry_point_refuses_bad_settings_before_training(tmp_path, flag, error):
  """A bad probe scaling or model preset is one line naming the flag before the first
  reference model trains (not after it, naming no flag or --preset)."""
  out = run_refused("experiments.fp8_probe", [f"--workdir={tmp_path}", "--steps=2", flag])
  assert out.stderr.strip().splitlines()[-1].startswith("error: " + error)
  assert "reference run" not in out.stdout


def test_entry_point_refuses_an_earlier_studys_runs_before_training(tmp_path):
  """A rerun into the same --workdir would delete the earlier study's runs (rec.runs
  replaces each run directory): one line names a run directory that holds one, before the
  first reference model trains."""
  old = tmp_path / "dlrm_small" / "bf16" / "runs" / "dlrm_small_s0"
  old.mkdir(parents=True)
  (old / "metrics.jsonl").write_text("{}\n")
  out = run_refused("experiments.fp8_probe", [f"--workdir={tmp_path}", "--steps=2",
                                              "--models=dlrm:small", "--variants=fp32,bf16"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {old}: holds an earlier run (metrics.jsonl); expected a fresh run directory "
      "(one run per workdir, never replaced): choose a fresh --workdir, or delete it to "
      "train again")
  assert "reference run" not in out.stdout and (old / "metrics.jsonl").read_text() == "{}\n"


def test_plot_without_an_fp32_variant(tmp_path):
  """--variants without fp32 (e.g. bf16,fp8_tensor): the plot draws each variant's log loss
  itself, rather than raising KeyError 'fp32' after every variant has trained (and before
  results.json is written)."""
  row = {"logloss_mean": 0.62, "logloss_std": 0.01, "auc_mean": 0.6, "auc_std": 0.01,
         "wall_seconds_mean": 1.0}
  for variants in ({"bf16": row, "fp8_tensor": row}, {"fp32": row, "fp8_row": row}):
    path = str(tmp_path / f"{'_'.join(variants)}.png")
    fp8_probe.plot({"models": [{"label": "dlrm:small", "probes": [], "variants": variants}]},
                   path)
    assert os.path.getsize(path) > 0
  assert "d AUC" in fp8_probe.format_variants({"bf16": row})


class _Source:
  """An eval source of fixed host batches."""

  def __init__(self, batches):
    self._batches = batches

  def batches(self, start):
    return iter(self._batches[start:])


def test_probe_leaves_out_padding_rows():
  """A last eval batch padded with mask-0 rows (as file data's is: dense 0, id 0) gives the
  probe of its real rows alone: the logit and layer-output SQNRs weigh no mask, and FP8's
  per-tensor scale is taken over the whole tensor, so padding rows would enter all three
  (the Criteo sample's 800 eval rows in one batch of 2048 are 61% padding). An all-padding
  batch is skipped."""
  cfg, mcfg, task, state, eval_src = _small_dlrm()
  full = next(iter(eval_src.batches(0)))
  n = 200
  real = dataclasses.replace(full, **{k: np.asarray(getattr(full, k))[:n] for k in
                                      ("dense", "ids", "lengths", "labels", "mask")})
  pad = lambda x, v: np.concatenate([x[:n], np.full_like(x[n:], v)])
  padded = dataclasses.replace(
      full, dense=pad(np.asarray(full.dense), 0), ids=pad(np.asarray(full.ids), 0),
      lengths=pad(np.asarray(full.lengths), 1), labels=pad(np.asarray(full.labels), 0),
      mask=pad(np.asarray(full.mask), 0))
  empty = dataclasses.replace(padded, mask=np.zeros_like(padded.mask))
  reps = []
  for batches in ([real], [padded, empty]):
    trained = fp8_probe.Trained(cfg, mcfg, task, state, _Source(batches), {})
    inputs = fp8_probe.eval_inputs(trained)
    assert len(inputs) == 1 and inputs[0][0].shape[0] == n
    reps.append(fp8_probe.probe(trained, "tensor", layers=["bottom_mlp.0"], inputs=inputs,
                                progress=lambda s: None))
  a, b = reps
  assert a["examples"] == b["examples"] == n
  # The same rows through the same programs: equal up to float32 rounding of the sums.
  for ra, rb in zip(a["layers"] + [a["all"]], b["layers"] + [b["all"]]):
    for k in ("logit_sqnr_db", "out_sqnr_db", "grad_sqnr_db", "d_logloss"):
      if k in ra:
        assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-9), (ra["layer"], k)


def test_step_times_interleave_the_variants_repeats(monkeypatch):
  """The variants' timed repeats take turns (fp32 bf16 fp32 bf16 ...), one repeat of
  `steps` calls at a time: timed back to back, a drift in the machine's speed between the
  first variant's repeats and the next's would go into their ratio."""
  calls = []
  real = fp8_probe.benchmark.time_steps

  def spy(step, state, steps, repeats, warmup=1):
    calls.append((step, steps, repeats, warmup))
    return real(step, state, steps, repeats, warmup)

  monkeypatch.setattr(fp8_probe.benchmark, "time_steps", spy)
  cfg = configs.make_run(model="dlrm", preset="small", data="synthetic", num_rows=200,
                         batch_size=64)
  out = fp8_probe.step_times(cfg, {"fp32": {}, "bf16": {"dtype": "bfloat16"}}, steps=2,
                             repeats=3)
  assert [(s, r, w) for _, s, r, w in calls] == [(2, 1, 0)] * 6
  fns = [c[0] for c in calls]
  assert fns[0] is not fns[1] and fns == fns[:2] * 3
  assert all(len(v["per_repeat_s"]) == 3 for v in out["variants"].values())
