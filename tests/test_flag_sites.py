"""Each flag name is defined at one site across experiments/ and the library.

A site: a `core.config.setting("name", ...)` call, an absl `flags.DEFINE_*("name", ...)`
call, or an entry `"name": (flags.DEFINE_*, ...)` of a table of flag specs. Read from the
source (ast), so a flag an entry point defines only when it runs is counted too.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRS = ("core", "rec", "llm", "kernels", "experiments")
# Names with two sites, and why (WORKSPACE_NOTES "Settings and flags" says the same).
TWO_SITES: dict[str, str] = {
    "batch_size": "experiments.predict's --batch_size takes 0 (the run's --eval_batch_size), "
                  "below the shared setting's bound of 1",
}


def flag_sites(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
  sites: dict[str, list[str]] = collections.defaultdict(list)
  for d in DIRS:
    for path in sorted((root / d).rglob("*.py")):
      tree = ast.parse(path.read_text(), str(path))
      where = lambda node: f"{path.relative_to(root)}:{node.lineno}"
      for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
          f = node.func
          name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
          if name.startswith("DEFINE") or name == "setting":
            sites[node.args[0].value].append(where(node))
        if isinstance(node, ast.Dict):
          for k, v in zip(node.keys, node.values):
            if (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and v.elts
                and isinstance(v.elts[0], ast.Attribute)
                and v.elts[0].attr.startswith("DEFINE")):
              sites[k.value].append(where(k))
  return sites


def test_every_flag_name_has_one_definition_site():
  sites = flag_sites()
  assert len(sites) > 200   # the scan sees the entry points' flags
  repeated = {n: s for n, s in sites.items() if len(s) > 1}
  unexplained = {n: s for n, s in repeated.items()
                 if n not in TWO_SITES or len(s) > 2}
  assert not unexplained, "\n".join(f"--{n}: {' '.join(s)}" for n, s in sorted(unexplained.items()))
  assert len(TWO_SITES) <= 3


def test_the_scan_counts_each_kind_of_site(tmp_path):
  (tmp_path / "core").mkdir()
  (tmp_path / "core" / "a.py").write_text(
      'from absl import flags\nfrom core import config\n'
      'flags.DEFINE_integer("x", 1, "")\nconfig.setting("x", "integer", "")\n'
      'T = {"y": (flags.DEFINE_string, {}, "")}\n')
  for d in DIRS[1:]:
    (tmp_path / d).mkdir()
  got = flag_sites(tmp_path)
  assert {n: len(s) for n, s in got.items()} == {"x": 2, "y": 1}
