"""Draft-head distillation: the loss terms against numpy, training through core.train
improves the draft's agreement with the target, checkpoints load back, sources resume."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm.speculative import DraftHead, distill
from tests.llm.speculative.conftest import CFG, STEPS, V


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_terms_against_numpy(target, sequences):
  tokens, mask = sequences[0][:3, :10], sequences[1][:3, :10].copy()
  mask[2, 7:] = 0.0
  draft = DraftHead(CFG, nnx.Rngs(3))
  embed, head = np.asarray(target.embed[...]), np.asarray(target.lm_head[...])

  @jax.jit
  def run(tokens, mask):
    feats = target.hidden(target.embed_tokens(tokens))[0]
    pred = draft(feats[:, :-1], jnp.take(target.embed[...], tokens[:, 1:], axis=0))[0]
    return feats, pred, distill.distill_losses(draft, embed, head, False, tokens, mask, feats)

  feats, pred, (reg, ce, top1, m) = jax.tree.map(np.asarray, run(tokens, mask))
  d = np.abs(pred - feats[:, 1:])
  np.testing.assert_allclose(reg, np.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1), rtol=1e-5)
  lp_want, lp_pred = _np_log_softmax(feats[:, 1:] @ head), _np_log_softmax(pred @ head)
  np.testing.assert_allclose(ce, -(np.exp(lp_want) * lp_pred).sum(-1), rtol=1e-5)
  np.testing.assert_array_equal(top1, lp_want.argmax(-1) == lp_pred.argmax(-1))
  np.testing.assert_array_equal(m, mask[:, 1:] * mask[:, :-1])


def test_training_improves_agreement_and_checkpoints_load(distilled, draft):
  task, out, workdir, first = distilled
  assert out["step"] == STEPS and out["finished"]
  after = out["eval"]
  # Eval after training against the train metrics of the first 10 steps.
  assert first["step"] == 10 and after["top1"] > first["top1"] + 0.2 and after["top1"] > 0.6
  assert after["reg"] < 0.5 * first["reg"] and after["cls"] < first["cls"]
  want = nnx.to_pure_dict(nnx.state(task.draft(out["state"]["params"])))
  got = nnx.to_pure_dict(nnx.state(draft))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sequences_and_source(target, sequences):
  """Sequences continue their prompts, differ, and are a function of the seed (the same
  call as the fixture's: compiled once)."""
  tokens, mask = sequences
  assert tokens.shape == (128, 32) and mask.all() and tokens.max() < V
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, V, 3).tolist() for _ in range(32)]
  assert all(tokens[i, :3].tolist() == prompts[i % 32] for i in range(128))
  assert len({tuple(r) for r in tokens[:32, 3:].tolist()}) == 32
  again = distill.generate_sequences(target, 128, 32, prompts=prompts, batch_size=128)
  other = distill.generate_sequences(target, 128, 32, prompts=prompts, batch_size=128, seed=1)
  np.testing.assert_array_equal(again[0], tokens)
  assert (other[0][:, 3:] != tokens[:, 3:]).any()
  src = distill.SequenceSource(tokens, mask, 8, seed=1)
  it = src.batches(0)
  first = [next(it) for _ in range(3)]
  resumed = next(src.batches(2))
  np.testing.assert_array_equal(first[2].tokens, resumed.tokens)
  evals = list(distill.SequenceSource(tokens[:20], mask[:20], 8, split="eval").batches())
  assert len(evals) == 3 and evals[-1].mask[4:].sum() == 0 and evals[-1].mask[:4].all()


def test_draft_vocab_counts():
  tokens = np.array([[5, 1, 1, 3], [1, 3, 7, 7]], np.int32)
  mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)   # the last 7 is padding
  # counts: 1 x3, 3 x2, 5 x1, 7 x1; ties broken toward the lower id, result sorted.
  np.testing.assert_array_equal(distill.draft_vocab(tokens, mask, 3, 8), [1, 3, 5])
  np.testing.assert_array_equal(distill.draft_vocab(tokens, mask, 5, 8), [0, 1, 3, 5, 7])
  with pytest.raises(ValueError, match="size=9"):
    distill.draft_vocab(tokens, mask, 9, 8)


def test_cached_sequences_and_features_resume(target, tmp_path):
  """A killed generation continues from its last saved chunk to the same sequences; stop
  tokens end sequences (mask 0 after); the cached features are the target's."""
  prompts = [[1, 2], [3], [4, 5, 6], [7]]
  dcfg = distill.DistillConfig(num_sequences=8, eval_sequences=2, seq_len=12, gen_batch=4)
  path = str(tmp_path / "seq.npz")
  full = distill.cached_sequences(target, path, prompts, dcfg, stop_tokens=(0,))
  tokens, mask = full
  for row, m in zip(tokens, mask):
    n = int(m.sum())
    assert m[:n].all() and not m[n:].any()
    assert 0 not in row[:n - 1].tolist() and (n == 12 or row[n - 1] == 0)
  assert (mask.sum(1) < 12).any()          # some sequence stopped at token 0
  # A run killed after the first chunk: only rows < 4 saved; the rerun makes the rest.
  part = str(tmp_path / "part.npz")
  distill.cached_sequences(target, part, prompts, dcfg, stop_tokens=(0,))
  with np.load(part) as f:
    saved = {k: f[k] for k in f.files}
  saved["done"] = np.asarray(4)
  saved["tokens"][4:] = 0
  np.savez(part, **saved)
  again = distill.cached_sequences(target, part, prompts, dcfg, stop_tokens=(0,))
  np.testing.assert_array_equal(again[0], tokens)
  feats = distill.cached_features(target, str(tmp_path / "f.npz"), tokens, batch_size=3)
  want = np.asarray(target.hidden(target.embed_tokens(jnp.asarray(tokens)))[0])
  np.testing.assert_allclose(feats, want, rtol=1e-5, atol=1e-5)



def test_cached_data_is_the_targets_own(target, tmp_path):
  """A workdir's sequences and features are keyed by the target that made them: another
  checkpoint of the same config (other weights; a fine-tune, --overwrite in the same
  workdir) makes its own instead of training on the first target's."""
  from tests.llm.test_model import make_model
  other = make_model(CFG, seed=1)[0]
  assert distill.target_fingerprint(other) != distill.target_fingerprint(target)
  assert distill.target_fingerprint(target) == distill.target_fingerprint(target)
  prompts = [[1, 2], [3]]
  dcfg = distill.DistillConfig(num_sequences=4, eval_sequences=1, seq_len=8, gen_batch=4)
  path = str(tmp_path / "seq.npz")
  mine = distill.cached_sequences(target, path, prompts, dcfg)
  theirs = distill.cached_sequences(other, path, prompts, dcfg)
  fresh = distill.cached_sequences(other, str(tmp_path / "fresh.npz"), prompts, dcfg)
  np.testing.assert_array_equal(theirs[0], fresh[0])
  assert not np.array_equal(theirs[0], mine[0])
  fp = str(tmp_path / "f.npz")
  distill.cached_features(target, fp, mine[0])
  got = distill.cached_features(other, fp, mine[0])
  want = np.asarray(other.hidden(other.embed_tokens(jnp.asarray(mine[0])))[0])
  # the same forward pass in float32 at a different batching: rounding only
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

def test_unrolled_steps_match_decoding(target, sequences):
  """`unrolled_predictions` against the head run as in decoding: step 1 is the causal head
  (the plain loss's predictions); step s at pair p equals committing pairs <= p-s+1 into the
  head's KV cache, then feeding it its own prediction s-1 times, one pair per call. 19
  pairs: more queries than a decode step, so the unrolled steps' masked attention is the
  dense one (`llm.attention.masked.dense_masked`), checked here against decode steps."""
  tokens = jnp.asarray(sequences[0][:2, :20])
  draft = DraftHead(CFG, nnx.Rngs(5))
  feats = target.hidden(target.embed_tokens(tokens))[0]
  f_in, emb = feats[:, :-1], target.embed_tokens(tokens[:, 1:])
  steps = 3
  preds = jax.jit(lambda f, e: distill.unrolled_predictions(draft, f, e, steps))(f_in, emb)
  np.testing.assert_allclose(preds[0], draft(f_in, emb)[0], rtol=1e-5, atol=1e-5)
  b, n = f_in.shape[:2]
  # Committing pairs < c: all n pairs in one call, those >= c written nowhere (slot n), so
  # one compiled program serves every c; then one pair per call as decoding feeds it.
  commit_fn = jax.jit(lambda c: draft(
      f_in, emb, positions_BT=jnp.broadcast_to(jnp.arange(n), (b, n)),
      cache=draft.init_cache(b, n),
      slots_BT=jnp.broadcast_to(jnp.where(jnp.arange(n) < c, jnp.arange(n), n), (b, n))))
  step_fn = jax.jit(lambda h, e, at, cache: draft(h, e, positions_BT=at, cache=cache,
                                                  slots_BT=at))
  for s in range(2, steps + 1):
    for p in (s - 1, 6, n - 1):
      commit = p - s + 2
      h, cache = commit_fn(commit)
      h = h[:, commit - 1:commit]
      for q in range(commit, p + 1):
        at = jnp.full((b, 1), q, jnp.int32)
        h, cache = step_fn(h, emb[:, q:q + 1], at, cache)
      np.testing.assert_allclose(preds[s - 1][:, p], h[:, 0], rtol=1e-4, atol=1e-5,
                                 err_msg=f"step {s}, pair {p}")
  # The loss at unroll=1 is the plain one; unrolled, step-1 terms keep their pairs and each
  # deeper step adds the pairs p >= s-1.
  embed, head = target.embed[...], target.lm_head[...]
  mask = jnp.ones(tokens.shape, jnp.float32)
  one = distill.distill_losses(draft, embed, head, False, tokens, mask, feats)
  (reg, ce, top1, m), per = distill.distill_losses(draft, embed, head, False, tokens, mask,
                                                   feats, unroll=steps, per_step=True)
  np.testing.assert_allclose(per[0][0], one[2])
  np.testing.assert_array_equal(m[0], [1, 2] + [3] * (n - 2))
  want, terms = 0.0, []
  for s in range(1, steps + 1):
    d = np.abs(np.asarray(preds[s - 1]) - np.asarray(feats[:, 1:]))
    terms.append(np.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1))
    want = want + np.where(np.arange(n) >= s - 1, terms[-1], 0.0)
  np.testing.assert_allclose(np.asarray(reg) * np.asarray(m), want, rtol=1e-5)
  # unroll_decay: step s weighs decay**(s-1); the mask sums the weights a pair has.
  reg_d, _, _, m_d = distill.distill_losses(draft, embed, head, False, tokens, mask, feats,
                                            unroll=steps, unroll_decay=0.5)
  np.testing.assert_allclose(m_d[0], [1, 1.5] + [1.75] * (n - 2))
  want_d = sum(0.5 ** (s - 1) * np.where(np.arange(n) >= s - 1, term, 0.0)
               for s, term in enumerate(terms, start=1))
  np.testing.assert_allclose(np.asarray(reg_d) * np.asarray(m_d), want_d, rtol=1e-5)


def test_greedy_sequences_need_distinct_prompts(target, tmp_path):
  """gen_temperature=0 is greedy decoding: accepted with a prompt per sequence (the rows are
  the target's argmax continuations), refused when prompts repeat (the same sequence twice);
  negative temperatures are refused by the config."""
  with pytest.raises(ValueError, match="gen_temperature=-0.5"):
    distill.DistillConfig(num_sequences=4, eval_sequences=1, gen_temperature=-0.5)
  dcfg = distill.DistillConfig(num_sequences=4, eval_sequences=1, seq_len=8, gen_batch=4,
                               gen_temperature=0.0, steps=1)
  with pytest.raises(ValueError, match="3 distinct prompts for num_sequences=4"):
    distill.train_draft(target, str(tmp_path / "dup"), dcfg, prompts=[[1], [2], [3], [1]])
  prompts = [[1], [2], [3], [4]]
  tokens, mask = distill.cached_sequences(target, str(tmp_path / "s.npz"), prompts, dcfg)
  assert mask.all()
  ids = jnp.asarray(tokens)
  logits = target(ids)[0]
  np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, :-1], -1)), tokens[:, 1:])


def test_a_run_of_other_settings_is_refused_before_its_sequences_are_remade(
    target, tmp_path, monkeypatch):
  """train_draft into the workdir of a run with other settings (experiments.spec_decode
  rerun with another --num_sequences) is refused before any sequence is generated: the
  run's sequences.npz stays the one the trained head was made from."""
  from core import train as train_lib
  prompts = [[1], [2], [3], [4], [5], [6]]
  dcfg = distill.DistillConfig(num_sequences=4, eval_sequences=2, seq_len=8, gen_batch=4,
                               batch_size=2, steps=1)
  workdir = str(tmp_path / "run")
  distill.train_draft(target, workdir, dcfg, prompts=prompts)
  path = os.path.join(workdir, "sequences.npz")
  before = open(path, "rb").read()
  calls = []
  real = distill.generate_sequences
  monkeypatch.setattr(distill, "generate_sequences",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  with pytest.raises(train_lib.RunSettingsError, match=r"distill.num_sequences: 4 "
                     r"\(checkpoint\) -> 6 \(now\)"):
    distill.train_draft(target, workdir, dataclasses.replace(dcfg, num_sequences=6),
                        prompts=prompts)
  assert not calls and open(path, "rb").read() == before


def test_loss_covers_the_replies(target, sequences, tmp_path):
  """loss_from leaves a row's earlier pairs out of the mask only (the terms are unchanged,
  the left-out pairs still feed attention); train_draft starts each sequence's loss at its
  last prompt token unless prompt_loss, and its eval top1 is then over those pairs."""
  tokens, mask = jnp.asarray(sequences[0][:3, :10]), jnp.ones((3, 10), jnp.float32)
  draft = DraftHead(CFG, nnx.Rngs(3))
  embed, head = target.embed[...], target.lm_head[...]
  feats = target.hidden(target.embed_tokens(tokens))[0]
  losses = jax.jit(lambda loss_from: distill.distill_losses(
      draft, embed, head, False, tokens, mask, feats, loss_from_B=loss_from))
  full = losses(jnp.zeros(3, jnp.int32))
  part = losses(jnp.asarray([0, 4, 9], jnp.int32))
  for a, b in zip(full[:3], part[:3]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(part[3], [[1] * 9, [0] * 4 + [1] * 5, [0] * 9])
  src = distill.SequenceSource(np.asarray(tokens), np.asarray(mask), 2, split="eval",
                               loss_from=np.asarray([0, 4, 9]))
  assert [b.loss_from.tolist() for b in src.batches()] == [[0, 4], [9, 0]]
  with pytest.raises(ValueError, match=r"loss_from of shape \(2,\)"):
    distill.SequenceSource(np.asarray(tokens), np.asarray(mask), 2, loss_from=np.zeros(2))

  prompts = [[1, 2, 3, 4, 5], [6], [7, 1], [2, 3, 4]]
  runs = {}
  for prompt_loss in (False, True):
    dcfg = distill.DistillConfig(num_sequences=4, eval_sequences=2, seq_len=8, gen_batch=4,
                                 batch_size=2, steps=1, prompt_loss=prompt_loss)
    runs[prompt_loss] = distill.train_draft(target, str(tmp_path / str(prompt_loss)), dcfg,
                                            prompts=prompts)[1]["eval"]
  # Eval rows: prompts [7, 1] and [2, 3, 4] in 8 tokens: 7 pairs each; replies only: the
  # pairs from the last prompt token, 6 and 5.
  assert runs[True]["pairs"] == 14 and runs[False]["pairs"] == 11


def test_features_captured_while_generating(target, tmp_path, monkeypatch):
  """cached_sequences(feats_path=) makes the same sequences as without it and keeps the
  target's features of them, equal to a forward pass, where cached_features finds them (no
  second pass); a run killed after its first chunk continues to the same features."""
  prompts = [[1, 2], [3], [4, 5, 6], [7]]
  dcfg = distill.DistillConfig(num_sequences=8, eval_sequences=2, seq_len=12, gen_batch=4)
  plain = distill.cached_sequences(target, str(tmp_path / "plain.npz"), prompts, dcfg,
                                   stop_tokens=(0,))
  seq, fp = str(tmp_path / "seq.npz"), str(tmp_path / "feats.npz")
  tokens, mask = distill.cached_sequences(target, seq, prompts, dcfg, stop_tokens=(0,),
                                          feats_path=fp)
  np.testing.assert_array_equal(tokens, plain[0])
  np.testing.assert_array_equal(mask, plain[1])

  def no_forward(*a, **k):
    raise AssertionError("features recomputed")

  monkeypatch.setattr(distill, "target_features", no_forward)
  feats = distill.cached_features(target, fp, tokens)
  want = np.asarray(target.hidden(target.embed_tokens(jnp.asarray(tokens)))[0])
  m = mask[..., None] > 0
  np.testing.assert_allclose(np.where(m, feats, 0), np.where(m, want, 0), rtol=2e-4, atol=2e-5)
  assert not feats[~mask.astype(bool)].any()

  # Killed after the first chunk: 4 rows with their features saved under the settings.
  with np.load(seq) as f:
    saved = {k: f[k] for k in f.files}
  saved["done"] = np.asarray(6)          # sequences ahead of the features: rows 4, 5 redone
  saved["tokens"][6:] = 0
  np.savez(seq, **saved)
  part = feats.copy()
  part[4:] = 0
  np.savez(fp, key=np.asarray("generated:" + str(saved["key"])), done=np.asarray(4),
           feats=part)
  again = distill.cached_sequences(target, seq, prompts, dcfg, stop_tokens=(0,),
                                   feats_path=fp, save_every_s=0.0)
  np.testing.assert_array_equal(again[0], tokens)
  np.testing.assert_array_equal(distill.cached_features(target, fp, tokens), feats)


def test_taps_features_loss_training_and_loading(target, sequences, tmp_path):
  """A head with taps (EAGLE-3's fused features): cached_features keeps the target's block
  states (float16) beside its features under a key of their own; distill_losses zeroes them
  on the pairs tap_keep drops (none kept equals zero taps) and refuses a taps head without
  them; train_draft trains one and load_draft rebuilds it with its taps from the run's
  settings."""
  tokens = sequences[0][:4, :10]
  path = str(tmp_path / "f.npz")
  feats, taps = distill.cached_features(target, path, tokens, taps=(0, 1))
  h, _, want = jax.jit(lambda t: target.hidden(target.embed_tokens(t), taps=(0, 1)))(tokens)
  np.testing.assert_allclose(feats, h, rtol=1e-5, atol=1e-5)
  assert taps.dtype == np.float16 and taps.shape == (4, 10, 2 * CFG.dim)
  np.testing.assert_allclose(taps, want, rtol=2e-3, atol=2e-3)
  with np.load(path) as f:
    assert str(f["key"]).endswith(":taps=[0, 1]") and int(f["done"]) == 4
  head = DraftHead(CFG, nnx.Rngs(3), taps=(0, 1))
  args = (head, target.embed[...], target.lm_head[...], False, jnp.asarray(tokens),
          jnp.ones((4, 10), jnp.float32), jnp.asarray(feats))
  loss = jax.jit(lambda tp, keep: distill.distill_losses(*args, taps_BTK=tp,
                                                         tap_keep_BP=keep)[:3])
  tp, ones = jnp.asarray(taps), jnp.ones((4, 9))
  for a, b in zip(loss(tp, jnp.zeros((4, 9))), loss(jnp.zeros_like(tp), ones)):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(loss(tp, ones)[0], loss(jnp.zeros_like(tp), ones)[0])
  with pytest.raises(ValueError, match=r"the head reads taps \(0, 1\); pass taps_BTK"):
    distill.distill_losses(*args)
  dcfg = distill.DistillConfig(num_sequences=4, eval_sequences=2, seq_len=8, gen_batch=4,
                               batch_size=2, steps=1, taps=(0, 1))
  workdir = str(tmp_path / "run")
  trained, out = distill.train_draft(target, workdir, dcfg, prompts=[[1], [2], [3], [4]])[:2]
  assert trained.taps == (0, 1) and out["step"] == 1
  loaded = distill.load_draft(workdir, CFG)
  assert loaded.taps == (0, 1)
  np.testing.assert_array_equal(loaded.fc[...], trained.fc[...])


def test_logged_lr_is_the_applied_one_after_a_skipped_step(target, sequences):
  """A step skipped for a non-finite loss advances the task's step, not AdamW's schedule:
  the logged lr is the one the next update applies (as LMTask's)."""
  from core import mesh as mesh_lib
  from llm.train_lib import OptimConfig, make_schedule
  optim = OptimConfig(peak_lr=1.0, warmup_steps=4, total_steps=8)
  task = distill.DistillTask(target, optim, mesh_lib.make_mesh("data:1",
                                                               devices=jax.devices()[:1]))
  batch = task.device_batch(distill.SequenceSource(sequences[0][:16], sequences[1][:16],
                                                   16).batch(0))
  state = task.init_state(0)
  nan = jax.tree.map(lambda x: x, state)
  nan["params"] = jax.tree.map(lambda x: jnp.full_like(x, np.nan), state["params"])
  step = jax.jit(lambda s, b: task.train_step(s, b, skip_nonfinite=True))
  skipped, m = step(nan, batch)
  assert float(m["skipped"]) == 1.0 and int(skipped["step"]) == 1
  skipped["params"] = state["params"]
  _, m = step(skipped, batch)
  assert float(m["skipped"]) == 0.0
  assert float(m["lr"]) == float(make_schedule(optim)(0)) == 0.0   # AdamW's count is 0


def test_load_draft_refuses_a_path_without_a_run_and_creates_nothing(tmp_path):
  """A typo'd draft path, or a directory without checkpoints/: load_draft and load_draft_vocab
  refuse naming the setting and the path, and leave the file system as it was (not a
  Checkpointer creating <path>/checkpoints, then failing naming that)."""
  from core import errors
  empty = tmp_path / "empty"
  empty.mkdir()
  for path, found in ((tmp_path / "typo", "no such directory"),
                      (empty, "no checkpoints/ directory in it")):
    for load in (lambda: distill.load_draft(str(path), CFG, where="--draft"),
                 lambda: distill.load_draft_vocab(str(path), V, where="--draft")):
      with pytest.raises(errors.UserError, match=rf"^--draft={path}: {found}"):
        load()
  assert sorted(os.listdir(tmp_path)) == ["empty"] and os.listdir(empty) == []
  (empty / "checkpoints").mkdir()   # a run killed before its first checkpoint
  with pytest.raises(errors.UserError, match=rf"^{empty}: no checkpoint in {empty}/checkpoints"):
    distill.load_draft(str(empty), CFG)
