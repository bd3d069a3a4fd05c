"""Recommendation training as a `core.train.Task`: dense model + sharded embedding collection.

One train step: the collection gathers the rows the batch needs (input distribution),
pools them (output distribution), the dense model (DLRM, logistic regression, ...) turns
dense features and pooled embeddings into logits; one backward pass gives gradients for
the dense parameters (updated by optax, all-reduced over the batch axes by XLA) and for the
embedding bag sums, from which the collection updates the rows the batch touched with a
sparse row-wise optimizer.

The collection's options change where work runs, not what is computed. RecD
(arXiv 2211.05239, the collection's `dedup`): `device_batch` attaches each batch shard's
distinct bags of the chosen features (`rec.data.dedup.dedup_batch`, unless the input
pipeline did already), and the lookups run on those. DMT's SPTT (arXiv 2403.00877, tables
placed "sptt"): the model's tower modules (`tower_transform`) run inside the tower groups,
within the collection's output distribution, and the model's `head` takes their outputs.

Host tier lookahead (`host_prefetch`, `--host_prefetch`): each train batch carries the
next batch's ids (`rec.data.lookahead.LookaheadSource`), and the step ends by admitting
their rows to the host-tier tables' device caches, so the next step's lookups read no host
memory where they fit (FBGEMM's TBE prefetch, TorchRec's prefetch pipeline); the state a
checkpoint holds is the state after that admission, so a resume continues exactly.

External distillation (ExFM, arXiv 2502.17494; `distill`, a `rec.distill.DistillSpec`): the
model is a `rec.distill.ExFMStudent` and the loss adds its auxiliary head / student adapter
terms on the batch's teacher column; eval and serving read the serving head only.

Evaluation (`RecEvaluator`): AUC, log loss, NE, accuracy and calibration; with
`group_feature` (a sparse feature's index, `--group_by`) the eval step also hands back each
example's bag of that feature, and the evaluator adds gAUC and NE by slice over those
groups (`rec.metrics.group_metrics`). Training never reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import checkpoint as ckpt_lib
from core import mesh as mesh_lib
from core import train as train_loop
from core import update as update_lib
from rec import distill as distill_lib
from rec import metrics as metrics_lib
from rec.data import dedup as dedup_lib
from rec.data.batch import SparseBatch
from rec.embedding import host_tier, reshard
from rec.embedding.collection import EmbeddingCollection


class RecEvaluator:
  """AUC, log loss, NE, accuracy and calibration over eval batches (padding masked out), on
  device; with `grouped`, gAUC and NE by slice of the batches' group ids too.

  Keeps each batch's logits, labels and mask where the eval step left them (no per-batch
  transfer) and computes the metrics over all of them in one jitted pass at `result()`
  (`metrics.device_metrics`: exact AUC by one sort); only a few numbers reach the host.
  Grouped, the logits, labels, mask and group ids come to the host once at `result()` for
  `metrics.group_metrics` (a few sorts over the eval set; adds gauc, gauc_groups,
  ne_by_slice).
  """

  def __init__(self, grouped: bool = False):
    self.grouped = grouped
    self.outputs: list[dict[str, jax.Array]] = []

  def update(self, outputs: dict[str, jax.Array], host: SparseBatch) -> None:
    del host
    self.outputs.append(outputs)

  def result(self) -> dict[str, Any]:
    if not self.outputs:
      return metrics_lib.RecMetrics().result()
    cat = {k: jnp.concatenate([o[k].reshape(o[k].shape[0], -1) if k == "group" else
                               o[k].reshape(-1) for o in self.outputs])
           for k in self.outputs[0]}
    self.outputs = []
    out: dict[str, Any] = metrics_lib.device_metrics(cat["logits"], cat["labels"], cat["mask"])
    if self.grouped:
      host = {k: np.asarray(jax.device_get(metrics_lib.replicated(v))) for k, v in cat.items()}
      out.update(metrics_lib.group_metrics(host["logits"], host["labels"], host["group"],
                                           host["mask"]))
    return out


def torch_adagrad(learning_rate, eps: float = 1e-8,
                  initial_accumulator_value: float = 0.0) -> optax.GradientTransformation:
  """torch.optim.Adagrad's update, the dense optimizer of the MLPerf DLRM-DCNv2 reference
  (its dlrm_main.py: lr_decay 0, weight_decay 0, initial_accumulator_value 0, eps 1e-8):

      A <- A + g^2;   w <- w - lr * g / (sqrt(A) + eps)

  optax.adagrad starts A at 0.1 and puts eps inside the root (g * rsqrt(A + eps)): its
  early steps are far smaller wherever the gradients are much smaller than sqrt(0.1)."""
  def init(params):
    return optax.ScaleByRssState(
        sum_of_squares=optax.tree.full_like(params, initial_accumulator_value))

  def update(updates, state, params=None):
    del params
    acc = jax.tree.map(lambda g, a: a + g * g, updates, state.sum_of_squares)
    updates = jax.tree.map(lambda g, a: g / (jnp.sqrt(a) + eps), updates, acc)
    return updates, optax.ScaleByRssState(sum_of_squares=acc)

  return optax.chain(optax.GradientTransformation(init, update),
                     optax.scale_by_learning_rate(learning_rate))


def make_dense_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
  makers: dict[str, Callable[..., optax.GradientTransformation]] = {
      "sgd": optax.sgd, "adagrad": optax.adagrad, "adam": optax.adam, "adamw": optax.adamw,
      "torch_adagrad": torch_adagrad}
  if name not in makers:
    raise ValueError(f"dense optimizer {name!r}: expected one of {sorted(makers)}")
  if not callable(learning_rate):
    train_loop.check_learning_rate(f"dense optimizer {name}: learning_rate", learning_rate)
  return makers[name](learning_rate)


def masked_bce(logits, batch: SparseBatch) -> jax.Array:
  """Mean sigmoid BCE of logits [B] over the batch's real examples (mask 1)."""
  per_ex = optax.sigmoid_binary_cross_entropy(logits, batch.labels)
  return jnp.sum(per_ex * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


class Grads(NamedTuple):
  """What RecTask.loss_and_grads hands the train step."""

  loss: jax.Array
  logits: jax.Array
  lookup: Any                   # the collection's Lookup
  g_params: Any                 # w.r.t. the dense parameters
  g_partial: dict[str, jax.Array]   # w.r.t. the devices' bag sums (apply_gradients)
  terms: dict[str, jax.Array]   # extra loss terms by name ({} without `distill`)
  emb_norm: jax.Array           # norm of the pooled embeddings' gradient, each bag once


class RecTask:
  """Binary-classification recommendation training over one mesh."""

  def __init__(self, model_fn: Callable[[nnx.Rngs], nnx.Module], collection: EmbeddingCollection,
               dense_tx: optax.GradientTransformation, mesh: Mesh,
               rules: mesh_lib.Rules = mesh_lib.REC_RULES,
               distill: distill_lib.DistillSpec | None = None,
               group_feature: int | None = None, host_prefetch: bool = False):
    if host_prefetch:
      host_tier.check_prefetch(collection)
    self.host_prefetch = host_prefetch
    self.model_fn = model_fn
    self.group_feature = group_feature
    self.distill = distill
    self.collection = collection
    self.dense_tx = dense_tx
    self.mesh = mesh
    self.rules = rules
    abstract = jax.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    self.graphdef, _ = nnx.split(abstract)
    if collection.towers:
      towers = getattr(getattr(abstract, "config", None), "towers", None)
      if not hasattr(abstract, "tower_transform") or (
          tuple(map(tuple, towers or ())) != collection.towers):
        raise ValueError(
            f"the collection's sptt towers {collection.towers} (tables by tower group) need a "
            f"model with the same towers and a tower_transform (rec/models/dmt.py); "
            f"{type(abstract).__name__} has towers {towers}")
    if distill is not None and (collection.towers or not isinstance(abstract,
                                                                     distill_lib.ExFMStudent)):
      raise ValueError(
          f"RecTask(distill=...): model {type(abstract).__name__} with sptt towers "
          f"{collection.towers}; expected a rec.distill.student_fn model and no sptt towers")
    self._dedup_shards: int | None = None

  # --- state

  def init_state(self, seed: int) -> dict[str, Any]:
    key = jax.random.key(seed)
    k_dense, k_emb = jax.random.split(key)
    rep = NamedSharding(self.mesh, P())

    params = jax.jit(lambda k: nnx.to_pure_dict(nnx.state(self.model_fn(nnx.Rngs(k)))))(k_dense)
    # Dense parameters are placed by their logical axis names (the MLP kernels carry
    # ("mlp_in", "mlp_out")) through the rules table: replicated under REC_RULES. The
    # optimizer state follows the parameters' shardings.
    abstract = nnx.state(jax.eval_shape(lambda: self.model_fn(nnx.Rngs(0))))
    param_shardings = mesh_lib.shardings_for(
        nnx.to_pure_dict(nnx.get_partition_spec(abstract)), self.rules, self.mesh)
    params = jax.device_put(params, param_shardings)
    opt = self.dense_tx.init(params)
    opt = jax.device_put(opt, optax.tree_map_params(
        self.dense_tx, lambda _, sharding: sharding, opt, param_shardings,
        transform_non_params=lambda _: rep))
    return {"step": jax.device_put(jnp.zeros((), jnp.int32), rep), "params": params,
            "opt": opt, "emb": self.collection.init(k_emb)}

  # --- checkpoints

  LAYOUT_KEY = "embedding_layout"   # the checkpoint metadata's record of the tables' layout

  def checkpoint_meta(self) -> dict[str, Any]:
    """Saved with every checkpoint: where each table's rows are in the state, so that a
    resume or a prediction under another layout can restore them (`restore_checkpoint`)."""
    if not hasattr(self, "_layout_json"):
      self._layout_json = self.collection.layout().to_json()
    return {self.LAYOUT_KEY: self._layout_json}

  def restore_checkpoint(self, ckpt, step: int, state) -> tuple[dict[str, Any], dict]:
    """Checkpoint `step` of `ckpt` (a core.checkpoint.Checkpointer) in `state`'s layout and
    shardings. A checkpoint written in another embedding layout (device count, mesh,
    sharding plan, planner budget) has its tables and their optimizer state read on the
    host and resharded through their unsharded rows (rec/embedding/reshard.py), saying so
    in one line; the dense parameters and optimizer state are placed on this mesh by their
    own shardings. Tables of other rows or dim are a CheckpointMismatchError of one line
    naming the table and both shapes (and the arrays that differ); a different dense model
    in the same layout is `Checkpointer.check_compatible`'s list."""
    saved = ckpt.restore_meta(step).get(self.LAYOUT_KEY)
    now = self.collection.layout()
    if saved is None or saved == self.checkpoint_meta()[self.LAYOUT_KEY]:
      return ckpt.restore(step, ckpt_lib.abstract_like(state))
    then = reshard.Layout.from_json(saved)
    where = f"checkpoint {ckpt.directory}/{step}"
    try:
      then.check_tables(now, where)
    except reshard.LayoutMismatchError as e:   # one line: the table, then its arrays
      problems, total = ckpt.mismatches(step, ckpt_lib.abstract_like(state))
      shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
      raise ckpt_lib.CheckpointMismatchError(
          f"{e} ({len(problems)} of {total} arrays differ: {shown})") from None
    if then.same_buffers(now):   # the same arrays on another mesh: orbax places them
      restored, meta = ckpt.restore(step, ckpt_lib.abstract_like(state))
    else:
      restored, meta = ckpt.restore(step, ckpt_lib.abstract_like(state), on_host=("emb",))
      restored = {**restored, "emb": self.collection.from_layout(
          then, restored["emb"], int(restored["step"]), where)}
    print(f"resharded checkpoint {step}: {then.describe()} -> {now.describe()}", flush=True)
    return restored, meta

  # --- batches

  def device_batch(self, host: SparseBatch) -> SparseBatch:
    """Places a host batch on the mesh (after checking its ids); a batch already on device
    (drawn there, e.g. `DeviceSynthetic`) is moved only if its sharding differs."""
    if isinstance(host.labels, jax.Array):
      if self.collection.dedup is not None and host.dedup is None:
        raise ValueError("RecD (--dedup_features) deduplicates host batches; this batch was "
                         "drawn on device (use a host data source, e.g. gen=host)")
      shardings = jax.tree.map(
          lambda x: mesh_lib.logical_sharding(("batch",) + (None,) * (x.ndim - 1), self.rules,
                                              self.mesh), host)
      return jax.device_put(host, shardings)
    if not self._ids_in_range(host.ids):
      self.collection.check_ids(host.ids, host.lengths)  # names the first bad id
    self.collection.check_lengths(host.lengths, host.ids.shape[2])   # 0 <= len <= L
    spec = self.collection.dedup
    if spec is not None and host.dedup is None:
      host = dedup_lib.dedup_batch(host, self.collection.dedup_features, spec.capacity,
                                   self.dedup_shards(), spec.on_overflow,
                                   [t.name for t in self.collection.tables])
    return mesh_lib.shard_batch(host, self.mesh, self.rules)

  def dedup_shards(self) -> int:
    """Batch shards in this process's share of a batch: the devices it feeds, each of
    which deduplicates its own rows (RecD)."""
    if self._dedup_shards is None:
      _, count = mesh_lib.process_batch_share(self.mesh, self.rules)
      self._dedup_shards = mesh_lib.axis_size("batch", self.rules, self.mesh) // count
    return self._dedup_shards

  def _ids_in_range(self, ids) -> bool:
    """Every slot's id (padding included) in [0, rows) of its table: one min and one max
    per feature; only when that fails does the exact per-bag check run."""
    ids = np.asarray(ids)
    rows = np.asarray([t.num_rows for t in self.collection.tables])
    return bool(ids.min(initial=0) >= 0 and (ids.max(axis=(0, 2), initial=0) < rows).all())

  @staticmethod
  def examples_in(host: SparseBatch) -> int:
    """Examples of the global batch: a host batch is this process's share of it (equal
    shares), a batch drawn on device is the global batch itself."""
    if isinstance(host.labels, jax.Array):
      return int(host.batch_size)
    return int(host.batch_size) * jax.process_count()

  # --- steps

  def logits(self, params, dense, emb_BFD) -> jax.Array:
    model = nnx.merge(self.graphdef, params)
    return model(dense, emb_BFD)

  def gather(self, emb_state, batch: SparseBatch):
    """The collection's gather phase for a batch (its distinct bags too, under RecD)."""
    return self.collection.gather(emb_state, batch.ids, batch.lengths, batch.weights,
                                  batch.dedup)

  def forward(self, params, dense, lookup, partial=None, step=None) -> jax.Array:
    """Logits from a lookup's bag sums (`partial`: differentiate through these): pool, then
    the model; under SPTT the model's tower modules run inside the pool's tower groups.
    `step`: the train step, for an iteration-wise compressed exchange (a2a_compression)."""
    if self.collection.towers:
      model = nnx.merge(self.graphdef, params)
      towers = self.collection.pool(lookup, partial, towers=model.tower_transform())
      return model.head(dense, towers)
    return self.logits(params, dense, self.collection.pool(lookup, partial, step=step))

  def model_loss(self, params, emb_BFD, state, batch: SparseBatch):
    """(loss, (logits, extra loss terms by name)) of the dense model on the pooled
    embeddings: mean BCE over real examples (plus the distillation terms under `distill`).
    A task with another loss (experiments/rankitect) overrides this one method."""
    del state   # the step, for a task whose loss draws per step
    if self.distill is not None:   # ExFM: serving, auxiliary and adapter terms
      loss, logits, terms = distill_lib.loss_terms(
          nnx.merge(self.graphdef, params), self.distill, batch.dense, emb_BFD, batch)
      return loss, (logits, terms)
    logits = self.logits(params, batch.dense, emb_BFD)
    return masked_bce(logits, batch), (logits, {})

  def loss_and_grads(self, state, batch: SparseBatch) -> Grads:
    """The loss, its gradients w.r.t. the dense params and the embedding bag sums, and the
    norm of the pooled embeddings' gradient (`Grads`). The pool runs outside the
    differentiated loss (jax.vjp), so the gradient w.r.t. its output emb_BFD, each
    (example, feature) once as on one device, is at hand; the bag sums' gradients are its
    transpose through the pool's collectives (several copies of a bag's gradient where the
    bag is row-sharded)."""
    lookup = self.gather(state["emb"], batch)
    step = state["step"]
    if self.collection.towers:   # SPTT: the tower modules run inside the pool
      def tower_loss(params, partial):
        logits = self.forward(params, batch.dense, lookup, partial, step)
        return masked_bce(logits, batch), (logits, {})

      (loss, (logits, terms)), (g_params, g_partial) = jax.value_and_grad(
          tower_loss, argnums=(0, 1), has_aux=True)(state["params"], lookup.partial)
      # sptt pools by a reduce-scatter inside each tower group (sharding/sptt.py), whose
      # transpose all-gathers: each of the group's `tower_size` devices holds the same
      # gradient of its samples' pooled embeddings (padding slots 0), so the bag sums'
      # squares count every (example, feature) tower_size times.
      emb_norm = optax.tree.norm(g_partial) / np.sqrt(np.float32(self.collection.tower_size))
    else:
      emb_BFD, pool_vjp = jax.vjp(lambda p: self.collection.pool(lookup, p, step=step),
                                  lookup.partial)
      (loss, (logits, terms)), (g_params, g_emb) = jax.value_and_grad(
          self.model_loss, argnums=(0, 1), has_aux=True)(state["params"], emb_BFD, state,
                                                          batch)
      g_partial, = pool_vjp(g_emb)
      emb_norm = optax.tree.norm(g_emb)
    return Grads(loss, logits, lookup, g_params, g_partial, terms, emb_norm)

  def train_step(self, state, batch: SparseBatch, skip_nonfinite: bool = False):
    """One step; metrics `loss` and `grad_norm`: the global norm of the dense gradients and
    of the pooled embeddings' gradient (emb_BFD: each example's bag of each feature once),
    the same figure under every sharding plan, with RecD or without, and on one device.
    skip_nonfinite: when the loss or grad_norm is NaN or inf the step changes nothing but
    the step count (dense state kept by a select; every id of the batch marked invalid, so
    the sparse update touches no row) and reports `skipped` 1 (`core.update.dense_update`).
    `host_prefetch`: after the update, the rows of the next batch (`batch.lookahead`) are
    admitted to the host tier's device caches (`EmbeddingCollection.prefetch`), so the next
    step's lookups find them there."""
    loss, _, lookup, g_params, g_partial, terms, emb_norm = self.loss_and_grads(state, batch)
    # The guard reads this norm in place of the bag sums' gradients, which the sparse update
    # applies: those are copies of g_emb's values (within the bound of a compressed
    # exchange) or sums of at most B of them (RecD), so one of them is NaN or inf only where
    # g_emb holds a NaN, an inf or a value past 1e33, whose square overflows: the norm is
    # not finite then either.
    dense = update_lib.dense_update(
        self.dense_tx, state["params"], state["opt"], g_params, loss,
        grad_norm=optax.tree.norm((g_params, emb_norm)), skip_nonfinite=skip_nonfinite)
    metrics = {**dense.metrics, **terms}
    if self.collection.dedup is not None:   # 1: a capacity overflow ran this batch plain
      metrics["dedup_fallback"] = jnp.float32(batch.dedup is None)
    if skip_nonfinite:
      lookup = dataclasses.replace(lookup, valid={k: v & dense.ok
                                                  for k, v in lookup.valid.items()})
    emb = self.collection.apply_gradients(state["emb"], lookup, g_partial, state["step"])
    if self.host_prefetch:   # the next step's rows into the host tier's device caches
      if batch.lookahead is None:
        raise ValueError("RecTask(host_prefetch=True): the batch carries no lookahead (the "
                         "next batch's ids); expected batches of rec.data.lookahead."
                         "LookaheadSource")
      emb = self.collection.prefetch(emb, batch.lookahead.ids, batch.lookahead.lengths,
                                     state["step"] + 1)
    new = {"step": state["step"] + 1, "params": dense.params, "opt": dense.opt, "emb": emb}
    return new, metrics

  def eval_step(self, state, batch: SparseBatch) -> dict[str, jax.Array]:
    """{logits, labels, mask} [B], left on device for `RecEvaluator`; with `group_feature`
    also `group` [B, L]: that feature's bag, its padding slots -1."""
    lookup = self.gather(state["emb"], batch)
    out = {"logits": self.forward(state["params"], batch.dense, lookup, step=state["step"]),
           "labels": batch.labels, "mask": batch.mask}
    if self.group_feature is not None:
      ids_BL = batch.ids[:, self.group_feature, :]
      live = jnp.arange(ids_BL.shape[1])[None, :] < batch.lengths[:, self.group_feature, None]
      out["group"] = jnp.where(live, ids_BL, -1)
    return out

  def new_evaluator(self) -> RecEvaluator:
    return RecEvaluator(grouped=self.group_feature is not None)
