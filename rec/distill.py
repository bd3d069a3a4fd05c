"""External distillation from a foundation model (ExFM, arXiv 2502.17494): a student's
Auxiliary Head and Student Adapter, and the data augmentation step (DAS) that writes the
teacher's predictions into the students' data.

The teacher (a large model trained elsewhere on the union of the students' data) never runs
inside a student's train or serving step: `augment` runs it once over a data period and
stores its logits, and `TeacherColumnSource` hands them to the student as a label-like
column of each batch (`SparseBatch.teacher`). The student's losses, all masked means over
the batch's real examples (BCE: sigmoid binary cross-entropy, soft targets allowed):

  serving head s (on true labels y):   BCE(s, y)
  plain distillation (kd_weight):      kd_weight * BCE(s, sigmoid(t~))
  auxiliary head a (aux_weight):       aux_weight * BCE(a, sigmoid(t~))
  student adapter g (adapter):         BCE(g(t), y)

t is the teacher's logit; t~ = stop_gradient(g(t)) with the adapter on, else t. The
auxiliary head is a separate MLP on the student's shared body (the input of its top MLP),
so the teacher's supervision reaches the body without being forced onto the serving head;
serving reads only s. The adapter g(t) = t + MLP(t) (last layer zero at init: it starts as
the identity) learns on the true labels how the teacher's logits map to the current data,
correcting a stale teacher before its output is a target. Gradients stop both ways, as
the paper's design: the adapter learns from its label loss only, the student from the
adapted target only (not through it), and nothing reaches the teacher column (data).

`RecTask(distill=DistillSpec(...))` trains a model built by `student_fn`; with every term
off it is the plain task's step.

Letters: B batch, F sparse features, D embedding dim, H body width.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core.errors import UserError
from rec.data.batch import BatchSource, SparseBatch
from rec.layers.mlp import MLP

TEACHER_COLUMN = "teacher"


@dataclasses.dataclass(frozen=True)
class DistillSpec:
  """Which external-distillation terms a student trains with (ExFM's ablation switches).

  kd_weight: plain distillation of the teacher into the serving head (0: off).
  aux_weight: the auxiliary head's distillation loss weight (0: no auxiliary head).
  aux_mlp: the auxiliary head's hidden widths (a final width-1 layer is added).
  adapter: the student adapter on the teacher's logits; adapter_mlp its hidden widths.
  """

  kd_weight: float = 0.0
  aux_weight: float = 0.0
  aux_mlp: tuple[int, ...] = (64,)
  adapter: bool = False
  adapter_mlp: tuple[int, ...] = (16,)

  def __post_init__(self):
    for name in ("kd_weight", "aux_weight"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise UserError(f"DistillSpec: {name}={v!r}; expected a finite number >= 0")
    for name in ("aux_mlp", "adapter_mlp"):
      sizes = tuple(getattr(self, name))
      if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in sizes):
        raise UserError(f"DistillSpec: {name}={sizes!r}; expected widths >= 1")
      object.__setattr__(self, name, tuple(int(s) for s in sizes))
    if self.adapter and not self.uses_target:
      raise UserError("DistillSpec: adapter=True with kd_weight=0 and aux_weight=0; expected a "
                      "term that uses the adapted teacher (kd_weight or aux_weight > 0)")

  @property
  def uses_target(self) -> bool:
    return self.kd_weight > 0 or self.aux_weight > 0

  @property
  def needs_teacher(self) -> bool:
    return self.uses_target or self.adapter


class ExFMStudent(nnx.Module):
  """A student (a model with `body`, `body_dim` and `top_mlp`: rec.models.common's
  DenseModel, i.e. DLRM, DCN-v2, DHEN, Wukong) with ExFM's auxiliary head and student
  adapter beside it; calling it gives the serving logits."""

  def __init__(self, base: nnx.Module, spec: DistillSpec, rngs: nnx.Rngs):
    missing = [a for a in ("body", "body_dim", "top_mlp") if not hasattr(base, a)]
    if spec.aux_weight > 0 and missing:
      raise UserError(f"ExFM auxiliary head: model {type(base).__name__} has no {missing}; "
                      "expected a model with a shared body under its top MLP (DLRM, DCNv2, "
                      "DHEN, Wukong)")
    self.base = base      # built first: its parameters are the plain model's draws
    self.aux_head = (MLP(base.body_dim, spec.aux_mlp + (1,), rngs, activate_last=False,
                         name="aux_head") if spec.aux_weight > 0 else None)
    adapter = None
    if spec.adapter:
      adapter = MLP(1, spec.adapter_mlp + (1,), rngs, activate_last=False, name="adapter")
      last = adapter.layers[-1]
      last.kernel[...] = jnp.zeros_like(last.kernel[...])   # identity at init
      last.bias[...] = jnp.zeros_like(last.bias[...])
    self.adapter = adapter

  def __call__(self, dense_BD, emb_BFD):
    """Serving logits [B]: the base model alone."""
    return self.base(dense_BD, emb_BFD)

  def heads(self, dense_BD, emb_BFD) -> tuple[jax.Array, jax.Array | None]:
    """(serving logits [B], auxiliary logits [B] or None), from one pass of the body."""
    if self.aux_head is None:
      return self.base(dense_BD, emb_BFD), None
    h_BH = self.base.body(dense_BD, emb_BFD)
    serve = self.base.top_mlp(h_BH)[:, 0].astype(jnp.float32)
    return serve, self.aux_head(h_BH.astype(jnp.float32))[:, 0]

  def adapt(self, teacher_B: jax.Array) -> jax.Array:
    """The adapter's logits g(t) = t + MLP(t) [B] (t itself without an adapter)."""
    if self.adapter is None:
      return teacher_B
    return teacher_B + self.adapter(teacher_B[:, None])[:, 0]


def student_fn(model_fn: Callable[[nnx.Rngs], nnx.Module],
               spec: DistillSpec) -> Callable[[nnx.Rngs], ExFMStudent]:
  """A RecTask model_fn: `model_fn`'s model wrapped as an ExFMStudent."""
  return lambda rngs: ExFMStudent(model_fn(rngs), spec, rngs)


def masked_mean(x_B, mask_B):
  return jnp.sum(x_B * mask_B) / jnp.maximum(jnp.sum(mask_B), 1.0)


def missing_teacher(where: str) -> UserError:
  return UserError(
      f"{where}: the batch has no {TEACHER_COLUMN!r} column (SparseBatch.teacher, the teacher's "
      "logit per example); expected the students' data augmented with the teacher's "
      "predictions (rec.distill.augment / TeacherColumnSource) for a distillation setting")


def loss_terms(model: ExFMStudent, spec: DistillSpec, dense_BD, emb_BFD,
               batch: SparseBatch) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """(total loss, serving logits [B], {loss_label, loss_kd, loss_aux, loss_adapter} of the
  terms that are on) for one batch; see the module docstring for the formulas."""
  serve_B, aux_B = model.heads(dense_BD, emb_BFD)
  label = masked_mean(optax.sigmoid_binary_cross_entropy(serve_B, batch.labels), batch.mask)
  terms = {"loss_label": label}
  total = label
  if spec.needs_teacher:
    if batch.teacher is None:
      raise missing_teacher("ExFM distillation")
    teacher_B = batch.teacher.astype(jnp.float32)
    target_B = teacher_B
    if spec.adapter:
      adapted_B = model.adapt(teacher_B)
      terms["loss_adapter"] = masked_mean(
          optax.sigmoid_binary_cross_entropy(adapted_B, batch.labels), batch.mask)
      total = total + terms["loss_adapter"]
      target_B = jax.lax.stop_gradient(adapted_B)
    soft_B = jax.nn.sigmoid(target_B)
    if spec.kd_weight > 0:
      terms["loss_kd"] = masked_mean(optax.sigmoid_binary_cross_entropy(serve_B, soft_B),
                                     batch.mask)
      total = total + spec.kd_weight * terms["loss_kd"]
    if spec.aux_weight > 0:
      terms["loss_aux"] = masked_mean(optax.sigmoid_binary_cross_entropy(aux_B, soft_B),
                                      batch.mask)
      total = total + spec.aux_weight * terms["loss_aux"]
  return total, serve_B, terms


# --------------------------------------------------------------------------- DAS


def teacher_logits(task, state: dict[str, Any], batches: Iterable[SparseBatch]) -> np.ndarray:
  """The teacher's logits [N * B] over `batches` (every row, padding included), by its
  task's eval step: the DAS's one pass of the teacher over a data period."""
  step = jax.jit(task.eval_step)
  out = [np.asarray(step(state, task.device_batch(b))["logits"], np.float32) for b in batches]
  return np.concatenate(out) if out else np.zeros((0,), np.float32)


def write_column(path: str, logits: np.ndarray) -> str:
  """Writes a teacher column (float32 [N]) atomically as .npy; returns the path."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp.npy"
  np.save(tmp, np.asarray(logits, np.float32))
  os.replace(tmp, path)
  return path


def augment(task, state: dict[str, Any], source: BatchSource, num_batches: int,
            path: str) -> "TeacherColumnSource":
  """DAS: runs the teacher (`task`, `state`) once over batches [0, num_batches) of the
  students' `source`, writes its logits to `path` and returns the augmented source."""
  import itertools
  logits = teacher_logits(task, state, itertools.islice(source.batches(0), num_batches))
  write_column(path, logits)
  return TeacherColumnSource(source, path, num_batches)


class TeacherColumnSource:
  """A BatchSource: `base`'s batches with the teacher column read from `path` (written by
  `augment`) attached, batch k's rows [k * B, (k + 1) * B) of it; `num_batches` of them."""

  def __init__(self, base: BatchSource, path: str, num_batches: int):
    if not os.path.exists(path):
      raise UserError(f"{path}: teacher column file not found; expected the DAS output "
                      "(rec.distill.augment) for these students' data")
    column = np.load(path)
    need = num_batches * base.batch_size
    if column.dtype.kind in "iuf":
      # checked as the student reads it: a float64 logit past float32's range becomes inf
      with np.errstate(over="ignore"):
        column = column.astype(np.float32)
    if (column.dtype != np.float32 or column.ndim != 1 or column.shape[0] < need
        or not np.isfinite(column[:need]).all()):
      finite = bool(np.isfinite(column).all()) if column.dtype == np.float32 else "-"
      raise UserError(f"{path}: teacher column of shape {column.shape}, dtype {column.dtype} "
                      f"(finite as float32: {finite}); expected {need} finite logits "
                      f"({num_batches} batches of {base.batch_size})")
    self.base, self.path, self.column = base, path, column
    self.spec, self.batch_size, self._num = base.spec, base.batch_size, int(num_batches)

  @property
  def num_batches(self) -> int:
    return self._num

  def batches(self, start: int = 0) -> Iterator[SparseBatch]:
    B = self.batch_size
    for k, b in enumerate(self.base.batches(start), start):
      if k >= self._num:
        return
      if b.batch_size != B:
        raise UserError(f"{self.path}: batch {k} has {b.batch_size} rows; expected {B}")
      yield dataclasses.replace(b, teacher=self.column[k * B:(k + 1) * B])
