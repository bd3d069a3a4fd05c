"""The typed rec run config (rec.configs.RecRunConfig) and train_rec's config on top of it:
flat names in and out (`make_run`, `replace_run`, `run_settings`), --storage with the whole
grammar reaching the collection as the object, --config replaying a run's written
config.py to the same resolved config, a flag winning over the file (noted in config.py),
a mistyped field of the file refused in one line naming file and field, the auto planner
priced with the data's padded bags, and --group_by checked against the data's features."""

import dataclasses
import os
import sys
import types

import jax
import pytest
from absl import flags

from core import config
from core import errors
from experiments import train_rec
from rec import configs
from rec.embedding.storage_spec import StorageSpec
from tests.cpu_env import cpu_env
from tests.experiments.entry import REPO
from tests import forkserver

SMALL = ["--model=dlrm", "--preset=small", "--num_rows=100", "--batch_size=32",
         "--eval_batch_size=32", "--eval_batches=1", "--mesh=-1", "--steps=2",
         "--log_every=1", "--eval_every=0"]


def _flags(args):
  fv = flags.FlagValues()
  configs.define_run_flags(*configs.RUN_FIELDS, flag_values=fv)
  config.define_flags(train_rec.TrainRecConfig, flag_values=fv)
  fv(["prog", *args])
  return fv


def test_nested_layout_and_flat_names():
  cfg = configs.make_run(batch_size=64, dedup_features="C1", a2a_mode="abs", days="0-2")
  assert (cfg.train.batch_size, cfg.embedding.dedup.dedup_features,
          cfg.embedding.a2a.a2a_mode, cfg.data.days) == (64, "C1", "abs", "0-2")
  assert configs.replace_run(cfg, batch_size=8).train.batch_size == 8
  assert set(cfg.run_settings()) == set(configs.RUN_FIELDS)
  with pytest.raises(errors.UserError, match=r"^--batch_size\b.*\b0\b.*expected an integer >= 1"):
    configs.make_run(batch_size=0)


def test_storage_flag_reaches_the_collection_as_the_object():
  fv = _flags(["--storage=int8_cache:lru:0.1:4"])
  cfg = train_rec.from_flags(fv).run
  assert cfg.embedding.storage == StorageSpec("int8_cache", "lru", 0.1, 4)
  cfg = configs.replace_run(cfg, model="dlrm", preset="small", num_rows=50, batch_size=16,
                            eval_batch_size=16, eval_batches=1, sharding="dp")
  task = configs.build_run(cfg)[0]
  assert {t.storage for t in task.collection.tables} == {StorageSpec("int8_cache", "lru", 0.1, 4)}
  # A bare *_cache kind takes --cache_policy / --cache_fraction (their defaults: lfu, 0.05).
  assert train_rec.from_flags(_flags(["--storage=int4_cache", "--cache_policy=lru"])
                              ).run.embedding.storage == StorageSpec("int4_cache", "lru", 0.05)
  with pytest.raises(errors.UserError, match=r"--cache_fraction=0.2: with "
                     r"--storage=int8_cache:lru:0.1; expected the cache settings given once"):
    train_rec.from_flags(_flags(["--storage=int8_cache:lru:0.1", "--cache_fraction=0.2"]))
  with pytest.raises(errors.UserError, match=r"^--storage='int3': expected one of "):
    train_rec.from_flags(_flags(["--storage=int3"]))


def test_config_file_replays_and_flags_win(tmp_path):
  cfg = train_rec.from_flags(_flags([*SMALL, "--storage=int8_cache:lru:0.1",
                                     "--a2a_grad_error_bound=0.5", "--epochs=1.5"]))
  path = config.write_file(cfg, str(tmp_path / "config.py"), command="python -m x")
  assert train_rec.from_flags(_flags([f"--config={path}"])) == cfg
  fv = _flags([f"--config={path}", "--learning_rate=0.2", "--batch_size=32"])
  got = train_rec.from_flags(fv)
  assert got.run == configs.replace_run(cfg.run, learning_rate=0.2) and got.loop == cfg.loop
  over = config.command_line_overrides(train_rec.TrainRecConfig, fv)
  assert over == {"learning_rate": (0.05, 0.2)}   # --batch_size=32 is the file's value
  text = open(config.write_file(got, str(tmp_path / "again.py"), overridden=over)).read()
  assert "'learning_rate': 0.2,  # --learning_rate on the command line; the --config file " \
         "had 0.05" in text


def test_config_file_with_a_mistyped_field_is_one_line(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config():\n  return {'batch_sise': 64}\n")
  with pytest.raises(errors.UserError, match=rf"^{bad}: batch_sise: not a setting of "
                     r"TrainRecConfig \(did you mean 'batch_size'\?\)"):
    train_rec.from_flags(_flags([f"--config={bad}"]))
  bad.write_text("def get_config():\n  return {'storage': 'int9'}\n")
  with pytest.raises(errors.UserError, match=rf"^{bad}: storage='int9': expected one of "):
    train_rec.from_flags(_flags([f"--config={bad}"]))


def test_train_rec_writes_config_py_that_replays_the_run(tmp_path):
  """The workdir's config.py replays the run: the same resolved settings; a flag given with
  it wins, is printed in one line, and is noted in the new config.py."""
  env = cpu_env(1)
  run = lambda *a: forkserver.run([sys.executable, "-m", "experiments.train_rec", *a],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  first = str(tmp_path / "a")
  out = run(*SMALL, "--storage=int8_cache:lru:0.1", f"--workdir={first}")
  assert out.returncode == 0, out.stderr[-3000:]
  written = os.path.join(first, train_rec.CONFIG_FILE)
  text = open(written).read()
  assert "python -m experiments.train_rec --model=dlrm" in text
  assert "'storage': 'int8_cache:lru:0.1'," in text
  second = str(tmp_path / "b")
  out = run(f"--config={written}", "--learning_rate=0.1", f"--workdir={second}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"--learning_rate=0.1 overrides {written}'s 0.05" in out.stdout.splitlines()
  got = config.read_file(train_rec.TrainRecConfig, os.path.join(second, train_rec.CONFIG_FILE))
  want = config.read_file(train_rec.TrainRecConfig, written)
  assert got == {**want, "learning_rate": 0.1}
  assert "# --learning_rate on the command line" in open(
      os.path.join(second, train_rec.CONFIG_FILE)).read()


@pytest.mark.devices(8)
def test_auto_plan_prices_the_datas_padded_bags(monkeypatch):
  """build_run hands the planner the train source's padded bag (`DataSpec.max_ids_per_bag`):
  the per-step bytes of the plan grow with the bag length."""
  from rec.embedding import planner
  seen = []
  real = planner.plan
  monkeypatch.setattr(configs.planner_lib, "plan",
                      lambda *a, **k: seen.append(k["cost_params"]) or real(*a, **k))
  comm = {}
  for L in (1, 4):
    data = "synthetic" + (f":multi_hot={'-'.join([str(L)] * 26)}" if L > 1 else "")
    cfg = configs.make_run(data=data, model="dlrm", preset="small", num_rows=100,
                           batch_size=64, eval_batch_size=64, sharding="auto",
                           memory_budget_gb=1.0)
    task, train_src, _, plan, _ = configs.build_run(cfg)
    assert seen[-1].ids_per_bag == train_src.spec.max_ids_per_bag == L
    coll = task.collection
    est = planner.estimate_plan(plan, coll.tables, coll.num_devices, 64,
                                configs.plan_cost_params(train_src.spec))
    comm[L] = float(est.per_device.comm_bytes.sum())
  assert comm[4] > comm[1] > 0


def test_group_by_names_a_sparse_feature_or_is_one_line():
  spec = types.SimpleNamespace(sparse_features=("C1", "site_id", "app_id"))
  assert configs.group_feature("", spec, "x") is None
  assert configs.group_feature("app_id", spec, "x") == 2
  with pytest.raises(errors.UserError) as e:
    configs.group_feature("site", spec, "avazu:D")
  assert str(e.value) == ("--group_by='site': not a sparse feature of --data=avazu:D; expected "
                          "one of C1, site_id, app_id (or empty: no groups)")
  # a run saved before the setting existed evaluated without groups
  assert configs.normalize_settings({"model": "logreg", "embedding_dim": 1})["group_by"] == ""


def test_host_tier_settings_plan_and_saved_storage():
  """--storage's @host survives the cache flags and the saved settings (an older run's,
  without it or --host_memory_gb, reads as the device tier and no host tier); with
  --host_memory_gb the auto plan moves the table the device budget cannot hold to the host
  tier, and a fixed --sharding with it is refused in one line."""
  from rec.embedding import optimizers as opt_lib
  from rec.embedding.config import TableConfig
  spec = train_rec.from_flags(_flags(["--storage=fp32_cache@host", "--cache_policy=lru"])
                              ).run.embedding.storage
  assert spec == StorageSpec("fp32_cache", "lru", 0.05, tier="host")
  saved = configs.make_run(storage="int8_cache:lfu:0.1:4@host").run_settings()
  assert (saved["storage"], saved["cache_fraction"], saved["cache_ways"]) == (
      "int8_cache@host", 0.1, 4)
  fields = set(configs.RUN_FIELDS) | {"cache_ways"}
  assert str(configs.make_run(**{k: v for k, v in saved.items() if k in fields}
                              ).embedding.storage) == "int8_cache:lfu:0.1:4@host"
  old = {k: v for k, v in configs.make_run(storage="int8_cache").run_settings().items()
         if k != "host_memory_gb"}
  assert old["storage"] == "int8_cache"
  assert configs.normalize_settings(old)["host_memory_gb"] == 0.0
  assert "host_memory_gb" in configs.LAYOUT_SETTINGS   # a resume may move tables

  tables = [TableConfig("big", 100_000, 64, pooling_factor=2.0),
            TableConfig("hot", 100_000, 64, pooling_factor=8.0),
            TableConfig("small", 1000, 64)]
  opt = opt_lib.get_sparse_optimizer("rowwise_adagrad", 0.1)
  cfg = configs.make_run(batch_size=1024, memory_budget_gb=40e6 / 2**30, host_memory_gb=1)
  plan = configs.make_plan(cfg, tables, 1, opt)
  assert {n: str(p.storage) for n, p in plan.items() if p.storage} == {
      "big": "fp32_cache:lfu:0.05@host"}
  assert configs.host_tier(configs.replace_run(cfg, host_memory_gb=0)) is None
  with pytest.raises(ValueError, match=r"^--host_memory_gb=1 with --sharding=tw: the planner "
                     r"chooses the tables of the host tier; expected --sharding=auto"):
    configs.make_plan(configs.replace_run(cfg, sharding="tw"), tables, 1, opt)


def _built(cfg, section=None, **fields):
  """`cfg` with fields replaced without make_run's checks (a config built field by field)."""
  if section is None:
    return dataclasses.replace(cfg, **fields)
  sub = dataclasses.replace(getattr(cfg, section), **fields)
  return dataclasses.replace(cfg, **{section: sub})


@pytest.mark.parametrize("section, fields, msg", [
    ("embedding", dict(memory_budget_gb=0.0), "--memory_budget_gb=0.0: expected a number > 0"),
    ("embedding", dict(memory_budget_gb=float("inf")),
     "--memory_budget_gb=inf: expected a number > 0"),
    ("embedding", dict(host_memory_gb=float("nan")),
     "--host_memory_gb=nan: expected a number >= 0 (0: no host tier)"),
    ("embedding", dict(storage="int8"), "--storage='int8': expected a StorageSpec (make_run and "
                                        "StorageSpec.parse read a storage name)"),
])
def test_a_config_built_field_by_field_is_validated_naming_the_flag(section, fields, msg):
  cfg = _built(configs.make_run(), section, **fields)
  with pytest.raises(ValueError) as e:
    cfg.validate()
  assert str(e.value) == msg


def test_a2a_mode_built_field_by_field_names_the_modes():
  e = configs.make_run().embedding
  cfg = _built(configs.make_run(), "embedding", a2a=dataclasses.replace(e.a2a, a2a_mode="lossy"))
  with pytest.raises(ValueError) as err:
    cfg.validate()
  assert str(err.value) == "--a2a_mode='lossy': expected none or one of ['abs', 'rel']"


def test_fixed_sharding_with_overrides_and_an_unknown_sharding():
  """--sharding=tw with --sharding_overrides=C2=rw: C2 row-wise over every device, the others
  table-wise as the uniform plan places them; a sharding the flag does not take is refused
  naming its choices."""
  from rec.embedding import optimizers as opt_lib
  from rec.embedding import planner
  from rec.embedding.config import ShardingKind, TableConfig
  tables = [TableConfig(f"C{i}", 100, 8) for i in (1, 2, 3)]
  opt = opt_lib.get_sparse_optimizer("sgd", 0.1)
  cfg = configs.make_run(sharding="tw", sharding_overrides="C2=rw")
  plan = configs.make_plan(cfg, tables, 4, opt)
  uniform = planner.uniform_plan(tables, ShardingKind.TABLE_WISE, 4)
  assert {n: (ShardingKind(p.kind).value, p.devices) for n, p in plan.items()} == {
      "C1": ("tw", uniform["C1"].devices), "C2": ("rw", (0, 1, 2, 3)),
      "C3": ("tw", uniform["C3"].devices)}
  with pytest.raises(ValueError, match=r"C9"):
    configs.make_plan(configs.replace_run(cfg, sharding_overrides="C9=rw"), tables, 4, opt)
  for bad in ("bogus", "sptt"):
    with pytest.raises(ValueError) as e:
      configs.make_plan(_built(cfg, "embedding", sharding=bad), tables, 4, opt)
    assert str(e.value) == (f"--sharding={bad!r}: expected one of ['auto', 'dp', 'tw', 'rw', "
                            "'cw', 'twrw']")


@pytest.mark.devices(8)
def test_batch_sizes_the_mesh_does_not_divide_are_refused():
  for over, msg in ((dict(batch_size=12), "--batch_size=12 is not divisible by the 8 devices "
                                          "of --mesh='-1'"),
                    (dict(eval_batch_size=20), "--eval_batch_size=20 is not divisible by the 8 "
                                               "devices of --mesh='-1'")):
    with pytest.raises(ValueError) as e:
      cfg = configs.make_run(num_rows=50, **{"batch_size": 16, "eval_batch_size": 16, **over})
      configs.build_run(cfg, devices=jax.devices()[:8])
    assert str(e.value) == msg


def test_epochs_need_a_finite_data_set():
  src = types.SimpleNamespace(num_batches=None)
  with pytest.raises(ValueError, match=r"^--epochs needs a finite data set; synthetic data is "
                     r"infinite: use --steps$"):
    configs.steps_for(1.0, src)
  assert configs.steps_for(2.5, types.SimpleNamespace(num_batches=3)) == 7
  assert configs.steps_for(0.01, types.SimpleNamespace(num_batches=3)) == 1
  # whole numbers within float rounding: 0.58 * 100 is 57.99999999999999 in floats
  hundred = types.SimpleNamespace(num_batches=100)
  assert [configs.steps_for(e, hundred) for e in (0.29, 0.57, 0.58, 1.13, 2.01)] == [
      29, 57, 58, 113, 201]
  assert [configs.steps_for(e, types.SimpleNamespace(num_batches=3)) for e in (1 / 3, 2 / 3)] == [
      1, 2]
  assert configs.steps_for(0.999, types.SimpleNamespace(num_batches=1000)) == 999
