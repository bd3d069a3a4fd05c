"""The serving engine: continuous batching over a paged KV cache against `llm.generate` one
request at a time (tokens equal, logits within 1e-5 of a full forward pass), bit-equal rows
alone or among others at one batch width, requests arriving at different steps, pages all
freed, preemption (of others, of itself, for a prompt chunk), stop strings / stop ids /
max_tokens, per-request sampling seeds, no recompiles as requests join and leave, and the
request and config checks."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm import generate as G
from llm.config import get_config
from core.errors import UserError
from llm.serving import programs as P
from llm.serving.config import CHUNK_WIDTHS, EngineConfig
from llm.serving.engine import Engine, SamplingParams
from llm.tokenizer import ByteTokenizer
from tests.llm.test_model import make_model

TINY = get_config("tiny")
# Lengths 1 (a decode row from the start), chunk-sized, and over two chunks and pages.
# (generate compiles a prefill per prompt length: four lengths.)
PROMPTS = [[5, 17, 99, 3, 250], [9], list(range(100, 137)), [42, 42, 8, 8, 1],
           [7, 1, 7, 1, 7, 1, 7, 1, 7, 1, 7, 1, 7, 1, 7, 1], list(range(3, 77, 2))]
NEW = 9
# One batch width, table width and pool: every step of every test here shares two compiled
# programs (three with sampling). 15 pages of 8 slots: four requests of up to 46 tokens may not all
# keep theirs (preemption).
CONFIG = EngineConfig(max_slots=4, block_size=8, prefill_chunk=16, max_model_len=48,
                      num_blocks=16, batch_widths=(4,), table_widths=(6,),
                      record_logits=True)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens_BT):
  return nnx.merge(graphdef, state)(tokens_BT)[0]


def full_forward_logits(model, prompt, reply):
  """Logits predicting each reply token, from one cache-free pass over prompt + reply."""
  seq = list(prompt) + list(reply)
  tokens = np.zeros((1, 48), np.int32)
  tokens[0, :len(seq)] = seq
  logits = np.asarray(_full_logits(*nnx.split(model), jnp.asarray(tokens)))[0]
  return logits[len(prompt) - 1:len(seq) - 1]


@pytest.fixture(scope="module")
def tiny():
  return make_model(TINY)[0]


@pytest.fixture(scope="module")
def reference(tiny):
  """`generate`'s rows. One call for all prompts (one compiled prefill instead of one per
  prompt length): tests/llm/test_generate.py checks that its batched rows equal its rows one
  request at a time; `test_generate_one_at_a_time` (slow) checks it here too."""
  return G.generate(tiny, PROMPTS, NEW, max_len=48)


@pytest.mark.slow   # 10 s of prefill compiles; test_generate.py covers batched == one at a time
def test_generate_one_at_a_time(tiny, reference):
  assert [G.generate(tiny, [p], NEW, max_len=48)[0] for p in PROMPTS] == reference


def _drain(engine, outs=None):
  outs = {} if outs is None else outs
  while engine.has_unfinished():
    for o in engine.step():
      outs.setdefault(o.request_id, []).append(o)
  return outs


def test_staggered_arrivals_equal_generate_one_at_a_time(tiny, reference):
  engine = Engine(tiny, CONFIG)
  params = SamplingParams(max_tokens=NEW)
  # Two requests, a few steps, then the rest (more than the 4 slots: some wait).
  ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
  outs = {}
  for _ in range(3):
    for o in engine.step():
      outs.setdefault(o.request_id, []).append(o)
  ids += [engine.add_request(p, params) for p in PROMPTS[2:]]
  assert engine.num_waiting >= 2
  _drain(engine, outs)
  for rid, prompt, want in zip(ids, PROMPTS, reference):
    final = outs[rid][-1]
    assert final.finished and final.finish_reason == "length"
    assert list(final.token_ids) == want
    assert [t for o in outs[rid] for t in o.new_token_ids] == want
    got = np.stack([l for o in outs[rid] for l in o.logits])
    np.testing.assert_allclose(got, full_forward_logits(tiny, prompt, want), atol=1e-5,
                               rtol=0)
  assert engine.pool.num_used == 0 and engine.slots == [None] * 4 and not engine.requests


def test_a_row_gets_the_same_bits_alone_or_among_others(tiny):
  engine = Engine(tiny, CONFIG)
  alone = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=NEW))[0]
  together = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=NEW))[2]
  assert alone.token_ids == together.token_ids
  assert all(np.array_equal(a, b) for a, b in zip(alone.logits, together.logits))


def test_preemption_recomputes_and_frees_every_page(tiny):
  # Four replies of 30 tokens need 20 pages at the end, more than the 15 there are: the
  # latest admitted requests give theirs back and recompute later.
  engine = Engine(tiny, CONFIG)
  prompts = [PROMPTS[4], PROMPTS[0], PROMPTS[3], PROMPTS[1]]
  params = SamplingParams(max_tokens=30)
  alone = [engine.generate([p], params)[0] for p in prompts]
  assert engine.preemptions == 0
  together = engine.generate(prompts, params)
  assert engine.preemptions > 0
  for a, b in zip(alone, together):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), atol=1e-5, rtol=0)
  assert engine.pool.num_used == 0 and engine.pool.num_free == 15


def test_no_recompile_as_requests_join_and_leave(tiny):
  engine = Engine(tiny, CONFIG)
  engine.generate(PROMPTS[:3], SamplingParams(max_tokens=3))
  before = P.engine_step._cache_size()
  engine.add_request(PROMPTS[4], SamplingParams(max_tokens=5))
  engine.step()
  engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
  _drain(engine)
  assert P.engine_step._cache_size() == before


def test_stop_ids_stop_strings_and_max_tokens(tiny, reference):
  tok = ByteTokenizer()
  engine = Engine(tiny, CONFIG, tok)
  want = reference[0]
  text = tok.decode(want)
  stop_id = want[4]
  first = want.index(stop_id)
  # A stop string: two characters of the reply's text from the fourth on (not U+FFFD: the
  # random model's bytes >= 128 do not all decode).
  outs = engine.generate([PROMPTS[0]] * 3, [
      SamplingParams(max_tokens=NEW, stop_token_ids=(stop_id,)),
      SamplingParams(max_tokens=4),
      SamplingParams(max_tokens=NEW)])
  assert list(outs[0].token_ids) == want[:first + 1] and outs[0].finish_reason == "stop"
  assert list(outs[1].token_ids) == want[:4] and outs[1].finish_reason == "length"
  assert outs[2].text == text
  stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
  rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW, stop=(stop,)))
  got = _drain(engine)[rid]
  assert got[-1].finish_reason == "stop" and got[-1].text == text[:text.index(stop)]
  assert "".join(o.text_delta for o in got) == got[-1].text   # ("length" without the stop)



def test_a_stop_string_given_as_a_str_is_one_string(tiny, reference):
  """SamplingParams(stop="ab") is the stop string "ab" (vLLM's `stop` takes a str too), not
  the stop strings "a" and "b"; an empty stop string (which would match at once) is refused."""
  tok = ByteTokenizer()
  text = tok.decode(reference[0])
  # The reply's first character, then one it never writes: as one string the stop never
  # appears (the reply runs to max_tokens); as two characters it would end the reply at once.
  c = next(ch for ch in text if ch != "\ufffd")
  stop = c + "\u2603"
  assert "\u2603" not in text
  assert SamplingParams(stop=stop).stop == (stop,)
  engine = Engine(tiny, CONFIG, tok)
  out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW, stop=stop))[0]
  assert out.finish_reason == "length" and out.text == text
  with pytest.raises(ValueError, match=r"stop=\['x', ''\]; expected non-empty strings"):
    engine.add_request([1], SamplingParams(stop=["x", ""]))


def test_sampling_follows_each_requests_seed(tiny, reference):
  engine = Engine(tiny, CONFIG)
  # One-token prompts: every row is a decode row (one sampled program to compile).
  hot = SamplingParams(max_tokens=NEW, temperature=1.5, seed=7)
  alone = engine.generate([[5]], hot)[0].token_ids
  mixed = engine.generate([PROMPTS[1], [5], [42]], [
      SamplingParams(max_tokens=NEW), hot, SamplingParams(max_tokens=NEW, temperature=1.5,
                                                          seed=8)])
  assert mixed[1].token_ids == alone
  assert list(mixed[0].token_ids) == reference[1]         # a greedy row beside sampled ones
  other = engine.generate([[5]], SamplingParams(max_tokens=NEW, temperature=1.5,
                                                seed=8))[0].token_ids
  assert other != alone
  # top_k past the vocabulary keeps every token, as 0 does (10**10 must not overflow the
  # step's int32 row inside step(): under the runner, every request would fail with it).
  assert engine.generate([[5]], dataclasses.replace(hot, top_k=10 ** 10))[0].token_ids == alone


def test_request_errors(tiny):
  engine = Engine(tiny, CONFIG)
  with pytest.raises(ValueError, match=r"plus max_tokens=44 makes 49 tokens, beyond the "
                                       r"engine's context of 48 .*at most 43 new tokens"):
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=44))
  with pytest.raises(ValueError, match=r"prompt token ids \[256\] outside \[0, 256\)"):
    engine.add_request([1, 256], SamplingParams())
  with pytest.raises(ValueError, match="the prompt is empty"):
    engine.add_request([], SamplingParams())
  with pytest.raises(ValueError, match="top_p=0"):
    engine.add_request([1], SamplingParams(top_p=0))
  with pytest.raises(ValueError, match="stop strings .* need a tokenizer"):
    engine.add_request([1], SamplingParams(stop=("x",)))
  with pytest.raises(ValueError, match="cannot hold one request of max_model_len=48"):
    Engine(tiny, EngineConfig(**{**CONFIG.__dict__, "num_blocks": 6}))
  # Not rounded down: top_k=2.5 would run as 2, 0.5 as 0 (no top-k at all).
  with pytest.raises(ValueError, match=r"top_k=0.5; expected an integer"):
    engine.add_request([1], SamplingParams(top_k=0.5, temperature=1.0))
  with pytest.raises(ValueError, match=r"request req-\d+: max_tokens=0; expected >= 1"):
    engine.add_request([1], SamplingParams(max_tokens=0))
  with pytest.raises(ValueError, match=r"stop_token_ids \[300, -1\] outside \[0, 256\)"):
    engine.add_request([1], SamplingParams(stop_token_ids=(3, 300, -1)))
  # A stop id as text passed the range check (int("7")) and never matched a token.
  with pytest.raises(ValueError, match=r"stop_token_ids=\[3, '7'\]; expected integer token ids"):
    engine.add_request([1], SamplingParams(stop_token_ids=(3, "7")))
  assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
  assert SamplingParams(stop_token_ids=[7, 8]).stop_token_ids == (7, 8)
  engine.add_request([1], SamplingParams(), request_id="a")
  with pytest.raises(ValueError, match="request id 'a' is already in use"):
    engine.add_request([2], SamplingParams(), request_id="a")
  assert engine.abort("a").finish_reason == "abort"
  assert engine.abort("a") is None and engine.abort("nobody") is None
  assert not engine.has_unfinished()
  # One SamplingParams per prompt: a shorter list is refused, not the prompts past it dropped.
  with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
    engine.generate([[1], [2]], [SamplingParams()])
  assert not engine.has_unfinished()


def test_config_errors_name_the_setting(tiny):
  def refused(match, model=tiny, **kw):
    with pytest.raises(ValueError, match=match):
      Engine(model, dataclasses.replace(CONFIG, **kw.pop("config", {})), **kw)

  # Checked before any array is made: a stand-in with the model's config is enough.
  windowed = types.SimpleNamespace(cfg=dataclasses.replace(TINY, sliding_window=8))
  refused(r"sliding_window=8; the paged cache keeps every position", windowed)
  refused(r"block_size=8 with the Pallas kernel; expected a power of two >= 16",
          config=dict(paged_attention="pallas"))
  refused(r"max_model_len=4096 is beyond the model's max_seq_len=%d" % TINY.max_seq_len,
          config=dict(max_model_len=4096))
  refused(r"chunk_widths=\[8\]; expected positive widths, the largest >= 16 \(prefill_chunk\)",
          config=dict(chunk_widths=(8,)))
  refused(r"table_widths=\[6, 0\]; expected positive widths", config=dict(table_widths=(6, 0)))
  draft = types.SimpleNamespace(cfg=types.SimpleNamespace(dim=TINY.dim + 1,
                                                          vocab_size=TINY.vocab_size))
  refused(r"draft head for dim %d, vocab %d; the model has dim %d" % (
      TINY.dim + 1, TINY.vocab_size, TINY.dim), config=dict(speculative_tree="chain:2"),
          draft=draft)
  # --chunk_widths as a flag's text.
  assert CHUNK_WIDTHS.check("16, 32,", "--chunk_widths") == (16, 32)
  with pytest.raises(UserError, match=r"--chunk_widths='16,x': not a comma-separated list of "
                                      "integers; expected prefill chunk widths"):
    CHUNK_WIDTHS.check("16,x", "--chunk_widths")
  with pytest.raises(UserError, match=r"--chunk_widths='16,0': widths must be >= 1"):
    CHUNK_WIDTHS.check("16,0", "--chunk_widths")


def test_a_request_preempted_for_a_prompt_chunk_is_not_prefilled_while_waiting(tiny, reference):
  # Two prompt rows, 6 pages: the first long prompt's last chunk preempts the latest admitted
  # requests; the loop over the step's prefill rows must not then prefill one of them (else
  # the 5-token prompt is prefilled while waiting, finishes, and runs again to 2 tokens).
  config = dataclasses.replace(CONFIG, max_slots=3, batch_widths=(3,), num_blocks=7,
                               prefill_rows=2, record_logits=False)
  engine = Engine(tiny, config)
  ids = [engine.add_request(PROMPTS[i], SamplingParams(max_tokens=n))
         for i, n in ((2, NEW), (5, NEW), (0, 1))]
  outs = _drain(engine)
  assert engine.preemptions > 0
  for rid, i, n in zip(ids, (2, 5, 0), (NEW, NEW, 1)):
    assert [o.finished for o in outs[rid]].count(True) == 1 and outs[rid][-1].finished
    assert list(outs[rid][-1].token_ids) == reference[i][:n]
  assert engine.pool.num_used == 0 and not engine.waiting and engine.finished == 3


def test_a_decode_row_short_of_a_page_preempts_itself_when_it_is_the_latest(tiny, reference):
  # 6 pages: the one-token prompt's reply and the 37-token prompt (admitted after it) both
  # decode; the latter, the latest admitted, finds no page for its next token and gives its
  # own back, then recomputes once the first has finished.
  engine = Engine(tiny, dataclasses.replace(CONFIG, num_blocks=7, record_logits=False))
  out = engine.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=11))
  assert engine.preemptions == 1
  assert [list(o.token_ids[:NEW]) for o in out] == [reference[1], reference[2]]
  assert [len(o.token_ids) for o in out] == [11, 11] and engine.pool.num_used == 0


def test_a_chunk_width_past_prefill_chunk_feeds_prefill_chunk_tokens(tiny, reference):
  # chunk_widths may go past prefill_chunk (the largest only has to hold it); a chunk that
  # ran min(remaining, width) = 24 tokens on pages grown for 16 would write its last 8 keys
  # to the padding page (and lose them), so the 37-token prompt's reply would be another
  # model's.
  engine = Engine(tiny, dataclasses.replace(CONFIG, chunk_widths=(24,), record_logits=False))
  out = engine.generate([PROMPTS[2], PROMPTS[0]], SamplingParams(max_tokens=NEW))
  assert [list(o.token_ids) for o in out] == [reference[2], reference[0]]
  assert engine.pool.num_used == 0


def test_abort_frees_the_request(tiny):
  engine = Engine(tiny, CONFIG)
  a = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=NEW))
  b = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW))
  engine.step()
  out = engine.abort(a)
  assert out.finished and out.finish_reason == "abort"
  outs = _drain(engine)
  assert a not in outs and outs[b][-1].finish_reason == "length"
  assert engine.pool.num_used == 0


# 25 s in interpret mode; covered by tests/kernels/test_paged_attention.py (the kernel
# against its reference, interpret mode) and the tests above (the engine on the xla path).
@pytest.mark.slow
def test_the_pallas_kernel_serves_the_same_tokens(tiny, reference):
  """paged_attention="pallas" (interpret mode on CPU): the kernel over the cached pages
  merged with each call's own keys, in decode rows and in prompt chunks of 16 over pages
  of 16 (a 37-token prompt: three chunks)."""
  config = EngineConfig(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=48,
                        num_blocks=7, batch_widths=(2,), table_widths=(3,),
                        paged_attention="pallas", record_logits=True)
  engine = Engine(tiny, config)
  assert engine.impl == "pallas"
  out = engine.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=NEW))
  for o, i in zip(out, (1, 2)):
    assert list(o.token_ids) == reference[i]
    np.testing.assert_allclose(np.stack(o.logits),
                               full_forward_logits(tiny, PROMPTS[i], reference[i]), atol=1e-5,
                               rtol=0)


def test_chunk_widths_for_are_the_buckets_the_chunks_fall_in():
  from llm.serving.config import chunk_widths_for
  assert chunk_widths_for([32, 128], 64) == (32, 64)
  assert chunk_widths_for([20], 64) == (32, 64)          # one chunk of 20 -> 32
  assert chunk_widths_for([100, 192], 64) == (64,)       # 64 + 36 -> 64; 3 x 64
  assert chunk_widths_for([200], 64) == (16, 64)         # 3 x 64 + 8 -> 16
  assert chunk_widths_for([5, 20], 16) == (16,)
