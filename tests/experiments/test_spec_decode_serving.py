"""experiments.spec_decode.serving's pieces on a tiny target: a draft-head run's held-out
requests and draft vocabulary read back from its workdir, then the plain and the speculative
engine on the same requests closed loop (replies equal by request, accept lengths counted,
the table's speedups the rounds' ratios, the plot written); the entry point's refusals before
the target loads."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from core.errors import UserError
from experiments.spec_decode import serving as study
from llm import weights as W
from llm.serving.config import EngineConfig
from llm.serving.engine import Engine, SamplingParams
from llm.serving.programs import load_draft
from llm.speculative import distill
from tests.experiments.entry import run_refused
from tests.llm.speculative.conftest import CFG, V
from tests.llm.test_model import make_model

PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 1], [2, 5, 7], [6, 6]]


@pytest.fixture(scope="module")
def target():
  return make_model(CFG)[0]


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
  """(workdir, draft vocabulary) of a one-step head run over 4 distinct prompts' sequences,
  2 held out, its vocabulary the 5 most frequent tokens of the training rows."""
  workdir = str(tmp_path_factory.mktemp("head"))
  dcfg = distill.DistillConfig(num_sequences=6, eval_sequences=2, seq_len=10, gen_batch=6,
                               batch_size=2, steps=1, draft_vocab=5)
  vocab = distill.train_draft(target, workdir, dcfg, prompts=PROMPTS, stop_tokens=(0,))[3]
  return workdir, vocab


def test_held_out_requests_and_vocab_read_back(target, run, tmp_path):
  workdir, vocab = run
  assert len(vocab) == 5
  np.testing.assert_array_equal(distill.load_draft_vocab(workdir, V), vocab)
  # Fewer than it trained on: the most frequent of the same counts (FR-Spec).
  fewer = distill.load_draft_vocab(workdir, V, 2)
  assert len(fewer) == 2 and set(fewer) <= set(vocab)
  with pytest.raises(ValueError, match=r"size=6 for the draft head of '.*'; expected 0 "
                     r"\(the run's own: 5\) up to 5"):
    distill.load_draft_vocab(workdir, V, 6)
  # Through the serving path the refusal names the flags.
  with pytest.raises(UserError, match=rf"^--decode_vocab=6 for the draft head of "
                     rf"--draft={re.escape(workdir)}; expected 0 \(the run's own: 5\)"):
    load_draft(workdir, target, 6)
  head, got = load_draft(workdir, target, 2)
  np.testing.assert_array_equal(got, fewer)
  assert head.cfg.dim == CFG.dim
  assert load_draft("", target) == (None, None)

  prompts, stop = study.held_out_requests(workdir, 2, 4)
  assert prompts == PROMPTS[4:] and stop == (0,)
  # A run whose prompts repeat (sampled from BOS): the held-out sequences' first tokens.
  tokens = np.arange(24, dtype=np.int32).reshape(4, 6) % V
  key = json.dumps({"num": 4, "prompts": [[1]], "stop": []})
  bos = str(tmp_path / "bos")
  distill._save_partial(os.path.join(bos, "sequences.npz"), key, 4, tokens=tokens,
                        mask=np.ones_like(tokens, np.float32))
  assert study.held_out_requests(bos, 2, 3) == (tokens[2:, :3].tolist(), ())
  distill._save_partial(os.path.join(bos, "sequences.npz"), key, 3, tokens=tokens,
                        mask=np.ones_like(tokens, np.float32))
  with pytest.raises(ValueError, match="3 of 4 sequences"):
    study.held_out_requests(bos, 2, 3)


def test_plain_and_speculative_engines_side_by_side(target, run, tmp_path):
  workdir, _ = run
  head, vocab = load_draft(workdir, target)
  cfg = EngineConfig(max_slots=2, block_size=8, prefill_chunk=8, max_model_len=24,
                     batch_widths=(2,), table_widths=(3,), speculative_tree="2:2:3")
  engines = {"plain": Engine(target, dataclasses.replace(cfg, speculative_tree="")),
             "eagle": Engine(target, cfg, draft=head, draft_vocab=vocab)}
  from llm.serving.runner import EngineRunner
  for e in engines.values():
    e.warmup()
  runners = {k: EngineRunner(e, max_queue=100).start() for k, e in engines.items()}
  reqs = [(p, SamplingParams(max_tokens=12, stop_token_ids=(0,))) for p in PROMPTS]
  try:
    points, replies = study.run_points(runners, engines, reqs, [1, 2], 2)
  finally:
    for r in runners.values():
      r.shutdown(drain_s=0)
  assert [(p["engine"], p["concurrency"], p["round"]) for p in points] == [
      (e, c, r) for r in range(2) for c in (1, 2) for e in ("plain", "eagle")]
  # Every engine, client count and round gave every request the same reply (greedy).
  first = replies["plain", 1, 0]
  assert sorted(first) == list(range(len(PROMPTS)))
  assert all(got == first for got in replies.values())
  assert all(1 <= len(ids) <= 12 for ids in first.values())
  ends = [ids[-1] == 0 for ids in first.values()]
  assert all(len(ids) == 12 or end for ids, end in zip(first.values(), ends))
  for p in points:
    # Warmed up (the draft head's weights come committed from its checkpoint, its caches
    # fresh: the engine places both alike, so nothing compiles while timed).
    assert p["compiles"] == 0
    assert p["failed"] == 0 and p["output_tokens"] == sum(len(i) for i in first.values())
    if p["engine"] == "eagle":
      assert p["spec_rounds"] > 0 and 1 <= p["accept_length"] <= 3
    else:
      assert p["accept_length"] is None and p["spec_rounds"] == 0
  rows = study.table(points, [1, 2], 2)
  by = {(p["engine"], p["concurrency"], p["round"]): p["throughput_tok_s"] for p in points}
  for row in rows:
    c = row["concurrency"]
    want = [by["eagle", c, r] / by["plain", c, r] for r in range(2)]
    assert row["speedup_per_round"] == pytest.approx(want, rel=1e-12)
    assert row["speedup"] == pytest.approx(np.median(want), rel=1e-12)
  path = study.plot(rows, str(tmp_path / "spec_serving.png"))
  assert os.path.getsize(path) > 1000


def test_serving_refuses_before_the_target_loads(run, tmp_path):
  """The decode vocabulary against the head's and the tree, --max_model_len against the
  requests and --draft's checkpoints, checked from the run's settings and the target's
  config alone (this target directory has no weights to load); a --draft without
  checkpoints is not made one."""
  workdir, _ = run
  target = tmp_path / "target"
  target.mkdir()
  (target / "config.json").write_text(json.dumps(W.config_to_hf(CFG)))
  base = [f"--checkpoint=hf:{target}", "--concurrency=1", "--max_new_tokens=4",
          "--speculative_tree=2:4:5", f"--workdir={tmp_path / 'w'}"]
  for args, want in (
      ([f"--draft={workdir}", "--decode_vocab=6"],
       "error: --decode_vocab=6: more tokens than the head trained on; expected at most 5 "
       "(0: the head's own)"),
      ([f"--draft={workdir}", "--decode_vocab=1"],
       "error: --decode_vocab=1: a draft vocabulary of 1 tokens; expected at least the top_k "
       "of --speculative_tree=2:4:5 (2)"),
      ([f"--draft={workdir}", "--max_model_len=6"],
       "error: --max_model_len=6: shorter than the longest request (3 prompt tokens + "
       "--max_new_tokens=4); expected at least 7"),
      ([f"--draft={tmp_path / 'none'}"], f"error: --draft={tmp_path / 'none'}: no draft-head "
       "checkpoint; expected a draft-head run's workdir")):
    out = run_refused("experiments.spec_decode.serving", base + args, timeout=60)
    assert out.stderr.strip().splitlines()[-1].startswith(want), out.stderr[-2000:]
  assert not (tmp_path / "none").exists()
  assert not (tmp_path / "w").exists() or os.listdir(tmp_path / "w") == []
