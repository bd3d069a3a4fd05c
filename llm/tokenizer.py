"""Text <-> token ids behind one small interface, for generation and training.

Three implementations of `Tokenizer` (encode / decode, bos_id / eos_id / stop_ids,
vocab_size, add_bos / add_eos, chat_template):

  ByteTokenizer        UTF-8 bytes are the tokens (vocab 256, no special tokens): the
                       byte-level models `experiments.train_lm` trains by default.
  HFTokenizer          a Hugging Face `tokenizer.json`, run by the `tokenizers` library (BPE,
                       byte-level BPE, SentencePiece conversions: whatever the file holds);
                       BOS / EOS come from tokenizer_config.json, config.json and
                       generation_config.json beside it, the chat template from
                       chat_template.jinja or tokenizer_config.json. GGUF files build one from
                       their embedded vocabulary (`llm.gguf_vocab`).
  Llama2cTokenizer     llama2.c's `tokenizer.bin` (a SentencePiece BPE vocabulary exported by
                       llama2.c's tokenizer.py), encoded as llama2.c's run.c does.

`tokenizer.bin` layout (little endian): uint32 max_token_length, then per token id i:
float32 score, int32 n, n bytes of the piece (UTF-8, SentencePiece's "▁" already replaced by
" "; BOS is "\\n<s>\\n", EOS "\\n</s>\\n", byte-fallback pieces are "<0x00>".."<0xFF>"). The
vocabulary size is not stored: it is the number of entries up to the end of the file, and
must equal the model's. run.c's encoding: a leading " " piece (SentencePiece's dummy
prefix) unless the text is empty; each UTF-8 code point becomes its piece, or its bytes'
<0xXX> pieces when the vocabulary lacks it; then, repeatedly, the adjacent pair whose
concatenation is a piece with the highest score is merged (the leftmost on ties). Here the
merges run off a heap in O(n log n) rather than run.c's O(n^2) rescans, with the same
choices; unlike run.c (and like SentencePiece) a merge never produces a special or a byte
piece, so text such as "<0x41>" stays text.

Decoding drops BOS / EOS, turns byte pieces back into bytes, strips the dummy-prefix space
of the first piece of the text (SentencePiece's and run.c's rule) and decodes UTF-8 with
U+FFFD for invalid sequences.

    tok = load_tokenizer("/path/Llama-3.2-1B")           # a directory with tokenizer.json
    tok = load_tokenizer("/path/tokenizer.json")
    tok = load_tokenizer("/path/tok512.bin")              # llama2.c
    tok = llm.checkpoints.load_tokenizer("/path/model.gguf")   # any of these, or a GGUF's
    ids = tok.encode("Once upon a time", bos=tok.add_bos); text = tok.decode(ids)

`add_bos` / `add_eos` say what the checkpoint's own tokenizer adds to a text, as its files
say it: tokenizer_config.json's `add_bos_token` / `add_eos_token` when present (transformers
rebuilds the post-processor from them), else what tokenizer.json's post-processor adds (a
TemplateProcessing such as Llama 3's "<|begin_of_text|> $A"; SmolLM2's adds nothing), GGUF's
`tokenizer.ggml.add_bos_token`; llama2.c's run.c always starts with BOS. `encode` itself adds
only what its `bos` / `eos` arguments ask for.
"""

from __future__ import annotations

import errno
import heapq
import json
import os
import re
import struct
from typing import Protocol, Sequence

from core import errors


class Tokenizer(Protocol):
  """What generation and training need from a tokenizer."""

  vocab_size: int            # ids are in [0, vocab_size)
  bos_id: int | None         # prepended by encode(bos=True); None: the tokenizer has none
  eos_id: int | None         # appended by encode(eos=True)
  stop_ids: tuple[int, ...]  # ids that end generation by default
  add_bos: bool              # the checkpoint's tokenizer prepends BOS to a text
  add_eos: bool              # ... and appends EOS
  chat_template: str | None  # Jinja2 chat template (llm.chat), None: the checkpoint has none
  special_tokens: dict[str, str]   # bos_token / eos_token / ... strings a template may use

  def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


def _with_specials(tok, ids: list[int], bos: bool, eos: bool) -> list[int]:
  for flag, name in ((bos, "bos"), (eos, "eos")):
    if flag and getattr(tok, f"{name}_id") is None:
      raise ValueError(f"{tok.source}: encode({name}=True), but the tokenizer has no "
                       f"{name.upper()} token")
  return ([tok.bos_id] if bos else []) + ids + ([tok.eos_id] if eos else [])


def _check_ids(tok, ids: Sequence[int]) -> list[int]:
  ids = [int(i) for i in ids]
  bad = [i for i in ids if not 0 <= i < tok.vocab_size]
  if bad:
    raise ValueError(f"{tok.source}: token ids {bad[:5]} outside [0, {tok.vocab_size})")
  return ids


class ByteTokenizer:
  """UTF-8 bytes as tokens: vocab 256, no BOS or EOS."""

  vocab_size = 256
  bos_id = None
  eos_id = None
  stop_ids = ()
  add_bos = add_eos = False
  chat_template = None
  special_tokens: dict[str, str] = {}
  source = "bytes"

  def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    return _with_specials(self, list(text.encode("utf-8")), bos, eos)

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(_check_ids(self, ids)).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json


def _token_content(tok) -> str | None:
  """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
  if isinstance(tok, dict):
    tok = tok.get("content")
  return tok if isinstance(tok, str) else None


class HFTokenizer:
  """A Hugging Face `tokenizer.json` through the `tokenizers` library.

  `bos_token` / `eos_token` (strings) override what the files beside tokenizer.json say:
  tokenizer_config.json's bos_token / eos_token, else config.json's bos_token_id /
  eos_token_id. `stop_ids` are generation_config.json's eos_token_id (one id or a list, as
  the Llama 3 instruct models list several), else the EOS and config.json's eos_token_id (all
  of a list: transformers builds the generation config from it). `add_bos` / `add_eos`: module
  docstring. The chat template is chat_template.jinja (transformers >= 4.43 writes it; it
  wins, as in transformers), else tokenizer_config.json's `chat_template` (a string, or a list
  of named templates whose "default" is used).
  """

  def __init__(self, path: str, bos_token: str | None = None, eos_token: str | None = None):
    from tokenizers import Tokenizer as _HFTok
    if not os.path.isfile(path):
      raise FileNotFoundError(errno.ENOENT, "no such file; expected a Hugging Face "
                              "tokenizer.json", path)
    try:
      tok = _HFTok.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception naming no file
      raise ValueError(f"{path}: not a Hugging Face tokenizer.json: {e}") from e
    self._tok, self.source, self._raw = tok, path, {}
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    d = os.path.dirname(os.path.abspath(path))
    side = {name: _read_json(os.path.join(d, name)) for name in
            ("tokenizer_config.json", "config.json", "generation_config.json")}
    conf = side["tokenizer_config.json"]
    self.bos_id = self._special("bos", bos_token, side)
    self.eos_id = self._special("eos", eos_token, side)
    gen_eos = side["generation_config.json"].get("eos_token_id")
    if gen_eos is not None:
      self.stop_ids = tuple(_token_id(i, "generation_config.json eos_token_id", d) for i in (
          gen_eos if isinstance(gen_eos, list) else [gen_eos]))
    else:   # transformers' generation config then comes from config.json (Llama 3.1 lists 3)
      conf_eos = side["config.json"].get("eos_token_id")
      conf_eos = [] if conf_eos is None else conf_eos if isinstance(conf_eos, list) else [conf_eos]
      self.stop_ids = tuple(dict.fromkeys(
          ([] if self.eos_id is None else [self.eos_id]) +
          [_token_id(i, "config.json eos_token_id", d) for i in conf_eos]))
    self.add_bos, self.add_eos = self._added_specials(conf)
    self.chat_template = _chat_template(d, conf)
    self.special_tokens = {}
    for name in ("bos", "eos", "unk", "pad"):
      text = _token_content(conf.get(f"{name}_token"))
      i = getattr(self, f"{name}_id", None)
      if text is None and i is not None:
        text = tok.id_to_token(i)
      if text is not None:
        self.special_tokens[f"{name}_token"] = text

  @classmethod
  def from_tokenizers(cls, tok, source: str, *, bos_id: int | None, eos_id: int | None,
                      stop_ids: tuple[int, ...], add_bos: bool, add_eos: bool,
                      chat_template: str | None,
                      raw_tokens: dict[int, tuple[str, bool]] | None = None) -> HFTokenizer:
    """Wraps a `tokenizers.Tokenizer` built elsewhere (a GGUF's vocabulary,
    `llm.gguf_vocab`). `raw_tokens`: id -> (text, special) of added tokens that decode to
    their text as written, not through the decoder (llama.cpp's user-defined and control
    tokens of a byte-level BPE: the ByteLevel decoder would read "é" in "<ctrlé>" as byte
    0xE9)."""
    self = cls.__new__(cls)
    self._tok, self.source, self._raw = tok, source, dict(raw_tokens or {})
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    self.bos_id, self.eos_id, self.stop_ids = bos_id, eos_id, tuple(stop_ids)
    self.add_bos, self.add_eos, self.chat_template = bool(add_bos), bool(add_eos), chat_template
    self.special_tokens = {f"{n}_token": tok.id_to_token(i)
                           for n, i in (("bos", bos_id), ("eos", eos_id)) if i is not None}
    return self

  @property
  def tokenizers(self):
    """The underlying `tokenizers.Tokenizer`."""
    return self._tok

  def _special(self, name: str, token: str | None, side: dict) -> int | None:
    where = "bos_token/eos_token argument"
    if token is None:
      token = _token_content(side["tokenizer_config.json"].get(f"{name}_token"))
      where = "tokenizer_config.json"
    if token is not None:
      i = self._tok.token_to_id(token)
      if i is None:
        raise ValueError(f"{self.source}: {name}_token {token!r} (from {where}) is not in the "
                         "vocabulary")
      return i
    i = side["config.json"].get(f"{name}_token_id")
    if isinstance(i, list):
      i = i[0] if i else None
    d = os.path.dirname(os.path.abspath(self.source))
    return None if i is None else _token_id(i, f"config.json {name}_token_id", d)

  def _added_specials(self, conf: dict) -> tuple[bool, bool]:
    """(add_bos, add_eos): tokenizer_config.json's flags, else what the post-processor adds
    around a text (found by encoding one with and without it)."""
    # A probe that encodes to something, so that what is added shows on its side.
    for probe in ("a", "the", "0", " ", "."):
      plain = self._tok.encode(probe, add_special_tokens=False).ids
      if plain:
        break
    full = self._tok.encode(probe, add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain),
              None)
    if at is None:
      raise ValueError(f"{self.source}: the post-processor turns {plain} into {full}; expected "
                       "special tokens around the text, not changes inside it")
    added = {"bos": full[:at], "eos": full[at + len(plain):]}
    out = []
    for name in ("bos", "eos"):
      flag = conf.get(f"add_{name}_token")
      if flag is not None:
        if not isinstance(flag, bool):
          raise ValueError(f"{self.source}: tokenizer_config.json add_{name}_token={flag!r}, "
                           "expected true or false")
        on = flag
      else:
        on = bool(added[name])
        if on and added[name] != [getattr(self, f"{name}_id")]:
          if len(added[name]) == 1 and getattr(self, f"{name}_id") is None:
            setattr(self, f"{name}_id", added[name][0])
          else:
            raise ValueError(f"{self.source}: the post-processor adds {added[name]} "
                             f"{'before' if name == 'bos' else 'after'} a text, but the "
                             f"{name.upper()} token is {getattr(self, f'{name}_id')}")
      if on and getattr(self, f"{name}_id") is None:
        raise ValueError(f"{self.source}: add_{name}_token is set but the tokenizer has no "
                         f"{name.upper()} token (no {name}_token in tokenizer_config.json, no "
                         f"{name}_token_id in config.json)")
      out.append(on)
    return out[0], out[1]

  def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    # The file's post-processor (e.g. Llama 3's <|begin_of_text|> template) is not applied:
    # `bos` / `eos` say explicitly what is added. Added tokens written in the text
    # ("<|im_start|>") become their ids, as in transformers.
    return _with_specials(self, self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode(text)`'s ids and each one's (start, end) character span in `text` (the
    tokenizers library's offsets: a byte-level token inside one character spans that
    character, SentencePiece's added "▁" the character it precedes)."""
    e = self._tok.encode(text, add_special_tokens=False)
    return list(e.ids), [tuple(o) for o in e.offsets]

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    ids = _check_ids(self, ids)
    if not self._raw or self._raw.keys().isdisjoint(ids):
      return self._tok.decode(ids, skip_special_tokens=skip_special)
    # The runs between raw tokens through the decoder, raw tokens as written.
    out, run = [], []
    for i in ids + [None]:
      if i is not None and i not in self._raw:
        run.append(i)
        continue
      out.append(self._tok.decode(run, skip_special_tokens=skip_special))
      run = []
      if i is not None and not (skip_special and self._raw[i][1]):
        out.append(self._raw[i][0])
    return "".join(out)


def _token_id(i, key: str, d: str) -> int:
  """A token id read from a JSON file beside tokenizer.json (`key` names file and key)."""
  if isinstance(i, bool) or not isinstance(i, int) or i < 0:
    file, _, name = key.partition(" ")
    raise errors.expected(os.path.join(d, file), f"{name}={i!r}", "a token id (an integer >= 0)")
  return i


def _chat_template(d: str, conf: dict) -> str | None:
  path = os.path.join(d, "chat_template.jinja")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as fh:
      return fh.read()
  t = conf.get("chat_template")
  if isinstance(t, list):   # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
    t = named.get("default")
    if t is None:
      raise ValueError(f"{os.path.join(d, 'tokenizer_config.json')}: chat_template lists "
                       f"{sorted(n for n in named if n)} but no 'default' template")
  if t is not None and not isinstance(t, str):
    raise ValueError(f"{os.path.join(d, 'tokenizer_config.json')}: chat_template is a "
                     f"{type(t).__name__}, expected a string or a list of named templates")
  return t


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, "rb") as fh:
    data = fh.read()
  try:
    d = json.loads(data.decode("utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not UTF-8 JSON ({e})") from None
  if not isinstance(d, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
  return d


# ---------------------------------------------------------------------------------------------
# llama2.c tokenizer.bin

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
_BOS_PIECE, _EOS_PIECE, _UNK_PIECE = b"\n<s>\n", b"\n</s>\n", b"<unk>"


def read_llama2c_tokenizer(path: str) -> tuple[int, list[bytes], list[float]]:
  """(max_token_length, pieces, scores) of a llama2.c tokenizer.bin; errors name the file,
  the token id and the byte offset where it stops making sense."""
  with open(path, "rb") as fh:
    data = fh.read()
  if len(data) < 4:
    raise ValueError(f"{path}: {len(data)} bytes, too short for the 4-byte max_token_length "
                     "of a llama2.c tokenizer.bin")
  (max_len,) = struct.unpack_from("<I", data, 0)
  pieces, scores, pos = [], [], 4
  while pos < len(data):
    i = len(pieces)
    if pos + 8 > len(data):
      raise ValueError(f"{path}: token {i} at byte {pos}: {len(data) - pos} bytes left, fewer "
                       "than the 8 of its score and length; the file is truncated")
    score, n = struct.unpack_from("<fi", data, pos)
    if not 0 <= n <= max_len:
      raise ValueError(f"{path}: token {i} at byte {pos} has length {n}, expected 0.."
                       f"{max_len} (the header's max_token_length); not a llama2.c "
                       "tokenizer.bin?")
    if pos + 8 + n > len(data):
      raise ValueError(f"{path}: token {i} at byte {pos} needs {n} bytes, {len(data) - pos - 8} "
                       "are left; the file is truncated")
    pieces.append(data[pos + 8:pos + 8 + n])
    scores.append(float(score))
    pos += 8 + n
  return max_len, pieces, scores


def write_llama2c_tokenizer(path: str, pieces: Sequence[bytes], scores: Sequence[float]) -> None:
  """Writes `pieces` / `scores` as llama2.c's tokenizer.py `export()` does."""
  with open(path, "wb") as fh:
    fh.write(struct.pack("<I", max((len(p) for p in pieces), default=0)))
    for p, s in zip(pieces, scores):
      fh.write(struct.pack("<fi", s, len(p)) + p)


class Llama2cTokenizer:
  """llama2.c's tokenizer.bin, encoded with run.c's rules (module docstring).

  `vocab_size`, when given (the model's), must equal the number of entries in the file.
  BOS / EOS are the "\\n<s>\\n" / "\\n</s>\\n" pieces (ids 1 and 2 in llama2.c's files);
  `stop_ids` holds both, as run.c ends a sample at BOS.
  """

  def __init__(self, path: str, vocab_size: int | None = None):
    if not os.path.isfile(path):
      raise FileNotFoundError(errno.ENOENT, "no such file; expected a llama2.c tokenizer.bin",
                              path)
    self.source = path
    _, self.pieces, self.scores = read_llama2c_tokenizer(path)
    self.vocab_size = len(self.pieces)
    if vocab_size is not None and vocab_size != self.vocab_size:
      raise ValueError(f"{path}: {self.vocab_size} tokens, but the model's vocabulary has "
                       f"{vocab_size}; is this the model's tokenizer.bin?")
    self.byte_of: dict[int, int] = {}   # byte-fallback piece id -> byte value
    byte_ids: dict[int, int] = {}       # byte value -> its piece id (first one wins)
    for i, p in enumerate(self.pieces):
      m = _BYTE_PIECE.fullmatch(p)
      if m:
        self.byte_of[i] = int(m.group(1), 16)
        byte_ids.setdefault(int(m.group(1), 16), i)
    self._byte_ids = byte_ids
    first = {}
    for i, p in enumerate(self.pieces):
      first.setdefault(p, i)
    self.bos_id, self.eos_id = first.get(_BOS_PIECE), first.get(_EOS_PIECE)
    self._special = {i for i in (self.bos_id, self.eos_id, first.get(_UNK_PIECE))
                     if i is not None}
    self.stop_ids = tuple(i for i in (self.eos_id, self.bos_id) if i is not None)
    # run.c starts every prompt with BOS (SentencePiece's Llama convention); no chat template.
    self.add_bos, self.add_eos = self.bos_id is not None, False
    self.chat_template, self.special_tokens = None, {}
    # Pieces text can become (run.c's sorted_vocab, less special and byte pieces): the lowest
    # id wins for a duplicated string, as a bsearch over ids sorted by string would find one.
    self._ids: dict[bytes, int] = {}
    for i, p in enumerate(self.pieces):
      if i not in self._special and i not in self.byte_of:
        self._ids.setdefault(p, i)
    self._merges: dict[tuple[int, int], tuple[float, int] | None] = {}

  def _byte_token(self, b: int, text: str) -> int:
    if b not in self._byte_ids:
      raise ValueError(f"{self.source}: byte 0x{b:02X} of {text[:40]!r} has no piece and no "
                       f"<0x{b:02X}> byte-fallback piece")
    return self._byte_ids[b]

  def _initial(self, text: str) -> list[int]:
    """One id per UTF-8 code point, or its bytes' fallback ids (run.c's first pass)."""
    data = text.encode("utf-8", errors="surrogateescape")
    ids = []
    if data:
      space = self._ids.get(b" ")
      ids.append(space if space is not None else self._byte_token(0x20, text))
    start = 0
    for j in range(len(data)):
      # A code point ends before the next non-continuation byte, or after 4 bytes.
      nxt = data[j + 1] if j + 1 < len(data) else 0
      if (nxt & 0xC0) == 0x80 and j + 1 - start < 4:
        continue
      chunk = data[start:j + 1]
      i = self._ids.get(chunk)
      ids.extend([i] if i is not None else [self._byte_token(b, text) for b in chunk])
      start = j + 1
    return ids

  def _merge(self, a: int, b: int) -> tuple[float, int] | None:
    """(score, id) of the piece pieces[a] + pieces[b], or None (memoized)."""
    key = (a, b)
    if key not in self._merges:
      i = self._ids.get(self.pieces[a] + self.pieces[b])
      # run.c starts its best score at -1e10: merges scoring at or below it never happen.
      self._merges[key] = None if i is None or self.scores[i] <= -1e10 else (self.scores[i], i)
    return self._merges[key]

  def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
    tok = self._initial(text)
    n = len(tok)
    nxt = list(range(1, n + 1))          # linked list over the initial positions
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []

    def push(i):
      j = nxt[i]
      if j < n:
        m = self._merge(tok[i], tok[j])
        if m is not None:
          # Highest score first, then leftmost: run.c's strict '>' keeps the first maximum.
          heapq.heappush(heap, (-m[0], i, tok[i], tok[j], m[1]))

    for i in range(n - 1):
      push(i)
    while heap:
      _, i, a, b, new = heapq.heappop(heap)
      j = nxt[i] if alive[i] else n
      if j >= n or tok[i] != a or tok[j] != b:
        continue   # stale: a neighbour merged since this entry was pushed
      tok[i] = new
      alive[j] = False
      nxt[i] = nxt[j]
      if nxt[j] < n:
        prv[nxt[j]] = i
      if prv[i] >= 0:
        push(prv[i])
      push(i)
    return _with_specials(self, [t for t, ok in zip(tok, alive) if ok], bos, eos)

  def decode(self, ids: Sequence[int]) -> str:
    out, at_start = [], True
    for i in _check_ids(self, ids):
      if i in (self.bos_id, self.eos_id):
        at_start = i == self.bos_id
        continue
      piece = bytes([self.byte_of[i]]) if i in self.byte_of else self.pieces[i]
      if at_start and i not in self.byte_of and piece.startswith(b" "):
        piece = piece[1:]   # the dummy prefix
      out.append(piece)
      at_start = False
    return b"".join(out).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------


GGUF_MAGIC = b"GGUF"


def is_gguf(path: str) -> bool:
  """Whether `path` names a GGUF file: its first bytes are GGUF's magic, or (a path that
  is not a file) its name ends in .gguf."""
  if not os.path.isfile(path):
    return path.endswith(".gguf")
  with open(path, "rb") as fh:
    return fh.read(len(GGUF_MAGIC)) == GGUF_MAGIC


TOKENIZER_FILES = ("a tokenizer.json, a directory holding one, a llama2.c tokenizer.bin or a "
                   "GGUF file")


def check_path(path: str, flag: str = "--tokenizer") -> None:
  """Refuses a tokenizer path (the value of `flag`) that names nothing a loader could read:
  an entry point calls it before any checkpoint is opened."""
  if os.path.isdir(path):
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
      raise errors.expected(f"{flag}={path}", "a directory without tokenizer.json",
                            TOKENIZER_FILES)
  elif not os.path.isfile(path):
    raise errors.expected(f"{flag}={path}", "no such file or directory", TOKENIZER_FILES)


def load_tokenizer(path: str, vocab_size: int | None = None) -> Tokenizer:
  """A directory holding tokenizer.json (a HF model directory), a `*.json` file (HF), or
  any other file (llama2.c tokenizer.bin, checked against `vocab_size` when given). A GGUF
  file's vocabulary is read by `llm.checkpoints.load_tokenizer` (which `llm.gguf_vocab` builds
  with this module's HFTokenizer)."""
  if is_gguf(path):
    raise errors.expected(path, "a GGUF file", "a tokenizer.json, a directory holding one or "
                          "a llama2.c tokenizer.bin here (llm.checkpoints.load_tokenizer, "
                          "behind the --tokenizer of generate and llm_quant, reads a GGUF's "
                          "vocabulary)")
  if os.path.isdir(path):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise FileNotFoundError(errno.ENOENT, "no tokenizer.json in this directory", path)
    tok: Tokenizer = HFTokenizer(file)
  elif path.endswith(".json"):
    tok = HFTokenizer(path)
  else:
    return Llama2cTokenizer(path, vocab_size)
  if vocab_size is not None and tok.vocab_size > vocab_size:
    raise ValueError(f"{tok.source}: {tok.vocab_size} tokens, more than the model's vocabulary "
                     f"of {vocab_size}")
  return tok
