"""experiments.cp_model end to end; the perf model, llm.cost's counts and core.hardware's link
constants against hand-derived numbers and the paper's Table 5."""

import dataclasses
import json
import math

import pytest

from core import hardware
from experiments.cp_model import perf_model as pm
from experiments.cp_model import study
from llm import cost
from llm.config import get_config
from tests.experiments.entry import run_entry

CFG = get_config("llama3_405b")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("cp_model")
  stdout, summary = run_entry("experiments.cp_model",
                              [f"--workdir={workdir}", "--curve_points=30"], timeout=300)
  with open(workdir / "results.json") as f:
    res = json.load(f)
  return workdir, stdout, summary, res


def test_every_point_reported(run):
  workdir, stdout, summary, res = run
  names = {p["name"] for p in res["points"]}
  want = {f"full {c} " + ("TP8" if n == 1 else f"CP{n}") for c, n in study.PAPER_FULL}
  want |= {f"partial {100 * t / 128000:g}% {v}" for t in study.PAPER_PARTIAL_MS
           for v in ("pass_kv", "pass_q")}
  assert names == want and len(res["points"]) == len(want) == 38
  for p in res["points"]:
    assert p["model_ms"] > 0 and math.isfinite(p["model_ms"])
    assert p["rel_err"] == pytest.approx((p["model_ms"] - p["paper_ms"]) / p["paper_ms"])
    assert p["name"] in stdout
  calib = [p for p in res["points"] if p["calibration"]]
  assert [p["name"] for p in calib] == ["full 128K TP8"]
  assert calib[0]["model_ms"] == pytest.approx(42010.0, rel=1e-6)
  assert summary == res["summary"] and summary["n_predicted"] == 37
  assert 0 < summary["median_abs_rel_err"] <= summary["max_abs_rel_err"]
  assert (workdir / "full_prefill.png").stat().st_size > 0
  assert (workdir / "partial_prefill.png").stat().st_size > 0


def test_latency_falls_with_cp_ranks(run):
  _, _, _, res = run
  for key in ("128K_s", "1M_s"):
    curve = res["curves"]["full"][key]
    assert all(a > b for a, b in zip(curve, curve[1:])), (key, curve)
  pts = sorted((p for p in res["points"] if p["kind"] == "full" and p["context"] == "128K"),
               key=lambda p: p["cp"])
  assert [p["cp"] for p in pts] == [1, 2, 4, 8, 16]
  assert all(a["model_ms"] > b["model_ms"] for a, b in zip(pts, pts[1:]))


def test_crossover_between_1_and_100_percent(run):
  _, _, summary, res = run
  assert 0.01 < summary["crossover_miss_rate_model"] < 1.0
  assert summary["crossover_miss_rate_paper_bracket"] == [0.05, 0.10]
  assert 0.05 < summary["crossover_miss_rate_paper_interp"] < 0.10
  curve = res["curves"]["partial_cp4"]
  x = summary["crossover_miss_rate_model"]
  for m, kv, q in zip(curve["miss_rate"], curve["pass_kv_ms"], curve["pass_q_ms"]):
    if m < x * 0.9:
      assert kv > q, m      # pass-Q wins below the crossover ...
    elif m > x * 1.1:
      assert kv < q, m      # ... pass-KV above it
  # Algorithms 1 and 5 at the paper's peaks: T >= 4000 and T >= 3200 (hand computed).
  assert res["rules"]["alg1_peak"]["new_tokens"] == 4000
  assert res["rules"]["alg5_peak"]["new_tokens"] == 3200


def test_flops_match_paper_appendix_a():
  t = 10**6
  f = cost.prefill_flops(CFG, t)
  # App. A: ATTN = 1/2 * 4 * T^2 * D * layers (~4.1e18); GEMM = 2 * W * T with W = 405B (the
  # model's W counts the decoder layers only: 1% fewer).
  assert f["attn"] == pytest.approx(0.5 * 4 * t**2 * 16384 * 126, rel=1e-5)
  assert f["gemm"] == pytest.approx(2 * 405e9 * t, rel=0.015)


def test_single_host_variants_equal_and_ring_free():
  for t, p in ((131072, 0), (3200, 124800)):
    kv = pm.prefill_time(CFG, t, p, cp=1, variant="pass_kv")
    q = pm.prefill_time(CFG, t, p, cp=1, variant="pass_q")
    assert kv == q and kv.ring_exposed == kv.all2all == kv.merge == 0


def test_ring_step_against_hand_numbers():
  # CP4, T = 3200, P = 124800, per GPU: KV block 32000 tok * 1 head * 128 * 2 (K, V) * 2 B;
  # Q block 800 tok * 16 heads * 128 * 2 B; All2All 3 * 800 * 16 * (128 * 2 + 4) B.
  m = cost.ring_message_bytes(CFG, 3200, 124800, cp=4)
  assert m == {"kv": 16_384_000, "q": 3_276_800, "all2all": 9_984_000}
  # Attention per step: 4 * 128 * 16 * (3200 * 124800 + 3200 * 3201 / 2) / 16 FLOPs.
  r = pm.ring_step_times(CFG, 3200, 124800, cp=4, variant="pass_q")
  eff = hardware.Efficiency()
  assert r["attn"] == pytest.approx(
      4 * 128 * 16 * (3200 * 124800 + 3200 * 3201 / 2) / 16 / (eff.attn * 800e12))
  assert r["sendrecv"] * 1e6 == pytest.approx(166, abs=0.5)    # Table 5, fitted row
  assert r["all2all"] * 1e6 == pytest.approx(424, abs=0.5)


def test_link_defaults_are_the_table5_fit():
  fit = study.table5_links(CFG)
  eff = hardware.Efficiency()
  for k, v in fit.items():
    assert getattr(eff, k) == pytest.approx(v, rel=1e-3), k
  lat, rate = hardware.alpha_beta(1e6, 1e-3 + 1e6 / 2e10, 5e6, 1e-3 + 5e6 / 2e10)
  assert lat == pytest.approx(1e-3) and rate == pytest.approx(2e10)


def test_calibration_and_its_limits():
  eff = pm.calibrate_gemm(CFG, tokens=131072, measured_s=42.01)
  assert pm.prefill_time(CFG, 131072, eff=eff).total == pytest.approx(42.01, rel=1e-9)
  assert 0 < eff.gemm < 1
  with pytest.raises(ValueError, match="measured_s=1.0"):
    pm.calibrate_gemm(CFG, tokens=131072, measured_s=1.0)


def test_model_crossover_is_algorithm5_under_its_assumptions():
  # Strip the model to Algorithm 5's assumptions (no message latency, one link bandwidth for
  # SendRecv and All2All): its crossover lands on Algorithm 5's within 2% (the rest: the
  # causal T^2/2 pairs, the log-sum-exp bytes, D + 1 ~ D).
  for frac in (0.3, 1.0):
    eff = dataclasses.replace(hardware.Efficiency(), sendrecv=frac, all2all=frac,
                              sendrecv_latency_s=0.0, all2all_latency_s=0.0)
    model = pm.crossover_new_tokens(CFG, 128000, cp=4, eff=eff)
    rule = study.rule_crossover("alltoall", n_ranks=4, peak_flops=eff.attn * 800e12,
                                   bandwidth=frac * 50e9, n_heads=128, n_kv_heads=8)
    assert model == pytest.approx(rule, rel=0.02), frac


def test_gti_bandwidth_still_hides_pass_kv_up_to_cp4():
  # §4.2.1: on GTI hosts (TCP, ~3 GB/s achieved per rank) pass-KV still scales to 4 nodes.
  eff = dataclasses.replace(hardware.Efficiency(), sendrecv=3e9 / 50e9)
  for cp in (2, 4):
    assert pm.prefill_time(CFG, 131072, cp=cp, eff=eff).ring_exposed == 0
  assert pm.prefill_time(CFG, 131072, cp=8, eff=eff).ring_exposed > 0


@pytest.mark.parametrize("name", ["llama3_405b", "llama3_8b", "llama32_1b", "tiny_tied"])
def test_layer_counts_match_the_config_parameter_count(name):
  """llm.cost's per-layer weights against LlamaConfig.num_params, counted independently."""
  cfg = get_config(name)
  per_layer = sum(cost.layer_linear_params(cfg).values())
  embed = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
  norms = cfg.n_layers * 2 * cfg.dim + cfg.dim
  assert cfg.n_layers * per_layer == cfg.num_params() - embed - norms
  assert cost.linear_flops_per_token(cfg) == 2 * per_layer
  assert cost.prefill_flops(cfg, 1000)["gemm"] == 2 * per_layer * 1000 * cfg.n_layers


def test_heads_per_gpu():
  # 405B on TP8: 128 / 8 = 16 query heads and one of the 8 KV heads per GPU; past 8 GPUs the
  # KV heads are replicated (one per GPU).
  assert cost.tp_heads(CFG, 8) == (16, 1) and cost.tp_heads(CFG, 16) == (8, 1)
  assert cost.tp_heads(CFG, 4) == (32, 2)
  with pytest.raises(ValueError, match="tp=3; expected a divisor of n_heads=128"):
    cost.tp_heads(CFG, 3)
