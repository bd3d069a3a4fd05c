"""LM training through the shared loop: loss, schedule, sharded == single device, exact resume."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from core import train as train_loop
from llm import train_lib
from llm.config import get_config
from llm.data import ByteTextSource

# The training tests share one setup, so equal programs compile once (the persistent
# compilation cache hands back the init, optimizer-init and step executables across tests):
# a one-block model (embedding, a block, the head and AdamW: every path of the step), the
# 8-device mesh that shards every axis, one schedule and one batch shape.
TINY1 = get_config("tiny").replace(n_layers=1)
MESH8 = "data:2,fsdp:2,tp:2"
OPTIM = train_lib.OptimConfig(peak_lr=1e-2, warmup_steps=2, total_steps=6)
SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("lm") / "text.txt"
  rng = np.random.default_rng(0)
  words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
  path.write_text(" ".join(rng.choice(words, 4000)))
  return str(path)


def test_next_token_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 5))
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
  loss, n = train_lib.next_token_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (ce * mask).sum() / mask.sum(), rtol=1e-5)
  assert float(n) == 8


def test_schedule_warmup_then_cosine():
  sched = train_lib.make_schedule(train_lib.OptimConfig(peak_lr=1.0, warmup_steps=10,
                                                        total_steps=110, final_lr_fraction=0.1))
  assert float(sched(0)) == 0.0 and abs(float(sched(10)) - 1.0) < 1e-6
  assert abs(float(sched(110)) - 0.1) < 1e-6
  assert float(sched(60)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)


def test_byte_source_is_deterministic_and_eval_covers_tail(text_file):
  src = ByteTextSource(text_file, 32, 4, seed=3)
  a, b = src.batch(7), ByteTextSource(text_file, 32, 4, seed=3).batch(7)
  np.testing.assert_array_equal(a.inputs, b.inputs)
  np.testing.assert_array_equal(a.inputs[:, 1:], a.targets[:, :-1])
  ev = list(ByteTextSource(text_file, 32, 4, split="eval").batches())
  data = np.fromfile(text_file, np.uint8)
  held = data[int(len(data) * 0.95):]
  assert (len(held) - 1) % 32, "the test needs a short last window"
  # Every held-out byte after the first is a target exactly once, in order (the short last
  # window included, not dropped).
  targets = np.concatenate([x.targets[x.mask > 0] for x in ev])
  np.testing.assert_array_equal(targets, held[1:])
  for x in ev:
    real = x.mask > 0
    np.testing.assert_array_equal(x.inputs[:, 1:][real[:, 1:]], x.targets[:, :-1][real[:, 1:]])
  with pytest.raises(ValueError, match="fewer than seq_len"):
    ByteTextSource(text_file, 100_000, 4)


def test_train_windows_reach_the_last_token(tmp_path):
  """A train window of seq_len + 1 tokens may end on the last one: with seq_len + 1 tokens
  there is one window (refused before), with seq_len + 2 two, each drawn."""
  path = tmp_path / "t.bin"
  path.write_bytes(bytes(range(100)))
  cut = int(100 * 0.95)                       # 95 train bytes
  src = ByteTextSource(str(path), cut - 1, 4)
  b = src.batch(0)
  np.testing.assert_array_equal(b.targets, np.tile(np.arange(1, cut), (4, 1)))
  src = ByteTextSource(str(path), cut - 2, 64)
  assert set(src.batch(0).targets[:, -1].tolist()) == {cut - 2, cut - 1}


def test_weight_decay_skips_norms_and_biases():
  """AdamW decays the matrices only: not the norms' scales, nor Qwen2's q / k / v biases
  (held [H,K] / [G,K], 2-D like a matrix)."""
  from flax import nnx
  from llm import model as model_lib
  cfg = get_config("tiny_qwen2")
  shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))))
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
  optim = train_lib.OptimConfig(peak_lr=0.1, warmup_steps=0, weight_decay=0.5)
  tx = train_lib.make_optimizer(optim)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
  attn = updates["layers"][0]["attn"]
  # Zero gradients: Adam's step is 0, so the update is -lr * wd * p on decayed weights.
  np.testing.assert_allclose(np.asarray(attn["wq"]), -0.05, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(updates["embed"]), -0.05, rtol=1e-6)
  for name in ("bq", "bk", "bv"):
    np.testing.assert_array_equal(np.asarray(attn[name]), 0.0, err_msg=name)
  np.testing.assert_array_equal(np.asarray(updates["final_norm"]["scale"]), 0.0)


def test_masked_targets_add_nothing_whatever_their_id():
  """A masked target outside the vocabulary (HF's -100, or V) leaves the loss and its
  gradient those of the real targets, not NaN (NaN cross-entropy times mask 0)."""
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 11)), jnp.float32)
  mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 1]], jnp.float32)
  good = jnp.asarray([[1, 2, 3, 0], [4, 5, 0, 6]], jnp.int32)
  bad = jnp.asarray([[1, 2, 3, -100], [4, 5, 11, 6]], jnp.int32)
  plain = lambda h, t: train_lib.next_token_loss(jnp.einsum("btd,dv->btv", h, w), t, mask)[0]
  chunked = lambda h, t: train_lib.chunked_cross_entropy(h, w, t, mask, False, 2)
  for fn in (plain, chunked):
    value, grad = jax.jit(fn), jax.jit(jax.grad(fn))
    assert float(value(h, bad)) == float(value(h, good))
    np.testing.assert_array_equal(np.asarray(grad(h, bad)), np.asarray(grad(h, good)))


def test_logged_lr_is_the_applied_one_after_a_skipped_step(text_file):
  """A step skipped for a non-finite loss advances the task's step but not AdamW's
  schedule; the logged lr is the one the next update applies (the schedule at the
  optimizer's count), not the schedule at the task's step."""
  optim = OPTIM      # warmup: the schedule at the task's step 1 is not the one at count 0
  task = train_lib.LMTask(TINY1, optim, mesh_lib.make_mesh("data:1", devices=jax.devices()[:1]))
  src = ByteTextSource(text_file, SEQ, BATCH)
  state = task.init_state(0)
  nan = jax.tree.map(lambda x: x, state)
  nan["params"]["final_norm"]["scale"] = jnp.full_like(
      state["params"]["final_norm"]["scale"], np.nan)
  step = jax.jit(functools.partial(task.train_step, skip_nonfinite=True))
  skipped, m = step(nan, task.device_batch(src.batch(0)))
  assert float(m["skipped"]) == 1.0 and int(skipped["step"]) == 1
  skipped["params"]["final_norm"]["scale"] = state["params"]["final_norm"]["scale"]
  _, m = step(skipped, task.device_batch(src.batch(1)))
  assert float(m["skipped"]) == 0.0
  # AdamW's count is still 0: this update applied the schedule's step-0 lr.
  assert float(m["lr"]) == float(train_lib.make_schedule(optim)(0)) == 0.0
  assert float(train_lib.make_schedule(optim)(1)) > 0.0


def _run_steps(task, src, n, start_state=None, start=0):
  state = task.init_state(0) if start_state is None else start_state
  # Donating the state, as core.train's loop jits the step: the same program as the loop's.
  step = jax.jit(task.train_step, donate_argnums=0)
  losses = []
  for k in range(start, start + n):
    state, m = step(state, task.device_batch(src.batch(k)))
    losses.append(float(m["loss"]))
  return state, losses


@pytest.mark.devices(8)
def test_sharded_training_equals_single_device(text_file):
  src = ByteTextSource(text_file, SEQ, BATCH)
  one = train_lib.LMTask(TINY1, OPTIM, mesh_lib.make_mesh("data:1", devices=jax.devices()[:1]))
  many = train_lib.LMTask(TINY1, OPTIM, mesh_lib.make_mesh(MESH8))
  s1, l1 = _run_steps(one, src, 4)
  s8, l8 = _run_steps(many, src, 4)
  np.testing.assert_allclose(l1, l8, rtol=2e-5)
  assert l1[-1] < l1[0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5),
               s1["params"], s8["params"])
  wq = s8["params"]["layers"][0]["attn"]["wq"]
  assert tuple(wq.sharding.spec) in (("fsdp", "tp"), ("fsdp", "tp", None))


@pytest.mark.devices(8)
def test_loop_resume_is_exact(text_file, tmp_path):
  """4 steps straight equal 2 steps, a stop with a checkpoint, and a resume for the other 2
  (params, optimizer moments and the data position all carried over), bit for bit."""
  cfg = TINY1
  mesh = mesh_lib.make_mesh(MESH8)
  src = ByteTextSource(text_file, SEQ, BATCH)

  def run(workdir, stop=None, resume=False):
    task = train_lib.LMTask(cfg, OPTIM, mesh)
    return train_loop.train(task, src.batches, None, train_loop.TrainConfig(
        workdir=str(workdir), steps=4, stop_at_step=stop, resume=resume, tensorboard=False,
        log_every=100))

  run(tmp_path / "straight")
  run(tmp_path / "split", stop=2)
  run(tmp_path / "split", resume=True)
  a = train_lib.load_workdir_params(str(tmp_path / "straight"), cfg)
  b = train_lib.load_workdir_params(str(tmp_path / "split"), cfg)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# --- chunked cross-entropy


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("chunks", [1, 4])     # one chunk, and several (strided) chunks
def test_chunked_cross_entropy_equals_plain_loss(vocab_major, chunks):
  """Value and gradients (hidden states and the weight) of the chunked loss equal the plain
  loss over full fp32 logits, masked targets included."""
  rng = np.random.default_rng(chunks)
  b, t, d, v = 2, 8, 16, 40
  h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((v, d) if vocab_major else (d, v)) / 4, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = jnp.asarray(rng.random((b, t)) > 0.3, jnp.float32)

  def plain(h, w):
    logits = jnp.einsum("btd,vd->btv" if vocab_major else "btd,dv->btv", h, w)
    loss, n = train_lib.next_token_loss(logits, targets, mask)
    return loss * n

  chunked = lambda h, w: train_lib.chunked_cross_entropy(h, w, targets, mask, vocab_major,
                                                         chunks)
  np.testing.assert_allclose(float(jax.jit(chunked)(h, w)), float(jax.jit(plain)(h, w)),
                             rtol=1e-5)
  got = jax.jit(jax.grad(lambda h, w: 3.0 * chunked(h, w), argnums=(0, 1)))(h, w)
  want = jax.jit(jax.grad(lambda h, w: 3.0 * plain(h, w), argnums=(0, 1)))(h, w)
  for name, a, e in zip(("dh", "dw"), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6, err_msg=name)


def test_chunked_loss_never_builds_full_logits():
  """No [B,T,V] array in the differentiated step's jaxpr: the largest vocab-sized value is
  one chunk of logits."""
  b, t, d, v, chunks = 2, 16, 8, 64, 4
  h = jnp.ones((b, t, d), jnp.bfloat16)
  w = jnp.ones((v, d), jnp.float32)
  tg, m = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda h, w: train_lib.chunked_cross_entropy(
      h, w, tg, m, True, chunks), argnums=(0, 1)))(h, w)
  shapes = set()

  def walk(jp):
    for eqn in jp.eqns:
      shapes.update(tuple(o.aval.shape) for o in eqn.outvars if hasattr(o.aval, "shape"))
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else [p]:
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  assert (b, t // chunks, v) in shapes
  assert not any(len(s) == 3 and s[-1] == v and s[1] > t // chunks for s in shapes)


@pytest.mark.devices(8)
def test_task_chunked_loss_and_bf16_moments_train_like_plain(text_file):
  """LMTask with the chunked loss takes the same steps as with the plain loss; AdamW's first
  moment in bf16 stays close and still lowers the loss."""
  cfg = TINY1
  mesh = mesh_lib.make_mesh(MESH8)
  src = ByteTextSource(text_file, SEQ, BATCH)
  _, plain = _run_steps(train_lib.LMTask(cfg, OPTIM, mesh, loss_chunk=0), src, 4)
  _, chunked = _run_steps(train_lib.LMTask(cfg, OPTIM, mesh, loss_chunk=4), src, 4)
  np.testing.assert_allclose(chunked, plain, rtol=2e-5)
  bf16 = dataclasses.replace(OPTIM, mu_dtype="bfloat16")
  state, low = _run_steps(train_lib.LMTask(cfg, bf16, mesh), src, 4)
  np.testing.assert_allclose(low, plain, rtol=2e-2)
  assert low[-1] < low[0]
  mu = jax.tree.leaves(state["opt"])
  assert any(x.dtype == jnp.bfloat16 for x in mu)


def test_packed_false_refuses_packed_rows(text_file):
  cfg = get_config("tiny")
  task = train_lib.LMTask(cfg, train_lib.OptimConfig(), mesh_lib.make_mesh(
      "data:1", devices=jax.devices()[:1]))
  batch = ByteTextSource(text_file, 16, 2).batch(0)
  assert task.device_batch(batch).segment_ids is None
  batch.segment_ids[1, 8:] = 2
  with pytest.raises(ValueError, match="batch row 1 holds several segment ids"):
    task.device_batch(batch)
  packed = train_lib.LMTask(cfg, train_lib.OptimConfig(), task.mesh, packed=True)
  np.testing.assert_array_equal(np.asarray(packed.device_batch(batch).segment_ids),
                                batch.segment_ids)
  with pytest.raises(ValueError, match="mu_dtype='float16'"):
    train_lib.OptimConfig(mu_dtype="float16")


def test_loss_chunk_tokens():
  assert train_lib.loss_chunk_tokens(1, 8192, 128256) == 2048   # 1 GiB of fp32 logits
  assert train_lib.loss_chunk_tokens(4, 6, 10) == 6
  assert train_lib.loss_chunk_tokens(1, 7, 1 << 30) == 1
