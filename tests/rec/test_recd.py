"""RecD (rec/data/dedup.py, the collection's `dedup` option, RecTask): the deduplicated
path trains exactly as the plain one (loss, gradients, updated rows) on 8 devices under
the sharding kinds and on one, with and without skip_nonfinite; the host dedup against a
per-sample reference; capacity overflow falls back or errors; the train loop (eval,
checkpoints, resume) runs with it. In the input pipeline: batches deduplicated by Grain's map
(in worker processes too) equal the host dedup of the same batches and train as the plain
ones; the session source's duplication rate is its parameter within the sampling error
(coin-flip sessions) or exactly (fixed-length sessions)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from core import mesh as mesh_lib
from core import train as train_loop
from rec import configs
from rec.data import dedup as dedup_lib
from rec.data import sessions, sources, workers
from rec.data.batch import SparseBatch
from rec.embedding import optimizers as opt_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.planner import TablePlacement
from rec.models.dlrm import DLRM, DLRMConfig
from rec.train_lib import RecTask

CFG = DLRMConfig(num_dense=3, num_sparse=5, embedding_dim=8, bottom_mlp=(8, 8), top_mlp=(8, 1),
                 rows_per_feature=(50,) * 5)
KINDS = {"dp": TablePlacement("dp", tuple(range(8))), "tw": TablePlacement("tw", (3,)),
         "rw": TablePlacement("rw", tuple(range(8))), "cw": TablePlacement("cw", (1, 5)),
         "twrw": TablePlacement("twrw", (4, 5, 6, 7))}
USER = ("C1", "C3", "C4")      # repeated within a session; C2, C5 per sample
LR = 0.1


def _session_batch(B=32, session=4, L=3, seed=1):
  """Sessions of `session` samples share the user features' bags (ids, lengths, weights);
  bags of 1..L ids, padding slots random (never read)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 50, (B, 5, L)).astype(np.int32)
  lengths = rng.integers(1, L + 1, (B, 5)).astype(np.int32)
  w = rng.uniform(0.5, 1.5, ids.shape).astype(np.float32)
  for f in (0, 2, 3):
    for x in (ids, lengths, w):
      x[:, f] = np.repeat(x[::session, f], session, axis=0)
  return SparseBatch(rng.standard_normal((B, 3)).astype(np.float32), ids, lengths,
                     (rng.random(B) < 0.3).astype(np.float32), np.ones(B, np.float32), w)


def _tasks(mesh, kinds, capacity=0, on_overflow="fallback"):
  """(plain task, dedup task): the same model, tables and plan; SGD so that an update is
  -lr x the gradient."""
  n = mesh.devices.size
  plan = {t.name: (KINDS[kinds[i % len(kinds)]] if n == 8 else TablePlacement("tw", (0,)))
          for i, t in enumerate(CFG.tables())}

  def task(**kw):
    coll = EmbeddingCollection(CFG.tables(), plan, mesh,
                               opt_lib.get_sparse_optimizer("sgd", LR), **kw)
    return RecTask(lambda r: DLRM(CFG, r), coll, optax.sgd(LR), mesh)

  return task(), task(dedup=dedup_lib.DedupSpec(USER, capacity, on_overflow))


def _init_state(task, seed=0):
  """A train state of random dense weights (any will do; RecTask.init_state compiles the
  model's init, which costs seconds) and the collection's initial tables."""
  rng = np.random.default_rng(seed)
  shapes = nnx.state(nnx.eval_shape(lambda: task.model_fn(nnx.Rngs(0))))
  params = jax.tree.map(lambda a: 0.3 * rng.standard_normal(a.shape).astype(a.dtype),
                        nnx.to_pure_dict(shapes))
  tables = task.collection.init_tables(jax.random.key(seed))
  return _state_for(task, {"step": np.int32(0), "params": params,
                           "opt": task.dense_tx.init(params)}, tables)


def _state_for(task, state, tables):
  """`task`'s train state with `state`'s step, dense parameters and optimizer state and
  the logical `tables` (one model init shared by the tasks of a test: compiling it costs)."""
  rep = jax.sharding.NamedSharding(task.mesh, jax.sharding.PartitionSpec())
  put = lambda x: jax.device_put(x, rep)
  return {"step": put(state["step"]), "params": jax.tree.map(put, state["params"]),
          "opt": jax.tree.map(put, state["opt"]), "emb": task.collection.from_tables(tables)}


def _mesh(n):
  return (mesh_lib.make_mesh("data:2,model:4") if n == 8 else
          mesh_lib.make_mesh("data:1", devices=jax.devices()[:1]))


class _Batches:
  """A random-access source of `_session_batch`es (batch k: seed k)."""

  spec, batch_size, num_batches = None, 32, None

  def batch(self, k):
    return _session_batch(seed=k)


def _pipeline_batch(task, k=1):
  """Batch k as the input pipeline delivers it: drawn and deduplicated by Grain's map
  (`WorkerSource`, the map in this process), before the task sees it."""
  coll = task.collection
  src = workers.WorkerSource(_Batches(), dedup_lib.DedupTransform(
      coll.dedup_features, coll.dedup.capacity, task.dedup_shards(), coll.dedup.on_overflow),
                             num_workers=0)
  return next(iter(src.batches(k)))


def _check_dedup_trains_as_plain(n, kinds, skip_nonfinite):
  """One step of the dedup task, fed the input pipeline's deduplicated batch, against the
  plain task's loss and gradients: with SGD every row moves by -lr x its gradient, so
  equal updates are equal gradients."""
  plain, dd = _tasks(_mesh(n), kinds)
  host = _session_batch()
  assert dedup_lib.duplication_rate(host, [0, 2, 3]) > 0.5
  state = _init_state(plain)
  piped = _pipeline_batch(dd)
  ref = dedup_lib.dedup_batch(host, [0, 2, 3], num_shards=dd.dedup_shards()).dedup
  for name in ("ids", "lengths", "weights", "inverse"):   # the host dedup of the same batch
    np.testing.assert_array_equal(getattr(piped.dedup, name), getattr(ref, name), err_msg=name)
  b0, b1 = plain.device_batch(host), dd.device_batch(piped)
  assert b0.dedup is None and b1.dedup.features == (0, 2, 3)
  assert b1.dedup.ids.shape == (8, 3, 3)   # 8 sessions: C_l = the sessions of a shard

  l0, _, lk0, gp0, gs0 = jax.jit(plain.loss_and_grads)(state, b0)[:5]
  g0 = plain.collection.dense_gradients(lk0, gs0)
  step = jax.jit(lambda s, b: dd.train_step(s, b, skip_nonfinite=skip_nonfinite))
  before = plain.collection.to_tables(state["emb"])
  new, m = step(_state_for(dd, state, before), b1)
  assert float(m["dedup_fallback"]) == 0
  np.testing.assert_allclose(float(m["loss"]), float(l0), rtol=1e-6)
  after = dd.collection.to_tables(new["emb"])
  for name in before:
    assert np.abs(g0[name]).max() > 0
    np.testing.assert_allclose(after[name], before[name] - LR * g0[name], rtol=1e-5,
                               atol=1e-7, err_msg=name)
  jax.tree.map(lambda a, p, g: np.testing.assert_allclose(a, p - LR * g, rtol=1e-5, atol=1e-7),
               new["params"], state["params"], gp0)
  if skip_nonfinite:   # a NaN batch changes nothing but the step count, as on the plain path
    assert float(m["skipped"]) == 0
    bad = dd.device_batch(dataclasses.replace(host, dense=np.full_like(host.dense, np.nan)))
    kept, m = step(new, bad)
    assert float(m["skipped"]) == 1 and int(kept["step"]) == 2
    for name, t in dd.collection.to_tables(kept["emb"]).items():
      np.testing.assert_array_equal(t, after[name])


@pytest.mark.slow
def test_dedup_forward_is_the_plain_forward_bit_for_bit():
  """Logits of the dedup lookup equal the plain ones exactly (equal bags pool equally)."""
  plain, dd = _tasks(_mesh(1), ("tw",))
  host = _session_batch()
  state = _init_state(plain)
  out0 = jax.jit(plain.eval_step)(state, plain.device_batch(host))
  out1 = jax.jit(dd.eval_step)(_state_for(dd, state, plain.collection.to_tables(state["emb"])),
                               dd.device_batch(host))
  np.testing.assert_array_equal(np.asarray(out1["logits"]), np.asarray(out0["logits"]))


@pytest.mark.devices(8)
def test_dedup_trains_as_plain_8_devices_a2a_and_rw():
  """Table-wise (all-to-all) and row-wise (all-gather / reduce-scatter), skip_nonfinite."""
  _check_dedup_trains_as_plain(8, ("tw", "rw"), skip_nonfinite=True)


def test_dedup_trains_as_plain_one_device():
  _check_dedup_trains_as_plain(1, ("tw",), skip_nonfinite=False)


@pytest.mark.slow
@pytest.mark.devices(8)
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_dedup_trains_as_plain_8_devices_every_kind(skip_nonfinite):
  _check_dedup_trains_as_plain(8, ("dp", "tw", "rw", "cw", "twrw"), skip_nonfinite)


@pytest.mark.slow
def test_dedup_trains_as_plain_one_device_skip_nonfinite():
  _check_dedup_trains_as_plain(1, ("tw",), skip_nonfinite=True)


@pytest.mark.parametrize("hashed", [True, False])
def test_dedup_batch_matches_per_sample_reference(hashed, monkeypatch):
  if not hashed:   # every row hashes alike: the check finds collisions, rows are sorted exactly
    monkeypatch.setattr(dedup_lib, "_HASH_MULT", np.zeros(4096, np.uint64))
  host = _session_batch()
  for shards in (1, 4):
    d = dedup_lib.dedup_batch(host, [0, 2, 3, 4], num_shards=shards).dedup
    b, C = 32 // shards, d.capacity // shards
    assert C & (C - 1) == 0 and d.inverse.max() < C      # automatic: a power of two
    for s in range(32):
      for j, f in enumerate((0, 2, 3, 4)):
        u = (s // b) * C + d.inverse[s, j]                # a row of the sample's own shard
        n = host.lengths[s, f]
        assert d.lengths[u, j] == n
        np.testing.assert_array_equal(d.ids[u, j, :n], host.ids[s, f, :n])
        np.testing.assert_array_equal(d.weights[u, j, :n], host.weights[s, f, :n])
    # Each shard's used rows hold distinct bags (C1 repeats within sessions only).
    for s in range(shards):
      used = d.inverse[s * b:(s + 1) * b, 0]
      assert sorted(set(used.tolist())) == list(range(used.max() + 1)) == list(range(b // 4))
  d = dedup_lib.dedup_batch(host, [0], num_shards=1).dedup
  assert d.capacity == 8 and d.inverse[:, 0].max() == 7  # 8 sessions, 8 distinct bags
  assert d.weights is not None
  assert dedup_lib.dedup_batch(dataclasses.replace(host, weights=None), [0]).dedup.weights is None


def test_capacity_overflow_falls_back_or_errors():
  host = _session_batch()
  host.lengths[:4, 0] = [1, 1, 2, 1]
  host.ids[:4, 0, 0] = [7, 7, 7, 8]       # shard 0 of 8: 3 distinct bags of C1
  out = dedup_lib.dedup_batch(host, [0, 2], capacity=2, num_shards=8)
  assert out is host and out.dedup is None
  with pytest.raises(dedup_lib.CapacityError,
                     match=r"feature 0 has 3 distinct bags in batch shard 0 \(4 samples\), "
                           r"over the capacity 2"):
    dedup_lib.dedup_batch(host, [0, 2], capacity=2, num_shards=8, on_overflow="error")
  assert dedup_lib.dedup_batch(host, [0, 2], capacity=3, num_shards=8).dedup.capacity == 24
  # the task names the table, as --dedup_features does (index 2 is C3, not "C2")
  mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  _, task = _tasks(mesh, ["tw"], capacity=2, on_overflow="error")
  host = _session_batch()
  host.ids[:4, 2, 0], host.lengths[:4, 2] = [1, 2, 3, 4], 1     # 4 distinct bags of C3 ...
  host.ids[:, 0, 0], host.lengths[:, 0], host.weights[:, 0] = 5, 1, 1.0   # ... 1 of C1
  for deliver in (task.device_batch, dedup_lib.DedupTransform(
      task.collection.dedup_features, 2, 1, "error",
      [t.name for t in task.collection.tables])):
    with pytest.raises(dedup_lib.CapacityError, match=r"^dedup: feature 'C3' has \d+ distinct"):
      deliver(host)


def test_spec_and_flag_errors_name_the_setting():
  assert dedup_lib.DedupSpec.from_flags("", known=["C1"]) is None
  assert dedup_lib.DedupSpec.from_flags("C1, C3", 4, known=["C1", "C3"]) == \
      dedup_lib.DedupSpec(("C1", "C3"), 4)
  with pytest.raises(ValueError, match=r"--dedup_features=C1,C9: unknown features \['C9'\]"):
    dedup_lib.DedupSpec.from_flags("C1,C9", known=["C1", "C2"])
  with pytest.raises(ValueError, match=r"--dedup_features=C1: dedup capacity -1"):
    dedup_lib.DedupSpec.from_flags("C1", -1)
  with pytest.raises(ValueError, match="--dedup_capacity=-2"):
    configs.RecRunConfig(embedding=configs.EmbeddingConfig(
        dedup=configs.DedupConfig(dedup_capacity=-2))).validate()
  mesh = _mesh(1)
  plan = {t.name: TablePlacement("tw", (0,)) for t in CFG.tables()}
  sgd = opt_lib.get_sparse_optimizer("sgd", 0.1)
  with pytest.raises(ValueError, match=r"dedup features \['C9'\] are not tables"):
    EmbeddingCollection(CFG.tables(), plan, mesh, sgd, dedup=dedup_lib.DedupSpec(("C9",)))
  # A batch's distinct bags must be the collection's dedup features.
  host = dedup_lib.dedup_batch(_session_batch(), [0, 2])
  plain = EmbeddingCollection(CFG.tables(), plan, mesh, sgd)
  with pytest.raises(ValueError, match="no `dedup` option"):
    plain.gather(plain.init(jax.random.key(0)), host.ids, host.lengths, host.weights, host.dedup)
  other = EmbeddingCollection(CFG.tables(), plan, mesh, sgd, dedup=dedup_lib.DedupSpec(USER))
  with pytest.raises(ValueError, match=r"batch deduplicates features \['C1', 'C3'\], the "
                                       r"collection \['C1', 'C3', 'C4'\]"):
    other.gather(other.init(jax.random.key(0)), host.ids, host.lengths, host.weights,
                 host.dedup)
  # bag_sizes: a bag longer than its table's size is an error, not a silent cut.
  short = EmbeddingCollection(CFG.tables(), plan, mesh, sgd, bag_sizes={"C2": 2})
  with pytest.raises(ValueError, match=r"feature 'C2': a bag of 3 ids at example \d+, longer "
                                       r"than its bag size 2"):
    short.check_lengths(_session_batch().lengths)


@pytest.mark.slow   # three short runs; the loop's resume itself is tests/core/test_train.py's
def test_train_loop_eval_and_resume_with_dedup(tmp_path):
  """train_rec's run (build_run) with --dedup_features: 4 straight steps == 2 + resume + 2,
  bit for bit, eval included; the metrics record no fallback."""
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=200, batch_size=64,
                             eval_batch_size=64, eval_batches=1, mesh="data:1",
                             dedup_features="C1,C2", seed=3)
  runs = {}
  for name, stops in (("straight", (None,)), ("resumed", (2, None))):
    for stop in stops:
      task, train_src, eval_src, _, _ = configs.build_run(cfg, devices=jax.devices()[:1])
      assert task.collection.dedup == dedup_lib.DedupSpec(("C1", "C2"))
      loop = train_loop.TrainConfig(workdir=str(tmp_path / name), steps=4, stop_at_step=stop,
                                    resume=stop is None and name == "resumed", log_every=1,
                                    tensorboard=False, nonfinite="skip")
      runs[name] = train_loop.train(task, train_src.batches, lambda: eval_src.batches(0), loop)
  a, b = runs["straight"], runs["resumed"]
  assert a["step"] == b["step"] == 4 and a["eval"]["auc"] == b["eval"]["auc"]
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               a["state"], b["state"])
  lines = (tmp_path / "straight" / "metrics.jsonl").read_text()
  assert '"dedup_fallback": 0.0' in lines


# --- RecD in the input pipeline: session data, Grain worker processes ----------------------

def test_worker_processes_deliver_the_host_dedup_of_each_batch():
  """Batches drawn and deduplicated in a Grain worker process equal the host-side dedup
  of the same batches (distinct bags, inverse indices, and the plain columns)."""
  src = sessions.SessionSource(64, 1000, dup_rate=0.75, num_user=3, user_bag=4, seed=5)
  dd = dedup_lib.DedupTransform([0, 1, 2], capacity=0, num_shards=4)
  piped = workers.WorkerSource(src, dd, num_workers=1)
  for k, got in zip(range(2, 5), piped.batches(2)):
    want = dedup_lib.dedup_batch(src.batch(k), [0, 1, 2], num_shards=4)
    for name in ("dense", "ids", "lengths", "labels", "mask"):
      np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.dedup.features == want.dedup.features == (0, 1, 2)
    for name in ("ids", "lengths", "inverse"):
      np.testing.assert_array_equal(getattr(got.dedup, name), getattr(want.dedup, name),
                                    err_msg=f"dedup.{name}, batch {k}")


def test_session_source_duplication_rate_is_its_parameter():
  """Each sample but a batch's first starts a session with probability 1 - dup: the user
  features hold exactly one distinct bag per session, and the duplication rate over K
  batches is dup (B - 1) / B within 4 standard errors sqrt((B - 1) dup (1 - dup)) / (B
  sqrt(K))."""
  B, K = 256, 24
  for dup in (0.0, 0.875):
    src = sessions.SessionSource(B, 5000, dup_rate=dup, num_user=2, user_bag=8, seed=2)
    rates = []
    for k in range(K):
      b = src.batch(k)
      starts = src.session_starts(k)
      first = np.flatnonzero(starts)[np.cumsum(starts) - 1]
      assert (b.ids[:, :2] == b.ids[first, :2]).all()          # repeated within a session
      assert (b.lengths == [8, 8] + [1] * 24).all()
      rate = dedup_lib.duplication_rate(b, [0])
      assert rate == 1 - starts.sum() / B                       # one distinct bag per session
      rates.append(rate)
    mean, std = sessions.expected_dup_rate(dup, B)
    assert abs(np.mean(rates) - mean) <= 4 * std / np.sqrt(K) + 1e-12, (dup, np.mean(rates))
  assert sessions.dup_rate_for_repeats(4) == 0.75
  # Process shares are the rows of the same global batches.
  halves = [sessions.SessionSource(B, 5000, dup_rate=dup, num_user=2, user_bag=8, seed=2,
                                   shard_index=i, num_shards=2) for i in range(2)]
  np.testing.assert_array_equal(np.concatenate([h.batch(3).ids for h in halves]),
                                src.batch(3).ids)


def test_fixed_length_sessions_duplicate_at_the_asked_rate():
  """session_len=S: every S consecutive samples share their user bags, so the duplication
  rate counted from each batch is 1 - 1/S (one distinct bag per session, none shared across
  sessions), items stay per sample, and batch k is the same on every draw."""
  B = 96
  for S in (1, 3, 8):
    src = sessions.SessionSource(B, 5000, session_len=S, num_user=2, num_item=3, user_bag=8,
                                 seed=4)
    assert src.dup_rate == pytest.approx(1 - 1 / S) and src.spec.sparse_features == (
        "C1", "C2", "C3", "C4", "C5")
    for k in (0, 5):
      b = src.batch(k)
      assert b.ids.shape == (B, 5, 8) and (b.lengths == [8, 8, 1, 1, 1]).all()
      for f in (0, 1):
        assert dedup_lib.duplication_rate(b, [f]) == pytest.approx(1 - 1 / S)
        np.testing.assert_array_equal(b.ids[:, f], np.repeat(b.ids[::S, f], S, axis=0))
      np.testing.assert_array_equal(src.batch(k).labels, b.labels)
    assert dedup_lib.duplication_rate(src.batch(0), [2, 3, 4]) < 0.5   # items: Zipf repeats only
  with pytest.raises(ValueError, match=r"study: session_len=7 for batch_size=96; expected a "
                                       r"session length >= 1 dividing"):
    sessions.SessionSource(B, 100, session_len=7, flag="study")
  with pytest.raises(ValueError, match=r"dup=0.5 and session_len=4; expected one of them"):
    sessions.SessionSource(B, 100, dup_rate=0.5, session_len=4)


def test_session_and_worker_errors_name_the_setting():
  train, _ = sources.make_sources("sessions:dup=0.5,user=3,user_bag=4", 64, num_rows=1000)
  assert train.dup_rate == 0.5 and train.bag_sizes["C3"] == 4 and train.bag_sizes["C4"] == 1
  for bad in ("sessions:dup=1.0", "sessions:dup=x", "sessions:user=27", "sessions:user_bag=0",
              "sessions:gen=device", "sessions:multi_hot=mlperf"):
    with pytest.raises(ValueError, match=f"--data='{bad}': option"):
      sources.make_sources(bad, 64, num_rows=1000)

  class Stream:   # no batch(k): only read in order
    spec, batch_size, num_batches = None, 8, None

  with pytest.raises(ValueError, match=r"--data_workers=2: the source Stream has no random "
                                       r"access"):
    workers.WorkerSource(Stream(), None, num_workers=2)
  with pytest.raises(ValueError, match=r"--data_workers=-1: expected >= 0"):
    workers.WorkerSource(sessions.SessionSource(8, 100), None, num_workers=-1)


@pytest.mark.slow   # two short runs, one with worker processes
def test_training_from_worker_batches_equals_plain_training(tmp_path):
  """train_rec's run on session data: batches and their dedup from a Grain worker process
  (--data_workers=1, --dedup_features) train as the plain run drawn in this process."""
  base = configs.make_run(model="dlrm", preset="small", num_rows=300, batch_size=64,
                              eval_batch_size=64, eval_batches=1, mesh="data:1",
                              data="sessions:dup=0.75,user=3,user_bag=4", seed=1,
                              dense_optimizer="sgd", sparse_optimizer="sgd")
  runs = {}
  for name, cfg, w in (("plain", base, 0),
                       ("dedup", configs.replace_run(base, dedup_features="C1,C2,C3"), 1)):
    task, train_src, _, _, _ = configs.build_run(cfg, devices=jax.devices()[:1], data_workers=w)
    assert isinstance(train_src, workers.WorkerSource) == (w == 1)
    loop = train_loop.TrainConfig(workdir=str(tmp_path / name), steps=3, log_every=1,
                                  eval_every=0, tensorboard=False)
    out = train_loop.train(task, train_src.batches, None, loop)
    runs[name] = (out["state"]["params"], task.collection.to_tables(out["state"]["emb"]))
  close = lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5,
                                                  atol=1e-6)
  jax.tree.map(close, runs["plain"], runs["dedup"])   # dense parameters and every table
  assert '"dedup_fallback": 0.0' in (tmp_path / "dedup" / "metrics.jsonl").read_text()
