"""attention(..., mask=): the explicit mask (tree attention) through "xla", "xla_decode" and
"auto" equals a numpy softmax over exactly the allowed keys; other impls refuse it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm import attention as attn_lib


def numpy_attention(q, k, v, allowed):
  """q [B,T,H,K], k/v [B,S,G,K], allowed [B,T,S]: (out, lse) by explicit loops."""
  b, t, h, kd = q.shape
  g = k.shape[2]
  out = np.zeros((b, t, h, kd))
  lse = np.full((b, t, h), -np.inf)
  for bi in range(b):
    for ti in range(t):
      keys = np.flatnonzero(allowed[bi, ti])
      if keys.size == 0:
        continue
      for hi in range(h):
        gi = hi // (h // g)
        logits = k[bi, keys, gi] @ q[bi, ti, hi] / np.sqrt(kd)
        m = logits.max()
        w = np.exp(logits - m)
        out[bi, ti, hi] = w @ v[bi, keys, gi] / w.sum()
        lse[bi, ti, hi] = m + np.log(w.sum())
  return out, lse


@pytest.mark.parametrize("impl", ["xla", "xla_decode", "auto"])
def test_mask_narrows_the_rule(impl):
  """Cache-like positions (empty slots at 2**30), segment ids and a random mask; one query
  whose mask allows nothing gets out 0 and lse -inf."""
  b, t, s, h, g, kd = 2, 5, 9, 4, 2, 8
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=shape).astype(np.float32)
             for shape in ((b, t, h, kd), (b, s, g, kd), (b, s, g, kd)))
  kv_pos = np.full((b, s), 2 ** 30, np.int32)
  kv_pos[0, :8], kv_pos[1, :6] = np.arange(8), [0, 1, 2, 3, 3, 4]
  q_pos = np.array([[3, 4, 4, 5, 7], [2, 3, 3, 4, 4]], np.int32)
  seg_q = np.array([[1, 1, 1, 2, 1], [1, 1, 1, 1, 1]], np.int32)
  seg_kv = np.where(np.arange(s) < 6, 1, 2)[None].repeat(b, 0).astype(np.int32)
  mask = rng.random((b, t, s)) < 0.6
  mask[1, 2] = False
  allowed = mask & (kv_pos[:, None, :] <= q_pos[:, :, None]) & (
      seg_q[:, :, None] == seg_kv[:, None, :])
  assert allowed.any(-1).sum() >= 8
  want_out, want_lse = numpy_attention(q, k, v, allowed)
  f = jax.jit(lambda q, k, v, m: attn_lib.attention(
      q, k, v, impl=impl, causal=True, q_positions=jnp.asarray(q_pos),
      kv_positions=jnp.asarray(kv_pos), q_segment_ids=jnp.asarray(seg_q),
      kv_segment_ids=jnp.asarray(seg_kv), mask=m))
  out, lse = f(q, k, v, jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[1, 2] == 0) and np.all(np.isneginf(np.asarray(lse)[1, 2]))
  # An all-true mask is the plain call.
  plain = attn_lib.attention(q, k, v, impl=impl, q_positions=jnp.asarray(q_pos),
                             kv_positions=jnp.asarray(kv_pos))
  full = attn_lib.attention(q, k, v, impl=impl, q_positions=jnp.asarray(q_pos),
                            kv_positions=jnp.asarray(kv_pos), mask=jnp.ones((b, t, s), bool))
  np.testing.assert_allclose(np.asarray(full[0]), np.asarray(plain[0]), rtol=1e-6, atol=1e-6)


def test_mask_errors():
  q = jnp.zeros((1, 2, 2, 4))
  k = jnp.zeros((1, 3, 1, 4))
  with pytest.raises(ValueError, match=r"impl='cudnn' takes no explicit mask"):
    attn_lib.attention(q, k, k, impl="cudnn", mask=jnp.ones((1, 2, 3), bool))
  with pytest.raises(ValueError, match=r"mask shape \(1, 3, 2\), expected \[B,T,S\]"):
    attn_lib.attention(q, k, k, impl="xla", mask=jnp.ones((1, 3, 2), bool))


@pytest.mark.parametrize("impl", ["xla", "xla_decode", "auto"])
def test_per_query_path_checks_the_callers_ids_and_positions(impl):
  """The per-query path hands its implementation ids it builds itself, so it checks the
  caller's: unchecked, a lone kv_segment_ids is dropped and a [B,1] q_segment_ids broadcast
  over the queries (both silently), and a [B,1] q_positions fails inside vmap."""
  q = jnp.zeros((1, 3, 2, 4))
  k = jnp.zeros((1, 8, 1, 4))
  mask = jnp.ones((1, 3, 8), bool)
  seg_kv = jnp.asarray(np.arange(8)[None] % 2, jnp.int32)
  with pytest.raises(ValueError, match="give both q_segment_ids and kv_segment_ids"):
    attn_lib.attention(q, k, k, impl=impl, mask=mask, kv_segment_ids=seg_kv)
  with pytest.raises(ValueError, match=r"q_segment_ids shape \(1, 1\), expected \(1, 3\)"):
    attn_lib.attention(q, k, k, impl=impl, mask=mask, q_segment_ids=jnp.ones((1, 1), jnp.int32),
                       kv_segment_ids=seg_kv)
  with pytest.raises(ValueError, match=r"q_positions shape \(1, 1\), expected \(1, 3\)"):
    attn_lib.attention(q, k, k, impl=impl, mask=mask, q_positions=jnp.ones((1, 1), jnp.int32))


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_long_calls_take_the_reference_with_the_mask(impl, monkeypatch):
  """More queries than a decode step (a draft head trained on its unrolled predictions):
  one reference call with the mask folded in, equal to numpy and, with its gradients, to
  the per-query path."""
  from llm.attention import masked
  from llm.attention.choose import DECODE_MAX_T
  b, t, s, h, g, kd = 1, DECODE_MAX_T + 4, 2 * DECODE_MAX_T + 8, 4, 2, 8
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=shape).astype(np.float32)
             for shape in ((b, t, h, kd), (b, s, g, kd), (b, s, g, kd)))
  q_pos = np.arange(t, dtype=np.int32)[None] + 4
  kv_pos = np.arange(s, dtype=np.int32)[None] % (t + 4)
  mask = rng.random((b, t, s)) < 0.5
  allowed = mask & (kv_pos[:, None, :] <= q_pos[:, :, None])
  kw = dict(causal=True, q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos))
  ref = attn_lib.get_attention("xla")

  def loss(fn, q, k, v):
    out, lse = fn(q, k, v)
    return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

  per_query = lambda q, k, v: masked.per_query_masked(ref, q, k, v, jnp.asarray(mask), **kw)
  (_, want), want_grads = jax.value_and_grad(lambda *a: loss(per_query, *a), argnums=(0, 1, 2),
                                             has_aux=True)(q, k, v)
  monkeypatch.setattr(masked, "per_query_masked", None)     # the long call must not use it
  dense = lambda q, k, v: attn_lib.attention(q, k, v, impl=impl, mask=jnp.asarray(mask), **kw)
  (_, got), grads = jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2),
                                       has_aux=True)(q, k, v)
  np.testing.assert_allclose(np.asarray(got[0]), numpy_attention(q, k, v, allowed)[0],
                             rtol=1e-5, atol=1e-5)
  for a, w in zip((*got, *grads), (*want, *want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5)
