"""StorageSpec (rec/embedding/storage_spec.py): one grammar, one validation, canonical text
that reads back as the same spec, the flags' form, and the registry's storages; the
collection, planner and TableConfig hold the object."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rec import configs
from rec.embedding import planner as planner_lib
from rec.embedding import rowwise_storage, storage, storage_spec
from rec.embedding.config import TableConfig
from rec.embedding.storage_spec import StorageSpec, make_storage


def test_grammar_defaults_and_canonical_text():
  cases = {
      "fp32": StorageSpec("fp32"),
      "bf16_sr": StorageSpec("bf16_sr"),
      "int4": StorageSpec("int4"),
      "int8_cache": StorageSpec("int8_cache", "lfu", 0.05, 16),
      "int4_cache": StorageSpec("int4_cache", "lfu", 0.01, 16),
      "int2_cache:lru": StorageSpec("int2_cache", "lru", 0.01, 16),
      "int8_cache:lru:0.1": StorageSpec("int8_cache", "lru", 0.1, 16),
      "int8_cache:lfu:1:4": StorageSpec("int8_cache", "lfu", 1.0, 4),
  }
  canonical = {"int8_cache": "int8_cache:lfu:0.05", "int4_cache": "int4_cache:lfu:0.01",
               "int2_cache:lru": "int2_cache:lru:0.01", "int8_cache:lfu:1:4": "int8_cache:lfu:1:4"}
  for text, want in cases.items():
    spec = StorageSpec.parse(text)
    assert spec == want, text
    assert str(spec) == canonical.get(text, text)
    assert StorageSpec.parse(str(spec)) == spec          # the text reads back as the spec
    assert hash(spec) == hash(want)
  # A fraction that %g would round still reads back exactly.
  odd = StorageSpec("int8_cache", "lru", 0.123456789)
  assert StorageSpec.parse(str(odd)) == odd and str(odd) == "int8_cache:lru:0.123456789"
  assert f"{StorageSpec('bf16'):>6}" == "  bf16"


@pytest.mark.parametrize("text,msg", [
    ("fp64", r"--formats entry='fp64': expected one of \['fp32'"),
    ("int8:lfu", r"--formats entry='int8:lfu': expected one of"),
    ("int8_cache:lfu:0.1:4:9", "expected one of"),
    ("int8_cache:mfu", r"cache policy 'mfu': expected one of \['lfu', 'lru'\]"),
    ("int8_cache:lfu:0", r"cache fraction 0.0: expected a number in \(0, 1\]"),
    ("int8_cache:lfu:1.5", r"cache fraction 1.5: expected a number in \(0, 1\]"),
    ("int8_cache:lfu:nan", r"cache fraction nan"),
    ("int8_cache:lfu:x", r"cache fraction 'x': not a number"),
    ("int8_cache:lfu:0.1:0", r"ways 0: expected an integer >= 1"),
    ("int8_cache:lfu:0.1:two", r"ways 'two': not a number"),
])
def test_parse_errors_name_where_and_value(text, msg):
  with pytest.raises(ValueError, match=msg):
    StorageSpec.parse(text, where="--formats entry")


def test_constructor_validates_too():
  with pytest.raises(ValueError, match=r"StorageSpec: cache_fraction=0.0: expected a number in"):
    StorageSpec("int8_cache", cache_fraction=0.0)
  for kind in ("int8_cache", "int8"):    # 0 is refused, not read as "keep the spec's own"
    with pytest.raises(ValueError, match=r"StorageSpec: cache_fraction=0.0: expected a number"):
      StorageSpec.parse(kind).on_host(0.0)
  with pytest.raises(ValueError, match=r"StorageSpec: cache_policy='lru': storage 'int8' has no"):
    StorageSpec("int8", cache_policy="lru")
  with pytest.raises(ValueError, match=r"StorageSpec: kind='int3': expected one of"):
    StorageSpec("int3")
  with pytest.raises(dataclasses.FrozenInstanceError):
    StorageSpec("fp32").kind = "bf16"


def test_flags_and_the_storage_agree_on_the_cache_fraction():
  """One validation: the flag, the text and the constructor accept (0, 1] alike."""
  for frac in (1e-6, 0.5, 1.0):
    spec = StorageSpec.from_flags("int8_cache", "lru", frac)
    assert spec == StorageSpec.parse(f"int8_cache:lru:{frac!r}")
    assert make_storage(spec).fraction == frac
  for frac in (0.0, -0.1, 1.01, float("inf")):
    with pytest.raises(ValueError, match=rf"--cache_fraction={frac!r}: expected a number in"):
      StorageSpec.from_flags("int8_cache", "lru", frac)
    with pytest.raises(ValueError, match="cache fraction"):
      StorageSpec.parse(f"int8_cache:lru:{frac!r}")
  # The cache flags are checked even where the storage has no cache; they are not kept.
  with pytest.raises(ValueError, match=r"--cache_policy='mru'"):
    StorageSpec.from_flags("fp32", "mru", 0.05)
  assert StorageSpec.from_flags("int4", "lru", 0.3) == StorageSpec("int4")
  with pytest.raises(ValueError, match=r"--storage='int3': expected one of"):
    StorageSpec.from_flags("int3", "lfu", 0.05)


def test_run_config_builds_the_spec_at_the_edge():
  cfg = configs.make_run(storage="int8_cache", cache_policy="lru", cache_fraction=0.05)
  cfg.validate()
  assert cfg.embedding.storage == StorageSpec("int8_cache", "lru", 0.05)
  assert str(cfg.embedding.storage) == "int8_cache:lru:0.05"
  assert configs.make_run(storage="bf16_sr").embedding.storage == StorageSpec("bf16_sr")
  for kw, msg in [({"storage": "int3"}, "--storage='int3'"),
                  ({"cache_fraction": 0.0}, "--cache_fraction=0.0"),
                  ({"cache_policy": "mru"}, "--cache_policy='mru'")]:
    with pytest.raises(ValueError, match=msg):
      configs.make_run(**kw).validate()
  # Settings stay JSON-able strings and numbers (checkpoints compare them on resume).
  back = configs.make_run(storage=StorageSpec.parse("int4_cache:lru:0.02"))
  saved = back.run_settings()
  assert (saved["storage"], saved["cache_policy"], saved["cache_fraction"]) == (
      "int4_cache", "lru", 0.02)
  json.dumps(saved)
  assert back.embedding.storage == StorageSpec.parse("int4_cache:lru:0.02")
  # The config holds the whole spec, ways too (saved only when not the default).
  four = configs.make_run(storage="int8_cache:lfu:0.1:4")
  assert four.embedding.storage == StorageSpec("int8_cache", "lfu", 0.1, 4)
  assert four.run_settings()["cache_ways"] == 4 and "cache_ways" not in saved


def test_registry_makes_each_kind():
  assert isinstance(make_storage(StorageSpec("fp32")), storage.Fp32Storage)
  assert make_storage(StorageSpec("bf16")) == storage.Bf16Storage()
  s = make_storage(StorageSpec.parse("int2_cache:lru:0.5:3"), seed=9)
  assert s == rowwise_storage.CachedQuantizedStorage(bits=2, policy="lru", fraction=0.5, ways=3,
                                                     seed=9)
  assert make_storage(StorageSpec("int4")) == rowwise_storage.CachedQuantizedStorage(
      bits=4, fraction=0.0)
  assert set(storage_spec.kinds()) >= {"fp32", "bf16", "bf16_sr", "int8", "int4", "int2",
                                       "int8_cache", "int4_cache", "int2_cache"}
  with pytest.raises(TypeError, match="expected a StorageSpec"):
    make_storage("int8")


def test_table_config_planner_and_collection_hold_the_object():
  t = TableConfig("t", 1000, 16, storage="int8_cache:lru:0.05")
  assert t.storage == StorageSpec("int8_cache", "lru", 0.05)
  assert TableConfig("u", 10, 4).storage == StorageSpec("fp32")
  assert TableConfig("v", 10, 4, storage=StorageSpec("bf16")).storage.kind == "bf16"
  assert planner_lib.storage_bytes(t) == make_storage(t.storage).bytes_per_row(16) / 16
  assert planner_lib.storage_bytes(TableConfig("h", 10, 8, storage="bf16")) == 2
  import jax
  cfg = configs.make_run(model="dlrm", preset="small", num_rows=64, batch_size=8,
                             eval_batch_size=8, eval_batches=1, storage="int4_cache",
                             cache_policy="lru", cache_fraction=0.5, sharding="dp", mesh="data:1")
  task, *_ = configs.build_run(cfg, devices=jax.devices()[:1])
  coll = task.collection
  assert {t.storage for t in coll.tables} == {StorageSpec("int4_cache", "lru", 0.5)}
  (name, g), = coll.groups.items()
  assert g.storage == StorageSpec("int4_cache", "lru", 0.5)
  assert coll.storage(g) == make_storage(g.storage, seed=cfg.seed)
  assert coll.describe()[name]["storage"] == "int4_cache:lru:0.5"
  assert name == "dp_int4_cache:lru:0.5_d16_w16"
