r"""EAGLE speculative decoding with tree attention (arXiv 2508.08192): train a draft head for a
target, then measure it against plain decoding per tree shape and batch size.

  python -m experiments.spec_decode          # stories260K, default trees, batch 1 and 8
  python -m experiments.spec_decode --target=workdir:runs/lm --prompt_text=book.txt   # a train_lm --workdir
  python -m experiments.spec_decode --trees=chain:4,4:5:24 --batch_sizes=1,8,32 \
      --max_new_tokens=256 --temperatures=0,0.8              # greedy and sampling
  G=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  python -m experiments.spec_decode --target=gguf:$G --chat_prompts --workdir=runs/spec_exact \
      --num_sequences=4928 --eval_sequences=32 --seq_len=160 --gen_batch=32 --gen_temperature=0 \
      --draft_vocab=4096 --draft_steps=2000 --draft_batch=8 --warmup_steps=50 --unroll=2 \
      --unroll_decay=0.5 --dtype=bfloat16 --draft_dtype=bfloat16 --decode_vocab=1024 \
      --trees=3:4:5,2:4:5 --batch_sizes=1,4 --bench_prompts=16 --max_new_tokens=64 \
      --repeats=3 --temperatures=0,1 --profile    # BENCHMARKS.md's run (1.61x, batch 1, lossless)

Steps: (1) the target (llama2c:PATH, hf:DIR, gguf:FILE or a train_lm workdir:DIR) samples
--num_sequences sequences of --seq_len tokens at --gen_temperature (0: greedy, which needs a
distinct chat request per sequence) (from BOS for llama2c / hf / gguf targets, from
random --gen_prompt_len-token windows of --prompt_text, by default the text the train_lm run
trained on, or, with --chat_prompts, replies to chat requests built from the checkpoint's own
vocabulary and chat template, prompts.py, ending at its end-of-turn token); the target's
features are captured as it generates them (no second forward pass; all of it kept in
<workdir>/draft and saved as it goes: a killed run continues); --draft_vocab=N keeps the N
most frequent tokens as the draft's vocabulary (EAGLE-3); (2) a DraftHead is distilled on
them through core.train in <workdir>/draft, the loss over the replies' pairs (EAGLE's;
--prompt_loss counts the prompts' too)
(checkpoints; a rerun with the same settings resumes or reuses it; --overwrite retrains;
--resume_allow=distill.learning_rate,... keeps it although those settings changed);
(3) for every temperature and batch size, --bench_prompts prompts, the first --prompt_len
tokens of held-out sequences (with --chat_prompts: the held-out chat requests, decoded up to
the chat's end of turn), in batches of that size, and plain `llm.generate.generate` and
`speculative_generate` run side by side per tree shape (--repeats alternating runs, medians
summed over the batches). Reported per (tree, batch): mean accepted length
(tokens per draft-verify round, EAGLE's tau), tokens per target call, ms per token and the
wall-clock speedup (benchmark.py beside this file); greedy output is checked token for token
against plain decoding, per prompt ("greedy ==": the rows equal out of the prompts;
greedy_rows_equal / greedy_rows in the summary line).
Writes <workdir>/results.json and <workdir>/spec_decode.png; the last stdout line is JSON.

Measured (2-core CPU shared with other jobs, load average ~14, jax 0.11.2, 2026-11-24):
`python -m experiments.spec_decode --draft_steps=600 --overwrite` (the defaults but 600
draft steps; 20.5 min wall, of which ~16.5 min distillation, 1 GiB peak RSS; the target's
sequences were reused from an interrupted run, generating them takes ~4 min). Draft eval:
top1 0.217 (draft argmax == target argmax), reg 0.799, cls 4.881. 128 greedy tokens from
16-token held-out prompts; greedy output equal to plain decoding in every row:

  batch  tree    accept len  tok/call  plain ms/tok  spec ms/tok  speedup
      1  1:4:4         1.49      1.49         0.135        0.466     0.29
      1  2:4:8         1.59      1.58         0.253        0.795     0.32
      1  4:5:24        1.81      1.80         0.282        2.154     0.13
      1  8:6:48        2.19      2.17         0.271        3.736     0.07
      8  1:4:4         1.48      1.53         1.526        6.910     0.22
      8  2:4:8         1.63      1.69         0.836        6.246     0.13
      8  4:5:24        1.87      1.92         1.757        9.195     0.19
      8  8:6:48        2.05      2.11         0.603       16.037     0.04

(ms/tok: wall time of the whole call / 128; tok/call here is the mean of per-prompt ratios,
now pooled over the prompts, benchmark.round_counts.) Speculative decoding is slower on
CPU here: a plain step of the 0.26M-parameter target takes ~0.13 ms, so the draft calls
and the tree bookkeeping (top-k, re-ranking, acceptance loops, per-query masked
attention) cost more than the target calls they save. GPU speedups (batch 1 and 8) are
unmeasured: the same command runs unchanged on one (attention_impl "auto" takes
"xla_decode" for the masked tree calls there too).
"""

from __future__ import annotations

import json
import math
import os
import re
import time

from absl import flags

from core import cli
from core import config
from core import errors
from core import settings  # noqa: F401  (the shared settings by name)
from experiments.common.report import Report
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS
STORIES = os.path.join("..", "shared", "data", "llama2c", "stories260K.bin")
# The draft head's run settings (saved with its checkpoints, compared on resume) whose flag
# is not the setting's own name; distill.NAME is otherwise set by --NAME.
SETTING_FLAGS = {"distill.learning_rate": "draft_lr", "distill.batch_size": "draft_batch"}


def _valid_trees(specs) -> bool:
  from llm.speculative.tree import TreeShape
  try:
    for s in specs:
      TreeShape.parse(s)
  except ValueError:
    return False
  return True


def _positive_ints(values) -> bool:
  try:
    return all(int(v) >= 1 for v in values)
  except ValueError:
    return False


def _temperatures(values) -> bool:
  try:
    return all(math.isfinite(float(v)) and float(v) >= 0 for v in values)
  except ValueError:
    return False


PROMPT_TEXT = config.setting(
    "prompt_text", "string", "Text whose windows prompt the target's sequences (default: none for "
    "llama2c / hf targets, which start from BOS; a train_lm workdir's own --text).", none_ok=True)
GEN_PROMPT_LEN = config.setting(
    "gen_prompt_len", "integer", "Tokens per --prompt_text window.", lower=1)
CHAT_PROMPTS = config.setting(
    "chat_prompts", "bool", "Prompt the target with chat requests: instructions built from words "
    "of its own vocabulary, rendered with its chat template (prompts.py); sequences end at its "
    "end-of-turn token; the held-out requests are the benchmark's prompts (--prompt_len unused).")
NUM_SEQUENCES = config.setting(
    "num_sequences", "integer", "Sequences the target generates for distillation.", lower=2)
GEN_TEMPERATURE = config.setting(
    "gen_temperature", "float", "Temperature the target samples them at (0: greedy).")
GEN_BATCH = config.setting(
    "gen_batch", "integer", "Sequences per generate call while making them.", lower=1)
DRAFT_DTYPE = config.setting(
    "draft_dtype", "enum", "dtype the trained head decodes in (its weights cast once; it trains "
    "in float32; default: --dtype's).", choices=("float32", "bfloat16"), none_ok=True)
DRAFT_STEPS = config.setting(
    "draft_steps", "integer", "Draft-head train steps.", lower=1)
DRAFT_BATCH = config.setting(
    "draft_batch", "integer", "Sequences per draft train step.", lower=1)
DRAFT_LR = config.setting(
    "draft_lr", "float", "Peak AdamW learning rate of the draft head.")
W_CLS = config.setting(
    "w_cls", "float", "Weight of the token cross-entropy beside the feature loss.", lower=0.0)
NOISE = config.setting(
    "noise", "float", "Uniform noise on the input features (EAGLE's).", lower=0.0)
UNROLL = config.setting(
    "unroll", "integer", "Draft steps the distillation loss unrolls: step s > 1 feeds the head "
    "its own step s-1 predictions, attending as at draft depth s (EAGLE-3's training-time test).",
    lower=1)
UNROLL_DECAY = config.setting(
    "unroll_decay", "float", "Weight of unrolled step s in the loss: decay**(s-1) (1: every step "
    "alike).")
TAPS = config.setting(
    "taps", "list", "Target blocks (0-based) whose states the head also reads beside the final "
    "features, e.g. 2,15,27 for a low, a middle and a high one (EAGLE-3's fused features; empty: "
    "EAGLE's head).")
TAP_DROPOUT = config.setting(
    "tap_dropout", "float", "Share of training pairs with the taps zeroed, as the head sees them "
    "inside a draft tree.")
PROMPT_LOSS = config.setting(
    "prompt_loss", "bool", "Count the prompts' pairs in the distillation loss too (default: the "
    "replies only, as EAGLE; the prompts still fill the head's attention context).")
BATCH_SIZES = config.setting(
    "batch_sizes", "list", "Batch sizes to measure.")
BENCH_PROMPTS = config.setting(
    "bench_prompts", "integer", "Held-out prompts each batch size is measured over (consecutive "
    "batches of that size; a multiple of each batch size).", lower=1)
TEMPERATURES = config.setting(
    "temperatures", "list", "Decoding temperatures to measure; 0: greedy (checked against plain "
    "decoding); > 0: sampling (rejection sampling; same distribution).")


# The LM settings this entry point takes from llm.run_config.LMRunConfig, at its own
# defaults (--seq_len narrowed: a sequence is a prompt and at least one more token).
LM_FLAGS = dict(dtype="float32", warmup_steps=100, seed=0)


def define_flags(flag_values=None) -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names; `flag_values`: where, default
  absl's FLAGS); every setting but --workdir / --overwrite / --resume_allow may come from
  a --config file (configs/ beside this file)."""
  from llm.run_config import LMRunConfig
  fv = flags.FLAGS if flag_values is None else flag_values
  config.define_flags(None, lm_settings.SEQ_LEN.narrowed(lower=2), in_config=True,
                      flag_values=fv, seq_len=128)
  config.define_flags(LMRunConfig, only=(), flag_values=fv, **LM_FLAGS)
  config.define_flags(
      None, "target", PROMPT_TEXT, GEN_PROMPT_LEN, CHAT_PROMPTS, "bos_id",
      NUM_SEQUENCES, "eval_sequences", GEN_TEMPERATURE,
      GEN_BATCH, "draft_vocab", "decode_vocab", DRAFT_DTYPE, DRAFT_STEPS, DRAFT_BATCH, DRAFT_LR,
      W_CLS, NOISE, UNROLL, UNROLL_DECAY, TAPS, TAP_DROPOUT, PROMPT_LOSS,
      "trees", BATCH_SIZES, BENCH_PROMPTS, "prompt_len", "max_new_tokens", TEMPERATURES,
      "repeats", "profile", in_config=True, flag_values=fv,
      target=f"llama2c:{STORIES}", prompt_text=None, gen_prompt_len=8, chat_prompts=False,
      bos_id=1, num_sequences=1024, eval_sequences=64, gen_temperature=1.0, gen_batch=64,
      draft_vocab=0, decode_vocab=0, draft_dtype=None, draft_steps=1500, draft_batch=32,
      draft_lr=3e-3, w_cls=0.1, noise=0.1, unroll=1, unroll_decay=1.0, taps=[],
      tap_dropout=0.3, prompt_loss=False, trees=["chain:4", "2:4:8", "4:5:24", "8:6:48"],
      batch_sizes=["1", "8"], bench_prompts=8, prompt_len=16, max_new_tokens=128,
      temperatures=["0"], repeats=3, profile=False)
  config.define_flags(None, "workdir", "overwrite", "resume_allow", flag_values=fv,
                      workdir="runs/spec_decode", overwrite=False, resume_allow=[])
  flags.register_validator("gen_temperature", lambda v: math.isfinite(v) and v >= 0,
                           message="expected a finite temperature >= 0 (0: greedy, which "
                           "needs a distinct prompt per sequence: --chat_prompts)",
                           flag_values=fv)
  flags.register_validator("draft_lr", lambda v: math.isfinite(v) and v > 0,
                           message="expected a finite learning rate > 0", flag_values=fv)
  flags.register_validator("taps", lambda v: all(x.isdigit() for x in v),
                           message="expected block indices >= 0, e.g. 2,15,27",
                           flag_values=fv)
  flags.register_validator("unroll_decay", lambda v: math.isfinite(v) and 0 < v <= 1,
                           message="expected a weight 0 < decay <= 1", flag_values=fv)
  flags.register_validator("tap_dropout", lambda v: 0.0 <= v < 1.0,
                           message="expected a share 0 <= p < 1", flag_values=fv)
  flags.register_validator("trees", lambda v: bool(v) and _valid_trees(v),
                           message="expected shapes TOP_K:DEPTH:BUDGET (e.g. 4:5:24) or "
                           "chain:DEPTH, every number >= 1", flag_values=fv)
  flags.register_validator("batch_sizes", lambda v: bool(v) and _positive_ints(v),
                           message="expected integers >= 1", flag_values=fv)
  flags.register_validator("temperatures", lambda v: bool(v) and _temperatures(v),
                           message="expected finite numbers >= 0", flag_values=fv)


def check_flags(f) -> None:
  """What single flags cannot say: the sizes that must agree (each error names its flags)."""
  if f.gen_temperature == 0 and not f.chat_prompts:
    raise ValueError("--gen_temperature=0 (greedy) needs --chat_prompts: greedy sequences "
                     "from the same prompt are the same sequence")
  if f.eval_sequences >= f.num_sequences:
    raise ValueError(f"--eval_sequences={f.eval_sequences}: expected fewer than "
                     f"--num_sequences={f.num_sequences} (the rest train the draft head)")
  if not f.chat_prompts and f.prompt_len >= f.seq_len:
    raise ValueError(f"--prompt_len={f.prompt_len}: expected < --seq_len={f.seq_len}")
  if f.prompt_text is not None and f.gen_prompt_len >= f.seq_len:
    raise ValueError(f"--gen_prompt_len={f.gen_prompt_len}: expected < --seq_len={f.seq_len}")
  biggest = max(int(b) for b in f.batch_sizes)
  if biggest > f.bench_prompts:
    raise ValueError(f"--batch_sizes up to {biggest} need as many benchmark prompts; "
                     f"raise --bench_prompts={f.bench_prompts}")
  if f.bench_prompts > f.eval_sequences:
    raise ValueError(f"--bench_prompts={f.bench_prompts}: expected at most --eval_sequences="
                     f"{f.eval_sequences} (the held-out prompts)")
  partial = [int(b) for b in f.batch_sizes if f.bench_prompts % int(b)]
  if partial:
    raise ValueError(f"--bench_prompts={f.bench_prompts}: not a multiple of batch size "
                     f"{partial[0]} (--batch_sizes); expected a multiple of each (a partial "
                     "last batch would be left out)")
  if f.decode_vocab and f.draft_vocab and f.decode_vocab > f.draft_vocab:
    raise ValueError(f"--decode_vocab={f.decode_vocab}: expected at most --draft_vocab="
                     f"{f.draft_vocab} (the vocabulary the head trained on)")


def lm_run(f):
  """The LM run of this study (llm.run_config.LMRunConfig): the target checkpoint (the
  run's init) in --dtype, its --seq_len sequences, and the draft head's training (the run's
  steps, batch_size and learning_rate: --draft_steps, --draft_batch, --draft_lr; its
  --warmup_steps and --seed); the settings the study changes from the flags' run."""
  from llm.run_config import LMRunConfig
  return config.replace(config.from_flags(LMRunConfig, f), init=f.target,
                        steps=f.draft_steps, batch_size=f.draft_batch,
                        learning_rate=f.draft_lr)


def with_flag_names(err: Exception, flag_names) -> str:
  """A resume error of the draft head's run (`core.train.check_resume`: one line per setting
  that differs), with the flag among `flag_names` that sets each of those settings."""
  keys = re.findall(r"^  (\S+): .* \(checkpoint\) -> .* \(now\)$", str(err), re.M)
  named = []
  for k in keys:
    name = SETTING_FLAGS.get(k, k[len("distill."):] if k.startswith("distill.") else k)
    if name in flag_names:
      named.append(f"{k} is --{name}")
  # spec_decode resumes its draft head by itself: it has no --resume flag to name.
  text = str(err).replace("--resume: the settings differ", "The draft head's settings differ", 1)
  return text + ("\nFlags of these settings: " + "; ".join(named) if named else "")


def _prompts_for_target(spec: str, vocab_size: int):
  """(generation prompts, stop ids): chat requests (--chat_prompts), else BOS for llama2c /
  hf / gguf targets, windows of a text for workdirs; no stop ids but the chat's."""
  import numpy as np
  if FLAGS.chat_prompts:
    from llm import chat
    from llm.checkpoints import find_tokenizer

    from experiments.spec_decode import prompts as prompts_lib
    tok = find_tokenizer(spec, None, vocab_size)
    if tok is None:
      raise ValueError(f"--chat_prompts: --target={spec} has no tokenizer to render chats")
    return (prompts_lib.chat_prompts(tok, FLAGS.num_sequences, FLAGS.seed),
            chat.stop_ids(tok))
  text = FLAGS.prompt_text
  if text is None and spec.startswith("workdir:"):
    from core import checkpoint as ckpt_lib
    ckpt = ckpt_lib.Checkpointer(spec.partition(":")[2])
    try:
      text = ckpt.restore_meta(ckpt.latest_step()).get("settings", {}).get("data.text")
    finally:
      ckpt.close()
    if not text:
      raise ValueError(f"--target={spec}: its checkpoint names no training text; pass "
                       "--prompt_text=FILE")
  if text is None:
    if FLAGS.bos_id >= vocab_size:
      raise errors.expected(f"--bos_id={FLAGS.bos_id}", "outside the target's vocabulary",
                            f"an id below {vocab_size} ({spec})")
    return [[FLAGS.bos_id]], ()
  from llm.checkpoints import find_tokenizer
  from llm.data import read_text
  tok = find_tokenizer(spec, None, vocab_size)
  if tok is None:
    raise ValueError(f"--prompt_text={text}: --target={spec} has no tokenizer beside it to "
                     "encode it")
  ids = np.asarray(tok.encode(read_text(text)), np.int32)
  n = FLAGS.gen_prompt_len
  if len(ids) <= n:
    raise ValueError(f"--prompt_text={text}: {len(ids)} tokens, need more than "
                     f"--gen_prompt_len={n}")
  rng = np.random.default_rng(FLAGS.seed)
  return [ids[s:s + n].tolist() for s in rng.integers(0, len(ids) - n, 256)], ()


def equal_rows(row: dict) -> str:
  """'k/n' prompts whose greedy tokens equal plain decoding's; '-' when sampling."""
  eq = row["greedy_rows_equal"]
  return "-" if eq is None else f"{eq}/{row['prompts']}"


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark as bench_lib
  from core.train import RunSettingsError
  from llm.checkpoints import load_config, load_model
  from llm.speculative import TreeShape, cast_head, distill

  from experiments.spec_decode import benchmark

  report = Report(FLAGS.workdir, clock=time.time)
  check_flags(FLAGS)
  shapes = [TreeShape.parse(s) for s in FLAGS.trees]
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  lm = lm_run(FLAGS)
  # What the target's config decides, then its prompts, before the weights load.
  cfg = load_config(lm.model.init)
  bad = [int(x) for x in FLAGS.taps if int(x) >= cfg.n_layers]
  if bad:
    raise ValueError(f"--taps={','.join(FLAGS.taps)}: blocks {bad} are past the target's "
                     f"{cfg.n_layers} blocks (expected 0 .. {cfg.n_layers - 1})")
  for name in ("decode_vocab", "draft_vocab"):
    if FLAGS[name].value > cfg.vocab_size:
      raise ValueError(f"--{name}={FLAGS[name].value}: the target's vocabulary has "
                       f"{cfg.vocab_size} tokens")
  # The tokens the draft proposes from while decoding: --decode_vocab, else --draft_vocab.
  name = "decode_vocab" if FLAGS.decode_vocab else "draft_vocab"
  if FLAGS[name].value and FLAGS[name].value < max(s.top_k for s in shapes):
    raise ValueError(f"--{name}={FLAGS[name].value}: expected at least the largest "
                     f"top_k of --trees ({max(s.top_k for s in shapes)})")
  if not FLAGS.chat_prompts and FLAGS.prompt_len + FLAGS.max_new_tokens > cfg.max_seq_len:
    raise ValueError(f"--prompt_len={FLAGS.prompt_len} + --max_new_tokens="
                     f"{FLAGS.max_new_tokens} exceeds the target's max_seq_len={cfg.max_seq_len}")
  if lm.data.seq_len > cfg.max_seq_len:
    raise errors.expected(f"--seq_len={lm.data.seq_len}", "longer than the target's "
                          f"max_seq_len={cfg.max_seq_len}", f"at most {cfg.max_seq_len}")
  t = lm.train
  dcfg = distill.DistillConfig(
      num_sequences=FLAGS.num_sequences, seq_len=lm.data.seq_len,
      eval_sequences=FLAGS.eval_sequences, gen_temperature=FLAGS.gen_temperature,
      batch_size=t.batch_size, steps=lm.loop.steps, learning_rate=t.learning_rate,
      warmup_steps=t.warmup_steps, w_cls=FLAGS.w_cls, noise=FLAGS.noise,
      unroll=FLAGS.unroll, unroll_decay=FLAGS.unroll_decay, prompt_loss=FLAGS.prompt_loss,
      taps=tuple(int(x) for x in FLAGS.taps), tap_dropout=FLAGS.tap_dropout,
      log_every=max(1, min(100, lm.loop.steps // 10)), seed=t.seed,
      gen_batch=FLAGS.gen_batch, draft_vocab=FLAGS.draft_vocab,
      checkpoint_every=max(1, min(100, lm.loop.steps // 10)))
  prompts, stop = _prompts_for_target(lm.model.init, cfg.vocab_size)
  first = dcfg.num_sequences - dcfg.eval_sequences
  longest = max(len(p) for p in prompts)
  if longest >= dcfg.seq_len:
    raise errors.expected(f"--seq_len={dcfg.seq_len}", f"not longer than the longest prompt "
                          f"({longest} tokens)", "a prompt and at least one more token")
  if FLAGS.chat_prompts:   # the benchmark's prompts: held-out requests, not --prompt_len
    bench = [prompts[i % len(prompts)] for i in range(first, first + FLAGS.bench_prompts)]
    if max(map(len, bench)) + FLAGS.max_new_tokens > cfg.max_seq_len:
      raise errors.expected(f"--max_new_tokens={FLAGS.max_new_tokens}", "beyond the target's "
                            f"max_seq_len={cfg.max_seq_len} after a held-out request of "
                            f"{max(map(len, bench))} tokens", "at most "
                            f"{cfg.max_seq_len - max(map(len, bench))}")
  cfg, target = load_model(lm.model.init, lm.model.dtype)
  print(f"target {lm.model.init}: {cfg.num_params() / 1e6:.2f}M params, {cfg.n_layers} layers, "
        f"dim {cfg.dim}, vocab {cfg.vocab_size}; draft head: 1 layer", flush=True)
  print(f"distilling the draft head in {os.path.join(FLAGS.workdir, 'draft')} "
        f"({dcfg.num_sequences} target sequences of {dcfg.seq_len} tokens, "
        f"{dcfg.steps} steps)", flush=True)
  try:
    draft, train_out, (tokens, mask), vocab = distill.train_draft(
        target, os.path.join(FLAGS.workdir, "draft"), dcfg, prompts=prompts, stop_tokens=stop,
        overwrite=FLAGS.overwrite, resume_allow=tuple(FLAGS.resume_allow),
        settings={"target": lm.model.init, "dtype": lm.model.dtype})
  except RunSettingsError as e:
    raise RunSettingsError(with_flag_names(e, set(FLAGS))) from None
  if FLAGS.decode_vocab:
    vocab = distill.draft_vocab(tokens[:first], mask[:first], FLAGS.decode_vocab,
                                cfg.vocab_size)
  draft = cast_head(draft, FLAGS.draft_dtype or lm.model.dtype)
  held_out = ([prompts[i % len(prompts)] for i in range(first, dcfg.num_sequences)]
              if FLAGS.chat_prompts else tokens[first:, :FLAGS.prompt_len].tolist())
  print(f"draft eval: {json.dumps({k: round(v, 4) for k, v in train_out['eval'].items()})}",
        flush=True)

  temperatures = [float(t) for t in FLAGS.temperatures]
  rows = []
  for temp in temperatures:
    for b in batch_sizes:
      rows += benchmark.compare(target, draft, held_out[:FLAGS.bench_prompts],
                                FLAGS.max_new_tokens, shapes, batch=b, repeats=FLAGS.repeats,
                                temperature=temp, seed=lm.train.seed, stop_tokens=stop,
                                draft_vocab=vocab)
  head = (f"{'temp':>4} {'batch':>5} {'tree':>9} {'accept len':>10} {'tok/call':>8} "
          f"{'plain ms/tok':>12} {'spec ms/tok':>11} {'speedup':>7} {'greedy ==':>9}")
  print(head)
  for r in rows:
    print(f"{r['temperature']:>4g} {r['batch']:>5} {r['tree']:>9} {r['accept_length']:>10.2f} "
          f"{r['tokens_per_call']:>8.2f} {r['plain_ms_per_token']:>12.3f} "
          f"{r['spec_ms_per_token']:>11.3f} {r['speedup']:>7.2f} {equal_rows(r):>9}")
  profile = []
  if FLAGS.profile:
    for shape in shapes:
      profile.append(benchmark.profile_round(target, draft, held_out[0], shape,
                                             draft_vocab=vocab))
    # Each piece as a multiple of the plain step timed just before it (medians), then ms.
    parts = ("verify", "verify_nomask", "draft_tree", "draft_catch_up", "accept", "commit")
    print(f"{'tree':>9} {'plain ms':>8} " + " ".join(f"{k:>14}" for k in parts)
          + f" {'round (x plain)':>15}")
    for r in profile:
      print(f"{r['tree']:>9} {r['plain_step_ms']:>8.1f} "
            + " ".join(f"{r[k + '_x']:>6.2f}x{r[k + '_ms']:>6.1f}ms" for k in parts)
            + f" {r['round_x']:>15.2f}")
  plot_path = report.plot(benchmark.plot, rows, name="spec_decode.png")
  best = {f"{t:g}": {str(b): max((r for r in rows if r["batch"] == b and r["temperature"] == t),
                                  key=lambda r: r["speedup"]) for b in batch_sizes}
          for t in temperatures}
  greedy = [r for r in rows if r["temperature"] == 0]
  equal, compared = (sum(r[k] for r in greedy) for k in ("greedy_rows_equal", "prompts"))
  summary = {"target": lm.model.init, "temperatures": temperatures,
             "max_new_tokens": FLAGS.max_new_tokens, "draft_eval": train_out["eval"],
             "draft_vocab": 0 if vocab is None else len(vocab),
             "draft_dtype": draft.cfg.dtype,
             "greedy_match": equal == compared if greedy else None,
             "greedy_rows_equal": equal, "greedy_rows": compared,
             "best": {t: {b: {"tree": r["tree"], "speedup": round(r["speedup"], 3),
                              "accept_length": round(r["accept_length"], 3)}
                          for b, r in by_b.items()} for t, by_b in best.items()},
             "wall_seconds": round(report.seconds, 1)}
  report.finish({
      "summary": summary, "rows": rows, "profile": profile, "machine": bench_lib.machine(),
      "plot": plot_path,
      "flags": {**{f: FLAGS[f].value for f in ("target", "trees", "batch_sizes", "prompt_len",
                                                 "max_new_tokens", "temperatures", "repeats",
                                                 "chat_prompts", "draft_vocab", "decode_vocab",
                                                 "draft_dtype", "gen_batch", "num_sequences",
                                                 "draft_steps", "draft_batch", "draft_lr",
                                                 "prompt_loss", "unroll", "unroll_decay",
                                                 "w_cls", "noise", "taps", "tap_dropout")},
                "dtype": lm.model.dtype, "seed": lm.train.seed,
                "seq_len": lm.data.seq_len}}, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
