"""DLRM / Llama PVF (experiments/pvf, arXiv 2405.01741): the trials' forward (the DLRM
module on the collection's lookup) equals the module on independently pooled embeddings,
a fault nothing reads has PVF 0, every recorded trial's verdict equals an independent
replay (the same fault flipped in numpy and run through a plain-numpy DLRM, or through a
direct Llama call), estimates agree with the exact PVF enumerated in numpy, and the
report's bit fields and ordering check count what they say."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
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


def _np_exact(target, group, fmt, bit, criterion):
  """[values, examples] verdicts of every fault of `bit` in the group, by the numpy replay."""
  size = {"emb": target.tables_RD.size,
          "emb_read": target.ids_XFL.shape[1] * target.ids_XFL.shape[2]
          * target.tables_RD.shape[1],
          "interaction": CFG.interaction_dim}.get(group)
  if size is None:
    mod, _, i = group.rpartition(".")
    size = sum(np.size(v) for v in target.params[mod]["layers"][int(i)].values())
  with np.errstate(over="ignore", invalid="ignore"):   # the faults make inf and NaN
    return np.array([[_np_changed(criterion, *_replay(target, group, fmt, e, 1 << bit, x))
                      for x in range(target.num_examples)] for e in range(size)])


def _np_layer_exact(target, group, fmt, criterion):
  """[values, bits, examples] verdicts of every single-bit fault of one MLP layer in numpy,
  all examples at once: _np_prob's model over a batch."""
  width = {"fp32": 32, "bf16": 16}[fmt]
  stored = jax.tree.map(lambda a: _flip(np.asarray(a, np.float32), fmt, 0, 0), target.params)
  table = _flip(target.tables_RD, fmt, (0, 0), 0)
  emb_XFD = np.stack([_np_emb(table, target.row_offset_F, target.ids_XFL[x],
                              target.lengths_XF[x], target.weights_XFL[x])
                      for x in range(target.num_examples)])

  def probs(params):
    x = _np_mlp(params["bottom_mlp"]["layers"], target.dense_XD, True)
    z = np.concatenate([x[:, None], emb_XFD], 1)
    li, lj = tril_indices(z.shape[1])
    h = np.concatenate([x, np.einsum("xfd,xgd->xfg", z, z)[:, li, lj]], 1)
    logit = _np_mlp(params["top_mlp"]["layers"], h.astype(np.float32), False)[:, 0]
    return np.float32(1) / (np.float32(1) + np.exp(-logit))

  mod, _, i = group.rpartition(".")
  layer = stored[mod]["layers"][int(i)]
  n = layer["kernel"].size
  ref = probs(stored)
  out = np.zeros((n + layer["bias"].size, width, target.num_examples), bool)
  with np.errstate(over="ignore", invalid="ignore"):
    for e in range(out.shape[0]):
      for b in range(width):
        new = dict(layer)
        if e < n:
          new["kernel"] = _flip(layer["kernel"], fmt,
                                np.unravel_index(e, layer["kernel"].shape), 1 << b)
        else:
          new["bias"] = _flip(layer["bias"], fmt, e - n, 1 << b)
        p = probs({**stored, mod: {"layers": {**stored[mod]["layers"], int(i): new}}})
        out[e, b] = [_np_changed(criterion, r, o) for r, o in zip(ref, p)]
  return out


def test_pvf_counts_faults_that_matter():
  """Each recorded trial's verdict equals the numpy replay of the same fault (group,
  element, bits, example), for sign flips under |change| > 0 and exponent-MSB flips under
  the 0.5 threshold, in fp32 and bf16 (each group kind: table, MLP layer, activation); the
  estimate agrees with the exact PVF, every (value, example) of that bit replayed in numpy;
  its interval is Wilson's; and the exhaustive run through the module gives, fault by
  fault, the numpy verdicts of every bit of a layer."""
  _, _, _, target = _target()
  crit = {"tol0": faults.tolerance_criterion(0.0), "threshold": faults.threshold_criterion()}
  cases = [("top_mlp.1", "fp32", 31, "tol0"), ("bottom_mlp.0", "bf16", 15, "tol0"),
           ("emb_read", "fp32", 30, "threshold"), ("interaction", "fp32", 30, "threshold"),
           ("emb", "bf16", 14, "threshold")]
  for gi, (group, fmt, bit, c) in enumerate(cases):
    row, = pvf.dlrm_pvf(target, fmt, faults.FaultModel("single", bit), crit[c], 64,
                        jax.random.key(gi), groups=[group], chunk=32, record=True)
    rec = row["records"]
    with np.errstate(over="ignore", invalid="ignore"):
      want = [_np_changed(c, *_replay(target, group, fmt, int(e), int(m), int(x)))
              for e, m, x in zip(rec["elem"], rec["mask"], rec["example"])]
    np.testing.assert_array_equal(rec["changed"], want, err_msg=f"{group} {fmt} bit {bit}")
    assert row["changed"] == sum(want) and np.all(rec["mask"] == 1 << bit)
    # The exact PVF of this bit: every (value, example) replayed in numpy.
    exact = _np_exact(target, group, fmt, bit, c)
    assert row["values"] == exact.shape[0]
    lo, hi = faults.wilson(row["changed"], row["trials"], z=4.0)   # misses with p = 6e-5
    assert lo <= exact.mean() <= hi, (group, fmt, bit, row["pvf"], exact.mean())
    # Wilson's interval: the roots in p of (k/n - p)^2 = z^2 p (1 - p) / n.
    n, ph, z = row["trials"], row["pvf"], 1.96
    roots = np.sort(np.roots([1 + z * z / n, -(2 * ph + z * z / n), ph * ph]).real)
    np.testing.assert_allclose([row["ci_low"], row["ci_high"]], np.clip(roots, 0, 1),
                               atol=1e-12)
  # Every single-bit fault of the logit layer (9 values x 32 bits x 24 examples) through
  # the module, fault by fault against numpy.
  res = pvf.dlrm_exact(target, "fp32", "top_mlp.1", crit["threshold"], chunk=512)
  want = _np_layer_exact(target, "top_mlp.1", "fp32", "threshold")
  np.testing.assert_array_equal(res["changed_VBX"], want)
  assert res["changed"] == want.sum() and res["trials"] == 9 * 32 * 24
  assert set(pvf.dlrm_groups(CFG)) == {"emb", "emb_read", "bottom_mlp", "bottom_mlp.0",
                                       "bottom_mlp.1", "interaction", "top_mlp", "top_mlp.0",
                                       "top_mlp.1"}


def test_component_group_is_its_layers():
  """`top_mlp` (every layer) has the layers' values, and its exact PVF of a bit is the
  layers' exact PVFs weighted by their sizes (a uniform value of the component)."""
  _, _, _, target = _target()
  crit = faults.threshold_criterion()
  parts = [pvf.dlrm_exact(target, "bf16", g, crit, bits=(14,), chunk=512)
           for g in ("top_mlp", "top_mlp.0", "top_mlp.1")]
  whole, l0, l1 = parts
  assert whole["values"] == l0["values"] + l1["values"]
  np.testing.assert_array_equal(whole["changed_VBX"],
                                np.concatenate([l0["changed_VBX"], l1["changed_VBX"]]))
  assert whole["changed"] == l0["changed"] + l1["changed"] > 0


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


def test_study_fields_and_paper_ordering():
  """PVF by bit field counts the recorded trials of each field, with Wilson intervals; the
  ordering check says agrees / disagrees only where the intervals are apart."""
  from experiments.pvf import study
  mask = np.array([1 << 31, 1 << 30, 1 << 3, 1 << 23, 1 << 31, 1 << 0], np.uint32)
  changed = np.array([1, 1, 0, 0, 0, 1], bool)
  row = {"group": "g", "fmt": "fp32", "fault": "single",
         "records": {"mask": mask, "changed": changed}}
  f = study.by_field(row)
  assert "records" not in row
  assert {k: (v["trials"], v["changed"]) for k, v in f.items()} == {
      "sign": (2, 1), "exponent": (2, 1), "mantissa": (2, 1)}
  assert (f["sign"]["ci_low"], f["sign"]["ci_high"]) == faults.wilson(1, 2)
  with pytest.raises(ValueError, match="one flipped bit"):
    study.by_field({"group": "g", "fmt": "fp32", "fault": "multi:2",
                    "records": {"mask": np.array([3], np.uint32), "changed": changed[:1]}})

  def r(group, k, n=1000):
    return {"group": group, "fmt": "fp32", "fault": "single", "pvf": k / n,
            **dict(zip(("ci_low", "ci_high"), faults.wilson(k, n)))}
  checks = study.ordering_checks([r("emb", 0), r("bottom_mlp", 60), r("top_mlp", 20),
                                  r("emb_read", 25)])
  assert [(c["claim"], c["verdict"]) for c in checks] == [
      ("top_mlp > bottom_mlp", "disagrees"), ("top_mlp > emb", "agrees"),
      ("top_mlp > emb_read", "not resolved")]


def _pvf_main(tmp_path, *args):
  import os
  import sys

  from tests import cpu_env, forkserver
  from tests.experiments.entry import REPO
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  return forkserver.run([sys.executable, "-m", "experiments.pvf", f"--workdir={tmp_path}",
                         "--llama=", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.parametrize("flags, error", [
    (["--faults=single,burst:0"], "--faults: fault model 'burst:0': k=0; expected k >= 1"),
    (["--llama_faults=twice"], "--llama_faults: fault model 'twice': expected single"),
    (["--criterion=tol:-1"], "--criterion: criterion 'tol:-1': expected threshold"),
    (["--formats=fp32,fp16"], "--formats: format 'fp16': expected one of"),
    (["--dlrm_run={empty}"], "--dlrm_run={empty}: no checkpoint there"),
])
def test_entry_point_refuses_bad_settings_before_training(tmp_path, flags, error):
  """A typo in a fault model, the criterion or a format, or a --dlrm_run without a
  checkpoint, is one line naming the flag, before any DLRM step."""
  empty = tmp_path / "empty"
  empty.mkdir()
  out = _pvf_main(tmp_path / "w", *[f.format(empty=empty) for f in flags])
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1].startswith("error: " + error.format(empty=empty))
  assert "steps of" not in out.stdout


def test_entry_point_tiny_run(tmp_path):
  """The whole study on a 3-step DLRM: one row per (format, fault model, group) with
  --trials trials, bit fields on the single-bit rows, and the paper's ordering checks."""
  import json
  out = _pvf_main(tmp_path, "--steps=3", "--batch_size=64", "--num_rows=1000",
                  "--trials=16", "--examples=64", "--formats=fp32,int8",
                  "--faults=single,burst:2")
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((tmp_path / "results.json").read_text())
  (m,) = res["models"]
  groups = ["emb", "emb_read", "bottom_mlp", "bottom_mlp.0", "bottom_mlp.1", "interaction",
            "top_mlp", "top_mlp.0", "top_mlp.1"]
  assert [(r["fmt"], r["fault"], r["group"]) for r in m["rows"]] == [
      (f, k, g) for f in ("fp32", "int8") for k in ("single", "burst:2") for g in groups]
  for r in m["rows"]:
    assert r["trials"] == 16 and r["pvf"] == r["changed"] / 16
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(faults.wilson(r["changed"], 16))
    if r["fault"] == "single":
      assert sum(f["trials"] for f in r["by_field"].values()) == 16
      assert sum(f["changed"] for f in r["by_field"].values()) == r["changed"]
  assert {(c["fmt"], c["fault"]) for c in m["checks"]} == {
      (f, k) for f in ("fp32", "int8") for k in ("single", "burst:2")}
  assert (tmp_path / "pvf.png").stat().st_size > 0
