"""The serving engine's context-parallel prefill (`EngineConfig.cp_prefill_min`,
llm/serving/cp_prefill.py) on 4 and 2 simulated CPU devices: prompts at or above the threshold
are prefilled in one ring-attention step, the rest in chunks, served together with requests
arriving while others decode; greedy tokens equal the engine without it, every logit within
TOL, sampled requests draw the same tokens, preemption recomputes through the same path,
pages are all freed, warmup compiles every CP program; and the setting's errors.

TOL: the CP prefill's logits come from ring attention, which sums each query's softmax over
N blocks of keys and merges them by log-sum-exp, where the chunked prefill sums over the
gathered pages in one pass: the same float32 values added in another order. Over the tiny
model's 2 layers and <= 48 keys that moves logits of order 1 by a few float32 ulps (about
1e-6 measured); 2e-5 leaves room for that, far below any difference a wrong key, position or
page would make (order 0.1 or more)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from core.mesh import make_mesh
from llm.serving import cp_prefill as C
from llm.serving.engine import Engine, SamplingParams
from tests.llm.serving.test_engine import CONFIG, PROMPTS, TINY
from tests.llm.test_model import make_model

MIN = 20
# Two prompts of 37 tokens and one of 24 at or above MIN (padded to 48 and 32), four below.
CP_PROMPTS = PROMPTS + [list(range(200, 224))]
NEW = 9
TOL = 2e-5


def _mesh(n: int):
  return make_mesh(f"cp:{n}", jax.devices()[:n])


def _ring_ops(engine, t: int) -> set[str]:
  """Collectives of the engine's CP prefill program of width t (pass-KV: ppermute)."""
  cp, z = engine.cp, np.zeros
  with jax.set_mesh(cp.mesh):
    jaxpr = C.prefill.trace(
        cp.graphdef, cp.state, z((1, t), np.int32), z((1,), np.int32),
        z((1, cp.max_pages), np.int32), (z((1,), np.float32), z((1,), np.int32),
                                         np.ones((1,), np.float32), z((1,), np.uint32),
                                         z((1,), np.int32)),
        block_size=CONFIG.block_size, num_blocks=CONFIG.num_blocks, sample=False,
        with_logits=True).jaxpr
  return {op for op in ("ppermute", "all_to_all") if op in str(jaxpr)}


def _cp_config(**kw):
  return dataclasses.replace(CONFIG, cp_prefill_min=MIN, **kw)


@pytest.fixture(scope="module")
def tiny():
  return make_model(TINY)[0]


@pytest.fixture(scope="module")
def reference(tiny):
  """The engine without CP prefill: the final output of each prompt, staggered as below."""
  return _serve(Engine(tiny, CONFIG))


def _serve(engine, params=SamplingParams(max_tokens=NEW)):
  """The short prompts first, then (while they decode) the rest; {request index: final
  output with all logits} and the steps that ran a CP prefill beside other requests' rows."""
  ids = [engine.add_request(p, params) for p in CP_PROMPTS[:2]]
  outs, mixed = {}, 0

  def step():
    nonlocal mixed
    calls = engine.cp.calls if engine.cp is not None else 0
    got = engine.step()
    if engine.cp is not None and engine.cp.calls > calls and len(got) > 1:
      mixed += 1
    for o in got:
      outs.setdefault(o.request_id, []).append(o)

  for _ in range(2):
    step()
  ids += [engine.add_request(p, params) for p in CP_PROMPTS[2:]]
  while engine.has_unfinished():
    step()
  final = {i: (outs[rid][-1], [lg for o in outs[rid] for lg in o.logits])
           for i, rid in enumerate(ids)}
  return final, mixed


@pytest.mark.parametrize("n", [pytest.param(4, marks=pytest.mark.devices(4)),
                               pytest.param(2, marks=pytest.mark.devices(2))])
def test_cp_prefill_serves_the_same_tokens_as_chunks(tiny, reference, n):
  engine = Engine(tiny, _cp_config(), mesh=_mesh(n))
  assert engine.cp.widths == (32, 48) and engine.cp.variant == "pass_kv"
  if n == 4:    # every program compiled up front: serving compiles no CP prefill
    assert _ring_ops(engine, 32) == {"ppermute"}
    assert engine.warmup() == 3 + 2
    before = C.prefill._cache_size()
  final, mixed = _serve(engine)
  if n == 4:
    assert C.prefill._cache_size() == before
  want, _ = reference
  assert engine.cp.calls == sum(len(p) >= MIN for p in CP_PROMPTS) == 3
  assert mixed >= 1                   # a CP prefill in a step with other requests' rows
  first, every = [], []
  for i, (out, logits) in final.items():
    ref, ref_logits = want[i]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    d = np.abs(np.stack(logits) - np.stack(ref_logits))
    every.append(float(d.max()))
    if len(CP_PROMPTS[i]) >= MIN:
      first.append(float(d[0].max()))
  print(f"cp:{n}: max |logit difference| vs chunked prefill: first tokens of the CP "
        f"prefills {max(first):.3g}, every token {max(every):.3g}")
  assert max(first) <= TOL and max(every) <= TOL
  assert engine.pool.num_used == 0 and engine.slots == [None] * 4 and not engine.requests


@pytest.mark.devices(2)
def test_sampled_requests_and_preemption_through_cp_prefill(tiny):
  """Sampled rows draw the same tokens as chunked prefill gives them (key fold_in(seed, i)
  from the first token on); a pool too small for all four replies preempts requests, which
  recompute prompt and reply through the CP path (their known tokens >= MIN)."""
  prompts = [CP_PROMPTS[6], PROMPTS[4], PROMPTS[0], list(range(60, 80))]
  # (top_k past the vocabulary: every token, as 0; 10**10 must not overflow the int32 row.)
  params = [SamplingParams(max_tokens=24, top_k=10 ** 10), SamplingParams(max_tokens=24),
            SamplingParams(max_tokens=24, temperature=1.0, top_k=10 ** 10, seed=3),
            SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=5)]
  plain = Engine(tiny, CONFIG).generate(prompts, params)
  engine = Engine(tiny, _cp_config(), mesh=_mesh(2))
  got = engine.generate(prompts, params)
  assert engine.preemptions > 0 and engine.cp.calls > 2
  for a, b in zip(plain, got):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(np.stack(b.logits), np.stack(a.logits), atol=TOL, rtol=0)
  assert engine.pool.num_used == 0 and engine.pool.num_free == 15


def test_widths_and_errors(tiny):
  assert C.cp_widths(20, 48, 4) == (32, 48)
  assert C.cp_widths(100, 48, 4) == (48,)
  assert C.cp_widths(1, 100, 3) == (6, 12, 18, 36, 66, 102)
  with pytest.raises(ValueError, match=r"cp_prefill_min=20 needs mesh=, a jax Mesh with a "
                                       r"'cp' axis of N > 1 devices .*got no mesh"):
    Engine(tiny, _cp_config())
  with pytest.raises(ValueError, match=r"cp_prefill_min=20 needs mesh=.*got a mesh of axes "
                                       r"\{'data': 1\}"):
    Engine(tiny, _cp_config(), mesh=make_mesh("data:1", jax.devices()[:1]))
  with pytest.raises(ValueError, match=r"mesh= without cp_prefill_min"):
    Engine(tiny, CONFIG, mesh=make_mesh("data:1", jax.devices()[:1]))
  with pytest.raises(ValueError, match=r"cp_prefill_min=20 with speculative_tree='2:2:3'; the "
                                       r"context-parallel prefill does not feed the draft"):
    Engine(tiny, _cp_config(speculative_tree="2:2:3"))


@pytest.mark.devices(2)
def test_a_context_parallel_model_names_the_variant(tiny):
  """A model with context_parallel="pass_q" prefills with pass-Q (its steps over the pages
  run without CP) and gives the same tokens; without cp_prefill_min it is refused."""
  model = make_model(TINY.replace(context_parallel="pass_q"))[0]
  with pytest.raises(ValueError, match=r"context_parallel='pass_q'; the engine serves one "
                                       r"device .*cp_prefill_min > 0 and mesh="):
    Engine(model, CONFIG)
  engine = Engine(model, _cp_config(), mesh=_mesh(2))
  assert engine.cp.variant == "pass_q" and _ring_ops(engine, 32) == {"all_to_all", "ppermute"}
  params = SamplingParams(max_tokens=3)
  want = Engine(tiny, CONFIG).generate([CP_PROMPTS[6]], params)[0].token_ids
  assert engine.generate([CP_PROMPTS[6]], params)[0].token_ids == want
  assert engine.cp.calls == 1
