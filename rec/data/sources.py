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
  sessions      RecD's session data (`rec.data.sessions.SessionSource`, arXiv 2211.05239):
                synthetic whose first `user=8` sparse features are bags of `user_bag=32`
                ids repeated over the samples of a session, sessions of mean length
                1 / (1 - dup) (`dup=0.75`: 4 samples), e.g. `sessions:dup=0.875,user=4`;
                logit_scale / zipf_alpha as above; drawn on the host (in Grain worker
                processes with train_rec's --data_workers, which also run RecD's dedup).
  criteo:DIR    Criteo's text files (`rec.data.criteo.criteo_layout`): Kaggle as downloaded
                (train.txt cut into 7 days as the DLRM reference does: days 1-6 train,
                day 7 test + validation halves; test.txt unlabeled, for prediction), a
                custom train.txt + valid.txt [+ test.txt], or Terabyte day_N[.gz] (`days`:
                any subset, e.g. '0-2'; MLPerf's split of day 23 when present, else of the
                last day given). Training evaluates on validation + test.
  criteo_bin:DIR  a directory written by `python -m experiments.preprocess_criteo`
                (`rec.data.criteo_bin`): train on its train split (Grain, blocks shuffled
                globally every epoch by `seed`), eval on valid + test (or test). Rows per
                feature come from its manifest (`num_rows` is not used).
  avazu:DIR     Avazu (`rec.data.avazu.avazu_layout`): as downloaded (train.gz split by day:
                the last day tests, the day before validates; test.gz unlabeled, for
                prediction), or a custom train.csv + dev.csv / valid.csv and / or test.csv.
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

`split_source` gives one split of a form (e.g. Kaggle's unlabeled test.txt as "predict")
for `experiments.predict`; `data_settings` is what a run records about its data (the
criteo_bin conversion's fingerprint and settings) so that a resume or a prediction on other
data is refused; `check_splits` reads every split once before training starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Callable, Iterator, Sequence

from core.errors import UserError
from rec.data import avazu, criteo, criteo_bin, csv_data, libfm, stream, synthetic
from rec.data.batch import BatchSource

DEFAULT_NUM_ROWS = 100_000
DEFAULT_EVAL_BATCHES = 20
FORMS = ("'synthetic', 'criteo:DIR' or 'avazu:DIR' (the native files), or 'libfm:DIR' or "
         "'csv:DIR' (preprocessed libFM / libFFM or BARS CSV files), 'criteo_bin:DIR' (the output "
         "of experiments.preprocess_criteo), or 'synthetic_deep'; the "
         "synthetic forms take ':logit_scale=X' (X > 0), 'zipf_alpha=X' (X >= 0) and "
         "'multi_hot=mlperf' or 'multi_hot=3-2-1-...' (26 bag sizes >= 1) and 'gen=auto|host|device', "
         "comma-separated; or 'sessions' (RecD's session data: ':dup=X' in [0, 1), 'user=N' "
         "user features in 1..26, 'user_bag=N' ids per user bag, and logit_scale / zipf_alpha)")
SYNTHETIC_TEACHERS = {"synthetic": "linear", "synthetic_deep": "deep"}
SESSIONS = "sessions"
# sessions:key=value -> (SessionSource argument, parser, valid)
SESSION_OPTIONS = {"dup": ("dup_rate", float, lambda x: 0.0 <= x < 1.0),
                   "user": ("num_user", int, lambda x: 1 <= x <= 26),
                   "user_bag": ("user_bag", int, lambda x: x >= 1)}
DEEP_LOGIT_SCALE = 3.0


def split_file(data: str, d: str, split: str, suffixes: Sequence[str] | None) -> str | None:
  """The one file of DIR named `split` plus one of `suffixes` (None: `split` or `split.*`)."""
  names = sorted(n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))
  if suffixes is None:
    hits = [n for n in names if n == split or n.startswith(split + ".")]
  else:
    hits = [n for n in names if n in {split + s for s in suffixes}]
  if len(hits) > 1:
    raise UserError(f"--data={data!r}: {d!r} has several {split} files ({', '.join(hits)}); "
                    "expected one")
  return os.path.join(d, hits[0]) if hits else None


def split_files(data: str, d: str, suffixes: Sequence[str] | None,
                example: str) -> tuple[list[str], list[str]]:
  """(train files, eval files) of a train / valid / test directory; eval = valid + test."""
  train = split_file(data, d, "train", suffixes)
  if train is None:
    found = sorted(os.listdir(d))
    raise UserError(f"--data={data!r}: {d!r} has no train file, expected {example}; found "
                    + (", ".join(found) if found else "nothing"))
  evals = [f for f in (split_file(data, d, s, suffixes) for s in ("valid", "test")) if f]
  if not evals:
    raise UserError(f"--data={data!r}: {d!r} has no valid or test file for evaluation, "
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
  """SyntheticCriteo's {teacher, logit_scale, ...} for a synthetic `--data` form (with
  SessionSource's dup_rate / num_user / user_bag for `sessions`); None for others."""
  kind, sep, opts = data.partition(":")
  if kind not in SYNTHETIC_TEACHERS and kind != SESSIONS:
    return None
  teacher = SYNTHETIC_TEACHERS.get(kind, "linear")
  out = {"teacher": teacher,
         "logit_scale": DEEP_LOGIT_SCALE if teacher == "deep" else synthetic.LOGIT_SCALE}
  for item in opts.split(",") if sep else ():
    key, eq, value = item.partition("=")
    try:
      if not eq:
        raise ValueError
      if kind == SESSIONS and key in SESSION_OPTIONS:
        name, parse, ok = SESSION_OPTIONS[key]
        out[name] = parse(value)
        if not ok(out[name]):
          raise ValueError
      elif kind == SESSIONS and key in ("multi_hot", "gen"):
        raise ValueError
      elif key == "logit_scale":
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
      raise UserError(f"--data={data!r}: option {item!r} of a synthetic form; expected "
                      f"{FORMS}, e.g. synthetic_deep:logit_scale=3.0") from None
  return out


def _split_data(data: str) -> tuple[str, str]:
  kind, sep, d = data.partition(":")
  if kind not in ("criteo", "criteo_bin", "avazu", "libfm", "csv") or not sep or not d:
    raise UserError(f"--data={data!r}: expected {FORMS}")
  if not os.path.isdir(d):
    raise UserError(f"--data={data!r}: {d!r} is not a directory")
  return kind, d


def check_form(data: str) -> None:
  """A UserError naming `data` unless it is one of FORMS (a synthetic form with valid
  options, or a file form whose directory exists): for an entry point that runs several
  --data values and should refuse a bad later one before measuring the first."""
  if synthetic_options(data) is None:
    _split_data(data)


def _check_num_rows(num_rows, minimum: int = 2) -> None:
  """--num_rows within what the form (`minimum`: 2 for files, whose row 0 is the missing
  value) and the embedding tables take, checked here so that the error names the flag
  rather than a data source or table class."""
  for r in ([num_rows] if isinstance(num_rows, int) else num_rows or []):
    if r < minimum:
      why = " (row 0 holds the missing value)" if minimum > 1 else ""
      raise UserError(f"--num_rows={r:,}: too few rows; expected at least {minimum}{why}")
    if r > stream.MAX_TABLE_ROWS:
      raise UserError(f"--num_rows={r:,}: more rows than an int32 id can address; expected "
                      f"at most 2^31 - 2 = {stream.MAX_TABLE_ROWS:,} (the ids and a table's "
                      "padding id, num_rows, are int32)")


def layout(data: str, days: str | Sequence[int] | None = None) -> stream.Layout:
  """The splits of a criteo:DIR or avazu:DIR form (printed by make_sources)."""
  kind, d = _split_data(data)
  if kind == "criteo":
    return criteo.criteo_layout(d, days, flag="--data=criteo:DIR")
  if days:
    raise UserError(f"--days={days}: given with --data={data}; expected --days only with "
                    "Criteo Terabyte's day_N files (--data=criteo:DIR)")
  if kind == "avazu":
    return avazu.avazu_layout(d, flag="--data=avazu:DIR")
  raise UserError(f"--data={data!r}: a {kind} directory has no split layout; expected "
                  "criteo:DIR or avazu:DIR")


def make_sources(data: str, batch_size: int, eval_batch_size: int | None = None,
                 num_rows: int | list[int] | None = None, seed: int = 0, bad_lines: str = "error",
                 shard_index: int = 0, num_shards: int = 1,
                 eval_batches: int = DEFAULT_EVAL_BATCHES, csv_label: str | None = None,
                 csv_dense: str | Sequence[str] | None = None,
                 csv_categorical: str | Sequence[str] | None = None, mesh=None,
                 days: str | Sequence[int] | None = None,
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
  days: Criteo Terabyte's days ('0-2', '0,3', a list; None = every day present).
  """
  eval_batch_size = eval_batch_size or batch_size
  _check_num_rows(num_rows, 1 if synthetic_options(data) is not None else 2)
  rows = DEFAULT_NUM_ROWS if num_rows is None else num_rows
  syn = synthetic_options(data)
  if syn is not None and days:
    raise UserError(f"--days={days}: given with --data={data}; expected --days only with "
                    "Criteo Terabyte's day_N files (--data=criteo:DIR)")
  gen = syn.pop("gen", "auto") if syn is not None else None
  if gen == "auto" and data.partition(":")[0] == SESSIONS:
    gen = "host"   # sessions are drawn on the host (in Grain workers with --data_workers)
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
  if syn is not None and data.partition(":")[0] == SESSIONS:
    from rec.data import sessions
    shards = dict(shard_index=shard_index, num_shards=num_shards, flag=f"--data={data}", **syn)
    train = sessions.SessionSource(batch_size, rows, seed=seed, split="train", **shards)
    evals = sessions.SessionSource(eval_batch_size, rows, seed=seed, split="test",
                                   num_batches=eval_batches, **shards)
    print(f"--data={data}: {train.describe()}", flush=True)
    return train, evals
  if syn is not None:
    shards = dict(shard_index=shard_index, num_shards=num_shards, **syn)
    train = synthetic.SyntheticCriteo(batch_size, rows, seed=seed, split="train", **shards)
    evals = synthetic.SyntheticCriteo(eval_batch_size, rows, seed=seed, split="test",
                                      num_batches=eval_batches, **shards)
    return train, evals
  kind, d = _split_data(data)
  if days and kind != "criteo":
    layout(data, days)   # the error naming --days
  common = dict(bad_lines=bad_lines, shard_index=shard_index, num_shards=num_shards)
  if kind != "criteo_bin":   # line sources take this shard's batch size
    for what, b in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
      if b % num_shards:
        raise UserError(f"--{what}={b} is not divisible by the {num_shards} processes")
    batch_size, eval_batch_size = batch_size // num_shards, eval_batch_size // num_shards
  if kind == "criteo_bin":
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
  lay = layout(data, days)
  print(f"--data={data}: {lay.note}", flush=True)
  make = _line_source(kind, lay, rows)
  train = make("train", batch_size, drop_remainder=True, repeat=True, **common)
  evals = make("eval", eval_batch_size, drop_remainder=False, repeat=False, **common)
  return _even(train, evals, num_shards)


def _line_source(kind: str, lay: stream.Layout, rows) -> Callable[..., stream.LineSource]:
  """make(split, batch_size, **kw): the text source of a split of `lay` ("eval": valid +
  test); Avazu splits by day check their rows' days."""

  def make(split: str, batch_size: int, **kw) -> stream.LineSource:
    parts = lay.eval_parts() if split == "eval" else lay.splits[split]
    labeled = split != "predict"
    if kind == "criteo":
      return criteo.CriteoSource(parts, batch_size, rows, labeled=labeled, **kw)
    days = None
    if lay.days:
      spans = [lay.days[s] for s in (("valid", "test") if split == "eval" else (split,))
               if s in lay.days]
      days = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
    return avazu.AvazuSource(parts, batch_size, rows, labeled=labeled, days=days, **kw)
  return make


def _even(train, evals, num_shards: int):
  """The line sources of a run, made ready: every .gz train file read to its end now (a
  truncated download, e.g. a Terabyte day first reached at step 31, stops the run before
  step 0 with the file named; eval files are parsed whole by `check_splits`); with several
  processes, every process's eval runs the same number of batches (the shards' counts
  differ by up to one; the short ones end with padding)."""
  stream.verify_gzip(train.files, "train files")
  if num_shards > 1:
    evals.pad_to_batches = evals.max_shard_batches()
  return train, evals


# --- one split, for prediction ---------------------------------------------------------------

@dataclasses.dataclass
class Split:
  """One split of a --data form, read once in file order: its source, whether it has
  labels, and the id of each row as the CSV of predictions names it."""

  name: str
  source: BatchSource
  labeled: bool
  id_column: str                           # the CSV header of the row ids
  prob_column: str                         # the CSV header of the probabilities
  row_ids: Callable[[], Iterator[str]]     # one id per row, in the source's order
  describe: str


def _numbers(first: int = 0) -> Callable[[], Iterator[str]]:
  return lambda: (str(i) for i in itertools.count(first))


def split_source(data: str, split: str, batch_size: int, num_rows=None,
                 days: str | Sequence[int] | None = None) -> Split:
  """One split of a criteo:DIR, avazu:DIR or criteo_bin:DIR form ("train", "valid", "test",
  or "predict": the unlabeled rows, Kaggle's test file), read in order, last batch padded.
  Kaggle's test rows get Kaggle's ids and headers (Criteo `Id,Predicted` from 60,000,000;
  Avazu `id,click` from the file), so the CSV is a submission; other rows are numbered."""
  if synthetic_options(data) is not None:
    raise UserError(f"--data={data}: generated data, with no rows to predict on; expected "
                    "criteo:DIR, avazu:DIR or criteo_bin:DIR")
  _check_num_rows(num_rows)
  rows = DEFAULT_NUM_ROWS if num_rows is None else num_rows
  kind, d = _split_data(data)
  if kind == "criteo_bin":
    m = criteo_bin.load_manifest(d)
    if split not in m["splits"]:
      raise UserError(f"--split={split}: {d}/manifest.json has splits "
                      f"{', '.join(m['splits'])}; expected one of them")
    src = criteo_bin.CriteoBinSource(d, split, batch_size, shuffle=False, repeat=False)
    labeled = m["splits"][split].get("labeled", True)
    kaggle = not labeled and m.get("layout") == "kaggle"
    return Split(split, src, labeled, "Id" if kaggle else "row",
                 "Predicted" if kaggle else "probability",
                 _numbers(criteo.KAGGLE_TEST_FIRST_ID if kaggle else 0),
                 f"{d} split {split} ({src.num_examples:,} rows)")
  if kind not in ("criteo", "avazu"):
    raise UserError(f"--data={data}: prediction reads criteo:DIR, avazu:DIR or criteo_bin:DIR; "
                    f"expected one of them (a {kind} directory's eval set is evaluated by "
                    "train_rec)")
  lay = layout(data, days)
  if split not in lay.splits:
    raise UserError(f"--split={split}: {d} ({lay.kind} layout) has the splits "
                    f"{', '.join(lay.splits)}; expected one of them")
  src = _line_source(kind, lay, rows)(split, batch_size, drop_remainder=False, repeat=False)
  labeled = split != "predict"
  if kind == "criteo":
    kaggle = lay.kind == "kaggle" and not labeled
    return Split(split, src, labeled, "Id" if kaggle else "row",
                 "Predicted" if kaggle else "probability",
                 _numbers(criteo.KAGGLE_TEST_FIRST_ID if kaggle else 0), lay.note)
  return Split(split, src, labeled, "id", "click" if not labeled else "probability",
               lambda: stream.first_fields(src), lay.note)


# --- what a run records about its data, and checks before training --------------------------

def data_settings(data: str) -> dict:
  """What a run's settings record about `data` beyond its name: for criteo_bin:DIR the
  conversion's fingerprint (a hash of its manifest, which holds every shard's checksum)
  and its id settings, so that a resume on reconverted data, or a prediction on data
  converted with other settings, is refused. Other forms: {}."""
  if data.partition(":")[0] != "criteo_bin":
    return {}
  d = data.partition(":")[2]
  m = criteo_bin.load_manifest(d)
  return {"data_fingerprint": criteo_bin.data_fingerprint(m),
          "data_conversion": criteo_bin.conversion_settings(m)}


def spec_settings(spec) -> dict:
  """The features a model was built for: {num_dense, sparse_features, rows_per_feature}."""
  return {"num_dense": int(spec.num_dense), "sparse_features": list(spec.sparse_features),
          "rows_per_feature": [int(r) for r in spec.rows_per_feature]}


def check_splits(*srcs: BatchSource) -> None:
  """Reads what training would only meet later, before step 0: criteo_bin shards were
  checked (checksums) when opened; a line source of a finite split is parsed once (its
  bad lines raise here, with file:line, or are counted with bad_lines="skip")."""
  for src in srcs:
    if isinstance(src, stream.LineSource) and not src.repeat:
      src.validate()
