"""The serving engine's speculative mode (EAGLE trees verified inside the batch): greedy rows
equal `llm.generate.generate` token for token, with a random untrained head (nothing
accepted) and with a head that predicts a nearly-bigram target well (most drafts accepted,
so the accepted paths' keys and values are what later rounds read), under preemption, with
pages all freed; and the mode's request checks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from llm import generate as G
from llm.serving.engine import Engine, SamplingParams
from llm.speculative import DraftHead
from tests.llm.serving.test_engine import CONFIG, PROMPTS, TINY
from tests.llm.test_model import make_model

NEW = 11


@pytest.fixture(scope="module")
def nearly_bigram():
  """(target, head): the tiny model with its attention and MLP outputs scaled by 0.05 (its
  next token mostly a function of the current one, the cache still counting), and a head
  whose prediction of the next feature is the target's final norm of the next token's
  embedding (fc = [I; 0], its block's outputs zero)."""
  target = make_model(TINY)[0]
  for block in target.layers:
    block.attn.wo[...] = block.attn.wo[...] * 0.05
    block.mlp.w_down[...] = block.mlp.w_down[...] * 0.05
  head = DraftHead(TINY, nnx.Rngs(1))
  d = TINY.dim
  head.fc[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
  head.block.attn.wo[...] = jnp.zeros_like(head.block.attn.wo[...])
  head.block.mlp.w_down[...] = jnp.zeros_like(head.block.mlp.w_down[...])
  head.norm.scale[...] = target.final_norm.scale[...]
  return target, head


def _check(engine, target, prompts, max_tokens):
  want = G.generate(target, prompts, max_tokens, max_len=64)
  out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
  assert [list(o.token_ids) for o in out] == want
  assert all(o.finish_reason == "length" for o in out)
  assert engine.pool.num_used == 0 and not engine.requests


@pytest.mark.slow   # 30 s of compiles; the test below covers the same programs
def test_untrained_head_equals_plain_greedy_decoding():
  target = make_model(TINY)[0]
  engine = Engine(target, dataclasses.replace(CONFIG, speculative_tree="2:3:4"),
                  draft=DraftHead(TINY, nnx.Rngs(1)))
  _check(engine, target, PROMPTS, NEW)
  assert engine.spec_rounds > 0


@pytest.mark.slow   # 30 s, most of it compiling the spec round and generate at -O0
def test_accepted_trees_equal_plain_greedy_decoding(nearly_bigram):
  target, head = nearly_bigram
  engine = Engine(target, dataclasses.replace(CONFIG, speculative_tree="2:3:4"), draft=head)
  _check(engine, target, PROMPTS, NEW)
  # Most rounds accept drafts, some not all of them.
  assert engine.spec_accepted > engine.spec_rounds
  assert engine.spec_accepted < 3 * engine.spec_rounds
  # Long replies: four requests need more pages than the pool has (preemption and
  # recompute, the draft's cache rows rebuilt with them).
  prompts = [PROMPTS[4], PROMPTS[0], PROMPTS[3], PROMPTS[1]]
  _check(engine, target, prompts, 30)
  assert engine.preemptions > 0


def test_speculative_request_checks():
  target = make_model(TINY)[0]
  head = nnx.eval_shape(lambda: DraftHead(TINY, nnx.Rngs(1)))   # never run here
  engine = Engine(target, dataclasses.replace(CONFIG, speculative_tree="chain:2"), draft=head)
  with pytest.raises(ValueError, match="temperature=1.0 on a speculative engine"):
    engine.add_request([1, 2], SamplingParams(temperature=1.0))
  with pytest.raises(ValueError, match="needs a draft head"):
    Engine(target, dataclasses.replace(CONFIG, speculative_tree="chain:2"))
  with pytest.raises(ValueError, match="a draft head without speculative_tree"):
    Engine(target, CONFIG, draft=head)
  with pytest.raises(ValueError, match="tree shape '2:x'"):
    Engine(target, dataclasses.replace(CONFIG, speculative_tree="2:x"), draft=head)
  assert engine.shape.depth == 2 and engine.h_root.shape == (CONFIG.max_slots, TINY.dim)


def test_load_draft_settings():
  """--draft / --decode_vocab as the servers resolve them: a random head over the first N
  ids, N at most the target's vocabulary; a decode vocabulary without a head refused."""
  from llm.serving.programs import load_draft
  target = nnx.eval_shape(lambda: make_model(TINY)[0])
  assert load_draft("", target) == (None, None)
  head, vocab = load_draft("random", target, 5)
  assert list(vocab) == [0, 1, 2, 3, 4] and isinstance(head, DraftHead)
  assert load_draft("random", target)[1] is None
  with pytest.raises(ValueError, match=rf"^decode_vocab={TINY.vocab_size + 1}: more ids than "
                     rf"the target's vocabulary of {TINY.vocab_size}; expected at most "):
    load_draft("random", target, TINY.vocab_size + 1)
  with pytest.raises(ValueError, match=r"^decode_vocab=3 without a draft head"):
    load_draft("", target, 3)


def test_load_draft_of_a_missing_workdir_names_the_flag(tmp_path):
  """--draft naming no directory: refused naming the flag and the path, nothing created."""
  from core import errors
  from llm.serving.programs import load_draft
  target = nnx.eval_shape(lambda: make_model(TINY)[0])
  path = tmp_path / "typo"
  with pytest.raises(errors.UserError, match=rf"^--draft={path}: no such directory; expected "
                     r"the workdir of a draft-head training run"):
    load_draft(str(path), target)
  assert not path.exists()
