"""core.config: settings defined once, typed configs, their flags and config files."""

from __future__ import annotations

import dataclasses
import json

import pytest
from absl import flags

from core import config
from core import errors
from core import settings


def _spec_parse(text: str) -> tuple[str, int]:
  kind, _, n = text.partition(":")
  if not n.isdigit():
    raise ValueError("expected KIND:N")
  return kind, int(n)


SPEC = config.setting("test_config_spec", "string", "A kind and a count, KIND:N.",
                      parse=_spec_parse, format=lambda v: f"{v[0]}:{v[1]}")
MODE = config.setting("test_config_mode", "enum", "A mode.", choices=("a", "b", "c"))


@dataclasses.dataclass(frozen=True)
class Inner:
  spec: tuple = SPEC.field(("x", 1))
  test_config_mode: str = MODE.field("a", choices=("a", "b"))


@dataclasses.dataclass(frozen=True)
class Run:
  loop: settings.LoopConfig = config.section(settings.LoopConfig)
  inner: Inner = config.section(Inner)
  seed: int = settings.SEED.field(0)
  dtype: str = settings.DTYPE.field("float32")


# `Inner.spec` is named after its field, not its setting: a config is refused.
def test_a_field_is_named_after_its_setting():
  with pytest.raises(ValueError, match="named after its setting"):
    config.leaves(Run)


@dataclasses.dataclass(frozen=True)
class Inner2:
  test_config_spec: tuple = SPEC.field(("x", 1))
  test_config_mode: str = MODE.field("a", choices=("a", "b"))


@dataclasses.dataclass(frozen=True)
class Run2:
  loop: settings.LoopConfig = config.section(settings.LoopConfig)
  inner: Inner2 = config.section(Inner2)
  seed: int = settings.SEED.field(0)
  dtype: str = settings.DTYPE.field("float32")


def _parsed(*args: str, **defaults) -> flags.FlagValues:
  fv = flags.FlagValues()
  config.define_flags(Run2, flag_values=fv, **defaults)
  fv(["prog", *args])
  return fv


def test_a_setting_is_defined_once():
  with pytest.raises(ValueError, match="defined in core.settings and again"):
    config.setting("steps", "integer", "Steps again.")
  assert config.get("steps") is settings.STEPS


def test_flags_from_the_tree_with_the_entry_points_defaults():
  fv = _parsed("--dtype=bfloat16", "--test_config_spec=y:3", steps=7)
  run = config.from_flags(Run2, fv)
  assert run.loop.steps == 7 and run.dtype == "bfloat16" and run.inner.test_config_spec == ("y", 3)
  assert run.loop.eval_every == 250 and run.inner.test_config_mode == "a"
  assert config.flat(run)["steps"] == 7
  # the narrowed choices are the flag's
  with pytest.raises(flags.IllegalFlagValueError):
    _parsed("--test_config_mode=c")


def test_only_some_flags_and_overrides():
  fv = flags.FlagValues()
  config.define_flags(Run2, only=("seed",), flag_values=fv)
  fv(["prog", "--seed=3"])
  assert "steps" not in fv and "config" in fv
  run = config.from_flags(Run2, fv, steps=5)
  assert run.seed == 3 and run.loop.steps == 5 and run.dtype == "float32"


def test_build_replace_and_one_line_errors():
  run = config.build(Run2, steps=3, test_config_spec="z:2")
  assert run.inner.test_config_spec == ("z", 2)
  assert config.replace(run, seed=4).seed == 4 and config.replace(run, seed=4).loop.steps == 3
  with pytest.raises(errors.UserError, match=r"^--steps=0: out of range; expected an integer >= "
                                             r"1$"):
    config.build(Run2, steps=0)
  with pytest.raises(errors.UserError, match=r"--stepz: not a setting of Run2 \(did you mean "
                                             r"'steps'\?\)"):
    config.build(Run2, stepz=1)
  with pytest.raises(errors.UserError, match=r"--test_config_spec='nope': expected KIND:N; "
                                             r"expected a kind and a count, kind:n"):
    config.build(Run2, test_config_spec="nope")
  with pytest.raises(errors.UserError, match=r"--test_config_mode='c': not a choice; expected one "
                                             r"of \['a', 'b'\]"):
    config.build(Run2, test_config_mode="c")


def test_a_written_config_replays_and_a_flag_wins(tmp_path):
  fv = _parsed("--steps=9", "--test_config_spec=q:4", "--seed=2")
  run = config.from_flags(Run2, fv)
  path = config.write_file(run, str(tmp_path / "config.py"), command="prog --steps=9")
  assert "prog --steps=9" in open(path).read()
  assert config.from_flags(Run2, _parsed(f"--config={path}")) == run
  fv = _parsed(f"--config={path}", "--seed=5")
  replayed = config.from_flags(Run2, fv)
  assert replayed == config.replace(run, seed=5)
  over = config.command_line_overrides(Run2, fv)
  assert over == {"seed": (2, 5)}
  again = config.write_file(replayed, str(tmp_path / "again.py"), overridden=over)
  assert "'seed': 5,  # --seed on the command line; the --config file had 2" in open(again).read()
  # a JSON file of some settings, and a dict from get_config
  (tmp_path / "c.json").write_text(json.dumps({"steps": 4}))
  assert config.from_flags(Run2, _parsed(f"--config={tmp_path / 'c.json'}")).loop.steps == 4
  (tmp_path / "d.py").write_text("def get_config():\n  return {'dtype': 'bfloat16'}\n")
  assert config.from_flags(Run2, _parsed(f"--config={tmp_path / 'd.py'}")).dtype == "bfloat16"


@dataclasses.dataclass(frozen=True)
class Rates:
  learning_rate: float = settings.LEARNING_RATE.field(0.1)   # unbounded: inf is a value


@pytest.mark.parametrize("rate", [float("inf"), float("-inf"), 1e-300, 0.1])
def test_a_written_config_replays_floats_python_cannot_spell(tmp_path, rate):
  """`inf` written as is would be an undefined name when the file is replayed."""
  path = config.write_file(config.build(Rates, learning_rate=rate), str(tmp_path / "c.py"))
  assert config.read_file(Rates, path) == {"learning_rate": rate}

@pytest.mark.parametrize("text,message", [
    ("def get_config(:\n", r"bad\.py:1:\d+: .*; expected a Python file defining get_config\(\)"),
    ("x = 1\n", r"bad\.py: no get_config\(\); expected a function get_config\(\)"),
    ("def get_config():\n  return {'step': 1}\n",
     r"bad\.py: step: not a setting of Run2 \(did you mean 'steps'\?\)"),
    ("def get_config():\n  return {'steps': 'abc'}\n",
     r"bad\.py: steps='abc': a str; expected an integer >= 1"),
    ("def get_config():\n  return {'resume': True}\n", r"bad\.py: resume: not a setting of Run2"),
    ("def get_config():\n  return [1]\n", r"bad\.py: a list; expected a dict of settings"),
    # the file's own code failing is a line naming it too, not a traceback
    ("def get_config():\n  return {'dtype': bfloat16}\n",
     r"bad\.py:2: NameError: name 'bfloat16' is not defined; expected a Python file whose "
     r"get_config\(\) runs"),
    ("import no_such_module_here\n", r"bad\.py:1: ModuleNotFoundError: "),
])
def test_a_bad_config_file_is_one_line(tmp_path, text, message):
  (tmp_path / "bad.py").write_text(text)
  with pytest.raises(errors.UserError, match=message):
    config.read_file(Run2, str(tmp_path / "bad.py"))
  fv = _parsed(f"--config={tmp_path / 'bad.py'}")
  with pytest.raises(errors.UserError):
    config.from_flags(Run2, fv)


def test_a_bad_json_config_names_line_and_column(tmp_path):
  (tmp_path / "bad.json").write_text('{"steps": 3,\n "seed": }')
  with pytest.raises(errors.UserError, match=r"bad\.json:2:10: "):
    config.read_file(Run2, str(tmp_path / "bad.json"))


def test_loose_settings_and_loop_config():
  fv = flags.FlagValues()
  config.define_flags(None, "repeats", *settings.RUN_FLAGS, repeats=5, flag_values=fv)
  fv(["prog", "--workdir=/tmp/x", "--resume_allow=a,b"])
  assert fv.repeats == 5 and "config" not in fv
  tc = settings.loop_config(settings.LoopConfig(steps=3), fv, seed=1)
  assert (tc.workdir, tc.steps, tc.resume_allow, tc.seed) == ("/tmp/x", 3, ("a", "b"), 1)
  with pytest.raises(ValueError, match="needs a default"):
    config.define_flags(None, "nonfinite", flag_values=flags.FlagValues())


def test_a_config_file_sets_the_loose_settings_declared_in_config(tmp_path):
  """A study's row as a file: its loose settings (declared in_config) become their flags'
  defaults, the typed config's leaves come through from_flags, a flag given wins; the
  per-invocation flags stay out of the file."""
  def parsed(*args):
    fv = flags.FlagValues()
    config.define_flags(Run2, flag_values=fv)
    config.define_flags(None, "repeats", in_config=True, repeats=5, flag_values=fv)
    config.define_flags(None, *settings.RUN_FLAGS, flag_values=fv)
    fv(["prog", *args])
    return fv

  row = tmp_path / "row.py"
  row.write_text("def get_config():\n  return {'repeats': 7, 'steps': 4}\n")
  fv = parsed(f"--config={row}")
  assert config.apply_file(fv) == {} and fv.repeats == 7 and not fv["repeats"].present
  assert config.from_flags(Run2, fv).loop.steps == 4
  fv = parsed(f"--config={row}", "--repeats=9")
  assert config.apply_file(fv) == {"repeats": (7, 9)} and fv.repeats == 9
  row.write_text("def get_config():\n  return {'repeats': 0}\n")
  with pytest.raises(errors.UserError, match=r"row\.py: repeats=0: out of range"):
    config.apply_file(parsed(f"--config={row}"))
  row.write_text("def get_config():\n  return {'workdir': '/tmp/x'}\n")
  with pytest.raises(errors.UserError, match=r"row\.py: workdir: not a setting of Run2"):
    config.apply_file(parsed(f"--config={row}"))
  # An entry point of loose settings only.
  fv = flags.FlagValues()
  config.define_flags(None, "repeats", "steps", in_config=True, flag_values=fv, steps=3)
  row.write_text("def get_config():\n  return {'steps': 8}\n")
  fv(["prog", f"--config={row}"])
  config.apply_file(fv)
  assert (fv.steps, fv.repeats) == (8, None)


def test_settings_defined_wrong_are_refused():
  with pytest.raises(ValueError, match=r"^Setting 'x': kind='number'; expected one of \('string', "
                                       r""):
    config.Setting("x", "number", "X.")
  for kw in (dict(kind="enum"), dict(kind="string", choices=("a",))):
    with pytest.raises(ValueError, match=r"^Setting 'x': choices go with kind='enum' \(and only "
                                         r"there\)$"):
      config.Setting("x", help="X.", **kw)
  with pytest.raises(ValueError, match=r"^Setting 'test_config_mode': choices \['a', 'd'\] are "
                                       r"not a subset of \('a', 'b', 'c'\)$"):
    MODE.field("a", choices=("a", "d"))
  with pytest.raises(ValueError, match=r"^Setting 'seed': choices \['1'\] are not a subset of "
                                       r"None$"):
    settings.SEED.field(0, choices=("1",))
  with pytest.raises(KeyError, match=r"no setting --stepz is defined \(known: \[.*'steps'"):
    config.get("stepz")


@dataclasses.dataclass(frozen=True)
class Twice:
  loop: settings.LoopConfig = config.section(settings.LoopConfig)
  steps: int = settings.STEPS.field(5)


def test_a_flat_name_twice_and_flags_that_are_not_there():
  with pytest.raises(ValueError, match=r"^Twice: setting 'steps' at steps and loop.steps; flat "
                                       "names must be unique$"):
    config.leaves(Twice)
  with pytest.raises(ValueError, match=r"^define_flags\(Run2\): \['stepz'\] are not its settings "
                                       r"\(expected some of \['steps', "):
    config.define_flags(Run2, only=("stepz",), flag_values=flags.FlagValues())
  with pytest.raises(ValueError, match=r"^define_flags: defaults for \['steps'\], which are not "
                                       "defined here$"):
    config.define_flags(None, "repeats", repeats=3, steps=4, flag_values=flags.FlagValues())


SWITCH = config.setting("test_config_switch", "bool", "A switch.")
NAMES = config.setting("test_config_names", "list", "Names.")
RATE = config.setting("test_config_rate", "float", "A rate.", lower=0)


@dataclasses.dataclass(frozen=True)
class Kinds:
  test_config_switch: bool = SWITCH.field(False)
  test_config_names: tuple = NAMES.field(("a",))
  test_config_rate: float = RATE.field(1.0)
  steps: int = settings.STEPS.field(3)
  dtype: str = settings.DTYPE.field("float32")


@pytest.mark.parametrize("values,message", [
    (dict(steps=None), "--steps=None: unset; expected an integer >= 1"),
    (dict(steps=2.5), "--steps=2.5: not an integer; expected an integer >= 1"),
    (dict(steps=True), "--steps=True: a bool; expected an integer >= 1"),
    (dict(dtype=16), "--dtype=16: an int; expected one of ['float32', 'bfloat16']"),
    (dict(test_config_switch="yes"), "--test_config_switch='yes': a str; expected true or false"),
    (dict(test_config_names=["a", 1]),
     "--test_config_names=['a', 1]: a list; expected a list of strings"),
    (dict(test_config_names=3), "--test_config_names=3: an int; expected a list of strings"),
    (dict(test_config_rate=float("inf")),
     "--test_config_rate=inf: not a finite number; expected a number >= 0"),
    (dict(test_config_rate=float("nan")),
     "--test_config_rate=nan: not a finite number; expected a number >= 0"),
    (dict(test_config_rate=-1), "--test_config_rate=-1.0: out of range; expected a number >= 0"),
])
def test_a_value_of_the_wrong_kind_is_one_line(values, message):
  with pytest.raises(errors.UserError) as e:
    config.build(Kinds, **values)
  assert str(e.value) == message


def test_values_of_each_kind_are_converted():
  run = config.build(Kinds, test_config_switch=True, test_config_names="x, y,", steps=4.0,
                     test_config_rate=2)
  assert run == Kinds(True, ("x", "y"), 2.0, 4, "float32") and isinstance(run.steps, int)
  several = SWITCH.several()
  assert several.check("true,False", "--test_config_switch") == (True, False)
  with pytest.raises(errors.UserError) as e:
    several.check("true,yes", "--test_config_switch")
  assert str(e.value) == "--test_config_switch='yes': not true or false; expected true or false"


def test_numpy_scalars_are_their_python_values():
  """A sweep's np.int64 seed or np.bool_ switch is the number / bool it holds (not refused
  as 'an int64; expected an integer'), and still checked as one."""
  import numpy as np
  run = config.build(Kinds, steps=np.int64(4), test_config_switch=np.bool_(True),
                     test_config_rate=np.float32(0.5), test_config_names=[np.str_("a")])
  assert run == Kinds(True, ("a",), 0.5, 4, "float32")
  assert type(run.steps) is int and type(run.test_config_switch) is bool
  assert type(run.test_config_rate) is float
  with pytest.raises(errors.UserError) as e:
    config.build(Kinds, steps=np.int32(0))
  assert str(e.value) == "--steps=0: out of range; expected an integer >= 1"


def test_config_files_that_are_not_there_or_return_a_config(tmp_path):
  missing = tmp_path / "nope.py"
  with pytest.raises(errors.UserError) as e:
    config.from_flags(Run2, _parsed(f"--config={missing}"))
  assert str(e.value) == f"--config={missing}: no such file; expected a Python or JSON config file"
  # get_config() may return the config itself
  row = tmp_path / "row.py"
  row.write_text("from tests.core.test_config import Run2\n"
                 "def get_config():\n  return Run2(seed=7)\n")
  assert config.read_file(Run2, str(row)) == config.flat(Run2(seed=7))
  assert config.from_flags(Run2, _parsed(f"--config={row}", "--steps=3")) == config.build(
      Run2, seed=7, steps=3)
  for cls, want in ((Kinds, "a Kinds or a dict of its settings"), (None, "a dict of settings")):
    with pytest.raises(errors.UserError) as e:
      config.read_file(cls, str(row))
    assert str(e.value) == f"{row}: get_config() returns a Run2; expected {want}"
  row.write_text("from tests.core.test_config import Inner2\n"
                 "def get_config():\n  return Inner2()\n")
  with pytest.raises(errors.UserError) as e:
    config.read_file(Run2, str(row))
  assert str(e.value) == (f"{row}: get_config() returns an Inner2; expected a Run2 or a dict of "
                          "its settings")
