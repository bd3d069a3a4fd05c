"""absl entry points: `run(main)` is `app.run(main)` whose help exits 0, whose user errors end
in one line, after starting the multi-process runtime when asked (`core.distributed`).

absl prints the help for `--help` / `--helpshort` / `--helpfull` / `--helpxml` and then exits
with status 1, so scripts and CI cannot tell a help request from a failure; `-h` is an
unknown flag there. Every `python -m experiments.<name>` calls `run`: the same help, status
0, and `-h` means `--help`.

Errors: a data or settings error (`core.errors.UserError`, a ValueError raised by the
project's own code, a missing or unreadable file, `sys.exit("message")`, or a flag that is
unknown or whose value its flag refuses while parsing) ends the run
with the one line `error: <message>` as the last line on stderr and exit status 2; the
traceback (Grain's and JAX's frames included) only with `--verbose_errors`. Anything else
is a bug and keeps its traceback. In a multi-process run the failing process tells the
others first (`distributed.report_failure`), so they end with a line naming it instead of
waiting for the heartbeat timeout; an unexpected error there (a collective whose peer
died) prints its traceback and then one line naming the processes gone silent and each
one's last step, and the process ends without jax's shutdown barrier. Known noise is
dropped: jax's "Unable to initialize backend 'tpu'" log line and the multiprocessing
resource tracker's "leaked semaphore / shared_memory" warnings after a killed or failed
run (the tracker still removes what they name).

A run stopped on request (an exception with an integer `exit_status`: `core.train.Interrupted`
after SIGTERM / SIGINT) ends with its message as the last line and that status (128 + the
signal's number), without a traceback.

The workdir: an entry point whose --workdir flag is set holds its lock (`core.workdir.claim`:
one run per workdir) from before `main` to exit; a --workdir that is an existing file or
cannot be written (a read-only mount) is refused there in one line, before any work.
"""

from __future__ import annotations

import gc
import logging as py_logging
import os
import sys
import traceback
from typing import Callable, Sequence

from absl import app, flags, logging

from core import config
from core import distributed
from core import errors
from core import workdir as workdir_lib

FLAGS = flags.FLAGS
_HELP = ("help", "?", "helpshort", "helpfull", "helpxml")
USER_ERROR_STATUS = 2
# Directories of the project's own code: a ValueError raised by a `raise` there is a
# message written for the user (config validation, readers), one raised inside jax or
# numpy is not.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN = tuple(os.path.join(_ROOT, d) + os.sep for d in ("core", "rec", "llm", "kernels",
                                                      "experiments"))
_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
# The resource tracker (a process of its own) inherits the -W options of sys.warnoptions.
_TRACKER_WARNINGS = "ignore::UserWarning:multiprocessing.resource_tracker"


def define_flags(flag_values=FLAGS) -> None:
  """The flags every entry point has (`run` defines them before parsing): --verbose_errors
  and those of the multi-process runtime (`core.distributed`)."""
  distributed.define_flags(flag_values)
  if "verbose_errors" not in flag_values:
    flags.DEFINE_bool("verbose_errors", False, "On a data or settings error, print the "
                      "traceback (Grain's and JAX's internal frames included) before the "
                      "one-line message.", flag_values=flag_values)


def quiet_library_logs() -> None:
  """Library INFO logs (orbax, jax) drown an entry point's progress lines: WARNING and up
  unless --verbosity was given."""
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


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
  """The flags parsed (absl's FLAGS(argv)); a flag that is unknown or has a bad value is a
  settings error like any other: one `error: ...` line and status 2 (absl's own parser
  prints two lines, `FATAL Flags parsing error: ...` and a pointer to the help, and exits 1,
  as a bug would)."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_STATUS)
  except SystemExit as e:
    if e.code == 1 and asks_for_help(argv[1:]):
      raise SystemExit(0) from None
    raise


def _innermost_frame(e: BaseException):
  tb = e.__traceback__
  if tb is None:
    return None
  while tb.tb_next is not None:
    tb = tb.tb_next
  return tb


def is_user_error(e: BaseException) -> bool:
  """Whether `e` is a data or settings error whose message is the whole story: a
  UserError, a ValueError raised by a `raise` statement in the project's code, or a
  missing / unreadable path (an OSError naming the file)."""
  if isinstance(e, errors.UserError):
    return True
  if isinstance(e, _PATH_ERRORS):   # a path the run was given that is not there / readable
    return getattr(e, "filename", None) is not None
  if not isinstance(e, ValueError):
    return False
  tb = _innermost_frame(e)
  if tb is None:
    return False
  path = os.path.abspath(tb.tb_frame.f_code.co_filename)
  if not path.startswith(_OWN):
    return False
  import linecache
  return linecache.getline(path, tb.tb_lineno).lstrip().startswith("raise")


def error_line(e: BaseException) -> str:
  """`error: <message>` with the message's own text (no Grain / jax notes)."""
  if isinstance(e, _PATH_ERRORS) and getattr(e, "filename", None) is not None:
    return f"error: {e.filename}: {e.strerror or type(e).__name__}"
  text = str(e.args[0]) if len(e.args) == 1 else str(e)
  return f"error: {text}"


class _DropBackendNoise(py_logging.Filter):
  """jax logs every platform it could not start (`Unable to initialize backend 'tpu'`)
  at INFO on machines with a plugin installed; the backend it did start is what matters."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return not str(record.getMessage()).startswith("Unable to initialize backend")


def quiet_known_noise() -> None:
  """Drops the log lines and warnings that say nothing about the run (module docstring)."""
  if _TRACKER_WARNINGS not in sys.warnoptions:
    sys.warnoptions.append(_TRACKER_WARNINGS)
  log = py_logging.getLogger("jax._src.xla_bridge")
  if not any(isinstance(f, _DropBackendNoise) for f in log.filters):
    log.addFilter(_DropBackendNoise())


def _end_with_error(line: str, status: int = USER_ERROR_STATUS) -> None:
  """Prints `line` last, tells the other processes of a multi-process run, and exits with
  `status`."""
  sys.stdout.flush()
  gc.collect()   # iterators of worker processes clean up now, not after the line
  print(line, file=sys.stderr, flush=True)
  distributed.report_failure(line, status=status)   # ends this process in a multi-process run
  sys.exit(status)


def run(main: Callable[[list[str]], object], argv: list[str] | None = None) -> None:
  """`app.run(main)`, with help requests (and `-h`) exiting 0, user errors ending in one
  line and status 2, and the multi-process runtime started first (`core.distributed`: its
  flags are every entry point's). In a multi-process run only process 0 prints to stdout;
  every process keeps stderr."""
  argv = list(sys.argv if argv is None else argv)
  argv = argv[:1] + ["--help" if a == "-h" else a for a in argv[1:]]
  quiet_known_noise()
  define_flags()

  def start(args):
    line, status = None, USER_ERROR_STATUS
    try:
      if distributed.initialize_from_flags() and not distributed.is_primary():
        sys.stdout = open(os.devnull, "w")
      over = config.apply_file(FLAGS)   # a --config file's loose settings (a study's row)
      if over:
        print(f"--config={FLAGS.config}: overridden by the command line: " + ", ".join(
            f"--{n}={now!r} (file: {was!r})" for n, (was, now) in over.items()), flush=True)
      if "workdir" in FLAGS and isinstance(FLAGS["workdir"].value, str) and FLAGS.workdir:
        workdir_lib.claim(FLAGS.workdir)   # process 0 of a multi-process run
      return main(args)
    except SystemExit as e:
      if not isinstance(e.code, str):
        raise
      line = e.code if e.code.startswith("error: ") else f"error: {e.code}"
    except KeyboardInterrupt:
      distributed.report_failure("error: interrupted (KeyboardInterrupt)", exit_process=False)
      raise
    except Exception as e:
      if isinstance(getattr(e, "exit_status", None), int):   # stopped on request
        line, status = str(e), e.exit_status
      elif not is_user_error(e):
        if not distributed.multi_process():
          raise
        # Several processes: the traceback, then one line that names the processes gone
        # silent (a failed collective is often a peer that died) and every last step; then
        # this process ends without jax's shutdown barrier, which would wait for the dead.
        distributed.settle()
        traceback.print_exception(e)
        line = distributed.failure_line(f"error: {type(e).__name__}: {e}".splitlines()[0])
        status = 1
      else:
        if FLAGS.verbose_errors:
          traceback.print_exception(e)
        line, status = error_line(e), USER_ERROR_STATUS
    # outside the except clause: the exception and its frames are gone before the line
    _end_with_error(line, status)

  app.run(start, argv=argv, flags_parser=_parse)
