"""experiments.spec_decode end to end on stories260K at toy sizes (slow: a subprocess that
distills a draft head and compiles every tree shape), then reruns: reusing the head, a changed
--draft_lr refused with a hint, and the hint followed."""

import json
import os
import sys

import pytest
from tests import forkserver
from tests.experiments.entry import run_refused
from tests.real_models import smollm2_gguf_or_skip

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("LLM_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
STORIES = os.path.join(DATA, "llama2c", "stories260K.bin")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(STORIES), reason=f"{STORIES} not found")
def test_spec_decode_entry(tmp_path):
  args = [f"--target=llama2c:{STORIES}", f"--workdir={tmp_path}", "--draft_steps=30",
          "--num_sequences=48", "--eval_sequences=8", "--seq_len=48", "--draft_batch=8",
          "--trees=chain:2,2:3:6", "--batch_sizes=1,2", "--max_new_tokens=12", "--repeats=1"]
  run = lambda *more: forkserver.run([sys.executable, "-m", "experiments.spec_decode", *args,
                                      *more], cwd=REPO, capture_output=True, text=True,
                                     timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  out = run()
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["greedy_match"] is True and set(summary["best"]["0"]) == {"1", "2"}
  # Counted per prompt: 4 greedy rows (2 trees x 2 batch sizes) of 8 prompts.
  assert summary["greedy_rows_equal"] == summary["greedy_rows"] == 32
  assert " 8/8\n" in out.stdout
  res = json.load(open(tmp_path / "results.json"))
  assert len(res["rows"]) == 4 and all(r["tokens_per_call"] >= 1.0 for r in res["rows"])
  for r in res["rows"]:
    # EAGLE's counts from the per-round log: each prompt's first token comes from the
    # prefill, each round adds its accepted drafts + 1; every prompt got 12 tokens.
    logs, new = r["accepted_per_round"], r["new_tokens"]
    # --bench_prompts (default 8) held-out prompts in batches of r["batch"].
    assert len(logs) == len(new) == r["prompts"] == 8 and new == [12] * 8
    assert all(1 + sum(a + 1 for a in log) >= 12 > 1 + sum(a + 1 for a in log[:-1])
               for log in logs)
    assert r["tokens_per_call"] == pytest.approx(
        sum(new) / sum(1 + len(log) for log in logs), rel=1e-12)
    assert r["accept_length"] == pytest.approx(
        sum(a + 1 for log in logs for a in log) / sum(len(log) for log in logs), rel=1e-12)
  assert (tmp_path / "spec_decode.png").exists()
  assert (tmp_path / "draft" / "checkpoints").is_dir()
  # A second run reuses the trained head (resumes a finished run: no training steps), here
  # decoding with a bfloat16 copy of it over the 64 most frequent tokens: still lossless.
  again = run("--draft_dtype=bfloat16", "--decode_vocab=64")
  assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-3000:]
  summary = json.loads(again.stdout.strip().splitlines()[-1])
  assert summary["greedy_match"] is True and summary["draft_vocab"] == 64
  assert summary["draft_dtype"] == "bfloat16"
  big = run("--decode_vocab=600")
  assert big.returncode == 2 and big.stderr.strip().splitlines()[-1] == (
      "error: --decode_vocab=600: the target's vocabulary has 512 tokens"), big.stderr[-3000:]
  # Another --draft_lr: refused, the hint naming flags spec_decode has; following it works.
  other = run("--draft_lr=0.001")
  assert other.returncode != 0
  assert "--resume_allow=distill.learning_rate" in other.stderr
  assert "distill.learning_rate is --draft_lr" in other.stderr
  allowed = run("--draft_lr=0.001", "--resume_allow=distill.learning_rate")
  assert allowed.returncode == 0 and "nothing to do" in allowed.stdout, allowed.stderr[-3000:]
  # Taps past the target's blocks: refused before anything is made, naming the flag.
  bad = run("--taps=1,99", f"--workdir={tmp_path / 'taps'}")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
      "error: --taps=1,99: blocks [99] are past the target's "), bad.stderr[-3000:]
  assert not (tmp_path / "taps" / "draft").exists()


# Sizes the target's config or prompts refuse, found before its weights load or the draft
# directory is made (not after the weights load, nor --trees= after training).
SMALL = ["--num_sequences=8", "--eval_sequences=2", "--bench_prompts=1", "--batch_sizes=1"]


@pytest.mark.skipif(not os.path.exists(STORIES), reason=f"{STORIES} not found")
@pytest.mark.parametrize("args, want", [
    (["--seq_len=513"], "error: --seq_len=513: longer than the target's max_seq_len=512; "
     "expected at most 512"),
    (["--bos_id=512"], "error: --bos_id=512: outside the target's vocabulary; expected an id "
     "below 512"),
    (["--trees="], "flag --trees=[]: expected shapes TOP_K:DEPTH:BUDGET"),
    (["--draft_vocab=513"], "error: --draft_vocab=513: the target's vocabulary has 512 tokens"),
    (["--draft_vocab=4", "--trees=chain:2,8:2:8"],
     "error: --draft_vocab=4: expected at least the largest top_k of --trees (8)"),
])
def test_spec_decode_refuses_before_the_target_loads(tmp_path, args, want):
  out = run_refused("experiments.spec_decode", [f"--target=llama2c:{STORIES}", *SMALL, *args,
                                                f"--workdir={tmp_path}"], timeout=60)
  # (absl's flag-parsing error is followed by a line pointing at --helpfull)
  assert any(want in line for line in out.stderr.strip().splitlines()[-2:]), out.stderr
  assert os.listdir(tmp_path) == []


@pytest.mark.models
def test_spec_decode_chat_requests_fit_seq_len_and_context(tmp_path):
  """The chat requests' lengths are checked against --seq_len (the training sequences) and,
  held out, with --max_new_tokens against the target's context, before anything is made."""
  target = f"--target=gguf:{smollm2_gguf_or_skip()}"
  for args, want in ((["--seq_len=20"], "error: --seq_len=20: not longer than the longest "
                      "prompt (46 tokens); expected a prompt and at least one more token"),
                     (["--max_new_tokens=8190"], "error: --max_new_tokens=8190: beyond the "
                      "target's max_seq_len=8192 after a held-out request of 40 tokens; "
                      "expected at most 8152")):
    out = run_refused("experiments.spec_decode", [target, "--chat_prompts", *SMALL, *args,
                                                  f"--workdir={tmp_path}"], timeout=60)
    assert out.stderr.strip().splitlines()[-1] == want
    assert os.listdir(tmp_path) == []


def test_bench_prompts_fill_every_batch():
  """A batch size that does not divide --bench_prompts is refused: its last, partial batch
  would be left out of the measurement (benchmark.compare drops it)."""
  import types

  from experiments.spec_decode import __main__ as spec
  ok = dict(eval_sequences=16, num_sequences=32, prompt_len=4, seq_len=8, prompt_text=None,
            chat_prompts=False, gen_prompt_len=8, batch_sizes=["1", "4"], bench_prompts=8,
            gen_temperature=1.0, draft_vocab=0, decode_vocab=0)
  spec.check_flags(types.SimpleNamespace(**ok))
  with pytest.raises(ValueError, match=r"^--bench_prompts=8: not a multiple of batch size 3 "
                     r"\(--batch_sizes\); expected a multiple of each"):
    spec.check_flags(types.SimpleNamespace(**{**ok, "batch_sizes": ["1", "3"]}))


def test_round_counts_pool_over_prompts():
  """Accept length and tokens per target call pooled over the prompts (the run recorded
  above: 8 prompts of 12 tokens at batch 1, one of them done in 4 rounds): 96 tokens over
  8 prefills + 76 rounds = 1.143 per call, below tau = 88 / 76. The former mean of
  per-prompt ratios gave 1.236, above tau (that one prompt's 2.4 counted as much as any)."""
  import types

  import numpy as np

  from experiments.spec_decode import benchmark
  logs = [[0] * 11, [0, 0, 0, 0, 2, 0, 0, 0, 0], [0] * 11, [0] * 11, [0] * 11, [2, 2, 2, 1],
          [0, 0, 0, 0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]]
  # Batch 2: four results of two rows each.
  results = [types.SimpleNamespace(tokens=[[7] * 12, [7] * 12],
                                   rounds=np.array([len(a), len(b)]),
                                   accepted=np.array([sum(a), sum(b)]))
             for a, b in zip(logs[::2], logs[1::2])]
  got = benchmark.round_counts(results)
  assert got["tokens_per_call"] == pytest.approx(96 / 84, rel=1e-12)
  assert got["accept_length"] == pytest.approx(88 / 76, rel=1e-12)
  assert got["tokens_per_call"] < got["accept_length"]


def test_compare_counts_the_greedy_rows_equal_to_plain(monkeypatch):
  """benchmark.compare checks greedy tokens per prompt: one prompt of four whose speculative
  tokens differ from plain decoding's gives 3 equal rows (greedy_match false); sampling
  rows carry no count."""
  import types

  import numpy as np

  from experiments.spec_decode import benchmark
  from llm.speculative import TreeShape
  prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
  plain = lambda target, g, n, **kw: [p + [9] * n for p in g]

  def spec(target, draft, g, n, **kw):
    toks = [p + [9] * n for p in g]
    if g[0] == [5, 6]:
      toks[0] = toks[0][:-1] + [0]     # the third prompt's last token differs
    return types.SimpleNamespace(tokens=toks, rounds=np.ones(len(g), int),
                                 accepted=np.full(len(g), n - 2), accepted_per_round=[[n - 2]])
  monkeypatch.setattr(benchmark, "generate", plain)
  monkeypatch.setattr(benchmark, "speculative_generate", spec)
  run = lambda **kw: benchmark.compare(None, None, prompts, 4, [TreeShape(2, 2, 3)], batch=2,
                                       repeats=1, progress=None, **kw)
  [row] = run()
  assert (row["greedy_rows_equal"], row["prompts"], row["greedy_match"]) == (3, 4, False)
  [row] = run(temperature=1.0)
  assert row["greedy_rows_equal"] is None and row["greedy_match"] is None


def test_profile_round_alternates_with_plain_steps():
  """benchmark.profile_round on a tiny target: every piece timed beside a plain step, its
  ratio and ms reported, round_x the sum of the round's ratios."""
  from flax import nnx

  from experiments.spec_decode import benchmark
  from llm.speculative import DraftHead, TreeShape
  from tests.llm.speculative.conftest import CFG
  from tests.llm.test_model import make_model

  target = make_model(CFG)[0]
  out = benchmark.profile_round(target, DraftHead(CFG, nnx.Rngs(0)), [1, 2, 3],
                                TreeShape(2, 2, 3), repeats=2, context=8)
  parts = ("verify", "draft_tree", "draft_catch_up", "accept", "commit")
  assert out["nodes"] == 4 and out["repeats"] == 2 and out["plain_step_ms"] > 0
  assert all(out[f"{k}_ms"] > 0 and out[f"{k}_x"] > 0 for k in parts + ("verify_nomask",))
  assert out["round_x"] == pytest.approx(sum(out[f"{k}_x"] for k in parts))
  assert out["round_ms"] == pytest.approx(sum(out[f"{k}_ms"] for k in parts))


def test_chat_prompts_are_distinct():
  """Greedy training replies (--gen_temperature=0) need one distinct request per sequence."""
  from experiments.spec_decode import prompts

  class Tok:
    vocab_size = 400

    def decode(self, ids):
      # 60 plain words: most templates use one or two of the three words, so 3000 plain
      # draws repeat about 1,200 times; only redrawing makes them distinct.
      return " " + "".join(chr(97 + (ids[0] // 26 ** k) % 26) for k in range(4)) \
          if ids[0] < 60 else "#"

  texts = prompts.instructions(Tok(), 3000, seed=0, pool=60)
  assert len(set(texts)) == len(texts) == 3000
