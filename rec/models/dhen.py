"""DHEN: Deep and Hierarchical Ensemble Network (Zhang et al., arXiv 2203.11014), the dense part.

Representation: X_n is a stack of N_n embeddings of dim D, [B, N_n, D]. X_0 is the
bottom MLP's dense embedding (when there are dense features) followed by the F pooled
sparse embeddings. One DHEN layer is

    X_{n+1} = LayerNorm(Ensemble_i Interaction_i(X_n) + ShortCut(X_n))

- every interaction module maps [B, N_n, D] -> [B, W, D] (W = `width`):
    dot            AdvancedDLRM: the N(N-1)/2 pairwise dot products, one linear map to W*D
    dcn            DCN-v2 cross layers on the flattened [B, N*D], reshaped back to N embeddings
    self_attention multi-head self-attention across the N embeddings (AutoInt)
    linear         linear compression N -> W (a learned [N, W] mix of the embeddings)
    conv           1-D convolution along the embeddings, D channels
    conv2d         2-D convolution over the [N, D] matrix, C channels -> C*N embeddings
  modules whose natural output count is not W (dcn, self_attention, conv keep N; conv2d
  gives C*N) end in a linear compression to W;
- Ensemble: "concat" stacks the module outputs (N_{n+1} = m W for m modules), "sum" adds
  them (N_{n+1} = W), "weighted_sum" adds them with one learned scalar each (init 1);
- ShortCut: identity when N_n == N_{n+1}, else a linear compression N_n -> N_{n+1};
- LayerNorm over each embedding's D values (learned scale and bias of size D).

After the last layer, [B, N, D] is flattened into the top MLP, which ends at the logit.
As in DLRM, the tables live in the sharded collection (`DHENConfig.tables()`).

Letters: B batch, Dn dense input features, D embedding dim, F sparse features,
N embeddings entering a layer, W embeddings per interaction module, P pairs N(N-1)/2.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from rec.layers.attention import SelfAttentionInteraction
from rec.layers.compression import LinearCompression
from rec.layers.conv import FeatureConv1D, FeatureConv2D
from rec.layers.dcn import CrossNetwork
from rec.layers.interaction import dot_interaction, num_dot_outputs
from rec.layers.mlp import MLP
from rec.models import common

INTERACTIONS = ("dot", "dcn", "self_attention", "linear", "conv", "conv2d")
ENSEMBLES = ("concat", "sum", "weighted_sum")


@dataclasses.dataclass(frozen=True)
class DHENConfig(common.DenseConfig):
  """Sizes of a DHEN; `layers` names the interaction modules of each layer, in order.

  bottom_mlp must end at embedding_dim (the dense features become one embedding) and is
  () when num_dense == 0; top_mlp must end at 1. head_dim 0 means embedding_dim //
  num_heads (at least 1); dcn_rank 0 means full-rank cross kernels.
  """

  num_dense: int
  num_sparse: int
  embedding_dim: int
  rows_per_feature: tuple[int, ...]
  bottom_mlp: tuple[int, ...] = ()
  layers: tuple[tuple[str, ...], ...] = (("dot", "linear"), ("dot", "linear"))
  width: int = 16
  ensemble: str = "concat"
  top_mlp: tuple[int, ...] = (1,)
  num_heads: int = 2
  head_dim: int = 0
  dcn_layers: int = 1
  dcn_rank: int = 0
  conv_kernel: int = 3
  conv_channels: int = 2
  feature_names: tuple[str, ...] | None = None
  dtype: str = "float32"   # activation dtype; parameters stay float32, logits are float32

  def __post_init__(self):
    w = "DHENConfig"
    if isinstance(self.layers, str) or any(isinstance(l, str) for l in self.layers):
      raise ValueError(f"{w}: layers={self.layers!r}, expected a tuple of tuples of module "
                       "names, e.g. (('dot', 'linear'), ('dot', 'linear'))")
    object.__setattr__(self, "layers", tuple(tuple(l) for l in self.layers))
    self.check_dense(w, mlps=("bottom_mlp", "top_mlp"), bottom="embedding")
    if not self.layers or any(not l for l in self.layers):
      raise ValueError(f"{w}: layers={self.layers}; expected at least one layer, each with at "
                       "least one interaction module")
    for i, layer in enumerate(self.layers):
      bad = [k for k in layer if k not in INTERACTIONS]
      if bad:
        raise ValueError(f"{w}: layer {i} has unknown interaction(s) {bad}; expected names "
                         f"from {INTERACTIONS}")
    if self.ensemble not in ENSEMBLES:
      raise ValueError(f"{w}: ensemble={self.ensemble!r}, expected one of {ENSEMBLES}")
    for name in ("width", "num_heads", "dcn_layers", "conv_kernel", "conv_channels"):
      if getattr(self, name) < 1:
        raise ValueError(f"{w}: {name}={getattr(self, name)}, expected >= 1")
    if self.head_dim < 0 or self.dcn_rank < 0:
      raise ValueError(f"{w}: head_dim={self.head_dim}, dcn_rank={self.dcn_rank}; expected >= 0 "
                       "(0: the default)")
    for i, (n_in, _) in enumerate(self.layer_sizes()):
      if "dot" in self.layers[i] and n_in < 2:
        raise ValueError(f"{w}: layer {i} has 'dot' on {n_in} embedding; pairwise dot "
                         "products need at least 2")

  @property
  def num_inputs(self) -> int:
    """N_0: the dense embedding (if any) and the F sparse embeddings."""
    return self.num_sparse + (1 if self.num_dense > 0 else 0)

  @property
  def attention_head_dim(self) -> int:
    return self.head_dim or max(1, self.embedding_dim // self.num_heads)

  def layer_sizes(self) -> list[tuple[int, int]]:
    """(N_in, N_out) of every layer."""
    sizes, n = [], self.num_inputs
    for layer in self.layers:
      n_out = self.width * (len(layer) if self.ensemble == "concat" else 1)
      sizes.append((n, n_out))
      n = n_out
    return sizes

  @classmethod
  def criteo(cls, num_rows: int | Sequence[int], **overrides) -> DHENConfig:
    """Our Criteo default: dim 64, bottom 13-512-256-64, two layers of {AdvancedDLRM,
    self-attention, linear} (width 16, concat), top 512-256-1."""
    kwargs = dict(num_dense=13, num_sparse=26, embedding_dim=64, rows_per_feature=num_rows,
                  bottom_mlp=(512, 256, 64), layers=(("dot", "self_attention", "linear"),) * 2,
                  width=16, ensemble="concat", top_mlp=(512, 256, 1), num_heads=2)
    return cls(**{**kwargs, **overrides})

  @classmethod
  def advanced_dlrm_linear(cls, num_rows: int | Sequence[int], num_layers: int,
                           **overrides) -> DHENConfig:
    """The paper's depth study: `num_layers` layers of {AdvancedDLRM, linear}, concat;
    Criteo sizes as in `criteo`."""
    return cls.criteo(num_rows, **{"layers": (("dot", "linear"),) * num_layers, **overrides})

  @classmethod
  def dhen_2l(cls, num_rows, **overrides) -> DHENConfig:
    return cls.advanced_dlrm_linear(num_rows, 2, **overrides)

  @classmethod
  def dhen_4l(cls, num_rows, **overrides) -> DHENConfig:
    return cls.advanced_dlrm_linear(num_rows, 4, **overrides)

  @classmethod
  def dhen_8l(cls, num_rows, **overrides) -> DHENConfig:
    return cls.advanced_dlrm_linear(num_rows, 8, **overrides)


class DotProjection(nnx.Module):
  """AdvancedDLRM module: pairwise dot products [B, P] -> linear -> [B, W, D]."""

  def __init__(self, num_in: int, width: int, dim: int, rngs: nnx.Rngs, dtype=jnp.float32):
    self.width, self.dim = width, dim
    self.proj = MLP(num_dot_outputs(num_in), (width * dim,), rngs, activate_last=False,
                    dtype=dtype)

  def __call__(self, x_BND):
    h = self.proj(dot_interaction(None, x_BND))
    return h.reshape(h.shape[0], self.width, self.dim)


class FlatCross(nnx.Module):
  """DCN-v2 cross layers on the flattened embeddings: [B, N, D] -> [B, N, D]."""

  def __init__(self, num_in: int, dim: int, num_layers: int, rank: int | None, rngs: nnx.Rngs,
               dtype=jnp.float32):
    self.cross = CrossNetwork(num_in * dim, num_layers, rngs, rank=rank, dtype=dtype)

  def __call__(self, x_BND):
    return self.cross(x_BND.reshape(x_BND.shape[0], -1)).reshape(x_BND.shape)


class InteractionModule(nnx.Module):
  """One named interaction, followed by a linear compression to W embeddings if needed."""

  def __init__(self, kind: str, num_in: int, cfg: DHENConfig, rngs: nnx.Rngs):
    d, w, dtype = cfg.embedding_dim, cfg.width, common.DTYPES[cfg.dtype]
    self.kind = kind
    if kind == "dot":
      self.inner, n_mid = DotProjection(num_in, w, d, rngs, dtype), w
    elif kind == "linear":
      self.inner, n_mid = LinearCompression(num_in, w, rngs, dtype), w
    elif kind == "dcn":
      self.inner = FlatCross(num_in, d, cfg.dcn_layers, cfg.dcn_rank or None, rngs, dtype)
      n_mid = num_in
    elif kind == "self_attention":
      self.inner = SelfAttentionInteraction(d, cfg.num_heads, cfg.attention_head_dim, rngs,
                                            dtype=dtype)
      n_mid = num_in
    elif kind == "conv":
      self.inner, n_mid = FeatureConv1D(d, cfg.conv_kernel, rngs, dtype=dtype), num_in
    elif kind == "conv2d":
      k = cfg.conv_kernel
      self.inner = FeatureConv2D((k, k), cfg.conv_channels, rngs, dtype=dtype)
      n_mid = cfg.conv_channels * num_in
    else:
      raise ValueError(f"DHEN: interaction {kind!r}, expected one of {INTERACTIONS}")
    self.fit = LinearCompression(n_mid, w, rngs, dtype) if n_mid != w else None

  def __call__(self, x_BND):
    y = self.inner(x_BND)
    return self.fit(y) if self.fit is not None else y


class DHENLayer(nnx.Module):
  """LayerNorm(Ensemble_i Interaction_i(X) + ShortCut(X)): [B, N_in, D] -> [B, N_out, D]."""

  def __init__(self, kinds: Sequence[str], num_in: int, num_out: int, cfg: DHENConfig,
               rngs: nnx.Rngs):
    dtype = common.DTYPES[cfg.dtype]
    self.ensemble = cfg.ensemble
    self.interactions = nnx.List([InteractionModule(k, num_in, cfg, rngs) for k in kinds])
    # Ones: a fresh weighted sum is the plain sum.
    self.weights = (nnx.Param(jnp.ones((len(kinds),), jnp.float32))
                    if cfg.ensemble == "weighted_sum" else None)
    self.shortcut = LinearCompression(num_in, num_out, rngs, dtype) if num_in != num_out else None
    self.norm = nnx.LayerNorm(cfg.embedding_dim, dtype=dtype, rngs=rngs)

  def __call__(self, x_BND):
    outs = [m(x_BND) for m in self.interactions]
    if self.ensemble == "concat":
      y = jnp.concatenate(outs, axis=1)
    elif self.ensemble == "sum":
      y = sum(outs[1:], outs[0])
    else:
      w = self.weights[...].astype(outs[0].dtype)
      y = sum((w[i] * o for i, o in enumerate(outs[1:], 1)), w[0] * outs[0])
    skip = self.shortcut(x_BND) if self.shortcut is not None else x_BND
    return self.norm(y + skip.astype(y.dtype))


class DHEN(common.StackedModel):
  """The dense part of DHEN: bottom MLP, N stacked DHEN layers, top MLP to one logit."""

  def __init__(self, config: DHENConfig, rngs: nnx.Rngs):
    self.config = cfg = config
    # No ReLU after the last bottom layer: the dense embedding is signed like the sparse ones.
    self.bottom_mlp = common.bottom_mlp(cfg, rngs, relu_last=False)
    self.layers = nnx.List([DHENLayer(kinds, n_in, n_out, cfg, rngs)
                            for kinds, (n_in, n_out) in zip(cfg.layers, cfg.layer_sizes())])
    self.top_mlp = common.top_mlp(cfg, cfg.layer_sizes()[-1][1] * cfg.embedding_dim, rngs)
