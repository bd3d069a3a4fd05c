"""Language-model training as a `core.train.Task`: next-token loss for the Llama decoder.

AdamW with linear warmup and cosine decay (as in Llama 3, arXiv 2407.21783, Sec. 3.4),
global-norm gradient clipping, fp32 master weights with bf16 compute when the config says
`dtype="bfloat16"` (the model casts parameters at use), optional per-block remat
(`LlamaConfig.remat`, `remat_policy`). Parameters are placed by their logical names through
LLM_RULES, so one code path runs data-parallel, FSDP, tensor-parallel or mixed on any mesh.

The loss never holds the [B,T,V] fp32 logits: `chunked_cross_entropy` applies the output
projection to T/C strided chunks of C tokens per row in a `lax.scan` and, when
differentiated, computes the gradients of each chunk in the same pass (softmax - one-hot,
then the two matmuls in the compute dtype), so the backward only scales them: the same three
matmuls as the plain loss, one [B,C,V] chunk of logits alive at a time.
`OptimConfig.mu_dtype="bfloat16"` keeps AdamW's first moment in bf16 (optax's `mu_dtype`).

Letters: B batch, T tokens, C tokens per chunk, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import mesh as mesh_lib
from core import update as update_lib
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
  mu_dtype: str = "float32"       # AdamW first moment: "float32" | "bfloat16"

  def __post_init__(self):
    if self.mu_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"OptimConfig: mu_dtype={self.mu_dtype!r}, expected 'float32' or "
                       "'bfloat16'")
    # Settings that can only diverge or never train are errors before the first step.
    checks = [("peak_lr", self.peak_lr > 0), ("warmup_steps", self.warmup_steps >= 0),
              ("total_steps", self.total_steps >= 1),
              ("final_lr_fraction", 0 <= self.final_lr_fraction <= 1),
              ("b1", 0 <= self.b1 < 1), ("b2", 0 <= self.b2 < 1),
              ("weight_decay", self.weight_decay >= 0), ("clip_norm", self.clip_norm > 0)]
    expected = {"peak_lr": "> 0", "warmup_steps": ">= 0", "total_steps": ">= 1",
                "final_lr_fraction": "in [0, 1]", "b1": "in [0, 1)", "b2": "in [0, 1)",
                "weight_decay": ">= 0", "clip_norm": "> 0"}
    for name, ok in checks:
      v = getattr(self, name)
      if not (ok and math.isfinite(v)):
        raise ValueError(f"OptimConfig: {name}={v!r}, expected a finite number {expected[name]}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  warmup = max(0, min(cfg.warmup_steps, cfg.total_steps - 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.peak_lr, warmup_steps=warmup,
      decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.peak_lr * cfg.final_lr_fraction)


# Biases (Qwen2's q / k / v; held [H,K] / [G,K], so not caught by the 1-D rule).
NO_DECAY = ("bq", "bk", "bv")


def decay_mask(params):
  """True where AdamW decays: matrices, not the norms' 1-D scales nor the biases (`NO_DECAY`
  by name: they are 2-D), as is usual for Llama-style training."""
  def decays(path, p):
    last = path[-1] if path else None
    name = getattr(last, "key", getattr(last, "name", None))
    return p.ndim > 1 and name not in NO_DECAY
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask, mu_dtype=jnp.dtype(cfg.mu_dtype)))


def applied_lr(cfg: OptimConfig, opt_state) -> jax.Array:
  """The learning rate the next update of `opt_state` applies: the schedule at the
  optimizer's own count, which a skipped step (`skip_nonfinite`) does not advance while the
  task's step does."""
  counts = [v for path, v in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
            if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"]
  if len(counts) != 1:
    raise ValueError(f"applied_lr: {len(counts)} schedule counts in the optimizer state, "
                     "expected 1 (make_optimizer's AdamW)")
  return make_schedule(cfg)(counts[0])


def next_token_loss(logits_BTV, targets_BT, mask_BT):
  """Mean cross-entropy over real targets (fp32), and the number of real targets. A masked
  target adds nothing whatever its id (an out-of-range one, e.g. -100, gives a NaN
  cross-entropy, which `ce * mask` would keep)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
  n = jnp.sum(mask_BT)
  return jnp.sum(_masked(ce, mask_BT)) / jnp.maximum(n, 1.0), n


def _masked(x, mask):
  """x * mask, with 0 where mask is 0 even where x is NaN."""
  return jnp.where(mask != 0, x * mask, 0.0)


# Auto chunk size: the largest C dividing T whose fp32 logits [B,C,V] fit in this many bytes.
LOGITS_CHUNK_BYTES = 1 << 30


def loss_chunk_tokens(batch: int, seq_len: int, vocab: int,
                      budget: int = LOGITS_CHUNK_BYTES) -> int:
  """Tokens per row per chunk: the largest divisor C of seq_len with B*C*V*4 <= budget."""
  best = 1
  for c in range(1, seq_len + 1):
    if seq_len % c == 0 and batch * c * vocab * 4 <= budget:
      best = c
  return best


def _chunks(x_BT, n):
  """[B,T,...] -> [n, B, T/n, ...]: chunk j holds tokens j, j + n, j + 2n, ... of each row
  (strided, so a chunk spreads over every shard of a sequence-sharded T)."""
  b, t = x_BT.shape[:2]
  return jnp.moveaxis(x_BT.reshape(b, t // n, n, *x_BT.shape[2:]), 2, 0)


def _unchunk(x_nBC):
  n, b, c = x_nBC.shape[:3]
  return jnp.moveaxis(x_nBC, 0, 2).reshape(b, c * n, *x_nBC.shape[3:])


def _chunk_logits(h_BCD, w, vocab_major):
  eq = "bcd,vd->bcv" if vocab_major else "bcd,dv->bcv"
  out = jnp.einsum(eq, h_BCD, w, preferred_element_type=jnp.float32)
  return model_lib.constrain(out, ("act_batch", None, "act_vocab"))


def _chunk_loss(logits_BCV, t_BC, m_BC):
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  tgt_BC = jnp.take_along_axis(logits_BCV, t_BC[..., None], axis=-1)[..., 0]
  return jnp.sum(_masked(lse_BC - tgt_BC, m_BC)), lse_BC


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def chunked_cross_entropy(h_BTD, w, targets_BT, mask_BT, vocab_major: bool, chunks: int):
  """sum over tokens of mask * cross-entropy(h @ W, target) in fp32, one chunk at a time.

  h_BTD: final hidden states (compute dtype); w: the output projection, [V,D] when
  vocab_major (tied embeddings) else [D,V], in any dtype (cast to h's dtype for the matmuls;
  its gradient comes back in w's dtype, accumulated in fp32); chunks: T/C, dividing T.
  """
  wc = w.astype(h_BTD.dtype)

  def body(total, xs):
    h, t, m = xs
    loss, _ = _chunk_loss(_chunk_logits(h, wc, vocab_major), t, m)
    return total + loss, None

  total, _ = jax.lax.scan(body, jnp.float32(0), (_chunks(h_BTD, chunks),
                                                 _chunks(targets_BT, chunks),
                                                 _chunks(mask_BT.astype(jnp.float32), chunks)))
  return total


def _xent_fwd(h_BTD, w, targets_BT, mask_BT, vocab_major, chunks):
  wc = w.astype(h_BTD.dtype)
  dt = h_BTD.dtype

  def body(carry, xs):
    total, dw = carry
    h, t, m = xs
    logits = _chunk_logits(h, wc, vocab_major)
    loss, lse = _chunk_loss(logits, t, m)
    # d(loss)/d(logits) = (softmax - one_hot) * mask, formed chunk by chunk.
    vocab = jnp.arange(logits.shape[-1], dtype=t.dtype)
    dlogits = ((jnp.exp(logits - lse[..., None]) - (vocab == t[..., None]))
               * m[..., None]).astype(dt)
    if vocab_major:
      dh = jnp.einsum("bcv,vd->bcd", dlogits, wc)
      dw = dw + jnp.einsum("bcv,bcd->vd", dlogits, h, preferred_element_type=jnp.float32)
    else:
      dh = jnp.einsum("bcv,dv->bcd", dlogits, wc)
      dw = dw + jnp.einsum("bcd,bcv->dv", h, dlogits, preferred_element_type=jnp.float32)
    return (total + loss, dw), dh

  init = (jnp.float32(0), jnp.zeros(w.shape, jnp.float32))
  (total, dw), dh = jax.lax.scan(body, init, (_chunks(h_BTD, chunks),
                                              _chunks(targets_BT, chunks),
                                              _chunks(mask_BT.astype(jnp.float32), chunks)))
  return total, (_unchunk(dh), dw, jnp.zeros((0,), w.dtype))


def _xent_bwd(vocab_major, chunks, res, g):
  dh, dw, w_like = res
  return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dw).astype(w_like.dtype), None,
          None)


chunked_cross_entropy.defvjp(_xent_fwd, _xent_bwd)


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
  """Next-token training of a Llama config on one mesh.

  loss_chunk: tokens per row per chunk of `chunked_cross_entropy` (None: the largest that
  keeps a chunk's fp32 logits within LOGITS_CHUNK_BYTES; 0: the plain loss over full
  logits). packed: batches may hold several documents per row (segment ids, positions
  restarting); when False every row must be one sequence at positions 0..T-1, and the task
  drops both arrays, so attention sees the plain causal case ("auto" then takes cuDNN).
  host_metrics: numbers measured on each host train batch, logged with its step by the loop
  (e.g. `llm.packing.PackedSource.step_metrics`: attention work per micro-batch and rank).

  init_weights: start from these contract weights (`llm.checkpoints.load_weights`: a
  pretrained checkpoint) instead of a random init; matrices held as `QuantizedParam`
  (int8 / int4) only with `lora`, replicated over the mesh. lora: train LoRA adapters
  (`llm.lora`) on the frozen weights: the state holds the base under "params" (never
  updated), the adapters under "lora" and the optimizer state of the adapters only.
  """

  def __init__(self, cfg: LlamaConfig, optim: OptimConfig, mesh: Mesh,
               rules: mesh_lib.Rules = mesh_lib.LLM_RULES, *, loss_chunk: int | None = None,
               packed: bool = False,
               host_metrics: Callable[[LMBatch], dict[str, float]] | None = None,
               init_weights: dict[str, Any] | None = None, lora=None):
    self.cfg, self.optim, self.mesh, self.rules = cfg, optim, mesh, rules
    self.loss_chunk, self.packed, self.host_metrics = loss_chunk, packed, host_metrics
    self.init_weights, self.lora = init_weights, lora
    self.tx = make_optimizer(optim)
    abstract = jax.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
    self.graphdef, abstract_state = nnx.split(abstract)
    self.param_shardings = nnx.to_pure_dict(
        model_lib.param_shardings(abstract_state, mesh, rules))
    if init_weights is not None and _has_quantized(init_weights):
      if lora is None:
        raise ValueError("LMTask: quantized weights train only through LoRA adapters "
                         "(--weights=int8|int4 needs --lora_rank)")

  def _base_params(self, seed: int):
    if self.init_weights is None:
      init = jax.jit(lambda k: nnx.to_pure_dict(nnx.state(model_lib.Llama(self.cfg, nnx.Rngs(k)))),
                     out_shardings=self.param_shardings)
      return init(jax.random.key(seed))
    model = nnx.eval_shape(lambda: model_lib.Llama(self.cfg, nnx.Rngs(0)))
    model_lib.load_weights(model, self.init_weights)
    params = nnx.to_pure_dict(nnx.state(model))
    if _has_quantized(self.init_weights):
      return jax.device_put(params, NamedSharding(self.mesh, P()))
    return jax.device_put(params, self.param_shardings)

  def init_state(self, seed: int) -> dict[str, Any]:
    rep = NamedSharding(self.mesh, P())
    params = self._base_params(seed)
    step = jax.device_put(jnp.zeros((), jnp.int32), rep)
    if self.lora is not None:
      from llm import lora as lora_lib
      from llm.weights import param_shapes
      adapters = jax.device_put(lora_lib.init_adapters(
          param_shapes(self.cfg), self.lora, jax.random.key(seed + 1)), rep)
      opt = jax.jit(self.tx.init, out_shardings=rep)(adapters)
      return {"step": step, "params": params, "lora": adapters, "opt": opt}
    opt = jax.jit(self.tx.init, out_shardings=optax.tree_map_params(
        self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, params), self.param_shardings,
        transform_non_params=lambda _: rep))(params)
    return {"step": step, "params": params, "opt": opt}

  def model(self, params, adapters=None) -> model_lib.Llama:
    model = nnx.merge(self.graphdef, params)
    if adapters is not None:
      from llm import lora as lora_lib
      lora_lib.with_adapters(model, adapters, self.lora)
    return model

  def logits(self, params, batch: LMBatch, adapters=None):
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # constraints by logical name
      logits, _ = self.model(params, adapters)(batch.inputs, positions_BT=batch.positions,
                                               segment_ids_BT=batch.segment_ids)
    return logits

  def loss_sum(self, params, batch: LMBatch, adapters=None):
    """(sum of masked next-token cross-entropies, number of real targets), fp32."""
    n = jnp.sum(batch.mask)
    b, t = batch.inputs.shape
    chunk = (loss_chunk_tokens(b, t, self.cfg.vocab_size) if self.loss_chunk is None
             else self.loss_chunk)
    if chunk == 0:
      loss, _ = next_token_loss(self.logits(params, batch, adapters), batch.targets, batch.mask)
      return loss * jnp.maximum(n, 1.0), n
    if t % chunk:
      raise ValueError(f"LMTask: loss_chunk={chunk} does not divide the sequence length {t}")
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
      model = self.model(params, adapters)
      h_BTD, _ = model.hidden(model.embed_tokens(batch.inputs), positions_BT=batch.positions,
                              segment_ids_BT=batch.segment_ids)
      w, vocab_major = model.output_weight()
      total = chunked_cross_entropy(h_BTD, w, batch.targets, batch.mask, vocab_major,
                                    t // chunk)
    return total, n

  def device_batch(self, host: LMBatch) -> LMBatch:
    if not self.packed:
      host = _single_sequences(host)
    return mesh_lib.shard_batch(host, self.mesh, self.rules, batch_axis="act_batch")

  example_unit = "tokens"   # examples_in counts tokens: the progress line says tokens/s

  def examples_in(self, host: LMBatch) -> int:
    """Tokens of the global batch (the loop's examples/s is tokens/s here): a host batch
    is this process's share of it."""
    if not hasattr(self, "_shares"):
      self._shares = mesh_lib.process_batch_share(self.mesh, self.rules, "act_batch")[1]
    return int(np.sum(host.mask)) * self._shares

  def train_step(self, state, batch: LMBatch, skip_nonfinite: bool = False):
    """One AdamW step (`core.update.dense_update`). skip_nonfinite: a step whose loss or
    gradient norm is NaN or inf keeps the parameters and optimizer state and reports
    `skipped` 1; the step count still advances."""
    if self.lora is not None:   # the adapters train; the base stays as it is
      def adapter_loss(adapters):
        total, n = self.loss_sum(state["params"], batch, adapters)
        return total / jnp.maximum(n, 1.0)

      loss, grads = jax.value_and_grad(adapter_loss)(state["lora"])
      dense = update_lib.dense_update(self.tx, state["lora"], state["opt"], grads, loss,
                                      skip_nonfinite=skip_nonfinite)
      metrics = {**dense.metrics, "lr": applied_lr(self.optim, state["opt"])}
      return {"step": state["step"] + 1, "params": state["params"], "lora": dense.params,
              "opt": dense.opt}, metrics

    def loss_fn(params):
      total, n = self.loss_sum(params, batch)
      return total / jnp.maximum(n, 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    dense = update_lib.dense_update(self.tx, state["params"], state["opt"], grads, loss,
                                    skip_nonfinite=skip_nonfinite)
    metrics = {**dense.metrics, "lr": applied_lr(self.optim, state["opt"])}
    return {"step": state["step"] + 1, "params": dense.params, "opt": dense.opt}, metrics

  def eval_step(self, state, batch: LMBatch):
    return self.loss_sum(state["params"], batch, state.get("lora"))

  def new_evaluator(self) -> LMEvaluator:
    return LMEvaluator()


def _has_quantized(weights) -> bool:
  from llm.quantized import QuantizedParam
  return any(isinstance(w, QuantizedParam) for w in weights.values())


def _single_sequences(host: LMBatch) -> LMBatch:
  """The batch without segment ids and positions, after checking that they say nothing
  (one segment per row, positions 0..T-1); a packed batch is an error naming the row."""
  t = host.inputs.shape[1]
  seg, pos = host.segment_ids, host.positions
  if seg is not None:
    bad = np.flatnonzero(np.any(np.asarray(seg) != np.asarray(seg)[:, :1], axis=1))
    if bad.size:
      raise ValueError(f"LMTask(packed=False): batch row {bad[0]} holds several segment ids "
                       f"{sorted(set(np.asarray(seg)[bad[0]].tolist()))[:5]}; for documents "
                       "packed into one row use LMTask(..., packed=True)")
  if pos is not None:
    bad = np.flatnonzero(np.any(np.asarray(pos) != np.arange(t), axis=1))
    if bad.size:
      raise ValueError(f"LMTask(packed=False): batch row {bad[0]} has positions "
                       f"{np.asarray(pos)[bad[0], :5].tolist()}..., expected 0..{t - 1}; "
                       "for packed rows use LMTask(..., packed=True)")
  return dataclasses.replace(host, segment_ids=None, positions=None)


# A LoRA run's workdir names its base and adapters here (experiments.train_lm).
LORA_FILE = "lora.json"


def load_workdir(workdir: str, step: int | None = None):
  """(LlamaConfig, params pure dict) from a `experiments.train_lm` workdir's checkpoint (a
  LoRA run's adapters merged into its base)."""
  import json
  import os
  from llm.config import config_from_dict
  path = os.path.join(workdir, "model_config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(errno.ENOENT, "missing; expected a workdir written by "
                            "experiments.train_lm", path)
  with open(path) as f:
    cfg = config_from_dict(json.load(f))
  return cfg, load_workdir_params(workdir, cfg, step)


def save_lora_run(workdir: str, init: str, weights: str, lora, base=None) -> str:
  """Writes the LoRA run's base checkpoint, its storage and the adapters' settings, and
  with `base` (the base's contract weights as trained on) their fingerprint
  (`core.checkpoint.tree_fingerprint`)."""
  import json
  import os
  from core.checkpoint import tree_fingerprint
  path = os.path.join(workdir, LORA_FILE)
  meta = {"init": init, "weights": weights, "rank": lora.rank, "alpha": lora.alpha,
          "targets": list(lora.targets)}
  if base is not None:
    meta["base_fingerprint"] = tree_fingerprint(base)
  with open(path, "w") as f:
    json.dump(meta, f, indent=2)
  return path


def load_workdir_params(workdir: str, cfg: LlamaConfig, step: int | None = None):
  """The params (pure dict, on one device) of the checkpoint at `step` (default: latest);
  a LoRA run's (`LORA_FILE`) are its base with the adapters merged in, float32."""
  import json
  import os
  from core import checkpoint as ckpt_lib
  ckpt = ckpt_lib.Checkpointer(workdir)
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(errno.ENOENT, "no checkpoint to load", f"{workdir}/checkpoints")
  mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  lora_path = os.path.join(workdir, LORA_FILE)
  lora = None
  if os.path.exists(lora_path):
    from llm import checkpoints
    from llm import lora as lora_lib
    with open(lora_path) as f:
      meta = json.load(f)
    lora = lora_lib.LoraConfig(meta["rank"], meta["alpha"], tuple(meta["targets"]))
    _, base, _ = checkpoints.load_pretrained(meta["init"], meta["weights"])
    want, have = meta.get("base_fingerprint"), None   # absent: a run recorded without it
    if want is not None and (have := ckpt_lib.tree_fingerprint(base)) != want:
      raise ValueError(
          f"{lora_path}: the base {meta['init']} ({meta['weights']}) holds other weights than "
          f"the adapters were trained on (fingerprint {have}, recorded {want}); expected the "
          "base as it was, or merge the adapters (experiments.export) while it is")
    task = LMTask(cfg, OptimConfig(), mesh, init_weights=base, lora=lora)
  else:
    task = LMTask(cfg, OptimConfig(), mesh)
  abstract = jax.eval_shape(lambda: task.init_state(0))
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), abstract)
  state, _ = ckpt.restore(step, abstract)
  ckpt.close()
  if lora is None:
    return state["params"]
  from llm import lora as lora_lib
  merged = lora_lib.merge(base, state["lora"], lora)
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg.replace(param_dtype="float32"),
                                                  nnx.Rngs(0)))
  model_lib.load_weights(model, merged)
  return nnx.to_pure_dict(nnx.state(model))
