"""ExFM external distillation (rec/distill.py, RecTask's `distill`): the loss terms equal
their formulas computed by hand in numpy; gradients stop where the design says (adapter
<-> student, teacher column); with every term off the step equals plain RecTask bit for bit
(one device and 8); the DAS column equals the teacher run directly; a missing teacher
column or column file stops with an error naming it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core import mesh as mesh_lib
from core.errors import UserError
from rec import distill
from rec.data.batch import SparseBatch
from rec.embedding import optimizers as opt_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.planner import TablePlacement
from rec.models.dcnv2 import DCNv2, DCNv2Config
from rec.models.dlrm import DLRM, DLRMConfig
from rec.train_lib import RecTask

CFG = DLRMConfig(num_dense=3, num_sparse=4, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1),
                 rows_per_feature=(30,) * 4)
FULL = distill.DistillSpec(kd_weight=0.3, aux_weight=0.7, aux_mlp=(6,), adapter=True,
                           adapter_mlp=(5,))


def _batch(B=16, seed=0, teacher=True):
  rng = np.random.default_rng(seed)
  return SparseBatch(
      dense=rng.standard_normal((B, 3)).astype(np.float32),
      ids=rng.integers(0, 30, (B, 4, 1)).astype(np.int32),
      lengths=np.ones((B, 4), np.int32),
      labels=(rng.random(B) < 0.4).astype(np.float32),
      mask=np.r_[np.ones(B - 3), np.zeros(3)].astype(np.float32),   # 3 padding rows
      teacher=(2.0 * rng.standard_normal(B)).astype(np.float32) if teacher else None)


def _np_mlp(layers, x, activate_last=False):
  """An MLP from its pure-dict layers in float64 numpy."""
  for i in range(len(layers)):
    x = x @ np.asarray(layers[i]["kernel"], np.float64) + np.asarray(layers[i]["bias"], np.float64)
    if i < len(layers) - 1 or activate_last:
      x = np.maximum(x, 0.0)
  return x


def _np_bce(z, p):
  """Sigmoid BCE with soft target p, float64, in its textbook form."""
  s = 1.0 / (1.0 + np.exp(-z))
  return -(p * np.log(s) + (1.0 - p) * np.log(1.0 - s))


def _student(spec, model=DLRM, cfg=CFG, seed=0):
  student = distill.ExFMStudent(model(cfg, nnx.Rngs(seed)), spec, nnx.Rngs(seed + 1))
  if student.adapter is not None:   # away from the identity start, so its MLP matters
    last = student.adapter.layers[-1]
    k = jax.random.key(7)
    last.kernel[...] = 0.5 * jax.random.normal(k, last.kernel[...].shape)
    last.bias[...] = jnp.full(last.bias[...].shape, 0.2)
  return student


@pytest.mark.parametrize("model,cfg", [
    (DLRM, CFG),
    pytest.param(DCNv2, DCNv2Config(num_dense=3, num_sparse=4, embedding_dim=4, bottom_mlp=(4,),
                        num_cross_layers=1, deep_mlp=(8,), top_mlp=(4, 1),
                        rows_per_feature=(30,) * 4), marks=pytest.mark.slow)])
def test_loss_terms_equal_formulas_by_hand(model, cfg):
  student = _student(FULL, model, cfg)
  b = _batch()
  emb = np.random.default_rng(1).standard_normal((16, 4, 4)).astype(np.float32)
  total, serve, terms = distill.loss_terms(student, FULL, jnp.asarray(b.dense), jnp.asarray(emb),
                                           jax.tree.map(jnp.asarray, b))
  p = nnx.to_pure_dict(nnx.state(student))
  # the serving head is the base model; the auxiliary head reads its body
  s = np.asarray(student.base(b.dense, emb), np.float64)
  h = np.asarray(student.base.body(b.dense, emb), np.float64)
  a = _np_mlp(p["aux_head"]["layers"], h)[:, 0]
  t = b.teacher.astype(np.float64)
  g = t + _np_mlp(p["adapter"]["layers"], t[:, None])[:, 0]
  y, m = b.labels, b.mask
  mean = lambda x: (x * m).sum() / m.sum()
  q = 1.0 / (1.0 + np.exp(-g))
  want = {"loss_label": mean(_np_bce(s, y)), "loss_kd": mean(_np_bce(s, q)),
          "loss_aux": mean(_np_bce(a, q)), "loss_adapter": mean(_np_bce(g, y))}
  for k, v in want.items():
    np.testing.assert_allclose(float(terms[k]), v, rtol=2e-5, err_msg=k)
  np.testing.assert_allclose(
      float(total), want["loss_label"] + 0.3 * want["loss_kd"] + 0.7 * want["loss_aux"]
      + want["loss_adapter"], rtol=2e-5)
  np.testing.assert_allclose(np.asarray(serve), s, rtol=1e-5, atol=1e-6)
  assert np.std(a - s) > 1e-3   # a separate head, not the serving one


def test_adapter_starts_as_identity_and_off_switches_drop_terms():
  student = distill.ExFMStudent(DLRM(CFG, nnx.Rngs(0)), FULL, nnx.Rngs(1))
  t = jnp.linspace(-3, 3, 7)
  np.testing.assert_array_equal(np.asarray(student.adapt(t)), np.asarray(t))
  spec = distill.DistillSpec(aux_weight=1.0)
  plain = distill.ExFMStudent(DLRM(CFG, nnx.Rngs(0)), spec, nnx.Rngs(1))
  assert plain.adapter is None and plain.aux_head is not None
  _, _, terms = distill.loss_terms(plain, spec, jnp.asarray(_batch().dense),
                                   jnp.ones((16, 4, 4)), jax.tree.map(jnp.asarray, _batch()))
  assert sorted(terms) == ["loss_aux", "loss_label"]


def test_gradients_stop_at_adapter_and_teacher_column():
  student = _student(FULL)
  graphdef, params = nnx.split(student)
  params = nnx.to_pure_dict(params)
  b = jax.tree.map(jnp.asarray, _batch())
  emb = jnp.asarray(np.random.default_rng(1).standard_normal((16, 4, 4)), jnp.float32)

  def total(params, teacher, spec=FULL):
    model = nnx.merge(graphdef, params)
    return distill.loss_terms(model, spec, b.dense, emb, dataclasses.replace(b, teacher=teacher))[0]

  g_params, g_teacher = jax.grad(total, argnums=(0, 1))(params, b.teacher)
  # the teacher column is data: the student's losses never reach it through the adapter's
  # target (stop_gradient); only the adapter's own label loss depends on it
  model = nnx.merge(graphdef, params)
  g_adapter_only = jax.grad(lambda t: distill.masked_mean(
      optax.sigmoid_binary_cross_entropy(model.adapt(t), b.labels), b.mask))(b.teacher)
  np.testing.assert_allclose(np.asarray(g_teacher), np.asarray(g_adapter_only), rtol=1e-5,
                             atol=1e-8)

  # the adapter learns from its label loss alone ...
  def adapter_loss(ad):
    p = dict(params, adapter=ad)
    m = nnx.merge(graphdef, p)
    return distill.masked_mean(optax.sigmoid_binary_cross_entropy(m.adapt(b.teacher), b.labels),
                               b.mask)
  want = jax.grad(adapter_loss)(params["adapter"])
  jax.tree.map(lambda x, w: np.testing.assert_allclose(np.asarray(x), np.asarray(w), rtol=1e-5,
                                                       atol=1e-8), g_params["adapter"], want)
  # ... and the student sees the adapted teacher as a constant target: the same gradients
  # as with that target written into the column and the adapter off
  adapted = jax.lax.stop_gradient(model.adapt(b.teacher))
  fixed = dataclasses.replace(FULL, adapter=False)
  g_fixed = jax.grad(lambda p: total(p, adapted, fixed))(
      {k: v for k, v in params.items() if k != "adapter"} | {"adapter": params["adapter"]})
  for part in ("base", "aux_head"):
    jax.tree.map(lambda x, w: np.testing.assert_allclose(np.asarray(x), np.asarray(w),
                                                         rtol=1e-5, atol=1e-7),
                 g_params[part], g_fixed[part])
  assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g_params["aux_head"]))


def _task(mesh, spec=None, lr=0.05):
  n = mesh.devices.size
  plan = {t.name: TablePlacement("tw", (i % n,)) for i, t in enumerate(CFG.tables())}
  coll = EmbeddingCollection(CFG.tables(), plan, mesh, opt_lib.get_sparse_optimizer("adagrad", lr))
  model_fn = lambda r: DLRM(CFG, r)
  if spec is not None:
    model_fn = distill.student_fn(model_fn, spec)
  return RecTask(model_fn, coll, optax.adam(lr), mesh, distill=spec)


def _run(task, batches):
  step = jax.jit(task.train_step)
  state = task.init_state(0)
  losses = []
  for b in batches:
    state, m = step(state, task.device_batch(b))
    losses.append(np.asarray(m["loss"]))
  return state, losses


@pytest.mark.devices(8)
@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_all_terms_off_equals_plain_rectask_bit_for_bit(devices):
  mesh = mesh_lib.make_mesh(f"data:{devices}", jax.devices()[:devices], rules=mesh_lib.REC_RULES)
  batches = [_batch(seed=k) for k in range(3)]
  plain, l_plain = _run(_task(mesh), [dataclasses.replace(b, teacher=None) for b in batches])
  off, l_off = _run(_task(mesh, distill.DistillSpec()), batches)
  np.testing.assert_array_equal(np.stack(l_plain), np.stack(l_off))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(plain["params"]),
               jax.device_get(off["params"]["base"]))
  coll = _task(mesh).collection
  jax.tree.map(np.testing.assert_array_equal, coll.to_tables(plain["emb"]),
               coll.to_tables(off["emb"]))


@pytest.mark.slow
@pytest.mark.devices(8)
def test_distilled_step_sharded_matches_one_device():
  one = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
  eight = mesh_lib.make_mesh("data:8", jax.devices()[:8], rules=mesh_lib.REC_RULES)
  batches = [_batch(seed=k) for k in range(2)]
  s1, l1 = _run(_task(one, FULL), batches)
  s8, l8 = _run(_task(eight, FULL), batches)
  np.testing.assert_allclose(np.stack(l1), np.stack(l8), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               jax.device_get(s1["params"]), jax.device_get(s8["params"]))


class _ListSource:
  def __init__(self, batches):
    self._b, self.batch_size, self.spec = batches, batches[0].batch_size, None

  @property
  def num_batches(self):
    return len(self._b)

  def batches(self, start=0):
    yield from self._b[start:]


def test_das_writes_the_teachers_predictions(tmp_path):
  mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
  teacher = _task(mesh)
  state = teacher.init_state(3)
  src = _ListSource([_batch(seed=k, teacher=False) for k in range(3)])
  aug = distill.augment(teacher, state, src, 3, str(tmp_path / "p0.npy"))
  # the teacher run directly: its model on the tables' rows, without the collection
  tables = teacher.collection.to_tables(state["emb"])
  model = nnx.merge(teacher.graphdef, state["params"])
  got = list(aug.batches(0))
  assert len(got) == 3
  for b, host in zip(got, src.batches(0)):
    emb = np.stack([np.asarray(tables[t.name])[host.ids[:, f, 0]]
                    for f, t in enumerate(CFG.tables())], axis=1)
    want = np.asarray(model(jnp.asarray(host.dense), jnp.asarray(emb)))
    np.testing.assert_allclose(b.teacher, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(b.labels, host.labels)
  np.testing.assert_array_equal(np.load(tmp_path / "p0.npy")[16:32], got[1].teacher)


def test_missing_teacher_column_is_named(tmp_path):
  mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
  task = _task(mesh, distill.DistillSpec(aux_weight=1.0))
  state = task.init_state(0)
  with pytest.raises(UserError, match="no 'teacher' column"):   # raised while tracing the step
    jax.eval_shape(task.train_step, state, task.device_batch(_batch(teacher=False)))
  src = _ListSource([_batch(teacher=False)])
  with pytest.raises(UserError, match="p9.npy: teacher column file not found"):
    distill.TeacherColumnSource(src, str(tmp_path / "p9.npy"), 1)
  distill.write_column(str(tmp_path / "short.npy"), np.zeros(10))
  with pytest.raises(UserError, match=r"short.npy: teacher column of shape \(10,\).*expected 16"):
    distill.TeacherColumnSource(src, str(tmp_path / "short.npy"), 1)
  # float64 logits past float32's range: inf in the student's float32 column
  np.save(tmp_path / "wide.npy", np.r_[np.zeros(15), 1e39])
  with pytest.raises(UserError, match=r"wide.npy: .*float32: False\); expected 16 finite"):
    distill.TeacherColumnSource(src, str(tmp_path / "wide.npy"), 1)
  np.save(tmp_path / "text.npy", np.array(["1.0"] * 16))
  with pytest.raises(UserError, match=r"text.npy: teacher column of shape \(16,\), dtype <U3"):
    distill.TeacherColumnSource(src, str(tmp_path / "text.npy"), 1)


def test_bad_settings_are_named():
  with pytest.raises(UserError, match="aux_weight=-1"):
    distill.DistillSpec(aux_weight=-1)
  with pytest.raises(UserError, match="adapter=True with kd_weight=0 and aux_weight=0"):
    distill.DistillSpec(adapter=True)
  with pytest.raises(ValueError, match="expected a rec.distill.student_fn model"):
    mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
    coll = _task(mesh).collection
    RecTask(lambda r: DLRM(CFG, r), coll, optax.adam(0.1), mesh,
            distill=distill.DistillSpec(aux_weight=1.0))
