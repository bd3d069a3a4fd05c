"""Chat requests for an instruct target, built without any data set: instruction templates
filled with common words taken from the checkpoint's own BPE vocabulary, rendered with its
chat template (the prompts of EAGLE's self-distillation, arXiv 2401.15077, whose responses
the target then writes itself).

Words: vocabulary entries that are a space-prefixed lowercase word of 4-10 letters (GPT-2
style "Ġword" pieces), in vocabulary order; BPE learns frequent words first, so the first
`pool` of them are common English words. Each request draws a template and words from a
seeded generator: the same seed gives the same requests.
"""

from __future__ import annotations

import numpy as np

from llm import chat

TEMPLATES = (
    "Write a short story about {a}.",
    "Explain what {a} means to a ten-year-old.",
    "Give me five interesting facts about {a}.",
    "Write a poem about {a} and {b}.",
    "What is the difference between {a} and {b}?",
    "Describe a day in the life of someone who loves {a}.",
    "How can I get better at {a}? Give practical tips.",
    "Write a letter to a friend about {a}.",
    "Why is {a} important? Explain in a few paragraphs.",
    "Write a dialogue between two people arguing about {a}.",
    "Summarize the history of {a}.",
    "Write a product description for something related to {a}.",
    "List the pros and cons of {a}.",
    "Tell me a story that involves {a}, {b} and {c}.",
    "Write an essay about how {a} changed the world.",
    "Write a recipe that a person who likes {a} would enjoy.",
    "Write a Python function that helps someone keep track of {a}.",
    "A train leaves at 3 pm carrying {a}. Make up a short math word problem about it and "
    "solve it step by step.",
    "Plan a weekend trip for someone interested in {a} and {b}.",
    "Write a news headline and a short article about {a}.",
    "What are common mistakes people make with {a}, and how can they avoid them?",
    "Compare {a}, {b} and {c} in a short table or list.",
    "Write a short speech for a school event about {a}.",
    "Answer briefly: is {a} related to {b}? Explain your reasoning.",
    "Translate the idea of {a} into a simple analogy a child would understand.",
    "Write a job advertisement for a position involving {a}.",
    "Give step-by-step instructions for a beginner who wants to learn about {a}.",
    "Write a funny limerick about {a}.",
    "Describe {a} in exactly three sentences.",
    "What questions should I ask an expert on {a}?",
    "Write a review of a fictional book titled 'The {a} of {b}'.",
    "Brainstorm ten names for a company that sells {a}.",
)


def vocab_words(tok, pool: int = 3000) -> list[str]:
  """The first `pool` vocabulary entries that decode to " word" (4-10 lowercase letters)."""
  words = []
  for i in range(tok.vocab_size):
    text = tok.decode([i])
    w = text[1:]
    if text.startswith(" ") and 4 <= len(w) <= 10 and w.isascii() and w.isalpha() \
        and w.islower():
      words.append(w)
      if len(words) == pool:
        break
  if len(words) < 50:
    raise ValueError(f"tokenizer of {tok.vocab_size} tokens: only {len(words)} plain words in "
                     "its vocabulary; expected a BPE vocabulary of English words for "
                     "--chat_prompts")
  return words


def instructions(tok, num: int, seed: int, pool: int = 3000) -> list[str]:
  """`num` distinct user instructions: templates filled with vocabulary words (a draw that
  repeats an earlier instruction is drawn again, so greedy replies never repeat)."""
  words = vocab_words(tok, pool)
  rng = np.random.default_rng([seed, 17])
  out, seen = [], set()
  while len(out) < num:
    t = TEMPLATES[rng.integers(len(TEMPLATES))]
    a, b, c = (words[j] for j in rng.choice(len(words), 3, replace=False))
    text = t.format(a=a, b=b, c=c)
    if text not in seen:
      seen.add(text)
      out.append(text)
  return out


def chat_prompts(tok, num: int, seed: int, where: str = "--chat_prompts") -> list[list[int]]:
  """`num` instructions as prompt ids: one user turn through the checkpoint's chat template,
  the assistant's turn opened."""
  return [chat.encode_chat(tok, [{"role": "user", "content": text}], where=where)
          for text in instructions(tok, num, seed)]
