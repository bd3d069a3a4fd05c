"""llm.chat_data: chat conversations, the loss on the assistant's tokens, packed rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm import chat_data
from llm import tokenizer as tok_lib
from tests import real_models

# A ChatML-like template over bytes: the reply and "<e>\n" are the assistant's.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<e>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class ChatBytes(tok_lib.ByteTokenizer):
  chat_template = TEMPLATE


CONV = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3"}, {"role": "assistant", "content": "6"}]


def _text(ids):
  return bytes(np.asarray(ids).tolist()).decode()


def test_the_assistant_tokens_are_the_ones_learned():
  c = chat_data.encode_conversation(ChatBytes(), CONV)
  assert _text(c.tokens) == "<user>2+2<e>\n<assistant>4<e>\n<user>3+3<e>\n<assistant>6<e>\n"
  learned = _text(c.tokens[c.learn])
  assert learned == "4<e>\n6<e>\n"
  assert chat_data.check_split(ChatBytes(), CONV)


def test_packed_rows_mask_targets_to_the_replies(tmp_path):
  path = tmp_path / "chat.jsonl"
  convs = [CONV, CONV[:2], [{"role": "system", "content": "s"}, *CONV[:2]]]
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs * 4))
  src = chat_data.ChatSource(str(path), ChatBytes(), seq_len=96, batch_size=2, seed=1)
  assert len(src.train) == 11 and len(src.eval) == 1
  b = src.batch(0)
  assert b.inputs.shape == (2, 96) and b.mask.dtype == np.float32
  for r in range(2):
    t = b.targets[r][b.mask[r] > 0]
    assert set(_text(t).replace("<e>\n", "")) <= set("46")   # only replies are targets
    assert "<e>\n" in _text(t)
  # every reply token of every conversation is a target exactly once per epoch
  per_epoch = sum(int(c.learn[1:].sum()) for c in src.train)
  rows_seen, total, k = 0, 0.0, 0
  rows = len(src._epoch_rows(0))
  while rows_seen + 2 <= rows:
    total += float(src.batch(k).mask.sum())
    rows_seen += 2
    k += 1
  if rows_seen == rows:
    assert total == per_epoch
  # resumable: batch k is a function of (seed, k)
  again = chat_data.ChatSource(str(path), ChatBytes(), seq_len=96, batch_size=2, seed=1)
  for k in (5, 0, 3):
    np.testing.assert_array_equal(again.batch(k).inputs, src.batch(k).inputs)
  ev = list(chat_data.ChatSource(str(path), ChatBytes(), 96, 2, split="eval").batches())
  assert len(ev) == 1 and ev[0].mask.sum() > 0


def test_a_single_conversation_is_refused_not_evaluated_on_nothing(tmp_path):
  """One conversation leaves none to hold out: refused (else the run trains on it and
  evaluates on no batches, which LMEvaluator reports as loss 0.0, perplexity 1.0)."""
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONV}) + "\n")
  for split in ("train", "eval"):
    with pytest.raises(ValueError, match=r"chat\.jsonl: 1 conversation\(s\); expected at least "
                       r"2 \(one held out for evaluation\)"):
      chat_data.ChatSource(str(path), ChatBytes(), 96, 2, split=split)


@pytest.mark.parametrize("line,message", [
    ('{"messages": [}', r"chat\.jsonl:2:15: not JSON"),
    ('[1, 2]', r"chat\.jsonl:2: \[1, 2\]; expected an object with \"messages\""),
    ('{"messages": [{"role": "user", "content": "x"}]}', r"chat\.jsonl:2: no assistant message"),
    ('{"messages": [{"role": "user"}]}', r"chat\.jsonl:2: entry 0 .* lacks \['content'\]"),
])
def test_a_bad_line_names_file_and_line(tmp_path, line, message):
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONV}) + "\n" + line + "\n")
  with pytest.raises(ValueError, match=message):
    chat_data.read_chat_file(str(path), ChatBytes())


def test_a_line_that_is_not_utf8_names_file_line_and_byte(tmp_path):
  """A Latin-1 "é" on line 2: not a bare UnicodeDecodeError at a position in a read buffer."""
  path = tmp_path / "chat.jsonl"
  path.write_bytes(json.dumps({"messages": CONV}).encode() + b"\n" +
                   json.dumps({"messages": CONV}).replace("2+2", "caf\u00e9").encode("latin-1"))
  with pytest.raises(ValueError, match=r"chat\.jsonl:2: byte 46 of the line \(0xE9\) is not "
                     r"UTF-8 \(invalid continuation byte\)"):
    chat_data.read_chat_file(str(path), ChatBytes())


def test_a_conversation_longer_than_a_row_is_refused(tmp_path):
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONV}) + "\n")
  with pytest.raises(ValueError, match=r"chat\.jsonl:1: 58 tokens; expected at most 40"):
    chat_data.read_chat_file(str(path), ChatBytes(), max_len=40)


@pytest.mark.models
def test_smollm2_template_pieces_encode_as_the_whole():
  from llm import checkpoints
  tok = checkpoints.load_tokenizer(real_models.smollm2_gguf_or_skip())
  conv = [{"role": "system", "content": "You are terse."}, *CONV]
  c = chat_data.encode_conversation(tok, conv)
  assert chat_data.check_split(tok, conv)
  replies = tok.decode(c.tokens[c.learn].tolist(), skip_special=False)
  assert replies == "4<|im_end|>\n6<|im_end|>\n"


# A SentencePiece vocabulary (GGUF `llama`: "▁" before the text, byte fallback) with the
# Zephyr template (TinyLlama's) and Llama 2's, which writes bos_token itself.
ZEPHYR = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
          "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
          "{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")


def _spm(template):
  from llm import gguf_vocab
  normal = ["▁", "▁4", "▁6", "4", "6", "2", "3", "+"]
  v = gguf_vocab.GGUFVocab(
      model="llama", tokens=["<unk>", "<s>", "</s>", *("<0x%02X>" % b for b in range(256)),
                             *normal],
      token_types=[2, 3, 3] + [6] * 256 + [1] * len(normal),
      scores=[0.0] * 259 + [-float(i) for i in range(len(normal))], bos_id=1, eos_id=2,
      unk_id=0, chat_template=template)
  return gguf_vocab.vocab_tokenizer(v, "spm.gguf")


@pytest.mark.parametrize("template,learned", [
    (ZEPHYR, ["4", "</s>", "▁", "<0x0A>", "6", "</s>", "▁", "<0x0A>"]),
    (LLAMA2, ["▁4", "▁", "</s>", "▁6", "▁", "</s>"]),
])
def test_sentencepiece_ids_are_the_whole_texts(template, learned):
  """The whole rendered text is encoded: encoding the pieces apart puts a "▁" before each
  (Zephyr's reply "4" becomes "▁4", Llama 2's " 4" becomes "▁", "▁4") and adds a BOS (a
  second one before Llama 2's {{ bos_token }}): ids the model never sees when it is prompted
  with encode_chat's."""
  from llm import chat
  tok = _spm(template)
  c = chat_data.encode_conversation(tok, CONV)
  whole = chat.encode_chat(tok, CONV, add_generation_prompt=False)
  assert c.tokens.tolist() == whole      # BOS only where the template writes it (Llama 2)
  assert c.tokens.tolist().count(tok.bos_id) == (template == LLAMA2)
  assert [tok.tokenizers.id_to_token(int(i)) for i in c.tokens[c.learn]] == learned
  assert chat_data.check_split(tok, CONV)
  # The prompt of the second reply is the conversation's tokens before it.
  prompt = chat.encode_chat(tok, CONV[:3])
  assert c.tokens[:len(prompt)].tolist() == prompt and c.learn[len(prompt)]
  assert not c.learn[:len(prompt)][-1]
