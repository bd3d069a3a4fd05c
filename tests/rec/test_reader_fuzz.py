"""Fuzzing the line readers (Criteo, Avazu, CSV, libFM, libFFM) against strict references.

Each reference below decodes one line at a time in plain Python (re, int, float, zlib.crc32,
datetime), written from the module docstrings and sharing no code with the readers. Files are
built from valid lines, some of them mutated (truncated, fields dropped or added, values
replaced by bad numbers, stray '\\r', NUL and non-UTF-8 bytes, huge or negative values,
empty and blank lines, a line split in two, separators changed), with LF or CRLF endings, with
or without a final newline, plain or gzip, in one or two files, read in small or large chunks.
For every file the reader must either return exactly the reference's rows or raise a
ValueError naming file:line of the first bad line (`bad_lines="error"`), and return exactly
the good rows with the reference's bad-line count (`bad_lines="skip"`); any other exception,
or any other rows, fails. Seeded: the same cases every run.
"""

from __future__ import annotations

import datetime
import gzip
import math
import os
import re
import zlib

import numpy as np
import pytest

from rec.data import avazu, criteo, csv_data, libfm

# --- file lines exactly as the readers split them ------------------------------------------


def split_lines(data: bytes) -> list[bytes]:
  """A file's lines as `readlines` gives them: each ends at '\\n'; a last piece without one
  is a line when it is not empty."""
  parts = data.split(b"\n")
  return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def line_text(line: bytes) -> bytes:
  """The line without its ending: one '\\n', then one '\\r'."""
  line = line[:-1] if line.endswith(b"\n") else line
  return line[:-1] if line.endswith(b"\r") else line


def log1p_f32(x: float) -> float:
  return float(np.float32(math.log1p(max(x, 0.0))))


def number(text: bytes, max_bytes: int) -> float | None:
  """Python float syntax, finite, at most `max_bytes` bytes, no NUL; None otherwise."""
  if len(text) > max_bytes or b"\0" in text:
    return None
  try:
    x = float(text)
  except ValueError:
    return None
  return x if math.isfinite(x) else None


# A decoded row: (label, dense values, ids, weights); None for a bad line.

# --- Criteo ----------------------------------------------------------------------------------

CRITEO_ROWS = [2, 3, 17, 1000, 99_991] + [40 + 13 * i for i in range(21)]


def ref_criteo(line: bytes):
  f = line_text(line).split(b"\t")
  if len(f) != 40 or f[0] not in (b"0", b"1"):
    return None
  dense = []
  for x in f[1:14]:
    if x and not re.fullmatch(rb"-?[0-9]{1,18}", x):
      return None
    dense.append(log1p_f32(float(int(x))) if x else 0.0)
  ids = []
  for x, r in zip(f[14:], CRITEO_ROWS):
    if not re.fullmatch(rb"[0-9a-fA-F]{0,8}", x):
      return None
    ids.append(1 + int(x, 16) % (r - 1) if x else 0)
  return float(f[0] == b"1"), dense, ids, None


def gen_criteo(rng) -> bytes:
  ints = []
  for _ in range(13):
    k = rng.integers(0, 6)
    ints.append("" if k == 0 else str(int(rng.integers(-50, 50))) if k < 3 else
                str(int(rng.integers(0, 10 ** int(rng.integers(1, 19))))))
  cats = []
  for _ in range(26):
    v = "" if rng.random() < 0.15 else f"{int(rng.integers(0, 2**32)):x}"[:int(rng.integers(1, 9))]
    cats.append(v.upper() if rng.random() < 0.2 else v)
  return "\t".join([str(int(rng.integers(0, 2)))] + ints + cats).encode()


def criteo_source(files, bad_lines, chunk_bytes):
  return criteo.CriteoSource(files, 3, CRITEO_ROWS, bad_lines=bad_lines, repeat=False,
                             drop_remainder=False, chunk_bytes=chunk_bytes)


# --- Avazu -----------------------------------------------------------------------------------

AVAZU_HEADER = ",".join(avazu.COLUMNS).encode()
AVAZU_ROWS = [25, 8] + [2, 5, 1000, 99_991] + [30 + 7 * i for i in range(17)]


def ref_avazu(line: bytes):
  f = line_text(line).split(b",")
  if len(f) != 24 or f[1] not in (b"0", b"1"):
    return None
  hour = f[2]
  if hour:
    if not re.fullmatch(rb"[0-9]{8}", hour):
      return None
    yy, mm, dd, hh = (int(hour[i:i + 2]) for i in range(0, 8, 2))
    try:
      day = datetime.date(2000 + yy, mm, dd)
    except ValueError:
      return None
    if hh > 23:
      return None
    ids = [1 + hh % (AVAZU_ROWS[0] - 1), 1 + day.weekday() % (AVAZU_ROWS[1] - 1)]
  else:
    ids = [0, 0]
  ids += [1 + zlib.crc32(x) % (r - 1) if x else 0 for x, r in zip(f[3:], AVAZU_ROWS[2:])]
  return float(f[1] == b"1"), [], ids, None


def gen_avazu(rng) -> bytes:
  day = datetime.date(2014, 10, 21) + datetime.timedelta(days=int(rng.integers(0, 900)))
  hour = "" if rng.random() < 0.1 else f"{day:%y%m%d}{int(rng.integers(0, 24)):02d}"
  cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 16 ** 6)):x}" for _ in range(21)]
  return ",".join([str(int(rng.integers(0, 10**12))), str(int(rng.integers(0, 2))), hour]
                  + cats).encode()


def avazu_source(files, bad_lines, chunk_bytes):
  return avazu.AvazuSource(files, 3, AVAZU_ROWS, bad_lines=bad_lines, repeat=False,
                           drop_remainder=False, chunk_bytes=chunk_bytes)


# --- CSV (BARS / FuxiCTR) --------------------------------------------------------------------

CSV_HEADER = b"id,label,I1,C1,I2,C2,note,I3,C3"
CSV_DENSE, CSV_CAT = (2, 4, 7), (3, 5, 8)        # column positions; id and note are ignored
CSV_ROWS = [2, 97, 5000]
CSV_CAT_INFERRED, CSV_ROWS_INFERRED = (3, 5, 6, 8), [2, 97, 13, 5000]


STOP = "stop"   # a line that stops the reader in both bad_lines modes


def ref_csv(line: bytes, inferred: bool = False):
  """Roles given (label, I1-I3 dense, C1-C3 categorical), or inferred from the header: I1-I3
  dense by name (a value that is not a number stops the reader), C1, C2, note, C3
  categorical, id ignored."""
  f = line_text(line).split(b",")
  if len(f) != 9:
    return None
  dense = [number(f[j], 64) if f[j] else 0.0 for j in CSV_DENSE]
  if inferred and None in dense:
    return STOP
  if f[1] not in (b"0", b"1") or None in dense:
    return None
  cat, rows = (CSV_CAT_INFERRED, CSV_ROWS_INFERRED) if inferred else (CSV_CAT, CSV_ROWS)
  ids = [1 + zlib.crc32(f[j]) % (r - 1) if f[j] else 0 for j, r in zip(cat, rows)]
  return float(f[1] == b"1"), [log1p_f32(x) for x in dense], ids, None


CSV_NUMBERS = ["0", "1", "-3", "2.5", "1e3", "-1e-3", ".5", "7.", "123456789012", "+4", ""]


def gen_csv(rng) -> bytes:
  num = lambda: str(rng.choice(CSV_NUMBERS)) if rng.random() < 0.7 else repr(rng.normal() * 100)
  cat = lambda: rng.choice(["", "a", "b b", "x-1", "é", "長", "0", "1.5"]) + str(
      int(rng.integers(0, 50)))
  f = [str(int(rng.integers(0, 10**6))), str(int(rng.integers(0, 2))), num(), cat(), num(),
       cat(), rng.choice(["", "free text", "x"]), num(), cat()]
  return ",".join(f).encode()


def csv_source(files, bad_lines, chunk_bytes):
  return csv_data.CsvSource(files, 3, CSV_ROWS, label="label", dense="I1,I2,I3",
                            categorical="C1,C2,C3", bad_lines=bad_lines, repeat=False,
                            drop_remainder=False, chunk_bytes=chunk_bytes)


def csv_inferred_source(files, bad_lines, chunk_bytes):
  src = csv_data.CsvSource(files, 3, CSV_ROWS_INFERRED, bad_lines=bad_lines, repeat=False,
                           drop_remainder=False, chunk_bytes=chunk_bytes)
  assert (src.columns.dense, src.columns.categorical) == (("I1", "I2", "I3"),
                                                          ("C1", "C2", "note", "C3"))
  return src


# --- libFM / libFFM --------------------------------------------------------------------------

FM_ROWS = [2, 5, 1000, 99_991]
FM_F = len(FM_ROWS)
FM_LABELS = {b"1": 1.0, b"+1": 1.0, b"0": 0.0, b"-1": 0.0}


def ref_fm(line: bytes, form: str):
  toks = [t for t in re.split(rb"[ \t]", line_text(line)) if t]
  if not toks or toks[0] not in FM_LABELS:
    return None
  if form == "libfm" and len(toks) != FM_F + 1:
    return None
  ids, weights = [0] * FM_F, [1.0] * FM_F
  seen = set()
  for k, tok in enumerate(toks[1:]):
    parts = tok.split(b":")
    if form == "libfm":
      if len(parts) != 2:
        return None
      field, (idx, val) = k, parts
    else:
      if len(parts) != 3 or not re.fullmatch(rb"[0-9]{1,9}", parts[0]):
        return None
      field, idx, val = int(parts[0]), parts[1], parts[2]
      if field >= FM_F or field in seen:
        return None
      seen.add(field)
    w = number(val, 64)
    if not re.fullmatch(rb"[0-9]{1,18}", idx) or w is None:
      return None
    ids[field] = 1 + int(idx) % (FM_ROWS[field] - 1)
    weights[field] = float(np.float32(w))
  return FM_LABELS[toks[0]], [], ids, weights


FM_VALUES = ["1", "0", "0.5", "-2.5", "1e-7", "3.", ".25", "+2", "-0"]


def gen_fm(rng, form: str) -> bytes:
  label = rng.choice(list(FM_LABELS))
  fields = range(FM_F) if form == "libfm" else rng.permutation(FM_F)[:int(rng.integers(0, FM_F + 1))]
  toks = [label.decode()]
  for j in fields:
    idx = str(int(rng.integers(0, 10 ** int(rng.integers(1, 19)))))
    val = str(rng.choice(FM_VALUES)) if rng.random() < 0.8 else repr(float(rng.normal()))
    toks.append(f"{idx}:{val}" if form == "libfm" else f"{j}:{idx}:{val}")
  sep = " " if rng.random() < 0.8 else rng.choice(["\t", "  ", " \t"])
  return sep.join(toks).encode()


def fm_source(form):
  def make(files, bad_lines, chunk_bytes):
    return libfm.LibFMSource(files, 3, FM_ROWS, num_fields=FM_F, form=form, bad_lines=bad_lines,
                             repeat=False, drop_remainder=False, chunk_bytes=chunk_bytes)
  return make


# --- mutations -------------------------------------------------------------------------------

NASTY = [b"", b"-", b"+", b"+1", b"-1", b"-0", b"1.5", b"1e400", b"-1e400", b"1e-400", b"nan",
         b"inf", b"-inf", b" 1", b"1 ", b"\r", b"1\r", b"\xff\xfe", b"1\x00", b"\x00", b"\x001",
         b"0x1f", b"9" * 25, b"9" * 18, b"-" + b"9" * 18, b"9" * 19, b"1_0", "é".encode(),
         b"1e5", b".5", b"5.", b"1,5", b"1:2", b"1:2:3", b"::", b"ffffffff", b"fffffffff",
         b"-12345678", b"123456789", b"\t", b"1" * 70, b"4294967296", b"e", b"\x0c1", b"\x80",
         b"14102100", b"14022900", b"14102124", b"00000000", b"0:1:1", b"9:1:1", b"3:1",
         b"0:0", b"1:-1", b"1:nan", b"1:" + b"2" * 65]


def mutate(rng, line: bytes, sep: bytes) -> bytes:
  """One random change of a line (without its ending); the result may still be valid."""
  kind = int(rng.integers(0, 13))
  fields = line.split(sep)
  if kind == 0:                                   # truncated
    return line[:int(rng.integers(0, len(line) + 1))]
  if kind == 1 and len(fields) > 1:               # a field missing
    del fields[int(rng.integers(0, len(fields)))]
    return sep.join(fields)
  if kind == 2:                                   # an extra field
    fields.insert(int(rng.integers(0, len(fields) + 1)), NASTY[int(rng.integers(len(NASTY)))])
    return sep.join(fields)
  if kind in (3, 4, 5):                           # a field replaced by a bad or odd value
    i = int(rng.integers(0, len(fields)))
    v = NASTY[int(rng.integers(len(NASTY)))]
    if sep == b" " and i > 0 and rng.random() < 0.8 and b":" in fields[i]:
      parts = fields[i].split(b":")            # change one part of a pair: val most often
      parts[[-1, -1, -2, 0][int(rng.integers(0, 4))]] = v
      fields[i] = b":".join(parts)
    else:
      fields[i] = v
    return sep.join(fields)
  if kind == 6:                                   # a stray byte somewhere
    i = int(rng.integers(0, len(line) + 1))
    b = [b"\r", b"\x00", b"\xff", b"\x80", b"\t", b" ", b",", b":", b"\n", b"\x0b"][
        int(rng.integers(0, 10))]
    return line[:i] + b + line[i:]
  if kind == 7:
    return b""
  if kind == 8:
    return [b" ", b"\t", b"\r", b" \t ", b"\r\r"][int(rng.integers(0, 5))]
  if kind == 9:                                   # separators changed
    return line.replace(sep, [b"\t", b" ", b",", b";"][int(rng.integers(0, 4))], 1)
  if kind == 10:                                  # a doubled separator
    i = line.find(sep, int(rng.integers(0, len(line) + 1)))
    return line if i < 0 else line[:i] + sep + line[i:]
  if kind == 11:                                  # a stray byte at the end of a field
    i = int(rng.integers(0, len(fields)))
    fields[i] += [b"\x00", b"\r", b" ", b"\xff", b"\x0c", b"0", b"e"][int(rng.integers(0, 7))]
    return sep.join(fields)
  return line + line[:int(rng.integers(0, len(line) + 1))]   # glued to part of itself


FORMATS = {
    # name: (generator, reference, source factory, field separator, header, file suffix)
    "criteo": (gen_criteo, ref_criteo, criteo_source, b"\t", None, ".txt"),
    "avazu": (gen_avazu, ref_avazu, avazu_source, b",", AVAZU_HEADER, ".csv"),
    "csv": (gen_csv, ref_csv, csv_source, b",", CSV_HEADER, ".csv"),
    "csv_inferred": (gen_csv, lambda l: ref_csv(l, inferred=True), csv_inferred_source, b",",
                     CSV_HEADER, ".csv"),
    "libfm": (lambda rng: gen_fm(rng, "libfm"), lambda l: ref_fm(l, "libfm"), fm_source("libfm"),
              b" ", None, ".libfm"),
    "libffm": (lambda rng: gen_fm(rng, "libffm"), lambda l: ref_fm(l, "libffm"),
               fm_source("libffm"), b" ", None, ".ffm"),
}


def write_case(rng, tmp_path, case: int, fmt: str, n_lines: int, bad_rate: float):
  """Random files of `fmt`: [(path, bytes)] and the reference rows of every data line, each
  (path, line number, row or None)."""
  gen, ref, _, sep, header, suffix = FORMATS[fmt]
  files = []
  expected = []
  for k in range(1 if rng.random() < 0.6 else 2):
    body = []
    for _ in range(int(rng.integers(0, n_lines + 1))):
      line = gen(rng)
      if rng.random() < bad_rate:
        line = mutate(rng, line, sep)
      body.append(line)
    end = b"\r\n" if rng.random() < 0.3 else b"\n"
    data = b"".join(l + end for l in ([header] if header else []) + body)
    if body and rng.random() < 0.4:      # how the file ends: no final '\n', a lone '\r', ...
      data = data[:-len(end)] + [b"", b"\r", b"\r\n\r", b"\n\r", b"\r\n\n", b"\n\n",
                                 b"\n \r"][int(rng.integers(0, 7))]
    name = f"case{case}_{k}{suffix}" + (".gz" if rng.random() < 0.2 else "")
    path = os.path.join(tmp_path, name)
    with (gzip.open(path, "wb") if name.endswith(".gz") else open(path, "wb")) as f:
      f.write(data)
    lines = split_lines(data)
    first = 1 if header else 0
    expected += [(path, first + i + 1, ref(l)) for i, l in enumerate(lines[first:])]
    files.append(path)
  return files, expected


def rows_of(batches) -> list:
  """(label, dense, ids, weights) of each mask-1 row, as Python lists of float32 values."""
  out = []
  for b in batches:
    for r in np.flatnonzero(b.mask == 1):
      w = None if b.weights is None else b.weights[r, :, 0].tolist()
      out.append((float(b.labels[r]), b.dense[r].tolist(), b.ids[r, :, 0].tolist(), w))
  return out


def check_case(fmt, files, expected, chunk_bytes):
  make = FORMATS[fmt][2]
  good = [row for _, _, row in expected if row not in (None, STOP)]
  bad = [(path, no) for path, no, row in expected if row in (None, STOP)]
  stop = [(path, no) for path, no, row in expected if row is STOP]

  def raises_at(src, path, no):
    with pytest.raises(ValueError) as err:
      list(src.batches())
    assert str(err.value).startswith(f"{path}:{no}: "), (str(err.value), path, no)

  src = make(files, "error", chunk_bytes)
  if bad:
    raises_at(src, *bad[0])
  else:
    assert rows_of(src.batches()) == good
  skip = make(files, "skip", chunk_bytes)
  if stop:
    raises_at(skip, *stop[0])
    return
  assert rows_of(skip.batches()) == good
  assert skip.bad_line_count == len(bad)
  assert skip.num_examples == len(good)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reader_matches_reference_on_mutated_files(tmp_path, fmt):
  rng = np.random.default_rng(sum(map(ord, fmt)))
  n_bad = n_good = 0
  for case in range(40):
    files, expected = write_case(rng, tmp_path, case, fmt, n_lines=30,
                                 bad_rate=[0.0, 0.03, 0.2, 0.7][case % 4])
    chunk_bytes = int(rng.choice([1 << 20, 200, 60]))
    try:
      check_case(fmt, files, expected, chunk_bytes)
    except BaseException as e:
      raise AssertionError(f"{fmt} case {case} ({files}, chunk_bytes={chunk_bytes}): "
                           f"{type(e).__name__}: {e}") from e
    n_bad += sum(row in (None, STOP) for *_, row in expected)
    n_good += sum(row not in (None, STOP) for *_, row in expected)
  assert n_bad > 100 and n_good > 500, (n_bad, n_good)   # the cases exercise both kinds


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_crlf_and_missing_final_newline_read_as_lf(tmp_path, fmt):
  gen, _, make, _, header, suffix = FORMATS[fmt]
  rng = np.random.default_rng(7)
  body = [gen(rng) for _ in range(20)]
  lines = ([header] if header else []) + body
  want = None
  for k, (end, last) in enumerate([(b"\n", b"\n"), (b"\r\n", b"\r\n"), (b"\r\n", b""),
                                   (b"\r\n", b"\r"), (b"\n", b"")]):
    path = os.path.join(tmp_path, f"f{k}{suffix}")
    with open(path, "wb") as f:
      f.write(b"".join(l + end for l in lines[:-1]) + lines[-1] + last)
    rows = rows_of(make([path], "error", 1 << 20).batches())
    assert len(rows) == 20
    want = want or rows
    assert rows == want, (end, last)
