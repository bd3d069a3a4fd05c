"""Settings shared by many entry points, rec and LM alike, each defined once
(`core.config.setting`): the output directory, run length, seeds, the mesh, timing and
the train loop's cadences. An entry point takes them in its typed config
(`WORKDIR.field(...)`) or as loose flags (`core.config.define_flags(None, "repeats",
repeats=5)`); its default is its own, the meaning is the one here.

`LoopConfig` is the train loop's section of a run config (train_rec, train_lm and the
studies that train); `loop_config` turns it into `core.train.TrainConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core import config

# What a run writes and where.
WORKDIR = config.setting(
    "workdir", "string", "Output directory: results.json, plots, metrics, checkpoints "
    "(default: the entry point's; a training run's is a new runs/<name>_<date-time>).",
    none_ok=True)
RESUME = config.setting(
    "resume", "bool", "Continue the run whose checkpoints are in --workdir (its saved "
    "settings must match the flags but for run length, cadences and paths).")
RESUME_ALLOW = config.setting(
    "resume_allow", "list", "Settings --resume may change deliberately, e.g. "
    "learning_rate,embedding_learning_rate.")
OUT = config.setting(
    "out", "string", "Where the output goes: gpu_report's report directory, an export's "
    "directory (--to=hf) or file (--to=gguf).", none_ok=True)
OVERWRITE = config.setting(
    "overwrite", "bool", "Delete what an earlier run left in the output directory (a "
    "training run's checkpoints and metrics in --workdir, a finished conversion in --dst) and "
    "start afresh; without it, that is refused.")

# How long, how many, which random numbers.
STEPS = config.setting(
    "steps", "integer", "Steps: a training run's train steps, a benchmark's steps per timed "
    "repeat.", lower=1)
EPOCHS = config.setting(
    "epochs", "float", "Train for this many passes over the train files (instead of "
    "--steps).", lower=0, none_ok=True)
SEED = config.setting("seed", "integer", "Seed of parameters and generated data.", lower=0)
REPEATS = config.setting("repeats", "integer", "Timed repeats (the median is reported).",
                         lower=1)
ROUNDS = config.setting(
    "rounds", "integer", "Rounds of a side-by-side comparison; each runs every variant in "
    "turn.", lower=1)
THREADS = config.setting("threads", "integer", "CPU threads of a peer (torch, llama.cpp); "
                         "where a peer is timed, ours runs on the same first N CPUs.",
                         lower=1)
PEER_PYTHON = config.setting(
    "peer_python", "string", "Python of the peer environment (TorchRec, transformers, "
    "llama.cpp); empty: skip the peer.")
PROFILE = config.setting(
    "profile", "bool", "Also trace the timed region (jax.profiler): device busy / span, "
    "kernels per step and the top kernels, in the results; traces under --workdir.")
COMPILATION_CACHE_DIR = config.setting(
    "compilation_cache_dir", "string", "JAX's persistent compilation cache ('': off).")

# Model and devices.
MESH = config.setting(
    "mesh", "string", "Device mesh, e.g. data:8, data:2,model:4, fsdp:2,tp:4; -1: all "
    "devices on the data axis.")
DTYPE = config.setting(
    "dtype", "enum", "Compute dtype of activations and matmuls (parameters stay float32).",
    choices=("float32", "bfloat16"))
PRESET = config.setting(
    "preset", "string", "Model sizes: a preset of the model family (rec.configs."
    "MODEL_PRESETS, llm.config.PRESETS).")
BATCH_SIZE = config.setting("batch_size", "integer", "Global batch size (examples or "
                            "sequences).", lower=1)
BATCH = config.setting("batch", "integer", "Rows per call of a benchmarked kernel, train "
                       "step, prefill or decode step.", lower=1)
# Unbounded here: each run's validate() refuses a rate that is not finite and > 0, naming
# the flag and the value (one message for a flag, a config file and a notebook alike).
LEARNING_RATE = config.setting("learning_rate", "float", "Learning rate (of the dense "
                               "part; the peak of a schedule).")
EVAL_BATCHES = config.setting("eval_batches", "integer", "Eval set size in eval batches.",
                              lower=1)
DATA = config.setting(
    "data", "string", "Input data: a rec data source, synthetic | synthetic_deep (planted "
    "Criteo-shaped data; options after ':', e.g. synthetic:zipf_alpha=1.2,gen=device) | "
    "sessions:dup=X | criteo:DIR | criteo_bin:DIR | avazu:DIR | libfm:DIR | csv:DIR "
    "(rec/data/sources.py describes each), or a directory of generated sequences "
    "(spec_decode.heads: a spec_decode draft directory).", none_ok=True)
CHECKPOINT = config.setting(
    "checkpoint", "string", "A checkpoint: a run's workdir, or llama2c:PATH | hf:DIR | "
    "gguf:FILE | workdir:DIR (llm.checkpoints).", none_ok=True)
FORMATS = config.setting(
    "formats", "list", "Number formats or row storages to compare (the entry point's help "
    "lists them).")
IMPLS = config.setting("impls", "list", "Kernel implementations to compare.")

# The train loop.
EVAL_EVERY = config.setting("eval_every", "integer", "Evaluate every N steps (0: only at "
                            "the end).", lower=0)
CHECKPOINT_EVERY = config.setting("checkpoint_every", "integer", "Checkpoint every N steps "
                                  "(0: only at the end).", lower=0)
CHECKPOINT_EVERY_MINUTES = config.setting(
    "checkpoint_every_minutes", "float", "Also checkpoint once this many minutes have "
    "passed since the last checkpoint (0: off).", lower=0)
LOG_EVERY = config.setting("log_every", "integer", "Progress line and train metrics every "
                           "N steps.", lower=1)
STOP_AT_STEP = config.setting("stop_at_step", "integer", "Stop (with a checkpoint) at this "
                              "step, as a preemption would.", lower=1, none_ok=True)
NONFINITE = config.setting(
    "nonfinite", "enum", "A NaN / inf loss or gradient norm: stop the run at that step (no "
    "checkpoint of it), or skip the step (counted).", choices=("stop", "skip"))
CHECK_EVERY = config.setting(
    "check_every", "integer", "Check losses for NaN / inf at least every N steps (they are "
    "checked at every log line, eval and checkpoint too).", lower=1)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The train loop's settings of a run (`core.train.TrainConfig` less the run's paths)."""
  steps: int = STEPS.field(1000)
  eval_every: int = EVAL_EVERY.field(250)
  checkpoint_every: int = CHECKPOINT_EVERY.field(0)
  checkpoint_every_minutes: float = CHECKPOINT_EVERY_MINUTES.field(10.0)
  log_every: int = LOG_EVERY.field(50)
  stop_at_step: int | None = STOP_AT_STEP.field(None)
  nonfinite: str = NONFINITE.field("stop")
  check_every: int = CHECK_EVERY.field(100)


# The loop's per-invocation flags (what to do with the workdir), beside a LoopConfig.
RUN_FLAGS = ("workdir", "resume", "resume_allow", "overwrite")


def loop_config(loop: LoopConfig, flag_values=None, **kw: Any):
  """`core.train.TrainConfig` of `loop`, the run's --workdir / --resume / --resume_allow /
  --overwrite flags (`flag_values`, default absl's FLAGS) and `kw` (the entry point's
  settings, seed, normalization ...; they win)."""
  from absl import flags
  from core import train
  fv = flags.FLAGS if flag_values is None else flag_values
  run = {"workdir": fv.workdir, "resume": fv.resume, "resume_allow": tuple(fv.resume_allow),
         "overwrite": fv.overwrite}
  return train.TrainConfig(**{**dataclasses.asdict(loop), **run, **kw})


def use_compilation_cache(path: str, min_compile_time_s: float = 1.0) -> None:
  """--compilation_cache_dir: JAX's persistent compilation cache in `path` for this process
  ('' leaves it off), keeping programs that took at least `min_compile_time_s` to compile."""
  if not path:
    return
  import os

  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
