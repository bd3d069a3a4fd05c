"""Records transformers' renderings of chat templates for tests/llm/test_chat.py.

Runs in the Python 3.11 peer environment (experiments/peers/README.md; transformers, jinja2,
no torch needed; $PEER its directory) and imports nothing from the project:
  $PEER/bin/python tests/llm/data/chat/record_templates.py > tests/llm/data/chat/renderings.json
Templates: SmolLM2-135M-Instruct's (ChatML, as its GGUF embeds it), TinyLlama-1.1B-Chat-v1.0's
(Zephyr: trim_blocks / lstrip_blocks matter), Llama 3 Instruct's (bos_token, `trim`),
Mistral Instruct v0.1's (raise_exception on roles that do not alternate) and one that uses
namespace, loop controls, tojson and {% generation %}.
"""

import json

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATES = {
    "smollm2": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "zephyr": "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}",
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "mistral": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
    "features": "{% set ns = namespace(n=0) %}\n{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n  {% set ns.n = ns.n + 1 %}\n  {% if m.role == 'assistant' %}{% generation %}<A{{ ns.n }}>{{ m.content }}</A>{% endgeneration %}\n  {% else %}<{{ m.role }} {{ m | tojson }}>\n  {% endif %}\n  {% if ns.n >= 3 %}{% break %}{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}<A{{ ns.n + 1 }}>{% endif %}",
}
SPECIALS = {"smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
            "zephyr": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
            "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
            "features": {"bos_token": "<s>", "eos_token": "</s>"}}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Say hello. ünïcode \"quotes\" <tags>"},
     {"role": "assistant", "content": "  Arr, hello!  "},
     {"role": "user", "content": "Again."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
]


def main():
  out = {"transformers": transformers.__version__, "templates": TEMPLATES, "specials": SPECIALS,
         "renderings": []}
  for name, template in TEMPLATES.items():
    for i, chat in enumerate(CHATS):
      for gen in (True, False):
        try:
          text = render_jinja_template([chat], chat_template=template, add_generation_prompt=gen,
                                       **SPECIALS[name])[0][0]
          error = None
        except Exception as e:  # noqa: BLE001 - recorded as the expected outcome
          text, error = None, f"{type(e).__name__}: {e}"
        out["renderings"].append({"template": name, "chat": i, "add_generation_prompt": gen,
                                  "text": text, "error": error})
  out["chats"] = CHATS
  print(json.dumps(out, ensure_ascii=False, indent=1))


if __name__ == "__main__":
  main()
