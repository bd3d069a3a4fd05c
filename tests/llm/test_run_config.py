"""llm.run_config: train_lm's settings as one typed config, its flags, its file and checks."""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from core import config
from core import errors
from llm import run_config
from llm.run_config import LMRunConfig


def _parsed(*args: str) -> flags.FlagValues:
  fv = flags.FlagValues()
  config.define_flags(LMRunConfig, flag_values=fv)
  fv(["train_lm", *args])
  return fv


def test_defaults_are_train_lms():
  run = LMRunConfig()
  assert (run.loop.steps, run.loop.eval_every, run.loop.log_every) == (300, 100, 25)
  assert (run.data.seq_len, run.train.batch_size, run.train.learning_rate) == (128, 16, 3e-3)
  assert run.data.packing.packing == "none" and run.model.remat == "none"
  assert config.from_flags(LMRunConfig, _parsed()) == run
  flat = config.flat(run)
  assert flat["doc_context"] == 131072 and flat["mesh"] == "-1" and flat["text"] is None


def test_remat_is_a_switch_and_a_policy():
  assert config.from_flags(LMRunConfig, _parsed("--remat")).model.remat == "full"
  assert config.from_flags(LMRunConfig, _parsed("--noremat")).model.remat == "none"
  assert config.from_flags(LMRunConfig, _parsed("--remat=dots")).model.remat == "dots"
  with pytest.raises(flags.IllegalFlagValueError, match="remat"):
    _parsed("--remat=dotz")
  run = config.build(LMRunConfig, remat="dots")
  cfg = run.llama_config(256)
  assert cfg.remat and cfg.remat_policy == "dots"
  assert not LMRunConfig().llama_config(256).remat


def test_a_written_config_replays_the_run(tmp_path):
  fv = _parsed("--text=book.txt", "--seq_len=64", "--packing=wlb", "--remat=attention",
               "--steps=7", "--learning_rate=0.01", "--mesh=data:2,cp:4")
  run = config.from_flags(LMRunConfig, fv)
  path = config.write_file(run, str(tmp_path / "config.py"),
                           command="python -m experiments.train_lm --steps=7")
  assert "python -m experiments.train_lm --steps=7" in open(path).read()
  assert config.from_flags(LMRunConfig, _parsed(f"--config={path}")) == run
  assert run_config.LMRunConfig(**{f.name: getattr(run, f.name)
                                   for f in dataclasses.fields(run)}) == run


def test_a_flag_wins_over_the_file_and_is_noted(tmp_path):
  run = config.build(LMRunConfig, text="book.txt", seed=2, steps=9)
  path = config.write_file(run, str(tmp_path / "config.py"))
  fv = _parsed(f"--config={path}", "--seed=5", "--steps=9")
  replayed = config.from_flags(LMRunConfig, fv)
  assert replayed == config.replace(run, seed=5)
  over = config.command_line_overrides(LMRunConfig, fv)
  assert over == {"seed": (2, 5)}       # --steps equals the file's: no override
  again = config.write_file(replayed, str(tmp_path / "again.py"), overridden=over)
  assert "'seed': 5,  # --seed on the command line; the --config file had 2" in open(again).read()


@pytest.mark.parametrize("text,message", [
    ("def get_config():\n  return {'seq_lenn': 64}\n",
     r"^\S*bad\.py: seq_lenn: not a setting of LMRunConfig \(did you mean 'seq_len'\?\)"),
    ("def get_config():\n  return {'packing': 'wlbb'}\n",
     r"^\S*bad\.py: packing='wlbb': not a choice; expected one of \['none', 'original', 'fixed', 'wlb'\]$"),
    ("def get_config():\n  return {'seq_len': '64'}\n",
     r"^\S*bad\.py: seq_len='64': a str; expected an integer >= 1$"),
    ("def get_config():\n  return {'remat': 'dotz'}\n",
     r"^\S*bad\.py: remat='dotz': not a choice; expected one of"),
    ("def get_config():\n  return {'weight_decay': -0.1}\n",
     r"^\S*bad\.py: weight_decay=-0\.1: out of range; expected a number >= 0$"),
])
def test_an_unknown_or_mistyped_field_is_one_line(tmp_path, text, message):
  (tmp_path / "bad.py").write_text(text)
  with pytest.raises(errors.UserError, match=message) as e:
    config.from_flags(LMRunConfig, _parsed(f"--config={tmp_path / 'bad.py'}"))
  assert "\n" not in str(e.value)


def test_validate_names_the_flags():
  from llm.attention.choose import DeviceInfo
  with pytest.raises(errors.UserError, match=r"^--text: not given; expected the text file"):
    LMRunConfig().validate()
  ok = config.build(LMRunConfig, text="t.txt")
  ok.validate()
  with pytest.raises(errors.UserError, match="--cp_sharding=doc needs documents"):
    config.replace(ok, cp_sharding="doc").validate(cp_ranks=4)
  with pytest.raises(ValueError, match=r"--learning_rate=0\.0: expected a finite"):
    config.replace(ok, learning_rate=0.0).validate()
  cudnn = config.replace(ok, attention_impl="cudnn", dtype="bfloat16", packing="wlb")
  with pytest.raises(errors.UserError, match="--attention_impl=cudnn with --packing=wlb"):
    cudnn.validate(device=DeviceInfo("cpu"))
  config.replace(cudnn, attention_impl="auto").validate(device=DeviceInfo("cpu"))


def test_run_settings_keep_the_names_checkpoints_hold():
  """The settings compared on --resume: the same keys as before the config existed, so
  earlier runs resume."""
  import types
  run = config.build(LMRunConfig, text="t.txt", packing="fixed")
  cfg = run.llama_config(256)
  mesh = types.SimpleNamespace(shape={"data": 2, "cp": 4})
  got = run.run_settings(cfg, run.optim_config(), mesh)
  assert got["mesh"] == "data:2,cp:4" and got["data.batch_size"] == 16
  assert got["optim.total_steps"] == 300 and got["optim.peak_lr"] == 3e-3
  assert {"data.packing", "data.cost_model", "model.remat", "data.seq_len"} <= set(got)
  assert "data.packing" not in LMRunConfig(
      data=run_config.DataSection(text="t.txt")).run_settings(cfg, run.optim_config(), mesh)


def test_preset_config_is_the_preset_at_the_runs_numerics():
  """A study's model (cp_prefill, cp_model, wlb_packing): the preset's own vocabulary and
  context, the run's dtype, remat, attention and context parallelism; llama_config sets
  the tokenizer's vocabulary and the run's sequence length instead."""
  from llm.config import get_config
  run = config.replace(LMRunConfig(), preset="llama_100m", dtype="bfloat16", remat="dots",
                       context_parallel="pass_q", seq_len=64)
  want = get_config("llama_100m", dtype="bfloat16", attention_impl="xla", remat=True,
                    remat_policy="dots", context_parallel="pass_q")
  assert run.preset_config() == want
  assert run.preset_config(attention_impl="auto") == want.replace(attention_impl="auto")
  assert run.llama_config(256) == want.replace(vocab_size=256, max_seq_len=64)


# --- llm.config: the model config a run builds and a workdir's model_config.json holds


@pytest.mark.parametrize("kw,message", [
    (dict(dim=30), "LlamaConfig: dim=30 not divisible by n_heads=4"),
    (dict(n_kv_heads=3), "LlamaConfig: n_heads=4 not a multiple of n_kv_heads=3"),
    (dict(head_dim=15), "LlamaConfig: head_dim=15 must be even for RoPE"),
    (dict(context_parallel="ring"), "LlamaConfig: context_parallel='ring', expected one of "
     r"\('none', 'pass_kv', 'pass_q', 'auto'\)"),
    (dict(remat_policy="some"), "LlamaConfig: remat_policy='some', expected 'full', 'dots' or "
     "'attention'"),
    (dict(cache_dtype="float16"), "LlamaConfig: cache_dtype='float16', expected None, "
     "'float32' or 'bfloat16'"),
    (dict(param_dtype="float16"), "LlamaConfig: param_dtype='float16', expected 'float32' or "
     "'bfloat16'"),
    (dict(sliding_window=0), "LlamaConfig: sliding_window=0; expected None or an integer >= 1"),
    (dict(sliding_window=4, window_layers="01"), "LlamaConfig: window_layers='01'; expected None "
     "or layer indices"),
    (dict(sliding_window=4, window_layers=(1, 0)), r"LlamaConfig: window_layers=\(1, 0\); "
     r"expected increasing layer indices in \[0, 2\)"),
    (dict(window_layers=(1,)),
     r"window_layers=\(1,\) with sliding_window=None"),
])
def test_llama_config_refusals_name_the_field(kw, message):
  from llm.config import LlamaConfig
  base = dict(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
  with pytest.raises(ValueError, match=message):
    LlamaConfig(**{**base, **kw})


def test_yarn_scaling_checks_and_attention_factor():
  import math

  from llm.config import YarnScaling, get_config
  with pytest.raises(ValueError, match="YarnScaling: rope_type='llama3', expected 'yarn'"):
    YarnScaling(factor=4.0, original_max_position=64, rope_type="llama3")
  with pytest.raises(ValueError, match=r"YarnScaling: factor=0.5, original_max_position=64, "
                     "beta_fast=32.0, beta_slow=1.0; expected factor >= 1"):
    YarnScaling(factor=0.5, original_max_position=64)
  # transformers' _compute_yarn_parameters: 0.1 ln(factor) + 1, the mscale ratio, or as given
  assert YarnScaling(4.0, 64).cos_sin_scale() == 0.1 * math.log(4.0) + 1
  assert YarnScaling(4.0, 64, attention_factor=1.5).cos_sin_scale() == 1.5
  assert YarnScaling(4.0, 64, mscale=1.0, mscale_all_dim=0.5).cos_sin_scale() == pytest.approx(
      (0.1 * math.log(4.0) + 1) / (0.05 * math.log(4.0) + 1), rel=1e-15)
  assert YarnScaling(1.0, 64).cos_sin_scale() == 1.0
  with pytest.raises(ValueError, match=r"Llama preset 'tiny2': expected one of \['byte_small'"):
    get_config("tiny2")


def test_model_config_json_round_trips(caplog):
  """What train_lm writes as model_config.json reads back equal (RoPE scalings of both kinds,
  window layers as a JSON list); an old file naming the ring as attention_impl is read as
  context_parallel with a warning."""
  import json

  from llm.config import YarnScaling, config_from_dict, config_to_dict, get_config
  for cfg in (get_config("tiny_tied"), get_config("llama3_8b"),
              get_config("tiny_qwen2", sliding_window=8, window_layers=(1,),
                             rope_scaling=YarnScaling(4.0, 64, beta_fast=16.0, truncate=False))):
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
  old = {**config_to_dict(get_config("tiny")), "attention_impl": "ring_pass_q"}
  del old["context_parallel"]
  with caplog.at_level("WARNING"):
    cfg = config_from_dict(old)
  assert (cfg.attention_impl, cfg.context_parallel) == ("xla", "pass_q")
  assert "attention_impl='ring_pass_q' read as context_parallel='pass_q'" in caplog.text
