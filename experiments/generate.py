r"""Generate tokens from a Llama checkpoint with a KV cache (prefill, then decode).

  python -m experiments.generate --checkpoint=llama2c:../shared/data/llama2c/stories260K.bin \
      --max_new_tokens=40                                    # greedy from BOS (id 1)
  python -m experiments.generate --checkpoint=hf:/path/to/Llama-3.2-1B --prompt_ids=128000,791 \
      --max_new_tokens=20 --temperature=0.7 --top_p=0.9 --seed=0
  python -m experiments.generate --checkpoint=workdir:runs/train_lm --prompt="Once upon a"

Prints the token ids (and text for byte-level models, vocab 256); the last stdout line is
JSON with the generated ids.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "llama2c:PATH | hf:DIR | workdir:DIR", required=True)
flags.DEFINE_list("prompt_ids", None, "Prompt token ids (default: the BOS token).")
flags.DEFINE_string("prompt", None, "Prompt text (byte-level models only: vocab 256).")
flags.DEFINE_integer("bos_id", 1, "BOS token used when no prompt is given.")
flags.DEFINE_integer("max_new_tokens", 40, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = all).")
flags.DEFINE_list("stop_ids", [], "Stop after any of these token ids.")
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
    cfg = cfg.replace(dtype=dtype, remat=False)
    graphdef, _ = nnx.split(jax.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0))))
    return cfg, nnx.merge(graphdef, params)
  from llm import weights as weights_lib
  cfg, weights = weights_lib.load_checkpoint(spec)
  cfg = cfg.replace(dtype=dtype)
  model = model_lib.Llama(cfg, nnx.Rngs(0))
  model_lib.load_weights(model, weights)
  return cfg, model


def main(argv):
  del argv
  import jax
  from llm.data import decode_bytes, encode_text
  from llm.generate import generate
  cfg, model = load_model(FLAGS.checkpoint, FLAGS.dtype)
  if FLAGS.prompt is not None:
    if cfg.vocab_size != 256:
      raise ValueError(f"--prompt needs a byte-level model (vocab 256); this one has "
                       f"{cfg.vocab_size}: pass --prompt_ids")
    prompt = encode_text(FLAGS.prompt)
  elif FLAGS.prompt_ids:
    prompt = [int(t) for t in FLAGS.prompt_ids]
  else:
    prompt = [FLAGS.bos_id]
  bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
  if bad:
    raise ValueError(f"prompt ids {bad} outside the vocabulary [0, {cfg.vocab_size})")
  t0 = time.time()
  out = generate(model, [prompt], FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                 top_k=FLAGS.top_k, top_p=FLAGS.top_p, stop_tokens=tuple(int(s) for s in FLAGS.stop_ids),
                 rng=jax.random.key(FLAGS.seed))[0]
  dt = time.time() - t0
  print("prompt ids:", " ".join(map(str, prompt)))
  print("generated ids:", " ".join(map(str, out)))
  if cfg.vocab_size == 256:
    print("text:", repr(decode_bytes(prompt + out)))
  print(json.dumps({"checkpoint": FLAGS.checkpoint, "prompt_ids": prompt, "generated_ids": out,
                    "num_generated": len(out), "seconds": round(dt, 3)}), flush=True)


if __name__ == "__main__":
  app.run(main)
