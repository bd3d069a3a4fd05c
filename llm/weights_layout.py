"""The flat weight dict every Llama loader meets in, and the conversions it needs.

    embed [V, D]; per layer i: layers.{i}.attn_norm [D], layers.{i}.wq [D, H, K],
    layers.{i}.wk [D, G, K], layers.{i}.wv [D, G, K], layers.{i}.wo [H, K, D],
    layers.{i}.mlp_norm [D], layers.{i}.w_gate [D, F], layers.{i}.w_up [D, F],
    layers.{i}.w_down [F, D]; final_norm [D]; lm_head [D, V] (absent when tied);
    with cfg.qkv_bias (Qwen2) also layers.{i}.bq [H, K], layers.{i}.bk / bv [G, K].

`param_shapes` / `check_weights` state and check it; `in_out` / `out_in` convert torch-style
[out, in] matrices; `interleaved_to_half` / `half_to_interleaved` permute q and k rows
between Meta's RoPE pairs and the model's half-split ones; `check_finite` finds a NaN or Inf;
`cast_for_export` casts for a file, refusing a value the narrower type cannot hold.

Letters: V vocab, D model dim, H query heads, G key/value heads, K head dim, F FFN hidden.
"""

from __future__ import annotations

import ml_dtypes  # registers numpy's "bfloat16" dtype, which safetensors' numpy path uses
import numpy as np

from llm.config import LlamaConfig

Weights = dict[str, np.ndarray]

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


# ---------------------------------------------------------------------------------------------
# RoPE layout permutations on [n_heads * K, D_in] ("out, in") matrices.

def _permute_heads(w: np.ndarray, n_heads: int, to_half: bool, where: str) -> np.ndarray:
  """Within each head, swaps the (K/2, 2) and (2, K/2) views of its K rows."""
  w = np.asarray(w)
  hk = w.shape[0]
  if hk % n_heads or (hk // n_heads) % 2:
    raise ValueError(f"{where}: {hk} rows do not split into {n_heads} heads of an even head_dim")
  half = hk // n_heads // 2
  split = (half, 2) if to_half else (2, half)
  return w.reshape(n_heads, *split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Meta/llama2.c q or k rows [H*K, ...] (pairs 2j, 2j+1) -> half-split rows (pairs j, j+K/2)."""
  return _permute_heads(w, n_heads, True, "interleaved_to_half")


def half_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of `interleaved_to_half`: half-split q or k rows back to Meta/llama2.c rows."""
  return _permute_heads(w, n_heads, False, "half_to_interleaved")


# ---------------------------------------------------------------------------------------------
# Contract shapes and the [out, in] <-> contract conversions shared by both formats.

def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """The contract name -> shape table for `cfg` (lm_head only when untied, q / k / v biases
  only with qkv_bias)."""
  v, d, h, g, k, f = (cfg.vocab_size, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                      cfg.ffn_dim)
  shapes = {"embed": (v, d)}
  for i in range(cfg.n_layers):
    p = f"layers.{i}."
    shapes.update({p + "attn_norm": (d,), p + "wq": (d, h, k), p + "wk": (d, g, k),
                   p + "wv": (d, g, k), p + "wo": (h, k, d), p + "mlp_norm": (d,),
                   p + "w_gate": (d, f), p + "w_up": (d, f), p + "w_down": (f, d)})
    if cfg.qkv_bias:
      shapes.update({p + "bq": (h, k), p + "bk": (g, k), p + "bv": (g, k)})
  shapes["final_norm"] = (d,)
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (d, v)
  return shapes


def check_weights(cfg: LlamaConfig, weights: Weights, where: str = "weights") -> None:
  """Raises ValueError naming any missing, unexpected or wrongly shaped parameter."""
  shapes = param_shapes(cfg)
  missing = [n for n in shapes if n not in weights]
  extra = [n for n in weights if n not in shapes]
  if missing or extra:
    raise ValueError(f"{where}: missing parameters {missing[:8]}, unexpected {extra[:8]} "
                     f"for vocab={cfg.vocab_size} dim={cfg.dim} n_layers={cfg.n_layers} "
                     f"tie_embeddings={cfg.tie_embeddings} qkv_bias={cfg.qkv_bias}")
  for n, shape in shapes.items():
    if tuple(np.shape(weights[n])) != shape:
      raise ValueError(f"{where}: parameter {n!r} has shape {tuple(np.shape(weights[n]))}, "
                       f"expected {shape}")


def in_out(w_out_in: np.ndarray, *heads: int) -> np.ndarray:
  """[out, in] torch/Meta matrix -> contract [in, *heads] (heads split `out`)."""
  w = np.ascontiguousarray(np.asarray(w_out_in).T)
  return w.reshape(w.shape[0], *heads) if heads else w


def out_in(w: np.ndarray) -> np.ndarray:
  """Contract [in, ...] -> [out, in] with the trailing axes flattened into `out`."""
  w = np.asarray(w)
  return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


_WIDER = "a wider type (float32 / bfloat16, GGUF F32 or Q8_0)"


def cast_for_export(name: str, a: np.ndarray, dtype, where: str,
                    wider: str = _WIDER) -> np.ndarray:
  """`a` as `dtype`; a finite value that becomes an Inf there (beyond float16's 65504) is a
  ValueError naming `where`, tensor `name` and its largest magnitude (`wider`: what to use
  instead), never written or loaded."""
  a = np.asarray(a)
  with np.errstate(over="ignore"):   # found below, named in the error
    out = a.astype(dtype)
  if (out.dtype.kind == "f" or out.dtype == DTYPES["bfloat16"]) and np.isinf(out).any():
    lost = np.isinf(out) & np.isfinite(a)
    if lost.any():
      raise ValueError(f"{where}: tensor {name!r} {tuple(a.shape)} holds values up to "
                       f"{float(np.abs(a[np.isfinite(a)]).max()):.6g} in magnitude, which "
                       f"{np.dtype(dtype).name} cannot hold ({int(lost.sum())} would become "
                       f"Inf); expected {wider}")
  return out


def check_finite(name: str, a: np.ndarray, where: str) -> None:
  """Raises ValueError naming `where` and tensor `name` when `a` holds a NaN or an Inf."""
  a = np.asarray(a)
  if a.dtype.kind in "fc" or a.dtype == DTYPES["bfloat16"]:
    bad = ~np.isfinite(a)
    if bad.any():
      first = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{where}: tensor {name!r} {tuple(a.shape)} holds {int(bad.sum())} "
                       f"non-finite values (NaN or Inf), the first at index {first} = "
                       f"{a[first]}; the checkpoint is corrupt or diverged")
