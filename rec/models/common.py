"""What every rec model config and dense model shares: dtypes, feature names, row counts,
and the check of the (dense_BD, emb_BFD) inputs that the embedding collection hands over.

Letters: B batch, Dn dense input features, F sparse features, D embedding dim.
"""

from __future__ import annotations

import jax.numpy as jnp

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
  """One row count per feature from an int (the same for all) or a sequence."""
  if isinstance(num_rows, int):
    return (num_rows,) * num_sparse
  rows = tuple(int(r) for r in num_rows)
  if len(rows) != num_sparse:
    raise ValueError(f"{len(rows)} row counts for num_sparse={num_sparse}, expected one each")
  return rows


def normalize_features(cfg) -> None:
  """Fills a frozen config's rows_per_feature (an int -> one per feature) and feature_names
  (None -> C1..CF), checking both against num_sparse."""
  object.__setattr__(cfg, "rows_per_feature",
                     rows_per_feature(cfg.rows_per_feature, cfg.num_sparse))
  object.__setattr__(cfg, "feature_names", feature_names(cfg.feature_names, cfg.num_sparse))


def check_dtype(where: str, dtype: str) -> None:
  if dtype not in DTYPES:
    raise ValueError(f"{where}: dtype={dtype!r}, expected one of {sorted(DTYPES)}")


def check_fp8(where: str, cfg) -> None:
  """cfg.fp8_recipe is known and each fp8_layers pattern names a layer of the model."""
  from rec.layers import fp8
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
  if cfg.num_dense > 0 and (dense_BD is None or dense_BD.shape[-1] != cfg.num_dense):
    raise ValueError(f"{model}: dense_BD shape {None if dense_BD is None else dense_BD.shape}, "
                     f"expected [B, {cfg.num_dense}]")
