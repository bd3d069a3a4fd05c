"""llm.chat against transformers: renderings of real chat templates recorded once from
transformers' apply_chat_template machinery (tests/llm/data/chat/record_templates.py, the
command is in its docstring), end-of-turn detection, and message checks."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from llm import chat
from llm import tokenizer as T

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat")
with open(os.path.join(DATA, "renderings.json"), encoding="utf-8") as _fh:
  REC = json.load(_fh)


@pytest.mark.parametrize("case", REC["renderings"],
                         ids=lambda r: f"{r['template']}-{r['chat']}-{r['add_generation_prompt']}")
def test_render_equals_transformers(case):
  template = REC["templates"][case["template"]]
  messages = REC["chats"][case["chat"]]
  specials = REC["specials"][case["template"]]
  if case["error"] is None:
    assert chat.render(template, messages, add_generation_prompt=case["add_generation_prompt"],
                       special_tokens=specials) == case["text"]
  else:   # raise_exception(...) in the template: the same message, naming where
    msg = case["error"].split(": ", 1)[1]
    with pytest.raises(ValueError, match=f"my template: TemplateError: {msg[:40]}"):
      chat.render(template, messages, add_generation_prompt=case["add_generation_prompt"],
                  special_tokens=specials, where="my template")


def test_render_can_fail():
  """The comparison above can fail: without trim_blocks / lstrip_blocks the Zephyr template
  leaves its newlines; without the tokenizer's eos_token it does not render."""
  import jinja2
  zephyr = REC["templates"]["zephyr"]
  msgs = REC["chats"][0]
  want = next(r["text"] for r in REC["renderings"] if r["template"] == "zephyr"
              and r["chat"] == 0 and r["add_generation_prompt"])
  assert jinja2.Template(zephyr).render(messages=msgs, add_generation_prompt=True,
                                        eos_token="</s>") != want
  with pytest.raises(ValueError, match="UndefinedError: 'eos_token' is undefined"):
    chat.render(zephyr, msgs, special_tokens={})


def test_keys_set_to_none_are_dropped_as_transformers_does():
  """An OpenAI-style message with `"tool_calls": null` renders as without the key (transformers
  5.24's apply_chat_template drops None-valued keys): the text below is its rendering of this
  chat with the recorded "features" template (tojson of the message); Llama 3.1's test
  `'tool_calls' in message` then `message.tool_calls | length` fails on a None left in."""
  msgs = [{"role": "user", "content": "hi", "name": None},
          {"role": "assistant", "content": "yo", "tool_calls": None}]
  assert chat.render(REC["templates"]["features"], msgs,
                     special_tokens=REC["specials"]["features"]) == (
      '<user {"role": "user", "content": "hi"}>\n<A2>yo</A><A3>')
  llama31_like = ("{% for m in messages %}{% if 'tool_calls' in m %}[{{ m.tool_calls | length }}"
                  " calls]{% else %}{{ m.content }}{% endif %}{% endfor %}")
  assert chat.render(llama31_like, msgs, add_generation_prompt=False) == "hiyo"
  assert msgs[1]["tool_calls"] is None and "name" in msgs[0]   # the caller's messages kept


def test_sandbox():
  with pytest.raises(ValueError, match="SecurityError"):
    chat.render("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
  with pytest.raises(ValueError, match="underscore-prefixed"):
    chat.render("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}])
  # strftime_now exists (templates print today's date with it).
  assert len(chat.render("{{ strftime_now('%Y') }}", [{"role": "user", "content": "x"}])) == 4


def _tokenizer(tmp_path, name: str, specials: list[str], bos: str, eos: str):
  """A byte-level BPE with the template's special tokens and the template itself."""
  tok = HFTok(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["hello there, what is the capital of France?"] * 5, trainers.BpeTrainer(
      vocab_size=300, special_tokens=specials, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  d = tmp_path / name
  d.mkdir()
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": bos, "eos_token": eos, "chat_template": REC["templates"][name]}))
  return T.load_tokenizer(str(d))


@pytest.mark.parametrize("name,specials,bos,eos,eot", [
    ("smollm2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>",
     "<|im_end|>"),
    ("zephyr", ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"], "<s>", "</s>",
     "</s>"),
    ("llama3", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>",
     "<|eot_id|>"),
    ("mistral", ["<unk>", "<s>", "</s>"], "<s>", "</s>", "</s>"),
])
def test_end_of_turn_and_encode_chat(tmp_path, name, specials, bos, eos, eot):
  tok = _tokenizer(tmp_path, name, specials, bos, eos)
  eot_id = tok.tokenizers.token_to_id(eot)
  assert chat.end_of_turn_id(tok) == eot_id
  assert eot_id in chat.stop_ids(tok) and tok.eos_id in chat.stop_ids(tok)
  msgs = [{"role": "user", "content": "hello there"}]
  ids = chat.encode_chat(tok, msgs)
  text = chat.render(REC["templates"][name], msgs, special_tokens=tok.special_tokens)
  # Special tokens written by the template become their ids; nothing is added around.
  assert ids == tok.tokenizers.encode(text, add_special_tokens=False).ids
  special_ids = {tok.tokenizers.token_to_id(t) for t in specials}
  assert sum(i in special_ids for i in ids) == sum(text.count(t) for t in specials) > 0
  if "bos_token" in REC["templates"][name]:
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_no_template_is_an_error(tmp_path):
  tok = T.ByteTokenizer()
  with pytest.raises(ValueError, match="--chat: the checkpoint's tokenizer .* has no chat "
                     "template"):
    chat.encode_chat(tok, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages,match", [
    ({"role": "user", "content": "x"}, "expected a non-empty JSON list"),
    ([], "expected a non-empty JSON list"),
    ([{"role": "user", "content": "x"}, "hi"], "entry 1 is str 'hi'"),
    ([{"role": "user"}], r"entry 0 .* lacks \['content'\]"),
    ([{"content": "x"}, {"role": "user", "content": "y"}], r"entry 0 .* lacks \['role'\]"),
    ([{"role": "user", "content": ["part"]}], r"entry 0 has content=\['part'\] \(list\)"),
])
def test_check_messages(messages, match):
  with pytest.raises(ValueError, match=f"m.json: {match}"):
    chat.check_messages(messages, "m.json")


def test_load_messages(tmp_path):
  good = tmp_path / "good.json"
  good.write_text(json.dumps([{"role": "user", "content": "hi", "name": "x"}]))
  assert chat.load_messages(str(good))[0]["content"] == "hi"
  bad = tmp_path / "bad.json"
  bad.write_text('[\n{"role": "user",\n "content": }\n]')
  with pytest.raises(ValueError, match=r"bad.json:3: not JSON"):
    chat.load_messages(str(bad))
  wrong = tmp_path / "wrong.json"
  wrong.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}]))
  with pytest.raises(ValueError, match=r"wrong.json: entry 1 has role=3"):
    chat.load_messages(str(wrong))
