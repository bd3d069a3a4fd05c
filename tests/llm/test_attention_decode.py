"""attention_impl="xla_decode" and "auto": both decode forms (elementwise sums; matrix
products, CPU's) equal the reference, and with the elementwise form a decode step's compiled
loop holds no copy of the KV cache (what "auto" picks per call:
tests/llm/test_attention_choose.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm.attention import decode as decode_lib
from llm.attention.decode import decode_attention_matmul, decode_attention_sums
from llm.attention.reference import attention_reference

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", [decode_attention_sums, decode_attention_matmul],
                         ids=["sums", "matmul"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_decode_attention_equals_reference(causal, heads, form):
  """Values, lse and gradients, with cache-like positions (empty slots at 2**30), segment
  ids, and a query that sees no key (out 0, lse -inf)."""
  b, t, s, k = 2, 3, 10, 8
  h, g = heads
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, h, k))
  kk = jax.random.normal(keys[1], (b, s, g, k))
  v = jax.random.normal(keys[2], (b, s, g, k))
  kv_pos = np.full((b, s), 2 ** 30, np.int32)
  kv_pos[0, :6], kv_pos[1, :4] = np.arange(6), np.arange(4)
  q_pos = jnp.asarray([[6, 7, 8], [-1, 4, 5]], jnp.int32)      # row 1, query 0 sees nothing
  seg_q = jnp.asarray([[1, 1, 2], [1, 1, 1]], jnp.int32)
  seg_kv = jnp.asarray(np.where(np.arange(s) < 3, 1, 2)[None].repeat(b, 0), jnp.int32)
  kw = dict(causal=causal, q_positions=q_pos, kv_positions=jnp.asarray(kv_pos),
            q_segment_ids=seg_q, kv_segment_ids=seg_kv)
  got = jax.jit(lambda q, k, v: form(q, k, v, **kw))(q, kk, v)
  want = jax.jit(lambda q, k, v: attention_reference(q, k, v, **kw))(q, kk, v)
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), **TOL)

  def loss(f):
    def inner(q, k, v):
      o, l = f(q, k, v, **kw)
      return jnp.sum(o * o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0))
    return inner

  ga = jax.jit(jax.grad(loss(form), argnums=(0, 1, 2)))(q, kk, v)
  gw = jax.jit(jax.grad(loss(attention_reference), argnums=(0, 1, 2)))(q, kk, v)
  for a, w in zip(ga, gw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), **TOL)


def test_decode_form_by_backend(monkeypatch):
  """CPU takes the matrix-product form, other backends the elementwise one."""
  assert decode_lib.decode_form() == ("matmul" if jax.default_backend() == "cpu" else "sums")
  monkeypatch.setattr(decode_lib.jax, "default_backend", lambda: "gpu")
  assert decode_lib.decode_form() == "sums"


def test_decode_loop_reads_the_cache_in_place(monkeypatch):
  """With the elementwise form (every backend but CPU) the compiled decode loop (bf16
  weights and cache) transposes no KV cache: the only cache-sized copies are the loop's
  entry copies of the (undonated) input cache."""
  monkeypatch.setattr(decode_lib, "decode_form", lambda: "sums")
  from llm import generate as gen
  from llm import model as model_lib
  from llm.config import get_config
  cfg = get_config("tiny", dtype="bfloat16", param_dtype="bfloat16")
  graphdef, state = nnx.split(model_lib.Llama(cfg, nnx.Rngs(0)))
  b, t, n = 2, 24, 6
  tok, cache, key = gen.prefill(graphdef, state, jnp.zeros((b, t), jnp.int32),
                                jnp.full((b,), t, jnp.int32), jax.random.key(0), None,
                                max_len=t + n)
  assert cache.k[0].dtype == jnp.bfloat16
  hlo = gen.decode.lower(graphdef, state, cache, tok, key, None, jnp.asarray([-1], jnp.int32),
                         n_new=n).compile().as_text()
  cache_elems = b * (t + n) * cfg.n_kv_heads * cfg.head_dim
  big_copies = []
  for line in hlo.splitlines():
    if " copy(" not in line or "=" not in line:
      continue
    shape = line.split("=", 1)[1].strip().split(" ", 1)[0]
    dims = shape[shape.index("[") + 1:shape.index("]")].split(",") if "[" in shape else []
    if dims and dims[0] and np.prod([int(d) for d in dims]) >= cache_elems:
      big_copies.append(line.strip())
  entry = [c for c in big_copies if "copy(%cache_" in c.replace(" ", " ")]
  assert len(big_copies) == len(entry) <= 2 * cfg.n_layers, big_copies
