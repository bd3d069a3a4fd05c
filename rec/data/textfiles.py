"""The data's text files opened for reading bytes: plain or gzip, with named errors.

`open_binary` reads a plain file or a .gz stream (a truncated or damaged stream raises a
UserError naming the file where it is met); `verify_gzip` reads .gz files to their end
before a run needs them; `index_lines` counts a file's lines in one pass and keeps where
its blocks start, so that the byte offset of any line of a plain file costs one block read.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import zlib
from typing import BinaryIO, Sequence

from core.errors import UserError

BLOCK = 1 << 24   # bytes per read of a pass over a whole file


@dataclasses.dataclass(frozen=True)
class LineIndex:
  """Line count of a file and where its blocks start, from one pass (`index_lines`), so
  that the byte offset of any line of a plain file costs one block read."""

  path: str
  lines: int                                 # a last line without its newline counts
  blocks: tuple[tuple[int, int], ...]        # (byte offset, newlines before it) per block

  def offset(self, line: int) -> int:
    """Byte offset where 0-based line `line` starts (`lines`: the end of the file)."""
    if self.path.endswith(".gz"):
      raise UserError(f"{self.path}: a gzip file; expected a plain file to seek in")
    if not 0 <= line <= self.lines:
      raise UserError(f"{self.path}: line {line + 1:,} asked for; expected at most "
                      f"{self.lines:,} lines")
    if line == 0:
      return 0
    # the block holding the line's preceding newline (the `line`-th newline)
    k = max(i for i, (_, before) in enumerate(self.blocks) if before < line)
    pos, before = self.blocks[k]
    with open(self.path, "rb") as f:
      f.seek(pos)
      block = f.read(BLOCK)
    i = -1
    for _ in range(line - before):
      i = block.find(b"\n", i + 1)
      if i < 0:   # the last line, without its newline: it ends the file
        return os.path.getsize(self.path)
    return pos + i + 1


def index_lines(path: str) -> LineIndex:
  """Counts the lines of a plain or .gz file by counting newlines in large blocks (no
  parsing) and remembers where each block starts."""
  total = 0
  pos = 0
  tail = b"\n"
  blocks = []
  with open_binary(path) as f:
    while block := f.read(BLOCK):
      blocks.append((pos, total))
      total += block.count(b"\n")
      pos += len(block)
      tail = block[-1:]
  return LineIndex(os.fspath(path), total + (tail != b"\n"), tuple(blocks))


def open_binary(path: str) -> BinaryIO:
  """Opens `path` for reading bytes, through gzip when its name ends in `.gz` (a damaged or
  truncated stream then raises a UserError naming the file, where it is met)."""
  if str(path).endswith(".gz"):
    return _GzipFile(path, "rb")
  return open(path, "rb", buffering=1 << 20)


def gzip_error(path: str, e: BaseException | None) -> UserError:
  """The one line for a .gz file whose stream cannot be read to its end (e None: the file
  is empty)."""
  if e is None:
    found = "an empty file (0 bytes), not a gzip stream (a download cut before its first byte)"
  elif isinstance(e, EOFError):
    found = "the gzip stream ends before its end marker (a truncated file)"
  else:
    found = f"damaged gzip data ({e})"
  return UserError(f"{path}: {found}; expected a whole .gz file (download or copy it again, "
                   "or check it with `gzip -t`)")


_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


class _GzipFile(gzip.GzipFile):
  """gzip.GzipFile whose read errors (EOFError, zlib.error, BadGzipFile: a truncated or
  damaged stream, none naming the file) are a UserError naming it; a stream read to its
  end is remembered as whole (`verify_gzip` skips it)."""

  def __init__(self, path, mode="rb"):
    st = os.stat(path)
    if st.st_size == 0:   # Python's gzip reads it as an empty stream; `gzip -t` refuses it
      raise gzip_error(os.fspath(path), None)
    self._key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    super().__init__(path, mode)

  def _named(self, read, *args):
    try:
      out = read(*args)
    except _GZIP_ERRORS as e:
      raise gzip_error(self.name, e) from None
    if not out and (not args or args[0] != 0):   # the end of the stream, CRC and length checked
      _GZIP_VERIFIED.add(self._key)
    return out

  def read(self, size=-1):
    return self._named(super().read, size)

  def read1(self, size=-1):
    return self._named(super().read1, size)

  def readline(self, size=-1):
    return self._named(super().readline, size)

  def readlines(self, hint=-1):
    return self._named(super().readlines, hint)

  def peek(self, n):
    return self._named(super().peek, n)


# (path, size, mtime_ns) of .gz files read to their end without error in this process
_GZIP_VERIFIED: set[tuple[str, int, int]] = set()


def verify_gzip(paths: Sequence[str], what: str = "") -> None:
  """Reads every .gz file of `paths` to the end of its stream before it is needed (threads:
  zlib releases the GIL), so a truncated or damaged download stops a run before step 0 with
  the file named, not when training first reaches it. Plain files are skipped; a file
  checked before in this process (same size and mtime) is not read again."""
  todo = []
  for p in dict.fromkeys(os.fspath(p) for p in paths):
    if not p.endswith(".gz"):
      continue
    st = os.stat(p)
    if (os.path.abspath(p), st.st_size, st.st_mtime_ns) not in _GZIP_VERIFIED:
      todo.append((p, st.st_size))
  if not todo:
    return
  size = sum(n for _, n in todo)
  if size > 64 << 20:
    print(f"{what or 'data'}: reading {len(todo)} gzip file(s) ({size / 2**30:.2f} GiB) to "
          "the end before training, to find a truncated one now", flush=True)

  def read_through(p: str) -> None:
    with open_binary(p) as f:
      while f.read(BLOCK):
        pass

  import concurrent.futures
  with concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1, 8)) as pool:
    list(pool.map(read_through, [p for p, _ in todo]))
