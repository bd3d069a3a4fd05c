"""The planner's layout model (estimate.layout / estimate_plan) against the collection.

The memory side is checked here against the collection itself (its groups' buffers and the
per-device bytes of its state, no compile); the collectives against the compiled step in
tests/experiments/test_planner_check.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from core import mesh as mesh_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as pl
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import TableConfig

TP = pl.TablePlacement


def test_wire_factors_turn_result_bytes_into_ring_traffic():
  # 8 devices: an all-to-all result of 800 bytes holds 100 of the device's own.
  assert pl.wire_bytes({("all-to-all", 8): 800.0}) == pytest.approx(2 * 700)
  assert pl.wire_bytes({("all-gather", 4): 400.0}) == pytest.approx(2 * 300)
  assert pl.wire_bytes({("reduce-scatter", 4): 100.0}) == pytest.approx(2 * 300)
  assert pl.wire_bytes({("all-reduce", 2): 100.0}) == pytest.approx(2 * 100)


def test_layout_by_hand_pads_buffers_and_all_to_all_slots():
  # N=2, B=8 (b=4), one-hot bags (L=1): u = 4 + 4 + 4 bytes on the all-to-all.
  a, b = TableConfig("a", 100, 8), TableConfig("b", 50, 16)
  plan = {"a": TP("tw", (0,)), "b": TP("tw", (1,))}
  est = pl.estimate_plan(plan, [a, b], 2, 8)
  # Two buffers (dims differ), each as long on both devices as on its owner's.
  assert sorted((g.width, g.rows_per_device, g.slots) for g in est.layout) == [
      (8, 100, 1), (16, 50, 1)]
  np.testing.assert_array_equal(est.per_device.memory_bytes, [100 * 36 + 50 * 68] * 2)
  assert [int(c.memory_bytes.max()) for c in est.per_table.values()] == [3600, 3400]
  # Per buffer: N*b*S*(u + 2*4*W) received per device.
  assert est.collectives == {("all-to-all", 2): 2 * 4 * (12 + 64) + 2 * 4 * (12 + 128)}
  # The planner budgets the padded layout: 3,600 + 3,400 per device does not fit 5,000,
  # though each table alone does.
  with pytest.raises(pl.PlanError, match="budget"):
    pl.uniform_plan([a, b], "tw", 2, memory_budget_bytes=5000)
  assert pl.uniform_plan([a, b], "tw", 2, memory_budget_bytes=7000) == plan


def test_balanced_layout_equals_the_per_table_sums():
  # Every device holds the same number of shards: no padding, so the layout's traffic is
  # the per-table sums averaged over the devices.
  N, B = 8, 256
  tables = [TableConfig(f"t{i}", 1000 + 8 * i, 16, pooling_factor=2.0) for i in range(8)]
  plans = {
      "tw": {t.name: TP("tw", (i,)) for i, t in enumerate(tables)},
      "cw": {t.name: TP("cw", ((2 * i) % 8, (2 * i + 1) % 8)) for i, t in enumerate(tables)},
      "twrw": {t.name: TP("twrw", tuple(range(4 * (i % 2), 4 * (i % 2) + 4)))
               for i, t in enumerate(tables)},
      "sptt": {t.name: TP("sptt", tuple(range(4 * (i % 2), 4 * (i % 2) + 4)))
               for i, t in enumerate(tables)},
      "rw": {t.name: TP("rw", tuple(range(8))) for t in tables},
      "dp": {t.name: TP("dp", tuple(range(8))) for t in tables},
  }
  for kind, plan in plans.items():
    est = pl.estimate_plan(plan, tables, N, B)
    sums = sum(c.comm_bytes for c in est.per_table.values())
    np.testing.assert_allclose(est.per_device.comm_bytes, sums.mean(), rtol=1e-12,
                               err_msg=kind)


def test_int_formats_give_every_column_chunk_its_own_scale_and_bias():
  t = TableConfig("q", 1000, 64, storage="int8")
  assert pl.row_bytes(t, 64) == 64 + 8 and pl.row_bytes(t, 16) == 16 + 8
  four = pl.placement_cost(t, TP("cw", (0, 1, 2, 3)), 4, 64, optimizer_state_bytes_per_row=0)
  np.testing.assert_array_equal(four.memory_bytes, [1000 * (16 + 8)] * 4)
  # A cache rounds up to whole sets: the block's exact bytes, not the average share.
  c = TableConfig("c", 1000, 16, storage="int8_cache:lfu:0.05")
  assert pl.block_bytes(c.storage, 1000, 16) >= 1000 * pl.row_bytes(c, 16)


@pytest.mark.devices(8)
def test_layout_memory_is_what_the_collection_holds():
  # Every kind twice or more, fp32 and bf16 buffers, uneven rows and devices: the layout's
  # groups are the collection's (rows per device, all-to-all slots) and its memory per
  # device is what the collection's state holds on each device.
  rng = np.random.default_rng(0)
  kinds = ("dp", "tw", "rw", "cw", "twrw")
  tables = [TableConfig(f"t{i}", int(rng.integers(5, 400)), 8,
                        storage=("fp32", "bf16")[i % 2]) for i in range(12)]
  plan = {}
  for i, t in enumerate(tables):
    d = int(rng.integers(0, 8))
    plan[t.name] = {"dp": TP("dp", tuple(range(8))), "rw": TP("rw", tuple(range(8))),
                    "tw": TP("tw", (d,)), "cw": TP("cw", (d, (d + 3) % 8)),
                    "twrw": TP("twrw", tuple(range(4 * (d % 2), 4 * (d % 2) + 4)))
                    }[kinds[i % 5]]
  mesh = mesh_lib.make_mesh("-1", jax.devices()[:8], rules=mesh_lib.REC_RULES)
  opt = opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.1)
  coll = EmbeddingCollection(tables, plan, mesh, opt)
  est = pl.estimate_plan(plan, tables, 8, 64, None, opt.state_bytes_per_row)
  want = {(g.comm, str(g.storage), g.width, tuple(coll.tables[f].name for f in g.features)):
          (g.rows_per_device, g.maps["feat"].shape[1] if g.comm == "a2a" else None)
          for g in coll.groups.values()}
  got = {(g.exchange, g.storage, g.width, g.tables):
         (g.rows_per_device, g.slots if g.exchange == "a2a" else None) for g in est.layout}
  assert got == want and len(got) >= 6
  held = {}
  for x in jax.tree.leaves(coll.init(jax.random.key(0))):
    for s in x.addressable_shards:
      held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
  assert sorted(held) == list(range(8))
  assert set(held.values()) == set(est.per_device.memory_bytes.tolist())
