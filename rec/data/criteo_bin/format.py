"""The on-disk layout of a converted Criteo directory: manifest, column files, checksums.

  <dir>/manifest.json           written last: format, version, settings, layout, columns
                                and dtypes, rows per feature, splits -> shards with row
                                counts and checksums, source files
  <dir>/<split>/<shard>.dense.npy   float32 [N, 13], log1p(max(x, 0)) as the text reader
  <dir>/<split>/<shard>.sparse.npy  int32 [N, 26], row ids (0 = missing)
  <dir>/<split>/<shard>.label.npy   uint8 [N] (0 for the unlabeled "predict" split)
  <dir>/<split>/<unit>.done     a unit's completion marker (JSON): its shards (named
                                <unit>-<j>), each with the CRC-32 of its three files

Splits: train, valid, test and, for Kaggle's test.txt, predict (labeled false). Column
files, markers and the manifest are written atomically (a temporary name, then a rename). `write_arrays` writes such a
directory from arrays (benchmarks and tests); `load_manifest` opens one.

Letters: N rows of a shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Sequence

import numpy as np

from core.errors import UserError
from rec.data import criteo

FORMAT = "criteo_bin"
VERSION = 2
ROWS_PER_SHARD = 2_000_000
COLUMNS = {"dense": ("float32", criteo.NUM_DENSE), "sparse": ("int32", criteo.NUM_SPARSE),
           "label": ("uint8", None)}
_CRC_BLOCK = 16 << 20


def settings_fingerprint(settings: dict) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def data_fingerprint(manifest: dict) -> str:
  """The fingerprint of a converted directory's content: a hash of its manifest, which holds
  the conversion's settings and every shard's row count and checksums."""
  return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def conversion_settings(manifest: dict) -> dict:
  """The settings that decide what the ids mean: {ids, min_count, num_rows, layout, days}."""
  s = manifest.get("settings", {})
  return {"ids": s.get("ids"), "min_count": s.get("min_count"),
          "num_rows": s.get("rows_per_feature") if s.get("ids") == "hash" else None,
          "layout": manifest.get("layout"), "days": s.get("days")}


def atomic_json(path: str, obj) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def save_npy(path: str, x: np.ndarray) -> int:
  """Writes `x` atomically; returns the CRC-32 of the file written."""
  tmp = f"{path}.tmp{os.getpid()}.npy"
  np.save(tmp, x)
  crc = file_crc32(tmp)
  os.replace(tmp, path)
  return crc


def file_crc32(path: str) -> int:
  """CRC-32 of a file's bytes (zlib, in blocks that release the GIL)."""
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(_CRC_BLOCK):
      crc = zlib.crc32(block, crc)
  return crc



def write_shard(base: str, dense, ids, labels) -> dict:
  return {"crc32": {"dense": save_npy(base + ".dense.npy", np.asarray(dense, np.float32)),
                    "sparse": save_npy(base + ".sparse.npy", np.asarray(ids, np.int32)),
                    "label": save_npy(base + ".label.npy", np.asarray(labels, np.uint8))}}



def load_manifest(d: str) -> dict:
  path = os.path.join(d, "manifest.json")
  if not os.path.isfile(path):
    raise UserError(f"{path}: not found; expected a directory written by `python -m "
                    "experiments.preprocess_criteo --dst=DIR` (a conversion that did not "
                    "finish writes no manifest.json; run it again to resume)")
  try:
    with open(path, "rb") as f:
      m = json.loads(f.read())
  except ValueError as e:   # a JSON or UTF-8 error: a manifest cut short or edited
    raise UserError(f"{path}: unreadable ({e}); expected the JSON manifest that "
                    "`python -m experiments.preprocess_criteo` writes last") from None
  if not isinstance(m, dict):
    raise UserError(f"{path}: a JSON {type(m).__name__}; expected the JSON object that "
                    "`python -m experiments.preprocess_criteo` writes last")
  if m.get("format") != FORMAT or m.get("version") != VERSION:
    raise UserError(f"{path}: format {m.get('format')!r} version {m.get('version')!r}; "
                    f"expected {FORMAT!r} version {VERSION}: convert the data again with this "
                    "code")
  return m



def write_arrays(dst: str, splits: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                 rows_per_feature: Sequence[int]) -> dict:
  """Writes (dense [N, 13] float32, ids [N, 26] int32, labels [N] uint8) per split as one
  converted directory (one unit per split, shards of ROWS_PER_SHARD rows, checksums), for
  benchmarks and tests that need a directory without text files."""
  rows = list(rows_per_feature)
  settings = {"format": FORMAT, "version": VERSION, "ids": "arrays", "rows_per_feature": rows}
  fingerprint = settings_fingerprint(settings)
  manifest = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
              "settings": settings, "rows_per_feature": rows, "layout": "arrays",
              "note": "arrays written by criteo_bin.write_arrays",
              "columns": {k: {"dtype": d, "width": w} for k, (d, w) in COLUMNS.items()},
              "splits": {}, "sources": [], "bad_lines_skipped": 0}
  for split, (dense, ids, labels) in splits.items():
    os.makedirs(os.path.join(dst, split), exist_ok=True)
    shards = []
    for j, a in enumerate(range(0, len(labels), ROWS_PER_SHARD)):
      name = f"arrays-{j:04d}"
      b = slice(a, a + ROWS_PER_SHARD)
      crc = write_shard(os.path.join(dst, split, name), dense[b], ids[b], labels[b])
      shards.append({"name": name, "rows": len(labels[b]), **crc})
    atomic_json(os.path.join(dst, split, "arrays.done"),
                 {"version": VERSION, "fingerprint": fingerprint, "shards": shards})
    manifest["splits"][split] = {"rows": len(labels), "shards": shards, "labeled": True}
  atomic_json(os.path.join(dst, "manifest.json"), manifest)
  return manifest
