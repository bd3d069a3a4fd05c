"""experiments.mp_embedding and its study (experiments/mp_embedding/study.py) at toy sizes;
the --storage / --cache_* options of train_rec (rec/configs.py, storage_spec.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments.mp_embedding import study as mp_embedding
from rec import configs
from rec.embedding.storage_spec import StorageSpec
from tests.experiments.entry import DATA
from tests.experiments.entry import run_entry as _run


def test_config_storage_names_and_errors():
  cfg = configs.make_run(storage="int8_cache", cache_policy="lru", cache_fraction=0.05)
  cfg.validate()
  assert str(cfg.embedding.storage) == "int8_cache:lru:0.05"
  assert str(configs.make_run(storage="bf16_sr").embedding.storage) == "bf16_sr"
  for kw, msg in [({"storage": "int3"}, "--storage='int3'"),
                  ({"cache_fraction": 0.0}, "--cache_fraction=0.0"),
                  ({"cache_policy": "mru"}, "--cache_policy='mru'")]:
    with pytest.raises(ValueError, match=msg):
      configs.make_run(**kw).validate()
  spec, = mp_embedding.parse_formats(["int4_cache:lfu:0.01"])
  assert spec == StorageSpec("int4_cache", "lfu", 0.01)
  with_spec = mp_embedding.with_storage(configs.make_run(), spec).flat_settings()
  assert (with_spec["storage"], with_spec["cache_policy"], with_spec["cache_fraction"]) == (
      "int4_cache", "lfu", 0.01)
  # "int8_cache:lfu" takes the default fraction; an entry the grammar refuses names itself.
  assert str(mp_embedding.parse_formats(["int8_cache:lfu"])[0]) == "int8_cache:lfu:0.05"
  for bad in ("int8:lfu:0.1", "int8_cache:lfu:0", "fp64"):
    with pytest.raises(ValueError, match=f"--formats entry='{bad}'"):
      mp_embedding.parse_formats([bad])
  # Cache ways are part of the spec a run config holds.
  four, = mp_embedding.parse_formats(["int8_cache:lfu:0.1:4"])
  assert mp_embedding.with_storage(configs.make_run(), four).embedding.storage.cache_ways == 4


def test_memory_is_counted_from_the_arrays():
  """One device, 26 tables of 200 rows in one group buffer of 5200 rows at dim 16: int8
  codes, fp32 scale and bias, a 10% LRU cache rounded up to whole 16-way sets (33 sets,
  528 slots), its tags and times."""
  import jax
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=200, batch_size=64,
                             eval_batch_size=64, eval_batches=1, storage="int8_cache",
                             cache_policy="lru", cache_fraction=0.1, sharding="tw")
  task, *_ = configs.build_run(cfg, devices=jax.devices()[:1])
  emb = task.collection.init(jax.random.key(0))
  m = mp_embedding.memory_breakdown(task.collection, emb)
  r, c = 26 * 200, 33 * 16
  assert m["components"] == {"values": r * 16, "scales_biases": r * 8, "cache": c * 64,
                             "tags": c * 4, "counters": c * 4}
  assert m["fp32_bytes"] == r * 64 and m["optimizer_bytes"] == r * 4
  assert m["reduction"] == pytest.approx(r * 64 / (r * 24 + c * 72))
  # Rows 0 .. 527 of the buffer (tables C1 .. C3) start in the cache.
  cached = mp_embedding.cached_rows(task.collection, emb)
  assert cached["C1"].all() and cached["C3"][:128].all() and not cached["C3"][128:].any()
  assert not cached["C26"].any()


def test_memory_by_dim():
  rows = {(r["format"], r["dim"]): r for r in mp_embedding.memory_by_dim(
      mp_embedding.parse_formats(["fp32", "int8_cache:lfu:0.05", "int4_cache:lru:0.01"]),
      dims=(16, 64), num_rows=3200)}
  assert rows[("fp32", 64)]["reduction"] == 1.0
  # int8 + 5% LFU at D=64: 64 + 8 + 0.05 * (256 + 4) + 4 bytes per row (10 sets x 16 ways).
  assert rows[("int8_cache:lfu:0.05", 64)]["bytes_per_row"] == pytest.approx(89.0)
  assert rows[("int4_cache:lru:0.01", 16)]["bytes_per_row"] == pytest.approx(8 + 4 + 0.01 * 72)



def test_tables_print_memory_in_the_unit_they_name():
  """26 fp32 tables of 100,000 rows at D = 16 hold 166,400,000 bytes: the docstring's 158.69,
  which is MiB (2^20 bytes); the headers say so (158.69 MB would be 1e6-byte units)."""
  from rec.embedding import storage as storage_lib
  fp32 = 26 * 100_000 * 16 * 4
  comp = dict.fromkeys(storage_lib.COMPONENTS, 0) | {"values": fp32}
  row = {"format": "fp32", "runs": [{}], "auc_mean": 0.7, "logloss_mean": 0.5,
         "auc_delta_mean": 0.0, "logloss_delta_mean": 0.0, "cache_hit_rate_mean": None,
         "memory_vs_reference": 1.0,
         "memory": {"components": comp, "table_bytes": fp32, "optimizer_bytes": 0}}
  for text in (mp_embedding.format_table({"rows": [row]}),
               mp_embedding.format_memory({"rows": [row]})):
    head, line = text.splitlines()
    assert " 158.69 " in line
    assert "MB" not in head
  assert "table MiB" in mp_embedding.format_table({"rows": [row]}).splitlines()[0]


def test_a_seed_or_format_given_twice_is_refused_before_training(tmp_path):
  """--seeds=0,0 would train seed 0 twice and report a std over two identical runs as if
  over two seeds (0 here, whatever the seed-to-seed spread is)."""
  base = configs.make_run(preset="small", num_rows=300, batch_size=64)
  fmt = mp_embedding.parse_formats(["fp32", "int8"])
  with pytest.raises(ValueError, match=r"^--seeds=0,1,0: \[0\] given more than once"):
    mp_embedding.compare_formats(base, fmt, seeds=[0, 1, 0], steps=1, workdir=str(tmp_path))
  with pytest.raises(ValueError, match=r"^--formats=fp32,int8,int8: \['int8'\] given more"):
    mp_embedding.compare_formats(base, fmt + fmt[1:], seeds=[0], steps=1,
                                 workdir=str(tmp_path))
  assert not os.listdir(tmp_path)

def test_entry_point_toy(tmp_path):
  stdout, out = _run("experiments.mp_embedding", [
      "--preset=small", "--num_rows=300", "--steps=3", "--batch_size=64",
      "--eval_batch_size=128", "--eval_batches=1", "--memory_dims=16,32",
      "--formats=fp32,int8_cache:lru:0.1", f"--workdir={tmp_path}"])
  assert set(out["rows"]) == {"fp32", "int8_cache:lru:0.1"}
  assert out["rows"]["fp32"]["memory_x"] == 1.0 and out["rows"]["fp32"]["hit_rate"] is None
  assert 1.5 < out["rows"]["int8_cache:lru:0.1"]["memory_x"] < 2.5
  assert 0 < out["rows"]["int8_cache:lru:0.1"]["hit_rate"] <= 1
  assert all(0 < r["auc"] < 1 for r in out["rows"].values())
  assert "bytes per row and reduction" in stdout
  res = json.loads((tmp_path / "results.json").read_text())
  assert len(res["memory_by_dim"]) == 4 and (tmp_path / "mp_embedding.png").exists()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "criteo_kaggle_sample")),
                    reason="Criteo sample not found (set REC_DATA_DIR)")
def test_entry_point_criteo_and_train_rec_flags(tmp_path):
  data = f"--data=criteo:{os.path.join(DATA, 'criteo_kaggle_sample')}"
  _, out = _run("experiments.mp_embedding", [
      data, "--steps=2", "--batch_size=128", "--eval_batch_size=512", "--num_rows=1000",
      "--formats=fp32,int8_cache:lfu:0.05", f"--workdir={tmp_path / 'mp'}"])
  assert out["rows"]["int8_cache:lfu:0.05"]["memory_x"] > 1.5
  _, out = _run("experiments.train_rec", [
      data, "--preset=small", "--steps=2", "--batch_size=128", "--eval_batch_size=512",
      "--num_rows=1000", "--storage=int4_cache", "--cache_policy=lru", "--cache_fraction=0.02",
      f"--workdir={tmp_path / 'train'}"])
  assert np.isfinite(out["test_logloss"])
  res = json.loads((tmp_path / "train" / "results.json").read_text())
  assert {g["storage"] for g in res["embedding_groups"].values()} == {"int4_cache:lru:0.02"}
