"""Tests for the embedding sharding planner: cost model by hand, placements, budget, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rec.embedding import planner as pl
from rec.embedding.config import ShardingKind, TableConfig

DP, TW, RW, CW, TWRW = pl.DP, pl.TW, pl.RW, pl.CW, pl.TWRW

# Criteo Kaggle's 26 categorical cardinalities, scaled by 1/100 to keep numbers small.
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
               3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
               142572]


def criteo_tables(dim=16):
  return [TableConfig(f"C{i + 1}", max(1, r // 100), dim) for i, r in enumerate(CRITEO_ROWS)]


def kinds_of(plan):
  return {n: p.kind for n, p in plan.items()}


# ----------------------------------------------------------------------------- helpers


def test_row_shards_and_column_chunks():
  assert pl.row_shard_sizes(10, 4) == (3, 3, 3, 1)
  assert pl.row_shard_sizes(9, 4) == (3, 3, 3, 0)
  assert pl.row_shard_sizes(3, 8) == (1, 1, 1, 0, 0, 0, 0, 0)
  assert pl.column_chunk_widths(64, 8) == (8,) * 8
  assert pl.column_chunk_widths(10, 4) == (3, 3, 3, 1)
  with pytest.raises(ValueError, match="gives 3 chunks, not 4"):
    pl.column_chunk_widths(9, 4)
  assert pl.default_group_size(8) == 4
  assert pl.default_group_size(6) == 3
  assert pl.default_group_size(2) == 2
  assert pl.default_group_size(1) == 1


def test_storage_and_optimizer_bytes_match_the_embedding_modules():
  from rec.embedding import optimizers, storage_spec
  for name, s in pl.STORAGE_BYTES.items():
    spec = storage_spec.StorageSpec.parse(name)
    assert storage_spec.make_storage(spec).bytes_per_row(10) == 10 * s
  t = TableConfig("t", 100, 8)
  assert pl.table_bytes(t) == 100 * (8 * 4 + 4)
  rowwise = optimizers.RowWiseAdagrad(learning_rate=0.1).state_bytes_per_row
  full = optimizers.Adagrad(learning_rate=0.1).state_bytes_per_row
  assert pl.table_bytes(t, rowwise) == 100 * (8 * 4 + 4)
  assert pl.table_bytes(t, full) == 100 * (8 * 4 + 8 * 4)
  assert pl.table_bytes(TableConfig("h", 100, 8, storage="bf16")) == 100 * (8 * 2 + 4)


# ----------------------------------------------------------------------------- cost model


def _cost(kind, devices, table=None, N=4, B=16, **kw):
  table = table or TableConfig("t", 100, 8, pooling_factor=2.0)
  kw.setdefault("cost_params", pl.CostParams(min_access_bytes=0))   # hand numbers: bytes as is
  return pl.placement_cost(table, pl.TablePlacement(kind, devices), N, B, **kw)


def test_min_access_bytes_charges_narrow_rows():
  # 32-byte rows (dim 8, fp32) cost a 64-byte transaction each: twice the elements.
  full = _cost(TW, (1,), cost_params=pl.CostParams(min_access_bytes=0))
  rounded = _cost(TW, (1,), cost_params=pl.CostParams(min_access_bytes=64))
  np.testing.assert_allclose(rounded.lookup_elems, 2 * full.lookup_elems)
  # Four chunks of 2 columns cost 4 transactions per id where tw costs one.
  cw = _cost(CW, (0, 1, 2, 3), cost_params=pl.CostParams(min_access_bytes=64))
  assert cw.lookup_elems.sum() == pytest.approx(4 * rounded.lookup_elems.sum())


def test_cost_model_by_hand():
  # N=4, B=16 (b=4), P=2 (L=2 slots), R=100, D=8, fp32, 4 B/row state; a bag on the
  # all-to-all u = 2*(4 + 4) + 4 (ids, weights, length), on rw's all-gather 2*4 + 4;
  # X(w) = u + 2*4*w.
  X8, X4 = 84, 52
  hbm, ici = 1e12, 1e11

  c = _cost(TW, (1,))
  np.testing.assert_array_equal(c.memory_bytes, [0, 3600, 0, 0])
  np.testing.assert_allclose(c.comm_bytes, [4 * X8, 3 * 4 * X8, 4 * X8, 4 * X8])
  np.testing.assert_allclose(c.lookup_elems, [0, 256 + 256, 0, 0])   # fwd 16*2*8, bwd same
  np.testing.assert_allclose(c.time_s[1], 4 * (256 + 2 * 256) / hbm + 3 * 4 * X8 / ici)

  c = _cost(CW, (2, 0))   # two chunks of 4 columns
  np.testing.assert_array_equal(c.memory_bytes, [2000, 0, 2000, 0])
  np.testing.assert_allclose(c.comm_bytes, [3 * 4 * X4 + 4 * X4, 2 * 4 * X4] * 2)
  np.testing.assert_allclose(c.lookup_elems, [256, 0, 256, 0])

  c = _cost(RW, (0, 1, 2, 3))   # 25 rows each
  np.testing.assert_array_equal(c.memory_bytes, [900] * 4)
  np.testing.assert_allclose(c.comm_bytes, [2 * 3 * 4 * 12 + 4 * 3 / 4 * 16 * 4 * 8] * 4)
  np.testing.assert_allclose(c.lookup_elems, [64 + 64] * 4)

  c = _cost(TWRW, (2, 3))   # 50 rows each
  np.testing.assert_array_equal(c.memory_bytes, [0, 0, 1800, 1800])
  np.testing.assert_allclose(c.comm_bytes, [2 * 4 * X8] * 2 + [4 * 4 * X8] * 2)
  np.testing.assert_allclose(c.lookup_elems, [0, 0, 256, 256])

  c = _cost(DP, (0, 1, 2, 3))   # U = b*L = 8 id slots all-gathered (id, valid, gradient)
  np.testing.assert_array_equal(c.memory_bytes, [3600] * 4)
  np.testing.assert_allclose(c.comm_bytes, [2 * 3 * 8 * (4 * 8 + 4 + 1)] * 4)
  np.testing.assert_allclose(c.lookup_elems, [4 * 2 * 8 + 32 * 8] * 4)
  np.testing.assert_allclose(c.time_s, 4 * (64 + 2 * 256) / hbm + 1776 / ici)

  # A 5-row table: every id slot is sent (dp.py); deduplicated rows would cap U at 5.
  tiny = TableConfig("tiny", 5, 8, pooling_factor=2.0)
  c = _cost(DP, (0, 1, 2, 3), tiny)
  np.testing.assert_allclose(c.comm_bytes, 2 * 3 * 8 * 37)
  c = _cost(DP, (0, 1, 2, 3), tiny,
            cost_params=pl.CostParams(min_access_bytes=0, dp_unique_rows=True))
  np.testing.assert_allclose(c.comm_bytes, 2 * 3 * 5 * 37)

  # Storage dtype and a per-element optimizer state change memory only as R*(w*s + o(w)).
  bf = TableConfig("bf", 100, 8, storage="bf16")
  c = _cost(CW, (0, 1), bf, optimizer_state_bytes_per_row=lambda w: 4 * w)
  np.testing.assert_array_equal(c.memory_bytes, [100 * (4 * 2 + 16)] * 2 + [0, 0])
  c = _cost(DP, (0,), table=TableConfig("x", 3, 8), N=1)
  np.testing.assert_allclose(c.comm_bytes[0], 0.0)


def test_a_narrow_last_column_chunk_costs_its_stored_width():
  # dim 10 in 3 chunks: 4, 4 and 2 columns, each stored 4 wide (cw.py), so every owner holds
  # R * 4 * 4 bytes, what estimate_plan's layout says. A per-table cost charging the last
  # chunk 2 columns would let three such tables "fit" 45,000 bytes per device (believed
  # 40,000) while the collection holds 48,000 on every device.
  ts = [TableConfig(f"t{i}", 1000, 10) for i in range(3)]
  c = pl.placement_cost(ts[0], pl.TablePlacement(CW, (0, 1, 2)), 3, 64, None, 0)
  np.testing.assert_array_equal(c.memory_bytes, [16000] * 3)
  with pytest.raises(pl.PlanError, match="over by"):
    pl.uniform_plan(ts, "cw", 3, memory_budget_bytes=45000, cw_min_width=1,
                    optimizer_state_bytes_per_row=0)
  plan = pl.uniform_plan(ts, "cw", 3, memory_budget_bytes=48000, cw_min_width=1,
                         optimizer_state_bytes_per_row=0)
  est = pl.estimate_plan(plan, ts, 3, 64, None, 0)
  np.testing.assert_array_equal(est.per_device.memory_bytes, [48000] * 3)
  np.testing.assert_array_equal(sum(c.memory_bytes for c in est.per_table.values()),
                                est.per_device.memory_bytes)


def test_the_budget_holds_the_cache_rounded_to_whole_sets():
  # rw over 8 devices: 332 rows per device, a 5% cache of 17 rows rounded up to 2 sets of
  # 16 ways (32 rows): the collection holds 50,112 bytes per device (estimate_plan's layout,
  # the state's shapes), not the 43,890 of 5% of a row each. A greedy budgeting the latter
  # would return plans over the budget.
  t = TableConfig("t", 2656, 100, storage="int8_cache:lfu:0.05")
  plan = pl.plan([t], 8, 50112, 256, kinds=["rw"], optimizer_state_bytes_per_row=0)
  est = pl.estimate_plan(plan, [t], 8, 256, None, 0)
  assert est.max_memory_bytes == 50112
  assert int(est.per_table["t"].memory_bytes.max()) == 43890
  with pytest.raises(pl.PlanError, match="over by"):
    pl.plan([t], 8, 50111, 256, kinds=["rw"], optimizer_state_bytes_per_row=0)
  # The per-row form the planner prices buffers with is the traced state's, byte for byte.
  from rec.embedding.planner import estimate
  from rec.embedding.storage_spec import StorageSpec
  for spec in ("int8_cache:lfu:0.05", "int4_cache:lru:0.3:4", "fp32_cache:lfu:0.1@host"):
    spec = StorageSpec.parse(spec)
    for rows in (1, 17, 332, 4097):
      assert pl.block_bytes_split(spec, rows, 8) == estimate._shape_bytes(spec, rows, 8)


@pytest.mark.parametrize("kind,devices", [(TW, (3,)), (CW, (5, 1, 2)), (TWRW, (4, 5, 6, 7))])
def test_all_to_all_bytes_are_conserved(kind, devices):
  # Every byte sent is received once: sum over devices of (sent + received) = 2 * moved,
  # and each shard moves b*X(w) with each of the other N-1 devices.
  N, B, P, D = 8, 64, 3.0, 12
  t = TableConfig("t", 1000, D, pooling_factor=P)
  c = pl.placement_cost(t, pl.TablePlacement(kind, devices), N, B)
  widths = pl.column_chunk_widths(D, len(devices)) if kind == CW else (D,) * len(devices)
  moved = sum((N - 1) * (B / N) * (3 * (4 + 4) + 4 + 2 * 4 * w) for w in widths)
  np.testing.assert_allclose(c.comm_bytes.sum(), 2 * moved)


# ----------------------------------------------------------------------------- uniform


def test_uniform_tw_round_robin_for_equal_tables():
  tables = [TableConfig(f"T{i}", 1000, 16) for i in range(26)]
  p = pl.uniform_plan(tables, "tw", 8)
  assert list(p) == [t.name for t in tables]
  assert [p[f"T{i}"].devices for i in range(26)] == [(i % 8,) for i in range(26)]
  counts = np.bincount([p[t.name].devices[0] for t in tables], minlength=8)
  assert counts.tolist() == [4, 4, 3, 3, 3, 3, 3, 3]


def test_uniform_tw_matches_least_loaded_reference():
  rng = np.random.default_rng(0)
  tables = [TableConfig(f"T{i}", int(rng.integers(10, 5000)), int(rng.choice([8, 16, 32, 64])),
                        pooling_factor=float(rng.integers(1, 5))) for i in range(20)]
  N = 5
  got = pl.uniform_plan(tables, TW, N)
  # Reference: biggest table first (bytes), each to the device with the smallest time
  # (ties within a relative 1e-9 to the lowest index, as the planner breaks them).
  load = np.zeros(N)
  want = {}
  order = sorted(range(len(tables)), key=lambda i: (-pl.table_bytes(tables[i]), i))
  for i in order:
    t = tables[i]
    d = min(range(N), key=lambda k: (round(load[k] / max(load.max(), 1e-300) * 1e9), k))
    want[t.name] = (d,)
    load += pl.placement_cost(t, pl.TablePlacement(TW, (d,)), N, 1024).time_s
  assert {n: p.devices for n, p in got.items()} == want
  assert all(p.kind == TW for p in got.values())


def test_uniform_cw_twrw_rw_dp_placements():
  N = 8
  p = pl.uniform_plan([TableConfig("a", 100, 64)], CW, N)
  assert p["a"].kind == CW and sorted(p["a"].devices) == list(range(8))   # 8 chunks of 8
  # dim 16 with chunks >= 4 wide: 4 chunks, the second table on the 4 other devices.
  p = pl.uniform_plan([TableConfig("a", 100, 16), TableConfig("b", 100, 16)], CW, N)
  assert p["a"].devices == (0, 1, 2, 3) and p["b"].devices == (4, 5, 6, 7)
  p = pl.uniform_plan([TableConfig("odd", 100, 9)], CW, N)   # min(8, 9 // 4) = 2 chunks
  assert len(p["odd"].devices) == 2
  p = pl.uniform_plan([TableConfig("narrow", 100, 3)], CW, N)   # narrower than a chunk
  assert len(p["narrow"].devices) == 1

  tables = [TableConfig(f"T{i}", 1000, 16) for i in range(3)]
  p = pl.uniform_plan(tables, TWRW, N)   # default group of 4: two groups
  assert [p[f"T{i}"].devices for i in range(3)] == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3)]
  p = pl.uniform_plan(tables, "twrw", N, group_size=2)
  assert [p[f"T{i}"].devices for i in range(3)] == [(0, 1), (2, 3), (4, 5)]
  for kind in (RW, DP):
    p = pl.uniform_plan(tables, kind, N)
    assert all(q.kind == kind and q.devices == tuple(range(8)) for q in p.values())
  with pytest.raises(ValueError, match="group_size=3"):
    pl.uniform_plan(tables, TWRW, N, group_size=3)
  with pytest.raises(ValueError, match="unknown sharding kind 'xw'"):
    pl.uniform_plan(tables, "xw", N)
  for kind in ShardingKind:
    pl.validate_plan(pl.uniform_plan(criteo_tables(), kind, N), criteo_tables(), N)


# ----------------------------------------------------------------------------- plan


def test_plan_huge_table_goes_row_wise_and_tiny_tables_replicate():
  N, budget = 8, 30_000
  # 8000 x 4 fp32 + 4 B/row = 160,000 bytes: rw (20,000 per device) fits; twrw over 4
  # devices (40,000) and tw do not, and dim 4 is too narrow to split into column chunks.
  tables = [TableConfig("huge", 8000, 4)] + [TableConfig(f"tiny{i}", 4, 4) for i in range(10)]
  # A dp exchange that all-gathers deduplicated rows moves 4 rows per tiny table: replicate.
  dedup = pl.CostParams(dp_unique_rows=True)
  p = pl.plan(tables, N, budget, batch_size=1024, cost_params=dedup)
  assert p["huge"] == pl.TablePlacement(RW, tuple(range(8)))
  assert all(p[f"tiny{i}"].kind == DP for i in range(10))
  est = pl.estimate_plan(p, tables, N, 1024, dedup)
  assert est.max_memory_bytes <= budget
  np.testing.assert_array_equal(est.per_device.memory_bytes, 20_000 + 10 * 4 * 20)
  # dp.py all-gathers every id slot's gradient (b = 128 per table and device): more than
  # sending the bags to one owner, so the tiny tables go table-wise.
  p = pl.plan(tables, N, budget, batch_size=1024)
  assert p["huge"] == pl.TablePlacement(RW, tuple(range(8)))
  assert all(p[f"tiny{i}"].kind == TW for i in range(10))
  assert pl.estimate_plan(p, tables, N, 1024).max_memory_bytes <= budget


def test_plan_respects_budget_and_beats_uniform_plans():
  tables, N, B = criteo_tables(), 8, 8192
  total = sum(pl.table_bytes(t) for t in tables)
  def uniform_times(budget):
    out = []
    for k in ShardingKind:
      try:
        u = pl.uniform_plan(tables, k, N, memory_budget_bytes=budget)
      except pl.PlanError:
        continue
      out.append(pl.estimate_plan(u, tables, N, B).max_time_s)
    return out

  for budget in (total, total // 4, int(total / 8 * 1.05)):
    p = pl.plan(tables, N, budget, B)
    pl.validate_plan(p, tables, N)
    est = pl.estimate_plan(p, tables, N, B)
    assert est.max_memory_bytes <= budget, budget
    # Under a tight budget the mixed plan beats every uniform plan that fits; with room
    # for all, one kind for every table (tw) is as good as the greedy's mix gets.
    if budget < total:
      assert est.max_time_s < min(uniform_times(budget)), budget
    else:
      assert est.max_time_s <= min(uniform_times(budget)), budget
  # A 1-row table: replicating it costs nothing when dp all-gathers deduplicated rows; dp.py
  # all-gathers every id slot, which costs more than sending the bags to their owners.
  c9 = [t for t in tables if t.name == "C9"]
  dedup = pl.CostParams(dp_unique_rows=True)
  assert pl.plan(c9, N, total, B, cost_params=dedup)["C9"].kind == DP
  assert pl.plan(c9, N, total, B)["C9"].kind != DP


def test_plan_memory_fallback_packs_what_time_first_cannot():
  # Time first puts the big tables column-wise (8 copies of the row-wise state); a budget
  # just above the all-row-wise footprint needs the least-memory fallback.
  tables, N, B = criteo_tables(), 8, 8192
  rw_need = pl.estimate_plan(pl.uniform_plan(tables, RW, N), tables, N, B).max_memory_bytes
  budget = int(rw_need * 1.02)
  p = pl.plan(tables, N, budget, B)
  assert pl.estimate_plan(p, tables, N, B).max_memory_bytes <= budget
  with pytest.raises(pl.PlanError, match=r"under rw on 8 devices.*over by"):
    pl.plan(tables, N, int(rw_need * 0.9), B)


def test_plan_overrides_are_honoured():
  tables, N, B = criteo_tables(), 8, 8192
  total = sum(pl.table_bytes(t) for t in tables)
  ov = {"C1": "tw", "C3": ShardingKind.ROW_WISE, "C4": "twrw", "C9": "cw", "C12": "dp"}
  p = pl.plan(tables, N, total, B, overrides=ov, group_size=2)
  for name, kind in ov.items():
    assert p[name].kind == pl.as_kind(kind), name
  assert len(p["C4"].devices) == 2
  assert len(p["C9"].devices) in (2, 4)   # dim 16: chunks >= 4 wide, k in {2, 4}
  pl.validate_plan(p, tables, N, group_size=2)
  # Still checked against the budget: forcing the biggest table table-wise overflows.
  big = max(tables, key=pl.table_bytes)
  with pytest.raises(pl.PlanError, match=f"table '{big.name}'.*under tw.*forced by override"):
    pl.plan(tables, N, pl.table_bytes(big) - 1, B, overrides={big.name: "tw"})
  with pytest.raises(ValueError, match=r"unknown tables \['C99'\]; known tables: \['C1', 'C2'"):
    pl.plan(tables, N, total, B, overrides={"C99": "tw"})
  p = pl.plan(tables, N, total, B, kinds=("tw", "rw"))
  assert {q.kind for q in p.values()} <= {TW, RW}
  # Tables up to replicate_below_bytes replicate; the rest are searched as before.
  small = {t.name for t in tables if pl.table_bytes(t) <= 100_000}
  p = pl.plan(tables, N, total, B, kinds=("tw", "rw"), replicate_below_bytes=100_000)
  assert small and {n for n, q in p.items() if q.kind == DP} == small


def test_plan_error_names_table_bytes_and_overage():
  # N=2: rw needs 50 rows * 36 = 1,800 bytes per device (cw 2,000; dp and tw 3,600).
  tables = [TableConfig("T0", 100, 8)]
  with pytest.raises(pl.PlanError) as e:
    pl.plan(tables, 2, 1000, batch_size=64)
  msg = str(e.value)
  for part in ("table 'T0'", "100 x 8 fp32 + 4 B/row", "1.80 KB (1,800 bytes)", "under rw",
               "on 2 devices", "budget 1.00 KB (1,000 bytes)", "over by 800 B (800 bytes)"):
    assert part in msg, (part, msg)
  assert isinstance(e.value, ValueError)
  # A second table that no longer fits after the first: the used bytes are reported.
  tables = [TableConfig("A", 100, 8), TableConfig("B", 60, 8)]   # 3,600 and 2,160 bytes
  with pytest.raises(pl.PlanError) as e:
    pl.plan(tables, 2, 2500, batch_size=64)
  msg = str(e.value)
  assert "table 'B'" in msg and "1.08 KB (1,080 bytes)" in msg, msg   # rw: 30 rows * 36
  assert "1.80 KB already used" in msg and "over by 380 B (380 bytes)" in msg, msg
  with pytest.raises(pl.PlanError, match=r"uniform tw plan.*over by 1.10 KB \(1,100 bytes\)"):
    pl.uniform_plan(tables[:1], "tw", 2, memory_budget_bytes=2500)


def test_plan_is_deterministic():
  tables, N, B = criteo_tables(), 8, 8192
  budget = sum(pl.table_bytes(t) for t in tables) // 5
  a = pl.plan(tables, N, budget, B, overrides={"C2": "tw"})
  b = pl.plan(list(tables), N, budget, B, overrides={"C2": "tw"})
  assert a == b and list(a) == list(b) == [t.name for t in tables]
  assert pl.format_plan(a, tables, N, B, budget) == pl.format_plan(b, tables, N, B, budget)
  summary = lambda p: json.dumps(pl.plan_summary(p, tables, N, B))
  assert summary(a) == summary(b)


# ----------------------------------------------------------------------------- reporting


def test_format_plan_lists_every_table_in_aligned_columns():
  tables, N, B = criteo_tables(), 8, 8192
  budget = sum(pl.table_bytes(t) for t in tables) // 4
  p = pl.plan(tables, N, budget, B)
  text = pl.format_plan(p, tables, N, B, budget)
  lines = text.splitlines()
  header, rows = lines[0], lines[2:2 + len(tables)]
  col = header.index("kind")
  for t, line in zip(tables, rows):
    assert line.split()[0] == t.name
    assert line[col:].split()[0] == p[t.name].kind.value, line
  assert len(lines) == 2 + len(tables) + 1 + 2 + N + 1
  assert "/ " in lines[2 + len(tables) + 3] and lines[-1].startswith("26 tables on 8 devices")
  assert pl.format_plan(p, tables, N, B).count("\n") == text.count("\n")   # no budget given


def test_plan_summary_is_json():
  tables, N, B = criteo_tables(), 8, 8192
  p = pl.uniform_plan(tables, "tw", N)
  s = pl.plan_summary(p)
  assert s["kinds"] == {"tw": 26}
  assert s["tables"]["C1"] == {"kind": "tw", "devices": list(p["C1"].devices)}
  s = json.loads(json.dumps(pl.plan_summary(p, tables, N, B)))
  est = pl.estimate_plan(p, tables, N, B)
  assert s["estimate"]["max_time_s"] == pytest.approx(est.max_time_s)
  assert s["estimate"]["device_memory_bytes"] == est.per_device.memory_bytes.tolist()


def test_parse_and_validate_overrides():
  assert pl.parse_overrides("C1=tw, C3 = RW,") == {"C1": "tw", "C3": "rw"}
  assert pl.parse_overrides("") == {}
  with pytest.raises(ValueError, match="'C1' in 'C1'.*expected TABLE=KIND"):
    pl.parse_overrides("C1")
  with pytest.raises(ValueError, match="unknown sharding kind 'xx' for table 'C2'.*"
                                       "valid kinds: dp, tw, rw, cw, twrw"):
    pl.parse_overrides("C1=tw,C2=xx")
  with pytest.raises(ValueError, match="'C1' given twice"):
    pl.parse_overrides("C1=tw,C1=rw")
  tables = criteo_tables()[:3]
  pl.validate_overrides({"C1": "tw"}, tables)
  with pytest.raises(ValueError, match=r"unknown tables \['D1'\]; known tables: \['C1', 'C2'"):
    pl.validate_overrides({"D1": "tw"}, tables)
  with pytest.raises(ValueError, match="unknown sharding kind 'zz'"):
    pl.validate_overrides({"C1": "zz"}, tables)


def test_validate_plan_rejects_malformed_placements():
  tables = [TableConfig("a", 100, 9)]
  bad = [(TW, (0, 1), "exactly 1 device"), (RW, (0, 1, 2), "all 8 devices"),
         (CW, (0, 1, 2, 3), "does not split into 4"), (TWRW, (1, 2), "contiguous, aligned"),
         (TW, (8,), "outside 0..7")]
  for kind, devs, why in bad:
    with pytest.raises(ValueError, match=why):
      pl.validate_plan({"a": pl.TablePlacement(kind, devs)}, tables, 8)
  with pytest.raises(ValueError, match="without a placement"):
    pl.validate_plan({}, tables, 8)
  with pytest.raises(ValueError, match="repeated device"):
    pl.TablePlacement(CW, (1, 1))
  assert pl.TablePlacement("tw", (3,)).kind is TW


def test_packed_codes_get_column_chunks_of_whole_bytes():
  # int4 codes pack 2 columns a byte, int2 4: a dim-10 int4 table stores whole rows, but
  # 2 cw chunks of 5 columns cannot be stored. The planner leaves such chunk counts out and
  # validate_plan names them (priced anyway, its uniform-plan comparison would fail in the
  # storage: auto plan, kinds=["cw"] and uniform cw alike).
  tables = [TableConfig("big", 10**6, 10, pooling_factor=20, storage="int4"),
            TableConfig("small", 100, 10, storage="int4"),
            TableConfig("c2", 1000, 24, storage="int2")]     # 4 chunks of 6: not whole bytes
  for kinds in (None, ["cw"]):
    plan = pl.plan(tables, 8, 10**9, 1024, kinds=kinds)
    pl.estimate_plan(plan, tables, 8, 1024)                # every buffer can be laid out
    for t in tables:
      p = plan[t.name]
      w = -(-t.dim // len(p.devices)) if p.kind == CW else t.dim
      assert w % pl.width_multiple(t.storage) == 0, (t.name, p)
  assert pl.uniform_plan(tables, "cw", 8)["big"].devices == (0,)   # one chunk of 10
  with pytest.raises(ValueError, match=r"table 'big' placed cw on \(0, 1\): rows stored 5 "
                     r"wide in int4.*multiple of 2"):
    pl.validate_plan({**plan, "big": pl.TablePlacement(CW, (0, 1))}, tables, 8)
  odd = [TableConfig("odd", 100, 7, storage="int4")]         # 7 columns: no whole-byte width
  with pytest.raises(pl.PlanError, match=r"table 'odd' \(dim 7, int4\): no placement"):
    pl.plan(odd, 8, 10**9, 1024)


# ----------------------------------------------------------------------------- device budget


@pytest.fixture
def device_pool(monkeypatch):
  """Sets the memory core.memory.device_memory reports, for rec.configs' default budget
  (read once per process, so the cache is cleared around each use)."""
  from core import memory
  from rec import configs

  def use(mem):
    configs._device_budget.cache_clear()
    monkeypatch.setattr(memory, "device_memory", lambda device=None: mem)

  yield use
  configs._device_budget.cache_clear()


def test_default_budget_is_the_gpus_bytes_limit_less_headroom(device_pool):
  from core import memory
  from rec import configs
  device_pool(memory.DeviceMemory(80 << 30, 1, "NVIDIA H100 bytes_limit"))
  budget, source = configs.plan_budget(configs.make_run())
  assert budget == int((80 << 30) * (1 - memory.GPU_HEADROOM)) == 64 << 30
  assert source == "NVIDIA H100 bytes_limit less 20% headroom"
  # The flag still decides when given.
  assert configs.plan_budget(configs.make_run(memory_budget_gb=1.5)) == (
      int(1.5 * 2**30), "--memory_budget_gb")


def test_default_budget_on_the_cpu_is_available_ram_over_its_devices(device_pool):
  from core import memory
  from rec import configs
  device_pool(memory.DeviceMemory(64 << 30, 8, "available RAM shared by 8 CPU devices",
                                  host_ram=True))
  budget, source = configs.plan_budget(configs.make_run())
  assert budget == 8 << 30 and source == "available RAM shared by 8 CPU devices, per device"


def test_auto_plan_uses_the_device_budget(device_pool):
  from core import memory
  from rec import configs
  from rec.embedding import optimizers as opt_lib
  tables, N = criteo_tables(), 8
  opt = opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.1)
  total = sum(pl.table_bytes(t, opt.state_bytes_per_row) for t in tables)
  cfg = configs.make_run(sharding="auto")
  device_pool(memory.DeviceMemory(total, 1, "gpu bytes_limit"))     # 80% of all tables
  p = configs.make_plan(cfg, tables, N, opt)
  est = pl.estimate_plan(p, tables, N, cfg.train.batch_size, None, opt.state_bytes_per_row)
  assert est.max_memory_bytes <= 0.8 * total
  device_pool(memory.DeviceMemory(total // 100, 1, "gpu bytes_limit"))   # under the biggest
  with pytest.raises(pl.PlanError, match="budget"):
    configs.make_plan(cfg, tables, N, opt)
  # An explicit budget ignores the device's (still the one too small for a table).
  big = configs.make_run(sharding="auto", memory_budget_gb=0.8 * total / 2**30)
  assert configs.make_plan(big, tables, N, opt) == p


def test_no_device_size_and_no_flag_names_the_flag(device_pool):
  from rec import configs
  device_pool(None)
  with pytest.raises(ValueError, match="--memory_budget_gb: not given"):
    configs.plan_budget(configs.make_run())


def test_format_plan_names_the_budget_and_its_source():
  tables, N, B = criteo_tables(), 8, 8192
  budget = sum(pl.table_bytes(t) for t in tables) // 4
  p = pl.plan(tables, N, budget, B)
  last = pl.format_plan(p, tables, N, B, budget, budget_source="H100 bytes_limit").splitlines()[-1]
  assert last.endswith(f", budget {pl._fmt_bytes(budget)} per device (H100 bytes_limit)"), last
  assert "budget" not in pl.format_plan(p, tables, N, B).splitlines()[-1]
