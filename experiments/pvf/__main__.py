r"""Parameter vulnerability factor (PVF, arXiv 2405.01741) of a trained DLRM per parameter
group, and of a Llama (stories260K, or a tiny random model when absent).

  python -m experiments.pvf                                   # runs/pvf
  python -m experiments.pvf --formats=fp32,bf16,int8 --faults=single,burst:4 --trials=4000
  python -m experiments.pvf --dlrm_run=runs/train_rec/RUN     # a train_rec run's checkpoint

DLRM: trains the `--preset` DLRM on synthetic data for --steps (rec.runs.train_run), or
restores the latest checkpoint of --dlrm_run (built with the same flags); then for each
--formats x --faults, --trials faults per group (embedding tables, bottom MLP layers,
interaction output, top MLP layers), each on one of --examples eval examples, under
--criterion (threshold[:t]: the click decision at t flips; tol:x: |change in probability|
> x). Llama: the same per group (embed, attention and MLP per layer, norms) with the top-1
next token at the last of --llama_len positions as the output, on sequences the model
samples itself (llm.generate). Every trial runs the real modules with their parameters
swapped (dlrm.py, llama.py; the injector and the trial batching are core/faults.py).
Prints a table per model, writes results.json and pvf.png; last line JSON.

Measured (`python -m experiments.pvf`, defaults, 2-core CPU, jax 0.11.2, 2026-11-24, 4.0
min; full tables in BENCHMARKS.md "PVF"): DLRM small (test AUC 0.755), threshold 0.5,
2000 single-bit faults per group, fp32 / bf16 / int8: emb 0 / 0 / 0 (CI upper 0.0019),
emb_read 0.011 / 0.0245 / 0, bottom_mlp.0 0.0075 / 0.012 / 0.001, interaction 0.011 /
0.0175 / 0.0045, top_mlp.1 0.0085 / 0.0245 / 0.001. stories260K, top-1 change, 500 per
group: layer 0 attention 0.054 / 0.088 / 0.018, layer 4 MLP 0.030 / 0.050 / 0.004,
norms 0.132 / 0.220 / 0.122.
"""

from __future__ import annotations

import os
import time

from absl import flags

from core import cli
from core import results as results_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  from rec import configs
  configs.define_rec_run_flags(preset="small", batch_size=512, num_rows=20_000)
  flags.DEFINE_integer("steps", 300, "DLRM train steps (synthetic data).", lower_bound=1)
  flags.DEFINE_string("dlrm_run", "", "Restore this train_rec run's latest checkpoint instead "
                      "of training (the run must match --preset / --num_rows).")
  flags.DEFINE_list("formats", ["fp32", "bf16", "int8"], "Stored formats the bits flip in.")
  flags.DEFINE_list("faults", ["single"],
                    "Fault models: single, single:<bit>, multi:<k>, burst:<k>[:<start>].")
  flags.DEFINE_string("criterion", "threshold:0.5", "DLRM output change: threshold[:t] | tol:x.")
  flags.DEFINE_integer("trials", 2000, "Faults per DLRM group and (format, fault).", lower_bound=1)
  flags.DEFINE_integer("examples", 1024, "DLRM eval examples the trials draw from.", lower_bound=1)
  flags.DEFINE_string("llama", "../shared/data/llama2c/stories260K.bin",
                      "llama2.c checkpoint; when absent, a tiny random-init Llama; '' skips.")
  flags.DEFINE_integer("llama_trials", 500, "Faults per Llama group and (format, fault).",
                       lower_bound=1)
  flags.DEFINE_integer("llama_seqs", 64, "Sequences sampled from the Llama as inputs.",
                       lower_bound=1)
  flags.DEFINE_integer("llama_len", 32, "Tokens per sequence.", lower_bound=1)
  flags.DEFINE_integer("chunk", 256, "Trials per jitted, vmapped call.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seed of training, inputs and fault draws.", lower_bound=0)
  flags.DEFINE_string("workdir", "runs/pvf", "Output directory.")


def _dlrm(t_key):
  import jax

  from core import checkpoint as ckpt_lib
  from core import faults
  from experiments.pvf import dlrm as pvf
  from rec import configs, runs

  cfg = configs.RecRunConfig(model="dlrm", preset=FLAGS.preset, data="synthetic",
                             num_rows=FLAGS.num_rows, batch_size=FLAGS.batch_size,
                             eval_batch_size=FLAGS.examples, eval_batches=1, seed=FLAGS.seed)
  if FLAGS.dlrm_run:
    task, train_src, eval_src, _, _ = configs.build_run(cfg)
    ckpt = ckpt_lib.Checkpointer(FLAGS.dlrm_run)
    try:
      state, _ = ckpt.restore(ckpt.latest_step(), ckpt_lib.abstract_like(task.init_state(0)))
    finally:
      ckpt.close()
    mcfg = configs.model_config(cfg, train_src.spec)
    auc = None
  else:
    print(f"== DLRM {FLAGS.preset}: {FLAGS.steps} steps of {FLAGS.batch_size}", flush=True)
    run = runs.train_run(cfg, os.path.join(FLAGS.workdir, "dlrm", "run"), steps=FLAGS.steps,
                         seed=FLAGS.seed, log_every=100)
    task, state, eval_src, mcfg = run.task, run.state, run.eval_src, run.model_config
    auc = run.eval["auc"]
  tables = task.collection.to_tables(state["emb"])
  target = pvf.dlrm_target(mcfg, state["params"], tables, [next(iter(eval_src.batches(0)))],
                           max_examples=FLAGS.examples)
  crit = faults.make_criterion(FLAGS.criterion)
  rows = []
  for fmt in FLAGS.formats:
    for f in FLAGS.faults:
      print(f"== DLRM {FLAGS.preset}: {fmt} {f}, {FLAGS.trials} trials per group", flush=True)
      rows += pvf.dlrm_pvf(target, fmt, faults.FaultModel.parse(f), crit, FLAGS.trials,
                           jax.random.fold_in(t_key, len(rows)), chunk=FLAGS.chunk)
  return {"label": f"DLRM {FLAGS.preset}", "criterion": FLAGS.criterion, "test_auc": auc,
          "examples": target.num_examples, "rows": rows}


def _llama(t_key):
  import jax
  from flax import nnx

  from core import faults
  from experiments.pvf import llama as llm_pvf
  from llm import weights as weights_lib
  from llm.config import PRESETS
  from llm.model import Llama, load_weights

  if os.path.exists(FLAGS.llama):
    cfg, w = weights_lib.load_llama2c(FLAGS.llama)
    model = Llama(cfg, nnx.Rngs(0))
    load_weights(model, w)
    label = f"Llama {os.path.basename(FLAGS.llama)}"
  else:
    print(f"== {FLAGS.llama} not found: a tiny random-init Llama instead", flush=True)
    model = Llama(PRESETS["tiny"], nnx.Rngs(FLAGS.seed))
    label = "Llama tiny (random init)"
  tokens = llm_pvf.sample_sequences(model, FLAGS.llama_seqs, FLAGS.llama_len,
                                    jax.random.fold_in(t_key, 7))
  rows = []
  for fmt in FLAGS.formats:
    for f in FLAGS.faults:
      print(f"== {label}: {fmt} {f}, {FLAGS.llama_trials} trials per group", flush=True)
      rows += llm_pvf.llama_pvf(model, tokens, fmt, faults.FaultModel.parse(f),
                                FLAGS.llama_trials, jax.random.fold_in(t_key, 100 + len(rows)),
                                chunk=min(FLAGS.chunk, 128))
  return {"label": label, "criterion": "top1 next token (last position)",
          "sequences": FLAGS.llama_seqs, "length": FLAGS.llama_len, "rows": rows}


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax

  from experiments.pvf import study

  t0 = time.perf_counter()
  key = jax.random.key(FLAGS.seed)
  out = {"platform": jax.default_backend(), "formats": FLAGS.formats, "faults": FLAGS.faults,
         "trials": FLAGS.trials, "models": [_dlrm(key)]}
  print(study.format_rows(out["models"][0]["rows"]), flush=True)
  if FLAGS.llama:
    out["models"].append(_llama(key))
    print(study.format_rows(out["models"][1]["rows"]), flush=True)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  out["plot"] = study.plot(out, os.path.join(FLAGS.workdir, "pvf.png"))
  out["wall_seconds"] = time.perf_counter() - t0
  results_lib.write_results(FLAGS.workdir, out)
  summary = {m["label"]: {f"{r['group']}/{r['fmt']}/{r['fault']}": round(r["pvf"], 5)
                          for r in m["rows"]} for m in out["models"]}
  summary["wall_seconds"] = round(out["wall_seconds"], 1)
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
