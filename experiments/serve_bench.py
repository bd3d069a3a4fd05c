r"""Load benchmark of the serving engine (continuous batching over a paged KV cache,
llm/serving): Poisson arrivals at each --rates, and closed-loop clients at each
--concurrency; time to first token and time per output token (p50 / p99), throughput and
goodput against the request rate, with a plot.

  G=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  python -m experiments.serve_bench --checkpoint=gguf:$G --dtype=bfloat16 \
      --concurrency=1,8 --rounds=3 --rates= --num_requests=16 --prompt_lens=32,128 \
      --output_lens=32,64 --max_slots=8 --max_model_len=256 \
      --compilation_cache_dir=runs/jax_compilation_cache --workdir=runs/serve_bench_mixed
      # 2-core Intel Xeon shared with other jobs (load 5-7 while timed), jax 0.11.2, mixed
      # batch: 8 clients at 3.28-4.73x one client's tokens/s (median 3.90x); 57 programs,
      # 304 s to trace with the cache warm (26 min to compile it at load 9)
  python -m experiments.serve_bench --checkpoint=gguf:$G --dtype=bfloat16 \
      --speculative_tree=2:4:5 --draft=DRAFT_WORKDIR ...   # EAGLE rounds inside the batch
  python -m experiments.serve_bench --preset=tiny      # random weights of an llm.config preset

The engine runs in process behind its runner (the queue and thread the HTTP server uses,
without the HTTP layer); requests are random token ids with lengths drawn from the mixes and
exact output lengths (no stop ids), so every point does the same work. Closed loop with N
clients measures throughput at N concurrent requests; "speedup" in the summary is the
throughput at the largest --concurrency over that at the smallest (one at a time with
--concurrency=1,...; with --rounds=R the client counts take turns R times and the median
of the R ratios is reported). Goodput: requests per second meeting --slo_ttft_s and --slo_tpot_s.
Every table width the engine uses is compiled before timing. Writes results.json and
serve_bench.png to --workdir; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from absl import flags
from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings  # the shared settings by name
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)
from llm.serving.config import DRAFT, EngineConfig

FLAGS = flags.FLAGS

RATES = config.setting(
    "rates", "list", "Poisson arrival rates to run, requests per second ('inf': all at "
    "once); empty: none.")
CONCURRENCY = config.setting(
    "concurrency", "list", "Closed-loop client counts to run (each client sends its next "
    "request when its last one finished); empty: none.")
NUM_REQUESTS = config.setting("num_requests", "integer", "Requests per rate or client count.",
                              lower=1)
PROMPT_LENS = config.setting(
    "prompt_lens", "list", "Prompt lengths in tokens; each request draws one uniformly.")
OUTPUT_LENS = config.setting(
    "output_lens", "list", "Output lengths in tokens (exact: no stop ids); each request draws "
    "one uniformly.")
SLO_TTFT_S = config.setting("slo_ttft_s", "float", "Goodput's time-to-first-token SLO "
                            "(seconds).", lower=0)
SLO_TPOT_S = config.setting("slo_tpot_s", "float", "Goodput's time-per-output-token SLO "
                            "(seconds).", lower=0)


def define_flags() -> None:
  config.define_flags(EngineConfig)
  config.define_flags(
      None, "checkpoint", "preset", "dtype", "weights", RATES, CONCURRENCY, NUM_REQUESTS,
      PROMPT_LENS, OUTPUT_LENS, SLO_TTFT_S, SLO_TPOT_S, DRAFT, "compilation_cache_dir", "seed",
      "rounds", "workdir",
      checkpoint=None, preset="tiny", dtype="float32", weights="float32", rates=["1", "4"],
      concurrency=["1", "8"], num_requests=16, prompt_lens=["32", "128"],
      output_lens=["32", "64"], slo_ttft_s=2.0, slo_tpot_s=0.2, draft="",
      compilation_cache_dir="", seed=0, rounds=1,
      workdir="runs/serve_bench")


def _numbers(flag: str, kind, lower: float, allow_inf: bool = False) -> list:
  out = []
  for text in FLAGS[flag].value or []:
    try:
      v = float(text) if kind is float else int(text)
    except ValueError:
      raise errors.expected(f"--{flag}={','.join(FLAGS[flag].value)}",
                            f"{text!r} is not a number", f"{kind.__name__}s") from None
    if not (v >= lower or (allow_inf and math.isinf(v))) or (math.isnan(v)):
      raise errors.expected(f"--{flag}", f"{text}", f"values >= {lower}")
    out.append(v)
  return out


def load(checkpoint, preset, dtype, weights):
  """(model, vocab size, lowest plain-token id) of --checkpoint, or random weights of
  --preset."""
  if checkpoint:
    from llm.checkpoints import load_model
    cfg, model = load_model(checkpoint, dtype, weights)
    # Skip the specials a GGUF / HF vocabulary puts first (SmolLM2: 17 of them).
    return model, cfg.vocab_size, min(32, cfg.vocab_size - 1)
  from flax import nnx
  from llm import model as model_lib
  from llm.config import get_config
  cfg = get_config(preset).replace(dtype=dtype, param_dtype=dtype)
  return model_lib.Llama(cfg, nnx.Rngs(0)), cfg.vocab_size, 0


def plot(points, path):
  from core.plot import pyplot
  plt = pyplot()
  rated = [p for p in points if p["mode"] == "poisson" and not math.isinf(p["rate"])]
  fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.6))
  if rated:
    x = [p["rate"] for p in rated]
    ax = axes[0]
    ax.plot(x, [p["throughput_tok_s"] for p in rated], "o-", label="throughput (tokens/s)")
    ax2 = ax.twinx()
    ax2.plot(x, [p["throughput_req_s"] for p in rated], "s--", color="C1",
             label="throughput (req/s)")
    ax2.plot(x, [p["goodput_req_s"] for p in rated], "^-", color="C2", label="goodput (req/s)")
    ax.set(xlabel="request rate (req/s)", ylabel="tokens/s", title="throughput and goodput")
    ax2.set_ylabel("requests/s")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax2.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    for ax, key, title in ((axes[1], "ttft", "time to first token"),
                           (axes[2], "tpot", "time per output token")):
      for q, style in (("p50", "o-"), ("p99", "s--")):
        ax.plot(x, [1e3 * (p[f"{key}_{q}_s"] or math.nan) for p in rated], style, label=q)
      ax.set(xlabel="request rate (req/s)", ylabel="ms", title=title)
      ax.legend(fontsize=8)
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  cli.quiet_library_logs()
  from experiments.benchmarks import serving as bench
  from llm.serving.engine import Engine, load_draft
  from llm.serving.runner import EngineRunner
  rates = _numbers("rates", float, 1e-9, allow_inf=True)
  clients = [int(c) for c in _numbers("concurrency", int, 1)]
  prompt_lens = [int(v) for v in _numbers("prompt_lens", int, 1)]
  output_lens = [int(v) for v in _numbers("output_lens", int, 1)]
  if not rates and not clients:
    raise errors.UserError("--rates and --concurrency are both empty: nothing to run")
  if not prompt_lens or not output_lens:
    raise errors.UserError("--prompt_lens and --output_lens need at least one length each")
  engine_config = config.from_flags(EngineConfig)
  settings.use_compilation_cache(FLAGS.compilation_cache_dir)
  model, vocab, low_id = load(FLAGS.checkpoint, FLAGS.preset, FLAGS.dtype, FLAGS.weights)
  if bool(FLAGS.draft) != bool(engine_config.speculative_tree):
    raise errors.UserError(f"--draft={FLAGS.draft!r} and --speculative_tree="
                           f"{engine_config.speculative_tree!r}: give both or neither")
  engine = Engine(model, engine_config, draft=load_draft(FLAGS.draft, model))
  longest = max(prompt_lens) + max(output_lens)
  if longest > engine.max_len:
    raise errors.UserError(f"--prompt_lens / --output_lens: the longest request has {longest} "
                           f"tokens, beyond the engine's context of {engine.max_len} "
                           "(--max_model_len)")
  t0 = time.time()
  programs = engine.warmup()
  compile_s = time.time() - t0
  print(f"engine: {engine_config.max_slots} slots, {engine.pool.num_blocks} pages of "
        f"{engine_config.block_size}, context {engine.max_len}, paged attention {engine.impl}; "
        f"{programs} programs compiled in {compile_s:.1f} s", flush=True)
  runner = EngineRunner(engine, max_queue=10 ** 6).start()
  points = []
  # Closed-loop client counts take turns, --rounds times (each on the same requests), so a
  # machine whose speed drifts slows all of them alike; then the Poisson rates once each.
  runs = ([("closed", c, r) for r in range(FLAGS.rounds) for c in clients]
          + [("poisson", x, 0) for x in rates])
  for i, (mode, x, rnd) in enumerate(runs):
    seed = FLAGS.seed + (clients.index(x) if mode == "closed" else len(clients) + i)
    reqs = bench.make_requests(FLAGS.num_requests, vocab, prompt_lens, output_lens, seed,
                               low_id)
    steps, rounds, accepted = engine.steps, engine.spec_rounds, engine.spec_accepted
    recs = (bench.run_closed(runner, reqs, int(x)) if mode == "closed"
            else bench.run_poisson(runner, reqs, x, seed))
    point = {"mode": mode, ("concurrency" if mode == "closed" else "rate"): x, "round": rnd,
             "engine_steps": engine.steps - steps,
             "accept_length": (1 + (engine.spec_accepted - accepted)
                               / max(engine.spec_rounds - rounds, 1)
                               if engine.shape is not None else None),
             **bench.summary(recs, FLAGS.slo_ttft_s, FLAGS.slo_tpot_s)}
    points.append(point)
    print(f"{mode:8s} {'clients' if mode == 'closed' else 'rate'}={x:<6g} r{rnd} "
          f"{point['throughput_tok_s']:8.1f} tok/s {point['throughput_req_s']:6.2f} req/s  "
          f"TTFT p50 {1e3 * point['ttft_p50_s']:7.0f} p99 {1e3 * point['ttft_p99_s']:7.0f} ms  "
          f"TPOT p50 {1e3 * (point['tpot_p50_s'] or 0):6.1f} p99 "
          f"{1e3 * (point['tpot_p99_s'] or 0):6.1f} ms  goodput {point['goodput_req_s']:.2f} "
          f"req/s ({100 * point['slo_attainment']:.0f}%)"
          + (f"  accept length {point['accept_length']:.2f}" if point['accept_length'] else ""),
          flush=True)
  runner.shutdown(drain_s=0)
  closed = [p for p in points if p["mode"] == "closed"]
  speedup, per_round = None, []
  if len(clients) >= 2:
    lo, hi = min(clients), max(clients)
    thr = {(p["round"], p["concurrency"]): p["throughput_tok_s"] for p in closed}
    per_round = [thr[r, hi] / thr[r, lo] for r in range(FLAGS.rounds)]
    speedup = float(np.median(per_round))
    print(f"throughput at {hi:g} concurrent requests: {speedup:.2f}x that at {lo:g} (median "
          f"of {FLAGS.rounds} rounds: {', '.join(f'{x:.2f}' for x in per_round)})", flush=True)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  png = plot(points, os.path.join(FLAGS.workdir, "serve_bench.png"))
  results = {"checkpoint": FLAGS.checkpoint, "preset": None if FLAGS.checkpoint else FLAGS.preset,
             "dtype": FLAGS.dtype, "weights": FLAGS.weights,
             "engine": config.to_dict(engine_config), "max_len": engine.max_len,
             "paged_attention": engine.impl, "compile_s": compile_s,
             "prompt_lens": prompt_lens, "output_lens": output_lens,
             "num_requests": FLAGS.num_requests, "slo_ttft_s": FLAGS.slo_ttft_s,
             "slo_tpot_s": FLAGS.slo_tpot_s, "points": points, "speedup": speedup,
             "speedup_per_round": per_round, "rounds": FLAGS.rounds,
             "preemptions": engine.preemptions, "draft": FLAGS.draft or None, "plot": png}
  summary = {"speedup": speedup, "points": len(points), "throughput_tok_s": {
      f"{p['mode']}:{p.get('concurrency', p.get('rate')):g}:r{p['round']}":
      round(p["throughput_tok_s"], 1) for p in points}}
  results_lib.finish(FLAGS.workdir, results, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
