"""A recommendation run's settings (`RecRunConfig`, a typed tree of frozen dataclasses on
`core.config`) and how a run is built from them: data sources, model, plan, task.

  RecRunConfig
    model      RecModelConfig   model, preset, embedding_dim, dtype, fp8_layers, fp8_recipe
    data       RecDataConfig    data, num_rows, bad_lines, days, csv_label, csv_dense,
                                csv_categorical, eval_batches, group_by
    embedding  EmbeddingConfig  storage (a StorageSpec), sharding, sharding_overrides,
                                memory_budget_gb, host_memory_gb, host_prefetch,
                 dedup  DedupConfig  dedup_features, dedup_capacity
                 a2a    A2AConfig    a2a_mode, a2a_error_bound, a2a_grad_error_bound,
                                     a2a_bits, a2a_table_factors, a2a_schedule
    train      RecTrainConfig   batch_size, eval_batch_size, dense_optimizer, learning_rate,
                                sparse_optimizer, embedding_learning_rate
    mesh, seed

Each leaf is a setting defined once (here, or in `core.settings` for those the LM entry
points share), so a leaf's flat name is its flag: `make_run(batch_size=64)`,
`replace_run(cfg, storage="int8_cache:lru:0.1")`, `define_run_flags("model", "data",
batch_size=1024)` in an entry point's define_flags() and `run_from_flags()` in its main.
The flags --cache_policy and --cache_fraction (and `make_run`'s cache_policy= /
cache_fraction= / cache_ways=) fold into the storage spec. `experiments/train_rec.py` is the
flag front end; notebooks and tests call `build_run` with a config.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Sequence

import jax
import numpy as np

from core import config
from core import errors
from core import memory as memory_lib
from core import mesh as mesh_lib
from core import settings as core_settings
from core import train as train_loop
from rec import metrics as metrics_lib
from rec.data import dedup as dedup_lib
from rec.data import lookahead as lookahead_lib
from rec.data import sources as sources_lib
from rec.data import workers as workers_lib
from rec.data.dedup import DedupSpec
from rec.embedding import a2a_compression as a2a_lib
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding import rowwise_storage
from rec.embedding import storage_spec as storage_spec_lib
from rec.embedding.collection import EmbeddingCollection
from rec.embedding.config import ShardingKind, TableConfig
from rec.embedding.storage_spec import StorageSpec
from rec.layers import fp8 as fp8_lib
from rec.train_lib import RecTask, make_dense_optimizer

DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam", "adamw", "torch_adagrad")
SHARDINGS = ("auto", "dp", "tw", "rw", "cw", "twrw")
# Settings that only decide where the state lies (devices, mesh, the embedding plan): a
# checkpoint written under others is resharded on restore (RecTask.restore_checkpoint), so
# a resume or a prediction may change them.
LAYOUT_SETTINGS = ("mesh", "sharding", "sharding_overrides", "memory_budget_gb",
                   "host_memory_gb")

# Settings of a rec run (those shared with the LM entry points are in core.settings).
MODEL = config.setting(
    "model", "string", "Model family: dlrm | dcnv2 | dhen | wukong | logreg, or searched:FILE "
    "(an architecture JSON of rec/models/searched.py, e.g. one experiments.rankitect found).")
EMBEDDING_DIM = config.setting("embedding_dim", "integer", "Embedding dim (of every model); "
                               "0 keeps the preset's.", lower=0)
FP8_LAYERS = config.setting(
    "fp8_layers", "string", "Dense layers whose matmuls run in FP8 (dlrm, dcnv2): 'all', or "
    "patterns such as top_mlp.*,cross.0 (rec/layers/fp8.py).")
FP8_RECIPE = config.setting(
    "fp8_recipe", "enum", "FP8 scaling: per tensor or per row (current amax), or per tensor "
    "from an amax history.", choices=tuple(fp8_lib.RECIPES))
NUM_ROWS = config.setting("num_rows", "integer", "Hashed rows per sparse feature.", lower=1)
BAD_LINES = config.setting("bad_lines", "enum", "Malformed data lines: stop, or skip and "
                           "count.", choices=("error", "skip"))
DAYS = config.setting(
    "days", "string", "--data=criteo:DIR with Terabyte day_N[.gz] files: the days to use, "
    "e.g. 0-2 or 0,3,23 (empty: every day present); day 23 (else the last day given) is "
    "split into validation and test halves.", none_ok=True)
CSV_LABEL = config.setting("csv_label", "string", "--data=csv:DIR: label column; empty = the "
                           "first named label/click/clicked/y.")
CSV_DENSE = config.setting("csv_dense", "string", "--data=csv:DIR: dense columns, e.g. I1,I2; "
                           "empty = inferred (numeric I<n> columns), none = no dense.")
CSV_CATEGORICAL = config.setting("csv_categorical", "string", "--data=csv:DIR: categorical "
                                 "columns, e.g. C1,C2; empty = every other column but id.")
GROUP_BY = config.setting(
    "group_by", "string", "Evaluation by group: a sparse feature whose value groups the eval "
    "examples (e.g. site_id or app_id for --data=avazu:DIR, C1..C26 for Criteo, a user "
    "feature for sessions); adds gAUC (impression-weighted AUC per group) and NE by slice "
    f"(the {metrics_lib.TOP_SLICES} biggest groups and the rest) to the eval metrics. Groups "
    "are the feature's hashed rows (its whole bag for multi-id features). Empty: none "
    "(experiments.predict: the run's own).")
EVAL_BATCH_SIZE = config.setting("eval_batch_size", "integer", "Global eval batch size.",
                                 lower=1)
DENSE_OPTIMIZER = config.setting(
    "dense_optimizer", "enum", "Optimizer of the dense part: optax's sgd, adagrad (accumulator "
    "from 0.1, eps 1e-7 inside the root), adam, adamw; or torch_adagrad, torch.optim.Adagrad's "
    "update (accumulator from 0, g / (sqrt(A) + 1e-8)), the MLPerf DLRM-DCNv2 reference's.",
    choices=DENSE_OPTIMIZERS)
SPARSE_OPTIMIZER = config.setting("sparse_optimizer", "enum", "Sparse embedding optimizer.",
                                  choices=tuple(opt_lib.OPTIMIZER_NAMES))
EMBEDDING_LEARNING_RATE = config.setting("embedding_learning_rate", "float",
                                         "Embedding learning rate.")
SHARDING = config.setting("sharding", "enum", "Embedding sharding: auto = planner.",
                          choices=SHARDINGS)
SHARDING_OVERRIDES = config.setting("sharding_overrides", "string", "Per-table kinds, e.g. "
                                    "C1=tw,C3=rw.")
MEMORY_BUDGET_GB = config.setting(
    "memory_budget_gb", "float", "Per-device embedding memory budget for the planner "
    "(default: the device's memory: a GPU's bytes_limit less "
    f"{memory_lib.GPU_HEADROOM:.0%}, or the available RAM divided over the CPU devices).",
    none_ok=True)
HOST_MEMORY_GB = config.setting(
    "host_memory_gb", "float", "Host memory per device (GiB) for the embedding host tier "
    "(rec/embedding/host_tier.py): with --sharding=auto, tables the device budget cannot hold "
    "keep their rows and optimizer state in pinned host memory and their hot rows in a device "
    "cache (LFU, 5% of the rows; a *_cache --storage keeps its own cache), biggest and least "
    "looked-up first. 0: no tier.", lower=0, none_ok=True)

HOST_PREFETCH = config.setting(
    "host_prefetch", "bool", "The host tier's lookahead: each train step ends by bringing the "
    "rows the next batch reads into the device caches of the tables on the host tier "
    "(*_cache...@host, or moved there by --host_memory_gb), evicting by the cache policy, so "
    "the next step's lookups read no host memory where the rows fit (FBGEMM's TBE prefetch). "
    "fp32_cache trains as without it, bit for bit; int8 / int4 caches round other rows. "
    "Needs a table on the host tier.")


def _parse_storage(text: str) -> StorageSpec:
  try:
    return StorageSpec.parse(text, "--storage")
  except ValueError as e:   # the caller names the flag or the file's field and the value
    msg, named = str(e), f"--storage={text!r}: "
    raise ValueError(msg[len(named):] if msg.startswith(named) else msg) from None


STORAGE = config.setting(
    "storage", "string", "Embedding row storage: KIND[:lfu|lru[:FRACTION[:WAYS]]], the cache "
    "suffix for a *_cache kind (such as int8_cache:lru). Kinds: "
    f"{' | '.join(storage_spec_lib.kinds())}. bf16 rounds updates to nearest, bf16_sr "
    "stochastically; intN are FBGEMM row-wise rows updated with stochastic rounding; *_cache "
    "adds an fp32 cache of the hot rows (arXiv 2010.11305), fp32_cache keeps float32 rows "
    "behind it; a *_cache kind ending in @host (fp32_cache:lfu:0.05@host) keeps every table's "
    "rows and optimizer state in host memory, the cache on the device (the host tier; "
    "--host_memory_gb moves only the tables that do not fit).", parse=_parse_storage,
    format=str)
CACHE_POLICY = config.setting(
    "cache_policy", "enum", "--storage=*_cache given without its :policy: which rows the "
    "cache keeps, the most frequently or the most recently used.", choices=("lfu", "lru"))
CACHE_FRACTION = config.setting(
    "cache_fraction", "float", "--storage=*_cache given without its :fraction: cache size as "
    "a fraction of each device's rows (the paper: int8 0.05, int4 0.01).")
DEDUP_FEATURES = config.setting(
    "dedup_features", "string", "RecD (arXiv 2211.05239): features looked up on each "
    "batch's distinct bags, e.g. C1,C3 (user features that repeat across a session's "
    "samples); empty: off.")
DEDUP_CAPACITY = config.setting(
    "dedup_capacity", "integer", "RecD: distinct bags per device and feature; a batch with "
    "more runs plain (metric dedup_fallback). 0: the next power of two that holds them.",
    lower=0)
A2A_MODE = config.setting(
    "a2a_mode", "enum", "Error-bounded lossy compression of the embedding exchange (arXiv "
    "2407.04272): the all-to-all of tw / cw / twrw tables and the reduce-scatter of rw tables "
    "send fixed-rate codes, forward and (--a2a_grad_error_bound) backward. abs: every value "
    "within --a2a_error_bound; rel: within it times its row's value range; none: float32.",
    choices=("none", *a2a_lib.MODES))
A2A_ERROR_BOUND = config.setting("a2a_error_bound", "float", "--a2a_mode: bound of the "
                                 "pooled embeddings sent (> 0).")
A2A_GRAD_ERROR_BOUND = config.setting(
    "a2a_grad_error_bound", "float", "--a2a_mode: bound of their gradients (> 0); unset: the "
    "gradients go in float32.", none_ok=True)
A2A_BITS = config.setting("a2a_bits", "integer", "--a2a_mode: code width, 4, 8 or 16 bits "
                          "per value (plus a 6-byte row header).", lower=4)
A2A_TABLE_FACTORS = config.setting(
    "a2a_table_factors", "string", "--a2a_mode: the dual-level adaptive bound's table level: "
    "factors of both bounds per table, e.g. C1=0.5,C3=2 (a table not named: 1).")
A2A_SCHEDULE = config.setting(
    "a2a_schedule", "string", "--a2a_mode: the dual-level adaptive bound's iteration level: "
    "a factor of both bounds per train step (counted from 0): constant (1), or "
    "KIND:START:END:STEPS, e.g. linear:2:0.5:1000: linear and cosine go from START at step 0 "
    "to END at step STEPS, step holds START before step STEPS; END from step STEPS on.")


@dataclasses.dataclass(frozen=True)
class RecModelConfig:
  """Which model, at which size and precision."""
  model: str = MODEL.field("dlrm")        # dlrm | dcnv2 | dhen | wukong | logreg | searched:FILE
  preset: str = core_settings.PRESET.field("kaggle")   # MODEL_PRESETS; kaggle: the Criteo one
  embedding_dim: int = EMBEDDING_DIM.field(0)   # 0: the preset's
  dtype: str = core_settings.DTYPE.field("float32")
  fp8_layers: str = FP8_LAYERS.field("")
  fp8_recipe: str = FP8_RECIPE.field("tensor")


@dataclasses.dataclass(frozen=True)
class RecDataConfig:
  """The data (rec.data.sources) and how it is read."""
  data: str = core_settings.DATA.field("synthetic")
  num_rows: int = NUM_ROWS.field(100_000)
  bad_lines: str = BAD_LINES.field("error")
  days: str = DAYS.field("")                        # criteo:DIR Terabyte days; "": all present
  csv_label: str = CSV_LABEL.field("")
  csv_dense: str = CSV_DENSE.field("")
  csv_categorical: str = CSV_CATEGORICAL.field("")
  eval_batches: int = core_settings.EVAL_BATCHES.field(8)
  group_by: str = GROUP_BY.field("")                # a sparse feature's name; "": no groups


@dataclasses.dataclass(frozen=True)
class DedupConfig:
  """RecD's lookups on each batch's distinct bags (rec.data.dedup)."""
  dedup_features: str = DEDUP_FEATURES.field("")
  dedup_capacity: int = DEDUP_CAPACITY.field(0)


@dataclasses.dataclass(frozen=True)
class A2AConfig:
  """The compressed embedding exchange (arXiv 2407.04272; `RecRunConfig.a2a_spec`)."""
  a2a_mode: str = A2A_MODE.field("none")
  a2a_error_bound: float = A2A_ERROR_BOUND.field(1e-3)
  a2a_grad_error_bound: float | None = A2A_GRAD_ERROR_BOUND.field(None)
  a2a_bits: int = A2A_BITS.field(8)
  a2a_table_factors: str = A2A_TABLE_FACTORS.field("")
  a2a_schedule: str = A2A_SCHEDULE.field("constant")


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
  """The embedding tables: row storage, placement, RecD and the exchange."""
  storage: StorageSpec = STORAGE.field(StorageSpec("fp32"))
  sharding: str = SHARDING.field("auto")
  sharding_overrides: str = SHARDING_OVERRIDES.field("")
  memory_budget_gb: float | None = MEMORY_BUDGET_GB.field(None)   # None: the device's
  host_memory_gb: float | None = HOST_MEMORY_GB.field(0.0)        # 0 (or None): no host tier
  host_prefetch: bool = HOST_PREFETCH.field(False)
  dedup: DedupConfig = config.section(DedupConfig)
  a2a: A2AConfig = config.section(A2AConfig)


@dataclasses.dataclass(frozen=True)
class RecTrainConfig:
  """Batch sizes and optimizers."""
  batch_size: int = core_settings.BATCH_SIZE.field(2048)
  eval_batch_size: int = EVAL_BATCH_SIZE.field(8192)
  dense_optimizer: str = DENSE_OPTIMIZER.field("adagrad")
  learning_rate: float = core_settings.LEARNING_RATE.field(0.05)
  sparse_optimizer: str = SPARSE_OPTIMIZER.field("rowwise_adagrad")
  embedding_learning_rate: float = EMBEDDING_LEARNING_RATE.field(0.05)


@dataclasses.dataclass(frozen=True)
class RecRunConfig:
  """A recommendation run's settings (module docstring); `make_run` builds one by flat
  names."""
  model: RecModelConfig = config.section(RecModelConfig)
  data: RecDataConfig = config.section(RecDataConfig)
  embedding: EmbeddingConfig = config.section(EmbeddingConfig)
  train: RecTrainConfig = config.section(RecTrainConfig)
  mesh: str = core_settings.MESH.field("-1")
  seed: int = core_settings.SEED.field(0)

  def run_settings(self) -> dict[str, Any]:
    """The config as a run's saved settings (`core.train.TrainConfig.settings`): every leaf
    by flat name, the storage as its flags' strings and numbers (storage: the kind, with
    @host on the host tier; cache_policy, cache_fraction; cache_ways only when not the
    default), `embedding_dim` as the dim the model gets, so the default 0 (the preset's)
    and the preset's dim given explicitly are the same setting."""
    return normalize_settings(self.flat_settings())

  def flat_settings(self) -> dict[str, Any]:
    """Every setting by flat name as JSON-able strings and numbers (a study's run record,
    results.json's "config"): the storage as its flags' storage (the kind, `KIND@host` on
    the host tier), cache_policy and cache_fraction (cache_ways only when not the default);
    `make_run` reads them back into the same spec."""
    out = config.flat(self)
    spec = out.pop("storage")
    out.update(storage=f"{spec.kind}@host" if spec.host else spec.kind,
               cache_policy=spec.cache_policy or _CACHE_FLAG_DEFAULTS[0],
               cache_fraction=spec.cache_fraction if spec.cached else _CACHE_FLAG_DEFAULTS[1])
    if spec.cached and spec.cache_ways != rowwise_storage.DEFAULT_WAYS:
      out["cache_ways"] = spec.cache_ways
    return out

  def validate(self) -> None:
    """Raises a ValueError naming the flag of the first setting that cannot train: a
    learning rate that is not finite and > 0, an unknown optimizer, a size < 1 (a config
    made by `make_run` has its values checked already; one built field by field not)."""
    t, e = self.train, self.embedding
    train_loop.check_learning_rate("--learning_rate", t.learning_rate)
    train_loop.check_learning_rate("--embedding_learning_rate", t.embedding_learning_rate)
    if t.dense_optimizer not in DENSE_OPTIMIZERS:
      raise ValueError(f"--dense_optimizer={t.dense_optimizer!r}: expected one of "
                       f"{list(DENSE_OPTIMIZERS)}")
    if t.sparse_optimizer not in opt_lib.OPTIMIZER_NAMES:
      raise ValueError(f"--sparse_optimizer={t.sparse_optimizer!r}: expected one of "
                       f"{list(opt_lib.OPTIMIZER_NAMES)}")
    for name, value in (("batch_size", t.batch_size), ("eval_batch_size", t.eval_batch_size),
                        ("num_rows", self.data.num_rows),
                        ("eval_batches", self.data.eval_batches)):
      if value < 1:
        raise ValueError(f"--{name}={value}: expected >= 1")
    if e.memory_budget_gb is not None and not (math.isfinite(e.memory_budget_gb)
                                               and e.memory_budget_gb > 0):
      raise ValueError(f"--memory_budget_gb={e.memory_budget_gb}: expected a number > 0")
    if e.host_memory_gb is not None and not (math.isfinite(e.host_memory_gb)
                                             and e.host_memory_gb >= 0):
      raise ValueError(f"--host_memory_gb={e.host_memory_gb}: expected a number >= 0 (0: no "
                       "host tier)")
    if self.model.fp8_recipe not in fp8_lib.RECIPES:
      raise ValueError(f"--fp8_recipe={self.model.fp8_recipe!r}: expected one of "
                       f"{list(fp8_lib.RECIPES)}")
    if not isinstance(e.storage, StorageSpec):
      raise ValueError(f"--storage={e.storage!r}: expected a StorageSpec (make_run and "
                       "StorageSpec.parse read a storage name)")
    self.a2a_spec()
    if e.dedup.dedup_capacity < 0:
      raise ValueError(f"--dedup_capacity={e.dedup.dedup_capacity}: expected >= 0 (0: the "
                       "next power of two that holds a batch's distinct bags)")

  def dedup_spec(self, tables) -> DedupSpec | None:
    """RecD's setting from --dedup_features / --dedup_capacity (None: off); names are
    checked against the tables."""
    d = self.embedding.dedup
    return DedupSpec.from_flags(d.dedup_features, d.dedup_capacity,
                                known=[t.name for t in tables])

  def a2a_spec(self, tables: Sequence[str] = ()) -> a2a_lib.A2ACompression | None:
    """The compressed embedding exchange from --a2a_mode, --a2a_error_bound,
    --a2a_grad_error_bound, --a2a_bits and the dual-level adaptive bound's
    --a2a_table_factors and --a2a_schedule (None: --a2a_mode=none); errors name the flag,
    and `tables` (names), when given, are the names --a2a_table_factors may use. With
    --a2a_mode=none any of them other than its default is an error, not ignored."""
    a = self.embedding.a2a
    if a.a2a_mode == "none":
      given = [f"--{n}={getattr(a, n)}" for n in A2A_FIELDS[1:]
               if getattr(a, n) != _FIELD_DEFAULTS[n]]
      if given:
        raise ValueError(f"{', '.join(given)} with --a2a_mode=none: no exchange is compressed; "
                         "expected --a2a_mode=abs|rel, or the default")
      return None
    if a.a2a_mode not in a2a_lib.MODES:
      raise ValueError(f"--a2a_mode={a.a2a_mode!r}: expected none or one of "
                       f"{list(a2a_lib.MODES)}")
    return a2a_lib.A2ACompression(
        a.a2a_mode, a.a2a_error_bound, a.a2a_grad_error_bound, a.a2a_bits,
        table_factors=a2a_lib.parse_table_factors(a.a2a_table_factors),
        schedule=a2a_lib.parse_schedule(a.a2a_schedule)).check(tables)

  def without_a2a(self) -> RecRunConfig:
    """This config with the embedding exchange in float32 (the --a2a_* settings at their
    defaults), e.g. a comparison's baseline."""
    return dataclasses.replace(self, embedding=dataclasses.replace(self.embedding,
                                                                   a2a=A2AConfig()))


A2A_FIELDS = tuple(n for n in config.leaves(A2AConfig))
# Settings that runs saved by earlier versions lack; such a run had their defaults.
LATER_FIELDS = A2A_FIELDS + ("group_by", "host_memory_gb", "host_prefetch")
_LEAVES = config.leaves(RecRunConfig)
_FIELD_DEFAULTS = {n: leaf.default for n, leaf in _LEAVES.items()}
_CACHE_FLAGS = ("cache_policy", "cache_fraction")
_CACHE_FLAG_DEFAULTS = ("lfu", 0.05)   # what a bare --storage=*_cache gets from the flags
# The flat names of a run's settings (`make_run`'s keywords, `run_settings`' keys, the
# names `define_run_flags` takes): every leaf, and the storage's cache flags.
RUN_FIELDS = tuple(_LEAVES) + _CACHE_FLAGS


def _with_cache(spec: StorageSpec, cache_policy: str | None = None,
                cache_fraction: float | None = None, cache_ways: int | None = None
                ) -> StorageSpec:
  """`spec` with the cache settings given (checked, errors naming --cache_policy /
  --cache_fraction, whatever the kind); a kind without a cache ignores them."""
  flag = {"cache_policy": "--cache_policy", "cache_fraction": "--cache_fraction",
          "cache_ways": "cache_ways", "kind": "--storage"}
  name = lambda f, v: f"{flag[f]}={v!r}"
  policy, fraction, ways = cache_policy, cache_fraction, cache_ways
  rowwise_storage.check_cache(
      policy if policy is not None else (spec.cache_policy or _CACHE_FLAG_DEFAULTS[0]),
      fraction if fraction is not None else (spec.cache_fraction or _CACHE_FLAG_DEFAULTS[1]),
      ways if ways is not None else (spec.cache_ways or rowwise_storage.DEFAULT_WAYS), name)
  if not spec.cached:
    return spec
  return StorageSpec(spec.kind, policy or spec.cache_policy,
                     float(fraction) if fraction is not None else spec.cache_fraction,
                     ways or spec.cache_ways, spec.tier)


def _fold(cfg: RecRunConfig, cache: dict[str, Any]) -> RecRunConfig:
  cache = {k: v for k, v in cache.items() if v is not None}
  if not cache:
    return cfg
  spec = _with_cache(cfg.embedding.storage, **cache)
  return dataclasses.replace(cfg, embedding=dataclasses.replace(cfg.embedding, storage=spec))


def make_run(**flat: Any) -> RecRunConfig:
  """A RecRunConfig from settings by flat name (the others at their defaults), each checked
  (`core.config.build`; errors name the flag): a leaf's name, or
  cache_policy= / cache_fraction= / cache_ways=, which fold into the storage spec
  (`storage` may be the spec or its text, e.g. "int8_cache:lru:0.1")."""
  cache = {n: flat.pop(n) for n in (*_CACHE_FLAGS, "cache_ways") if n in flat}
  return _fold(config.build(RecRunConfig, **flat), cache)


def replace_run(cfg: RecRunConfig, **flat: Any) -> RecRunConfig:
  """`cfg` with the settings in `flat` (`make_run`'s names) changed, each checked."""
  cache = {n: flat.pop(n) for n in (*_CACHE_FLAGS, "cache_ways") if n in flat}
  return _fold(config.replace(cfg, **flat), cache)


def define_run_flags(*names: str, flag_values=None, **defaults: Any) -> None:
  """Defines the flags of RecRunConfig settings for an entry point's define_flags(): those
  in `names` at the config's defaults and those in `defaults` at the entry point's own
  (`core.config.define_flags(RecRunConfig, only=...)`, with --config); with --storage also
  --cache_policy and --cache_fraction, which fold into a bare --storage=*_cache.
  `flag_values`: where (default absl's FLAGS)."""
  from absl import flags
  flags.disclaim_key_flags()   # the flags are the calling entry point's: its --help lists them
  unknown = sorted((set(names) | set(defaults)) - set(RUN_FIELDS))
  if unknown:
    raise ValueError(f"define_run_flags: {unknown} are not RecRunConfig fields (expected "
                     f"some of {list(RUN_FIELDS)})")
  cache = {n: defaults.pop(n, d) for n, d in zip(_CACHE_FLAGS, _CACHE_FLAG_DEFAULTS)}
  only = [n for n in names if n not in _CACHE_FLAGS]
  config.define_flags(RecRunConfig, only=only, flag_values=flag_values, **defaults)
  if "storage" in only or "storage" in defaults or set(_CACHE_FLAGS) & set(names):
    config.define_flags(None, *_CACHE_FLAGS, flag_values=flag_values, **cache)


def run_from_flags(flag_values=None, **overrides: Any) -> RecRunConfig:
  """The RecRunConfig of the entry point's flags (`define_run_flags`): each setting from,
  last wins, its default, its flag's default, the --config file, the command line, then
  `overrides` (`make_run`'s names: the values the entry point fixes). A setting without a
  flag keeps the config's default. --cache_policy / --cache_fraction fold into the storage
  (`fold_cache_flags`) unless `overrides` fixes the storage; cache settings in `overrides`
  fold in after them."""
  cache = {n: overrides.pop(n) for n in (*_CACHE_FLAGS, "cache_ways") if n in overrides}
  cfg = config.from_flags(RecRunConfig, flag_values, **overrides)
  if "storage" not in overrides:
    cfg = fold_cache_flags(cfg, flag_values)
  return _fold(cfg, cache)


def fold_cache_flags(cfg: RecRunConfig, flag_values=None) -> RecRunConfig:
  """`cfg` with the flags --cache_policy / --cache_fraction folded into a bare
  --storage=*_cache (what they meant before the storage took :policy:fraction); with a
  --storage that gives them, either flag given is an error. Any other storage (a --config
  file's, one without a cache) keeps its own."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  if "storage" not in fv or not all(n in fv for n in _CACHE_FLAGS):
    return cfg
  given = [n for n in _CACHE_FLAGS if fv[n].present]
  text = fv["storage"].value
  from_flag = fv["storage"].present or _parse_storage(text) == cfg.embedding.storage
  if from_flag and ":" not in text:
    return _fold(cfg, {n: fv[n].value for n in _CACHE_FLAGS})
  if given:
    got = ", ".join(f"--{n}={fv[n].value!r}" for n in given)
    raise errors.expected(got, f"with --storage={cfg.embedding.storage}",
                          "the cache settings given once: in --storage=KIND:POLICY:FRACTION "
                          "or as --cache_policy / --cache_fraction with a bare --storage=KIND")
  return cfg


def preset_embedding_dim(model: str, preset: str) -> int:
  """The embedding dim of `model`'s `preset` (what --embedding_dim=0 keeps)."""
  spec = types.SimpleNamespace(sparse_features=tuple(f"C{i}" for i in range(1, 27)),
                               rows_per_feature=(1,) * 26, num_dense=13)   # Criteo's shape
  return model_config(make_run(model=model, preset=preset), spec).tables()[0].dim

def normalize_settings(settings: dict[str, Any]) -> dict[str, Any]:
  """Run settings with `embedding_dim` 0 (the preset's) as the preset's dim, for settings
  saved before `RecRunConfig.run_settings` stored the effective dim and for the comparison
  on resume (`core.train.TrainConfig.normalize_settings`). Unknown presets stay as given.
  Rec settings without some a2a fields, group_by or host_memory_gb get their defaults (a
  run saved without a2a_mode sent float32, one without a2a_schedule used a constant bound,
  one without group_by evaluated without groups, one without host_memory_gb had no host
  tier, one without host_prefetch no lookahead), so a resume that turns an a2a setting on
  is refused naming it."""
  if "model" in settings and any(n not in settings for n in LATER_FIELDS):
    settings = {**{n: _FIELD_DEFAULTS[n] for n in LATER_FIELDS}, **settings}
  if settings.get("embedding_dim") != 0 or "model" not in settings:
    return settings
  try:
    dim = preset_embedding_dim(settings["model"], settings.get("preset", "kaggle"))
  except (ValueError, OSError):   # an unknown preset, a searched:FILE not there: as given
    return settings
  return {**settings, "embedding_dim": dim}


from rec.models.presets import (  # noqa: E402,F401  (re-exported: configs.model_config ...)
    MODEL_PRESETS, MODELS, PATTERNS, PRESETS, SEARCHED, _pattern, _with_embedding_dim,
    build_model_fn, model_config, model_stats, searched_config)



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
  if cfg.embedding.memory_budget_gb is not None:
    return int(cfg.embedding.memory_budget_gb * 2**30), "--memory_budget_gb"
  got = _device_budget()
  if got is None:
    raise ValueError("--memory_budget_gb: not given, and this device reports no memory size; "
                     "expected a per-device budget in GiB")
  return got


def plan_cost_params(spec) -> planner_lib.CostParams:
  """The planner's cost constants with what the data's batches carry: `spec`'s padded bag
  (`DataSpec.max_ids_per_bag`, the id slots every exchange sends per bag)."""
  return planner_lib.CostParams(ids_per_bag=int(spec.max_ids_per_bag))


def host_tier(cfg: RecRunConfig) -> planner_lib.HostTier | None:
  """The planner's host tier of --host_memory_gb (GiB of host memory per device; None
  when 0 or unset)."""
  gb = cfg.embedding.host_memory_gb
  if not gb:
    return None
  return planner_lib.HostTier(max(1, int(gb * 2**30)), source="--host_memory_gb")


def make_plan(cfg: RecRunConfig, tables: list[TableConfig], num_devices: int,
              optimizer: opt_lib.SparseOptimizer,
              cost_params: planner_lib.CostParams | None = None) -> planner_lib.Plan:
  """The embedding plan of --sharding (auto: the planner under `plan_budget`, priced with
  `cost_params`, e.g. `plan_cost_params(spec)`; None: bags of ceil(pooling factor) ids),
  with --sharding_overrides; with --host_memory_gb the auto planner moves the tables the
  budget cannot hold to the host tier (`host_tier`; their placements carry the storage)."""
  e = cfg.embedding
  overrides = planner_lib.parse_overrides(e.sharding_overrides) if e.sharding_overrides else {}
  planner_lib.validate_overrides(overrides, tables)
  tier = host_tier(cfg)
  if tier is not None and e.sharding != "auto":
    raise ValueError(
        f"--host_memory_gb={e.host_memory_gb:g} with --sharding={e.sharding}: the planner "
        "chooses the tables of the host tier; expected --sharding=auto, or every table on the "
        "tier by --storage=KIND_cache...@host (e.g. fp32_cache:lfu:0.05@host) and "
        "--host_memory_gb=0")
  if e.sharding == "auto":
    # A row-wise optimizer keeps one accumulator per row per column chunk under cw (as
    # TorchRec does), which changes the update; auto plans keep it exact by leaving cw out.
    kinds = None
    if isinstance(optimizer, opt_lib.RowWiseAdagrad):
      kinds = tuple(k for k in planner_lib.AUTO_KINDS if k != ShardingKind.COLUMN_WISE)
    return planner_lib.plan(
        tables, num_devices, memory_budget_bytes=plan_budget(cfg)[0],
        batch_size=cfg.train.batch_size, overrides=overrides, kinds=kinds,
        cost_params=cost_params, optimizer_state_bytes_per_row=optimizer.state_bytes_per_row,
        host_tier=tier)
  if e.sharding not in SHARDINGS:   # a config built field by field (make_run checks it)
    raise ValueError(f"--sharding={e.sharding!r}: expected one of {list(SHARDINGS)}")
  plan = planner_lib.uniform_plan(tables, ShardingKind(e.sharding), num_devices)
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
         f"--sharding={cfg.embedding.sharding} placed every table {'/'.join(kinds)}")
  raise ValueError(
      f"--a2a_mode={cfg.embedding.a2a.a2a_mode}: {why}, so no embedding exchange exists to "
      f"compress; expected tables placed {'|'.join(COMPRESSED_KINDS)} on 2 or more devices (e.g. "
      "--sharding=tw), or --a2a_mode=none")


# Sharding kinds whose exchange a2a_compression compresses (dp and sptt groups are not).
COMPRESSED_KINDS = ("tw", "cw", "twrw", "rw")


def group_feature(group_by: str, spec, data: str) -> int | None:
  """The index of --group_by's sparse feature in `spec` (None when empty); a name the data
  does not have is a UserError naming the flag, the value and the features there are."""
  if not group_by:
    return None
  names = list(spec.sparse_features)
  if group_by not in names:
    raise errors.expected(f"--group_by={group_by!r}", f"not a sparse feature of --data={data}",
                          f"one of {', '.join(names)} (or empty: no groups)")
  return names.index(group_by)


def build_run(cfg: RecRunConfig, devices=None, sources=None, a2a_compression=None,
              data_workers: int = 0):
  """Returns (task, train source, eval source, plan, mesh). `sources`: (train, eval) sources
  to use instead of those of cfg.data (e.g. one split to predict on). `a2a_compression`: an
  `a2a_compression.A2ACompression` for the collection's exchange (a study's table-wise
  factors or schedule) instead of cfg's --a2a_* settings (`RecRunConfig.a2a_spec`; None and
  --a2a_mode=none: float32); a plan with no exchange to compress is an error.
  `data_workers` > 0: train batches are drawn in that many Grain worker processes
  (`rec.data.workers.WorkerSource`), which also run RecD's dedup (--dedup_features).
  The auto planner prices the train source's padded bags (`plan_cost_params`); --group_by
  names a sparse feature of the eval source (`group_feature`), whose bags the task's eval
  step hands to its evaluator (gAUC, NE by slice). --host_prefetch: the train source's
  batches carry the next batch's ids (`rec.data.lookahead.LookaheadSource`) and the task
  prefetches their rows (RecTask refuses it without a table on the host tier)."""
  cfg.validate()
  t, d, e = cfg.train, cfg.data, cfg.embedding
  mesh = mesh_lib.make_mesh(cfg.mesh, devices, rules=mesh_lib.REC_RULES)
  n = mesh_lib.axis_size("batch", mesh_lib.REC_RULES, mesh)
  for what, b in (("batch_size", t.batch_size), ("eval_batch_size", t.eval_batch_size)):
    if b % n:
      raise ValueError(f"--{what}={b} is not divisible by the {n} devices of --mesh={cfg.mesh!r}")
  if sources is not None:
    train_src, eval_src = sources
  else:
    train_src, eval_src = sources_lib.make_sources(
        d.data, t.batch_size, eval_batch_size=t.eval_batch_size, num_rows=d.num_rows,
        seed=cfg.seed, bad_lines=d.bad_lines, eval_batches=d.eval_batches,
        csv_label=d.csv_label, csv_dense=d.csv_dense, csv_categorical=d.csv_categorical,
        mesh=mesh, days=d.days or None, **dict(zip(
            ("shard_index", "num_shards"), mesh_lib.process_batch_share(mesh, mesh_lib.REC_RULES))))
  group = group_feature(d.group_by, eval_src.spec, d.data)
  model_fn, tables, init_scale = build_model_fn(cfg, train_src.spec)
  if e.storage != StorageSpec("fp32"):
    tables = [dataclasses.replace(tb, storage=e.storage) for tb in tables]
  sparse_opt = opt_lib.get_sparse_optimizer(t.sparse_optimizer, t.embedding_learning_rate)
  plan = make_plan(cfg, tables, n, sparse_opt, plan_cost_params(train_src.spec))
  if a2a_compression is not None and e.a2a.a2a_mode != "none":
    raise ValueError(f"build_run: a2a_compression={a2a_compression} and --a2a_mode="
                     f"{e.a2a.a2a_mode}; expected one of the two")
  if a2a_compression is None:
    a2a_compression = cfg.a2a_spec([tb.name for tb in tables])
  if a2a_compression is not None:
    check_exchange(cfg, plan, n)
  coll = EmbeddingCollection(tables, plan, mesh, sparse_opt, init_scale=init_scale,
                             storage_seed=cfg.seed, dedup=cfg.dedup_spec(tables),
                             a2a_compression=a2a_compression,
                             bag_sizes=getattr(train_src, "bag_sizes", None))
  dense_tx = make_dense_optimizer(t.dense_optimizer, t.learning_rate)
  # amax histories ride their gradients
  if cfg.model.fp8_layers and cfg.model.fp8_recipe == "delayed":
    dense_tx = fp8_lib.with_fp8_history(dense_tx)
  task = RecTask(model_fn, coll, dense_tx, mesh, group_feature=group,
                 host_prefetch=e.host_prefetch)
  if data_workers:
    dd = coll.dedup and dedup_lib.DedupTransform(coll.dedup_features, coll.dedup.capacity,
                                                 task.dedup_shards(), coll.dedup.on_overflow,
                                                 [t.name for t in coll.tables])
    train_src = workers_lib.WorkerSource(train_src, dd or None, data_workers)
  if e.host_prefetch:   # each batch carries the next one's ids
    train_src = lookahead_lib.LookaheadSource(train_src)
  return task, train_src, eval_src, plan, mesh


def checkpoint_settings(cfg: RecRunConfig, mesh, spec=None,
                        epochs: float | None = None) -> dict[str, Any]:
  """The settings a train_rec run saves with its checkpoints (`core.train.TrainConfig.
  settings`): the config's run settings, --epochs, the mesh it ran on, what its data means
  (`sources.data_settings`: a conversion's fingerprint) and, given the train source's
  `spec`, the features the model was built for (`rec.predict` checks data against them)."""
  out = {**cfg.run_settings(), "epochs": epochs,
         "mesh": ",".join(f"{a}:{n}" for a, n in mesh.shape.items()),
         **sources_lib.data_settings(cfg.data.data)}
  if spec is not None:
    out["features"] = sources_lib.spec_settings(spec)
  return out


def steps_for(epochs: float, train_src) -> int:
  """Steps of `epochs` passes over the train source (rounded down, at least 1); with several
  processes, over the smallest process share (every process must run the same number of
  steps). A product within float rounding of a whole number counts as it (--epochs=0.58 of
  100 batches: 58 steps, where the float product 57.99999999999999 would round down to 57)."""
  if train_src.num_batches is None:
    raise ValueError("--epochs needs a finite data set; synthetic data is infinite: use --steps")
  nb = train_src.num_batches
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    nb = int(np.min(multihost_utils.process_allgather(np.int64(nb))))
  x = float(epochs) * nb
  return max(1, math.floor(x + 1e-9 * max(1.0, x)))
