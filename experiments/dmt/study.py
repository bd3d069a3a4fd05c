"""DMT (arXiv 2403.00877) study: the flat DLRM against tower models, trained through the
shared RecTask, train loop and sparse optimizers, and the all-to-all volume of SPTT against
the flat model's.

  train_eval(model_fn, tables, ...)   one model trained and evaluated (core.train.train):
                                      test AUC / log loss, train seconds, pooled embeddings
                                      of the last test batch
  comm_volume(...)                    bytes per step that the collection's all-to-alls and
                                      in-group collectives deliver, flat vs SPTT (checked
                                      against the compiled HLO in tests/experiments/dmt)
  hlo_unit_bytes(...)                 bytes per bag and per pooled value read from the
                                      compiled flat and SPTT lookups' HLO (8 devices)
  h100_step_model(...), h100_table    flat vs SPTT step time of a GPU on H100 hosts (compute,
                                      NVLink, inter-host exchange; core.hardware's links)
                                      from those bytes, per host count, beside the paper's 1.9x
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
from rec import runs
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
                               seed=seed, tensorboard=False)
  evals = lambda: itertools.islice(eval_source.batches(0), eval_batches)
  out = train_loop.train(task, source.batches, evals, cfg)
  last = task.device_batch(list(evals())[-1])
  emb = coll.lookup(out["state"]["emb"], last.ids, last.lengths, last.weights)
  return {"auc": out["eval"]["auc"], "logloss": out["eval"]["logloss"],
          "train_seconds": out["train_seconds"], "eval_emb": np.asarray(emb)}


def comm_volume(batch: int, num_features: int, dim: int, towers: int | Sequence[Sequence[int]],
                tower_k: int, bag: int = 1, group_size: int = 8, bytes_per_value: int = 4,
                id_bytes: int = 4) -> dict[str, Any]:
  """Bytes per step (forward; the backward moves the pooled gradients the same way back)
  that the collection's collectives deliver, summed over devices, each device's own share
  included (rec/embedding/collection.py): the bytes of the compiled program's collectives.
  A bag travels as its `bag` ids, `bag` float32 weights and its length; pooled values as
  float32. `towers`: the partition (tower t's features), or a count T (features dealt
  evenly); T towers of `group_size` devices, N = T * group_size devices in all, and the
  flat model table-wise over the same N.

  flat (table-wise, global): all-to-all of the bags and of the pooled vectors back.
  SPTT: global (over the towers): the bags and the compressed [B, T (K + 1), D] outputs;
  inside each group: the bags all-gathered (each of its devices receives the group's) and
  the partial sums reduce-scattered, over the fast links of one host.
  Padding, as the program sends it: the batch in N blocks of ceil(B / N) rows (a global
  batch is a multiple of N); the static all-to-alls send every device (flat) S = ceil(F /
  N) table slots (the table-wise plan deals tables of equal size round-robin: the study's),
  and every tower (SPTT) Fm slots, its largest tower's feature count, live or not.
  """
  parts = (None if isinstance(towers, (int, np.integer)) else
           [tuple(int(f) for f in t) for t in towers])
  T = int(towers) if parts is None else len(parts)
  F = int(num_features)
  if T < 1 or T > F:
    raise ValueError(f"comm_volume: towers={towers!r}; expected 1 to {F} towers")
  if parts is not None and sorted(f for t in parts for f in t) != list(range(F)):
    raise ValueError(f"comm_volume: towers={towers!r}; expected a partition of the "
                     f"{F} features")
  fm = -(-F // T) if parts is None else max(len(t) for t in parts)
  N = T * group_size
  b = N * -(-batch // N)                       # the batch padded to N equal blocks
  S = -(-F // N)                               # flat: table slots per device
  bag_bytes = bag * id_bytes + bag * 4 + 4
  value_bytes = dim * bytes_per_value
  flat = {"global_ids": b * N * S * bag_bytes, "global_embeddings": b * N * S * value_bytes}
  sptt = {"global_ids": b * T * fm * bag_bytes,
          "global_embeddings": b * T * (tower_k + 1) * value_bytes,
          "intra_group_ids": group_size * b * T * fm * bag_bytes,
          "intra_group_embeddings": b * T * fm * value_bytes}
  flat["global_total"] = flat["global_ids"] + flat["global_embeddings"]
  sptt["global_total"] = sptt["global_ids"] + sptt["global_embeddings"]
  return {"flat": flat, "sptt": sptt, "devices": N,
          "global_reduction": flat["global_total"] / sptt["global_total"]}


# --- the step-time model on H100 hosts -------------------------------------------------------

PAPER_SPEEDUP = 1.9   # arXiv 2403.00877 abstract: "up to 1.9x speedup" over flat baselines
GPUS_PER_HOST = 8


def hlo_unit_bytes(dims: Sequence[int] = (4, 8), batch: int = 16, bag: int = 1,
                   tower_k: int = 2) -> dict[str, Any]:
  """Bytes the compiled lookups move, read from their HLO (core.hlo) on 8 devices (2 tower
  groups of 4 for SPTT, table-wise over all 8 for flat), 8 features, at two embedding dims:
  the flat all-to-all is bags + pooled values, B F (u + e D), so the two dims give the
  bytes per bag u and per pooled value e. The SPTT collectives of the same compile must then
  be what those units predict (else a ValueError): the numbers the step model scales."""
  from core import hlo
  if jax.device_count() < 8:
    raise ValueError(f"hlo_unit_bytes: {jax.device_count()} devices; expected 8 (set "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)")
  N, T, G, F = 8, 2, 4, 8
  towers = ((0, 2, 5, 7), (1, 3, 4, 6))
  mesh = mesh_lib.make_mesh("data:2,model:4", jax.devices()[:8])
  sgd = opt_lib.get_sparse_optimizer("sgd", 0.1)
  ids = np.zeros((batch, F, bag), np.int32)
  lengths = np.ones((batch, F), np.int32)
  weights = np.ones((batch, F, bag), np.float32)
  got = {}
  for D in dims:
    cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=towers, tower_k=tower_k,
                    bottom_mlp=(8, D), top_mlp=(8, 1), rows_per_feature=(16,) * F)
    tables = cfg.tables()
    model = DMTModel(cfg, nnx.Rngs(0))
    for name, plan, kw in (("flat", planner_lib.uniform_plan(tables, "tw", N), {}),
                           ("sptt", planner_lib.tower_plan(tables, towers, N),
                            {"towers": model.tower_transform()})):
      coll = EmbeddingCollection(tables, plan, mesh, sgd)
      fn = jax.jit(lambda s, i, l, w, coll=coll, kw=kw: coll.lookup(s, i, l, w, **kw))
      text = fn.lower(coll.init(jax.random.key(0)), ids, lengths, weights).compile().as_text()
      got[(name, D)] = {f"{k[0]} {','.join(k[1])}": N * v
                        for k, v in hlo.collective_bytes(text).items()}
  d1, d2 = dims
  a2a = lambda D: got[("flat", D)]["all-to-all data,model"]
  value = (a2a(d2) - a2a(d1)) / (batch * F * (d2 - d1))
  bag_bytes = a2a(d1) / (batch * F) - value * d1
  for D in dims:   # SPTT's collectives in the same units
    want = {"all-to-all data": batch * F * bag_bytes + batch * T * (tower_k + 1) * D * value,
            "all-gather model": G * batch * F * bag_bytes,
            "reduce-scatter model": batch * F * D * value}
    if got[("sptt", D)] != want:
      raise ValueError(f"hlo_unit_bytes: SPTT collectives at dim {D} {got[('sptt', D)]}, "
                       f"expected {want} from the flat program's units")
  return {"bag_bytes": bag_bytes, "value_bytes": value, "bag": bag,
          "compiled": {f"{n} D={D}": v for (n, D), v in got.items()}}


def h100_step_model(bag_bytes: float, value_bytes: float, hosts: int, local_batch: int,
                    num_features: int, dim: int, tower_k: int, flops_flat: float,
                    flops_dmt: float, gpus_per_host: int = GPUS_PER_HOST, hw=None,
                    eff=None, padded: bool = True) -> dict[str, Any]:
  """Step time of one GPU, flat table-wise DLRM vs DMT through SPTT with one tower per host,
  on `hosts` hosts of `gpus_per_host` H100 (core.hardware: NVLink inside a host, the RDMA
  NIC of each GPU across hosts, with the CP model's fitted lines: Efficiency.all2all_link
  across, nvlink_link inside).

  Bytes per GPU and step (b = local_batch, F features, D dim, u = bag_bytes, e =
  value_bytes, N = hosts * G GPUs, H = hosts). F counts table slots as the collection's
  static all-to-alls send them (`comm_volume`): N ceil(F / N) flat (every GPU sends every
  GPU the busiest GPU's table count: 32 for 26 tables on 8 or 16 GPUs, 128 on 128), H Fm
  for SPTT (Fm = ceil(F / H), the largest of the equal-count towers) and H G ceil(Fm / G)
  with the towers' tables table-wise inside the host (as flat on one host). padded=False:
  F slots everywhere, as all-to-alls with per-peer split sizes (TorchRec's) send them.
    flat   all-to-alls over all N GPUs (the collection's three: forward bags b F u and
           pooled b F D e, backward the pooled gradients b F D e); the share (N - G) / N of
           each leaves the host, the share (G - 1) / N crosses NVLink, at the same time (the
           slower one counts); each pays its link's latency once.
    SPTT   global all-to-all over the towers (one per host): bags b F u forward, the towers'
           compressed outputs b H (K + 1) D e forward and their gradients backward; the
           share (H - 1) / H leaves the host. Inside the host (NVLink rings of G, core.
           hardware.ring_collective_s): all-gather of the group's bags (G b F u gathered),
           reduce-scatter of the partial sums (G b F D e) and, backward, the all-gather of
           their gradients (G b F D e).
    SPTT with the host's tables table-wise ("sptt_tw", the paper's in-host layout; this
           codebase's SPTT is row-wise inside the group): the same global exchange, inside the
           host all-to-alls over NVLink of the bags b F u and of the pooled values b F D e and
           their gradients, the share (G - 1) / G leaving each GPU.
  Compute: 3 x forward FLOPs per example (forward + backward) x b at the BF16 peak x
  Efficiency.gemm. Two overlap cases: none (compute + communication) and full
  (max(compute, communication)); the paper's gain comes from the communication, so the
  speedup is largest where the exchange dominates the step.
  """
  from core import hardware
  hw, eff = hw or hardware.Hardware(), eff or hardware.Efficiency()
  if hosts < 1 or local_batch < 1 or gpus_per_host < 1:
    raise ValueError(f"h100_step_model: hosts={hosts}, local_batch={local_batch}, "
                     f"gpus_per_host={gpus_per_host}; expected >= 1 each")
  net, nvl = eff.all2all_link(hw), eff.nvlink_link(hw)
  G, H, b, F, D = gpus_per_host, hosts, local_batch, num_features, dim
  N = G * H

  def a2a(per_gpu: float, n: int, off_host: float, on_host: float) -> float:
    """An all-to-all: each GPU sends `per_gpu` bytes to n peers (itself included)."""
    if per_gpu == 0 or n == 1:
      return 0.0
    t_net = net.time(per_gpu * off_host) if off_host > 0 else 0.0
    t_nvl = nvl.time(per_gpu * on_host) if on_host > 0 else 0.0
    return max(t_net, t_nvl)

  fm = -(-F // H)
  slots = ({"flat": N * -(-F // N), "sptt": H * fm, "sptt_tw": H * G * -(-fm // G)}
           if padded else {"flat": F, "sptt": F, "sptt_tw": F})
  bags = {k: b * n * bag_bytes for k, n in slots.items()}
  pooled = {k: b * n * D * value_bytes for k, n in slots.items()}
  flat = {"global_s": (a2a(bags["flat"], N, (N - G) / N, (G - 1) / N)
                       + 2 * a2a(pooled["flat"], N, (N - G) / N, (G - 1) / N)),
          "intra_s": 0.0}
  compressed = b * H * (tower_k + 1) * D * value_bytes
  sptt = {"global_s": (a2a(bags["sptt"], H, (H - 1) / H, 0.0)
                       + 2 * a2a(compressed, H, (H - 1) / H, 0.0)),
          "intra_s": (hardware.ring_collective_s("all_gather", G * bags["sptt"], G, nvl)
                      + hardware.ring_collective_s("reduce_scatter", G * pooled["sptt"], G, nvl)
                      + hardware.ring_collective_s("all_gather", G * pooled["sptt"], G, nvl))}
  # The same towers with the host's tables placed table-wise (modelled, not built here):
  # all-to-alls over NVLink of the bags and of the pooled values and their gradients.
  sptt_tw = {"global_s": sptt["global_s"],
             "intra_s": (a2a(bags["sptt_tw"], G, 0.0, (G - 1) / G)
                         + 2 * a2a(pooled["sptt_tw"], G, 0.0, (G - 1) / G))}
  rate = hw.bf16_flops * eff.gemm
  flat["compute_s"] = 3 * flops_flat * b / rate
  sptt["compute_s"] = sptt_tw["compute_s"] = 3 * flops_dmt * b / rate
  for m in (flat, sptt, sptt_tw):
    m["comm_s"] = m["global_s"] + m["intra_s"]
    m["step_serial_s"] = m["compute_s"] + m["comm_s"]
    m["step_overlap_s"] = max(m["compute_s"], m["comm_s"])
  out = {"hosts": H, "gpus": N, "local_batch": b, "slots": slots, "flat": flat, "sptt": sptt,
         "sptt_tw": sptt_tw}
  for name, m in (("", sptt), ("_tw", sptt_tw)):
    out[f"speedup_serial{name}"] = flat["step_serial_s"] / m["step_serial_s"]
    out[f"speedup_overlap{name}"] = flat["step_overlap_s"] / m["step_overlap_s"]
  return out


def measured_units(bag: int = 1) -> dict[str, Any]:
  """`hlo_unit_bytes`, compiled here when 8 devices exist, else in a subprocess with 8
  simulated CPU devices."""
  if jax.device_count() >= 8:
    return hlo_unit_bytes(bag=bag)
  import json
  import subprocess
  import sys
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip())
  code = ("import json; from experiments.dmt import study; "
          f"print(json.dumps(study.hlo_unit_bytes(bag={int(bag)})))")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=False)
  if out.returncode:
    raise RuntimeError(f"hlo_unit_bytes in a subprocess failed:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def h100_table(units: dict[str, Any], host_counts: Sequence[int], local_batch: int,
               dim: int, tower_k: int, num_features: int = 26, num_dense: int = 13,
               seed: int = 0) -> list[dict[str, Any]]:
  """`h100_step_model` per host count, one tower per host (a random equal-count partition
  of the features; FLOPs do not depend on which features), forward FLOPs per example of the
  study's flat DLRM and DMT models from XLA's cost analysis (core.flops); each row's
  "unpadded" holds the same model with padded=False."""
  from core import flops as flops_lib
  bottom, top = (64, dim), (64, 1)
  flat_cfg = DLRMConfig(num_dense=num_dense, num_sparse=num_features, embedding_dim=dim,
                        bottom_mlp=bottom, top_mlp=top, rows_per_feature=(8,) * num_features)
  shapes = (num_dense, num_features, dim)
  flops_flat = flops_lib.model_flops_per_example(lambda r: DLRM(flat_cfg, r), shapes)
  rows = []
  for h in host_counts:
    parts = towers_lib.random_partition(num_features, h, seed) if h > 1 else (
        tuple(range(num_features)),)
    cfg = DMTConfig(num_dense=num_dense, embedding_dim=dim, towers=parts, tower_k=tower_k,
                    bottom_mlp=bottom, top_mlp=top, rows_per_feature=8)
    flops_dmt = flops_lib.model_flops_per_example(lambda r, cfg=cfg: DMTModel(cfg, r), shapes)
    args = (units["bag_bytes"], units["value_bytes"], h, local_batch, num_features, dim,
            tower_k, flops_flat, flops_dmt)
    row = h100_step_model(*args)
    row.update(flops_flat=flops_flat, flops_dmt=flops_dmt,
               unpadded=h100_step_model(*args, padded=False))
    rows.append(row)
  return rows


def format_h100(rows) -> str:
  """Milliseconds per step of one GPU and the speedups flat / SPTT (rw in the group, as
  built) and flat / SPTT with table-wise hosts (tw, modelled); slots: the table slots the
  flat all-to-alls send (padding included, `h100_step_model`); "unpad": the serial
  speedups with no padding on either side (all-to-alls of per-peer sizes)."""
  lines = [f"{'hosts':>5}{'GPUs':>5}{'slots':>6}{'compute':>9}{'flat comm':>10}"
           f"{'SPTT global':>12}{'rw intra':>9}{'tw intra':>9}{'x rw':>7}{'x rw ovl':>9}"
           f"{'x tw':>7}{'x tw ovl':>9}{'x rw unpad':>11}{'x tw unpad':>11}   paper"]
  for r in rows:
    f, s, t, u = r["flat"], r["sptt"], r["sptt_tw"], r["unpadded"]
    lines.append(f"{r['hosts']:>5}{r['gpus']:>5}{r['slots']['flat']:>6}"
                 f"{1e3 * s['compute_s']:>9.3f}"
                 f"{1e3 * f['comm_s']:>10.3f}{1e3 * s['global_s']:>12.3f}"
                 f"{1e3 * s['intra_s']:>9.3f}{1e3 * t['intra_s']:>9.3f}"
                 f"{r['speedup_serial']:>7.2f}{r['speedup_overlap']:>9.2f}"
                 f"{r['speedup_serial_tw']:>7.2f}{r['speedup_overlap_tw']:>9.2f}"
                 f"{u['speedup_serial']:>11.2f}{u['speedup_serial_tw']:>11.2f}"
                 f"   up to {PAPER_SPEEDUP}x")
  return "\n".join(lines)


def plot_h100(rows, path: str) -> str:
  """Modelled speedup flat / SPTT per host count beside the paper's up to 1.9x."""
  from core import plot as plot_lib
  with plot_lib.figure(path, figsize=(6, 4)) as (fig, ax):
    x = [r["hosts"] for r in rows]
    ax.plot(x, [r["speedup_serial"] for r in rows], "o-", label="SPTT as built (rw in host)")
    ax.plot(x, [r["speedup_serial_tw"] for r in rows], "s-", label="SPTT, tw in host (modelled)")
    ax.plot(x, [r["unpadded"]["speedup_serial_tw"] for r in rows], "s--",
            label="SPTT, tw in host, no padding (modelled)")
    ax.axhline(PAPER_SPEEDUP, color="r", ls="--", lw=1, label=f"paper: up to {PAPER_SPEEDUP}x")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="hosts of 8 H100 (one tower per host)",
           ylabel="step time flat / DMT", title="DMT step model, H100 hosts")
    ax.set_xticks(x, [str(v) for v in x])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  return path


def run(towers: Sequence[int], tower_k: int, steps: int, batch_size: int, eval_batches: int,
        num_rows: int, dim: int, teacher: str, comm_batch: int, seed: int, workdir: str,
        log=print) -> dict[str, Any]:
  """The comparison on synthetic Criteo-shaped data (26 one-hot features): the flat DLRM,
  then per tower count T the similarity partition (of the flat model's learned pooled
  embeddings) and a random one. Returns {"rows", "similarity"}."""
  F, D, R = 26, dim, num_rows
  # An earlier run's models in `workdir` are refused before the first trains (one run per
  # workdir; the study does not resume).
  runs.check_fresh([os.path.join(workdir, "flat")] + [
      os.path.join(workdir, f"dmt_t{T}_{kind}") for T in towers
      for kind in ("similarity", "random")], resume_flag=False)
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
      vol = comm_volume(comm_batch, F, D, parts, tower_k)
      within = sum(sim[a, b] for t in parts for a in t for b in t if a != b) / max(
          1, sum(len(t) * (len(t) - 1) for t in parts))
      rows.append({"model": f"DMT T={T} ({kind})", "towers": parts, "auc": res["auc"],
                   "logloss": res["logloss"], "global_bytes": vol["sptt"]["global_total"],
                   "intra_group_bytes": vol["sptt"]["intra_group_embeddings"],
                   "global_reduction": vol["global_reduction"],
                   "within_tower_similarity": within, "train_seconds": res["train_seconds"]})
  return {"rows": rows, "similarity": sim.tolist()}


def format_table(rows) -> str:
  """Test AUC / log loss and the all-to-all bytes per step in MiB (2^20 bytes); inside the
  tower groups, the pooled partial sums reduce-scattered (comm_volume's
  intra_group_embeddings; the bags' all-gather, intra_group_ids, is not in the column)."""
  lines = [f"{'model':<26}{'AUC':>8}{'logloss':>9}{'global a2a MiB/step':>20}{'x less':>8}"
           f"{'intra pooled MiB':>17}"]
  for r in rows:
    lines.append(f"{r['model']:<26}{r['auc']:>8.4f}{r['logloss']:>9.4f}"
                 f"{r['global_bytes'] / 2**20:>20.1f}{r['global_reduction']:>8.2f}"
                 f"{r['intra_group_bytes'] / 2**20:>17.1f}")
  return "\n".join(lines)


def plot(rows, path: str) -> str:
  """Test AUC against the global all-to-all bytes per step, one point per model."""
  from core import plot as plot_lib
  with plot_lib.figure(path, figsize=(6.5, 4)) as (fig, ax):
    for r in rows:
      ax.scatter(r["global_bytes"] / 2**20, r["auc"], s=40)
      ax.annotate(r["model"], (r["global_bytes"] / 2**20, r["auc"]), fontsize=7)
    ax.set(xlabel="global all-to-all MiB per step (forward)", ylabel="test AUC",
           title="DMT vs flat DLRM")
    ax.grid(alpha=0.3)
  return path
