"""Every paper-table row kept as a config file (experiments/<study>/configs/*.py, a
get_config() as core.config.read_file expects) says how it was run and what it printed, and
replays through --config: its settings resolve to those of the command its docstring gives
(flags parsed and the study's configs built, nothing run)."""

from __future__ import annotations

import ast
import glob
import importlib
import os
import re
import shlex

import pytest
from absl import flags

from core import config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = sorted(os.path.relpath(p, REPO)
              for p in glob.glob(os.path.join(REPO, "experiments", "*", "configs", "*.py")))
FIELDS = ("Command", "Same as", "Hardware", "Time", "Prints")


def _build(study: str, mod, fv):
  """What the study's main builds from its flags before it runs anything."""
  from rec import configs
  if study in ("compare_rec", "mp_embedding", "wukong_scaling", "fp8_probe"):
    return configs.run_from_flags(fv, seed=fv.data_seed)
  if study == "rankitect":
    return configs.run_from_flags(fv, model="dlrm")
  if study == "a2a_compression":
    return configs.run_from_flags(fv, **mod.STUDY)
  if study == "spec_decode":
    return mod.lm_run(fv)
  if study == "wlb_packing":
    cfg = mod.build_config(fv)
    return cfg, mod.lm_run(fv, cfg)
  if study == "cp_model":
    return mod.build_constants(fv)
  return None


def _flag_values(study: str):
  mod = importlib.import_module(f"experiments.{study}.__main__")
  fv = flags.FlagValues()
  mod.define_flags(flag_values=fv)
  return mod, fv


def _resolved(study: str, args: list[str]):
  """(the loose settings' values, the study's built configs) after parsing `args`."""
  mod, fv = _flag_values(study)
  fv(["prog", *args])
  config.apply_file(fv)
  cls = config._declared(fv)["cls"]
  typed = set(config.leaves(cls)) if cls is not None else set()
  values = {n: fv[n].value for n in fv if n not in typed and n != "config"}
  return values, _build(study, mod, fv)


def _fields(doc: str) -> dict[str, str]:
  out, key = {}, None
  for line in doc.splitlines():
    m = re.match(r"^([A-Z][a-z ]+): (.*)$", line)
    if m and m[1] in FIELDS:
      key = m[1]
      out[key] = m[2].strip()
    elif key and line.startswith("  "):
      out[key] += " " + line.strip()
    else:
      key = None
  return out


def _flags(command: str, study: str) -> list[str]:
  words = shlex.split(command)
  at = words.index(f"experiments.{study}")
  assert words[at - 2:at] == ["python", "-m"], command
  return words[at + 1:]


def test_every_study_with_a_paper_table_has_rows():
  studies = {p.split(os.sep)[1] for p in ROWS}
  assert {"cp_model", "wlb_packing", "spec_decode", "scaleacross", "dmt", "recd", "pvf",
          "a2a_compression", "mp_embedding", "compare_rec", "wukong_scaling",
          "exfm", "rankitect", "fp8_probe", "llm_quant", "finetune_lm"} <= studies


@pytest.mark.parametrize("path", ROWS)
def test_a_row_replays_its_command_through_config(path):
  study = path.split(os.sep)[1]
  with open(os.path.join(REPO, path)) as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  fields = _fields(doc or "")
  assert set(FIELDS) <= set(fields), f"{path}: docstring fields {sorted(fields)}"
  assert all(fields[k] for k in FIELDS)
  assert re.search(r"\d", fields["Prints"]), f"{path}: Prints names no number"
  command = _flags(fields["Command"], study)
  assert f"--config={path}" in command
  extra = [a for a in command if not a.startswith("--config=")]
  assert all(a.split("=")[0] in ("--workdir", "--overwrite") for a in extra), extra
  declared = config._declared(_flag_values(study)[1])
  rows = config.read_file(declared["cls"], os.path.join(REPO, path), declared["loose"])
  assert rows, f"{path}: get_config() sets nothing"
  cwd = os.getcwd()
  os.chdir(REPO)   # the files and commands name paths from the repository root
  try:
    via_file = _resolved(study, [f"--config={path}"])
    via_command = _resolved(study, _flags(fields["Same as"], study))
  finally:
    os.chdir(cwd)
  assert via_file == via_command
