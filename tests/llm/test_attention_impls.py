"""Llama picks its attention by config string: the Pallas kernel gives the XLA logits."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llm import model as model_lib
from llm.config import get_config


def test_llama_pallas_attention_equals_xla():
  cfg = get_config("tiny", n_layers=1)
  ref = model_lib.Llama(cfg, nnx.Rngs(0))
  ker = model_lib.Llama(cfg.replace(attention_impl="pallas"), nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size)
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 14], 2, 0))
  want, _ = nnx.jit(lambda m, t: m(t, segment_ids_BT=seg))(ref, tokens)
  got, _ = nnx.jit(lambda m, t: m(t, segment_ids_BT=seg))(ker, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
