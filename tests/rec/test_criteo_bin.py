"""Criteo conversion to numpy shards and the Grain reader of them (rec.data.criteo_bin).

References: the text reader (`criteo.CriteoSource`) on the same files, a plain-Python
vocabulary, and slices of an uninterrupted iteration. Files are made in the test.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys

import numpy as np
import pytest

from core.errors import UserError
from rec.data import criteo, criteo_bin, sources
from tests import cpu_env
from tests.experiments.entry import REPO
from tests import forkserver
from tests.rec import in_process_pool as in_process_pool_lib

ROWS = 97


def line(i: int) -> str:
  """A valid Criteo line whose I1 is i; categorical values repeat with skewed counts."""
  label = str(int(i % 3 == 0))
  ints = [str(i)] + [str((i * j) % 7 - 2) if j % 4 else "" for j in range(1, 13)]
  cats = [f"{(i * i + f) % (3 + f * 5):x}" if (i + f) % 9 else "" for f in range(26)]
  return "\t".join([label] + ints + cats) + "\n"


def kaggle_dir(tmp_path, n_train=3000, name="src"):
  d = tmp_path / name
  d.mkdir()
  (d / "train.txt").write_text("".join(line(i) for i in range(n_train)))
  (d / "valid.txt").write_text("".join(line(i) for i in range(n_train, n_train + 150)))
  (d / "test.txt").write_text("".join(line(i) for i in range(n_train + 150, n_train + 250)))
  return d


def convert(src, dst, **kw):
  kw.setdefault("num_rows", ROWS)
  kw.setdefault("workers", 2)
  kw.setdefault("unit_bytes", 40_000)   # several units per file
  return criteo_bin.convert(str(src), str(dst), **kw)


CONVERT = sys.modules["rec.data.criteo_bin.convert"]


@pytest.fixture
def in_process_pool(monkeypatch):
  """`convert`'s units converted in this process instead of spawned worker processes (each
  spawn imports the project anew): for tests of what a conversion writes, resumes and
  refuses. The spawned pool itself converts in the two tests that take no such fixture
  (test_conversion_equals_the_text_reader_and_shuffles_blocks: hashed ids;
  test_vocabulary_with_frequency_threshold: the vocabulary's counting pass too)."""
  in_process_pool_lib.use(monkeypatch)


def all_rows(batches):
  keep = np.concatenate([b.mask for b in batches]) == 1
  return (np.concatenate([b.dense for b in batches])[keep],
          np.concatenate([b.ids[:, :, 0] for b in batches])[keep],
          np.concatenate([b.labels for b in batches])[keep])


def test_conversion_equals_the_text_reader_and_shuffles_blocks(tmp_path):
  src = kaggle_dir(tmp_path)
  m = convert(src, tmp_path / "bin")
  assert m["splits"]["train"]["rows"] == 3000 and len(m["splits"]["train"]["shards"]) > 2
  assert m["rows_per_feature"] == [ROWS] * 26 and m["version"] == criteo_bin.VERSION
  # eval order: the text reader's batches, bit for bit, last batch padded
  for split, files in (("train", ["train.txt"]), (["valid", "test"], ["valid.txt", "test.txt"])):
    ours = list(criteo_bin.CriteoBinSource(str(tmp_path / "bin"), split, 256, shuffle=False,
                                           repeat=False).batches())
    ref = list(criteo.CriteoSource([str(src / f) for f in files], 256, ROWS,
                                   drop_remainder=False, repeat=False).batches())
    assert len(ours) == len(ref)
    for x, y in zip(ours, ref):
      for name in ("dense", "ids", "lengths", "labels", "mask"):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
  # train: every epoch is a new permutation of the 64-row blocks of every shard
  tr = criteo_bin.CriteoBinSource(str(tmp_path / "bin"), "train", 128, seed=3, block_rows=64)
  n = tr.num_batches
  assert n == sum(s["rows"] // 64 for s in m["splits"]["train"]["shards"]) // 2
  first = list(itertools.islice(tr.batches(), 2 * n))
  text = all_rows(list(criteo.CriteoSource(str(src / "train.txt"), 3000, ROWS,
                                            repeat=False).batches()))
  for epoch in (first[:n], first[n:]):
    lines = np.rint(np.expm1(all_rows(epoch)[0][:, 0])).astype(int)
    assert len(set(lines)) == len(lines) == n * 128
    assert (np.diff(lines.reshape(-1, 64), axis=1) == 1).all()   # blocks are consecutive rows
  e0 = np.rint(np.expm1(all_rows(first[:n])[0][:, 0])).astype(int)
  e1 = np.rint(np.expm1(all_rows(first[n:])[0][:, 0])).astype(int)
  assert not np.array_equal(e0, e1) and not np.array_equal(e0, np.sort(e0))
  # each row decodes as the text reader decoded that line (line e0[k] is row e0[k] of text)
  d, ids, y = all_rows(first[:n])
  np.testing.assert_array_equal(d, text[0][e0])
  np.testing.assert_array_equal(ids, text[1][e0])
  np.testing.assert_array_equal(y, text[2][e0])
  # exact resume, and Grain's own iterator state
  np.testing.assert_array_equal(next(tr.batches(7)).ids, first[7].ids)
  it = tr.iterator()
  for _ in range(3):
    next(it)
  state = it.get_state()
  it2 = tr.iterator()
  it2.set_state(state)
  np.testing.assert_array_equal(next(it2).ids, first[3].ids)
  # worker processes read the same batches in the same order
  workers = criteo_bin.CriteoBinSource(str(tmp_path / "bin"), "train", 128, seed=3, block_rows=64,
                                       num_workers=2)
  for k, b in zip(range(4), workers.batches(2)):
    np.testing.assert_array_equal(b.ids, first[2 + k].ids)
  # process shares: the slices of every global batch
  halves = [criteo_bin.CriteoBinSource(str(tmp_path / "bin"), "train", 128, seed=3,
                                       block_rows=64, shard_index=i, num_shards=2)
            for i in range(2)]
  for k in (0, 5):
    both = np.concatenate([h.batch(k).ids for h in halves])
    np.testing.assert_array_equal(both, first[k].ids)


def test_vocabulary_with_frequency_threshold(tmp_path):
  src = kaggle_dir(tmp_path, n_train=1200)
  m = convert(src, tmp_path / "bin", ids="vocab", min_count=20)
  train_lines = (src / "train.txt").read_text().splitlines()
  counts = [collections.Counter() for _ in range(26)]
  for ln in train_lines:
    for f, v in enumerate(ln.split("\t")[14:]):
      if v:
        counts[f][int(v, 16)] += 1
  vocab = []
  for c in counts:
    kept = sorted((v for v in c if c[v] >= 20), key=lambda v: (-c[v], v))
    vocab.append({v: 2 + i for i, v in enumerate(kept)})
  assert m["rows_per_feature"] == [2 + len(v) for v in vocab]
  src_bin = criteo_bin.CriteoBinSource(str(tmp_path / "bin"), ["valid", "test"], 50,
                                       shuffle=False, repeat=False)
  _, ids, _ = all_rows(list(src_bin.batches()))
  eval_lines = ((src / "valid.txt").read_text() + (src / "test.txt").read_text()).splitlines()
  want = [[0 if not v else vocab[f].get(int(v, 16), 1) for f, v in enumerate(ln.split("\t")[14:])]
          for ln in eval_lines]
  np.testing.assert_array_equal(ids, np.array(want))
  assert (ids == 1).any() and (ids > 1).any()


def test_resume_after_a_kill_redoes_only_unfinished_units(tmp_path, in_process_pool):
  src = kaggle_dir(tmp_path)
  dst = tmp_path / "bin"
  m = convert(src, dst)
  train_dir = dst / "train"
  markers = sorted(p for p in os.listdir(train_dir) if p.endswith(".done"))
  # as if killed: the manifest, one unit's marker and its half-written shard are gone
  os.remove(dst / "manifest.json")
  victim = markers[1][:-len(".done")]
  os.remove(train_dir / markers[1])
  with open(train_dir / f"{victim}-0000.sparse.npy", "r+b") as f:
    f.truncate(100)
  with pytest.raises(UserError, match="manifest.json: not found"):
    criteo_bin.CriteoBinSource(str(dst), "train", 64)
  kept = {p: os.path.getmtime(train_dir / p) for p in markers if p != markers[1]}
  m2 = convert(src, dst)
  assert m2["splits"] == m["splits"]
  assert all(os.path.getmtime(train_dir / p) == t for p, t in kept.items())
  criteo_bin.CriteoBinSource(str(dst), "train", 64)  # opens cleanly again


def test_bad_shards_stop_with_the_file_named(tmp_path, in_process_pool):
  src = kaggle_dir(tmp_path, n_train=500)
  dst = tmp_path / "bin"
  convert(src, dst, unit_bytes=1 << 20)
  base = dst / "train" / "train_txt-00000-0000"
  open_ = lambda **kw: criteo_bin.CriteoBinSource(str(dst), "train", 64, **kw)
  col = lambda c: base.parent / f"{base.name}.{c}.npy"

  def save(path, x):   # a new file: readers of the old one (Grain's threads) keep their map
    np.save(str(path) + ".new.npy", x)
    os.replace(str(path) + ".new.npy", path)
  # truncated
  data = col("dense").read_bytes()
  col("dense").write_bytes(data[:-52 * 10])
  with pytest.raises(UserError, match=r"train_txt-00000-0000\.dense\.npy: unreadable or "
                     r"truncated.*expected float32 \(500, 13\)"):
    open_()
  col("dense").write_bytes(data)
  # other row counts (a shard from another conversion)
  labels0 = np.load(col("label"))
  save(col("label"), np.zeros(499, np.uint8))
  with pytest.raises(UserError, match=r"label\.npy: uint8 \(499,\); expected uint8 \(500,\)"):
    open_()
  save(col("label"), labels0)
  open_()
  # an id changed to another id in range: only the checksum can tell, and it does on open
  ids = np.load(col("sparse"))
  ids[123, 4] = (ids[123, 4] + 1) % ROWS
  save(col("sparse"), ids)
  with pytest.raises(UserError) as e:
    open_()
  assert str(e.value).startswith(f"{col('sparse')}: CRC-32 ")
  assert "expected" in str(e.value) and "the file changed after conversion" in str(e.value)
  # values no checksum is needed for: each message names the file, row, column and value
  read = lambda: list(criteo_bin.CriteoBinSource(str(dst), "train", 100, shuffle=False,
                                                 repeat=False, verify=False).batches())
  ids[123, 4] = -5
  save(col("sparse"), ids)
  with pytest.raises(UserError) as e:
    read()
  assert str(e.value) == (f"{base}.sparse.npy row 123, column C5: id -5; expected an id in "
                          f"[0, {ROWS}) (the manifest's rows): a corrupt shard")
  save(col("sparse"), np.where(ids < 0, 0, ids))
  labels = labels0.copy()
  labels[77] = 7
  save(col("label"), labels)
  with pytest.raises(UserError, match=r"train_txt-00000-0000\.label\.npy row 77: label 7; "
                                      r"expected 0 or 1: a corrupt shard"):
    read()
  save(col("label"), labels0)
  dense = np.load(col("dense"))
  dense[300, 2] = np.nan
  save(col("dense"), dense)
  with pytest.raises(UserError, match=r"\.dense\.npy row 300, column I3: value nan; expected a "
                                      r"finite value >= 0"):
    read()
  # another preprocessing version / settings
  marker = dst / "train" / "train_txt-00000.done"
  mk = json.loads(marker.read_text())
  marker.write_text(json.dumps(dict(mk, fingerprint="0" * 16)))
  with pytest.raises(UserError, match=r"train_txt-00000\.done: written by another conversion"):
    open_()
  man = json.loads((dst / "manifest.json").read_text())
  (dst / "manifest.json").write_text(json.dumps(dict(man, version=0)))
  with pytest.raises(UserError, match=r"manifest\.json: format 'criteo_bin' version 0; expected"):
    open_()
  # a manifest cut short, or not an object: the file named, not a JSONDecodeError traceback
  for text, found in ((json.dumps(man)[:40], "unreadable (Unterminated string"),
                      ("[1]", "a JSON list; expected the JSON object")):
    (dst / "manifest.json").write_text(text)
    for read_it in (open_, lambda: sources.data_settings(f"criteo_bin:{dst}")):
      with pytest.raises(UserError) as e:
        read_it()
      assert str(e.value).startswith(f"{dst}/manifest.json: {found}"), str(e.value)


def test_bad_lines_days_and_the_data_flag(tmp_path, in_process_pool):
  src = kaggle_dir(tmp_path, n_train=400)
  lines = (src / "train.txt").read_text().splitlines(keepends=True)
  lines[300] = lines[300].replace("\t", "\tx", 1)    # I1 becomes "x300"
  (src / "train.txt").write_text("".join(lines))
  with pytest.raises(UserError, match=r"train\.txt:301: field I1 = 'x300'; expected an integer"):
    convert(src, tmp_path / "a", unit_bytes=10_000)
  m = convert(src, tmp_path / "b", bad_lines="skip", unit_bytes=10_000)
  assert m["bad_lines_skipped"] == 1 and m["splits"]["train"]["rows"] == 399
  tera = tmp_path / "tera"
  tera.mkdir()
  for d in range(24):
    if d != 7:
      (tera / f"day_{d}").write_text(line(d) + line(d + 100))
  with pytest.raises(UserError) as e:
    convert(tera, tmp_path / "c", days="0-23")
  assert str(e.value).startswith(f"{tera}/day_7[.gz]: not found; expected every day of "
                                 "--days=0-23")
  with pytest.raises(UserError) as e:
    convert(tmp_path / "nothing_here", tmp_path / "c")
  assert str(e.value).startswith(f"--src={tmp_path / 'nothing_here'}: ") and "--data" not in str(e.value)
  with pytest.raises(UserError, match=r"--num_rows: rows_per_feature for C1 = 3,000,000,000, "
                                      r"expected at most 2\^31"):
    convert(src, tmp_path / "c", num_rows=3_000_000_000)
  train, ev = sources.make_sources(f"criteo_bin:{tmp_path / 'b'}", 64, eval_batch_size=32)
  assert train.spec.rows_per_feature == (ROWS,) * 26 and ev.num_examples == 250
  assert next(train.batches()).ids.shape == (64, 26, 1)
  with pytest.raises(UserError, match="manifest.json: not found"):
    sources.make_sources(f"criteo_bin:{tmp_path}", 64)


def test_terabyte_days_gz_halves_equal_the_text_reader(tmp_path, in_process_pool):
  tera = tmp_path / "tera"
  tera.mkdir()
  import gzip
  for d in (0, 1, 2, 23):
    text = "".join(line(1000 * d + i) for i in range(40 + d))
    if d in (1, 23):
      with gzip.open(tera / f"day_{d}.gz", "wt") as f:
        f.write(text)
    else:
      (tera / f"day_{d}").write_text(text)
  m = convert(tera, tmp_path / "bin", days="0,1,23", unit_bytes=3000)
  lay = criteo.criteo_layout(str(tera), "0,1,23")
  assert {s: v["rows"] for s, v in m["splits"].items()} == {"train": 81, "valid": 32, "test": 31}
  for split in ("train", "valid", "test"):
    ours = all_rows(list(criteo_bin.CriteoBinSource(str(tmp_path / "bin"), split, 16,
                                                    shuffle=False, repeat=False).batches()))
    ref = all_rows(list(criteo.CriteoSource(lay.splits[split], 16, ROWS, drop_remainder=False,
                                            repeat=False).batches()))
    for x, y in zip(ours, ref):
      np.testing.assert_array_equal(x, y, err_msg=split)
  assert m["settings"]["days"] == [0, 1, 23] and m["layout"] == "terabyte"


def test_kaggle_download_conversion_and_its_unlabeled_test_file(tmp_path, capfd,
                                                                in_process_pool):
  d = tmp_path / "kaggle"
  d.mkdir()
  (d / "train.txt").write_text("".join(line(i) for i in range(703)))
  (d / "test.txt").write_text("".join(line(i).split("\t", 1)[1] for i in range(703, 750)))
  dst = tmp_path / "bin"
  m = convert(d, dst, unit_bytes=20_000)
  assert {s: (v["rows"], v["labeled"]) for s, v in m["splits"].items()} == {
      "train": (603, True), "test": (50, True), "valid": (50, True), "predict": (47, False)}
  lay = criteo.criteo_layout(str(d))
  for split in m["splits"]:
    ours = all_rows(list(criteo_bin.CriteoBinSource(str(dst), split, 32, shuffle=False,
                                                    repeat=False).batches()))
    ref = all_rows(list(criteo.CriteoSource(lay.splits[split], 32, ROWS, drop_remainder=False,
                                            repeat=False, labeled=split != "predict").batches()))
    for x, y in zip(ours, ref):
      np.testing.assert_array_equal(x, y, err_msg=split)
  err = capfd.readouterr().err
  assert "convert: " in err and "\r" not in err    # a log file gets one line per report
  # run again: it says it resumed and keeps everything
  convert(d, dst, unit_bytes=20_000)
  out = capfd.readouterr().out
  assert "resuming the conversion in" in out and "units already converted" in out
  # a finished conversion of other settings or inputs is refused, unless --overwrite
  with pytest.raises(UserError) as e:
    convert(d, dst, unit_bytes=20_000, num_rows=ROWS + 1)
  assert str(e.value).startswith(f"{dst}/manifest.json: a finished conversion of other inputs "
                                 f"or settings (rows_per_feature: [{ROWS}, {ROWS}, {ROWS}, '...'] ")
  (d / "train.txt").write_text("".join(line(i) for i in range(1, 704)))
  with pytest.raises(UserError, match=r"sources: \['train.txt \(65,822 B, modified "):
    convert(d, dst, unit_bytes=20_000)
  m2 = convert(d, dst, unit_bytes=20_000, overwrite=True)
  assert m2["fingerprint"] != m["fingerprint"] and m2["splits"]["train"]["rows"] == 603
  assert criteo_bin.data_fingerprint(m2) == sources.data_settings(f"criteo_bin:{dst}")["data_fingerprint"]
  assert criteo_bin.data_fingerprint(m2) != criteo_bin.data_fingerprint(m)


def test_the_vocabulary_count_resumes_after_a_kill(tmp_path, capfd, in_process_pool):
  src = kaggle_dir(tmp_path, n_train=1200)
  ref = convert(src, tmp_path / "ref", ids="vocab", min_count=3)
  # as a kill during the counting pass leaves it: the counts of two finished units on disk,
  # no vocab.done, no shard and no manifest
  dst = tmp_path / "bin"
  lay = criteo_bin.source_layout(str(src))
  units = [u for u in criteo_bin.plan_units(lay, 40_000) if u.split == "train"]
  settings_fp = ref["fingerprint"]
  os.makedirs(dst / "vocab" / "counts")
  for u in units[:2]:
    criteo_bin._count_unit((u, "error", str(dst / "vocab"), settings_fp))
  capfd.readouterr()
  m = convert(src, dst, ids="vocab", min_count=3)
  out = capfd.readouterr().out
  assert f"2 of {len(units)} train units already counted (kept), {len(units) - 2} to do" in out
  assert m["rows_per_feature"] == ref["rows_per_feature"] and m["splits"] == ref["splits"]
  assert not os.path.exists(dst / "vocab" / "counts")     # removed once the vocabulary is built


def test_a_pool_worker_that_starts_after_its_parent_died_ends():
  """A worker whose start outlasts a killed parent would otherwise wait for ever on the task
  queue's lock that a sibling (killed with the parent) held, keeping the job's pipes open."""
  run = lambda parent: forkserver.run(
      [sys.executable, "-c", "import os, sys; from rec.data import criteo_bin; "
       f"criteo_bin._die_with_parent({parent}); print('alive')"],
      cwd=REPO, env=dict(os.environ, PYTHONPATH=cpu_env.python_path(REPO)),
      capture_output=True, text=True, timeout=120,
      fork=True)   # a child of the fork server: its parent's pid as a pool worker's is
  gone = run("os.getppid() + 1")                     # not its parent: that one is gone
  assert gone.returncode == 1 and gone.stdout == "", gone
  alive = run("os.getppid()")
  assert alive.returncode == 0 and alive.stdout == "alive\n", alive


def test_bad_settings_are_refused_before_anything_is_read(tmp_path):
  for kw, msg in ((dict(ids="dict"), "--ids='dict'; expected 'hash' or 'vocab'"),
                  (dict(bad_lines="drop"), "--bad_lines='drop'; expected one of "),
                  (dict(ids="vocab", min_count=0), "--min_count=0; expected >= 1")):
    with pytest.raises(UserError) as e:
      convert(tmp_path / "absent", tmp_path / "bin", **kw)
    assert str(e.value).startswith(msg)
  assert not (tmp_path / "bin").exists()


def test_hashed_rows_a_run_cannot_train_are_refused_before_converting(tmp_path,
                                                                       in_process_pool):
  """2^31 - 1 and 2^31 rows fit the int32 ids of the shards, but not a table a run trains
  (its padding id num_rows is int32 too: stream.MAX_TABLE_ROWS = 2^31 - 2), so the
  conversion, hours on Terabyte, would be written and never trained on."""
  src = tmp_path / "src"
  src.mkdir()
  (src / "train.txt").write_text("".join(line(i) for i in range(40)))
  for rows in (2**31 - 1, 2**31):
    with pytest.raises(UserError) as e:
      convert(src, tmp_path / "bin", num_rows=rows)
    assert str(e.value).startswith(f"--num_rows: rows_per_feature for C1 = {rows:,}, expected "
                                   "at most 2^31 - 2 = 2,147,483,646")
  assert not (tmp_path / "bin").exists()
  # A vocabulary's rows are counted, not set: --num_rows is not its setting.
  assert convert(src, tmp_path / "vocab", ids="vocab", num_rows=2**31)["rows_per_feature"]
  # A directory written with such rows (before this check) is refused when opened.
  n = 8
  criteo_bin.write_arrays(str(tmp_path / "old"), {"train": (
      np.zeros((n, 13), np.float32), np.ones((n, 26), np.int32), np.zeros(n, np.uint8))},
      [2**31] * 26)
  with pytest.raises(UserError) as e:
    criteo_bin.CriteoBinSource(str(tmp_path / "old"), "train", 8)
  assert str(e.value).startswith(f"{tmp_path / 'old'}/manifest.json: rows per feature C1 = "
                                 "2,147,483,648; expected at most 2^31 - 2")


def test_gz_line_ranges_read_in_many_chunks_and_units_of_many_shards(tmp_path, monkeypatch):
  """Day 23's test half starts mid-stream: its .gz unit skips whole chunks of lines before
  it; a unit with more rows than a shard holds is written as several shards. Both equal the
  text reader, and a bad line there is named by its line in the decompressed file."""
  import functools
  import gzip
  tera = tmp_path / "tera"
  tera.mkdir()
  (tera / "day_0").write_text("".join(line(i) for i in range(90)))
  lines23 = [line(5000 + i) for i in range(301)]
  with gzip.open(tera / "day_23.gz", "wt") as f:
    f.write("".join(lines23))
  in_process_pool_lib.use(monkeypatch)
  monkeypatch.setattr(CONVERT, "ROWS_PER_SHARD", 40)
  monkeypatch.setattr(CONVERT, "_unit_lines",
                      functools.partial(CONVERT._unit_lines, chunk_bytes=1500))
  m = convert(tera, tmp_path / "bin", days="0,23")
  lay = criteo.criteo_layout(str(tera), "0,23")
  assert {s: v["rows"] for s, v in m["splits"].items()} == {"train": 90, "valid": 151,
                                                            "test": 150}
  assert all(len(m["splits"][s]["shards"]) >= 2 for s in m["splits"])
  for split in m["splits"]:
    ours = all_rows(list(criteo_bin.CriteoBinSource(str(tmp_path / "bin"), split, 16,
                                                    shuffle=False, repeat=False).batches()))
    ref = all_rows(list(criteo.CriteoSource(lay.splits[split], 16, ROWS, drop_remainder=False,
                                            repeat=False).batches()))
    for x, y in zip(ours, ref):
      np.testing.assert_array_equal(x, y, err_msg=split)
  lines23[260] = lines23[260].replace("\t", "\tx", 1)    # line 261 of day_23, in the test half
  with gzip.open(tera / "day_23.gz", "wt") as f:
    f.write("".join(lines23))
  with pytest.raises(UserError, match=rf"^{tera}/day_23\.gz:261: field I1 = 'x5260'; expected "
                     "an integer"):
    convert(tera, tmp_path / "bad", days="0,23")


def test_units_cover_the_file_and_start_at_lines(tmp_path):
  """Cuts fall after a newline, every byte in exactly one unit, none empty; a long last line
  ends the cuts early."""
  src = tmp_path / "src"
  src.mkdir()
  text = "".join(line(i) for i in range(60)) + line(60).rstrip("\n") * 30 + "\n"
  (src / "train.txt").write_text(text)
  (src / "valid.txt").write_text(line(1))
  (src / "test.txt").write_text(line(2))
  data = text.encode()
  lay = criteo_bin.source_layout(str(src))
  for unit_bytes in (500, 1000, 2999, 4000, len(data)):
    units = [u for u in criteo_bin.plan_units(lay, unit_bytes) if u.split == "train"]
    assert units[0].start == 0 and units[-1].end == len(data)
    assert all(a.end == b.start for a, b in zip(units, units[1:]))
    assert all(u.end > u.start and (u.start == 0 or data[u.start - 1:u.start] == b"\n")
               for u in units)
    assert all(u.end - u.start <= unit_bytes + len(line(59)) for u in units[:-1])


def test_a_finished_vocabulary_conversion_reruns_as_is_and_a_corrupt_manifest(tmp_path, capfd,
                                                                              monkeypatch):
  in_process_pool_lib.use(monkeypatch)
  src = kaggle_dir(tmp_path, n_train=400)
  dst = tmp_path / "bin"
  m = convert(src, dst, ids="vocab", min_count=2)
  capfd.readouterr()
  assert convert(src, dst, ids="vocab", min_count=2) == m
  assert "units already converted with these settings (kept), 0 to do" in capfd.readouterr().out
  (dst / "manifest.json").write_text('{"fingerprint": "0')
  with pytest.raises(UserError) as e:
    convert(src, dst, ids="vocab", min_count=2)
  assert str(e.value) == (f"{dst}/manifest.json: unreadable (Unterminated string starting at: "
                          "line 1 column 17 (char 16)); expected the manifest of a finished "
                          "conversion: --overwrite to replace it, or another --dst")
  (dst / "manifest.json").write_text('{"fingerprint": "0"}')
  with pytest.raises(UserError, match=r"manifest\.json: a finished conversion of other inputs "
                     r"or settings \(another format version\); expected"):
    convert(src, dst, ids="vocab", min_count=2)


def test_vocabulary_files_are_read_once_per_unit_and_closed(tmp_path, monkeypatch):
  """The vocabulary's .npz files: each unit's conversion reads a feature's keys and ids once
  (an NpzFile rereads an array from its zip at every access: per chunk, millions of keys),
  and building the vocabulary leaves no counts file open (one per 64 MiB unit: thousands
  of descriptors for plain Terabyte days)."""
  import functools
  in_process_pool_lib.use(monkeypatch)
  monkeypatch.setattr(CONVERT, "_unit_lines",
                      functools.partial(CONVERT._unit_lines, chunk_bytes=1500))
  opened, most_open, reads = [], [0], collections.Counter()
  load, getitem = np.load, np.lib.npyio.NpzFile.__getitem__

  def spy_load(path, *a, **kw):
    most_open[0] = max(most_open[0], sum(z.fid is not None for z in opened))
    out = load(path, *a, **kw)
    if isinstance(out, np.lib.npyio.NpzFile):
      opened.append(out)
    return out

  def spy_getitem(self, key):
    reads[os.path.basename(self.fid.name), key] += 1
    return getitem(self, key)

  monkeypatch.setattr(np, "load", spy_load)
  monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", spy_getitem)
  src = kaggle_dir(tmp_path, n_train=1200)
  m = convert(src, tmp_path / "bin", ids="vocab", min_count=2)
  units = criteo_bin.plan_units(criteo_bin.source_layout(str(src)), 40_000)
  assert len([u for u in units if u.split == "train"]) >= 3   # several counts files
  assert most_open[0] == 0
  assert {k: n for k, n in reads.items() if k[0] == "C3.npz"} == {
      ("C3.npz", "keys"): len(units), ("C3.npz", "ids"): len(units)}
  assert m["splits"]["train"]["rows"] == 1200


def test_the_block_order_is_a_permutation_every_epoch():
  """EpochShuffle orders blocks as Grain's shuffle().repeat() does (reseeded per epoch),
  and stays a permutation at the lengths where Grain's index_shuffle repeats an index
  (max_index 2^16: 65,537 blocks read one block twice per epoch and another never)."""
  import grain
  from rec.data.criteo_bin.source import EpochShuffle
  n = 1000
  want = grain.MapDataset.range(n).shuffle(seed=7).repeat()
  got = EpochShuffle(n, 7)
  assert [got(i) for i in range(3 * n)] == [want[i] for i in range(3 * n)]
  n = (1 << 16) + 1
  order = EpochShuffle(n, 0)
  for epoch in range(2):
    idx = np.fromiter((order(epoch * n + i) for i in range(n)), np.int64, n)
    assert np.array_equal(np.sort(idx), np.arange(n)), epoch


def test_a_source_pickles_as_its_file_names_not_its_data(tmp_path):
  """Grain's worker processes (num_workers, --data_workers' WorkerSource) get the source
  pickled: its shards travel as file names and are mapped again there, so a worker does not
  receive a copy of the whole split (gigabytes for Kaggle) and reads the same batches."""
  import pickle
  n = 20_000
  rng = np.random.default_rng(0)
  arrays = (rng.random((n, 13), dtype=np.float32), rng.integers(0, ROWS, (n, 26), np.int32),
            rng.integers(0, 2, n).astype(np.uint8))
  criteo_bin.write_arrays(str(tmp_path), {"train": arrays, "valid": arrays}, [ROWS] * 26)
  for split, kw in (("train", dict(shuffle=True, seed=1)), ("valid", dict(shuffle=False))):
    src = criteo_bin.CriteoBinSource(str(tmp_path), split, 512, **kw)
    data = pickle.dumps(src.dataset)
    assert len(data) < 100_000 < n * (13 * 4 + 26 * 4 + 1), len(data)
    again = pickle.loads(data)
    for k in (0, 3, src.num_batches - 1):
      for name in ("dense", "ids", "labels", "mask"):
        np.testing.assert_array_equal(getattr(again[k], name), getattr(src.batch(k), name))


_FEW_FILES = """
import resource, sys
import numpy as np
from rec.data import criteo_bin
sys.modules["rec.data.criteo_bin.format"].ROWS_PER_SHARD = 10
d, hard = sys.argv[1], int(sys.argv[2])
z = np.zeros(400, np.uint8)
criteo_bin.write_arrays(d, {"train": (np.zeros((400, 13), np.float32),
                                      np.zeros((400, 26), np.int32), z)}, [5] * 26)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
src = criteo_bin.CriteoBinSource(d, "train", 40, block_rows=10)
print(len(src.shards), len(src.batch(3).labels), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_thousands_of_mapped_shards_raise_the_open_file_limit(tmp_path):
  """Every mapped column file holds a descriptor (Criteo Terabyte: thousands of shards, over
  the usual soft limit of 1,024): the source raises the soft limit up to the hard one, and a
  hard limit too low is one line saying what is needed (not a shard "unreadable or
  truncated")."""
  run = lambda d, hard: forkserver.run(
      [sys.executable, "-c", _FEW_FILES, str(tmp_path / d), str(hard)], cwd=REPO,
      env=dict(os.environ, PYTHONPATH=cpu_env.python_path(REPO)), capture_output=True,
      text=True, timeout=120, fork=True)   # the limits set in the child stay there
  import resource
  hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
  if hard != resource.RLIM_INFINITY and hard < 4096:
    pytest.skip(f"hard open-file limit {hard}: too low to raise the soft one to")
  ok = run("ok", 4096)
  assert ok.returncode == 0, ok.stderr
  shards, rows, soft = map(int, ok.stdout.split())
  assert shards == 40 and rows == 40 and 3 * 40 < soft <= 4096, ok.stdout
  low = run("low", 100)
  assert low.returncode == 1
  last = low.stderr.strip().splitlines()[-1]
  assert last.startswith(f"core.errors.UserError: {tmp_path / 'low'} split train: 120 column "
                         "files to map, ") and "the hard limit is 100" in last, low.stderr
