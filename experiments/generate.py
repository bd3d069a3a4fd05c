r"""Generate text or tokens from a Llama checkpoint with a KV cache (prefill, then decode).

  python -m experiments.generate --checkpoint=hf:/path/to/Llama-3.2-1B --prompt="The capital of" \
      --max_new_tokens=20 --temperature=0.7 --top_p=0.9 --seed=0   # DIR/tokenizer.json
  python -m experiments.generate --checkpoint=llama2c:../shared/data/llama2c/stories260K.bin \
      --tokenizer=/path/to/tok512.bin --prompt="Once upon a time"
  python -m experiments.generate --checkpoint=llama2c:../shared/data/llama2c/stories260K.bin \
      --max_new_tokens=40                                    # token ids, greedy from BOS (id 1)
  python -m experiments.generate --checkpoint=workdir:runs/train_lm --prompt="Once upon a"

The tokenizer (llm.tokenizer) is --tokenizer when given (a tokenizer.json, a directory with
one, or a llama2.c tokenizer.bin), else hf:DIR's tokenizer.json, else the one a train_lm
workdir holds (its copy of train_lm's --tokenizer, or bytes). With a tokenizer, --prompt is
text, the BOS token is prepended for hf: and llama2c: checkpoints (--bos to change it) and
generation stops at the tokenizer's EOS ids unless --stop_ids is given. Without one, use
--prompt_ids. Prints the ids and the decoded text; the last stdout line is JSON.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags
from core import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  flags.DEFINE_string("checkpoint", None, "llama2c:PATH | hf:DIR | workdir:DIR", required=True)
  flags.DEFINE_string("tokenizer", None, "tokenizer.json, a directory holding one, or a llama2.c "
                      "tokenizer.bin (default: the checkpoint's own, see the module docstring).")
  flags.DEFINE_list("prompt_ids", None, "Prompt token ids (default: the BOS token).")
  flags.DEFINE_string("prompt", None, "Prompt text (needs a tokenizer).")
  flags.DEFINE_bool("bos", None, "Prepend the tokenizer's BOS to --prompt (default: yes for hf: "
                    "and llama2c: checkpoints, no for train_lm workdirs, which train without it).")
  flags.DEFINE_integer("bos_id", None, "Token used when no prompt is given (default: the "
                       "tokenizer's BOS, else 1).")
  flags.DEFINE_integer("max_new_tokens", 40, "Tokens to generate; prompt + new tokens must fit "
                       "in the model's max_seq_len.")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = all).")
  flags.DEFINE_list("stop_ids", None, "Stop after any of these token ids (default: the "
                    "tokenizer's EOS ids; none without a tokenizer).")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")


def load_model(spec: str, dtype: str = "float32"):
  """Llama model from `llama2c:PATH`, `hf:DIR` or `workdir:DIR` (a train_lm run)."""
  import jax
  from flax import nnx
  from llm import model as model_lib
  kind, _, path = spec.partition(":")
  if kind == "workdir":
    from llm.train_lib import load_workdir
    cfg, params = load_workdir(path)
    check_params_finite(params, f"{path} (latest checkpoint)")
    cfg = cfg.replace(dtype=dtype, remat=False)
    graphdef, _ = nnx.split(jax.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0))))
    return cfg, nnx.merge(graphdef, params)
  from llm import weights as weights_lib
  cfg, weights = weights_lib.load_checkpoint(spec)
  cfg = cfg.replace(dtype=dtype)
  model = model_lib.Llama(cfg, nnx.Rngs(0))
  model_lib.load_weights(model, weights)
  return cfg, model


def check_params_finite(params, where: str) -> None:
  """Raises ValueError naming `where` and the parameter that holds a NaN or an Inf."""
  import jax
  import numpy as np
  from llm.weights import check_finite
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    check_finite(jax.tree_util.keystr(path), np.asarray(leaf), where)


def find_tokenizer(spec: str, flag: str | None, vocab_size: int):
  """The tokenizer for checkpoint `spec` (module docstring), or None (token ids only)."""
  from llm import tokenizer as tok_lib
  if flag:
    return tok_lib.load_tokenizer(flag, vocab_size)
  kind, _, path = spec.partition(":")
  if kind == "hf" and os.path.exists(os.path.join(path, "tokenizer.json")):
    return tok_lib.load_tokenizer(path, vocab_size)
  if kind == "workdir":
    for name in ("tokenizer.json", "tokenizer.bin"):
      if os.path.exists(os.path.join(path, name)):
        return tok_lib.load_tokenizer(os.path.join(path, name), vocab_size)
    if vocab_size == tok_lib.ByteTokenizer.vocab_size:
      return tok_lib.ByteTokenizer()
  return None


def main(argv):
  del argv
  import jax
  from llm.generate import generate
  cfg, model = load_model(FLAGS.checkpoint, FLAGS.dtype)
  tok = find_tokenizer(FLAGS.checkpoint, FLAGS.tokenizer, cfg.vocab_size)
  if FLAGS.prompt is not None:
    if tok is None:
      raise app.UsageError(f"--prompt needs a tokenizer: {FLAGS.checkpoint} has none beside it "
                           "(pass --tokenizer=PATH, or --prompt_ids)")
    bos = FLAGS.bos
    if bos is None:
      bos = tok.bos_id is not None and not FLAGS.checkpoint.startswith("workdir:")
    prompt = tok.encode(FLAGS.prompt, bos=bos)
    if not prompt:
      raise app.UsageError("--prompt encodes to no tokens; give some text or --bos")
  elif FLAGS.prompt_ids:
    prompt = [int(t) for t in FLAGS.prompt_ids]
  else:
    bos_id = FLAGS.bos_id
    if bos_id is None:
      bos_id = tok.bos_id if tok is not None and tok.bos_id is not None else 1
    prompt = [bos_id]
  bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
  if bad:
    raise app.UsageError(f"prompt ids {bad} outside the vocabulary [0, {cfg.vocab_size})")
  if len(prompt) + FLAGS.max_new_tokens > cfg.max_seq_len:
    raise app.UsageError(
        f"--max_new_tokens={FLAGS.max_new_tokens} with a {len(prompt)}-token prompt makes "
        f"{len(prompt) + FLAGS.max_new_tokens} tokens, beyond the model's max_seq_len="
        f"{cfg.max_seq_len} ({FLAGS.checkpoint}); use --max_new_tokens="
        f"{max(cfg.max_seq_len - len(prompt), 0)} or less")
  if FLAGS.stop_ids is not None:
    stop = tuple(int(s) for s in FLAGS.stop_ids)
  else:
    stop = tok.stop_ids if tok is not None else ()
  t0 = time.time()
  out = generate(model, [prompt], FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                 top_k=FLAGS.top_k, top_p=FLAGS.top_p, stop_tokens=stop,
                 rng=jax.random.key(FLAGS.seed))[0]
  dt = time.time() - t0
  print("prompt ids:", " ".join(map(str, prompt)))
  print("generated ids:", " ".join(map(str, out)))
  text = None
  if tok is not None:
    text = tok.decode(prompt + out)
    print("text:", text)
  print(json.dumps({"checkpoint": FLAGS.checkpoint, "prompt_ids": prompt, "generated_ids": out,
                    "text": text, "num_generated": len(out), "seconds": round(dt, 3)}),
        flush=True)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
