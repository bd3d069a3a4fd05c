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
