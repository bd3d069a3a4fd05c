"""Resharding an embedding collection's state (rec/embedding/reshard.py): layout -> logical
rows -> another layout, for every sharding kind, storage kind and optimizer state, across
device counts and meshes.

What is exact: where the new plan cuts a table's columns alike (every kind but cw has one
chunk; cw with the same chunk count), rows, codes, scales, biases, optimizer state and a
cache's resident rows move bit for bit, and a round trip gives back the state bit for bit.
A cw table cut into another chunk count goes through float32 values: float rows and
per-element optimizer state stay exact, int8 codes are requantized (within half a step),
row-wise Adagrad's per-chunk accumulators are averaged (exact up to rounding where whole
chunks merge). A smaller or differently set cache writes back, as an eviction would, the
resident rows that no longer fit (values within one quantization step), the others stay.
"""

import dataclasses

import jax
import numpy as np
import pytest

from core import mesh as mesh_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding import reshard
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import TableConfig
from rec.embedding.planner import TablePlacement
from rec.embedding.storage_spec import StorageSpec

# Rows that split evenly over neither 8, 4 nor 3 devices; table i is sharded KINDS[i % 5] in
# "mixed" plans and stored STORAGES[i // 2 % 5], so every kind meets two storage kinds (a
# cache holding every row keeps every row wherever the table goes).
STORAGES = ["fp32", "bf16_sr", "int8", "int4", "int8_cache:lfu:1"]
TABLES = [TableConfig(f"t{i}", r, 8, storage=StorageSpec.parse(STORAGES[i // 2 % 5]),
                      pooling="mean" if i % 2 else "sum")
          for i, r in enumerate([37, 50, 13, 101, 5, 64, 29, 71, 19, 43])]
KINDS = ("dp", "tw", "rw", "cw", "twrw")
B, L = 16, 3


def _plan(kind: str, n: int, tables=TABLES, chunks: int = 2):
  """Every table `kind` over n devices ("mixed": table i the i-th kind), placements spread."""
  def one(i):
    k = KINDS[i % 5] if kind == "mixed" else kind
    if k in ("dp", "rw"):
      return TablePlacement(k, tuple(range(n)))
    if k == "tw":
      return TablePlacement(k, ((3 * i) % n,))
    if k == "cw":
      return TablePlacement(k, tuple((i + j) % n for j in range(min(n, chunks))))
    g = min(n, 4)
    first = (g * i) % n
    return TablePlacement(k, tuple(range(first - first % g, first - first % g + g)))
  return {t.name: one(i) for i, t in enumerate(tables)}


MESHES = {"2x4": ("data:2,model:4", 8), "8": ("data:8", 8), "4": ("data:4", 4),
          "3": ("data:3", 3), "1": ("data:1", 1)}


@pytest.fixture(scope="module")
def meshes():
  return {k: mesh_lib.make_mesh(spec, jax.devices()[:n]) for k, (spec, n) in MESHES.items()}


OPTS = {"rowwise_adagrad": opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.1),
        "adam": opt_lib.get_sparse_optimizer("adam", 0.1)}


def _trained_like(coll, seed=0):
  """A state of `coll` (host arrays) whose rows, codes, scales, optimizer state and caches
  hold arbitrary values (a cached row's fp32 value off its codes, LFU counts, LRU times),
  its padding a fresh state's."""
  templates = coll.host_templates()
  logical = reshard.to_logical(coll.layout(), templates)
  rng = np.random.default_rng(seed)
  rand = lambda v: (rng.integers(0, 256, v.shape) if v.dtype == np.uint8 else
                    rng.uniform(-1, 1, v.shape)).astype(v.dtype)
  for chunks in logical.values():
    for ch in chunks.values():
      t = ch.table
      for k in ("rows", "q", "bias"):
        if k in t:
          t[k] = rand(t[k])
      if "scale" in t:
        t["scale"] = rng.uniform(1e-3, 1e-2, t["scale"].shape).astype(t["scale"].dtype)
      for k, v in ch.opt.items():
        ch.opt[k] = rng.random(v.shape).astype(v.dtype)
      if "cached" in t:
        full = t["cached"].all()    # a cache of every row stays full
        t["cached"] = t["cached"] if full else rng.random(t["cached"].shape) < 0.6
        t["cache_rows"] = np.where(t["cached"][:, None], rand(t["cache_rows"]), 0).astype(
            np.float32)
      if "counts" in t:
        t["counts"] = rng.integers(0, 9, t["counts"].shape).astype(np.int32)
      if "last" in t:
        t["last"] = np.where(t["cached"], rng.integers(1, 9, t["last"].shape), 0).astype(np.int32)
  return reshard.from_logical(coll.layout(), logical, coll.storages(), templates, step=0)


def _floats(coll, host):
  """{table: float32 rows [rows, dim]} of a host state, from its logical chunks."""
  out = {}
  for t, chunks in reshard.to_logical(coll.layout(), host).items():
    cols = []
    for (c0, c1), ch in sorted(chunks.items()):
      cols.append(reshard._storage(ch.storage).rows_to_float(ch.table)[:, :c1 - c0])
    out[t] = np.concatenate(cols, 1)
  return out


def _same(a, b) -> bool:
  """Same tree, shapes, dtypes and bits."""
  def bits(x):
    x = np.asarray(x)
    return x.shape, x.dtype, x.tobytes()
  return (jax.tree.structure(a) == jax.tree.structure(b) and
          all(bits(x) == bits(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


# (source plan, mesh) -> (target plan, mesh): every kind leaves and reaches every device count
# with its column cut kept (cw: 2 chunks wherever there are 2 devices).
PAIRS = [
    (("mixed", "2x4"), ("mixed", "4")),
    (("mixed", "4"), ("mixed", "3")),
    (("rw", "2x4"), ("tw", "1")),
    (("twrw", "8"), ("dp", "4")),
    (("tw", "4"), ("twrw", "2x4")),
    (("cw", "2x4"), ("cw", "3")),
]


@pytest.mark.devices(8)
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("src,dst", PAIRS, ids=lambda p: f"{p[0]}@{p[1]}")
def test_round_trip_is_bitwise(src, dst, opt, meshes):
  a = EmbeddingCollection(TABLES, _plan(src[0], meshes[src[1]].size), meshes[src[1]], OPTS[opt])
  b = EmbeddingCollection(TABLES, _plan(dst[0], meshes[dst[1]].size), meshes[dst[1]], OPTS[opt])
  sa = _trained_like(a)
  sb = b.from_layout(a.layout(), sa, step=3)
  assert jax.tree.map(lambda x: x.sharding, sb) == jax.tree.map(
      lambda s: s, b.state_shardings())
  ta, tb = _floats(a, sa), _floats(b, jax.device_get(sb))
  for n in ta:   # the same values wherever the rows went
    np.testing.assert_array_equal(tb[n], ta[n], err_msg=n)
  # the logical rows (codes, scales, caches, optimizer state) equal, and back bit for bit
  la, lb = reshard.to_logical(a.layout(), sa), reshard.to_logical(b.layout(), jax.device_get(sb))
  assert _same({t: {c: dataclasses.asdict(ch) | {"width": 0} for c, ch in cs.items()}
                for t, cs in la.items()},
               {t: {c: dataclasses.asdict(ch) | {"width": 0} for c, ch in cs.items()}
                for t, cs in lb.items()})
  assert _same(jax.device_get(a.from_layout(b.layout(), jax.device_get(sb), step=3)), sa)


@pytest.mark.devices(8)
def test_one_hot_and_multi_hot_lookups_after_resharding(meshes):
  """Pooled embeddings of the resharded state: bit for bit where a bag's rows are summed on
  one device in both layouts; where row shards' partial sums regroup (rw, twrw -> one
  device) within float32 summation order."""
  opt = OPTS["adam"]
  tables = TABLES[:5]
  a = EmbeddingCollection(tables, _plan("mixed", 8, tables), meshes["2x4"], opt)
  b = EmbeddingCollection(tables, _plan("tw", 1, tables), meshes["1"], opt)
  sa = _trained_like(a, seed=1)
  sb = b.from_layout(a.layout(), sa, step=0)
  rng = np.random.default_rng(0)
  ids = np.stack([rng.integers(0, t.num_rows, (B, L)) for t in tables], 1).astype(np.int32)
  lengths = rng.integers(0, L + 1, (B, len(tables))).astype(np.int32)
  w = rng.uniform(0.5, 1.5, (B, len(tables), L)).astype(np.float32)
  ea = np.asarray(jax.jit(a.lookup)(jax.device_put(sa, a.state_shardings()),
                                    *mesh_lib.shard_batch((ids, lengths, w), a.mesh,
                                                          mesh_lib.REC_RULES)))
  eb = np.asarray(jax.jit(b.lookup)(sb, ids, lengths, w))
  for f, t in enumerate(tables):
    if KINDS[f % 5] in ("rw", "twrw"):
      np.testing.assert_allclose(eb[:, f], ea[:, f], rtol=1e-6, atol=1e-7, err_msg=t.name)
    else:
      np.testing.assert_array_equal(eb[:, f], ea[:, f], err_msg=t.name)
  one = lengths.clip(max=1)    # one id per bag: a sum of one nonzero term, any grouping
  ea1 = np.asarray(jax.jit(a.lookup)(jax.device_put(sa, a.state_shardings()),
                                     *mesh_lib.shard_batch((ids, one, w), a.mesh,
                                                           mesh_lib.REC_RULES)))
  np.testing.assert_array_equal(np.asarray(jax.jit(b.lookup)(sb, ids, one, w)), ea1)


@pytest.mark.devices(8)
def test_cw_into_another_chunk_count(meshes):
  """cw over 4 chunks -> one chunk (and back to 2): float rows and Adam state exact, int8
  rows requantized to nearest, row-wise Adagrad's accumulators the
  column-weighted mean of the chunks' (what one chunk would have summed)."""
  tables = [dataclasses.replace(t, storage=StorageSpec.parse(s))
            for t, s in zip(TABLES[:3], ["fp32", "int8", "bf16"])]
  for name in ("adam", "rowwise_adagrad"):
    a = EmbeddingCollection(tables, _plan("cw", 8, tables, chunks=4), meshes["8"], OPTS[name])
    sa = _trained_like(a, seed=2)
    la = reshard.to_logical(a.layout(), sa)
    b = EmbeddingCollection(tables, _plan("tw", 1, tables), meshes["1"], OPTS[name])
    sb = b.from_layout(a.layout(), sa, step=0)
    lb = reshard.to_logical(b.layout(), jax.device_get(sb))
    ta, tb = _floats(a, sa), _floats(b, jax.device_get(sb))
    for t in tables:
      if t.storage.kind in ("fp32", "bf16"):
        np.testing.assert_array_equal(tb[t.name], ta[t.name], err_msg=t.name)
      else:   # one scale per row now: within half a step of the new quantization
        q = lb[t.name][(0, 8)].table
        step = np.asarray(q["scale"], np.float32)[:, None]
        assert (np.abs(tb[t.name] - ta[t.name]) <= 0.5 * step + 1e-6).all(), t.name
      chunks = [la[t.name][c] for c in sorted(la[t.name])]
      new = lb[t.name][(0, 8)].opt
      if name == "adam":
        for k in ("m", "v"):
          np.testing.assert_array_equal(new[k], np.concatenate([c.opt[k] for c in chunks], 1))
      else:
        np.testing.assert_allclose(new["sum_sq"], np.mean([c.opt["sum_sq"] for c in chunks], 0),
                                   rtol=1e-6)
    # and one chunk -> 2 chunks: Adam's state cut exactly
    c = EmbeddingCollection(tables, _plan("cw", 4, tables), meshes["4"], OPTS[name])
    lc = reshard.to_logical(c.layout(), jax.device_get(c.from_layout(b.layout(),
                                                                      jax.device_get(sb), 0)))
    if name == "adam":
      for t in tables:
        np.testing.assert_array_equal(lc[t.name][(0, 4)].opt["m"], lb[t.name][(0, 8)].opt["m"][:, :4])


@pytest.mark.devices(8)
def test_partial_cache_keeps_what_fits_and_writes_back_the_rest(meshes):
  """A cache of a quarter of each block's rows, rw over 8 -> tw on one device (one block,
  other sets): resident rows that fit keep their fp32 values; the others get the codes an
  eviction writes (within one step of their value); rows never cached keep their codes;
  LFU counts carry over."""
  tables = [dataclasses.replace(t, storage=StorageSpec.parse(s))
            for t, s in zip(TABLES[:4], ["int8_cache:lfu:0.25", "int8_cache:lfu:0.25",
                                         "int4_cache:lru:0.25:2", "int4_cache:lru:0.25:2"])]
  for src, dst in ((("rw", "8"), ("tw", "1")),):
    a = EmbeddingCollection(tables, _plan(src[0], meshes[src[1]].size, tables),
                            meshes[src[1]], OPTS["adam"])
    b = EmbeddingCollection(tables, _plan(dst[0], meshes[dst[1]].size, tables),
                            meshes[dst[1]], OPTS["adam"])
    sa = _trained_like(a, seed=3)
    sb = b.from_layout(a.layout(), sa, step=7)
    la, lb = reshard.to_logical(a.layout(), sa), reshard.to_logical(b.layout(), jax.device_get(sb))
    ta, tb = _floats(a, sa), _floats(b, jax.device_get(sb))
    evicted = 0
    for t in tables:
      x, y = la[t.name][(0, 8)].table, lb[t.name][(0, 8)].table
      assert not (y["cached"] & ~x["cached"]).any()        # nothing new enters
      stay, out = y["cached"], x["cached"] & ~y["cached"]
      evicted += out.sum()
      np.testing.assert_array_equal(tb[t.name][stay], ta[t.name][stay])
      never = ~x["cached"]
      for k in ("q", "scale", "bias"):
        np.testing.assert_array_equal(y[k][never], x[k][never])
      step = np.asarray(y["scale"], np.float32)[out, None]
      assert (np.abs(tb[t.name][out] - ta[t.name][out]) <= step + 1e-6).all()
      key = "counts" if "counts" in x else "last"
      np.testing.assert_array_equal(y[key][stay], x[key][stay])
      if key == "counts":
        np.testing.assert_array_equal(y[key], x[key])
    assert evicted > 0     # the test saw an overflow


@pytest.mark.devices(8)
def test_sptt_towers_into_plain_kinds_and_back(meshes):
  tables = [dataclasses.replace(t, storage=StorageSpec("fp32")) for t in TABLES[:6]]
  plan = planner_lib.tower_plan(tables, [[0, 3, 5], [1, 2, 4]], 8)
  a = EmbeddingCollection(tables, plan, meshes["2x4"], OPTS["rowwise_adagrad"])
  b = EmbeddingCollection(tables, _plan("mixed", 3, tables), meshes["3"], OPTS["rowwise_adagrad"])
  sa = _trained_like(a, seed=4)
  sb = b.from_layout(a.layout(), sa, step=0)
  assert _same(jax.device_get(a.from_layout(b.layout(), jax.device_get(sb), 0)), sa)
  assert a.layout().describe() == "8 devices (data:2,model:4) sptt"


@pytest.mark.devices(8)
def test_host_templates_are_a_fresh_state(meshes):
  """The padding template made on the host from one row equals the collection's fresh
  buffers (`_empty_group`), every storage kind; its tree gives the state's shardings."""
  tables = [dataclasses.replace(t, storage=StorageSpec.parse(s)) for t, s in
            zip(TABLES[:6], STORAGES + ["int4_cache:lru:0.3:2"])]
  coll = EmbeddingCollection(tables, _plan("mixed", 4, tables), meshes["4"], OPTS["rowwise_adagrad"])
  want = {n: jax.device_get(jax.jit(lambda ex=ex: coll._empty_group(ex))())
          for n, ex in coll.exchanges.items()}
  assert _same(coll.host_templates(), want)
  assert jax.tree.structure(coll.state_shardings()) == jax.tree.structure(want)


@pytest.mark.devices(8)
def test_layout_json_describe_and_other_tables(meshes):
  a = EmbeddingCollection(TABLES, _plan("mixed", 8), meshes["8"], OPTS["adam"])
  lay = a.layout()
  assert reshard.Layout.from_json(lay.to_json()) == lay
  import json
  assert json.loads(json.dumps(lay.to_json())) == lay.to_json()   # as the metadata reads back
  assert lay.describe() == "8 devices 2 dp + 2 tw + 2 rw + 2 cw + 2 twrw"
  assert EmbeddingCollection(TABLES, _plan("tw", 1), meshes["1"],
                             OPTS["adam"]).layout().describe() == "1 device tw"
  other = [dataclasses.replace(t, num_rows=t.num_rows + 1) if t.name == "t3" else t
           for t in TABLES]
  b = EmbeddingCollection(other, _plan("tw", 4, other), meshes["4"], OPTS["adam"])
  with pytest.raises(reshard.LayoutMismatchError) as e:
    b.from_layout(lay, a.host_templates(), 0, where="checkpoint c/4")
  assert str(e.value) == (
      "checkpoint c/4: table t3 is [101, 8] (rows, dim) there and [102, 8] in the model built "
      "now; expected the same table sizes (--num_rows, the data's vocabulary) and embedding dim")
