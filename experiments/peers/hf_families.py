"""transformers' own Llama, Qwen2 and Mistral: random-weight checkpoints, logits, greedy ids and
the mean token loss of a text; Qwen2's tokenizer on a given vocabulary (the peer of
tests/llm/test_families_peer.py).

Runs in the Python 3.11 peer environment (torch CPU + transformers; experiments/peers/
README.md) and imports nothing from the project. Every array goes through files: one job
file (JSON) in, one .npz (and the checkpoints) out. float32, eager attention off (sdpa),
torch.inference_mode.

  python hf_families.py --job job.json --out out.npz

job.json: {"write": [{"name", "family": "llama" | "qwen2" | "mistral", "config": {...},
                      "dir", "seed", "copy": [files]}],   # build, randomize,
                                                  # save_pretrained(dir), copy files into it
           "read": [{"name", "dir"}],             # load a directory (ours or transformers')
           "gguf": [{"name", "file"}],            # load a GGUF file (needs gguf, accelerate)
           "ids": [[...]],                        # logits of these rows (equal lengths)
           "prompts": [[...], ...], "new_tokens": N,   # greedy ids, one prompt at a time
           "eval": [{"name", "dir", "text", "seq_len"}],   # mean token loss of a text file
           "qwen2_tokenizer": [{"name", "tokenizer_json", "dir", "texts"}]}
             # transformers' Qwen2Tokenizer from the vocab and merges of a byte-level BPE
             # tokenizer.json: saved to dir (save_pretrained), the texts' ids
out.npz: <name>.logits [B,T,V] float32, <name>.greedy_<i> [N] for prompt i, <name>.loss and
<name>.tokens (the eval's mean loss and the number of targets), <name>.ids_<i> the ids of
text i (no special tokens added).

Random weights: transformers' own initialization (normal, std 0.02) gives near-uniform
logits whose greedy ids hang on ties; each tensor is drawn again (seeded): norm scales
1 + 0.1 N(0, 1), biases 0.5 N(0, 1), embeddings N(0, 1 / hidden) (tied ones are the output
too), other matrices N(0, 1 / fan_in): logits of order 1-5.

Mean token loss (`--job` "eval"): the text's tokens by transformers' tokenizer from
tokenizer.json (no special tokens), cut as experiments.eval_lm cuts them: windows of
seq_len + 1 tokens starting every seq_len tokens, each predicting its last seq_len tokens
from positions 0..; the loss summed over every target in float64, divided by their number.
"""

import argparse
import json
import math
import os
import shutil

import numpy as np
import torch
import transformers

CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}


def randomize(model, seed: int) -> None:
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      n = torch.randn(p.shape, generator=g, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1 + 0.1 * n)
      elif name.endswith(".bias"):
        p.copy_(0.5 * n)
      else:                 # [out, in] matrices and the [V, D] embedding
        p.copy_(n / math.sqrt(p.shape[-1]))


def load(d: str, gguf_file: str | None = None):
  """transformers' model of directory `d` (or of `d`/`gguf_file`, read by its GGUF loader)."""
  kw = {} if gguf_file is None else {"gguf_file": gguf_file}
  model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                            attn_implementation="sdpa", **kw)
  return model.eval()


def greedy(model, prompt, n: int) -> np.ndarray:
  """n greedy tokens after `prompt`, through generate's own KV cache (a sliding window
  model's cache is transformers' sliding-window one)."""
  ids = torch.tensor([prompt], dtype=torch.long)
  out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
  return out[0, len(prompt):].numpy().astype(np.int32)


def mean_loss(model, d: str, text_path: str, seq_len: int) -> tuple[float, int]:
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
  with open(text_path, encoding="utf-8") as f:
    ids = tok(f.read(), add_special_tokens=False)["input_ids"]
  total, count = 0.0, 0
  for s in range(0, len(ids) - 1, seq_len):
    win = torch.tensor([ids[s:s + seq_len + 1]], dtype=torch.long)
    logits = model(win[:, :-1]).logits[0].double()
    ce = torch.nn.functional.cross_entropy(logits, win[0, 1:], reduction="sum")
    total += float(ce)
    count += win.shape[1] - 1
  return total / count, count


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--job", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--threads", type=int, default=2)
  args = ap.parse_args()
  torch.set_num_threads(args.threads)
  with open(args.job) as f:
    job = json.load(f)
  out = {}
  models = []
  for w in job.get("write", []):
    cfg_cls, model_cls = CLASSES[w["family"]]
    model = model_cls(cfg_cls(**w["config"])).to(torch.float32)
    randomize(model, w["seed"])
    model.save_pretrained(w["dir"])
    for path in w.get("copy", []):   # e.g. a tokenizer.json for the eval
      shutil.copy(path, w["dir"])
    models.append((w["name"], load(w["dir"])))   # read back as any user would
  for r in job.get("read", []):
    models.append((r["name"], load(r["dir"])))
  for g in job.get("gguf", []):
    models.append((g["name"], load(*os.path.split(os.path.abspath(g["file"])))))
  with torch.inference_mode():
    for name, model in models:
      if job.get("ids"):
        out[f"{name}.logits"] = model(torch.tensor(job["ids"], dtype=torch.long)).logits.numpy()
      for i, p in enumerate(job.get("prompts", [])):
        out[f"{name}.greedy_{i}"] = greedy(model, p, job["new_tokens"])
    for e in job.get("eval", []):
      loss, n = mean_loss(load(e["dir"]), e["dir"], e["text"], e["seq_len"])
      out[f"{e['name']}.loss"], out[f"{e['name']}.tokens"] = np.float64(loss), np.int64(n)
  for t in job.get("qwen2_tokenizer", []):
    with open(t["tokenizer_json"], encoding="utf-8") as f:
      bpe = json.load(f)["model"]
    merges = [tuple(m.split(" ", 1) if isinstance(m, str) else m) for m in bpe["merges"]]
    tok = transformers.Qwen2Tokenizer(vocab=bpe["vocab"], merges=merges)
    tok.save_pretrained(t["dir"])
    for i, text in enumerate(t["texts"]):
      ids = tok(text, add_special_tokens=False)["input_ids"]
      out[f"{t['name']}.ids_{i}"] = np.asarray(ids, np.int64)
  np.savez(args.out, **out)
  print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                    "arrays": len(out)}))


if __name__ == "__main__":
  main()
