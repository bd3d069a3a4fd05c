"""Weight-only int8 / int4 Llama inference, measured: perplexity on a held-out text and decode
tokens/s of each weight format against float32, in one process.

Variants of one checkpoint (`llm.quantized`):
  float32  the checkpoint's weights (a GGUF's dequantized exactly)
  int8     our group-wise int8 of the float32 weights (groups of 32, float16 scale)
  int4     our group-wise int4 of the float32 weights (groups of 32, float16 scale + min)
  gguf     a GGUF's own quantization: its Q8_0 / Q4_0 / Q4_1 blocks as stored
Here int8 / int4 always quantize the float32 weights, so on a GGUF they show our quantizer
beside the file's own (`generate --weights=int4` takes a Q4_x file's blocks instead).

Perplexity: the text's tokens cut into windows of `window` tokens (the last one shorter),
each scored on its tokens after the first, exp(mean negative log-likelihood) over all of
them. Decode: greedy, batch 1, a prompt of the text's first tokens, `new_tokens` steps with
the KV cache (`experiments.benchmarks.decode.time_decode`), variants interleaved round by
round so they share the machine's state; tokens/s from the median step time.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout.txt")
HELDOUT_SOURCE = ("Lewis Carroll, Alice's Adventures in Wonderland (1865), chapter I, first "
                  "six paragraphs; public domain (Project Gutenberg eBook #11), transcribed")
MODES = ("float32", "int8", "int4", "gguf")


def load_variants(checkpoint: str, modes, dtype: str = "float32") -> dict[str, Any]:
  """{mode: (model, info)}; info: forms by count and bytes of parameters held."""
  import jax
  from flax import nnx

  from llm import checkpoints, quantized
  from llm import model as model_lib
  kind, path = checkpoints.parse_spec(checkpoint)
  for m in modes:
    quantized.check_mode(m, kind, flag="--modes")
  cfg, flat = checkpoints.load_weights(checkpoint)
  cfg = cfg.replace(dtype=dtype)
  out = {}
  for mode in modes:
    if mode == "gguf":
      stored = checkpoints.gguf_checkpoint(path).tensors
      params, forms = quantized.quantize(cfg, mode, stored=stored)
    else:
      params, forms = quantized.quantize(cfg, mode, weights=flat)
    model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
    model_lib.load_weights(model, params)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    out[mode] = (model, {"forms": quantized.summarize_forms(forms), "param_bytes": int(held)})
  return cfg, out


def text_ids(checkpoint: str, text: str, vocab_size: int, tokenizer: str | None = None):
  """(ids, tokenizer description): the checkpoint's own tokenizer (or `tokenizer`), BOS as it
  adds it; without one, UTF-8 bytes (a model without a tokenizer, e.g. stories260K: the
  perplexity then only compares weight formats with each other)."""
  from llm import checkpoints
  tok = checkpoints.find_tokenizer(checkpoint, tokenizer, vocab_size)
  if tok is None:
    if vocab_size < 256:
      raise ValueError(f"{checkpoint}: no tokenizer and a vocabulary of {vocab_size} < 256 "
                       "byte ids; pass --tokenizer")
    return list(text.encode("utf-8")), "utf-8 bytes (the checkpoint has no tokenizer)"
  return checkpoints.text_prompt(tok, text), getattr(tok, "source", type(tok).__name__)


def windows(ids, window: int) -> list[list[int]]:
  """Consecutive windows of `window` ids (the last shorter); each needs 2 ids to score."""
  if window < 2:
    raise ValueError(f"window={window}: expected at least 2 tokens")
  out = [ids[i:i + window] for i in range(0, len(ids), window)]
  return [w for w in out if len(w) >= 2]


def perplexity(model, wins: list[list[int]]) -> dict[str, float]:
  """exp(mean NLL) of every window's tokens after its first, no cache, one compile (windows
  padded to the longest; padding is neither attended to by real tokens nor scored)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  graphdef, state = nnx.split(model)
  width = max(len(w) for w in wins)

  @jax.jit
  def nll(state, tokens_1T, n_valid):
    logits_1TV, _ = nnx.merge(graphdef, state)(tokens_1T)
    logp = jax.nn.log_softmax(logits_1TV[0, :-1].astype(jnp.float32), axis=-1)
    tgt = tokens_1T[0, 1:]
    nll_T = -jnp.take_along_axis(logp, tgt[:, None], axis=-1)[:, 0]
    mask = jnp.arange(width - 1) < n_valid - 1
    return jnp.sum(jnp.where(mask, nll_T, 0.0))

  total, count = 0.0, 0
  for w in wins:
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(w)] = w
    total += float(nll(state, jnp.asarray(tokens), len(w)))
    count += len(w) - 1
  return {"perplexity": float(np.exp(total / count)), "nll": total / count, "tokens": count}


def decode_rates(variants: dict, prompt: list[int], new_tokens: int, repeats: int,
                 rounds: int, log=lambda s: None) -> dict[str, dict]:
  """Per variant: decode seconds of every repeat (interleaved rounds), the median step time,
  tokens/s, and the greedy ids."""
  from core import benchmark
  from experiments.benchmarks.decode import time_decode
  times = {m: [] for m in variants}
  ids = {}
  for r in range(rounds):
    for mode, (model, _) in variants.items():
      _, dec, out = time_decode(model, [prompt], new_tokens, repeats)
      times[mode] += dec
      ids[mode] = out[0]
      log(f"round {r} {mode}: decode {np.median(dec) * 1e3 / (new_tokens - 1):.2f} ms/step")
  res = {}
  for mode, t in times.items():
    step = benchmark.median(t) / (new_tokens - 1)
    res[mode] = {"decode_s": t, "decode_ms_per_step": step * 1e3,
                 "decode_tokens_per_s": 1.0 / step, "greedy_ids": ids[mode]}
  return res


def run(checkpoint: str, modes, text: str, text_source: str, *, window: int, prompt_len: int,
        new_tokens: int, repeats: int, rounds: int, dtype: str = "float32",
        tokenizer: str | None = None, log=lambda s: None) -> dict[str, Any]:
  """The study's numbers (module docstring) as a dict for results.json."""
  from core import benchmark
  load_before = os.getloadavg()
  t0 = time.time()
  cfg, variants = load_variants(checkpoint, modes, dtype)
  ids, tok_desc = text_ids(checkpoint, text, cfg.vocab_size, tokenizer)
  window = min(window, cfg.max_seq_len)
  wins = windows(ids, window)
  if not wins:
    raise ValueError(f"the held-out text gives {len(ids)} tokens; expected at least 2")
  if prompt_len + new_tokens > cfg.max_seq_len or prompt_len > len(ids):
    raise ValueError(f"--prompt_len={prompt_len} + --new_tokens={new_tokens} exceed the model's "
                     f"max_seq_len={cfg.max_seq_len} or the text's {len(ids)} tokens")
  rows = {}
  log(f"loaded {', '.join(variants)} in {time.time() - t0:.1f} s; {len(ids)} text tokens")
  for mode, (model, info) in variants.items():
    rows[mode] = {**info, **perplexity(model, wins)}
    log(f"{mode}: perplexity {rows[mode]['perplexity']:.4f}")
  rates = decode_rates(variants, ids[:prompt_len], new_tokens, repeats, rounds, log)
  base = rates.get("float32")
  for mode, r in rates.items():
    rows[mode].update(r)
    if base is not None:
      rows[mode]["decode_speedup_vs_float32"] = (r["decode_tokens_per_s"]
                                                 / base["decode_tokens_per_s"])
      ref = base["greedy_ids"]
      rows[mode]["greedy_ids_equal_float32"] = next(
          (i for i, (a, b) in enumerate(zip(r["greedy_ids"], ref)) if a != b), len(ref))
  return {"checkpoint": checkpoint, "config": {"params": cfg.num_params(), "dim": cfg.dim,
                                               "layers": cfg.n_layers, "vocab": cfg.vocab_size},
          "dtype": dtype, "text": {"source": text_source, "tokenizer": tok_desc,
                                   "tokens": len(ids), "window": window, "windows": len(wins)},
          "decode": {"batch": 1, "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "repeats": repeats, "rounds": rounds},
          "variants": rows, "machine": benchmark.machine(),
          "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
          "seconds": time.time() - t0}


def table(results: dict) -> str:
  """Human table of the variants ("-" against float32 where float32 was not measured)."""
  lines = [f"{'weights':9s}{'perplexity':>12s}{'MB held':>10s}{'decode tok/s':>14s}"
           f"{'vs fp32':>9s}{'same ids':>10s}  forms"]
  for mode, r in results["variants"].items():
    x = r.get("decode_speedup_vs_float32")
    lines.append(f"{mode:9s}{r['perplexity']:12.4f}{r['param_bytes'] / 1e6:10.1f}"
                 f"{r['decode_tokens_per_s']:14.1f}{'-' if x is None else f'{x:.2f}x':>9}"
                 f"{r.get('greedy_ids_equal_float32', '-'):>10}  "
                 + ", ".join(f"{k}: {v}" for k, v in r["forms"].items()))
  return "\n".join(lines)


def summary(results: dict) -> dict[str, Any]:
  """The last stdout line's numbers per variant; the speedup against float32 is None when
  --modes left float32 out (nothing was measured to compare with)."""
  out = {"checkpoint": results["checkpoint"]}
  for m, r in results["variants"].items():
    x = r.get("decode_speedup_vs_float32")
    out[m] = {"perplexity": round(r["perplexity"], 4),
              "decode_tokens_per_s": round(r["decode_tokens_per_s"], 1),
              "decode_speedup_vs_float32": None if x is None else round(x, 3),
              "param_mb": round(r["param_bytes"] / 1e6, 2)}
  return out


def plot(results: dict, path: str) -> None:
  """Perplexity and decode tokens/s per variant, weight MB on the bars."""
  from core import plot as plot_lib
  modes = list(results["variants"])
  rows = [results["variants"][m] for m in modes]
  with plot_lib.figure(path, 1, 2, figsize=(9, 3.4), dpi=120) as (fig, axes):
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(modes)]
    axes[0].bar(modes, [r["perplexity"] for r in rows], color=colors)
    lo = min(r["perplexity"] for r in rows)
    axes[0].set_ylim(lo * 0.95, max(r["perplexity"] for r in rows) * 1.02)
    axes[0].set_title("perplexity (held-out text)")
    bars = axes[1].bar(modes, [r["decode_tokens_per_s"] for r in rows], color=colors)
    for b, r in zip(bars, rows):
      axes[1].annotate(f"{r['param_bytes'] / 1e6:.0f} MB", (b.get_x() + b.get_width() / 2,
                       b.get_height()), ha="center", va="bottom", fontsize=8)
    axes[1].set_title("decode tokens/s, batch 1 (CPU)")
    fig.suptitle(f"{os.path.basename(results['checkpoint'])}: weight-only quantization", fontsize=9)
