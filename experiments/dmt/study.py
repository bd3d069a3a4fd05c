"""DMT (arXiv 2403.00877) study: the flat DLRM against tower models, trained through the
shared RecTask, train loop and sparse optimizers, and the all-to-all volume of SPTT against
the flat model's.

  train_eval(model_fn, tables, ...)   one model trained and evaluated (core.train.train):
                                      test AUC / log loss, train seconds, pooled embeddings
                                      of the last test batch
  comm_volume(...)                    bytes per step that the collection's all-to-alls and
                                      in-group collectives deliver, flat vs SPTT (checked
                                      against the compiled HLO in tests/experiments/dmt)
  run(...)                            the comparison: flat, then per T the similarity and
                                      the random partition; rows for the table and plot
  format_table(rows), plot(rows, path)
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core import mesh as mesh_lib
from core import train as train_loop
from rec.data.synthetic import SyntheticCriteo
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding import towers as towers_lib
from rec.models.dlrm import DLRM, DLRMConfig
from rec.models.dmt import DMTConfig, DMTModel
from rec.embedding.collection import EmbeddingCollection
from rec.train_lib import RecTask


class SameStartTask(RecTask):
  """A RecTask whose state starts from the study's fixed draws, the same for every model:
  dense parameters of model_fn(nnx.Rngs(seed)), tables uniform in +-sqrt(1 / rows) from
  jax.random.key(seed + 1) as one [F, R, D] draw (so flat and tower models share tables)."""

  def init_state(self, seed: int) -> dict[str, Any]:
    state = super().init_state(seed)
    params = nnx.to_pure_dict(nnx.state(self.model_fn(nnx.Rngs(seed))))
    state["params"] = jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding), params,
                                   state["params"])
    state["opt"] = self.dense_tx.init(state["params"])
    tables = self.collection.tables
    R, D = tables[0].num_rows, tables[0].dim
    s = np.sqrt(1.0 / R)
    full = jax.random.uniform(jax.random.key(seed + 1), (len(tables), R, D), jnp.float32, -s, s)
    state["emb"] = self.collection.from_tables({t.name: full[i] for i, t in enumerate(tables)})
    return state


def train_eval(model_fn: Callable[[nnx.Rngs], nnx.Module], tables, source, eval_source,
               steps: int, eval_batches: int, workdir: str, seed: int = 0, lr: float = 0.05,
               mesh=None) -> dict[str, Any]:
  """Trains `model_fn`'s model and its tables (table-wise on `mesh`, default one device)
  with Adagrad in optax's form for both (sparse on the touched rows: on one-hot data the
  same steps as dense Adagrad on the full tables), then evaluates on `eval_batches` test
  batches. Returns auc, logloss, train_seconds and eval_emb [B, F, D], the pooled
  embeddings of the last test batch."""
  mesh = mesh or mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
  n = mesh_lib.axis_size("emb_shard", mesh_lib.REC_RULES, mesh)
  sparse = opt_lib.get_sparse_optimizer("adagrad", lr, initial_accumulator_value=0.1, eps=1e-7)
  coll = EmbeddingCollection(tables, planner_lib.uniform_plan(tables, "tw", n), mesh, sparse)
  task = SameStartTask(model_fn, coll, optax.adagrad(lr), mesh)
  cfg = train_loop.TrainConfig(workdir=workdir, steps=steps, log_every=max(1, steps // 4),
                               seed=seed, tensorboard=False, overwrite=True)
  evals = lambda: itertools.islice(eval_source.batches(0), eval_batches)
  out = train_loop.train(task, source.batches, evals, cfg)
  last = task.device_batch(list(evals())[-1])
  emb = coll.lookup(out["state"]["emb"], last.ids, last.lengths, last.weights)
  return {"auc": out["eval"]["auc"], "logloss": out["eval"]["logloss"],
          "train_seconds": out["train_seconds"], "eval_emb": np.asarray(emb)}


def comm_volume(batch: int, num_features: int, dim: int, towers: int, tower_k: int,
                bag: int = 1, group_size: int = 8, bytes_per_value: int = 4,
                id_bytes: int = 4) -> dict[str, Any]:
  """Bytes per step (forward; the backward moves the pooled gradients the same way back)
  that the collection's collectives deliver, summed over devices, each device's own share
  included (rec/embedding/collection.py). A bag travels as its `bag` ids, `bag` float32
  weights and its length; pooled values as float32.

  flat (table-wise, global): all-to-all of the bags [B, F] and of the pooled [B, F, D] back.
  SPTT, towers of F / T features on groups of `group_size` devices: global (over the
  towers): the bags [B, F] and the compressed [B, T (K + 1), D] outputs; inside each group:
  the bags all-gathered (each of its devices receives the group's) and the partial sums
  reduce-scattered ([B, F, D] delivered), over the fast links of one host.
  The payload: the collection's static all-to-all pads every device (flat) or tower (SPTT)
  to the largest one's table count, which sends more where tables do not divide evenly.
  """
  bag_bytes = bag * id_bytes + bag * 4 + 4
  ids = batch * num_features * bag_bytes
  flat = {"global_ids": ids, "global_embeddings": batch * num_features * dim * bytes_per_value}
  sptt = {"global_ids": ids,
          "global_embeddings": batch * towers * (tower_k + 1) * dim * bytes_per_value,
          "intra_group_ids": group_size * ids,
          "intra_group_embeddings": batch * num_features * dim * bytes_per_value}
  flat["global_total"] = flat["global_ids"] + flat["global_embeddings"]
  sptt["global_total"] = sptt["global_ids"] + sptt["global_embeddings"]
  return {"flat": flat, "sptt": sptt,
          "global_reduction": flat["global_total"] / sptt["global_total"]}


def run(towers: Sequence[int], tower_k: int, steps: int, batch_size: int, eval_batches: int,
        num_rows: int, dim: int, teacher: str, comm_batch: int, seed: int, workdir: str,
        log=print) -> dict[str, Any]:
  """The comparison on synthetic Criteo-shaped data (26 one-hot features): the flat DLRM,
  then per tower count T the similarity partition (of the flat model's learned pooled
  embeddings) and a random one. Returns {"rows", "similarity"}."""
  F, D, R = 26, dim, num_rows
  src = lambda split: SyntheticCriteo(batch_size, R, seed=seed, split=split, teacher=teacher)
  train, test = src("train"), src("test")
  common = dict(steps=steps, eval_batches=eval_batches, seed=seed)
  bottom, top = (64, D), (64, 1)
  flat_cfg = DLRMConfig(num_dense=13, num_sparse=F, embedding_dim=D, bottom_mlp=bottom,
                        top_mlp=top, rows_per_feature=(R,) * F)
  log("== flat DLRM")
  flat = train_eval(lambda r: DLRM(flat_cfg, r), flat_cfg.tables(), train, test,
                    workdir=os.path.join(workdir, "flat"), **common)
  vol = comm_volume(comm_batch, F, D, 1, 0)
  rows = [{"model": "flat DLRM", "towers": None, "auc": flat["auc"],
           "logloss": flat["logloss"], "global_bytes": vol["flat"]["global_total"],
           "intra_group_bytes": 0, "global_reduction": 1.0,
           "train_seconds": flat["train_seconds"]}]
  sim = towers_lib.feature_similarity(flat["eval_emb"])
  costs = [R * D] * F
  for T in towers:
    for kind, parts in (("similarity", towers_lib.partition(sim, costs, T)),
                        ("random", towers_lib.random_partition(F, T, seed))):
      log(f"== DMT T={T} {kind} towers {parts}")
      cfg = DMTConfig(num_dense=13, embedding_dim=D, towers=parts, tower_k=tower_k,
                      bottom_mlp=bottom, top_mlp=top, rows_per_feature=R)
      res = train_eval(lambda r, cfg=cfg: DMTModel(cfg, r), cfg.tables(), train, test,
                       workdir=os.path.join(workdir, f"dmt_t{T}_{kind}"), **common)
      vol = comm_volume(comm_batch, F, D, T, tower_k)
      within = sum(sim[a, b] for t in parts for a in t for b in t if a != b) / max(
          1, sum(len(t) * (len(t) - 1) for t in parts))
      rows.append({"model": f"DMT T={T} ({kind})", "towers": parts, "auc": res["auc"],
                   "logloss": res["logloss"], "global_bytes": vol["sptt"]["global_total"],
                   "intra_group_bytes": vol["sptt"]["intra_group_embeddings"],
                   "global_reduction": vol["global_reduction"],
                   "within_tower_similarity": within, "train_seconds": res["train_seconds"]})
  return {"rows": rows, "similarity": sim.tolist()}


def format_table(rows) -> str:
  lines = [f"{'model':<26}{'AUC':>8}{'logloss':>9}{'global a2a MB/step':>20}{'x less':>8}"
           f"{'intra-group MB':>16}"]
  for r in rows:
    lines.append(f"{r['model']:<26}{r['auc']:>8.4f}{r['logloss']:>9.4f}"
                 f"{r['global_bytes'] / 2**20:>20.1f}{r['global_reduction']:>8.2f}"
                 f"{r['intra_group_bytes'] / 2**20:>16.1f}")
  return "\n".join(lines)


def plot(rows, path: str) -> str:
  """Test AUC against the global all-to-all bytes per step, one point per model."""
  from core import plot as plot_lib
  plt = plot_lib.pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for r in rows:
    ax.scatter(r["global_bytes"] / 2**20, r["auc"], s=40)
    ax.annotate(r["model"], (r["global_bytes"] / 2**20, r["auc"]), fontsize=7)
  ax.set(xlabel="global all-to-all MB per step (forward)", ylabel="test AUC",
         title="DMT vs flat DLRM")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
