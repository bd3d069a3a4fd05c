"""Tests of the libFM / libFFM and BARS CSV readers, their --data forms and a train_rec run.

References: values computed by hand, plain-Python decodings (`decode_line` for the
vectorized libFM parser, and int / float / zlib.crc32 / math.log1p written out here), the
Criteo reader on the same examples converted to both formats, and slices of a full
iteration for resuming and sharding.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from rec.data import criteo, csv_data, libfm, sources
from rec.data.batch import SparseBatch
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.environ.get("REC_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
CRITEO_DIR = os.path.join(DATA_DIR, "criteo_kaggle_sample")
needs_criteo = pytest.mark.skipif(
    not os.path.isfile(os.path.join(CRITEO_DIR, "train.txt")),
    reason=f"Criteo sample not found at {CRITEO_DIR} (set REC_DATA_DIR)")


# --- helpers ---------------------------------------------------------------------------------

def write(d, name: str, lines: list[str]) -> str:
  path = os.path.join(d, name)
  data = "".join(lines).encode()
  with (gzip.open(path, "wb") if name.endswith(".gz") else open(path, "wb")) as f:
    f.write(data)
  return path


def take(it, n: int) -> list[SparseBatch]:
  return list(itertools.islice(it, n))


def assert_batches_equal(a: list[SparseBatch], b: list[SparseBatch]):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for name in ("dense", "ids", "lengths", "labels", "mask", "weights"):
      u, v = getattr(x, name), getattr(y, name)
      assert (u is None) == (v is None), name
      if u is not None:
        np.testing.assert_array_equal(u, v, err_msg=name)


def real_rows(batches: list[SparseBatch]):
  """(dense, ids [N, F], labels, weights [N, F] or None) of the mask-1 rows."""
  keep = np.concatenate([b.mask for b in batches]) == 1
  weights = None
  if batches[0].weights is not None:
    weights = np.concatenate([b.weights[:, :, 0] for b in batches])[keep]
  return (np.concatenate([b.dense for b in batches])[keep],
          np.concatenate([b.ids[:, :, 0] for b in batches])[keep],
          np.concatenate([b.labels for b in batches])[keep], weights)


def fm_line(label: str, pairs) -> str:
  return " ".join([label] + [f"{i}:{v}" for i, v in pairs]) + "\n"


def numbered_fm(n: int, F: int = 4) -> list[str]:
  """n valid positional lines: field 0's idx is the line index, field 1's val is i / 4."""
  return [fm_line(str(1 if i % 3 == 0 else -1),
                  [(i, 1), (1000 + 7 * i, i / 4)] + [(50 * j + i % 5, 1) for j in range(2, F)])
          for i in range(n)]


def line_index(batches: list[SparseBatch], rows: int = 10**6) -> list[int]:
  """Field 0's id minus 1 = the line index of `numbered_fm` rows (when rows - 1 > n)."""
  return list(real_rows(batches)[1][:, 0] - 1)


# --- libFM: decoding by hand ----------------------------------------------------------------

def test_libfm_positional_by_hand(tmp_path):
  rows = [5, 7, 1000]
  lines = ["1 3:1 17:0.5 99:2\n",
           "-1\t4:1  18:1e-3 100:-2.5 \r\n",          # tab, double space, trailing blank, CRLF
           "0 0:1 123456789012345678:1 5:0\n",
           "+1 8:1 6:1 999:1"]                          # no final newline
  path = write(tmp_path, "train.libfm", lines)
  src = libfm.LibFMSource(path, 4, rows, repeat=False)
  assert (src.form, src.num_fields) == ("libfm", 3)
  assert src.spec.sparse_features == ("f0", "f1", "f2") and src.spec.num_dense == 0
  assert src.spec.rows_per_feature == (5, 7, 1000)
  assert "3 fields f0..f2" in src.describe() and "weight" in src.describe()
  (b,) = list(src.batches())
  assert b.dense.shape == (4, 0) and b.ids.shape == (4, 3, 1) and b.weights.shape == (4, 3, 1)
  assert b.weights.dtype == np.float32 and b.ids.dtype == np.int32 and (b.lengths == 1).all()
  assert b.labels.tolist() == [1, 0, 0, 1] and (b.mask == 1).all()
  expect_ids = [[1 + 3 % 4, 1 + 17 % 6, 1 + 99 % 999],
                [1 + 4 % 4, 1 + 18 % 6, 1 + 100 % 999],
                [1 + 0, 1 + 123456789012345678 % 6, 1 + 5],
                [1 + 8 % 4, 1 + 6 % 6, 1 + 999 % 999]]
  assert b.ids[:, :, 0].tolist() == expect_ids
  np.testing.assert_array_equal(
      b.weights[:, :, 0], np.array([[1, 0.5, 2], [1, 1e-3, -2.5], [1, 1, 0], [1, 1, 1]],
                                   np.float32))
  ignore = libfm.LibFMSource(path, 4, rows, repeat=False, values="ignore")
  (c,) = list(ignore.batches())
  assert c.weights is None and c.dense.shape == (4, 0)
  np.testing.assert_array_equal(c.ids, b.ids)


def test_libffm_by_hand(tmp_path):
  lines = ["1 0:3:1 2:99:0.5\n",          # field 1 missing -> id 0, weight 1
           "0 2:5:1 1:4:2 0:7:1\n",       # fields in any order
           "-1\n"]                        # every field missing
  path = write(tmp_path, "train.ffm", lines)
  src = libfm.LibFMSource(path, 3, [10, 10, 10], repeat=False)
  assert (src.form, src.num_fields) == ("libffm", 3)
  (b,) = list(src.batches())
  assert b.ids[:, :, 0].tolist() == [[1 + 3 % 9, 0, 1 + 99 % 9], [1 + 7, 1 + 4, 1 + 5], [0, 0, 0]]
  assert b.weights[:, :, 0].tolist() == [[1, 1, 0.5], [1, 2, 1], [1, 1, 1]]
  assert b.labels.tolist() == [1, 0, 0]
  wide = libfm.LibFMSource(path, 3, 10, num_fields=5, repeat=False)   # F given
  assert wide.spec.sparse_features == ("f0", "f1", "f2", "f3", "f4")
  assert (next(wide.batches()).ids[:, 3:, 0] == 0).all()


def test_libfm_eval_padding_has_zero_weights(tmp_path):
  path = write(tmp_path, "valid.txt", numbered_fm(5))
  ev = libfm.LibFMSource(path, 4, 10**6, drop_remainder=False, repeat=False)
  batches = list(ev.batches())
  assert ev.num_batches == len(batches) == 2
  last = batches[1]
  assert last.mask.tolist() == [1, 0, 0, 0]
  assert (last.weights[1:] == 0).all() and (last.ids[1:] == 0).all() and (last.lengths == 1).all()
  assert last.weights[0, 1, 0] == 4 / 4
  assert line_index(batches) == [0, 1, 2, 3, 4]


# --- libFM: bad lines -----------------------------------------------------------------------

FROM = "pairs on the first line of {good}"
LIBFM_BAD = [
    ("1 1:1 2:1\n", "a label and 2 idx:val pairs; expected a label and 3 idx:val pairs (" + FROM + ")"),
    ("1 1:1 2:1 3:1 4:1\n", "a label and 4 idx:val pairs; expected a label and 3 idx:val pairs ("
     + FROM + ")"),
    ("\n", "an empty line; expected a label and 3 idx:val pairs (" + FROM + ")"),
    ("2 1:1 2:1 3:1\n", "label = '2'; expected 1, +1, 0 or -1"),
    ("1.0 1:1 2:1 3:1\n", "label = '1.0'; expected 1, +1, 0 or -1"),
    ("yes 1:1 2:1 3:1\n", "label = 'yes'; expected 1, +1, 0 or -1"),
    ("1 1:1 2 3:1\n", "field f1 = '2'; expected idx:val"),
    ("1 1:1 2:1:1 3:1\n", "field f1 = '2:1:1'; expected idx:val"),
    ("1 1:1 2:1 x:1\n", "field f2 = 'x:1'; expected idx:val with idx a non-negative integer "
                        "of at most 18 digits"),
    ("1 -1:1 2:1 3:1\n", "field f0 = '-1:1'; expected idx:val with idx a non-negative integer "
                         "of at most 18 digits"),
    ("1 1:1 1234567890123456789:1 3:1\n",
     "field f1 = '1234567890123456789:1'; expected idx:val with idx a non-negative integer "
     "of at most 18 digits"),
    ("1 :1 2:1 3:1\n", "field f0 = ':1'; expected idx:val with idx a non-negative integer "
                       "of at most 18 digits"),
    ("1 1:1 2:abc 3:1\n", "field f1 = '2:abc'; expected idx:val with val a finite number of "
                          "at most 64 characters"),
    ("1 1:1 2: 3:1\n", "field f1 = '2:'; expected idx:val with val a finite number of at most "
                       "64 characters"),
    ("1 1:nan 2:1 3:1\n", "field f0 = '1:nan'; expected idx:val with val a finite number of "
                          "at most 64 characters"),
    ("1 1:1 2:1 3:1e999\n", "field f2 = '3:1e999'; expected idx:val with val a finite number "
                            "of at most 64 characters"),
    ("1 1:1 2:1 3:" + "1" * 65 + "\n", f"field f2 = {('3:' + '1' * 38 + '...')!r}; expected "
     "idx:val with val a finite number of at most 64 characters"),
    ("1 1:1 x 3:zz\n", "field f1 = 'x'; expected idx:val"),     # the first bad field is named
]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 40])
@pytest.mark.parametrize("bad_line,message", LIBFM_BAD)
def test_libfm_bad_line_names_file_line_field(tmp_path, bad_line, message, chunk_bytes):
  good = write(tmp_path, "a.libfm", [fm_line("1", [(i, 1), (i, 2), (i, 3)]) for i in range(4)])
  lines = [fm_line("0", [(i, 1), (i, 0.5), (i, 1)]) for i in range(6)]
  lines[2] = bad_line
  bad = write(tmp_path, "b.libfm", lines)
  src = libfm.LibFMSource([good, bad], 2, 100, chunk_bytes=chunk_bytes)
  with pytest.raises(ValueError) as err:
    take(src.batches(), 10)
  assert str(err.value) == f"{bad}:3: {message.format(good=good)}"
  skip = libfm.LibFMSource([good, bad], 2, 100, bad_lines="skip", repeat=False,
                           chunk_bytes=chunk_bytes)
  assert skip.num_examples == 9 and skip.bad_line_count == 1


@pytest.mark.parametrize("bad_line,message", [
    ("1 0:1:1 3:1:1\n", "pair 2 = '3:1:1'; expected field:idx:val with field an integer in "
                        "[0, 3) (the largest field in the first 4 lines of {good}, plus one; "
                        "pass num_fields for more)"),
    ("1 0:1:1 0:2:1\n", "pair 2 = '0:2:1': field 0 already appeared in this line; expected at "
                        "most one pair per field (one-hot)"),
    ("1 a:1:1\n", "pair 1 = 'a:1:1'; expected field:idx:val with field an integer in [0, 3) "
                  "(the largest field in the first 4 lines of {good}, plus one; pass "
                  "num_fields for more)"),
    ("1 0:1\n", "pair 1 = '0:1'; expected field:idx:val"),
    ("1 0:1:x\n", "pair 1 = '0:1:x'; expected field:idx:val with val a finite number of at "
                  "most 64 characters"),
    ("1 0:-1:1\n", "pair 1 = '0:-1:1'; expected field:idx:val with idx a non-negative integer "
                   "of at most 18 digits"),
    ("\t \n", "an empty line; expected a label and field:idx:val pairs"),
])
def test_libffm_bad_lines(tmp_path, bad_line, message):
  good = write(tmp_path, "a.ffm", ["1 0:1:1 1:2:1\n", "0 2:3:1\n", "1 0:5:1\n", "0 1:1:1\n"])
  bad = write(tmp_path, "b.ffm", ["1 0:1:1\n", "0 1:1:1\n", bad_line, "1 2:1:1\n"])
  src = libfm.LibFMSource([good, bad], 2, 100, repeat=False)
  assert src.num_fields == 3
  with pytest.raises(ValueError) as err:
    list(src.batches())
  assert str(err.value) == f"{bad}:3: {message.format(good=good)}"


@pytest.mark.parametrize("last", ["\r", "\r\n", "\n", " \r", "\t\r\n"])
@pytest.mark.parametrize("form", ["libfm", "libffm"])
def test_lone_cr_or_blank_last_line_is_a_bad_line(tmp_path, form, last):
  """A last line holding only a line ending (a CRLF file's trailing '\\r') is an empty line:
  file:line in error mode, one skipped line in skip mode; never an assertion."""
  pair = (lambda j, i: f"{i}:1") if form == "libfm" else (lambda j, i: f"{j}:{i}:1")
  lines = [" ".join(["1" if i % 2 else "-1"] + [pair(j, 10 * i + j) for j in range(3)]) + "\r\n"
           for i in range(5)]
  path = write(tmp_path, "crlf." + form, lines + [last])
  empty = "field:idx:val pairs" if form == "libffm" else "3 idx:val pairs"
  for chunk_bytes in (1 << 20, 30):
    src = libfm.LibFMSource(path, 2, 100, repeat=False, chunk_bytes=chunk_bytes)
    with pytest.raises(ValueError) as err:
      list(src.batches())
    assert str(err.value).startswith(f"{path}:6: an empty line; expected a label and {empty}")
    skip = libfm.LibFMSource(path, 2, 100, repeat=False, bad_lines="skip",
                             drop_remainder=False, chunk_bytes=chunk_bytes)
    _, ids, labels, _ = real_rows(list(skip.batches()))
    assert skip.bad_line_count == 1 and skip.num_examples == 5
    assert labels.tolist() == [0, 1, 0, 1, 0]
    assert ids[:, 0].tolist() == [1 + 10 * i for i in range(5)]


def test_libfm_first_line_and_argument_errors(tmp_path):
  empty = write(tmp_path, "empty.libfm", [])
  with pytest.raises(ValueError, match="empty.libfm: empty file"):
    libfm.LibFMSource(empty, 2)
  no_pairs = write(tmp_path, "label_only.libfm", ["1\n", "0 1:1\n"])
  with pytest.raises(ValueError, match=r"label_only.libfm:1: expected `label idx:val"):
    libfm.LibFMSource(no_pairs, 2)
  three = write(tmp_path, "three.libfm", ["1 1:2:3:4\n"])
  with pytest.raises(ValueError, match=r"three.libfm:1: expected"):
    libfm.LibFMSource(three, 2)
  good = write(tmp_path, "ok.libfm", numbered_fm(3))
  with pytest.raises(ValueError, match="form='libffm' was given, but the first line is in the "
                                       "libfm form"):
    libfm.LibFMSource(good, 2, form="libffm")
  with pytest.raises(ValueError, match="values='log'"):
    libfm.LibFMSource(good, 2, values="log")
  with pytest.raises(ValueError, match="num_fields=0"):
    libfm.LibFMSource(good, 2, num_fields=0)
  with pytest.raises(ValueError, match="rows_per_feature for f2 = 1, expected an int >= 2"):
    libfm.LibFMSource(good, 2, [5, 5, 1, 5])
  with pytest.raises(FileNotFoundError, match="nope.libfm"):
    libfm.LibFMSource(os.path.join(tmp_path, "nope.libfm"), 2)


def _random_token(rng, form: str, F: int) -> str:
  """A pair token that is valid most of the time and wrong in one of many ways otherwise."""
  idx = str(int(rng.integers(0, 10**int(rng.integers(1, 19)))))
  val = rng.choice(["1", "0", "0.25", "-3", "1e-7", "2.", ".5", str(rng.random())])
  field = str(int(rng.integers(0, F)))
  if rng.random() < 0.12:
    which = int(rng.integers(0, 8))
    idx = ["-3", "x", "", "1234567890123456789", idx][min(which, 4)]
    val = ["", "abc", "nan", "inf", "1" * 70, "1,5", "1e400", val][which]
    field = [field, "9", "a", "", field, "-1", field, "1234567890"][which]
  parts = [idx, val] if form == "libfm" else [field, idx, val]
  if rng.random() < 0.03:
    parts = parts[:-1] if rng.random() < 0.5 else parts + ["7"]
  return ":".join(parts)


@pytest.mark.parametrize("form", ["libfm", "libffm"])
def test_libfm_vectorized_parse_matches_plain_python(form):
  # The chunk parser against `decode_line`, line by line, on random good and bad lines.
  rng = np.random.default_rng(0 if form == "libfm" else 1)
  F = 5
  rows = [2, 3, 1000, 99_991, 10**6]
  lines = []
  for _ in range(600):
    n = F if form == "libfm" else int(rng.integers(0, F + 1))
    if rng.random() < 0.03:
      n += int(rng.choice([-1, 1]))
    label = rng.choice(["1", "0", "-1", "+1"] if rng.random() > 0.05 else ["2", "", "1.0", "-0"])
    sep = rng.choice([" ", "\t", "  "])
    toks = [label] + [_random_token(rng, form, F) for _ in range(max(n, 0))]
    end = rng.choice(["\n", "\r\n", " \n"])
    lines.append((sep.join(toks) + end).encode())
  parsed = libfm.parse_lines(lines, rows, form, F, "test")
  ref = [libfm.decode_line(line, rows, form, F, "test") for line in lines]
  bad_ref = [(i, r) for i, r in enumerate(ref) if isinstance(r, str)]
  good_ref = [r for r in ref if not isinstance(r, str)]
  assert 30 < len(bad_ref) < 450 and len(good_ref) > 100
  assert parsed.bad == bad_ref
  np.testing.assert_array_equal(parsed.labels, [r[0] for r in good_ref])
  np.testing.assert_array_equal(parsed.ids, np.array([r[1] for r in good_ref]))
  np.testing.assert_array_equal(parsed.dense, np.array([r[2] for r in good_ref], np.float32))


# --- libFM: shards and resume ----------------------------------------------------------------

def test_libfm_shards_disjoint_and_complete(tmp_path):
  lines = numbered_fm(25)
  files = [write(tmp_path, "x.libfm", lines[:9]), write(tmp_path, "y.libfm.gz", lines[9:])]
  seen = []
  for s in range(3):
    src = libfm.LibFMSource(files, 4, 10**6, shard_index=s, num_shards=3, repeat=False,
                            drop_remainder=False, chunk_bytes=100)
    idx = line_index(list(src.batches()))
    assert idx == list(range(s, 25, 3)) and src.num_examples == len(idx)
    seen += idx
  assert sorted(seen) == list(range(25))


@pytest.mark.parametrize("bad_lines", ["error", "skip"])
@pytest.mark.parametrize("num_shards,chunk_bytes", [(1, 1 << 20), (2, 150)])
def test_libfm_resume_equals_skipping(tmp_path, bad_lines, num_shards, chunk_bytes):
  lines = numbered_fm(41)
  if bad_lines == "skip":
    for i in (2, 17, 18, 33):
      lines[i] = "7 1:1 2:1 3:1 4:1\n"
  files = [write(tmp_path, "a.libfm", lines[:15]), write(tmp_path, "b.libfm", lines[15:])]
  kw = dict(bad_lines=bad_lines, shard_index=num_shards - 1, num_shards=num_shards,
            chunk_bytes=chunk_bytes)
  src = libfm.LibFMSource(files, 3, 10**6, **kw)
  nb = src.num_batches
  full = take(src.batches(), 3 * nb + 1)
  assert_batches_equal(full[:nb], full[nb:2 * nb])    # epochs repeat
  for start in range(2 * nb + 1):
    fresh = libfm.LibFMSource(files, 3, 10**6, **kw)
    assert_batches_equal(take(fresh.batches(start), 2), full[start:start + 2])
  ev_kw = dict(kw, drop_remainder=False, repeat=False)
  whole = list(libfm.LibFMSource(files, 3, 10**6, **ev_kw).batches())
  for start in range(len(whole) + 1):
    fresh = libfm.LibFMSource(files, 3, 10**6, **ev_kw)
    assert_batches_equal(list(fresh.batches(start)), whole[start:])


# --- CSV -------------------------------------------------------------------------------------

CSV_HEADER = "id,I1,I2,Label,C1,I3,device\n"


def test_csv_inferred_roles_and_values_by_hand(tmp_path):
  lines = [CSV_HEADER,
           "r1,3,-2,1,abc,7,phone\n",
           "r2,,0.5,0,,,\n",           # empty values
           "r3,1e3,12,1,abc,5,tablet\r\n"]
  path = write(tmp_path, "train.csv", lines)
  src = csv_data.CsvSource(path, 3, [10, 1000], repeat=False)
  cols = src.columns
  assert (cols.label, cols.dense, cols.categorical) == ("Label", ("I1", "I2", "I3"),
                                                        ("C1", "device"))
  assert cols.ignored == ("id",) and cols.inferred == {"label", "dense", "categorical"}
  assert src.describe().splitlines() == [
      f"{path}: column roles",
      "  label: Label (inferred: the first column named label/click/clicked/y)",
      "  dense (3, log1p(max(x, 0))): I1, I2, I3 (inferred: the columns named I<n>; a value "
      "that is not a number stops the run, give --csv_dense/--csv_categorical if one of them "
      "is categorical)",
      "  categorical (2, crc32 hashed): C1, device (inferred: the other columns, except id)",
      "  ignored: id"]
  assert src.spec.num_dense == 3 and src.spec.sparse_features == ("C1", "device")
  (b,) = list(src.batches())
  assert b.weights is None and b.labels.tolist() == [1, 0, 1]
  np.testing.assert_array_equal(
      b.dense, np.array([[math.log1p(3), 0, math.log1p(7)], [0, math.log1p(0.5), 0],
                         [math.log1p(1000), math.log1p(12), math.log1p(5)]], np.float32))

  def h(v, r):
    return 1 + zlib.crc32(v.encode()) % (r - 1) if v else 0
  assert b.ids[:, :, 0].tolist() == [[h("abc", 10), h("phone", 1000)], [0, 0],
                                     [h("abc", 10), h("tablet", 1000)]]


@pytest.mark.parametrize("bad_at", [2, 1500])
@pytest.mark.parametrize("bad_lines", ["error", "skip"])
def test_csv_value_against_inferred_dense_role_stops(tmp_path, bad_at, bad_lines):
  """One non-number in an I<n> column, in the first rows or far past them, never turns the
  column categorical: reading stops at its file:line (even with bad_lines=skip) and asks for
  the roles; with the roles given it is categorical, or a bad line of a dense column."""
  rows = [f"r{i},{i},{i % 7},{i % 2},c{i % 5},{i % 3},d\n" for i in range(2000)]
  rows[3] = "r3,1,2,7,c,4,d\n"                          # a bad label: an ordinary bad line
  rows[bad_at - 2] = f"r,{bad_at},2,1,c,x9,d\n"         # line bad_at of the file (header = 1)
  path = write(tmp_path, "train.csv", [CSV_HEADER] + rows)
  src = csv_data.CsvSource(path, 64, 50, bad_lines=bad_lines, repeat=False, chunk_bytes=4096)
  assert src.columns.dense == ("I1", "I2", "I3")        # by name, whatever the values
  first = 5 if (bad_at > 5 and bad_lines == "error") else bad_at
  with pytest.raises(ValueError) as err:
    list(src.batches())
  msg = str(err.value)
  if first == 5:
    assert msg == f"{path}:5: field Label = '7'; expected 0 or 1"
    return
  assert msg.startswith(f"{path}:{bad_at}: field I3 = 'x9'; expected a finite number or empty, "
                        "as column I3 was inferred dense (named I<n>); give the column roles "
                        "explicitly with --csv_dense and --csv_categorical"), msg
  given = csv_data.CsvSource(path, 64, 50, dense="I1,I2", bad_lines="skip", repeat=False,
                             drop_remainder=False)
  assert given.columns.categorical == ("C1", "I3", "device")
  assert given.num_examples == 1999 and given.bad_line_count == 1   # the bad label only
  dense_given = csv_data.CsvSource(path, 64, 50, dense="I1,I2,I3", bad_lines="skip",
                                   repeat=False)
  assert dense_given.num_examples == 1998 and dense_given.bad_line_count == 2


def test_csv_given_roles(tmp_path):
  path = write(tmp_path, "train.csv", [CSV_HEADER, "r1,3,-2,1,abc,7,phone\n"])
  src = csv_data.CsvSource(path, 1, 50, label="I3", dense="I1", categorical="C1,device",
                           repeat=False)
  assert (src.columns.label, src.columns.dense, src.columns.categorical) == (
      "I3", ("I1",), ("C1", "device"))
  assert src.columns.ignored == ("id", "I2", "Label")
  with pytest.raises(ValueError, match=r"field I3 = '7'; expected 0 or 1"):
    list(src.batches())
  none = csv_data.CsvSource(path, 1, 50, dense="none", repeat=False)
  assert none.columns.dense == () and none.columns.categorical == ("I1", "I2", "C1", "I3",
                                                                   "device")
  assert next(none.batches()).dense.shape == (1, 0)
  with pytest.raises(ValueError, match=r"dense column 'I9' is not in the header of .*train.csv: "
                                       r"id, I1, I2, Label, C1, I3, device"):
    csv_data.CsvSource(path, 1, dense="I1,I9")
  with pytest.raises(ValueError, match="column 'I1' of .* is both dense and categorical"):
    csv_data.CsvSource(path, 1, dense="I1", categorical="I1,C1")
  no_label = write(tmp_path, "nolabel.csv", ["a,b\n", "1,2\n"])
  with pytest.raises(ValueError, match=r"no label column in the header of .*nolabel.csv \(a, b\): "
                                       r"expected one named label, click, clicked, y"):
    csv_data.CsvSource(no_label, 1)
  only_dense = write(tmp_path, "dense.csv", ["click,I1\n", "1,2\n"])
  with pytest.raises(ValueError, match="no categorical column"):
    csv_data.CsvSource(only_dense, 1)


@pytest.mark.parametrize("bad_line,message", [
    ("r,1,2,2,a,b,c\n", "field Label = '2'; expected 0 or 1"),
    ("r,1,2,,a,b,c\n", "field Label = ''; expected 0 or 1"),
    ("r,abc,2,1,a,b,c\n", "field I1 = 'abc'; expected a finite number or empty"),
    ("r,1,nan,1,a,b,c\n", "field I2 = 'nan'; expected a finite number or empty"),
    ("r,1,2,1,a,b\n", "6 comma-separated fields; expected 7"),
    ("r,1,2,1,a,b,c,d\n", "8 comma-separated fields; expected 7"),
    ("r,x,2,7,a,b,c\n", "field I1 = 'x'; expected a finite number or empty"),  # first in order
])
def test_csv_bad_lines(tmp_path, bad_line, message):
  good = "r,1,2,1,a,b,c\n"
  path = write(tmp_path, "train.csv", ["id,I1,I2,Label,C1,C2,C3\n", good, good, bad_line, good])
  # dense given: inferred, a non-number in I1 would stop the reader whatever bad_lines says
  with pytest.raises(ValueError) as err:
    list(csv_data.CsvSource(path, 2, dense="I1,I2", repeat=False).batches())
  assert str(err.value) == f"{path}:4: {message}"    # the header is line 1
  skip = csv_data.CsvSource(path, 2, dense="I1,I2", bad_lines="skip", repeat=False)
  assert skip.num_examples == 3 and skip.bad_line_count == 1


@pytest.mark.parametrize("bad_lines", ["error", "skip"])
def test_csv_quoted_field_stops_the_reader(tmp_path, bad_lines):
  """csv / pandas unquote '"x"' to x (and keep the comma of '"x,y"'): hashing the quotes, or
  splitting at the comma, would read another value. A quote inside a value is part of it,
  for them and here."""
  good = "r,1,a,b\n"
  for line, shown in [('r,0,"x",b\n', "'\"x\"'"), ('r,0,"x,y",b\n', "'\"x'")]:
    path = write(tmp_path, "q.csv", ["id,click,C1,C2\n", good, good, line, good])
    src = csv_data.CsvSource(path, 1, 50, bad_lines=bad_lines, repeat=False)
    with pytest.raises(ValueError) as err:
      list(src.batches())
    assert str(err.value).startswith(
        f"{path}:4: field C1 = {shown} starts with a quote; expected plain comma-separated "
        "values (quoted CSV fields are not supported"), str(err.value)
  path = write(tmp_path, "inner.csv", ["id,click,C1,C2\n", 'r,1,x"y,b\n'])
  (b,) = list(csv_data.CsvSource(path, 1, 50, bad_lines=bad_lines, repeat=False).batches())
  assert b.ids[0, 0, 0] == 1 + zlib.crc32(b'x"y') % 49


def test_csv_header_checks(tmp_path):
  a = write(tmp_path, "a.csv", ["label,C1\n", "1,x\n"])
  b = write(tmp_path, "b.csv", ["label,C2\n", "1,x\n"])
  with pytest.raises(ValueError, match=r"b.csv:1: header 'label,C2' differs from the header of "
                                       r".*a.csv: 'label,C1'"):
    csv_data.CsvSource([a, b], 1)
  quoted = write(tmp_path, "q.csv", ['"label",C1\n'])
  with pytest.raises(ValueError, match="q.csv:1: .*quoted CSV fields are not supported"):
    csv_data.CsvSource(quoted, 1)
  dup = write(tmp_path, "d.csv", ["label,C1,C1\n"])
  with pytest.raises(ValueError, match="d.csv:1: header names C1 more than once"):
    csv_data.CsvSource(dup, 1)
  empty = write(tmp_path, "e.csv", [])
  with pytest.raises(ValueError, match="e.csv:1: expected a header row"):
    csv_data.CsvSource(empty, 1)


def _numbered_csv(n: int) -> list[str]:
  return ["label,I1,C1\n"] + [f"{i % 2},{i},v{i}\n" for i in range(n)]


def test_csv_shards_and_resume(tmp_path):
  lines = _numbered_csv(23)
  files = [write(tmp_path, "a.csv", lines[:10]),
           write(tmp_path, "b.csv.gz", lines[:1] + lines[10:])]   # each file has the header
  seen = []
  for s in range(2):
    src = csv_data.CsvSource(files, 3, 1000, shard_index=s, num_shards=2, chunk_bytes=40)
    full = take(src.batches(), 3 * src.num_batches)
    for start in range(2 * src.num_batches):
      fresh = csv_data.CsvSource(files, 3, 1000, shard_index=s, num_shards=2, chunk_bytes=40)
      assert_batches_equal(take(fresh.batches(start), 2), full[start:start + 2])
    ev = csv_data.CsvSource(files, 3, 1000, shard_index=s, num_shards=2, repeat=False,
                            drop_remainder=False)
    dense = real_rows(list(ev.batches()))[0][:, 0]
    idx = list(np.rint(np.expm1(dense.astype(np.float64))).astype(int))
    assert idx == list(range(s, 23, 2))
    seen += idx
  assert sorted(seen) == list(range(23))


# --- the --data forms ------------------------------------------------------------------------

def test_make_sources_libfm(tmp_path, capsys):
  d = tmp_path / "fm"
  d.mkdir()
  write(d, "train.libfm", numbered_fm(10))
  write(d, "valid.libfm", numbered_fm(3))
  write(d, "test.libfm.gz", numbered_fm(4))
  train, ev = sources.make_sources(f"libfm:{d}", 4, num_rows=77)
  assert train.files == (str(d / "train.libfm"),)
  assert ev.files == (str(d / "valid.libfm"), str(d / "test.libfm.gz"))
  assert train.spec.rows_per_feature == (77,) * 4 and ev.spec == train.spec
  assert train.repeat and train.drop_remainder and not ev.repeat and not ev.drop_remainder
  assert ev.num_examples == 7 and train.num_batches == 2
  assert "libFM positional lines" in capsys.readouterr().out
  # eval files must have the train file's field count; the message names the eval line
  write(d, "valid.libfm", numbered_fm(2) + [fm_line("1", [(1, 1)] * 3)])
  _, ev = sources.make_sources(f"libfm:{d}", 4)
  with pytest.raises(ValueError, match=r"valid.libfm:3: a label and 3 idx:val pairs; expected a "
                                       r"label and 4 idx:val pairs \(pairs on the first line of "
                                       r".*train.libfm\)"):
    list(ev.batches())
  os.remove(d / "valid.libfm")
  assert sources.make_sources(f"libfm:{d}", 4)[1].files == (str(d / "test.libfm.gz"),)
  write(d, "train.txt", numbered_fm(2))
  with pytest.raises(ValueError, match=r"several train files \(train.libfm, train.txt\)"):
    sources.make_sources(f"libfm:{d}", 4)
  os.remove(d / "train.libfm")
  os.remove(d / "train.txt")
  with pytest.raises(ValueError, match=r"no train file, expected train or train.<ext> .*; found "
                                       r"test.libfm.gz"):
    sources.make_sources(f"libfm:{d}", 4)
  write(d, "train", numbered_fm(2))
  os.remove(d / "test.libfm.gz")
  with pytest.raises(ValueError, match="no valid or test file"):
    sources.make_sources(f"libfm:{d}", 4)


def test_make_sources_csv_and_forms(tmp_path, capsys):
  write(tmp_path, "train.csv", _numbered_csv(9))
  write(tmp_path, "valid.csv", _numbered_csv(2))
  write(tmp_path, "test.csv", _numbered_csv(3))
  write(tmp_path, "notes.txt", ["x"])
  train, ev = sources.make_sources(f"csv:{tmp_path}", 4, num_rows=33)
  assert [os.path.basename(f) for f in ev.files] == ["valid.csv", "test.csv"]
  assert ev.columns == train.columns and train.columns.dense == ("I1",)
  assert ev.num_examples == 5 and train.spec.rows_per_feature == (33,)
  out = capsys.readouterr().out
  assert f"--data=csv:{tmp_path}: {tmp_path}/train.csv: column roles\n  label: label (" in out
  assert "\n  dense (1, log1p(max(x, 0))): I1 (inferred" in out
  train, _ = sources.make_sources(f"csv:{tmp_path}", 4, csv_label="label", csv_dense="none",
                                  csv_categorical="I1,C1")
  assert train.columns.dense == () and train.columns.categorical == ("I1", "C1")
  os.remove(tmp_path / "train.csv")
  with pytest.raises(ValueError, match=r"no train file, expected train.csv\[.gz\]; found "
                                       r"notes.txt, test.csv, valid.csv"):
    sources.make_sources(f"csv:{tmp_path}", 4)
  for bad in ["libfm", "csv:", "svm:/x"]:
    with pytest.raises(ValueError, match=r"'libfm:DIR' or 'csv:DIR'") as e:
      sources.make_sources(bad, 2)
    assert repr(bad) in str(e.value)


# --- the real Criteo sample converted to both formats -----------------------------------------

def _criteo_to_libfm(line: str) -> str:
  """AutoInt-style: dense field j -> idx j with val log1p(max(x, 0)); categorical -> idx =
  the hex value (2**32 + j when empty, any fixed idx)."""
  f = line.rstrip("\n").split("\t")
  pairs = [(j, repr(math.log1p(max(int(x), 0))) if x else "0") for j, x in enumerate(f[1:14])]
  pairs += [(int(x, 16) if x else 2**32 + j, 1) for j, x in enumerate(f[14:])]
  return fm_line(f[0], pairs)


@needs_criteo
def test_criteo_sample_as_libfm_and_csv(tmp_path):
  rows = 1000
  names = ("train.txt", "valid.txt", "test.txt")
  raw = {}
  for name in names:
    with open(os.path.join(CRITEO_DIR, name)) as f:
      raw[name] = f.readlines()
  fm_dir, csv_dir = tmp_path / "fm", tmp_path / "csv"
  fm_dir.mkdir()
  csv_dir.mkdir()
  header = ",".join(criteo.FIELD_NAMES) + "\n"
  for name in names:
    split = name.split(".")[0]
    write(fm_dir, f"{split}.libfm", [_criteo_to_libfm(l) for l in raw[name]])
    write(csv_dir, f"{split}.csv", [header] + [l.replace("\t", ",") for l in raw[name]])

  ref = criteo.CriteoSource(os.path.join(CRITEO_DIR, "train.txt"), 512, rows,
                            drop_remainder=False, repeat=False)
  r_dense, r_ids, r_labels, _ = real_rows(list(ref.batches()))
  assert len(r_labels) == ref.num_examples == 7200

  fm_train, fm_eval = sources.make_sources(f"libfm:{fm_dir}", 512, num_rows=rows)
  fm = libfm.LibFMSource(fm_train.files, 512, rows, drop_remainder=False, repeat=False)
  _, ids, labels, weights = real_rows(list(fm.batches()))
  assert fm.num_examples == 7200 and fm.num_fields == 39
  np.testing.assert_array_equal(labels, r_labels)
  np.testing.assert_array_equal(weights[:, :13], r_dense)   # same float64 log1p, same rounding
  present = r_ids != 0
  np.testing.assert_array_equal(ids[:, 13:][present], r_ids[present])   # 1 + hex % (rows - 1)
  assert (weights[:, 13:] == 1).all()
  assert fm_eval.num_examples == 409 + 391

  csv_train, csv_eval = sources.make_sources(f"csv:{csv_dir}", 512, num_rows=rows)
  assert csv_train.columns.dense == criteo.DENSE_NAMES
  assert csv_train.columns.categorical == criteo.SPARSE_NAMES
  cs = csv_data.CsvSource(csv_train.files, 512, rows, columns=csv_train.columns,
                          drop_remainder=False, repeat=False)
  dense, ids, labels, weights = real_rows(list(cs.batches()))
  assert cs.num_examples == 7200 and weights is None
  np.testing.assert_array_equal(labels, r_labels)
  np.testing.assert_array_equal(dense, r_dense)
  cats = [l.rstrip("\n").split("\t")[14:] for l in raw["train.txt"]]
  expect = [[1 + zlib.crc32(c.encode()) % (rows - 1) if c else 0 for c in row] for row in cats]
  np.testing.assert_array_equal(ids, np.array(expect))
  assert csv_eval.num_examples == 409 + 391


# --- train_rec end to end -----------------------------------------------------------------------

def test_train_rec_on_libfm_and_csv_dirs(tmp_path):
  # 10 fields, so that the auto plan puts a table on each of the 8 devices.
  rng = np.random.default_rng(0)
  fm_dir, csv_dir = tmp_path / "fm", tmp_path / "csv"
  fm_dir.mkdir()
  csv_dir.mkdir()
  for split, n in (("train", 256), ("valid", 48), ("test", 40)):
    x = rng.integers(0, 20, (n, 10))
    y = (x[:, 0] < 10).astype(int)
    write(fm_dir, f"{split}.svm", [fm_line(str(2 * l - 1), [(100 * j + v, v / 20 if j == 0 else 1)
                                                             for j, v in enumerate(r)])
                                   for l, r in zip(y, x)])
    write(csv_dir, f"{split}.csv",
          ["clicked,I1," + ",".join(f"C{j}" for j in range(1, 10)) + "\n"]
          + [f"{l},{r[0]}," + ",".join(f"v{v}" for v in r[1:]) + "\n" for l, r in zip(y, x)])
  common = ["--preset=small", "--num_rows=64", "--batch_size=64", "--eval_batch_size=64",
            "--steps=6", "--eval_every=0", "--log_every=3"]
  runs = {f"libfm:{fm_dir}": [], f"csv:{csv_dir}": ["--csv_label=clicked"]}
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  procs = {d: forkserver.popen(
      [sys.executable, "-m", "experiments.train_rec", *common, f"--data={d}",
       f"--workdir={tmp_path / d.split(':')[0]}", *extra], cwd=REPO, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d, extra in runs.items()}
  for d, proc in procs.items():   # both at once: most of each run is compiling
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["steps"] == 6 and summary["test_examples"] == 48 + 40
    assert 0.0 <= summary["test_auc"] <= 1.0 and math.isfinite(summary["test_logloss"])
    assert any(l.startswith(f"--data={d}: ") for l in lines)
    config = json.load(open(tmp_path / d.split(":")[0] / "results.json"))["config"]
    assert config["data"] == d
  assert config["csv_label"] == "clicked"
