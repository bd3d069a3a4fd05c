"""LoRA (Hu et al., arXiv 2106.09685): low-rank adapters on the Llama projections, the base
frozen (float, or int8 / int4 weights as `llm.quantized` holds them: QLoRA-style).

A target projection W (contract shape [*in, *out], e.g. wq [D, H, K]) computes
  y = x W + (alpha / rank) * (x A) B,    A [*in, rank], B [rank, *out]
with A drawn from N(0, 1 / in_features) and B zero, so training starts at the base model.
`LoraWeight` holds (W, A, B) as one parameter value: the model's dense products
(`llm.model._dense`) multiply x by W as they would without adapters (a `QuantizedParam`
dequantized inside the computation) and add the low-rank path, so no merged weight is
formed and the gradients of A and B cost two thin products per projection.

Adapters are a flat dict {contract name: {"a": A, "b": B}} ("layers.3.wq", ...).
`with_adapters` puts them into a model; `merge` adds their product into float weights
(for export: the merged model is a plain checkpoint); `save_peft` / `load_peft` write and
read them as a Hugging Face PEFT adapter directory (adapter_config.json +
adapter_model.safetensors, lora_A [rank, in] / lora_B [out, rank] per HF module), which
`peft.PeftModel.from_pretrained` loads on top of the exported HF base.

Letters: r rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from core import errors

# Targets: the projections of a block, and groups of them.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GROUPS = {"attention": ("wq", "wk", "wv", "wo"), "mlp": ("w_gate", "w_up", "w_down"),
          "all": PROJECTIONS}
# Contract name -> (the HF module under model.layers.{i}, how many leading axes are inputs)
_HF_MODULES = {"wq": ("self_attn.q_proj", 1), "wk": ("self_attn.k_proj", 1),
               "wv": ("self_attn.v_proj", 1), "wo": ("self_attn.o_proj", 2),
               "w_gate": ("mlp.gate_proj", 1), "w_up": ("mlp.up_proj", 1),
               "w_down": ("mlp.down_proj", 1)}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r, alpha (the update is scaled by alpha / r), and the projections adapted."""
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = GROUPS["all"]

  def __post_init__(self):
    if not (isinstance(self.rank, int) and self.rank >= 1):
      raise ValueError(f"--lora_rank={self.rank}: expected an integer >= 1")
    if not (math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"--lora_alpha={self.alpha}: expected a number > 0")
    object.__setattr__(self, "targets", expand_targets(self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def peft_config(self) -> dict[str, Any]:
    """adapter_config.json of a PEFT LoRA adapter with these settings."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
            "target_modules": sorted(_HF_MODULES[t][0].split(".")[1] for t in self.targets),
            "base_model_name_or_path": None}


def expand_targets(targets: Sequence[str] | str) -> tuple[str, ...]:
  """Projection names from names and groups ("attention", "mlp", "all"), in model order;
  an unknown one is an error naming --lora_targets."""
  if isinstance(targets, str):
    targets = [t for t in targets.split(",") if t]
  out = set()
  for t in targets:
    if t in GROUPS:
      out.update(GROUPS[t])
    elif t in PROJECTIONS:
      out.add(t)
    else:
      raise ValueError(f"--lora_targets: {t!r}; expected projections of {list(PROJECTIONS)} "
                       f"or groups {list(GROUPS)}")
  if not out:
    raise ValueError("--lora_targets: empty; expected at least one projection")
  return tuple(p for p in PROJECTIONS if p in out)


def _short(name: str) -> str:
  return name.rsplit(".", 1)[-1]


def _n_in(name: str) -> int:
  return _HF_MODULES[_short(name)][1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
  """A projection's value with an adapter: base W (an array or a QuantizedParam, frozen),
  A [*in, r], B [r, *out], and the scale alpha / r."""
  base: Any
  a: jax.Array
  b: jax.Array
  scale: float = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.a.shape[:-1]) + tuple(self.b.shape[1:])

  def delta(self, dtype=jnp.float32) -> jax.Array:
    """scale * A B in the contract shape."""
    a = self.a.astype(jnp.float32).reshape(-1, self.a.shape[-1])
    b = self.b.astype(jnp.float32).reshape(self.b.shape[0], -1)
    return (self.scale * (a @ b)).reshape(self.shape).astype(dtype)

  def low_rank(self, x, dtype) -> jax.Array:
    """scale * (x A) B for x [..., *in] -> [..., *out], in `dtype`."""
    n_in = self.a.ndim - 1
    lead = x.shape[:x.ndim - n_in]
    # The scale goes into A in float32 before the cast: a bfloat16 scale (16 / 12 ->
    # 1.3359) would scale every update by the same wrong factor, unlike the merged weights.
    a = self.a.reshape(-1, self.a.shape[-1]).astype(jnp.float32) * self.scale
    xa = x.reshape(*lead, -1).astype(dtype) @ a.astype(dtype)
    y = xa @ self.b.reshape(self.b.shape[0], -1).astype(dtype)
    return y.reshape(*lead, *self.b.shape[1:])


def init_adapters(shapes: Mapping[str, Sequence[int]], cfg: LoraConfig, key: jax.Array,
                  n_layers: int | None = None) -> dict[str, dict[str, jax.Array]]:
  """Adapters of every target projection in `shapes` (contract name -> shape, e.g.
  `llm.weights.param_shapes`): A ~ N(0, 1 / in_features), B = 0, float32."""
  out = {}
  names = [n for n in shapes if _short(n) in cfg.targets]
  for name, k in zip(names, jax.random.split(key, max(len(names), 1))):
    shape = tuple(shapes[name])
    n_in = _n_in(name)
    fan_in = math.prod(shape[:n_in])
    a = jax.random.normal(k, (*shape[:n_in], cfg.rank), jnp.float32) / math.sqrt(fan_in)
    out[name] = {"a": a, "b": jnp.zeros((cfg.rank, *shape[n_in:]), jnp.float32)}
  return out


def adapter_size(shapes: Mapping[str, Sequence[int]], cfg: LoraConfig) -> int:
  """Elements of the adapters `init_adapters` makes for `shapes`: (in + out) x rank per
  target projection."""
  return sum((math.prod(shape[:_n_in(name)]) + math.prod(shape[_n_in(name):])) * cfg.rank
             for name, shape in shapes.items() if _short(name) in cfg.targets)


def with_adapters(model, adapters: Mapping[str, Mapping[str, jax.Array]], cfg: LoraConfig):
  """`model` (an `llm.model.Llama`, changed in place and returned) with each adapted
  projection's value a `LoraWeight` over its current value."""
  from llm import model as model_lib
  params = model_lib._flat_params(model)
  unknown = sorted(set(adapters) - set(params))
  if unknown:
    raise ValueError(f"with_adapters: {unknown[:4]} are not parameters of the model")
  for name, ab in adapters.items():
    var = params[name]
    base = var.get_value()
    if isinstance(base, LoraWeight):
      raise ValueError(f"with_adapters: {name} has an adapter already")
    var.set_value(LoraWeight(base, ab["a"], ab["b"], cfg.scale))
  return model


def merge(weights: Mapping[str, Any], adapters: Mapping[str, Mapping[str, Any]],
          cfg: LoraConfig) -> dict[str, np.ndarray]:
  """Float32 contract weights with each adapter's scale * A B added (a quantized base is
  dequantized first): a plain checkpoint of the fine-tuned model."""
  from llm.quantized import QuantizedParam
  unknown = sorted(set(adapters) - set(weights))
  if unknown:
    raise ValueError(f"merge: adapters {unknown[:4]} ({len(unknown)}) are not among the "
                     f"weights ({len(weights)} parameters); expected adapters of its projections")
  out = {}
  for name, w in weights.items():
    if isinstance(w, QuantizedParam):
      w = w.value(jnp.float32)
    w = np.asarray(jax.device_get(w), np.float32)
    if name in adapters:
      a = np.asarray(jax.device_get(adapters[name]["a"]), np.float64)
      b = np.asarray(jax.device_get(adapters[name]["b"]), np.float64)
      d = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
      w = (w.astype(np.float64) + cfg.scale * d.reshape(w.shape)).astype(np.float32)
    out[name] = w
  return out


def _peft_key(name: str, which: str) -> str:
  layer = name.split(".")[1]
  return f"base_model.model.model.layers.{layer}.{_HF_MODULES[_short(name)][0]}.lora_{which}.weight"


def save_peft(directory: str, adapters: Mapping[str, Mapping[str, Any]], cfg: LoraConfig,
              base: str | None = None) -> str:
  """Writes the adapters as a PEFT LoRA directory (lora_A [r, in], lora_B [out, r] per HF
  module, float32); `base`: the base model's checkpoint spec, recorded in adapter_config.json
  (an hf: spec as its directory, the form peft loads)."""
  from safetensors.numpy import save_file
  os.makedirs(directory, exist_ok=True)
  tensors = {}
  for name, ab in adapters.items():
    a = np.asarray(jax.device_get(ab["a"]), np.float32)
    b = np.asarray(jax.device_get(ab["b"]), np.float32)
    tensors[_peft_key(name, "A")] = np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)
    tensors[_peft_key(name, "B")] = np.ascontiguousarray(b.reshape(b.shape[0], -1).T)
  save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
  # peft's AutoPeftModel reads this as a transformers path: an hf: spec's directory; the
  # other kinds (gguf:, llama2c:, workdir:) have none and stay as the spec.
  if base is not None and base.startswith("hf:"):
    base = base[len("hf:"):]
  conf = {**cfg.peft_config(), "base_model_name_or_path": base}
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump(conf, f, indent=2)
  return directory


# PEFT LoraConfig settings that change which weights an adapter touches or how much (other
# than r, lora_alpha and target_modules): refused when set, never ignored.
_PEFT_UNSUPPORTED = ("rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                     "modules_to_save", "exclude_modules", "layer_replication",
                     "trainable_token_indices", "target_parameters", "alora_invocation_tokens",
                     "use_rslora", "use_dora", "lora_bias", "use_qalora", "arrow_config")


def _peft_targets(conf: dict, n_layers: int, where: str) -> tuple[str, ...]:
  """The projections a PEFT config's target_modules adapts, matched as peft matches them: a
  list entry names a module or a dotted suffix of its name, a string is a regular expression
  the whole module name must match ("all-linear": every projection); the projections it
  adapts must be the same in every layer."""
  import re
  spec = conf.get("target_modules")
  names = {t: _HF_MODULES[t][0] for t in PROJECTIONS}

  def hit(key: str) -> bool:
    if isinstance(spec, str):
      return spec == "all-linear" or re.fullmatch(spec, key) is not None
    return any(key == m or key.endswith("." + m) for m in spec)

  if not (isinstance(spec, str) or (isinstance(spec, list)
                                    and all(isinstance(m, str) for m in spec))):
    raise errors.expected(where, f"target_modules={spec!r}", "a list of module names or a "
                          "regular expression (peft's LoraConfig.target_modules)")
  if isinstance(spec, str):
    try:
      re.compile(spec)
    except re.error as e:
      raise errors.expected(where, f"target_modules={spec!r} ({e})", "a list of module names "
                            "or a valid regular expression") from None
  targets = []
  for t, module in names.items():
    layers = [i for i in range(n_layers) if hit(f"model.layers.{i}.{module}")]
    if layers and len(layers) < n_layers:
      raise errors.expected(where, f"target_modules={spec!r} adapts {module} in layers "
                            f"{layers} of {n_layers}", "the same projections in every layer")
    if layers:
      targets.append(t)
  if not targets:
    raise errors.expected(where, f"target_modules={spec!r}", "at least one of the Llama "
                          f"projections {sorted(m.split('.')[1] for m in names.values())}")
  return tuple(targets)


def load_peft(directory: str, shapes: Mapping[str, Sequence[int]]
              ) -> tuple[dict[str, dict[str, np.ndarray]], LoraConfig]:
  """(adapters, LoraConfig) of a PEFT LoRA directory written by `save_peft` (or by peft for
  a Llama model), checked against the contract `shapes`: a setting that changes the
  arithmetic and is not read here (rsLoRA, DoRA, per-module ranks or alphas, some layers
  only, biases, modules saved whole) and a tensor that no target projection reads are errors
  naming the file and the key or tensor, never ignored."""
  from safetensors.numpy import load_file
  conf_path = os.path.join(directory, "adapter_config.json")
  with open(conf_path) as f:
    conf = json.load(f)
  if not isinstance(conf, dict) or conf.get("peft_type") != "LORA":
    found = conf.get("peft_type") if isinstance(conf, dict) else conf
    raise errors.expected(conf_path, f"peft_type={found!r}", "a LORA adapter")
  for key in _PEFT_UNSUPPORTED:
    if conf.get(key) not in (None, False, {}, [], ""):
      raise errors.expected(conf_path, f"{key}={conf[key]!r}", "it unset: a plain LoRA "
                            "adapter (scale lora_alpha / r on every target projection of every "
                            "layer, no other weights)")
  if conf.get("bias", "none") != "none":
    raise errors.expected(conf_path, f"bias={conf['bias']!r}", "'none' (the base model's "
                          "biases as they are)")
  rank, alpha = conf.get("r"), conf.get("lora_alpha")
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise errors.expected(conf_path, f"r={rank!r}", "an integer >= 1")
  if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
      or not (math.isfinite(alpha) and alpha > 0)):
    raise errors.expected(conf_path, f"lora_alpha={alpha!r}", "a number > 0")
  n_layers = len({name.split(".")[1] for name in shapes if name.startswith("layers.")})
  cfg = LoraConfig(rank, float(alpha), _peft_targets(conf, n_layers, conf_path))
  path = os.path.join(directory, "adapter_model.safetensors")
  tensors = load_file(path)
  adapters, used = {}, set()
  for name, shape in shapes.items():
    if _short(name) not in cfg.targets:
      continue
    n_in = _n_in(name)
    ka, kb = _peft_key(name, "A"), _peft_key(name, "B")
    if ka not in tensors or kb not in tensors:
      raise ValueError(f"{path}: no {ka if ka not in tensors else kb}; expected an adapter "
                       f"for every {_short(name)} (target_modules)")
    a, b = tensors[ka], tensors[kb]
    want_a = (cfg.rank, math.prod(shape[:n_in]))
    want_b = (math.prod(shape[n_in:]), cfg.rank)
    if a.shape != want_a or b.shape != want_b:
      raise ValueError(f"{path}: {ka} {a.shape} / {kb} {b.shape}; expected {want_a} / {want_b}")
    adapters[name] = {"a": a.T.reshape(*shape[:n_in], cfg.rank).astype(np.float32),
                      "b": b.T.reshape(cfg.rank, *shape[n_in:]).astype(np.float32)}
    used.update((ka, kb))
  unread = sorted(set(tensors) - used)
  if unread:
    raise errors.expected(path, f"tensor {unread[0]!r} ({len(unread)} not read), which no "
                          f"target projection of {conf_path} reads", "only the lora_A / lora_B "
                          "weights of the target projections")
  return adapters, cfg
