"""PVF of a DLRM per parameter group (arXiv 2405.01741): bit flips in embedding tables,
each bottom-MLP layer, the interaction and each top-MLP layer.

    target = dlrm_target(model_cfg, params, tables, eval_batches)      # numpy / device
    rows = dlrm_pvf(target, fmt="bf16", fault=FaultModel.parse("single"),
                    criterion=faults.threshold_criterion(0.5), trials=2000, key=key)

Groups (`dlrm_groups`): `emb` (every table's values, one group: a fault lands on a uniform
value of all tables), `emb_read` (a uniform value of the rows the example's bag slots
read: PVF given that the faulty row is looked up; "values" is then F * L * D per
example), `bottom_mlp.<i>` / `top_mlp.<i>` (kernel and bias of layer i), and
`interaction`, which has no parameters: its group is the interaction's output vector
[dense, pairwise dots] of the example (an activation fault, reported beside the parameter
groups for comparison). The output is the click probability sigmoid(logit) of one example.

The forward pass here is DLRM's (rec/models/dlrm.py: ReLU bottom MLP, `dot_interaction`,
top MLP to a logit) on one example with float32 compute, written over the pure parameter
dict so a trial can corrupt one value: an MLP group is copied per trial with one element
flipped (vmapped: N copies of one layer); an embedding fault touches one row, so a trial
rebuilds only the example's bags, replacing the faulty row's value where the example looks
it up (`tests/rec/test_pvf.py` checks this forward against the DLRM module). A fault in a
row the example does not read changes nothing, which is why embedding PVF is small;
padding slots (coefficient 0) read no row, so a NaN planted in a row cannot leak through
0 * NaN where the example does not look that row up.

Letters: X examples, F sparse features, L ids per bag, D embedding dim, R rows of all
tables stacked.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from core import faults
from rec.layers.interaction import dot_interaction


@dataclasses.dataclass
class DLRMTarget:
  """A trained DLRM's dense params (pure dict), full tables and eval examples."""

  config: Any                     # rec.models.dlrm.DLRMConfig
  params: dict[str, Any]
  tables_RD: np.ndarray           # every table stacked in feature order
  row_offset_F: np.ndarray        # first row of feature f's table in tables_RD
  dense_XD: np.ndarray
  ids_XFL: np.ndarray             # local row ids (padding: any id, coefficient 0)
  coef_XFL: np.ndarray            # pooling coefficients (weight * valid / len for mean)


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
  dense, ids, coef = [], [], []
  for b in batches:
    keep = np.asarray(b.mask) > 0
    L = b.ids.shape[2]
    live = np.arange(L)[None, None, :] < np.asarray(b.lengths)[:, :, None]
    w = np.ones(b.ids.shape, np.float32) if b.weights is None else np.asarray(b.weights)
    dense.append(np.asarray(b.dense, np.float32)[keep])
    ids.append(np.where(live, np.asarray(b.ids), 0)[keep])
    coef.append(np.where(live, w, 0.0).astype(np.float32)[keep])
  dense, ids, coef = (np.concatenate(x) for x in (dense, ids, coef))
  if max_examples is not None:
    dense, ids, coef = dense[:max_examples], ids[:max_examples], coef[:max_examples]
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), params)
  return DLRMTarget(config, params, stacked, offs.astype(np.int32), dense,
                    ids.astype(np.int32), coef)


def dlrm_groups(config) -> list[str]:
  """emb, emb_read, bottom_mlp.<i>..., interaction, top_mlp.<i>... (forward order)."""
  return (["emb", "emb_read"] + [f"bottom_mlp.{i}" for i in range(len(config.bottom_mlp))]
          + ["interaction"] + [f"top_mlp.{i}" for i in range(len(config.top_mlp))])


def _mlp(layers, x, activate_last):
  n = len(layers)
  for i in range(n):
    x = x @ layers[i]["kernel"] + layers[i]["bias"]
    if i < n - 1 or activate_last:
      x = jax.nn.relu(x)
  return x


def _layer_list(params, name):
  if name not in params:
    return []
  return [params[name]["layers"][i] for i in sorted(params[name]["layers"])]


def _forward(config, bottom, top, dense_D, emb_FD, inter_fn=lambda h: h):
  """One example's click probability; inter_fn corrupts the interaction output."""
  x = _mlp(bottom, dense_D, True)[None] if bottom else None
  h = dot_interaction(x, emb_FD[None], config.self_interaction)[0]
  return jax.nn.sigmoid(_mlp(top, inter_fn(h), False)[0])


def dlrm_probabilities(target: DLRMTarget) -> np.ndarray:
  """Fault-free probabilities [X] of this module's forward (fp32 values)."""
  bottom = _layer_list(target.params, "bottom_mlp")
  top = _layer_list(target.params, "top_mlp")

  def one(dense, ids, coef):
    rows = jnp.asarray(target.tables_RD)[ids + jnp.asarray(target.row_offset_F)[:, None]]
    return _forward(target.config, bottom, top, dense, jnp.einsum("fl,fld->fd", coef, rows))
  return np.asarray(jax.jit(jax.vmap(one))(target.dense_XD, target.ids_XFL, target.coef_XFL))


def _group_faulty(target: DLRMTarget, group: str, fmt: str):
  """(faulty(data, elem, mask, x), data, size) for one group with values stored in fmt."""
  cfg = target.config
  enc = jax.tree.map(lambda a: faults.encode(a, fmt), target.params)
  emb = faults.encode(target.tables_RD, fmt)
  data = {"params": enc, "emb": emb, "dense": target.dense_XD, "ids": target.ids_XFL,
          "coef": target.coef_XFL, "offset": target.row_offset_F}
  is_enc = lambda a: isinstance(a, dict) and "v" in a
  D = target.tables_RD.shape[1]

  def decoded(d):
    p = jax.tree.map(faults.decode, d["params"], is_leaf=is_enc)
    return _layer_list(p, "bottom_mlp"), _layer_list(p, "top_mlp")

  def bags(d, x):
    gid_FL = d["ids"][x] + d["offset"][:, None]
    rows_FLD = faults.decode({k: v[gid_FL] for k, v in d["emb"].items()})
    return gid_FL, rows_FLD

  if group in ("emb", "emb_read"):
    F, L = target.ids_XFL.shape[1:]

    def faulty(d, elem, mask, x):
      bottom, top = decoded(d)
      gid_FL, rows_FLD = bags(d, x)
      if group == "emb":
        r, c = elem // D, elem % D
      else:   # a value of a row the example's bag slot (f, l) reads
        r, c = gid_FL.reshape(-1)[elem // D], elem % D
      bad = faults.flip_bits(d["emb"]["v"][r, c], mask)
      scale = {"scale": d["emb"]["scale"][r][None]} if "scale" in d["emb"] else {}
      val = faults.decode({"v": bad.reshape(1, 1), **scale})[0, 0]
      # A padding slot (coefficient 0) reads no row, as in FBGEMM's kernels.
      hit = ((gid_FL == r) & (d["coef"][x] != 0))[..., None] & (jnp.arange(D) == c)
      rows_FLD = jnp.where(hit, val, rows_FLD)
      emb_FD = jnp.einsum("fl,fld->fd", d["coef"][x], rows_FLD)
      return _forward(cfg, bottom, top, d["dense"][x], emb_FD)
    return faulty, data, int(target.tables_RD.size if group == "emb" else F * L * D)

  if group == "interaction":
    def faulty(d, elem, mask, x):
      bottom, top = decoded(d)
      _, rows_FLD = bags(d, x)
      emb_FD = jnp.einsum("fl,fld->fd", d["coef"][x], rows_FLD)

      def inter_fn(h):
        e = faults.encode(h, fmt)
        e["v"] = faults.flip_element(e["v"], elem, mask)
        return faults.decode(e)
      return _forward(cfg, bottom, top, d["dense"][x], emb_FD, inter_fn)
    return faulty, data, int(cfg.interaction_dim)

  mod, _, idx = group.rpartition(".")
  if mod not in ("bottom_mlp", "top_mlp") or not idx.isdigit() or int(idx) not in target.params.get(
      mod, {}).get("layers", {}):
    raise ValueError(f"PVF group {group!r}: expected one of {dlrm_groups(cfg)}")
  i = int(idx)
  leaves = ("kernel", "bias")

  def faulty(d, elem, mask, x):
    old = d["params"][mod]["layers"][i]
    layer = dict(zip(leaves, faults.flip_in_group([old[k] for k in leaves], elem, mask)))
    p = dict(d["params"])
    p[mod] = {"layers": {**d["params"][mod]["layers"], i: layer}}
    bottom, top = decoded({**d, "params": p})
    _, rows_FLD = bags(d, x)
    emb_FD = jnp.einsum("fl,fld->fd", d["coef"][x], rows_FLD)
    return _forward(cfg, bottom, top, d["dense"][x], emb_FD)
  sizes = [int(np.size(target.params[mod]["layers"][i][k])) for k in leaves]
  return faulty, data, int(sum(sizes))


def dlrm_pvf(target: DLRMTarget, fmt: str, fault: faults.FaultModel, criterion,
             trials: int, key: jax.Array, groups: Sequence[str] | None = None,
             chunk: int = 256) -> list[dict[str, Any]]:
  """One row per group: {group, values, fmt, fault, trials, changed, nonfinite, pvf,
  ci_low, ci_high}."""
  rows = []
  for gi, group in enumerate(groups or dlrm_groups(target.config)):
    faulty, data, size = _group_faulty(target, group, fmt)
    res = faults.estimate(faulty, data, size, len(target.dense_XD), faults.bit_width(fmt),
                          fault, criterion, trials, jax.random.fold_in(key, gi), chunk)
    rows.append({"group": group, "values": size, "fmt": fmt, "fault": fault.label, **res})
  return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
  """A table: group, values, format, fault, trials, changed, PVF [95% CI], non-finite."""
  lines = [f"{'group':<16}{'values':>10}  {'fmt':<5}{'fault':<10}{'trials':>7}{'changed':>8}"
           f"  {'PVF':>9}  {'95% CI (Wilson)':<21}{'nonfinite':>9}"]
  for r in rows:
    lines.append(f"{r['group']:<16}{r['values']:>10,}  {r['fmt']:<5}{r['fault']:<10}"
                 f"{r['trials']:>7}{r['changed']:>8}  {r['pvf']:>9.5f}  "
                 f"[{r['ci_low']:.5f}, {r['ci_high']:.5f}]  {r['nonfinite']:>7}")
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> str:
  """One panel per model: PVF per group, one bar per (format, fault), Wilson 95% CIs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = [m for m in results["models"] if m["rows"]]
  fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.8 * len(models)), squeeze=False)
  for ax, m in zip(axes[:, 0], models):
    groups = list(dict.fromkeys(r["group"] for r in m["rows"]))
    series = list(dict.fromkeys((r["fmt"], r["fault"]) for r in m["rows"]))
    x = np.arange(len(groups))
    w = 0.8 / len(series)
    for s, (fmt, fault) in enumerate(series):
      by = {r["group"]: r for r in m["rows"] if (r["fmt"], r["fault"]) == (fmt, fault)}
      p = np.array([by[g]["pvf"] for g in groups])
      err = np.array([[by[g]["pvf"] - by[g]["ci_low"] for g in groups],
                      [by[g]["ci_high"] - by[g]["pvf"] for g in groups]])
      ax.bar(x + (s - (len(series) - 1) / 2) * w, p, w, yerr=err, capsize=2,
             label=f"{fmt} {fault}")
    ax.set_xticks(x, groups, rotation=30, fontsize=8)
    ax.set(ylabel="PVF (95% Wilson CI)", title=f"{m['label']}: {m['criterion']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
