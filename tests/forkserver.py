"""`python -m <module>` for the tests without paying the imports each time: drop-ins for
`subprocess.run` and `subprocess.Popen` whose runs of the project's entry points are forked
from a process that has already imported them.

The suite starts hundreds of entry-point processes; each spends about 2.5 s importing jax,
flax, orbax and the project before it does any work. `run(cmd, ...)` and `Popen(cmd, ...)`
take `subprocess`'s arguments; when `cmd` is `[sys.executable, "-m", module, *args]` (or
`-c code` when asked with fork=True: such code may check what a fresh interpreter has
imported) they ask a server process, started once per pytest worker and environment, to
fork a child that runs the module as `python -m` would (`runpy`, `sys.argv`, `__main__`,
the given cwd, environment, stdin / stdout / stderr, session and exit status; threads
joined and `atexit` handlers run at the end). The server imported every entry point's
module but touched no device, so a child sets up its own backend from its own `XLA_FLAGS`
(the number of simulated devices, say). The server holds one thread besides its own
(OpenBLAS's pool, which re-creates itself after fork).

Variables read when jax and the libraries are imported (`JAX_*`, `PYTHON*`, `TF_*`,
thread-count variables ...) are part of a server's identity: a run with other values gets
a server of its own. Anything else falls back to `subprocess`: other interpreters, other
arguments (preexec_fn, pass_fds ...), or `FORKSERVER=0` in the environment (every process
fresh).

The children are real processes (a pid, signals, process groups, exit status, their own
children); pipes are FIFOs, so `select` and `readline` behave as with `subprocess`. Each
child dies with its server (PR_SET_PDEATHSIG) and the server with its pytest worker.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Variables a library reads when it is imported (or the interpreter at start): a server
# imported everything under its own values, so they must match the run's.
_IMPORT_TIME = ("JAX_", "XLA_PYTHON", "TF_", "PYTHON", "OMP_", "OPENBLAS_", "MKL_", "LD_",
                "CUDA", "TPU_", "GRAIN_", "ABSL_", "TENSORSTORE_")


def _import_key(env: dict[str, str]) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME)))


# --------------------------------------------------------------------------- the client

class _Server:
  """One server process: requests in, `{"pid"}` and `{"exit", "returncode"}` lines out."""

  def __init__(self, env: dict[str, str]):
    self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=REPO,
                                 env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 bufsize=0)
    self.pending = b""
    self.exits: dict[int, int] = {}
    ready = self._line(None)
    if ready != "ready":
      raise RuntimeError(f"tests/forkserver.py did not start: {ready!r}")

  def alive(self) -> bool:
    return self.proc.poll() is None

  def _line(self, timeout: float | None) -> str | None:
    """The next line (unbuffered reads, so a waiting line never hides in a buffer from
    select); None after `timeout` seconds."""
    fd = self.proc.stdout.fileno()
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in self.pending:
      left = None if deadline is None else max(deadline - time.monotonic(), 0)
      ready, _, _ = select.select([fd], [], [], left)
      if not ready:
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        raise RuntimeError("tests/forkserver.py ended")
      self.pending += chunk
    line, self.pending = self.pending.split(b"\n", 1)
    return line.decode()

  def _message(self, timeout: float | None) -> dict | None:
    line = self._line(timeout)
    if line is None:
      return None
    msg = json.loads(line)
    if "exit" in msg:
      self.exits[msg["exit"]] = msg["returncode"]
    return msg

  def spawn(self, request: dict) -> int:
    self.proc.stdin.write((json.dumps(request) + "\n").encode())
    self.proc.stdin.flush()
    while True:
      msg = self._message(None)
      if "pid" in msg:
        return msg["pid"]

  def wait(self, pid: int, timeout: float | None) -> int | None:
    """The child's exit status, or None if it is still running after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while pid not in self.exits:
      left = None if deadline is None else max(deadline - time.monotonic(), 0)
      if self._message(left) is None:
        return None
    return self.exits.pop(pid)


_servers: dict[tuple, _Server] = {}


def _server(env: dict[str, str]) -> _Server:
  key = _import_key(env)
  server = _servers.get(key)
  if server is None or not server.alive():
    server = _servers[key] = _Server(env)
  return server


@atexit.register
def _close() -> None:
  for server in _servers.values():
    if server.alive():
      server.proc.stdin.close()
      try:
        server.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        server.proc.kill()


_STREAMS = {"stdin": (None, subprocess.DEVNULL), "stdout": (None, subprocess.DEVNULL,
            subprocess.PIPE), "stderr": (None, subprocess.DEVNULL, subprocess.PIPE,
                                         subprocess.STDOUT)}
_KNOWN = {"cwd", "env", "text", "universal_newlines", "start_new_session", "stdin", "stdout",
          "stderr"}


def _forkable(cmd, fork, kwargs, known=_KNOWN) -> bool:
  if os.environ.get("FORKSERVER", "1") == "0" or not isinstance(cmd, (list, tuple)):
    return False
  if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] not in ("-m", "-c"):
    return False
  if fork is None:   # `-c` code may check what a fresh interpreter imports: only when asked
    fork = cmd[1] == "-m" and cmd[2] != "pytest"
  if not fork or set(kwargs) - known:
    return False
  for name, allowed in _STREAMS.items():
    value = kwargs.get(name)
    if value not in allowed and not (name != "stdin" and hasattr(value, "fileno")):
      return False
  return True


def _target(value, fd: int, tmp: str, name: str):
  """Where the child's stream goes (a path it opens) and the read end kept here, if any."""
  if value is None:   # inherited: this process's own stream, by its /proc path
    return f"/proc/{os.getpid()}/fd/{fd}", None
  if value == subprocess.DEVNULL:
    return os.devnull, None
  if value == subprocess.STDOUT:
    return "stdout", None
  if value == subprocess.PIPE:
    path = os.path.join(tmp, name)
    os.mkfifo(path)
    return path, os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # open before the writer
  return f"/proc/{os.getpid()}/fd/{value.fileno()}", None


class Popen:
  """`subprocess.Popen` for a forked `python -m` run (see `popen`): pid, poll, wait,
  send_signal / terminate / kill, communicate, stdout / stderr pipes, returncode."""

  def __init__(self, cmd, *, stdin=None, stdout=None, stderr=None, cwd=None, env=None,
               text=False, universal_newlines=False, start_new_session=False,
               input_path: str | None = None):
    self.args = list(cmd)
    self.returncode: int | None = None
    self._text = bool(text or universal_newlines)
    env = dict(os.environ if env is None else env)
    self._server = _server(env)
    tmp = tempfile.mkdtemp(prefix="forkserver_")
    try:
      # stdin: the given input, else /dev/null (what pytest's capture leaves on fd 0; the
      # worker's own fd 0 may be its channel to the pytest process)
      targets = {"stdin": input_path or os.devnull}
      ends = {}
      for name, value, fd in (("stdout", stdout, 1), ("stderr", stderr, 2)):
        targets[name], ends[name] = _target(value, fd, tmp, name)
      self.pid = self._server.spawn({
          "argv": self.args[1:], "env": env, "cwd": os.path.abspath(cwd or "."),
          "new_session": bool(start_new_session), **targets})
    finally:
      for name in ("stdout", "stderr"):
        path = os.path.join(tmp, name)
        if os.path.exists(path):
          os.unlink(path)   # both ends are open by now
      os.rmdir(tmp)
    self.stdin = None
    self._chunks: dict[int, list[bytes]] = {}
    self.stdout, self.stderr = (self._reader(ends[n]) for n in ("stdout", "stderr"))

  def _reader(self, fd):
    if fd is None:
      return None
    os.set_blocking(fd, True)
    return open(fd, "r" if self._text else "rb", closefd=True)

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = self._server.wait(self.pid, 0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      self.returncode = self._server.wait(self.pid, timeout)
      if self.returncode is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, sig)

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)

  def communicate(self, input=None, timeout: float | None = None):
    """Reads stdout / stderr to their ends, then waits (`subprocess.Popen.communicate`)."""
    if input is not None:
      raise ValueError("forkserver.Popen has no stdin pipe: use run(..., input=...)")
    deadline = None if timeout is None else time.monotonic() + timeout
    streams = [s for s in (self.stdout, self.stderr) if s is not None and not s.closed]
    chunks = self._chunks   # kept across a timeout, as subprocess does
    for s in streams:
      chunks.setdefault(id(s), [])
    while streams:
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        raise subprocess.TimeoutExpired(self.args, timeout)
      ready, _, _ = select.select(streams, [], [], left)
      for s in ready:
        data = os.read(s.fileno(), 65536)
        if data:
          chunks[id(s)].append(data)
        else:
          streams.remove(s)
    self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))

    def joined(s):
      if s is None:
        return None
      raw = b"".join(chunks.get(id(s), []))
      s.close()
      return raw.decode(errors="replace") if self._text else raw

    return joined(self.stdout), joined(self.stderr)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for s in (self.stdout, self.stderr):
      if s is not None:
        s.close()
    self.wait()


def popen(cmd, *, fork: bool | None = None, **kwargs):
  """`subprocess.Popen(cmd, **kwargs)`, forked from a server (a `Popen` here) when it can be
  (the module docstring)."""
  if not _forkable(cmd, fork, kwargs):
    return subprocess.Popen(cmd, **kwargs)
  return Popen(cmd, **kwargs)


def run(cmd, *, fork: bool | None = None, **kwargs) -> subprocess.CompletedProcess:
  """`subprocess.run(cmd, **kwargs)`; forked from a server when it can be (the module
  docstring). fork=False: always a fresh process."""
  run_only = {"capture_output", "timeout", "input", "check"}
  if not _forkable(cmd, fork, kwargs, _KNOWN | run_only):
    return subprocess.run(cmd, **kwargs)
  timeout, data, check = kwargs.pop("timeout", None), kwargs.pop("input", None), \
      kwargs.pop("check", False)
  if kwargs.pop("capture_output", False):
    kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
  with tempfile.TemporaryDirectory(prefix="forkrun_") as tmp:
    input_path = None
    if data is not None:
      input_path = os.path.join(tmp, "stdin")
      with open(input_path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    proc = Popen(cmd, input_path=input_path, **kwargs)
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
  result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
  if check:
    result.check_returncode()
  return result


# --------------------------------------------------------------------------- the server

def _die_with_parent() -> None:
  try:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
  except OSError:
    pass


def _forget_settings(module: str) -> None:
  """Drops the settings `module` defined on import from core.config's registry, so that
  running it as __main__ defines them once, as in a fresh process."""
  config = sys.modules.get("core.config")
  if config is not None:
    for name in [n for n, m in config._DEFINED_IN.items() if m == module]:
      del config._REGISTRY[name], config._DEFINED_IN[name]


def _child(request: dict, ready_fd: int) -> None:
  """In the forked child: becomes `python <argv>` and never returns."""
  code = 1
  try:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _die_with_parent()
    if request["new_session"]:
      os.setsid()
    opened = {}
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY | os.O_APPEND),
                            (2, "stderr", os.O_WRONLY | os.O_APPEND)):
      if request[name] == "stdout":
        os.dup2(1, 2)
        continue
      opened[name] = os.open(request[name], flags)
      os.dup2(opened[name], fd)
      os.close(opened[name])
    os.write(ready_fd, b"x")
    os.close(ready_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]
    argv = request["argv"]
    import runpy
    try:
      if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        # Run as __main__ from its file, as a fresh `python -m` does (the server's import of
        # the module stays with the modules that imported it).
        for name in (argv[1], argv[1] + ".__main__"):
          sys.modules.pop(name, None)
          _forget_settings(name)
        runpy._run_module_as_main(argv[1], alter_argv=True)   # what `python -m` calls
      else:
        sys.argv = ["-c", *argv[2:]]
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
      code = 0
    except SystemExit as e:
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:   # as the interpreter does for an uncaught exception
      import traceback
      traceback.print_exc()
      code = 1
    threading._shutdown()   # join non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001 (a closed stream)
        pass
    os._exit(code)


def _serve() -> None:
  _die_with_parent()
  import importlib
  from tests.experiments import entry
  for module in entry.MODULES:
    try:
      importlib.import_module(module)
    except Exception:  # noqa: BLE001 (an optional dependency: the child imports it itself)
      pass
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  out = os.dup(1)
  os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # nothing but replies on the protocol pipe

  def reply(msg: dict) -> None:
    os.write(out, (json.dumps(msg) + "\n").encode())

  def reap() -> None:
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        return
      reply({"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})

  os.write(out, b"ready\n")
  buf = b""
  while True:
    ready, _, _ = select.select([0, wake_r], [], [])
    if wake_r in ready:
      os.read(wake_r, 4096)
      reap()
    if 0 in ready:
      data = os.read(0, 65536)
      if not data:
        return
      buf += data
      while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        request = json.loads(line)
        sys.stderr.flush()
        sync_r, sync_w = os.pipe()
        pid = os.fork()
        if pid == 0:
          os.close(sync_r)
          for fd in (wake_r, wake_w, out):
            os.close(fd)
          _child(request, sync_w)
        os.close(sync_w)
        os.read(sync_r, 1)   # its streams are open (or it died: b"")
        os.close(sync_r)
        reply({"pid": pid})
    reap()


if __name__ == "__main__":
  _serve()
