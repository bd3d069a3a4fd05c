r"""EAGLE inside the serving engine's batch against concurrency (arXiv 2508.08192's serving
figure: speedup by batch size): the same held-out chat requests of a draft-head run served by
the plain engine and by the speculative one (`llm.serving`: continuous batching over a paged
KV cache; each running request drafts its own tree, the batch verifies every tree in one
target pass), closed loop at each --concurrency; per client count the throughput of both,
the speedup (speculative over plain, median of --rounds), the accept length (tokens per
request per round: accepted drafts + the bonus), TTFT and TPOT. Greedy replies are checked
token for token against the plain engine's (the rows equal plain decoding).

  python -m experiments.spec_decode.serving --draft=runs/spec_serve/draft \
      --speculative_tree=2:4:5 --decode_vocab=1024 --concurrency=1,2,4,8,16 --rounds=2 \
      --max_new_tokens=64 --compilation_cache_dir=runs/jax_compilation_cache \
      --workdir=runs/spec_serving

--draft is a draft-head run's workdir (experiments.spec_decode's <workdir>/draft): the target
is the one it was distilled from (its settings; --checkpoint overrides, the same model in
another file), the requests are its held-out chat requests (the last eval_sequences prompts
its sequences were generated from, read back from <draft>/sequences.npz, with the stop ids
they ended at), so the head never trained on them (for a run that sampled from BOS or text
windows, the first --prompt_len tokens of its held-out sequences). Each request stops at the
chat's end of turn or at --max_new_tokens; both engines produce the same replies (greedy),
so each point is the same work. The client counts and the two engines take turns --rounds
times (a machine whose speed drifts slows both alike). Every program both engines use is
compiled before timing (--chunk_widths unset: the prefill chunk widths these prompts need),
and the programs XLA compiles while a point runs are counted (0 expected). Writes
results.json and spec_serving.png to --workdir (throughput, speedup with the paper's range,
accept length against concurrency); the last stdout line is a JSON summary.

The paper (its abstract): Llama 4 Maverick at about 4 ms per token at batch 1 on 8 H100s,
and EAGLE speedups of 1.4x-2.0x at large batch sizes in production; this study measures the
same ratio on whatever device runs it.
"""

from __future__ import annotations

import dataclasses
import json
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

# The paper's serving figures (arXiv 2508.08192, abstract): batch-1 latency of Llama 4
# Maverick on 8 H100s, and the speedup range at large batch sizes in production.
PAPER = {"arxiv": "2508.08192", "batch1_ms_per_token": 4.0,
         "batch1_setup": "Llama 4 Maverick, 8 NVIDIA H100", "large_batch_speedup": [1.4, 2.0]}


def define_flags() -> None:
  config.define_flags(EngineConfig, max_slots=16, speculative_tree="2:4:5")
  config.define_flags(
      None, DRAFT, "decode_vocab", "checkpoint", "dtype", "concurrency", "num_requests",
      "max_new_tokens", "prompt_len", "rounds", "compilation_cache_dir", "workdir", draft=None,
      decode_vocab=0, checkpoint=None, dtype="float32", concurrency=["1", "2", "4", "8", "16"],
      num_requests=None, max_new_tokens=64, prompt_len=16, rounds=1, compilation_cache_dir="",
      workdir="runs/spec_serving")
  flags.mark_flag_as_required("draft")


def run_settings(draft_dir: str) -> dict:
  """The settings a draft-head run saved with its latest checkpoint."""
  from core import checkpoint as ckpt_lib
  def missing():
    return errors.expected(f"--draft={draft_dir}", "no draft-head checkpoint",
                           "a draft-head run's workdir (experiments.spec_decode's "
                           "<workdir>/draft)")
  if not os.path.isdir(os.path.join(draft_dir, "checkpoints")):
    raise missing()   # (a Checkpointer would make the directory)
  ckpt = ckpt_lib.Checkpointer(draft_dir)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise missing()
    return (ckpt.restore_meta(step) or {}).get("settings", {})
  finally:
    ckpt.close()


def held_out_requests(draft_dir: str, eval_sequences: int, prompt_len: int):
  """(held-out prompts, the stop ids their sequences ended at) of a draft-head run: the
  prompts of its last `eval_sequences` sequences (<draft_dir>/sequences.npz) when they are
  distinct (chat requests), else, as experiments.spec_decode's benchmark takes them, the
  first `prompt_len` tokens of those sequences (runs sampled from BOS or text windows)."""
  path = os.path.join(draft_dir, "sequences.npz")
  if not os.path.exists(path):
    raise errors.expected(f"--draft={draft_dir}", f"no {path}",
                          "the run's sequences (its held-out prompts are read from them)")
  with np.load(path) as f:
    key = json.loads(str(f["key"]))
    tokens, done = f["tokens"], int(f["done"])
  prompts, n = key["prompts"], key["num"]
  if done < n:
    raise errors.expected(f"--draft={draft_dir}", f"{done} of {n} sequences in {path}",
                          "a finished run")
  first = n - eval_sequences
  held = [list(map(int, prompts[i % len(prompts)])) for i in range(first, n)]
  if len({tuple(p) for p in held}) < len(held):
    held = tokens[first:n, :prompt_len].astype(int).tolist()
  return held, tuple(int(t) for t in key["stop"])


def run_points(runners, engines, reqs, clients, rounds):
  """Closed-loop points: every client count, each engine in turn, `rounds` times; per
  point the statistics, the engine's steps, (speculative) accept length and the programs
  XLA compiled while it ran (0 once the engines are warmed up)."""
  from core.benchmark import CompileClock
  from experiments.benchmarks import serving as bench
  points, replies = [], {}
  for rnd in range(rounds):
    for c in clients:
      for name in ("plain", "eagle"):
        engine = engines[name]
        steps, rounds0, acc0 = engine.steps, engine.spec_rounds, engine.spec_accepted
        load = os.getloadavg()[0]
        with CompileClock() as clock:
          recs = bench.run_closed(runners[name], reqs, c)
        point = {"engine": name, "concurrency": c, "round": rnd,
                 "compiles": clock.backend_compiles,
                 "engine_steps": engine.steps - steps,
                 "spec_rounds": engine.spec_rounds - rounds0,
                 "accept_length": (1 + (engine.spec_accepted - acc0)
                                   / max(engine.spec_rounds - rounds0, 1)
                                   if name == "eagle" else None),
                 "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
                 **bench.summary(recs, math.inf, math.inf)}
        if point["failed"]:
          raise RuntimeError(f"{name} engine, {c} clients: {point['failed']} requests failed: "
                             f"{point['errors']}")
        replies[name, c, rnd] = {r.index: r.ids for r in recs}
        points.append(point)
        print(f"{name:5s} clients={c:<3d} r{rnd} {point['throughput_tok_s']:7.1f} tok/s  "
              f"TTFT p50 {1e3 * point['ttft_p50_s']:6.0f} ms  TPOT p50 "
              f"{1e3 * (point['tpot_p50_s'] or 0):6.1f} p99 "
              f"{1e3 * (point['tpot_p99_s'] or 0):6.1f} ms  steps {point['engine_steps']}"
              + (f"  accept length {point['accept_length']:.2f}" if name == "eagle" else "")
              + f"  load {point['load_before']:.1f}->{point['load_after']:.1f}"
              + (f"  COMPILED {point['compiles']} programs while timed" if point["compiles"]
                 else ""), flush=True)
  return points, replies


def table(points, clients, rounds):
  """Per client count: medians of both engines' throughput, the speedup (median of the
  rounds' ratios), the accept length and TPOT."""
  by = {(p["engine"], p["concurrency"], p["round"]): p for p in points}
  rows = []
  for c in clients:
    ratios = [by["eagle", c, r]["throughput_tok_s"] / by["plain", c, r]["throughput_tok_s"]
              for r in range(rounds)]
    med = lambda name, k: float(np.median([by[name, c, r][k] or math.nan
                                          for r in range(rounds)]))
    rows.append({"concurrency": c, "plain_tok_s": med("plain", "throughput_tok_s"),
                 "eagle_tok_s": med("eagle", "throughput_tok_s"),
                 "speedup": float(np.median(ratios)), "speedup_per_round": ratios,
                 "accept_length": med("eagle", "accept_length"),
                 "plain_tpot_p50_ms": 1e3 * med("plain", "tpot_p50_s"),
                 "eagle_tpot_p50_ms": 1e3 * med("eagle", "tpot_p50_s"),
                 "plain_ttft_p50_ms": 1e3 * med("plain", "ttft_p50_s"),
                 "eagle_ttft_p50_ms": 1e3 * med("eagle", "ttft_p50_s")})
  return rows


def plot(rows, path):
  """Throughput of both engines, the speedup (the paper's large-batch range shaded) and the
  accept length, against the client count."""
  from core.plot import pyplot
  plt = pyplot()
  xs = [r["concurrency"] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  axes[0].plot(xs, [r["plain_tok_s"] for r in rows], "o-", label="plain")
  axes[0].plot(xs, [r["eagle_tok_s"] for r in rows], "s-", label="EAGLE")
  axes[0].set(ylabel="output tokens/s", title="throughput")
  axes[1].plot(xs, [r["speedup"] for r in rows], "o-", color="C2", label="measured")
  lo, hi = PAPER["large_batch_speedup"]
  axes[1].axhspan(lo, hi, color="C1", alpha=0.2, label=f"arXiv {PAPER['arxiv']}: {lo}-{hi}x "
                  "(large batches, H100s)")
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set(ylabel="EAGLE / plain throughput", title="speedup")
  axes[2].plot(xs, [r["accept_length"] for r in rows], "o-", color="C3")
  axes[2].set(ylabel="tokens per round", title="accept length")
  for ax in axes:
    ax.set(xlabel="concurrent requests (closed loop)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  cli.quiet_library_logs()
  from llm.checkpoints import load_config, load_model
  from llm.serving.engine import Engine, SamplingParams, load_draft
  from llm.speculative.tree import TreeShape
  from llm.serving.runner import EngineRunner
  clients = []
  for text in FLAGS.concurrency or []:
    if not text.isdigit() or int(text) < 1:
      raise errors.expected(f"--concurrency={','.join(FLAGS.concurrency)}", repr(text),
                            "client counts >= 1")
    clients.append(int(text))
  if not clients:
    raise errors.UserError("--concurrency is empty: nothing to run")
  cfg = config.from_flags(EngineConfig)
  if not cfg.speculative_tree:
    raise errors.expected("--speculative_tree", "''", "a tree shape, e.g. 2:4:5")
  if max(clients) > cfg.max_slots:
    raise errors.expected(f"--max_slots={cfg.max_slots}", "fewer slots than clients",
                          f"at least --concurrency's largest, {max(clients)}")
  run = run_settings(FLAGS.draft)
  if "distill.eval_sequences" not in run:
    raise errors.expected(f"--draft={FLAGS.draft}", "no distill.eval_sequences in its "
                          "checkpoint's settings", "a draft-head run of experiments.spec_decode")
  prompts, stop = held_out_requests(FLAGS.draft, int(run["distill.eval_sequences"]),
                                    FLAGS.prompt_len)
  n = FLAGS.num_requests or len(prompts)
  if n > len(prompts):
    raise errors.expected(f"--num_requests={n}", f"{len(prompts)} held-out requests in "
                          f"--draft={FLAGS.draft}", f"at most {len(prompts)}")
  prompts = prompts[:n]
  checkpoint = FLAGS.checkpoint or run.get("target")
  if not checkpoint:
    raise errors.expected(f"--draft={FLAGS.draft}", "no target in the run's settings",
                          "--checkpoint=SPEC of the target it was distilled from")
  # What the target's config and the run's settings decide, before the weights load.
  trained = int(run.get("distill.draft_vocab") or 0)
  vocab_size = load_config(checkpoint).vocab_size
  if FLAGS.decode_vocab > (trained or vocab_size):
    raise errors.expected(f"--decode_vocab={FLAGS.decode_vocab}", "more tokens than the "
                          + ("head trained on" if trained else "target's vocabulary"),
                          f"at most {trained or vocab_size} (0: the "
                          + ("head's own)" if trained else "whole vocabulary)"))
  top_k = TreeShape.parse(cfg.speculative_tree).top_k
  if 0 < (FLAGS.decode_vocab or trained) < top_k:
    raise errors.expected(f"--decode_vocab={FLAGS.decode_vocab}" if FLAGS.decode_vocab else
                          f"--draft={FLAGS.draft}", f"a draft vocabulary of "
                          f"{FLAGS.decode_vocab or trained} tokens", "at least the top_k of "
                          f"--speculative_tree={cfg.speculative_tree} ({top_k})")
  longest = max(len(p) for p in prompts) + FLAGS.max_new_tokens
  if cfg.max_model_len is not None and cfg.max_model_len < longest:
    raise errors.expected(f"--max_model_len={cfg.max_model_len}", f"shorter than the longest "
                          f"request ({longest - FLAGS.max_new_tokens} prompt tokens + "
                          f"--max_new_tokens={FLAGS.max_new_tokens})", f"at least {longest}")
  settings.use_compilation_cache(FLAGS.compilation_cache_dir)
  _, model = load_model(checkpoint, FLAGS.dtype)
  if cfg.max_model_len is None:
    cfg = dataclasses.replace(cfg, max_model_len=-(-longest // cfg.block_size) * cfg.block_size)
  if not cfg.chunk_widths:      # the chunk widths these prompts need, as serve_bench's
    cfg = dataclasses.replace(cfg, chunk_widths=chunk_widths_for(
        sorted({len(p) for p in prompts}), cfg.prefill_chunk))
  draft, vocab = load_draft(FLAGS.draft, model, FLAGS.decode_vocab)
  engines = {"plain": Engine(model, dataclasses.replace(cfg, speculative_tree="")),
             "eagle": Engine(model, cfg, draft=draft, draft_vocab=vocab)}
  compile_s = {}
  for name, engine in engines.items():
    t0 = time.time()
    programs = engine.warmup()
    compile_s[name] = time.time() - t0
    print(f"{name} engine: {cfg.max_slots} slots, context {engine.max_len}, {programs} "
          f"programs compiled in {compile_s[name]:.0f} s", flush=True)
  params = SamplingParams(max_tokens=FLAGS.max_new_tokens, stop_token_ids=stop)
  reqs = [(p, params) for p in prompts]
  runners = {}
  previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  try:
    runners = {k: EngineRunner(e, max_queue=10 ** 6).start() for k, e in engines.items()}
    points, replies = run_points(runners, engines, reqs, clients, FLAGS.rounds)
  finally:
    for runner in runners.values():
      runner.shutdown(drain_s=0)
    signal.signal(signal.SIGTERM, previous)
  reference = replies["plain", clients[0], 0]
  differing = sorted({i for key, got in replies.items() for i in got
                      if got[i] != reference[i]})
  rows = table(points, clients, FLAGS.rounds)
  print(f"{'clients':>7} {'plain tok/s':>11} {'EAGLE tok/s':>11} {'speedup':>7} "
        f"{'accept len':>10} {'plain TPOT':>10} {'EAGLE TPOT':>10}")
  for r in rows:
    print(f"{r['concurrency']:>7} {r['plain_tok_s']:>11.1f} {r['eagle_tok_s']:>11.1f} "
          f"{r['speedup']:>7.2f} {r['accept_length']:>10.2f} {r['plain_tpot_p50_ms']:>8.1f}ms "
          f"{r['eagle_tpot_p50_ms']:>8.1f}ms", flush=True)
  print(f"replies equal to the plain engine's at {clients[0]} clients, in both engines at "
        f"every client count and round: {len(prompts) - len(differing)} / {len(prompts)} "
        "requests", flush=True)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  png = plot(rows, os.path.join(FLAGS.workdir, "spec_serving.png"))
  tokens = sum(len(t) for t in reference.values())
  results = {"draft": FLAGS.draft, "checkpoint": checkpoint, "dtype": FLAGS.dtype,
             "decode_vocab": FLAGS.decode_vocab, "draft_vocab": None if vocab is None
             else len(vocab), "engine": config.to_dict(cfg), "compile_s": compile_s,
             "requests": len(prompts), "output_tokens": tokens,
             "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": FLAGS.max_new_tokens,
             "stop_ids": list(stop), "rounds": FLAGS.rounds, "rows": rows, "points": points,
             "replies_equal": len(prompts) - len(differing), "replies_differing": differing,
             "compiled_while_timed": sum(p["compiles"] for p in points),
             "paper": PAPER, "plot": png}
  summary = {"speedup": {str(r["concurrency"]): round(r["speedup"], 3) for r in rows},
             "accept_length": {str(r["concurrency"]): round(r["accept_length"], 2)
                               for r in rows},
             "replies_equal": f"{len(prompts) - len(differing)}/{len(prompts)}"}
  results_lib.finish(FLAGS.workdir, results, summary)
  if differing:
    raise SystemExit(f"EAGLE replies differ from plain decoding on requests {differing}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
