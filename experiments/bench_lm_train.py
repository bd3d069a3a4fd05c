r"""Llama training-step throughput and MFU, with a breakdown of where the step goes.

  python -m experiments.bench_lm_train --preset=llama32_1b --seq_len=8192 --batch=1
  python -m experiments.bench_lm_train --preset=tiny --seq_len=64 --batch=2 --steps=2   # CPU

One jitted, donated `LMTask.train_step` (llm/train_lib.py: bf16 compute by default, fp32
master weights, AdamW, the chunked cross-entropy) on random tokens, timed over --steps per
repeat after a warm-up; the median step gives tokens/s and MFU = tokens/s x
`LlamaConfig.flops_per_token(seq_len)` / (devices x peak), the peak read from PEAK_FLOPS by
the device kind and printed with it (none on CPU). --breakdown times the parts separately,
each jitted on its own, same shapes:
  forward          the loss alone (no gradients);
  forward+backward the gradients, no optimizer;
  no-attention     forward+backward with attention replaced by a pass-through of q (what
                   the step costs without attention; the difference is attention's share);
  loss head        the output projection + chunked cross-entropy, forward and backward;
  optimizer        clipping + AdamW on fixed gradients.
It also reports XLA's cost analysis of the compiled step (FLOPs, bytes accessed) and its
memory analysis (temporaries, arguments). --profile writes a jax.profiler trace of a few
steps to <workdir>/profile (TensorBoard / Perfetto); --xla_dump writes XLA's HLO passes to
<workdir>/xla_dump and the compiled step's HLO to <workdir>/step.hlo.txt.
Writes results.json; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import json
import os

from absl import flags, logging

from core import cli
from core import results as results_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  flags.DEFINE_string("preset", "llama32_1b", "Model size (llm.config.PRESETS).")
  flags.DEFINE_integer("seq_len", 8192, "Tokens per row.")
  flags.DEFINE_integer("batch", 1, "Global batch (rows).")
  flags.DEFINE_string("mesh", "data:1", "Mesh (core.mesh: e.g. data:1, fsdp:8, data:2,tp:4).")
  flags.DEFINE_string("attention_impl", "auto", "llm.attention implementation.")
  flags.DEFINE_enum("remat", "none", ["none", "full", "dots", "attention"],
                    "Rematerialization: none, or LlamaConfig.remat_policy.")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
  flags.DEFINE_enum("mu_dtype", "float32", ["float32", "bfloat16"], "AdamW first-moment dtype.")
  flags.DEFINE_integer("loss_chunk", -1, "Tokens per chunk of the cross-entropy (-1: auto, "
                       "0: plain loss over full logits).")
  flags.DEFINE_integer("steps", 10, "Steps per timed repeat.")
  flags.DEFINE_integer("repeats", 3, "Timed repeats.")
  flags.DEFINE_integer("warmup", 2, "Untimed steps after compiling.")
  flags.DEFINE_bool("breakdown", True, "Time forward, backward, attention, loss head, optimizer.")
  flags.DEFINE_bool("profile", False, "jax.profiler trace of 3 steps to <workdir>/profile.")
  flags.DEFINE_bool("xla_dump", False, "XLA HLO dumps to <workdir>/xla_dump.")
  flags.DEFINE_string("workdir", "runs/bench_lm_train", "Where results.json and traces go.")


# Dense (no sparsity) tensor-core peak FLOP/s by device kind, per compute dtype; float32 is
# the TF32 rate XLA uses for fp32 matmuls on these GPUs. Matched by substring, first wins.
PEAK_FLOPS = (
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 378e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 418e12}),
    ("H100", {"bfloat16": 989e12, "float32": 494e12}),       # SXM
    ("H200", {"bfloat16": 989e12, "float32": 494e12}),
    ("GH200", {"bfloat16": 989e12, "float32": 494e12}),
    ("B200", {"bfloat16": 2250e12, "float32": 1100e12}),
    ("A100", {"bfloat16": 312e12, "float32": 156e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 183e12}),
    ("L4", {"bfloat16": 121e12, "float32": 60e12}),
)


def peak_flops(device_kind: str, dtype: str) -> float | None:
  """Dense peak FLOP/s of one device of this kind for `dtype` compute; None if unknown."""
  for name, peaks in PEAK_FLOPS:
    if name.lower() in device_kind.lower():
      return peaks.get(dtype)
  return None


def _median_ms(fn, args, steps, repeats, warmup):
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


def _passthrough_attention(q_BTHK, k_BSGK, v_BSGK, **kwargs):
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

  step = jax.jit(task.train_step, donate_argnums=0)
  compiled = step.lower(state, dev_batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(compiled.as_text())

  def step_fn(s):
    s, _ = step(s, dev_batch)
    return s

  per_step, state = benchmark.time_steps(step_fn, state, steps, repeats, warmup)
  step_ms = benchmark.median(per_step) * 1e3
  if profile_dir:
    with jax.profiler.trace(profile_dir):
      for _ in range(3):
        state = step_fn(state)
      jax.block_until_ready(state)

  n_dev = mesh.devices.size
  # What "auto" runs for the model's attention calls (no cache, default positions).
  q_spec = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_heads, cfg.head_dim), cfg.dtype)
  kv_spec = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)
  resolved = (attn_lib.choose_impl(q_spec, kv_spec) if cfg.attention_impl == "auto"
              else cfg.attention_impl)
  tokens = batch * seq_len
  flops_tok = cfg.flops_per_token(seq_len, training=True)
  kind = jax.devices()[0].device_kind
  peak = peak_flops(kind, cfg.dtype) if jax.default_backend() == "gpu" else None
  tflops = tokens * flops_tok / (step_ms / 1e3) / 1e12
  res = {"preset_dims": {"dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads,
                         "kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn_dim,
                         "vocab": cfg.vocab_size},
         "params": cfg.num_params(), "seq_len": seq_len, "batch": batch, "mesh": mesh_spec,
         "devices": n_dev, "device_kind": kind, "attention_impl": cfg.attention_impl,
         "attention_resolved": resolved,
         "remat": cfg.remat_policy if cfg.remat else "none", "dtype": cfg.dtype,
         "mu_dtype": mu_dtype, "loss_chunk": task.loss_chunk,
         "step_ms": step_ms, "step_ms_repeats": [t * 1e3 for t in per_step],
         "tokens_per_s": tokens / (step_ms / 1e3), "model_flops_per_token": flops_tok,
         "model_tflops_per_s": tflops, "peak_tflops_per_device": None if peak is None
         else peak / 1e12,
         "mfu": None if peak is None else tflops * 1e12 / (n_dev * peak),
         "xla_flops": float(cost.get("flops", 0.0)) if cost else None,
         "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)) if cost else None,
         "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
         "argument_bytes": getattr(mem, "argument_size_in_bytes", None)}
  if not breakdown:
    return res

  # Parts, each its own jit over the same shapes; the state is not donated here.
  params = state["params"]
  loss = lambda p, b: task.loss_sum(p, b)[0] / tokens
  fwd = jax.jit(loss)
  grads_fn = jax.jit(jax.grad(loss))
  parts = {"forward": _median_ms(fwd, (params, dev_batch), steps, repeats, warmup),
           "forward+backward": _median_ms(grads_fn, (params, dev_batch), steps, repeats,
                                          warmup)}
  attn_lib.register("_passthrough", _passthrough_attention)
  bare = train_lib.LMTask(cfg.replace(attention_impl="_passthrough"), optim, mesh,
                          loss_chunk=loss_chunk)
  bare_grads = jax.jit(jax.grad(lambda p, b: bare.loss_sum(p, b)[0] / tokens))
  parts["no-attention forward+backward"] = _median_ms(bare_grads, (params, dev_batch), steps,
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
  parts["loss head forward+backward"] = _median_ms(
      jax.jit(jax.grad(head, argnums=(0, 1))), (params, h, dev_batch), steps, repeats, warmup)
  g = grads_fn(params, dev_batch)

  def opt_step(p, o, g):
    import optax
    updates, o = task.tx.update(g, o, p)
    return optax.apply_updates(p, updates), o

  parts["optimizer"] = _median_ms(jax.jit(opt_step), (params, state["opt"], g), steps, repeats,
                                  warmup)
  parts["attention (by difference)"] = (parts["forward+backward"]
                                        - parts["no-attention forward+backward"])
  res["breakdown_ms"] = parts
  return res


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  if FLAGS.xla_dump:
    dump = os.path.abspath(os.path.join(FLAGS.workdir, "xla_dump"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
  import jax
  from llm.config import get_config

  cfg = get_config(FLAGS.preset, dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl,
                   remat=FLAGS.remat != "none",
                   remat_policy="full" if FLAGS.remat == "none" else FLAGS.remat,
                   max_seq_len=max(FLAGS.seq_len, get_config(FLAGS.preset).max_seq_len))
  res = run_benchmark(
      cfg, seq_len=FLAGS.seq_len, batch=FLAGS.batch, mesh_spec=FLAGS.mesh,
      mu_dtype=FLAGS.mu_dtype, loss_chunk=None if FLAGS.loss_chunk < 0 else FLAGS.loss_chunk,
      steps=FLAGS.steps, repeats=FLAGS.repeats, warmup=FLAGS.warmup, breakdown=FLAGS.breakdown,
      profile_dir=os.path.join(FLAGS.workdir, "profile") if FLAGS.profile else None,
      hlo_path=os.path.join(FLAGS.workdir, "step.hlo.txt") if FLAGS.xla_dump else None)
  from core import benchmark
  res["preset"] = FLAGS.preset
  res["machine"] = benchmark.machine()

  print(f"Llama {FLAGS.preset} ({res['params'] / 1e6:,.1f}M params) | seq {FLAGS.seq_len} | "
        f"batch {FLAGS.batch} | mesh {FLAGS.mesh} ({res['devices']} x {res['device_kind']}) | "
        f"attention {cfg.attention_impl} ({res['attention_resolved']}) | remat {res['remat']} "
        f"| {cfg.dtype} compute, mu {FLAGS.mu_dtype}")
  print(f"{'step ms':>10s}{'tokens/s':>14s}{'model TFLOP/s':>16s}{'MFU':>9s}")
  mfu = "n/a" if res["mfu"] is None else f"{100 * res['mfu']:.1f}%"
  print(f"{res['step_ms']:10.1f}{res['tokens_per_s']:14,.0f}{res['model_tflops_per_s']:16.1f}"
        f"{mfu:>9s}")
  if res["peak_tflops_per_device"] is None:
    print(f"MFU: no peak FLOP/s known for {res['device_kind']!r} "
          f"({jax.default_backend()}); PEAK_FLOPS lists the GPUs")
  else:
    print(f"MFU against {res['peak_tflops_per_device']:.0f} TFLOP/s per device "
          f"({res['device_kind']}, dense {cfg.dtype}); model FLOPs "
          f"{res['model_flops_per_token'] / 1e9:.2f} GFLOP/token (LlamaConfig.flops_per_token)")
  if res.get("xla_flops"):
    print(f"XLA cost analysis of the step: {res['xla_flops'] / 1e12:.2f} TFLOP, "
          f"{res['xla_bytes_accessed'] / 1e9:.2f} GB accessed; temporaries "
          f"{(res['temp_bytes'] or 0) / 2**30:.2f} GiB")
  if "breakdown_ms" in res:
    print("\nbreakdown (each part jitted alone, median ms):")
    for name, ms in res["breakdown_ms"].items():
      print(f"  {name:32s}{ms:10.2f}{100 * ms / res['step_ms']:8.1f}% of the step")
  results_lib.write_results(FLAGS.workdir, res)
  summary = {k: res[k] for k in ("preset", "seq_len", "batch", "mesh", "attention_impl",
                                 "attention_resolved", "remat", "step_ms", "tokens_per_s", "model_tflops_per_s",
                                 "mfu", "peak_tflops_per_device", "device_kind")}
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
