"""Tests of the recommendation data readers: Criteo, Avazu, synthetic, and the --data flag.

References are plain-Python decodings of the raw text (int(), int(hex, 16), zlib.crc32,
datetime), hand-computed values, and slices of a full iteration for resuming.
"""

from __future__ import annotations

import datetime
import gzip
import itertools
import logging
import math
import os
import zlib

import numpy as np
import pytest

from rec.data import avazu, criteo, sources, synthetic
from rec.data.batch import SparseBatch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.environ.get("REC_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
CRITEO_DIR = os.path.join(DATA_DIR, "criteo_kaggle_sample")
AVAZU_DIR = os.path.join(DATA_DIR, "avazu_sample")
needs_criteo = pytest.mark.skipif(
    not os.path.isfile(os.path.join(CRITEO_DIR, "train.txt")),
    reason=f"Criteo sample not found at {CRITEO_DIR} (set REC_DATA_DIR)")
needs_avazu = pytest.mark.skipif(
    not os.path.isfile(os.path.join(AVAZU_DIR, "train.csv")),
    reason=f"Avazu sample not found at {AVAZU_DIR} (set REC_DATA_DIR)")

# Varied table sizes, so a feature hashed with another feature's modulus would show.
CRITEO_ROWS = [2, 3, 1000, 99_991] + [50 + 7 * i for i in range(22)]


# --- references and helpers --------------------------------------------------------------

def ref_criteo_line(line: str, rows) -> tuple[float, list[float], list[int]]:
  """The decoding of one Criteo line, field by field in plain Python."""
  f = line.rstrip("\r\n").split("\t")
  dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]]
  ids = [1 + int(x, 16) % (r - 1) if x else 0 for x, r in zip(f[14:], rows)]
  return float(f[0]), dense, ids


def ref_avazu_line(line: str, rows) -> tuple[float, list[int]]:
  f = line.rstrip("\r\n").split(",")
  ids = [0, 0]
  if f[2]:
    when = datetime.datetime.strptime(f[2], "%y%m%d%H")
    ids = [1 + when.hour % (rows[0] - 1), 1 + when.weekday() % (rows[1] - 1)]
  ids += [1 + zlib.crc32(x.encode()) % (r - 1) if x else 0 for x, r in zip(f[3:], rows[2:])]
  return float(f[1]), ids


def take(it, n: int) -> list[SparseBatch]:
  return list(itertools.islice(it, n))


def assert_batches_equal(a: list[SparseBatch], b: list[SparseBatch]):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for name in ("dense", "ids", "lengths", "labels", "mask"):
      np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)


def real_rows(batches: list[SparseBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(dense, ids [N, F], labels) of the mask-1 rows of a list of batches."""
  keep = np.concatenate([b.mask for b in batches]) == 1
  return (np.concatenate([b.dense for b in batches])[keep],
          np.concatenate([b.ids[:, :, 0] for b in batches])[keep],
          np.concatenate([b.labels for b in batches])[keep])


def crit(label="0", ints=None, cats=None) -> str:
  """One Criteo line; ints / cats default to distinct valid values."""
  ints = [str(i) for i in range(13)] if ints is None else ints
  cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
  return "\t".join([label] + list(ints) + list(cats)) + "\n"


def numbered_criteo(n: int) -> list[str]:
  """n valid lines whose I1 is the line index and label alternates with a period of 3."""
  return [crit(str(int(i % 3 == 0)), [str(i)] + [str(i * j % 7 - 2) for j in range(12)],
               [f"{(i * 2654435761 + j) % 2**32:x}" for j in range(26)]) for i in range(n)]


def write(tmp_path, name: str, lines: list[str]) -> str:
  path = os.path.join(tmp_path, name)
  data = "".join(lines).encode()
  with (gzip.open(path, "wb") if name.endswith(".gz") else open(path, "wb")) as f:
    f.write(data)
  return path


def line_index(batches: list[SparseBatch]) -> np.ndarray:
  """Recovers the I1 = line index of `numbered_criteo` rows."""
  return np.rint(np.expm1(real_rows(batches)[0][:, 0].astype(np.float64))).astype(int)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Mann-Whitney AUC by ranks (scores are continuous, so ties do not matter)."""
  ranks = np.empty(len(scores))
  ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
  pos = labels == 1
  n_pos, n_neg = pos.sum(), (~pos).sum()
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# --- Criteo on real lines ------------------------------------------------------------------

@needs_criteo
def test_criteo_real_sample_matches_plain_python():
  path = os.path.join(CRITEO_DIR, "train.txt")
  src = criteo.CriteoSource(path, 1024, CRITEO_ROWS, drop_remainder=False, repeat=False)
  assert src.num_examples == 7200 and src.num_batches == 8
  batches = list(src.batches())
  assert len(batches) == 8
  for b in batches:
    assert b.dense.shape == (1024, 13) and b.dense.dtype == np.float32
    assert b.ids.shape == (1024, 26, 1) and b.ids.dtype == np.int32
    assert b.lengths.shape == (1024, 26) and b.lengths.dtype == np.int32
    assert (b.lengths == 1).all()
    assert b.labels.dtype == np.float32 and b.mask.dtype == np.float32 and b.weights is None
  dense, ids, labels = real_rows(batches)
  assert ids.min() >= 0 and (ids < np.array(CRITEO_ROWS)).all()
  assert (dense >= 0).all()

  with open(path) as f:
    raw = f.readlines()
  assert len(raw) == len(labels) == 7200
  assert labels.mean() == pytest.approx(0.215, abs=0.002)
  ref = [ref_criteo_line(line, CRITEO_ROWS) for line in raw]
  np.testing.assert_array_equal(labels, [r[0] for r in ref])
  np.testing.assert_allclose(dense, np.array([r[1] for r in ref]), rtol=1e-6, atol=0)
  np.testing.assert_array_equal(ids, np.array([r[2] for r in ref]))


@needs_criteo
def test_criteo_first_line_by_hand():
  # First line of train.txt: label 0, I = 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2,
  # C1 = 68fd1e64, C2 = 80e26c9b, C22 = <empty>, C26 = 9727dd16.
  src = criteo.CriteoSource(os.path.join(CRITEO_DIR, "train.txt"), 4, 1000, repeat=False)
  b = next(src.batches())
  assert b.labels[0] == 0
  np.testing.assert_allclose(
      b.dense[0], np.log1p([1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2]).astype(np.float32))
  assert b.ids[0, 0, 0] == 1 + 0x68FD1E64 % 999
  assert b.ids[0, 1, 0] == 1 + 0x80E26C9B % 999
  assert b.ids[0, 21, 0] == 0
  assert b.ids[0, 25, 0] == 1 + 0x9727DD16 % 999


# --- Criteo edge cases ---------------------------------------------------------------------

def test_criteo_edge_values(tmp_path):
  ints = ["", "-3", "0", "7", "123456789012", "-99999999999", "18", "", "", "", "1", "-0", ""]
  cats = ["", "0", "a", "FFFFFFFF", "ffffffff", "AbC"] + [f"{i:x}" for i in range(20)]
  lines = [crit("1", ints, cats).replace("\n", "\r\n"),                     # CRLF
           crit("0", [""] * 13, [""] * 26).rstrip("\n")]                     # no final newline
  path = write(tmp_path, "edge.txt", lines)
  src = criteo.CriteoSource(path, 2, 100, repeat=False)
  assert src.num_examples == 2
  b = next(src.batches())
  expect = [0, 0, 0, 7, 123456789012, 0, 18, 0, 0, 0, 1, 0, 0]
  np.testing.assert_allclose(b.dense[0], np.log1p(np.array(expect, np.float64)).astype(np.float32))
  ids = b.ids[0, :, 0]
  assert list(ids[:6]) == [0, 1 + 0 % 99, 1 + 10 % 99, 1 + 0xFFFFFFFF % 99, 1 + 0xFFFFFFFF % 99,
                           1 + 0xABC % 99]
  assert b.labels.tolist() == [1, 0]
  assert (b.dense[1] == 0).all() and (b.ids[1] == 0).all()


def test_criteo_gz_equals_plain(tmp_path):
  lines = numbered_criteo(50)
  plain = criteo.CriteoSource(write(tmp_path, "day_0", lines), 8, 1000, repeat=False,
                              drop_remainder=False)
  gz = criteo.CriteoSource(write(tmp_path, "day_0.gz", lines), 8, 1000, repeat=False,
                           drop_remainder=False)
  assert gz.num_examples == plain.num_examples == 50
  assert_batches_equal(list(gz.batches()), list(plain.batches()))
  assert_batches_equal(take(gz.batches(3), 2), take(plain.batches(3), 2))


BAD_CASES = [
    (crit("0", cats=[f"{i:08x}" for i in range(25)]),
     "39 tab-separated fields (an unlabeled line, like Kaggle's test.txt: training and "
     "evaluation need the label first); expected 40"),
    (crit("0").rstrip("\n") + "\textra\n", "41 tab-separated fields; expected 40"),
    ("\n", "1 tab-separated fields; expected 40"),
    (crit("2"), "field label = '2'; expected 0 or 1"),
    (crit(""), "field label = ''; expected 0 or 1"),
    (crit("01"), "field label = '01'; expected 0 or 1"),
    (crit("0", ints=["1"] * 4 + ["abc"] + ["1"] * 8),
     "field I5 = 'abc'; expected an integer or empty"),
    (crit("0", ints=["1.5"] + ["1"] * 12), "field I1 = '1.5'; expected an integer or empty"),
    (crit("0", ints=["1"] * 12 + ["-"]), "field I13 = '-'; expected an integer or empty"),
    (crit("0", ints=["+3"] + ["1"] * 12), "field I1 = '+3'; expected an integer or empty"),
    (crit("0", ints=["1"] * 2 + ["12a456789012"] + ["1"] * 10),
     "field I3 = '12a456789012'; expected an integer or empty"),
    (crit("0", ints=["1" * 19] + ["1"] * 12),
     "field I1 = '1111111111111111111'; expected an integer of at most 18 digits or empty"),
    (crit("0", cats=["0"] * 11 + ["xyz12345"] + ["0"] * 14),
     "field C12 = 'xyz12345'; expected up to 8 hex digits or empty"),
    (crit("0", cats=["0"] * 25 + ["123456789"]),
     "field C26 = '123456789'; expected up to 8 hex digits or empty"),
    (crit("0", cats=["0x12"] + ["0"] * 25),
     "field C1 = '0x12'; expected up to 8 hex digits or empty"),
    (crit("1", ints=["abc"] + ["1"] * 12, cats=["zz"] * 26),   # the first bad field is named
     "field I1 = 'abc'; expected an integer or empty"),
]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 300])
@pytest.mark.parametrize("bad_line,message", BAD_CASES)
def test_criteo_bad_line_raises_with_file_line_field(tmp_path, bad_line, message, chunk_bytes):
  good = write(tmp_path, "good.txt", numbered_criteo(4))
  lines = numbered_criteo(6)
  lines[2] = bad_line
  bad = write(tmp_path, "bad.txt", lines)
  src = criteo.CriteoSource([good, bad], 2, 1000, chunk_bytes=chunk_bytes)
  with pytest.raises(ValueError) as err:
    take(src.batches(), 10)
  assert str(err.value) == f"{bad}:3: {message}"


def test_criteo_skip_bad_lines(tmp_path, caplog):
  lines = numbered_criteo(12)
  bad_at = [1, 6, 7, 11]
  for i, (bad_line, _) in zip(bad_at, BAD_CASES[::4]):
    lines[i] = bad_line
  path = write(tmp_path, "mixed.txt", lines)
  clean = write(tmp_path, "clean.txt", [l for i, l in enumerate(lines) if i not in bad_at])
  caplog.set_level(logging.WARNING)
  src = criteo.CriteoSource(path, 3, 1000, bad_lines="skip", repeat=False)
  got = list(src.batches())
  assert src.bad_line_count == 4
  assert_batches_equal(got, list(criteo.CriteoSource(clean, 3, 1000, repeat=False).batches()))
  assert src.num_batches == 2 and src.num_examples == 8
  list(src.batches())   # a second pass finds the same lines, counted once
  assert src.bad_line_count == 4
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(f"{path}:2: 39 tab-separated fields" in w for w in warnings), warnings
  # The same file in error mode fails on its first bad line.
  with pytest.raises(ValueError, match=r"mixed\.txt:2: "):
    list(criteo.CriteoSource(path, 3, 1000).batches())


@pytest.mark.parametrize("bad_lines", ["error", "skip"])
@pytest.mark.parametrize("num_shards,chunk_bytes", [(1, 1 << 20), (1, 250), (2, 600)])
def test_criteo_resume_equals_slice_of_full_iteration(tmp_path, bad_lines, num_shards, chunk_bytes):
  lines = numbered_criteo(47)
  if bad_lines == "skip":
    for i in (3, 20, 21, 40):
      lines[i] = crit("7")
  files = [write(tmp_path, "a.txt", lines[:20]), write(tmp_path, "b.txt.gz", lines[20:])]
  kw = dict(bad_lines=bad_lines, shard_index=num_shards - 1, num_shards=num_shards,
            chunk_bytes=chunk_bytes)
  src = criteo.CriteoSource(files, 4, 1000, **kw)
  nb = src.num_batches
  n_valid = len(range(num_shards - 1, 47, num_shards)) - (
      0 if bad_lines == "error" else sum(i % num_shards == num_shards - 1 for i in (3, 20, 21, 40)))
  assert src.num_examples == n_valid and nb == n_valid // 4
  full = take(src.batches(), 3 * nb + 2)   # more than two epochs
  assert_batches_equal(full[:nb], full[nb:2 * nb])
  for start in range(0, 2 * nb + 1):
    # A fresh source each time: resuming must not depend on state from earlier passes.
    fresh = criteo.CriteoSource(files, 4, 1000, **kw)
    assert_batches_equal(take(fresh.batches(start), 3), full[start:start + 3])
    assert_batches_equal(take(src.batches(start), 3), full[start:start + 3])
  # One pass, padded: resuming without knowing the epoch length (or the bad lines) up front.
  ev_kw = dict(kw, drop_remainder=False, repeat=False)
  full = list(criteo.CriteoSource(files, 4, 1000, **ev_kw).batches())
  assert len(full) == math.ceil(n_valid / 4)
  for start in range(0, len(full) + 2):
    fresh = criteo.CriteoSource(files, 4, 1000, **ev_kw)
    assert_batches_equal(list(fresh.batches(start)), full[start:])


def test_criteo_shards_are_disjoint_and_cover(tmp_path):
  lines = numbered_criteo(25)
  files = [write(tmp_path, "x.txt", lines[:9]), write(tmp_path, "y.txt", lines[9:])]
  seen = []
  for s in range(3):
    src = criteo.CriteoSource(files, 4, 1000, shard_index=s, num_shards=3, repeat=False,
                              drop_remainder=False, chunk_bytes=500)
    idx = line_index(list(src.batches()))
    assert list(idx) == list(range(s, 25, 3))
    assert src.num_examples == len(idx)
    seen += list(idx)
  assert sorted(seen) == list(range(25))


def test_sources_of_several_processes_split_each_global_batch(tmp_path):
  """make_sources with num_shards: global batch sizes, each process's share of every global
  batch (the same lines as one process, interleaved), eval streams of equal length."""
  d = tmp_path / "k"
  d.mkdir()
  write(d, "train.txt", numbered_criteo(40))
  write(d, "valid.txt", numbered_criteo(5))        # 9 eval lines: 5 + 4 per shard,
  write(d, "test.txt", numbered_criteo(4))         # 2 and 1 batches of 4
  one_tr, one_ev = sources.make_sources(f"criteo:{d}", 8, eval_batch_size=8, num_rows=1000)
  parts = [sources.make_sources(f"criteo:{d}", 8, eval_batch_size=8, num_rows=1000,
                                shard_index=s, num_shards=2) for s in range(2)]
  for k, batch in enumerate(take(one_tr.batches(), 3)):
    shares = [take(tr.batches(k), 1)[0] for tr, _ in parts]
    assert all(b.batch_size == 4 for b in shares)
    assert sorted(np.concatenate([line_index([b]) for b in shares])) == sorted(line_index([batch]))
  evs = [list(ev.batches()) for _, ev in parts]
  assert len(evs[0]) == len(evs[1]) == parts[0][1].num_batches == 2      # shard 1 padded
  assert evs[1][-1].mask.sum() == 0 and evs[0][-1].mask.sum() == 1     # the padding batch
  got = sorted(np.concatenate([line_index(e) for e in evs]))
  assert got == sorted(line_index(list(one_ev.batches())))
  with pytest.raises(ValueError, match="--batch_size=9 is not divisible by the 2 processes"):
    sources.make_sources(f"criteo:{d}", 9, num_rows=1000, shard_index=0, num_shards=2)


def test_criteo_eval_padding_and_train_remainder(tmp_path):
  path = write(tmp_path, "t.txt", numbered_criteo(10))
  ev = criteo.CriteoSource(path, 4, 1000, drop_remainder=False, repeat=False)
  batches = list(ev.batches())
  assert ev.num_batches == len(batches) == 3
  last = batches[-1]
  assert last.mask.tolist() == [1, 1, 0, 0]
  assert (last.ids[2:] == 0).all() and (last.dense[2:] == 0).all() and (last.labels[2:] == 0).all()
  assert (last.lengths == 1).all()
  assert (batches[0].mask == 1).all()
  assert list(line_index(batches)) == list(range(10))
  assert_batches_equal(take(ev.batches(2), 5), batches[2:])
  assert take(ev.batches(3), 1) == []

  train = criteo.CriteoSource(path, 4, 1000)
  assert train.num_batches == 2
  first = take(train.batches(), 4)
  assert list(line_index(first)) == [0, 1, 2, 3, 4, 5, 6, 7] * 2  # 8, 9 dropped every epoch


def test_criteo_argument_checks(tmp_path):
  path = write(tmp_path, "t.txt", numbered_criteo(3))
  with pytest.raises(ValueError, match="rows_per_feature for C1 = 1, expected an int >= 2"):
    criteo.CriteoSource(path, 2, 1)
  with pytest.raises(ValueError, match="rows_per_feature for C3 = 0"):
    criteo.CriteoSource(path, 2, [5, 5, 0] + [5] * 23)
  with pytest.raises(ValueError, match="has 25 entries, expected one int or 26"):
    criteo.CriteoSource(path, 2, [5] * 25)
  with pytest.raises(ValueError, match="bad_lines='ignore'"):
    criteo.CriteoSource(path, 2, bad_lines="ignore")
  with pytest.raises(ValueError, match="shard_index=2"):
    criteo.CriteoSource(path, 2, shard_index=2, num_shards=2)
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    criteo.CriteoSource(os.path.join(tmp_path, "nope.txt"), 2)
  with pytest.raises(ValueError, match="fewer than batch_size=4"):
    take(criteo.CriteoSource(path, 4).batches(), 1)


# --- Avazu ---------------------------------------------------------------------------------

AVAZU_HEADER = ",".join(avazu.COLUMNS) + "\n"


def az(click="0", hour="14102100", cats=None, row_id="1") -> str:
  cats = [f"v{i}" for i in range(21)] if cats is None else cats
  return ",".join([row_id, click, hour] + list(cats)) + "\n"


@needs_avazu
def test_avazu_real_sample_matches_plain_python():
  rows = avazu.avazu_rows(1000)
  src = avazu.AvazuSource(os.path.join(AVAZU_DIR, "train.csv"), 1000, 1000,
                          drop_remainder=False, repeat=False)
  # train.csv: a header line and 8087 data rows (8088 lines).
  assert src.num_examples == 8087 and src.num_batches == 9
  batches = list(src.batches())
  b = batches[0]
  assert b.dense.shape == (1000, 0) and b.ids.shape == (1000, 23, 1)
  assert src.spec.rows_per_feature == rows and rows[:3] == (25, 8, 1000)
  dense, ids, labels = real_rows(batches)
  with open(os.path.join(AVAZU_DIR, "train.csv")) as f:
    raw = f.readlines()[1:]
  ref = [ref_avazu_line(line, rows) for line in raw]
  np.testing.assert_array_equal(labels, [r[0] for r in ref])
  np.testing.assert_array_equal(ids, np.array([r[1] for r in ref]))
  assert ids.min() >= 0 and (ids < np.array(rows)).all()
  # every row is from 2014-10-21, a Tuesday: day_of_week id = 1 + 1
  assert (ids[:, 1] == 2).all()
  dev = avazu.AvazuSource(os.path.join(AVAZU_DIR, "dev.csv"), 100, repeat=False,
                          drop_remainder=False)
  assert dev.num_examples == 480 and len(real_rows(list(dev.batches()))[2]) == 480


def test_avazu_header_detection_and_hour_features(tmp_path):
  rows = [("0", "14102923"), ("1", "14010100"), ("0", ""), ("1", "16022912")]
  lines = [az(c, h) for c, h in rows]
  with_header = write(tmp_path, "train.csv", [AVAZU_HEADER] + lines)
  without = write(tmp_path, "dev.csv.gz", lines)
  a = list(avazu.AvazuSource(with_header, 4, 100, repeat=False).batches())
  b = list(avazu.AvazuSource(without, 4, 100, repeat=False).batches())
  assert_batches_equal(a, b)
  ids = a[0].ids[:, :, 0]
  # 2014-10-29 23h is a Wednesday (2), 2014-01-01 0h a Wednesday, 2016-02-29 12h a Monday (0)
  assert ids[:, 0].tolist() == [24, 1, 0, 13]
  assert ids[:, 1].tolist() == [3, 3, 0, 1]
  assert ids[0, 2] == 1 + zlib.crc32(b"v0") % 99 and ids[0, 22] == 1 + zlib.crc32(b"v20") % 99
  assert a[0].labels.tolist() == [0, 1, 0, 1]
  assert avazu.AvazuSource(with_header, 4, 100).num_examples == 4


@pytest.mark.parametrize("bad_line,message", [
    (az(click="yes"), "field click = 'yes'; expected 0 or 1"),
    (az(hour="14133100"), "field hour = '14133100'; expected YYMMDDHH"),
    (az(hour="14023000"), "field hour = '14023000'; expected YYMMDDHH"),
    (az(hour="14102124"), "field hour = '14102124'; expected YYMMDDHH"),
    (az(hour="1410210"), "field hour = '1410210'; expected YYMMDDHH"),
    (az(hour="141021000"), "field hour = '141021000'; expected YYMMDDHH"),
    (az(hour="1410210x"), "field hour = '1410210x'; expected YYMMDDHH"),
    (az(cats=["a"] * 20), "23 comma-separated fields (an unlabeled line, like Kaggle's test.gz"),
])
def test_avazu_bad_lines(tmp_path, bad_line, message):
  lines = [AVAZU_HEADER, az(), az(), bad_line, az()]
  path = write(tmp_path, "train.csv", lines)
  with pytest.raises(ValueError) as err:
    list(avazu.AvazuSource(path, 2, repeat=False).batches())
  assert str(err.value).startswith(f"{path}:4: {message}")   # header is line 1
  src = avazu.AvazuSource(path, 2, bad_lines="skip", repeat=False)
  assert src.num_examples == 3 and src.bad_line_count == 1


def test_avazu_shards_and_resume(tmp_path):
  lines = [az(str(i % 2), cats=[str(i)] * 21) for i in range(17)]
  path = write(tmp_path, "train.csv", [AVAZU_HEADER] + lines)
  seen = []
  for s in range(2):
    src = avazu.AvazuSource(path, 3, 1000, shard_index=s, num_shards=2)
    full = take(src.batches(), 8)
    assert_batches_equal(take(src.batches(5), 3), full[5:])
    one_epoch = full[:src.num_batches]
    seen.append(real_rows(one_epoch)[1][:, 2])
  expect = [1 + zlib.crc32(str(i).encode()) % 999 for i in range(17)]
  # shard 0: records 0, 2 .. 16 (3 full batches); shard 1: 1, 3 .. 15 (2 batches, 15 dropped)
  assert list(seen[0]) == expect[0:17:2] and list(seen[1]) == expect[1:13:2]


# --- synthetic -------------------------------------------------------------------------------

def test_synthetic_determinism_shapes_and_ranges():
  rows = [1, 2, 10] + [1000] * 22 + [3]
  a = synthetic.SyntheticCriteo(64, rows, seed=3, num_batches=5)
  b = synthetic.SyntheticCriteo(64, rows, seed=3, num_batches=5)
  all_a = list(a.batches())
  assert len(all_a) == 5 and a.num_batches == 5
  assert_batches_equal(all_a, list(b.batches()))
  assert_batches_equal(list(a.batches(3)), all_a[3:])
  x = all_a[0]
  assert x.dense.shape == (64, 13) and x.dense.dtype == np.float32 and (x.dense >= 0).all()
  assert x.ids.shape == (64, 26, 1) and x.ids.dtype == np.int32
  assert (x.lengths == 1).all() and (x.mask == 1).all() and set(np.unique(x.labels)) <= {0, 1}
  ids = np.concatenate([y.ids[:, :, 0] for y in all_a])
  assert ids.min() >= 0 and (ids < np.array(rows)).all() and (ids[:, 0] == 0).all()
  assert ids[:, 2].max() >= 5   # a 10-row table is not stuck at a few rows
  assert not np.array_equal(synthetic.SyntheticCriteo(64, rows, seed=4).batch(0).ids, x.ids)
  test = synthetic.SyntheticCriteo(64, rows, seed=3, split="test")
  assert not np.array_equal(test.batch(0).ids, x.ids)
  assert synthetic.SyntheticCriteo(64, rows, seed=3).num_batches is None
  # shard s of n yields rows [s*b, (s+1)*b) of every global batch: the same global batches
  # for any number of processes
  halves = [synthetic.SyntheticCriteo(64, rows, seed=3, shard_index=s, num_shards=2,
                                      num_batches=5) for s in range(2)]
  for k in (0, 3):
    both = [h.batch(k) for h in halves]
    assert both[0].batch_size == 32
    for name in ("dense", "ids", "lengths", "labels", "mask"):
      np.testing.assert_array_equal(np.concatenate([getattr(h, name) for h in both]),
                                    getattr(all_a[k], name), err_msg=name)
  with pytest.raises(ValueError, match="not divisible by num_shards=3"):
    synthetic.SyntheticCriteo(64, rows, shard_index=0, num_shards=3)


def test_zipf_ranks_match_exact_pmf():
  rng = np.random.default_rng(0)
  for num_rows, alpha in [(300, 1.05), (5000, 1.05), (4000, 1.0), (3000, 0.0)]:
    n = 400_000
    r = synthetic.zipf_ranks(rng, num_rows, n, alpha)
    assert r.min() >= 0 and r.max() < num_rows
    pmf = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
    pmf /= pmf.sum()
    emp = np.bincount(r, minlength=num_rows) / n
    # Kolmogorov-Smirnov bound at p ~ 1e-4
    assert np.abs(np.cumsum(emp) - np.cumsum(pmf)).max() < 2.2 / math.sqrt(n), (num_rows, alpha)
  big = synthetic.zipf_ranks(rng, 10**9, 10_000, 1.05)
  assert big.min() >= 0 and big.max() < 10**9 and big.max() > 10**6


class _FixedUniforms:
  """Stands in for a Generator whose random() returns the given numbers."""

  def __init__(self, u):
    self.u = np.asarray(u, np.float64)

  def random(self, size):
    return self.u.reshape(size)


@pytest.mark.parametrize("num_rows,alpha", [(700, 1.05), (6000, 1.05), (3000, 1.0), (2500, 0.5)])
def test_zipf_ranks_inverse_cdf_exact_at_rank_midpoints(num_rows, alpha):
  # A uniform at the middle of rank r's slice of the exact CDF must give rank r, head and
  # tail alike (the tail's midpoint-rule masses are off by ~1e-7 of a rank's own mass).
  pmf = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
  cdf = np.cumsum(pmf) / pmf.sum()
  mid = cdf - 0.5 * pmf / pmf.sum()
  got = synthetic.zipf_ranks(_FixedUniforms(mid), num_rows, num_rows, alpha)
  np.testing.assert_array_equal(got, np.arange(num_rows))


def test_synthetic_zipf_skew_and_scatter():
  src = synthetic.SyntheticCriteo(2048, 100_000, seed=0)
  ids = np.concatenate([src.batch(k).ids[:, 0, 0] for k in range(5)])
  values, counts = np.unique(ids, return_counts=True)
  order = np.argsort(-counts)
  assert counts[order[:100]].sum() / len(ids) > 0.4   # 100 of 100k rows take > 40% of lookups
  assert counts[order[0]] / len(ids) > 0.08           # rank 0: 1 / H(100k, 1.05) ~ 0.1
  # The three hottest rows are ranks 0, 1, 2 sent through feature 0's fixed permutation.
  a, b = synthetic.row_permutation(100_000, 0)
  assert list(values[order[:3]]) == [(a * r + b) % 100_000 for r in range(3)]
  assert sorted(values[order[:3]]) != [0, 1, 2]
  plain = synthetic.zipf_ids(np.random.default_rng(1), 1000, 10_000, 1.05, perm_seed=None)
  assert np.bincount(plain).argmax() == 0
  scattered = synthetic.zipf_ids(np.random.default_rng(1), 1000, 10_000, 1.05, perm_seed=0)
  a, b = synthetic.row_permutation(1000, 0)
  np.testing.assert_array_equal(scattered, (plain.astype(np.int64) * a + b) % 1000)
  assert len(np.unique((np.arange(1000) * a + b) % 1000)) == 1000   # a permutation


def test_synthetic_planted_signal_auc():
  src = synthetic.SyntheticCriteo(2048, seed=0, split="test")
  logits, labels = [], []
  for k in range(10):
    b = src.batch(k)
    logits.append(src.true_logits(b))
    labels.append(b.labels)
  logits, labels = np.concatenate(logits), np.concatenate(labels)
  assert 0.22 < labels.mean() < 0.28
  assert auc(logits, labels) > 0.75
  # the AUC helper against brute force over all pairs, and near 0.5 for unrelated labels
  s, y = logits[:300], labels[:300]
  pairs = (s[y == 1][:, None] > s[y == 0][None, :]).mean()
  assert auc(s, y) == pytest.approx(pairs, abs=1e-12)
  assert abs(auc(logits, np.random.default_rng(0).permutation(labels)) - 0.5) < 0.03


# --- the --data flag ----------------------------------------------------------------------

def test_make_sources_synthetic():
  train, ev = sources.make_sources("synthetic", 32, eval_batch_size=16, num_rows=50,
                                   eval_batches=3)
  assert train.num_batches is None and ev.num_batches == 3 and len(list(ev.batches())) == 3
  assert next(ev.batches()).labels.shape == (16,)
  assert train.spec.rows_per_feature == (50,) * 26
  assert sources.make_sources("synthetic", 8)[0].spec.rows_per_feature == (100_000,) * 26


def test_make_sources_criteo_layouts(tmp_path):
  kaggle = tmp_path / "kaggle"
  kaggle.mkdir()
  for name in ("train.txt", "valid.txt", "test.txt"):
    write(kaggle, name, numbered_criteo(9))
  train, ev = sources.make_sources(f"criteo:{kaggle}", 4, num_rows=77)
  assert train.files == (str(kaggle / "train.txt"),)
  assert ev.files == (str(kaggle / "valid.txt"), str(kaggle / "test.txt"))
  assert train.spec.rows_per_feature == (77,) * 26 and train.repeat and not ev.repeat
  assert ev.num_examples == 18 and not ev.drop_remainder and train.drop_remainder

  tera = tmp_path / "tera"
  tera.mkdir()
  for d in range(24):
    write(tera, f"day_{d}" + (".gz" if d % 2 else ""), numbered_criteo(2))
  train, ev = sources.make_sources(f"criteo:{tera}", 4, num_shards=2, shard_index=1)
  assert [os.path.basename(f) for f in train.files] == [
      f"day_{d}" + (".gz" if d % 2 else "") for d in range(23)]
  # day 23's halves: validation (its first line), then test (its second)
  assert [(os.path.basename(p.path), p.start, p.stop) for p in ev.parts] == [
      ("day_23.gz", 0, 1), ("day_23.gz", 1, 2)]
  assert train.num_examples == 23 and train.spec.rows_per_feature == (100_000,) * 26
  os.remove(tera / "day_5.gz")
  with pytest.raises(ValueError, match=r"day_5\[\.gz\]: not found"):
    sources.make_sources(f"criteo:{tera}", 4, days="0-23")
  assert sources.make_sources(f"criteo:{tera}", 4)[0].num_examples == 44   # the 22 days present


def test_make_sources_avazu_and_bad_values(tmp_path):
  write(tmp_path, "train.csv", [AVAZU_HEADER] + [az()] * 5)
  write(tmp_path, "dev.csv", [az()] * 2)
  write(tmp_path, "test.csv", [az()] * 3)
  train, ev = sources.make_sources(f"avazu:{tmp_path}", 2)
  assert train.num_examples == 5 and ev.num_examples == 5 and train.spec.num_dense == 0
  for bad in ["criteo", "criteo:", "avazu", "imagenet:/x", "synthetic:3"]:
    with pytest.raises(ValueError, match=r"expected 'synthetic', 'criteo:DIR' or 'avazu:DIR'") as e:
      sources.make_sources(bad, 2)
    assert repr(bad) in str(e.value)
  with pytest.raises(ValueError, match="is not a directory"):
    sources.make_sources(f"avazu:{tmp_path}/nothing", 2)
  with pytest.raises(ValueError, match="neither train.txt"):
    sources.make_sources(f"criteo:{tmp_path}", 2)


# --- damaged .gz files and --num_rows bounds: one line naming the file or the flag ----------

def _truncated_gz(path, lines: list[str]) -> None:
  """A gzip file of `lines` cut in half, as an interrupted download leaves it."""
  data = gzip.compress("".join(lines).encode())
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])


def _assert_names(e, path) -> None:
  from core import cli
  assert cli.is_user_error(e.value), repr(e.value)
  msg = str(e.value)
  assert msg.startswith(f"{path}: the gzip stream ends before its end marker") and "\n" not in msg


def test_truncated_gz_names_the_file(tmp_path):
  from core.errors import UserError
  # Criteo text .gz: met when the reader reaches it
  day = tmp_path / "one" / "day_0.gz"
  day.parent.mkdir()
  _truncated_gz(day, numbered_criteo(3000))
  with pytest.raises(UserError) as e:
    list(criteo.CriteoSource(str(day), 4, 1000, repeat=False).batches())
  _assert_names(e, day)
  # Avazu's train.gz: its days are scanned when the layout is made
  avz = tmp_path / "avazu"
  avz.mkdir()
  _truncated_gz(avz / "train.gz", [AVAZU_HEADER] + [az(hour=f"141021{h:02d}", row_id=str(i))
                                                    for i, h in enumerate(range(24))] * 40)
  with pytest.raises(UserError) as e:
    sources.make_sources(f"avazu:{avz}", 4)
  _assert_names(e, avz / "train.gz")
  # a Terabyte train day training would reach only late: found before any batch is drawn
  tera = tmp_path / "tera"
  tera.mkdir()
  for d in range(3):
    write(tera, f"day_{d}.gz", numbered_criteo(2000))
  _truncated_gz(tera / "day_1.gz", numbered_criteo(2000))
  with pytest.raises(UserError) as e:
    sources.make_sources(f"criteo:{tera}", 4)
  _assert_names(e, tera / "day_1.gz")
  write(tera, "day_1.gz", numbered_criteo(2000))   # whole again: accepted
  assert sources.make_sources(f"criteo:{tera}", 4)[0].num_examples == 4000


def test_empty_gz_is_a_truncated_download(tmp_path):
  """A 0-byte .gz (a download cut before its first byte) is no gzip stream (`gzip -t`
  refuses it); Python's gzip would read it as an empty file, an eval split of no rows."""
  from core import cli
  from rec.data import textfiles
  empty = tmp_path / "test.gz"
  empty.write_bytes(b"")
  for read in (lambda: textfiles.verify_gzip([str(empty)]),
               lambda: textfiles.index_lines(str(empty)),
               lambda: list(criteo.CriteoSource(str(empty), 4, 1000, repeat=False).batches())):
    with pytest.raises(ValueError) as e:
      read()
    assert cli.is_user_error(e.value), repr(e.value)
    assert str(e.value).startswith(f"{empty}: an empty file (0 bytes), not a gzip stream")
  write(tmp_path, "whole.gz", [])    # an empty stream, compressed: still an empty file
  assert textfiles.index_lines(str(tmp_path / "whole.gz")).lines == 0


def test_num_rows_bounds_name_the_flag(tmp_path):
  from core.errors import UserError
  for name in ("train.txt", "valid.txt"):
    write(tmp_path, name, numbered_criteo(9))
  top = 2**31 - 2   # ids and the padding id num_rows below int32's maximum
  for data in (f"criteo:{tmp_path}", "synthetic"):
    sources.make_sources(data, 4, num_rows=top)
    for n in (top + 1, 2**31, 2**31 + 1):
      with pytest.raises(UserError, match=rf"^--num_rows={n:,}: more rows than an int32 id can "
                                          rf"address; expected at most 2\^31 - 2 = {top:,} "):
        sources.make_sources(data, 4, num_rows=n)
  with pytest.raises(UserError, match=r"^--num_rows=1: too few rows; expected at least 2"):
    sources.make_sources(f"criteo:{tmp_path}", 4, num_rows=1)
