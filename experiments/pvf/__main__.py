r"""Parameter vulnerability factor (PVF, arXiv 2405.01741) of a trained DLRM per parameter
group, and of a Llama (stories260K, or a tiny random model when absent), beside what the
paper reports.

  python -m experiments.pvf                                   # runs/pvf
  python -m experiments.pvf --trials=8000                     # narrower intervals
  python -m experiments.pvf --formats=fp32 --faults=single,burst:4 --llama_faults=single,multi:2
  python -m experiments.pvf --dlrm_run=runs/train_rec/RUN     # a train_rec run's checkpoint

DLRM: trains the `--preset` DLRM on synthetic data for --steps (rec.runs.train_run), or
restores the latest checkpoint of --dlrm_run (built with the same flags); then for each
--formats x --faults (default the paper's fault models: SBF `single`, MBF `multi:2`,
MBBF `burst:2`), --trials faults per group (embedding tables, the bottom and top MLP as
the paper's components and per layer, the interaction output), each on one of --examples
eval examples, under --criterion (threshold[:t]: the click decision at t flips; tol:x:
|change in probability| > x). Llama: the same per group (embed, attention and MLP per
layer, norms) for --formats x --llama_faults, with the top-1 next token at the last of
--llama_len positions as the output, on sequences the model samples itself
(llm.generate). Every trial runs the real modules with their parameters swapped (dlrm.py,
llama.py; the injector and the trial batching are core/faults.py). Prints a table per
model with the paper's finding beside the groups it names (n/a elsewhere; study.py says
what could be read of the paper), PVF by bit field of the single-bit faults and the
paper's ordering of DLRM components tested on ours; writes results.json and pvf.png; last
line JSON. Every PVF has a 95% Wilson interval; the widest half-width is printed.

Measured (`python -m experiments.pvf`, defaults, 2-core CPU shared at load average 28-30,
jax 0.11.2, 2026-11-27, 11.9 min wall; tables in BENCHMARKS.md "PVF"): DLRM small (test
AUC 0.755), threshold 0.5, 2000 faults per group, fp32 SBF / MBF / MBBF: emb 0 / 0 / 0
(CI upper 0.0019; paper: lower than the MLPs), emb_read 0.011 / 0.0235 / 0.0265,
bottom_mlp 0.0075 / 0.014 / 0.014, top_mlp 0.0055 / 0.014 / 0.016 (paper: the most
vulnerable component; above emb here, above bottom_mlp only at --trials=64000 with
--formats=fp32 --faults=single: 0.0076 vs 0.0057; below emb_read). stories260K,
top-1 change, 500 SBF per group, fp32 / bf16 / int8: norms 0.132 / 0.210 / 0.126, layer 0
attention 0.054 / 0.122 / 0.026.
"""

from __future__ import annotations

import os

from absl import flags

from core import cli
from core import config
from core import settings
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

DLRM_RUN = config.setting("dlrm_run", "string", "Restore this train_rec run's latest checkpoint "
                          "instead of training (the run must match --preset / --num_rows).")
FAULTS = config.setting("faults", "list", "DLRM fault models (the paper's SBF, MBF, MBBF by "
                        "default): single, single:<bit>, multi:<k>, burst:<k>[:<start>].")
CRITERION = config.setting("criterion", "string", "DLRM output change: threshold[:t] | tol:x.")
EXAMPLES = config.setting("examples", "integer", "DLRM eval examples the trials draw from.",
                          lower=1)
LLAMA = config.setting("llama", "string", "llama2.c checkpoint; when absent, a tiny random-init "
                       "Llama; '' skips.")
LLAMA_TRIALS = config.setting("llama_trials", "integer", "Faults per Llama group and (format, "
                              "fault).", lower=1)
LLAMA_FAULTS = config.setting("llama_faults", "list", "Llama fault models (as --faults).")
LLAMA_SEQS = config.setting("llama_seqs", "integer", "Sequences sampled from the Llama as "
                            "inputs.", lower=1)
LLAMA_LEN = config.setting("llama_len", "integer", "Tokens per sequence.", lower=1)
CHUNK = config.setting("chunk", "integer", "Trials per jitted, vmapped call.", lower=1)


def define_flags(flag_values=None) -> None:
  """The entry point's flags (`flag_values`: where, default absl's FLAGS); every setting
  but --workdir may come from a --config file (configs/ beside this file)."""
  from rec import configs
  config.define_flags(
      None, settings.PRESET, settings.BATCH_SIZE, configs.NUM_ROWS, settings.STEPS, DLRM_RUN,
      settings.FORMATS, FAULTS, CRITERION, rec_settings.TRIALS, EXAMPLES, LLAMA, LLAMA_TRIALS,
      LLAMA_FAULTS, LLAMA_SEQS, LLAMA_LEN, CHUNK, settings.SEED, in_config=True,
      flag_values=flag_values, preset="small", batch_size=512, num_rows=20_000, steps=300,
      dlrm_run="", formats=["fp32", "bf16", "int8"], faults=["single", "multi:2", "burst:2"],
      criterion="threshold:0.5", trials=2000, examples=1024,
      llama="../shared/data/llama2c/stories260K.bin", llama_trials=500, llama_faults=["single"],
      llama_seqs=64, llama_len=32, chunk=256, seed=0)
  config.define_flags(None, settings.WORKDIR, flag_values=flag_values, workdir="runs/pvf")


def _fault_settings():
  """(criterion, DLRM fault models, Llama fault models) from their flags, and --formats
  checked: refused before any training, each error naming its flag."""
  from core import faults

  def parse(flag, parse_one, values):
    try:
      return [parse_one(v) for v in values]
    except ValueError as e:
      raise ValueError(f"--{flag}: {e}") from None

  parse("formats", faults.bit_width, FLAGS.formats)
  crit, = parse("criterion", faults.make_criterion, [FLAGS.criterion])
  return (crit, parse("faults", faults.FaultModel.parse, FLAGS.faults),
          parse("llama_faults", faults.FaultModel.parse, FLAGS.llama_faults))


def _dlrm(t_key, crit, fault_list):
  import jax

  from core import checkpoint as ckpt_lib
  from experiments.pvf import dlrm as pvf
  from experiments.pvf import study
  from rec import configs, runs

  cfg = configs.make_run(model="dlrm", preset=FLAGS.preset, data="synthetic",
                         num_rows=FLAGS.num_rows, batch_size=FLAGS.batch_size,
                         eval_batch_size=FLAGS.examples, eval_batches=1, seed=FLAGS.seed)
  if FLAGS.dlrm_run:
    task, train_src, eval_src, _, _ = configs.build_run(cfg)
    ckpt = ckpt_lib.Checkpointer(FLAGS.dlrm_run)
    try:
      step = ckpt.latest_step()
      if step is None:
        raise ValueError(f"--dlrm_run={FLAGS.dlrm_run}: no checkpoint there; expected the "
                         "workdir of a train_rec run of the same --preset / --num_rows")
      state, _ = ckpt.restore(step, ckpt_lib.abstract_like(task.init_state(0)))
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
  rows = []
  for i, fmt in enumerate(FLAGS.formats):
    print(f"== DLRM {FLAGS.preset}: {fmt} {','.join(FLAGS.faults)}, {FLAGS.trials} trials "
          "per group and fault model", flush=True)
    rows += _with_fields(pvf.dlrm_pvf(target, fmt, fault_list, crit, FLAGS.trials,
                                      jax.random.fold_in(t_key, i), chunk=FLAGS.chunk,
                                      record=True))
  rows = _by_fault(rows)
  return {"label": f"DLRM {FLAGS.preset}", "criterion": FLAGS.criterion, "test_auc": auc,
          "examples": target.num_examples, "rows": rows, "paper": study.PAPER_DLRM,
          "checks": study.ordering_checks(rows)}


def _with_fields(rows):
  """Rows of single-bit faults get their PVF by bit field from their records; the records
  themselves are dropped."""
  from experiments.pvf import study
  for r in rows:
    if r["fault"].startswith("single"):
      r["by_field"] = study.by_field(r)
    r.pop("records", None)
  return rows


def _by_fault(rows):
  """Rows ordered by (format, fault model), groups in forward order within each."""
  key = {k: i for i, k in enumerate(dict.fromkeys((r["fmt"], r["fault"]) for r in rows))}
  return sorted(rows, key=lambda r: key[r["fmt"], r["fault"]])


def _llama(t_key, fault_list):
  import jax
  from flax import nnx

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
  for i, fmt in enumerate(FLAGS.formats):
    print(f"== {label}: {fmt} {','.join(FLAGS.llama_faults)}, {FLAGS.llama_trials} trials "
          "per group and fault model", flush=True)
    rows += _with_fields(llm_pvf.llama_pvf(
        model, tokens, fmt, fault_list, FLAGS.llama_trials,
        jax.random.fold_in(t_key, 100 + i), chunk=min(FLAGS.chunk, 128), record=True))
  rows = _by_fault(rows)
  # The paper has no language model (its text model is a BERT classifier): n/a per group.
  return {"label": label, "criterion": "top1 next token (last position)",
          "sequences": FLAGS.llama_seqs, "length": FLAGS.llama_len, "rows": rows, "paper": {}}


def main(argv):
  del argv
  cli.quiet_library_logs()
  import jax

  from experiments.pvf import study

  crit, dlrm_faults, llama_faults = _fault_settings()
  report = Report(FLAGS.workdir)
  key = jax.random.key(FLAGS.seed)
  out = {"platform": jax.default_backend(), "formats": FLAGS.formats, "faults": FLAGS.faults,
         "llama_faults": FLAGS.llama_faults, "trials": FLAGS.trials,
         "llama_trials": FLAGS.llama_trials, "paper": study.PAPER_NOTE,
         "models": [_dlrm(key, crit, dlrm_faults)]}
  if FLAGS.llama:
    out["models"].append(_llama(key, llama_faults))
  for m in out["models"]:
    worst = max(r["ci_high"] - r["ci_low"] for r in m["rows"]) / 2
    print(f"== {m['label']}: PVF per group ({m['criterion']}); widest 95% Wilson half-width "
          f"{worst:.4f}", flush=True)
    print(study.format_rows(m["rows"], m["paper"]))
    print(study.format_fields(m["rows"]))
  print(study.format_checks(out["models"][0]["checks"]))
  print(study.PAPER_NOTE, flush=True)
  out["plot"] = report.plot(study.plot, out, name="pvf.png")
  report.finish(out, {m["label"]: {f"{r['group']}/{r['fmt']}/{r['fault']}": round(r["pvf"], 5)
                                   for r in m["rows"]} for m in out["models"]},
                wall="wall_seconds")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
