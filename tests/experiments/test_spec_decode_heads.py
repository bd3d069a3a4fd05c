"""experiments.spec_decode.heads: per-step agreement and accept lengths against the
library's own counts, on a tiny target and a random head."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.spec_decode import heads
from llm.config import get_config
from llm.speculative import distill
from llm.speculative.decode import cache_slots, speculative_generate
from llm.speculative.draft import DraftHead
from llm.speculative.tree import TreeShape
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
