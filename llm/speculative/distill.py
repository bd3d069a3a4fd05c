"""Training the EAGLE draft head by self-distillation (arXiv 2401.15077), through core.train.

`train_draft` runs it in a workdir: the sequences the target generates and their features
(`llm.speculative.distill_data`) are kept there and saved chunk by chunk (`cached_sequences`,
`cached_features`), so a killed run continues where it stopped; the head is trained as a
`DistillTask` (`llm.speculative.distill_task`: the loss, the draft vocabulary, unrolled
steps, taps) by the train loop, which checkpoints and resumes by itself (`loop_config`);
`load_draft` reads a run's head back, `load_draft_vocab` its draft vocabulary. `DistillConfig`
holds a run's settings.

The names of the data and task modules are this module's too (`distill.DistillTask`,
`distill.SequenceSource`, `distill.distill_losses`, ...).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core import errors
from core import mesh as mesh_lib
from llm.model import Llama
from llm.speculative.distill_data import (SeqBatch, SequenceSource, draft_vocab,
                                          generate_sequences, split_target_features,
                                          target_features)
from llm.speculative.distill_task import (DistillEvaluator, DistillTask, distill_losses,
                                          smooth_l1, unrolled_mask, unrolled_predictions)
from llm.speculative.draft import DraftHead
from llm.train_lib import OptimConfig, make_optimizer

__all__ = ["DistillConfig", "DistillEvaluator", "DistillTask", "SeqBatch", "SequenceSource",
           "cached_features", "cached_sequences", "distill_losses", "draft_vocab",
           "generate_sequences", "load_draft", "load_draft_vocab", "loop_config", "smooth_l1",
           "split_target_features", "target_features", "train_draft", "unrolled_mask",
           "unrolled_predictions"]


def _open_run(workdir: str, where: str | None, want: str):
  """The Checkpointer of the draft-head run in `workdir` and its latest step, refused (naming
  `where`, the setting that gave the path, and the path) when it holds no checkpoint: a load
  creates nothing (a Checkpointer on a missing `<workdir>/checkpoints` would make it)."""
  from core import checkpoint as ckpt_lib
  name = f"{where}={workdir}" if where else workdir
  expect = "the workdir of a draft-head training run (experiments.spec_decode's <workdir>/draft)"
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    found = ("no such directory" if not os.path.exists(workdir) else
             f"no checkpoints/ directory in it, so {want}")
    raise errors.expected(name, found, expect)
  ckpt = ckpt_lib.Checkpointer(workdir)
  step = ckpt.latest_step()
  if step is None:
    ckpt.close()
    raise errors.expected(name, f"no checkpoint in {ckpt.directory}, so {want}", expect)
  return ckpt, step


def load_draft(workdir: str, target_cfg, step: int | None = None,
               where: str | None = None) -> DraftHead:
  """The DraftHead of a DistillTask run's checkpoint at `step` (default: the latest), with
  the taps its run's settings name. `where` names the setting that gave `workdir` in errors
  ("--draft")."""
  ckpt, latest = _open_run(workdir, where, "no draft head to load")
  try:
    step = latest if step is None else step
    mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
    rep = NamedSharding(mesh, P())
    meta = ckpt.restore_meta(step) or {}
    taps = tuple(meta.get("settings", {}).get("distill.taps") or ())
    abstract_draft = nnx.eval_shape(lambda: DraftHead(target_cfg, nnx.Rngs(0), taps))
    graphdef, abstract_params = nnx.split(abstract_draft)
    params = nnx.to_pure_dict(abstract_params)
    tx = make_optimizer(OptimConfig())
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                "opt": jax.eval_shape(tx.init, params)}
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), abstract)
    state, _ = ckpt.restore(step, abstract)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, state["params"])


def load_draft_vocab(workdir: str, vocab_size: int, size: int = 0,
                     where: str | None = None, size_flag: str | None = None
                     ) -> np.ndarray | None:
  """The draft vocabulary of a DistillTask run in `workdir`: the `size` most frequent tokens
  of its training sequences (`<workdir>/sequences.npz`, the held-out ones left out, as
  `train_draft` counts them), `size` 0 meaning the run's own `draft_vocab`. A head's output
  rows are the target's, so decoding may keep fewer than it trained on (FR-Spec, arXiv
  2502.14856). None for a run without one and size 0 (the whole vocabulary). `where` /
  `size_flag`: the flags that gave `workdir` / `size`, named in a refusal (a UserError)."""
  import json
  ckpt, step = _open_run(workdir, where, "no run settings to read")
  try:
    settings = (ckpt.restore_meta(step) or {}).get("settings", {})
  finally:
    ckpt.close()
  trained = int(settings.get("distill.draft_vocab") or 0)
  if size < 0 or (trained and size > trained) or size > vocab_size:
    from core.errors import UserError
    run = f"{where}={workdir}" if where else repr(workdir)
    raise UserError(f"{size_flag or 'load_draft_vocab: size'}={size} for the draft head of "
                    f"{run}; expected 0 (the run's own: {trained or 'the whole vocabulary'})"
                    f" up to {trained or vocab_size} tokens")
  if not (size or trained):
    return None
  path = os.path.join(workdir, "sequences.npz")
  if not os.path.exists(path):
    raise FileNotFoundError(errno.ENOENT, "the draft-head run's training sequences (its draft "
                            "vocabulary is counted from them) are missing", path)
  with np.load(path) as f:
    made = json.loads(str(f["key"]))["num"]
    if int(f["done"]) < made:
      raise ValueError(f"{path}: {int(f['done'])} of {made} sequences made; the run that "
                       "trained the head had them all")
    n_train = made - int(settings["distill.eval_sequences"])
    return draft_vocab(f["tokens"][:n_train], f["mask"][:n_train], size or trained, vocab_size)


# DistillConfig fields that are the loop's (free to change on resume, as core.train's own).
_LOOP_FIELDS = ("steps", "eval_every", "log_every", "checkpoint_every")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Self-distillation run: data the target generates, then the train loop's settings."""

  num_sequences: int = 1024       # generated sequences (the last eval_sequences held out)
  seq_len: int = 128              # tokens per sequence, prompt included
  eval_sequences: int = 64
  gen_temperature: float = 1.0    # the target samples its training sequences at this (0: greedy)
  gen_batch: int = 64             # sequences generated per generate call
  draft_vocab: int = 0            # tokens the draft proposes from (0: the whole vocabulary)
  prompt_loss: bool = False       # pairs inside the prompts count in the loss (EAGLE: replies only)
  cache_features: bool = True     # the target's features computed once, kept in the workdir
  batch_size: int = 32
  steps: int = 1500
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  weight_decay: float = 0.0
  w_cls: float = 0.1
  noise: float = 0.1
  unroll: int = 1                 # draft steps the loss unrolls (`unrolled_predictions`)
  unroll_decay: float = 1.0       # weight of unrolled step s: decay**(s-1)
  taps: tuple[int, ...] = ()      # target blocks whose states the head also reads (EAGLE-3)
  tap_dropout: float = 0.3        # share of pairs trained with the taps zeroed (draft trees)
  eval_every: int = 0
  log_every: int = 100
  checkpoint_every: int = 0
  seed: int = 0

  def __post_init__(self):
    if not 0 < self.eval_sequences < self.num_sequences:
      raise ValueError(f"DistillConfig: eval_sequences={self.eval_sequences}, expected "
                       f"0 < eval_sequences < num_sequences={self.num_sequences}")
    if not (math.isfinite(self.gen_temperature) and self.gen_temperature >= 0):
      raise ValueError(f"DistillConfig: gen_temperature={self.gen_temperature}, expected a "
                       "finite temperature >= 0 (0: greedy)")


def _load_partial(path: str, key: str):
  """(arrays, rows done) of `path` (.npz) when it was made with `key`, else None."""
  import os
  if not os.path.exists(path):
    return None
  with np.load(path) as f:
    if str(f["key"]) != key:
      return None
    return {k: f[k] for k in f.files if k not in ("key", "done")}, int(f["done"])


def _save_partial(path: str, key: str, done: int, **arrays) -> None:
  import os
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  np.savez(path + ".tmp.npz", key=np.asarray(key), done=np.asarray(done), **arrays)
  os.replace(path + ".tmp.npz", path)


def target_fingerprint(target: Llama) -> str:
  """`core.checkpoint.tree_fingerprint` of the target's weights, salted with its config
  (sizes, dtypes). The workdir's sequences and features are keyed by it, so a run pointed at
  another checkpoint of the same shape (a fine-tuned one, another dtype) makes its own
  instead of reusing the first target's."""
  from core.checkpoint import tree_fingerprint
  return tree_fingerprint(nnx.to_pure_dict(nnx.state(target)), salt=repr(target.cfg))


def features_key(tokens: np.ndarray, dim: int, target: str = "") -> str:
  """What `cached_features` keys a features file by: a hash of the tokens and their shape,
  the width, and the target's fingerprint (`target_fingerprint`)."""
  import hashlib
  tokens = np.ascontiguousarray(tokens, np.int32)
  return (hashlib.sha256(tokens.tobytes()).hexdigest() + f":{list(tokens.shape)}:{dim}"
          + (f":target={target}" if target else ""))


def cached_sequences(target: Llama, path: str, prompts, dcfg: DistillConfig, stop_tokens=(),
                     feats_path: str | None = None, save_every_s: float = 120.0):
  """`generate_sequences` for dcfg, kept in `path` (.npz) with the settings and the target
  (`target_fingerprint`) that made it (regenerated when they differ); saved after every
  chunk, so a killed run continues from the last one.

  feats_path: the target's features are captured while generating (`feats_out`) and kept
  there: every `save_every_s` seconds under the sequences' settings (a killed run continues
  from the last rows saved with their features) and, once every sequence is made, under the
  key `cached_features` reads, which then finds them made. Sequences made earlier without
  capture leave their features to `cached_features`."""
  import json
  import time as time_lib
  fingerprint = target_fingerprint(target)
  key = json.dumps({"num": dcfg.num_sequences, "len": dcfg.seq_len, "seed": dcfg.seed,
                    "temperature": dcfg.gen_temperature, "prompts": [list(map(int, p))
                                                                      for p in prompts],
                    "stop": [int(t) for t in stop_tokens], "batch": dcfg.gen_batch,
                    "vocab": target.cfg.vocab_size, "target": fingerprint}, sort_keys=True)
  saved = _load_partial(path, key)
  out, start = (None, 0) if saved is None else ((saved[0]["tokens"], saved[0]["mask"]),
                                                saved[1])
  if start < dcfg.num_sequences:
    n = dcfg.num_sequences
    feats, fkey = None, "generated:" + key
    if feats_path is not None:
      fsaved = _load_partial(feats_path, fkey)
      if fsaved is not None and fsaved[1] <= start:
        # Rows are a function of (seed, chunk): regenerate those saved without features.
        feats, start = fsaved[0]["feats"], fsaved[1]
      elif start == 0:
        feats = np.zeros((n, dcfg.seq_len, target.cfg.dim), np.float32)
    holder, last = {}, [time_lib.perf_counter()]

    def save(done):
      _save_partial(path, key, done, tokens=holder["out"][0], mask=holder["out"][1])
      if feats is None:
        return
      if done == n:
        _save_partial(feats_path, features_key(holder["out"][0], target.cfg.dim, fingerprint),
                      n, feats=feats)
      elif time_lib.perf_counter() - last[0] > save_every_s:
        _save_partial(feats_path, fkey, done, feats=feats)
        last[0] = time_lib.perf_counter()

    if out is None:
      out = (np.zeros((n, dcfg.seq_len), np.int32), np.zeros((n, dcfg.seq_len), np.float32))
    holder["out"] = out
    if start:
      print(f"  continuing the target's sequences from {start}/{n}", flush=True)
    generate_sequences(target, n, dcfg.seq_len, prompts=prompts,
                       temperature=dcfg.gen_temperature, seed=dcfg.seed, progress=True,
                       batch_size=dcfg.gen_batch, stop_tokens=stop_tokens, start=start,
                       out=out, on_chunk=save, feats_out=feats)
  return out


def cached_features(target: Llama, path: str, tokens: np.ndarray, batch_size: int = 8,
                    taps: tuple[int, ...] = ()):
  """`target_features` of `tokens`, kept in `path` (.npz) keyed by a hash of the tokens and
  the target's fingerprint;
  saved every few chunks, so a killed run continues. With `taps`: (features, the states at
  those blocks in float16, [N, T, len(taps)*D]), kept together."""
  taps = tuple(int(i) for i in taps)
  key = (features_key(tokens, target.cfg.dim, target_fingerprint(target))
         + (f":taps={list(taps)}" if taps else ""))
  saved = _load_partial(path, key)
  feats, start = (None, 0) if saved is None else (saved[0]["feats"], saved[1])
  tapped = None if saved is None or not taps else saved[0]["taps"]
  if start < len(tokens):
    if feats is None:
      feats = np.zeros(tokens.shape + (target.cfg.dim,), np.float32)
      if taps:
        tapped = np.zeros(tokens.shape + (len(taps) * target.cfg.dim,), np.float16)
    last = [time.perf_counter(), 0.0]     # (end of the last save, its duration)

    def save(done):
      # At most every minute, and at most a tenth of the time in saving (large files).
      since = time.perf_counter() - last[0]
      if done == len(tokens) or (since > 60 and since > 10 * last[1]):
        t = time.perf_counter()
        _save_partial(path, key, done, feats=feats, **({"taps": tapped} if taps else {}))
        last[:] = [time.perf_counter(), time.perf_counter() - t]

    feats = target_features(target, tokens, batch_size=batch_size, start=start, out=feats,
                            on_chunk=save, progress=True, taps=taps, taps_out=tapped)
  return (feats, tapped) if taps else feats


def loop_config(workdir: str, dcfg: DistillConfig, *, overwrite: bool = False, settings=None,
                resume_allow=()):
  """The core.train loop settings of a draft-head run in `workdir`: resumed when it holds
  checkpoints (unless `overwrite`); the run's settings are every DistillConfig field but the
  loop's own, as distill.NAME, plus `settings`; those in `resume_allow` may change."""
  import os
  from core import train as train_lib
  return train_lib.TrainConfig(
      workdir=workdir, steps=dcfg.steps, eval_every=dcfg.eval_every,
      checkpoint_every=dcfg.checkpoint_every, log_every=dcfg.log_every, seed=dcfg.seed,
      resume=not overwrite and os.path.isdir(os.path.join(workdir, "checkpoints")),
      overwrite=overwrite, tensorboard=False, resume_allow=tuple(resume_allow),
      settings={**{f"distill.{k}": v for k, v in dataclasses.asdict(dcfg).items()
                   if k not in _LOOP_FIELDS}, **(settings or {})},
      nonfinite_hint="lower the draft learning rate")


def _latest_step(workdir: str) -> int:
  import os
  from core import checkpoint as ckpt_lib
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    return -1
  ckpt = ckpt_lib.Checkpointer(workdir)
  try:
    step = ckpt.latest_step()
  finally:
    ckpt.close()
  return -1 if step is None else step


def train_draft(target: Llama, workdir: str, dcfg: DistillConfig, *, prompts=((1,),),
                stop_tokens=(), mesh: Mesh | None = None, overwrite: bool = False,
                settings=None, resume_allow=()):
  """Generates (or reuses) the sequences (`cached_sequences`, ending at `stop_tokens`), the
  draft vocabulary (`draft_vocab` of the training sequences, when dcfg.draft_vocab) and the
  target's features (`cached_features`, when dcfg.cache_features and training remains),
  trains a DraftHead in `workdir` through core.train (`loop_config`: an existing run with
  the same settings is resumed, a finished one just loaded; one of other settings is
  refused before the sequences and features are touched; settings named in
  `resume_allow`, e.g. "distill.learning_rate", may differ from the run's) and returns
  (draft, train summary, (tokens, mask), draft vocabulary ids or None)."""
  import os
  from core import train as train_lib
  if dcfg.gen_temperature == 0:
    distinct = len({tuple(int(t) for t in p) for p in prompts})
    if distinct < dcfg.num_sequences:
      raise ValueError(f"train_draft: gen_temperature=0 (greedy) with {distinct} distinct "
                       f"prompts for num_sequences={dcfg.num_sequences}: greedy sequences "
                       "from the same prompt are the same sequence; give one prompt per "
                       "sequence or sample (gen_temperature > 0)")
  loop = loop_config(workdir, dcfg, overwrite=overwrite, settings=settings,
                     resume_allow=resume_allow)
  if not overwrite:   # a run of other settings is refused before its sequences are made anew
    train_lib.check_resume(loop)
  train_more = overwrite or _latest_step(workdir) < dcfg.steps
  feats_path = os.path.join(workdir, "features_taps.npz" if dcfg.taps else "features.npz")
  # Generation captures the final features only: with taps they come from a forward pass.
  capture = dcfg.cache_features and train_more and not dcfg.taps
  tokens, mask = cached_sequences(target, os.path.join(workdir, "sequences.npz"), prompts, dcfg,
                                  stop_tokens, feats_path=feats_path if capture else None)
  n_train = dcfg.num_sequences - dcfg.eval_sequences
  vocab = None
  if dcfg.draft_vocab:
    vocab = draft_vocab(tokens[:n_train], mask[:n_train], dcfg.draft_vocab,
                        target.cfg.vocab_size)
  loss_from = None
  if not dcfg.prompt_loss:
    # Pair p predicts the feature whose argmax is token p + 2; the draft proposes tokens
    # from the second new one on (the first comes from the target's prefill), so the
    # pairs it is used on start at p = len(prompt) - 1.
    loss_from = np.asarray([len(prompts[i % len(prompts)]) - 1
                            for i in range(dcfg.num_sequences)], np.int32)
  feats = taps = None
  if dcfg.cache_features and train_more:
    feats = cached_features(target, feats_path, tokens, taps=dcfg.taps)
    if dcfg.taps:
      feats, taps = feats
  mesh = mesh or mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  optim = OptimConfig(peak_lr=dcfg.learning_rate, warmup_steps=dcfg.warmup_steps,
                      total_steps=dcfg.steps, weight_decay=dcfg.weight_decay)
  task = DistillTask(target, optim, mesh, w_cls=dcfg.w_cls, noise=dcfg.noise,
                     draft_vocab=vocab, unroll=dcfg.unroll, taps=dcfg.taps,
                     tap_dropout=dcfg.tap_dropout, unroll_decay=dcfg.unroll_decay)
  split = lambda x, a, b: None if x is None else x[a:b]
  train_src = SequenceSource(tokens[:n_train], mask[:n_train], dcfg.batch_size, seed=dcfg.seed,
                             feats=split(feats, 0, n_train),
                             loss_from=split(loss_from, 0, n_train),
                             taps=split(taps, 0, n_train))
  eval_src = SequenceSource(tokens[n_train:], mask[n_train:], dcfg.batch_size, split="eval",
                            feats=split(feats, n_train, None),
                            loss_from=split(loss_from, n_train, None),
                            taps=split(taps, n_train, None))
  out = train_lib.train(task, train_src.batches, lambda: eval_src.batches(0), loop)
  return task.draft(out["state"]["params"]), out, (tokens, mask), vocab
