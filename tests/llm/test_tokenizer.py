"""llm.tokenizer: tokenizers built here, against references.

llama2.c's tokenizer.bin: hand-worked encodings of a tiny vocabulary, then the same random
vocabulary run through the `tokenizers` library's BPE with SentencePiece's conventions (the
conversion transformers applies to Llama 2's tokenizer), which must give the same ids.
tokenizer.json: a small BPE trained with `tokenizers` on a few sentences.
"""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from llm import tokenizer as T
from llm.data import TextSource

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.environ.get("LLM_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
TOK512 = os.path.join(DATA_DIR, "llama2c", "tok512.bin")

SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her friends.",
    "One day, she saw a big, red ball under the old tree.",
    "The quick brown fox jumps over the lazy dog.",
    "Lily's mom said: \"Don't worry, we can find it together!\"",
] * 4


# ---------------------------------------------------------------------------------------------
# llama2.c tokenizer.bin


def _bin_pieces(normal: dict[str, float]) -> tuple[list[bytes], list[float]]:
  """A llama2.c vocabulary: <unk>, BOS, EOS, the 256 byte pieces, then `normal` pieces
  (SentencePiece's "▁" written as " ", as llama2.c's tokenizer.py exports them)."""
  pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
  scores = [0.0] * len(pieces)
  for p, s in normal.items():
    pieces.append(p.encode("utf-8"))
    scores.append(s)
  return pieces, scores


# Scores: higher merges first. " " (the dummy prefix), single letters, and merged pieces.
_TINY = {" ": -1.0, "a": -2.0, "b": -3.0, "c": -4.0, "ab": -10.0, "bc": -5.0, "abc": -6.0,
         " a": -20.0, " ab": -7.0, "é": -8.0, "aa": -9.0}


@pytest.fixture
def tiny_bin(tmp_path):
  path = str(tmp_path / "tokenizer.bin")
  T.write_llama2c_tokenizer(path, *_bin_pieces(_TINY))
  return path


def _id(tok, piece):
  return tok.pieces.index(piece.encode("utf-8"))


def test_llama2c_file_format(tiny_bin):
  # The layout of llama2.c's tokenizer.py export(), written by hand here.
  with open(tiny_bin, "rb") as fh:
    data = fh.read()
  assert struct.unpack_from("<I", data, 0)[0] == 6            # len(b"\n</s>\n")
  assert struct.unpack_from("<fi", data, 4) == (0.0, 5) and data[12:17] == b"<unk>"
  tok = T.Llama2cTokenizer(tiny_bin, vocab_size=259 + len(_TINY))
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.stop_ids) == (270, 1, 2, (2, 1))
  assert tok.byte_of[3] == 0 and tok.byte_of[3 + 0x41] == 0x41   # run.c's "+3" byte rule
  assert tok.scores[_id(tok, "bc")] == -5.0


def test_llama2c_hand_worked_encodings(tiny_bin):
  tok = T.Llama2cTokenizer(tiny_bin)
  i = lambda p: _id(tok, p)  # noqa: E731
  # "abc": [" ", a, b, c]; candidates " a" -20, ab -10, bc -5 -> bc; then " a" -20, abc -6 ->
  # abc; then " abc" is no piece: done.
  assert tok.encode("abc") == [i(" "), i("abc")]
  # "ab": [" ", a, b] -> ab (-10 beats " a" -20) -> " ab" (-7).
  assert tok.encode("ab", bos=True, eos=True) == [1, i(" ab"), 2]
  # "cab": [" ", c, a, b] -> ab -> no " c", "cab": [" ", c, ab].
  assert tok.encode("cab") == [i(" "), i("c"), i("ab")]
  # Ties go to the leftmost pair: "aaa" -> [" ", aa, a] (the rightmost first would give
  # [" ", a, aa] and then [" a", aa]).
  assert tok.encode("aaa") == [i(" "), i("aa"), i("a")]
  assert tok.encode("bcbc") == [i(" "), i("bc"), i("bc")]
  # Byte fallback: "z" and "€" (3 UTF-8 bytes) are no pieces; "é" is one.
  assert tok.encode("zé€") == [i(" "), 3 + ord("z"), i("é"), 3 + 0xE2, 3 + 0x82, 3 + 0xAC]
  assert tok.encode("") == []


def test_llama2c_merges_never_make_special_or_byte_pieces(tmp_path):
  """Text spelling "<0x41>" or "\n<s>\n" stays text, as in SentencePiece (run.c's merge loop
  would turn it into the byte "A" or into BOS)."""
  path = str(tmp_path / "tokenizer.bin")
  T.write_llama2c_tokenizer(path, *_bin_pieces(
      {" ": -1.0, "<0x4": -2.0, "1>": -3.0, "\n<s": -4.0, ">\n": -5.0, "<": -6.0, "0": -7.0,
       "x": -8.0, "4": -9.0, "1": -10.0, ">": -11.0, "<0": -12.0, "<0x": -13.0, "s": -14.0,
       "\n<": -15.0, "\n": -16.0}))
  tok = T.Llama2cTokenizer(path)
  for text in ("<0x41>", "\n<s>\n"):
    ids = tok.encode(text)
    assert 3 + 0x41 not in ids and 1 not in ids and len(ids) == 3, ids   # " ", two halves
    assert tok.decode(ids) == text


def test_llama2c_decode(tiny_bin):
  tok = T.Llama2cTokenizer(tiny_bin)
  for text in ["abc", "cab bcbc", "zé€ ab", " leading space", "a\nb\tc", "🦙"]:
    ids = tok.encode(text, bos=True, eos=True)
    assert tok.decode(ids) == text, ids
  # Only the dummy prefix after BOS (or at the start) is stripped; bytes that do not form
  # UTF-8 decode to U+FFFD.
  i = lambda p: _id(tok, p)  # noqa: E731
  assert tok.decode([1, i(" ab"), i(" ab"), 1, i(" a")]) == "ab aba"
  assert tok.decode([i("a"), 3 + 0xE2, 3 + 0x82]) == "a\ufffd"
  with pytest.raises(ValueError, match=r"token ids \[270\] outside \[0, 270\)"):
    tok.decode([270])


def _random_vocab(rng: random.Random, alphabet: str, n: int) -> dict[str, float]:
  """n distinct pieces over `alphabet` (plus "▁"-led words) with distinct scores."""
  pieces = set(alphabet) | {"▁"}
  while len(pieces) < n:
    k = rng.randint(2, 5)
    w = "".join(rng.choice(alphabet) for _ in range(k))
    pieces.add("▁" + w[1:] if rng.random() < 0.3 else w)
  scores = rng.sample(range(-10 * n, 0), len(pieces))
  return {p: float(s) for p, s in zip(sorted(pieces), scores)}


def _hf_sentencepiece_bpe(vocab: dict[str, float], bin_pieces: list[bytes]) -> HFTok:
  """The same vocabulary as a `tokenizers` BPE with byte fallback, SentencePiece-style: what
  transformers' LlamaConverter builds from a tokenizer.model (merges ranked by the score of
  the merged piece)."""
  ids = {p.decode("utf-8").replace(" ", "▁") if not p.startswith(b"<0x") and i > 2
         else p.decode("utf-8"): i for i, p in enumerate(bin_pieces)}
  merges = []
  for piece, score in vocab.items():
    for cut in range(1, len(piece)):
      a, b = piece[:cut], piece[cut:]
      if a in vocab and b in vocab:
        merges.append((-score, ids[piece], a, b))
  merges = [(a, b) for *_, a, b in sorted(merges)]
  hf = HFTok(models.BPE(vocab=ids, merges=merges, unk_token="<unk>", byte_fallback=True,
                        fuse_unk=True))
  hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                        normalizers.Replace(" ", "▁")])
  hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                  decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  return hf


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_llama2c_encoding_equals_tokenizers_bpe(tmp_path, seed):
  rng = random.Random(seed)
  alphabet = "abcde fgh.é"
  vocab = _random_vocab(rng, alphabet.replace(" ", "▁"), 120)   # SentencePiece's form
  pieces, scores = _bin_pieces({p.replace("▁", " "): s for p, s in vocab.items()})
  path = str(tmp_path / "tokenizer.bin")
  T.write_llama2c_tokenizer(path, pieces, scores)
  ours = T.Llama2cTokenizer(path)
  ref = _hf_sentencepiece_bpe(vocab, pieces)
  texts = ["".join(rng.choice(alphabet + "xyz€\n") for _ in range(rng.randint(1, 60)))
           for _ in range(300)]
  n_merged = 0
  for text in texts:
    want = ref.encode(text, add_special_tokens=False).ids
    got = ours.encode(text)
    assert got == want, text
    assert ours.decode(got) == text == ref.decode(want)
    n_merged += len(got) < len(text.encode()) + 1
  assert n_merged > 250      # merges really happen


def test_llama2c_errors(tmp_path, tiny_bin):
  with pytest.raises(ValueError, match=r"tokenizer.bin: 270 tokens, but the model's vocabulary "
                     "has 512"):
    T.Llama2cTokenizer(tiny_bin, vocab_size=512)
  size = os.path.getsize(tiny_bin)
  with open(tiny_bin, "r+b") as fh:
    fh.truncate(size - 2)
  with pytest.raises(ValueError, match=r"tokenizer.bin: token 269 at byte \d+ needs 2 bytes, 0 "
                     "are left; the file is truncated"):
    T.Llama2cTokenizer(tiny_bin)
  with open(tiny_bin, "r+b") as fh:
    fh.truncate(size - 9)
  with pytest.raises(ValueError, match="token 269 at byte .*fewer than the 8 .*truncated"):
    T.Llama2cTokenizer(tiny_bin)
  # A vocabulary without byte pieces cannot encode what it lacks.
  path = str(tmp_path / "nobytes.bin")
  T.write_llama2c_tokenizer(path, [b"<unk>", b"\n<s>\n", b"\n</s>\n", b" ", b"a"], [0.0] * 5)
  with pytest.raises(ValueError, match=r"byte 0x7A of 'az' has no piece and no <0x7A>"):
    T.Llama2cTokenizer(path).encode("az")


def test_stories260k_tokenizer():
  """tok512.bin beside stories260K.bin, when present (llama2.c's custom 512-token vocab)."""
  if not os.path.exists(TOK512):
    pytest.skip(f"{TOK512} absent (the shared data holds no tokenizer for stories260K)")
  tok = T.Llama2cTokenizer(TOK512, vocab_size=512)
  assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.byte_of[3] == 0
  text = "Once upon a time, there was a little girl named Lily."
  ids = tok.encode(text, bos=True)
  assert ids[0] == 1 and len(ids) < len(text) and tok.decode(ids) == text


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json


def train_bpe(d, vocab_size=400, config: dict | None = None) -> str:
  """A byte-level BPE trained on SENTENCES with <s> / </s> specials, saved as DIR/tokenizer.json
  (and `config` as DIR/tokenizer_config.json)."""
  tok = HFTok(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  os.makedirs(d, exist_ok=True)
  tok.save(os.path.join(d, "tokenizer.json"))
  if config is not None:
    with open(os.path.join(d, "tokenizer_config.json"), "w") as fh:
      json.dump(config, fh)
  return os.path.join(d, "tokenizer.json")


def test_hf_tokenizer_round_trip_and_specials(tmp_path):
  path = train_bpe(str(tmp_path / "a"), config={
      "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
  tok = T.load_tokenizer(os.path.dirname(path))
  ref = HFTok.from_file(path)
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.stop_ids) == (
      ref.get_vocab_size(), 1, 2, (2,))
  assert 256 + 3 < tok.vocab_size <= 400     # bytes, specials and learned merges
  for text in SENTENCES[:5] + ["unseen wörds 🦙 too"]:
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=True, eos=True) == [1] + ids + [2]
    assert tok.decode([1] + ids + [2]) == text        # specials are dropped
  assert len(tok.encode(SENTENCES[0])) < len(SENTENCES[0]) / 2   # it learned merges
  # generation_config.json's eos list (as Llama 3 instruct models have) sets the stop ids.
  with open(str(tmp_path / "a" / "generation_config.json"), "w") as fh:
    json.dump({"eos_token_id": [2, 0]}, fh)
  assert T.load_tokenizer(path).stop_ids == (2, 0)
  # Without side files there are no specials, and encode(bos=True) says so.
  bare = T.load_tokenizer(train_bpe(str(tmp_path / "b")))
  assert (bare.bos_id, bare.eos_id, bare.stop_ids) == (None, None, ())
  with pytest.raises(ValueError, match="tokenizer.json: encode\\(bos=True\\), but the tokenizer "
                     "has no BOS"):
    bare.encode("x", bos=True)
  # config.json's ids serve when tokenizer_config.json names no token.
  with open(str(tmp_path / "b" / "config.json"), "w") as fh:
    json.dump({"bos_token_id": 1, "eos_token_id": 2}, fh)
  assert T.load_tokenizer(str(tmp_path / "b")).bos_id == 1
  # Without generation_config.json, transformers stops at config.json's eos_token_id list
  # (Llama 3.1's has three); every one is a stop id, not only its first.
  with open(str(tmp_path / "b" / "config.json"), "w") as fh:
    json.dump({"eos_token_id": [2, 0]}, fh)
  assert T.load_tokenizer(str(tmp_path / "b")).stop_ids == (2, 0)


def test_hf_tokenizer_errors(tmp_path):
  path = train_bpe(str(tmp_path / "a"), config={"bos_token": "<bos>"})
  with pytest.raises(ValueError, match="bos_token '<bos>' \\(from tokenizer_config.json\\) is "
                     "not in the vocabulary"):
    T.load_tokenizer(path)
  assert T.HFTokenizer(path, bos_token="<s>").bos_id == 1      # the argument overrides
  with pytest.raises(ValueError, match=r"\d+ tokens, more than the model's vocabulary of 100"):
    T.load_tokenizer(train_bpe(str(tmp_path / "b")), vocab_size=100)
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  with pytest.raises(ValueError, match="bad.json: not a Hugging Face tokenizer.json"):
    T.load_tokenizer(str(bad))
  with pytest.raises(FileNotFoundError, match="no tokenizer.json in this directory"):
    T.load_tokenizer(str(tmp_path))


def test_a_tokenizer_flag_naming_nothing_is_refused_naming_the_flag(tmp_path):
  """--tokenizer's path (find_tokenizer's `flag`): the flag, the value, what it takes; a
  missing file named alone as 'expected a llama2.c tokenizer.bin' leaves the user to guess
  which setting gave the path."""
  from core import errors
  from llm import checkpoints as C
  want = ("; expected a tokenizer.json, a directory holding one, a llama2.c tokenizer.bin or "
          "a GGUF file")
  nope = str(tmp_path / "nope.bin")
  with pytest.raises(errors.UserError) as e:
    C.find_tokenizer("llama2c:/unused.bin", nope, 512)
  assert str(e.value) == f"--tokenizer={nope}: no such file or directory{want}"
  with pytest.raises(errors.UserError) as e:
    T.check_path(str(tmp_path))
  assert str(e.value) == f"--tokenizer={tmp_path}: a directory without tokenizer.json{want}"
  T.check_path(train_bpe(str(tmp_path / "a")))   # a file, and a directory holding one
  T.check_path(str(tmp_path / "a"))


def test_byte_tokenizer():
  tok = T.ByteTokenizer()
  assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
  assert tok.decode([195]) == "\ufffd"
  with pytest.raises(ValueError, match="has no BOS"):
    tok.encode("x", bos=True)


# ---------------------------------------------------------------------------------------------
# Training data through a tokenizer


def test_text_source_with_tokenizer(tmp_path):
  path = train_bpe(str(tmp_path / "a"))
  tok = T.load_tokenizer(path)
  text_file = tmp_path / "text.txt"
  text = " ".join(SENTENCES) * 3
  text_file.write_text(text, encoding="utf-8")
  ids = np.asarray(tok.encode(text), np.int32)
  src = TextSource(str(text_file), 16, 4, tokenizer=tok, seed=1)
  assert src.vocab_size == tok.vocab_size and src.tokens.dtype == np.int32
  cut = int(len(ids) * 0.95)
  np.testing.assert_array_equal(src.tokens, ids[:cut])
  b = src.batch(3)
  # Every window is a slice of the encoded text.
  for row_in, row_t in zip(b.inputs, b.targets):
    s = next(s for s in range(cut) if (ids[s:s + 16] == row_in).all())
    np.testing.assert_array_equal(row_t, ids[s + 1:s + 17])
  ev = TextSource(str(text_file), 16, 4, tokenizer=tok, split="eval")
  np.testing.assert_array_equal(ev.tokens, ids[cut:])
  bad = tmp_path / "latin1.txt"
  bad.write_bytes(b"caf\xe9 " * 100)
  with pytest.raises(ValueError, match=r"latin1.txt: byte 3 \(0xE9\) is not UTF-8"):
    TextSource(str(bad), 16, 4, tokenizer=tok)


def test_hf_tokenizer_adds_bos_as_its_files_say(tmp_path):
  """add_bos / add_eos: tokenizer_config.json's flags win; else the post-processor decides
  (a TemplateProcessing like Llama 3's adds BOS; SmolLM2's byte-level one adds nothing)."""
  from tokenizers import processors
  conf = {"bos_token": "<s>", "eos_token": "</s>"}
  path = train_bpe(str(tmp_path / "a"), config=conf)
  assert (T.load_tokenizer(path).add_bos, T.load_tokenizer(path).add_eos) == (False, False)
  ref = HFTok.from_file(path)
  ref.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  ref.save(path)
  tok = T.load_tokenizer(path)
  assert (tok.add_bos, tok.add_eos, tok.bos_id) == (True, False, 1)
  assert tok.encode("the park", bos=tok.add_bos) == ref.encode("the park").ids
  for flags, want in (({"add_bos_token": False}, (False, False)),
                      ({"add_bos_token": True, "add_eos_token": True}, (True, True))):
    with open(tmp_path / "a" / "tokenizer_config.json", "w") as fh:
      json.dump({**conf, **flags}, fh)
    tok = T.load_tokenizer(path)
    assert (tok.add_bos, tok.add_eos) == want
  with open(tmp_path / "a" / "tokenizer_config.json", "w") as fh:
    json.dump({"add_bos_token": "yes"}, fh)
  with pytest.raises(ValueError, match="add_bos_token='yes', expected true or false"):
    T.load_tokenizer(path)
  ref.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                     special_tokens=[("</s>", 2)])
  ref.save(path)
  with open(tmp_path / "a" / "tokenizer_config.json", "w") as fh:
    json.dump({"bos_token": "</s>"}, fh)   # the post-processor's EOS is not the BOS: fine
  tok = T.load_tokenizer(path)
  assert (tok.add_bos, tok.add_eos, tok.eos_id) == (False, True, 2)


def test_hf_tokenizer_chat_template_sources(tmp_path):
  path = train_bpe(str(tmp_path / "a"), config={"chat_template": "{{ messages[0].content }}"})
  assert T.load_tokenizer(path).chat_template == "{{ messages[0].content }}"
  with open(tmp_path / "a" / "tokenizer_config.json", "w") as fh:
    json.dump({"chat_template": [{"name": "tool_use", "template": "T"},
                                 {"name": "default", "template": "D"}]}, fh)
  assert T.load_tokenizer(path).chat_template == "D"
  (tmp_path / "a" / "chat_template.jinja").write_text("J")   # transformers >= 4.43: it wins
  assert T.load_tokenizer(path).chat_template == "J"
  os.remove(tmp_path / "a" / "chat_template.jinja")
  with open(tmp_path / "a" / "tokenizer_config.json", "w") as fh:
    json.dump({"chat_template": [{"name": "tool_use", "template": "T"}]}, fh)
  with pytest.raises(ValueError, match=r"chat_template lists \['tool_use'\] but no 'default'"):
    T.load_tokenizer(path)
  assert T.ByteTokenizer().chat_template is None
