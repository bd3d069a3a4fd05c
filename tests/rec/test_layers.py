"""Interaction layers (DCN-v2 cross, FM, optimized FM / FMB, self-attention, conv,
linear compression) against explicit numpy references on small inputs."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import mesh as mesh_lib
from rec.layers.attention import SelfAttentionInteraction
from rec.layers.compression import LinearCompression, linear_compression
from rec.layers.conv import FeatureConv1D, FeatureConv2D
from rec.layers.dcn import CrossLayer, CrossNetwork
from rec.layers.fm import FactorizationMachineBlock, LowRankFM, fm_interaction, optimized_fm
from rec.layers.params import glorot_normal, param

RTOL, ATOL = 1e-5, 1e-5


def _rand(rng, *shape):
  return rng.normal(size=shape).astype(np.float32)


def _build(make, seed):
  """make(rngs) with every Param drawn from numpy: shapes come from nnx.eval_shape, so no
  init program is compiled (biases start at zero in the layers: random here, tested too)."""
  module = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for _, p in nnx.iter_graph(module):
    if isinstance(p, nnx.Param):
      std = 1.0 / np.sqrt(p.shape[0]) if len(p.shape) >= 2 else 0.5
      p.set_value(jnp.asarray(rng.normal(size=p.shape) * std, jnp.float32))
  return module


def _call(module, *args):
  """One jitted call: one compile instead of one per eager op."""
  return nnx.jit(lambda m, *a: m(*a))(module, *(jnp.asarray(a) for a in args))


def np_layer_norm(x, scale, bias, eps=1e-6):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def np_mlp(mlp, x, activate_last):
  for i, layer in enumerate(mlp.layers):
    x = x @ np.asarray(layer.kernel[...], np.float64) + np.asarray(layer.bias[...], np.float64)
    if i < len(mlp.layers) - 1 or activate_last:
      x = np.maximum(x, 0.0)
  return x


# ---------------------------------------------------------------------------- DCN-v2

@pytest.mark.parametrize("rank", [None, 3])
def test_cross_layer_matches_numpy(rank):
  rng = np.random.default_rng(0)
  layer = _build(lambda r: CrossLayer(6, r, rank=rank), 1)
  x0, x = _rand(rng, 4, 6), _rand(rng, 4, 6)
  if rank is None:
    w = np.asarray(layer.kernel[...], np.float64)
  else:
    w = np.asarray(layer.down[...], np.float64) @ np.asarray(layer.up[...], np.float64)
    assert layer.down[...].shape == (6, 3) and layer.up[...].shape == (3, 6)
  b = np.asarray(layer.bias[...], np.float64)
  want = np.stack([x0[i] * (w.T @ x[i] + b) + x[i] for i in range(4)])  # x0 ∘ (W x + b) + x
  np.testing.assert_allclose(_call(layer, x0, x), want, rtol=RTOL, atol=ATOL)


def test_cross_network_stacks_on_the_same_x0():
  rng = np.random.default_rng(1)
  net = _build(lambda r: CrossNetwork(5, 3, r, rank=2), 2)
  x0 = _rand(rng, 3, 5) * 0.5
  x = x0.astype(np.float64)
  for layer in net.layers:
    w = np.asarray(layer.down[...], np.float64) @ np.asarray(layer.up[...], np.float64)
    x = x0 * (x @ w + np.asarray(layer.bias[...])) + x
  np.testing.assert_allclose(_call(net, x0), x, rtol=RTOL, atol=ATOL)
  with pytest.raises(ValueError, match=r"x0 \(3, 4\).*expected both \[B, 5\]"):
    net.layers[0](jnp.ones((3, 4)), jnp.ones((3, 4)))


# ---------------------------------------------------------------------------- FM

def test_fm_interaction_is_the_sum_over_pairs():
  rng = np.random.default_rng(2)
  v = _rand(rng, 3, 5, 4)
  want = [sum(float(v[b, i] @ v[b, j]) for i, j in itertools.combinations(range(5), 2))
          for b in range(3)]
  np.testing.assert_allclose(fm_interaction(jnp.asarray(v)), want, rtol=RTOL, atol=ATOL)


def test_fm_interaction_of_bf16_rounds_once():
  """bf16 embeddings: the result is the exact sum over pairs rounded once to bf16. In bf16
  the two sums of squares (about F times a result's size here) would lose small results
  whole."""
  rng = np.random.default_rng(0)
  emb = jnp.asarray(rng.standard_normal((64, 26, 16)), jnp.bfloat16)
  e = np.asarray(emb.astype(jnp.float32), np.float64)
  s, q = e.sum(1), (e * e).sum((1, 2))
  want = 0.5 * ((s * s).sum(-1) - q)
  got = fm_interaction(emb)
  assert got.dtype == jnp.bfloat16
  # One bf16 rounding: 2^-8 relative; float32 sums of terms up to (s * s).sum + q: 2^-18
  # of that covers their 2^-24 per operation over 26 + 16 terms.
  tol = 2.0 ** -8 * np.abs(want) + 2.0 ** -18 * ((s * s).sum(-1) + q)
  assert np.all(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want) <= tol)


def test_optimized_fm_matches_numpy_and_full_fm_at_identity():
  rng = np.random.default_rng(3)
  x, y = _rand(rng, 2, 6, 4), _rand(rng, 6, 3)
  want = np.stack([x[b] @ x[b].T @ y for b in range(2)])
  np.testing.assert_allclose(optimized_fm(jnp.asarray(x), jnp.asarray(y)), want, rtol=RTOL, atol=ATOL)
  # k = n with Y = I: the low-rank FM is the full pairwise interaction X X^T.
  fm = _build(lambda r: LowRankFM(6, 6, r), 0)
  fm.projection.set_value(jnp.eye(6))
  full = np.stack([x[b] @ x[b].T for b in range(2)])
  np.testing.assert_allclose(_call(fm, x), full, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("output_relu", [False, True])
def test_fm_block_matches_numpy(output_relu):
  rng = np.random.default_rng(4)
  fmb = _build(lambda r: FactorizationMachineBlock(5, 3, 4, rank=2, hidden=(7,), rngs=r,
                                                   output_relu=output_relu), 5)
  x = _rand(rng, 3, 5, 4)
  y = np.asarray(fmb.fm.projection[...], np.float64)
  flat = np.stack([(x[b] @ x[b].T @ y).reshape(-1) for b in range(3)])
  h = np_layer_norm(flat, np.asarray(fmb.norm.scale[...]), np.asarray(fmb.norm.bias[...]))
  want = np_mlp(fmb.mlp, h, activate_last=output_relu).reshape(3, 3, 4)
  got = _call(fmb, x)
  assert got.shape == (3, 3, 4)
  if output_relu:
    assert (want == 0).any() and (want > 0).any()   # the ReLU cuts some outputs, not all
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)   # float32 as every layer here


# ---------------------------------------------------------------------------- attention

def test_self_attention_matches_numpy():
  rng = np.random.default_rng(6)
  h, k, d, e, f = 2, 3, 4, 5, 6
  att = _build(lambda r: SelfAttentionInteraction(d, h, k, r, out_dim=e), 6)
  x = _rand(rng, 2, f, d)
  wq, wk, wv = (np.asarray(p[...], np.float64).reshape(d, h, k) for p in (att.query, att.key, att.value))
  wo = np.asarray(att.out[...], np.float64).reshape(h, k, e)
  want = np.zeros((2, f, e))
  for b in range(2):
    for head in range(h):
      q, kk, v = x[b] @ wq[:, head], x[b] @ wk[:, head], x[b] @ wv[:, head]
      s = q @ kk.T / np.sqrt(k)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      want[b] += (p @ v) @ wo[head]
  np.testing.assert_allclose(_call(att, x), want, rtol=RTOL, atol=ATOL)
  # Permuting the features permutes the output the same way (no positions).
  perm = rng.permutation(f)
  np.testing.assert_allclose(_call(att, x[:, perm]), want[:, perm], rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- conv

def _same_pad(n_in, k):
  lo = (k - 1) // 2
  return lo, k - 1 - lo


def test_conv1d_matches_numpy():
  rng = np.random.default_rng(7)
  conv = _build(lambda r: FeatureConv1D(3, 3, r, out_dim=2), 8)
  x = _rand(rng, 2, 5, 3)
  w = np.asarray(conv.conv.kernel[...], np.float64)   # [W, D, E]
  bias = np.asarray(conv.conv.bias[...], np.float64)
  lo, hi = _same_pad(5, 3)
  xp = np.pad(x, ((0, 0), (lo, hi), (0, 0)))
  want = np.zeros((2, 5, 2))
  for b, f, o in itertools.product(range(2), range(5), range(2)):
    want[b, f, o] = bias[o] + sum(xp[b, f + t, c] * w[t, c, o] for t in range(3) for c in range(3))
  np.testing.assert_allclose(_call(conv, x), want, rtol=RTOL, atol=ATOL)


def test_conv2d_matches_numpy_channel_major():
  rng = np.random.default_rng(9)
  kf, kd, c = 3, 2, 2   # an even width checks the SAME padding split (lo 0, hi 1)
  conv = _build(lambda r: FeatureConv2D((kf, kd), c, r), 10)
  x = _rand(rng, 2, 4, 5)
  w = np.asarray(conv.conv.kernel[...], np.float64)   # [Wf, Wd, 1, C]
  bias = np.asarray(conv.conv.bias[...], np.float64)
  (flo, fhi), (dlo, dhi) = _same_pad(4, kf), _same_pad(5, kd)
  xp = np.pad(x, ((0, 0), (flo, fhi), (dlo, dhi)))
  want = np.zeros((2, c, 4, 5))
  for b, ch, f, d in itertools.product(range(2), range(c), range(4), range(5)):
    want[b, ch, f, d] = bias[ch] + (xp[b, f:f + kf, d:d + kd] * w[:, :, 0, ch]).sum()
  got = _call(conv, x)
  assert got.shape == (2, c * 4, 5)
  np.testing.assert_allclose(got, want.reshape(2, c * 4, 5), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- compression

def test_linear_compression_matches_numpy():
  rng = np.random.default_rng(11)
  lcb = _build(lambda r: LinearCompression(5, 3, r), 11)
  x = _rand(rng, 2, 5, 4)
  w = np.asarray(lcb.kernel[...], np.float64)
  want = np.stack([w.T @ x[b] for b in range(2)])   # each output embedding mixes the inputs
  np.testing.assert_allclose(_call(lcb, x), want, rtol=RTOL, atol=ATOL)
  with pytest.raises(ValueError, match=r"input \(2, 4, 4\), expected \[B, 5, D\]"):
    lcb(jnp.ones((2, 4, 4)))
  with pytest.raises(ValueError, match="linear_compression"):
    linear_compression(jnp.ones((2, 5, 4)), jnp.ones((4, 3)))


# ---------------------------------------------------------------------------- placement

@pytest.mark.devices(8)
def test_every_kernel_carries_rule_names():
  """Each layer's weights carry names the REC rules table knows (else placement fails)."""
  makers = [lambda r: CrossLayer(4, r), lambda r: CrossLayer(4, r, rank=2),
            lambda r: LowRankFM(3, 2, r), lambda r: SelfAttentionInteraction(4, 2, 2, r),
            lambda r: FeatureConv1D(4, 3, r), lambda r: FeatureConv2D((3, 3), 2, r),
            lambda r: LinearCompression(3, 2, r),
            lambda r: FactorizationMachineBlock(3, 2, 4, 2, (5,), r)]
  mesh = mesh_lib.make_mesh("data:8")
  for make in makers:
    layer = nnx.eval_shape(lambda: make(nnx.Rngs(0)))   # shapes and metadata only
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
    named = [tuple(s) for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.P))
             if len(s)]
    assert named and all("mlp_out" in s for s in named), (type(layer).__name__, named)
    shardings = mesh_lib.shardings_for(specs, mesh_lib.REC_RULES, mesh)
    assert all(s.is_fully_replicated for s in jax.tree.leaves(shardings))


def test_init_scales_and_zero_bias():
  key = jax.random.key(0)
  assert float(jnp.std(glorot_normal(key, (300, 500)))) == pytest.approx(np.sqrt(2 / 800), rel=0.02)
  # Conv kernels [W, in, out]: the receptive field multiplies both fans.
  assert float(jnp.std(glorot_normal(key, (3, 100, 200)))) == pytest.approx(np.sqrt(2 / 900), rel=0.02)
  layer = CrossLayer(4, nnx.Rngs(0))
  np.testing.assert_array_equal(layer.bias[...], np.zeros(4))   # DCN-v2 starts at x0 * W x0 + x0
  p = param(nnx.Rngs(0), (2, 3), ("mlp_in", "mlp_out"))
  assert p.get_metadata()["out_sharding"] == ("mlp_in", "mlp_out")
  with pytest.raises(ValueError, match=r"1 axis names \('mlp_in',\) for shape \(2, 3\)"):
    param(nnx.Rngs(0), (2, 3), ("mlp_in",))
