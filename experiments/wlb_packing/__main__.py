r"""WLB-LLM's packing study (arXiv 2503.17924, Table 2) on synthetic long-tailed documents.

  python -m experiments.wlb_packing                       # fit the cost model here, then study
  python -m experiments.wlb_packing --cost_model=flops    # FLOP counts instead of a fit
  python -m experiments.wlb_packing --cost_model=fit --save_cost_model=/tmp/cost.json
  python -m experiments.wlb_packing --cost_model=/tmp/cost.json   # reuse a fit (e.g. a GPU's)

1. Cost model (`llm.packing.cost`): times one causal attention call per document length
   (`--fit_impl`, "xla" here) and one layer's matmuls per token count on this machine at a
   small shape (--measure_*), fits W = sum_docs (a l^2 + b l + c) + d T + e (relative
   least squares, coefficients >= 0) and scales it by FLOPs to --target (Llama 3 8B, the
   nearest preset to the paper's 7B). On a GPU, measure at the target shape itself
   (--measure_*= the target's sizes, --fit_lengths up to the context) and save it.
2. Study (study.py beside this file): the same stream of global batches (--micro_batches
   sequences of --context tokens, filled in loader order) packed by every Table 2 row: original,
   fixed-length greedy over --windows global batches, WLB-LLM (variable length up to
   --max_len_factor x context) with 1 / 2 / 3 outlier queues; imbalance degree (max over a
   step's micro-batches of W / mean, averaged over --steps), of W and of attention alone;
   packing time per global batch; token delay. Then per-sequence vs per-document CP sharding
   over --cp ranks (exact pairs per rank, and the tile model's adaptive pick).
3. Training grid (training.py): train_lm's packed source (Pile-shaped documents,
   llm.packing.lengths.CorpusLengths) for every packing x CP layout over --train_steps
   global batches at --context, read by the work meter train_lm logs (imbalance across
   micro-batches and CP ranks, the cost model's step time); modelled speedup over the
   original packing with per-sequence CP beside the paper's end-to-end 1.23x.

Prints the tables, writes results.json, wlb_packing.png and wlb_training.png to --workdir;
last line is JSON.

Defaults: 4 micro-batches of 128K per global batch, 512 global batches (~144K documents:
log-normal, median 1024, sigma 1.0, plus a 0.2% Pareto tail from 16K, clipped to 128K; these
were chosen so that the original packing lands near the paper's 1.44, the one number fitted),
WLB cap 1.0 x context (the activation memory the fixed-length run already needs), queue
thresholds 64K | 32K, 64K | 16K, 32K, 64K; CP over 8 ranks on the first 4 global batches.
`python -m experiments.wlb_packing` on the 2-core CPU (jax 0.11.2, other jobs sharing it),
47 s wall (most of it timing kernels), printed (paper in brackets):
  cost fit: a = 1.53e-6 s/l^2, d = 1.28e-2 s/token, e = 1.5e-2 s (Llama 3 8B layer, x8
  attention, x64 linear from the timed shape), fit errors up to 36% (attention), 11% (linear)
  original 1.545 [1.44]; fixed greedy over 1 / 2 / 4 / 8 global batches 1.416 / 1.337 /
  1.244 / 1.148 [1.41 / 1.22 / 1.11 / 1.08] at 2.2-2.5 ms per global batch; WLB-LLM with
  1 / 2 / 3 queues 1.120 / 1.051 / 1.034 [1.24 / 1.05 / 1.05] at 2.9-3.8 ms [8-23 ms];
  token delay 0.45 / 0.61 / 0.69 global batches (8 / 11 / 14% of tokens delayed);
  CP8 rank imbalance of attention pairs, per-sequence vs per-document: 1.864 vs 1.001
  (original), 1.791 vs 1.001 (WLB, 3 queues); tile model: adaptive 157781 vs sequence
  176805 / document 166548 tile units on the original packing.
The fit moves between runs on a shared CPU (the original row was 1.45-1.68 over four fits);
BENCHMARKS.md ("WLB-LLM packing") has the table, sensitivity runs and the comparison.
On a GPU, measure at the target shape and reuse the fit (unmeasured here):
  python -m experiments.wlb_packing --fit_impl=auto --fit_dtype=bfloat16 --measure_dim=4096 \
    --measure_heads=32 --measure_kv_heads=8 --measure_head_dim=128 --measure_ffn=14336 \
    --fit_lengths=1024,4096,16384,32768,65536,131072 --fit_tokens=8192,32768,131072 \
    --save_cost_model=h100_cost.json
"""

from __future__ import annotations

import os
import time

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings  # noqa: F401  (the shared settings by name)
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

from experiments.common.report import Report
from experiments.wlb_packing import study, training
from llm.packing.cp_shard import TileModel
from llm.packing.lengths import LengthDist

FLAGS = flags.FLAGS
_CFG, _DIST = study.StudyConfig(), LengthDist()  # defaults, documented in study.py / llm/packing


def _ints(min_value: int):
  """A validator of a list flag: every item an integer >= min_value."""
  def ok(values):
    try:
      return all(int(v) >= min_value for v in values)
    except ValueError:
      return False
  return ok


SAVE_COST_MODEL = config.setting(
    "save_cost_model", "string", "Also write the cost model used to this path.", none_ok=True)
FIT_IMPL = config.setting(
    "fit_impl", "string", "llm.attention implementation to time.")
FIT_DTYPE = config.setting(
    "fit_dtype", "enum", "dtype of the timed calls.", choices=("float32", "bfloat16", "float16"))
FIT_REPEATS = config.setting(
    "fit_repeats", "integer", "Timed repeats per point (median).", lower=1)
FIT_LENGTHS = config.setting(
    "fit_lengths", "list", "Document lengths timed for the attention fit.")
FIT_TOKENS = config.setting(
    "fit_tokens", "list", "Token counts timed for the linear-op fit.")
MEASURE_DIM = config.setting(
    "measure_dim", "integer", "Model dim of the timed shape.", lower=1)
MEASURE_HEADS = config.setting(
    "measure_heads", "integer", "Query heads of the timed shape.", lower=1)
MEASURE_KV_HEADS = config.setting(
    "measure_kv_heads", "integer", "KV heads of the timed shape.", lower=1)
MEASURE_HEAD_DIM = config.setting(
    "measure_head_dim", "integer", "Head dim of the timed shape.", lower=1)
MEASURE_FFN = config.setting(
    "measure_ffn", "integer", "MLP hidden size of the timed shape.", lower=1)
CONTEXT = config.setting(
    "context", "integer", "Sequence length of fixed-length packing.", lower=1)
MICRO_BATCHES = config.setting(
    "micro_batches", "integer", "Micro-batches (sequences) per global batch.", lower=1)
MAX_LEN_FACTOR = config.setting(
    "max_len_factor", "float", "WLB-LLM's micro-batch token cap / context.")
WINDOWS = config.setting(
    "windows", "list", "Global batches per greedy window.")
QUEUES = config.setting(
    "queues", "list", "Outlier queue counts for WLB-LLM.")
OUTLIER_FRACTIONS = config.setting(
    "outlier_fractions", "list", "Queue thresholds / context; q queues use the q largest.")
CP = config.setting(
    "cp", "integer", "Context-parallel ranks for the sharding comparison (1: none).", lower=1)
CP_STEPS = config.setting(
    "cp_steps", "integer", "Global batches in the CP comparison.", lower=1)
TILE_Q = config.setting(
    "tile_q", "integer", "Query rows per kernel tile (tile model).", lower=1)
TILE_KV = config.setting(
    "tile_kv", "integer", "Keys per kernel tile (tile model).", lower=1)
DOC_MEDIAN = config.setting(
    "doc_median", "float", "Median length of the log-normal body.")
DOC_SIGMA = config.setting(
    "doc_sigma", "float", "Sigma of the log-normal body.", lower=0.0)
TAIL_PROB = config.setting(
    "tail_prob", "float", "Probability that a document is from the tail.", lower=0.0, upper=1.0)
TAIL_MIN = config.setting(
    "tail_min", "float", "Pareto tail scale (smallest tail length).")
TAIL_ALPHA = config.setting(
    "tail_alpha", "float", "Pareto tail exponent (smaller: heavier).")
MIN_LEN = config.setting(
    "min_len", "integer", "Shortest document.", lower=1)
TRAIN_STEPS = config.setting(
    "train_steps", "integer", "Global batches per cell of the training grid (packing x CP layout "
    "on train_lm's Pile-shaped source; 0: skip it).", lower=0)


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (`flag_values`: where,
  default absl's FLAGS); every setting but --workdir / --save_cost_model may come from a
  --config file (configs/ beside this file)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  config.define_flags(None, "workdir", SAVE_COST_MODEL, flag_values=fv,
                      workdir="runs/wlb_packing", save_cost_model=None)
  config.define_flags(
      None, "cost_model", "target", FIT_IMPL, FIT_DTYPE, FIT_REPEATS,
      FIT_LENGTHS, FIT_TOKENS, MEASURE_DIM, MEASURE_HEADS, MEASURE_KV_HEADS, MEASURE_HEAD_DIM,
      MEASURE_FFN, CONTEXT, MICRO_BATCHES, "steps", MAX_LEN_FACTOR, WINDOWS, QUEUES,
      OUTLIER_FRACTIONS, CP, CP_STEPS, TILE_Q, TILE_KV, DOC_MEDIAN, DOC_SIGMA, TAIL_PROB,
      TAIL_MIN, TAIL_ALPHA, MIN_LEN, "seed", TRAIN_STEPS, in_config=True, flag_values=fv,
      cost_model="fit", target="llama3_8b", fit_impl="xla",
      fit_dtype="float32", fit_repeats=5,
      fit_lengths=["128", "256", "512", "768", "1024", "1536", "2048"],
      fit_tokens=["256", "512", "1024", "2048", "4096"], measure_dim=512, measure_heads=4,
      measure_kv_heads=1, measure_head_dim=128, measure_ffn=1792, context=_DIST.context,
      micro_batches=_CFG.micro_batches, steps=_CFG.steps, max_len_factor=_CFG.max_len_factor,
      windows=[str(k) for k in _CFG.windows], queues=[str(q) for q in _CFG.queues],
      outlier_fractions=[str(f) for f in _CFG.outlier_fractions], cp=_CFG.cp,
      cp_steps=_CFG.cp_steps, tile_q=_CFG.tile_q, tile_kv=_CFG.tile_kv, doc_median=_DIST.median,
      doc_sigma=_DIST.sigma, tail_prob=_DIST.tail_prob, tail_min=_DIST.tail_min,
      tail_alpha=_DIST.tail_alpha, min_len=_DIST.min_len, seed=_CFG.seed, train_steps=16)
  for name in ("max_len_factor", "doc_median", "tail_min", "tail_alpha"):
    flags.register_validator(name, lambda v: v > 0, message="expected a value > 0",
                             flag_values=fv)
  for name, low in (("fit_lengths", 1), ("fit_tokens", 1), ("windows", 1), ("queues", 0)):
    flags.register_validator(name, _ints(low), message=f"expected integers >= {low}",
                             flag_values=fv)
  flags.register_validator(
      "outlier_fractions", _fractions, message="expected fractions of the context in (0, 1]",
      flag_values=fv)


def _fractions(values) -> bool:
  """A validator of --outlier_fractions: every item a number in (0, 1]."""
  try:
    return all(0 < float(x) <= 1 for x in values)
  except ValueError:
    return False


def check_cost_flags(f) -> None:
  """The cost model's settings, each error naming its flag, before the fit times anything
  (tens of seconds) or the study runs: --target a preset, --cost_model 'flops', 'fit' or a
  CostModel JSON; for 'fit' the attention implementation, the timed shape's heads and enough
  distinct points for the fit's coefficients (3 for attention, 2 for the linear ops)."""
  from llm import attention
  from llm.config import PRESETS
  if f.target not in PRESETS:
    raise errors.expected(f"--target={f.target}", "not an llm.config preset",
                          f"one of {', '.join(sorted(PRESETS))}")
  if f.cost_model == "fit":
    attention.check_impl(f.fit_impl, "--fit_impl")
    if f.measure_heads % f.measure_kv_heads:
      raise errors.expected(f"--measure_heads={f.measure_heads} --measure_kv_heads="
                            f"{f.measure_kv_heads}", "query heads not a multiple of the KV "
                            "heads", "--measure_heads a multiple of --measure_kv_heads")
    for flag, need in (("fit_lengths", 3), ("fit_tokens", 2)):
      values = getattr(f, flag)
      distinct = len({int(x) for x in values})
      if distinct < need:
        raise errors.expected(f"--{flag}={','.join(values)}", f"{distinct} distinct value(s)",
                              f"at least {need}, one per coefficient of the fit")
  elif f.cost_model != "flops":
    want = "'flops', 'fit' or a CostModel JSON file (written by --save_cost_model)"
    if not os.path.isfile(f.cost_model):
      raise errors.expected(f"--cost_model={f.cost_model}", "no such file", want)
    from llm.packing import cost as C
    try:
      C.CostModel.load(f.cost_model)
    except (ValueError, TypeError) as e:
      raise errors.expected(f"--cost_model={f.cost_model}", f"not a CostModel JSON ({e})",
                            want) from None


def build_cost(f, llama, progress):
  """The cost model of --cost_model for the target model `llama` (its LlamaConfig)."""
  from llm.packing import cost as C
  target = C.Shape.from_config(llama)
  if f.cost_model == "flops":
    return C.flop_cost_model(target)
  if f.cost_model == "fit":
    measure = C.Shape(f.measure_dim, f.measure_heads, f.measure_kv_heads, f.measure_head_dim,
                      f.measure_ffn)
    return C.fit_cost_model(measure, target, lengths=[int(x) for x in f.fit_lengths],
                            tokens=[int(x) for x in f.fit_tokens], impl=f.fit_impl,
                            dtype=f.fit_dtype, repeats=f.fit_repeats, progress=progress)
  return C.CostModel.load(f.cost_model)


def build_config(f) -> study.StudyConfig:
  """The study's config from the flags; a value the study cannot use names its flag."""
  if f.min_len > f.context:
    raise ValueError(f"--min_len={f.min_len}: expected at most --context={f.context}")
  for flag in ("windows", "queues"):
    values = [int(x) for x in getattr(f, flag)]
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
      raise ValueError(f"--{flag}={','.join(getattr(f, flag))}: {twice[0]} twice (two rows of "
                       "one name); expected each value once")
  if f.train_steps and f.cp > 1 and f.context % (2 * f.cp):
    raise ValueError(f"--context={f.context} with --cp={f.cp} and --train_steps="
                     f"{f.train_steps}: the training grid's per-document CP layout cuts every "
                     f"row into 2 x {f.cp} chunks; expected a multiple of {2 * f.cp} (or "
                     "--train_steps=0)")
  if f.cp > 1 and f.cp_steps > f.steps:
    raise ValueError(f"--cp_steps={f.cp_steps}: more global batches than the stream has; "
                     f"expected at most --steps={f.steps}")
  bad = [k for k in f.windows if f.steps % int(k)]
  if bad:
    raise ValueError(f"--steps={f.steps} is not a multiple of --windows {bad}")
  fractions = [float(x) for x in f.outlier_fractions]
  too_many = [q for q in f.queues if int(q) > len(fractions)]
  if too_many:
    raise ValueError(f"--queues={','.join(f.queues)}: {too_many[0]} queues need as many "
                     f"--outlier_fractions, got {len(fractions)}")
  thr = sorted(int(x * f.context) for x in fractions)
  if len(set(thr)) != len(thr) or (thr and thr[0] < 1):
    raise ValueError(f"--outlier_fractions={','.join(f.outlier_fractions)}: thresholds {thr} "
                     f"tokens of --context={f.context}; expected distinct and >= 1")
  if int(f.max_len_factor * f.context) < 1:
    raise ValueError(f"--max_len_factor={f.max_len_factor}: a cap of "
                     f"{int(f.max_len_factor * f.context)} tokens; expected >= 1")
  dist = LengthDist(context=f.context, median=f.doc_median, sigma=f.doc_sigma,
                    tail_prob=f.tail_prob, tail_min=f.tail_min, tail_alpha=f.tail_alpha,
                    min_len=f.min_len)
  return study.StudyConfig(
      dist=dist, micro_batches=f.micro_batches, steps=f.steps, max_len_factor=f.max_len_factor,
      windows=tuple(int(x) for x in f.windows), queues=tuple(int(x) for x in f.queues),
      outlier_fractions=tuple(fractions), cp=f.cp, cp_steps=f.cp_steps, tile_q=f.tile_q,
      tile_kv=f.tile_kv, seed=f.seed)


def lm_run(f, cfg: study.StudyConfig):
  """The LM run of the training grid (train_lm's settings the study changes; its packing
  and CP layout set per cell): --target's model at the study's context, micro-batches, CP
  ranks and seed."""
  return training.lm_run(context=cfg.dist.context, micro_batches=cfg.micro_batches,
                         cp=cfg.cp, seed=cfg.seed, preset=f.target)


def main(argv):
  del argv
  report = Report(FLAGS.workdir, clock=time.time)
  say = lambda msg: report.log(msg, digits=1)
  cfg = build_config(FLAGS)
  check_cost_flags(FLAGS)
  lm = lm_run(FLAGS, cfg)
  target = lm.preset_config()
  cost = build_cost(FLAGS, target, say)
  if FLAGS.save_cost_model:
    cost.save(FLAGS.save_cost_model)
  m = cost.meta
  if m.get("source") == "measured":
    say(f"cost model ({m['backend']}, {m['impl']}): attention a={cost.attn_quad:.3e} s/l^2 "
        f"b={cost.attn_lin:.3e} s/l c={cost.attn_const:.3e} s, linear d={cost.lin_per_token:.3e}"
        f" s/token e={cost.lin_const:.3e} s (scaled x{m['attn_factor']:.0f} attention, "
        f"x{m['linear_factor']:.0f} linear); fit errors attention "
        f"{max(map(abs, m['attention']['rel_err'])):.1%}, linear "
        f"{max(map(abs, m['linear']['rel_err'])):.1%} max")
  res = study.run_study(cfg, cost, progress=say)
  res["cost_model"] = cost.to_dict()
  if FLAGS.train_steps and cfg.cp == 1:
    say("training grid skipped: --cp=1 (its per-document and adaptive CP layouts need 2 or "
        "more ranks)")
  if FLAGS.train_steps and cfg.cp > 1:
    p = lm.data.packing
    res["training"] = training.train_grid(
        context=lm.data.seq_len, micro_batches=lm.train.batch_size, cp=cfg.cp,
        steps=FLAGS.train_steps, cost=cost, n_layers=target.n_layers,
        tile=TileModel(cfg.tile_q, cfg.tile_kv), fixed_window=p.fixed_window,
        wlb_queues=p.wlb_queues, seed=lm.train.seed, preset=lm.model.preset, progress=say)
  res["seconds"] = report.seconds
  print(study.format_table(res))
  if "training" in res:
    unit = "s" if m.get("source") == "measured" else m.get("source", "")
    print(training.format_grid(res["training"], cfg.cp, unit))
  report.plot(study.plot, res, name="wlb_packing.png")
  if "training" in res:
    report.plot(training.plot_grid, res["training"], name="wlb_training.png")
  summary = {r["name"]: round(r["imbalance"], 3) for r in res["rows"]}
  summary.update({f"{r['name']}_delay": round(r["mean_delay_steps"], 3) for r in res["rows"]
                  if r["name"].startswith("wlb")})
  summary.update({f"cp_{name}_{mode}": round(c["pairs_imbalance"][mode], 3)
                  for name, c in res["cp"].items() for mode in ("sequence", "document")})
  summary["attention_share"] = round(res["attention_share"], 3)
  for r in res.get("training", []):
    summary[f"train_{r['packing']}_{r['layout']}_speedup"] = round(r["speedup"], 3)
  report.finish(res, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
