r"""Load benchmark of the serving engine (continuous batching over a paged KV cache,
llm/serving): Poisson arrivals at each --rates, and closed-loop clients at each
--concurrency; time to first token and time per output token (p50 / p99), throughput and
goodput against the request rate, with a plot.

  G=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  python -m experiments.serve_bench --checkpoint=gguf:$G --dtype=bfloat16 \
      --targets=engine,ours_http,llama_cpp --threads=2 \
      --concurrency=1,8 --rounds=3 --rates= --num_requests=16 --prompt_lens=32,128 \
      --output_lens=32,64 --max_slots=8 --max_model_len=256 \
      --compilation_cache_dir=runs/jax_compilation_cache \
      --workdir=runs/serve_bench_vs_llama_cpp_final
      # 2-core Intel Xeon, load 1.0-1.6 while timed, jax 0.11.2, llama.cpp with
      # OMP_WAIT_POLICY=PASSIVE: 8 clients at 3.97x one client's tokens/s in process, 3.84x
      # over HTTP, llama.cpp 1.01x; ours over HTTP / llama.cpp: 1.12x at 1 client, 4.40x at
      # 8 (medians of 3 rounds; with OMP_WAIT_POLICY=ACTIVE llama.cpp decodes 3x faster:
      # 0.30x and 1.83x); 42 programs, 70-80 s per process to trace with the cache warm
  python -m experiments.serve_bench --checkpoint=gguf:$G --dtype=bfloat16 \
      --speculative_tree=2:4:5 --draft=DRAFT_WORKDIR ...   # EAGLE rounds inside the batch
  python -m experiments.serve_bench --preset=tiny      # random weights of an llm.config preset

The engine runs in process behind its runner (the queue and thread the HTTP server uses,
without the HTTP layer); requests are random token ids with lengths drawn from the mixes and
exact output lengths (no stop ids). Closed loop with N clients measures throughput at N
concurrent requests; "speedup" in the summary is the throughput at the largest
--concurrency over that at the smallest (one at a time with --concurrency=1,...; with
--rounds=R the client counts take turns R times and the median of the R ratios is
reported). Every client count and rate runs the same --num_requests requests (drawn with
--seed), so the ratios compare the same work. Goodput: requests per second meeting
--slo_ttft_s and --slo_tpot_s.
Every table width the engine uses is compiled before timing; --chunk_widths unset, the
prefill chunk widths are those the --prompt_lens mix needs (the default powers-of-two
buckets its chunks fall in: the same programs run, the unused ones are not compiled).

--targets runs several servers on the same requests, interleaved (each round runs every
target's client counts in turn): engine (in process), ours_http (`python -m
experiments.serve` as a child process, same engine settings, --warmup_tables=all, over HTTP)
and llama_cpp (llama.cpp's server, experiments/peers/llama_cpp_server.py in --peer_python,
on the --checkpoint=gguf: file itself: one sequence at a time, --threads threads,
OMP_WAIT_POLICY=PASSIVE unless set). The HTTP targets get text prompts made of word tokens
that encode back to the same ids (benchmarks/serving.py, `word_tokens`; llama.cpp's
/extras/tokenize is checked to give the same ids before timing) and stream them
(`HTTPRunner`); greedy, exactly max_tokens (ours: ignore_eos; llama.cpp: logit bias -1e4 on
the tokenizer's stop ids and the control tokens, repeat_penalty 1; a reply of another length
counts as failed). Server children run pinned to the first --threads CPUs (XLA sizes its CPU
thread pool from them) and are stopped (SIGTERM, then SIGKILL) when the run ends, fails or
is interrupted; their logs are in --workdir. Every point records the load average before and
after it. With two or more targets, results.json has each target's throughput over
llama_cpp's at each client count (median of the rounds' ratios), and each target's speedup.
Writes results.json and serve_bench.png (none when the only points are at rate inf) to
--workdir; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time

import numpy as np

from absl import flags
from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings  # the shared settings by name
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)
from llm.serving.config import DRAFT, EngineConfig, chunk_widths_for

FLAGS = flags.FLAGS

RATES = config.setting(
    "rates", "list", "Poisson arrival rates to run, requests per second ('inf': all at "
    "once); empty: none.")
PROMPT_LENS = config.setting(
    "prompt_lens", "list", "Prompt lengths in tokens; each request draws one uniformly.")
OUTPUT_LENS = config.setting(
    "output_lens", "list", "Output lengths in tokens (exact: no stop ids); each request draws "
    "one uniformly.")
SLO_TTFT_S = config.setting("slo_ttft_s", "float", "Goodput's time-to-first-token SLO "
                            "(seconds).", lower=0)
SLO_TPOT_S = config.setting("slo_tpot_s", "float", "Goodput's time-per-output-token SLO "
                            "(seconds).", lower=0)
TARGET_NAMES = ("engine", "ours_http", "llama_cpp")
TARGETS = config.setting(
    "targets", "list", "What serves the requests, each on the same ones, interleaved: engine "
    "(in process), ours_http (experiments.serve as a child process, over HTTP), llama_cpp "
    "(llama.cpp's server on the --checkpoint=gguf: file, in --peer_python).")
SERVER_TIMEOUT_S = config.setting(
    "server_timeout_s", "float", "Seconds a server child may take to answer (ours compiles "
    "its programs first), and a request may wait on its socket.", lower=1)


def define_flags() -> None:
  config.define_flags(EngineConfig)
  config.define_flags(
      None, "checkpoint", "preset", "dtype", "weights", RATES, "concurrency", "num_requests",
      PROMPT_LENS, OUTPUT_LENS, SLO_TTFT_S, SLO_TPOT_S, DRAFT, "decode_vocab", "mesh",
      "compilation_cache_dir", "seed", "rounds", "workdir", TARGETS, "threads", "peer_python",
      SERVER_TIMEOUT_S, checkpoint=None, preset="tiny", dtype="float32", weights="float32",
      rates=["1", "4"], concurrency=["1", "8"], num_requests=16, prompt_lens=["32", "128"],
      output_lens=["32", "64"], slo_ttft_s=2.0, slo_tpot_s=0.2, draft="", decode_vocab=0,
      mesh="", compilation_cache_dir="", seed=0, rounds=1, targets=["engine"], threads=2,
      peer_python="", server_timeout_s=3600.0, workdir="runs/serve_bench")


def _numbers(flag: str, kind, want: str, ok, distinct: bool = False) -> list:
  """The values of the list flag --`flag` as `kind`, each passing `ok` (`want` says what
  passes), each once where `distinct` (a point each)."""
  texts = FLAGS[flag].value or []
  where = f"--{flag}={','.join(texts)}"
  out = []
  for text in texts:
    try:
      v = kind(text)
    except ValueError:
      kind_name = "a number" if kind is float else "an integer"
      raise errors.expected(where, f"{text!r} is not {kind_name}", want) from None
    if not ok(v):
      raise errors.expected(where, f"{text!r} is out of range", want)
    if distinct and v in out:
      raise errors.expected(where, f"{text!r} twice", f"{want}, each once")
    out.append(v)
  return out


def model_config(checkpoint, preset, weights):
  """The LlamaConfig of --checkpoint (read without its weights) or --preset, with --preset
  and --weights checked against them."""
  from llm import quantized
  if checkpoint:
    from llm import checkpoints
    if FLAGS["preset"].present:
      raise errors.expected(f"--preset={preset}", f"given with --checkpoint={checkpoint}",
                            "one of them (the checkpoint has its sizes)")
    kind, _ = checkpoints.parse_spec(checkpoint)
    quantized.check_mode(weights, kind)
    return checkpoints.load_config(checkpoint)
  from llm.config import get_config
  try:
    cfg = get_config(preset)
  except ValueError as e:
    raise errors.UserError(f"--preset={preset}: {e}") from None
  quantized.check_mode(weights, None)
  return cfg


def load(checkpoint, preset, dtype, weights):
  """(model, vocab size, lowest plain-token id) of --checkpoint, or random weights of
  --preset (matrices int8 / int4 with --weights, as a checkpoint's)."""
  if checkpoint:
    from llm.checkpoints import load_model
    cfg, model = load_model(checkpoint, dtype, weights)
    return model, cfg.vocab_size, low_token_id(cfg)
  from flax import nnx
  from llm import model as model_lib
  from llm.config import get_config
  cfg = get_config(preset).replace(dtype=dtype, param_dtype=dtype)
  if weights == "float32":
    return model_lib.Llama(cfg, nnx.Rngs(0)), cfg.vocab_size, 0
  from llm import quantized
  flat = model_lib.weights_from_model(model_lib.Llama(get_config(preset), nnx.Rngs(0)))
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
  params, forms = quantized.quantize(cfg, weights, weights=flat)
  print(f"weights {weights}: {quantized.summarize_forms(forms)}", flush=True)
  model_lib.load_weights(model, params)
  return model, cfg.vocab_size, 0


def low_token_id(cfg) -> int:
  """The lowest id a checkpoint's request draws: past the specials a GGUF / HF vocabulary
  puts first (SmolLM2: 17 of them)."""
  return min(32, cfg.vocab_size - 1)


def peer_python(flag: str) -> str:
  """--peer_python (which must exist), or bin/python of ../peer311 or ../peer beside the
  checkout."""
  want = ("the Python of the peer environment with llama-cpp-python[server] "
          "(experiments/peers/README.md)")
  if flag:
    if not os.path.isfile(flag):
      raise errors.expected(f"--peer_python={flag}", "no such file", want)
    return flag
  from experiments import peers
  tried = peers.environments()
  for path in tried:
    if os.path.exists(path):
      return path
  raise errors.expected("--targets=llama_cpp", f"--peer_python unset and no {' or '.join(tried)}",
                        want)


def engine_flags(engine_config) -> list[str]:
  """experiments.serve's flags for the same engine settings."""
  out = []
  for f in dataclasses.fields(engine_config):
    s = f.metadata.get("setting")
    value = getattr(engine_config, f.name)
    if s is None or value is None:
      continue
    text = s.flag_text(value)
    text = (",".join(text) if isinstance(text, list) else
            str(text).lower() if isinstance(text, bool) else str(text))
    out.append(f"--{f.name}={text}")
  return out


def plot(points, path):
  """Per target: closed-loop throughput, TTFT and TPOT against the client count (medians of
  the rounds, each round a dot), and the same against the Poisson rate (goodput dashed).
  None (no plot) when the only points are at rate inf."""
  rows = [(mode, key) for mode, key in (("closed", "concurrency"), ("poisson", "rate"))
          if any(p["mode"] == mode and not math.isinf(p[key]) for p in points
                 if key in p)]
  if not rows:
    return None
  from core.plot import pyplot
  plt = pyplot()
  targets = list(dict.fromkeys(p["target"] for p in points))
  fig, axes = plt.subplots(len(rows), 3, figsize=(15, 3.6 * len(rows)), squeeze=False)
  for row, (mode, key) in zip(axes, rows):
    label = ("concurrent requests (closed loop)" if mode == "closed"
             else "request rate (req/s)")
    ax2 = None   # the goodput axis of the Poisson row
    for t, target in enumerate(targets):
      mine = [p for p in points if p["mode"] == mode and p["target"] == target
              and not math.isinf(p[key])]
      xs = sorted({p[key] for p in mine})
      if not xs:
        continue

      def med(metric, scale=1.0):
        return [scale * float(np.median([p[metric] or math.nan for p in mine
                                         if p[key] == x])) for x in xs]

      row[0].plot(xs, med("throughput_tok_s"), "o-", color=f"C{t}", label=target)
      row[0].plot([p[key] for p in mine], [p["throughput_tok_s"] for p in mine], ".",
                  color=f"C{t}", alpha=0.4)
      if mode == "poisson":
        ax2 = row[0].twinx() if ax2 is None else ax2
        ax2.plot(xs, med("goodput_req_s"), "^--", color=f"C{t}")
        ax2.set_ylabel("goodput (req/s), dashed")
      for ax, metric in ((row[1], "ttft"), (row[2], "tpot")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
          ax.plot(xs, med(f"{metric}_{q}_s", 1e3), style, color=f"C{t}", label=f"{target} {q}")
    row[0].set(xlabel=label, ylabel="output tokens/s", title="throughput")
    row[1].set(xlabel=label, ylabel="ms", title="time to first token")
    row[2].set(xlabel=label, ylabel="ms", title="time per output token")
    for ax in row:
      ax.grid(alpha=0.3)
      if mode == "closed":
        ax.set_xscale("log", base=2)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _check_llama_prompts(runner, reqs, to_text, bos):
  """llama.cpp's tokens of each prompt text are the ids (after BOS when it adds one)."""
  for i, (ids, _) in enumerate(reqs):
    got = runner.post("/extras/tokenize", {"input": to_text(ids)})["tokens"]
    if got != ([bos] if bos is not None and got[:1] == [bos] else []) + list(ids):
      raise RuntimeError(f"llama_cpp: request {i}'s prompt text tokenizes to {len(got)} ids "
                         f"{got[:8]}...; expected the {len(ids)} ids {list(ids[:8])}... it "
                         "was made of")


def _start_servers(targets, engine_config, tok, bias, n_ctx, cpus, peer, servers):
  """{target: HTTPRunner} of the HTTP targets (llama_cpp's server in the Python `peer`),
  their servers appended to `servers` as they start (the caller stops them)."""
  from experiments.benchmarks import serving as bench
  os.makedirs(FLAGS.workdir, exist_ok=True)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  started = {}
  for target in targets:
    if target == "engine":
      continue
    port = bench.free_port()
    log = os.path.join(FLAGS.workdir, f"{target}_server.log")
    if target == "ours_http":
      cmd = [sys.executable, "-m", "experiments.serve", f"--checkpoint={FLAGS.checkpoint}",
             f"--dtype={FLAGS.dtype}", f"--weights={FLAGS.weights}", f"--port={port}",
             "--served_model_name=serve_bench", "--warmup_tables=all", "--drain_s=0",
             f"--max_queue={10 ** 6}", f"--compilation_cache_dir={FLAGS.compilation_cache_dir}",
             f"--draft={FLAGS.draft}", f"--decode_vocab={FLAGS.decode_vocab}",
             f"--mesh={FLAGS.mesh}", *engine_flags(engine_config)]
      env = dict(os.environ)
      body = {"ignore_eos": True}
    else:
      kind, path = FLAGS.checkpoint.split(":", 1)
      cmd = [peer,
             os.path.join(root, "experiments", "peers", "llama_cpp_server.py"),
             "--gguf_file", path, "--port", str(port), "--threads", str(FLAGS.threads),
             "--n_ctx", str(n_ctx)]
      env = dict(os.environ)
      env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
      body = {"repeat_penalty": 1.0, "logit_bias": {str(i): -1e4 for i in bias}}
    print(f"{target}: starting {' '.join(cmd)} (CPUs {cpus}; log {log})", flush=True)
    server = bench.Server(cmd, port, target, log, env=env, cpus=cpus, cwd=root)
    servers.append(server)
    t0 = time.time()
    models = server.wait_ready(FLAGS.server_timeout_s)
    model = models["data"][0]["id"]
    print(f"{target}: {model} answering on {server.url} after {time.time() - t0:.0f} s",
          flush=True)
    started[target] = (bench.HTTPRunner(server.url, model, tok.decode, body,
                                         timeout_s=FLAGS.server_timeout_s), server,
                       time.time() - t0)
  return started


def main(argv):
  del argv
  cli.quiet_library_logs()
  from experiments.benchmarks import serving as bench
  from llm.serving.cp_prefill import mesh_for
  from llm.serving.engine import Engine, load_draft
  from llm.serving.runner import EngineRunner
  # Every setting is checked, the model's config and tokenizer read, before weights load.
  rates = _numbers("rates", float, "rates > 0 (requests per second) or inf",
                   lambda v: v > 0, distinct=True)
  clients = _numbers("concurrency", int, "client counts >= 1", lambda v: v >= 1,
                     distinct=True)
  prompt_lens = _numbers("prompt_lens", int, "lengths >= 1 (tokens)", lambda v: v >= 1)
  output_lens = _numbers("output_lens", int, "lengths >= 1 (tokens)", lambda v: v >= 1)
  targets = list(dict.fromkeys(FLAGS.targets or []))
  if not rates and not clients:
    raise errors.expected("--rates= and --concurrency=", "both empty: nothing to run",
                          "a rate or a client count")
  for flag, lens in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
    if not lens:
      raise errors.expected(f"--{flag}=", "no lengths", "one or more lengths (tokens)")
  if clients and max(clients) > FLAGS.num_requests:
    raise errors.expected(f"--concurrency={','.join(FLAGS.concurrency)}",
                          f"{max(clients)} clients for --num_requests={FLAGS.num_requests}",
                          f"at most {FLAGS.num_requests} clients (each sends whole requests; "
                          "the others would idle)")
  if FLAGS.rounds > 1 and not clients:
    raise errors.expected(f"--rounds={FLAGS.rounds}", "no --concurrency to repeat",
                          "--rounds=1 (rounds repeat the client counts; each rate runs once)")
  bad = [t for t in targets if t not in TARGET_NAMES]
  if bad or not targets:
    raise errors.expected(f"--targets={','.join(FLAGS.targets or [])}",
                          f"{bad[0]!r}" if bad else "none",
                          f"one or more of {', '.join(TARGET_NAMES)}")
  http_targets = [t for t in targets if t != "engine"]
  if http_targets and not FLAGS.checkpoint:
    raise errors.expected(f"--targets={','.join(targets)}", "no --checkpoint",
                          "a --checkpoint with a tokenizer (the servers take text)")
  if "llama_cpp" in targets and not FLAGS.checkpoint.startswith("gguf:"):
    raise errors.expected("--targets=llama_cpp", f"--checkpoint={FLAGS.checkpoint}",
                          "a gguf:FILE checkpoint (llama.cpp serves that file)")
  peer = peer_python(FLAGS.peer_python) if "llama_cpp" in targets else None
  engine_config = config.from_flags(EngineConfig)
  if bool(FLAGS.draft) != bool(engine_config.speculative_tree):
    raise errors.UserError(f"--draft={FLAGS.draft!r} and --speculative_tree="
                           f"{engine_config.speculative_tree!r}: give both or neither")
  if FLAGS.decode_vocab and not FLAGS.draft:
    raise errors.expected(f"--decode_vocab={FLAGS.decode_vocab}", "no --draft",
                          "--decode_vocab=0 without a draft head")
  if not engine_config.chunk_widths:
    engine_config = dataclasses.replace(engine_config, chunk_widths=chunk_widths_for(
        prompt_lens, engine_config.prefill_chunk))
  cpus = sorted(os.sched_getaffinity(0))
  if http_targets and FLAGS.threads > len(cpus):
    raise errors.expected(f"--threads={FLAGS.threads}", f"{len(cpus)} CPUs available",
                          f"at most {len(cpus)}")
  cpus = cpus[:FLAGS.threads]
  mesh = mesh_for(FLAGS.mesh)
  cfg = model_config(FLAGS.checkpoint, FLAGS.preset, FLAGS.weights)
  if FLAGS.decode_vocab > cfg.vocab_size:
    raise errors.expected(f"--decode_vocab={FLAGS.decode_vocab}",
                          f"more tokens than the model's vocabulary of {cfg.vocab_size}",
                          f"at most {cfg.vocab_size}")
  # The engine's context (Engine.max_len): --max_model_len, at most the model's.
  max_len = min(engine_config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
  longest = max(prompt_lens) + max(output_lens)
  if longest > max_len:
    raise errors.UserError(f"--prompt_lens / --output_lens: the longest request has {longest} "
                           f"tokens, beyond the engine's context of {max_len} "
                           "(--max_model_len, at most the model's max_seq_len)")
  tok, pool, bias = None, None, None
  if http_targets:
    from llm.checkpoints import find_tokenizer
    tok = find_tokenizer(FLAGS.checkpoint, None, cfg.vocab_size)
    if tok is None:
      raise errors.expected(f"--targets={','.join(targets)}",
                            f"no tokenizer with --checkpoint={FLAGS.checkpoint}",
                            "a checkpoint with its tokenizer (the servers take text)")
    low_id = low_token_id(cfg)
    pool = bench.word_tokens(tok, low_id)
    if len(pool) < 16:
      raise errors.expected(f"--checkpoint={FLAGS.checkpoint}",
                            f"{len(pool)} word tokens that encode back to themselves",
                            "16 or more (the HTTP targets' text prompts are made of them)")
    # llama.cpp ends a reply at any end-of-generation token: the stop ids and the control
    # tokens (no text) below the first plain token are kept from winning.
    bias = sorted(set(tok.stop_ids) | {i for i in range(low_id) if tok.decode([i]) == ""})
  settings.use_compilation_cache(FLAGS.compilation_cache_dir)
  model, vocab, low_id = load(FLAGS.checkpoint, FLAGS.preset, FLAGS.dtype, FLAGS.weights)
  draft, draft_vocab = load_draft(FLAGS.draft, model, FLAGS.decode_vocab)
  engine = Engine(model, engine_config, draft=draft, draft_vocab=draft_vocab, mesh=mesh)
  compile_s, programs = None, None
  if "engine" in targets:
    t0 = time.time()
    programs = engine.warmup()
    compile_s = time.time() - t0
    print(f"engine: {engine_config.max_slots} slots, {engine.pool.num_blocks} pages of "
          f"{engine_config.block_size}, context {engine.max_len}, chunk widths "
          f"{engine.chunk_widths}, paged attention {engine.impl}; {programs} programs "
          f"compiled in {compile_s:.1f} s", flush=True)
  servers: list = []
  previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  runner = None
  try:
    started = _start_servers(targets, engine_config, tok, bias, engine.max_len, cpus, peer,
                             servers)
    runners = {t: r for t, (r, _, _) in started.items()}
    if "engine" in targets:
      runner = EngineRunner(engine, max_queue=10 ** 6).start()
      runners["engine"] = runner
    points = _run_points(targets, runners, engine, clients, rates, vocab, low_id, pool,
                         prompt_lens, output_lens, tok, bench)
  finally:
    if runner is not None:
      runner.shutdown(drain_s=0)
    codes = {s.name: s.stop() for s in servers}
    signal.signal(signal.SIGTERM, previous)
  summary_targets, ratios = _ratios(points, targets, clients, FLAGS.rounds)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  png = plot(points, os.path.join(FLAGS.workdir, "serve_bench.png"))
  first = summary_targets[targets[0]]
  results = {"checkpoint": FLAGS.checkpoint, "preset": None if FLAGS.checkpoint else FLAGS.preset,
             "dtype": FLAGS.dtype, "weights": FLAGS.weights, "targets": targets,
             "engine": config.to_dict(engine_config), "max_len": engine.max_len,
             "paged_attention": engine.impl, "compile_s": compile_s, "programs": programs,
             "servers": {s.name: {"cmd": s.cmd, "ready_s": started[s.name][2],
                                  "exit_code": codes[s.name], "log": s.log,
                                  "engine": _engine_line(s.log)} for s in servers},
             "threads": FLAGS.threads, "cpus": cpus if http_targets else None,
             "llama_cpp_logit_bias_ids": bias,
             "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
             if "llama_cpp" in targets else None,
             "prompt_lens": prompt_lens, "output_lens": output_lens,
             "num_requests": FLAGS.num_requests, "slo_ttft_s": FLAGS.slo_ttft_s,
             "slo_tpot_s": FLAGS.slo_tpot_s, "points": points, "speedup": first["speedup"],
             "speedup_per_round": first["speedup_per_round"], "per_target": summary_targets,
             "ratios_to_llama_cpp": ratios, "rounds": FLAGS.rounds,
             "preemptions": engine.preemptions, "draft": FLAGS.draft or None,
             "decode_vocab": FLAGS.decode_vocab, "plot": png}
  summary = {"speedup": first["speedup"], "points": len(points),
             "speedups": {t: v["speedup"] for t, v in summary_targets.items()},
             "ratios_to_llama_cpp": ratios, "throughput_tok_s": {
                 f"{p['target']}:{p['mode']}:{p.get('concurrency', p.get('rate')):g}:"
                 f"r{p['round']}": round(p["throughput_tok_s"], 1) for p in points}}
  results_lib.finish(FLAGS.workdir, results, summary)


def _run_points(targets, runners, engine, clients, rates, vocab, low_id, pool, prompt_lens,
                output_lens, tok, bench):
  # Closed-loop client counts take turns, and the targets with them, --rounds times, so a
  # machine whose speed drifts slows all of them alike; then the Poisson rates once each.
  # Every point runs the same requests (the Poisson rates: the same arrivals, scaled).
  runs = ([("closed", c, r, t) for r in range(FLAGS.rounds) for t in targets for c in clients]
          + [("poisson", x, 0, t) for x in rates for t in targets])
  reqs = bench.make_requests(FLAGS.num_requests, vocab, prompt_lens, output_lens, FLAGS.seed,
                             low_id, pool)
  if "llama_cpp" in runners:
    _check_llama_prompts(runners["llama_cpp"], reqs, tok.decode,
                         tok.bos_id if tok.add_bos else None)
  points = []
  for mode, x, rnd, target in runs:
    runner = runners[target]
    steps, rounds, accepted = engine.steps, engine.spec_rounds, engine.spec_accepted
    load_before = os.getloadavg()
    recs = (bench.run_closed(runner, reqs, int(x)) if mode == "closed"
            else bench.run_poisson(runner, reqs, x, FLAGS.seed))
    load_after = os.getloadavg()
    local = target == "engine"
    point = {"target": target, "mode": mode,
             ("concurrency" if mode == "closed" else "rate"): x, "round": rnd,
             "engine_steps": engine.steps - steps if local else None,
             "accept_length": (1 + (engine.spec_accepted - accepted)
                               / max(engine.spec_rounds - rounds, 1)
                               if local and engine.shape is not None else None),
             "load_before": [round(v, 2) for v in load_before],
             "load_after": [round(v, 2) for v in load_after],
             **bench.summary(recs, FLAGS.slo_ttft_s, FLAGS.slo_tpot_s)}
    points.append(point)
    print(f"{target:9s} {mode:7s} {'clients' if mode == 'closed' else 'rate'}={x:<6g} r{rnd} "
          f"{point['throughput_tok_s']:8.1f} tok/s {point['throughput_req_s']:6.2f} req/s  "
          f"TTFT p50 {1e3 * (point['ttft_p50_s'] or 0):7.0f} p99 "
          f"{1e3 * (point['ttft_p99_s'] or 0):7.0f} ms  "
          f"TPOT p50 {1e3 * (point['tpot_p50_s'] or 0):6.1f} p99 "
          f"{1e3 * (point['tpot_p99_s'] or 0):6.1f} ms  goodput {point['goodput_req_s']:.2f} "
          f"req/s ({100 * point['slo_attainment']:.0f}%)  load {load_before[0]:.1f}->"
          f"{load_after[0]:.1f}"
          + (f"  failed {point['failed']}: {point['errors'][0]}" if point["failed"] else "")
          + (f"  accept length {point['accept_length']:.2f}" if point['accept_length'] else ""),
          flush=True)
  return points


def _engine_line(log: str) -> str | None:
  """Our server's "engine: ... programs compiled in ... s" line."""
  with open(log, errors="replace") as f:
    return next((line.strip() for line in f if line.startswith("engine: ")), None)


def _ratio(a: float, b: float) -> float | None:
  return a / b if b > 0 else None   # b: no tokens (every request failed)


def _median(xs) -> float | None:
  xs = [x for x in xs if x is not None]
  return float(np.median(xs)) if xs else None


def _fmt(x) -> str:
  return "n/a" if x is None else f"{x:.2f}"


def _ratios(points, targets, clients, rounds: int):
  """Each target's speedup (largest over smallest client count, median of the rounds) and
  each target's throughput over llama_cpp's per client count (median of the rounds); a
  ratio over a point without output tokens is None (n/a), left out of the median."""
  thr = {(p["target"], p["round"], p["concurrency"]): p["throughput_tok_s"]
         for p in points if p["mode"] == "closed"}
  per_target = {}
  for t in targets:
    speedup, per_round = None, []
    if len(clients) >= 2:
      lo, hi = min(clients), max(clients)
      per_round = [_ratio(thr[t, r, hi], thr[t, r, lo]) for r in range(rounds)]
      speedup = _median(per_round)
      print(f"{t}: throughput at {hi:g} concurrent requests: {_fmt(speedup)}x that at {lo:g} "
            f"(median of {rounds} rounds: {', '.join(map(_fmt, per_round))})",
            flush=True)
    per_target[t] = {"speedup": speedup, "speedup_per_round": per_round,
                     "throughput_tok_s_median": {
                         str(c): float(np.median([thr[t, r, c] for r in range(rounds)]))
                         for c in clients}}
  ratios = {}
  if "llama_cpp" in targets:
    for t in targets:
      if t == "llama_cpp":
        continue
      ratios[t] = {}
      for c in clients:
        per_round = [_ratio(thr[t, r, c], thr["llama_cpp", r, c]) for r in range(rounds)]
        ratios[t][str(c)] = {"median": _median(per_round), "per_round": per_round}
        print(f"{t} / llama_cpp throughput at {c} clients: {_fmt(_median(per_round))}x "
              f"(rounds: {', '.join(map(_fmt, per_round))})", flush=True)
  return per_target, ratios


if __name__ == "__main__":
  define_flags()
  cli.run(main)
