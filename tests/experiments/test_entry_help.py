"""Every `python -m experiments.<name>` answers --help (and -h) with its flags and status 0."""

import os
import sys

import pytest

from core import cli

from tests.experiments.entry import ENTRY_POINTS, MODULES, REPO
from tests import forkserver


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_exits_zero(name):
  out = forkserver.run([sys.executable, "-m", f"experiments.{name}", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert f"experiments.{name}" in out.stdout or "flags:" in out.stdout
  assert "--" in out.stdout and "Try --helpfull" in out.stdout


@pytest.mark.parametrize("name", ["train_rec", "train_lm"])
def test_checkpoint_cadences_in_help(name):
  """Both checkpoint cadences: every N steps (0: only at the end) and every N minutes
  (default 10, 0: off)."""
  out = forkserver.run([sys.executable, "-m", f"experiments.{name}", "--helpshort"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  text = " ".join(out.stdout.split())
  assert out.returncode == 0
  assert "--checkpoint_every: Checkpoint every N steps (0: only at the end)." in text
  assert ("--checkpoint_every_minutes: Also checkpoint once this many minutes have passed "
          "since the last checkpoint (0: off). (default: '10.0') (a non-negative number)"
          ) in text, text


def test_short_h_and_errors_keep_their_status():
  h = forkserver.run([sys.executable, "-m", "experiments.cp_model", "-h"], cwd=REPO,
                     capture_output=True, text=True, timeout=300)
  assert h.returncode == 0 and "--workdir" in h.stdout
  bad = forkserver.run([sys.executable, "-m", "experiments.cp_model", "--no_such_flag"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "no_such_flag" in bad.stderr   # a settings error


def test_asks_for_help():
  assert cli.asks_for_help(["--help"]) and cli.asks_for_help(["--steps=3", "--helpfull"])
  assert cli.asks_for_help(["-?"]) and cli.asks_for_help(["--help=true"])
  assert not cli.asks_for_help(["--help=false"]) and not cli.asks_for_help(["--steps=3"])
  assert not cli.asks_for_help(["--", "--help"])


def test_entry_points_import_together():
  """Tests import entry points side by side: none may define flags on import (several share
  names such as --workdir), so each defines them in `define_flags()` when run as a script;
  nor may the library (core.train, core.cli, rec.configs ...): the entry point that reads a
  flag defines it (`cli.run` the ones every entry point has)."""
  code = ("import importlib, sys\n"
          "import core.train, core.cli, core.distributed, rec.configs, rec.runs, llm.train_lib\n"
          f"for m in {MODULES!r}:\n"
          "  importlib.import_module(m)\n"
          "from absl import flags\n"
          "mine = [m for m in flags.FLAGS.flags_by_module_dict()\n"
          "        if m.split('.')[0] in ('experiments', 'core', 'rec', 'llm', 'kernels')]\n"
          "assert not mine, mine\n")
  out = forkserver.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
