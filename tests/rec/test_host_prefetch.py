"""The host tier's lookahead (`--host_prefetch`; EmbeddingCollection.prefetch,
CachedQuantizedStorage.prefetch, rec/data/lookahead.py): each step ends by admitting the
next batch's rows to the device caches. fp32 rows behind the cache train bit for bit as fp32
tables, on one device and on 8 (tw and rw); with room in the cache the next step's lookups
all hit it (no host read); prefetching changes where rows are, never their values, under
every sharding kind; int8 rows train close to the run without it; a run with it resumes
exactly; the flag needs a table on the host tier."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from rec.data.batch import SparseBatch
from rec.data.lookahead import LookaheadSource
from rec.embedding import optimizers as so
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import TableConfig
from rec.embedding.planner import TablePlacement
from tests.rec.test_rowwise_storage import KINDS, TABLES, _batches

# A fully associative LRU cache of half of each device's rows: a batch's rows fit.
ROOMY = "fp32_cache:lru:0.5:128@host"


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


_STEPS = {}   # one compiled step per (mesh, plan, storage): runs with and without prefetch


def _run(mesh, plan, storage, prefetch, steps=4):
  """(collection, state, misses): the state after `steps` sparse Adagrad steps (with
  `prefetch`, each step ends by admitting the next batch's rows; without, the same program
  prefetches empty bags, which changes nothing), and before each step the ids of its batch
  that would read host memory, {group: summed over devices}."""
  key = (id(mesh), tuple(sorted(plan.items())), storage)
  if key not in _STEPS:
    tables = [dataclasses.replace(t, storage=storage) for t in TABLES]
    coll = EmbeddingCollection(tables, plan, mesh, so.get_sparse_optimizer("adagrad", 0.1))

    @jax.jit
    def step(state, s, ids, lengths, weights, target, next_ids, next_lengths):
      lk = coll.gather(state, ids, lengths, weights)
      grad = jax.grad(lambda p: jnp.sum((coll.pool(lk, p) - target) ** 2))(lk.partial)
      state = coll.apply_gradients(state, lk, grad, s)
      return coll.prefetch(state, next_ids, next_lengths, s + 1)

    _STEPS[key] = coll, step
  coll, step = _STEPS[key]
  state = coll.init(jax.random.key(0))

  misses = jax.jit(lambda st, ids, lengths: {
      k: jnp.sum(v) for k, v in coll.cache_misses(st, ids, lengths).items()})
  batches = [mesh_lib.shard_batch(b, mesh, mesh_lib.REC_RULES) for b in _batches(steps + 1)]
  count = []
  for s in range(steps):
    if coll.host_groups():
      count.append({k: int(v) for k, v in misses(state, *batches[s][:2]).items()})
    ids, lengths = batches[s + 1][:2]
    state = step(state, jnp.int32(s), *batches[s], ids, lengths if prefetch else 0 * lengths)
  return coll, state, count


def _assert_same_training(ref, got):
  """Tables and sparse optimizer state of two runs equal bit for bit."""
  (c0, s0, _), (c1, s1, _) = ref, got
  want, have = c0.to_tables(s0), c1.to_tables(s1)
  for n in want:
    np.testing.assert_array_equal(_bits(have[n]), _bits(want[n]), err_msg=n)
  opt = lambda s: [jax.device_get(g["opt"]) for _, g in sorted(s.items())]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(_bits(a), _bits(b)), opt(s1), opt(s0))


@pytest.fixture(scope="module")
def mesh1():
  return mesh_lib.make_mesh("data:1", jax.devices()[:1])


@pytest.fixture(scope="module")
def one_device(mesh1):
  plan = {t.name: TablePlacement("tw", (0,)) for t in TABLES}
  return plan, _run(mesh1, plan, "fp32", False)


def test_one_device_trains_as_fp32_and_next_lookups_hit(mesh1, one_device):
  """fp32 rows in host memory behind an LRU cache with room for a batch: bit for bit the
  fp32 tables and Adagrad state; only step 0 (nothing prefetched before it) reads host
  memory, every later step finds all its rows cached, where without prefetch each does."""
  plan, ref = one_device
  got = _run(mesh1, plan, ROOMY, True)
  _assert_same_training(ref, got)
  misses = [sum(m.values()) for m in got[2]]
  assert misses[0] > 0 and misses[1:] == [0] * (len(misses) - 1), misses
  without = _run(mesh1, plan, ROOMY, False)
  _assert_same_training(ref, without)
  assert all(sum(m.values()) > 0 for m in without[2]), without[2]
  (_, g), = got[1].items()
  assert g["table"]["rows"].sharding.memory_kind == "pinned_host"


def test_small_lfu_cache_evicts_and_still_trains_as_fp32(mesh1, one_device):
  """A 10% LFU cache of 2 ways: prefetching evicts (rows written back) and leaves the rows
  that score too low or meet a full set to the step's own admission; still fp32's bits."""
  plan, ref = one_device
  got = _run(mesh1, plan, "fp32_cache:lfu:0.1:2@host", True)
  _assert_same_training(ref, got)
  without = _run(mesh1, plan, "fp32_cache:lfu:0.1:2@host", False)
  host = lambda run: [sum(m.values()) for m in run[2][1:]]
  assert sum(host(got)) < sum(host(without)), (host(got), host(without))
  assert min(host(got)) > 0     # best effort: some rows do not fit


@pytest.mark.devices(8)
def test_sharded_tw_and_rw_train_as_fp32():
  """8 devices, tables alternately tw (on devices 0, 3, 6) and rw (every device): each
  device admits the rows its shards read after the ids' exchange; bit for bit the same
  8-device fp32 training, and the tw tables' next lookups all hit."""
  mesh8 = mesh_lib.make_mesh("data:2,model:4")
  plan = {t.name: KINDS["tw" if i % 2 == 0 else "rw"](i) for i, t in enumerate(TABLES)}
  ref = _run(mesh8, plan, "fp32", False)
  got = _run(mesh8, plan, ROOMY, True)
  _assert_same_training(ref, got)
  tw = [{k: v for k, v in m.items() if k.startswith("a2a")} for m in got[2]]
  assert sum(tw[0].values()) > 0 and all(v == 0 for m in tw[1:] for v in m.values()), tw


@pytest.mark.devices(8)
@pytest.mark.parametrize("kind", ["dp", "cw", "twrw", "sptt"])
def test_prefetch_moves_rows_into_the_caches_not_their_values(kind):
  """Every other kind (sptt: two towers of 4 devices): prefetching a batch changes no
  table's values; afterwards none of the batch's rows reads host memory."""
  mesh8 = mesh_lib.make_mesh("data:2,model:4")
  if kind == "sptt":
    tables = [TableConfig(f"C{i + 1}", r, 8, storage=ROOMY) for i, r in enumerate(
        (37, 50, 13, 64, 29))]
    plan = planner_lib.tower_plan(tables, [[0, 2], [1, 3, 4]], 8)
  else:
    tables = [dataclasses.replace(t, storage=ROOMY) for t in TABLES]
    plan = {t.name: KINDS[kind](i) for i, t in enumerate(tables)}
  coll = EmbeddingCollection(tables, plan, mesh8, so.get_sparse_optimizer("adagrad", 0.1))
  rng = np.random.default_rng(1)
  full = {t.name: rng.standard_normal((t.num_rows, 8)).astype(np.float32) for t in tables}
  state = coll.from_tables(full)
  ids, lengths = mesh_lib.shard_batch(_batches(1, seed=3)[0][:2], mesh8, mesh_lib.REC_RULES)
  misses = lambda st: int(sum(np.sum(v) for v in jax.jit(coll.cache_misses)(st, ids, lengths)
                              .values()))
  before = misses(state)
  state = jax.jit(coll.prefetch)(state, ids, lengths, jnp.int32(1))
  got = coll.to_tables(state)
  for n in full:
    np.testing.assert_array_equal(_bits(got[n]), _bits(full[n]), err_msg=n)
  assert before > 0 and misses(state) == 0, (before, misses(state))


def test_int8_rows_train_close_to_without_prefetch(mesh1, one_device):
  """int8 rows (stochastic rounding) behind a small LFU cache in host memory: prefetching
  caches other rows, so other rows round; the tables stay close to the run without it."""
  plan, _ = one_device
  c0, s0, _ = _run(mesh1, plan, "int8_cache:lfu:0.2:2@host", False)
  c1, s1, _ = _run(mesh1, plan, "int8_cache:lfu:0.2:2@host", True)
  a, b = c0.to_tables(s0), c1.to_tables(s1)
  assert any((a[n] != b[n]).any() for n in a)     # other rows cached, other rounding
  for n in a:    # within two int8 steps of the rows' range (about 0.7 / 255 each)
    assert np.isfinite(b[n]).all()
    np.testing.assert_allclose(b[n], a[n], rtol=0, atol=0.006, err_msg=n)


# ------------------------------------------------------------------------- in a run

def test_lookahead_source_attaches_the_next_batch():
  """Each batch carries the following batch's ids and lengths, from any start (a resume
  sees what the uninterrupted run saw); the last batch empty bags."""
  class Three:
    spec, batch_size, num_batches = None, 2, 3

    def batches(self, start=0):
      for k in range(start, 3):
        yield SparseBatch(np.zeros((2, 1), np.float32), np.full((2, 1, 1), k, np.int32),
                          np.ones((2, 1), np.int32), np.zeros(2, np.float32),
                          np.ones(2, np.float32))

  got = list(LookaheadSource(Three()).batches(0))
  assert [int(b.lookahead.ids[0, 0, 0]) for b in got[:2]] == [1, 2]
  assert not got[2].lookahead.lengths.any()
  again = list(LookaheadSource(Three()).batches(1))
  assert [int(b.ids[0, 0, 0]) for b in again] == [1, 2]
  np.testing.assert_array_equal(again[0].lookahead.ids, got[1].lookahead.ids)


@pytest.mark.devices(2)
def test_run_with_prefetch_resumes_exactly_and_trains_as_fp32(tmp_path):
  """Logistic regression on 2 devices (rw tables) through core.train with --host_prefetch: 4 straight
  steps == 2, checkpoint, resume, 2 more (every array, the caches with what the last step
  prefetched); and the tables and dense weights are those of plain fp32 training."""
  from core import train as train_lib
  from rec import configs
  base = dict(model="logreg", preset="small", num_rows=300, batch_size=64, eval_batch_size=64,
              eval_batches=1, sharding="rw", mesh="data:2")
  cfg = configs.make_run(**base, storage="fp32_cache:lru:0.1:2@host", host_prefetch=True)
  outs = []
  for name, c, stops in (("straight", cfg, [None]), ("resumed", cfg, [2, None]),
                         ("fp32", configs.make_run(**base), [None])):
    for stop in stops:
      task, train_src, _, _, _ = configs.build_run(c, devices=jax.devices()[:2])
      out = train_lib.train(task, train_src.batches, None, train_lib.TrainConfig(
          workdir=str(tmp_path / name), steps=4, stop_at_step=stop, resume=stop is None
          and name == "resumed", log_every=100, tensorboard=False))
    outs.append((task, jax.device_get(out["state"])))
  (task, a), (_, b), (plain, c) = outs
  assert a["step"] == b["step"] == 4
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(_bits(x), _bits(y)) if np.asarray(
      x).dtype == np.float32 else np.testing.assert_array_equal(x, y), a, b)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(_bits(x), _bits(y)), a["params"],
               c["params"])
  want, got = plain.collection.to_tables(c["emb"]), task.collection.to_tables(a["emb"])
  for n in want:
    np.testing.assert_array_equal(_bits(got[n]), _bits(want[n]), err_msg=n)


def test_flag_needs_a_table_on_the_host_tier():
  from rec import configs
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=300, batch_size=64,
                         eval_batch_size=64, mesh="data:1", host_prefetch=True)
  with pytest.raises(ValueError, match=r"^--host_prefetch: no embedding table is on the host "
                     r"tier \(storages \['fp32'\]\); expected --storage=KIND_cache\.\.\.@host"):
    configs.build_run(cfg, devices=jax.devices()[:1])
  settings = configs.make_run(storage="fp32_cache@host", host_prefetch=True).run_settings()
  assert settings["host_prefetch"] is True
  old = {k: v for k, v in settings.items() if k != "host_prefetch"}
  assert configs.normalize_settings(old)["host_prefetch"] is False
