"""Criteo conversion to numpy shards and the Grain reader of them (rec.data.criteo_bin).

References: the text reader (`criteo.CriteoSource`) on the same files, a plain-Python
vocabulary, and slices of an uninterrupted iteration. Files are made in the test.
"""

from __future__ import annotations

import collections
import itertools
import json
import os

import numpy as np
import pytest

from rec.data import criteo, criteo_bin, sources

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
  order = np.rint(np.expm1(text[0][:, 0])).astype(int)   # I1 = line number
  for epoch in (first[:n], first[n:]):
    lines = np.rint(np.expm1(all_rows(epoch)[0][:, 0])).astype(int)
    assert len(set(lines)) == len(lines) == n * 128
    assert (np.diff(lines.reshape(-1, 64), axis=1) == 1).all()   # blocks are consecutive rows
  e0 = np.rint(np.expm1(all_rows(first[:n])[0][:, 0])).astype(int)
  e1 = np.rint(np.expm1(all_rows(first[n:])[0][:, 0])).astype(int)
  assert not np.array_equal(e0, e1) and not np.array_equal(e0, np.sort(e0))
  # each row decodes as the text reader decoded that line
  d, ids, y = all_rows(first[:n])
  np.testing.assert_array_equal(ids, text[1][e0]) and np.testing.assert_array_equal(y, text[2][e0])
  del order
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


def test_resume_after_a_kill_redoes_only_unfinished_units(tmp_path):
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
  with pytest.raises(ValueError, match="no manifest.json"):
    criteo_bin.CriteoBinSource(str(dst), "train", 64)
  kept = {p: os.path.getmtime(train_dir / p) for p in markers if p != markers[1]}
  m2 = convert(src, dst)
  assert m2["splits"] == m["splits"]
  assert all(os.path.getmtime(train_dir / p) == t for p, t in kept.items())
  criteo_bin.CriteoBinSource(str(dst), "train", 64)  # opens cleanly again


def test_bad_shards_stop_with_the_file_named(tmp_path):
  src = kaggle_dir(tmp_path, n_train=500)
  dst = tmp_path / "bin"
  convert(src, dst, unit_bytes=1 << 20)
  base = dst / "train" / "train_txt-00000-0000"
  open_ = lambda: criteo_bin.CriteoBinSource(str(dst), "train", 64)
  # truncated
  data = (base.parent / (base.name + ".dense.npy")).read_bytes()
  (base.parent / (base.name + ".dense.npy")).write_bytes(data[:-52 * 10])
  with pytest.raises(ValueError, match=r"train_txt-00000-0000\.dense\.npy: unreadable or "
                     r"truncated.*expected float32 \(500, 13\)"):
    open_()
  (base.parent / (base.name + ".dense.npy")).write_bytes(data)
  # other row counts (a shard from another conversion)
  np.save(base.parent / (base.name + ".label.npy"), np.zeros(499, np.uint8))
  with pytest.raises(ValueError, match=r"label\.npy: uint8 \(499,\), expected uint8 \(500,\)"):
    open_()
  # corrupt values: a label byte of 7
  labels = np.zeros(500, np.uint8)
  labels[123] = 7
  np.save(base.parent / (base.name + ".label.npy"), labels)
  with pytest.raises(ValueError, match=r"train_txt-00000-0000\.\*\.npy row 123: label 7\.0"):
    list(criteo_bin.CriteoBinSource(str(dst), "train", 100, shuffle=False, repeat=False).batches())
  # another preprocessing version / settings
  marker = dst / "train" / "train_txt-00000.done"
  mk = json.loads(marker.read_text())
  marker.write_text(json.dumps(dict(mk, fingerprint="0" * 16)))
  with pytest.raises(ValueError, match=r"train_txt-00000\.done: written by another conversion"):
    open_()
  man = json.loads((dst / "manifest.json").read_text())
  (dst / "manifest.json").write_text(json.dumps(dict(man, version=0)))
  with pytest.raises(ValueError, match=r"manifest\.json: format 'criteo_bin' version 0, expected"):
    open_()


def test_bad_lines_missing_days_and_the_data_flag(tmp_path):
  src = kaggle_dir(tmp_path, n_train=400)
  lines = (src / "train.txt").read_text().splitlines(keepends=True)
  lines[300] = lines[300].replace("\t", "\tx", 1)    # label field becomes "0x..."? no: I1
  (src / "train.txt").write_text("".join(lines))
  with pytest.raises(ValueError, match=r"train\.txt:301: field I1 = 'x300'"):
    convert(src, tmp_path / "a", unit_bytes=10_000)
  m = convert(src, tmp_path / "b", bad_lines="skip", unit_bytes=10_000)
  assert m["bad_lines_skipped"] == 1 and m["splits"]["train"]["rows"] == 399
  tera = tmp_path / "tera"
  tera.mkdir()
  for d in range(24):
    if d != 7:
      (tera / f"day_{d}").write_text(line(d))
  with pytest.raises(ValueError, match=r"missing day_7\[\.gz\]"):
    convert(tera, tmp_path / "c")
  train, ev = sources.make_sources(f"criteo_bin:{tmp_path / 'b'}", 64, eval_batch_size=32)
  assert train.spec.rows_per_feature == (ROWS,) * 26 and ev.num_examples == 250
  assert next(train.batches()).ids.shape == (64, 26, 1)
  with pytest.raises(ValueError, match="no manifest.json"):
    sources.make_sources(f"criteo_bin:{tmp_path}", 64)
