r"""Context-parallel Llama prefill (arXiv 2411.01783): CP vs no-CP logits and latency.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
      python -m experiments.cp_prefill --mesh=cp:4 --seq_len=512 --variant=pass_kv
  python -m experiments.cp_prefill --mesh=cp:8 --preset=llama_100m --seq_len=8192 \
      --cached_len=24576 --variant=auto                        # 8 GPUs: persistent-KV prefill
  python -m experiments.cp_prefill --mesh=data:2,cp:4 --batch=2 --seq_len=256 --variant=pass_q

Runs a real prefill of `--batch` random prompts through `llm.model.Llama` with random
weights, twice: with context_parallel=<variant> under `jax.set_mesh(--mesh)` (the mesh
needs a `cp` axis; it uses the first devices when it needs fewer than are present), and
without CP (attention_impl "xla", one device). Full prefill: a forward over seq_len tokens
(load-balanced over the cp ranks, logits back in natural order). Persistent-KV prefill
(--cached_len=P > 0): P tokens are prefilled into a KV cache first (not timed), then the
timed call adds seq_len new tokens, attending to the P cached ones where they sit. Both
lengths must be multiples of 2 * cp (the load-balanced layout).

Reports the max |logit difference| CP vs no-CP over every position of the timed call,
PASS/FAIL at --tol (absolute; default 1e-4 for float32, where both run at float32 matmul
precision; 0.2 for bfloat16, where the two runs round activations to bf16 at different
points, which moves logits of order 5 by a few bf16 ulps: 0.059 on the first command below), the median
wall time of each over --repeats (after one compile call), and the variant that ran (read
off the traced program: an all_to_all means pass-Q) next to the one the rule picks
(`llm.attention.cp_select`, paper Algorithm 5, with --peak_tflops / --bandwidth_gbps).
Prints a table, writes results.json to --workdir, and prints a one-line JSON summary last;
exits 1 when the check fails.

On CPU, devices are simulated: set XLA_FLAGS=--xla_force_host_platform_device_count=N before
the run (N >= the mesh size). The N "devices" share the host's cores, so CP timings there say
little; they mean something on real accelerators. On the 2-core CPU of BENCHMARKS.md
(2026-11-21) the first command took 4.4 s and printed max |diff| 4.59e-06 (PASS), CP4
pass_kv 12.1 ms vs no CP 16.9 ms (four smaller attention blocks over two cores, not more
hardware); with `--dtype=bfloat16` max |diff| 0.059 (PASS at 0.2);
`--mesh=cp:8 --preset=llama_100m --seq_len=256 --variant=pass_kv` printed CP8 696 ms vs no
CP 314 ms, max |diff| 7.9e-06.
"""

from __future__ import annotations

import functools
import math
import statistics

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings  # noqa: F401  (the shared settings by name)
from experiments.common.report import Report
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS


CACHED_LEN = config.setting(
    "cached_len", "integer", "Tokens already in the KV cache (persistent-KV prefill; 0: full "
    "prefill without a cache). Multiple of 2*cp.", lower=0)
VARIANT = config.setting(
    "variant", "enum", "Ring attention variant.", choices=("pass_kv", "pass_q", "auto"))
INNER_IMPL = config.setting(
    "inner_impl", "enum", "Per-block attention inside the ring.", choices=("xla", "pallas"))
TOL = config.setting(
    "tol", "float", "Max |logit difference| to pass; default 1e-4 (float32), 0.2 (bfloat16).",
    none_ok=True)
PEAK_TFLOPS = config.setting(
    "peak_tflops", "float", "C of the auto rule, TF/s per rank (H100 dense bf16).")
BANDWIDTH_GBPS = config.setting(
    "bandwidth_gbps", "float", "BW of the auto rule, GB/s per rank (400 Gb/s RDMA).")


# The LM run's settings (llm.run_config.LMRunConfig) this entry point takes, at its own
# defaults; every other setting of the run keeps LMRunConfig's.
LM_FLAGS = dict(mesh="cp:-1", preset="tiny", seq_len=512, dtype="float32", seed=0)


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names; `flag_values`: where, default
  absl's FLAGS). The model, mesh and lengths are LMRunConfig's settings; every setting but
  --workdir may come from a --config file."""
  from llm.run_config import LMRunConfig
  fv = flags.FLAGS if flag_values is None else flag_values
  config.define_flags(LMRunConfig, only=(), flag_values=fv, **LM_FLAGS)
  config.define_flags(
      None, CACHED_LEN, "batch", VARIANT, INNER_IMPL, "repeats", TOL, PEAK_TFLOPS,
      BANDWIDTH_GBPS, in_config=True, flag_values=fv, cached_len=0, batch=1,
      variant="pass_kv", inner_impl="xla", repeats=5, tol=None, peak_tflops=989.0,
      bandwidth_gbps=50.0)
  config.define_flags(None, "workdir", flag_values=fv, workdir="runs/cp_prefill")
  for name in ("peak_tflops", "bandwidth_gbps"):
    flags.register_validator(name, lambda v: v > 0, message="expected a value > 0",
                             flag_values=fv)
  flags.register_validator("tol", lambda v: v is None or v >= 0, message="expected >= 0",
                           flag_values=fv)


def make_mesh_for(spec: str):
  """The mesh for `spec` over the first devices it needs (all of them for a -1 size)."""
  import jax
  from core import mesh as mesh_lib
  axes = mesh_lib.parse_mesh(spec)
  if "cp" not in dict(axes):
    raise ValueError(f"--mesh={spec!r} has no cp axis; expected e.g. cp:4 or data:2,cp:4")
  devices = jax.devices()
  if all(n != -1 for _, n in axes):
    devices = devices[:min(len(devices), math.prod(n for _, n in axes))]
  mesh = mesh_lib.make_mesh(spec, devices)
  if mesh.shape["cp"] < 2:   # one rank runs no ring: "CP" would be the no-CP model again
    raise errors.expected(f"--mesh={spec}", f"a cp axis of {mesh.shape['cp']} rank on "
                          f"{len(jax.devices())} device(s)", "cp >= 2 ranks (on CPU, set "
                          "XLA_FLAGS=--xla_force_host_platform_device_count=N first)")
  return mesh


def ring_variant_in(jaxpr) -> str:
  """"pass_q" if the traced program returns partials with an all_to_all (pass-Q), else
  "pass_kv" when it rotates blocks with ppermute; "none" without a ring."""
  import jax.extend as jex

  def names(jx):
    for eqn in jx.eqns:
      yield eqn.primitive.name
      for sub in eqn.params.values():
        sub = sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub
        if isinstance(sub, jex.core.Jaxpr):
          yield from names(sub)
  found = set(names(jaxpr))
  return "pass_q" if "all_to_all" in found else "pass_kv" if "ppermute" in found else "none"


def _timed(fn, args, repeats: int):
  """(outputs of the compile call, seconds of each later call)."""
  import time
  import jax
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return out, times


def run(cfg, mesh, *, seq_len: int, cached_len: int = 0, batch: int = 1,
        variant: str = "pass_kv", inner_impl: str = "xla", repeats: int = 5, tol: float = 1e-4,
        peak_flops: float = 989e12, bandwidth: float = 50e9, seed: int = 0,
        preset: str = "") -> dict:
  """CP (ring attention over `mesh`) vs no-CP prefill of random tokens; returns results.json.
  variant "auto" is resolved here by the paper's rule with peak_flops / bandwidth."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from core import benchmark
  from llm import model as model_lib
  from llm.attention import ring

  n = mesh.shape["cp"]
  for name, length in (("seq_len", seq_len), ("cached_len", cached_len)):
    if length < 0 or length % (2 * n) or (name == "seq_len" and length == 0):
      raise ValueError(f"--{name}={length}: expected a {'positive ' if name == 'seq_len' else ''}"
                       f"multiple of 2 * cp = {2 * n} (the load-balanced layout)")
  # The rule ring_attention applies at trace time: T new tokens, KV = the P + T cache slots.
  rule = ring.select_variant(variant, new_tokens=seq_len, cached_tokens=cached_len,
                             n_ranks=n, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                             bytes_per_elem=jnp.dtype(cfg.dtype).itemsize,
                             peak_flops=peak_flops, bandwidth=bandwidth)
  ref_cfg = cfg.replace(attention_impl="xla")
  cp_cfg = cfg.replace(attention_impl=inner_impl, context_parallel=rule)
  ref = model_lib.Llama(ref_cfg, nnx.Rngs(seed))
  cp_model = nnx.eval_shape(lambda: model_lib.Llama(cp_cfg, nnx.Rngs(seed)))
  model_lib.load_weights(cp_model, model_lib.weights_from_model(ref))
  model_lib.shard_model(cp_model, mesh)
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cached_len + seq_len)), jnp.int32)
  old, new = tokens[:, :cached_len], tokens[:, cached_len:]

  @functools.partial(jax.jit, static_argnums=0)
  def forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def fill(graphdef, state, tokens, max_len):
    model = nnx.merge(graphdef, state)
    return model(tokens, cache=model.init_cache(tokens.shape[0], max_len))[1]

  @functools.partial(jax.jit, static_argnums=0)
  def extend(graphdef, state, tokens, cache):
    return nnx.merge(graphdef, state)(tokens, cache=cache)[0]

  def timed_call(model):
    graphdef, state = nnx.split(model)
    if cached_len == 0:
      fn, args = forward, (graphdef, state, new)
    else:   # the cache holds exactly P + T slots: P/N + T/N on each rank under CP
      fn, args = extend, (graphdef, state, new,
                          jax.block_until_ready(fill(graphdef, state, old, cached_len + seq_len)))
    return (fn, args, *_timed(fn, args, repeats))

  _, _, ref_logits, ref_s = timed_call(ref)
  ref_logits = np.asarray(ref_logits)
  with jax.set_mesh(mesh):
    fn, args, cp_logits, cp_s = timed_call(cp_model)
    used = ring_variant_in(fn.trace(*args).jaxpr.jaxpr)
  if not cp_logits.is_fully_addressable:   # several processes: every one gets all of it
    from jax.experimental import multihost_utils
    cp_logits = multihost_utils.process_allgather(cp_logits, tiled=True)
  diff = float(np.max(np.abs(np.asarray(cp_logits) - ref_logits)))
  cp_med, ref_med = benchmark.median(cp_s), benchmark.median(ref_s)
  summary = {
      "preset": preset, "mesh": dict(mesh.shape), "cp": n, "batch": batch, "seq_len": seq_len,
      "cached_len": cached_len, "phase": "persistent_kv" if cached_len else "full",
      "variant": variant, "variant_used": used, "variant_rule": rule, "inner_impl": inner_impl,
      "dtype": cfg.dtype,
      "max_abs_diff": diff, "max_abs_logit": float(np.max(np.abs(ref_logits))), "tol": tol,
      "passed": bool(diff <= tol), "cp_ms": cp_med * 1e3, "no_cp_ms": ref_med * 1e3,
      "speedup": ref_med / cp_med, "new_tokens_per_s_cp": batch * seq_len / cp_med,
      "params": cfg.num_params()}
  return {"summary": summary, "cp_s": cp_s, "no_cp_s": ref_s, "machine": benchmark.machine(),
          "auto_rule": {"peak_flops": peak_flops, "bandwidth": bandwidth}}


def format_table(res: dict) -> str:
  s = res["summary"]
  phase = (f"persistent-KV prefill of {s['seq_len']} new tokens after {s['cached_len']} cached"
           if s["cached_len"] else f"full prefill of {s['seq_len']} tokens")
  var = s["variant"] + (f" (picked {s['variant_used']})" if s["variant"] == "auto" else "")
  lines = [f"Llama {s['preset']} ({s['params'] / 1e6:.2f}M params, {s['dtype']}) | mesh "
           f"{s['mesh']} | batch {s['batch']} | {phase}",
           f"{'':28}{'median ms':>12}{'min ms':>10}{'new tok/s':>12}"]
  for name, times in (("no CP (1 device, xla)", res["no_cp_s"]),
                      (f"CP{s['cp']} {var}", res["cp_s"])):
    med = statistics.median(times)
    lines.append(f"{name:28}{med * 1e3:12.2f}{min(times) * 1e3:10.2f}"
                 f"{s['batch'] * s['seq_len'] / med:12,.0f}")
  lines.append(f"max |logits CP - no CP| = {s['max_abs_diff']:.3g} (max |logit| "
               f"{s['max_abs_logit']:.3g}, tol {s['tol']:g}): "
               + ("PASS" if s["passed"] else "FAIL"))
  return "\n".join(lines)


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax
  from llm.run_config import LMRunConfig
  lm = config.from_flags(LMRunConfig)
  m = lm.model
  if m.dtype == "float32":
    jax.config.update("jax_default_matmul_precision", "float32")  # fp32 parity, also on GPU
  mesh = make_mesh_for(lm.parallelism.mesh)
  tol = FLAGS.tol if FLAGS.tol is not None else (1e-4 if m.dtype == "float32" else 0.2)
  res = run(lm.preset_config(), mesh, seq_len=lm.data.seq_len, cached_len=FLAGS.cached_len,
            batch=FLAGS.batch, variant=FLAGS.variant, inner_impl=FLAGS.inner_impl,
            repeats=FLAGS.repeats, tol=tol, peak_flops=FLAGS.peak_tflops * 1e12,
            bandwidth=FLAGS.bandwidth_gbps * 1e9, seed=lm.train.seed, preset=m.preset)
  print(format_table(res))
  Report(FLAGS.workdir).finish(res, res["summary"])
  if not res["summary"]["passed"]:
    raise SystemExit(1)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
