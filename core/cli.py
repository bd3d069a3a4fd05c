"""absl entry points: `run(main)` is `app.run(main)` whose help exits 0, after starting the
multi-process runtime when asked (`core.distributed`).

absl prints the help for `--help` / `--helpshort` / `--helpfull` / `--helpxml` and then exits
with status 1, so scripts and CI cannot tell a help request from a failure; `-h` is an
unknown flag there. Every `python -m experiments.<name>` calls `run`: the same help, status
0, and `-h` means `--help`.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from absl import app

from core import distributed

_HELP = ("help", "?", "helpshort", "helpfull", "helpxml")


def asks_for_help(args: Sequence[str]) -> bool:
  """Whether the command-line arguments (program name excluded) request help."""
  for a in args:
    if a == "--":
      return False
    if a.startswith("-"):
      name, _, value = a.lstrip("-").partition("=")
      if name in _HELP and value.lower() not in ("false", "0"):
        return True
  return False


def _parse(argv: list[str]) -> list[str]:
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    if e.code == 1 and asks_for_help(argv[1:]):
      raise SystemExit(0) from None
    raise


def run(main: Callable[[list[str]], object], argv: list[str] | None = None) -> None:
  """`app.run(main)`, with help requests (and `-h`) exiting 0, and the multi-process
  runtime started first (`core.distributed`: its flags are every entry point's). In a
  multi-process run only process 0 prints to stdout; every process keeps stderr."""
  argv = list(sys.argv if argv is None else argv)
  argv = argv[:1] + ["--help" if a == "-h" else a for a in argv[1:]]

  def start(args):
    if distributed.initialize_from_flags() and not distributed.is_primary():
      sys.stdout = open(os.devnull, "w")
    return main(args)

  app.run(start, argv=argv, flags_parser=_parse)
