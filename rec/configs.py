"""Builds a recommendation run from plain settings: data sources, model, plan, task.

`experiments/train_rec.py` is the flag front end; notebooks and tests call `build_run`
directly with a `RecRunConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from core import flops as flops_lib
from core import memory as memory_lib
from core import mesh as mesh_lib
from core import train as train_loop
from rec.data import dedup as dedup_lib
from rec.data import sources as sources_lib
from rec.data import workers as workers_lib
from rec.data.dedup import DedupSpec
from rec.embedding import a2a_compression as a2a_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import ShardingKind, TableConfig
from rec.embedding.storage_spec import StorageSpec
from rec.layers import fp8 as fp8_lib
from rec.models import dcnv2 as dcnv2_lib
from rec.models import dhen as dhen_lib
from rec.models import dlrm as dlrm_lib
from rec.models import logreg as logreg_lib
from rec.models import searched as searched_lib
from rec.models import wukong as wukong_lib
from rec.train_lib import RecTask, make_dense_optimizer


@dataclasses.dataclass
class RecRunConfig:
  model: str = "dlrm"                 # dlrm | dcnv2 | dhen | wukong | logreg | searched:FILE
  preset: str = "kaggle"              # per model, see MODEL_PRESETS; kaggle = its Criteo default
  embedding_dim: int = 0              # 0: the preset's; else overrides it (and the tables')
  dtype: str = "float32"              # dense activations: float32 | bfloat16 (not logreg)
  fp8_layers: str = ""                # FP8 dense matmuls (dlrm, dcnv2): "", "all", "top_mlp.*"
  fp8_recipe: str = "tensor"          # tensor | row | delayed (rec/layers/fp8.py)
  data: str = "synthetic"             # synthetic[_deep] | criteo:DIR | ... (rec.data.sources)
  num_rows: int = 100_000             # hashed rows per sparse feature
  mesh: str = "-1"
  batch_size: int = 2048
  eval_batch_size: int = 8192
  eval_batches: int = 8               # synthetic eval set size, in eval batches
  dense_optimizer: str = "adagrad"
  learning_rate: float = 0.05
  sparse_optimizer: str = "rowwise_adagrad"
  embedding_learning_rate: float = 0.05
  sharding: str = "auto"              # auto | dp | tw | rw | cw | twrw
  sharding_overrides: str = ""        # "C1=tw,C3=rw"
  memory_budget_gb: float | None = None  # per device, for the planner; None: the device's
  storage: str = "fp32"               # embedding rows: a storage_spec kind (storage_spec())
  cache_fraction: float = 0.05        # int8_cache / int4_cache: fp32 cache, fraction of rows
  cache_policy: str = "lfu"           # int8_cache / int4_cache: lfu | lru
  bad_lines: str = "error"            # error | skip
  dedup_features: str = ""            # RecD: "C1,C3" looked up on each batch's distinct bags
  dedup_capacity: int = 0             # RecD: distinct bags per device and feature; 0: automatic
  # Compressed embedding exchange (arXiv 2407.04272; a2a_spec()): none | abs | rel
  a2a_mode: str = "none"
  a2a_error_bound: float = 1e-3       # pooled embeddings: abs |x - x'|, rel x the row's range
  a2a_grad_error_bound: float | None = None   # their gradients; None: sent in float32
  a2a_bits: int = 8                   # code width: 4 | 8 | 16
  a2a_table_factors: str = ""         # both bounds' factor per table: "C1=0.5,C3=2" (else 1)
  a2a_schedule: str = "constant"      # ... per train step: constant | KIND:START:END:STEPS
  seed: int = 0
  csv_label: str = ""                 # csv:DIR label column; "" = inferred
  csv_dense: str = ""                 # csv:DIR dense columns "I1,I2"; "" = inferred, "none"
  csv_categorical: str = ""           # csv:DIR categorical columns; "" = inferred
  days: str = ""                      # criteo:DIR Terabyte days, e.g. "0-2"; "" = all present

  @classmethod
  def from_flags(cls, flag_values, keep: Sequence[str] = (), **overrides) -> RecRunConfig:
    """The config of an entry point's flags: every field takes the absl flag of its name
    (`define_rec_run_flags`), or its value in `overrides`, which win; a field the entry
    point fixes at the dataclass default is named in `keep`. A field with none of the three
    is an error naming its flag, never a silent default."""
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(keep) - set(fields))
    if unknown:
      raise ValueError(f"RecRunConfig.from_flags: keep={unknown} are not RecRunConfig fields "
                       f"(expected some of {fields})")
    missing = [n for n in fields if n not in flag_values and n not in overrides and n not in keep]
    if missing:
      raise ValueError(
          f"RecRunConfig.from_flags: this entry point defines no flag "
          f"{', '.join('--' + n for n in missing)}; define it "
          f"(rec.configs.define_rec_run_flags({', '.join(map(repr, missing))})), pass its "
          f"value ({missing[0]}=...), or keep its default (keep=({missing[0]!r}, ...))")
    kw = {n: flag_values[n].value for n in fields if n in flag_values}
    return cls(**{**kw, **overrides})

  def run_settings(self) -> dict[str, Any]:
    """The config as a run's saved settings (`core.train.TrainConfig.settings`): every
    field, `embedding_dim` as the dim the model gets, so the default 0 (the preset's) and
    the preset's dim given explicitly are the same setting."""
    return normalize_settings(dataclasses.asdict(self))

  def validate(self) -> None:
    """Raises a ValueError naming the flag of the first setting that cannot train: a
    learning rate that is not finite and > 0, an unknown optimizer, a size < 1."""
    train_loop.check_learning_rate("--learning_rate", self.learning_rate)
    train_loop.check_learning_rate("--embedding_learning_rate", self.embedding_learning_rate)
    if self.dense_optimizer not in DENSE_OPTIMIZERS:
      raise ValueError(f"--dense_optimizer={self.dense_optimizer!r}: expected one of "
                       f"{list(DENSE_OPTIMIZERS)}")
    if self.sparse_optimizer not in opt_lib.OPTIMIZER_NAMES:
      raise ValueError(f"--sparse_optimizer={self.sparse_optimizer!r}: expected one of "
                       f"{list(opt_lib.OPTIMIZER_NAMES)}")
    for name in ("batch_size", "eval_batch_size", "num_rows", "eval_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name}={getattr(self, name)}: expected >= 1")
    if self.memory_budget_gb is not None and not (math.isfinite(self.memory_budget_gb)
                                                  and self.memory_budget_gb > 0):
      raise ValueError(f"--memory_budget_gb={self.memory_budget_gb}: expected a number > 0")
    if self.fp8_recipe not in fp8_lib.RECIPES:
      raise ValueError(f"--fp8_recipe={self.fp8_recipe!r}: expected one of {list(fp8_lib.RECIPES)}")
    self.storage_spec()
    self.a2a_spec()
    if self.dedup_capacity < 0:
      raise ValueError(f"--dedup_capacity={self.dedup_capacity}: expected >= 0 (0: the next "
                       "power of two that holds a batch's distinct bags)")

  def dedup_spec(self, tables) -> DedupSpec | None:
    """RecD's setting from --dedup_features / --dedup_capacity (None: off); names are
    checked against the tables."""
    return DedupSpec.from_flags(self.dedup_features, self.dedup_capacity,
                                known=[t.name for t in tables])

  def a2a_spec(self, tables: Sequence[str] = ()) -> a2a_lib.A2ACompression | None:
    """The compressed embedding exchange from --a2a_mode, --a2a_error_bound,
    --a2a_grad_error_bound, --a2a_bits and the dual-level adaptive bound's
    --a2a_table_factors and --a2a_schedule (None: --a2a_mode=none); errors name the flag,
    and `tables` (names), when given, are the names --a2a_table_factors may use. With
    --a2a_mode=none any of them other than its default is an error, not ignored."""
    if self.a2a_mode == "none":
      given = [f"--{n}={getattr(self, n)}" for n in A2A_FIELDS[1:]
               if getattr(self, n) != _FIELD_DEFAULTS[n]]
      if given:
        raise ValueError(f"{', '.join(given)} with --a2a_mode=none: no exchange is compressed; "
                         "expected --a2a_mode=abs|rel, or the default")
      return None
    if self.a2a_mode not in a2a_lib.MODES:
      raise ValueError(f"--a2a_mode={self.a2a_mode!r}: expected none or one of "
                       f"{list(a2a_lib.MODES)}")
    return a2a_lib.A2ACompression(
        self.a2a_mode, self.a2a_error_bound, self.a2a_grad_error_bound, self.a2a_bits,
        table_factors=a2a_lib.parse_table_factors(self.a2a_table_factors),
        schedule=a2a_lib.parse_schedule(self.a2a_schedule)).check(tables)

  def without_a2a(self) -> RecRunConfig:
    """This config with the embedding exchange in float32 (the --a2a_* settings at their
    defaults), e.g. a comparison's baseline."""
    return dataclasses.replace(self, **{n: _FIELD_DEFAULTS[n] for n in A2A_FIELDS})

  def storage_spec(self) -> StorageSpec:
    """The tables' row storage from --storage, --cache_policy and --cache_fraction (errors
    name the flag), e.g. StorageSpec("int8_cache", "lfu", 0.05)."""
    return StorageSpec.from_flags(self.storage, self.cache_policy, self.cache_fraction)

  def with_storage(self, spec: StorageSpec) -> RecRunConfig:
    """This config with the tables stored as `spec` (its settings as the fields above)."""
    if spec.cached and spec.cache_ways != StorageSpec(spec.kind).cache_ways:
      raise ValueError(f"storage {spec}: {spec.cache_ways} cache ways; a RecRunConfig has no "
                       f"setting for them (runs use {StorageSpec(spec.kind).cache_ways})")
    over = {"storage": spec.kind}
    if spec.cached:
      over.update(cache_policy=spec.cache_policy, cache_fraction=spec.cache_fraction)
    return dataclasses.replace(self, **over)


DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam", "adamw")
A2A_FIELDS = ("a2a_mode", "a2a_error_bound", "a2a_grad_error_bound", "a2a_bits",
              "a2a_table_factors", "a2a_schedule")
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RecRunConfig)}
# Every RecRunConfig field, e.g. for `define_rec_run_flags(*RUN_FIELDS)`.
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RecRunConfig))


def _run_flags() -> dict[str, tuple[Callable[..., Any], dict[str, Any], str]]:
  """RecRunConfig field -> (absl DEFINE function, its keyword arguments, help)."""
  from absl import flags
  count = dict(lower_bound=1)
  return {
      "model": (flags.DEFINE_string, {},
                "Model family: dlrm | dcnv2 | dhen | wukong | logreg, or searched:FILE (an "
                "architecture JSON of rec/models/searched.py, e.g. one experiments.rankitect "
                "found)."),
      "preset": (flags.DEFINE_string, {},
                 "Model sizes (rec.configs.MODEL_PRESETS). kaggle: the model's Criteo default; "
                 "small: a tiny one. dlrm: also terabyte. dhen: also dhen_2l, dhen_4l, dhen_8l. "
                 "wukong: also l<layers>_n<n> (e.g. l3_n16) and scaled<i> (rung i of the "
                 "scaling ladder)."),
      "embedding_dim": (flags.DEFINE_integer, dict(lower_bound=0),
                        "Embedding dim (of every model); 0 keeps the preset's."),
      "dtype": (flags.DEFINE_enum, dict(enum_values=["float32", "bfloat16"]),
                "Dense activation / matmul dtype (parameters stay float32)."),
      "fp8_layers": (flags.DEFINE_string, {},
                     "Dense layers whose matmuls run in FP8 (dlrm, dcnv2): 'all', or patterns "
                     "such as top_mlp.*,cross.0 (rec/layers/fp8.py)."),
      "fp8_recipe": (flags.DEFINE_enum, dict(enum_values=list(fp8_lib.RECIPES)),
                     "FP8 scaling: per tensor or per row (current amax), or per tensor from an "
                     "amax history."),
      "data": (flags.DEFINE_string, {},
               "synthetic | synthetic_deep (planted Criteo-shaped data; options after ':', e.g. "
               "synthetic:zipf_alpha=1.2,multi_hot=mlperf,gen=device) | criteo:DIR (Kaggle "
               "train.txt or Terabyte day_N) | criteo_bin:DIR (preprocessed binary Criteo, "
               "experiments.preprocess_criteo) | avazu:DIR | libfm:DIR (libFM / libFFM train, "
               "valid, test) | csv:DIR (BARS / FuxiCTR CSV with a header; see --csv_*). "
               "rec/data/sources.py describes each form."),
      "num_rows": (flags.DEFINE_integer, count, "Hashed rows per sparse feature."),
      "mesh": (flags.DEFINE_string, {},
               "Device mesh, e.g. data:8 or data:2,model:4; -1 = all devices."),
      "batch_size": (flags.DEFINE_integer, count, "Global train batch size."),
      "eval_batch_size": (flags.DEFINE_integer, count, "Global eval batch size."),
      "eval_batches": (flags.DEFINE_integer, count,
                       "Synthetic data: eval set size in eval batches."),
      "dense_optimizer": (flags.DEFINE_enum, dict(enum_values=list(DENSE_OPTIMIZERS)),
                          "Optax optimizer of the dense part."),
      "learning_rate": (flags.DEFINE_float, {}, "Dense learning rate."),
      "sparse_optimizer": (flags.DEFINE_enum, dict(enum_values=list(opt_lib.OPTIMIZER_NAMES)),
                           "Sparse embedding optimizer."),
      "embedding_learning_rate": (flags.DEFINE_float, {}, "Embedding learning rate."),
      "sharding": (flags.DEFINE_enum,
                   dict(enum_values=["auto", "dp", "tw", "rw", "cw", "twrw"]),
                   "Embedding sharding: auto = planner."),
      "sharding_overrides": (flags.DEFINE_string, {}, "Per-table kinds, e.g. C1=tw,C3=rw."),
      "memory_budget_gb": (flags.DEFINE_float, {},
                           "Per-device embedding memory budget for the planner (default: "
                           "the device's memory: a GPU's bytes_limit less "
                           f"{memory_lib.GPU_HEADROOM:.0%}, or the available RAM divided "
                           "over the CPU devices)."),
      "storage": (flags.DEFINE_enum,
                  dict(enum_values=["fp32", "bf16", "bf16_sr", "int8", "int4", "int8_cache",
                                    "int4_cache"]),
                  "Embedding row storage: bf16 rounds updates to nearest, bf16_sr "
                  "stochastically; int8 / int4 are FBGEMM row-wise rows updated with stochastic "
                  "rounding; *_cache adds an fp32 cache of the hot rows (arXiv 2010.11305)."),
      "cache_fraction": (flags.DEFINE_float, {},
                         "--storage=int8_cache / int4_cache: cache size as a fraction of each "
                         "device's rows (the paper: int8 0.05, int4 0.01)."),
      "cache_policy": (flags.DEFINE_enum, dict(enum_values=["lfu", "lru"]),
                       "--storage=*_cache: which rows the cache keeps, the most frequently or "
                       "the most recently used."),
      "bad_lines": (flags.DEFINE_enum, dict(enum_values=["error", "skip"]),
                    "Malformed data lines: stop, or skip and count."),
      "dedup_features": (flags.DEFINE_string, {},
                         "RecD (arXiv 2211.05239): features looked up on each batch's distinct "
                         "bags, e.g. C1,C3 (user features that repeat across a session's "
                         "samples); empty: off."),
      "dedup_capacity": (flags.DEFINE_integer, dict(lower_bound=0),
                         "RecD: distinct bags per device and feature; a batch with more runs "
                         "plain (metric dedup_fallback). 0: the next power of two that holds "
                         "them."),
      "a2a_mode": (flags.DEFINE_enum, dict(enum_values=["none", *a2a_lib.MODES]),
                   "Error-bounded lossy compression of the embedding exchange (arXiv "
                   "2407.04272): the all-to-all of tw / cw / twrw tables and the reduce-scatter "
                   "of rw tables send fixed-rate codes, forward and (--a2a_grad_error_bound) "
                   "backward. abs: every value within --a2a_error_bound; rel: within it times "
                   "its row's value range; none: float32."),
      "a2a_error_bound": (flags.DEFINE_float, {},
                          "--a2a_mode: bound of the pooled embeddings sent (> 0)."),
      "a2a_grad_error_bound": (flags.DEFINE_float, {},
                               "--a2a_mode: bound of their gradients (> 0); unset: the "
                               "gradients go in float32."),
      "a2a_bits": (flags.DEFINE_integer, dict(lower_bound=4),
                   "--a2a_mode: code width, 4, 8 or 16 bits per value (plus a 6-byte row "
                   "header)."),
      "a2a_table_factors": (flags.DEFINE_string, {},
                            "--a2a_mode: the dual-level adaptive bound's table level: factors "
                            "of both bounds per table, e.g. C1=0.5,C3=2 (a table not named: "
                            "1)."),
      "a2a_schedule": (flags.DEFINE_string, {},
                       "--a2a_mode: the dual-level adaptive bound's iteration level: a factor "
                       "of both bounds per train step (counted from 0): constant (1), or "
                       "KIND:START:END:STEPS, e.g. linear:2:0.5:1000: linear and cosine go "
                       "from START at step 0 to END at step STEPS, step holds START before "
                       "step STEPS; END from step STEPS on."),
      "seed": (flags.DEFINE_integer, dict(lower_bound=0),
               "Seed of parameters and synthetic data."),
      "csv_label": (flags.DEFINE_string, {},
                    "--data=csv:DIR: label column; empty = the first named "
                    "label/click/clicked/y."),
      "csv_dense": (flags.DEFINE_string, {},
                    "--data=csv:DIR: dense columns, e.g. I1,I2; empty = inferred (numeric I<n> "
                    "columns), none = no dense."),
      "csv_categorical": (flags.DEFINE_string, {},
                          "--data=csv:DIR: categorical columns, e.g. C1,C2; empty = every other "
                          "column but id."),
      "days": (flags.DEFINE_string, {},
               "--data=criteo:DIR with Terabyte day_N[.gz] files: the days to use, e.g. 0-2 or "
               "0,3,23 (empty: every day present); day 23 (else the last day given) is split "
               "into validation and test halves."),
  }


def define_rec_run_flags(*names: str, flag_values=None, **defaults: Any) -> None:
  """Defines the absl flags of RecRunConfig fields, one definition each (help, choices,
  bounds), for an entry point's `define_flags()`: the fields in `names` with the dataclass
  defaults, and those in `defaults` with the entry point's own. `from_flags` reads them.
  `flag_values`: where (default absl's FLAGS)."""
  from absl import flags
  flags.disclaim_key_flags()   # the flags are the calling entry point's: its --help lists them
  fv = flags.FLAGS if flag_values is None else flag_values
  table = _run_flags()
  unknown = sorted((set(names) | set(defaults)) - set(table))
  if unknown:
    raise ValueError(f"define_rec_run_flags: {unknown} are not RecRunConfig fields (expected "
                     f"some of {list(table)})")
  fields = {f.name: f.default for f in dataclasses.fields(RecRunConfig)}
  for name in [n for n in table if n in names or n in defaults]:
    define, kw, text = table[name]
    define(name, defaults.get(name, fields[name]), help=text, flag_values=fv, **kw)


def preset_embedding_dim(model: str, preset: str) -> int:
  """The embedding dim of `model`'s `preset` (what --embedding_dim=0 keeps)."""
  spec = types.SimpleNamespace(sparse_features=tuple(f"C{i}" for i in range(1, 27)),
                               rows_per_feature=(1,) * 26, num_dense=13)   # Criteo's shape
  return model_config(RecRunConfig(model=model, preset=preset), spec).tables()[0].dim


def normalize_settings(settings: dict[str, Any]) -> dict[str, Any]:
  """Run settings with `embedding_dim` 0 (the preset's) as the preset's dim, for settings
  saved before `RecRunConfig.run_settings` stored the effective dim and for the comparison
  on resume (`core.train.TrainConfig.normalize_settings`). Unknown presets stay as given.
  Rec settings without some a2a fields get their defaults (a run saved without a2a_mode
  sent float32, one without a2a_schedule used a constant bound), so a resume that turns
  either on is refused naming them."""
  if "model" in settings and any(n not in settings for n in A2A_FIELDS):
    settings = {**{n: _FIELD_DEFAULTS[n] for n in A2A_FIELDS}, **settings}
  if settings.get("embedding_dim") != 0 or "model" not in settings:
    return settings
  try:
    dim = preset_embedding_dim(settings["model"], settings.get("preset", "kaggle"))
  except (ValueError, OSError):   # an unknown preset, a searched:FILE not there: as given
    return settings
  return {**settings, "embedding_dim": dim}


PRESETS = {
    "kaggle": dlrm_lib.DLRMConfig.criteo_kaggle,
    "terabyte": dlrm_lib.DLRMConfig.criteo_terabyte,
}

# Per model: preset name -> constructor(rows, **overrides). "kaggle" is each model's
# Criteo default, "small" a tiny one for tests and smoke runs. Size patterns (PATTERNS,
# for scaling studies such as experiments.wukong_scaling) are parsed by `_pattern`:
#   wukong  "l<layers>_n<n>" (the paper's Criteo search space, n_F = n_L = n), optionally
#           "_k<rank>_w<mlp width>" (WukongConfig.family; defaults k24, w512), and
#           "scaled<i>" (rung i of wukong.SCALING_LADDER);
#   dlrm    "w<W>[_d<depth>]": bottom MLP (W, D), top MLP depth x W then 1 (depth 2), dim 16;
#   dcnv2   "x<layers>_r<rank>_w<W>[_d<depth>]": raw dense features, <layers> cross layers
#           of rank <rank> (0: full rank), deep MLP depth x W (depth 2), stacked, dim 16.
MODEL_PRESETS: dict[str, dict[str, Callable[..., Any]]] = {
    "dlrm": {
        **PRESETS,
        "small": lambda rows, **o: dlrm_lib.DLRMConfig(
            **{"embedding_dim": 16, "bottom_mlp": (64, 16), "top_mlp": (64, 1),
               "rows_per_feature": rows, **o}),
    },
    "dcnv2": {
        "kaggle": dcnv2_lib.DCNv2Config.criteo,
        # MLPerf Training DLRM-DCNv2: criteo's architecture, multi-hot pooling factors, big
        # tables in bf16 (rows from the data: MLPERF_ROWS for MLPerf-shaped data).
        "mlperf": dcnv2_lib.DCNv2Config.mlperf,
        "small": lambda rows, **o: dcnv2_lib.DCNv2Config(
            **{"embedding_dim": 16, "rows_per_feature": rows, "bottom_mlp": (64, 16),
               "num_cross_layers": 2, "cross_rank": 32, "deep_mlp": (64,), "top_mlp": (1,), **o}),
    },
    "dhen": {
        "kaggle": dhen_lib.DHENConfig.criteo,
        "dhen_2l": dhen_lib.DHENConfig.dhen_2l,
        "dhen_4l": dhen_lib.DHENConfig.dhen_4l,
        "dhen_8l": dhen_lib.DHENConfig.dhen_8l,
        # Every interaction kind once, so a smoke run exercises them all.
        "small": lambda rows, **o: dhen_lib.DHENConfig(
            **{"embedding_dim": 16, "rows_per_feature": rows, "bottom_mlp": (64, 16),
               "layers": (("dot", "self_attention", "linear"), ("dcn", "conv", "conv2d")),
               "width": 8, "dcn_rank": 16, "top_mlp": (64, 1), **o}),
    },
    "wukong": {
        "kaggle": wukong_lib.WukongConfig.criteo,
        "small": lambda rows, **o: wukong_lib.WukongConfig(
            **{"embedding_dim": 16, "rows_per_feature": rows, "bottom_mlp": (64, 32),
               "num_layers": 2, "num_fm": 4, "num_lcb": 4, "fm_rank": 8, "fm_mlp": (64,),
               "top_mlp": (64, 1), **o}),
    },
}


PATTERNS = {"dlrm": ["w<W>[_d<depth>]"], "dcnv2": ["x<layers>_r<rank>_w<W>[_d<depth>]"],
            "wukong": ["l<layers>_n<n>[_k<rank>][_w<width>]", "scaled<i>"]}


def _pattern(model: str, preset: str) -> Callable[..., Any] | None:
  """The constructor of a size-pattern preset (see MODEL_PRESETS' comment), or None."""
  if model == "wukong":
    if m := re.fullmatch(r"l(\d+)_n(\d+)(?:_k(\d+))?(?:_w(\d+))?", preset):
      layers, n = int(m[1]), int(m[2])
      rank, width = int(m[3] or 24), int(m[4] or 512)
      # k24, w512 is WukongConfig.criteo's own FMB / top MLP, so "l2_n8" is unchanged.
      return lambda rows, **o: wukong_lib.WukongConfig.family(rows, layers, n, n, rank, width, **o)
    if m := re.fullmatch(r"scaled(\d+)", preset):
      return lambda rows, **o: wukong_lib.WukongConfig.scaled(rows, int(m[1]), **o)
  if model == "dlrm" and (m := re.fullmatch(r"w(\d+)(?:_d(\d+))?", preset)):
    width, depth = int(m[1]), int(m[2] or 2)
    return lambda rows, **o: dlrm_lib.DLRMConfig(
        **{"num_dense": 13, "num_sparse": 26, "embedding_dim": 16, "rows_per_feature": rows,
           "bottom_mlp": (width, 16), "top_mlp": (width,) * depth + (1,), **o})
  if model == "dcnv2" and (m := re.fullmatch(r"x(\d+)_r(\d+)_w(\d+)(?:_d(\d+))?", preset)):
    layers, rank, width, depth = int(m[1]), int(m[2]), int(m[3]), int(m[4] or 2)
    return lambda rows, **o: dcnv2_lib.DCNv2Config(
        **{"num_dense": 13, "num_sparse": 26, "embedding_dim": 16, "rows_per_feature": rows,
           "bottom_mlp": (), "num_cross_layers": layers, "cross_rank": rank,
           "deep_mlp": (width,) * depth, "structure": "stacked", "top_mlp": (1,), **o})
  return None


def _with_embedding_dim(mcfg, dim: int):
  """The config at embedding dim `dim`; a bottom MLP that feeds embeddings ends at the
  new dim (DLRM, DHEN) or keeps its number of dense embeddings (Wukong)."""
  over: dict[str, Any] = {"embedding_dim": dim}
  if mcfg.num_dense > 0 and isinstance(mcfg, (dlrm_lib.DLRMConfig, dhen_lib.DHENConfig)):
    over["bottom_mlp"] = mcfg.bottom_mlp[:-1] + (dim,)
  if mcfg.num_dense > 0 and isinstance(mcfg, wukong_lib.WukongConfig):
    over["bottom_mlp"] = mcfg.bottom_mlp[:-1] + (mcfg.num_dense_embeddings * dim,)
  return dataclasses.replace(mcfg, **over)


def model_config(cfg: RecRunConfig, spec):
  """The model config for `cfg.model` / `cfg.preset` on data shaped like `spec`."""
  names = tuple(spec.sparse_features)
  rows = tuple(spec.rows_per_feature)
  if cfg.model == "logreg":
    if cfg.embedding_dim not in (0, 1):
      raise ValueError(f"--embedding_dim={cfg.embedding_dim}: logreg's tables are dim 1")
    if cfg.dtype != "float32" or cfg.fp8_layers:
      raise ValueError(f"--dtype={cfg.dtype!r}, --fp8_layers={cfg.fp8_layers!r} with "
                       "--model=logreg: logreg has no dense layers to run in low precision "
                       "(expected float32 and no FP8 layers)")
    return logreg_lib.LogRegConfig(num_dense=spec.num_dense, num_sparse=len(names),
                                   rows_per_feature=rows, feature_names=names)
  if cfg.model.startswith(SEARCHED):
    return searched_config(cfg, spec)
  if cfg.model not in MODEL_PRESETS:
    raise ValueError(f"--model={cfg.model!r}: expected one of "
                     f"{sorted(MODEL_PRESETS) + ['logreg', SEARCHED + 'FILE']}")
  presets = MODEL_PRESETS[cfg.model]
  make = presets.get(cfg.preset) or _pattern(cfg.model, cfg.preset)
  if make is None:
    extra = PATTERNS.get(cfg.model, [])
    raise ValueError(f"--preset={cfg.preset!r} for --model={cfg.model}: expected one of "
                     f"{sorted(presets) + extra}")
  over: dict[str, Any] = dict(num_dense=spec.num_dense, num_sparse=len(names), feature_names=names)
  if cfg.dtype != "float32":
    over["dtype"] = cfg.dtype
  if cfg.fp8_layers:
    if cfg.model not in ("dlrm", "dcnv2"):
      raise ValueError(f"--fp8_layers={cfg.fp8_layers!r} with --model={cfg.model}: FP8 layers "
                       "are wired into dlrm and dcnv2")
    over.update(fp8_layers=cfg.fp8_layers, fp8_recipe=cfg.fp8_recipe)
  if spec.num_dense == 0:
    over["bottom_mlp"] = ()
  mcfg = make(rows, **over)
  if cfg.embedding_dim < 0:
    raise ValueError(f"--embedding_dim={cfg.embedding_dim}: expected >= 0 (0: the preset's)")
  if cfg.embedding_dim and cfg.embedding_dim != mcfg.embedding_dim:
    mcfg = _with_embedding_dim(mcfg, cfg.embedding_dim)
  return mcfg


SEARCHED = "searched:"   # --model=searched:FILE, an architecture JSON (rec/models/searched.py)


def searched_config(cfg: RecRunConfig, spec) -> searched_lib.SearchedConfig:
  """The architecture of --model=searched:FILE on data shaped like `spec` (its embedding dim
  is the file's; --preset does not apply)."""
  path = cfg.model[len(SEARCHED):]
  arch = searched_lib.load_arch(path)
  if cfg.fp8_layers:
    raise ValueError(f"--fp8_layers={cfg.fp8_layers!r} with --model={cfg.model}: FP8 layers "
                     "are wired into dlrm and dcnv2")
  if cfg.embedding_dim and cfg.embedding_dim != arch.get("embedding_dim"):
    raise ValueError(f"--embedding_dim={cfg.embedding_dim} with --model={cfg.model}: the file "
                     f"sets embedding_dim={arch.get('embedding_dim')}; expected 0 or that value")
  return searched_lib.SearchedConfig.from_arch(
      arch, num_dense=spec.num_dense, num_sparse=len(spec.sparse_features),
      rows_per_feature=tuple(spec.rows_per_feature), feature_names=tuple(spec.sparse_features),
      dtype=cfg.dtype, where=path)


MODELS = {dlrm_lib.DLRMConfig: dlrm_lib.DLRM, dcnv2_lib.DCNv2Config: dcnv2_lib.DCNv2,
          dhen_lib.DHENConfig: dhen_lib.DHEN, wukong_lib.WukongConfig: wukong_lib.Wukong,
          logreg_lib.LogRegConfig: logreg_lib.LogReg,
          searched_lib.SearchedConfig: searched_lib.SearchedModel}


def build_model_fn(cfg: RecRunConfig, spec) -> tuple[Any, list[TableConfig], str | float]:
  """Returns (model constructor taking rngs, its tables, init scale of the tables)."""
  mcfg = model_config(cfg, spec)
  model_cls = MODELS[type(mcfg)]
  init_scale = 0.0 if cfg.model == "logreg" else "dlrm"
  return (lambda rngs: model_cls(mcfg, rngs)), mcfg.tables(), init_scale


def model_stats(task: RecTask, spec, batch: int = 64) -> dict[str, float]:
  """Dense and embedding parameter counts and forward GFLOPs/example of the dense model
  (XLA's count; the embedding lookup is memory traffic and not counted)."""
  tables = task.collection.tables
  dense = flops_lib.count_params(nnx.eval_shape(lambda: task.model_fn(nnx.Rngs(0))))
  shapes = (spec.num_dense, len(tables), tables[0].dim)
  gflops = flops_lib.model_flops_per_example(task.model_fn, shapes, batch=batch) / 1e9
  return {"dense_params": dense, "embedding_params": sum(t.num_rows * t.dim for t in tables),
          "gflops_per_example": gflops}


@functools.cache
def _device_budget() -> tuple[int, str] | None:
  # Read once per process, so the plan and its printout see one number.
  mem = memory_lib.device_memory()
  if mem is None:
    return None
  return memory_lib.per_device_budget(mem), (
      f"{mem.source}, per device" if mem.host_ram else
      f"{mem.source} less {memory_lib.GPU_HEADROOM:.0%} headroom")


def plan_budget(cfg: RecRunConfig) -> tuple[int, str]:
  """(bytes per device, where they come from) of the planner's budget: --memory_budget_gb
  GiB, or by default the device's memory (`core.memory.per_device_budget`: a GPU's
  bytes_limit less GPU_HEADROOM for the dense model, activations and XLA's temporaries,
  which the planner does not count; the CPU's available RAM divided over its devices)."""
  if cfg.memory_budget_gb is not None:
    return int(cfg.memory_budget_gb * 2**30), "--memory_budget_gb"
  got = _device_budget()
  if got is None:
    raise ValueError("--memory_budget_gb: not given, and this device reports no memory size; "
                     "expected a per-device budget in GiB")
  return got


def make_plan(cfg: RecRunConfig, tables: list[TableConfig], num_devices: int,
              optimizer: opt_lib.SparseOptimizer) -> planner_lib.Plan:
  overrides = planner_lib.parse_overrides(cfg.sharding_overrides) if cfg.sharding_overrides else {}
  planner_lib.validate_overrides(overrides, tables)
  if cfg.sharding == "auto":
    # A row-wise optimizer keeps one accumulator per row per column chunk under cw (as
    # TorchRec does), which changes the update; auto plans keep it exact by leaving cw out.
    kinds = None
    if isinstance(optimizer, opt_lib.RowWiseAdagrad):
      kinds = tuple(k for k in planner_lib.AUTO_KINDS if k != ShardingKind.COLUMN_WISE)
    return planner_lib.plan(
        tables, num_devices, memory_budget_bytes=plan_budget(cfg)[0],
        batch_size=cfg.batch_size, overrides=overrides, kinds=kinds,
        optimizer_state_bytes_per_row=optimizer.state_bytes_per_row)
  try:
    kind = ShardingKind(cfg.sharding)
  except ValueError:
    raise ValueError(f"--sharding={cfg.sharding!r}: expected auto or one of "
                     f"{[k.value for k in ShardingKind]}") from None
  plan = planner_lib.uniform_plan(tables, kind, num_devices)
  if overrides:
    for name, k in overrides.items():
      one = [t for t in tables if t.name == name]
      plan[name] = planner_lib.uniform_plan(one, ShardingKind(k), num_devices)[name]
  return plan


def check_exchange(cfg: RecRunConfig, plan: planner_lib.Plan, num_devices: int) -> None:
  """A compressed exchange needs one: an all-to-all (tw, cw, twrw tables) or a
  reduce-scatter (rw) over 2 or more devices; else a ValueError naming the flags."""
  kinds = sorted({ShardingKind(p.kind).value for p in plan.values()})
  if num_devices > 1 and set(kinds) & set(COMPRESSED_KINDS):
    return
  why = (f"--mesh={cfg.mesh!r} gives the embedding tables 1 device" if num_devices == 1 else
         f"--sharding={cfg.sharding} placed every table {'/'.join(kinds)}")
  raise ValueError(
      f"--a2a_mode={cfg.a2a_mode}: {why}, so no embedding exchange exists to compress; "
      f"expected tables placed {'|'.join(COMPRESSED_KINDS)} on 2 or more devices (e.g. "
      "--sharding=tw), or --a2a_mode=none")


# Sharding kinds whose exchange a2a_compression compresses (dp and sptt groups are not).
COMPRESSED_KINDS = ("tw", "cw", "twrw", "rw")


def build_run(cfg: RecRunConfig, devices=None, sources=None, a2a_compression=None,
              data_workers: int = 0):
  """Returns (task, train source, eval source, plan, mesh). `sources`: (train, eval) sources
  to use instead of those of cfg.data (e.g. one split to predict on). `a2a_compression`: an
  `a2a_compression.A2ACompression` for the collection's exchange (a study's table-wise
  factors or schedule) instead of cfg's --a2a_* settings (`RecRunConfig.a2a_spec`; None and
  --a2a_mode=none: float32); a plan with no exchange to compress is an error.
  `data_workers` > 0: train batches are drawn in that many Grain worker processes
  (`rec.data.workers.WorkerSource`), which also run RecD's dedup (--dedup_features)."""
  cfg.validate()
  mesh = mesh_lib.make_mesh(cfg.mesh, devices, rules=mesh_lib.REC_RULES)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  for what, b in (("batch_size", cfg.batch_size), ("eval_batch_size", cfg.eval_batch_size)):
    if b % n:
      raise ValueError(f"--{what}={b} is not divisible by the {n} devices of --mesh={cfg.mesh!r}")
  if sources is not None:
    train_src, eval_src = sources
  else:
    train_src, eval_src = sources_lib.make_sources(
        cfg.data, cfg.batch_size, eval_batch_size=cfg.eval_batch_size, num_rows=cfg.num_rows,
        seed=cfg.seed, bad_lines=cfg.bad_lines, eval_batches=cfg.eval_batches,
        csv_label=cfg.csv_label, csv_dense=cfg.csv_dense, csv_categorical=cfg.csv_categorical,
        mesh=mesh, days=cfg.days or None, **dict(zip(
            ("shard_index", "num_shards"), mesh_lib.process_batch_share(mesh, mesh_lib.REC_RULES))))
  model_fn, tables, init_scale = build_model_fn(cfg, train_src.spec)
  if cfg.storage != "fp32":
    tables = [dataclasses.replace(t, storage=cfg.storage_spec()) for t in tables]
  sparse_opt = opt_lib.get_sparse_optimizer(cfg.sparse_optimizer, cfg.embedding_learning_rate)
  plan = make_plan(cfg, tables, n, sparse_opt)
  if a2a_compression is not None and cfg.a2a_mode != "none":
    raise ValueError(f"build_run: a2a_compression={a2a_compression} and --a2a_mode="
                     f"{cfg.a2a_mode}; expected one of the two")
  if a2a_compression is None:
    a2a_compression = cfg.a2a_spec([t.name for t in tables])
  if a2a_compression is not None:
    check_exchange(cfg, plan, n)
  coll = EmbeddingCollection(tables, plan, mesh, sparse_opt, init_scale=init_scale,
                             storage_seed=cfg.seed, dedup=cfg.dedup_spec(tables),
                             a2a_compression=a2a_compression,
                             bag_sizes=getattr(train_src, "bag_sizes", None))
  dense_tx = make_dense_optimizer(cfg.dense_optimizer, cfg.learning_rate)
  if cfg.fp8_layers and cfg.fp8_recipe == "delayed":   # amax histories ride their gradients
    dense_tx = fp8_lib.with_fp8_history(dense_tx)
  task = RecTask(model_fn, coll, dense_tx, mesh)
  if data_workers:
    dd = coll.dedup and dedup_lib.DedupTransform(coll.dedup_features, coll.dedup.capacity,
                                                 task.dedup_shards(), coll.dedup.on_overflow)
    train_src = workers_lib.WorkerSource(train_src, dd or None, data_workers)
  return task, train_src, eval_src, plan, mesh


def steps_for(epochs: float, train_src) -> int:
  """Steps of `epochs` passes over the train source; with several processes, over the
  smallest process share (every process must run the same number of steps)."""
  if train_src.num_batches is None:
    raise ValueError("--epochs needs a finite data set; synthetic data is infinite: use --steps")
  nb = train_src.num_batches
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    nb = int(np.min(multihost_utils.process_allgather(np.int64(nb))))
  return max(1, math.floor(epochs * nb))
