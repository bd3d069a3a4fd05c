"""Loading a Llama checkpoint for serving: `llama2c:PATH`, `hf:DIR`, `gguf:FILE` or
`workdir:DIR` (a train_lm run) -> (LlamaConfig, Llama module), the tokenizer that belongs to
it, and prompts built the way that tokenizer builds them.

Entry points (generate, spec_decode, bench_llm, ...) and notebooks share these; the file
formats themselves are read by `llm.weights` (llama2.c, safetensors), `llm.gguf` and
`llm.tokenizer`; chat templates are rendered by `llm.chat`.

`load_config` reads a checkpoint's LlamaConfig without its weights (settings are checked
against it before a large model loads); `load_tokenizer` reads what `llm.tokenizer` reads and
also a GGUF file's vocabulary (recognised by its magic, whatever the file's name).

The tokenizer of a checkpoint: hf:DIR's tokenizer.json (with tokenizer_config.json,
chat_template.jinja, generation_config.json beside it), the vocabulary a GGUF file embeds,
the tokenizer.json / tokenizer.bin copy a train_lm workdir holds (or bytes), none for
llama2c: (pass one). What a text prompt starts and ends with is what that tokenizer adds
(`Tokenizer.add_bos` / `add_eos`), never a rule by checkpoint kind; train_lm workdirs are the
one case where the checkpoint itself says otherwise: train_lm encodes its stream without
special tokens, so their tokenizer adds none.
"""

from __future__ import annotations

import errno
import functools
import os

FORMS = ("llama2c:PATH (llama2.c legacy .bin)", "hf:DIR (Hugging Face config.json + "
         "safetensors)", "gguf:FILE (llama.cpp GGUF, Llama or Qwen2 architecture)",
         "workdir:DIR (an experiments.train_lm run)")
_KINDS = ("llama2c", "hf", "gguf", "workdir")


def parse_spec(spec: str) -> tuple[str, str]:
  """`kind:path` -> (kind, path); anything else is a ValueError listing the forms."""
  kind, sep, path = spec.partition(":")
  if not sep or not path or kind not in _KINDS:
    raise ValueError(f"checkpoint {spec!r}: expected one of {', '.join(FORMS)}")
  return kind, path


def absolute_spec(spec: str | None) -> str | None:
  """`kind:path` with the path made absolute (what a workdir records of a checkpoint)."""
  if not spec:
    return None
  kind, _, path = spec.partition(":")
  return f"{kind}:{os.path.abspath(path)}"


@functools.lru_cache(maxsize=2)
def _gguf_checkpoint(path: str, mtime_ns: int, size: int):
  from llm.gguf import read_gguf
  del mtime_ns, size   # cache key only: a rewritten file is read again
  return read_gguf(path)


def gguf_checkpoint(path: str):
  """`llm.gguf.GGUFCheckpoint` of `path`, shared by the model and tokenizer loaders (opening
  a GGUF parses its whole vocabulary)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(errno.ENOENT, "no such GGUF file", path)
  st = os.stat(path)
  return _gguf_checkpoint(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def load_config(spec: str):
  """The LlamaConfig of a checkpoint, read without its weights: a GGUF's metadata, hf:DIR's
  config.json, a llama2.c header, a workdir's model_config.json (so that settings can be
  checked against it before a large model loads)."""
  kind, path = parse_spec(spec)
  if kind == "gguf":
    return gguf_checkpoint(path).config   # the cached reader load_weights uses next
  from llm import weights as weights_lib
  if kind == "hf":
    return weights_lib.hf_config(path)
  if kind == "llama2c":
    return weights_lib.llama2c_config(path)
  from llm.config import config_from_dict
  file = os.path.join(path, "model_config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(errno.ENOENT, "missing; expected a workdir written by "
                            "experiments.train_lm", file)
  return config_from_dict(weights_lib.read_json(file))


def load_weights(spec: str, weights: str = "float32"):
  """(LlamaConfig, contract weights) of a llama2c:, hf: or gguf: checkpoint: float32 arrays,
  or with `weights` int8 | int4 | gguf the matrices as `llm.quantized.QuantizedParam` (a
  GGUF's Q8_0 / Q4_x blocks taken directly where they map)."""
  from llm import quantized
  kind, path = parse_spec(spec)
  quantized.check_mode(weights, kind)
  if kind == "gguf":
    ckpt = gguf_checkpoint(path)
    if weights == "float32":
      return ckpt.config, ckpt.weights()
    return ckpt.config, quantized.quantize(ckpt.config, weights, stored=ckpt.tensors)[0]
  if kind == "workdir":
    raise ValueError(f"checkpoint {spec!r}: workdir checkpoints are restored by the train loop "
                     "(load_model), not read as flat weights")
  from llm import weights as weights_lib
  cfg, flat = weights_lib.load_checkpoint(spec)
  if weights != "float32":
    flat = quantized.quantize(cfg, weights, weights=flat)[0]
  return cfg, flat


def load_model(spec: str, dtype: str = "float32", weights: str = "float32"):
  """Llama model from `llama2c:PATH`, `hf:DIR`, `gguf:FILE` or `workdir:DIR` for inference,
  computing in `dtype` with its weights stored in `dtype` too (bfloat16: half the memory and
  the bytes a decode step reads; the products see the same values as a float32 copy cast at
  use, the norm scales are rounded to bfloat16); `weights` int8 | int4 | gguf holds its
  matrices weight-only quantized (`llm.quantized`)."""
  import jax
  from flax import nnx
  from llm import model as model_lib
  kind, path = parse_spec(spec)
  if kind == "workdir" and weights != "float32":
    from llm import quantized
    quantized.check_mode(weights, kind)
    cfg, model = load_model(spec)   # quantized from the float32 checkpoint, as other kinds
    flat = model_lib.weights_from_model(model)
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
    model_lib.load_weights(model, quantized.quantize(cfg, weights, weights=flat)[0])
    return cfg, model
  if kind == "workdir":
    from llm.train_lib import load_workdir
    cfg, params = load_workdir(path)
    check_params_finite(params, f"{path} (latest checkpoint)")
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype, remat=False)
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    graphdef, _ = nnx.split(jax.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0))))
    return cfg, nnx.merge(graphdef, params)
  cfg, flat = load_weights(spec, weights)
  cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))   # no random init
  model_lib.load_weights(model, flat)
  return cfg, model


def load_pretrained(spec: str, weights: str = "float32", tokenizer: str | None = None):
  """(LlamaConfig, contract weights, tokenizer or None) to start training from: any kind
  `load_model` reads (a workdir's latest checkpoint, a LoRA run's adapters merged), the
  matrices int8 / int4 with `weights`; the tokenizer (`tokenizer`, a path, or the
  checkpoint's own) may have fewer tokens than the model's vocabulary (Qwen2's embeddings
  are padded past its tokenizer's 151,665 tokens), never more."""
  from llm import model as model_lib
  from llm import quantized
  kind, _ = parse_spec(spec)
  if kind == "workdir":
    quantized.check_mode(weights, kind)   # before the checkpoint is read
    cfg, model = load_model(spec)
    flat = model_lib.weights_from_model(model)
    if weights != "float32":
      flat = quantized.quantize(cfg, weights, weights=flat)[0]
  else:
    cfg, flat = load_weights(spec, weights)
  # find_tokenizer's loaders refuse a vocabulary larger than cfg.vocab_size
  return cfg, flat, find_tokenizer(spec, tokenizer, cfg.vocab_size)


def check_params_finite(params, where: str) -> None:
  """Raises ValueError naming `where` and the parameter that holds a NaN or an Inf."""
  import jax
  import numpy as np
  from llm.weights import check_finite
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    check_finite(jax.tree_util.keystr(path), np.asarray(leaf), where)


def load_tokenizer(path: str, vocab_size: int | None = None):
  """`llm.tokenizer.load_tokenizer`, and also a GGUF file's embedded vocabulary (any
  architecture's: only its tokenizer.ggml.* metadata is read)."""
  from llm import tokenizer as tok_lib
  if tok_lib.is_gguf(path):
    from llm.gguf import read_vocab
    from llm.gguf_vocab import vocab_tokenizer
    return vocab_tokenizer(read_vocab(path), path, vocab_size)
  return tok_lib.load_tokenizer(path, vocab_size)


def find_tokenizer(spec: str, flag: str | None, vocab_size: int):
  """The tokenizer for checkpoint `spec` (module docstring), or None (token ids only).
  `flag` (a tokenizer.json, a directory holding one, a llama2.c tokenizer.bin or a GGUF
  file's vocabulary) wins."""
  from llm import tokenizer as tok_lib
  if flag:
    tok_lib.check_path(flag)
    return load_tokenizer(flag, vocab_size)
  kind, path = parse_spec(spec)
  if kind == "hf" and os.path.exists(os.path.join(path, "tokenizer.json")):
    return tok_lib.load_tokenizer(path, vocab_size)
  if kind == "gguf":
    return gguf_checkpoint(path).tokenizer()
  if kind == "workdir":
    tok = None
    for name in ("tokenizer.json", "tokenizer.bin", "tokenizer.gguf"):
      if os.path.exists(os.path.join(path, name)):
        tok = load_tokenizer(os.path.join(path, name), vocab_size)
        break
    if tok is None and vocab_size == tok_lib.ByteTokenizer.vocab_size:
      tok = tok_lib.ByteTokenizer()
    if tok is not None:
      tok.add_bos = tok.add_eos = False   # train_lm's stream has no special tokens
    return tok
  return None


def text_prompt(tok, text: str, bos: bool | None = None) -> list[int]:
  """Ids of a plain-text prompt: BOS / EOS as the tokenizer adds them; `bos` overrides BOS."""
  return tok.encode(text, bos=tok.add_bos if bos is None else bos, eos=tok.add_eos)
