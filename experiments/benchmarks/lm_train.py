"""Llama training-step throughput and MFU, with a breakdown of where the step goes.

`run_benchmark` times one jitted, donated `LMTask.train_step` (llm/train_lib.py: bf16 compute
by default, fp32 master weights, AdamW, the chunked cross-entropy) on random tokens over
`steps` per repeat after a warm-up; the median step gives tokens/s and MFU = tokens/s x
`LlamaConfig.flops_per_token(seq_len)` / (devices x peak), the peak read from
`core.benchmark.PEAK_FLOPS` by the device kind (none on CPU). With breakdown=True it times
the parts separately, each jitted on its own, same shapes: forward, forward+backward,
forward+backward with attention replaced by a pass-through of q (the difference is
attention's share), the loss head, the optimizer.

Letters: B batch, T / S query / key length, H heads, G key/value heads, K head dim.
"""

from __future__ import annotations


def median_ms(fn, args, steps, repeats, warmup):
  """Median ms per call of fn(*args) (args not donated), after compiling + warm-up."""
  import time

  import jax
  from core import benchmark
  out = fn(*args)
  jax.block_until_ready(out)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / steps)
  return benchmark.median(times) * 1e3


def passthrough_attention(q_BTHK, k_BSGK, v_BSGK, **kwargs):
  """Attention replaced by q itself (lse 0): the step without attention's cost."""
  import jax.numpy as jnp
  del kwargs
  keep = 0 * (jnp.sum(k_BSGK) + jnp.sum(v_BSGK))   # k, v projections stay in the step
  return q_BTHK + keep.astype(q_BTHK.dtype), jnp.zeros(q_BTHK.shape[:3], jnp.float32)


def run_benchmark(cfg, *, seq_len, batch, mesh_spec, mu_dtype="float32", loss_chunk=None,
                  steps=10, repeats=3, warmup=2, breakdown=True, profile_dir=None,
                  hlo_path=None):
  """Times the train step of `cfg` (a LlamaConfig) and its parts; returns a results dict."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from core import benchmark
  from core import mesh as mesh_lib
  from llm import attention as attn_lib
  from llm import train_lib
  from llm.data import LMBatch

  mesh = mesh_lib.make_mesh(mesh_spec)
  optim = train_lib.OptimConfig(peak_lr=1e-4, warmup_steps=10, total_steps=1000,
                                mu_dtype=mu_dtype)
  task = train_lib.LMTask(cfg, optim, mesh, loss_chunk=loss_chunk)
  rng = np.random.default_rng(0)
  win = rng.integers(0, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
  host = LMBatch(inputs=win[:, :-1], targets=win[:, 1:], mask=np.ones((batch, seq_len),
                                                                       np.float32),
                 positions=None, segment_ids=None)
  dev_batch = task.device_batch(host)
  state = task.init_state(0)

  import time
  t0 = time.perf_counter()
  # The compiled executable is called directly: jit's own call path would compile again.
  compiled = jax.jit(task.train_step, donate_argnums=0).lower(state, dev_batch).compile()
  compile_s = time.perf_counter() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(compiled.as_text())

  def step_fn(s):
    s, _ = compiled(s, dev_batch)
    return s

  per_step, state = benchmark.time_steps(step_fn, state, steps, repeats, warmup)
  step_ms = benchmark.median(per_step) * 1e3
  profile = None
  if profile_dir:
    from core import profiling
    with profiling.trace(profile_dir):
      for _ in range(3):
        state = step_fn(state)
      jax.block_until_ready(state)
    profile = profiling.summarize(profile_dir, steps=3)

  n_dev = mesh.devices.size
  # What "auto" runs for the model's attention calls (no cache, default positions).
  q_spec = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_heads, cfg.head_dim), cfg.dtype)
  kv_spec = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)
  resolved = (attn_lib.choose_impl(q_spec, kv_spec) if cfg.attention_impl == "auto"
              else cfg.attention_impl)
  tokens = batch * seq_len
  flops_tok = cfg.flops_per_token(seq_len, training=True)
  kind = jax.devices()[0].device_kind
  peak = benchmark.peak_flops(kind, cfg.dtype) if jax.default_backend() == "gpu" else None
  tflops = tokens * flops_tok / (step_ms / 1e3) / 1e12
  res = {"preset_dims": {"dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
                         "kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn_dim,
                         "vocab": cfg.vocab_size},
         "params": cfg.num_params(), "seq_len": seq_len, "batch": batch, "mesh": mesh_spec,
         "devices": n_dev, "device_kind": kind, "attention_impl": cfg.attention_impl,
         "attention_resolved": resolved,
         "remat": cfg.remat_policy if cfg.remat else "none", "dtype": cfg.dtype,
         "mu_dtype": mu_dtype, "loss_chunk": task.loss_chunk,
         "compile_s": compile_s, "step_ms": step_ms, "step_ms_repeats": [t * 1e3 for t in per_step],
         "tokens_per_s": tokens / (step_ms / 1e3), "model_flops_per_token": flops_tok,
         "model_tflops_per_s": tflops, "peak_tflops_per_device": None if peak is None
         else peak / 1e12,
         "mfu": None if peak is None else tflops * 1e12 / (n_dev * peak),
         "xla_flops": float(cost.get("flops", 0.0)) if cost else None,
         "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)) if cost else None,
         "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
         "argument_bytes": getattr(mem, "argument_size_in_bytes", None)}
  if profile is not None:
    res["profile"] = profile
  if not breakdown:
    return res

  # Parts, each its own jit over the same shapes; the state is not donated here.
  params = state["params"]
  loss = lambda p, b: task.loss_sum(p, b)[0] / tokens
  fwd = jax.jit(loss)
  grads_fn = jax.jit(jax.grad(loss))
  parts = {"forward": median_ms(fwd, (params, dev_batch), steps, repeats, warmup),
           "forward+backward": median_ms(grads_fn, (params, dev_batch), steps, repeats,
                                          warmup)}
  attn_lib.register("_passthrough", passthrough_attention)
  bare = train_lib.LMTask(cfg.replace(attention_impl="_passthrough"), optim, mesh,
                          loss_chunk=loss_chunk)
  bare_grads = jax.jit(jax.grad(lambda p, b: bare.loss_sum(p, b)[0] / tokens))
  parts["no-attention forward+backward"] = median_ms(bare_grads, (params, dev_batch), steps,
                                                      repeats, warmup)

  def head(p, h, b):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      w, vocab_major = task.model(p).output_weight()
      chunk = train_lib.loss_chunk_tokens(batch, seq_len, cfg.vocab_size) \
          if loss_chunk is None else loss_chunk
      if chunk == 0:
        logits = task.model(p).logits(h)
        return train_lib.next_token_loss(logits, b.targets, b.mask)[0]
      return train_lib.chunked_cross_entropy(h, w, b.targets, b.mask, vocab_major,
                                             seq_len // chunk) / tokens

  h = jnp.zeros((batch, seq_len, cfg.dim), cfg.dtype) + 0.01
  h = jax.device_put(h, jax.sharding.NamedSharding(mesh, mesh_lib.logical_to_spec(
      ("act_batch", "act_seq", "act_embed"), mesh_lib.LLM_RULES, mesh)))
  parts["loss head forward+backward"] = median_ms(
      jax.jit(jax.grad(head, argnums=(0, 1))), (params, h, dev_batch), steps, repeats, warmup)
  g = grads_fn(params, dev_batch)

  def opt_step(p, o, g):
    import optax
    updates, o = task.tx.update(g, o, p)
    return optax.apply_updates(p, updates), o

  parts["optimizer"] = median_ms(jax.jit(opt_step), (params, state["opt"], g), steps, repeats,
                                  warmup)
  parts["attention (by difference)"] = (parts["forward+backward"]
                                        - parts["no-attention forward+backward"])
  res["breakdown_ms"] = parts
  return res
