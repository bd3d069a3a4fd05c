r"""Export a checkpoint as a Hugging Face directory or a GGUF file, with its tokenizer and
chat template.

  python -m experiments.export --checkpoint=workdir:runs/finetune_lm/lora --to=hf --out=/tmp/hf
  python -m experiments.export --checkpoint=workdir:runs/finetune_lm/full --to=gguf \
      --gguf_type=Q8_0 --out=/tmp/model.gguf

--checkpoint: every kind `llm.checkpoints` loads (a LoRA run's workdir exports its base with
the adapters merged; the adapters alone are its adapter/ directory, PEFT's layout).
--to=hf: config.json + model.safetensors (--dtype float32 | bfloat16) and the tokenizer:
tokenizer.json with tokenizer_config.json (bos / eos tokens, chat template), built from the
checkpoint's own (a HF tokenizer's files, or a GGUF vocabulary through `tokenizers`).
--to=gguf: a GGUF llama.cpp runs (--gguf_type F32 | F16 | Q8_0) with the vocabulary of a
GGUF or llama2.c tokenizer (`llm.gguf.save_gguf`); a tokenizer.json has no GGUF form here and
is refused in one line. Either format is written as the checkpoint's family
(`llm.config.family`, the summary's "family"): Qwen2 (q / k / v biases; HF
Qwen2ForCausalLM, GGUF arch qwen2), Mistral (a sliding window; HF MistralForCausalLM, GGUF
arch llama with llama.attention.sliding_window, which llama.cpp ignores), else Llama. The
output appears whole or not at all (written beside it, then renamed); an existing --out is
refused unless --overwrite, and so is --dtype with --to=gguf or --gguf_type with --to=hf.
"""

from __future__ import annotations

import json
import os
import shutil

from absl import flags

from core import cli
from core import config
from core import errors
from core import results as results_lib

FLAGS = flags.FLAGS
TO = config.setting("to", "enum", "Export format: hf (a Hugging Face directory) or gguf.",
                    choices=("hf", "gguf"))
GGUF_TYPE = config.setting("gguf_type", "enum", "--to=gguf: matrix storage.",
                           choices=("F32", "F16", "Q8_0"))


def define_flags() -> None:
  from core import settings  # noqa: F401  (the settings named below)
  from llm import settings as lm_settings  # noqa: F401
  config.define_flags(None, "checkpoint", TO, "out", GGUF_TYPE, "dtype", "overwrite",
                      "tokenizer", checkpoint=None, to="hf", out=None, gguf_type="F16",
                      dtype="float32", overwrite=False, tokenizer=None)
  flags.mark_flags_as_required(["checkpoint", "out"])


def hf_tokenizer_files(tok, where: str) -> dict[str, str]:
  """{file name: text} of a HF tokenizer directory for `tok` (generation_config.json with its
  BOS and stop ids among them); one that has no such form is a UserError naming `where`."""
  inner = getattr(tok, "tokenizers", None) or getattr(tok, "_tok", None)
  if inner is None or not hasattr(inner, "to_str"):
    raise errors.expected(where, f"a {type(tok).__name__} tokenizer ({tok.source})",
                          "a HF tokenizer.json or a GGUF vocabulary to export with --to=hf")
  conf = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(tok.add_bos),
          "add_eos_token": bool(tok.add_eos), "clean_up_tokenization_spaces": False}
  for name, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
    if i is not None:
      conf[name] = inner.id_to_token(i)
  if tok.chat_template:
    conf["chat_template"] = tok.chat_template
  files = {"tokenizer.json": _adding_specials(inner, tok, where),
           "tokenizer_config.json": json.dumps(conf, indent=2)}
  # The stop ids (a Llama 3 instruct's three, a GGUF's EOS and end of turn) go where
  # transformers' generate and our loader read them; config.json names no token.
  stop = list(dict.fromkeys(tok.stop_ids or ([] if tok.eos_id is None else [tok.eos_id])))
  gen = {k: v for k, v in (("bos_token_id", tok.bos_id),
                           ("eos_token_id", stop[0] if len(stop) == 1 else stop or None))
         if v is not None}
  if gen:
    files["generation_config.json"] = json.dumps(gen, indent=2)
  return files


def _adding_specials(inner, tok, where: str) -> str:
  """tokenizer.json's text for `inner` with a post-processor that adds what `tok` adds
  (`add_bos` / `add_eos`) and nothing else: transformers' PreTrainedTokenizerFast encodes
  through the post-processor and ignores tokenizer_config.json's add_bos_token, so a GGUF
  vocabulary's BOS (which has no post-processor) or a train_lm workdir's none (a Llama 3
  tokenizer.json's template adds one) would otherwise differ there. A ByteLevel step (token
  offsets) is kept; the template is built as transformers' LlamaTokenizerFast builds it."""
  from tokenizers import Tokenizer
  from tokenizers import processors
  want_bos = [tok.bos_id] if tok.add_bos else []
  want_eos = [tok.eos_id] if tok.add_eos else []

  def adds(t):
    for probe in ("a", "the", "0", " ", "."):
      plain = t.encode(probe, add_special_tokens=False).ids
      if plain:
        break
    return plain, t.encode(probe, add_special_tokens=True).ids

  plain, full = adds(inner)
  if full == want_bos + plain + want_eos:
    return inner.to_str()
  if None in want_bos + want_eos:
    raise errors.expected(where, f"a tokenizer that adds a BOS / EOS it has no id for "
                          f"(bos_id={tok.bos_id}, eos_id={tok.eos_id})", "ids for the tokens "
                          "it adds")
  bos = [inner.id_to_token(i) for i in want_bos]
  eos = [inner.id_to_token(i) for i in want_eos]
  template = processors.TemplateProcessing(
      single=[*bos, "$A:0", *eos], pair=[*bos, "$A:0", *eos, *(f"{b}:1" for b in bos), "$B:1",
                                         *(f"{e}:1" for e in eos)],
      special_tokens=list(dict.fromkeys(zip(bos + eos, want_bos + want_eos))))
  probe_tok = Tokenizer.from_str(inner.to_str())
  probe_tok.post_processor = template
  data = json.loads(inner.to_str())
  old = data.get("post_processor")
  steps = old.get("processors", []) if old and old.get("type") == "Sequence" else [old]
  keep = [p for p in steps if p and p.get("type") == "ByteLevel"]
  new = json.loads(probe_tok.to_str())["post_processor"]
  data["post_processor"] = {"type": "Sequence", "processors": keep + [new]} if keep else new
  text = json.dumps(data, ensure_ascii=False)
  plain2, full2 = adds(Tokenizer.from_str(text))
  if (plain2, full2) != (plain, want_bos + plain + want_eos):
    raise errors.expected(where, f"a tokenizer.json whose post-processor turns {plain} into "
                          f"{full2} after rewriting", f"{want_bos + plain + want_eos}")
  return text


def gguf_vocab(spec: str, tok, where: str):
  """The GGUF vocabulary of the checkpoint's tokenizer (a GGUF's own, or a llama2.c one),
  adding BOS / EOS as that tokenizer adds them (a train_lm workdir's adds none, whatever its
  tokenizer.gguf says), with its chat template."""
  import dataclasses
  from llm import checkpoints
  from llm import gguf
  from llm import tokenizer as tok_lib
  from llm.gguf_vocab import vocab_from_llama2c
  source = getattr(tok, "source", "")
  kind, path = checkpoints.parse_spec(spec)
  if tok_lib.is_gguf(source):
    vocab = gguf.read_vocab(source)
  elif kind == "gguf":
    vocab = checkpoints.gguf_checkpoint(path).vocab
  elif isinstance(tok, tok_lib.Llama2cTokenizer):
    vocab = vocab_from_llama2c(tok)
  else:
    raise errors.expected(where, f"a {type(tok).__name__} tokenizer ({source})",
                          "a GGUF or llama2.c vocabulary to export with --to=gguf (export "
                          "--to=hf for a tokenizer.json)")
  template = vocab.chat_template if vocab.chat_template is not None else tok.chat_template
  return dataclasses.replace(vocab, add_bos=bool(tok.add_bos), add_eos=bool(tok.add_eos),
                             chat_template=template or None)


def main(argv):
  del argv
  cli.quiet_library_logs()
  from llm import checkpoints
  from llm.config import family
  for name, reader in (("dtype", "hf"), ("gguf_type", "gguf")):
    if FLAGS[name].present and FLAGS.to != reader:
      raise errors.expected(f"--{name}={FLAGS[name].value}", f"not read with --to={FLAGS.to}",
                            f"it only with --to={reader}, which reads it")
  out = os.path.abspath(FLAGS.out)
  if os.path.exists(out) and not FLAGS.overwrite:
    raise errors.expected(f"--out={FLAGS.out}", "exists", "a new path (or --overwrite)")
  where = f"--checkpoint={FLAGS.checkpoint}"
  cfg, weights, tok = checkpoints.load_pretrained(FLAGS.checkpoint, "float32", FLAGS.tokenizer)
  if tok is None:
    raise errors.expected(where, "no tokenizer beside it", "--tokenizer=PATH")
  tmp = f"{out}.partial.{os.getpid()}"
  try:
    if FLAGS.to == "hf":
      from llm import weights as weights_lib
      files = hf_tokenizer_files(tok, where)
      weights_lib.save_hf(tmp, cfg, weights, dtype=FLAGS.dtype)
      for name, text in files.items():
        with open(os.path.join(tmp, name), "w") as f:
          f.write(text)
    else:
      from llm import gguf
      vocab = gguf_vocab(FLAGS.checkpoint, tok, where)
      gguf.save_gguf(tmp, cfg, weights, FLAGS.gguf_type, vocab=vocab)
    if os.path.exists(out):
      (shutil.rmtree if os.path.isdir(out) else os.remove)(out)
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      (shutil.rmtree if os.path.isdir(tmp) else os.remove)(tmp)
  size = (sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
          if os.path.isdir(out) else os.path.getsize(out))
  summary = {"checkpoint": FLAGS.checkpoint, "to": FLAGS.to, "out": out, "bytes": size,
             "params": cfg.num_params(), "family": family(cfg),
             "format": FLAGS.dtype if FLAGS.to == "hf" else FLAGS.gguf_type}
  print(f"export: {FLAGS.checkpoint} -> {out} ({FLAGS.to}, {summary['format']}, "
        f"{size / 1e6:.1f} MB)", flush=True)
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
