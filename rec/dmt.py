"""Disaggregated Multi-Tower (DMT, arXiv 2403.00877): features split into towers, each
tower's interactions compressed by a tower module before the global interaction, and the
semantic-preserving tower transform (SPTT) that keeps each tower's lookups inside one
device group.

Pieces:
  feature_similarity(emb_XFD)       |cos| of pooled embeddings per feature pair, averaged
                                    over examples (how strongly two features interact in
                                    the dot interaction of a trained flat model)
  partition(sim, costs, T)          towers of balanced cost (rows x dim) that group similar
                                    features: greedy, most costly feature first, each into
                                    the tower it is most similar to among those with room
  DMTModel                          bottom MLP; per tower a module [B, F_t, D] -> [B, K, D]
                                    (a learned linear compression over the tower's
                                    features, + one vector from the tower's own pairwise
                                    dot products through a linear layer); global dot
                                    interaction of [dense, all towers' K + 1 vectors];
                                    top MLP
  SPTT (sptt_lookup)                a mesh ("tower": T, "local": G): tower t's tables live
                                    row-wise on the G devices of group t. Per step:
                                    (1) ids to their tower's group: all-to-all over "tower"
                                    (ids only, global); (2) inside the group: ids
                                    all-gathered over "local", each device sums its rows,
                                    partial sums reduce-scattered over "local" (the heavy
                                    embedding traffic stays in the group: NVLink / one host);
                                    (3) the tower module runs where the tower's embeddings
                                    are; (4) the compressed [B, K, D] per tower goes back to
                                    the data-parallel layout: all-to-all over "tower".
  collective_bytes(hlo_text)        bytes per device of each collective in a compiled
                                    program, by mesh axes (checks comm_volume's accounting
                                    against what XLA emits for SPTT, tests/rec/test_dmt.py)
  comm_volume(...)                  per-step bytes of each all-to-all / collective for the
                                    flat model (table-wise: pooled [B, F, D] all-to-all)
                                    and for SPTT (global: ids + compressed [B, T (K + 1), D];
                                    intra-group: [B, F, D] reduce-scatter)

SPTT changes where work runs, not what is computed: `sptt_lookup` with the identity
module equals the global lookup (tests/rec/test_dmt.py on 8 devices).

Letters: B batch (B_l per device, B_g global), T towers, G devices per tower group,
F features (F_t per tower, padded to Fm), L ids per bag, R rows (per tower, padded to Rm),
D embedding dim, K compressed vectors per tower, X examples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rec.layers.interaction import dot_interaction, num_dot_outputs
from rec.layers.mlp import MLP


# ------------------------------------------------------------------ partitioner

def feature_similarity(emb_XFD: np.ndarray) -> np.ndarray:
  """[F, F] mean over examples of |cos(e_i, e_j)| of pooled embeddings (diagonal 1)."""
  e = np.asarray(emb_XFD, np.float64)
  e = e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
  return np.abs(np.einsum("xfd,xgd->xfg", e, e)).mean(0)


def partition(sim: np.ndarray, costs: Sequence[float], num_towers: int,
              slack: float = 0.1) -> list[list[int]]:
  """Features -> towers: cost per tower at most (1 + slack) x the mean (or the one feature
  that alone exceeds it), features grouped by similarity. Deterministic."""
  F = len(costs)
  if not 1 <= num_towers <= F:
    raise ValueError(f"partition: num_towers={num_towers} for {F} features; expected 1..{F}")
  costs = np.asarray(costs, np.float64)
  cap = (1 + slack) * costs.sum() / num_towers
  max_feats = -(-F // num_towers)
  towers: list[list[int]] = [[] for _ in range(num_towers)]
  load = np.zeros(num_towers)
  # An empty tower scores the mean similarity: a feature joins a tower only when it is
  # more similar to it than to features on average.
  off = ~np.eye(F, dtype=bool)
  empty = float(np.asarray(sim)[off].mean()) if F > 1 else 0.0
  for f in sorted(range(F), key=lambda f: (-costs[f], f)):
    def score(t):
      return sim[f, towers[t]].mean() if towers[t] else empty
    room = [t for t in range(num_towers)
            if len(towers[t]) < max_feats and (load[t] + costs[f] <= cap or not towers[t])]
    if not room:
      room = [int(np.argmin(load))]
    t = max(room, key=lambda t: (score(t), -load[t], -t))
    towers[t].append(f)
    load[t] += costs[f]
  return [sorted(t) for t in towers]


def random_partition(num_features: int, num_towers: int, seed: int = 0) -> list[list[int]]:
  """Equal-count towers of a random permutation (the baseline partition)."""
  perm = np.random.default_rng(seed).permutation(num_features)
  return [sorted(perm[t::num_towers].tolist()) for t in range(num_towers)]


# ------------------------------------------------------------------ model

@dataclasses.dataclass(frozen=True)
class DMTConfig:
  """A DLRM whose features are split into towers, each compressed to K + 1 vectors."""

  num_dense: int
  embedding_dim: int
  towers: tuple[tuple[int, ...], ...]      # feature indices per tower
  tower_k: int = 2                         # compressed vectors per tower (+ 1 local-dot vector)
  bottom_mlp: tuple[int, ...] = (64, 16)
  top_mlp: tuple[int, ...] = (64, 1)

  def __post_init__(self):
    object.__setattr__(self, "towers", tuple(tuple(int(f) for f in t) for t in self.towers))
    flat = sorted(f for t in self.towers for f in t)
    if flat != list(range(len(flat))) or any(not t for t in self.towers):
      raise ValueError(f"DMTConfig: towers={self.towers} must split 0..F-1, none empty")
    if self.bottom_mlp[-1] != self.embedding_dim:
      raise ValueError(f"DMTConfig: bottom_mlp={self.bottom_mlp} must end at "
                       f"embedding_dim={self.embedding_dim}")

  @property
  def num_sparse(self) -> int:
    return sum(len(t) for t in self.towers)


class TowerModule(nnx.Module):
  """[B, F_t, D] -> [B, K + 1, D]: K learned mixtures of the tower's embeddings and one
  projection of the tower's pairwise dot products."""

  def __init__(self, num_features: int, dim: int, k: int, rngs: nnx.Rngs):
    init = nnx.initializers.normal(1.0 / np.sqrt(num_features))
    self.mix = nnx.Param(init(rngs.params(), (num_features, k)))
    p = num_dot_outputs(num_features, self_interaction=num_features == 1)
    self.self_interaction = num_features == 1
    self.local = nnx.Linear(p, dim, rngs=rngs)

  def __call__(self, emb_BFD):
    mixed_BKD = jnp.einsum("bfd,fk->bkd", emb_BFD, self.mix[...])
    dots_BP = dot_interaction(None, emb_BFD, self.self_interaction)
    return jnp.concatenate([mixed_BKD, self.local(dots_BP)[:, None]], axis=1)


class DMTModel(nnx.Module):
  """Bottom MLP, tower modules, global dot interaction, top MLP -> logit [B]."""

  def __init__(self, config: DMTConfig, rngs: nnx.Rngs):
    self.config = config
    D = config.embedding_dim
    self.bottom_mlp = MLP(config.num_dense, config.bottom_mlp, rngs, activate_last=True)
    self.towers = nnx.List([TowerModule(len(t), D, config.tower_k, rngs) for t in config.towers])
    n = 1 + len(config.towers) * (config.tower_k + 1)
    self.top_mlp = MLP(D + num_dot_outputs(n), config.top_mlp, rngs, activate_last=False)

  def tower_outputs(self, emb_BFD):
    """[B, T (K + 1), D]: each tower module on its features (global layout)."""
    return jnp.concatenate([m(emb_BFD[:, np.asarray(t)]) for m, t in
                            zip(self.towers, self.config.towers)], axis=1)

  def head(self, dense_BD, towers_BND):
    x_BD = self.bottom_mlp(dense_BD)
    return self.top_mlp(dot_interaction(x_BD, towers_BND))[:, 0]

  def __call__(self, dense_BD, emb_BFD):
    return self.head(dense_BD, self.tower_outputs(emb_BFD))


# ------------------------------------------------------------------ SPTT

@dataclasses.dataclass
class SPTTLayout:
  """Static layout: per tower its features (padded to Fm with -1), tables padded to Rm."""

  towers: tuple[tuple[int, ...], ...]
  feat_TF: np.ndarray          # [T, Fm] feature index, -1 = padding
  rows_per_feature: tuple[int, ...]
  Rm: int
  G: int

  @classmethod
  def build(cls, towers, rows_per_feature, group_size: int) -> SPTTLayout:
    Fm = max(len(t) for t in towers)
    feat = np.full((len(towers), Fm), -1, np.int32)
    for i, t in enumerate(towers):
      feat[i, :len(t)] = t
    Rm = max(rows_per_feature)
    Rm = -(-Rm // group_size) * group_size
    return cls(tuple(tuple(t) for t in towers), feat, tuple(rows_per_feature), Rm, group_size)

  def stack_tables(self, tables: Sequence[np.ndarray]) -> np.ndarray:
    """[T, Fm, Rm, D] from per-feature tables (padding rows / features zero)."""
    D = np.shape(tables[0])[1]
    out = np.zeros(self.feat_TF.shape + (self.Rm, D), np.float32)
    for t, row in enumerate(self.feat_TF):
      for j, f in enumerate(row):
        if f >= 0:
          out[t, j, :self.rows_per_feature[f]] = np.asarray(tables[f])
    return out

  def tower_ids(self, ids_BFL, lengths_BF):
    """ids [B, T, Fm, L] and lengths [B, T, Fm] per tower slot (padding: empty bags)."""
    f = np.maximum(self.feat_TF, 0)
    live = self.feat_TF >= 0
    ids = jnp.asarray(ids_BFL)[:, f]
    lengths = jnp.where(live[None], jnp.asarray(lengths_BF)[:, f], 0)
    return ids, lengths


def sptt_mesh(num_towers: int, devices=None):
  """Mesh ("tower": T, "local": N / T) over the devices."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  if devices.size % num_towers:
    raise ValueError(f"sptt_mesh: {devices.size} devices do not split into {num_towers} towers")
  return jax.sharding.Mesh(devices.reshape(num_towers, -1), ("tower", "local"))


def sptt_lookup(mesh, layout: SPTTLayout, tables_TFRD, ids_BFL, lengths_BF, module_fn=None,
                module_params=None):
  """SPTT forward: per-tower pooled embeddings computed inside each tower's device group,
  passed through module_fn(params_t, emb [b, Fm, D]) -> [b, K, D] there, and returned to
  the data-parallel layout: [B, T, K, D] (module_fn None: the embeddings, K = Fm).

  tables_TFRD sharded P("tower", None, "local", None) (row-wise inside the group), the
  batch over ("tower", "local"); module_params: a pytree with a leading T axis.
  """
  ids, lengths = layout.tower_ids(ids_BFL, lengths_BF)
  T, G = mesh.shape["tower"], mesh.shape["local"]
  Rl = layout.Rm // G
  bspec = P(("tower", "local"))
  fn = module_fn or (lambda p, e: e)
  params = module_params if module_params is not None else jnp.zeros((T,))

  def local(tbl, ids, lengths, params):
    # tbl [1, Fm, Rl, D]; ids [B_l, T, Fm, L]; lengths [B_l, T, Fm]; params [1, ...]
    Bl = ids.shape[0]
    # (1) ids to their tower's group (global all-to-all over "tower", ids only)
    ids_t = jax.lax.all_to_all(ids, "tower", 1, 0, tiled=True)[:, 0]        # [T*B_l, Fm, L]
    len_t = jax.lax.all_to_all(lengths, "tower", 1, 0, tiled=True)[:, 0]    # [T*B_l, Fm]
    # (2) inside the group: row-wise lookup
    ids_g = jax.lax.all_gather(ids_t, "local", axis=0, tiled=True)          # [G*T*B_l, Fm, L]
    len_g = jax.lax.all_gather(len_t, "local", axis=0, tiled=True)
    g = jax.lax.axis_index("local")
    L = ids_g.shape[-1]
    live = jnp.arange(L) < len_g[..., None]
    local_row = ids_g - g * Rl
    mine = live & (local_row >= 0) & (local_row < Rl)
    rows = tbl[0][jnp.arange(tbl.shape[1])[None, :, None], jnp.clip(local_row, 0, Rl - 1)]
    partial = jnp.einsum("bfl,bfld->bfd", mine.astype(tbl.dtype), rows)     # [G*T*B_l, Fm, D]
    emb = jax.lax.psum_scatter(partial, "local", scatter_dimension=0, tiled=True)  # [T*B_l, ...]
    # (3) the tower module where the tower's embeddings are
    out = fn(jax.tree.map(lambda p: p[0], params), emb)                     # [T*B_l, K, D]
    # (4) compressed outputs back to the data-parallel layout (global all-to-all)
    back = jax.lax.all_to_all(out.reshape((T, Bl) + out.shape[1:]), "tower", 0, 0, tiled=True)
    return jnp.swapaxes(back.reshape((T, Bl) + out.shape[1:]), 0, 1)       # [B_l, T, K, D]

  pspec = jax.tree.map(lambda _: P("tower"), params)
  f = jax.shard_map(local, mesh=mesh,
                    in_specs=(P("tower", None, "local", None), bspec, bspec, pspec),
                    out_specs=bspec, check_vma=False)
  return f(tables_TFRD, ids, lengths, params)


def place_tables(mesh, tables_TFRD):
  return jax.device_put(tables_TFRD, NamedSharding(mesh, P("tower", None, "local", None)))


def comm_volume(batch: int, num_features: int, dim: int, towers: int, tower_k: int,
                bag: int = 1, bytes_per_value: int = 4, id_bytes: int = 4) -> dict[str, float]:
  """Bytes per step (forward; the backward sends the same again) leaving a device summed
  over devices, all-to-all-style (a device's own share counted too: an upper bound that is
  the same for both models).

  flat (table-wise, global): ids [B, F, L] all-to-all + pooled [B, F, D] all-to-all.
  SPTT: global: ids [B, F, L] + compressed [B, T (K + 1), D]; intra-group: ids
  all-gather (G x) and pooled partials reduce-scatter [B, F, D] (G x), over the fast
  links of the group.
  """
  ids = batch * num_features * bag * id_bytes
  flat = {"global_ids": ids, "global_embeddings": batch * num_features * dim * bytes_per_value}
  sptt = {"global_ids": ids,
          "global_embeddings": batch * towers * (tower_k + 1) * dim * bytes_per_value,
          "intra_group_embeddings": batch * num_features * dim * bytes_per_value}
  flat["global_total"] = flat["global_ids"] + flat["global_embeddings"]
  sptt["global_total"] = sptt["global_ids"] + sptt["global_embeddings"]
  return {"flat": flat, "sptt": sptt,
          "global_reduction": flat["global_total"] / sptt["global_total"]}


# ------------------------------------------------------------------ quality study

def train_eval(model: nnx.Module, source, eval_source, steps: int, eval_batches: int,
               num_rows: int, dim: int, seed: int = 0, lr: float = 0.05,
               log=None) -> dict[str, Any]:
  """Trains `model(dense, emb_BFD)` and full tables [F, R, D] (one-hot features, dense
  Adagrad: small tables) on `source`; returns test AUC / log loss, the tables and time."""
  import time

  import optax

  from rec import metrics as metrics_lib

  F = source.spec.rows_per_feature.__len__()
  s = np.sqrt(1.0 / num_rows)
  tables = jax.random.uniform(jax.random.key(seed + 1), (F, num_rows, dim), jnp.float32, -s, s)
  graphdef, params = nnx.split(model)
  params = {"tables": tables, "model": nnx.to_pure_dict(params)}
  tx = optax.adagrad(lr)
  opt = tx.init(params)
  fidx = jnp.arange(F)[None, :]

  def logits_fn(p, dense, ids):
    st = nnx.state(nnx.merge(graphdef, nnx.split(model)[1]))
    nnx.replace_by_pure_dict(st, p["model"])
    m = nnx.merge(graphdef, st)
    return m(dense, p["tables"][fidx, ids[:, :, 0]])

  @jax.jit
  def step(params, opt, dense, ids, labels):
    def loss(p):
      return optax.sigmoid_binary_cross_entropy(logits_fn(p, dense, ids), labels).mean()
    l, g = jax.value_and_grad(loss)(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, l

  t0 = time.perf_counter()
  for k, b in zip(range(steps), source.batches(0)):
    params, opt, l = step(params, opt, b.dense, b.ids, b.labels)
    if log and (k + 1) % max(1, steps // 4) == 0:
      log(f"  step {k + 1}/{steps} loss {float(l):.4f}")
  jax.block_until_ready(params)
  train_s = time.perf_counter() - t0
  ev = jax.jit(logits_fn)
  logits, labels = [], []
  for _, b in zip(range(eval_batches), eval_source.batches(0)):
    logits.append(ev(params, b.dense, b.ids))
    labels.append(b.labels)
  m = metrics_lib.device_metrics(jnp.concatenate(logits), np.concatenate(labels))
  emb = np.asarray(params["tables"][fidx, b.ids[:, :, 0]])
  return {"auc": m["auc"], "logloss": m["logloss"], "train_seconds": train_s,
          "tables": params["tables"], "eval_emb": emb}


_HLO_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "f64": 8,
              "s64": 8, "pred": 1}


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes per device of each collective kind in a compiled (per-device) HLO module, by the
  mesh axes it runs over: {"all-to-all {'tower'}": n, ...}; an op's result shapes (all
  tuple elements) are counted, so all-to-all counts what a device receives."""
  import re
  out: dict[str, int] = {}
  pat = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-to-all|all-gather|reduce-scatter|all-reduce)\(")
  for line in hlo_text.splitlines():
    m = pat.search(line)
    if not m:
      continue
    size = 0
    for dt, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)):
      n = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
      size += n * _HLO_BYTES.get(dt, 4)
    axes = re.search(r"\{'[^}]*\}", line[m.end():])
    key = f"{m.group(2)} {axes.group(0) if axes else ''}".strip()
    out[key] = out.get(key, 0) + size
  return out
