"""The `--data` flag: one string -> (train, eval) BatchSources for the recommendation experiments.

Forms:
  synthetic     SyntheticCriteo: train split endless, eval = `eval_batches` batches of the
                test split (same hidden model, different draws).
  synthetic_deep  the same with `teacher="deep"` (planted high-order interactions) and logit
                scale DEEP_LOGIT_SCALE = 3.0 (Bayes AUC about 0.925), for capacity and scaling
                studies. Both synthetic forms take comma-separated options after a colon:
                `logit_scale=X` (the std of the planted logit before its bias), `zipf_alpha=X`
                (the id law's exponent, default 1.05), `multi_hot=mlperf` or
                `multi_hot=3-2-1-...` (one bag size per sparse feature, dash-separated;
                mlperf = the MLPerf DLRM-DCNv2 sizes), `gen=host` (numpy, the reference
                stream), `gen=device` (`DeviceSynthetic`: the same model drawn on the
                accelerator by a jitted generator, so data never limits the step) or
                `gen=auto` (the default: device on a GPU / TPU, host on CPU), e.g.
                `synthetic_deep:logit_scale=4.0` or `synthetic:multi_hot=mlperf`.
  criteo:DIR    Kaggle layout (DIR/train.txt): train on train.txt, eval on valid.txt +
                test.txt (labeled splits; the challenge's own unlabeled test.txt has 39
                fields and is rejected line 1). Terabyte layout (DIR/day_0 .. day_23, each
                plain or .gz): train on day_0 .. day_22, eval on day_23.
  criteo_bin:DIR  a directory written by `python -m experiments.preprocess_criteo`
                (`rec.data.criteo_bin`): train on its train split (Grain, blocks shuffled
                globally every epoch by `seed`), eval on valid + test (or test). Rows per
                feature come from its manifest (`num_rows` is not used).
  avazu:DIR     train on DIR/train.csv, eval on DIR/dev.csv + DIR/test.csv.
  libfm:DIR     libFM (`label idx:val ...`, fields by position) or libFFM
                (`label field:idx:val ...`) files, e.g. the AutoInt / FuxiCTR dumps: train on
                DIR/train.<any extension> (or DIR/train), eval on DIR/valid.* + DIR/test.*
                (those present, at least one). The line form and the number of fields come
                from the train file's first line(s); see `rec.data.libfm`.
  csv:DIR       BARS / FuxiCTR CSV files with a header row: train on DIR/train.csv, eval on
                DIR/valid.csv + DIR/test.csv (those present, at least one; `.csv.gz` too).
                Label, dense and categorical columns are the `csv_label` / `csv_dense` /
                `csv_categorical` lists where given, else inferred from the train file's
                header and first rows; see `rec.data.csv_data`.
File sources train with `drop_remainder=True, repeat=True` and evaluate with
`drop_remainder=False, repeat=False` (last eval batch padded with mask 0); files are read in
order (no shuffling) and `seed` only affects synthetic data. `num_rows=None` means
`DEFAULT_NUM_ROWS` = 100_000 hashed rows per feature for every form (Avazu's hour_of_day /
day_of_week tables are capped at 25 / 8 rows). For libfm and csv the eval files are read with
the train file's layout (fields, column roles), which is printed.
"""

from __future__ import annotations

import os
from typing import Sequence

from rec.data import avazu, criteo, csv_data, libfm, synthetic
from rec.data.batch import BatchSource

DEFAULT_NUM_ROWS = 100_000
DEFAULT_EVAL_BATCHES = 20
FORMS = ("'synthetic', 'criteo:DIR' or 'avazu:DIR' (the native files), or 'libfm:DIR' or "
         "'csv:DIR' (preprocessed libFM / libFFM or BARS CSV files), 'criteo_bin:DIR' (the output "
         "of experiments.preprocess_criteo), or 'synthetic_deep'; the "
         "synthetic forms take ':logit_scale=X' (X > 0), 'zipf_alpha=X' (X >= 0) and "
         "'multi_hot=mlperf' or 'multi_hot=3-2-1-...' (26 bag sizes >= 1) and 'gen=auto|host|device', "
         "comma-separated")
SYNTHETIC_TEACHERS = {"synthetic": "linear", "synthetic_deep": "deep"}
DEEP_LOGIT_SCALE = 3.0
CRITEO_DAYS = 24


def _need(data: str, paths: list[str], layout: str) -> list[str]:
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise ValueError(f"--data={data!r}: the {layout} layout needs {', '.join(paths)}; "
                     f"missing: {', '.join(missing)}")
  return paths


def _day_file(d: str, day: int) -> str | None:
  for name in (f"day_{day}", f"day_{day}.gz"):
    if os.path.isfile(os.path.join(d, name)):
      return os.path.join(d, name)
  return None


def criteo_files(data: str, d: str) -> tuple[list[str], list[str]]:
  """(train files, eval files) of a Criteo directory, Kaggle or Terabyte layout."""
  if os.path.isfile(os.path.join(d, "train.txt")):
    return _need(data, [os.path.join(d, "train.txt")], "Criteo Kaggle"), _need(
        data, [os.path.join(d, "valid.txt"), os.path.join(d, "test.txt")], "Criteo Kaggle")
  days = [_day_file(d, i) for i in range(CRITEO_DAYS)]
  if any(days):
    missing = [f"day_{i}[.gz]" for i, f in enumerate(days) if f is None]
    if missing:
      raise ValueError(f"--data={data!r}: Criteo Terabyte layout needs day_0 .. day_23 "
                       f"(plain or .gz) in {d!r}; missing {', '.join(missing)}")
    return days[:-1], days[-1:]
  raise ValueError(f"--data={data!r}: {d!r} has neither train.txt (Criteo Kaggle layout) nor "
                   "day_0 .. day_23[.gz] (Criteo Terabyte layout)")


def split_file(data: str, d: str, split: str, suffixes: Sequence[str] | None) -> str | None:
  """The one file of DIR named `split` plus one of `suffixes` (None: `split` or `split.*`)."""
  names = sorted(n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))
  if suffixes is None:
    hits = [n for n in names if n == split or n.startswith(split + ".")]
  else:
    hits = [n for n in names if n in {split + s for s in suffixes}]
  if len(hits) > 1:
    raise ValueError(f"--data={data!r}: {d!r} has several {split} files ({', '.join(hits)}); "
                     "expected one")
  return os.path.join(d, hits[0]) if hits else None


def split_files(data: str, d: str, suffixes: Sequence[str] | None,
                example: str) -> tuple[list[str], list[str]]:
  """(train files, eval files) of a train / valid / test directory; eval = valid + test."""
  train = split_file(data, d, "train", suffixes)
  if train is None:
    found = sorted(os.listdir(d))
    raise ValueError(f"--data={data!r}: {d!r} has no train file, expected {example}; found "
                     + (", ".join(found) if found else "nothing"))
  evals = [f for f in (split_file(data, d, s, suffixes) for s in ("valid", "test")) if f]
  if not evals:
    raise ValueError(f"--data={data!r}: {d!r} has no valid or test file for evaluation, "
                     f"expected one named like {example.replace('train', 'valid')}; found "
                     f"{', '.join(sorted(os.listdir(d)))}")
  return [train], evals


def _multi_hot_option(value: str) -> tuple[int, ...]:
  if value == "mlperf":
    return synthetic.MLPERF_MULTI_HOT
  sizes = tuple(int(x) for x in value.split("-"))
  if len(sizes) != 26 or min(sizes) < 1:
    raise ValueError
  return sizes


def synthetic_options(data: str) -> dict | None:
  """SyntheticCriteo's {teacher, logit_scale, ...} for a synthetic `--data` form; None for
  others."""
  kind, sep, opts = data.partition(":")
  if kind not in SYNTHETIC_TEACHERS:
    return None
  teacher = SYNTHETIC_TEACHERS[kind]
  out = {"teacher": teacher,
         "logit_scale": DEEP_LOGIT_SCALE if teacher == "deep" else synthetic.LOGIT_SCALE}
  for item in opts.split(",") if sep else ():
    key, eq, value = item.partition("=")
    try:
      if not eq:
        raise ValueError
      if key == "logit_scale":
        out["logit_scale"] = float(value)
        if not out["logit_scale"] > 0:
          raise ValueError
      elif key == "zipf_alpha":
        out["zipf_alpha"] = float(value)
        if not out["zipf_alpha"] >= 0:
          raise ValueError
      elif key == "multi_hot":
        out["multi_hot"] = _multi_hot_option(value)
      elif key == "gen":
        if value not in ("host", "device", "auto"):
          raise ValueError
        out["gen"] = value
      else:
        raise ValueError
    except ValueError:
      raise ValueError(f"--data={data!r}: option {item!r} of a synthetic form; expected "
                       f"{FORMS}, e.g. synthetic_deep:logit_scale=3.0") from None
  return out


def make_sources(data: str, batch_size: int, eval_batch_size: int | None = None,
                 num_rows: int | list[int] | None = None, seed: int = 0, bad_lines: str = "error",
                 shard_index: int = 0, num_shards: int = 1,
                 eval_batches: int = DEFAULT_EVAL_BATCHES, csv_label: str | None = None,
                 csv_dense: str | Sequence[str] | None = None,
                 csv_categorical: str | Sequence[str] | None = None, mesh=None,
                 ) -> tuple[BatchSource, BatchSource]:
  """(train, eval) sources for a `--data` value; see the module docstring for the forms.

  Batch sizes are global; shard_index / num_shards make the sources of process
  `shard_index` of `num_shards` yield its share of each global batch: rows [i*b, (i+1)*b)
  of it (b = batch / num_shards) for synthetic and criteo_bin data, whose global batches
  are then the same for every process count; for the line readers, every num_shards-th
  line (record % num_shards == shard_index), so a global batch holds the same lines in
  a process-count dependent order, and the eval streams are padded to equal lengths.
  eval_batches applies to synthetic only. csv_label / csv_dense / csv_categorical give
  the csv form's column roles (None or '' = inferred, 'none' = no columns, else
  comma-separated names). mesh: where `gen=device` synthetic batches are
  drawn (split over the mesh axes of the logical "batch" axis); None = the default device.
  """
  eval_batch_size = eval_batch_size or batch_size
  rows = DEFAULT_NUM_ROWS if num_rows is None else num_rows
  kind, sep, d = data.partition(":")
  syn = synthetic_options(data)
  gen = syn.pop("gen", "auto") if syn is not None else None
  if gen == "auto":   # an accelerator's step outruns numpy generation by far
    import jax
    gen = "host" if jax.default_backend() == "cpu" else "device"
  if gen == "device":
    from core import mesh as mesh_lib
    from rec.data import device_synthetic
    axes = None if mesh is None else mesh_lib.mesh_axes("batch", mesh_lib.REC_RULES, mesh)
    place = dict(mesh=mesh, batch_axes=axes, **syn)
    train = device_synthetic.DeviceSynthetic(batch_size, rows, seed=seed, split="train", **place)
    evals = device_synthetic.DeviceSynthetic(eval_batch_size, rows, seed=seed, split="test",
                                             num_batches=eval_batches, **place)
    return train, evals
  if syn is not None:
    shards = dict(shard_index=shard_index, num_shards=num_shards, **syn)
    train = synthetic.SyntheticCriteo(batch_size, rows, seed=seed, split="train", **shards)
    evals = synthetic.SyntheticCriteo(eval_batch_size, rows, seed=seed, split="test",
                                      num_batches=eval_batches, **shards)
    return train, evals
  if kind not in ("criteo", "criteo_bin", "avazu", "libfm", "csv") or not sep or not d:
    raise ValueError(f"--data={data!r}: expected {FORMS}")
  if not os.path.isdir(d):
    raise ValueError(f"--data={data!r}: {d!r} is not a directory")
  common = dict(bad_lines=bad_lines, shard_index=shard_index, num_shards=num_shards)
  if kind != "criteo_bin":   # line sources take this shard's batch size
    for what, b in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
      if b % num_shards:
        raise ValueError(f"--{what}={b} is not divisible by the {num_shards} processes")
    batch_size, eval_batch_size = batch_size // num_shards, eval_batch_size // num_shards
  if kind == "criteo_bin":
    from rec.data import criteo_bin
    shards = dict(shard_index=shard_index, num_shards=num_shards)
    m = criteo_bin.load_manifest(d)
    train = criteo_bin.CriteoBinSource(d, "train", batch_size, shuffle=True, repeat=True,
                                       seed=seed, **shards)
    evals = criteo_bin.CriteoBinSource(d, [s for s in ("valid", "test") if s in m["splits"]],
                                       eval_batch_size, shuffle=False, repeat=False, **shards)
    return train, evals
  if kind == "libfm":
    train_files, eval_files = split_files(data, d, None, "train or train.<ext> (train.libfm, "
                                          "train.txt, train.svm, train.ffm, ...)")
    train = libfm.LibFMSource(train_files, batch_size, rows, drop_remainder=True, repeat=True,
                              **common)
    evals = libfm.LibFMSource(eval_files, eval_batch_size, rows, num_fields=train.num_fields,
                              form=train.form, fields_from=train.fields_from,
                              drop_remainder=False, repeat=False, **common)
    print(f"--data={data}: {train.describe()}", flush=True)
    return _even(train, evals, num_shards)
  if kind == "csv":
    train_files, eval_files = split_files(data, d, (".csv", ".csv.gz"), "train.csv[.gz]")
    train = csv_data.CsvSource(train_files, batch_size, rows, label=csv_label or None,
                               dense=csv_dense, categorical=csv_categorical,
                               drop_remainder=True, repeat=True, **common)
    evals = csv_data.CsvSource(eval_files, eval_batch_size, rows, columns=train.columns,
                               drop_remainder=False, repeat=False, **common)
    print(f"--data={data}: {train.describe()}", flush=True)
    return _even(train, evals, num_shards)
  if kind == "criteo":
    train_files, eval_files = criteo_files(data, d)
    cls = criteo.CriteoSource
  else:
    train_files = _need(data, [os.path.join(d, "train.csv")], "Avazu")
    eval_files = _need(data, [os.path.join(d, "dev.csv"), os.path.join(d, "test.csv")], "Avazu")
    cls = avazu.AvazuSource
  train = cls(train_files, batch_size, rows, drop_remainder=True, repeat=True, **common)
  evals = cls(eval_files, eval_batch_size, rows, drop_remainder=False, repeat=False, **common)
  return _even(train, evals, num_shards)


def _even(train, evals, num_shards: int):
  """Line sources of several processes: every process's eval runs the same number of
  batches (the shards' counts differ by up to one; the short ones end with padding)."""
  if num_shards > 1:
    evals.pad_to_batches = evals.max_shard_batches()
  return train, evals
