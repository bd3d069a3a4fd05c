"""What one training step of a Llama config holds in memory per device, estimated before
anything is built or compiled, and the check that refuses a run the devices cannot hold.

`train_estimate` counts, per device of the mesh (each array's shard under the parameter
shardings of `LLM_RULES`, activations split over their act_* axes):

  params       every parameter in its param_dtype (exact: the abstract model's shapes)
  optimizer    AdamW's two moments: mu in OptimConfig.mu_dtype, nu in the param dtype (exact)
  gradients    one param-sized tree in the param dtype: all live at once, since global-norm
               clipping reads every gradient before any update (exact)
  activations  what the backward pass needs saved, a lower bound (below), in the compute dtype
  logits       one chunk of `chunked_cross_entropy`'s fp32 logits [B, C, V]

With LoRA (`lora_estimate`): params are the frozen base (float: sharded as above; int8 /
int4 weights: replicated, codes + scales) plus the float32 adapters (replicated), and the
optimizer and gradients are the adapters' only (exact); the activations are counted as in
full training.

Activations per token per layer, with h, g, f the query heads, KV heads and MLP width a
device holds (divided by tp where it divides them), K the head dim, D the model dim:
  no remat     4D + (2h + 2g) K + 3f: block input, both RMSNorm outputs, the residual
               after attention, q / k / v after RoPE, the attention output, SwiGLU's gate,
               up and their product (the inputs of every matmul's weight gradient), plus
               with --attention_impl=xla (and "auto" where it runs xla: off a GPU) the fp32
               softmax probabilities, h * S (S = T keys; under ring attention too, which
               keeps each ring step's block of them)
  remat full   D saved per layer (the block input), plus one layer's no-remat set while
               its backward recomputes it
  remat dots   D + (h + 2g) K + h K + 2D + 2f saved per layer (matmul outputs and the
               attention output), plus one layer's no-remat set
  remat attention  D + h K saved per layer, plus one layer's no-remat set
times the tokens a device holds: ceil(B / batch shards) * ceil(T / cp ranks).

The activation count leaves out what an implementation may avoid or fuse away (casts of
the weights to the compute dtype, the backward's own transients, XLA's fusion buffers, the
embedding and norm outputs outside the blocks), so the total is below what XLA allocates:
the check refuses only runs that cannot fit, and a run it lets through can still run out
of memory. Against `compiled.memory_analysis()` of the jitted, state-donating train step
(arguments + outputs - aliased + temporaries; tests/llm/test_memory.py, which derives its
bounds) XLA on the CPU allocates 1.16-1.22x the estimate where the state dominates (AdamW's
update tree, unfused, is one more param-sized array) and 1.6-2.8x where activations do
(the backward's cotangents and the fp32 attention scores beside the saved set; bf16 runs
highest, with their fp32 upcasts).

`check_train_memory` compares the estimate with `core.memory.device_memory`: on a GPU each
device's share against its bytes_limit; on the CPU the simulated devices of this process
allocate from one host, so the sum of their shares against the available RAM.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from core import errors
from core import memory as memory_lib
from core import mesh as mesh_lib

PARTS = ("params", "optimizer", "gradients", "activations", "logits")


@dataclasses.dataclass(frozen=True)
class TrainMemory:
  """Bytes per device of one training step, by part (see the module docstring)."""

  params: int
  optimizer: int
  gradients: int
  activations: int
  logits: int
  local_devices: int    # devices of the mesh on this process

  @property
  def per_device(self) -> int:
    return sum(getattr(self, p) for p in PARTS)

  def text(self) -> str:
    """'params 1.5 TiB + optimizer ... = 6.0 TiB' per device."""
    parts = " + ".join(f"{p} {memory_lib.format_bytes(getattr(self, p))}" for p in PARTS)
    return f"{parts} = {memory_lib.format_bytes(self.per_device)}"


def _split(n: int, ways: int) -> int:
  """What one of `ways` devices holds of n (n when they do not divide it: replicated)."""
  return n // ways if ways > 1 and n % ways == 0 else n


def activation_bytes_per_token(cfg, *, tp: int = 1, keys: int = 0) -> tuple[int, int]:
  """(bytes saved per token per layer, bytes of one layer's full no-remat set per token)
  on one device of a tp-way group, in the compute dtype; `keys`: keys per query under
  --attention_impl=xla (its fp32 probabilities are kept), 0 for flash kernels."""
  a = np.dtype(cfg.dtype).itemsize
  d, k = cfg.dim, cfg.head_dim
  h, g, f = _split(cfg.n_heads, tp), _split(cfg.n_kv_heads, tp), _split(cfg.ffn_dim, tp)
  full = (4 * d + (2 * h + 2 * g) * k + 3 * f) * a + h * keys * 4
  if not cfg.remat:
    return full, full
  saved = {"full": d, "dots": d + (h + 2 * g) * k + h * k + 2 * d + 2 * f,
           "attention": d + h * k}[cfg.remat_policy] * a
  return saved, full


def lora_estimate(cfg, mesh, lora, weights: str = "float32", *, mu_dtype: str = "float32",
                  rules=mesh_lib.LLM_RULES) -> tuple[int, int, int]:
  """(params, optimizer, gradients) bytes per device of a LoRA run (`llm.train_lib.LMTask`
  with `lora`): the frozen base (float: sharded as in full training; `weights` int8 / int4
  / gguf: replicated, `llm.quantized.held_bytes`) and the float32 adapters (replicated);
  AdamW's moments and the gradients of the adapters only."""
  from llm import lora as lora_lib
  from llm import quantized
  from llm.weights import param_shapes
  if weights == "float32":
    base = train_estimate(cfg, mesh, 1, 1, mu_dtype=mu_dtype, rules=rules).params
  else:
    base = quantized.held_bytes(cfg, weights)
  adapters = lora_lib.adapter_size(param_shapes(cfg), lora)
  return (base + 4 * adapters, adapters * (np.dtype(mu_dtype).itemsize + 4), 4 * adapters)


def train_estimate(cfg, mesh, batch_size: int, seq_len: int, *, mu_dtype: str = "float32",
                   rules=mesh_lib.LLM_RULES, abstract_state=None, lora=None,
                   weights: str = "float32") -> TrainMemory:
  """Bytes per device of one training step of `cfg` on `mesh` (module docstring).
  abstract_state: `nnx.split(jax.eval_shape(Llama))[1]`, when the caller has it. lora: an
  `llm.lora.LoraConfig` (its base frozen, held as `weights`): the state parts of
  `lora_estimate`; the activations as in full training."""
  from flax import nnx
  from llm import model as model_lib
  from llm import train_lib
  if abstract_state is None:
    abstract = jax.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
    abstract_state = nnx.split(abstract)[1]
  shardings = model_lib.param_shardings(abstract_state, mesh, rules)
  params = mu = nu = 0
  for var, sh in zip(jax.tree.leaves(abstract_state, is_leaf=_is_var),
                     jax.tree.leaves(shardings, is_leaf=_is_var)):
    value = var.get_value()
    shape, dtype = value.shape, np.dtype(value.dtype)
    n = math.prod(sh.get_value().shard_shape(shape))
    params += n * dtype.itemsize
    mu += n * np.dtype(mu_dtype).itemsize
    nu += n * dtype.itemsize
  sizes = dict(mesh.shape)
  batch_ways = mesh_lib.axis_size("act_batch", rules, mesh)
  cp = sizes.get("cp", 1) if cfg.context_parallel != "none" else 1
  tp = mesh_lib.axis_size("act_heads", rules, mesh)
  tokens = -(-batch_size // batch_ways) * -(-seq_len // cp)
  # Ring attention (cp > 1) runs one block per ring step and keeps every step's
  # probabilities for the backward: a query's over all seq_len keys, as without the ring.
  keys = seq_len if _attention_impl(cfg, seq_len // cp) == "xla" else 0
  saved, full = activation_bytes_per_token(cfg, tp=tp, keys=keys)
  acts = tokens * (cfg.n_layers * saved + (full if cfg.remat else 0))
  chunk = train_lib.loss_chunk_tokens(batch_size, seq_len, cfg.vocab_size)
  logits = -(-batch_size // batch_ways) * chunk * _split(cfg.vocab_size, tp) * 4
  me = jax.process_index()
  local = sum(d.process_index == me for d in mesh.devices.flat)
  optimizer, gradients = mu + nu, params
  if lora is not None:
    params, optimizer, gradients = lora_estimate(cfg, mesh, lora, weights, mu_dtype=mu_dtype,
                                                 rules=rules)
  return TrainMemory(params=params, optimizer=optimizer, gradients=gradients,
                     activations=acts, logits=logits, local_devices=local)


def _attention_impl(cfg, tokens: int) -> str:
  """The implementation training's attention calls run: "auto" resolved as `llm.attention`
  resolves it for a [B, T, H, K] call without a cache (on a CPU "xla", which keeps its
  fp32 probabilities like an explicit --attention_impl=xla)."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  from llm.attention.choose import choose_impl
  q = jax.ShapeDtypeStruct((1, tokens, cfg.n_heads, cfg.head_dim), cfg.dtype)
  k = jax.ShapeDtypeStruct((1, tokens, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)
  return choose_impl(q, k)


def _is_var(x) -> bool:
  from flax import nnx
  return isinstance(x, nnx.Variable)


def check_train_memory(est: TrainMemory, mem: memory_lib.DeviceMemory | None, where: str,
                       override: str = "--nomemory_check") -> None:
  """Raises a UserError when the estimate is over the devices' memory: each device's share
  over a GPU's bytes_limit, or on the CPU the sum over this process's devices over the
  available RAM. `where` names the run's settings; `override` the flag that skips the
  check. Nothing to compare with (mem None): no check."""
  if mem is None:
    return
  devices = est.local_devices if mem.host_ram else 1
  need = est.per_device * devices
  if need <= mem.bytes:
    return
  each = f" on each of {devices} devices" if devices > 1 else " on one device"
  raise errors.expected(
      where, f"training needs at least {memory_lib.format_bytes(need)} ({est.text()}{each}), "
      f"over the {memory_lib.format_bytes(mem.bytes)} of {mem.source}",
      "a smaller --preset, --batch_size or --seq_len, a --mesh that splits the parameters "
      f"(fsdp / tp axes), or {override} to compile anyway")


def check_train_run(cfg, mesh, batch_size: int, seq_len: int, *, mu_dtype: str = "float32",
                    where: str, override: str = "--nomemory_check", lora=None,
                    weights: str = "float32") -> TrainMemory:
  """`train_estimate` checked against the memory of this process's first device
  (`check_train_memory`); returns the estimate."""
  est = train_estimate(cfg, mesh, batch_size, seq_len, mu_dtype=mu_dtype, lora=lora,
                       weights=weights)
  check_train_memory(est, memory_lib.device_memory(), where, override)
  return est
