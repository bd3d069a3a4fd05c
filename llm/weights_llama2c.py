"""llama2.c legacy checkpoints (`export.py --version 0`): read, written, and their config.

A 28-byte header (7 int32: dim, hidden, layers, heads, kv heads, vocab (negative: a separate
classifier), seq_len), then float32 arrays stacked over layers, q and k rows in Meta's
interleaved RoPE layout (permuted to and from the model's half-split one). The file size is
checked against the header, and every tensor for NaN or Inf.
"""

from __future__ import annotations

import math
import os

import numpy as np

from llm.config import LlamaConfig
from llm.weights_layout import (Weights, check_finite, check_weights, half_to_interleaved,
                                in_out, interleaved_to_half, out_in)

_LLAMA2C_MAGIC = 0x616B3432  # "ak42": llama2.c's versioned export, not the legacy one


def llama2c_config(path: str) -> LlamaConfig:
  """The LlamaConfig of a llama2.c legacy checkpoint, from its header (the file size
  checked against it), without reading the weights."""
  return _llama2c_layout(path)[0]


def _llama2c_layout(path: str):
  """(config, [(name, shape)] in file order, number of floats) of a llama2.c file."""
  actual = os.path.getsize(path)
  if actual < 28:
    raise ValueError(f"{path}: {actual} bytes, too short for the 28-byte llama2.c header")
  header = np.fromfile(path, dtype="<i4", count=7)
  dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = (int(x) for x in header)
  if dim == _LLAMA2C_MAGIC:
    raise ValueError(f"{path}: versioned llama2.c export (magic 'ak42'); only the legacy "
                     "format (export.py --version 0) is supported")
  tied = vocab > 0
  vocab = abs(vocab)
  fields = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=n_kv_heads, vocab_size=vocab, seq_len=seq_len)
  if (min(fields.values()) <= 0 or dim % n_heads or n_heads % n_kv_heads
      or (dim // n_heads) % 2):
    raise ValueError(f"{path}: bad llama2.c header {fields}: expected positive sizes, dim a "
                     "multiple of n_heads, n_heads a multiple of n_kv_heads, even head size")
  k = dim // n_heads
  kv_dim = n_kv_heads * k
  # (name, shape) in file order; the per-layer arrays are stacked over layers.
  layout = [("embed", (vocab, dim)), ("rms_att", (n_layers, dim)),
            ("wq", (n_layers, dim, dim)), ("wk", (n_layers, kv_dim, dim)),
            ("wv", (n_layers, kv_dim, dim)), ("wo", (n_layers, dim, dim)),
            ("rms_ffn", (n_layers, dim)), ("w1", (n_layers, hidden, dim)),
            ("w2", (n_layers, dim, hidden)), ("w3", (n_layers, hidden, dim)),
            ("rms_final", (dim,)), ("freq_cis_real", (seq_len, k // 2)),
            ("freq_cis_imag", (seq_len, k // 2))]
  if not tied:
    layout.append(("classifier", (vocab, dim)))
  n_floats = sum(math.prod(s) for _, s in layout)
  expected = 28 + 4 * n_floats
  if actual != expected:
    what = "truncated" if actual < expected else "longer than the header says"
    raise ValueError(f"{path}: {actual} bytes, expected {expected} for the llama2.c header "
                     f"{fields} ({'shared' if tied else 'separate'} classifier): the file is "
                     f"{what}")
  cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
                    n_kv_heads=n_kv_heads, ffn_dim=hidden, head_dim=k, norm_eps=1e-5,
                    rope_theta=10000.0, rope_scaling=None, tie_embeddings=tied,
                    max_seq_len=seq_len)
  return cfg, layout, n_floats


def load_llama2c(path: str) -> tuple[LlamaConfig, Weights]:
  """Reads a llama2.c legacy checkpoint (7 int32 header, then float32 arrays)."""
  cfg, layout, n_floats = _llama2c_layout(path)
  n_layers, n_heads, n_kv_heads, k, dim = (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                           cfg.head_dim, cfg.dim)
  # Mapped, not read: the arrays below are copies, so the peak is about the result's size
  # (reading the file first doubled it: 56 GB for a 7B model's 28 GB).
  flat = np.memmap(path, dtype="<f4", mode="r", offset=28, shape=(n_floats,))
  raw, pos = {}, 0
  for name, shape in layout:
    size = int(np.prod(shape))
    raw[name] = flat[pos:pos + size].reshape(shape)
    pos += size
    if not name.startswith("freq_cis"):   # unused legacy RoPE tables
      check_finite(name, raw[name], f"{path} (llama2.c; per-layer arrays are [layer, ...])")
  weights = {"embed": np.array(raw["embed"])}   # np.array: a plain ndarray copy
  for i in range(n_layers):
    p = f"layers.{i}."
    weights[p + "attn_norm"] = np.array(raw["rms_att"][i])
    weights[p + "wq"] = in_out(interleaved_to_half(raw["wq"][i], n_heads), n_heads, k)
    weights[p + "wk"] = in_out(interleaved_to_half(raw["wk"][i], n_kv_heads), n_kv_heads, k)
    weights[p + "wv"] = in_out(raw["wv"][i], n_kv_heads, k)
    weights[p + "wo"] = np.ascontiguousarray(raw["wo"][i].T).reshape(n_heads, k, dim)
    weights[p + "mlp_norm"] = np.array(raw["rms_ffn"][i])
    weights[p + "w_gate"] = in_out(raw["w1"][i])   # llama2.c: silu(w1 x) * (w3 x), then w2
    weights[p + "w_up"] = in_out(raw["w3"][i])
    weights[p + "w_down"] = in_out(raw["w2"][i])
  weights["final_norm"] = np.array(raw["rms_final"])
  if not cfg.tie_embeddings:
    weights["lm_head"] = in_out(raw["classifier"])
  # No weight may view the mapping (a size-1 axis can make a transpose a view): the file
  # may be rewritten under it (save_llama2c to the same path), which would crash a reader.
  weights = {n: np.array(a) if np.may_share_memory(a, flat) else a for n, a in weights.items()}
  del raw, flat   # the file's mapping ends here
  return cfg, weights


def save_llama2c(path: str, cfg: LlamaConfig, weights: Weights) -> None:
  """Writes a llama2.c legacy checkpoint (float32; what llama2.c's run.c reads)."""
  if cfg.head_dim * cfg.n_heads != cfg.dim or cfg.rope_scaling is not None:
    raise ValueError(f"save_llama2c: {path}: the legacy format needs head_dim * n_heads == dim "
                     f"(got {cfg.head_dim} * {cfg.n_heads} vs {cfg.dim}) and no RoPE scaling "
                     f"(got {cfg.rope_scaling})")
  if cfg.qkv_bias or cfg.sliding_window is not None:
    raise ValueError(f"save_llama2c: {path}: qkv_bias={cfg.qkv_bias}, sliding_window="
                     f"{cfg.sliding_window}; run.c's Llama has no biases and no window "
                     "(export it as hf or gguf)")
  if cfg.rope_theta != 10000.0 or cfg.norm_eps != 1e-5:
    raise ValueError(f"save_llama2c: {path}: run.c hard-codes rope_theta 10000 and eps 1e-5, "
                     f"got rope_theta={cfg.rope_theta} norm_eps={cfg.norm_eps}")
  check_weights(cfg, weights, f"save_llama2c({path})")
  f32 = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
  w = {n: f32(x) for n, x in weights.items()}
  L, k = cfg.n_layers, cfg.head_dim
  per_layer = lambda fn: np.stack([fn(f"layers.{i}.") for i in range(L)])  # noqa: E731
  vocab = cfg.vocab_size if cfg.tie_embeddings else -cfg.vocab_size
  header = np.array([cfg.dim, cfg.ffn_dim, L, cfg.n_heads, cfg.n_kv_heads, vocab,
                     cfg.max_seq_len], dtype="<i4")
  # run.c ignores the legacy freq_cis tables but their bytes must be there; write the
  # interleaved cos/sin they once held.
  freqs = 1.0 / 10000.0 ** (np.arange(0, k, 2, dtype=np.float64) / k)
  angles = np.outer(np.arange(cfg.max_seq_len), freqs)
  arrays = [w["embed"], per_layer(lambda p: w[p + "attn_norm"]),
            per_layer(lambda p: half_to_interleaved(out_in(w[p + "wq"]), cfg.n_heads)),
            per_layer(lambda p: half_to_interleaved(out_in(w[p + "wk"]), cfg.n_kv_heads)),
            per_layer(lambda p: out_in(w[p + "wv"])),
            per_layer(lambda p: w[p + "wo"].reshape(-1, cfg.dim).T),
            per_layer(lambda p: w[p + "mlp_norm"]),
            per_layer(lambda p: w[p + "w_gate"].T), per_layer(lambda p: w[p + "w_down"].T),
            per_layer(lambda p: w[p + "w_up"].T), w["final_norm"], np.cos(angles),
            np.sin(angles)]
  if not cfg.tie_embeddings:
    arrays.append(w["lm_head"].T)
  with open(path, "wb") as fh:
    fh.write(header.tobytes())
    for a in arrays:
      fh.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
