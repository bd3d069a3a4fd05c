"""DLRM / Llama PVF (experiments/pvf): the trials' forward (the DLRM module on the
collection's lookup) equals the module on independently pooled embeddings, a fault
nothing reads has PVF 0, and every recorded trial's verdict equals an independent replay:
the same fault flipped in numpy and run through a plain-numpy DLRM, or through a direct
Llama call."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from core import faults
from experiments.pvf import dlrm as pvf
from rec.data.batch import SparseBatch
from rec.layers.interaction import tril_indices
from rec.models.dlrm import DLRM, DLRMConfig

CFG = DLRMConfig(num_dense=3, num_sparse=3, embedding_dim=4, bottom_mlp=(8, 4),
                 top_mlp=(8, 1), rows_per_feature=(11, 7, 5))


def _target(lengths_value=None):
  rng = np.random.default_rng(0)
  model = DLRM(CFG, nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model))
  tables = {n: rng.standard_normal((r, 4)).astype(np.float32)
            for n, r in zip(CFG.feature_names, CFG.rows_per_feature)}
  B, L = 24, 2
  ids = np.stack([rng.integers(0, r, (B, L)) for r in CFG.rows_per_feature], 1).astype(np.int32)
  lengths = rng.integers(0, L + 1, (B, 3)).astype(np.int32)
  if lengths_value is not None:
    lengths[:] = lengths_value
  batch = SparseBatch(rng.standard_normal((B, 3)).astype(np.float32), ids, lengths,
                      np.zeros(B, np.float32), np.ones(B, np.float32),
                      rng.uniform(0.5, 2, (B, 3, L)).astype(np.float32))
  return model, tables, batch, pvf.dlrm_target(CFG, params, tables, [batch])


def _pooled(tables, batch):
  """emb [B, F, D]: weighted bag sums of the live slots, in numpy."""
  L = batch.ids.shape[2]
  live = np.arange(L)[None, None] < batch.lengths[..., None]
  return np.stack([np.einsum("bl,bld->bd", np.where(live[:, f], batch.weights[:, f], 0),
                             tables[n][batch.ids[:, f]])
                   for f, n in enumerate(CFG.feature_names)], 1)


def test_forward_equals_dlrm_module():
  model, tables, batch, target = _target()
  want = jax.nn.sigmoid(model(jnp.asarray(batch.dense), jnp.asarray(_pooled(tables, batch))))
  np.testing.assert_allclose(pvf.dlrm_probabilities(target), want, rtol=1e-5, atol=1e-6)


def test_pvf_zero_where_output_does_not_depend():
  # Empty bags: no example reads any table row, whatever the bits (NaN, inf) become.
  _, _, _, target = _target(lengths_value=0)
  for fmt, group in (("fp32", "emb"), ("bf16", "emb_read"), ("int8", "emb_read")):
    rows = pvf.dlrm_pvf(target, fmt, faults.FaultModel("burst", bits=6),
                        faults.tolerance_criterion(0.0), 200, jax.random.key(0),
                        groups=[group], chunk=100)
    assert rows[0]["changed"] == 0 and rows[0]["trials"] == 200, (fmt, rows)


# ------------------------------------------------------------------ the numpy replay

_STORE = {"fp32": (np.float32, np.uint32), "bf16": (ml_dtypes.bfloat16, np.uint16)}


def _flip(x: np.ndarray, fmt: str, index, mask: int) -> np.ndarray:
  """float32 values of `x` stored in `fmt`, the bits `mask` of x[index] flipped."""
  dtype, view = _STORE[fmt]
  stored = np.array(x, np.float32).astype(dtype)
  bits = stored.view(view)
  bits[index] ^= view(mask)
  return stored.astype(np.float32)


def _np_mlp(layers, x, activate_last):
  n = len(layers)
  for i in range(n):
    x = x @ layers[i]["kernel"] + layers[i]["bias"]
    if i < n - 1 or activate_last:
      x = np.maximum(x, np.float32(0))
  return x


def _np_prob(params, dense, emb_FD, inter=lambda h: h):
  """Plain-numpy DLRM (arXiv 1906.00091): ReLU bottom MLP, dot interaction in the
  reference's order, top MLP, sigmoid."""
  x = _np_mlp(params["bottom_mlp"]["layers"], dense, True)
  z = np.concatenate([x[None], emb_FD])
  li, lj = tril_indices(len(z))
  h = inter(np.concatenate([x, (z @ z.T)[li, lj]]).astype(np.float32))
  logit = _np_mlp(params["top_mlp"]["layers"], h, False)[0]
  return np.float32(1) / (np.float32(1) + np.exp(-logit))


def _np_emb(tables_RD, offs, ids, lengths, weights):
  """Pooled [F, D] of one example from the stacked table; padding slots read nothing."""
  out = np.zeros((len(offs), tables_RD.shape[1]), np.float32)
  for f in range(len(offs)):
    for l in range(lengths[f]):
      out[f] += weights[f, l] * tables_RD[offs[f] + ids[f, l]]
  return out


def _replay(target, group, fmt, elem, mask, x):
  """(fault-free, faulty) probability of one trial, recomputed in numpy."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float32), target.params)
  stored = jax.tree.map(lambda a: _flip(a, fmt, 0, 0), p)       # every value in `fmt`
  table = _flip(target.tables_RD, fmt, (0, 0), 0)
  ids, lengths, weights = target.ids_XFL[x], target.lengths_XF[x], target.weights_XFL[x]
  offs, D, dense = target.row_offset_F, target.tables_RD.shape[1], target.dense_XD[x]
  emb = _np_emb(table, offs, ids, lengths, weights)
  ref = _np_prob(stored, dense, emb)
  if group in ("emb", "emb_read"):
    r = elem // D if group == "emb" else (ids + offs[:, None]).reshape(-1)[elem // D]
    bad = _flip(target.tables_RD, fmt, (r, elem % D), mask)
    return ref, _np_prob(stored, dense, _np_emb(bad, offs, ids, lengths, weights))
  if group == "interaction":
    return ref, _np_prob(stored, dense, emb, lambda h: _flip(h, fmt, elem, mask))
  mod, _, i = group.rpartition(".")
  layer = p[mod]["layers"][int(i)]
  n = layer["kernel"].size
  new = dict(stored[mod]["layers"][int(i)])
  if elem < n:
    new["kernel"] = _flip(layer["kernel"], fmt, np.unravel_index(elem, layer["kernel"].shape),
                          mask)
  else:
    new["bias"] = _flip(layer["bias"], fmt, elem - n, mask)
  faulty = {**stored, mod: {"layers": {**stored[mod]["layers"], int(i): new}}}
  return ref, _np_prob(faulty, dense, emb)


def _np_changed(criterion: str, ref, out) -> bool:
  if criterion == "tol0":
    return not abs(out - ref) <= 0
  return bool((ref >= 0.5) != (out >= 0.5) or not np.isfinite(out))


def test_pvf_counts_faults_that_matter():
  """Each recorded trial's verdict equals the numpy replay of the same fault (group,
  element, bits, example), for sign flips under |change| > 0 and exponent-MSB flips under
  the 0.5 threshold, in fp32 and bf16 (each group kind: table, MLP layer, activation)."""
  _, _, _, target = _target()
  # The logit's bias: a sign flip changes every probability (bias != 0).
  b = target.params["top_mlp"]["layers"][1]["bias"]
  assert abs(float(b[0])) > 0
  crit = {"tol0": faults.tolerance_criterion(0.0), "threshold": faults.threshold_criterion()}
  cases = [("top_mlp.1", "fp32", 31, "tol0"), ("bottom_mlp.0", "bf16", 15, "tol0"),
           ("emb_read", "fp32", 30, "threshold"), ("interaction", "fp32", 30, "threshold"),
           ("emb", "bf16", 14, "threshold")]
  counts = {}
  for gi, (group, fmt, bit, c) in enumerate(cases):
    row, = pvf.dlrm_pvf(target, fmt, faults.FaultModel("single", bit), crit[c], 64,
                        jax.random.key(gi), groups=[group], chunk=32, record=True)
    rec = row["records"]
    with np.errstate(over="ignore", invalid="ignore"):   # the faults make inf and NaN
      want = [_np_changed(c, *_replay(target, group, fmt, int(e), int(m), int(x)))
              for e, m, x in zip(rec["elem"], rec["mask"], rec["example"])]
    np.testing.assert_array_equal(rec["changed"], want, err_msg=f"{group} {fmt} bit {bit}")
    assert row["changed"] == sum(want) and np.all(rec["mask"] == 1 << bit)
    counts[group, fmt] = row
  # 9 values (8 kernel + 1 bias): kernel faults change p unless the ReLU input is 0.
  assert counts["top_mlp.1", "fp32"]["values"] == 9
  assert counts["top_mlp.1", "fp32"]["changed"] > 32
  # Exponent MSB of a value a bag reads or of the interaction: threshold crossings.
  assert counts["emb_read", "fp32"]["changed"] > 0
  assert counts["interaction", "fp32"]["changed"] > 0
  assert set(pvf.dlrm_groups(CFG)) == {"emb", "emb_read", "bottom_mlp.0", "bottom_mlp.1",
                                       "interaction", "top_mlp.0", "top_mlp.1"}


# ------------------------------------------------------------------ Llama


def test_llama_pvf_tiny():
  from experiments.pvf import llama as llm_pvf
  from llm import generate as generate_lib
  from llm.config import PRESETS
  from llm.model import Llama
  model = Llama(PRESETS["tiny"], nnx.Rngs(0))
  toks = llm_pvf.sample_sequences(model, 4, 8, jax.random.key(0))
  assert toks.shape == (4, 8) and (toks[:, 0] == 1).all()
  again = generate_lib.generate(model, [[1]] * 4, 7, temperature=1.0, rng=jax.random.key(0))
  np.testing.assert_array_equal(toks[:, 1:], again)
  groups = llm_pvf.llama_groups(model)
  assert "layers.1.mlp" in groups and len(groups["norms"]) == 5
  # Mantissa LSB flips of the MLP hardly matter; exponent-MSB flips of the norms do.
  lsb, msb = (llm_pvf.llama_pvf(model, toks, "fp32", faults.FaultModel("single", bit), 32,
                                jax.random.key(1), groups=[g], chunk=32, record=True)[0]
              for bit, g in ((0, "layers.0.mlp"), (30, "norms")))
  assert lsb["changed"] == 0 and msb["changed"] > 0, (lsb, msb)
  # Replay every norm trial by a direct call of the model with the bit flipped in numpy.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
  call = jax.jit(lambda p, t: nnx.merge(graphdef, p, rest)(t[None])[0][0, -1])
  sizes = [int(np.size(llm_pvf._get(pure, path))) for path in groups["norms"]]

  def top1(p, x):
    state = jax.tree.map(lambda v: v, params)
    nnx.replace_by_pure_dict(state, p)
    logits = np.asarray(call(state, jnp.asarray(toks[x])))
    return int(np.argmax(logits)), bool(np.isfinite(logits).all())

  rec = msb["records"]
  clean = {x: top1(pure, x) for x in set(rec["example"].tolist())}
  for e, m, x, changed in zip(rec["elem"], rec["mask"], rec["example"], rec["changed"]):
    k = int(np.searchsorted(np.cumsum(sizes), e, side="right"))
    local = int(e) - int(np.sum(sizes[:k]))
    path = groups["norms"][k]
    arr = llm_pvf._get(pure, path)
    flipped = _flip(arr, "fp32", np.unravel_index(local, arr.shape), int(m))
    p = llm_pvf._set(pure, path, flipped)
    arg, finite = top1(p, int(x))
    assert bool(changed) == (arg != clean[int(x)][0] or not finite), (e, x)
