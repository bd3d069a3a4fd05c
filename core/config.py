"""Typed run configs, the flags made from them, and a run's settings as a file.

A setting is defined once, as a `Setting`: its flag name, kind, help, choices, bounds and,
for a setting whose value is an object (a `StorageSpec`), how the flag's text becomes the
object and back. A run config is a tree of frozen dataclasses whose leaf fields are
settings (`Setting.field()`); a section is a field holding another config
(`section(Cls)`). Flags are generated from the tree (`define_flags`), one flag per leaf,
named by the setting, so `--batch_size` means the same on every entry point that has it.
Leaf names are unique within a config, so a config is also a flat mapping of names to
values (`flat`, `build`, `replace`).

  @dataclasses.dataclass(frozen=True)
  class TrainSection:
    steps: int = STEPS.field(1000)
    learning_rate: float = LEARNING_RATE.field(0.05)

  @dataclasses.dataclass(frozen=True)
  class Run:
    train: TrainSection = section(TrainSection)

  define_flags(Run)                  # in the entry point's define_flags()
  run = from_flags(Run)              # in main: flags, --config file, defaults
  run.train.steps; flat(run)["steps"]; replace(run, steps=5)

An entry point may define flags for part of a config only (`define_flags(Run,
only=("steps",))`): the fields without a flag keep the dataclass default, or the value the
entry point passes to `from_flags(Run, learning_rate=0.1)` (a study states the settings it
changes, never the ones it keeps).

A run's settings as a file: `--config=FILE` (every entry point built on these configs
defines it) reads a Python file whose `get_config()` returns the config, or a dict of
settings by flat name (the big_vision / ml_collections convention), or a JSON object; flags
given on the command line win over the file, and the file over the defaults.
`write_file` writes the resolved config as such a Python file (the workdir's config.py),
naming any setting where a flag overrode the file; `--config=<workdir>/config.py` replays
the run. absl's `--flagfile=FILE` (one `--flag=value` per line) works as well.

An entry point whose settings are partly loose flags (a study's --seeds, --models beside
its RecRunConfig) names them `define_flags(None, ..., in_config=True)`: its --config file
may set them too (a paper-table row as a file), `apply_file` makes the file's values their
flags' defaults (core.cli.run calls it before main), and a typed config's `from_flags`
reads the same file past them. Per-invocation flags (--workdir, --resume) stay out of it.

Bad settings are one line naming the flag or the file and field, what was found and what
was expected (`core.errors.UserError`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import pprint
import runpy
import sys
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from core import errors

KINDS = ("string", "integer", "float", "bool", "enum", "list")
_REGISTRY: dict[str, "Setting"] = {}
_DEFINED_IN: dict[str, str] = {}   # setting name -> the module that defines it
_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Setting:
  """One setting: the flag `--<name>`, what it holds (`kind`), its help, and checks.

  kind: string | integer | float | bool | enum (one of `choices`) | list (comma-separated
  strings, a tuple in the config). `lower` / `upper` bound a number. `parse` turns the
  flag's text into the value (an object setting; its kind is string) and `format` the
  value back into text (default `str`). `none_ok`: the value may be None (unset).
  `switch`: an enum whose flag is also a switch, (value of `--name`, value of `--noname`),
  e.g. ("full", "none") for `--remat` beside `--remat=dots`."""
  name: str
  kind: str
  help: str
  choices: tuple[str, ...] | None = None
  lower: float | None = None
  upper: float | None = None
  parse: Callable[[str], Any] | None = None
  format: Callable[[Any], str] | None = None
  none_ok: bool = False
  item: "Setting | None" = None   # a list made by `several`: the setting of each value
  switch: tuple[str, str] | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Setting {self.name!r}: kind={self.kind!r}; expected one of {KINDS}")
    if (self.kind == "enum") != (self.choices is not None):
      raise ValueError(f"Setting {self.name!r}: choices go with kind='enum' (and only there)")

  def field(self, default: Any = _MISSING, *, choices: Sequence[str] | None = None) -> Any:
    """A dataclass field holding this setting, with the config's default; `choices` narrows
    an enum's choices for this config (a subset of the setting's)."""
    if choices is not None:
      extra = sorted(set(choices) - set(self.choices or ()))
      if self.kind != "enum" or extra:
        raise ValueError(f"Setting {self.name!r}: choices {list(choices)} are not a subset "
                         f"of {self.choices}")
    meta = {"setting": self, "choices": tuple(choices) if choices is not None else self.choices}
    return dataclasses.field(default=default, metadata=meta)

  def narrowed(self, lower: float | None = None, upper: float | None = None) -> "Setting":
    """This setting with tighter bounds, for an entry point that takes fewer values (its
    flag checks them; name, kind and help stay this setting's)."""
    if (lower is not None and self.lower is not None and lower < self.lower) or (
        upper is not None and self.upper is not None and upper > self.upper):
      raise ValueError(f"Setting {self.name!r}: bounds [{lower}, {upper}] are wider than "
                       f"[{self.lower}, {self.upper}]")
    return dataclasses.replace(self, lower=self.lower if lower is None else lower,
                               upper=self.upper if upper is None else upper)

  def several(self) -> "Setting":
    """This setting as a comma-separated list of its values, for an entry point that runs
    each (`--rows=1000,5000`): kind list, every value checked as this setting checks one."""
    return dataclasses.replace(
        self, kind="list", choices=None, lower=None, upper=None, parse=None, format=None,
        none_ok=False, item=self,
        help=f"{self.help} Several, comma-separated: each is run.")

  def item_value(self, text: Any, where: str) -> Any:
    """One value of a `several` list (flag text or a value) converted and checked."""
    item = self.item
    value = text
    if isinstance(text, str) and item.parse is None:
      try:
        if item.kind == "integer":
          value = int(text) if text.strip().lstrip("+-").isdigit() else float(text)
        elif item.kind == "float":
          value = float(text)
        elif item.kind == "bool":
          value = {"true": True, "false": False}[text.strip().lower()]
      except (ValueError, KeyError):
        raise errors.expected(f"{where}={text!r}", "not true or false" if item.kind == "bool"
                              else "not a number", item._expected()) from None
    return item.check(value, where)

  def flag_text(self, value: Any) -> Any:
    """The value as the flag holds it (an object setting's text; a tuple as a list)."""
    if value is None:
      return None
    if self.parse is not None:
      return (self.format or str)(value)
    if self.kind == "list":
      if self.item is not None:   # `several`: each value as the flag's text holds it
        return [v if isinstance(v, str) else str(self.item.flag_text(v)) for v in value]
      return list(value)
    return value

  def check(self, value: Any, where: str, choices: Sequence[str] | None = None) -> Any:
    """`value` converted to this setting's type and checked; otherwise a UserError
    `<where>=<value>: <what is wrong>; expected <what>`, `where` naming the flag
    ("--steps") or a file and field ("run.py: steps")."""
    def bad(problem: str, want: str | None = None):
      return errors.expected(f"{where}={value!r}", problem,
                             want or self._expected(choices))

    if value is None:
      if self.none_ok:
        return None
      raise bad("unset")
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
      value = value.item()   # a numpy scalar (a sweep's np.int64 seed) as the Python value
    if self.parse is not None:
      if isinstance(value, str):
        try:
          return self.parse(value)
        except ValueError as e:
          raise bad(str(e)) from None
      return value
    kind_of = _a(type(value).__name__)
    if self.kind in ("string", "enum"):
      if not isinstance(value, str):
        raise bad(kind_of)
      allowed = choices if choices is not None else self.choices
      if allowed is not None and value not in allowed:
        raise bad("not a choice")
      return value
    if self.kind == "bool":
      if not isinstance(value, bool):
        raise bad(kind_of, "true or false")
      return value
    if self.kind == "list":
      if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
      if self.item is not None and isinstance(value, (list, tuple)):
        return tuple(self.item_value(v, where) for v in value)
      if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise bad(kind_of, "a list of strings")
      return tuple(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise bad(kind_of)
    if self.kind == "integer":
      if isinstance(value, float):
        if not value.is_integer():
          raise bad("not an integer")
        value = int(value)
    else:
      value = float(value)
      if math.isnan(value) or (not math.isfinite(value) and (
          self.lower is not None or self.upper is not None)):
        raise bad("not a finite number")
    if (self.lower is not None and value < self.lower) or (
        self.upper is not None and value > self.upper):
      raise bad("out of range")
    return value

  def _expected(self, choices: Sequence[str] | None = None) -> str:
    allowed = choices if choices is not None else self.choices
    if allowed is not None:
      return f"one of {list(allowed)}"
    want = {"string": "a string", "integer": "an integer", "float": "a number",
            "bool": "true or false", "list": "a comma-separated list"}[self.kind]
    if self.parse is not None:
      want = self.help.split(".")[0].lower() or want
    bounds = [f">= {self.lower:g}" if self.lower is not None else "",
              f"<= {self.upper:g}" if self.upper is not None else ""]
    bounds = " and ".join(b for b in bounds if b)
    return f"{want} {bounds}".strip()


def setting(name: str, kind: str, help: str, **kw: Any) -> Setting:
  """Defines the setting `name`, once in the project: a second definition of the name is
  an error (`Setting` instances are looked up with `get`)."""
  module = sys._getframe(1).f_globals.get("__name__", "?")
  if name in _REGISTRY and _DEFINED_IN[name] != module:   # (a reloaded module redefines)
    raise ValueError(f"setting --{name} is defined in {_DEFINED_IN[name]} and again in "
                     f"{module}; use core.config.get({name!r})")
  s = Setting(name, kind, help, **kw)
  _REGISTRY[name], _DEFINED_IN[name] = s, module
  return s


def get(name: str) -> Setting:
  """The setting `name` (its defining module must be imported)."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"no setting --{name} is defined (known: {sorted(_REGISTRY)})") from None


def section(cls: type) -> Any:
  """A dataclass field holding a nested config (its defaults)."""
  return dataclasses.field(default_factory=cls, metadata={"section": cls})


@dataclasses.dataclass(frozen=True)
class Leaf:
  """A config leaf: its flat name, path of sections, setting, default and choices."""
  name: str
  path: tuple[str, ...]
  setting: Setting
  default: Any
  choices: tuple[str, ...] | None


def leaves(cls: type) -> dict[str, Leaf]:
  """The leaves of config class `cls` by flat name (unique: an error names a clash)."""
  out: dict[str, Leaf] = {}
  for leaf in _walk(cls, ()):
    if leaf.name in out:
      raise ValueError(f"{cls.__name__}: setting {leaf.name!r} at {'.'.join(leaf.path)} and "
                       f"{'.'.join(out[leaf.name].path)}; flat names must be unique")
    out[leaf.name] = leaf
  return out


def _walk(cls: type, prefix: tuple[str, ...]) -> Iterator[Leaf]:
  for f in dataclasses.fields(cls):
    if "section" in f.metadata:
      yield from _walk(f.metadata["section"], prefix + (f.name,))
    elif "setting" in f.metadata:
      s = f.metadata["setting"]
      if s.name != f.name:
        raise ValueError(f"{cls.__name__}.{f.name}: holds setting --{s.name}; a field is "
                         "named after its setting")
      default = f.default if f.default is not _MISSING else (
          f.default_factory() if f.default_factory is not _MISSING else None)
      yield Leaf(f.name, prefix + (f.name,), s, default, f.metadata["choices"])


def flat(config: Any) -> dict[str, Any]:
  """The config's leaves by flat name."""
  out = {}
  for f in dataclasses.fields(config):
    v = getattr(config, f.name)
    if "section" in f.metadata:
      out.update(flat(v))
    elif "setting" in f.metadata:
      out[f.name] = v
  return out


def build(cls: type, where: str = "", **values: Any) -> Any:
  """A `cls` config from settings by flat name (others at their defaults), each checked;
  an unknown name or a bad value is a UserError naming `where` (a file) or the flag."""
  table = leaves(cls)
  unknown = sorted(set(values) - set(table))
  if unknown:
    raise _unknown(cls, unknown[0], table, where)
  checked = {n: table[n].setting.check(v, _where(where, n, v), table[n].choices)
             for n, v in values.items()}
  return _assemble(cls, (), checked)


def replace(config: Any, where: str = "", **values: Any) -> Any:
  """`config` with the settings in `values` (by flat name) changed, each checked."""
  return build(type(config), where, **{**flat(config), **values})


def _assemble(cls: type, prefix: tuple[str, ...], values: Mapping[str, Any]) -> Any:
  kw = {}
  for f in dataclasses.fields(cls):
    if "section" in f.metadata:
      kw[f.name] = _assemble(f.metadata["section"], prefix + (f.name,), values)
    elif f.name in values:
      kw[f.name] = values[f.name]
  return cls(**kw)


def _a(noun: str) -> str:
  """'a str', 'an int': a type's name with its article, for the messages."""
  return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _where(where: str, name: str, value: Any) -> str:
  del value   # the message gives it once, as found
  return f"{where}: {name}" if where else f"--{name}"


def _unknown(cls: type | None, name: str, table: Mapping[str, Any],
             where: str) -> errors.UserError:
  close = difflib.get_close_matches(name, list(table), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  of = cls.__name__ if cls is not None else "this entry point"
  return errors.expected(f"{where}: {name}" if where else f"--{name}",
                         f"not a setting of {of}{hint}", f"one of {sorted(table)}")


# Flags -------------------------------------------------------------------------------

CONFIG = setting("config", "string",
                 "A run's settings as a file: a Python file whose get_config() returns the "
                 "config or a dict of settings by flag name (a run's workdir keeps its "
                 "resolved config.py), or a JSON object; flags given on the command line win "
                 "over it.", none_ok=True)


def define_flags(cls: type | None = None, *settings_: Setting | str,
                 only: Sequence[str] | None = None, flag_values=None, in_config: bool = False,
                 **defaults: Any) -> None:
  """Defines the absl flags of config class `cls` (each leaf, or the leaves named in
  `only` and in `defaults`), of the loose `settings_` (a Setting or a setting's name), and
  --config when `cls` is given or `in_config`. `in_config`: the --config file may set the
  loose settings too (`apply_file`). `defaults`: the entry point's own defaults by flat
  name. `flag_values`: where (default absl's FLAGS)."""
  from absl import flags
  flags.disclaim_key_flags()   # the flags are the calling entry point's: its --help lists them
  fv = flags.FLAGS if flag_values is None else flag_values
  todo: list[tuple[Setting, Any, tuple[str, ...] | None]] = []
  declared = _declared(fv)
  if in_config:
    declared["loose"].update({s.name: s for s in (get(s) if isinstance(s, str) else s
                                                   for s in settings_)})
    todo.append((CONFIG, None, None))
  if cls is not None:
    declared["cls"] = cls
    table = leaves(cls)
    names = list(table) if only is None else list(only)
    names += [n for n in defaults if n in table and n not in names]
    unknown = sorted(set(names) - set(table))
    if unknown:
      raise ValueError(f"define_flags({cls.__name__}): {unknown} are not its settings "
                       f"(expected some of {list(table)})")
    todo += [(table[n].setting, defaults.pop(n, table[n].default), table[n].choices)
             for n in names]
    todo.append((CONFIG, None, None))
  for s in settings_:
    s = get(s) if isinstance(s, str) else s
    if s.kind == "enum" and s.name not in defaults:
      raise ValueError(f"define_flags: --{s.name} needs a default (an enum has no unset value)")
    todo.append((s, defaults.pop(s.name, None), s.choices))
  if defaults:
    raise ValueError(f"define_flags: defaults for {sorted(defaults)}, which are not defined here")
  for s, default, choices in todo:
    if s.name not in fv:
      define_flag(s, default, choices, fv)


def define_flag(s: Setting, default: Any, choices: Sequence[str] | None, flag_values) -> None:
  """Defines the absl flag of setting `s` with `default` (absl's validation of the kind,
  the choices and the bounds)."""
  from absl import flags
  text = s.flag_text(default)
  kw = dict(help=s.help, flag_values=flag_values)
  if s.switch is not None:
    flags.DEFINE_flag(flags.Flag(_switch_parser(tuple(choices or s.choices), s.switch),
                                 flags.ArgumentSerializer(), s.name, text, s.help,
                                 boolean=True), flag_values)
  elif s.kind == "enum":
    flags.DEFINE_enum(s.name, text, list(choices or s.choices), **kw)
  elif s.kind == "list":
    flags.DEFINE_list(s.name, text, **kw)
    if s.item is not None:   # `several`: each value checked while parsing
      def check_items(values, s=s):
        for v in values or ():
          try:
            s.item_value(v, f"--{s.name}")
          except errors.UserError as e:
            raise flags.ValidationError(str(e).split("=", 1)[1]) from None
        return True
      flags.register_validator(s.name, check_items, flag_values=flag_values)
  elif s.kind == "bool":
    flags.DEFINE_bool(s.name, text, **kw)
  elif s.kind == "integer" and s.parse is None:
    flags.DEFINE_integer(s.name, text, lower_bound=s.lower, upper_bound=s.upper, **kw)
  elif s.kind == "float" and s.parse is None:
    flags.DEFINE_float(s.name, text, lower_bound=s.lower, upper_bound=s.upper, **kw)
  else:
    flags.DEFINE_string(s.name, text, **kw)


def _switch_parser(choices: tuple[str, ...], switch: tuple[str, str]):
  """absl parser of a switch enum: one of `choices`, or a bool's text (`--name` alone is
  "true") for `switch`."""
  from absl import flags

  class SwitchParser(flags.EnumParser):
    def parse(self, argument):
      text = str(argument).lower()
      if text in ("true", "t", "1", "yes"):
        return switch[0]
      if text in ("false", "f", "0", "no"):
        return switch[1]
      return super().parse(argument)

  return SwitchParser(list(choices))


def from_flags(cls: type, flag_values=None, **overrides: Any) -> Any:
  """The `cls` config of the defined flags: each leaf takes, last wins, its dataclass
  default, the flag's default, the --config file's value, the flag given on the command
  line, then `overrides` (the entry point's fixed values). Each value checked, errors
  naming the flag or the file and field."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  table = leaves(cls)
  values: dict[str, Any] = {}
  for name in table:
    if name in fv:
      values[name] = fv[name].value
  path = fv["config"].value if "config" in fv else None
  if path:
    for name, value in read_file(cls, path, _loose(fv)).items():
      if name in table and (name not in fv or not fv[name].present):
        values[name] = value
  values.update(overrides)
  return build(cls, **{n: v for n, v in values.items()})


def command_line_overrides(cls: type, flag_values=None) -> dict[str, Any]:
  """Settings given both in the --config file and on the command line with another
  value: {name: (file's value, flag's value)} (the flag won)."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  path = fv["config"].value if "config" in fv else None
  if not path:
    return {}
  out = {}
  table = leaves(cls)
  for name, value in read_file(cls, path, _loose(fv)).items():
    if name in table and name in fv and fv[name].present:
      given = table[name].setting.check(fv[name].value, _where("", name, fv[name].value),
                                        table[name].choices)
      if given != value:
        out[name] = (value, given)
  return out


# Files -------------------------------------------------------------------------------

def read_file(cls: type | None, path: str,
              extra: Mapping[str, Setting] | Collection[str] = ()) -> dict[str, Any]:
  """The settings of config file `path` by flat name, checked against `cls` (None: no typed
  config) and the loose settings in `extra` (names, or names to the Setting an entry point
  defined, e.g. a `several` one): a Python file whose get_config() returns
  a `cls` config or a dict, or a JSON object. One UserError line naming the file (and line,
  or field) for a file that does not parse, an unknown setting or a value of the wrong
  kind."""
  if not os.path.isfile(path):
    raise errors.expected(f"--config={path}", "no such file", "a Python or JSON config file")
  if path.endswith(".json"):
    try:
      with open(path) as f:
        got = json.load(f)
    except json.JSONDecodeError as e:
      raise errors.expected(f"{path}:{e.lineno}:{e.colno}", e.msg, "a JSON object of settings"
                            ) from None
  else:
    try:
      module = runpy.run_path(path)
      if not callable(module.get("get_config")):
        raise errors.expected(path, "no get_config()", "a function get_config() returning the "
                              "config or a dict of settings")
      got = module["get_config"]()
    except SyntaxError as e:
      raise errors.expected(f"{path}:{e.lineno}:{e.offset}", f"{e.msg}",
                            "a Python file defining get_config()") from None
    except errors.UserError:
      raise
    except Exception as e:   # the file's own code failed (a name undefined, a bad import)
      raise errors.expected(_line_in(path, e), f"{type(e).__name__}: {e}",
                            "a Python file whose get_config() runs") from e
  if dataclasses.is_dataclass(got) and not isinstance(got, type):
    if cls is None or type(got) is not cls:
      want = ("a dict of settings" if cls is None else
              f"{_a(cls.__name__)} or a dict of its settings")
      raise errors.expected(path, f"get_config() returns {_a(type(got).__name__)}", want)
    got = flat(got)
  if not isinstance(got, Mapping):
    raise errors.expected(path, _a(type(got).__name__), "a dict of settings by name")
  table = leaves(cls) if cls is not None else {}
  out = {}
  for name, value in got.items():
    if name in table:
      out[name] = table[name].setting.check(value, f"{path}: {name}", table[name].choices)
    elif name in extra:
      s = extra[name] if isinstance(extra, Mapping) else get(name)
      out[name] = s.check(value, f"{path}: {name}")
    else:
      raise _unknown(cls, name, {**table, **dict.fromkeys(extra)}, path)
  return out


def _line_in(path: str, e: BaseException) -> str:
  """`path:line` of the innermost frame of `e` that runs in the file `path` (else `path`)."""
  where, tb = path, e.__traceback__
  while tb is not None:
    if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
      where = f"{path}:{tb.tb_lineno}"
    tb = tb.tb_next
  return where


def _declared(fv) -> dict[str, Any]:
  """What an entry point declared of its --config file on FlagValues `fv`: the typed config
  class whose leaves it holds ("cls") and the loose settings it may set ("loose"). Kept in
  the FlagValues' own __dict__, where absl keeps its state, so each FlagValues has its own."""
  return fv.__dict__.setdefault("__config_file", {"cls": None, "loose": {}})


def _loose(fv) -> dict[str, Setting]:
  """The loose settings declared in_config whose flags `fv` still holds."""
  return {n: s for n, s in _declared(fv)["loose"].items() if n in fv}


def apply_file(flag_values=None) -> dict[str, tuple[Any, Any]]:
  """The --config file's values of the loose settings declared `in_config` made their
  flags' defaults, so `FLAGS.seeds` reads the file's seeds unless --seeds was given (the
  typed config's leaves come from `from_flags`). Returns {name: (file's, flag's)} of the
  loose settings the command line overrode. Nothing without --config or such settings."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  loose = _loose(fv)
  path = fv["config"].value if "config" in fv else None
  if not path or not loose:
    return {}
  over = {}
  for name, value in read_file(_declared(fv)["cls"], path, loose).items():
    if name not in loose:
      continue
    s = loose[name]
    if fv[name].present:
      given = s.check(fv[name].value, f"--{name}")
      if given != value:
        over[name] = (value, given)
    else:
      fv.set_default(name, s.flag_text(value))
  return over


def write_file(config: Any, path: str, *, command: str = "",
               overridden: Mapping[str, tuple[Any, Any]] | None = None) -> str:
  """Writes `config` as a Python config file (`--config=path` replays it), atomically;
  `command`: the command that made it; `overridden`: settings whose flag overrode the
  --config file ({name: (file's, flag's)}), noted beside them. Returns the path."""
  table = leaves(type(config))
  values = flat(config)
  lines = ['"""The resolved settings of a run.', ""]
  if command:
    lines += ["Made by:", f"  {command}", ""]
  lines += [f"Replay: the same entry point with --config={path} (flags given win).", '"""',
            "", "", "def get_config():", "  return {"]
  for name in table:
    text = _source(_plain(table[name].setting, values[name]))
    note = ""
    if overridden and name in overridden:
      was, now = overridden[name]
      note = f"  # --{name} on the command line; the --config file had {_plain(table[name].setting, was)!r}"
    lines.append(f"      {name!r}: {text},{note}")
  lines += ["  }", ""]
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write("\n".join(lines))
  os.replace(tmp, path)
  return path


def _source(value: Any) -> str:
  """Python source of a config file's value; a float that is not finite as float('inf')
  (its repr, `inf`, would be an undefined name in the file)."""
  if isinstance(value, float) and not math.isfinite(value):
    return f"float('{value}')"
  if isinstance(value, list) and any(isinstance(v, float) for v in value):
    return "[" + ", ".join(_source(v) for v in value) + "]"
  return pprint.pformat(value, width=80)


def _plain(s: Setting, value: Any) -> Any:
  """A value as a config file writes it: an object setting as its text, a tuple as a list."""
  if value is None:
    return None
  if s.parse is not None:
    return (s.format or str)(value)
  return list(value) if isinstance(value, tuple) else value


def to_dict(config: Any) -> dict[str, Any]:
  """The config as JSON-able nested dicts (object settings as their text), e.g. for
  results.json."""
  out = {}
  for f in dataclasses.fields(config):
    v = getattr(config, f.name)
    if "section" in f.metadata:
      out[f.name] = to_dict(v)
    elif "setting" in f.metadata:
      out[f.name] = _plain(f.metadata["setting"], v)
  return out
