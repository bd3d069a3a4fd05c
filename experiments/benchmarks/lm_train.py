"""Llama training-step throughput and MFU, with a breakdown of where the step goes.

`run_benchmark` times one jitted, donated `LMTask.train_step` (llm/train_lib.py: bf16 compute
by default, fp32 master weights, AdamW, the chunked cross-entropy) on random tokens over
`steps` per repeat after a warm-up; the median step gives tokens/s and MFU = tokens/s x
`LlamaConfig.flops_per_token(seq_len)` / (devices x peak), the peak read from
`core.benchmark.PEAK_FLOPS` by the device kind (none on CPU). With breakdown=True it times
the parts separately, each jitted on its own, same shapes: forward, forward+backward,
forward+backward with attention replaced by a pass-through of q (the difference is
attention's share), the loss head, the optimizer.

`compare_finetuning` builds, for one model, sequence length and batch, the full fine-tuning
step and LoRA steps (arXiv 2106.09685; `llm.lora`) on a frozen base held in the compute
dtype or as int8 / int4 weights (`llm.quantized`; QLoRA-style, arXiv 2305.14314), and
measures them side by side in one process: trainable parameters, the bytes of parameters,
adapters and optimizer state, XLA's memory analysis of each compiled step, and the median
step time with the variants' timed repeats interleaved; `comparison_table` and
`plot_comparison` show it.

Letters: B batch, T / S query / key length, H heads, G key/value heads, K head dim.
"""

from __future__ import annotations

import os


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


def dump_options(directory):
  """Compiler options that write XLA's HLO passes of one compile to `directory` as text
  (per compile: XLA_FLAGS set once the backend is up would change nothing); None: none."""
  if not directory:
    return None
  return {"xla_dump_to": os.path.abspath(directory), "xla_dump_hlo_as_text": True}


def passthrough_attention(q_BTHK, k_BSGK, v_BSGK, **kwargs):
  """Attention replaced by q itself (lse 0): the step without attention's cost."""
  import jax.numpy as jnp
  del kwargs
  keep = 0 * (jnp.sum(k_BSGK) + jnp.sum(v_BSGK))   # k, v projections stay in the step
  return q_BTHK + keep.astype(q_BTHK.dtype), jnp.zeros(q_BTHK.shape[:3], jnp.float32)


def run_benchmark(cfg, *, seq_len, batch, mesh_spec, mu_dtype="float32", loss_chunk=None,
                  steps=10, repeats=3, warmup=2, breakdown=True, profile_dir=None,
                  hlo_path=None, xla_dump_dir=None):
  """Times the train step of `cfg` (a LlamaConfig) and its parts; returns a results dict.
  xla_dump_dir: XLA's HLO passes of the compiled step written there (as text)."""
  import jax
  import jax.numpy as jnp
  from core import benchmark
  from core import mesh as mesh_lib
  from llm import attention as attn_lib
  from llm import train_lib

  mesh = mesh_lib.make_mesh(mesh_spec)
  optim = train_lib.OptimConfig(peak_lr=1e-4, warmup_steps=10, total_steps=1000,
                                mu_dtype=mu_dtype)
  task = train_lib.LMTask(cfg, optim, mesh, loss_chunk=loss_chunk)
  host = _random_batch(cfg.vocab_size, batch, seq_len)
  dev_batch = task.device_batch(host)
  state = task.init_state(0)

  import time
  t0 = time.perf_counter()
  # The compiled executable is called directly: jit's own call path would compile again.
  compiled = jax.jit(task.train_step, donate_argnums=0).lower(state, dev_batch).compile(
      dump_options(xla_dump_dir))
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

    def three_steps(state=state):
      for _ in range(3):
        state = step_fn(state)
      return jax.block_until_ready(state)

    traced, profile = profiling.profiled(profile_dir, three_steps, steps=3)
    state = state if traced is None else traced

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


# --- LoRA / QLoRA against full fine-tuning: memory and step time, side by side

# What `compare_finetuning` runs: full fine-tuning (fp32 master weights, AdamW on every
# parameter) and LoRA adapters on a frozen base held in the compute dtype, or as int8 /
# int4 groups of 32 (llm.quantized: QLoRA-style).
VARIANTS = ("full", "lora", "qlora8", "qlora4")
_QUANT = {"qlora8": "int8", "qlora4": "int4"}


def random_weights(cfg, seed: int = 0):
  """Float32 contract weights (`llm.weights` names) of a randomly initialized `cfg`, on the
  host: the one start every variant of `compare_finetuning` shares."""
  import jax
  from flax import nnx
  from llm import model as model_lib
  cfg = cfg.replace(param_dtype="float32")
  # One jitted init (eager, each parameter's draw would be a program of its own).
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0))))
  state = jax.jit(lambda k: nnx.state(model_lib.Llama(cfg, nnx.Rngs(k))))(jax.random.key(seed))
  return model_lib.weights_from_model(nnx.merge(graphdef, state))


def _random_batch(vocab_size: int, batch: int, seq_len: int, seed: int = 0):
  import numpy as np
  from llm.data import LMBatch
  win = np.random.default_rng(seed).integers(0, vocab_size, (batch, seq_len + 1))
  win = win.astype(np.int32)
  return LMBatch(inputs=win[:, :-1], targets=win[:, 1:],
                 mask=np.ones((batch, seq_len), np.float32), positions=None, segment_ids=None)


def _nbytes(tree) -> int:
  import jax
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def _size(tree) -> int:
  import jax
  return int(sum(x.size for x in jax.tree.leaves(tree)))


def _variant_task(variant, cfg, weights, lora, optim, mesh, loss_chunk):
  """(LMTask, how its base is held) of one variant."""
  from llm import quantized
  from llm import train_lib
  if variant == "full":
    task = train_lib.LMTask(cfg.replace(param_dtype="float32"), optim, mesh,
                            loss_chunk=loss_chunk, init_weights=weights)
    return task, "float32, trained"
  if lora is None:
    raise ValueError(f"compare_finetuning: variant {variant!r} needs a LoraConfig (lora=)")
  base, held = weights, f"{cfg.dtype}, frozen"
  if variant in _QUANT:
    base, forms = quantized.quantize(cfg, _QUANT[variant], weights=weights)
    # Tensors left float (the norms) are held in the compute dtype like the rest of the base.
    counts = quantized.summarize_forms({k: f.replace("float32", cfg.dtype)
                                        for k, f in forms.items()})
    held = ", ".join(f"{n} {form}" for form, n in counts.items()) + ", frozen"
  # The frozen base is held in the compute dtype (the norms and any matrix left float too):
  # no fp32 master copy is needed for weights that never change.
  task = train_lib.LMTask(cfg.replace(param_dtype=cfg.dtype), optim, mesh,
                          loss_chunk=loss_chunk, init_weights=base, lora=lora)
  return task, held


def compare_finetuning(cfg, lora, *, variants=VARIANTS, weights=None, seq_len, batch,
                       mesh_spec="data:1", devices=None, mu_dtype="float32", loss_chunk=None,
                       steps=2, repeats=3, warmup=1, seed=0, xla_dump_dir=None):
  """Full fine-tuning against LoRA (`lora`: an llm.lora.LoraConfig) on the same model,
  weights (`weights`: float32 contract weights, default `random_weights(cfg, seed)`) and
  batch of random tokens, each variant one jitted, donated `LMTask.train_step`.

  Each variant is compiled ahead of time (XLA's memory analysis of the compiled step:
  argument / output / temporary bytes per device, the outputs aliased to donated arguments
  counted once in `xla_total_bytes`), called once (its step-0 loss) and `warmup` times;
  then the timed repeats are interleaved, variant by variant within each repeat (A B C D
  A B C D ...), so load on a shared machine falls on every variant alike. A repeat is
  `steps` calls; the median repeat gives ms per step. Memory held by the state: the
  parameters (the trained ones, or the frozen base), the adapters, the optimizer state (all
  of the arrays, over every device). Returns {"variants": {name: row}, "ratios": {name:
  row / full's} (when "full" is run), settings}. xla_dump_dir: each variant's compiled step
  as XLA's HLO passes in <xla_dump_dir>/<variant>."""
  import time

  import jax
  from core import mesh as mesh_lib
  from llm import train_lib

  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    raise ValueError(f"compare_finetuning: variants {list(variants)}; expected some of "
                     f"{list(VARIANTS)}")
  mesh = mesh_lib.make_mesh(mesh_spec, devices)
  optim = train_lib.OptimConfig(peak_lr=1e-4, warmup_steps=10, total_steps=1000,
                                mu_dtype=mu_dtype)
  weights = random_weights(cfg, seed) if weights is None else weights
  host = _random_batch(cfg.vocab_size, batch, seq_len, seed)
  tokens = batch * seq_len
  runs = {}
  for v in variants:
    task, held = _variant_task(v, cfg, weights, lora, optim, mesh, loss_chunk)
    state = task.init_state(seed)
    dev_batch = task.device_batch(host)
    t0 = time.perf_counter()
    compiled = jax.jit(task.train_step, donate_argnums=0).lower(state, dev_batch).compile(
        dump_options(xla_dump_dir and os.path.join(xla_dump_dir, v)))
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    xla = {k: getattr(mem, f"{k}_size_in_bytes", None)
           for k in ("argument", "output", "temp", "alias", "generated_code")}
    total = (None if None in (xla["argument"], xla["output"], xla["temp"]) else
             xla["argument"] + xla["output"] - (xla["alias"] or 0) + xla["temp"])
    lora_tree = state.get("lora")
    row = {"base": held,
           "trainable_params": _size(lora_tree if lora_tree is not None else state["params"]),
           "param_bytes": _nbytes(state["params"]),
           "adapter_bytes": 0 if lora_tree is None else _nbytes(lora_tree),
           "optimizer_state_bytes": _nbytes(state["opt"]),
           **{f"xla_{k}_bytes": n for k, n in xla.items()}, "xla_total_bytes": total,
           "compile_s": compile_s}
    row["state_bytes"] = row["param_bytes"] + row["adapter_bytes"] + row["optimizer_state_bytes"]
    state, metrics = compiled(state, dev_batch)
    row["loss_step0"] = float(metrics["loss"])
    for _ in range(warmup):
      state, metrics = compiled(state, dev_batch)
    jax.block_until_ready(state)
    runs[v] = {"compiled": compiled, "state": state, "batch": dev_batch, "row": row,
               "times": [], "metrics": metrics}

  for _ in range(repeats):
    for v in variants:
      r = runs[v]
      state, metrics = r["state"], r["metrics"]
      t0 = time.perf_counter()
      for _ in range(steps):
        state, metrics = r["compiled"](state, r["batch"])
      jax.block_until_ready(state)
      r["times"].append((time.perf_counter() - t0) / steps)
      r["state"], r["metrics"] = state, metrics

  from core import benchmark
  rows = {}
  for v in variants:
    r = runs[v]
    step_s = benchmark.median(r["times"])
    rows[v] = {**r["row"], "loss_last": float(r["metrics"]["loss"]), "step_ms": step_s * 1e3,
               "step_ms_repeats": [t * 1e3 for t in r["times"]],
               "tokens_per_s": tokens / step_s}
  del runs
  ratio_keys = ("trainable_params", "optimizer_state_bytes", "param_bytes", "state_bytes",
                "xla_argument_bytes", "xla_temp_bytes", "xla_output_bytes", "xla_total_bytes",
                "step_ms", "tokens_per_s")
  ratios = {}
  if "full" in rows:
    full = rows["full"]
    ratios = {v: {k: (rows[v][k] / full[k] if rows[v][k] is not None and full[k] else None)
                  for k in ratio_keys} for v in variants if v != "full"}
  n_dev = mesh.devices.size
  return {"variants": rows, "ratios": ratios, "order": list(variants),
          "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                              "targets": list(lora.targets)},
          "params": cfg.num_params(), "seq_len": seq_len, "batch": batch, "tokens": tokens,
          "mesh": mesh_spec, "devices": n_dev, "device_kind": jax.devices()[0].device_kind,
          "dtype": cfg.dtype, "mu_dtype": mu_dtype, "remat": cfg.remat_policy if cfg.remat
          else "none", "attention_impl": cfg.attention_impl, "steps": steps,
          "repeats": repeats, "warmup": warmup,
          "preset_dims": {"dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
                          "kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn_dim,
                          "vocab": cfg.vocab_size, "tied": cfg.tie_embeddings}}


def comparison_table(res) -> str:
  """Markdown tables of `compare_finetuning`'s result: each variant's memory and step time,
  then its ratios to full fine-tuning."""
  from core.memory import format_bytes as fb
  rows, order = res["variants"], res["order"]
  out = ["| variant | base held as | trainable params | optimizer state | parameters | "
         "adapters | XLA arguments | XLA temporaries | XLA outputs | step ms | tokens/s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  opt = lambda n: "n/a" if n is None else fb(n)
  for v in order:
    r = rows[v]
    out.append(f"| {v} | {r['base']} | {r['trainable_params']:,} | "
               f"{fb(r['optimizer_state_bytes'])} | {fb(r['param_bytes'])} | "
               f"{fb(r['adapter_bytes'])} | {opt(r['xla_argument_bytes'])} | "
               f"{opt(r['xla_temp_bytes'])} | {opt(r['xla_output_bytes'])} | "
               f"{r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} |")
  if res["ratios"]:
    x = lambda q: "n/a" if q is None else f"{q:.3g}x"
    out += ["", "| / full | trainable | optimizer state | parameters | state (params + "
            "adapters + optimizer) | XLA arguments | XLA temporaries | XLA total | step time "
            "| tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v, q in res["ratios"].items():
      out.append(f"| {v} | {x(q['trainable_params'])} | {x(q['optimizer_state_bytes'])} | "
                 f"{x(q['param_bytes'])} | {x(q['state_bytes'])} | "
                 f"{x(q['xla_argument_bytes'])} | {x(q['xla_temp_bytes'])} | "
                 f"{x(q['xla_total_bytes'])} | {x(q['step_ms'])} | {x(q['tokens_per_s'])} |")
  return "\n".join(out)


def plot_comparison(res, path: str) -> str:
  """Bar plot of `compare_finetuning`'s result: median step time, the state's memory
  (parameters, adapters, optimizer state) and XLA's memory analysis of each step (MiB)."""
  import numpy as np
  from core import plot
  rows, order = res["variants"], res["order"]
  x = np.arange(len(order))
  mib = lambda k: np.array([(rows[v][k] or 0) / 2**20 for v in order])
  with plot.figure(path, 1, 3, figsize=(14, 4.2), tight=(0, 0, 1, 0.93)) as (fig, axes):
    ax = axes[0]
    ax.bar(x, [rows[v]["step_ms"] for v in order], color="tab:blue")
    ax.set(title="median step (ms)", xticks=x, xticklabels=order)
    ax = axes[1]
    bottom = np.zeros(len(order))
    for k, label in (("param_bytes", "parameters"), ("adapter_bytes", "adapters"),
                     ("optimizer_state_bytes", "optimizer state")):
      ax.bar(x, mib(k), bottom=bottom, label=label)
      bottom += mib(k)
    ax.set(title="state held (MiB)", xticks=x, xticklabels=order)
    ax.legend(fontsize=8)
    ax = axes[2]
    w = 0.27
    for i, (k, label) in enumerate((("xla_argument_bytes", "arguments"),
                                    ("xla_temp_bytes", "temporaries"),
                                    ("xla_output_bytes", "outputs"))):
      ax.bar(x + (i - 1) * w, mib(k), w, label=label)
    ax.set(title="XLA memory analysis per device (MiB)", xticks=x, xticklabels=order)
    ax.legend(fontsize=8)
    for a in axes:
      a.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{res['params'] / 1e6:,.1f}M params | seq {res['seq_len']} x batch "
                 f"{res['batch']} | {res['dtype']} compute | {res['device_kind']}"
                 + (f" | LoRA rank {res['lora']['rank']}" if res["lora"] else ""), fontsize=9)
  return path
