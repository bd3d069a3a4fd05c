"""experiments.spec_decode.heads: per-step agreement and accept lengths against the
library's own counts, on a tiny target and a random head; which features it reads, and what it
refuses before the target loads."""

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.spec_decode import heads
from llm import weights as W
from llm.config import get_config
from llm.speculative import distill
from llm.speculative.decode import cache_slots, speculative_generate
from llm.speculative.draft import DraftHead
from llm.speculative.tree import TreeShape
from tests.experiments.entry import run_refused
from tests.llm.test_model import make_model

CFG = get_config("tiny", vocab_size=8)


def test_per_step_top1_and_accept_lengths():
  target = make_model(CFG)[0]
  head = DraftHead(CFG, nnx.Rngs(3))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 8, 3).tolist() for _ in range(2)]
  tokens, mask = distill.generate_sequences(target, 2, 20, prompts=prompts, batch_size=2)
  feats = np.asarray(target.hidden(target.embed_tokens(jnp.asarray(tokens)))[0])
  loss_from = np.full((2,), 2, np.int32)
  got = heads.per_step_top1(target, head, tokens, mask, feats, loss_from, None, steps=2)
  # Step 1 by hand: the head's argmax against the target's on pairs p >= 2 of real tokens.
  pred = head(jnp.asarray(feats[:, :-1]), target.embed_tokens(jnp.asarray(tokens[:, 1:])))[0]
  agree = (np.argmax(np.asarray(target.logits(pred)), -1)
           == np.argmax(np.asarray(target.logits(jnp.asarray(feats[:, 1:]))), -1))
  pairs = (mask[:, 1:] * mask[:, :-1] > 0) & (np.arange(19)[None] >= 2)
  assert abs(got["top1_d1"] - agree[pairs].mean()) < 1e-6
  assert set(got) == {"top1_d1", "top1_d2"} and 0 <= got["top1_d2"] <= 1
  shape = TreeShape.parse("chain:3")
  res = heads.accept_lengths(target, head, prompts, shape, 8)
  per = [a for p in prompts
         for a in speculative_generate(target, head, [p], 8, shape=shape,
                                     max_len=cache_slots(3, 8, shape)).accepted_per_round[0]]
  assert res["rounds"] == len(per)
  assert abs(res["accept_length"] - (sum(per) + len(per)) / len(per)) < 1e-12
  first = [a >= 1 for a in per]
  assert res["per_depth"][0] == sum(first) / len(per)


def test_held_out_features_only_when_finished_for_these_sequences(tmp_path, capsys):
  """features.npz is used only when it holds the features of these very sequences, all of
  them: a killed run's file (rows of zeros after `done`, or the capture saved under the
  sequences' settings) is not read as features, zeros and all."""
  tokens = np.arange(24, dtype=np.int32).reshape(4, 6)
  feats = np.random.default_rng(0).standard_normal((4, 6, 3)).astype(np.float32)
  path = str(tmp_path / "features.npz")
  assert heads.held_out_features(str(tmp_path), tokens, 3, 2) is None   # no file
  distill._save_partial(path, distill.features_key(tokens, 3), 4, feats=feats)
  np.testing.assert_array_equal(heads.held_out_features(str(tmp_path), tokens, 3, 2), feats[2:])
  # A run with taps keys its file by the taps too; its "feats" are the same features.
  distill._save_partial(path, distill.features_key(tokens, 3) + ":taps=[1]", 4, feats=feats)
  np.testing.assert_array_equal(heads.held_out_features(str(tmp_path), tokens, 3, 2), feats[2:])
  for key, done in ((distill.features_key(tokens, 3), 3), ("generated:{}", 4),
                    (distill.features_key(tokens + 1, 3), 4)):
    distill._save_partial(path, key, done, feats=feats)
    assert heads.held_out_features(str(tmp_path), tokens, 3, 2) is None
    assert "not the finished features of these sequences" in capsys.readouterr().out


def test_heads_refuses_before_the_target_loads(tmp_path):
  """Every --heads directory and the --data sequences are checked before the target is read
  and the first head evaluated (--target names no file), then --max_new_tokens against the
  target's config before its weights load (its directory has none)."""
  data = tmp_path / "data"
  (data / "checkpoints").mkdir(parents=True)
  tokens = np.zeros((4, 6), np.int32)
  key = json.dumps({"num": 4, "prompts": [[1]], "stop": []})
  distill._save_partial(str(data / "sequences.npz"), key, 3, tokens=tokens,
                        mask=np.ones_like(tokens, np.float32))
  base = ["--target=hf:/nope", f"--data={data}", "--eval_sequences=2",
          f"--workdir={tmp_path / 'w'}"]
  for args, want in (
      ([f"--heads={data},{tmp_path}/other"], f"error: --heads={data},{tmp_path}/other: "
       f"{tmp_path}/other holds no checkpoints; expected spec_decode draft directories"),
      ([f"--heads={data}", "--trees="], "error: --trees='': no tree shape; expected"),
      ([f"--heads={data}"], f"error: --data={data}: 3 of 4 sequences made in "
       f"{data}/sequences.npz (an interrupted run); expected a finished run's sequences")):
    out = run_refused("experiments.spec_decode.heads", base + args, timeout=60)
    assert out.stderr.strip().splitlines()[-1].startswith(want), out.stderr[-2000:]
  # Finished sequences, a target with a config but no weights: its context is checked.
  distill._save_partial(str(data / "sequences.npz"), key, 4, tokens=tokens,
                        mask=np.ones_like(tokens, np.float32))
  (tmp_path / "target").mkdir()
  (tmp_path / "target" / "config.json").write_text(json.dumps(W.config_to_hf(CFG)))
  out = run_refused("experiments.spec_decode.heads", [
      f"--target=hf:{tmp_path / 'target'}", *base[1:], f"--heads={data}",
      f"--max_new_tokens={CFG.max_seq_len}"], timeout=60)
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --max_new_tokens={CFG.max_seq_len}: beyond the target's max_seq_len="
      f"{CFG.max_seq_len} after a held-out prompt of 1 tokens; expected at most "
      f"{CFG.max_seq_len - 1}")
  assert not os.path.exists(tmp_path / "w") or os.listdir(tmp_path / "w") == []
