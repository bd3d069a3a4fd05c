"""Workload cost of a micro-batch, fitted from measured kernel times (arXiv 2503.17924, Sec. 4).

WLB-LLM balances micro-batches by their estimated latency W(x) = Wa(x) + Wl(x): attention,
which grows with the square of every document's length, plus the linear operators (QKV / O
projections, MLP), which grow with the micro-batch's token count. The paper obtains both
functions by offline profiling; here they are fitted to times measured on the machine in use:

  Wa(docs) = sum over documents of  a * l^2 + b * l + c     (one causal attention call each)
  Wl(T)    = d * T + e                                      (T = sum of the lengths)

in seconds for one transformer layer, forward + backward. A document-masked kernel that skips
masked blocks (the Pallas kernels, cuDNN's packed segments) costs the sum of its documents'
costs, so each document is timed alone (B=1, T=l, causal). `measure_attention` times any
registered implementation (`llm.attention`, e.g. "xla" on CPU, "cudnn" / "pallas" on a GPU);
`measure_linear` times one layer's matmuls. `fit_cost_model` measures at a `Shape`, fits,
and rescales to a target shape by FLOPs (attention terms by H*K, linear terms by the layer's
matmul FLOPs per token); on a GPU, measure at the target shape itself and the factors are 1.
`CostModel.save` / `load` keep a fit as JSON so a GPU fit can be reused elsewhere.

Letters: l document length, T tokens in a micro-batch, H query heads, G KV heads, K head dim.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import os
import time
from typing import Any, Sequence

import numpy as np

from llm import cost as llm_cost


@dataclasses.dataclass(frozen=True)
class Shape:
  """The per-layer sizes that set a layer's cost."""

  dim: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int

  @classmethod
  def from_config(cls, cfg) -> Shape:
    return cls(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim)

  @property
  def attention_width(self) -> int:
    """H * K: attention FLOPs per (query, key) pair are proportional to it."""
    return self.n_heads * self.head_dim

  @property
  def linear_flops_per_token(self) -> int:
    """Forward matmul FLOPs per token of one layer: Q, O, K, V projections and SwiGLU."""
    return llm_cost.linear_flops_per_token(self)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds per layer (forward + backward): sum_docs (a l^2 + b l + c) + d T + e."""

  attn_quad: float            # a: s per l^2
  attn_lin: float             # b: s per token of a document (softmax, memory traffic)
  attn_const: float           # c: s per document (per-call / per-segment overhead)
  lin_per_token: float        # d
  lin_const: float = 0.0      # e: s per micro-batch
  meta: dict = dataclasses.field(default_factory=dict, compare=False)

  def __post_init__(self):
    # A hand-edited or foreign JSON must not slip a string, NaN or negative cost into the
    # packers' sums and argmins (where a NaN load wins every comparison silently).
    for f in dataclasses.fields(self):
      if f.name == "meta":
        continue
      v = getattr(self, f.name)
      if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
          or not np.isfinite(v) or v < 0):
        raise ValueError(f"CostModel: {f.name}={v!r}; expected a finite number >= 0")

  def doc_attention(self, lengths) -> np.ndarray:
    l = np.asarray(lengths, np.float64)
    return self.attn_quad * l * l + self.attn_lin * l + self.attn_const * (l > 0)

  def doc_total(self, lengths) -> np.ndarray:
    """What one document adds to a micro-batch's W: its attention and its tokens' linear ops."""
    l = np.asarray(lengths, np.float64)
    return self.doc_attention(l) + self.lin_per_token * l

  def attention(self, lengths) -> float:
    """Wa of a micro-batch holding documents of these lengths."""
    return float(np.sum(self.doc_attention(lengths)))

  def linear(self, tokens) -> float:
    return self.lin_per_token * float(tokens) + self.lin_const

  def total(self, lengths) -> float:
    """W = Wa + Wl of a micro-batch holding documents of these lengths."""
    return self.attention(lengths) + self.linear(np.sum(lengths))

  def scaled(self, attn: float, linear: float, **meta) -> CostModel:
    """Attention's l^2 and l terms times `attn`, the per-token linear cost times `linear`;
    per-call constants kept; `meta` entries added."""
    return dataclasses.replace(
        self, attn_quad=self.attn_quad * attn, attn_lin=self.attn_lin * attn,
        lin_per_token=self.lin_per_token * linear, meta={**self.meta, **meta})

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> CostModel:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise ValueError(f"CostModel: unknown fields {sorted(unknown)}; expected {sorted(fields)}")
    return cls(**d)

  def save(self, path: str) -> str:
    from core.results import write_json
    return write_json(self.to_dict(), path)

  @classmethod
  def load(cls, path: str) -> CostModel:
    if not os.path.isfile(path):
      raise FileNotFoundError(errno.ENOENT, "no such cost model file (write one with "
                              "CostModel.save or experiments.wlb_packing --save_cost_model)",
                              path)
    with open(path) as f:
      d = json.load(f)
    if not isinstance(d, dict):
      raise ValueError(f"CostModel.load: {path} holds a JSON {type(d).__name__}; expected an "
                       "object of CostModel fields")
    try:
      return cls.from_dict(d)
    except (TypeError, ValueError) as e:
      raise ValueError(f"CostModel.load: {path}: {e}") from None


def flop_cost_model(shape: Shape) -> CostModel:
  """Pure FLOP counts (causal attention 4 H K l^2 / 2 forward, x3 with the backward), no
  overheads: the unfitted model, in FLOPs rather than seconds."""
  return CostModel(attn_quad=3 * 2 * shape.attention_width, attn_lin=0.0, attn_const=0.0,
                   lin_per_token=3.0 * shape.linear_flops_per_token,
                   meta={"source": "flops", "shape": dataclasses.asdict(shape)})


# ----------------------------------------------------------------------------- measuring


def _interleaved_medians(calls, repeats: int) -> list[float]:
  """Median seconds of each (fn, args) in `calls`, timed in `repeats` rounds that each run
  every call once, so that load from other processes falls on all points alike."""
  import jax
  for fn, args in calls:
    jax.block_until_ready(fn(*args))               # compile + warm up
  times = [[] for _ in calls]
  for _ in range(repeats):
    for k, (fn, args) in enumerate(calls):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - t)
  return [float(np.median(t)) for t in times]


def _attention_calls(lengths, shape: Shape, impl: str, dtype: str, backward: bool, seed: int):
  import jax
  from llm.attention import attention

  def fwd(q, k, v):
    return attention(q, k, v, impl=impl, causal=True)[0]

  if backward:
    def step(q, k, v, g):
      out, vjp = jax.vjp(fwd, q, k, v)
      return out, vjp(g)
  else:
    def step(q, k, v, g):
      del g
      return fwd(q, k, v)
  step = jax.jit(step)
  calls = []
  for n, l in enumerate(lengths):
    keys = jax.random.split(jax.random.key(seed + n), 4)
    q = jax.random.normal(keys[0], (1, l, shape.n_heads, shape.head_dim), dtype)
    k = jax.random.normal(keys[1], (1, l, shape.n_kv_heads, shape.head_dim), dtype)
    v = jax.random.normal(keys[2], (1, l, shape.n_kv_heads, shape.head_dim), dtype)
    g = jax.random.normal(keys[3], q.shape, dtype)
    calls.append((step, (q, k, v, g)))
  return calls


def _linear_calls(tokens, shape: Shape, dtype: str, backward: bool, seed: int):
  import jax
  import jax.numpy as jnp

  d, hk, gk, f = (shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim,
                  shape.ffn_dim)

  def layer(x, w):
    q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
    o = q @ w["o"]                       # the attention output has q's shape
    h = jax.nn.silu(x @ w["gate"]) * (x @ w["up"])
    return jnp.sum(o) + jnp.sum(h @ w["down"]) + jnp.sum(k) + jnp.sum(v)

  step = jax.jit(jax.grad(layer, argnums=(0, 1)) if backward else layer)
  keys = jax.random.split(jax.random.key(seed), 8)
  sizes = {"q": (d, hk), "k": (d, gk), "v": (d, gk), "o": (hk, d), "gate": (d, f),
           "up": (d, f), "down": (f, d)}
  w = {name: jax.random.normal(key, s, dtype) * s[0] ** -0.5
       for key, (name, s) in zip(keys[1:], sizes.items())}
  return [(step, (jax.random.normal(keys[0], (t, d), dtype), w)) for t in tokens]


def measure_attention(lengths: Sequence[int], shape: Shape, *, impl: str = "xla",
                      dtype: str = "float32", repeats: int = 5, backward: bool = True,
                      seed: int = 0) -> list[float]:
  """Median seconds of one causal attention call (forward, + backward when `backward`) on a
  single document of each length: q [1,l,H,K], k / v [1,l,G,K], through
  `llm.attention.attention(impl=...)`."""
  return _interleaved_medians(_attention_calls(lengths, shape, impl, dtype, backward, seed),
                              repeats)


def measure_linear(tokens: Sequence[int], shape: Shape, *, dtype: str = "float32",
                   repeats: int = 5, backward: bool = True, seed: int = 0) -> list[float]:
  """Median seconds of one layer's matmuls (Q, K, V, O projections and the SwiGLU MLP) on T
  tokens, forward (+ backward: gradients of the input and every weight)."""
  return _interleaved_medians(_linear_calls(tokens, shape, dtype, backward, seed), repeats)


# ----------------------------------------------------------------------------- fitting


def fit_nonnegative(columns: np.ndarray, y: np.ndarray) -> np.ndarray:
  """Least squares of y on the columns with every coefficient >= 0, in relative error (rows
  weighted by 1 / y: times span orders of magnitude). Exact for a few columns: the best fit
  over every subset of columns whose unconstrained solution is non-negative."""
  x = np.asarray(columns, np.float64)
  y = np.asarray(y, np.float64)
  if x.ndim != 2 or x.shape[0] != y.shape[0]:
    raise ValueError(f"fit_nonnegative: columns {x.shape} and y {y.shape} disagree")
  if np.any(y <= 0):
    raise ValueError(f"fit_nonnegative: times must be > 0, got {y.tolist()}")
  w = 1.0 / y
  best, best_err = np.zeros(x.shape[1]), np.inf
  for r in range(1, x.shape[1] + 1):
    for cols in itertools.combinations(range(x.shape[1]), r):
      sub = x[:, cols] * w[:, None]
      coef, *_ = np.linalg.lstsq(sub, y * w, rcond=None)
      if np.any(coef < 0):
        continue
      err = float(np.sum((sub @ coef - y * w) ** 2))
      if err < best_err:
        best_err, best = err, np.zeros(x.shape[1])
        best[list(cols)] = coef
  return best


def fit_attention(lengths, times) -> tuple[float, float, float]:
  """(a, b, c) >= 0 with time(l) ~ a l^2 + b l + c."""
  l = np.asarray(lengths, np.float64)
  a, b, c = fit_nonnegative(np.stack([l * l, l, np.ones_like(l)], 1), times)
  return float(a), float(b), float(c)


def fit_linear(tokens, times) -> tuple[float, float]:
  """(d, e) >= 0 with time(T) ~ d T + e."""
  t = np.asarray(tokens, np.float64)
  d, e = fit_nonnegative(np.stack([t, np.ones_like(t)], 1), times)
  return float(d), float(e)


def relative_errors(pred, measured) -> list[float]:
  pred, measured = np.asarray(pred, np.float64), np.asarray(measured, np.float64)
  return ((pred - measured) / measured).tolist()


def fit_cost_model(measure_shape: Shape, target: Shape | None = None, *,
                   lengths: Sequence[int] = (128, 256, 512, 768, 1024, 1536, 2048),
                   tokens: Sequence[int] = (256, 512, 1024, 2048, 4096),
                   impl: str = "xla", dtype: str = "float32", repeats: int = 5,
                   progress=None) -> CostModel:
  """Measures attention per document and one layer's linear ops at `measure_shape`, fits
  W = sum (a l^2 + b l + c) + d T + e, and scales it to `target` by FLOPs (None: no scaling).
  `meta` records the measurements, the fit's relative errors and the scaling factors."""
  import jax
  from core.benchmark import machine

  say = progress or (lambda msg: None)
  say(f"timing attention ({impl}, {dtype}) at lengths {list(lengths)} and linear ops at "
      f"{list(tokens)} tokens, {repeats} interleaved rounds")
  # One set of rounds for both, so that the attention / linear ratio is measured side by side.
  calls = (_attention_calls(lengths, measure_shape, impl, dtype, True, 0)
           + _linear_calls(tokens, measure_shape, dtype, True, 0))
  times = _interleaved_medians(calls, repeats)
  t_attn, t_lin = times[:len(lengths)], times[len(lengths):]
  a, b, c = fit_attention(lengths, t_attn)
  d, e = fit_linear(tokens, t_lin)
  model = CostModel(a, b, c, d, e)
  meta = {
      "source": "measured", "impl": impl, "dtype": dtype, "repeats": repeats,
      "backend": jax.default_backend(), "machine": machine(),
      "measure_shape": dataclasses.asdict(measure_shape),
      "attention": {"lengths": list(lengths), "seconds": t_attn,
                    "rel_err": relative_errors(model.doc_attention(lengths), t_attn)},
      "linear": {"tokens": list(tokens), "seconds": t_lin,
                 "rel_err": relative_errors([model.linear(t) for t in tokens], t_lin)},
  }
  model = dataclasses.replace(model, meta=meta)
  if target is None or target == measure_shape:
    return dataclasses.replace(model, meta={**meta, "target_shape": meta["measure_shape"],
                                            "attn_factor": 1.0, "linear_factor": 1.0})
  fa = target.attention_width / measure_shape.attention_width
  fl = target.linear_flops_per_token / measure_shape.linear_flops_per_token
  return model.scaled(fa, fl, target_shape=dataclasses.asdict(target),
                      attn_factor=fa, linear_factor=fl)


def from_setting(text: str, cfg) -> CostModel:
  """The workload model of --cost_model=`text` for LlamaConfig `cfg`: "flops" (its FLOP
  counts in GFLOP units) or a CostModel JSON's path (seconds)."""
  if text == "flops":
    return flop_cost_model(Shape.from_config(cfg)).scaled(1e-9, 1e-9, unit="GFLOP")
  return CostModel.load(text)
