"""llama.cpp (llama-cpp-python) on a GGUF file: logits, greedy ids and tokens for checks of our
GGUF export, or prefill / decode times beside ours (the peer of tests/experiments/peers/
test_llama_cpp_gguf.py and of experiments.bench_llm's llama.cpp row).

Runs in the Python 3.11 peer environment (llama-cpp-python; experiments/peers/README.md) and
imports nothing from the project. One sequence at a time on CPU, --threads threads for both
prompt and single-token evaluation, flash attention off, the KV cache in --kv_type (f16 is
llama.cpp's default; f32 leaves only the weights' own rounding between llama.cpp and a
float32 reference). llama.cpp's extra weight buffers (`use_extra_bufts`: AMX tiles and the
repacked Q4_0 / Q8_0 layouts) are off unless --extra_bufts: a -DGGML_NATIVE=ON build on a CPU
that reports AMX compiles the AMX kernels, and the 2-core VM here reports AMX but faults on
its instructions (SIGILL in ggml_backend_amx_mul_mat); without them the quantized products
run ggml's AVX-512 dot products. On a shared machine run it with OMP_WAIT_POLICY=PASSIVE: the
OpenMP build's threads spin while they wait, and with more runnable jobs than cores a 2-thread
decode step took 2.2 s instead of 29 ms here (1 thread: 28 ms).

  python llama_cpp_gguf.py check --gguf_file M.gguf --prompt_ids_file p.json --new_tokens 16 \
      --texts_file texts.json
  python llama_cpp_gguf.py check ... --teacher_forced_ids_file t.json --scores_out scores.npz
  python llama_cpp_gguf.py bench --gguf_file M.gguf --prompt_ids_file p.json --new_tokens 64

check (logits_all): for every prompt of --prompt_ids_file (JSON [[ids...], ...]) the logits of
its last position and --new_tokens greedy ids (argmax of llama.cpp's logits, the first on a tie,
as its greedy sampler picks; each prompt from an empty cache); for every text of --texts_file
(JSON [str, ...]) llama.cpp's tokens without and with the vocabulary's own specials
(`tokenize(..., add_bos=False | True, special=True)`: control tokens written in the text become
their ids) and llama.cpp's `llama_detokenize` of the first (control tokens left out, as a
decode that skips specials; a SentencePiece vocabulary's leading space removed); for every
sequence of --teacher_forced_ids_file (JSON [[ids...], ...]) the logits at every position,
evaluated at once into an empty cache, written to --scores_out (.npz, one float32 [T, V] array
per sequence, keys "0", "1", ...).
bench (batch 1 only: this API decodes one sequence): per repeat, the prompt evaluated at once
into a fresh cache, then greedy single-token steps, new_tokens - 1 of them; medians over
--repeats after one warm-up run; the output keys of hf_llama.py (prefill_repeats_s,
decode_repeats_s, generated_ids, impl, ...).
The last stdout line is one JSON object; llama.cpp's own log goes to stderr.
"""

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np

import llama_cpp

KV_TYPES = {"f32": 0, "f16": 1}   # ggml_type: GGML_TYPE_F32, GGML_TYPE_F16


def model_params_without_extra_bufts() -> None:
  """Makes every llama_cpp.Llama load its weights without extra buffer types (the Llama class
  takes no argument for `llama_model_params.use_extra_bufts`). Refuses a llama-cpp-python
  whose `llama_model_params` has no such field: a ctypes structure takes any attribute
  silently, so the setting would be lost and the extra buffers kept."""
  low = llama_cpp.llama_cpp
  fields = [name for name, *_ in low.llama_model_params._fields_]
  if "use_extra_bufts" not in fields:
    sys.exit(f"llama-cpp-python {llama_cpp.__version__}: llama_model_params has no "
             f"use_extra_bufts field (fields: {', '.join(fields)}); expected the one of 0.3.36 "
             "(experiments/peers/README.md), or pass --extra_bufts to keep the extra buffers")
  default = low.llama_model_default_params

  def params():
    p = default()
    p.use_extra_bufts = False
    return p

  low.llama_model_default_params = params


def load(path: str, threads: int, n_ctx: int, logits_all: bool, kv_type: str):
  return llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                         n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=logits_all,
                         flash_attn=False, type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type],
                         seed=0, verbose=False)


def last_logits(llm) -> np.ndarray:
  """The logits of the last evaluated position (a copy)."""
  if llm._logits_all:
    return np.array(llm.scores[llm.n_tokens - 1], np.float32)
  ptr = llm._ctx.get_logits_ith(-1)
  return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)


def greedy(llm, prompt: list[int], n: int) -> tuple[np.ndarray, list[int], float, float]:
  """(logits after the prompt, n greedy ids, prefill seconds, decode seconds)."""
  llm.reset()
  t0 = time.perf_counter()
  llm.eval(prompt)
  first = last_logits(llm)
  ids = [int(np.argmax(first))]
  t1 = time.perf_counter()
  for _ in range(n - 1):
    llm.eval([ids[-1]])
    ids.append(int(np.argmax(last_logits(llm))))
  t2 = time.perf_counter()
  return first, ids, t1 - t0, t2 - t1


def detokenize(llm, ids: list[int]) -> str:
  """llama.cpp's own detokenizer (llama-cpp-python's `detokenize` joins the pieces itself)."""
  arr = (llama_cpp.llama_token * len(ids))(*ids)
  size = 64 + 16 * len(ids)
  buf = ctypes.create_string_buffer(size)
  n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, size, False, False)
  if n < 0:
    raise RuntimeError(f"llama_detokenize needs {-n} bytes, more than {size}")
  return buf.raw[:n].decode("utf-8", errors="replace")


def impl() -> str:
  return f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"


def check(args, prompts) -> dict:
  texts = []
  if args.texts_file:
    with open(args.texts_file) as f:
      texts = json.load(f)
  forced = []
  if args.teacher_forced_ids_file:
    if not args.scores_out:
      sys.exit("--teacher_forced_ids_file needs --scores_out (the .npz the logits go to)")
    with open(args.teacher_forced_ids_file) as f:
      forced = json.load(f)
  n_ctx = max([len(p) + args.new_tokens for p in prompts] + [len(s) for s in forced] + [64])
  llm = load(args.gguf_file, args.threads, n_ctx, True, args.kv_type)
  logits, ids = [], []
  for p in prompts:
    first, new, _, _ = greedy(llm, p, args.new_tokens)
    logits.append(first.tolist())
    ids.append(new)
  scores = {}
  for i, seq in enumerate(forced):
    llm.reset()
    llm.eval(seq)
    scores[str(i)] = np.array(llm.scores[:len(seq)], np.float32)
  if forced:
    np.savez(args.scores_out, **scores)
  tokens, with_specials, detok = [], [], []
  for t in texts:
    b = t.encode("utf-8")
    tokens.append(llm.tokenize(b, add_bos=False, special=True))
    with_specials.append(llm.tokenize(b, add_bos=True, special=True))
    detok.append(detokenize(llm, tokens[-1]))
  return {"impl": impl(), "n_vocab": llm.n_vocab(), "kv_type": args.kv_type,
          "logits": logits, "greedy_ids": ids, "tokens": tokens,
          "tokens_add_special": with_specials, "detokenized": detok}


def bench(args, prompts) -> dict:
  if len(prompts) != 1:
    sys.exit(f"llama_cpp_gguf.py bench: {len(prompts)} prompt rows; expected 1 (this API "
             "decodes one sequence)")
  prompt = prompts[0]
  llm = load(args.gguf_file, args.threads, len(prompt) + args.new_tokens + 8, False,
             args.kv_type)
  greedy(llm, prompt, args.new_tokens)   # warm-up
  pre, dec = [], []
  for _ in range(args.repeats):
    _, ids, p, d = greedy(llm, prompt, args.new_tokens)
    pre.append(p)
    dec.append(d)
  p, d = statistics.median(pre), statistics.median(dec)
  steps = args.new_tokens - 1
  bufts = "extra buffers" if args.extra_bufts else "no extra buffers"
  return {"impl": f"{impl()}, {args.threads} threads, KV cache {args.kv_type}, {bufts}",
          "batch": 1, "prompt_len": len(prompt), "new_tokens": args.new_tokens,
          "prefill_s": p, "decode_s": d, "prefill_tokens_per_s": len(prompt) / p,
          "decode_tokens_per_s": steps / d, "decode_ms_per_step": 1e3 * d / steps,
          "prefill_repeats_s": pre, "decode_repeats_s": dec, "generated_ids": [ids]}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("mode", choices=("check", "bench"))
  ap.add_argument("--gguf_file", required=True)
  ap.add_argument("--prompt_ids_file", required=True, help="JSON [[ids...], ...]")
  ap.add_argument("--new_tokens", type=int, default=16)
  ap.add_argument("--texts_file", help="check: JSON [text, ...] to tokenize")
  ap.add_argument("--teacher_forced_ids_file",
                  help="check: JSON [[ids...], ...] whose logits at every position to write")
  ap.add_argument("--scores_out", help="check: .npz for --teacher_forced_ids_file's logits")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--kv_type", choices=tuple(KV_TYPES), default="f16")
  ap.add_argument("--extra_bufts", action="store_true",
                  help="keep llama.cpp's extra weight buffers (AMX, repacked layouts)")
  args = ap.parse_args()
  if not args.extra_bufts:
    model_params_without_extra_bufts()
  if args.new_tokens < 1:
    sys.exit(f"--new_tokens={args.new_tokens}; expected at least 1")
  with open(args.prompt_ids_file) as f:
    prompts = json.load(f)
  out = (check if args.mode == "check" else bench)(args, prompts)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
