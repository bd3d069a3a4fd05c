"""FP8 matmuls for the dense layers of recommendation models, as in LoKA ("Low-precision
Kernel Applications for Recommendation Models At Scale"): E4M3 operands in the forward
matmul, E5M2 output gradients in the two backward matmuls, float32 accumulation, with
per-tensor or row-wise scaling, current or delayed, chosen per layer.

  y  = x @ w             forward:  Q4(x) @ Q4(w)
  dx = g @ w^T           backward: Q5(g) @ Q4(w)^T
  dw = x^T @ g                     Q4(x)^T @ Q5(g)
Q4 / Q5: `core.quant.quantize_fp8` to E4M3 / E5M2 with a scale per
  "tensor"  one amax per operand (Transformer Engine's recipe); the forward's quantized x
            and w are reused in the backward;
  "row"     one amax per row of each operand along the contraction (FBGEMM's f8f8bf16
            rowwise, torchao's "rowwise"): the forward scales x per row and w per output
            column; the backward requantizes w per input row (for dx) and x and g per
            column (for dw) from the high-precision residuals, so every scale factors out
            of its contraction and multiplies the float32 result;
and "current" scaling takes the amax of the operand itself, "delayed" (per tensor only)
the largest of the last `history` steps' amaxes (TE's delayed scaling), as a power of two:
the history holds ceil(log2 amax) per step, and a step before any history uses current
scaling. Values past a delayed amax saturate at the format's maximum.

The products of FP8 values are exact in float32, so on CPU the emulation is exact up to
the float32 accumulation order; on a GPU the same program hands XLA a dot_general of
float8 operands with a float32 result, which Hopper runs as an FP8 GEMM (cuBLASLt), the
scales applied after it.

Delayed scaling keeps its history in the model as an `Fp8History` variable ([3, history]:
rows x, w, g). A pure train step cannot write a model variable, so the new history
travels as the variable's gradient (Flax's "overwrite with gradient" idea): the
custom_vjp returns (new - old) * 2^-40 (so the global gradient norm barely moves: the
entries are integers below 2^11) and `with_fp8_history(tx)` turns that into an update of
exactly new - old (integers and a power of two: exact in float32). An optimizer without
that wrapper would treat the history as a parameter: `rec.configs.build_run` wraps the
dense optimizer whenever a model layer scales with delay.

Layers are picked by name patterns (`selected`): an MLP's layers are
`<mlp>.<index>` (bottom_mlp.0, top_mlp.2, deep_mlp.1), DCN cross layers `cross.<index>`;
"all" or "*" picks every one.

Letters: B rows (batch), K contraction, N outputs, H history length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core.quant import floats
from core.quant.mx import floor_log2
from core.quant import exact

EMPTY = -1000.0                    # a history slot with no amax yet
HISTORY_GRAD_SCALE = 2.0 ** -40    # the history's update rides its gradient, scaled down
_HISTORY_ROWS = 3                  # x, w, g


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How one layer's matmuls use FP8 (see the module docstring)."""

  granularity: str = "tensor"      # tensor | row
  scaling: str = "current"         # current | delayed (tensor only)
  history: int = 16                # delayed: steps of amax history
  fwd: str = "e4m3"                # format of x and w
  bwd: str = "e5m2"                # format of the output gradient

  def __post_init__(self):
    where = "rec/layers/fp8.py Fp8Recipe"
    if self.granularity not in ("tensor", "row"):
      raise ValueError(f"{where}: granularity={self.granularity!r}, expected 'tensor' or 'row'")
    if self.scaling not in ("current", "delayed"):
      raise ValueError(f"{where}: scaling={self.scaling!r}, expected 'current' or 'delayed'")
    if self.scaling == "delayed" and self.granularity != "tensor":
      raise ValueError(f"{where}: delayed scaling needs granularity='tensor' (a history of "
                       "per-row amaxes would follow rows of different batches)")
    if self.history < 1:
      raise ValueError(f"{where}: history={self.history}, expected >= 1")
    for f in (self.fwd, self.bwd):
      if f not in floats.FP8_FORMATS:
        raise ValueError(f"{where}: format {f!r}, expected one of {sorted(floats.FP8_FORMATS)}")

  @property
  def delayed(self) -> bool:
    return self.scaling == "delayed"


RECIPES = {
    "tensor": Fp8Recipe("tensor", "current"),
    "row": Fp8Recipe("row", "current"),
    "delayed": Fp8Recipe("tensor", "delayed"),
}


def get_recipe(name: str | Fp8Recipe) -> Fp8Recipe:
  if isinstance(name, Fp8Recipe):
    return name
  if name not in RECIPES:
    raise ValueError(f"fp8 recipe {name!r}: expected one of {sorted(RECIPES)}")
  return RECIPES[name]


def selected(layer: str, patterns: str) -> bool:
  """Whether `layer` (e.g. "top_mlp.1") matches the comma-separated `patterns` ("" none,
  "all" or "*" every layer, "top_mlp.*,cross.0" ...)."""
  pats = [p.strip() for p in patterns.split(",") if p.strip()]
  return any(p == "all" or fnmatch.fnmatchcase(layer, p) for p in pats)


def check_patterns(patterns: str, layers: list[str], where: str) -> None:
  """Raises if a pattern matches none of the model's FP8-capable `layers` (a typo)."""
  for p in [p.strip() for p in patterns.split(",") if p.strip()]:
    if p != "all" and not any(fnmatch.fnmatchcase(name, p) for name in layers):
      raise ValueError(f"{where}: fp8_layers pattern {p!r} matches no layer; the model's "
                       f"layers are {layers}")


# ---------------------------------------------------------------------------- history


class Fp8History(nnx.Variable):
  """Per layer, [3, H] float32: ceil(log2 amax) of x, w and g over the last H steps."""


def empty_history(recipe: Fp8Recipe) -> jax.Array:
  return jnp.full((_HISTORY_ROWS, recipe.history), EMPTY, jnp.float32)


def _log2_ceil(amax):
  """ceil(log2 amax) as float32, exact from the bits; EMPTY where amax is NaN, Inf or
  too small to scale (below FP8_MIN_AMAX)."""
  a = exact.abs_bits(amax)
  up = (a & 0x7FFFFF) != 0
  e = floor_log2(a) + up.astype(jnp.int32)
  ok = jnp.isfinite(amax) & (amax >= floats.FP8_MIN_AMAX)
  return jnp.where(ok, jnp.minimum(e, 127).astype(jnp.float32), EMPTY)


def _history_amax(row_H, current):
  """2^max(history) (exact), or `current` when the history is empty."""
  e = jnp.max(row_H)
  pow2 = exact.from_bits((jnp.clip(e, -126, 127).astype(jnp.int32) + 127) << 23)
  return jnp.where(e > EMPTY, pow2, current)


def _push(row_H, amax):
  return jnp.concatenate([_log2_ceil(amax)[None], row_H[:-1]])


def _is_history(path) -> bool:
  keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
  return any(k.startswith("fp8_history") for k in keys)


def with_fp8_history(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` for every parameter but the `Fp8History` leaves (keys "fp8_history*"), whose
  update is their gradient / HISTORY_GRAD_SCALE: exactly the new history minus the old.
  `tx` sees zero gradients for those leaves and keeps its usual state (the same tree as
  without the wrapper, so checkpoints and optax.tree_map_params see nothing new)."""

  def update(grads, state, params=None):
    hist = jax.tree_util.tree_map_with_path(lambda p, _: _is_history(p), grads)
    inner = jax.tree.map(lambda g, h: jnp.zeros_like(g) if h else g, grads, hist)
    updates, state = tx.update(inner, state, params)
    updates = jax.tree.map(lambda u, g, h: g * (1.0 / HISTORY_GRAD_SCALE) if h else u,
                           updates, grads, hist)
    return updates, state

  return optax.GradientTransformation(tx.init, update)


# ----------------------------------------------------------------------------- matmul


def _q(v, fmt, granularity, amax=None) -> floats.Fp8Tensor:
  return floats.quantize_fp8(v.astype(jnp.float32), fmt, granularity, amax)


def _mm(a, b):
  """float8 [M, K] @ float8 [K, N] -> float32 (an FP8 GEMM on Hopper)."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _forward(x, w, recipe, hist):
  """(y float32, residuals, new history rows x and w or None)."""
  if recipe.granularity == "row":
    xq = _q(x, recipe.fwd, "row")                            # [B, K], scale [B, 1]
    wq = _q(w.T, recipe.fwd, "row")                          # [N, K], scale [N, 1]
    y = _mm(xq.values, wq.values.T) * xq.scale_inv * wq.scale_inv.T
    return y, (x, w), None
  ax, aw = floats.fp8_amax(x), floats.fp8_amax(w)
  new = None
  if recipe.delayed:
    new = (_push(hist[0], ax), _push(hist[1], aw))
    ax, aw = _history_amax(hist[0], ax), _history_amax(hist[1], aw)
  xq, wq = _q(x, recipe.fwd, "tensor", ax), _q(w, recipe.fwd, "tensor", aw)
  y = _mm(xq.values, wq.values) * (xq.scale_inv * wq.scale_inv)
  return y, (xq, wq), new


def _backward(recipe, res, g, hist):
  """(dx, dw float32, new history row g or None)."""
  g = g.astype(jnp.float32)
  if recipe.granularity == "row":
    x, w = res
    g_r = _q(g, recipe.bwd, "row")                           # [B, N], scale [B, 1]
    w_r = _q(w, recipe.fwd, "row")                           # [K, N], scale [K, 1]
    dx = _mm(g_r.values, w_r.values.T) * g_r.scale_inv * w_r.scale_inv.T
    x_c = _q(x.T, recipe.fwd, "row")                         # [K, B], scale [K, 1]
    g_c = _q(g.T, recipe.bwd, "row")                         # [N, B], scale [N, 1]
    dw = _mm(x_c.values, g_c.values.T) * x_c.scale_inv * g_c.scale_inv.T
    return dx, dw, None
  xq, wq = res
  ag = floats.fp8_amax(g)
  new = None
  if recipe.delayed:
    new = _push(hist[2], ag)
    ag = _history_amax(hist[2], ag)
  gq = _q(g, recipe.bwd, "tensor", ag)
  dx = _mm(gq.values, wq.values.T) * (gq.scale_inv * wq.scale_inv)
  dw = _mm(xq.values.T, gq.values) * (xq.scale_inv * gq.scale_inv)
  return dx, dw, new


# Both custom_vjps take and return float32 (fp8_matmul casts around them, and autodiff
# transposes those casts).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_mm(x, w, recipe):
  return _forward(x, w, recipe, None)[0]


def _fp8_mm_fwd(x, w, recipe):
  y, res, _ = _forward(x, w, recipe, None)
  return y, res


def _fp8_mm_bwd(recipe, res, g):
  dx, dw, _ = _backward(recipe, res, g, None)
  return dx, dw


_fp8_mm.defvjp(_fp8_mm_fwd, _fp8_mm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_mm_delayed(x, w, hist, recipe):
  return _forward(x, w, recipe, hist)[0]


def _fp8_mm_delayed_fwd(x, w, hist, recipe):
  y, res, new = _forward(x, w, recipe, hist)
  return y, (res, hist, new)


def _fp8_mm_delayed_bwd(recipe, saved, g):
  res, hist, (new_x, new_w) = saved
  dx, dw, new_g = _backward(recipe, res, g, hist)
  new = jnp.stack([new_x, new_w, new_g])
  return dx, dw, (new - hist) * HISTORY_GRAD_SCALE


_fp8_mm_delayed.defvjp(_fp8_mm_delayed_fwd, _fp8_mm_delayed_bwd)


def fp8_matmul(x_BK: jax.Array, w_KN: jax.Array, recipe: Fp8Recipe | str = "tensor",
               history: jax.Array | None = None) -> jax.Array:
  """x @ w with FP8 operands (E4M3 forward, E5M2 gradients); x may have leading dims
  [..., K]. Delayed recipes need the layer's `history` ([3, H]); its gradient carries
  the updated history (see the module docstring). Returns x's dtype."""
  recipe = get_recipe(recipe)
  if w_KN.ndim != 2 or x_BK.shape[-1] != w_KN.shape[0]:
    raise ValueError(f"fp8_matmul: x {x_BK.shape} @ w {w_KN.shape}, expected [..., K] @ [K, N]")
  lead, dtype = x_BK.shape[:-1], x_BK.dtype
  x2 = x_BK.reshape(-1, x_BK.shape[-1]).astype(jnp.float32)
  w_KN = w_KN.astype(jnp.float32)
  if recipe.delayed:
    if history is None or history.shape != (_HISTORY_ROWS, recipe.history):
      raise ValueError(f"fp8_matmul: delayed scaling needs a history of shape "
                       f"{(_HISTORY_ROWS, recipe.history)}, got "
                       f"{None if history is None else history.shape}")
    y = _fp8_mm_delayed(x2, w_KN, history.astype(jnp.float32), recipe)
  else:
    y = _fp8_mm(x2, w_KN, recipe)
  return y.reshape(*lead, w_KN.shape[1]).astype(dtype)


def reference_matmul(x_BK, w_KN):
  """float32 x @ w at full precision (what the FP8 path approximates)."""
  return jnp.matmul(x_BK.astype(jnp.float32), w_KN.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------- layers

_capturing = [0]


@contextlib.contextmanager
def capture_errors():
  """While tracing inside this context, every FP8 layer also computes its float32 matmul
  on the same input and sows [sum((y8 - y32)^2), sum(y32^2)] as the nnx.Intermediate
  "fp8_error" (call the model through `nnx.capture(model, nnx.Intermediate)` to read
  them): the probe's per-layer error."""
  _capturing[0] += 1
  try:
    yield
  finally:
    _capturing[0] -= 1


def record_error(module: nnx.Module, y8: jax.Array, reference: Callable[[], jax.Array]) -> None:
  """Sows a layer's output error against its float32 reference (`reference()`, traced
  only inside `capture_errors`)."""
  if _capturing[0]:
    y8, y32 = y8.astype(jnp.float32), reference().astype(jnp.float32)
    module.sow(nnx.Intermediate, "fp8_error",
               jnp.stack([jnp.sum((y8 - y32) ** 2), jnp.sum(y32 ** 2)]))



_plain = [0]


@contextlib.contextmanager
def as_plain_matmuls():
  """While tracing inside this context, FP8 layers run their float matmul (what
  `rec.models.presets.model_stats` counts: the model's FLOPs, not the emulated
  quantization's element-wise work, which doubled a small model's count)."""
  _plain[0] += 1
  try:
    yield
  finally:
    _plain[0] -= 1


class Fp8Linear(nnx.Linear):
  """nnx.Linear whose matmul is `fp8_matmul` (same kernel / bias parameters, so an FP8
  model loads an fp32 model's state; delayed scaling adds `fp8_history`)."""

  def __init__(self, in_features: int, out_features: int, *, recipe: Fp8Recipe | str,
               rngs: nnx.Rngs, **kwargs: Any):
    super().__init__(in_features, out_features, rngs=rngs, **kwargs)
    self.recipe = get_recipe(recipe)
    if self.recipe.delayed:
      self.fp8_history = Fp8History(empty_history(self.recipe))

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    del out_sharding
    dtype = self.dtype or inputs.dtype
    kernel = self.kernel[...].astype(dtype)
    if _plain[0]:
      y = inputs.astype(dtype) @ kernel
    else:
      hist = self.fp8_history[...] if self.recipe.delayed else None
      y = fp8_matmul(inputs.astype(dtype), kernel, self.recipe, hist)
      record_error(self, y, lambda: reference_matmul(inputs, kernel))
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    return y


def history_rows(history: jax.Array) -> dict[str, np.ndarray]:
  """{x, w, g: the recorded ceil(log2 amax), newest first, EMPTY slots dropped}."""
  h = np.asarray(history)
  return {k: h[i][h[i] > EMPTY] for i, k in enumerate(("x", "w", "g"))}
