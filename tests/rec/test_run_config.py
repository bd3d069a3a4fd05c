"""The typed rec run config (rec.configs.RecRunConfig) and train_rec's config on top of it:
flat names in and out (`make_run`, `replace_run`, `run_settings`), --storage with the whole
grammar reaching the collection as the object, --config replaying a run's written
config.py to the same resolved config, a flag winning over the file (noted in config.py),
and a mistyped field of the file refused in one line naming file and field."""

import os
import sys

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
