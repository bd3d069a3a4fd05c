r"""Score a language model on held-out data: mean token loss, perplexity, bits per token.

  python -m experiments.eval_lm --checkpoint=gguf:SmolLM2-135M-Instruct.Q4_1.gguf --text=book.txt
  python -m experiments.eval_lm --checkpoint=workdir:runs/train_lm_tiny_... --text=book.txt
  python -m experiments.eval_lm --checkpoint=hf:DIR --data=chat:held_out.jsonl

--checkpoint takes every kind `llm.checkpoints` loads: llama2c:PATH, hf:DIR, gguf:FILE and
workdir:DIR (a train_lm run, full or LoRA fine-tuning: the adapters merged into its base).
--text: the file's tokens (the checkpoint's tokenizer, or --tokenizer; no BOS) in
non-overlapping windows of --seq_len + 1 tokens sharing their boundary token, so every token
after the first is predicted once from at most --seq_len tokens before it
(`llm.evaluate.text_batches`); --max_windows scores only the first ones. --data=chat:FILE
(JSON Lines of {"messages": [...]}): each conversation rendered with the checkpoint's chat
template, the loss on the assistant's tokens only (`llm.chat_data`).

Writes <workdir>/results.json (default runs/eval_lm); the last stdout line is a JSON summary
with loss, perplexity, bits_per_token and the number of tokens scored.
"""

from __future__ import annotations

import os
import time

from absl import flags

from core import cli
from core import config
from core import errors
from core import results as results_lib

FLAGS = flags.FLAGS
MAX_WINDOWS = config.setting("max_windows", "integer", "Score only the first N windows of "
                             "--text (unset: all).", lower=1, none_ok=True)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script."""
  from core import settings  # noqa: F401  (the settings named below)
  from llm import settings as lm_settings  # noqa: F401
  config.define_flags(
      None, "checkpoint", "text", "data", "tokenizer", "seq_len", "batch_size", "dtype",
      "weights", "workdir", MAX_WINDOWS, checkpoint=None, text=None, data=None,
      tokenizer=None, seq_len=512, batch_size=4, dtype="float32", weights="float32",
      workdir="runs/eval_lm", max_windows=None)
  flags.mark_flag_as_required("checkpoint")


def main(argv):
  del argv
  cli.quiet_library_logs()
  from llm import chat_data
  chat = chat_data.chat_path(FLAGS.data)
  if (FLAGS.text is None) == (chat is None):
    raise errors.expected("--text / --data", "both given" if chat else "neither given",
                          "one of --text=FILE or --data=chat:FILE")
  if chat and FLAGS.max_windows is not None:
    raise errors.expected(f"--max_windows={FLAGS.max_windows}",
                          f"given with --data={FLAGS.data}", "--max_windows only with --text "
                          "(chat rows are whole conversations)")
  from llm import checkpoints
  from llm import evaluate
  from llm.data import read_text
  from llm import tokenizer as tok_lib
  if FLAGS.tokenizer:
    tok_lib.check_path(FLAGS.tokenizer)
  cfg = checkpoints.load_config(FLAGS.checkpoint)
  if FLAGS.seq_len > cfg.max_seq_len:
    raise errors.expected(f"--seq_len={FLAGS.seq_len}", f"longer than the model's context "
                          f"({cfg.max_seq_len})", f"at most {cfg.max_seq_len}")
  tok = checkpoints.find_tokenizer(FLAGS.checkpoint, FLAGS.tokenizer, cfg.vocab_size)
  if tok is None:
    raise errors.UserError(f"--checkpoint={FLAGS.checkpoint}: no tokenizer beside it; "
                           "expected --tokenizer=PATH")
  if chat:
    convs = chat_data.read_chat_file(chat, tok, max_len=FLAGS.seq_len)
    batches = evaluate.chat_batches(convs, FLAGS.seq_len, FLAGS.batch_size)
    what = f"{len(convs)} conversations of {chat}"
  else:
    tokens = tok.encode(read_text(FLAGS.text))
    if len(tokens) < 2:   # text_batches is lazy: it would say so after the weights load
      raise errors.expected(f"--text={FLAGS.text}", f"{len(tokens)} token(s)",
                            "at least 2 (one to predict from the one before it)")
    batches = evaluate.text_batches(tokens, FLAGS.seq_len, FLAGS.batch_size, FLAGS.max_windows)
    what = f"{len(tokens):,} tokens of {FLAGS.text}"
  cfg, model = checkpoints.load_model(FLAGS.checkpoint, FLAGS.dtype, FLAGS.weights)
  print(f"eval_lm: {FLAGS.checkpoint} ({cfg.num_params() / 1e6:.1f}M params, "
        f"{FLAGS.weights}, {FLAGS.dtype}) on {what}", flush=True)
  t0 = time.time()
  ev = evaluate.mean_loss(model, batches)
  summary = {"checkpoint": FLAGS.checkpoint, "text": FLAGS.text, "data": FLAGS.data,
             "tokenizer": FLAGS.tokenizer, "seq_len": FLAGS.seq_len,
             "max_windows": FLAGS.max_windows, "dtype": FLAGS.dtype, "weights": FLAGS.weights,
             **ev, "seconds": time.time() - t0}
  print(f"loss {ev['loss']:.5f} | perplexity {ev['perplexity']:.4f} | "
        f"{ev['bits_per_token']:.4f} bits/token over {ev['num_tokens']:,} tokens", flush=True)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  results_lib.finish(FLAGS.workdir, {"summary": summary}, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
