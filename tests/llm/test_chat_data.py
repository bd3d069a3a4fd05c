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
