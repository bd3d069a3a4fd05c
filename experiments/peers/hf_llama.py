"""Hugging Face transformers Llama prefill / decode speed on CPU (peer of experiments.bench_llm).

Runs in the peer environment (torch CPU + transformers), imports nothing from the project.
Loads, as AutoModelForCausalLM (Llama, Qwen2 and Mistral alike), a model directory
(--model_dir: one that `experiments.bench_llm` exported with the same weights as our model,
or a real checkpoint's) or a GGUF file (--gguf_file: transformers
dequantizes it with the gguf package and undoes llama.cpp's Q/K permutation itself; needs
`gguf` and `accelerate` in this environment), then times, in fp32 under torch.inference_mode:
  prefill: one forward over [batch, prompt_len] prompt tokens with use_cache=True and the
           logits of the last position only (`logits_to_keep=1`, as ours computes them: the
           [batch, prompt_len, vocab] logits of every position would add prompt_len - 1 rows
           of the output projection, about 30% more multiply-adds for llama_100m's 128-token
           prefill);
  decode:  greedy single-token forwards with the KV cache (past_key_values), new_tokens - 1
           of them (the first new token comes from the prefill).
Prints one JSON line: medians over repeats, tokens/s, and the greedy ids of every row (so the
caller can check that both implementations generate the same tokens).
"""

import argparse
import json
import os
import statistics
import time

import torch
import transformers


def prefill(model, prompts):
  """One forward over `prompts` [B, T] into a fresh KV cache, logits of the last position
  only; refuses a transformers whose forward ignores `logits_to_keep` (it takes **kwargs)."""
  out = model(prompts, use_cache=True, logits_to_keep=1)
  if out.logits.shape[1] != 1:
    raise RuntimeError(f"transformers {transformers.__version__}: prefill logits of shape "
                       f"{tuple(out.logits.shape)}; expected [batch, 1, vocab] from "
                       "logits_to_keep=1 (transformers 5.24.0 is the one measured)")
  return out


def main():
  ap = argparse.ArgumentParser()
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--model_dir")
  src.add_argument("--gguf_file")
  ap.add_argument("--prompt_ids_file", required=True, help="JSON [[ids...], ...] (equal lengths)")
  ap.add_argument("--new_tokens", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2)
  args = ap.parse_args()
  if args.new_tokens < 2:
    ap.error(f"--new_tokens={args.new_tokens}; expected at least 2 (one decode step after "
             "the prefill's token)")
  torch.set_num_threads(args.threads)
  # transformers 5 calls the argument `dtype` (4.x: `torch_dtype`).
  dtype = ({"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5
           else {"torch_dtype": torch.float32})
  if args.gguf_file:
    d, name = os.path.split(os.path.abspath(args.gguf_file))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, **dtype,
                                                              attn_implementation="sdpa")
  else:
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, **dtype,
                                                              attn_implementation="sdpa")
  model.eval()
  with open(args.prompt_ids_file) as f:
    prompts = torch.tensor(json.load(f), dtype=torch.long)
  b, t = prompts.shape

  def run():
    with torch.inference_mode():
      t0 = time.perf_counter()
      out = prefill(model, prompts)
      t1 = time.perf_counter()
      past = out.past_key_values
      tok = out.logits[:, -1].argmax(-1, keepdim=True)
      ids = [tok]
      for _ in range(args.new_tokens - 1):
        out = model(tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        ids.append(tok)
      t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(ids, 1).tolist()

  run()  # warm-up
  pre, dec = [], []
  for _ in range(args.repeats):
    p, d, ids = run()
    pre.append(p)
    dec.append(d)
  p, d = statistics.median(pre), statistics.median(dec)
  print(json.dumps({
      "impl": f"transformers {transformers.__version__} (torch {torch.__version__}, sdpa)",
      "batch": b, "prompt_len": t, "new_tokens": args.new_tokens,
      "prefill_s": p, "decode_s": d, "prefill_tokens_per_s": b * t / p,
      "decode_tokens_per_s": b * (args.new_tokens - 1) / d,
      "decode_ms_per_step": 1e3 * d / (args.new_tokens - 1),
      "prefill_repeats_s": pre, "decode_repeats_s": dec, "generated_ids": ids}))


if __name__ == "__main__":
  main()
