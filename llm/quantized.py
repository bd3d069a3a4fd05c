"""Weight-only quantized Llama inference: the model's matrices held as group-wise int8 / int4
codes (`core.quant.groupwise`, ggml's Q8_0 / Q4_0 / Q4_1 layouts) and dequantized inside the
jitted computation, at each matmul, so memory holds only the codes, scales and biases.

Modes (generate / bench_llm `--weights`, `checkpoints.load_model(..., weights=...)`):
  float32  no quantization: the checkpoint's float weights (in the model's param dtype)
  int8     every matrix int8, groups of 32 along its input axis, one float16 scale
  int4     every matrix int4, groups of 32, a float16 scale and minimum (Q4_1's form)
  gguf     (gguf: checkpoints) every tensor as the file stores it: Q8_0 -> int8, Q4_0 /
           Q4_1 -> int4 blocks; other types dequantized to float
A GGUF's Q8_0 blocks are taken directly in int8 mode, its Q4_0 / Q4_1 blocks in int4 mode
(`StoredTensor.rows()`: same codes, scales and minimums, no requantization); a tensor of
another type is dequantized and quantized here. The K-quants (Q4_K, Q5_K, Q6_K) do not map:
their 32-element sub-blocks carry 6-bit scales times a float16 super-scale (a float32
product), and Q5_K / Q6_K codes are 5 / 6 bits; they are dequantized and requantized.

Quantized: embed, wq, wk, wv, wo, w_gate, w_up, w_down, lm_head; the norms stay float. A
matrix whose input axis is not a multiple of the group size stays float (as llama.cpp keeps
such a matrix F16); `quantize` reports each tensor's form. The embedding is quantized along
the model dim, its contraction axis as the tied output projection; a lookup dequantizes
only the rows it reads.

Each quantized matrix is a `QuantizedParam`: ggml-style rows [out, in] plus the contract
shape (`llm.weights`), so `value()` gives the same array `load_weights` would hold for the
dequantized float weights. Single device: no mesh sharding of quantized parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from core.quant import groupwise
from llm.config import LlamaConfig

MODES = ("float32", "int8", "int4", "gguf")
MATRICES = ("embed", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
_BITS = {"int8": 8, "int4": 4}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedParam:
  """A contract parameter held quantized: rows [out, in] (the embedding: [V, D]) and how
  they map back to the contract shape."""

  rows: groupwise.GroupQuantized
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))   # contract shape
  transposed: bool = dataclasses.field(default=True, metadata=dict(static=True))
  # "auto": `matmul` runs the Pallas kernel (kernels/weight_only_matmul.py) on a GPU where
  # it takes the call, else XLA's `groupwise_matmul`; "xla": always the latter.
  matmul_impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    return self.rows.nbytes

  def value(self, dtype=jnp.float32) -> jax.Array:
    """The dequantized parameter in its contract shape and `dtype`."""
    w = self.rows.dequantize(dtype)
    return (w.T if self.transposed else w).reshape(self.shape)

  def _dims(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of the contract shape: rows [prod(out), prod(in)]."""
    if not self.transposed:                  # embedding [V, D]: contracts D
      return self.shape[1:], self.shape[:1]
    k = self.rows.shape[1]
    for n_in in range(1, len(self.shape)):
      if int(np.prod(self.shape[:n_in])) == k:
        return self.shape[:n_in], self.shape[n_in:]
    raise ValueError(f"QuantizedParam: rows {self.rows.shape} do not match the leading "
                     f"axes of the contract shape {self.shape}")

  def matmul(self, x, dtype=jnp.float32, preferred_element_type=None) -> jax.Array:
    """x [..., *in] times the parameter -> [..., *out] (as `jnp.einsum` of x with `value()`),
    the rows dequantized inside the computation and contracted in their own [out, in]
    layout: on a GPU, bf16 / fp16 x of a few rows, in registers by the Pallas kernel
    (`matmul_impl` "auto"); else by `groupwise.groupwise_matmul`."""
    in_dims, out_dims = self._dims()
    lead = x.shape[:x.ndim - len(in_dims)]
    x_MK = x.reshape(-1, self.rows.shape[1])
    if self.matmul_impl == "auto" and _kernel_backend():
      from kernels import weight_only_matmul as wom
      x_MK = x_MK.astype(dtype)
      if wom.supports(x_MK.dtype, x_MK.shape[0], self.rows) is None:
        y = wom.weight_only_matmul(x_MK, self.rows, out_dtype=preferred_element_type or dtype)
        return y.reshape(*lead, *out_dims)
    y = groupwise.groupwise_matmul(x_MK, self.rows, dtype, preferred_element_type)
    return y.reshape(*lead, *out_dims)

  def take(self, ids, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` of an embedding-like parameter [V, D], dequantized: [..., D]."""
    if self.transposed:
      raise ValueError(f"QuantizedParam.take: a transposed parameter of shape {self.shape} "
                       "has no rows to take")
    return self.rows.take_rows(ids, dtype)


def _kernel_backend() -> bool:
  """Whether "auto" takes the Pallas kernel: on a GPU (tests run it interpreted on CPU)."""
  return jax.default_backend() == "gpu"


def _short(name: str) -> str:
  return name.rsplit(".", 1)[-1]


def _rows_of(name: str, w: np.ndarray) -> np.ndarray:
  """Contract array -> rows [out, in] (the embedding as it is)."""
  from llm.weights import _from_contract
  return np.asarray(w) if _short(name) == "embed" else _from_contract(name, w)


def _param(name: str, shape, rows: groupwise.GroupQuantized,
           matmul_impl: str = "auto") -> QuantizedParam:
  return QuantizedParam(rows, tuple(shape), _short(name) != "embed", matmul_impl)


def check_mode(mode: str, checkpoint_kind: str | None, flag: str = "--weights") -> None:
  """Raises ValueError naming `flag` for an unknown mode, or `gguf` on another checkpoint."""
  if mode not in MODES:
    raise ValueError(f"{flag}={mode!r}: expected one of {', '.join(MODES)}")
  if mode == "gguf" and checkpoint_kind != "gguf":
    raise ValueError(f"{flag}=gguf takes the blocks a GGUF file stores; the checkpoint is "
                     f"{checkpoint_kind or 'random weights'}: use --weights=int8 or int4")


def quantize(cfg: LlamaConfig, mode: str, weights: dict[str, np.ndarray] | None = None,
             stored: dict | None = None, group: int = groupwise.GROUP):
  """(params, forms): the flat contract with each matrix a `QuantizedParam` where `mode`
  quantizes it, else a float32 array; forms {name: how it is held} (e.g. "int4 Q4_1
  blocks", "int8", "float32 (in 172 not a multiple of 32)").

  `stored`: a GGUF's tensors (`GGUFCheckpoint.tensors`), whose blocks are taken directly
  where they map (module docstring); `weights`: float32 contract weights (needed without
  `stored`)."""
  from llm.weights import _hf_shape, _to_contract, check_finite, param_shapes
  check_mode(mode, "gguf" if stored is not None else None, flag="weights")
  if weights is None and stored is None:
    raise ValueError("quantize: give float `weights` or a GGUF's `stored` tensors")
  params, forms = {}, {}
  for name, shape in param_shapes(cfg).items():
    t = None if stored is None else stored.get(name)

    def as_float():
      if t is None:
        return np.asarray(weights[name], np.float32)
      w = t.dequantize()
      check_finite(t.name, w, f"{t.qtype}, dequantized")
      return _to_contract(cfg, name, w)

    if _short(name) not in MATRICES or mode == "float32":
      params[name], forms[name] = as_float(), "float32"
      continue
    src = f" {t.qtype}" if t is not None else ""
    direct = t is not None and t.qtype in groupwise.GGML_BLOCKS
    if mode == "gguf":
      bits = groupwise.GGML_BLOCKS[t.qtype][0] if direct else None
    else:
      bits = _BITS[mode]
      direct = direct and groupwise.GGML_BLOCKS[t.qtype][0] == bits
    if bits is None:
      params[name], forms[name] = as_float(), f"float32 (from{src})"
      continue
    if direct:
      rows = groupwise.from_ggml_blocks(t.rows(), t.qtype, where=f"{t.name} ({t.qtype})")
      if rows.shape != _hf_shape(cfg, name):
        raise ValueError(f"{t.name}: {t.qtype} blocks give rows {rows.shape}, expected "
                         f"{_hf_shape(cfg, name)} for {name}")
      params[name], forms[name] = _param(name, shape, rows), f"int{bits} {t.qtype} blocks"
      continue
    w = as_float()
    rows = _rows_of(name, w)
    if rows.shape[1] % group:
      params[name] = w
      forms[name] = f"float32 (in {rows.shape[1]} not a multiple of {group})"
      continue
    q = groupwise.quantize_groupwise(rows, bits, group, where=t.name if t else name)
    params[name] = _param(name, shape, q)
    forms[name] = f"int{bits}" + (f" (requantized from{src})" if t is not None else "")
  return params, forms


def random_params(cfg: LlamaConfig, mode: str, seed: int = 0, group: int = groupwise.GROUP,
                  matmul_impl: str = "auto"):
  """The flat contract of `cfg` held as `quantize(cfg, mode)` would hold it, with random
  codes, float16 scales (and int4's minimums) drawn on the default device: no float weights
  are drawn or quantized, so a model of a billion parameters is ready in a second. For
  timing quantized inference only: the dequantized weights are noise of about the scale of
  a trained model's (|w| < 0.03), and the outputs mean nothing. The norms are ones; a matrix
  whose input axis is not a multiple of `group` is float noise in cfg.param_dtype, as
  `quantize` keeps it float. matmul_impl: the matrices' `QuantizedParam.matmul_impl`."""
  from llm.weights import param_shapes
  from llm.weights_hf import _hf_shape
  if mode not in _BITS:
    raise ValueError(f"random_params: mode={mode!r}, expected one of {tuple(_BITS)}")
  bits, key = _BITS[mode], jax.random.key(seed)
  f16 = jnp.float16
  params = {}
  for i, (name, shape) in enumerate(param_shapes(cfg).items()):
    k_codes, k_scale, k_float = jax.random.split(jax.random.fold_in(key, i), 3)
    if _short(name) not in MATRICES:
      params[name] = np.ones(shape, np.float32)
      continue
    n, k = tuple(shape) if _short(name) == "embed" else _hf_shape(cfg, name)
    if k % group:
      params[name] = np.asarray(0.02 * jax.random.normal(k_float, shape, jnp.float32))
      continue
    scale = jax.random.uniform(k_scale, (n, k // group), jnp.float32, 1e-4, 2e-4)
    if bits == 8:
      codes = jax.random.randint(k_codes, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
      rows = groupwise.GroupQuantized(codes, scale.astype(f16), None, 8, group)
    else:      # two codes in [0, 15] per byte; w = scale * code + bias, bias = -7.5 scale
      codes = jax.random.randint(k_codes, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
      scale = scale * 16
      rows = groupwise.GroupQuantized(codes, scale.astype(f16), (-7.5 * scale).astype(f16),
                                      4, group)
    params[name] = _param(name, shape, rows, matmul_impl)
  return params


def held_bytes(cfg: LlamaConfig, mode: str, group: int = groupwise.GROUP) -> int:
  """Bytes the parameters of `cfg` hold under `mode`, from the shapes alone (what `quantize`
  makes, then loaded into the model: floats in cfg.param_dtype): int8 codes + float16
  scales, int4 packed codes + float16 scales and minimums; a matrix whose input axis is not
  a multiple of `group` stays float. For `gguf` the file's types are unknown here: the
  smallest they map to, Q4_0's (no minimums), a lower bound."""
  from llm.weights import param_shapes
  from llm.weights_hf import _hf_shape
  check_mode(mode, "gguf" if mode == "gguf" else None, flag="weights")
  item = np.dtype(cfg.param_dtype).itemsize
  bits = 8 if mode == "int8" else 4
  per_group = 2 * (1 + (mode == "int4"))      # float16 scale (+ float16 minimum: Q4_1)
  total = 0
  for name, shape in param_shapes(cfg).items():
    n = int(np.prod(shape))
    rows = shape if _short(name) == "embed" else _hf_shape(cfg, name)
    if mode == "float32" or _short(name) not in MATRICES or rows[-1] % group:
      total += n * item
    else:
      total += n * bits // 8 + n // group * per_group
  return total


def summarize_forms(forms: dict[str, str]) -> dict[str, int]:
  """{form: tensor count}, layer indices folded (for a one-line report)."""
  out: dict[str, int] = {}
  for form in forms.values():
    out[form] = out.get(form, 0) + 1
  return dict(sorted(out.items()))


def param_bytes(params: dict) -> int:
  """Bytes the flat parameters hold (quantized ones as codes + scales + biases)."""
  return sum(p.nbytes if isinstance(p, QuantizedParam) else np.asarray(p).nbytes
             for p in params.values())
