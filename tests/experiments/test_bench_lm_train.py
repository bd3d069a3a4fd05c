"""experiments.bench_lm_train: the tiny preset end to end on CPU, and the peak table
(core.benchmark.PEAK_FLOPS)."""

import json
import os
import sys

import pytest

from core import benchmark
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_peak_table():
  assert benchmark.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
  assert benchmark.peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert benchmark.peak_flops("NVIDIA H200", "bfloat16") == 989e12
  assert benchmark.peak_flops("cpu", "bfloat16") is None


@pytest.mark.slow   # an entry point end to end; CI's default suite keeps to its time
def test_tiny_preset_runs_with_breakdown(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=cpu_env.xla_flags(2))
  out = forkserver.run(
      [sys.executable, "-m", "experiments.bench_lm_train", "--preset=tiny", "--seq_len=32",
       "--batch=2", "--mesh=data:2", "--remat=dots", "--steps=1", "--repeats=1", "--warmup=0",
       "--mu_dtype=bfloat16", "--xla_dump", f"--workdir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  summary = json.loads(lines[-1])
  assert summary["mfu"] is None and summary["attention_resolved"] == "xla"
  assert summary["remat"] == "dots" and summary["tokens_per_s"] > 0
  assert any("MFU: no peak FLOP/s known for 'cpu'" in line for line in lines)
  res = json.loads((tmp_path / "results.json").read_text())
  parts = res["breakdown_ms"]
  assert {"forward", "forward+backward", "no-attention forward+backward", "optimizer",
          "loss head forward+backward"} <= set(parts)
  assert all(v > 0 for k, v in parts.items() if k != "attention (by difference)")
  assert (tmp_path / "step.hlo.txt").exists() and (tmp_path / "xla_dump").is_dir()


# --- --compare: LoRA / QLoRA against full fine-tuning (experiments.benchmarks.lm_train)

RANK = 4


def tiny_config(layers=1):
  from llm.config import get_config
  return get_config("tiny", dtype="float32", attention_impl="xla", n_layers=layers)


def host_weights(cfg):
  """Float32 contract weights drawn with numpy (no init program to compile): N(0, 1/fan_in)
  matrices, unit norms."""
  import numpy as np
  from llm.weights import param_shapes
  rng = np.random.default_rng(0)
  return {n: (np.ones(s, np.float32) if len(s) == 1 else
              (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32))
          for n, s in param_shapes(cfg).items()}


@pytest.fixture(scope="module")
def compared():
  """Full fine-tuning and LoRA on a one-layer tiny Llama, in this process on one device
  (float32 compute, so both step-0 losses are the same model's); the int8 / int4 bases run
  in test_compare_runs_as_an_entry_point (slow: two more compiles)."""
  import jax
  from experiments.benchmarks import lm_train
  from llm import lora as lora_lib
  cfg = tiny_config()
  lora = lora_lib.LoraConfig(RANK, 8.0, ("attention", "mlp"))
  res = lm_train.compare_finetuning(cfg, lora, variants=("full", "lora"),
                                    weights=host_weights(cfg), seq_len=16, batch=2,
                                    devices=jax.devices()[:1], loss_chunk=0, steps=1,
                                    repeats=2, warmup=0)
  return cfg, res


def lora_params_by_formula(cfg, rank):
  """r (in + out) per adapted projection: wq D -> HK, wk / wv D -> GK, wo HK -> D, w_gate /
  w_up D -> F, w_down F -> D, in every layer."""
  d, hk, gk, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
  per_layer = (d + hk) + 2 * (d + gk) + (hk + d) + 2 * (d + f) + (f + d)
  return cfg.n_layers * rank * per_layer


def check_counts(cfg, res, rank, lora_variants):
  """Trainable parameters and AdamW's state (float32 moments: 8 bytes per trained
  parameter, plus the same step counters) of full fine-tuning and each LoRA variant."""
  rows = res["variants"]
  n_lora = lora_params_by_formula(cfg, rank)
  n_full = cfg.num_params()
  assert rows["full"]["trainable_params"] == n_full
  counters = rows["full"]["optimizer_state_bytes"] - 8 * n_full
  assert 0 <= counters < 64
  for v in lora_variants:
    assert rows[v]["trainable_params"] == n_lora, v
    assert rows[v]["adapter_bytes"] == 4 * n_lora, v
    assert rows[v]["optimizer_state_bytes"] == 8 * n_lora + counters, v
    assert rows[v]["optimizer_state_bytes"] < rows["full"]["optimizer_state_bytes"], v
    assert res["ratios"][v]["optimizer_state_bytes"] == pytest.approx(
        (8 * n_lora + counters) / (8 * n_full + counters)), v


def test_lora_trains_what_the_rank_formula_gives(compared):
  cfg, res = compared
  assert res["order"] == ["full", "lora"] and res["lora"]["rank"] == RANK
  check_counts(cfg, res, RANK, ["lora"])
  rows = res["variants"]
  # The frozen base is held in the compute dtype: float32 here, as full's master weights.
  assert rows["full"]["param_bytes"] == rows["lora"]["param_bytes"] == 4 * cfg.num_params()


def test_both_start_from_the_same_model_and_are_measured(compared):
  import math
  _, res = compared
  rows = res["variants"]
  # B = 0: LoRA's step 0 is the base model's loss.
  assert rows["lora"]["loss_step0"] == pytest.approx(rows["full"]["loss_step0"], rel=1e-5)
  for v, r in rows.items():
    assert math.isfinite(r["loss_last"]), v
    assert len(r["step_ms_repeats"]) == 2 and r["tokens_per_s"] > 0
    for k in ("xla_argument_bytes", "xla_temp_bytes", "xla_output_bytes", "xla_total_bytes"):
      assert isinstance(r[k], int) and r[k] > 0, (v, k)
  # The step's arguments hold the state: the adapters' step passes far less than full's.
  assert rows["lora"]["xla_argument_bytes"] < rows["full"]["xla_argument_bytes"]


def test_the_table_and_the_plot(compared, tmp_path):
  from experiments.benchmarks import lm_train
  _, res = compared
  lines = lm_train.comparison_table(res).splitlines()
  assert lines[0].startswith("| variant | base held as | trainable params")
  assert [l.split("|")[1].strip() for l in lines[2:4]] == ["full", "lora"]
  assert lines[-1].split("|")[1].strip() == "lora" and lines[-3].startswith("| / full |")
  path = lm_train.plot_comparison(res, str(tmp_path / "compare.png"))
  assert os.path.getsize(path) > 10_000


def test_unknown_variants_are_refused():
  from experiments.benchmarks import lm_train
  with pytest.raises(ValueError, match=r"variants \['dora'\]; expected some of"):
    lm_train.compare_finetuning(tiny_config(), None, variants=("dora",), seq_len=8, batch=1)


@pytest.mark.slow   # an entry point end to end, four compiled steps
def test_compare_runs_as_an_entry_point(tmp_path):
  from llm.config import get_config
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run(
      [sys.executable, "-m", "experiments.bench_lm_train", "--compare=full,lora,qlora8,qlora4",
       "--preset=tiny", "--dtype=float32", "--seq_len=16", "--batch=2", "--lora_rank=2",
       "--steps=1", "--repeats=2", "--warmup=0", f"--workdir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["lora_optimizer_state_bytes"] < summary["full_optimizer_state_bytes"]
  assert {"lora_step_vs_full", "qlora8_step_vs_full", "qlora4_step_vs_full"} <= set(summary)
  res = json.loads((tmp_path / "results.json").read_text())
  assert res["order"] == ["full", "lora", "qlora8", "qlora4"] and res["lora"]["rank"] == 2
  assert res["lora"]["targets"] == ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
  check_counts(get_config("tiny"), res, 2, ["lora", "qlora8", "qlora4"])
  rows = res["variants"]
  # The base: float32 (the compute dtype), then int8 / int4 codes with their scales.
  assert rows["qlora4"]["param_bytes"] < rows["qlora8"]["param_bytes"] < rows["lora"]["param_bytes"]
  assert "16 int8" in rows["qlora8"]["base"] and "16 int4" in rows["qlora4"]["base"]
  assert rows["lora"]["loss_step0"] == pytest.approx(rows["full"]["loss_step0"], rel=1e-5)
  assert rows["qlora8"]["loss_step0"] == pytest.approx(rows["full"]["loss_step0"], rel=1e-2)
  assert rows["qlora4"]["loss_step0"] == pytest.approx(rows["full"]["loss_step0"], rel=5e-2)
  assert (tmp_path / "compare.png").exists() and "| qlora4 |" in out.stdout
  bad = forkserver.run(
      [sys.executable, "-m", "experiments.bench_lm_train", "--compare=full,lora",
       "--preset=tiny", "--breakdown", f"--workdir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2
  assert "error: --breakdown with --compare: a single-step measurement" in bad.stderr


@pytest.mark.parametrize("args, want", [
    (["--attention_impl=cudnn"], "error: --attention_impl=cudnn: no GPU with cuDNN flash "
                                 "attention here (backend cpu); expected --attention_impl=auto"),
    (["--loss_chunk=7"], "error: --loss_chunk=7: does not divide --seq_len=32; expected a "
                         "divisor of it, 0 (plain loss) or -1 (auto)"),
    (["--lora_rank=4"], "error: --lora_rank: given without a LoRA variant to read it "
                        "(--compare=); expected --compare with lora, qlora8 or qlora4"),
    (["--compare=full", "--lora_targets=mlp"], "error: --lora_targets: given without a LoRA "
                                               "variant to read it (--compare=full)"),
    (["--preset=nope"], "error: --preset=nope: unknown; expected one of byte_small, "),
])
def test_bad_settings_are_refused_before_compiling(tmp_path, args, want):
  """One line naming the flag, before a step compiles and before the workdir gets a file
  (else cuDNN off a GPU ends in a RuntimeError traceback while compiling, and LoRA settings
  without a LoRA variant are silently ignored)."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.bench_lm_train", [
      "--preset=tiny", "--seq_len=32", "--batch=2", "--steps=1", "--repeats=1", *args,
      f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1].startswith(want), out.stderr[-3000:]
  assert os.listdir(tmp_path / "w") == []
