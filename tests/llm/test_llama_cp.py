"""Llama with context parallelism (arXiv 2411.01783) on 2, 4 and 8 simulated CPU devices.

Every case runs the model with a context_parallel variant under a mesh with a `cp` axis and
the same weights without CP (no mesh), and compares logits at fp32
tolerance (conftest sets float32 matmul precision): full prefill (load-balanced, logits back
in natural order), prefill into a cp-sharded KV cache then decode, persistent-KV prefill,
and greedy generation. The cache layout is checked slot by slot against `layout`.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from core.mesh import make_mesh, parse_mesh
from llm import generate as G
from llm import model as M
from llm.attention import layout
from llm.config import get_config
from tests.llm.test_model import make_model, tokens_for

TINY = get_config("tiny")           # 4 heads, 2 KV heads, 2 layers
TOL = dict(rtol=1e-5, atol=1e-5)
# XLA compile time dominates; LLVM -O0 cuts it and changes no fp32 result beyond rounding.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _devices(spec: str) -> int:
  return math.prod(size for _, size in parse_mesh(spec))


def _mesh(spec: str):
  return make_mesh(spec, devices=jax.devices()[:_devices(spec)])


def _on(spec: str, *rest):
  """A parametrize case on mesh `spec`, marked with the devices it needs."""
  return pytest.param(spec, *rest, marks=pytest.mark.devices(_devices(spec)))


def _models(variant: str):
  """(no-CP model, model with context_parallel=variant), the same weights; both take
  TINY's attention_impl ("auto"), the CP one for the ring's blocks."""
  return make_model(TINY)[0], make_model(TINY.replace(context_parallel=variant))[0]


@functools.partial(jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions, segment_ids):
  return nnx.merge(graphdef, state)(tokens, positions_BT=positions,
                                    segment_ids_BT=segment_ids)[0]


@functools.partial(jit, static_argnums=0)
def _cached(graphdef, state, tokens, cache, lengths):
  return nnx.merge(graphdef, state)(tokens, cache=cache, lengths_B=lengths)


def _collectives(jaxpr):
  """Names of the collectives in a jaxpr, inside shard_map bodies too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("ppermute", "all_to_all", "psum", "pmax", "all_gather"):
      yield eqn.primitive.name
    for sub in eqn.params.values():
      sub = sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub
      if isinstance(sub, jex.core.Jaxpr):
        yield from _collectives(sub)


# ----------------------------------------------------------------------------- layout


def test_cache_slots_rule():
  # Sharded prefill of 8 tokens on 2 ranks (capacity 6), row 1 with 3 padding tokens
  # (load-balanced order: positions 0 1 6 7 | 2 3 4 5, valid = position < 5).
  valid = layout.load_balance(np.arange(8)[None] < np.array([[8], [5]]), 2, axis=1)
  got = layout.cache_slots(np.zeros((2, 2), np.int32), valid, 6, sharded=True)
  np.testing.assert_array_equal(got, [[0, 1, 2, 3, 6, 7, 8, 9], [0, 1, 12, 12, 6, 7, 8, 12]])
  # A decode token goes to the least-filled rank, then round robin; past capacity: dropped.
  fill = np.array([[4, 4], [2, 3], [6, 6]])
  got = layout.cache_slots(fill, np.ones((3, 3), bool), 6, sharded=False)
  np.testing.assert_array_equal(got, [[4, 10, 5], [2, 9, 3], [12, 12, 12]])
  # Under jit the same.
  np.testing.assert_array_equal(
      jax.jit(lambda f, v: layout.cache_slots(f, v, 6, sharded=False))(fill, np.ones((3, 3), bool)),
      got)
  # One decode token per step after a balanced prefill is layout.decode_placement.
  n, per_rank, cap = 4, 3, 6
  fill = np.full((1, n), per_rank)
  for step in range(12):
    slot = layout.cache_slots(fill, np.ones((1, 1), bool), cap, sharded=False)[0, 0]
    assert slot == layout.decode_placement(step, n, prefill_per_rank=per_rank,
                                           capacity_per_rank=cap)[2]
    fill[0, slot // cap] += 1
  with pytest.raises(ValueError, match="T=6 to be a multiple of the 4 ranks"):
    layout.cache_slots(np.zeros((1, 4)), np.ones((1, 6), bool), 4, sharded=True)


@pytest.mark.parametrize("spec", [_on("cp:2"), _on("cp:4"), _on("cp:8"), _on("data:2,cp:4")])
def test_load_balance_sharded_equals_layout(spec):
  from llm.attention import ring
  mesh = _mesh(spec)
  n = mesh.shape["cp"]
  x = np.random.default_rng(0).standard_normal((2, 4 * n, 3)).astype(np.float32)
  pos = np.broadcast_to(np.arange(4 * n, dtype=np.int32), (2, 4 * n))
  batch = "data" if "data" in mesh.shape else None
  fn = jax.jit(lambda x, pos: [
      ring.load_balance_sharded(a, mesh=mesh, spec=P(batch, "cp"), inverse=inv)
      for a in (x, pos) for inv in (False, True)])
  lb_x, unlb_x, lb_pos, unlb_pos = fn(x, pos)
  np.testing.assert_array_equal(lb_x, layout.load_balance(x, n, 1))
  np.testing.assert_array_equal(unlb_x, layout.unload_balance(x, n, 1))
  np.testing.assert_array_equal(lb_pos, layout.balanced_positions(2, 4 * n, n))
  np.testing.assert_array_equal(unlb_pos, layout.unload_balance(pos, n, 1))
  assert lb_x.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, "cp")), 3)


# ----------------------------------------------------------------------------- full prefill


# Each variant on two rank counts (2, 4, 8 all covered) and beside a data or tp axis; the
# ring's own tests (test_ring_attention) run both variants on every rank count.
@pytest.mark.parametrize("spec,variant", [
    _on("cp:2", "pass_q"), _on("cp:8", "pass_kv"),
    _on("data:2,cp:4", "pass_kv"), _on("tp:2,cp:4", "pass_q")])
def test_full_prefill_equals_no_cp(spec, variant):
  ref, model = _models(variant)
  t = 32
  tokens = tokens_for(TINY, 2, t)
  # Row 0: two packed sequences with restarting positions; row 1: positions from 100.
  seg = np.array([[1] * 13 + [2] * 19, [1] * t], np.int32)
  pos = np.array([list(range(13)) + list(range(19)), list(range(100, 100 + t))], np.int32)
  args = (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg))
  want = np.asarray(_forward(*nnx.split(ref), *args))
  mesh = _mesh(spec)
  graphdef, state = nnx.split(M.shard_model(model, mesh))
  with jax.set_mesh(mesh):
    assert M.cp_ranks(model.cfg) == mesh.shape["cp"]
    got = _forward(graphdef, state, *args)
    # The ring really ran: pass-KV rotates KV with ppermute; pass-Q also returns partials
    # with one all_to_all.
    names = set(_collectives(_forward.trace(graphdef, state, *args).jaxpr.jaxpr))
  assert "ppermute" in names and ("all_to_all" in names) == (variant == "pass_q"), names
  batch = "data" if spec.startswith("data") else None
  want_spec = P(batch, "cp", "tp" if spec.startswith("tp") else None)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 3), got.sharding
  np.testing.assert_allclose(np.asarray(got), want, err_msg=spec, **TOL)


@pytest.mark.devices(4)
def test_no_cp_without_context_parallel_or_cp_axis():
  model = make_model(TINY)[0]
  with jax.set_mesh(_mesh("cp:4")):
    assert M.cp_ranks(model.cfg) == 1                      # context_parallel "none"
  ring = TINY.replace(context_parallel="auto")
  assert M.cp_ranks(ring) == 1                              # no mesh
  with jax.set_mesh(_mesh("data:4")):
    assert M.cp_ranks(ring) == 1                            # no cp axis


@pytest.mark.devices(2)
def test_ring_blocks_run_the_configs_attention_impl():
  """The ring's inner kernel is cfg.attention_impl, part of the model's static config: one
  jitted forward traced for two configs runs each one's kernel, with no trace-time context
  to go stale in jit's cache."""
  from llm.attention import register
  from llm.attention.reference import attention_reference
  calls = []

  def spy(q, k, v, **kw):
    calls.append(q.shape)
    return attention_reference(q, k, v, **kw)

  register("test_cp_spy", spy)
  n, t = 2, 8
  mesh = _mesh(f"cp:{n}")
  ref = make_model(TINY)[0]
  tokens = jnp.asarray(tokens_for(TINY, 2, t))
  want = np.asarray(_forward(*nnx.split(ref), tokens, None, None))
  got = {}
  for impl in ("xla", "test_cp_spy"):
    model = make_model(TINY.replace(context_parallel="pass_kv", attention_impl=impl))[0]
    with jax.set_mesh(mesh):
      got[impl] = np.asarray(_forward(*nnx.split(M.shard_model(model, mesh)), tokens, None,
                                      None))
    # One block per ring step and layer, each rank's T / N queries; none for "xla".
    assert calls == ([] if impl == "xla" else [(2, t // n, TINY.n_heads, TINY.head_dim)]
                     * n * TINY.n_layers), (impl, calls)
  for impl, logits in got.items():
    np.testing.assert_allclose(logits, want, err_msg=impl, **TOL)


# ----------------------------------------------------------------------------- KV cache


def _prefill_and_decode(model, tokens, lengths, steps, max_len, decode_model=None):
  """Ragged prefill into a fresh cache, then `steps` single-token decode calls fed with
  the argmax; returns (per-call logits, final cache)."""
  graphdef, state = nnx.split(model)
  dec_graphdef, dec_state = nnx.split(decode_model or model)
  cache = model.init_cache(tokens.shape[0], max_len)
  logits, cache = _cached(graphdef, state, jnp.asarray(tokens), cache, jnp.asarray(lengths))
  out = [np.asarray(logits)]
  tok = np.asarray(logits)[np.arange(len(lengths)), np.asarray(lengths) - 1].argmax(-1)
  for _ in range(steps):
    logits, cache = _cached(dec_graphdef, dec_state, jnp.asarray(tok[:, None], jnp.int32),
                            cache, jnp.full(len(lengths), 1, jnp.int32))
    out.append(np.asarray(logits))
    tok = out[-1][:, 0].argmax(-1)
  return out, cache


@pytest.mark.devices(4)
def test_prefill_then_decode_cp4_equals_no_cp():
  """cp:4: pass-KV prefill (16 tokens, row 1 ragged: 11), then 6 decode steps with a pass-Q
  model on the same cache; per-step logits equal no-CP, and the cache holds the paper's
  layout: rank i has prefill chunks i and 7-i, decode tokens round robin."""
  ref, kv_model = _models("pass_kv")
  q_model = make_model(TINY.replace(context_parallel="pass_q"))[0]
  n, t, steps = 4, 16, 6
  cap = t // n + -(-steps // n)                         # 6 slots per rank
  tokens = tokens_for(TINY, 2, t)
  lengths = np.array([16, 11], np.int32)
  want, _ = _prefill_and_decode(ref, tokens, lengths, steps, t + steps)
  mesh = _mesh("cp:4")
  with jax.set_mesh(mesh):
    got, cache = _prefill_and_decode(kv_model, tokens, lengths, steps, n * cap,
                                     decode_model=q_model)
  np.testing.assert_allclose(got[0][0], want[0][0], **TOL)
  np.testing.assert_allclose(got[0][1, :11], want[0][1, :11], **TOL)   # real tokens only
  for step in range(1, steps + 1):
    np.testing.assert_allclose(got[step], want[step], err_msg=f"decode {step}", **TOL)
  assert cache.k[1].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "cp")), 4)
  assert cache.pos.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "cp")), 2)
  np.testing.assert_array_equal(cache.length, lengths + steps)
  # Row 0: prefill slots hold the load-balanced order, decode tokens decode_placement.
  pos = np.asarray(cache.pos)
  per_rank = t // n
  want_pos = np.full(n * cap, M.SENTINEL_POS)
  pre = (np.arange(n)[:, None] * cap + np.arange(per_rank)).reshape(-1)
  want_pos[pre] = layout.balanced_positions(1, t, n)[0]
  dec = layout.decode_placement(np.arange(steps), n, prefill_per_rank=per_rank,
                                capacity_per_rank=cap)[2]
  want_pos[dec] = t + np.arange(steps)
  np.testing.assert_array_equal(pos[0], want_pos)
  # Row 1: every position once, each rank's slots filled from the front.
  real = pos[1][pos[1] != M.SENTINEL_POS]
  assert sorted(real.tolist()) == list(range(11 + steps))
  per = (pos[1].reshape(n, cap) != M.SENTINEL_POS)
  assert all(list(r) == sorted(r, reverse=True) for r in per)
  assert per.sum(1).max() - per.sum(1).min() <= 1       # still balanced


@pytest.mark.devices(4)
@pytest.mark.parametrize("variant,new", [("pass_kv", 16), ("pass_q", 16), ("auto", 16),
                                         ("pass_q", 4)])
def test_persistent_kv_prefill_cp4(variant, new):
  """P = 16 cached tokens, then T new ones (16: load-balanced; 4 = N: a contiguous split)
  attend to the cache left where it is; logits equal the no-CP full forward."""
  ref, model = _models(variant)
  n, p = 4, 16
  tokens = tokens_for(TINY, 2, p + new, seed=3)
  b = tokens.shape[0]
  full = np.asarray(_forward(*nnx.split(ref), jnp.asarray(tokens),
                             jnp.asarray(np.broadcast_to(np.arange(p + new), (b, p + new))),
                             jnp.ones((b, p + new), jnp.int32)))
  mesh = _mesh("cp:4")
  graphdef, state = nnx.split(model)
  ones = lambda k: jnp.full(b, k, jnp.int32)
  with jax.set_mesh(mesh):
    cache = model.init_cache(b, p + new)
    l0, cache = _cached(graphdef, state, jnp.asarray(tokens[:, :p]), cache, ones(p))
    l1, cache = _cached(graphdef, state, jnp.asarray(tokens[:, p:]), cache, ones(new))
    # Only the fill counts cross ranks on the way in: no all-gather of the KV cache.
    hlo = _cached.lower(graphdef, state, jnp.asarray(tokens[:, p:]), cache,
                        ones(new)).compile().as_text()
  np.testing.assert_allclose(np.asarray(l0), full[:, :p], **TOL)
  np.testing.assert_allclose(np.asarray(l1), full[:, p:], err_msg=variant, **TOL)
  gathered = re.findall(r"= [a-z0-9]+\[([0-9,]*)\][^ ]* all-gather\(", hlo)
  assert gathered and not [g for g in gathered if g.startswith(f"{b},{p + new}")], gathered
  # Rank r holds its share of both chunks: chunks r, 2N-1-r of each (load-balanced) chunk.
  pos = np.asarray(cache.pos)[0].reshape(n, -1)
  first = layout.balanced_positions(1, p, n)[0].reshape(n, -1)
  second = (p + (layout.balanced_positions(1, new, n)[0] if new % (2 * n) == 0
                 else np.arange(new))).reshape(n, -1)
  np.testing.assert_array_equal(pos, np.concatenate([first, second], axis=1))


@pytest.mark.devices(4)
def test_cache_must_split_over_cp():
  model = make_model(TINY.replace(context_parallel="pass_kv"))[0]
  with jax.set_mesh(_mesh("cp:4")):
    with pytest.raises(ValueError, match="max_len=18 slots is not a multiple of the 4 ranks"):
      model.init_cache(2, 18)


# ----------------------------------------------------------------------------- generate


PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 9], [100], [7, 7, 7, 7]]


@pytest.mark.devices(8)
def test_generate_cp_equals_no_cp():
  ref = make_model(TINY)[0]
  want = G.generate(ref, PROMPTS, 7)
  model = make_model(TINY.replace(context_parallel="pass_kv"))[0]
  mesh = _mesh("cp:4")
  assert G.generate(model, PROMPTS, 7, mesh=mesh) == want
  auto = make_model(TINY.replace(context_parallel="auto"))[0]
  mesh = _mesh("data:2,cp:4")
  M.shard_model(auto, mesh)
  with jax.set_mesh(mesh):
    assert G.generate(auto, PROMPTS, 7) == want
  assert len({tuple(o) for o in want}) == 4
  # Prompts pad to 16 (2N = 8): 4 + ceil(6 / 4) = 6 slots per rank.
  with pytest.raises(ValueError, match="need 6 slots per rank: a multiple of 4 that is >= 24"):
    G.generate(model, PROMPTS, 7, mesh=_mesh("cp:4"), max_len=22)
