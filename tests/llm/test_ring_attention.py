"""Ring attention (arXiv 2411.01783) on 2, 4 and 8 simulated CPU devices vs attention_reference.

Every case runs the sharded computation and the single-device reference in fp32
(conftest sets float32 matmul precision) and compares outputs AND log-sum-exps at 1e-5.
To keep the file fast, one jit per test holds the GQA x segment-id combinations of a case.
"""

from __future__ import annotations

import functools
import sys
import types

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from core.mesh import make_mesh
from llm.attention import attention
from llm.attention import layout
from llm.attention.reference import attention_reference
from llm.attention.ring import ring_attention, select_variant

TOL = dict(rtol=1e-5, atol=1e-5)
B, K = 2, 8
HEADS = ((4, 2), (4, 4))          # (H, G): grouped-query and plain multi-head
EMPTY_POS = 2 ** 30               # position of an empty cache slot: masked by the causal rule
# XLA compile time dominates this file; LLVM -O0 cuts it by about a third and changes no
# fp32 result beyond rounding.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


# Rank counts of the cp axis, each case marked with the devices it needs. The ring runs the
# same code for every count (N - 1 steps): persistent KV and decode take 2 and 4 ranks, full
# prefill 2, 4 and 8 (and test_llama_cp runs the model's ring on cp:2, cp:4 and cp:8).
RANKS_2_4 = [pytest.param(n, marks=pytest.mark.devices(n)) for n in (2, 4)]


def _mesh(n: int, spec: str | None = None):
  return make_mesh(spec or f"cp:{n}", devices=jax.devices()[:n])


def _qkv(rng, t: int, s: int, h: int, g: int):
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return f(B, t, h, K), f(B, s, g, K), f(B, s, g, K)


def _segments(rng, length: int) -> np.ndarray:
  """Packed sequences: sorted ids, 3 segments per row at random cut points."""
  return np.sort(rng.integers(0, 3, (B, length)), axis=1).astype(np.int32)


def _arange(length: int, offset: int = 0) -> np.ndarray:
  return np.broadcast_to(np.arange(length, dtype=np.int32) + offset, (B, length)).copy()


def _references(calls: list[dict]) -> list:
  """attention_reference(**call) on one device for each call, all in one jit (eager
  dispatch would compile every op for every shape)."""
  causals = [c["causal"] for c in calls]
  arrays = [{k: a for k, a in c.items() if k != "causal"} for c in calls]
  fn = jit(lambda xs: [attention_reference(**x, causal=z) for x, z in zip(xs, causals)])
  return fn(arrays)


def _close(got, want, what: str):
  got_o, got_l = (np.asarray(a) for a in got)
  want_o, want_l = (np.asarray(a) for a in want)
  np.testing.assert_allclose(got_o, want_o, err_msg=f"{what}: out", **TOL)
  # -inf (a query that saw no key) must match exactly; allclose treats equal infs as equal.
  np.testing.assert_allclose(got_l, want_l, err_msg=f"{what}: lse", **TOL)


# ----------------------------------------------------------------------------- layout


def test_load_balance_layout_and_round_trip():
  # n=2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  np.testing.assert_array_equal(layout.balanced_positions(1, 8, 2)[0], [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(layout.balanced_order(4), [0, 7, 1, 6, 2, 5, 3, 4])
  x = np.random.default_rng(0).standard_normal((2, 48, 3)).astype(np.float32)
  for n in (1, 2, 4, 8):
    for axis in (1, -2):
      y = layout.load_balance(x, n, axis)
      assert isinstance(y, np.ndarray)
      np.testing.assert_array_equal(layout.unload_balance(y, n, axis), x)
    # Under jit (jax arrays) the result equals the numpy one; positions round-trip too.
    y_jit = jax.jit(lambda a, n=n: layout.load_balance(a, n, 1))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y_jit), layout.load_balance(x, n, 1))
    pos = layout.balanced_positions(2, 48, n, offset=5)
    np.testing.assert_array_equal(layout.unload_balance(pos, n, 1), _arange(48, 5))
  # Causal work per rank is equal: sum over a rank's queries of (#keys at or before them).
  per_rank = layout.balanced_positions(1, 32, 4)[0].reshape(4, 8).sum(axis=1) + 8
  assert len(set(per_rank.tolist())) == 1
  with pytest.raises(ValueError, match="length 12, expected a multiple of 2\\*n = 8"):
    layout.load_balance(np.zeros((1, 12)), 4, 1)


def test_decode_placement_round_robin():
  got = [layout.decode_placement(d, 4, prefill_per_rank=3, capacity_per_rank=6)
         for d in range(9)]
  assert got[:5] == [(0, 3, 3), (1, 3, 9), (2, 3, 15), (3, 3, 21), (0, 4, 4)]
  assert got[8] == (0, 5, 5)
  rank, local, glob = layout.decode_placement(np.arange(9), 4, prefill_per_rank=3,
                                              capacity_per_rank=6)
  assert [tuple(map(int, r)) for r in zip(rank, local, glob)] == got
  with pytest.raises(ValueError, match="step=12 needs local slot 6 on rank 0"):
    layout.decode_placement(12, 4, prefill_per_rank=3, capacity_per_rank=6)


# ----------------------------------------------------------------------------- full prefill


# (causal, (H, G), segment ids): every GQA x segment-id pair once, both masks twice.
PREFILL_COMBOS = ((True, (4, 2), True), (True, (4, 4), False), (False, (4, 2), False),
                  (False, (4, 4), True))


@pytest.mark.parametrize("n,variant", [
    pytest.param(2, "pass_kv", marks=pytest.mark.devices(2)),
    pytest.param(2, "pass_q", marks=pytest.mark.devices(2)),
    pytest.param(4, "pass_kv", marks=pytest.mark.devices(4)),
    pytest.param(4, "pass_q", marks=pytest.mark.devices(4)),
    pytest.param(8, "pass_q", marks=pytest.mark.devices(8))])   # cp:8 pass_kv: test_llama_cp
def test_full_prefill(n, variant):
  rng = np.random.default_rng(n)
  t = 8 * n if n < 8 else 64
  mesh = _mesh(n)
  cases, wants, names = [], [], []
  for causal, (h, g), with_seg in PREFILL_COMBOS:
    q, k, v = _qkv(rng, t, t, h, g)
    seg = _segments(rng, t) if with_seg else None
    wants.append(dict(q_BTHK=q, k_BSGK=k, v_BSGK=v, causal=causal, q_segment_ids=seg,
                      kv_segment_ids=seg))
    # The paper's load-balanced layout (it matters for causal work; any layout is exact),
    # positions travel with the tokens.
    lb = lambda a: None if a is None else layout.load_balance(a, n, 1)
    cases.append(dict(q=lb(q), k=lb(k), v=lb(v), seg=lb(seg), pos=lb(_arange(t))))
    names.append(f"n={n} {variant} causal={causal} H={h} G={g} seg={with_seg}")

  wants = _references(wants)

  @jit
  def run(cases):
    return [ring_attention(c["q"], c["k"], c["v"], mesh=mesh, variant=variant, causal=causal,
                           q_segment_ids=c["seg"], kv_segment_ids=c["seg"],
                           q_positions=c["pos"], kv_positions=c["pos"])
            for c, (causal, _, _) in zip(cases, PREFILL_COMBOS)]

  for (o, l), want, name in zip(run(cases), wants, names):
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "cp")), 4), name
    o, l = layout.unload_balance(np.asarray(o), n, 1), layout.unload_balance(np.asarray(l), n, 1)
    _close((o, l), want, name)


@pytest.mark.devices(4)
def test_default_positions_natural_order():
  """No positions given: natural order, the same defaults as attention_reference."""
  rng = np.random.default_rng(1)
  q, k, v = _qkv(rng, 16, 16, 4, 2)
  want = _references([dict(q_BTHK=q, k_BSGK=k, v_BSGK=v, causal=True)])[0]
  got = jit(lambda q, k, v: ring_attention(q, k, v, mesh=_mesh(4), variant="pass_q"))(q, k, v)
  _close(got, want, "default positions")


def _collectives(jaxpr):
  """(primitive, operand shape) of every collective, inside shard_map bodies too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("ppermute", "all_to_all", "all_gather", "psum", "pmax"):
      yield eqn.primitive.name, tuple(eqn.invars[0].aval.shape)
    for sub in eqn.params.values():
      sub = sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub
      if isinstance(sub, jex.core.Jaxpr):
        yield from _collectives(sub)


@pytest.mark.devices(4)
def test_communication_pattern():
  """pass-KV moves only the G KV heads (N-1 ring steps); pass-Q moves queries N-1 times and
  returns partials with one all_to_all; nothing is all-gathered."""
  n, t, h, g = 4, 16, 4, 2
  q, k, v = (jnp.zeros(a.shape) for a in _qkv(np.random.default_rng(0), t, t, h, g))
  mesh = _mesh(n)
  for variant, moved in (("pass_kv", (B, t // n, g, K)), ("pass_q", (B, t // n, h, K))):
    jaxpr = jax.make_jaxpr(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, variant=variant))
    got = list(_collectives(jaxpr(q, k, v).jaxpr))
    ring = [shape for name, shape in got if name == "ppermute"]
    # Per step: k and v (pass-KV) or q (pass-Q), plus the [B, T/N] positions.
    per_step = 2 if variant == "pass_kv" else 1
    assert sorted(set(ring)) == sorted({moved, (B, t // n)}), (variant, got)
    assert ring.count(moved) == per_step * (n - 1), (variant, got)
    a2a = [shape for name, shape in got if name == "all_to_all"]
    assert a2a == ([] if variant == "pass_kv" else [(n, B, t // n, h, K), (n, B, t // n, h)])
    assert not [name for name, _ in got if name in ("all_gather", "psum", "pmax")], got


# ----------------------------------------------------------------------------- persistent KV


@pytest.mark.parametrize("n", RANKS_2_4)
def test_persistent_kv_prefill(n):
  """T new tokens (load-balanced) attend to P cached tokens left on their ranks + themselves."""
  rng = np.random.default_rng(10 + n)
  mesh = _mesh(n)
  c = 2 * n
  # (variant, T, P, (H, G), causal, segment ids): short and long new chunks.
  combos = (("pass_kv", c, 3 * c, (4, 2), True, True), ("pass_kv", 2 * c, c, (4, 4), False, True),
            ("pass_q", c, 3 * c, (4, 4), True, False), ("pass_q", 2 * c, c, (4, 2), True, True))
  cases, wants, names = [], [], []
  lb = lambda a: None if a is None else layout.load_balance(a, n, 1)
  old = lambda a, p: None if a is None else a[:, :p]
  new = lambda a, p: None if a is None else a[:, p:]
  for variant, t, p, (h, g), causal, with_seg in combos:
    q_all, k, v = _qkv(rng, p + t, p + t, h, g)
    seg = _segments(rng, p + t) if with_seg else None
    wants.append(dict(q_BTHK=q_all[:, p:], k_BSGK=k, v_BSGK=v, causal=causal,
                      q_segment_ids=new(seg, p), kv_segment_ids=seg,
                      q_positions=_arange(t, p), kv_positions=_arange(p + t)))
    cases.append(dict(
        q=lb(q_all[:, p:]), k=lb(new(k, p)), v=lb(new(v, p)), seg=lb(new(seg, p)),
        pos=lb(_arange(t, p)), k_cache=lb(old(k, p)), v_cache=lb(old(v, p)),
        cache_seg=lb(old(seg, p)), cache_pos=lb(_arange(p))))
    names.append(f"n={n} {variant} T={t} P={p} H={h} G={g} causal={causal} seg={with_seg}")

  wants = _references(wants)

  @jit
  def run(cases):
    return [ring_attention(x["q"], x["k"], x["v"], mesh=mesh, variant=combo[0], causal=combo[4],
                           q_segment_ids=x["seg"], kv_segment_ids=x["seg"],
                           q_positions=x["pos"], kv_positions=x["pos"], k_cache=x["k_cache"],
                           v_cache=x["v_cache"], cache_segment_ids=x["cache_seg"],
                           cache_positions=x["cache_pos"])
            for x, combo in zip(cases, combos)]

  for (o, l), want, name in zip(run(cases), wants, names):
    o, l = layout.unload_balance(np.asarray(o), n, 1), layout.unload_balance(np.asarray(l), n, 1)
    _close((o, l), want, name)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("n", RANKS_2_4)
def test_decode_round_robin_cache(n):
  """A KV cache [B, n*C, G, K] sharded over cp: prefill load-balanced into each rank's first
  slots, earlier decode tokens and the current ones round robin (decode_placement), empty
  slots masked. Queries: t_per_rank in (1, 2) tokens per rank (pass-Q ring), and a single
  token (T=1, not divisible by n: replicated queries, merged across ranks)."""
  rng = np.random.default_rng(20 + n)
  mesh = _mesh(n)
  p, done = 2 * n, n + 1                  # prefill length, decode tokens already generated
  cases, wants, names, variants = [], [], [], []
  # (query tokens, variant, segment ids); T=1 with pass_kv takes the same replicated route.
  combos = ((n, "pass_q", True), (2 * n, "pass_q", False), (1, "pass_q", True))
  if n == 4:
    combos += ((1, "pass_kv", False), (n, "pass_kv", False))
  for t_new, variant, with_seg in combos:
    h, g = HEADS[len(cases) % 2]
    total = p + done + t_new
    cap = p // n + -(-(done + t_new) // n)            # per-rank slots
    q_all, k, v = _qkv(rng, total, total, h, g)
    seg = np.zeros((B, total), np.int32)
    if with_seg:                                       # two sequences packed per row
      seg[:, : p // 2] = 1
    want = dict(q_BTHK=q_all[:, total - t_new:], k_BSGK=k, v_BSGK=v, causal=True,
                q_segment_ids=seg[:, total - t_new:], kv_segment_ids=seg,
                q_positions=_arange(t_new, total - t_new), kv_positions=_arange(total))
    # Cache arrays, empty slots: far-future position and a segment id no query has.
    k_c = np.zeros((B, n * cap, g, K), np.float32)
    v_c = np.zeros_like(k_c)
    pos_c = np.full((B, n * cap), EMPTY_POS, np.int32)
    seg_c = np.full((B, n * cap), -1, np.int32)
    per_rank = p // n
    pre_slots = (np.arange(n)[:, None] * cap + np.arange(per_rank)[None]).reshape(-1)
    order = layout.load_balance(np.arange(p), n, 0)   # prefill token held by each slot
    dec_slots = layout.decode_placement(np.arange(done + t_new), n, prefill_per_rank=per_rank,
                                        capacity_per_rank=cap)[2]
    slots = np.concatenate([pre_slots, dec_slots])
    tokens = np.concatenate([order, p + np.arange(done + t_new)])
    k_c[:, slots], v_c[:, slots] = k[:, tokens], v[:, tokens]
    pos_c[:, slots], seg_c[:, slots] = tokens, seg[:, tokens]
    cases.append(dict(q=q_all[:, total - t_new:], k=k_c, v=v_c, qpos=_arange(t_new, total - t_new),
                      kpos=pos_c, qseg=seg[:, total - t_new:] if with_seg else None,
                      kseg=seg_c if with_seg else None))
    wants.append(want)
    variants.append(variant)
    names.append(f"n={n} {variant} T={t_new} H={h} G={g} seg={with_seg}")

  wants = _references(wants)

  @jit
  def run(cases):
    return [ring_attention(c["q"], c["k"], c["v"], mesh=mesh, variant=var, causal=True,
                           q_segment_ids=c["qseg"], kv_segment_ids=c["kseg"],
                           q_positions=c["qpos"], kv_positions=c["kpos"])
            for c, var in zip(cases, variants)]

  for got, want, name in zip(run(cases), wants, names):
    _close(got, want, name)


# ----------------------------------------------------------------------------- registry, meshes


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec,variant", [("data:2,tp:2,cp:2", "pass_kv"),
                                          ("fsdp:2,tp:2,cp:2", "pass_q")])
def test_set_mesh_with_batch_and_heads_sharded(spec, variant):
  """Under jax.set_mesh (the abstract mesh, as the Llama model passes it), with batch and
  heads sharded too."""
  rng = np.random.default_rng(30)
  mesh = make_mesh(spec)
  t, n = 16, 2
  q, k, v = _qkv(rng, t, t, 4, 2)
  seg = _segments(rng, t)
  want = _references([dict(q_BTHK=q, k_BSGK=k, v_BSGK=v, causal=True, q_segment_ids=seg,
                           kv_segment_ids=seg)])[0]
  batch = spec.split(":")[0]
  put = lambda a, *rest: jax.device_put(layout.load_balance(a, n, 1),
                                        NamedSharding(mesh, P(batch, "cp", *rest)))
  pos = put(_arange(t))
  with jax.set_mesh(mesh):
    o, l = jit(lambda q, k, v, s, p: ring_attention(
        q, k, v, mesh=jax.sharding.get_abstract_mesh(), variant=variant, causal=True,
        q_segment_ids=s, kv_segment_ids=s, q_positions=p, kv_positions=p))(
        put(q, "tp", None), put(k, "tp", None), put(v, "tp", None), put(seg), pos)
  assert o.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, "cp", "tp", None)), 4)
  assert l.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, "cp", "tp")), 3)
  _close((layout.unload_balance(np.asarray(o), n, 1), layout.unload_balance(np.asarray(l), n, 1)),
         want, spec)


@pytest.mark.devices(4)
def test_explicit_settings_and_errors():
  rng = np.random.default_rng(31)
  q, k, v = _qkv(rng, 8, 8, 4, 4)
  want = _references([dict(q_BTHK=q, k_BSGK=k, v_BSGK=v, causal=False)])[0]
  got = jit(lambda q, k, v: ring_attention(q, k, v, mesh=_mesh(4), axis="cp", variant="pass_kv",
                                           inner_impl="xla", causal=False))(q, k, v)
  _close(got, want, "explicit")
  # Ring attention is no registry name: the error names the setting that replaces it.
  with pytest.raises(ValueError, match="context_parallel='pass_q'"):
    attention(q, k, v, impl="ring_pass_q")
  with pytest.raises(ValueError, match="lack axis 'cp'"):
    ring_attention(q, k, v, mesh=_mesh(4, "data:4"))
  with pytest.raises(ValueError, match="key length S = 6 is not a multiple of the 4 ranks"):
    ring_attention(q, k[:, :6], v[:, :6], mesh=_mesh(4))
  with pytest.raises(ValueError, match="variant='ring'"):
    ring_attention(q, k, v, mesh=_mesh(4), variant="ring")
  with pytest.raises(ValueError, match="inner_impl='ring_pass_kv'"):
    ring_attention(q, k, v, mesh=_mesh(4), inner_impl="ring_pass_kv")


# ----------------------------------------------------------------------------- auto


@pytest.mark.devices(4)
def test_auto_asks_cp_select(monkeypatch):
  """variant="auto" passes the case to cp_select.choose_variant and runs what it answers."""
  calls = []

  def choose_variant(new_tokens, cached_tokens, *, n_ranks, n_heads, n_kv_heads, peak_flops,
                     bandwidth, bytes_per_elem=2, algorithm="alltoall"):
    calls.append(dict(new_tokens=new_tokens, cached_tokens=cached_tokens, n_ranks=n_ranks,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, bytes_per_elem=bytes_per_elem))
    return "pass_q" if new_tokens < cached_tokens else "pass_kv"

  fake = types.ModuleType("llm.attention.cp_select")
  fake.choose_variant = choose_variant
  monkeypatch.setitem(sys.modules, "llm.attention.cp_select", fake)
  rng = np.random.default_rng(40)
  n, t, p = 4, 8, 24
  q_all, k, v = _qkv(rng, p + t, p + t, 4, 2)
  want = _references([dict(q_BTHK=q_all[:, p:], k_BSGK=k, v_BSGK=v, causal=True,
                           q_positions=_arange(t, p))])[0]
  got = jit(lambda q, k, v: ring_attention(q, k, v, mesh=_mesh(n), variant="auto", causal=True,
                                           q_positions=jnp.asarray(_arange(t, p))))(
      q_all[:, p:], k, v)
  _close(got, want, "auto")
  assert calls == [dict(new_tokens=t, cached_tokens=p, n_ranks=n, n_heads=4, n_kv_heads=2,
                        bytes_per_elem=4)]
  assert select_variant("auto", new_tokens=64, cached_tokens=0, n_ranks=4, n_heads=4,
                        n_kv_heads=2) == "pass_kv"


def test_auto_matches_real_cp_select():
  cp_select = pytest.importorskip("llm.attention.cp_select")
  for t, p in ((128, 0), (128, 128_000), (1, 100_000), (4096, 4096)):
    kw = dict(n_ranks=4, n_heads=32, n_kv_heads=8, peak_flops=8e14, bandwidth=5e10,
              bytes_per_elem=2, algorithm="alltoall")
    assert select_variant("auto", new_tokens=t, cached_tokens=p, **kw) == \
        cp_select.choose_variant(t, p, **kw)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.devices(4)
@pytest.mark.parametrize("variant", ["pass_kv", "pass_q"])
def test_full_prefill_gradients(variant):
  n, t = 4, 16
  rng = np.random.default_rng(50)
  q, k, v = _qkv(rng, t, t, 4, 2)
  seg = _segments(rng, t)
  w_o = rng.standard_normal(q.shape).astype(np.float32)
  w_l = rng.standard_normal(q.shape[:3]).astype(np.float32)
  lb = lambda a: layout.load_balance(a, n, 1)
  mesh = _mesh(n)

  def loss(fn, w_o, w_l):
    def f(q, k, v):
      o, l = fn(q, k, v)
      return jnp.sum(o * w_o) + jnp.sum(l * w_l)
    return f

  ref = loss(lambda q, k, v: attention_reference(q, k, v, causal=True, q_segment_ids=seg,
                                                 kv_segment_ids=seg), w_o, w_l)
  ring = loss(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, variant=variant, causal=True,
                                             q_segment_ids=lb(seg), kv_segment_ids=lb(seg),
                                             q_positions=lb(_arange(t)),
                                             kv_positions=lb(_arange(t))), lb(w_o), lb(w_l))
  want = jit(jax.grad(ref, argnums=(0, 1, 2)))(q, k, v)
  got = jit(jax.grad(ring, argnums=(0, 1, 2)))(lb(q), lb(k), lb(v))
  for name, gg, ww in zip("qkv", got, want):
    np.testing.assert_allclose(layout.unload_balance(np.asarray(gg), n, 1), ww,
                               err_msg=f"{variant} d{name}", **TOL)


@pytest.mark.devices(2)
@pytest.mark.parametrize("variant", ["pass_kv", "pass_q"])
def test_pallas_inner_block(variant):
  """The Pallas flash-attention kernel (interpret mode) as ring attention's inner block."""
  from llm.attention.reference import attention_reference
  from llm.attention.ring import ring_attention
  mesh = make_mesh("cp:2", devices=jax.devices()[:2])
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (1, 32, 4, 16), jnp.float32)
  k = jax.random.normal(kk, (1, 32, 2, 16), jnp.float32)
  v = jax.random.normal(kv, (1, 32, 2, 16), jnp.float32)
  out, lse = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, variant=variant,
                                                    causal=True, inner_impl="pallas"))(q, k, v)
  want_out, want_lse = attention_reference(q, k, v, causal=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
