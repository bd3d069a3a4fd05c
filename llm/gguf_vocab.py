"""A GGUF file's vocabulary (its `tokenizer.ggml.*` metadata) as a tokenizer, and back.

  GGUFVocab    the `tokenizer.ggml.*` metadata as `llm.gguf` reads and writes it.
  vocab_tokenizer  an `llm.tokenizer.HFTokenizer` built with the `tokenizers` library:
             `gpt2` (byte-level BPE from tokens + merges, pre-tokenized as
             `tokenizer.ggml.pre` says: GPT-2's regex, digits split first, Llama 3's, or
             Qwen2's (each digit alone; NFC-normalized first as Qwen2's own tokenizer is,
             which llama.cpp skips)) and
             `llama` (SentencePiece BPE from tokens + scores, merges ranked by score, byte
             fallback, "▁" for spaces); control / unknown tokens special, user-defined ones
             added (a byte-level vocabulary's decode to their text as written, as llama.cpp
             writes them); BOS / EOS and whether they are added as the file says (llama.cpp's
             defaults when it is silent); `tokenizer.chat_template`.
  vocab_from_llama2c  a llama2.c tokenizer.bin as a `llama` vocabulary (export to GGUF).

Errors name the file (`where`) and the key: an unsupported model or pre-tokenizer, a merge
that is not 'left right', scores or token types that do not match the tokens, a token given
twice (llama.cpp aborts on it; an empty token is its "[EMPTY_<id>]"), an id outside the
vocabulary.
"""

from __future__ import annotations

import dataclasses
import warnings

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@dataclasses.dataclass
class GGUFVocab:
  """The `tokenizer.ggml.*` metadata of a GGUF file (what `llm.gguf.save_gguf` writes back)."""

  model: str                       # "gpt2" (byte-level BPE) | "llama" (SentencePiece)
  tokens: list[str]
  token_types: list[int]
  scores: list[float] | None = None
  merges: list[str] | None = None
  pre: str | None = None
  bos_id: int | None = None
  eos_id: int | None = None
  unk_id: int | None = None
  eot_id: int | None = None
  add_bos: bool | None = None
  add_eos: bool | None = None
  add_space_prefix: bool | None = None
  chat_template: str | None = None


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`. GPT-2's is the
# one `tokenizers`' ByteLevel pre-tokenizer applies itself.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# LLAMA_VOCAB_PRE_TYPE_QWEN2: Llama 3's with single digits (\p{N}, not \p{N}{1,3}).
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_GPT2 = ("default", "gpt-2")
_PRE_DIGITS_GPT2 = ("smollm", "starcoder", "refact")   # each digit alone, then GPT-2's regex
_PRE_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen")
SUPPORTED_PRE = _PRE_GPT2 + _PRE_DIGITS_GPT2 + _PRE_LLAMA3 + _PRE_QWEN2


def _bpe_tokenizer(v: GGUFVocab, where: str):
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
  pre = v.pre
  if pre is None:
    warnings.warn(f"{where}: no tokenizer.ggml.pre; using GPT-2's pre-tokenizer as llama.cpp "
                  "does (it warns that generation quality may suffer)")
    pre = "default"
  if pre not in SUPPORTED_PRE:
    raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r}; supported pre-tokenizers: "
                     f"{', '.join(SUPPORTED_PRE)}")
  if not v.merges:
    raise ValueError(f"{where}: a gpt2 (BPE) vocabulary without tokenizer.ggml.merges")
  merges = []
  for m in v.merges:
    cut = m.find(" ", 1)   # llama.cpp splits at the first space after the first character
    if cut < 0:
      raise ValueError(f"{where}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
    merges.append((m[:cut], m[cut + 1:]))
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(v.tokens)}, merges=merges,
                             fuse_unk=False, byte_fallback=False,
                             ignore_merges=pre in _PRE_LLAMA3))
  regex = {**dict.fromkeys(_PRE_LLAMA3, _LLAMA3_REGEX),
           **dict.fromkeys(_PRE_QWEN2, _QWEN2_REGEX)}.get(pre)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
  if pre in _PRE_GPT2:
    tok.pre_tokenizer = byte_level
  elif pre in _PRE_DIGITS_GPT2:
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 byte_level])
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level])
  if pre in _PRE_QWEN2:      # Qwen2's tokenizer.json normalizes to NFC before splitting
    tok.normalizer = normalizers.NFC()
  tok.decoder = decoders.ByteLevel()
  return tok, pre


def _spm_tokenizer(v: GGUFVocab, where: str):
  """SentencePiece BPE as transformers' LlamaConverter builds it: merges of normal pieces
  ranked by the merged piece's score, byte fallback, "▁" for spaces and a leading one."""
  from tokenizers import Tokenizer, decoders, models, normalizers
  if v.scores is None or len(v.scores) != len(v.tokens):
    raise ValueError(f"{where}: a llama (SentencePiece) vocabulary needs one score per token "
                     f"(tokenizer.ggml.scores has {0 if v.scores is None else len(v.scores)}, "
                     f"tokens {len(v.tokens)})")
  types = v.token_types or [_NORMAL] * len(v.tokens)
  ids = {}
  for i, t in enumerate(v.tokens):
    ids.setdefault(t, i)
  normal = {t: i for t, i in ids.items() if types[i] == _NORMAL}
  merges = []
  for piece, i in normal.items():
    for cut in range(1, len(piece)):
      a, b = piece[:cut], piece[cut:]
      if a in normal and b in normal:
        merges.append((-v.scores[i], i, a, b))
  merges = [(a, b) for *_, a, b in sorted(merges)]
  unk = v.tokens[v.unk_id] if v.unk_id is not None else None
  tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True,
                             byte_fallback=True))
  steps = [normalizers.Replace(" ", "▁")]
  steps_back = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if v.add_space_prefix is None or v.add_space_prefix:   # llama.cpp's default for llama vocabs
    steps.insert(0, normalizers.Prepend("▁"))
    steps_back.append(decoders.Strip(" ", 1, 0))   # the prefix's space; without it (Gemma's
    # files) a leading space is the text's own, kept as llama.cpp and transformers keep it
  tok.normalizer = normalizers.Sequence(steps)
  tok.decoder = decoders.Sequence(steps_back)
  return tok


def vocab_tokenizer(v: GGUFVocab | None, where: str, vocab_size: int | None = None):
  """`llm.tokenizer.HFTokenizer` for a GGUF vocabulary (None: the file has none)."""
  from tokenizers import AddedToken

  from llm.tokenizer import HFTokenizer
  if v is None:
    raise ValueError(f"{where}: no tokenizer.ggml.model: the file carries no vocabulary; pass "
                     "--tokenizer")
  if vocab_size is not None and len(v.tokens) > vocab_size:
    raise ValueError(f"{where}: {len(v.tokens)} tokens in tokenizer.ggml.tokens, more than the "
                     f"model's vocabulary of {vocab_size}")
  if "" in v.tokens:   # llama.cpp names an empty token "[EMPTY_<id>]"
    v = dataclasses.replace(v, tokens=[t or f"[EMPTY_{i}]" for i, t in enumerate(v.tokens)])
  first: dict[str, int] = {}
  for i, t in enumerate(v.tokens):
    if first.setdefault(t, i) != i:   # the tokenizer would lose an id (llama.cpp aborts)
      raise ValueError(f"{where}: tokenizer.ggml.tokens {first[t]} and {i} are both {t!r}; "
                       "expected distinct tokens")
  if v.token_types and len(v.token_types) != len(v.tokens):
    raise ValueError(f"{where}: {len(v.token_types)} token types for {len(v.tokens)} tokens")
  for name, i in (("unknown_token_id", v.unk_id), ("eot_token_id", v.eot_id)):
    if i is not None and not 0 <= i < len(v.tokens):
      raise ValueError(f"{where}: tokenizer.ggml.{name}={i} outside the {len(v.tokens)} tokens")
  try:
    if v.model == "gpt2":
      tok, pre = _bpe_tokenizer(v, where)
      default_bos = pre in _PRE_LLAMA3             # llama.cpp: llama3-family BPE adds BOS
    elif v.model == "llama":
      tok, default_bos = _spm_tokenizer(v, where), True
    else:
      raise ValueError(f"{where}: tokenizer.ggml.model={v.model!r}; supported: 'gpt2' "
                       "(byte-level BPE) and 'llama' (SentencePiece)")
  except ValueError:
    raise
  except Exception as e:   # the tokenizers library raises a bare Exception naming no file
    raise ValueError(f"{where}: the tokenizer.ggml.* vocabulary does not build a tokenizer "
                     f"({e})") from None
  types = v.token_types or [_NORMAL] * len(v.tokens)
  raw = {}
  if v.model == "gpt2":   # llama.cpp writes added tokens' text as it is, not byte-level
    for i, (t, k) in enumerate(zip(v.tokens, types)):
      if k in (_CONTROL, _UNKNOWN, _USER_DEFINED) and tok.decoder.decode([t]) != t:
        raw[i] = (t, k != _USER_DEFINED)
  special = [AddedToken(t, special=True, normalized=False)
             for t, k in zip(v.tokens, types) if k in (_CONTROL, _UNKNOWN)]
  user = [AddedToken(t, special=False, normalized=False)
          for t, k in zip(v.tokens, types) if k == _USER_DEFINED]
  tok.add_special_tokens(special)
  tok.add_tokens(user)
  bos = v.bos_id if v.bos_id is not None else (1 if v.model == "llama" else None)
  eos = v.eos_id if v.eos_id is not None else (2 if v.model == "llama" else None)
  add_bos = default_bos if v.add_bos is None else v.add_bos
  add_eos = bool(v.add_eos)
  for name, i, on in (("bos", bos, add_bos), ("eos", eos, add_eos)):
    if i is not None and not 0 <= i < len(v.tokens):
      raise ValueError(f"{where}: tokenizer.ggml.{name}_token_id={i} outside the "
                       f"{len(v.tokens)} tokens")
    if on and i is None:
      raise ValueError(f"{where}: tokenizer.ggml.add_{name}_token is true but there is no "
                       f"tokenizer.ggml.{name}_token_id")
  stop = tuple(dict.fromkeys(i for i in (eos, v.eot_id) if i is not None))
  return HFTokenizer.from_tokenizers(tok, where, bos_id=bos, eos_id=eos, stop_ids=stop,
                                     add_bos=add_bos, add_eos=add_eos,
                                     chat_template=v.chat_template, raw_tokens=raw)


def vocab_from_llama2c(tok) -> GGUFVocab:
  """A llama2.c tokenizer.bin vocabulary as GGUF `llama` (SentencePiece) metadata."""
  tokens, types = [], []
  for i, p in enumerate(tok.pieces):
    if i in tok.byte_of:
      tokens.append(p.decode("ascii"))
      types.append(_BYTE)
    elif i in (tok.bos_id, tok.eos_id):
      tokens.append("<s>" if i == tok.bos_id else "</s>")
      types.append(_CONTROL)
    elif p == b"<unk>":
      tokens.append("<unk>")
      types.append(_UNKNOWN)
    else:
      tokens.append(p.decode("utf-8", errors="replace").replace(" ", "▁"))
      types.append(_NORMAL)
  unk = next((i for i, k in enumerate(types) if k == _UNKNOWN), None)
  return GGUFVocab(model="llama", tokens=tokens, token_types=types, scores=list(tok.scores),
                   bos_id=tok.bos_id, eos_id=tok.eos_id, unk_id=unk, add_bos=True,
                   add_eos=False, add_space_prefix=True)
