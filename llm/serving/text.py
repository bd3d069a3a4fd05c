"""A request's reply as text while it is generated: stop strings and what may be streamed.

`ReplyText.update(ids)` decodes the reply's ids (stop token ids left out), finds the first
stop string, and says how much of the text is final: a partial UTF-8 sequence at the end
(decoded as U+FFFD) and a tail that could still become a stop string are held back, so a
stream never sends text it would have to take back. Decoding is of the whole reply each
time (a tokenizer's decode of a few hundred ids costs microseconds; a word's text may
depend on its neighbours, so decoding pieces apart would be wrong for SentencePiece-style
leading spaces).
"""

from __future__ import annotations

from typing import Sequence


class ReplyText:
  """The text of one reply: `text` (cut before a stop string once one appeared), `stopped`
  (a stop string ended it), `emitted` (characters handed out so far)."""

  def __init__(self, tokenizer, stop: Sequence[str] = (), skip_ids: Sequence[int] = ()):
    self.tok = tokenizer
    self.stop = tuple(s for s in stop if s)
    self.skip = set(int(i) for i in skip_ids)
    self.text = ""
    self.stopped = False
    self.emitted = 0

  def update(self, ids: Sequence[int], final: bool = False) -> str:
    """Re-decodes the reply `ids`; returns the new text that is safe to send (all of what is
    left when `final`)."""
    if self.stopped:
      return ""
    text = self.tok.decode([i for i in ids if i not in self.skip])
    hit = [(text.find(s), s) for s in self.stop if s in text]
    if hit:
      at = min(hit)[0]
      text, self.stopped, final = text[:at], True, True
    self.text = text
    safe = len(text)
    if not final:
      safe = len(text.rstrip("\ufffd"))
      # Hold back the longest tail that is a prefix of a stop string.
      safe -= max((n for s in self.stop for n in range(1, min(len(s), safe + 1))
                   if text[safe - n:safe] == s[:n]), default=0)
    safe = max(safe, self.emitted)
    delta = text[self.emitted:safe]
    self.emitted = safe
    return delta
