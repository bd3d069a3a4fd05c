"""The host tier (rec/embedding/host_tier.py): rows and optimizer state in host memory, the
hot rows in the device cache; the same training as the storage without the tier, bit for
bit; checkpoints restored into host memory and resharded to and from the device; the
planner's choice of tier and its one-line errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import mesh as mesh_lib
from rec import mlperf
from rec.embedding import host_tier
from rec.embedding import planner
from rec.embedding.config import TableConfig
from rec.embedding.planner import TablePlacement
from rec.embedding.storage_spec import StorageSpec, make_storage
from tests.rec.test_rowwise_storage import KINDS, TABLES, _train


def test_grammar_and_errors():
  for text in ("fp32_cache:lru:0.01@host", "int8_cache:lfu:0.05:4@host", "int4_cache:lfu:0.01@host"):
    spec = StorageSpec.parse(text)
    assert spec.host and str(spec) == text and StorageSpec.parse(str(spec)) == spec
  assert str(StorageSpec("fp32").on_host(0.02)) == "fp32_cache:lfu:0.02@host"
  assert str(StorageSpec.parse("int8_cache:lru:0.1").on_host()) == "int8_cache:lru:0.1@host"
  assert StorageSpec.from_flags("fp32_cache@host", "lru", 0.1) == StorageSpec.parse(
      "fp32_cache:lru:0.1@host")
  with pytest.raises(ValueError, match=r"storage='fp32@host': tier 'host': storage 'fp32' has "
                     r"no device cache.*fp32_cache:lfu:0.05@host"):
    StorageSpec.parse("fp32@host")
  with pytest.raises(ValueError, match=r"tier 'disk': expected one of \['device', 'host'\]"):
    StorageSpec.parse("int8_cache@disk")
  st = make_storage(StorageSpec.parse("int8_cache:lfu:0.5@host"))
  assert st.host and st.host_keys == ("q", "scale", "bias")
  assert make_storage(StorageSpec.parse("fp32_cache")).host_keys == ()


def _one(name):
  return {t.name: TablePlacement("tw", (0,)) for t in TABLES}


@pytest.fixture(scope="module")
def mesh1():
  return mesh_lib.make_mesh("data:1", jax.devices()[:1])


def _same_state(a, b):
  """Every array of two collections' states equal, group by group (names differ by @host)."""
  for (_, x), (_, y) in zip(sorted(a.items()), sorted(b.items())):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(x), jax.device_get(y))


def test_put_drops_negative_ids_on_host_and_device():
  """`put` drops ids outside [0, rows), negative ones too: `.at[]` alone wraps -1 to the
  last row (a -1 "empty" tag would overwrite it)."""
  a = jnp.arange(8.0).reshape(4, 2)
  on_host = jax.device_put(a, jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind=host_tier.HOST_MEMORY))
  want = np.asarray(a).copy()
  want[1] = -1.0
  for x in (a, on_host):
    out = jax.jit(host_tier.put)(x, jnp.array([-1, 1, 4, -5], jnp.int32), -jnp.ones((4, 2)))
    assert out.sharding.memory_kind == x.sharding.memory_kind
    np.testing.assert_array_equal(jax.device_get(out), want)


@pytest.mark.slow   # ~15 s: two trainings of int8 rows with stochastic rounding
def test_small_cache_equals_the_cached_storage_bitwise(mesh1):
  """int8 rows with a 10% LFU cache of 2 ways, rows and Adagrad state in host memory: the
  same cache decisions, codes, cached values and optimizer state as without the tier; the
  rows and optimizer state stay in host memory through the jitted steps."""
  plan = _one(mesh1)
  coll, host, _ = _train(mesh1, plan, "int8_cache:lfu:0.1:2@host")
  _, dev, _ = _train(mesh1, plan, "int8_cache:lfu:0.1:2")
  (name, st), = host.items()
  kinds = {k: v.sharding.memory_kind for k, v in st["table"].items()}
  assert kinds == {"q": "pinned_host", "scale": "pinned_host", "bias": "pinned_host",
                   "cache_rows": "device", "cache_tags": "device", "counts": "device"}
  assert {v.sharding.memory_kind for v in st["opt"].values()} == {"pinned_host"}
  _same_state(host, dev)
  b = host_tier.state_bytes_by_memory(host)
  assert b["host"] > b["device"] > 0


@pytest.mark.parametrize("storage", ["fp32_cache:lru:0.02:2@host", pytest.param(
    "fp32_cache:lfu:1@host", marks=pytest.mark.slow)])
def test_fp32_rows_on_host_train_as_fp32(storage, mesh1):
  """fp32 rows behind a 2% LRU cache (or a full one) in host memory: eviction writes back
  exact values, so the tables are those of plain fp32 tables, bit for bit."""
  plan = _one(mesh1)
  ref_coll, ref, _ = _train(mesh1, plan, "fp32")
  want = ref_coll.to_tables(ref)
  coll, st, _ = _train(mesh1, plan, storage)
  assert next(iter(st.values()))["table"]["rows"].sharding.memory_kind == "pinned_host"
  got = coll.to_tables(st)
  for n in want:
    np.testing.assert_array_equal(got[n], want[n], err_msg=f"{storage} {n}")
  (name, g), = st.items()
  np.testing.assert_array_equal(jax.device_get(g["opt"]["sum_sq"]),
                                jax.device_get(next(iter(ref.values()))["opt"]["sum_sq"]))


@pytest.mark.devices(8)
def test_sharded_host_tier_equals_one_device(mesh1):
  """rw over 8 devices, each caching its own rows with its rows in host memory, against fp32
  tables on one device (the tolerance of the cache tests: rw sums partials apart)."""
  mesh8 = mesh_lib.make_mesh("data:2,model:4")
  ref_coll, ref, _ = _train(mesh1, _one(mesh1), "fp32")
  want = ref_coll.to_tables(ref)
  coll, st, _ = _train(mesh8, {t.name: KINDS["rw"](i) for i, t in enumerate(TABLES)},
                       "fp32_cache:lfu:0.2:2@host")
  (name, g), = st.items()
  assert g["table"]["rows"].sharding.memory_kind == "pinned_host"
  assert len(g["table"]["rows"].sharding.device_set) == 8
  got = coll.to_tables(st)
  for n in want:
    np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6, err_msg=n)


# -------------------------------------------------------------- checkpoints, resharding

def _memory_kinds(state):
  return jax.tree.map(lambda x: x.sharding.memory_kind, state)


def test_checkpoint_restores_host_memory_and_reshards_to_and_from_the_device(mesh1, tmp_path):
  """One table (t1) on the host tier, its rows, cache and Adagrad state holding arbitrary
  values: an orbax checkpoint (core.checkpoint) restores its rows and optimizer state into
  pinned_host, bit for bit; read on the host it reshards into an all-device fp32 plan (the
  same tables and optimizer state) and back (rows and state in host memory again), and
  into the same cached storage on the device with every row's cache residency kept (to
  reshard, the tier is no change of arrays)."""
  from core import checkpoint as ckpt_lib
  from rec.embedding import optimizers as so
  from rec.embedding import reshard
  from rec.embedding.collection import EmbeddingCollection
  from tests.rec.test_reshard import _floats, _trained_like
  opt = so.get_sparse_optimizer("adagrad", 0.1)
  on_host = StorageSpec.parse("fp32_cache:lru:0.1:2@host")
  plan = _one(mesh1)
  plan["t1"] = dataclasses.replace(plan["t1"], storage=on_host)
  coll = EmbeddingCollection(TABLES, plan, mesh1, opt)
  st = jax.device_put(_trained_like(coll), coll.state_shardings())
  kinds = _memory_kinds(st)
  host_group = next(n for n in st if n.endswith("@host_d8_w8"))
  assert kinds[host_group]["table"]["rows"] == "pinned_host"
  assert set(jax.tree.leaves(kinds[host_group]["opt"])) == {"pinned_host"}
  ck = ckpt_lib.Checkpointer(str(tmp_path))
  ck.save(2, {"emb": st}, {"layout": coll.layout().to_json()})
  back, meta = ck.restore(2, ckpt_lib.abstract_like({"emb": st}))
  assert _memory_kinds(back["emb"]) == kinds
  _same_state(back["emb"], st)

  logical = lambda c, x: {t: {k: (ch.table, ch.opt) for k, ch in chunks.items()}
                          for t, chunks in reshard.to_logical(c.layout(), jax.device_get(x)).items()}
  saved = reshard.Layout.from_json(meta["layout"])
  want = _floats(coll, jax.device_get(st))
  dev = EmbeddingCollection(TABLES, _one(mesh1), mesh1, opt)
  st_dev = dev.from_layout(saved, ck.restore(2, {}, on_host=("emb",))[0]["emb"], step=2)
  assert set(jax.tree.leaves(_memory_kinds(st_dev))) == {"device"}
  jax.tree.map(np.testing.assert_array_equal, _floats(dev, jax.device_get(st_dev)), want)
  ck.save(3, {"emb": st_dev}, {})
  st_back = coll.from_layout(dev.layout(), ck.restore(3, {}, on_host=("emb",))[0]["emb"], step=2)
  assert _memory_kinds(st_back) == kinds
  jax.tree.map(np.testing.assert_array_equal, _floats(coll, jax.device_get(st_back)), want)
  opt_of = lambda c, x: {t: {k: ch[1] for k, ch in v.items()} for t, v in logical(c, x).items()}
  jax.tree.map(np.testing.assert_array_equal, opt_of(coll, st_back), opt_of(coll, st))

  plan["t1"] = dataclasses.replace(plan["t1"], storage=dataclasses.replace(on_host,
                                                                         tier="device"))
  cached = EmbeddingCollection(TABLES, plan, mesh1, opt)
  st_c = cached.from_layout(saved, jax.device_get(st), step=2)
  assert set(jax.tree.leaves(_memory_kinds(st_c))) == {"device"}
  # per row: stored values, cache residency and values, LRU times, Adagrad state
  jax.tree.map(np.testing.assert_array_equal, logical(cached, st_c), logical(coll, st))


# ------------------------------------------------------------------------------ planner

def _tables(storage="fp32"):
  return [TableConfig("big", 100_000, 64, pooling_factor=2.0, storage=storage),
          TableConfig("hot", 100_000, 64, pooling_factor=8.0, storage=storage),
          TableConfig("small", 1000, 64, storage=storage)]


def test_planner_moves_the_biggest_coldest_tables_to_host():
  """Two equal tables (25.6 MB fp32 + 0.4 MB Adagrad each) and a 40 MB device budget: the
  less looked-up one goes to the host tier (its rows and state in host memory, a 5% cache
  on the device); the estimate splits the bytes; without the tier the plan fails."""
  tables, budget = _tables(), 40_000_000
  with pytest.raises(planner.PlanError, match=r"table 'big'.*over by"):
    planner.plan(tables, 1, budget, 1024)
  plan = planner.plan(tables, 1, budget, 1024, host_tier=planner.HostTier(10**9))
  assert str(plan["big"].storage) == "fp32_cache:lfu:0.05@host"
  assert plan["hot"].storage is None and plan["small"].storage is None
  est = planner.estimate_plan(plan, tables, 1, 1024)
  assert est.max_memory_bytes <= budget
  rows = 100_000 * (64 * 4 + 4)                     # fp32 rows + row-wise Adagrad, on host
  assert int(est.per_table["big"].host_bytes[0]) == rows
  assert int(est.per_device.host_bytes[0]) == rows
  dev, host = planner.block_bytes_split(plan["big"].storage, 100_000, 64)
  assert host == 100_000 * 64 * 4 and 0 < dev < 0.07 * host    # cache + tags + LFU counts
  text = planner.format_plan(plan, tables, 1, 1024, budget, host_budget_bytes=10**9)
  assert "host tier: 1 tables" in text and "fp32_cache:lfu:0.05@host  host" in text
  # The plan fits on the device: no table moves.
  assert all(p.storage is None for p in planner.plan(
      tables, 1, 10**9, 1024, host_tier=planner.HostTier(10**9)).values())


def test_planner_errors_name_the_table_and_bytes():
  tables = _tables()
  with pytest.raises(planner.PlanError) as e:    # host memory too small
    planner.plan(tables, 1, 40_000_000, 1024, host_tier=planner.HostTier(10_000_000, source="x"))
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith("table 'big' (100,000 x 64 fp32_cache:lfu:0.05@host) needs 26.00 MB "
                        "(26,000,000 bytes) of host memory on device 0 even with the host tier")
  assert "host budget 10.00 MB (10,000,000 bytes, x) per device: over by 16.00 MB" in msg
  with pytest.raises(planner.PlanError) as e:    # the device cannot hold even the caches
    planner.plan(tables, 1, 100_000, 1024, host_tier=planner.HostTier(10**9))
  msg = str(e.value)
  assert "\n" not in msg and "with 3 tables on the host tier (big, hot, small)" in msg
  assert "budget 100.00 KB (100,000 bytes)" in msg


def test_collection_takes_the_planned_storage(mesh1):
  """A placement's storage (the planner's host tier) is the storage the collection builds."""
  plan = {t.name: TablePlacement("tw", (0,)) for t in TABLES}
  plan["t1"] = dataclasses.replace(plan["t1"], storage=StorageSpec.parse("fp32_cache@host"))
  from rec.embedding import optimizers as so
  from rec.embedding.collection import EmbeddingCollection
  coll = EmbeddingCollection(TABLES, plan, mesh1, so.get_sparse_optimizer("sgd", 0.1))
  assert {str(g.storage) for g in coll.groups.values()} == {"fp32", "fp32_cache:lfu:0.05@host"}


def test_mlperf_fp32_plans_onto_one_h100_through_the_host_tier():
  """What `bench_dlrm --preset=mlperf --show_plan --plan_storage=fp32` prints for one
  device: fp32 tables with row-wise Adagrad (~105 GB) do not fit 70 GiB; two 40M-row tables
  go to host memory."""
  plan, tables, opt = mlperf.full_size_plan(1, 70.0, storage=StorageSpec("fp32"),
                                            host_tier=planner.HostTier(256 * 2**30))
  est = planner.estimate_plan(plan, tables, 1, mlperf.GLOBAL_BATCH, None,
                              opt.state_bytes_per_row)
  on_host = sorted(n for n, p in plan.items() if p.storage is not None)
  assert len(on_host) == 2 and all(t.num_rows == 40_000_000 for t in tables
                                   if t.name in on_host)
  assert est.max_memory_bytes <= 70 * 2**30
  assert est.max_host_bytes == 2 * 40_000_000 * (128 * 4 + 4)
  assert 104e9 < est.max_memory_bytes + est.max_host_bytes - 2 * 1.19e9 < 106e9
