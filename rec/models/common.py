"""What every rec model config and dense model shares: dtypes, feature names, row counts,
the check of the (dense_BD, emb_BFD) inputs that the embedding collection hands over, and
the skeleton of DLRM, DCN-v2, DHEN and Wukong (DenseConfig's checks and tables; bottom MLP,
interaction, top MLP: DenseModel, and StackedModel for a stack of embedding layers).

Letters: B batch, Dn dense input features, F sparse features, D embedding dim,
N embeddings in a stack.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rec.embedding.config import TableConfig
from rec.layers import fp8
from rec.layers.mlp import MLP

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def feature_names(names, num_sparse: int, prefix: str = "C") -> tuple[str, ...]:
  """The given names (checked: one per feature, unique), or C1..CF."""
  if names is None:
    return tuple(f"{prefix}{i + 1}" for i in range(num_sparse))
  names = tuple(names)
  if len(names) != num_sparse:
    raise ValueError(f"{len(names)} feature names {names} for num_sparse={num_sparse}")
  if len(set(names)) != len(names):
    raise ValueError(f"feature names {names} are not unique")
  return names


def rows_per_feature(num_rows, num_sparse: int) -> tuple[int, ...]:
  """One row count per feature from an int (the same for all) or a sequence of ints."""
  def is_int(r):   # numpy integers too (counts read from arrays); no bools, and no floats,
    return isinstance(r, (int, np.integer)) and not isinstance(r, bool)   # which int() cuts
  if is_int(num_rows):
    return (int(num_rows),) * num_sparse
  try:
    rows = tuple(num_rows)
  except TypeError:
    raise ValueError(f"rows_per_feature={num_rows!r}; expected one int, or one int per "
                     f"feature (num_sparse={num_sparse})") from None
  bad = [i for i, r in enumerate(rows) if not is_int(r)]
  if bad:
    raise ValueError(f"rows_per_feature[{bad[0]}]={rows[bad[0]]!r}; expected one int, or one "
                     f"int per feature (num_sparse={num_sparse})")
  if len(rows) != num_sparse:
    raise ValueError(f"{len(rows)} row counts for num_sparse={num_sparse}, expected one each")
  return tuple(int(r) for r in rows)


def normalize_features(cfg) -> None:
  """Fills a frozen config's rows_per_feature (an int -> one per feature) and feature_names
  (None -> C1..CF), checking both against num_sparse."""
  try:
    object.__setattr__(cfg, "rows_per_feature",
                       rows_per_feature(cfg.rows_per_feature, cfg.num_sparse))
    object.__setattr__(cfg, "feature_names", feature_names(cfg.feature_names, cfg.num_sparse))
  except ValueError as e:
    raise ValueError(f"{type(cfg).__name__}: {e}") from None


def check_dtype(where: str, dtype: str) -> None:
  if dtype not in DTYPES:
    raise ValueError(f"{where}: dtype={dtype!r}, expected one of {sorted(DTYPES)}")


def check_fp8(where: str, cfg) -> None:
  """cfg.fp8_recipe is known and each fp8_layers pattern names a layer of the model."""
  fp8.get_recipe(cfg.fp8_recipe)
  fp8.check_patterns(cfg.fp8_layers, cfg.fp8_layer_names, where)


def uses_delayed_fp8(cfg) -> bool:
  """Whether a model config has layers with delayed FP8 scaling (whose histories need
  `rec.layers.fp8.with_fp8_history` around the dense optimizer)."""
  return bool(getattr(cfg, "fp8_layers", "")) and getattr(cfg, "fp8_recipe", "") == "delayed"


def check_inputs(model: str, cfg, dense_BD, emb_BFD) -> None:
  """Shapes of a dense model's inputs against its config; dense_BD may be None (or anything)
  when cfg.num_dense == 0."""
  if emb_BFD.ndim != 3 or emb_BFD.shape[1:] != (cfg.num_sparse, cfg.embedding_dim):
    raise ValueError(f"{model}: emb_BFD shape {emb_BFD.shape}, expected "
                     f"[B, {cfg.num_sparse}, {cfg.embedding_dim}]")
  check_dense_input(model, cfg.num_dense, dense_BD, emb_BFD.shape[0])


def check_dense_input(model: str, num_dense: int, dense_BD, batch: int) -> None:
  """dense_BD is [batch, num_dense] when num_dense > 0: the whole shape, since a [1, Dn] or
  [B, 1, Dn] array would broadcast against the embeddings' batch into wrong logits."""
  if num_dense > 0 and (dense_BD is None or tuple(dense_BD.shape) != (batch, num_dense)):
    raise ValueError(f"{model}: dense_BD shape {None if dense_BD is None else dense_BD.shape}, "
                     f"expected [{batch}, {num_dense}] ([B, num_dense], B the embeddings' batch)")


# ------------------------------------------------------------------ the shared skeleton
#
# DLRM, DCN-v2, DHEN and Wukong share one shape: the dense features through a bottom MLP,
# an interaction over them and the pooled embeddings, a top MLP to one logit. What differs
# is the interaction (and the bottom MLP's last ReLU), so a model file holds its config's
# own fields and checks, its interaction modules and `interact`; the rest is here.


class DenseConfig:
  """What the four dense-model configs share beside their fields (num_dense, num_sparse,
  embedding_dim, rows_per_feature, bottom_mlp, top_mlp, feature_names, dtype): the checks
  of those fields and the tables. A frozen dataclass mixes it in."""

  def check_dense(self, where: str, mlps: Sequence[str] = (), bottom: str = "",
                  positive: str = "") -> None:
    """Fills rows_per_feature / feature_names and checks the shared fields, each error
    naming `where` (the config's class): the counts; `mlps`' sizes positive (the message
    lists them together, or one at a time when `positive` is "each"); `bottom`: what the
    bottom MLP's output becomes, when it must end at embedding_dim ("dot": dotted with
    the embeddings, "embedding": the dense embedding) or at a multiple of it
    ("embeddings": cut into dense embeddings); a bottom MLP only with dense features;
    top_mlp ending at the logit; the dtype."""
    for f in ("bottom_mlp", "top_mlp", *mlps):
      object.__setattr__(self, f, tuple(int(s) for s in getattr(self, f)))
    normalize_features(self)
    if self.num_sparse < 1 or self.num_dense < 0 or self.embedding_dim < 1:
      raise ValueError(f"{where}: num_sparse={self.num_sparse}, num_dense={self.num_dense}, "
                       f"embedding_dim={self.embedding_dim}; expected >= 1, >= 0, >= 1")
    if positive == "each":
      for f in mlps:
        if any(s < 1 for s in getattr(self, f)):
          raise ValueError(f"{where}: {f}={getattr(self, f)}, expected positive layer sizes")
    elif mlps and any(s < 1 for f in mlps for s in getattr(self, f)):
      raise ValueError(f"{where}: " + ", ".join(f"{f}={getattr(self, f)}" for f in mlps)
                       + "; expected positive layer sizes")
    if bottom and self.num_dense > 0:
      d, b = self.embedding_dim, self.bottom_mlp
      if bottom == "embeddings" and (not b or b[-1] % d):
        raise ValueError(f"{where}: bottom_mlp={b} must end at a multiple of embedding_dim="
                         f"{d}: its output is cut into dense embeddings")
      if bottom != "embeddings" and (not b or b[-1] != d):
        what = "is dotted with the embeddings" if bottom == "dot" else "is the dense embedding"
        raise ValueError(f"{where}: bottom_mlp={b} must end at embedding_dim={d}: its output "
                         f"{what}")
    if self.num_dense == 0 and self.bottom_mlp:
      raise ValueError(f"{where}: bottom_mlp={self.bottom_mlp} with num_dense=0; expected () "
                       "(no dense features, no bottom MLP)")
    if not self.top_mlp or self.top_mlp[-1] != 1:
      raise ValueError(f"{where}: top_mlp={self.top_mlp} must end at 1 (the logit)")
    check_dtype(where, self.dtype)

  def tables(self) -> list[TableConfig]:
    """One sum-pooled table per sparse feature, named after the feature (with the config's
    per-table pooling_factors and table_storage where it has them)."""
    n = self.num_sparse
    pf = getattr(self, "pooling_factors", None) or (1.0,) * n
    st = getattr(self, "table_storage", None) or ("fp32",) * n
    return [TableConfig(name=name, num_rows=rows, dim=self.embedding_dim,
                        pooling_factor=float(p), storage=s)
            for name, rows, p, s in zip(self.feature_names, self.rows_per_feature, pf, st)]


def _fp8(cfg) -> dict:
  return dict(fp8_layers=getattr(cfg, "fp8_layers", ""),
              fp8_recipe=getattr(cfg, "fp8_recipe", "tensor"))


def bottom_mlp(cfg, rngs: nnx.Rngs, relu_last: bool) -> MLP | None:
  """The bottom MLP over the dense features (None without one); `relu_last`: a ReLU after
  its last layer (DLRM's reference; off where its output is an embedding, signed like the
  sparse ones)."""
  if not cfg.bottom_mlp:
    return None
  return MLP(cfg.num_dense, cfg.bottom_mlp, rngs, activate_last=relu_last,
             dtype=DTYPES[cfg.dtype], name="bottom_mlp", **_fp8(cfg))


def top_mlp(cfg, in_features: int, rngs: nnx.Rngs) -> MLP:
  """The top MLP from the interaction's `in_features` to the logit (no last ReLU: the
  references' sigmoid follows it, the loss takes the logit)."""
  return MLP(in_features, cfg.top_mlp, rngs, activate_last=False, dtype=DTYPES[cfg.dtype],
             name="top_mlp", **_fp8(cfg))


class DenseModel(nnx.Module):
  """A dense rec model: `bottom_mlp` (or None), `interact`, `top_mlp` to one logit.

  A subclass builds `config`, `bottom_mlp` (`bottom_mlp()`), its interaction modules and
  `top_mlp` (`top_mlp()`) in that order in its __init__, and defines
  `interact(x_BD, emb_BFD)`: the bottom MLP's output (the raw dense features without a
  bottom MLP, None without dense features) and the embeddings, both in the activation
  dtype, to the top MLP's input [B, body_dim]."""

  def __call__(self, dense_BD, emb_BFD):
    """dense_BD: [B, Dn] (ignored, may be None, when num_dense == 0); emb_BFD: [B, F, D].

    Returns float32 logits [B].
    """
    return self.top_mlp(self.body(dense_BD, emb_BFD))[:, 0].astype(jnp.float32)

  @property
  def body_dim(self) -> int:
    return self.top_mlp.in_features

  def body(self, dense_BD, emb_BFD):
    """The shared body under the top MLP: bottom MLP and interaction, [B, body_dim]
    (extra heads, e.g. ExFM's auxiliary head in rec/distill.py, read it)."""
    cfg = self.config
    check_inputs(type(self).__name__, cfg, dense_BD, emb_BFD)
    dtype = DTYPES[cfg.dtype]
    x_BD = None
    if cfg.num_dense > 0:
      x_BD = dense_BD.astype(dtype)
      if self.bottom_mlp is not None:
        x_BD = self.bottom_mlp(x_BD)
    return self.interact(x_BD, emb_BFD.astype(dtype))

  def interact(self, x_BD, emb_BFD):
    raise NotImplementedError


class StackedModel(DenseModel):
  """A DenseModel over a stack of embeddings (DHEN, Wukong): X_0 = [the bottom MLP's output
  cut into dense embeddings of dim D, the F pooled embeddings], [B, N_0, D], through
  `layers` (each [B, N, D] -> [B, N', D]), flattened into the top MLP."""

  def interact(self, x_BD, emb_BFD):
    x_BND = emb_BFD
    if x_BD is not None:
      d = emb_BFD.shape[-1]
      x_BND = jnp.concatenate([x_BD.reshape(x_BD.shape[0], -1, d), x_BND], axis=1)
    for layer in self.layers:
      x_BND = layer(x_BND)
    return x_BND.reshape(x_BND.shape[0], -1)
