"""Chat fine-tuning data: conversations rendered with the checkpoint's chat template, the loss
only on the assistant's tokens, packed into rows.

A chat file is JSON Lines, one conversation per line: `{"messages": [{"role": "user",
"content": "..."}, {"role": "assistant", "content": "..."}, ...]}` (other keys are kept
out). `encode_conversation` renders it with the tokenizer's chat template (`llm.chat`) and
marks the tokens to learn: each assistant message's text as the template writes it, from the
end of the generation prompt that precedes it to the end of its turn (its end-of-turn token
included, so the model learns to stop). The whole rendered text is encoded once (the ids of
`llm.chat.encode_chat`, as transformers' apply_chat_template gives them) and a token is
learned when its character span (the tokenizer's offsets) overlaps a reply, as transformers'
assistant masks are found; encoding the pieces apart would differ where a boundary is not a
special token (a SentencePiece tokenizer puts a "▁" before each piece: Llama 2's " {reply}",
Zephyr's "<|assistant|>\n{reply}"). A tokenizer without offsets (bytes) encodes the pieces
apart, which for bytes is the same. No BOS is added beyond what the template writes (Llama
3's and Llama 2's write it), as at inference (`encode_chat`: transformers'
apply_chat_template and vLLM's chat prompts alike), so a fine-tuned model is trained on the
ids it is prompted with. A template whose render of a conversation does not start
with its render of the conversation's prefix (one that rewrites earlier turns) is refused
naming the line.

`ChatSource` serves them like the other LM sources: the train conversations in a seeded
order per epoch, packed by next-fit into rows of `seq_len` tokens (documents never split,
`llm.packing.batch.to_lm_batch`: segment ids and positions, so each conversation is computed
as if alone), targets masked to the assistant's tokens; batch k is a function of (seed, k),
so a resumed run sees the batches the uninterrupted one would. The last `eval_fraction` of
the conversations (at least one) is held out for evaluation.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from typing import Iterator, Sequence

import numpy as np

from llm import chat as chat_lib
from llm.data import LMBatch
from llm.packing import batch as batch_lib


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A conversation's token ids and which of them the model learns (the assistant's)."""
  tokens: np.ndarray   # [L] int32
  learn: np.ndarray    # [L] bool

  def __len__(self) -> int:
    return len(self.tokens)


def _segments(tok, messages: Sequence[dict], where: str) -> list[tuple[str, bool]]:
  """The rendered conversation as (text, learn) pieces in order."""
  template = chat_lib._need_template(tok, where)

  def render(msgs, gen):
    return chat_lib.render(template, msgs, add_generation_prompt=gen,
                           special_tokens=tok.special_tokens, where=where)

  full = render(messages, False)
  pieces, done = [], 0
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    before = render(messages[:i], True)
    through = render(messages[:i + 1], False)
    if not (through.startswith(before) and full.startswith(through) and len(before) >= done):
      raise ValueError(f"{where}: the chat template's text for messages 0..{i} is not a prefix "
                       "of its text for the whole conversation; expected a template that "
                       "appends turns (the assistant's tokens cannot be located)")
    if len(before) > done:
      pieces.append((full[done:len(before)], False))
    pieces.append((full[len(before):len(through)], True))
    done = len(through)
  if done < len(full):
    pieces.append((full[done:], False))
  return pieces


def encode_conversation(tok, messages: Sequence[dict], where: str = "conversation"
                        ) -> Conversation:
  """Token ids of the rendered conversation (BOS as the tokenizer adds it) and the mask of
  the assistant's tokens; a conversation without an assistant message is an error."""
  chat_lib.check_messages(list(messages), where)
  if not any(m["role"] == "assistant" for m in messages):
    raise ValueError(f"{where}: no assistant message; expected at least one (the tokens "
                     "the model learns)")
  pieces = _segments(tok, messages, where)
  encode = getattr(tok, "encode_with_offsets", None)
  if encode is not None:
    text = "".join(t for t, _ in pieces)
    ids, offsets = encode(text)
    # inside[c]: how many reply characters lie before character c.
    inside = np.concatenate([[0], np.cumsum(np.concatenate(
        [np.full(len(t), r, np.int64) for t, r in pieces]))])
    # A token is learned when a reply character lies in its span [start, end) (an empty
    # span: the character at start).
    learn = [bool(inside[min(max(e, s + 1), len(text))] > inside[min(s, len(text))])
             for s, e in offsets]
  else:
    ids, learn = [], []
    for text, is_reply in pieces:
      piece = tok.encode(text)
      ids += piece
      learn += [is_reply] * len(piece)
  return Conversation(np.asarray(ids, np.int32), np.asarray(learn, bool))


def check_split(tok, messages: Sequence[dict]) -> bool:
  """Whether the conversation's ids are `llm.chat.encode_chat`'s: always, for a tokenizer
  with offsets; for one without, whether encoding the pieces apart gives the ids of the
  whole text."""
  conv = encode_conversation(tok, messages)
  whole = chat_lib.encode_chat(tok, messages, add_generation_prompt=False)
  return conv.tokens.tolist() == list(whole)


def chat_path(data: str | None) -> str | None:
  """The file of a `--data=chat:FILE` setting (None when unset); another form is an error
  naming the flag."""
  if data is None:
    return None
  kind, sep, path = data.partition(":")
  if kind != "chat" or not sep or not path:
    from core import errors
    raise errors.expected(f"--data={data}", "not a chat file", "chat:FILE.jsonl (JSON Lines "
                          "of {\"messages\": [...]}); plain text goes in --text")
  return path


def read_chat_file(path: str, tok, max_len: int | None = None) -> list[Conversation]:
  """The conversations of a JSON Lines chat file; a bad line is a ValueError naming the
  file and line; a conversation longer than `max_len` tokens is one too (rows never split
  a conversation)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(errno.ENOENT, "no such chat file (--data=chat:FILE)", path)
  out = []
  with open(path, "rb") as f:
    for n, raw in enumerate(f, start=1):
      where = f"{path}:{n}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: byte {e.start} of the line (0x{raw[e.start]:02X}) is not "
                         f"UTF-8 ({e.reason}); expected UTF-8 JSON Lines") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}:{e.colno}: not JSON ({e.msg}); expected "
                         '{"messages": [{"role": ..., "content": ...}, ...]}') from None
      if not isinstance(record, dict) or "messages" not in record:
        raise ValueError(f"{where}: {str(record)[:80]}; expected an object with \"messages\"")
      conv = encode_conversation(tok, record["messages"], where)
      if max_len is not None and len(conv) > max_len:
        raise ValueError(f"{where}: {len(conv)} tokens; expected at most {max_len} (a row "
                         "holds whole conversations: raise --seq_len or shorten it)")
      out.append(conv)
  if not out:
    raise ValueError(f"{path}: no conversations; expected JSON Lines of "
                     '{"messages": [...]}')
  return out


def pack_rows(convs: Sequence[Conversation], order: Sequence[int], seq_len: int
              ) -> list[list[int]]:
  """Next-fit of conversations (indices in `order`) into rows of `seq_len` tokens."""
  rows, row, used = [], [], 0
  for i in order:
    n = len(convs[i])
    if row and used + n > seq_len:
      rows.append(row)
      row, used = [], 0
    row.append(int(i))
    used += n
  if row:
    rows.append(row)
  return rows


def lm_batch(convs: Sequence[Conversation], rows: Sequence[Sequence[int]], seq_len: int,
             batch_rows: int) -> LMBatch:
  """`batch_rows` rows of packed conversations (rows beyond `rows` are padding), targets
  masked to the assistant's tokens."""
  rows = [list(r) for r in rows]
  if not rows or len(rows) > batch_rows:
    raise ValueError(f"lm_batch: {len(rows)} rows; expected 1..{batch_rows}")
  b = batch_lib.to_lm_batch([c.tokens for c in convs], rows, seq_len)
  learn = np.zeros_like(b.mask)
  for r, row in enumerate(rows):
    o = 0
    for i in row:
      c = convs[i]
      learn[r, o:o + len(c) - 1] = c.learn[1:]   # target t is token t + 1
      o += len(c)
  pad = batch_rows - len(rows)
  grow = lambda x, fill: np.concatenate([x, np.full((pad, seq_len), fill, x.dtype)])
  positions = np.concatenate([b.positions, np.broadcast_to(
      np.arange(seq_len, dtype=np.int32), (pad, seq_len))])
  return LMBatch(inputs=grow(b.inputs, 0), targets=grow(b.targets, 0),
                 mask=grow(b.mask * learn, 0), positions=positions,
                 segment_ids=grow(b.segment_ids, 0))


class ChatSource:
  """Packed rows of a chat file's conversations (resumable): `batch_size` rows of `seq_len`
  tokens per batch, the train part in a seeded order per epoch; `split="eval"`: the held-out
  conversations once, in file order."""

  def __init__(self, path: str, tok, seq_len: int, batch_size: int, *, split: str = "train",
               eval_fraction: float = 0.1, seed: int = 0,
               conversations: Sequence[Conversation] | None = None):
    if split not in ("train", "eval"):
      raise ValueError(f"ChatSource: split={split!r}; expected 'train' or 'eval'")
    convs = list(conversations) if conversations is not None else read_chat_file(
        path, tok, max_len=seq_len)
    # One held out at least: with none, evaluation would report a loss of 0 over no tokens.
    held = max(1, int(round(len(convs) * eval_fraction)))
    self.train = convs[:len(convs) - held]
    self.eval = convs[len(convs) - held:]
    if not self.train:
      raise ValueError(f"{path}: {len(convs)} conversation(s); expected at least 2 (one held "
                       "out for evaluation)")
    self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
    self.split, self.seed = split, seed
    self.vocab_size = tok.vocab_size
    self._epochs: dict[int, list[list[int]]] = {}
    self._starts = [0]   # the first row of each epoch seen so far

  def _epoch_rows(self, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s rows: the train conversations in its seeded order, packed."""
    if epoch not in self._epochs:
      order = np.random.default_rng((self.seed, epoch)).permutation(len(self.train))
      self._epochs = {epoch: pack_rows(self.train, order, self.seq_len)}   # one kept
    return self._epochs[epoch]

  def _row(self, i: int) -> list[int]:
    """Row i of the sequence of every epoch's rows in turn."""
    while i >= self._starts[-1] + len(self._epoch_rows(len(self._starts) - 1)):
      self._starts.append(self._starts[-1] + len(self._epoch_rows(len(self._starts) - 1)))
    epoch = int(np.searchsorted(self._starts, i, side="right")) - 1
    return self._epoch_rows(epoch)[i - self._starts[epoch]]

  def batch(self, k: int) -> LMBatch:
    """Train batch k: rows k*B .. k*B+B-1 of the epochs' rows in turn."""
    rows = [self._row(i) for i in range(k * self.batch_size, (k + 1) * self.batch_size)]
    return lm_batch(self.train, rows, self.seq_len, self.batch_size)

  def batches(self, start: int = 0) -> Iterator[LMBatch]:
    if self.split == "eval":
      yield from self._eval_batches()
      return
    k = start
    while True:
      yield self.batch(k)
      k += 1

  def _eval_batches(self) -> Iterator[LMBatch]:
    rows = pack_rows(self.eval, range(len(self.eval)), self.seq_len)
    for i in range(0, len(rows), self.batch_size):
      yield lm_batch(self.eval, rows[i:i + self.batch_size], self.seq_len, self.batch_size)
