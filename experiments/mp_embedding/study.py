"""Mixed-precision embedding tables with an fp32 cache against fp32 tables (arXiv 2010.11305).

The study of `experiments.mp_embedding`; a notebook can call it too:

    base = configs.make_run(data="synthetic", batch_size=1024)
    res = compare_formats(base, parse_formats(["fp32", "int8_cache:lfu:0.05"]), seeds=(0,),
                          steps=300, workdir="runs/mp")
    print(format_table(res))

Every format (a `StorageSpec`, rec/embedding/storage_spec.py) trains the same model on the
same data and batches with the same seeds (`rec.runs.train_run`); only the embedding row
storage differs (`rec/embedding/rowwise_storage.py`). Per format: test AUC and log loss
(mean over seeds, and the change against fp32 per seed), the share of eval lookups the
cache served, and the memory of the tables counted from the state's arrays
(`memory_breakdown`, summing each storage's `component_bytes`): values (fp32 rows or
codes), scales and biases, cache rows, cache tags, counters (LFU counts or LRU times); the
sparse optimizer's state is listed apart (it is the same for every format). `memory_by_dim`
gives the same count for one table at other embedding dims (the paper's 3x needs rows wider
than Criteo DLRM's 16).

Letters: R rows, D embedding dim.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from core import config
from rec import configs, runs
from rec.embedding import storage as storage_lib
from rec.embedding import storage_spec
from rec.embedding.storage_spec import StorageSpec

METRICS = ("auc", "logloss")
MEMORY_DIMS = config.setting("memory_dims", "list", "Embedding dims of the per-dim memory "
                             "table.", item=config.Setting("memory_dim", "integer",
                                                           "An embedding dim.", lower=1))
DEFAULT_FORMATS = ("fp32", "int8_cache:lfu:0.05", "int8_cache:lru:0.05", "int4_cache:lfu:0.01",
                   "int4_cache:lru:0.01")


def parse_formats(entries: Sequence[str]) -> list[StorageSpec]:
  """--formats entries -> storage specs (errors name the entry)."""
  return [StorageSpec.parse(entry, where="--formats entry") for entry in entries]


def with_storage(base: configs.RecRunConfig, spec: StorageSpec) -> configs.RecRunConfig:
  """`base` with its tables stored as `spec`."""
  return configs.replace_run(base, storage=spec)


def memory_breakdown(collection, emb_state: Mapping[str, Any]) -> dict[str, Any]:
  """Bytes of the embedding tables by component (`RowStorage.component_bytes`), counted
  from the arrays of the state, against fp32 rows of the same tables. The logical size: a
  sharded buffer counts every device's block once; a replicated (dp) buffer counts one
  copy, though each device holds one."""
  comp = dict.fromkeys(storage_lib.COMPONENTS, 0)
  optimizer = 0
  for name, g in collection.groups.items():
    for key, b in collection.storage(g).component_bytes(emb_state[name]["table"]).items():
      comp[key] += b
    optimizer += storage_lib.state_bytes(emb_state[name]["opt"])
  total = sum(comp.values())
  fp32 = sum(4 * t.num_rows * t.dim for t in collection.tables)
  return {"components": comp, "table_bytes": total, "fp32_bytes": fp32,
          "reduction": fp32 / total, "optimizer_bytes": optimizer}


def memory_by_dim(formats: Sequence[StorageSpec], dims: Sequence[int] = (16, 32, 64, 128),
                  num_rows: int = 100_000) -> list[dict[str, Any]]:
  """Bytes of one table of `num_rows` rows per format and dim, from a real state (one
  block); the reduction against fp32 rows."""
  import jax.numpy as jnp
  out = []
  for spec in formats:
    storage = storage_spec.make_storage(spec)
    for d in dims:
      st = storage.from_float(jnp.zeros((num_rows, d), jnp.float32))
      b = storage_lib.state_bytes(st)
      out.append({"format": str(spec), "dim": d, "bytes": b, "bytes_per_row": b / num_rows,
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


def train_format(base: configs.RecRunConfig, spec: StorageSpec, seeds: Sequence[int],
                 workdir: str, steps: int | None = None, epochs: float | None = None,
                 log_every: int = 100) -> dict[str, Any]:
  """Trains `base` with tables stored as `spec`, once per seed; returns the format's row:
  per-seed metrics, memory (`memory_breakdown`), eval cache hit rate, wall time."""
  if (steps is None) == (epochs is None):
    raise ValueError(f"train_format: steps={steps}, epochs={epochs}; give exactly one")
  cfg = with_storage(base, spec)
  built = configs.build_run(cfg)
  task, train_src, eval_src = built[:3]
  n_steps = configs.steps_for(epochs, train_src) if epochs is not None else int(steps)
  rows = []
  for seed in seeds:
    print(f"== {spec} seed {seed}: {n_steps} steps of {cfg.train.batch_size} "
          f"(tables: {cfg.embedding.storage})", flush=True)
    run = runs.train_run(cfg, run_dir(workdir, spec, seed), steps=n_steps, seed=seed,
                         log_every=log_every, built=built)
    emb = run.state["emb"]
    rows.append({"seed": int(seed), **{k: run.eval[k] for k in METRICS},
                 "cache_hit_rate": cache_hit_rate(task.collection, emb, eval_src.batches(0)),
                 "wall_seconds": run.wall_seconds, "examples_per_sec": run.examples_per_sec})
    memory = memory_breakdown(task.collection, emb)
  row = {"format": str(spec), "storage": str(cfg.embedding.storage), "steps": n_steps,
         "runs": rows, "memory": memory}
  for k in METRICS + ("wall_seconds", "examples_per_sec"):
    row[f"{k}_mean"] = float(np.mean([r[k] for r in rows]))
  hits = [r["cache_hit_rate"] for r in rows if r["cache_hit_rate"] is not None]
  row["cache_hit_rate_mean"] = float(np.mean(hits)) if hits else None
  return row


def run_dir(workdir: str, spec: StorageSpec, seed: int) -> str:
  """The run directory of `spec` and `seed` under the study's workdir."""
  return os.path.join(workdir, "runs", f"{str(spec).replace(':', '_')}_s{seed}")


def compare_formats(base: configs.RecRunConfig, formats: Sequence[StorageSpec],
                    seeds: Sequence[int] = (0,), steps: int | None = None,
                    epochs: float | None = None, workdir: str = "runs/mp_embedding",
                    log_every: int = 100) -> dict[str, Any]:
  """Every format under the same budget; the first is the reference (fp32) that the others'
  AUC and log loss changes are taken against, seed by seed."""
  if not formats:
    raise ValueError("compare_formats: no formats")
  # A repeated seed is the same run again: it would pass for an independent one in the
  # mean +- std over seeds (and share its run directory); a repeated format likewise.
  for flag, items in (("--seeds", [int(s) for s in seeds]),
                      ("--formats", [str(f) for f in formats])):
    twice = sorted({x for x in items if items.count(x) > 1}, key=str)
    if twice:
      raise ValueError(f"{flag}={','.join(map(str, items))}: {twice} given more than once; "
                       "expected distinct entries")
  for spec in formats:   # bad settings fail before anything trains
    with_storage(base, spec).validate()
  runs.check_fresh([run_dir(workdir, f, s) for f in formats for s in seeds],   # and earlier runs
                   resume_flag=False)
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
  return {"config": base.flat_settings(), "formats": [str(f) for f in formats],
          "seeds": [int(s) for s in seeds], "steps": steps, "epochs": epochs, "rows": rows,
          "wall_seconds": time.perf_counter() - t0}


def format_table(results: Mapping[str, Any]) -> str:
  """One line per format: quality against the reference, memory (MiB, 2^20 bytes), cache
  hit rate."""
  ref = results["rows"][0]["format"]
  lines = [f"{'format':24} {'AUC':>7} {'dAUC':>16} {'logloss':>8} {'dlogloss':>16} "
           f"{'table MiB':>9} {'x ' + ref:>10} {'hit rate':>8}"]
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
  """Bytes by component of each format's tables (MiB, 2^20 bytes)."""
  lines = [f"{'format':24} " + " ".join(f"{c:>13}" for c in storage_lib.COMPONENTS)
           + f" {'total':>9} {'optimizer':>9}"]
  for r in results["rows"]:
    m = r["memory"]
    lines.append(f"{r['format']:24} " + " ".join(f"{m['components'][c] / 2**20:13.2f}"
                                                 for c in storage_lib.COMPONENTS)
                 + f" {m['table_bytes'] / 2**20:9.2f} {m['optimizer_bytes'] / 2**20:9.2f}")
  return "\n".join(lines)


def plot(results, path: str) -> None:
  """Quality change (AUC, log loss) against memory reduction, one point per format."""
  from core import plot as plot_lib
  rows = results["rows"]
  with plot_lib.figure(path, 1, 2, figsize=(10, 3.8)) as (fig, axes):
    for ax, key, label in ((axes[0], "auc", "test AUC - reference"),
                           (axes[1], "logloss", "test log loss - reference")):
      for r in rows:
        ax.errorbar(r["memory_vs_reference"], r[f"{key}_delta_mean"],
                    yerr=r[f"{key}_delta_std"] or None, fmt="o", capsize=3)
        ax.annotate(r["format"], (r["memory_vs_reference"], r[f"{key}_delta_mean"]),
                    fontsize=7, xytext=(4, 4), textcoords="offset points")
      ax.axhline(0, color="gray", lw=0.8)
      ax.set(xlabel=f"table memory reduction vs {rows[0]['format']} (x)", ylabel=label)
    fig.suptitle(f"mixed-precision embeddings, data {results['config']['data']}")
