"""llm.memory: the training-memory estimate against what XLA allocates, and the check."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from core import errors
from core import memory as memory_lib
from core import mesh as mesh_lib
from llm import config as config_lib
from llm import memory
from llm import train_lib
from llm.data import LMBatch


def _mesh(spec):
  n = math.prod(int(p.split(":")[1]) for p in spec.split(","))
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices")
  return mesh_lib.make_mesh(spec, devices=jax.devices()[:n], rules=mesh_lib.LLM_RULES)


def _cfg(preset="tiny", **kw):
  return config_lib.get_config(preset, attention_impl="xla", **kw)


def _measured(cfg, mesh, batch, seq_len, mu_dtype="float32"):
  """Bytes one device holds in the jitted, state-donating train step: arguments + outputs -
  aliased (the donated state) + temporaries, as XLA's buffer assignment reports them."""
  task = train_lib.LMTask(cfg, train_lib.OptimConfig(mu_dtype=mu_dtype), mesh)
  state = jax.eval_shape(lambda: task.init_state(0))
  # The shardings init_state gives, without running it.
  rep = NamedSharding(mesh, P())
  opt = optax.tree_map_params(task.tx, lambda _, s: s, state["opt"], task.param_shardings,
                              transform_non_params=lambda _: rep)
  shardings = {"step": rep, "params": task.param_shardings, "opt": opt}
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                       shardings)
  win = np.zeros((batch, seq_len + 1), np.int32)
  host = LMBatch(inputs=win[:, :-1], targets=win[:, 1:], mask=np.ones((batch, seq_len),
                                                                      np.float32),
                 positions=None, segment_ids=None)
  compiled = jax.jit(task.train_step, donate_argnums=0).lower(
      state, task.device_batch(host)).compile()
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


@pytest.mark.parametrize("spec", ["data:1", "fsdp:2,tp:2"])
def test_state_parts_are_the_placed_shards(spec):
  """params, optimizer and gradients are exact: each device's shard bytes of the state
  LMTask places (AdamW's scalar step counts aside)."""
  mesh = _mesh(spec)
  cfg = _cfg("tiny")
  task = train_lib.LMTask(cfg, train_lib.OptimConfig(mu_dtype="bfloat16"), mesh)
  state = task.init_state(0)
  shard = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
  est = memory.train_estimate(cfg, mesh, 8, 64, mu_dtype="bfloat16")
  assert est.params == shard(state["params"]) == est.gradients
  assert 0 <= shard(state["opt"]) - est.optimizer <= 64        # the step counts
  assert est.local_devices == mesh.devices.size
  if spec != "data:1":
    assert est.params < memory.train_estimate(cfg, _mesh("data:1"), 8, 64).params


# Tolerance. The estimate is a lower bound by construction (module docstring): the state is
# exact and the activations count only what the backward must keep. What XLA adds:
#  - where the state dominates (batch 1, 16 tokens): at most one more param-sized tree
#    (AdamW's updates before they are added), a quarter of the fp32 state's 16 bytes per
#    parameter, so measured / estimate <= 1.25, plus a little for the activations: <= 1.3;
#  - where activations dominate: beside each saved activation the backward holds its
#    cotangent, and the xla attention its fp32 scores before the softmax, about the saved
#    set again; bf16 adds the fp32 copies it upcasts to: measured / estimate <= 3.
CASES = [("tiny", "data:1", 1, 16, {}, 1.3),
         ("tiny", "data:1", 16, 128, {}, 3.0),
         ("tiny", "fsdp:2,tp:2", 16, 128, {"dtype": "bfloat16", "remat": True}, 3.0),
         # ring attention keeps every ring step's xla probabilities: h * seq_len per token,
         # not one step's h * seq_len / cp (which put XLA at 3.5x the estimate here)
         ("tiny", "cp:2", 8, 256, {"context_parallel": "pass_kv"}, 3.0)]


@pytest.mark.parametrize("preset,spec,batch,seq_len,kw,factor", CASES)
def test_estimate_is_a_lower_bound_within_factor_of_xla(preset, spec, batch, seq_len, kw,
                                                        factor):
  mesh = _mesh(spec)
  cfg = _cfg(preset, max_seq_len=max(seq_len, 16), **kw)
  est = memory.train_estimate(cfg, mesh, batch, seq_len).per_device
  got = _measured(cfg, mesh, batch, seq_len)
  assert est <= got <= factor * est, (got / est, est, got)
  print(f"{preset} {spec} {batch}x{seq_len} {kw}: measured / estimate {got / est:.2f}")


def test_auto_attention_off_a_gpu_counts_the_xla_probabilities():
  """--attention_impl=auto (the default) runs the xla attention off a GPU, which keeps its fp32
  probabilities [B, H, T, S] like an explicit xla: the same estimate, still a lower bound."""
  if jax.default_backend() == "gpu":
    pytest.skip("auto runs a flash kernel on a GPU")
  mesh = _mesh("data:1")
  auto = config_lib.get_config("tiny", attention_impl="auto", max_seq_len=256)
  xla = memory.train_estimate(_cfg("tiny", max_seq_len=256), mesh, 2, 256)
  est = memory.train_estimate(auto, mesh, 2, 256)
  assert est == xla
  # h * S * 4 bytes per token per layer: 4 heads x 256 keys x 4 B x 512 tokens x 2 layers
  assert est.activations >= 4 * 256 * 4 * 512 * 2
  assert est.per_device <= _measured(auto, mesh, 2, 256)


def test_remat_and_sharding_lower_the_activations():
  cfg = _cfg("byte_small")
  one = _mesh("data:1")
  plain = memory.train_estimate(cfg, one, 8, 256)
  remat = memory.train_estimate(cfg.replace(remat=True), one, 8, 256)
  tp = memory.train_estimate(cfg, _mesh("tp:2"), 8, 256)
  data = memory.train_estimate(cfg, _mesh("data:2"), 8, 256)
  assert remat.activations < plain.activations / 2
  assert tp.activations < plain.activations
  assert data.activations == plain.activations // 2


def test_405b_state_alone_is_16_bytes_per_parameter():
  cfg = config_lib.get_config("llama3_405b", vocab_size=256, max_seq_len=32)
  est = memory.train_estimate(cfg, _mesh("data:1"), 1, 32)
  state = est.params + est.optimizer + est.gradients
  assert state == 16 * cfg.num_params()
  assert est.per_device > 6e12


def _est(**parts):
  base = dict(params=1 << 30, optimizer=2 << 30, gradients=1 << 30, activations=1 << 20,
              logits=1 << 10, local_devices=4)
  return memory.TrainMemory(**{**base, **parts})


def test_check_refuses_naming_parts_pool_and_override():
  ram = memory_lib.DeviceMemory(10 << 30, 4, "available RAM shared by 4 CPU devices",
                                host_ram=True)
  with pytest.raises(errors.UserError) as e:
    memory.check_train_memory(_est(), ram, "--preset=x")   # 4 x 4 GiB > 10 GiB
  msg = str(e.value)
  assert msg.startswith("--preset=x: training needs at least 16.0 GiB")
  for part in ("params 1.0 GiB", "optimizer 2.0 GiB", "gradients 1.0 GiB",
               "activations 1.0 MiB", "on each of 4 devices", "10.0 GiB of available RAM",
               "--nomemory_check"):
    assert part in msg, (part, msg)
  assert "\n" not in msg
  memory.check_train_memory(_est(), memory_lib.DeviceMemory(17 << 30, 4, "RAM", True), "w")


def test_check_compares_one_share_with_a_gpu():
  gpu = memory_lib.DeviceMemory(5 << 30, 1, "H100 bytes_limit")
  memory.check_train_memory(_est(), gpu, "w")          # 4 GiB per device fits 5 GiB
  with pytest.raises(errors.UserError, match="H100 bytes_limit"):
    memory.check_train_memory(_est(params=2 << 30), gpu, "w")
  memory.check_train_memory(_est(params=1 << 50), None, "w")   # no pool known: no check


def _lora_task(cfg, mesh, weights, mu_dtype="float32"):
  """An LMTask training attention adapters of rank 4 on a frozen base: random float weights,
  or those weights as `quantized.quantize` holds them int8 / int4."""
  from flax import nnx
  from llm import lora as lora_lib
  from llm import model as model_lib
  from llm import quantized
  lcfg = lora_lib.LoraConfig(4, 8.0, ("attention",))
  init = None
  if weights != "float32":
    w = model_lib.weights_from_model(model_lib.Llama(cfg, nnx.Rngs(0)))
    init = quantized.quantize(cfg, weights, weights={k: np.asarray(v) for k, v in w.items()})[0]
  task = train_lib.LMTask(cfg, train_lib.OptimConfig(mu_dtype=mu_dtype), mesh,
                          init_weights=init, lora=lcfg)
  return task, lcfg


@pytest.mark.parametrize("spec,weights", [("data:1", "float32"), ("fsdp:2,tp:2", "float32"),
                                          ("data:1", "int8"), ("data:1", "int4")])
def test_lora_state_parts_are_the_placed_shards(spec, weights):
  """With LoRA the state is the frozen base (float sharded, int8 / int4 replicated) and the
  adapters, whose optimizer state and gradients are all that training adds: each part is
  the bytes LMTask places on a device, and far below full fine-tuning's."""
  mesh = _mesh(spec)
  cfg = _cfg("tiny", vocab_size=512)
  task, lcfg = _lora_task(cfg, mesh, weights, mu_dtype="bfloat16")
  state = task.init_state(0)
  shard = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
  est = memory.train_estimate(cfg, mesh, 8, 64, mu_dtype="bfloat16", lora=lcfg,
                              weights=weights)
  assert est.params == shard(state["params"]) + shard(state["lora"])
  assert est.gradients == shard(state["lora"])
  assert 0 <= shard(state["opt"]) - est.optimizer <= 64        # the step counts
  full = memory.train_estimate(cfg, mesh, 8, 64, mu_dtype="bfloat16")
  # rank-4 attention adapters: 3,584 float32 elements (replicated) against the base's
  # 139,584 (split over the devices by fsdp x tp)
  assert est.gradients == 4 * 3584 and est.optimizer == (2 + 4) * 3584
  assert est.optimizer < full.optimizer and est.gradients < full.gradients
  if weights != "float32":
    assert est.params < full.params * (0.4 if weights == "int8" else 0.25) + 4 * shard(
        state["lora"])


@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_lora_estimate_is_a_lower_bound_within_factor_of_xla(weights):
  """The LoRA estimate against XLA's buffers for the jitted, state-donating LoRA step (the
  activations counted as in full training; the same factor as full training's where
  activations dominate)."""
  mesh = _mesh("data:1")
  cfg = _cfg("tiny", max_seq_len=128)
  task, lcfg = _lora_task(cfg, mesh, weights)
  state = task.init_state(0)
  win = np.zeros((16, 129), np.int32)
  host = LMBatch(inputs=win[:, :-1], targets=win[:, 1:], mask=np.ones((16, 128), np.float32),
                 positions=None, segment_ids=None)
  m = jax.jit(task.train_step, donate_argnums=0).lower(
      state, task.device_batch(host)).compile().memory_analysis()
  got = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
         + m.temp_size_in_bytes)
  est = memory.train_estimate(cfg, mesh, 16, 128, lora=lcfg, weights=weights).per_device
  assert est <= got <= 3.0 * est, (got / est, est, got)
