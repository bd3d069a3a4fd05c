r"""Llama prefill and decode tokens/s, side by side with Hugging Face transformers on CPU,
and decode time against the memory-bandwidth floor.

  python -m experiments.bench_llm                                       # ours only
  python -m experiments.bench_llm --peer_python=$PEER/bin/python       # + transformers
  python -m experiments.bench_llm --preset=llama32_1b --dtype=bfloat16 --batch=1 \
      --prompt_len=1024 --new_tokens=64                                 # a GPU: ms/token vs floor
  python -m experiments.bench_llm --checkpoint=gguf:$GGUF --peer_python=$PEER/bin/python \
      --new_tokens=64                             # a real model (SmolLM2-135M) beside transformers

A ~100M-parameter config (`llama_100m`: dim 768, 12 layers, 12 heads, 4 KV heads, FFN 2048,
vocab 32000) with random weights, fp32; or a real checkpoint (--checkpoint=llama2c: | hf: |
gguf:), prompted with --prompt through its own tokenizer (every row the same; --prompt_len is
then its length), whose file the peer reads itself
(transformers' own GGUF dequantization and Q/K un-permutation; an HF directory as it is).
Random and llama2.c weights are exported with `llm.weights.save_hf`. The peer script
(`experiments/peers/hf_llama.py`, run in the peer environment) loads the very same tensors
into `transformers.LlamaForCausalLM`. Timed per round, ours then the peer
(alternating, so both see the same machine state):
  prefill: the prompt [batch, prompt_len] written into a fresh KV cache, first token sampled;
  decode:  greedy steps with the KV cache, (new_tokens - 1) model calls.
Both run greedy, so the generated ids must agree (a cross-check of the model and the
loader against an independent implementation); the script reports how many rows match.

--weights=int8 | int4 | gguf quantizes our model's weights only (the peer keeps float
weights). --dtype=bfloat16 stores weights and computes in bf16, KV cache included (the peer still
gets the fp32 export, so ids may part after a few tokens). The bandwidth floor of a decode
step is (weight bytes + KV-cache bytes read per step) / copy bandwidth: every weight is read
once per step (the embedding table once as the tied output projection, or only its B rows
when untied), and the cache of every layer up to the filled length (prompt + half the new
tokens on average); the copy bandwidth is measured in the same run, as a device-to-device
copy of --copy_mb MiB counting its read and its write. Reported: decode ms per token and
its ratio to the floor.
Writes results.json and a PNG; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from absl import flags

from core import cli
from core import config
from core import results as results_lib
from core import settings  # noqa: F401  (the shared settings by name)
from experiments.benchmarks.decode import decode_bytes_per_step  # noqa: F401
from experiments.benchmarks.decode import time_decode as time_ours
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS


COPY_MB = config.setting(
    "copy_mb", "integer", "Size of the copy that measures memory bandwidth (MiB).", lower=1)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, "preset", "checkpoint", "prompt", "batch", "prompt_len", "new_tokens", "repeats",
      "rounds", "threads", "peer_python", "workdir", "seed", "dtype", "weights", COPY_MB,
      preset="llama_100m", checkpoint=None,
      prompt="Once upon a time, there was a little robot who", batch=1, prompt_len=128,
      new_tokens=32, repeats=3, rounds=2, threads=2, peer_python="", workdir="runs/bench_llm",
      seed=0, dtype="float32", weights="float32", copy_mb=1024)


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
  """Device memory bandwidth in bytes/s over `mib` MiB, read and write counted."""
  from core import benchmark
  return benchmark.copy_bandwidth(mib << 20, repeats)


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax
  import numpy as np
  from flax import nnx
  from core import benchmark
  from llm import model as model_lib
  from llm import weights as weights_lib
  from llm.config import get_config

  os.makedirs(FLAGS.workdir, exist_ok=True)
  hf_dir = os.path.join(FLAGS.workdir, "hf_model")
  rng = np.random.default_rng(FLAGS.seed)
  tok, peer_model = None, None
  if FLAGS.checkpoint:
    from llm import checkpoints
    kind, path = checkpoints.parse_spec(FLAGS.checkpoint)
    cfg, weights = checkpoints.load_weights(FLAGS.checkpoint)
    tok = checkpoints.find_tokenizer(FLAGS.checkpoint, None, cfg.vocab_size)
    # The peer reads the very file: transformers dequantizes a GGUF and undoes llama.cpp's
    # Q/K permutation itself; an HF directory is read as it is.
    peer_model = {"gguf": ["--gguf_file", path], "hf": ["--model_dir", path]}.get(kind)
    name = FLAGS.checkpoint
  else:
    cfg = get_config(FLAGS.preset)
    weights = model_lib.weights_from_model(model_lib.Llama(cfg, nnx.Rngs(FLAGS.seed)))
    name = FLAGS.preset
  if peer_model is None and (FLAGS.peer_python or not FLAGS.checkpoint):
    weights_lib.save_hf(hf_dir, cfg, weights)
    peer_model = ["--model_dir", hf_dir]
  # bf16: the same weights, stored and computed in bf16 (load_weights casts to each param's
  # dtype); the peer keeps fp32.
  cfg = cfg.replace(dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
  if FLAGS.weights != "float32":
    from llm import quantized
    stored = None
    if FLAGS.checkpoint and kind == "gguf":
      stored = checkpoints.gguf_checkpoint(path).tensors
    else:
      quantized.check_mode(FLAGS.weights, kind if FLAGS.checkpoint else None)
    weights, forms = quantized.quantize(cfg, FLAGS.weights, weights=weights, stored=stored)
    print(f"weights {FLAGS.weights}: {quantized.summarize_forms(forms)}", flush=True)
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(FLAGS.seed)))
  model_lib.load_weights(model, weights)
  del weights
  if tok is not None:
    from llm.checkpoints import text_prompt
    prompts = [text_prompt(tok, FLAGS.prompt)] * FLAGS.batch
  else:
    prompts = rng.integers(0, cfg.vocab_size, (FLAGS.batch, FLAGS.prompt_len)).tolist()
  prompt_len = len(prompts[0])
  prompts_file = os.path.join(FLAGS.workdir, "prompts.json")
  with open(prompts_file, "w") as f:
    json.dump(prompts, f)
  print(f"Llama {name}: {cfg.num_params() / 1e6:.1f}M params | batch {FLAGS.batch} | "
        f"prompt {prompt_len} | {FLAGS.new_tokens} new tokens | {FLAGS.dtype} | weights "
        f"{FLAGS.weights}", flush=True)

  ours = {"prefill": [], "decode": []}
  peer = {"prefill": [], "decode": []}
  ours_ids = peer_ids = None
  peer_impl = None
  for r in range(FLAGS.rounds):
    p, d, ours_ids = time_ours(model, prompts, FLAGS.new_tokens, FLAGS.repeats)
    ours["prefill"] += p
    ours["decode"] += d
    print(f"round {r}: ours prefill {np.median(p) * 1e3:.1f} ms, decode "
          f"{np.median(d) * 1e3 / (FLAGS.new_tokens - 1):.2f} ms/step", flush=True)
    if FLAGS.peer_python:
      out = subprocess.run(
          [FLAGS.peer_python, os.path.join(os.path.dirname(__file__), "peers", "hf_llama.py"),
           *peer_model, "--prompt_ids_file", prompts_file, "--new_tokens",
           str(FLAGS.new_tokens), "--repeats", str(FLAGS.repeats), "--threads", str(FLAGS.threads)],
          capture_output=True, text=True)
      if out.returncode != 0:
        raise RuntimeError(f"peer failed:\n{out.stderr[-3000:]}")
      res = json.loads(out.stdout.strip().splitlines()[-1])
      peer["prefill"] += res["prefill_repeats_s"]
      peer["decode"] += res["decode_repeats_s"]
      peer_ids, peer_impl = res["generated_ids"], res["impl"]
      print(f"round {r}: peer prefill {res['prefill_s'] * 1e3:.1f} ms, decode "
            f"{res['decode_ms_per_step']:.2f} ms/step", flush=True)

  n_pre = FLAGS.batch * prompt_len
  n_dec = FLAGS.batch * (FLAGS.new_tokens - 1)

  def rates(t):
    if not t["prefill"]:
      return None
    p, d = benchmark.median(t["prefill"]), benchmark.median(t["decode"])
    return {"prefill_tokens_per_s": n_pre / p, "decode_tokens_per_s": n_dec / d,
            "prefill_ms": p * 1e3, "decode_ms_per_step": d * 1e3 / (FLAGS.new_tokens - 1)}

  o, q = rates(ours), rates(peer)
  bandwidth = copy_bandwidth(FLAGS.copy_mb)
  kv_tokens = prompt_len + (FLAGS.new_tokens - 1) / 2       # filled, mean over steps
  w_bytes, kv_bytes = decode_bytes_per_step(model, FLAGS.batch, kv_tokens)
  floor_ms = (w_bytes + kv_bytes) / bandwidth * 1e3
  o["decode_floor_ms"] = floor_ms
  o["decode_over_floor"] = o["decode_ms_per_step"] / floor_ms
  summary = {"preset": None if FLAGS.checkpoint else FLAGS.preset,
             "checkpoint": FLAGS.checkpoint, "params": cfg.num_params(), "batch": FLAGS.batch,
             "prompt_len": prompt_len, "new_tokens": FLAGS.new_tokens,
             "dtype": FLAGS.dtype, "weights": FLAGS.weights, "ours": o, "peer": q, "peer_impl": peer_impl,
             "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_step": w_bytes,
             "kv_bytes_per_step": kv_bytes, "device": jax.devices()[0].device_kind}
  if q:
    summary["prefill_speedup"] = o["prefill_tokens_per_s"] / q["prefill_tokens_per_s"]
    summary["decode_speedup"] = o["decode_tokens_per_s"] / q["decode_tokens_per_s"]
    summary["rows_with_identical_ids"] = sum(a == b for a, b in zip(ours_ids, peer_ids))
    summary["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                   for a, b in zip(ours_ids, peer_ids)]
  print(f"\n{'':12s}{'prefill tok/s':>16s}{'decode tok/s':>16s}{'decode ms/step':>16s}")
  for who, r in (("ours (JAX)", o), ("transformers", q)):
    if r:
      print(f"{who:12s}{r['prefill_tokens_per_s']:16,.0f}{r['decode_tokens_per_s']:16,.1f}"
            f"{r['decode_ms_per_step']:16.2f}")
  print(f"decode floor: ({w_bytes / 1e6:,.1f} MB weights + {kv_bytes / 1e6:,.1f} MB KV cache) / "
        f"{bandwidth / 1e9:,.0f} GB/s copy bandwidth = {floor_ms:.3f} ms per step; ours "
        f"{o['decode_ms_per_step']:.3f} ms = {o['decode_over_floor']:.2f}x the floor "
        f"({summary['device']})")
  if q:
    print(f"ratio ours/peer: prefill {summary['prefill_speedup']:.2f}x, decode "
          f"{summary['decode_speedup']:.2f}x; greedy ids identical in "
          f"{summary['rows_with_identical_ids']}/{FLAGS.batch} rows")
  results = {"summary": summary, "machine": benchmark.machine(), "ours_s": ours, "peer_s": peer,
             "ours_ids": ours_ids, "peer_ids": peer_ids}
  results_lib.write_results(FLAGS.workdir, results)
  if q:
    from core import plot as plot_lib
    with plot_lib.figure(os.path.join(FLAGS.workdir, "bench_llm.png"), 1, 2,
                         figsize=(8, 3.2), dpi=120) as (fig, axes):
      for ax, key, title in ((axes[0], "prefill_tokens_per_s", "prefill tokens/s"),
                             (axes[1], "decode_tokens_per_s", "decode tokens/s")):
        ax.bar(["ours (JAX)", "transformers"], [o[key], q[key]], color=["tab:blue", "tab:orange"])
        ax.set_title(title)
      fig.suptitle(f"Llama {name}, batch {FLAGS.batch}, prompt {prompt_len}, CPU")
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
