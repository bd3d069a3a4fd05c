"""Where a recommendation run's time goes: the input pipeline alone, the jitted step alone,
and the two together through the train loop (`core.train.train`).

A run is fed well when its end-to-end rate is close to its step's rate: the loop then adds
only what it cannot hide (host->device copies the prefetch thread has not overlapped,
metric fetches). `measure` returns all three rates for one task and source; the entry point
is `experiments/bench_pipeline.py`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np

from core import benchmark
from core import train as train_loop
from rec.data.batch import BatchSource


def source_rate(src: BatchSource, batches: int, warmup: int = 2) -> float:
  """Examples/s of `src.batches()` alone (host numpy batches, or device batches for a
  source that draws them on device: then each is waited for)."""
  it = src.batches(0)
  for _ in range(warmup):
    jax.block_until_ready(next(it))
  n = 0
  t = time.perf_counter()
  for _ in range(batches):
    b = next(it)
    jax.block_until_ready(b)
    n += int(b.batch_size)
  return n / (time.perf_counter() - t)


def step_rate(task, src: BatchSource, steps: int, repeats: int) -> float:
  """Median examples/s of the jitted, donated train step over a pool of 8 batches placed on
  the devices before timing (what `experiments.bench_dlrm` times)."""
  pool = [task.device_batch(src.batch(k)) for k in range(8)]
  step = jax.jit(task.train_step, donate_argnums=0)
  i = [0]

  def one(s):
    b = pool[i[0] % len(pool)]
    i[0] += 1
    return step(s, b)[0]

  per_step, _ = benchmark.time_steps(one, task.init_state(0), steps, repeats, warmup=3)
  return pool[0].batch_size / benchmark.median(per_step)


def loop_rate(task, src: BatchSource, steps: int, workdir: str | None = None,
              hooks=()) -> float:
  """Examples/s of `core.train.train` (no eval, one final checkpoint) over `steps` steps,
  first step (compilation) excluded, as the loop reports it; `hooks`: the loop's extra
  hooks (`core.hooks.Hook`)."""
  with tempfile.TemporaryDirectory() as tmp:
    cfg = train_loop.TrainConfig(workdir=workdir or os.path.join(tmp, "run"), steps=steps,
                                 eval_every=0, checkpoint_every=0, log_every=max(steps // 4, 1),
                                 tensorboard=False)
    out = train_loop.train(task, src.batches, None, cfg, hooks=hooks)
  return float(out["examples_per_sec"])


def measure(task, src: BatchSource, *, steps: int = 50, repeats: int = 3,
            source_batches: int = 50, profile_dir: str | None = None) -> dict[str, Any]:
  """{source, step, end_to_end} examples/s and end_to_end / step; with `profile_dir`, one
  more loop run of `steps` steps traces its steady middle there (steps after steps // 3 up
  to steps - steps // 6: no state init, first-step compile or final checkpoint;
  `core.profiling.StepWindow`) and "profile" holds its summary: how busy the device was
  while the loop fed it, and which kernels ran."""
  out = {"source_examples_per_sec": source_rate(src, source_batches),
         "step_examples_per_sec": step_rate(task, src, max(steps // repeats, 1), repeats),
         "end_to_end_examples_per_sec": loop_rate(task, src, steps)}
  out["end_to_end_over_step"] = out["end_to_end_examples_per_sec"] / out["step_examples_per_sec"]
  if profile_dir:
    from core import profiling
    from core.hooks import Hook
    first = max(1, steps // 3)
    window = profiling.StepWindow(profile_dir, first, max(first + 1, steps - steps // 6))
    try:
      loop_rate(task, src, steps, hooks=[Hook(window, every=1)])
    finally:
      window.close()
    out["profile"] = window.summary()
  return out


GENERATED = "generated.json"   # synthetic_bin_dir's settings of the rows it wrote there


def synthetic_bin_dir(d: str, rows: int, rows_per_feature: int, seed: int = 0) -> str:
  """A converted Criteo directory (`rec.data.criteo_bin` layout) of `rows` random rows
  (ids of a bounded Zipf law of exponent 1.2 over each table's rows, hot rows scattered:
  `synthetic.zipf_ids`; 25% positives) at `d`, written once and reused while its settings
  (`GENERATED`: rows, rows per feature, seed, id law) are these."""
  from rec.data import criteo, criteo_bin, synthetic
  want = {"rows": int(rows), "rows_per_feature": int(rows_per_feature), "seed": int(seed),
          "ids": "synthetic.zipf_ids alpha 1.2"}
  try:
    with open(os.path.join(d, GENERATED)) as f:
      have = json.load(f)
    if have == want:
      criteo_bin.load_manifest(d)
      return d
  except (OSError, ValueError):   # absent, or written by another format version: write it
    pass
  if os.path.exists(os.path.join(d, GENERATED)):   # stale until the new rows are written
    os.remove(os.path.join(d, GENERATED))
  rng = np.random.default_rng(seed)
  dense = np.log1p(rng.exponential(3.0, (rows, criteo.NUM_DENSE))).astype(np.float32)
  ids = synthetic.zipf_ids(rng, rows_per_feature, (rows, criteo.NUM_SPARSE), 1.2)
  labels = (rng.random(rows) < 0.25).astype(np.uint8)
  criteo_bin.write_arrays(d, {"train": (dense, ids, labels),
                              "test": (dense[:8192], ids[:8192], labels[:8192])},
                          [rows_per_feature] * criteo.NUM_SPARSE)
  with open(os.path.join(d, GENERATED), "w") as f:
    json.dump(want, f)
  return d
