"""experiments.wlb_packing: the study's numbers recomputed by hand from the packed
micro-batches (workload imbalance, token delay, CP rank imbalance of visible pairs), the
paper's Table 2 values carried beside ours, the stream's termination, and the entry point end
to end on a small stream (FLOP cost model, no timing)."""

import itertools
import json
import math
import os

import numpy as np
import pytest

from experiments.wlb_packing import study
from llm.config import get_config
from llm.packing import packers as P
from llm.packing.cost import CostModel, Shape, flop_cost_model
from llm.packing.lengths import LengthDist
from tests.experiments.entry import run_entry

# The paper's Table 2 (arXiv 2503.17924; Llama 7B, 128K context), imbalance degree.
TABLE2 = {"original": 1.44, "fixed_greedy_1": 1.41, "fixed_greedy_2": 1.22,
          "fixed_greedy_4": 1.11, "fixed_greedy_8": 1.08, "wlb_1q": 1.24, "wlb_2q": 1.05,
          "wlb_3q": 1.05}


def _workload(lengths, cost: CostModel, what="total") -> float:
  """W of one micro-batch from the cost model's five coefficients, in plain Python."""
  a, b, c = cost.attn_quad, cost.attn_lin, cost.attn_const
  attn = sum(a * l * l + b * l + c for l in lengths)
  if what == "attention":
    return attn
  if what == "tokens":
    return float(sum(lengths))
  return attn + cost.lin_per_token * sum(lengths) + cost.lin_const


def _imbalance(steps, lengths, cost, what="total") -> float:
  """Mean over steps of max / mean of the micro-batches' workloads."""
  out = []
  for step in steps:
    w = [_workload([int(lengths[i]) for i in mb], cost, what) for mb in step]
    mean = sum(w) / len(w)
    out.append(max(w) / mean if mean > 0 else 1.0)
  return sum(out) / len(out)


def _sequence_pairs_imbalance(doc_lengths, n) -> float:
  """Rank imbalance of visible (query, key) pairs when a row is cut into 2n chunks and rank r
  holds chunks r and 2n-1-r: a query at position p of its document sees p + 1 keys."""
  total = sum(doc_lengths)
  t = math.ceil(max(total, 1) / (2 * n)) * 2 * n
  w = [p + 1 for l in doc_lengths for p in range(l)] + [0] * (t - total)
  c = t // (2 * n)
  ranks = [sum(w[r * c:(r + 1) * c]) + sum(w[(2 * n - 1 - r) * c:(2 * n - r) * c])
           for r in range(n)]
  return max(ranks) / (sum(ranks) / n)


def _delay(steps, arrivals, lengths) -> float:
  """Token-weighted mean of (step trained - step arrived), over documents that arrived."""
  arrived = {i: g for g, a in enumerate(arrivals) for i in a}
  placed = {i: s for s, step in enumerate(steps) for mb in step for i in mb}
  end = len(steps)
  num = sum(int(lengths[i]) * max(placed.get(i, end) - g, 0) for i, g in arrived.items())
  return num / sum(int(lengths[i]) for i in arrived)


SMALL = study.StudyConfig(dist=LengthDist(context=4096, median=128, sigma=1.0, tail_prob=0.02,
                                          tail_min=1024),
                          micro_batches=4, steps=8, windows=(1, 2), queues=(1, 2), cp=4,
                          cp_steps=1, tile_q=32, tile_kv=32)
SMALL_COST = flop_cost_model(Shape(64, 2, 1, 32, 128))


@pytest.fixture(scope="module")
def small():
  return study.run_study(SMALL, SMALL_COST)


def test_study_runs_every_row(small):
  res = small
  names = [r["name"] for r in res["rows"]]
  assert names == ["original", "fixed_greedy_1", "fixed_greedy_2", "wlb_1q", "wlb_2q"]
  assert all(r["imbalance"] >= 1 for r in res["rows"])
  assert {r["name"]: r["paper"] for r in res["rows"]} == {n: TABLE2[n] for n in names}
  # The paper's packing time beside ours (the "pack ms" column), in the table and results.
  assert res["paper_wlb_pack_ms"] == (8.0, 23.0)
  assert "paper's WLB-LLM packing time: 8-23 ms per global batch" in study.format_table(res)
  # Every row's numbers, recomputed by hand from the micro-batches the packers produced.
  lengths, orig = study.stream(SMALL)
  arrivals = [[i for mb in s for i in mb] for s in orig]
  steps = {"original": orig}
  for k in SMALL.windows:
    steps[f"fixed_greedy_{k}"] = P.simulate("g", lengths, arrivals, packer=P.FixedGreedyPacker(
        seq_len=4096, micro_batches=4, window=k, cost=SMALL_COST)).steps
  for q in SMALL.queues:
    steps[f"wlb_{q}q"] = P.simulate("w", lengths, arrivals, packer=P.WLBPacker(
        micro_batches=4, max_len=4096, cost=SMALL_COST,
        outlier_thresholds=SMALL.thresholds(q))).steps
  for r in res["rows"]:
    s = steps[r["name"]]
    assert r["steps"] == len(s) == 8
    for key, what in (("imbalance", "total"), ("imbalance_attention", "attention"),
                      ("imbalance_tokens", "tokens")):
      assert r[key] == pytest.approx(_imbalance(s, lengths, SMALL_COST, what), rel=1e-12), \
          (r["name"], key)
    assert r["mean_delay_steps"] == pytest.approx(_delay(s, arrivals, lengths), rel=1e-12)
  assert res["rows"][0]["mean_delay_steps"] == 0.0      # the loader's own order
  # Balancing helps: more greedy window, lower imbalance; WLB below the original.
  imb = {r["name"]: r["imbalance"] for r in res["rows"]}
  assert imb["fixed_greedy_2"] < imb["original"] and imb["wlb_2q"] < imb["original"]
  for name, c in res["cp"].items():
    mbs = [[int(lengths[i]) for i in mb] for step in steps[name][:SMALL.cp_steps] for mb in step
           if mb]
    assert c["micro_batches"] == len(mbs)
    want = sum(_sequence_pairs_imbalance(m, SMALL.cp) for m in mbs) / len(mbs)
    assert c["pairs_imbalance"]["sequence"] == pytest.approx(want, rel=1e-12)
    assert c["pairs_imbalance"]["document"] <= c["pairs_imbalance"]["sequence"]
    assert c["pairs_imbalance"]["document"] < 1.01        # every document split evenly
    assert c["tile_time"]["adaptive"] <= min(c["tile_time"]["sequence"],
                                             c["tile_time"]["document"])
    assert sum(c["chosen"].values()) == len(mbs)


def test_stream_fills_the_steps_and_bad_configs_are_refused():
  lengths, orig = study.stream(SMALL)
  assert len(orig) == SMALL.steps and all(len(s) == SMALL.micro_batches for s in orig)
  seqs = [mb for s in orig for mb in s]
  assert [i for mb in seqs for i in mb] == list(range(sum(len(mb) for mb in seqs)))
  assert all(lengths[mb].sum() <= 4096 for mb in seqs)
  for field, value in (("steps", 0), ("micro_batches", 0), ("cp_steps", 0), ("windows", (0,))):
    with pytest.raises(ValueError, match=f"{field}(\\[0\\])?': 0"):
      study.StudyConfig(**{field: value})
  with pytest.raises(ValueError, match="steps=6 is not a multiple of windows \\[4\\]"):
    study.StudyConfig(steps=6, windows=(1, 2, 4))
  with pytest.raises(ValueError, match="4 outlier queues"):
    study.StudyConfig(queues=(4,))
  with pytest.raises(ValueError, match="outlier_fractions"):
    study.StudyConfig(outlier_fractions=(0.5, 0.5))


def test_wlb_packing_end_to_end(tmp_path):
  cost = tmp_path / "cost.json"
  args = dict(context=8192, steps=16, windows="1,2", queues="1,2", cp=4, cp_steps=1, tile_q=32,
              tile_kv=32, doc_median=256, tail_min=2048, tail_prob=0.02, train_steps=2)
  stdout, summary = run_entry(
      "experiments.wlb_packing",
      [f"--workdir={tmp_path}", "--cost_model=flops", f"--save_cost_model={cost}"]
      + [f"--{k}={v}" for k, v in args.items()], timeout=300)
  assert set(summary) >= {"original", "fixed_greedy_1", "fixed_greedy_2", "wlb_1q", "wlb_2q",
                          "wlb_2q_delay", "cp_original_sequence", "cp_original_document"}
  assert "original" in stdout and "paper" in stdout
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  assert [r["name"] for r in res["rows"]][0] == "original" and res["rows"][0]["paper"] == 1.44
  assert os.path.getsize(tmp_path / "wlb_packing.png") > 1000
  assert os.path.getsize(tmp_path / "wlb_training.png") > 1000
  assert summary["train_original_sequence_speedup"] == 1.0 and len(res["training"]) == 9
  # The FLOP cost model of Llama 3 8B's layer (H 32, G 8, K 128, D 4096, F 14336), by hand:
  # attention 3 x 4 H K l^2 / 2 (forward + backward), linear 3 x 2 x layer weights per token.
  model = CostModel.load(str(cost))
  assert model.meta["source"] == "flops"
  assert model.attn_quad == 6 * 32 * 128 and model.attn_lin == model.attn_const == 0
  weights = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336
  assert model.lin_per_token == 3 * 2 * weights and model.lin_const == 0
  # The original packing's imbalance and CP rank imbalance, by hand from the same stream.
  cfg = study.StudyConfig(
      dist=LengthDist(context=8192, median=256, tail_min=2048, tail_prob=0.02), steps=16,
      windows=(1, 2), queues=(1, 2), cp=4, cp_steps=1, tile_q=32, tile_kv=32)
  lengths, orig = study.stream(cfg)
  assert summary["original"] == round(_imbalance(orig, lengths, model), 3)
  mbs = [[int(lengths[i]) for i in mb] for mb in orig[0]]
  assert summary["cp_original_sequence"] == round(
      sum(_sequence_pairs_imbalance(m, 4) for m in mbs) / len(mbs), 3)
  share = np.mean([_workload([int(lengths[i]) for i in mb], model, "attention")
                   / _workload([int(lengths[i]) for i in mb], model) for s in orig for mb in s])
  assert summary["attention_share"] == round(float(share), 3)


def test_flop_cost_model_matches_llm_cost():
  from llm import cost as llm_cost
  cfg = get_config("llama3_8b")
  assert Shape.from_config(cfg).linear_flops_per_token == llm_cost.linear_flops_per_token(cfg)


def test_training_grid_equals_an_independent_count():
  """Every cell of the training grid (train_lm's source and meter, host only) against plain
  numpy over the same batches: pairs per (micro-batch, rank) after the model's entry
  balancing (chunk i and 2N-1-i of the row, by index), their max / mean, the cost model's
  slowest (micro-batch, rank) time and the speedup over the first cell."""
  from experiments.wlb_packing import training
  from llm.packing.cp_shard import TileModel
  from llm.packing.lengths import CorpusLengths
  from llm.packing.source import PackedSource, PackingSpec
  t, n, m, steps = 256, 4, 4, 3
  cost = CostModel(attn_quad=2.0, attn_lin=1.0, attn_const=5.0, lin_per_token=3.0,
                   lin_const=7.0)
  rows = training.train_grid(context=t, micro_batches=m, cp=n, steps=steps, cost=cost,
                             n_layers=2, tile=TileModel(16, 16), seed=1)
  assert [(r["packing"], r["layout"]) for r in rows][:4] == [
      ("original", "sequence"), ("original", "document"), ("original", "adaptive"),
      ("fixed", "sequence")] and len(rows) == 9
  c = t // (2 * n)
  slots = np.concatenate([np.arange(k * c, (k + 1) * c)
                          for i in range(n) for k in (i, 2 * n - 1 - i)])
  base = None
  for row in rows:
    src = PackedSource(np.zeros(t + 1, np.int32), CorpusLengths(context=t),
                       PackingSpec(packing=row["packing"], layout=row["layout"]), seq_len=t,
                       batch_size=m, cp=n, cost=cost, seed=1, tile_model=TileModel(16, 16))
    mb, cp, step, tokens = [], [], [], 0
    for batch in itertools.islice(src.batches(0), steps):
      seg, pos = batch.segment_ids[:, slots], batch.positions[:, slots]
      w = np.where(seg != 0, pos + 1, 0).reshape(m, n, -1).sum(-1)
      mb.append(w.sum(1).max() / w.sum(1).mean())
      cp.append(w.sum(0).max() / w.sum(0).mean())
      worst = 0.0
      for b in range(m):
        s_r, p_r = seg[b].reshape(n, -1), pos[b].reshape(n, -1)
        for q in range(n):
          attn = 0.0
          for d in set(s_r[q].tolist()) - {0}:
            l = int(np.sum(seg[b] == d))
            held = float(np.sum(np.where(s_r[q] == d, p_r[q] + 1, 0)))
            attn += (2.0 * l * l + l + 5.0) * held / (l * (l + 1) / 2)
          worst = max(worst, attn + 3.0 * int(np.sum(s_r[q] != 0)) + 7.0)
      step.append(2 * worst)
      tokens += int(np.sum(seg != 0))
    assert row["imbalance_mb"] == pytest.approx(np.mean(mb), rel=1e-9)
    assert row["imbalance_cp"] == pytest.approx(np.mean(cp), rel=1e-9)
    assert row["model_step"] == pytest.approx(np.mean(step), rel=1e-9)
    throughput = tokens / sum(step)
    base = base or throughput
    assert row["speedup"] == pytest.approx(throughput / base, rel=1e-9)
  cells = {(r["packing"], r["layout"]): r for r in rows}
  assert cells[("original", "document")]["imbalance_cp"] < cells[("original", "sequence")][
      "imbalance_cp"]


@pytest.mark.parametrize("args, want", [
    (["--outlier_fractions=0.5,abc"], "flag --outlier_fractions=['0.5', 'abc']: expected "
                                      "fractions of the context in (0, 1]"),
    (["--fit_dtype=f32"], "flag --fit_dtype=f32: value should be one of "
                          "<float32|bfloat16|float16>"),
    (["--cost_model=fit", "--fit_impl=nope"], "error: --fit_impl='nope': expected one of "),
    (["--cost_model=fit", "--measure_kv_heads=3"],
     "error: --measure_heads=4 --measure_kv_heads=3: query heads not a multiple of the KV "
     "heads; expected --measure_heads a multiple of --measure_kv_heads"),
    (["--cost_model=fit", "--fit_tokens=256"], "error: --fit_tokens=256: 1 distinct value(s); "
                                               "expected at least 2, one per coefficient"),
    (["--target=llama7b"], "error: --target=llama7b: not an llm.config preset; expected one "
                           "of byte_small, "),
    (["--cost_model=nope.json"], "error: --cost_model=nope.json: no such file; expected "
                                 "'flops', 'fit' or a CostModel JSON file"),
    (["--context=1004", "--min_len=1"],
     "error: --context=1004 with --cp=4 and --train_steps=2: the training grid's per-document "
     "CP layout cuts every row into 2 x 4 chunks; expected a multiple of 8"),
    (["--queues=1,1"], "error: --queues=1,1: 1 twice (two rows of one name); expected each "
                       "value once"),
    (["--windows=2,2"], "error: --windows=2,2: 2 twice"),
    (["--cp_steps=9"], "error: --cp_steps=9: more global batches than the stream has; expected "
                       "at most --steps=8"),
])
def test_bad_settings_are_refused_before_the_fit_and_the_study(tmp_path, args, want):
  """One message naming the flag before the cost model is timed or the study runs (else
  these end in tracebacks, name no flag, fail after the study, or print two rows of one
  name)."""
  from tests.experiments.entry import run_refused
  out = run_refused("experiments.wlb_packing", [
      "--cost_model=flops", "--context=4096", "--steps=8", "--windows=1,2", "--cp=4",
      "--cp_steps=1", "--train_steps=2", "--doc_median=256", "--tail_min=1024", *args,
      f"--workdir={tmp_path / 'w'}"])
  assert want in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert not os.listdir(tmp_path / "w") if (tmp_path / "w").exists() else True


def test_no_outlier_queues_need_no_fractions():
  from types import SimpleNamespace

  from experiments.wlb_packing.__main__ import build_config
  f = SimpleNamespace(min_len=16, context=4096, windows=["1"], queues=[], steps=4,
                      outlier_fractions=[], max_len_factor=1.0, train_steps=0, cp=4,
                      doc_median=256.0, doc_sigma=1.0, tail_prob=0.0, tail_min=1024.0,
                      tail_alpha=1.5, micro_batches=4, cp_steps=1, tile_q=32, tile_kv=32, seed=0)
  cfg = build_config(f)   # an IndexError before
  assert cfg.queues == () and cfg.outlier_fractions == ()
