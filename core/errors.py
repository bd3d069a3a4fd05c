"""Errors that a person fixes by changing the input or a setting, not the code.

`UserError` carries one line that names where the problem is (a file and line or row, or
the flag), what was found and what was expected:

  <file>:<line or row>: <what was found>; expected <what>
  --flag=<value>: <what is wrong>; expected <what>

`core.cli.run` prints it as `error: <message>` at the end of the output and exits with
status 2, without a traceback (`--verbose_errors` shows it). It is a ValueError, so code
that catches ValueError keeps working, and it pickles with its message, so an error
raised in a Grain or multiprocessing worker reaches the main process intact.
"""

from __future__ import annotations


class UserError(ValueError):
  """Bad input data or settings; the message says where, what was found and what was
  expected."""


def expected(where: str, found: str, want: str) -> UserError:
  """`UserError('<where>: <found>; expected <want>')`, the one shape of these messages."""
  return UserError(f"{where}: {found}; expected {want}")
