"""experiments/wlb_packing.py end to end on a small stream (FLOP cost model, no timing)."""

import json
import os

from llm.packing.cost import CostModel
from tests.experiments.entry import run_entry


def test_wlb_packing_end_to_end(tmp_path):
  cost = tmp_path / "cost.json"
  stdout, summary = run_entry(
      "experiments.wlb_packing",
      [f"--workdir={tmp_path}", "--cost_model=flops", f"--save_cost_model={cost}",
       "--context=8192", "--steps=16", "--windows=1,2", "--queues=1,2", "--cp=4", "--cp_steps=1",
       "--tile_q=32", "--tile_kv=32", "--doc_median=256", "--tail_min=2048",
       "--tail_prob=0.02"], timeout=300)
  assert set(summary) >= {"original", "fixed_greedy_1", "fixed_greedy_2", "wlb_1q", "wlb_2q",
                          "wlb_2q_delay", "cp_original_sequence", "cp_original_document"}
  assert "original" in stdout and "paper" in stdout
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  assert [r["name"] for r in res["rows"]][0] == "original" and res["rows"][0]["paper"] == 1.44
  assert os.path.getsize(tmp_path / "wlb_packing.png") > 1000
  assert CostModel.load(str(cost)).meta["source"] == "flops"
