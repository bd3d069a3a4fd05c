r"""Generate text or tokens from a Llama checkpoint with a KV cache (prefill, then decode).

  python -m experiments.generate --checkpoint=gguf:/path/SmolLM2-135M-Instruct.Q4_1.gguf \
      --chat="What is the capital of France?" --max_new_tokens=64     # the GGUF's template
  python -m experiments.generate --checkpoint=hf:/path/to/Llama-3.2-1B --prompt="The capital of" \
      --max_new_tokens=20 --temperature=0.7 --top_p=0.9 --seed=0   # DIR/tokenizer.json
  python -m experiments.generate --checkpoint=hf:DIR --chat_file=messages.json   # [{role, content}]
  python -m experiments.generate --checkpoint=llama2c:../shared/data/llama2c/stories260K.bin \
      --tokenizer=/path/to/tok512.bin --prompt="Once upon a time"
  python -m experiments.generate --checkpoint=llama2c:../shared/data/llama2c/stories260K.bin \
      --max_new_tokens=40                                    # token ids, greedy from BOS (id 1)
  python -m experiments.generate --checkpoint=gguf:$GGUF --weights=int4 --prompt="Paris is"
      # weight-only int4 (the file's Q4_1 blocks as stored); int8, or gguf: every tensor as stored
  python -m experiments.generate --checkpoint=workdir:runs/lm --prompt="Once upon a"   # a train_lm --workdir

The tokenizer (llm.checkpoints.find_tokenizer) is --tokenizer when given (a tokenizer.json, a
directory with one, a llama2.c tokenizer.bin, or a GGUF file's vocabulary), else the
checkpoint's own: hf:DIR's
tokenizer.json, the vocabulary a GGUF embeds, the copy a train_lm workdir holds (or bytes).
--prompt is text, with BOS / EOS exactly as that tokenizer adds them (--bos / --nobos
override BOS; they go with --prompt only, --bos_id with no prompt flag only). --chat (one user message) or --chat_file (a JSON list of {"role", "content"})
renders the checkpoint's chat template with the assistant's turn opened, as transformers'
apply_chat_template(add_generation_prompt=True) does. Generation stops at the tokenizer's
EOS ids (and, for chats, the template's end-of-turn token) unless --stop_ids is given.
Without a tokenizer, use --prompt_ids. The prompt, its ids and its length (prompt plus
--max_new_tokens within the model's max_seq_len) are checked against the checkpoint's config
before the weights load. Prints the ids and the decoded text (for chats, the reply); the last
stdout line is JSON.
"""

from __future__ import annotations

import time

from absl import flags
from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings  # noqa: F401  (the shared settings by name)
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS


PROMPT_IDS = config.setting(
    "prompt_ids", "list", "Prompt token ids (default: the BOS token).", none_ok=True)
CHAT = config.setting(
    "chat", "string", "One user message, rendered with the checkpoint's chat template (the "
    "assistant's turn opened).", none_ok=True)
CHAT_FILE = config.setting(
    "chat_file", "string", 'A JSON file holding a list of {"role", "content"} messages, '
    "rendered like --chat.", none_ok=True)
BOS = config.setting(
    "bos", "bool", "Prepend the tokenizer's BOS to --prompt (default: as the checkpoint's "
    "tokenizer does: tokenizer_config.json add_bos_token, the tokenizer.json post-processor, GGUF "
    "tokenizer.ggml.add_bos_token).", none_ok=True)
TEMPERATURE = config.setting(
    "temperature", "float", "0 = greedy.", lower=0)
TOP_K = config.setting(
    "top_k", "integer", "Keep the k most likely tokens (0 = all).", lower=0)
TOP_P = config.setting(
    "top_p", "float", "Nucleus sampling mass, 0 < p <= 1 (1 = all).", lower=0, upper=1)
STOP_IDS = config.setting(
    "stop_ids", "list", "Stop after any of these token ids (default: the tokenizer's EOS ids; "
    "none without a tokenizer; empty: none).", none_ok=True)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, "checkpoint", "tokenizer", PROMPT_IDS, "prompt", CHAT, CHAT_FILE, BOS, "bos_id",
      "max_new_tokens", TEMPERATURE, TOP_K, TOP_P, STOP_IDS, "seed", "dtype", "weights",
      checkpoint=None, tokenizer=None, prompt_ids=None, prompt=None, chat=None, chat_file=None,
      bos=None, bos_id=None, max_new_tokens=40, temperature=0.0, top_k=0, top_p=1.0,
      stop_ids=None, seed=0, dtype="float32", weights="float32")
  flags.mark_flag_as_required("checkpoint")


def _ids(flag: str) -> list[int] | None:
  """The integers of a list flag (--prompt_ids, --stop_ids), or None when not given."""
  values = FLAGS[flag].value
  if values is None:
    return None
  bad = [v for v in values if not v.strip().lstrip("-").isdigit()]
  if bad:
    raise errors.expected(f"--{flag}={','.join(values)}", f"{bad[0]!r} is not an integer",
                          "comma-separated token ids")
  return [int(v) for v in values]


def _messages():
  """The chat messages of --chat / --chat_file (None for other prompts), read and checked
  before anything loads."""
  from llm import chat
  if FLAGS.chat is not None:
    return [{"role": "user", "content": FLAGS.chat}]
  if FLAGS.chat_file is None:
    return None
  try:
    return chat.load_messages(FLAGS.chat_file)
  except UnicodeDecodeError as e:
    raise errors.expected(f"--chat_file={FLAGS.chat_file}", f"byte {e.start} is not UTF-8",
                          "a UTF-8 JSON list of {\"role\", \"content\"} messages") from None
  except ValueError as e:
    raise errors.UserError(f"--chat_file: {e}") from None
  except OSError as e:   # a missing file, a directory
    raise errors.expected(f"--chat_file={FLAGS.chat_file}", e.strerror or str(e),
                          "a UTF-8 JSON list of {\"role\", \"content\"} messages") from None


def _prompt(tok, messages):
  """(prompt ids, stop ids implied by the prompt kind or None, is_chat) from the flags."""
  from llm import chat
  from llm.checkpoints import text_prompt
  if (FLAGS.prompt is not None or messages is not None) and tok is None:
    flag = "prompt" if FLAGS.prompt is not None else "chat_file" if FLAGS.chat_file else "chat"
    raise errors.UserError(f"--{flag} needs a tokenizer: {FLAGS.checkpoint} has none beside "
                           "it; pass --tokenizer=PATH, or give --prompt_ids")
  if messages is not None:
    flag = "--chat_file" if FLAGS.chat_file else "--chat"
    try:
      return chat.encode_chat(tok, messages, where=flag), chat.stop_ids(tok), True
    except ValueError as e:
      raise errors.UserError(str(e)) from None
  if FLAGS.prompt is not None:
    prompt = text_prompt(tok, FLAGS.prompt, FLAGS.bos)
    if not prompt:
      raise errors.UserError("--prompt encodes to no tokens; give some text or --bos")
    return prompt, None, False
  if FLAGS.prompt_ids is not None:
    return _ids("prompt_ids"), None, False
  bos_id = FLAGS.bos_id
  if bos_id is None:
    bos_id = tok.bos_id if tok is not None and tok.bos_id is not None else 1
  return [bos_id], None, False


def main(argv):
  del argv
  import jax
  from llm.checkpoints import find_tokenizer, load_config, load_model
  from llm.generate import generate
  from llm import tokenizer as tok_lib
  # Everything the flags alone decide, then what the checkpoint's config decides, before the
  # weights load.
  given = [n for n in ("prompt", "chat", "chat_file", "prompt_ids")
           if FLAGS[n].value is not None]
  if len(given) > 1:
    raise errors.UserError(f"--{' and --'.join(given)}: give one prompt")
  for name, want in (("chat", "a user message"), ("chat_file", "a JSON file of messages"),
                     ("prompt_ids", "comma-separated token ids")):
    if name in given and not FLAGS[name].value:
      raise errors.expected(f"--{name}=''", "empty", want)
  if FLAGS.top_p == 0:
    raise errors.expected("--top_p=0.0", "out of range", "a number > 0 and <= 1")
  if FLAGS.bos is not None and FLAGS.prompt is None:
    raise errors.expected(f"--{'bos' if FLAGS.bos else 'nobos'}",
                          f"given with {'--' + given[0] if given else 'no prompt'}",
                          "--prompt (it sets BOS of a text prompt only)")
  if FLAGS.bos_id is not None and given:
    raise errors.expected(f"--bos_id={FLAGS.bos_id}", f"given with --{given[0]}",
                          "no prompt flag (it is the start token of a sequence without one)")
  stop_flag = _ids("stop_ids")
  messages = _messages()
  if FLAGS.tokenizer:
    tok_lib.check_path(FLAGS.tokenizer)
  cfg = load_config(FLAGS.checkpoint)
  tok = find_tokenizer(FLAGS.checkpoint, FLAGS.tokenizer, cfg.vocab_size)
  prompt, chat_stop, is_chat = _prompt(tok, messages)
  for where, ids in (("prompt ids", prompt), ("--stop_ids", stop_flag or [])):
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
      raise errors.expected(where, f"{bad[:5]} outside the vocabulary",
                            f"ids in [0, {cfg.vocab_size}) ({FLAGS.checkpoint})")
  if len(prompt) + FLAGS.max_new_tokens > cfg.max_seq_len:
    raise errors.UserError(
        f"--max_new_tokens={FLAGS.max_new_tokens} with a {len(prompt)}-token prompt makes "
        f"{len(prompt) + FLAGS.max_new_tokens} tokens, beyond the model's max_seq_len="
        f"{cfg.max_seq_len} ({FLAGS.checkpoint}); use --max_new_tokens="
        f"{max(cfg.max_seq_len - len(prompt), 0)} or less")
  cfg, model = load_model(FLAGS.checkpoint, FLAGS.dtype, FLAGS.weights)
  if stop_flag is not None:
    stop = tuple(stop_flag)
  elif chat_stop is not None:
    stop = chat_stop
  else:
    stop = tok.stop_ids if tok is not None else ()
  t0 = time.time()
  out = generate(model, [prompt], FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                 top_k=FLAGS.top_k, top_p=FLAGS.top_p, stop_tokens=stop,
                 rng=jax.random.key(FLAGS.seed))[0]
  dt = time.time() - t0
  print("prompt ids:", " ".join(map(str, prompt)))
  print("generated ids:", " ".join(map(str, out)))
  text = reply = None
  if tok is not None:
    text = tok.decode(prompt + out)
    reply = tok.decode(out)
    print("reply:" if is_chat else "text:", reply if is_chat else text)
  results_lib.print_summary({"checkpoint": FLAGS.checkpoint, "prompt_ids": prompt,
                             "generated_ids": out, "text": text, "reply": reply, "chat": is_chat,
                             "stop_ids": list(stop), "num_generated": len(out),
                             "weights": FLAGS.weights, "seconds": round(dt, 3)})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
