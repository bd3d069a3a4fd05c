"""Data directories as people download them (rec.data.criteo / avazu layouts, stream.Part):
Criteo Kaggle's train.txt cut as the DLRM reference cuts it, its unlabeled test.txt,
Terabyte day subsets with MLPerf's split, Avazu's train.gz split by day, and the errors for
files given in the wrong place.

References: numpy.array_split (the DLRM reference's own expression for the days and the
halves), plain-Python decodings of the lines (test_data.ref_criteo_line / ref_avazu_line),
datetime for Avazu's days, and the whole-file reader for the parts.
"""

from __future__ import annotations

import datetime
import gzip
import os
import shutil

import numpy as np
import pytest

from core.errors import UserError
from rec.data import avazu, criteo, sources, stream
from tests.rec.test_data import (AVAZU_DIR, AVAZU_HEADER, DATA_DIR, az, line_index,
                                 numbered_criteo, real_rows, ref_avazu_line, ref_criteo_line,
                                 write)

RAW_DIR = os.path.join(DATA_DIR, "criteo_kaggle_raw")
SAMPLE_DIR = os.path.join(DATA_DIR, "criteo_kaggle_sample")
needs_raw = pytest.mark.skipif(
    not os.path.isfile(os.path.join(RAW_DIR, "train.txt")),
    reason=f"Criteo Kaggle raw sample not found at {RAW_DIR} (set REC_DATA_DIR)")


def read(src) -> list:
  return list(src.batches())


def kaggle_dir(tmp_path, n: int, test_lines: int = 5):
  d = tmp_path / "kaggle"
  d.mkdir()
  write(d, "train.txt", numbered_criteo(n))
  unlabeled = [l.split("\t", 1)[1] for l in numbered_criteo(n + test_lines)[n:]]
  write(d, "test.txt", unlabeled)
  return d


@pytest.mark.parametrize("n", [103, 70, 14])
def test_kaggle_download_is_cut_into_days_as_the_dlrm_reference(tmp_path, n):
  d = kaggle_dir(tmp_path, n)
  lay = criteo.criteo_layout(str(d))
  assert lay.kind == "kaggle" and set(lay.splits) == {"train", "valid", "test", "predict"}
  # dlrm_data_pytorch: indices = np.array_split(indices, offset_per_file[1:-1]) with the
  # days of data_utils (divmod, the remainder to the first days); train = days 1-6;
  # test_indices, val_indices = np.array_split(day 7, 2)
  days = np.array_split(np.arange(n), 7)
  test_ref, valid_ref = np.array_split(days[-1], 2)
  want = {"train": np.concatenate(days[:-1]), "test": test_ref, "valid": valid_ref}
  make = lambda parts, **kw: criteo.CriteoSource(parts, 4, 1000, drop_remainder=False,
                                                 repeat=False, **kw)
  for split, ref in want.items():
    np.testing.assert_array_equal(line_index(read(make(lay.splits[split]))), ref, err_msg=split)
  # a part is the same rows whether it is reached by seeking or by reading past the lines
  # before it, from a plain or a gzip file
  gz = write(tmp_path, "train.txt.gz", numbered_criteo(n))
  for split in ("test", "valid"):
    p = lay.splits[split][0]
    rows = real_rows(read(make(p)))
    for other in (stream.Part(p.path, p.start, p.stop), stream.Part(gz, p.start, p.stop)):
      for a, b in zip(rows, real_rows(read(make(other)))):
        np.testing.assert_array_equal(a, b)
  # the unlabeled test.txt: 39 fields, decoded as the same line with a label in front
  pred = real_rows(read(make(lay.splits["predict"], labeled=False)))
  ref = [ref_criteo_line(l, [1000] * 26) for l in numbered_criteo(n + 5)[n:]]
  np.testing.assert_allclose(pred[0], np.array([r[1] for r in ref], np.float32), rtol=1e-6)
  np.testing.assert_array_equal(pred[1], np.array([r[2] for r in ref]))
  assert (pred[2] == 0).all()
  # train_rec's sources: train on days 1-6, evaluate on day 7 (validation, then test)
  train, ev = sources.make_sources(f"criteo:{d}", 2, num_rows=1000)
  assert train.num_examples == len(want["train"])
  np.testing.assert_array_equal(line_index(read(ev)), np.concatenate([valid_ref, test_ref]))
  # several processes: each reads every other record of the part, together all of it
  halves = [criteo.CriteoSource(lay.splits["train"], 2, 1000, drop_remainder=False,
                                repeat=False, shard_index=i, num_shards=2) for i in range(2)]
  got = np.sort(np.concatenate([line_index(read(h)) for h in halves]))
  np.testing.assert_array_equal(got, want["train"])


def test_kaggle_files_in_the_wrong_place_name_file_and_fields(tmp_path):
  d = kaggle_dir(tmp_path, 30)
  # Kaggle's unlabeled test.txt given as training data (39 fields)
  bad = tmp_path / "bad"
  bad.mkdir()
  shutil.copy(d / "test.txt", bad / "train.txt")
  with pytest.raises(UserError) as e:
    criteo.criteo_layout(str(bad))
  assert "expected at least 14" in str(e.value)
  write(bad, "train.txt", [l.split("\t", 1)[1] for l in numbered_criteo(30)])
  train, _ = sources.make_sources(f"criteo:{bad}", 4, num_rows=1000)
  with pytest.raises(UserError) as e:
    read(train)
  assert str(e.value) == (f"{bad}/train.txt:1: 39 tab-separated fields (an unlabeled line, like "
                          "Kaggle's test.txt: training and evaluation need the label first); "
                          "expected 40")
  # a labeled test.txt (40 fields) given for prediction in Kaggle's layout
  write(d, "test.txt", numbered_criteo(3))
  split = sources.split_source(f"criteo:{d}", "predict", 4, 1000)
  with pytest.raises(UserError) as e:
    read(split.source)
  assert str(e.value) == (f"{d}/test.txt:1: 40 tab-separated fields (a labeled line; Kaggle's "
                          "test.txt has no label column); expected 39")
  with pytest.raises(UserError, match=r"--days='0-2': .* holds train.txt \(the Kaggle layout\)"):
    criteo.criteo_layout(str(d), "0-2")
  with pytest.raises(UserError, match=r"--split=predict: .* has the splits train, test, valid; expected one of them"):
    os.remove(d / "test.txt")
    sources.split_source(f"criteo:{d}", "predict", 4, 1000)


def test_custom_split_stays_accepted(tmp_path):
  for name, n in (("train.txt", 9), ("valid.txt", 4), ("test.txt", 5)):
    write(tmp_path, name, numbered_criteo(n))
  lay = criteo.criteo_layout(str(tmp_path))
  assert lay.kind == "custom" and [p.path for p in lay.eval_parts()] == [
      str(tmp_path / "valid.txt"), str(tmp_path / "test.txt")]
  train, ev = sources.make_sources(f"criteo:{tmp_path}", 4, num_rows=77)
  assert train.files == (str(tmp_path / "train.txt"),) and train.num_examples == 9
  assert ev.num_examples == 9 and not ev.repeat and train.repeat
  with pytest.raises(UserError, match=r"--num_rows=3,000,000,000: more rows than an int32 id "
                                      r"can address; expected at most 2\^31"):
    sources.make_sources(f"criteo:{tmp_path}", 4, num_rows=3_000_000_000)


@needs_raw
def test_kaggle_raw_sample_as_downloaded():
  lay = criteo.criteo_layout(RAW_DIR)
  sizes = {k: sum(p.stop - p.start for p in v) for k, v in lay.splits.items() if k != "predict"}
  assert sizes == {"train": 6 * 1143, "test": 571, "valid": 571}   # 8000 = 7 * 1142 + 6
  # the raw sample's test.txt is the labeled sample's test.txt without its label column
  pred = real_rows(read(criteo.CriteoSource(lay.splits["predict"], 100, 1000, labeled=False,
                                            drop_remainder=False, repeat=False)))
  ref = real_rows(read(criteo.CriteoSource(os.path.join(SAMPLE_DIR, "test.txt"), 100, 1000,
                                           drop_remainder=False, repeat=False)))
  np.testing.assert_array_equal(pred[0], ref[0])
  np.testing.assert_array_equal(pred[1], ref[1])
  # and the test split is lines 6859..7429 of train.txt, decoded as plain Python does
  lines = open(os.path.join(RAW_DIR, "train.txt")).read().splitlines()[6858:7429]
  dense, ids, labels = real_rows(read(criteo.CriteoSource(lay.splits["test"], 100, 1000,
                                                          drop_remainder=False, repeat=False)))
  want = [ref_criteo_line(l, [1000] * 26) for l in lines]
  np.testing.assert_array_equal(labels, [w[0] for w in want])
  np.testing.assert_array_equal(ids, [w[2] for w in want])


def test_terabyte_day_subsets_and_the_mlperf_split(tmp_path):
  for day in range(24):
    if day not in (5, 6):
      write(tmp_path, f"day_{day}" + (".gz" if day % 2 else ""), numbered_criteo(3 + day))
  # day 23 present: the others train, its first ceil(n/2) lines validate, the rest test
  lay = criteo.criteo_layout(str(tmp_path), "0-2,23")
  assert [os.path.basename(p.path) for p in lay.splits["train"]] == ["day_0", "day_1.gz", "day_2"]
  n = 3 + 23
  for split, ref in zip(("valid", "test"), np.array_split(np.arange(n), 2)):
    got = line_index(read(criteo.CriteoSource(lay.splits[split], 4, 1000, drop_remainder=False,
                                              repeat=False)))
    np.testing.assert_array_equal(got, ref, err_msg=split)
  # without day 23 the last day given is split the same way; the others train
  lay = criteo.criteo_layout(str(tmp_path), [0, 2, 3])
  assert [os.path.basename(p.path) for p in lay.splits["train"]] == ["day_0", "day_2"]
  assert os.path.basename(lay.splits["valid"][0].path) == "day_3.gz" and "day 23 absent" in lay.note
  assert sum(criteo.CriteoSource(lay.splits[s], 1, 1000, repeat=False).num_examples
             for s in ("valid", "test")) == 6
  # every day present by default (5 and 6 are not)
  lay = criteo.criteo_layout(str(tmp_path))
  assert len(lay.splits["train"]) == 21 and "days 0-4, 7-22 train" in lay.note
  # a missing day, a single day, a bad list: errors naming the file or the flag
  with pytest.raises(UserError) as e:
    criteo.criteo_layout(str(tmp_path), "0-6")
  assert str(e.value).startswith(f"{tmp_path}/day_5[.gz]: not found; expected every day of "
                                 "--days=0-6 (present in")
  with pytest.raises(UserError, match=r"--days=3: one day \(3\); expected at least two"):
    criteo.criteo_layout(str(tmp_path), "3")
  with pytest.raises(UserError, match=r"--days='0-x': '0-x' is not a day"):
    criteo.parse_days("0-x")
  with pytest.raises(UserError, match=r"--days='22-24': day 24; expected days in 0..23"):
    criteo.parse_days("22-24")
  train, ev = sources.make_sources(f"criteo:{tmp_path}", 2, days="0,1,7")
  assert train.num_examples == 3 + 4 and ev.num_examples == 10
  # train_rec's --days reaches the sources through RecRunConfig.days
  import jax
  from rec import configs
  cfg = configs.make_run(model="logreg", data=f"criteo:{tmp_path}", days="0,1,7", mesh="-1",
                             batch_size=2, eval_batch_size=2)
  _, train, ev, _, _ = configs.build_run(cfg, jax.devices()[:1])
  assert train.num_examples == 7 and ev.num_examples == 10
  with pytest.raises(UserError, match="--days=0-2: given with --data=synthetic"):
    sources.make_sources("synthetic", 2, days="0-2")


def avazu_download(tmp_path, days=(21, 22, 23, 24), rows_per_day=50, gz=True):
  """An Avazu train file as downloaded (header, rows in time order over `days` of Oct 2014)
  from the sample's rows, and an unlabeled test file."""
  src = open(os.path.join(AVAZU_DIR, "train.csv")).read().splitlines()[1:]
  lines, k = [AVAZU_HEADER], 0
  for day in days:
    for i in range(rows_per_day):
      f = src[k % len(src)].split(",")
      f[2] = f"1410{day:02d}{i * 24 // rows_per_day:02d}"
      lines.append(",".join(f) + "\n")
      k += 1
  name = "train.gz" if gz else "train"
  write(tmp_path, name, lines)
  test = ["id,hour," + ",".join(avazu.COLUMNS[3:]) + "\n"] + [
      ",".join(l.split(",")[:1] + l.split(",")[2:]) for l in lines[1:6]]
  write(tmp_path, "test.gz" if gz else "test", test)
  return lines[1:]


@pytest.mark.skipif(not os.path.isfile(os.path.join(AVAZU_DIR, "train.csv")),
                    reason="Avazu sample not found (set REC_DATA_DIR)")
@pytest.mark.parametrize("gz", [True, False])
def test_avazu_download_is_split_by_day(tmp_path, gz):
  lines = avazu_download(tmp_path, gz=gz)
  lay = avazu.avazu_layout(str(tmp_path))
  day = [datetime.datetime.strptime(l.split(",")[2], "%y%m%d%H").day for l in lines]
  want = {"train": [i for i, x in enumerate(day) if x < 23], "valid": [i for i, x in enumerate(day)
          if x == 23], "test": [i for i, x in enumerate(day) if x == 24]}
  rows = [100] * 23
  for split, idx in want.items():
    _, ids, labels = real_rows(read(avazu.AvazuSource(lay.splits[split], 7, rows,
                                                      drop_remainder=False, repeat=False,
                                                      days=lay.days[split])))
    ref = [ref_avazu_line(lines[i], rows) for i in idx]
    np.testing.assert_array_equal(labels, [r[0] for r in ref], err_msg=split)
    np.testing.assert_array_equal(ids, [r[1] for r in ref], err_msg=split)
  assert lay.days == {"train": (141021, 141022), "valid": (141023,) * 2, "test": (141024,) * 2}
  # the unlabeled test file: the same ids as the labeled line, its `id` column kept
  split = sources.split_source(f"avazu:{tmp_path}", "predict", 4, 100)
  _, ids, labels = real_rows(read(split.source))
  np.testing.assert_array_equal(ids, [ref_avazu_line(l, rows)[1] for l in lines[:5]])
  assert list(split.row_ids())[:5] == [l.split(",")[0] for l in lines[:5]]
  assert (split.id_column, split.prob_column) == ("id", "click")
  train, ev = sources.make_sources(f"avazu:{tmp_path}", 5, num_rows=100)
  assert train.num_examples == 100 and ev.num_examples == 100


@pytest.mark.skipif(not os.path.isfile(os.path.join(AVAZU_DIR, "train.csv")),
                    reason="Avazu sample not found (set REC_DATA_DIR)")
def test_avazu_out_of_order_and_too_few_days(tmp_path):
  lines = avazu_download(tmp_path, rows_per_day=400)
  bad = list(lines)
  bad[1001] = lines[20]                        # a row of day 21 among day 23's
  write(tmp_path, "train.gz", [AVAZU_HEADER] + bad)
  with pytest.raises(UserError) as e:
    avazu.avazu_layout(str(tmp_path))
  h20, h1000 = lines[20].split(",")[2], lines[1000].split(",")[2]
  assert str(e.value).startswith(f"{tmp_path}/train.gz:1003: hour '{h20}' after {h1000}; "
                                 "expected Avazu's labeled train file in time order")
  avazu_download(tmp_path, days=(21, 22))
  with pytest.raises(UserError, match=r"train.gz: 2 days \(141021, 141022\); expected at least 3"):
    avazu.avazu_layout(str(tmp_path))
  # a row of another day inside a chunk that does not change day stops the reader by name
  lines = avazu_download(tmp_path)
  lay = avazu.avazu_layout(str(tmp_path))
  bad = list(lines)
  bad[110] = bad[110].replace(",141023", ",141021", 1)   # a day-21 hour among day 23's
  write(tmp_path, "train.gz", [AVAZU_HEADER] + bad)
  with pytest.raises(UserError, match=r"train.gz:112: field hour = '1410210.', outside this split's "
                                      r"days 141023..141023; expected the file in time order"):
    read(avazu.AvazuSource(lay.splits["valid"], 5, 100, repeat=False, bad_lines="skip",
                           days=lay.days["valid"]))


def test_line_index_offsets(tmp_path):
  lines = [f"{i}\t" + "x" * (i % 7) + "\n" for i in range(1000)]
  path = write(tmp_path, "f.txt", lines)
  index = stream.index_lines(path)
  assert index.lines == 1000
  starts = np.cumsum([0] + [len(l) for l in lines])
  for k in (0, 1, 517, 999, 1000):
    assert index.offset(k) == starts[k]
  with open(path, "ab") as f:
    f.write(b"last line without a newline")
  index = stream.index_lines(path)
  assert index.lines == 1001 and index.offset(1001) == os.path.getsize(path)
  with pytest.raises(UserError, match="line 1,003 asked for; expected at most 1,001 lines"):
    index.offset(1002)
  with gzip.open(str(tmp_path / "g.gz"), "wb") as f:
    f.write("".join(lines).encode())
  assert stream.index_lines(str(tmp_path / "g.gz")).lines == 1000


def test_eval_lines_are_checked_before_training(tmp_path):
  """`check_splits`: a bad line in the evaluation files stops a run before its first step,
  not at its first evaluation."""
  write(tmp_path, "train.txt", numbered_criteo(20))
  lines = numbered_criteo(9)
  lines[6] = lines[6].replace("\t", "\t-", 1)       # I1 = "-6": fine; then break the label
  lines[7] = "7" + lines[7][1:]
  write(tmp_path, "valid.txt", lines)
  train, ev = sources.make_sources(f"criteo:{tmp_path}", 4, num_rows=100)
  with pytest.raises(UserError, match=r"valid.txt:8: field label = '7'; expected 0 or 1"):
    sources.check_splits(ev)
  sources.check_splits(train)       # a repeating train source is read as it trains
