"""FP8 dense layers (rec/layers/fp8.py): the FP8 matmul and its gradients against a
numpy + ml_dtypes reference, delayed scaling's history and its exact update through the
optimizer wrapper, per-layer selection in DLRM / DCN-v2, and the CUDA lowering (float8
dot_generals). The probe's tests are in tests/experiments/test_fp8_probe.py."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core import quant
from rec import configs
from rec import runs
from rec.layers import fp8
from rec.models import dcnv2, dlrm


def _data(seed=0, b=48, k=24, n=10):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(b, k)) * np.exp(rng.normal(size=(b, 1)))).astype(np.float32)
  w = (rng.normal(size=(k, n)) * 0.2).astype(np.float32)
  g = (rng.normal(size=(b, n)) * 1e-3).astype(np.float32)
  return x, w, g


def _deq(v, fmt, gran, amax=None):
  values, scale_inv = quant.quantize_fp8_reference(v, fmt, gran, amax)
  return values.astype(np.float64) * scale_inv


def _reference(x, w, g, recipe):
  """y, dx, dw from numpy + ml_dtypes quantization, float64 accumulation."""
  if recipe == "tensor":
    xq, wq, gq = _deq(x, "e4m3", "tensor"), _deq(w, "e4m3", "tensor"), _deq(g, "e5m2", "tensor")
    return xq @ wq, gq @ wq.T, xq.T @ gq
  y = _deq(x, "e4m3", "row") @ _deq(w.T, "e4m3", "row").T
  dx = _deq(g, "e5m2", "row") @ _deq(w, "e4m3", "row").T
  dw = _deq(x.T, "e4m3", "row") @ _deq(g.T, "e5m2", "row").T
  return y, dx, dw


@pytest.mark.parametrize("recipe", ["tensor", "row"])
def test_fp8_matmul_matches_reference(recipe):
  x, w, g = _data()
  y, vjp = jax.vjp(lambda a, b: fp8.fp8_matmul(a, b, recipe), jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  for got, want in zip((y, dx, dw), _reference(x, w, g, recipe)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5,
                               atol=2e-6 * np.abs(want).max())
  # ... and differs from the float32 product by FP8 rounding (the test can fail).
  exact = x.astype(np.float64) @ w
  err = np.abs(np.asarray(y) - exact).max() / np.abs(exact).max()
  assert 1e-3 < err < 0.1


def test_fp8_matmul_leading_dims_and_dtype():
  x, w, _ = _data(1, b=12)
  x3 = jnp.asarray(x.reshape(3, 4, -1), jnp.bfloat16)
  y = fp8.fp8_matmul(x3, jnp.asarray(w), "tensor")
  assert y.shape == (3, 4, w.shape[1]) and y.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"expected \[..., K\] @ \[K, N\]"):
    fp8.fp8_matmul(jnp.ones((2, 3)), jnp.ones((4, 5)))
  with pytest.raises(ValueError, match="delayed scaling needs a history of shape"):
    fp8.fp8_matmul(jnp.ones((2, 3)), jnp.ones((3, 5)), "delayed")
  with pytest.raises(ValueError, match="delayed scaling needs granularity='tensor'"):
    fp8.Fp8Recipe("row", "delayed")
  with pytest.raises(ValueError, match="fp8 recipe 'rows'"):
    fp8.get_recipe("rows")


def test_delayed_scaling_history():
  """The history records ceil(log2 amax) of x, w, g, newest first; the first step scales
  by the current amax, later ones by 2^max(history), saturating what exceeds it."""
  x, w, g = _data(2)
  rec = fp8.Fp8Recipe("tensor", "delayed", history=4)
  h0 = fp8.empty_history(rec)
  f = lambda a, b, h: jnp.sum(fp8.fp8_matmul(a, b, rec, h) * g)
  _, _, gh = jax.grad(f, argnums=(0, 1, 2))(x, w, h0)
  h1 = np.asarray(h0) + np.asarray(gh) / fp8.HISTORY_GRAD_SCALE
  want = [np.ceil(np.log2(np.abs(v).max())) for v in (x, w, g)]
  np.testing.assert_array_equal(h1[:, 0], want)
  np.testing.assert_array_equal(h1[:, 1:], fp8.EMPTY)
  # Step 1 is current scaling: the same numbers as the "tensor" recipe.
  np.testing.assert_array_equal(fp8.fp8_matmul(x, w, rec, h0), fp8.fp8_matmul(x, w, "tensor"))
  # Step 2 with a history whose x entry is 2 binades below x's amax: x is quantized
  # against amax 2^(e - 2) and its largest values saturate.
  h = h1.copy()
  h[0, 0] -= 2
  y = np.asarray(fp8.fp8_matmul(x, w, rec, jnp.asarray(h)))
  xq = _deq(x, "e4m3", "tensor", np.float32(2.0 ** h[0, 0]))
  wq = _deq(w, "e4m3", "tensor", np.float32(2.0 ** h[1, 0]))
  np.testing.assert_allclose(y, xq @ wq, rtol=2e-5, atol=1e-6 * np.abs(xq @ wq).max())
  assert np.abs(xq).max() == pytest.approx(2.0 ** h[0, 0], rel=1e-6)     # saturated there
  assert 2.0 ** h[0, 0] < np.abs(x).max()
  assert fp8.history_rows(jnp.asarray(h1))["g"].tolist() == [want[2]]


def test_history_rides_the_gradient_exactly_through_the_optimizer():
  """With `with_fp8_history`, adagrad updates the kernels as usual and the history leaves
  become exactly the new history; the global gradient norm barely sees them."""
  rec = fp8.Fp8Recipe("tensor", "delayed", history=3)
  model = fp8.Fp8Linear(6, 4, recipe=rec, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  tx = fp8.with_fp8_history(optax.adagrad(0.1))
  plain = optax.adagrad(0.1)
  opt, opt_plain = tx.init(params), plain.init(params)
  assert jax.tree.structure(opt) == jax.tree.structure(opt_plain)
  rng = np.random.default_rng(3)
  for step in range(4):
    x = jnp.asarray(rng.normal(size=(8, 6)) * 2.0 ** step, jnp.float32)

    def loss(p):
      m = nnx.merge(graphdef, p)
      return jnp.sum(m(x) ** 2)
    grads = jax.grad(loss)(params)
    g_hist = grads["fp8_history"]
    assert optax.tree.norm(g_hist) < 1e-8
    updates, opt = tx.update(grads, opt, params)
    new = optax.apply_updates(params, updates)
    # Kernel and bias: what plain adagrad does with the same gradients.
    masked = {**grads, "fp8_history": jnp.zeros_like(g_hist)}
    upd_plain, opt_plain = plain.update(masked, opt_plain, params)
    np.testing.assert_array_equal(new["kernel"], optax.apply_updates(params, upd_plain)["kernel"])
    hist = np.asarray(new["fp8_history"])
    assert hist[0, 0] == np.ceil(np.log2(np.abs(np.asarray(x)).max()))
    np.testing.assert_array_equal(hist[:, 1:], np.asarray(params["fp8_history"])[:, :-1])
    params = new
  assert (np.asarray(params["fp8_history"]) > fp8.EMPTY).all()


def test_layer_selection_and_state_compatibility():
  cfg = dlrm.DLRMConfig(num_dense=3, num_sparse=4, embedding_dim=8, bottom_mlp=(16, 8),
                        top_mlp=(16, 8, 1), rows_per_feature=10)
  assert cfg.fp8_layer_names == ["bottom_mlp.0", "bottom_mlp.1", "top_mlp.0", "top_mlp.1",
                                 "top_mlp.2"]
  m32 = dlrm.DLRM(cfg, nnx.Rngs(0))
  m8 = dlrm.DLRM(dataclasses.replace(cfg, fp8_layers="top_mlp.*,bottom_mlp.1"), nnx.Rngs(0))
  kinds = [type(l).__name__ for l in list(m8.bottom_mlp.layers) + list(m8.top_mlp.layers)]
  assert kinds == ["Linear", "Fp8Linear", "Fp8Linear", "Fp8Linear", "Fp8Linear"]
  s32, s8 = nnx.to_pure_dict(nnx.state(m32)), nnx.to_pure_dict(nnx.state(m8))
  assert jax.tree.structure(s32) == jax.tree.structure(s8)
  rng = np.random.default_rng(4)
  dense = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)
  emb = jnp.asarray(rng.normal(size=(32, 4, 8)), jnp.float32)
  y32 = np.asarray(m32(dense, emb))
  y8 = np.asarray(nnx.merge(nnx.graphdef(m8), nnx.state(m32))(dense, emb))
  sqnr = 10 * np.log10(np.sum(y32 ** 2) / np.sum((y8 - y32) ** 2))
  assert 15 < sqnr < 60, sqnr
  with pytest.raises(ValueError, match=r"pattern 'top\.\*' matches no layer"):
    dataclasses.replace(cfg, fp8_layers="top.*")
  with pytest.raises(ValueError, match="fp8 recipe 'fast'"):
    dataclasses.replace(cfg, fp8_layers="all", fp8_recipe="fast")
  d = dcnv2.DCNv2Config(num_dense=3, num_sparse=4, embedding_dim=8, rows_per_feature=10,
                        num_cross_layers=2, cross_rank=4, deep_mlp=(8,), fp8_layers="cross.1",
                        fp8_recipe="delayed")
  m = dcnv2.DCNv2(d, nnx.Rngs(0))
  assert m.cross.layers[0].fp8_recipe is None and m.cross.layers[1].fp8_recipe.delayed
  assert set(nnx.to_pure_dict(nnx.state(m))["cross"]["layers"][1]) == {
      "down", "up", "bias", "fp8_history_down", "fp8_history_up"}


def test_bf16_dense_compute():
  """dtype="bfloat16" (--dtype of train_rec): every matmul of DLRM and DCN-v2 takes bf16
  operands, parameters stay float32 and the logits float32; the result is the fp32
  model's to bf16 precision (neither equal nor far off)."""
  rng = np.random.default_rng(5)
  dense = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)
  emb = jnp.asarray(rng.normal(size=(32, 4, 8)) * 0.5, jnp.float32)
  for cfg in (dlrm.DLRMConfig(num_dense=3, num_sparse=4, embedding_dim=8, bottom_mlp=(16, 8),
                              top_mlp=(16, 1), rows_per_feature=10),
              dcnv2.DCNv2Config(num_dense=3, num_sparse=4, embedding_dim=8, rows_per_feature=10,
                                bottom_mlp=(8,), num_cross_layers=2, cross_rank=4,
                                deep_mlp=(16,))):
    cls = configs.MODELS[type(cfg)]
    m32 = cls(cfg, nnx.Rngs(0))
    m16 = nnx.merge(nnx.graphdef(cls(dataclasses.replace(cfg, dtype="bfloat16"), nnx.Rngs(0))),
                    nnx.state(m32))
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(m16)))
    jaxpr = str(jax.make_jaxpr(lambda d, e: m16(d, e))(dense, emb))
    outs = re.findall(r":(\w+)\[[\d,]*\] = dot_general", jaxpr)    # each matmul's result
    # One per layer, plus DLRM's dot interaction or the second factor of each low-rank cross.
    extra = 2 if isinstance(cfg, dcnv2.DCNv2Config) else 1
    assert len(outs) == len(cfg.fp8_layer_names) + extra, outs
    assert set(outs) == {"bf16"}, outs
    y32, y16 = np.asarray(m32(dense, emb)), m16(dense, emb)
    assert y16.dtype == jnp.float32
    y16 = np.asarray(y16)
    sqnr = 10 * np.log10(np.sum(y32 ** 2) / np.sum((y16 - y32) ** 2))
    assert 20 < sqnr < 70, (type(cfg).__name__, sqnr)
  with pytest.raises(ValueError, match="--dtype='bfloat16', .* with --model=logreg"):
    configs.model_config(configs.make_run(model="logreg", dtype="bfloat16"),
                         runs.CRITEO_SHAPED)


def test_run_config_passes_dtype_and_fp8():
  spec = runs.CRITEO_SHAPED
  base = configs.make_run(model="dcnv2", preset="small")
  m = configs.model_config(configs.replace_run(base, dtype="bfloat16", fp8_layers="cross.*",
                                               fp8_recipe="row"), spec)
  assert (m.dtype, m.fp8_layers, m.fp8_recipe) == ("bfloat16", "cross.*", "row")
  assert configs.model_config(base, spec).fp8_layers == ""
  with pytest.raises(ValueError, match="FP8 layers are wired into dlrm and dcnv2"):
    configs.model_config(configs.replace_run(base, model="wukong", fp8_layers="all"), spec)
  with pytest.raises(ValueError, match="--fp8_recipe='x'"):
    dataclasses.replace(base, model=dataclasses.replace(base.model, fp8_recipe="x")).validate()


@pytest.mark.parametrize("recipe", ["tensor", "delayed"])
def test_model_flops_count_fp8_layers_as_their_matmuls(recipe):
  """model_stats counts an FP8 model's FLOPs as the float model's (the emulated
  quantization's element-wise work doubled a small model's count)."""
  spec = runs.CRITEO_SHAPED
  base = configs.make_run(model="dlrm", preset="small", num_rows=100, mesh="data:1")
  stats = lambda cfg: configs.model_stats(configs.build_run(cfg, jax.devices()[:1])[0], spec)
  plain = stats(base)
  fp8_run = stats(configs.replace_run(base, fp8_layers="all", fp8_recipe=recipe))
  assert fp8_run == plain


def test_lowers_for_cuda_to_float8_dots():
  """The train step's matmuls reach XLA as float8 x float8 -> float32 dot_generals (E4M3
  forward, E5M2 x E4M3 backward): what Hopper runs as FP8 GEMMs. Lowered ahead of time
  for CUDA; no GPU needed (compiling for it is not checked here)."""
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
  for recipe in ("tensor", "row"):
    f = jax.grad(lambda a, b: jnp.sum(fp8.fp8_matmul(a, b, recipe) ** 2), argnums=(0, 1))
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    assert len(dots) == 3, dots
    assert all("f8E4M3FN" in d for d in dots)
    assert sum("f8E5M2" in d for d in dots) == 2
    assert all("-> tensor<" in d and "xf32>" in d.split("->")[-1] for d in dots)


@pytest.mark.gpu
class TestFp8OnGpu:
  """The FP8 matmul compiled on a GPU (float8 dot_generals: FP8 GEMMs on Hopper) against
  the numpy + ml_dtypes reference; the fp32 accumulation may round in another order."""

  @pytest.fixture(autouse=True)
  def _gpu(self):
    if jax.default_backend() != "gpu":
      pytest.skip("needs a GPU (run with JAX_PLATFORMS=cuda)")

  @pytest.mark.parametrize("recipe", ["tensor", "row"])
  @pytest.mark.parametrize("k", [24, 1024])
  def test_matches_reference(self, recipe, k):
    x, w, g = _data(k=k)

    @jax.jit
    def run(x, w, g):
      y, vjp = jax.vjp(lambda a, b: fp8.fp8_matmul(a, b, recipe), x, w)
      return (y, *vjp(g))

    for got, want in zip(run(x, w, g), _reference(x, w, g, recipe)):
      np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-3,
                                 atol=1e-4 * np.abs(want).max())
