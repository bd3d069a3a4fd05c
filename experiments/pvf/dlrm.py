"""PVF of a DLRM per parameter group (arXiv 2405.01741): bit flips in the embedding tables,
each bottom-MLP layer, the interaction and each top-MLP layer, run through the real modules.

    target = dlrm_target(model_cfg, params, tables, eval_batches)
    rows = dlrm_pvf(target, fmt="bf16", fault=FaultModel.parse("single"),
                    criterion=faults.threshold_criterion(0.5), trials=2000, key=key)

Groups (`dlrm_groups`): `emb` (every table's values, one group: a fault lands on a uniform
value of all tables), `emb_read` (a uniform value of the rows the example's bag slots
read: PVF given that the faulty row is looked up; "values" is then F * L * D per
example), `bottom_mlp` / `top_mlp` (a uniform value of every layer's kernel and bias: the
paper's bottom / top MLP components), `bottom_mlp.<i>` / `top_mlp.<i>` (layer i), and
`interaction`, which has no parameters: its group is the interaction's output vector
[dense, pairwise dots] of the example (an activation fault, reported beside the parameter
groups for comparison). The output is the click probability sigmoid(logit) of one example.

How a fault reaches the output: every trial runs the `DLRM` module itself, `nnx.merge` of
its graph definition with the (faulted) parameters, on pooled embeddings from the
embedding collection's own lookup (`EmbeddingCollection.lookup`: coefficients from
weights, lengths and the table's pooling, bag sums). An MLP fault copies the
group's kernels and biases per trial with one element flipped (vmapped: N copies). The
tables are far too big to copy per trial, so the lookup reads a compact table per
example: for each feature one zero row (which the collection's padding slots read) and
then the stored rows its bag slots read, in order, with the faulty value flipped wherever
the example reads that row; a fault in a row the example does not read changes nothing,
which is why embedding PVF is small. The interaction fault sits at the top MLP's input
(`_InputFault` wraps the module's `top_mlp`), which is exactly the interaction's output.
Values are flipped in the format they are stored in (`core.faults`: fp32, bf16 or
symmetric row-wise int8 codes), and the fault-free reference runs the same format.

Letters: X examples, F sparse features, L ids per bag, D embedding dim, R rows of all
tables stacked, I interaction outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import faults
from core import mesh as mesh_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import ShardingKind
from rec.embedding.storage_spec import StorageSpec
from rec.models.dlrm import DLRM


@dataclasses.dataclass
class DLRMTarget:
  """A trained DLRM: the module's graph definition and parameters, its full tables and
  the eval examples."""

  config: Any                     # rec.models.dlrm.DLRMConfig
  graphdef: Any                   # nnx graph definition of DLRM(config)
  params: dict[str, Any]          # the module's parameters (pure dict, float32 numpy)
  tables_RD: np.ndarray           # every table stacked in feature order
  row_offset_F: np.ndarray        # first row of feature f's table in tables_RD
  dense_XD: np.ndarray
  ids_XFL: np.ndarray             # local row ids (padding slots: 0)
  lengths_XF: np.ndarray
  weights_XFL: np.ndarray         # per-id weights (ones when the data has none)

  @property
  def num_examples(self) -> int:
    return len(self.dense_XD)


def dlrm_target(config, params: dict[str, Any], tables: dict[str, np.ndarray],
                batches: Sequence[Any], max_examples: int | None = None) -> DLRMTarget:
  """Stacks the tables (DLRM: one table per feature, all of dim D) and the examples of
  `batches` (SparseBatch; mask-0 padding rows dropped), at most max_examples of them."""
  names = list(config.feature_names)
  missing = [n for n in names if n not in tables]
  if missing:
    raise ValueError(f"dlrm_target: no table for features {missing}")
  stacked = np.concatenate([np.asarray(tables[n], np.float32) for n in names])
  offs = np.concatenate([[0], np.cumsum([tables[n].shape[0] for n in names])[:-1]])
  dense, ids, lengths, weights = [], [], [], []
  for b in batches:
    keep = np.asarray(b.mask) > 0
    L = b.ids.shape[2]
    live = np.arange(L)[None, None, :] < np.asarray(b.lengths)[:, :, None]
    w = np.ones(b.ids.shape, np.float32) if b.weights is None else np.asarray(b.weights)
    dense.append(np.asarray(b.dense, np.float32)[keep])
    ids.append(np.where(live, np.asarray(b.ids), 0)[keep])
    lengths.append(np.asarray(b.lengths)[keep])
    weights.append(np.asarray(w, np.float32)[keep])
  dense, ids, lengths, weights = (np.concatenate(x)[:max_examples]
                                  for x in (dense, ids, lengths, weights))
  graphdef = nnx.split(nnx.eval_shape(lambda: DLRM(config, nnx.Rngs(0))))[0]
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), params)
  return DLRMTarget(config, graphdef, params, stacked, offs.astype(np.int32), dense,
                    ids.astype(np.int32), lengths.astype(np.int32), weights)


def dlrm_groups(config) -> list[str]:
  """emb, emb_read, bottom_mlp, bottom_mlp.<i>..., interaction, top_mlp, top_mlp.<i>...
  (forward order; `bottom_mlp` / `top_mlp`: every layer of the component, the paper's
  parameter components)."""
  return (["emb", "emb_read", "bottom_mlp"]
          + [f"bottom_mlp.{i}" for i in range(len(config.bottom_mlp))]
          + ["interaction", "top_mlp"] + [f"top_mlp.{i}" for i in range(len(config.top_mlp))])


class _InputFault:
  """Runs `inner` on `fault(x)`: a fault at a submodule's input, i.e. in the activation
  the module before it produced."""

  def __init__(self, inner, fault):
    self.inner, self.fault = inner, fault

  def __call__(self, x):
    return self.inner(self.fault(x))


class _ExampleLookup:
  """The collection's lookup of one example over compact tables: per feature a zero row,
  then the L rows its bag slots read (module docstring), on a one-device collection."""

  def __init__(self, config, L: int):
    tables = [dataclasses.replace(t, num_rows=1 + L, storage=StorageSpec("fp32"))
              for t in config.tables()]
    mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1], rules=mesh_lib.REC_RULES)
    plan = planner_lib.uniform_plan(tables, ShardingKind.DATA_PARALLEL, 1)
    self.coll = EmbeddingCollection(tables, plan, mesh, opt_lib.get_sparse_optimizer("sgd", 1.0))
    feature = {t.name: f for f, t in enumerate(tables)}
    # Slot l of a bag reads compact row l + 1.
    self.ids_FL = np.broadcast_to(np.arange(1, L + 1, dtype=np.int32), (len(tables), L))
    # Per group, the row of the flat [F * (1 + L), D] compact rows each buffer row holds
    # (dp blocks: whole tables, full width); None where that is every row in order.
    self.src = {}
    for name in self.coll.groups:
      blocks = self.coll.blocks(name)
      src = np.zeros(max(row + r1 - r0 for _, r0, r1, _, _, row in blocks), np.int64)
      for table, r0, r1, c0, c1, row in blocks:
        assert (c0, c1) == (0, config.embedding_dim), (table, c0, c1)
        src[row:row + r1 - r0] = feature[table] * (1 + L) + np.arange(r0, r1)
      self.src[name] = None if np.array_equal(src, np.arange(len(tables) * (1 + L))) else src

  def __call__(self, rows_FLD, lengths_F, weights_FL):
    """Pooled embeddings [F, D] of one example whose slots read `rows_FLD`."""
    full = jnp.concatenate([jnp.zeros_like(rows_FLD[:, :1]), rows_FLD], axis=1)
    flat = full.reshape(-1, full.shape[-1])
    state = {}
    for name, g in self.coll.groups.items():
      buf = flat if self.src[name] is None else flat[self.src[name]]
      state[name] = {"table": self.coll.storage(g).from_float(buf)}
    return self.coll.lookup(state, self.ids_FL[None], lengths_F[None], weights_FL[None])[0]


def _is_enc(a) -> bool:
  return isinstance(a, dict) and "v" in a


def _forward(graphdef, params, dense_D, emb_FD, fault=None):
  """Click probability of one example: the DLRM module on `params` (pure dict, float32);
  `fault` (if any) corrupts the top MLP's input, the interaction's output."""
  model = nnx.merge(graphdef, params)
  if fault is not None:
    model.top_mlp = _InputFault(model.top_mlp, fault)
  dense = dense_D[None] if model.config.num_dense > 0 else None
  return jax.nn.sigmoid(model(dense, emb_FD[None]))[0]


def _data(target: DLRMTarget, fmt: str) -> dict[str, Any]:
  """The arrays every trial reads, the parameters and tables stored in `fmt`."""
  return {"params": jax.tree.map(lambda a: faults.encode(a, fmt), target.params),
          "emb": faults.encode(target.tables_RD, fmt), "dense": target.dense_XD,
          "ids": target.ids_XFL, "lengths": target.lengths_XF, "weights": target.weights_XFL,
          "offset": target.row_offset_F}


def _emb_faulty(target: DLRMTarget, lookup: _ExampleLookup, group: str):
  """faulty(data, elem, mask, x) of the embedding groups."""
  D = target.tables_RD.shape[1]

  def faulty(d, elem, mask, x):
    params = jax.tree.map(faults.decode, d["params"], is_leaf=_is_enc)
    gid_FL = d["ids"][x] + d["offset"][:, None]
    if group == "emb":
      r, c = elem // D, elem % D
    else:   # a value of a row the example's bag slot (f, l) reads
      r, c = gid_FL.reshape(-1)[elem // D], elem % D
    enc = {k: v[gid_FL] for k, v in d["emb"].items()}          # stored rows, [F, L, D]
    hit = (gid_FL == r)[..., None] & (jnp.arange(D) == c)
    enc["v"] = jnp.where(hit, faults.flip_bits(enc["v"], mask), enc["v"])
    emb_FD = lookup(faults.decode(enc), d["lengths"][x], d["weights"][x])
    return _forward(target.graphdef, params, d["dense"][x], emb_FD)
  return faulty


def clean_embeddings(target: DLRMTarget, fmt: str,
                     lookup: _ExampleLookup | None = None) -> jax.Array:
  """Pooled embeddings [X, F, D] of every example from the tables stored in `fmt`, through
  the collection's lookup (what the non-embedding groups' trials read)."""
  lookup = lookup or _ExampleLookup(target.config, target.ids_XFL.shape[2])
  emb = faults.encode(target.tables_RD, fmt)

  @jax.jit
  def pooled(emb, ids, offset, lengths, weights):
    def one(ids_FL, lengths_F, weights_FL):
      gid_FL = ids_FL + offset[:, None]
      return lookup(faults.decode({k: v[gid_FL] for k, v in emb.items()}), lengths_F,
                    weights_FL)
    return jax.vmap(one)(ids, lengths, weights)
  return pooled(emb, target.ids_XFL, target.row_offset_F, target.lengths_XF,
                target.weights_XFL)


def _group_faulty(target: DLRMTarget, group: str, fmt: str, lookup=None, clean=None):
  """(faulty(data, elem, mask, x), data, size) for one group with values stored in fmt;
  `lookup` (an _ExampleLookup) and `clean` (clean_embeddings) are built when not given."""
  cfg = target.config
  data = _data(target, fmt)
  F, L = target.ids_XFL.shape[1:]
  lookup = lookup or _ExampleLookup(cfg, L)
  if group in ("emb", "emb_read"):
    size = target.tables_RD.size if group == "emb" else F * L * target.tables_RD.shape[1]
    return _emb_faulty(target, lookup, group), data, int(size)

  data = {"params": data["params"], "dense": data["dense"],
          "emb": clean_embeddings(target, fmt, lookup) if clean is None else clean}
  if group == "interaction":
    def faulty(d, elem, mask, x):
      params = jax.tree.map(faults.decode, d["params"], is_leaf=_is_enc)

      def fault(h_1I):
        e = faults.encode(h_1I[0], fmt)
        e["v"] = faults.flip_element(e["v"], elem, mask)
        return faults.decode(e)[None]
      return _forward(target.graphdef, params, d["dense"][x], d["emb"][x], fault)
    return faulty, data, int(cfg.interaction_dim)

  mod, dot, idx = group.partition(".")
  layers = target.params.get(mod, {}).get("layers", {}) if mod in ("bottom_mlp", "top_mlp") else {}
  if not layers or (dot and not (idx.isdigit() and int(idx) in layers)):
    raise ValueError(f"PVF group {group!r}: expected one of {dlrm_groups(cfg)}")
  # The group's arrays in order: kernel and bias of layer idx, or of every layer.
  slots = [(i, k) for i in ([int(idx)] if idx else sorted(layers)) for k in ("kernel", "bias")]

  def faulty(d, elem, mask, x):
    old = d["params"][mod]["layers"]
    new = faults.flip_in_group([old[i][k] for i, k in slots], elem, mask)
    layers = {i: dict(v) for i, v in old.items()}
    for (i, k), v in zip(slots, new):
      layers[i][k] = v
    enc = {**d["params"], mod: {"layers": layers}}
    params = jax.tree.map(faults.decode, enc, is_leaf=_is_enc)
    return _forward(target.graphdef, params, d["dense"][x], d["emb"][x])
  return faulty, data, int(sum(np.size(layers[i][k]) for i, k in slots))


def dlrm_probabilities(target: DLRMTarget, fmt: str = "fp32") -> np.ndarray:
  """Fault-free probabilities [X] of the trials' forward (values stored in `fmt`)."""
  faulty, data, _ = _group_faulty(target, "emb", fmt)
  n = target.num_examples
  run = jax.jit(jax.vmap(faulty, in_axes=(None, 0, 0, 0)))
  return np.asarray(run(data, jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.uint32),
                        jnp.arange(n, dtype=jnp.int32)))


def dlrm_pvf(target: DLRMTarget, fmt: str,
             fault: faults.FaultModel | Sequence[faults.FaultModel], criterion,
             trials: int, key: jax.Array, groups: Sequence[str] | None = None,
             chunk: int = 256, record: bool = False) -> list[dict[str, Any]]:
  """One row per group (and fault model, when several are given; each group's trials
  compile once for all of them): {group, values, fmt, fault, trials, changed, nonfinite,
  pvf, ci_low, ci_high} (+ the trials themselves with `record`, see `faults.estimate`)."""
  fault_list = [fault] if isinstance(fault, faults.FaultModel) else list(fault)
  rows = []
  groups = groups or dlrm_groups(target.config)
  lookup = _ExampleLookup(target.config, target.ids_XFL.shape[2])
  clean = (clean_embeddings(target, fmt, lookup)
           if any(g not in ("emb", "emb_read") for g in groups) else None)
  for gi, group in enumerate(groups):
    faulty, data, size = _group_faulty(target, group, fmt, lookup, clean)
    for fi, f in enumerate(fault_list):
      k = jax.random.fold_in(key, gi)
      res = faults.estimate(faulty, data, size, target.num_examples, faults.bit_width(fmt),
                            f, criterion, trials, k if fi == 0 else jax.random.fold_in(k, fi),
                            chunk, record=record)
      rows.append({"group": group, "values": size, "fmt": fmt, "fault": f.label, **res})
  return rows


def dlrm_exact(target: DLRMTarget, fmt: str, group: str, criterion,
               bits: Sequence[int] | None = None, chunk: int = 256) -> dict[str, Any]:
  """The exact single-bit PVF of one group (`faults.exhaustive`: every value, bit in
  `bits` (default all) and example once) and each fault's verdict ("changed_VBX")."""
  faulty, data, size = _group_faulty(target, group, fmt)
  res = faults.exhaustive(faulty, data, size, target.num_examples, faults.bit_width(fmt),
                          criterion, None if bits is None else tuple(bits), chunk)
  return {"group": group, "values": size, "fmt": fmt, "fault": "single (every bit)", **res}
