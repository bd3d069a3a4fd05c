"""Our Wukong and FuxiCTR's WuKong (arXiv 2403.02545) trained side by side on the same
examples, same sizes, optimizers and budget (`python -m experiments.wukong_scaling
--study=fuxictr`).

The train batches our run reads (`train_src.batches(0)`, the first `steps` of them, in
order) and every eval batch are written once to `<workdir>/data.npz`; FuxiCTR's whole
`WuKong` model trains on that file in its own PyTorch environment
(experiments/peers/fuxictr_wukong.py, `--mode=train`), ours trains through the shared loop
(rec.runs.train_run) on the same source, so both sides see identical examples in the same
order. Both eval sets are the same examples; both sides' metrics come from rec.metrics
(ours on device, the peer's from its logits on the host: exact AUC, NE from float64 log
loss). Sizes: the Wukong preset's l, n_F, n_L, k, FMB MLP and top MLP, at the run's
embedding dim. Optimizers: dense Adam (--learning_rate) and element-wise Adagrad for the
tables (--embedding_learning_rate) on both sides (torch has no row-wise Adagrad; element-wise
Adagrad gives untouched rows zero change in both, so dense torch tables and our sparse
update are the same algorithm).

What stays different is the two designs (experiments/peers/README.md): FuxiCTR embeds each
numeric field as value * vector (13 more embeddings into layer 0, no bottom MLP), ends its
FMB MLP in a ReLU, puts BatchNorm in the head (`mlp_batch_norm`), draws Y ~ N(0, 1) and
tables ~ N(0, 1e-4), and uses zero MLP biases and LayerNorm epsilon 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any, Mapping, Sequence

import numpy as np

from core.errors import UserError
from rec import configs, runs
from rec.metrics import RecMetrics
from rec.models.wukong import WukongConfig

METRICS = ("auc", "ne", "logloss")


def _flat(batches, where: str) -> dict[str, np.ndarray]:
  """Host batches -> flat columns; every bag must hold exactly one id (FuxiCTR's
  categorical fields are single ids) and carry no per-id weights."""
  dense, ids, labels, mask = [], [], [], []
  for i, b in enumerate(batches):
    lengths = np.asarray(b.lengths)
    if np.asarray(b.ids).shape[2] != 1 or not np.all(lengths[np.asarray(b.mask) > 0] == 1):
      raise UserError(f"{where} batch {i}: bags of {np.asarray(b.ids).shape[2]} slots, "
                      f"lengths {sorted(set(lengths.reshape(-1).tolist()))[:5]}; expected one "
                      "id per bag (FuxiCTR's categorical fields are single ids)")
    if b.weights is not None:
      raise UserError(f"{where} batch {i}: per-id weights; expected none (one-hot fields)")
    dense.append(np.asarray(b.dense, np.float32))
    ids.append(np.asarray(b.ids)[:, :, 0].astype(np.int32))
    labels.append(np.asarray(b.labels, np.float32))
    mask.append(np.asarray(b.mask, np.float32))
  return {"dense": np.concatenate(dense), "ids": np.concatenate(ids),
          "labels": np.concatenate(labels), "mask": np.concatenate(mask)}


def peer_config(mcfg: WukongConfig, cfg: configs.RecRunConfig, steps: int, seed: int,
                mlp_batch_norm: bool, max_grad_norm: float) -> dict[str, Any]:
  """The sizes and training settings the peer builds and trains (its config_json)."""
  t = cfg.train
  if t.dense_optimizer != "adam" or t.sparse_optimizer != "adagrad":
    raise UserError(f"--dense_optimizer={t.dense_optimizer}, --sparse_optimizer="
                    f"{t.sparse_optimizer} with --study=fuxictr; expected adam and adagrad "
                    "(the pair both frameworks run as the same algorithm)")
  return {"embedding_dim": mcfg.embedding_dim, "num_layers": mcfg.num_layers,
          "num_fm": mcfg.num_fm, "num_lcb": mcfg.num_lcb, "fm_rank": mcfg.fm_rank,
          "fm_mlp": list(mcfg.fm_mlp), "top_mlp": list(mcfg.top_mlp),
          "num_dense": mcfg.num_dense, "rows_per_feature": list(mcfg.rows_per_feature),
          "batch_size": t.batch_size, "eval_batch_size": t.eval_batch_size,
          "steps": steps, "learning_rate": t.learning_rate,
          "embedding_learning_rate": t.embedding_learning_rate,
          "dense_optimizer": "adam", "sparse_optimizer": "adagrad", "seed": int(seed),
          "mlp_batch_norm": bool(mlp_batch_norm), "max_grad_norm": float(max_grad_norm)}


def write_data(path: str, train_src, eval_src, steps: int) -> dict[str, int]:
  """The first `steps` train batches and the whole eval set to `path` (.npz)."""
  it = train_src.batches(0)
  train = _flat((next(it) for _ in range(steps)), "train data")
  ev = _flat(eval_src.batches(0), "eval data")
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  np.savez(path, **{f"train_{k}": v for k, v in train.items()},
           **{f"eval_{k}": v for k, v in ev.items()})
  return {"train_examples": int(train["mask"].sum()), "eval_examples": int(ev["mask"].sum())}


def _windows(loss: np.ndarray, every: int) -> list[tuple[int, float]]:
  """Mean loss over each logging window (the shared loop's `train` records)."""
  return [(min(i + every, loss.size), float(loss[i:i + every].mean()))
          for i in range(0, loss.size, every)]


def _our_curve(workdir: str) -> list[tuple[int, float]]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    recs = [json.loads(l) for l in f if l.strip()]
  return [(r["step"], r["loss"]) for r in recs if r["split"] == "train"]


def run_peer(peer_python: str, peer_src: str, data_path: str, config: Mapping[str, Any],
             out_path: str, threads: int) -> dict[str, np.ndarray]:
  """FuxiCTR's WuKong trained by experiments/peers/fuxictr_wukong.py --mode=train."""
  script = os.path.join(os.path.dirname(__file__), "..", "peers", "fuxictr_wukong.py")
  inputs = out_path + ".in.npz"
  with np.load(data_path) as d:
    np.savez(inputs, config_json=json.dumps(dict(config)), **{k: d[k] for k in d.files})
  try:
    r = subprocess.run([peer_python, script, "--mode", "train", "--wukong_src", peer_src,
                        "--inputs", inputs, "--outputs", out_path, "--threads", str(threads)],
                       capture_output=True, text=True)
  finally:
    os.remove(inputs)
  if r.returncode != 0:
    raise RuntimeError(f"FuxiCTR peer ({peer_python} {script}) exited {r.returncode}:\n"
                       + r.stderr[-3000:])
  with np.load(out_path) as out:
    return {k: out[k] for k in out.files}


def peer_metrics(eval_logits: np.ndarray, data_path: str) -> dict[str, float]:
  with np.load(data_path) as d:
    labels, mask = d["eval_labels"], d["eval_mask"]
  if eval_logits.shape != labels.shape:
    raise RuntimeError(f"peer eval logits {eval_logits.shape}, eval labels {labels.shape}")
  m = RecMetrics()
  m.update(eval_logits, labels, mask)
  return m.result()


def side_by_side(cfg: configs.RecRunConfig, seeds: Sequence[int], workdir: str, *,
                 peer_python: str, peer_src: str, steps: int | None = None,
                 epochs: float | None = None, log_every: int = 50,
                 mlp_batch_norm: bool = True, max_grad_norm: float = 0.0,
                 threads: int = 2) -> dict[str, Any]:
  """Both sides once per seed on the same examples; returns {config, data, rows (side,
  seed, METRICS, examples_per_sec, curve), mean / std per side, reference}."""
  for p, flag in ((peer_python, "--fuxictr_python"), (peer_src, "--fuxictr_src")):
    if not os.path.exists(p):
      raise UserError(f"{flag}={p!r}: no such file; expected the FuxiCTR peer environment "
                      "(experiments/peers/README.md)")
  if cfg.model.model != "wukong":
    raise UserError(f"--models / --model={cfg.model.model!r} with --study=fuxictr; expected wukong")
  runs.check_fresh([os.path.join(workdir, f"ours_s{seed}") for seed in seeds],
                   resume_flag=False)   # before the data is written
  t0 = time.perf_counter()
  built = configs.build_run(cfg)
  task, train_src, eval_src = built[:3]
  mcfg = configs.model_config(cfg, train_src.spec)
  n_steps = configs.steps_for(epochs, train_src) if epochs is not None else int(steps)
  peer_cfg = peer_config(mcfg, cfg, n_steps, 0, mlp_batch_norm, max_grad_norm)
  data_path = os.path.join(workdir, "data.npz")
  counts = write_data(data_path, train_src, eval_src, n_steps)
  stats = configs.model_stats(task, train_src.spec)
  rows = []
  for seed in seeds:
    print(f"== ours seed {seed}: {n_steps} steps of {cfg.train.batch_size}", flush=True)
    run = runs.train_run(cfg, os.path.join(workdir, f"ours_s{seed}"), steps=n_steps, seed=seed,
                         log_every=log_every, built=built)
    rows.append({"side": "ours", "seed": int(seed), **{k: run.eval[k] for k in METRICS},
                 "examples_per_sec": run.examples_per_sec,
                 "dense_params": stats["dense_params"], "curve": _our_curve(run.workdir)})
    del run
    print(f"== FuxiCTR seed {seed}: {n_steps} steps of {cfg.train.batch_size}", flush=True)
    out = run_peer(peer_python, peer_src, data_path, {**peer_cfg, "seed": int(seed)},
                   os.path.join(workdir, f"fuxictr_s{seed}.npz"), threads)
    loss = out["train_loss"]
    if not np.all(np.isfinite(loss)):
      raise RuntimeError(f"FuxiCTR seed {seed}: non-finite train loss at step "
                         f"{int(np.argmin(np.isfinite(loss)))}")
    m = peer_metrics(out["eval_logits"], data_path)
    rows.append({"side": "fuxictr", "seed": int(seed), **{k: float(m[k]) for k in METRICS},
                 "examples_per_sec": float(out["examples_per_sec"]),
                 "dense_params": int(out["dense_params"]), "curve": _windows(loss, log_every)})
    print(f"   ours NE {rows[-2]['ne']:.4f} AUC {rows[-2]['auc']:.4f} | FuxiCTR NE "
          f"{rows[-1]['ne']:.4f} AUC {rows[-1]['auc']:.4f}", flush=True)
  summary = {}
  for side in ("ours", "fuxictr"):
    got = [r for r in rows if r["side"] == side]
    summary[side] = {f"{k}_{s}": v for k in METRICS + ("examples_per_sec",)
                     for s, v in zip(("mean", "std"), runs.mean_std([r[k] for r in got]))}
  ref = runs.reference_metrics(eval_src)
  return {"study": "fuxictr", "config": cfg.flat_settings(), "peer_config": peer_cfg,
          "steps": n_steps, "seeds": [int(s) for s in seeds], "data": counts, "rows": rows,
          "summary": summary, "reference": ref, "gflops_per_example": stats["gflops_per_example"],
          "wall_seconds": time.perf_counter() - t0}


def format_side_by_side(res: Mapping[str, Any]) -> str:
  """One line per side (mean ± sample std over seeds) and per run."""
  n = len(res["seeds"])
  lines = [f"{'side':10} {'test AUC':>17} {'test NE':>17} {'logloss':>17} {'dense params':>13} "
           f"{'ex/s':>8}"]
  for side, name in (("ours", "ours (JAX)"), ("fuxictr", "FuxiCTR")):
    s = res["summary"][side]
    params = next(r["dense_params"] for r in res["rows"] if r["side"] == side)
    cell = lambda k: f"{s[k + '_mean']:.4f} ± {s[k + '_std']:.4f}"
    lines.append(f"{name:10} {cell('auc'):>17} {cell('ne'):>17} {cell('logloss'):>17} "
                 f"{params:>13,} {s['examples_per_sec_mean']:>8,.0f}")
  for r in res["rows"]:
    lines.append(f"  {r['side']:8} seed {r['seed']}: AUC {r['auc']:.4f} NE {r['ne']:.4f}; train "
                 f"loss {r['curve'][0][1]:.4f} (first window) -> {r['curve'][-1][1]:.4f} (last)")
  ref = res.get("reference")
  if ref:
    lines.append(f"true logits (Bayes): AUC {ref['auc']:.4f} NE {ref['ne']:.4f}")
  lines.append(f"{res['steps']} steps x {res['config']['batch_size']} = "
               f"{res['data']['train_examples']:,} train examples, "
               f"{res['data']['eval_examples']:,} eval examples, the same on both sides; "
               f"{n} seeds (mean ± sample std); {res['wall_seconds']:.0f} s in all")
  return "\n".join(lines)


def plot_curves(res: Mapping[str, Any], path: str) -> str:
  """Train loss (mean over each logging window) of both sides, one line per seed."""
  from core import plot as plot_lib
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with plot_lib.figure(path, figsize=(6.5, 4)) as (fig, ax):
    for r in res["rows"]:
      steps, loss = zip(*r["curve"])
      ax.plot(steps, loss, "-" if r["side"] == "ours" else "--",
              c="C0" if r["side"] == "ours" else "C1",
              label=f"{r['side']} seed {r['seed']} (test NE {r['ne']:.4f})")
    ax.set(xlabel="step", ylabel="train loss (window mean)",
           title=f"{res['config']['data']}: ours vs FuxiCTR WuKong, {res['steps']} steps of "
                 f"{res['config']['batch_size']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  return path
