"""Settings shared by several recommendation entry points (benchmarks and studies), each
defined once (`core.config.setting`); the settings of a rec training run are its config's
(`rec.configs`), those rec and LM entry points share are in `core.settings`. An entry point
takes them as loose flags (`core.config.define_flags(None, "dim", dim=64)`) with its own
default; a sweep takes several values of one (`ROWS.several()`: `--rows=1000,5000`).
"""

from __future__ import annotations

from core import config

# Tables and ids of a benchmark or study.
ROWS = config.setting(
    "rows", "integer", "Rows per embedding table of a benchmark (bench_dlrm --preset=mlperf: "
    "the cap on each of the reference's tables, 0 keeping its 204M rows).", lower=0)
DIM = config.setting("dim", "integer", "Embedding dim of a study's or benchmark's tables.",
                     lower=1)
ZIPF_ALPHA = config.setting("zipf_alpha", "float", "Zipf exponent of the generated ids "
                            "(0: uniform).", lower=0)

# Comparisons over models and seeds.
MODELS = config.setting("models", "list", "Models to compare: names, or model:preset (e.g. "
                        "wukong:l3_n16, dcnv2:small).")
SEEDS = config.setting("seeds", "list", "Parameter-init seeds: one run per seed (and model, "
                       "format or variant); quality is the mean over seeds.",
                       item=config.Setting("seed", "integer", "A parameter-init seed.", lower=0))
DATA_SEED = config.setting("data_seed", "integer", "Seed of the synthetic data (its hidden "
                           "model and batch stream, stochastic rounding), apart from the "
                           "parameter-init --seeds.", lower=0)
TRIALS = config.setting("trials", "integer", "Trials of a search or a Monte-Carlo estimate "
                        "(pvf: faults per group; rankitect: candidates trained).", lower=1)
PROBE_BATCHES = config.setting("probe_batches", "integer", "Eval batches a probe runs "
                               "(sensitivities, payload sizes; at most).", lower=1)

# Input pipelines and RecD's session data.
DATA_WORKERS = config.setting(
    "data_workers", "integer", "Grain worker processes that draw the train batches "
    "(synthetic, sessions, criteo_bin) and run RecD's dedup (--dedup_features); 0: in this "
    "process.", lower=0)
NUM_USER = config.setting("num_user", "integer", "RecD session data: user features (their "
                          "bags repeat over a session; deduplicated).", lower=1)
USER_BAG = config.setting("user_bag", "integer", "RecD session data: ids per user-feature "
                          "bag.", lower=1)
