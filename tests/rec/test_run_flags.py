"""The rec run flags (rec.configs.define_run_flags): one definition per RecRunConfig
setting with each entry point's defaults (and --config); `run_from_flags` keeping the
default of a setting an entry point has no flag for; the effective embedding dim in a run's
settings, so a resume with the preset's dim given explicitly is not refused (issue 31,
item 11)."""


import numpy as np
import pytest
from absl import flags

from core import checkpoint as ckpt_lib
from core import train as train_lib
from rec import configs


def _flag_values(*names, **defaults):
  fv = flags.FlagValues()
  configs.define_run_flags(*names, flag_values=fv, **defaults)
  return fv


def test_defaults_bounds_and_every_field():
  fv = _flag_values(*configs.RUN_FIELDS)
  assert sorted(fv) == sorted(configs.RUN_FIELDS + ("config",))
  fv(["prog"])
  assert configs.run_from_flags(fv) == configs.make_run()   # the config's defaults
  fv = _flag_values("data", batch_size=1024, embedding_dim=16)
  fv(["prog"])
  assert sorted(fv) == ["batch_size", "config", "data", "embedding_dim"]
  assert (fv.batch_size, fv.embedding_dim, fv.data) == (1024, 16, "synthetic")
  for bad in ("--batch_size=0", "--embedding_dim=-1"):
    fv = _flag_values("batch_size", "embedding_dim")
    with pytest.raises(flags.IllegalFlagValueError, match=f"flag {bad}"):
      fv(["prog", bad])
  with pytest.raises(ValueError, match=r"\['batchsize'\] are not RecRunConfig fields"):
    configs.define_run_flags(batchsize=3)


def test_from_flags_keeps_the_default_of_a_setting_without_a_flag():
  fv = _flag_values("batch_size", "num_rows")
  fv(["prog", "--batch_size=64"])
  cfg = configs.run_from_flags(fv, seed=3)
  assert (cfg.train.batch_size, cfg.data.num_rows, cfg.seed) == (64, 100_000, 3)
  assert cfg.model == configs.make_run().model           # no flag: the config's default
  with pytest.raises(ValueError, match=r"--sed: not a setting of RecRunConfig \(did you mean "
                     r"'seed'\?\)"):
    configs.run_from_flags(fv, sed=3)


def test_effective_embedding_dim_in_settings():
  assert configs.make_run().run_settings()["embedding_dim"] == 16         # DLRM kaggle
  assert configs.make_run(model="dcnv2").run_settings()["embedding_dim"] == 128
  assert configs.make_run(embedding_dim=32).run_settings()["embedding_dim"] == 32
  assert configs.make_run(model="logreg").run_settings()["embedding_dim"] == 1
  old = configs.make_run(model="wukong", preset="l2_n8").flat_settings()
  assert configs.normalize_settings(old)["embedding_dim"] == 128
  assert configs.normalize_settings({**old, "preset": "nope"})["embedding_dim"] == 0


def _resume(workdir, saved: dict, now: configs.RecRunConfig, normalize=True):
  ckpt = ckpt_lib.Checkpointer(workdir)
  loop = dict(workdir=workdir, steps=1, normalize_settings=configs.normalize_settings
              if normalize else None)
  ckpt.save(1, {"x": np.zeros(2, np.float32)}, {"step": 1, "steps": 1, "settings": {
      **train_lib.run_settings(train_lib.TrainConfig(**loop)), **saved}})
  ckpt.close()
  return train_lib.check_resume(train_lib.TrainConfig(**loop, resume=True,
                                                      settings=now.run_settings()))


def test_resume_with_the_preset_dim_given(tmp_path):
  """`--resume --embedding_dim=16` on a run started without it (the default 0, the DLRM
  preset's 16): the same setting, whether the checkpoint stores 16 or 0 (settings holding
  the flag's value rather than the effective dim). Another dim is still refused, naming it."""
  default = configs.make_run()
  explicit = configs.make_run(embedding_dim=16)
  assert _resume(str(tmp_path / "a"), default.run_settings(), explicit) == 1
  assert _resume(str(tmp_path / "b"), default.flat_settings(), explicit) == 1
  assert _resume(str(tmp_path / "c"), explicit.run_settings(), default) == 1
  with pytest.raises(train_lib.RunSettingsError, match=r"embedding_dim: 16 \(checkpoint\) -> "
                     r"32 \(now\)"):
    _resume(str(tmp_path / "d"), default.flat_settings(),
            configs.make_run(embedding_dim=32))


def test_cache_settings_an_entry_point_fixes_keep_the_flags_given():
  """`run_from_flags(cache_fraction=...)`: the entry point's value folds in after the command
  line's --storage / --cache_policy (neither dropped); fixing the storage too leaves the flags'
  cache settings out."""
  from rec.embedding.storage_spec import StorageSpec
  fv = _flag_values("storage", "cache_policy", "cache_fraction")
  fv(["prog", "--storage=int8_cache", "--cache_policy=lru"])
  assert configs.run_from_flags(fv).embedding.storage == StorageSpec("int8_cache", "lru", 0.05)
  assert configs.run_from_flags(fv, cache_fraction=0.2).embedding.storage == StorageSpec(
      "int8_cache", "lru", 0.2)
  assert configs.run_from_flags(fv, storage="int4_cache", cache_fraction=0.01
                                ).embedding.storage == StorageSpec("int4_cache", None, 0.01)
  fv = _flag_values("storage", "cache_policy", "cache_fraction")
  fv(["prog", "--storage=int8_cache:lfu:0.1"])
  assert configs.run_from_flags(fv, cache_policy="lru").embedding.storage == StorageSpec(
      "int8_cache", "lru", 0.1)
