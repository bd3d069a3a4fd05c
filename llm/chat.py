"""Chat prompts: a checkpoint's Jinja2 chat template rendered the way transformers renders it.

transformers' `apply_chat_template` compiles the template in Jinja2's immutable sandbox with
trim_blocks and lstrip_blocks, the loop-controls extension, a `tojson` filter that keeps
non-ASCII text, the globals `raise_exception(message)`, `strftime_now(format)` and a
`namespace` that refuses underscore-prefixed attributes, and renders
it with `messages`, `add_generation_prompt`, `tools` / `documents` (None here) and the
tokenizer's special-token strings (`bos_token`, `eos_token`, ...), message keys whose value
is None dropped first (`_normalize_chat_messages` in transformers 5.24). The rendered text
already holds every special token the template wants, so it is encoded with no BOS / EOS
added (transformers encodes it with add_special_tokens=False). `{% generation %}` blocks (assistant
masks in transformers) render their body.

    messages = chat.check_messages(json.load(open("messages.json")), "messages.json")
    ids = chat.encode_chat(tok, messages)                 # ends with the assistant header
    stop = chat.stop_ids(tok)                             # the EOS ids and the end-of-turn

The end-of-turn token is found from the template itself: a rendered assistant message is
followed by it (SmolLM2's "<|im_end|>", Llama 3's "<|eot_id|>", Zephyr-style "</s>").
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Sequence

_PROBE = "ENDOFTURNPROBE"


def check_messages(messages: Any, where: str) -> list[dict]:
  """`messages` as a list of {"role": str, "content": str, ...} dicts; anything else is a
  ValueError naming `where` and the entry."""
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"{where}: expected a non-empty JSON list of {{\"role\", \"content\"}} "
                     f"messages, got {type(messages).__name__} {str(messages)[:80]}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ValueError(f"{where}: entry {i} is {type(m).__name__} {repr(m)[:80]}; expected a "
                       "{\"role\": ..., \"content\": ...} object")
    missing = [k for k in ("role", "content") if k not in m]
    if missing:
      raise ValueError(f"{where}: entry {i} {str(m)[:80]} lacks {missing}")
    for k in ("role", "content"):
      if not isinstance(m[k], str):
        raise ValueError(f"{where}: entry {i} has {k}={m[k]!r} ({type(m[k]).__name__}); "
                         "expected a string")
  return messages


def load_messages(path: str) -> list[dict]:
  """A JSON file holding a list of {"role", "content"} messages."""
  with open(path, encoding="utf-8") as fh:
    try:
      messages = json.load(fh)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
  return check_messages(messages, path)


def _template(source: str):
  import jinja2
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders the body (transformers' tracker
    records where it lies, for assistant masks; rendering is the same)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  class Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):
      self, attrs = args[0], dict(*args[1:], **kwargs)
      for name in attrs:
        Namespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore-prefixed "
                                              "names are refused in chat templates")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  env.globals["namespace"] = Namespace
  return env.from_string(source)


def render(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
           special_tokens: dict[str, str] | None = None, where: str = "chat template") -> str:
  """The template's text for `messages` (transformers' apply_chat_template(tokenize=False)).
  Keys whose value is None are dropped first, as transformers does: an OpenAI-style
  `"tool_calls": null` would otherwise read as present (Llama 3.1's `'tool_calls' in
  message`) or be written out (`message | tojson`)."""
  import jinja2
  messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
  try:
    return _template(template).render(messages=messages, tools=None, documents=None,
                                      add_generation_prompt=add_generation_prompt,
                                      **(special_tokens or {}))
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"{where}: {type(e).__name__}: {e}") from None


def _need_template(tok, where: str) -> str:
  if getattr(tok, "chat_template", None) is None:
    raise ValueError(f"{where}: the checkpoint's tokenizer ({getattr(tok, 'source', tok)}) has no "
                     "chat template (tokenizer_config.json chat_template, chat_template.jinja or "
                     "GGUF tokenizer.chat_template); use --prompt with plain text")
  return tok.chat_template


def encode_chat(tok, messages: Sequence[dict], add_generation_prompt: bool = True,
                where: str = "--chat") -> list[int]:
  """Token ids of the rendered conversation (no BOS / EOS beyond what the template writes)."""
  text = render(_need_template(tok, where), messages,
                add_generation_prompt=add_generation_prompt, special_tokens=tok.special_tokens,
                where=f"{tok.source} chat template")
  return tok.encode(text)


def end_of_turn_id(tok) -> int | None:
  """The special token the template writes right after an assistant message, or None when
  none follows it (or the template has no assistant turn to show)."""
  template = _need_template(tok, "end_of_turn_id")
  msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
  try:
    text = render(template, msgs, add_generation_prompt=False, special_tokens=tok.special_tokens)
  except ValueError:
    return None
  at = text.rfind(_PROBE)
  if at < 0:
    return None
  specials = _special_ids(tok)
  for i in tok.encode(text[at + len(_PROBE):]):
    if i in specials:
      return i
  return None


def _special_ids(tok) -> set[int]:
  ids = {i for i in (tok.bos_id, tok.eos_id) if i is not None} | set(tok.stop_ids)
  inner = getattr(tok, "tokenizers", None)
  if inner is not None:
    ids |= {i for i, t in inner.get_added_tokens_decoder().items() if t.special}
  return ids


def stop_ids(tok) -> tuple[int, ...]:
  """What ends a chat reply: the tokenizer's stop ids and the template's end-of-turn token."""
  eot = end_of_turn_id(tok)
  return tuple(tok.stop_ids) + (() if eot is None or eot in tok.stop_ids else (eot,))
