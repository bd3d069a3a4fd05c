"""Language-model training as a `core.train.Task`: next-token loss for the Llama decoder.

AdamW with linear warmup and cosine decay (as in Llama 3, arXiv 2407.21783, Sec. 3.4),
global-norm gradient clipping, fp32 master weights with bf16 compute when the config says
`dtype="bfloat16"` (the model casts parameters at use), optional per-block remat
(`LlamaConfig.remat`). Parameters are placed by their logical names through LLM_RULES, so
one code path runs data-parallel, FSDP, tensor-parallel or mixed on any mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import mesh as mesh_lib
from llm import model as model_lib
from llm.config import LlamaConfig
from llm.data import LMBatch


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warmup + cosine decay to `final_lr_fraction * peak_lr`."""

  peak_lr: float = 3e-4
  warmup_steps: int = 100
  total_steps: int = 1000
  final_lr_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  clip_norm: float = 1.0


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  warmup = max(0, min(cfg.warmup_steps, cfg.total_steps - 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.peak_lr, warmup_steps=warmup,
      decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.peak_lr * cfg.final_lr_fraction)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  # No weight decay on norms (1-D scales), as is usual for Llama-style training.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask))


def next_token_loss(logits_BTV, targets_BT, mask_BT):
  """Mean cross-entropy over real targets (fp32), and the number of real targets."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
  n = jnp.sum(mask_BT)
  return jnp.sum(ce * mask_BT) / jnp.maximum(n, 1.0), n


class LMEvaluator:
  """Token-weighted mean loss, perplexity and bits per token over eval batches."""

  def __init__(self):
    self.loss_sum = 0.0
    self.tokens = 0.0

  def update(self, outputs, host: LMBatch) -> None:
    loss_sum, n = jax.device_get(outputs)
    self.loss_sum += float(loss_sum)
    self.tokens += float(n)

  def result(self) -> dict[str, float]:
    loss = self.loss_sum / max(self.tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bits_per_token": loss / math.log(2.0), "num_tokens": self.tokens}


class LMTask:
  """Next-token training of a Llama config on one mesh."""

  def __init__(self, cfg: LlamaConfig, optim: OptimConfig, mesh: Mesh,
               rules: mesh_lib.Rules = mesh_lib.LLM_RULES):
    self.cfg, self.optim, self.mesh, self.rules = cfg, optim, mesh, rules
    self.tx = make_optimizer(optim)
    abstract = jax.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
    self.graphdef, abstract_state = nnx.split(abstract)
    self.param_shardings = nnx.to_pure_dict(
        model_lib.param_shardings(abstract_state, mesh, rules))

  def init_state(self, seed: int) -> dict[str, Any]:
    rep = NamedSharding(self.mesh, P())
    init = jax.jit(lambda k: nnx.to_pure_dict(nnx.state(model_lib.Llama(self.cfg, nnx.Rngs(k)))),
                   out_shardings=self.param_shardings)
    params = init(jax.random.key(seed))
    opt = jax.jit(self.tx.init, out_shardings=optax.tree_map_params(
        self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, params), self.param_shardings,
        transform_non_params=lambda _: rep))(params)
    return {"step": jax.device_put(jnp.zeros((), jnp.int32), rep), "params": params, "opt": opt}

  def model(self, params) -> model_lib.Llama:
    return nnx.merge(self.graphdef, params)

  def logits(self, params, batch: LMBatch):
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # constraints by logical name
      logits, _ = self.model(params)(batch.inputs, positions_BT=batch.positions,
                                     segment_ids_BT=batch.segment_ids)
    return logits

  def device_batch(self, host: LMBatch) -> LMBatch:
    return mesh_lib.shard_batch(host, self.mesh, self.rules, batch_axis="act_batch")

  @staticmethod
  def examples_in(host: LMBatch) -> int:
    return int(np.sum(host.mask))   # tokens: the loop's examples/s is tokens/s here

  def train_step(self, state, batch: LMBatch):
    def loss_fn(params):
      loss, _ = next_token_loss(self.logits(params, batch), batch.targets, batch.mask)
      return loss

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = self.tx.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "lr": make_schedule(self.optim)(state["step"])}
    return {"step": state["step"] + 1, "params": params, "opt": opt}, metrics

  def eval_step(self, state, batch: LMBatch):
    loss, n = next_token_loss(self.logits(state["params"], batch), batch.targets, batch.mask)
    return loss * n, n

  def new_evaluator(self) -> LMEvaluator:
    return LMEvaluator()


def load_workdir(workdir: str, step: int | None = None):
  """(LlamaConfig, params pure dict) from a `experiments.train_lm` workdir's checkpoint."""
  import json
  import os
  from llm.config import config_from_dict
  path = os.path.join(workdir, "model_config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: missing; expected a workdir written by experiments.train_lm")
  with open(path) as f:
    cfg = config_from_dict(json.load(f))
  return cfg, load_workdir_params(workdir, cfg, step)


def load_workdir_params(workdir: str, cfg: LlamaConfig, step: int | None = None):
  """The params (pure dict, on one device) of the checkpoint at `step` (default: latest)."""
  from core import checkpoint as ckpt_lib
  ckpt = ckpt_lib.Checkpointer(workdir)
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"{workdir}/checkpoints: no checkpoint to load")
  mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  task = LMTask(cfg, OptimConfig(), mesh)
  abstract = jax.eval_shape(lambda: task.init_state(0))
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), abstract)
  state, _ = ckpt.restore(step, abstract)
  ckpt.close()
  return state["params"]
