"""Llama decode time against the memory-bandwidth floor.

A decode step must read every weight once (the embedding table in full only as the tied
output projection, else only its B rows) and the KV cache of every layer up to the filled
length (at most the window in a sliding-window layer); that many bytes over the device's
copy bandwidth is the floor no implementation beats by much. `time_decode` times greedy
prefill and decode with the KV cache (`llm.generate`); `measure_decode` puts the two side
by side for one batch size.

Letters: B batch, T prompt length, D model dim.
"""

from __future__ import annotations

import time
from typing import Any

from core import profiling


def decode_kv_tokens(cfg, prompt_len: int, new_tokens: int) -> float:
  """Cached tokens one row's decode step reads, summed over the layers and averaged over the
  new_tokens - 1 decode steps (the prefill samples the first new token): step j = 1 ..
  new_tokens - 1 feeds the token at position prompt_len + j - 1, whose query sees
  prompt_len + j keys, at most W in a layer with a sliding window W (`layer_window`)."""
  if new_tokens < 2:
    raise ValueError(f"decode_kv_tokens: new_tokens={new_tokens}, expected >= 2 (one decode "
                     "step after the prefill's token)")
  total = 0.0
  for layer in range(cfg.n_layers):
    w = cfg.layer_window(layer)
    total += sum(prompt_len + j if w is None else min(prompt_len + j, w)
                 for j in range(1, new_tokens)) / (new_tokens - 1)
  return total


def decode_bytes_per_step(model, batch: int, prompt_len: int,
                          new_tokens: int) -> tuple[float, float]:
  """(weight bytes, KV-cache bytes) one decode step must read, averaged over the steps of
  generating `new_tokens` after prompts of `prompt_len`: every parameter once (the embedding
  table in full only as the tied output projection, else its `batch` rows), and k, v of
  `decode_kv_tokens` cached tokens per row, in the cache dtype."""
  import jax
  import numpy as np
  from flax import nnx
  cfg = model.cfg
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  if not cfg.tie_embeddings:   # a weight-only quantized table counts its codes and scales
    emb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.embed.get_value()))
    weights -= emb * (cfg.vocab_size - batch) / cfg.vocab_size
  item = np.dtype(cfg.cache_dtype or cfg.dtype).itemsize
  kv = (2 * batch * decode_kv_tokens(cfg, prompt_len, new_tokens) * cfg.n_kv_heads
        * cfg.head_dim * item)
  return float(weights), float(kv)


def time_decode(model, prompts, new_tokens: int, repeats: int, profile_dir: str | None = None,
                profile: dict | None = None):
  """(prefill seconds per repeat, decode seconds per repeat, generated ids) for greedy
  generation of `new_tokens` tokens after `prompts` [B, T] (no stop token); the first run
  compiles and is not timed. `profile_dir`: one more run's decode (not its prefill) is
  traced there and its summary (core.profiling.profiled) goes into `profile`."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from llm import generate as gen
  profile = {} if profile is None else profile
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(prompts, jnp.int32)
  lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
  stop = jnp.asarray((-1,), jnp.int32)   # no stop token: always new_tokens steps
  max_len = tokens.shape[1] + new_tokens

  def run(trace_dir=None):
    key = jax.random.key(0)
    t0 = time.perf_counter()
    tok, cache, key = gen.prefill(graphdef, state, tokens, lengths, key, None, max_len=max_len)
    jax.block_until_ready((tok, cache))
    t1 = time.perf_counter()
    def decode():
      out, _ = gen.decode(graphdef, state, cache, tok, key, None, stop, n_new=new_tokens)
      return np.asarray(out)

    if trace_dir:   # a profile is a by-product: one that cannot be taken says why
      out, summary = profiling.profiled(trace_dir, decode, steps=new_tokens - 1)
      profile.update(summary)
    else:
      out = decode()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, None if out is None else out.tolist()   # None: no trace started

  run()  # compile
  pre, dec = [], []
  for _ in range(repeats):
    p, d, ids = run()
    pre.append(p)
    dec.append(d)
  if profile_dir:
    run(profile_dir)
  return pre, dec, ids


def measure_decode(model, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                   copy_bytes_per_s: float, seed: int = 0,
                   profile_dir: str | None = None) -> dict[str, Any]:
  """Prefill ms, decode ms per step and its ratio to the floor (weights + the KV cache the
  mean step reads, `decode_bytes_per_step`, over `copy_bytes_per_s`) for random prompts
  [batch, prompt_len]; with `profile_dir`, "profile": the traced decode's summary
  (core.profiling.summarize)."""
  import numpy as np

  from core import benchmark
  if new_tokens < 2:
    raise ValueError(f"measure_decode: new_tokens={new_tokens}, expected >= 2 (one decode "
                     "step after the prefill's token)")
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, model.cfg.vocab_size, (batch, prompt_len)).tolist()
  summary: dict = {}
  pre, dec, _ = time_decode(model, prompts, new_tokens, repeats, profile_dir, summary)
  step_ms = benchmark.median(dec) * 1e3 / (new_tokens - 1)
  w_bytes, kv_bytes = decode_bytes_per_step(model, batch, prompt_len, new_tokens)
  floor_ms = (w_bytes + kv_bytes) / copy_bytes_per_s * 1e3
  out = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
         "prefill_ms": benchmark.median(pre) * 1e3, "decode_ms_per_step": step_ms,
         "decode_floor_ms": floor_ms, "decode_over_floor": step_ms / floor_ms,
         "weight_bytes_per_step": w_bytes, "kv_bytes_per_step": kv_bytes}
  if profile_dir:
    out["profile"] = summary
  return out


__all__ = ["decode_bytes_per_step", "decode_kv_tokens", "measure_decode", "time_decode"]
