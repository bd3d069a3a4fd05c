"""experiments.scaleacross: the step-time model against the one-site model and the CP
model's link terms, a tiny plan computed by hand, bad cluster files, the entry point."""

import copy
import json
import os
import sys

import pytest

from core import hardware
from experiments.cp_model import perf_model as pm
from experiments.scaleacross import cluster as cl
from experiments.scaleacross import model, search, study
from llm import cost
from llm.config import get_config
from tests.experiments.entry import REPO, run_entry
from tests import forkserver

NV = {"gbps": 3600, "latency_us": 10, "efficiency": 0.8}
NET = {"gbps": 400, "latency_us": 50.75, "efficiency": 0.5686}   # core.hardware's SendRecv fit


def raw(levels, baseline, **kw):
  d = {"name": "t", "levels": levels,
       "gpu": {"bf16_tflops": 989, "hbm_gib": 80, "hbm_tbps": 3.35},
       "model": {"preset": "llama3_70b", "seq_len": 8192, "global_batch_tokens": 8192 * 64},
       "baseline": baseline}
  d.update(kw)
  return copy.deepcopy(d)


def one_and_two_sites(plan):
  """The same 256 GPUs as one site of 32 hosts, and as two sites of 16 hosts joined by a
  link equal to the fabric."""
  one = cl.parse(raw([{"name": "nvlink", "size": 8, "link": NV},
                      {"name": "fabric", "size": 32, "link": NET}], plan), "one.json")
  two = cl.parse(raw([{"name": "nvlink", "size": 8, "link": NV},
                      {"name": "fabric", "size": 16, "link": NET},
                      {"name": "site", "size": 2, "link": dict(NET)}], plan), "two.json")
  return one, two


PLANS = [
    dict(tp=8, pp=8, fsdp=4, dp=1, v=2, placement=["tp", "cp", "fsdp", "pp", "dp"]),
    dict(tp=8, pp=4, fsdp=4, dp=2, v=1, placement=["tp", "fsdp", "pp", "dp", "cp"]),
    dict(tp=4, cp=2, pp=8, fsdp=4, placement=["tp", "pp", "fsdp", "cp", "dp"]),
    dict(tp=8, pp=16, dp=2, overlap=False, placement=["tp", "pp", "dp", "cp", "fsdp"]),
]


def assert_same_step(plan):
  cfg = get_config("llama3_70b")
  one, two = one_and_two_sites(plan)
  a = model.step_time(one, one.baseline, cfg, 0.6)
  b = model.step_time(two, two.baseline, cfg, 0.6)
  assert "infeasible" not in a
  for k in ("total", "compute", "tp_comm", "cp_exposed", "pp_p2p_exposed", "bubble",
            "sync_exposed", "update"):
    assert b[k] == pytest.approx(a[k], rel=1e-12, abs=1e-15), k
  assert b["sync_s"] == pytest.approx(a["sync_s"], rel=1e-12)
  # The breakdown adds up to the step.
  assert sum(b[k] for k in study.BREAKDOWN) == pytest.approx(b["total"], rel=1e-12)
  return two


@pytest.mark.parametrize("plan", PLANS)
def test_two_sites_collapse_to_one_site_flat_rings(plan):
  two = assert_same_step(dict(plan, hierarchical=False))
  assert any(model.crosses(two, two.baseline)["site"])


@pytest.mark.parametrize("plan", [PLANS[1], PLANS[3]])
def test_two_sites_collapse_to_one_site_hierarchical(plan):
  """Hierarchical collectives too, where each group spans one level (a group over both the
  fabric and the site link reduces in two rings, 2 + 2 (f - 1) latencies against one ring's
  2 (2 f - 1): the bytes agree, the latencies do not)."""
  two = assert_same_step(dict(plan, hierarchical=True))
  for g in model.geometry(two, two.baseline).values():
    assert sum(g.factor(i) > 1 for i in range(3)) <= 1


def test_slower_site_link_only_slows_what_crosses_it():
  cfg = get_config("llama3_70b")
  plan = dict(tp=8, pp=8, fsdp=4, v=2, placement=["tp", "fsdp", "cp", "dp", "pp"])
  one, two = one_and_two_sites(plan)
  slow = copy.deepcopy(two.raw)
  slow["levels"][2]["link"] = {"gbps": 10, "latency_us": 5000}
  slow = cl.parse(slow, "slow.json")
  a = model.step_time(two, two.baseline, cfg, 0.6)
  b = model.step_time(slow, slow.baseline, cfg, 0.6)
  assert model.crosses(slow, slow.baseline)["site"] == ["pp"]
  assert b["pp_p2p_exposed"] > a["pp_p2p_exposed"] and b["total"] > a["total"]
  assert b["sync_s"] == a["sync_s"] and b["tp_comm"] == a["tp_comm"]


def test_cp_ring_across_sites_is_the_cp_models_sendrecv():
  """CP2 between two sites whose link is the CP paper's inter-host line: one ring step's
  SendRecv equals experiments.cp_model's (both through core.hardware's link terms)."""
  cfg = get_config("llama3_405b")
  _, two = one_and_two_sites(dict(tp=8, cp=2, pp=4, fsdp=4,
                                  placement=["tp", "pp", "fsdp", "dp", "cp"]))
  geo = model.geometry(two, two.baseline)
  assert geo["cp"].factor(2) == 2 and geo["cp"].factor(1) == 1
  for tokens in (8192, 131072):
    msg = cost.ring_message_bytes(cfg, tokens, 0, cp=2, tp=8)["kv"]
    ours = model.ring_step_s(msg, geo["cp"], two, two.baseline)
    theirs = pm.ring_step_times(cfg, tokens, 0, cp=2, tp=8)["sendrecv"]
    assert ours == pytest.approx(theirs, rel=1e-12)
    eff, hw = hardware.Efficiency(), hardware.Hardware()
    assert theirs == pytest.approx(eff.sendrecv_latency_s + msg / (eff.sendrecv *
                                                                   hw.net_bytes_per_s))


def tiny(hierarchical):
  """4 GPUs: 2 per host (8 Gb/s, 1 us), 2 sites (0.8 Gb/s, 1 ms); the tiny Llama, DP4."""
  return cl.parse({
      "levels": [{"name": "host", "size": 2, "link": {"gbps": 8, "latency_us": 1}},
                 {"name": "site", "size": 2, "link": {"gbps": 0.8, "latency_us": 1000}}],
      "gpu": {"bf16_tflops": 1, "hbm_gib": 80, "hbm_tbps": 1},
      "model": {"preset": "tiny", "seq_len": 16, "global_batch_tokens": 64},
      "baseline": {"dp": 4, "overlap": False, "hierarchical": hierarchical}}, "tiny.json")


@pytest.mark.parametrize("hierarchical", [True, False])
def test_tiny_plan_by_hand(hierarchical):
  c = tiny(hierarchical)
  got = model.step_time(c, c.baseline, get_config("tiny"), 0.5)
  # tiny: V 256, D 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 128; one 16-token sequence
  # per GPU (m = 1). Forward FLOPs: per layer 2 * (64*16*(2*4 + 2*2) + 3*64*128) * 16 =
  # 1,179,648 projections + 4*16*4*(16*17/2) = 34,816 attention; head 2*256*64*16 = 524,288.
  fwd = 2 * (1179648 + 34816) + 524288
  rate = 1e12 * 0.5
  compute = 3 * fwd / rate                                      # forward + 2x backward
  params = 256 * 64 * 2 + 2 * (12288 + 24576 + 128) + 64        # 106,816
  grad = 4 * params
  if hierarchical:   # all-reduce in the host (2 ranks), then across the sites (2 ranks)
    sync = 2 * (1e-6 + grad / 2 / 1e9) + 2 * (1e-3 + grad / 4 / 1e8)
  else:              # one ring of 4: 6 steps of grad / 4, each waiting for the site link
    sync = 6 * (1e-3 + grad / 4 / 1e8)
  update = params * 32 / 1e12
  assert got["microbatches"] == 1
  assert got["compute"] == pytest.approx(compute, rel=1e-12)
  assert got["sync_s"]["dp_all_reduce"] == pytest.approx(sync, rel=1e-12)
  assert got["total"] == pytest.approx(compute + sync + update, rel=1e-12)
  want_tf = get_config("tiny").flops_per_token(16) * 64 / got["total"] / 4 / 1e12
  assert got["tflops_per_gpu"] == pytest.approx(want_tf)


def test_compression_and_flows_act_on_windowed_links_only():
  base = tiny(True).raw
  wan = copy.deepcopy(base)
  wan["levels"][1]["link"]["window_mib"] = 0.001     # ~1 KB per flow in flight
  cfg = get_config("tiny")
  times = {}
  for comp, flows in ((1, 1), (4, 1), (1, 8)):
    for name, r in (("lan", base), ("wan", wan)):
      r = dict(r, baseline=dict(r["baseline"], compression=comp, flows=flows))
      c = cl.parse(r, f"{name}.json")
      times[name, comp, flows] = model.step_time(c, c.baseline, cfg, 0.5)["sync_s"]["dp_all_reduce"]
  assert times["lan", 4, 1] == times["lan", 1, 1] == times["lan", 1, 8]
  assert times["wan", 4, 1] < times["wan", 1, 1] and times["wan", 1, 8] < times["wan", 1, 1]


def write(tmp_path, name, d):
  p = tmp_path / name
  p.write_text(json.dumps(d))
  return str(p)


def good():
  return raw([{"name": "nvlink", "size": 8, "link": NV},
              {"name": "fabric", "size": 4, "link": NET},
              {"name": "site", "size": 2, "link": {"gbps": 100, "latency_us": 2000}}],
             {"tp": 8, "pp": 4, "dp": 2})


@pytest.mark.parametrize("edit, where, what", [
    (lambda d: d["levels"][2].pop("link"), "levels[2].link", "missing"),
    (lambda d: d["levels"][1]["link"].pop("gbps"), "levels[1].link", "'gbps' missing"),
    (lambda d: d["levels"][2]["link"].update(gbps=-5), "levels[2].link.gbps", "-5"),
    (lambda d: d["levels"][0]["link"].update(latency_us=-1), "levels[0].link.latency_us", "-1"),
    (lambda d: d["baseline"].update(tp=3, dp=2), "baseline.tp", "3 does not divide the 64"),
    (lambda d: d["baseline"].update(dp=4), "baseline", "tp*cp*pp*fsdp*dp = 128"),
    (lambda d: d["baseline"].update(placement=["tp", "pp"]), "baseline.placement", "['tp', 'pp']"),
    (lambda d: d["model"].update(preset="llama9"), "model.preset", "'llama9'"),
    (lambda d: d["search"].update(pp=[0]), "search.pp", "0"),
    (lambda d: d["baseline"].update(overlap="yes"), "baseline.overlap", "'yes'"),
    (lambda d: d["baseline"].update(tpp=2), "baseline", "unknown keys ['tpp']"),
])
def test_bad_cluster_file_names_file_and_key(tmp_path, edit, where, what):
  d = good()
  d.setdefault("search", {})
  edit(d)
  path = write(tmp_path, "bad_cluster.json", d)
  with pytest.raises(ValueError) as e:
    cl.load(path)
  msg = str(e.value)
  assert msg.startswith("bad_cluster.json: ") and where in msg and what in msg, msg


def test_good_file_loads(tmp_path):
  c = cl.load(write(tmp_path, "ok.json", good()))
  assert c.devices == 64 and c.unit_sizes() == (1, 8, 32, 64)
  assert [l.name for l in c.links] == ["nvlink", "fabric", "site"]


def test_shipped_clusters_load_and_search_spaces_are_distinct():
  d = os.path.join(REPO, "experiments", "scaleacross", "clusters")
  names = sorted(os.listdir(d))
  assert {"two_buildings.json", "two_regions.json", "llama3_16k.json"} <= set(names)
  for n in names:
    c = cl.load(os.path.join(d, n))
    assert c.devices == 16384 and c.preset == "llama3_405b"
  c = cl.load(os.path.join(d, "two_buildings.json"))
  ps = search.plans(c, get_config(c.preset))
  assert len(ps) == len(set(ps)) > 0


def test_table4_fit_reproduces_the_fitted_row():
  ref = cl.load(study.REFERENCE_CLUSTER)
  cfg = get_config(ref.preset)
  eff = study.fit_compute_efficiency(ref, cfg)
  rows = study.published_check(ref, cfg, eff)
  assert 0 < eff <= 1 and rows[0]["model_tflops"] == pytest.approx(430.0, rel=1e-6)
  assert [r["paper_tflops"] for r in rows] == [430.0, 400.0, 380.0]
  assert all(abs(r["rel_err"]) < 0.2 for r in rows)


def small_cluster(tmp_path):
  d = good()
  d["search"] = {"tp": [4, 8], "cp": [1], "pp": [2, 4], "v": [1, 2],
                 "hierarchical": [True, False], "flows": [1, 4], "compression": [1, 2]}
  d["levels"][2]["link"]["window_mib"] = 4
  return write(tmp_path, "small.json", d)


def test_entry_point(tmp_path):
  path = small_cluster(tmp_path)
  stdout, summary = run_entry("experiments.scaleacross",
                              [f"--cluster={path}", f"--workdir={tmp_path / 'run'}"],
                              timeout=300)
  res = json.loads((tmp_path / "run" / "results.json").read_text())
  assert (tmp_path / "run" / "design_space.png").stat().st_size > 0
  assert summary["cluster"] == "t" and summary["plans_feasible"] == res["plans_feasible"] > 0
  best, base = res["best"]["step_s"], res["baseline"]["step_s"]
  assert best <= base and best == min(d["step_s"] for d in res["design_space"] + [res["baseline"]])
  assert summary["best_speedup"] == pytest.approx(base / best, rel=1e-3)
  single = res["best_single_change"]
  assert single["step_s"] == min(e["step_s"] for e in res["single_change_by_group"].values())
  assert "Table 4" in stdout and "baseline" in stdout


def test_sweep_more_bandwidth_never_slows(tmp_path):
  """More bandwidth on the site link never slows the baseline or the best plan."""
  sweep = study.sweep_outer_link(cl.load(small_cluster(tmp_path)), 0.6, [1, 4, 1000])
  assert [r["outer_gbps"] for r in sweep] == [1, 4, 1000]
  for a, b in zip(sweep, sweep[1:]):
    assert b["baseline_step_s"] <= a["baseline_step_s"] and b["best_step_s"] <= a["best_step_s"]
  assert sweep[0]["baseline_step_s"] > sweep[-1]["baseline_step_s"]


def test_entry_point_bad_file_is_one_error_line(tmp_path):
  d = good()
  del d["levels"][1]["link"]
  path = write(tmp_path, "broken.json", d)
  out = forkserver.run([sys.executable, "-m", "experiments.scaleacross", f"--cluster={path}",
                        f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2
  assert "error: broken.json: levels[1].link: missing" in (out.stdout + out.stderr)


def test_sweep_table_prints_a_bandwidth_with_no_feasible_single_change():
  """sweep_outer_link stores None where no single change of the baseline fits (as
  format_table does for best_single_change); the sweep's table says so instead of failing
  on the None after the whole sweep has run."""
  row = {"outer_gbps": 800.0, "baseline_step_s": 7.8, "best_step_s": 6.0, "best_speedup": 1.3,
         "best_plan": "tp8 pp16", "single_group": None, "single_speedup": None,
         "placement_network_speedup": None}
  lines = study.format_sweep([row, {**row, "single_group": "v", "single_speedup": 1.15}],
                             "region").splitlines()
  assert lines[1].split()[5:7] == ["none", "tp8"]
  assert lines[2].split()[5] == "v:1.150"
