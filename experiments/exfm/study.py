"""ExFM (arXiv 2502.17494) study: one foundation-model teacher (Wukong) serving 2-3 vertical
students (DLRM / DCN-v2) through the DAS, on streaming data in time order. The teacher sees
far more data than any student (every row of each period plus teacher-only history; the
students their vertical's first batches), and is checked to beat the students alone before
anything is distilled from it.

  synthetic_periods(...),       rows of every period in time order: synthetic with drifting
  criteo_periods(...)           features, or the Criteo sample in file order
  route(rows, S, feature)       each student's vertical: rows whose id of `feature` is
                                congruent to its index mod S (the teacher trains on all)
  Stream                        a run's batches over periods as one resumable BatchSource
  train_teacher(...)            the teacher, updated every `teacher_every` periods on the
                                union data since its last update; the DAS writes its logits
                                for each period's student rows from the snapshot then current
  train_student(...)            a student variant, period by period through RecTask and
                                core.train (resume): train on period p, evaluate on p + 1
  run(...)                      teachers, students alone, the teacher check (its column's
                                NE vs each student alone), distilled students, scaling
  format_table(...), plot_gains(...), plot_scaling(...)

Students' NE gain = (NE alone - NE variant) / NE alone, in %, per evaluated period.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from typing import Any, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from core import flops as flops_lib
from core import mesh as mesh_lib
from core import plot as plot_lib
from core import train as train_loop
from core.errors import UserError
from rec import distill
from rec import runs
from rec.data.batch import DataSpec, SparseBatch
from rec.data.criteo import CriteoSource
from rec.data.synthetic import LOGIT_SCALE, SyntheticCriteo
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.metrics import RecMetrics
from rec.models.dcnv2 import DCNv2, DCNv2Config
from rec.models.dlrm import DLRM, DLRMConfig
from rec.models.wukong import Wukong, WukongConfig
from rec.train_lib import RecTask

# The paper's ablation, in order; each a DistillSpec of the student (None: plain RecTask).
VARIANTS = {
    "alone": None,
    "kd": distill.DistillSpec(kd_weight=1.0),
    "aux_head": distill.DistillSpec(aux_weight=1.0),
    "aux_head+adapter": distill.DistillSpec(aux_weight=1.0, adapter=True),
}
# The paper's reported NE gains by variant. Not filled: the public text found (the arXiv
# 2502.17494 abstract and third-party summaries of it) claims "significant performance
# gain" without per-variant numbers; the paper's tables were not reachable, and numbers are
# not guessed.
PAPER_NE_GAIN: dict[str, float | None] = {v: None for v in VARIANTS}
# Variants trained with every teacher size (NE gain against teacher size).
SCALING_VARIANTS = ("kd", "aux_head+adapter")
# Synthetic rows per period, in units of S n B, at least: each student's vertical (ids by
# value mod S) then holds n full batches.
MIN_SHARE = 1.6
# Teacher sizes (Wukong): name -> (embedding dim, layers, n_F = n_L, rank, MLP width).
TEACHERS = {"S": (8, 1, 4, 8, 64), "M": (16, 2, 8, 16, 128), "L": (16, 3, 16, 24, 256)}


# --------------------------------------------------------------------------- data


@dataclasses.dataclass
class Rows:
  """Examples in time order: dense [N, 13], ids [N, 26] (one-hot), labels [N]."""

  dense: np.ndarray
  ids: np.ndarray
  labels: np.ndarray

  def take(self, idx) -> "Rows":
    return Rows(self.dense[idx], self.ids[idx], self.labels[idx])

  def __len__(self) -> int:
    return len(self.labels)


def _rows(batch: SparseBatch) -> Rows:
  return Rows(np.asarray(batch.dense), np.asarray(batch.ids)[:, :, 0], np.asarray(batch.labels))


def synthetic_periods(num_periods: int, rows_per_period: int, num_rows: int,
                      drift_features: int, seed: int = 0,
                      logit_scale: float = LOGIT_SCALE) -> tuple[list[Rows], DataSpec]:
  """Periods of SyntheticCriteo(teacher="deep") whose first `drift_features` features drift:
  in period p their Zipf ranks land on rows shifted by p * (num_rows // 7 + 1) (new ids
  become the popular ones, old ones fade), and labels are drawn again from the source's
  hidden model on the shifted ids (each id keeps its meaning; which ids are seen moves).
  `logit_scale`: the std of the hidden logit (higher: more signal to learn)."""
  chunk = 2048
  src = SyntheticCriteo(chunk, num_rows, seed=seed, teacher="deep", logit_scale=logit_scale)
  n_chunks = -(-rows_per_period // chunk)
  shift = num_rows // 7 + 1
  periods = []
  for p in range(num_periods):
    parts = []
    for c in range(n_chunks):
      b = src.batch(p * n_chunks + c)
      ids = np.array(b.ids)
      ids[:, :drift_features] = (ids[:, :drift_features] + p * shift) % num_rows
      b = dataclasses.replace(b, ids=ids)
      logit = src.true_logits(b)
      rng = np.random.default_rng([seed, 2025, p, c])
      labels = (rng.random(len(logit)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
      parts.append(_rows(dataclasses.replace(b, labels=labels)))
    periods.append(Rows(*(np.concatenate([getattr(r, f) for r in parts])[:rows_per_period]
                          for f in ("dense", "ids", "labels"))))
  return periods, src.spec


def criteo_periods(path: str, num_periods: int, num_rows: int) -> tuple[list[Rows], DataSpec]:
  """The rows of a Criteo file (labeled, native format) in file order, which is time order
  for Criteo Kaggle's train.txt, cut into `num_periods` equal periods."""
  if not os.path.isfile(path):
    raise UserError(f"{path}: Criteo file not found; expected a labeled train.txt "
                    "(e.g. --data=criteo:DIR with DIR/train.txt)")
  src = CriteoSource([path], 1000, num_rows, repeat=False, drop_remainder=False)
  batches = list(src.batches(0))
  allr = Rows(*(np.concatenate([np.asarray(getattr(b, f))[np.asarray(b.mask) > 0]
                                for b in batches]) for f in ("dense", "ids", "labels")))
  allr.ids = allr.ids[:, :, 0]
  n = len(allr) // num_periods
  if n < 64:
    raise UserError(f"{path}: {len(allr)} rows for {num_periods} periods; expected at least "
                    f"64 rows per period")
  return [allr.take(slice(p * n, (p + 1) * n)) for p in range(num_periods)], src.spec


def route(rows: Rows, num_students: int, feature: int) -> list[Rows]:
  """The students' verticals: row r goes to student ids[r, feature] mod S."""
  v = rows.ids[:, feature] % num_students
  return [rows.take(np.flatnonzero(v == s)) for s in range(num_students)]


def to_batches(rows: Rows, batch_size: int) -> list[SparseBatch]:
  """Full batches of `rows` in order (a remainder smaller than a batch is left out)."""
  out = []
  for k in range(len(rows) // batch_size):
    r = rows.take(slice(k * batch_size, (k + 1) * batch_size))
    out.append(SparseBatch(dense=r.dense.astype(np.float32), ids=r.ids[:, :, None].astype(np.int32),
                           lengths=np.ones(r.ids.shape, np.int32),
                           labels=r.labels.astype(np.float32),
                           mask=np.ones(batch_size, np.float32)))
  return out


class Stream:
  """A BatchSource over periods of batch lists: batch k of the concatenation; `ends[p]` is
  the step after period p (what training through period p runs to)."""

  def __init__(self, periods: Sequence[Sequence[SparseBatch]], spec: DataSpec, batch_size: int):
    self.periods = [list(p) for p in periods]
    self.flat = list(itertools.chain.from_iterable(self.periods))
    self.ends = list(itertools.accumulate(len(p) for p in self.periods))
    self.spec, self.batch_size = spec, batch_size

  @property
  def num_batches(self) -> int:
    return len(self.flat)

  def batches(self, start: int = 0):
    yield from self.flat[start:]


class PeriodSource:
  """One period's batches as a BatchSource (what the DAS augments)."""

  def __init__(self, batches: Sequence[SparseBatch], spec: DataSpec, batch_size: int):
    self._b, self.spec, self.batch_size = list(batches), spec, batch_size

  @property
  def num_batches(self) -> int:
    return len(self._b)

  def batches(self, start: int = 0):
    yield from self._b[start:]


# --------------------------------------------------------------------------- models


def teacher_config(size: str, spec: DataSpec) -> WukongConfig:
  dim, layers, n, rank, width = TEACHERS[size]
  return WukongConfig(num_dense=spec.num_dense, num_sparse=len(spec.sparse_features),
                      embedding_dim=dim, rows_per_feature=spec.rows_per_feature,
                      bottom_mlp=(width, 2 * dim), num_layers=layers, num_fm=n, num_lcb=n,
                      fm_rank=rank, fm_mlp=(width,), top_mlp=(width, 1))


def student_config(index: int, spec: DataSpec, dim: int = 8):
  """Student 0, 2: small DLRMs; student 1: a small DCN-v2."""
  common = dict(num_dense=spec.num_dense, num_sparse=len(spec.sparse_features),
                embedding_dim=dim, rows_per_feature=spec.rows_per_feature)
  if index % 2 == 1:
    return DCNv2Config(bottom_mlp=(32,), num_cross_layers=2, deep_mlp=(32,), top_mlp=(16, 1),
                       **common)
  return DLRMConfig(bottom_mlp=(32, dim), top_mlp=(32, 1), **common)


def make_task(model_fn, tables, lr: float, spec: distill.DistillSpec | None = None) -> RecTask:
  """One device, tables table-wise, Adagrad on the dense part and the touched rows."""
  mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
  sparse = opt_lib.get_sparse_optimizer("adagrad", lr, initial_accumulator_value=0.1, eps=1e-7)
  coll = EmbeddingCollection(tables, planner_lib.uniform_plan(tables, "tw", 1), mesh, sparse)
  if spec is not None:
    model_fn = distill.student_fn(model_fn, spec)
  return RecTask(model_fn, coll, optax.adagrad(lr), mesh, distill=spec)


def model_fn_for(cfg):
  cls = {DLRMConfig: DLRM, DCNv2Config: DCNv2, WukongConfig: Wukong}[type(cfg)]
  return lambda rngs: cls(cfg, rngs)


def ne_of(logits: np.ndarray, batches: Sequence[SparseBatch]) -> float:
  m = RecMetrics()
  m.update(np.asarray(logits), np.concatenate([b.labels for b in batches]))
  return float(m.result()["ne"])


def _train_to(task, stream: Stream, step: int, workdir: str, first: bool, seed: int,
              eval_batches=None) -> dict[str, Any]:
  # The first segment starts a fresh run (`run` refused an earlier one in `workdir`), the
  # later ones resume it.
  cfg = train_loop.TrainConfig(workdir=workdir, steps=step, log_every=max(1, step),
                               resume=not first, seed=seed, tensorboard=False, max_to_keep=1)
  return train_loop.train(task, stream.batches, eval_batches, cfg)


# --------------------------------------------------------------------------- teacher + DAS


def train_teacher(size: str, union: Stream, student_periods: list[list[list[SparseBatch]]],
                  spec: DataSpec, history: int, teacher_every: int, lr: float, seed: int,
                  workdir: str, log=print) -> dict[str, Any]:
  """The teacher of `size` streamed over `union` (history periods, then the students'
  periods): trained on the history first, then every `teacher_every` periods on the periods
  since its last update. For each student period p the DAS writes the logits of the then
  current snapshot on each student's rows of p (`<workdir>/das/s<k>_p<p>.npy`).

  Returns {size, dense_params, train_examples (by its last update), embedding_params,
  flops_per_example, columns: {(k, p): path}, train_seconds}."""
  cfg = teacher_config(size, spec)
  task = make_task(model_fn_for(cfg), cfg.tables(), lr)
  ckpt_dir = os.path.join(workdir, "train")
  t0 = time.perf_counter()
  out = _train_to(task, union, union.ends[history - 1], ckpt_dir, True, seed)
  state, trained = out["state"], union.ends[history - 1]
  columns = {}
  num_periods = len(union.periods)
  for p in range(history, num_periods):
    if p > history and (p - history) % teacher_every == 0:   # the slower cadence
      out = _train_to(task, union, union.ends[p - 1], ckpt_dir, False, seed)
      state, trained = out["state"], union.ends[p - 1]
      log(f"  teacher {size}: updated through period {p - 1}")
    for k, batches in enumerate(student_periods):
      path = os.path.join(workdir, "das", f"s{k}_p{p}.npy")
      distill.augment(task, state, PeriodSource(batches[p], spec, union.batch_size),
                      len(batches[p]), path)
      columns[(k, p)] = path
  model = nnx.eval_shape(lambda: model_fn_for(cfg)(nnx.Rngs(0)))
  return {"size": size, "dense_params": flops_lib.count_params(model),
          "train_examples": trained * union.batch_size,
          "embedding_params": sum(t.num_rows * t.dim for t in cfg.tables()),
          "flops_per_example": flops_lib.model_flops_per_example(model_fn_for(cfg), cfg),
          "columns": columns, "train_seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- students


def train_student(k: int, variant: str, periods: list[list[SparseBatch]], spec: DataSpec,
                  history: int, columns: dict | None, lr: float, seed: int, workdir: str,
                  log=print) -> list[float]:
  """Student k as `variant` on its periods from `history` on (n batches each), each
  period's batches carrying the DAS column: one core.train run of (T - 1) n steps whose
  evaluation every n steps reads the next period (after period i's training the i + 1-th
  eval call gets period i + 1), so it trains on period p and is evaluated on p + 1, then
  continues. Returns the serving head's NE on each period history + 1 .. end."""
  dspec = VARIANTS[variant]
  cfg = student_config(k, spec)
  task = make_task(model_fn_for(cfg), cfg.tables(), lr, dspec)
  raw = periods[history:]
  n = len(raw[0])
  if any(len(b) != n for b in raw):
    raise ValueError(f"student {k}: batches per period {[len(b) for b in raw]}; expected equal")
  own = raw
  if dspec is not None:   # the students read the DAS's files, never the teacher
    own = [list(distill.TeacherColumnSource(PeriodSource(b, spec, b[0].batch_size),
                                            columns[(k, history + i)], n).batches(0))
           for i, b in enumerate(raw)]
  stream = Stream(own[:-1], spec, raw[0][0].batch_size)
  next_period = itertools.count(1)
  cfg = train_loop.TrainConfig(workdir=workdir, steps=stream.num_batches, eval_every=n,
                               log_every=n, seed=seed, tensorboard=False, max_to_keep=1)
  train_loop.train(task, stream.batches, lambda: raw[next(next_period)], cfg)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    evals = [r for r in map(json.loads, f) if r["split"] == "eval"]
  if [r["step"] for r in evals] != [n * (i + 1) for i in range(len(raw) - 1)]:
    raise RuntimeError(f"{workdir}: eval steps {[r['step'] for r in evals]}; expected every {n}")
  return [float(r["ne"]) for r in evals]


# --------------------------------------------------------------------------- the study


def student_jobs(num_students: int, teacher_sizes: Sequence[str],
                 main_teacher: str) -> list[tuple[int, str, str]]:
  """(student, variant, teacher size) of every student run, in training order: each
  student alone, then every distilled variant with the main teacher, then the scaling
  variants with the other teachers."""
  jobs = [(k, "alone", main_teacher) for k in range(num_students)]
  jobs += [(k, v, main_teacher) for k in range(num_students) for v in VARIANTS if v != "alone"]
  jobs += [(k, v, s) for k in range(num_students) for s in teacher_sizes if s != main_teacher
           for v in SCALING_VARIANTS]
  return jobs


def run_dirs(workdir: str, num_students: int, teacher_sizes: Sequence[str],
             main_teacher: str) -> list[str]:
  """The training runs' directories of one data set's `run` in `workdir`: each teacher's
  (its DAS files beside it) and each student job's."""
  return ([os.path.join(workdir, f"teacher_{s}", "train") for s in teacher_sizes]
          + [os.path.join(workdir, "students", f"s{k}_{v}_{s}")
             for k, v, s in student_jobs(num_students, teacher_sizes, main_teacher)])


def run(data: str, num_students: int, periods: int, history: int, teacher_every: int,
        batch_size: int, batches_per_period: int, num_rows: int, drift_features: int,
        teacher_sizes: Sequence[str], main_teacher: str, vertical_feature: int, lr: float,
        seed: int, workdir: str, log=print, teacher_data: float = 4.0,
        logit_scale: float = LOGIT_SCALE) -> dict[str, Any]:
  """The comparison on one data set; see the entry point's docstring. Every student gets
  n = min(batches_per_period, the fewest full batches any student's vertical holds in a
  period) batches per period. Synthetic periods hold max(teacher_data, 1.6) S n B rows:
  the teacher trains on all of them, each student on the first n batches of its vertical
  (1.6 at least because verticals by id are not of equal size); on Criteo the teacher has
  every row of a period, the students their verticals' first n batches.

  Order: the teachers and the students alone first, then the check that the teacher is
  the better model on the students' evaluated periods (logged, and in `teacher_check`),
  then the distilled students. An earlier run's teachers or students in `workdir` are
  refused before anything trains (`rec.runs.check_fresh`): the study does not resume
  (another `workdir`, or delete them)."""
  runs.check_fresh(run_dirs(workdir, num_students, teacher_sizes, main_teacher),
                   resume_flag=False)
  t_start = time.perf_counter()
  total = history + periods
  if data == "synthetic":
    rows, spec = synthetic_periods(
        total, int(max(teacher_data, MIN_SHARE) * num_students * batches_per_period
                   * batch_size), num_rows, drift_features, seed, logit_scale)
  else:
    rows, spec = criteo_periods(data, total, num_rows)
  verticals = [route(r, num_students, vertical_feature) for r in rows]
  student_periods = [[to_batches(v[k], batch_size) for v in verticals]
                     for k in range(num_students)]
  n = min([batches_per_period] + [len(b) for sp in student_periods for b in sp])
  if n < 1:
    raise UserError(f"{data}: a student's vertical has no full batch of {batch_size} in some "
                    "period; expected more rows per period or a smaller batch size")
  student_periods = [[b[:n] for b in sp] for sp in student_periods]
  union = Stream([to_batches(r, batch_size) for r in rows], spec, batch_size)
  student_examples = (periods - 1) * n * batch_size
  log(f"== {data}: {total} periods ({history} teacher-only history) of {len(rows[0])} rows; "
      f"{n} batches of {batch_size} per student and period; the teacher "
      f"{len(union.periods[0])} per period")

  teachers = {}
  for size in teacher_sizes:
    log(f"== teacher {size} (Wukong {TEACHERS[size]})")
    teachers[size] = train_teacher(size, union, student_periods, spec, history, teacher_every,
                                   lr, seed, os.path.join(workdir, f"teacher_{size}"), log)
  eval_periods = list(range(history + 1, total))
  results = {}
  t0 = time.perf_counter()
  done_jobs = [0]

  def student(k, variant, size, num_jobs):
    name = f"s{k}_{variant}_{size}"
    nes = train_student(k, variant, student_periods[k], spec, history,
                        teachers[size]["columns"], lr, seed,
                        os.path.join(workdir, "students", name), log)
    results[(k, variant, size)] = nes
    done_jobs[0] += 1
    done = time.perf_counter() - t0
    log(f"[{done_jobs[0]}/{num_jobs}] student {k} ({model_name(k, spec)}) {variant:<17} "
        f"teacher {size}: NE {' '.join(f'{x:.4f}' for x in nes)} | {done:.0f} s, ETA "
        f"{done / done_jobs[0] * (num_jobs - done_jobs[0]):.0f} s")

  jobs = student_jobs(num_students, teacher_sizes, main_teacher)
  num_jobs = len(jobs)
  for job in jobs[:num_students]:   # each student alone
    student(*job, num_jobs)

  # The check before distilling: the teacher's column against each student alone, on the
  # periods the students are evaluated on (the teacher's snapshot then current: stale by
  # up to teacher_every periods; the student trained through the period before).
  teacher_check = []
  for size in teacher_sizes:
    for k in range(num_students):
      alone = np.asarray(results[(k, "alone", main_teacher)])
      t_ne = np.asarray([ne_of(np.load(teachers[size]["columns"][(k, p)]),
                               student_periods[k][p]) for p in eval_periods])
      margin = 100.0 * (alone - t_ne) / alone
      teacher_check.append({"teacher": size, "student": k, "teacher_ne": t_ne.tolist(),
                            "alone_ne": alone.tolist(), "margin_pct": margin.tolist(),
                            "mean_margin_pct": float(margin.mean())})
      log(f"check: teacher {size} NE {' '.join(f'{x:.4f}' for x in t_ne)} vs student {k} "
          f"alone {' '.join(f'{x:.4f}' for x in alone)}: teacher "
          + (f"better by {margin.mean():.2f} %" if margin.min() > 0 else
             f"NOT better in every period (mean {margin.mean():+.2f} %)"))
  log(f"   the teacher trained on {teachers[main_teacher]['train_examples']:,} examples by its "
      f"last update, each student on {student_examples:,}")
  for job in jobs[num_students:]:
    student(*job, num_jobs)

  rows_out = []
  for k in range(num_students):
    alone = np.asarray(results[(k, "alone", main_teacher)])
    check = next(c for c in teacher_check if c["teacher"] == main_teacher and c["student"] == k)
    for (kk, variant, size), nes in results.items():
      if kk != k:
        continue
      gain = 100.0 * (alone - np.asarray(nes)) / alone
      rows_out.append({"student": k, "model": model_name(k, spec),
                       "variant": variant, "teacher": size, "ne": nes,
                       "ne_gain_pct": gain.tolist(), "mean_ne_gain_pct": float(gain.mean()),
                       "teacher_ne": check["teacher_ne"] if size == main_teacher else None,
                       "paper_ne_gain_pct": PAPER_NE_GAIN.get(variant)})
  scaling = []
  for size in teacher_sizes:
    t = teachers[size]
    scaling.append({"teacher": size, "dense_params": t["dense_params"],
                    "embedding_params": t["embedding_params"],
                    "flops_per_example": t["flops_per_example"],
                    "train_examples": t["train_examples"],
                    "mean_teacher_margin_pct": float(np.mean(
                        [c["mean_margin_pct"] for c in teacher_check if c["teacher"] == size])),
                    "mean_ne_gain_pct": {v: float(np.mean(
                        [r["mean_ne_gain_pct"] for r in rows_out
                         if r["variant"] == v and r["teacher"] == size]))
                        for v in SCALING_VARIANTS},
                    "teacher_train_seconds": t["train_seconds"]})
  return {"data": data, "eval_periods": eval_periods, "rows": rows_out, "scaling": scaling,
          "teacher_check": teacher_check, "batch_size": batch_size,
          "rows_per_period": len(rows[0]), "student_batches_per_period": n,
          "teacher_batches_per_period": len(union.periods[0]),
          "student_train_examples": student_examples,
          "wall_seconds": time.perf_counter() - t_start}


def model_name(k: int, spec: DataSpec) -> str:
  return type(student_config(k, spec)).__name__[:-len("Config")]


def format_table(res: dict[str, Any]) -> str:
  lines = [f"{res['data']}: the teacher's column vs each student alone (NE per evaluated "
           f"period {res['eval_periods']}; margin: (alone - teacher) / alone, %)"]
  for c in res["teacher_check"]:
    lines.append(f"  teacher {c['teacher']} / student {c['student']}: teacher "
                 + " ".join(f"{x:.4f}" for x in c["teacher_ne"]) + " | alone "
                 + " ".join(f"{x:.4f}" for x in c["alone_ne"])
                 + f" | margin {c['mean_margin_pct']:+.2f} %")
  lines.append(f"{res['data']}: NE gain over the student alone (%), per evaluated period")
  lines.append(f"{'student':<10}{'variant':<19}{'teacher':<9}{'mean':>8}  per period"
               f"{'':<20}paper")
  for r in res["rows"]:
    paper = "n/a" if r["paper_ne_gain_pct"] is None else f"{r['paper_ne_gain_pct']:.2f}"
    lines.append(f"{r['student']} {r['model']:<8}{r['variant']:<19}{r['teacher']:<9}"
                 f"{r['mean_ne_gain_pct']:>8.3f}  "
                 + " ".join(f"{g:+.2f}" for g in r["ne_gain_pct"]) + f"   {paper}")
  for v in SCALING_VARIANTS:
    lines.append(f"teacher size -> mean NE gain of {v} (%): " + ", ".join(
        f"{s['teacher']} ({s['dense_params']:,} dense params, "
        f"{s['flops_per_example'] / 1e6:.2f} MFLOP/ex, teacher margin "
        f"{s['mean_teacher_margin_pct']:+.2f} %): {s['mean_ne_gain_pct'][v]:+.3f}"
        for s in res["scaling"]))
  return "\n".join(lines)


def plot_gains(results: Sequence[dict[str, Any]], path: str) -> str:
  """NE gain per evaluated period, one panel per data set, a line per variant (mean over
  the students, main teacher)."""
  with plot_lib.figure(
      path, 1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False) as (fig, axes):
    for ax, res in zip(axes[0], results):
      main = [r for r in res["rows"] if r["teacher_ne"] is not None]
      for variant in VARIANTS:
        g = np.mean([r["ne_gain_pct"] for r in main if r["variant"] == variant], axis=0)
        ax.plot(res["eval_periods"], g, marker="o", label=variant)
      ax.axhline(0, color="gray", lw=0.8)
      ax.set(xlabel="evaluated period (trained on the ones before)", ylabel="NE gain (%)",
             title=os.path.basename(res["data"].rstrip("/")) or res["data"])
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  return path


def plot_scaling(results: Sequence[dict[str, Any]], path: str) -> str:
  """Against the teacher's dense FLOPs per example: the students' mean NE gain of each
  SCALING_VARIANTS variant (left) and the teacher's own NE margin over the students alone
  (right), a line per data set."""
  with plot_lib.figure(path, 1, 2, figsize=(10, 3.8)) as (fig, (ax, ax_t)):
    for res in results:
      s = res["scaling"]
      name = os.path.basename(res["data"].rstrip("/")) or res["data"]
      x = [t["flops_per_example"] for t in s]
      for v, style in zip(SCALING_VARIANTS, ("o-", "s--")):
        y = [t["mean_ne_gain_pct"][v] for t in s]
        ax.plot(x, y, style, label=f"{name}: {v}")
        for t, yy in zip(s, y):
          ax.annotate(t["teacher"], (t["flops_per_example"], yy), fontsize=8)
      ax_t.plot(x, [t["mean_teacher_margin_pct"] for t in s], "o-", label=name)
      for t in s:
        ax_t.annotate(t["teacher"], (t["flops_per_example"], t["mean_teacher_margin_pct"]),
                      fontsize=8)
    for a, ylabel, title in ((ax, "student NE gain (%)", "ExFM transfer vs teacher size"),
                             (ax_t, "teacher NE margin over student alone (%)",
                              "teacher vs students, same periods")):
      a.axhline(0, color="gray", lw=0.8)
      a.set_xscale("log")
      a.set(xlabel="teacher FLOPs per example", ylabel=ylabel, title=title)
      a.grid(alpha=0.3)
      a.legend(fontsize=7)
  return path
