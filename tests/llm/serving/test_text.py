"""ReplyText: stop strings cut the reply before them, a stream never sends text it would take
back (a tail that may become a stop string, a partial UTF-8 character), and the pieces add up
to the final text."""

from __future__ import annotations

from llm.serving.text import ReplyText
from llm.tokenizer import ByteTokenizer


def _stream(reply, ids, final_at=None):
  pieces = []
  for n in range(1, len(ids) + 1):
    pieces.append(reply.update(ids[:n], final=n == final_at))
    if reply.stopped:
      break
  return pieces


def test_a_stop_string_across_tokens_is_held_back_then_cut():
  ids = list("one two. three".encode())
  reply = ReplyText(ByteTokenizer(), stop=(". t",))
  pieces = _stream(reply, ids)
  assert reply.stopped and reply.text == "one two"
  assert "".join(pieces) == "one two"
  # "." and ". " were held back (a prefix of the stop string) until it completed.
  assert pieces[ids.index(ord("."))] == "" and pieces[ids.index(ord(".")) + 1] == ""


def test_partial_utf8_is_held_back_and_skipped_ids_are_not_text():
  ids = list("é!".encode()) + [3]
  reply = ReplyText(ByteTokenizer(), skip_ids=(3,))
  pieces = _stream(reply, ids, final_at=len(ids))
  assert pieces == ["", "é", "!", ""] and reply.text == "é!" and not reply.stopped


def test_a_held_back_tail_that_is_no_stop_is_sent_at_the_end():
  ids = list(b"ab.")
  reply = ReplyText(ByteTokenizer(), stop=(".x",))
  assert _stream(reply, ids, final_at=3) == ["a", "b", "."]
  reply = ReplyText(ByteTokenizer(), stop=(".x",))
  assert _stream(reply, ids) == ["a", "b", ""] and reply.text == "ab."
