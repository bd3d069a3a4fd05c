"""Mixed-precision embedding tables with an fp32 cache against fp32 tables (arXiv 2010.11305).

The library behind `experiments.mp_embedding`; a notebook can call it directly:

    base = configs.RecRunConfig(data="synthetic", batch_size=1024)
    res = compare_formats(base, ["fp32", "int8_cache:lfu:0.05"], seeds=(0,), steps=300,
                          workdir="runs/mp")
    print(format_table(res))

Every format trains the same model on the same data and batches with the same seeds; only
the embedding row storage differs (`rec/embedding/cached_storage.py`). Per format: test AUC
and log loss (mean over seeds, and the change against fp32 per seed), the share of eval
lookups the cache served, and the memory of the tables counted from the state's arrays
(`memory_breakdown`): values (fp32 rows or codes), scales and biases, cache rows, cache tags,
counters (LFU counts or LRU times); the sparse optimizer's state is listed apart (it is the
same for every format). `memory_by_dim` gives the same count for one table at other embedding
dims (the paper's 3x needs rows wider than Criteo DLRM's 16).

Letters: R rows, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from core import train as train_lib
from rec import configs
from rec.embedding import storage as storage_lib

METRICS = ("auc", "logloss")
DEFAULT_FORMATS = ("fp32", "int8_cache:lfu:0.05", "int8_cache:lru:0.05", "int4_cache:lfu:0.01",
                   "int4_cache:lru:0.01")
# Storage state keys by what they hold (every key of every format appears here once).
COMPONENTS = {"rows": "values", "q": "values", "scale": "scales_biases",
              "bias": "scales_biases", "cache_rows": "cache", "cache_tags": "tags",
              "counts": "counters", "cache_last": "counters"}
COMPONENT_ORDER = ("values", "scales_biases", "cache", "tags", "counters")


def split_format(spec: str) -> dict[str, Any]:
  """RecRunConfig fields for a format: "fp32", "bf16_sr", "int8", or
  "int8_cache:lfu:0.05" (storage, cache policy, cache fraction)."""
  parts = spec.split(":")
  if parts[0] not in configs.STORAGES:
    raise ValueError(f"--formats entry {spec!r}: storage {parts[0]!r}, expected one of "
                     f"{list(configs.STORAGES)}")
  out: dict[str, Any] = {"storage": parts[0]}
  if parts[0].endswith("_cache"):
    if len(parts) != 3:
      raise ValueError(f"--formats entry {spec!r}: expected {parts[0]}:lfu|lru:fraction")
    out.update(cache_policy=parts[1], cache_fraction=float(parts[2]))
  elif len(parts) != 1:
    raise ValueError(f"--formats entry {spec!r}: {parts[0]} takes no cache settings")
  return out


def memory_breakdown(collection, emb_state: Mapping[str, Any]) -> dict[str, Any]:
  """Bytes of the embedding tables by component, counted from the arrays of the state,
  against fp32 rows of the same tables. The logical size: a sharded buffer counts every
  device's block once; a replicated (dp) buffer counts one copy, though each device holds
  one."""
  comp = {k: 0 for k in COMPONENT_ORDER}
  optimizer = 0
  for name in collection.groups:
    for key, arr in emb_state[name]["table"].items():
      comp[COMPONENTS[key]] += storage_lib.state_bytes({key: arr})
    optimizer += storage_lib.state_bytes(emb_state[name]["opt"])
  total = sum(comp.values())
  fp32 = sum(4 * t.num_rows * t.dim for t in collection.tables)
  return {"components": comp, "table_bytes": total, "fp32_bytes": fp32,
          "reduction": fp32 / total, "optimizer_bytes": optimizer}


def memory_by_dim(formats: Sequence[str], dims: Sequence[int] = (16, 32, 64, 128),
                  num_rows: int = 100_000) -> list[dict[str, Any]]:
  """Bytes of one table of `num_rows` rows per format and dim, from a real state (one
  block); the reduction against fp32 rows."""
  import jax.numpy as jnp
  out = []
  for spec in formats:
    storage = storage_lib.get_storage(configs.RecRunConfig(**split_format(spec)).table_storage())
    for d in dims:
      st = storage.from_float(jnp.zeros((num_rows, d), jnp.float32))
      b = storage_lib.state_bytes(st)
      out.append({"format": spec, "dim": d, "bytes": b, "bytes_per_row": b / num_rows,
                  "reduction": 4 * num_rows * d / b})
  return out


def cached_rows(collection, emb_state: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Per table, a bool [rows] of the rows some device holds in its fp32 cache (under cw a
  row whose chunk on any device is cached); tables without a cache are absent."""
  out: dict[str, np.ndarray] = {}
  for name, g in collection.groups.items():
    tbl = emb_state[name]["table"]
    if "cache_tags" not in tbl:
      continue
    shards = collection.shards(name)
    tags = np.asarray(tbl["cache_tags"]).reshape(shards, -1)
    per_block = np.asarray(tbl["q"]).shape[0] // shards
    in_cache = np.zeros(shards * per_block, bool)
    for d in range(shards):
      t = tags[d][tags[d] >= 0]
      in_cache[d * per_block + t] = True
    for table, r0, r1, _, _, row in collection.blocks(name):
      mask = out.setdefault(table, np.zeros(next(t.num_rows for t in collection.tables
                                                 if t.name == table), bool))
      mask[r0:r1] |= in_cache[row:row + (r1 - r0)]
  return out


def cache_hit_rate(collection, emb_state: Mapping[str, Any], batches: Iterable[Any]
                   ) -> float | None:
  """The share of looked-up ids (in bags, real examples) whose row is in the cache, over
  `batches` (host SparseBatches); None without a cache."""
  masks = cached_rows(collection, emb_state)
  if not masks:
    return None
  hits = total = 0
  for b in batches:
    ids, lengths = np.asarray(b.ids), np.asarray(b.lengths)
    live = (np.arange(ids.shape[2]) < lengths[..., None]) & (np.asarray(b.mask)[:, None, None] > 0)
    for f, t in enumerate(collection.tables):
      if t.name in masks:
        sel = ids[:, f][live[:, f]]
        hits += int(masks[t.name][np.clip(sel, 0, t.num_rows - 1)].sum())
        total += sel.size
  return hits / max(total, 1)


def train_format(base: configs.RecRunConfig, spec: str, seeds: Sequence[int], workdir: str,
                 steps: int | None = None, epochs: float | None = None,
                 log_every: int = 100) -> dict[str, Any]:
  """Trains `base` with tables stored as `spec`, once per seed; returns the format's row:
  per-seed metrics, memory (`memory_breakdown`), eval cache hit rate, wall time."""
  if (steps is None) == (epochs is None):
    raise ValueError(f"train_format: steps={steps}, epochs={epochs}; give exactly one")
  cfg = dataclasses.replace(base, **split_format(spec))
  task, train_src, eval_src, _, _ = configs.build_run(cfg)
  n_steps = configs.steps_for(epochs, train_src) if epochs is not None else int(steps)
  runs = []
  for seed in seeds:
    run_dir = os.path.join(workdir, "runs", f"{spec.replace(':', '_')}_s{seed}")
    if os.path.isdir(run_dir):
      shutil.rmtree(run_dir)
    print(f"== {spec} seed {seed}: {n_steps} steps of {cfg.batch_size} "
          f"(tables: {cfg.table_storage()})", flush=True)
    t0 = time.perf_counter()
    out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0),
                          train_lib.TrainConfig(workdir=run_dir, steps=n_steps,
                                                log_every=max(1, log_every), seed=int(seed),
                                                tensorboard=False))
    wall = time.perf_counter() - t0
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    emb = out["state"]["emb"]
    runs.append({"seed": int(seed), **{k: float(out["eval"][k]) for k in METRICS},
                 "cache_hit_rate": cache_hit_rate(task.collection, emb, eval_src.batches(0)),
                 "wall_seconds": wall, "examples_per_sec": out["examples_per_sec"]})
    memory = memory_breakdown(task.collection, emb)
  row = {"format": spec, "storage": cfg.table_storage(), "steps": n_steps, "runs": runs,
         "memory": memory}
  for k in METRICS + ("wall_seconds", "examples_per_sec"):
    row[f"{k}_mean"] = float(np.mean([r[k] for r in runs]))
  hits = [r["cache_hit_rate"] for r in runs if r["cache_hit_rate"] is not None]
  row["cache_hit_rate_mean"] = float(np.mean(hits)) if hits else None
  return row


def compare_formats(base: configs.RecRunConfig, formats: Sequence[str] = DEFAULT_FORMATS,
                    seeds: Sequence[int] = (0,), steps: int | None = None,
                    epochs: float | None = None, workdir: str = "runs/mp_embedding",
                    log_every: int = 100) -> dict[str, Any]:
  """Every format under the same budget; the first is the reference (fp32) that the others'
  AUC and log loss changes are taken against, seed by seed."""
  if not formats:
    raise ValueError("compare_formats: no formats")
  for spec in formats:   # bad entries fail before anything trains
    configs.RecRunConfig(**{**dataclasses.asdict(base), **split_format(spec)}).validate()
  t0 = time.perf_counter()
  rows = [train_format(base, f, seeds, workdir, steps=steps, epochs=epochs, log_every=log_every)
          for f in formats]
  ref = rows[0]
  for row in rows:
    for k in METRICS:
      deltas = [r[k] - q[k] for r, q in zip(row["runs"], ref["runs"])]
      row[f"{k}_delta_mean"] = float(np.mean(deltas))
      row[f"{k}_delta_std"] = float(np.std(deltas, ddof=1)) if len(deltas) > 1 else 0.0
    row["memory_vs_reference"] = ref["memory"]["table_bytes"] / row["memory"]["table_bytes"]
  return {"config": dataclasses.asdict(base), "formats": list(formats),
          "seeds": [int(s) for s in seeds], "steps": steps, "epochs": epochs, "rows": rows,
          "wall_seconds": time.perf_counter() - t0}


def format_table(results: Mapping[str, Any]) -> str:
  """One line per format: quality against the reference, memory, cache hit rate."""
  ref = results["rows"][0]["format"]
  lines = [f"{'format':24} {'AUC':>7} {'dAUC':>16} {'logloss':>8} {'dlogloss':>16} "
           f"{'table MB':>9} {'x ' + ref:>10} {'hit rate':>8}"]
  for r in results["rows"]:
    pm = lambda k: (f"{r[k + '_delta_mean']:+.4f}" + (f" ± {r[k + '_delta_std']:.4f}"
                                                       if len(r["runs"]) > 1 else ""))
    hit = "-" if r["cache_hit_rate_mean"] is None else f"{r['cache_hit_rate_mean']:.1%}"
    lines.append(f"{r['format']:24} {r['auc_mean']:7.4f} {pm('auc'):>16} "
                 f"{r['logloss_mean']:8.4f} {pm('logloss'):>16} "
                 f"{r['memory']['table_bytes'] / 2**20:9.2f} {r['memory_vs_reference']:9.2f}x "
                 f"{hit:>8}")
  return "\n".join(lines)


def format_memory(results: Mapping[str, Any]) -> str:
  """Bytes by component of each format's tables (MB)."""
  lines = [f"{'format':24} " + " ".join(f"{c:>13}" for c in COMPONENT_ORDER)
           + f" {'total':>9} {'optimizer':>9}"]
  for r in results["rows"]:
    m = r["memory"]
    lines.append(f"{r['format']:24} " + " ".join(f"{m['components'][c] / 2**20:13.2f}"
                                                 for c in COMPONENT_ORDER)
                 + f" {m['table_bytes'] / 2**20:9.2f} {m['optimizer_bytes'] / 2**20:9.2f}")
  return "\n".join(lines)
