"""Evaluating a language model: mean token loss and perplexity of a text or a chat file, and
greedy replies scored against expected answers.

Text (`text_batches`): the file's tokens in non-overlapping windows of `seq_len + 1` tokens
that share their boundary token, so every token after the first is predicted exactly once
from at most `seq_len` tokens of context before it (the last window padded, its padding
masked): the protocol `experiments.eval_lm` states and its peer check repeats in
transformers. Chat (`chat_batches`): each conversation on its own row (positions from 0),
the loss only on the assistant's tokens (`llm.chat_data`).

`mean_loss` sums the masked cross-entropy of every batch in float64 on the host: loss =
sum / targets, perplexity = exp(loss), bits per token = loss / ln 2.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from llm.data import LMBatch


def text_batches(tokens: Sequence[int], seq_len: int, batch_size: int,
                 max_windows: int | None = None) -> Iterator[LMBatch]:
  """Batches of windows of `tokens` (module docstring); `max_windows`: the first ones only."""
  for name, v, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                       ("max_windows", 1 if max_windows is None else max_windows, 1)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
      raise ValueError(f"text_batches: {name}={v!r}; expected an integer >= {low}"
                       + (" or None" if name == "max_windows" else ""))
  tokens = np.asarray(tokens, np.int32)
  if tokens.size < 2:
    raise ValueError(f"{tokens.size} token(s); expected at least 2 to predict one")
  starts = list(range(0, tokens.size - 1, seq_len))[:max_windows]
  for i in range(0, len(starts), batch_size):
    rows = starts[i:i + batch_size]
    inputs = np.zeros((batch_size, seq_len), np.int32)
    targets = np.zeros_like(inputs)
    mask = np.zeros((batch_size, seq_len), np.float32)
    for r, s in enumerate(rows):
      win = tokens[s:s + seq_len + 1]
      n = win.size - 1
      inputs[r, :n], targets[r, :n], mask[r, :n] = win[:-1], win[1:], 1.0
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)).copy()
    yield LMBatch(inputs=inputs, targets=targets, mask=mask, positions=pos,
                  segment_ids=np.ones((batch_size, seq_len), np.int32))


def chat_batches(convs, seq_len: int, batch_size: int) -> Iterator[LMBatch]:
  """One conversation per row (in order), targets masked to the assistant's tokens."""
  from llm import chat_data
  for i in range(0, len(convs), batch_size):
    rows = [[j] for j in range(i, min(i + batch_size, len(convs)))]
    yield chat_data.lm_batch(convs, rows, seq_len, batch_size)


@nnx.jit
def _loss_sums(model, inputs, targets, mask, positions, segment_ids):
  # The segment ids keep a row's padding (positions from 0 again after a conversation: the
  # causal mask compares positions) out of its tokens' attention.
  logits, _ = model(inputs, positions_BT=positions, segment_ids_BT=segment_ids)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.sum(ce * mask), jnp.sum(mask)


def mean_loss(model, batches: Iterable[LMBatch]) -> dict[str, float]:
  """{"loss", "perplexity", "bits_per_token", "num_tokens"} of `model` over `batches`
  (rows are single sequences: positions from 0, segment id 1 (0: padding) or none)."""
  total, count = 0.0, 0.0
  for b in batches:
    seg = None if b.segment_ids is None else jnp.asarray(b.segment_ids)
    s, n = _loss_sums(model, jnp.asarray(b.inputs), jnp.asarray(b.targets),
                      jnp.asarray(b.mask), jnp.asarray(b.positions), seg)
    total += float(jax.device_get(s))
    count += float(jax.device_get(n))
  if count == 0:
    raise ValueError("mean_loss: no targets to score")
  loss = total / count
  # exp overflows float64 past a loss of ~709.8 nats: the perplexity is then inf, not e^700
  perplexity = math.exp(loss) if loss < math.log(np.finfo(np.float64).max) else math.inf
  return {"loss": loss, "perplexity": perplexity,
          "bits_per_token": loss / math.log(2.0), "num_tokens": int(count)}


def greedy_replies(model, tok, conversations: Sequence[Sequence[dict]], max_new_tokens: int,
                   batch_size: int = 8) -> list[str]:
  """The greedy reply to each conversation (its messages rendered with the chat template
  and the generation prompt), decoded up to the first stop token."""
  from llm import chat as chat_lib
  from llm import generate as gen_lib
  stop = chat_lib.stop_ids(tok)
  prompts = [chat_lib.encode_chat(tok, list(c)) for c in conversations]
  width = max(len(p) for p in prompts) + max_new_tokens
  out = []
  for i in range(0, len(prompts), batch_size):
    chunk = prompts[i:i + batch_size]
    pad = chunk + [chunk[-1]] * (batch_size - len(chunk))   # one compiled shape
    rows = gen_lib.generate(model, pad, max_new_tokens, stop_tokens=stop, max_len=width)
    out += [tok.decode([t for t in r if t not in stop]) for r in rows[:len(chunk)]]
  return out
