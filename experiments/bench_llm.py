r"""Llama prefill and decode tokens/s, side by side with Hugging Face transformers on CPU,
and decode time against the memory-bandwidth floor.

  python -m experiments.bench_llm                                       # ours only
  python -m experiments.bench_llm --peer_python=$PEER/bin/python       # + transformers
  python -m experiments.bench_llm --preset=llama32_1b --dtype=bfloat16 --batch=1 \
      --prompt_len=1024 --new_tokens=64                                 # a GPU: ms/token vs floor
  python -m experiments.bench_llm --checkpoint=gguf:$GGUF --peer_python=$PEER/bin/python \
      --new_tokens=64                             # a real model (SmolLM2-135M) beside transformers
  python -m experiments.bench_llm --checkpoint=gguf:$GGUF --peer_python=$PEER/bin/python \
      --peers=transformers,llama_cpp --new_tokens=64      # and beside llama.cpp on the same file

A ~100M-parameter config (`llama_100m`: dim 768, 12 layers, 12 heads, 4 KV heads, FFN 2048,
vocab 32000) with random weights, fp32; or a real checkpoint (--checkpoint=llama2c: | hf: |
gguf:), prompted with --prompt through its own tokenizer (every row the same; its length is
the prompt length, so --prompt_len is refused; --prompt without a tokenizer too), whose file
the peer reads itself
(transformers' own GGUF dequantization and Q/K un-permutation; an HF directory as it is).
Random and llama2.c weights are exported with `llm.weights.save_hf`. The peer script
(`experiments/peers/hf_llama.py`, run in the peer environment) loads the very same tensors
into `transformers.LlamaForCausalLM`. Timed per round, ours then the peer
(alternating, so both see the same machine state):
  prefill: the prompt [batch, prompt_len] written into a fresh KV cache, first token sampled;
  decode:  greedy steps with the KV cache, (new_tokens - 1) model calls.
Both run greedy, so the generated ids must agree (a cross-check of the model and the
loader against an independent implementation); the script reports how many rows match.
--peers=llama_cpp (or transformers,llama_cpp): llama.cpp (llama-cpp-python,
`experiments/peers/llama_cpp_gguf.py`, --threads threads, KV cache float16 as llama.cpp's
default) runs the --checkpoint=gguf: file itself, in its own storage type (SmolLM2's Q4_1:
llama.cpp's quantized kernels, while ours computes with the dequantized float32 weights unless
--weights says otherwise; export the checkpoint with `experiments.export --gguf_type=F32` for
the same weights on both sides), batch 1 only (its Python API decodes one sequence); it is
timed in the same rounds, and its greedy ids compared like transformers'. On a machine shared
with other jobs set OMP_WAIT_POLICY=PASSIVE (the peer inherits it): llama.cpp's OpenMP threads
otherwise spin while they wait, which under load made its decode steps ~70x slower here.

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

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings  # noqa: F401  (the shared settings by name)
from experiments.benchmarks.decode import decode_bytes_per_step
from experiments.benchmarks.decode import time_decode as time_ours
from experiments.common.report import Report
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS


COPY_MB = config.setting(
    "copy_mb", "integer", "Size of the copy that measures memory bandwidth (MiB).", lower=1)
PEERS = config.setting(
    "peers", "list", "With --peer_python: the peers timed beside ours, transformers and / or "
    "llama_cpp (llama.cpp runs the --checkpoint=gguf: file itself; batch 1).")
# peer name -> (script under experiments/peers/, the name its table row shows)
PEER_SCRIPTS = {"transformers": ("hf_llama.py", "transformers"),
                "llama_cpp": ("llama_cpp_gguf.py", "llama.cpp")}


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, "preset", "checkpoint", "prompt", "batch", "prompt_len", "new_tokens", "repeats",
      "rounds", "threads", "peer_python", "workdir", "seed", "dtype", "weights", COPY_MB,
      PEERS, peers=("transformers",), preset="llama_100m", checkpoint=None,
      prompt="Once upon a time, there was a little robot who", batch=1, prompt_len=128,
      new_tokens=32, repeats=3, rounds=2, threads=2, peer_python="", workdir="runs/bench_llm",
      seed=0, dtype="float32", weights="float32", copy_mb=1024)


def check_peers() -> tuple[str, ...]:
  """The peers to run (none without --peer_python), each known and once, --peer_python an
  executable, llama.cpp's needs met; refused naming the flag before anything runs."""
  import shutil
  given = tuple(FLAGS.peers)
  for who in given:
    if who not in PEER_SCRIPTS:
      raise errors.expected(f"--peers={','.join(given)}", f"{who!r} is not a peer",
                            f"peers among {', '.join(PEER_SCRIPTS)}")
  if len(set(given)) < len(given):
    raise errors.expected(f"--peers={','.join(given)}", "a peer named twice", "each once")
  if not FLAGS.peer_python:
    if FLAGS["peers"].present:
      raise errors.expected(f"--peers={','.join(given)}", "given without --peer_python",
                            "--peer_python=PYTHON of the peer environment")
    return ()
  if not given:
    raise errors.expected("--peers=''", "no peer, with --peer_python",
                          f"peers among {', '.join(PEER_SCRIPTS)}")
  if shutil.which(FLAGS.peer_python) is None:
    raise errors.expected(f"--peer_python={FLAGS.peer_python}", "no such executable",
                          "the Python of the peer environment")
  if "llama_cpp" in given:
    if not (FLAGS.checkpoint or "").startswith("gguf:"):
      raise errors.expected("--peers=llama_cpp", f"--checkpoint={FLAGS.checkpoint}",
                            "--checkpoint=gguf:FILE (llama.cpp runs a GGUF file)")
    if FLAGS.batch != 1:
      raise errors.expected("--peers=llama_cpp", f"--batch={FLAGS.batch}",
                            "--batch=1 (llama.cpp's Python API decodes one sequence)")
  return given


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

  peers = check_peers()
  if peers:   # both sides on the same --threads cores, before jax's backend starts
    benchmark.pin_cpus(FLAGS.threads)
  if FLAGS.new_tokens < 2:
    raise errors.expected(f"--new_tokens={FLAGS.new_tokens}", "no decode step to time",
                          "at least 2 (the first token comes from the prefill)")
  # The model's config and the prompts, checked before the workdir is made or weights load.
  kind = path = tok = None
  if FLAGS.checkpoint:
    from llm import checkpoints
    if FLAGS["preset"].present:
      raise errors.expected(f"--preset={FLAGS.preset}", f"given with --checkpoint="
                            f"{FLAGS.checkpoint}", "one of them (the checkpoint has its sizes)")
    kind, path = checkpoints.parse_spec(FLAGS.checkpoint)
    cfg = checkpoints.load_config(FLAGS.checkpoint)
    tok = checkpoints.find_tokenizer(FLAGS.checkpoint, None, cfg.vocab_size)
    name = FLAGS.checkpoint
    model_flag = f"--checkpoint={name}"
  else:
    try:
      cfg = get_config(FLAGS.preset)
    except ValueError as e:
      raise errors.UserError(f"--preset={FLAGS.preset}: {e}") from None
    name = FLAGS.preset
    model_flag = f"--preset={name}"
  from llm import quantized
  quantized.check_mode(FLAGS.weights, kind)
  rng = np.random.default_rng(FLAGS.seed)
  if tok is not None:
    from llm.checkpoints import text_prompt
    if FLAGS["prompt_len"].present:
      raise errors.expected(f"--prompt_len={FLAGS.prompt_len}", f"given with --checkpoint="
                            f"{FLAGS.checkpoint}, whose tokenizer encodes --prompt",
                            "--prompt (its length is the prompt length)")
    prompt = text_prompt(tok, FLAGS.prompt)
    if not prompt:
      raise errors.expected(f"--prompt={FLAGS.prompt!r}", "no tokens", "some text")
    prompts = [prompt] * FLAGS.batch
  else:
    if FLAGS["prompt"].present:
      raise errors.expected("--prompt", f"given with {model_flag}, which has no tokenizer "
                            "(random prompt ids)", "--prompt_len")
    prompts = rng.integers(0, cfg.vocab_size, (FLAGS.batch, FLAGS.prompt_len)).tolist()
  prompt_len = len(prompts[0])
  if prompt_len + FLAGS.new_tokens > cfg.max_seq_len:
    prompt_flag = (f"--prompt ({prompt_len} tokens)" if tok is not None
                   else f"--prompt_len={prompt_len}")
    raise errors.expected(f"{prompt_flag} + --new_tokens={FLAGS.new_tokens}",
                          f"{prompt_len + FLAGS.new_tokens} tokens, beyond the max_seq_len of "
                          f"{model_flag}", f"at most {cfg.max_seq_len}")

  report = Report(FLAGS.workdir)
  hf_dir = report.path("hf_model")   # the workdir made
  peer_model = None
  if FLAGS.checkpoint:
    cfg, weights = checkpoints.load_weights(FLAGS.checkpoint)
    # The peer reads the very file: transformers dequantizes a GGUF and undoes llama.cpp's
    # Q/K permutation itself; an HF directory is read as it is.
    peer_model = {"gguf": ["--gguf_file", path], "hf": ["--model_dir", path]}.get(kind)
  else:
    weights = model_lib.weights_from_model(model_lib.Llama(cfg, nnx.Rngs(FLAGS.seed)))
  if peer_model is None and ("transformers" in peers or not FLAGS.checkpoint):
    weights_lib.save_hf(hf_dir, cfg, weights)
    peer_model = ["--model_dir", hf_dir]
  # bf16: the same weights, stored and computed in bf16 (load_weights casts to each param's
  # dtype); the peer keeps fp32.
  cfg = cfg.replace(dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
  if FLAGS.weights != "float32":
    stored = checkpoints.gguf_checkpoint(path).tensors if kind == "gguf" else None
    weights, forms = quantized.quantize(cfg, FLAGS.weights, weights=weights, stored=stored)
    print(f"weights {FLAGS.weights}: {quantized.summarize_forms(forms)}", flush=True)
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(FLAGS.seed)))
  model_lib.load_weights(model, weights)
  del weights
  prompts_file = os.path.join(FLAGS.workdir, "prompts.json")
  with open(prompts_file, "w") as f:
    json.dump(prompts, f)
  print(f"Llama {name}: {cfg.num_params() / 1e6:.1f}M params | batch {FLAGS.batch} | "
        f"prompt {prompt_len} | {FLAGS.new_tokens} new tokens | {FLAGS.dtype} | weights "
        f"{FLAGS.weights}", flush=True)

  peer_args = {"transformers": peer_model,
               "llama_cpp": ["bench", "--gguf_file", path] if FLAGS.checkpoint else None}
  ours = {"prefill": [], "decode": []}
  times = {p: {"prefill": [], "decode": []} for p in peers}
  ours_ids, ids, impls = None, {}, {}
  for r in range(FLAGS.rounds):
    p, d, ours_ids = time_ours(model, prompts, FLAGS.new_tokens, FLAGS.repeats)
    ours["prefill"] += p
    ours["decode"] += d
    print(f"round {r}: ours prefill {np.median(p) * 1e3:.1f} ms, decode "
          f"{np.median(d) * 1e3 / (FLAGS.new_tokens - 1):.2f} ms/step", flush=True)
    for who in peers:
      script = os.path.join(os.path.dirname(__file__), "peers", PEER_SCRIPTS[who][0])
      out = subprocess.run(
          [FLAGS.peer_python, script, *peer_args[who], "--prompt_ids_file", prompts_file,
           "--new_tokens", str(FLAGS.new_tokens), "--repeats", str(FLAGS.repeats),
           "--threads", str(FLAGS.threads)], capture_output=True, text=True)
      if out.returncode != 0:
        raise RuntimeError(f"peer {who} failed:\n{out.stderr[-3000:]}")
      res = json.loads(out.stdout.strip().splitlines()[-1])
      times[who]["prefill"] += res["prefill_repeats_s"]
      times[who]["decode"] += res["decode_repeats_s"]
      ids[who], impls[who] = res["generated_ids"], res["impl"]
      print(f"round {r}: {PEER_SCRIPTS[who][1]} prefill {res['prefill_s'] * 1e3:.1f} ms, "
            f"decode {res['decode_ms_per_step']:.2f} ms/step", flush=True)

  n_pre = FLAGS.batch * prompt_len
  n_dec = FLAGS.batch * (FLAGS.new_tokens - 1)

  def rates(t):
    p, d = benchmark.median(t["prefill"]), benchmark.median(t["decode"])
    return {"prefill_tokens_per_s": n_pre / p, "decode_tokens_per_s": n_dec / d,
            "prefill_ms": p * 1e3, "decode_ms_per_step": d * 1e3 / (FLAGS.new_tokens - 1)}

  o = rates(ours)
  bandwidth = copy_bandwidth(FLAGS.copy_mb)
  w_bytes, kv_bytes = decode_bytes_per_step(model, FLAGS.batch, prompt_len, FLAGS.new_tokens)
  floor_ms = (w_bytes + kv_bytes) / bandwidth * 1e3
  o["decode_floor_ms"] = floor_ms
  o["decode_over_floor"] = o["decode_ms_per_step"] / floor_ms
  compared = {}
  for who in peers:
    q = rates(times[who])
    compared[who] = {**q, "impl": impls[who],
                     "prefill_speedup": o["prefill_tokens_per_s"] / q["prefill_tokens_per_s"],
                     "decode_speedup": o["decode_tokens_per_s"] / q["decode_tokens_per_s"],
                     "rows_with_identical_ids": sum(a == b for a, b in zip(ours_ids, ids[who])),
                     "first_divergence": [
                         next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                         for a, b in zip(ours_ids, ids[who])]}
  summary = {"preset": None if FLAGS.checkpoint else FLAGS.preset,
             "checkpoint": FLAGS.checkpoint, "params": cfg.num_params(), "batch": FLAGS.batch,
             "prompt_len": prompt_len, "new_tokens": FLAGS.new_tokens,
             "dtype": FLAGS.dtype, "weights": FLAGS.weights, "ours": o, "peers": compared,
             "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_step": w_bytes,
             "kv_bytes_per_step": kv_bytes, "device": jax.devices()[0].device_kind}
  # The first peer's numbers also under the keys a single-peer run has always written.
  first = compared[peers[0]] if peers else None
  summary["peer"] = first and {k: first[k] for k in ("prefill_tokens_per_s",
                                                     "decode_tokens_per_s", "prefill_ms",
                                                     "decode_ms_per_step")}
  summary["peer_impl"] = first and first["impl"]
  if first:
    summary.update({k: first[k] for k in ("prefill_speedup", "decode_speedup",
                                          "rows_with_identical_ids", "first_divergence")})
  print(f"\n{'':14s}{'prefill tok/s':>16s}{'decode tok/s':>16s}{'decode ms/step':>16s}")
  for who, r in (("ours (JAX)", o), *((PEER_SCRIPTS[w][1], compared[w]) for w in peers)):
    print(f"{who:14s}{r['prefill_tokens_per_s']:16,.0f}{r['decode_tokens_per_s']:16,.1f}"
          f"{r['decode_ms_per_step']:16.2f}")
  print(f"decode floor: ({w_bytes / 1e6:,.1f} MB weights + {kv_bytes / 1e6:,.1f} MB KV cache) / "
        f"{bandwidth / 1e9:,.0f} GB/s copy bandwidth = {floor_ms:.3f} ms per step; ours "
        f"{o['decode_ms_per_step']:.3f} ms = {o['decode_over_floor']:.2f}x the floor "
        f"({summary['device']})")
  for who in peers:
    c = compared[who]
    print(f"ratio ours/{PEER_SCRIPTS[who][1]}: prefill {c['prefill_speedup']:.2f}x, decode "
          f"{c['decode_speedup']:.2f}x; greedy ids identical in "
          f"{c['rows_with_identical_ids']}/{FLAGS.batch} rows ({c['impl']})")
  results = {"summary": summary, "machine": benchmark.machine(), "ours_s": ours,
             "peers_s": times, "ours_ids": ours_ids, "peer_ids": ids}
  title = f"Llama {name}, batch {FLAGS.batch}, prompt {prompt_len}, CPU"
  bars = {"ours (JAX)": o, **{PEER_SCRIPTS[w][1]: compared[w] for w in peers}}
  report.finish(results, summary, plots=[(plot, (bars, title), "bench_llm.png")] if peers else [])


def plot(bars: dict[str, dict], title: str, path: str) -> None:
  """Prefill and decode tokens/s, ours beside each peer's ({name: rates})."""
  from core import plot as plot_lib
  colors = ["tab:blue", "tab:orange", "tab:green"]
  with plot_lib.figure(path, 1, 2, figsize=(8, 3.2), dpi=120) as (fig, axes):
    for ax, key, name in ((axes[0], "prefill_tokens_per_s", "prefill tokens/s"),
                          (axes[1], "decode_tokens_per_s", "decode tokens/s")):
      ax.bar(list(bars), [r[key] for r in bars.values()], color=colors[:len(bars)])
      ax.set_title(name)
    fig.suptitle(title)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
