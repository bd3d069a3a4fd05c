"""The settings of an LM training run (experiments.train_lm) as one typed, validated config.

  run = LMRunConfig()                                   # train_lm's defaults
  run = config.replace(run, seq_len=1024, packing="wlb", mesh="data:2,cp:4")
  run.validate(cp_ranks=4)                              # what the library cannot train
  cfg = run.llama_config(vocab_size=256); optim = run.optim_config()
  cfg = run.preset_config()                             # the preset as defined (studies)

Sections: `model` (the Llama: preset, dtype, remat, attention, context parallelism),
`data` (text, tokenizer, rows, eval set, and `packing`: WLB-LLM's document packing, arXiv
2503.17924), `parallelism` (the mesh), `train` (optimizer, seed, memory check) and `loop`
(core.settings.LoopConfig at train_lm's cadences). Each leaf is a setting
(`core.config.setting`), so `--seq_len` is one flag, `config.flat(run)["seq_len"]` its value
and a workdir's config.py (`core.config.write_file`) replays the run with `--config`.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

from core import config
from core import errors
from core import settings
from llm import settings as lm_settings
from llm import tokenizer as tok_lib

# train_lm's own settings (every other LM setting is in llm/settings.py or core/settings.py).
CONTEXT_PARALLEL = config.setting(
    "context_parallel", "enum", "Ring attention over the mesh's cp axis "
    "(LlamaConfig.context_parallel).", choices=("none", "pass_kv", "pass_q", "auto"))
WEIGHT_DECAY = config.setting("weight_decay", "float", "AdamW weight decay (matrices only).",
                              lower=0)
MEMORY_CHECK = config.setting(
    "memory_check", "bool", "Refuse a run whose parameters, optimizer state, gradients and "
    "activations (llm.memory's lower-bound estimate) exceed the device's memory (GPU: "
    "bytes_limit; CPU: available RAM), before compiling.")
PACKING = config.setting(
    "packing", "enum", "none: random windows of --text; else documents (spans of --text with "
    "the Pile's long-tailed lengths) packed into rows by the loader's next-fit (original), "
    "fixed-length greedy balancing (fixed) or WLB-LLM's variable-length packing with outlier "
    "queues (wlb); arXiv 2503.17924.", choices=("none", "original", "fixed", "wlb"))
CP_SHARDING = config.setting(
    "cp_sharding", "enum", "Context-parallel layout of packed rows: per sequence (the "
    "model's 2N chunks), per document (2N chunks of each document) or the per-batch adaptive "
    "choice; doc / adaptive need --packing and a cp mesh axis.",
    choices=("seq", "doc", "adaptive"))
FIXED_WINDOW = config.setting("fixed_window", "integer", "--packing=fixed: global batches "
                              "per greedy window.", lower=1)
WLB_QUEUES = config.setting(
    "wlb_queues", "integer", "--packing=wlb: outlier queues (thresholds 1/2, 1/4, 1/8 of "
    "--seq_len; q queues use the q largest).", lower=0, upper=3)
DOC_CONTEXT = config.setting(
    "doc_context", "integer", "Packed documents: lengths drawn with the Pile's shape at this "
    "context, then scaled to --seq_len (0: drawn at --seq_len, unscaled).", lower=0)
INIT = config.setting(
    "init", "string", "Start from a pretrained checkpoint: hf:DIR | gguf:FILE | "
    "llama2c:FILE | workdir:DIR (llm.checkpoints). Its config sets the model's shape (no "
    "--preset) and its tokenizer the tokens (a --tokenizer must have its vocabulary).",
    none_ok=True)
LORA_RANK = config.setting(
    "lora_rank", "integer", "LoRA (llm.lora): adapters of this rank on the --lora_targets "
    "projections, the pretrained weights frozen; 0: full fine-tuning.", lower=0)
LORA_ALPHA = config.setting("lora_alpha", "float", "LoRA: the adapters' update is scaled by "
                            "alpha / rank.", lower=0)
LORA_TARGETS = config.setting(
    "lora_targets", "list", "LoRA: the projections adapted: wq, wk, wv, wo, w_gate, w_up, "
    "w_down, or the groups attention, mlp, all.")
CP_TILE = config.setting(
    "cp_tile", "integer", "--cp_sharding=adaptive: query / key tile of the tile model (0: the "
    "Mosaic GPU kernel's 128, scaled like the documents by --seq_len / --doc_context).",
    lower=0)


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The Llama trained: its size (an llm.config preset, vocab set to the tokenizer's, or a
  pretrained checkpoint's: `init`) and how it computes. Weights start random (the seed) or
  from `init`; `weights` holds the frozen pretrained matrices int8 / int4 under LoRA."""
  preset: str = settings.PRESET.field("tiny")
  init: str | None = INIT.field(None)
  weights: str = lm_settings.WEIGHTS.field("float32")
  dtype: str = settings.DTYPE.field("float32")
  remat: str = lm_settings.REMAT.field("none")
  attention_impl: str = lm_settings.ATTENTION_IMPL.field("xla")
  context_parallel: str = CONTEXT_PARALLEL.field("none")


@dataclasses.dataclass(frozen=True)
class PackingSection:
  """Documents packed into rows (llm/packing/source.py) instead of random windows."""
  packing: str = PACKING.field("none")
  cp_sharding: str = CP_SHARDING.field("seq")
  fixed_window: int = FIXED_WINDOW.field(2)
  wlb_queues: int = WLB_QUEUES.field(2)
  doc_context: int = DOC_CONTEXT.field(131072)
  cp_tile: int = CP_TILE.field(0)
  cost_model: str = lm_settings.COST_MODEL.field("flops")


@dataclasses.dataclass(frozen=True)
class LoraSection:
  """LoRA fine-tuning (arXiv 2106.09685): rank 0 trains every weight."""
  lora_rank: int = LORA_RANK.field(0)
  lora_alpha: float = LORA_ALPHA.field(16.0)
  lora_targets: tuple[str, ...] = LORA_TARGETS.field(("all",))


@dataclasses.dataclass(frozen=True)
class DataSection:
  """The text trained on (its tail held out for eval), or a chat file (`data`:
  chat:FILE.jsonl, the loss on the assistant's tokens), its tokens and rows."""
  text: str | None = lm_settings.TEXT.field(None)
  data: str | None = settings.DATA.field(None)
  tokenizer: str | None = lm_settings.TOKENIZER.field(None)
  seq_len: int = lm_settings.SEQ_LEN.field(128)
  eval_batches: int = settings.EVAL_BATCHES.field(8)
  packing: PackingSection = config.section(PackingSection)


@dataclasses.dataclass(frozen=True)
class ParallelismSection:
  """How the devices are laid out (core.mesh, LLM_RULES)."""
  mesh: str = settings.MESH.field("-1")


@dataclasses.dataclass(frozen=True)
class TrainSection:
  """AdamW with warmup + cosine decay (llm.train_lib.OptimConfig), the seed, the memory
  check."""
  batch_size: int = settings.BATCH_SIZE.field(16)
  learning_rate: float = settings.LEARNING_RATE.field(3e-3)
  warmup_steps: int = lm_settings.WARMUP_STEPS.field(30)
  weight_decay: float = WEIGHT_DECAY.field(0.1)
  seed: int = settings.SEED.field(0)
  memory_check: bool = MEMORY_CHECK.field(True)


@dataclasses.dataclass(frozen=True)
class LMLoopConfig(settings.LoopConfig):
  """The train loop at train_lm's cadences."""
  steps: int = settings.STEPS.field(300)
  eval_every: int = settings.EVAL_EVERY.field(100)
  log_every: int = settings.LOG_EVERY.field(25)


@dataclasses.dataclass(frozen=True)
class LMRunConfig:
  """Every setting of an LM training run (experiments.train_lm)."""
  model: ModelSection = config.section(ModelSection)
  lora: LoraSection = config.section(LoraSection)
  data: DataSection = config.section(DataSection)
  parallelism: ParallelismSection = config.section(ParallelismSection)
  train: TrainSection = config.section(TrainSection)
  loop: LMLoopConfig = config.section(LMLoopConfig)

  def llama_config(self, vocab_size: int, pretrained=None):
    """The LlamaConfig trained: the preset at this vocabulary (or the `pretrained`
    checkpoint's LlamaConfig: its shape and context), dtype, remat, attention."""
    from llm import config as config_lib
    if pretrained is not None:
      return pretrained.replace(param_dtype="float32", **self._numerics())
    return config_lib.get_config(self.model.preset, vocab_size=vocab_size,
                                 max_seq_len=max(self.data.seq_len, 16), **self._numerics())

  def preset_config(self, **overrides):
    """The preset's LlamaConfig as llm.config defines it (its vocabulary and context) at the
    run's dtype, remat, attention and context parallelism, then `overrides`: the model a
    study runs or counts without a tokenizer or a text (cp_prefill, cp_model, wlb_packing)."""
    from llm import config as config_lib
    return config_lib.get_config(self.model.preset, **{**self._numerics(), **overrides})

  def _numerics(self) -> dict[str, Any]:
    """The LlamaConfig fields the model section sets beside the sizes."""
    m = self.model
    remat = ({"remat": False} if m.remat == "none" else
             {"remat": True, "remat_policy": m.remat})
    return {"dtype": m.dtype, "attention_impl": m.attention_impl,
            "context_parallel": m.context_parallel, **remat}

  def lora_config(self):
    """llm.lora.LoraConfig of the lora section, or None (rank 0: full fine-tuning)."""
    if self.lora.lora_rank == 0:
      return None
    from llm import lora as lora_lib
    return lora_lib.LoraConfig(self.lora.lora_rank, self.lora.lora_alpha,
                               self.lora.lora_targets)

  def chat_file(self) -> str | None:
    """The file of --data=chat:FILE (None: --text)."""
    from llm import chat_data
    return chat_data.chat_path(self.data.data)

  def optim_config(self):
    """llm.train_lib.OptimConfig of the train section, decaying over the loop's steps."""
    from llm import train_lib
    t = self.train
    return train_lib.OptimConfig(peak_lr=t.learning_rate, warmup_steps=t.warmup_steps,
                                 total_steps=self.loop.steps, weight_decay=t.weight_decay)

  def validate(self, cp_ranks: int = 1, device=None, llama=None) -> None:
    """Every combination the library cannot train, refused before anything is traced, each
    error naming the flags: no --text, a learning rate that is not a finite number > 0, the
    attention implementation's limits (`check_attention`), packing's (`check_packing`).
    `cp_ranks`: the mesh's cp ranks under context parallelism; `device`: an
    llm.attention.choose.DeviceInfo (None: probed where needed); `llama`: the LlamaConfig
    (default: `llama_config` at a byte vocabulary; the checks read no vocabulary)."""
    from core import train as train_lib
    self.check_data()
    train_lib.check_learning_rate("--learning_rate", self.train.learning_rate)
    f = types.SimpleNamespace(**config.flat(self))
    check_attention(f, self.llama_config(256) if llama is None else llama, device)
    check_packing(f, cp_ranks)

  def check_data(self) -> None:
    """What to train on: --text or --data=chat:FILE (one), and what goes with each; LoRA's
    and --weights' settings; that --tokenizer names a tokenizer."""
    if not self.data.text and not self.data.data:
      raise errors.expected("--text", "not given", "the text file to train on (--text=FILE, "
                            "--data=chat:FILE, or a --config file that sets one)")
    if self.data.text and self.data.data:
      raise errors.expected(f"--text={self.data.text} --data={self.data.data}", "both given",
                            "one: plain text (--text) or a chat file (--data=chat:FILE)")
    self.chat_file()
    if self.data.tokenizer:
      tok_lib.check_path(self.data.tokenizer)
    if self.data.data and self.data.packing.packing != "none":
      raise errors.expected(f"--packing={self.data.packing.packing} with --data",
                            "packing of --text's documents", "--packing=none (a chat file's "
                            "conversations are packed whole, each its own segment)")
    self.lora_config()   # its errors name the flags
    if self.model.weights != "float32" and (self.lora.lora_rank == 0 or not self.model.init):
      raise errors.expected(f"--weights={self.model.weights}", "frozen quantized weights "
                            "without adapters to train", "--init=CHECKPOINT and --lora_rank "
                            ">= 1 (QLoRA), or --weights=float32")

  def run_settings(self, llama, optim, mesh) -> dict[str, Any]:
    """The run's settings saved with each checkpoint and compared on --resume (names as
    the checkpoints of earlier runs hold them)."""
    from llm import config as config_lib
    d, p = self.data, self.data.packing
    out = {**{f"model.{k}": v for k, v in config_lib.config_to_dict(llama).items()},
           **{f"optim.{k}": v for k, v in dataclasses.asdict(optim).items()},
           "data.text": d.text and os.path.abspath(d.text),
           "data.tokenizer": d.tokenizer and os.path.abspath(d.tokenizer),
           "data.seq_len": d.seq_len, "data.batch_size": self.train.batch_size,
           "data.eval_batches": d.eval_batches,
           "mesh": ",".join(f"{a}:{n}" for a, n in mesh.shape.items())}
    if self.model.init:
      from llm import checkpoints
      out["model.init"] = checkpoints.absolute_spec(self.model.init)
    if self.model.weights != "float32":
      out["model.weights"] = self.model.weights
    if self.lora.lora_rank:
      out.update({"lora.rank": self.lora.lora_rank, "lora.alpha": self.lora.lora_alpha,
                  "lora.targets": list(self.lora_config().targets)})
    if d.data:
      out["data.data"] = f"chat:{os.path.abspath(self.chat_file())}"
      out.pop("data.text")
    if p.packing != "none":
      out.update({"data.packing": p.packing, "data.cp_sharding": p.cp_sharding,
                  "data.cp_tile": p.cp_tile, "data.fixed_window": p.fixed_window,
                  "data.wlb_queues": p.wlb_queues, "data.doc_context": p.doc_context,
                  "data.cost_model": p.cost_model})
    return out


# Settings --resume may change: placement and kernels change no arithmetic that the state
# depends on.
CHANGEABLE = ("mesh", "model.attention_impl", "model.context_parallel", "model.remat",
              "model.remat_policy", "data.eval_batches", "data.cp_sharding", "data.cp_tile")


def check(f, llama, cp_ranks: int, device=None) -> None:
  """`check_attention`, then `check_packing`, on settings by flat name (`f`: any object with
  them as attributes, e.g. absl's FLAGS or `types.SimpleNamespace(**config.flat(run))`)."""
  check_attention(f, llama, device)
  check_packing(f, cp_ranks)


# What each --attention_impl trains (llm/attention): "xla", "xla_decode" and the Pallas
# kernels ("pallas", "pallas_mgpu", "pallas_triton") take segment ids and positions
# anywhere, so every --packing x --context_parallel x --cp_sharding combination; "auto"
# picks per call among them (cuDNN only for calls without segment ids or positions).
# "cudnn" takes one document per row (its registry entry's max_segments=1: a packed row
# comes out NaN) and refuses segment ids on ring attention blocks, so no --packing (and so
# no --cp_sharding=doc|adaptive, which need packed documents); ring attention without
# packing runs its blocks (tests/llm/test_attention_cudnn.py). cuDNN computes in bfloat16 /
# float16 with head dims a multiple of 8 up to 256, on a GPU with cuDNN (sm >= 8.0).
def check_attention(f, llama, device=None) -> None:
  """--attention_impl=cudnn combinations cuDNN cannot run (the table above), each named
  with its flags' values. `device`: an llm.attention.choose.DeviceInfo (None: probed)."""
  if f.attention_impl != "cudnn":
    return
  from llm.attention import choose
  from llm.attention.cudnn import supports
  instead = "expected --attention_impl=auto (cuDNN where a call allows it), pallas or xla"
  if f.packing != "none" or f.cp_sharding != "seq":
    raise errors.UserError(
        f"--attention_impl=cudnn with --packing={f.packing} --cp_sharding={f.cp_sharding} "
        f"--context_parallel={f.context_parallel}: packed rows hold several documents "
        "(segment ids); cuDNN attention takes one document per row, and no segment ids on "
        f"ring attention blocks; {instead}, or --packing=none --cp_sharding=seq")
  reason = supports(llama.dtype, llama.head_dim)
  if reason:
    raise errors.UserError(f"--attention_impl=cudnn with --dtype={f.dtype} --preset="
                           f"{f.preset} (head dim {llama.head_dim}): {reason}; {instead}")
  device = choose.device_info() if device is None else device
  if not device.cudnn:
    here = (f"backend {device.backend}" if device.backend != "gpu" else
            f"compute capability {device.compute_capability}; it needs sm 8.0 or newer and "
            "cuDNN found")
    raise errors.UserError(f"--attention_impl=cudnn: no GPU with cuDNN flash attention here "
                           f"({here}); {instead}")


def check_packing(f, cp_ranks: int) -> None:
  """Combinations packing cannot run; the error names the flags."""
  if f.cp_sharding != "seq" and f.packing == "none":
    raise errors.UserError(f"--cp_sharding={f.cp_sharding} needs documents: set --packing="
                           "original|fixed|wlb (--packing=none trains on windows of one "
                           "sequence)")
  if f.cp_sharding != "seq" and cp_ranks < 2:
    raise errors.UserError(
        f"--cp_sharding={f.cp_sharding} needs context parallelism: --context_parallel="
        "pass_kv|pass_q|auto and a --mesh with a cp axis of 2 or more ranks (got "
        f"--context_parallel={f.context_parallel}, --mesh={f.mesh})")
  if f.cp_sharding != "seq" and f.seq_len % (2 * cp_ranks):
    raise errors.UserError(f"--seq_len={f.seq_len} with --cp_sharding={f.cp_sharding}: "
                           f"expected a multiple of 2 x {cp_ranks} cp ranks (2 chunks per "
                           "rank)")
  if f.packing != "none" and f.doc_context and f.doc_context < f.seq_len:
    raise errors.UserError(f"--doc_context={f.doc_context}: expected 0 or at least "
                           f"--seq_len={f.seq_len} (lengths are drawn at it and scaled down "
                           "to --seq_len)")
