"""Draft heads of several spec_decode runs side by side on one run's held-out data: the
teacher-forced agreement with the target at each unrolled draft step, and the accept length
of speculative decoding over every held-out request (counts only, no timing: it may share
the machine).

  G=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  python -m experiments.spec_decode.heads --target=gguf:$G --data=runs/spec_greedy3/draft \
      --heads=runs/spec_greedy3/draft,runs/spec_ttt2/draft,runs/spec_ttt2d/draft \
      --eval_sequences=32 --draft_vocab=4096 --steps=3 --trees=chain:4,2:4:4 \
      --max_new_tokens=64 --workdir=runs/spec_heads

--data is a spec_decode draft directory (its `sequences.npz`, whose key holds the prompts and
stop ids, and `features.npz`); its last --eval_sequences sequences are the held-out ones and
the draft vocabulary is recounted from the others, as spec_decode made it. Per-step
agreement (`per_step_top1`): `DistillTask(unroll=steps)`'s eval over the held-out replies
(step s fed the head's own step s-1 predictions); a head with taps has no taps in
`features.npz` and gets none. Accept length (`accept_lengths`): batch 1, greedy, each
held-out request alone, with the share of rounds whose drafted token at depth d was accepted
given depth d-1's was (EAGLE's per-depth acceptance).
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import flags

from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings  # noqa: F401  (the shared settings by name)
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)

FLAGS = flags.FLAGS


def per_step_top1(target, head, tokens, mask, feats, loss_from, draft_vocab, steps: int,
                  batch_size: int = 8) -> dict[str, float]:
  """{top1_d1 .. top1_d<steps>}: how often the head's argmax at each unrolled step equals the
  target's over the sequences' pairs from loss_from on (`DistillTask`'s eval)."""
  import jax
  from flax import nnx

  from core import mesh as mesh_lib
  from llm.speculative import distill
  from llm.train_lib import OptimConfig
  mesh = mesh_lib.make_mesh("data:1", devices=jax.devices()[:1])
  task = distill.DistillTask(target, OptimConfig(peak_lr=1e-3, warmup_steps=1, total_steps=2),
                             mesh, draft_vocab=draft_vocab, unroll=max(steps, 2))
  src = distill.SequenceSource(tokens, mask, batch_size, split="eval", feats=feats,
                               loss_from=loss_from)
  state = {"params": nnx.to_pure_dict(nnx.state(head))}
  step = jax.jit(task.eval_step)
  ev = task.new_evaluator()
  for b in src.batches(0):
    ev.update(step(state, task.device_batch(b)), b)
  res = ev.result()
  return {f"top1_d{s}": res[f"top1_d{s}"] for s in range(1, steps + 1)}


def accept_lengths(target, head, prompts, shape, max_new_tokens: int, *, stop_tokens=(),
                   draft_vocab=None) -> dict:
  """Greedy speculative decoding of each prompt alone: accept length (tokens per round,
  EAGLE's tau), rounds, and per depth the share of rounds reaching it that accept it."""
  from llm.speculative.decode import cache_slots, speculative_generate
  max_len = cache_slots(max(len(p) for p in prompts), max_new_tokens, shape)
  per_round = []
  for p in prompts:
    r = speculative_generate(target, head, [list(p)], max_new_tokens, shape=shape,
                             stop_tokens=stop_tokens, draft_vocab=draft_vocab, max_len=max_len)
    per_round += r.accepted_per_round[0]
  a = np.asarray(per_round)
  reach = [int(np.sum(a >= d)) for d in range(shape.depth + 1)]
  return {"accept_length": float((a.sum() + len(a)) / max(len(a), 1)), "rounds": len(a),
          "per_depth": [reach[d + 1] / reach[d] if reach[d] else None
                        for d in range(shape.depth)]}


def held_out_features(data_dir: str, tokens: np.ndarray, dim: int, eval_sequences: int,
                      target: str = ""):
  """The target's features of the last `eval_sequences` of `tokens` from
  <data_dir>/features.npz, or None (and a printed line saying why) where that file is absent
  or holds other features: those of other sequences or of another target (`target`: its
  `distill.target_fingerprint`), or not all of them (a killed run leaves rows of zeros, or
  the features captured so far under the sequences' settings)."""
  from llm.speculative import distill
  path = os.path.join(data_dir, "features.npz")
  if not os.path.exists(path):
    return None
  with np.load(path) as f:
    key, want = str(f["key"]), distill.features_key(tokens, dim, target)
    # A run with taps keys its file `<key>:taps=[...]`; its "feats" are the same features.
    if (key == want or key.startswith(want + ":taps=")) and int(f["done"]) == len(tokens):
      return f["feats"][len(tokens) - eval_sequences:]
  print(f"{path}: not the finished features of these sequences by this target; per-step "
        "agreement skipped", flush=True)
  return None


def define_flags() -> None:
  config.define_flags(
      None, "target", "data", "heads", "eval_sequences", "draft_vocab", "steps", "trees",
      "max_new_tokens", "workdir", target=None, data=None, heads=[], eval_sequences=32,
      draft_vocab=0, steps=3, trees=["chain:4", "2:4:4"], max_new_tokens=64,
      workdir="runs/spec_heads")
  flags.mark_flags_as_required(["target", "data"])


def main(argv):
  del argv
  cli.quiet_library_logs()
  from llm.checkpoints import load_config, load_model
  from llm.speculative import distill
  from llm.speculative.tree import TreeShape
  if not FLAGS.heads:
    raise ValueError("--heads: none given; expected spec_decode draft directories, e.g. "
                     "--heads=runs/a/draft,runs/b/draft")
  for wd in FLAGS.heads:   # every head before the first one's evaluation
    if not os.path.isdir(os.path.join(wd, "checkpoints")):
      raise errors.expected(f"--heads={','.join(FLAGS.heads)}", f"{wd} holds no checkpoints",
                            "spec_decode draft directories (<workdir>/draft)")
  if not FLAGS.trees:
    raise errors.expected("--trees=''", "no tree shape", "shapes TOP_K:DEPTH:BUDGET or "
                          "chain:DEPTH")
  shapes = [TreeShape.parse(t) for t in FLAGS.trees]
  path = os.path.join(FLAGS.data, "sequences.npz")
  if not os.path.exists(path):
    raise ValueError(f"--data={FLAGS.data}: no sequences.npz there; expected a spec_decode "
                     "draft directory")
  with np.load(path) as f:
    key = json.loads(str(f["key"]))
    tokens, mask, done = f["tokens"], f["mask"], int(f["done"])
  n, ev = len(tokens), FLAGS.eval_sequences
  if done < n:
    raise errors.expected(f"--data={FLAGS.data}", f"{done} of {n} sequences made in {path} "
                          "(an interrupted run)", "a finished run's sequences")
  if ev >= n:
    raise errors.expected(f"--eval_sequences={ev}", f"--data holds {n} sequences",
                          f"fewer than {n} (the others count the draft vocabulary)")
  cfg = load_config(FLAGS.target)
  if FLAGS.draft_vocab > cfg.vocab_size:
    raise errors.expected(f"--draft_vocab={FLAGS.draft_vocab}", "more tokens than the "
                          "target's vocabulary", f"at most {cfg.vocab_size}")
  if FLAGS.draft_vocab and FLAGS.draft_vocab < max(s.top_k for s in shapes):
    raise errors.expected(f"--draft_vocab={FLAGS.draft_vocab}", "fewer tokens than a tree "
                          "drafts per node", f"at least the largest top_k of --trees "
                          f"({max(s.top_k for s in shapes)})")
  prompts = [key["prompts"][i % len(key["prompts"])] for i in range(n)]
  longest = max(len(p) for p in prompts[n - ev:])
  if longest + FLAGS.max_new_tokens > cfg.max_seq_len:
    raise errors.expected(f"--max_new_tokens={FLAGS.max_new_tokens}", "beyond the target's "
                          f"max_seq_len={cfg.max_seq_len} after a held-out prompt of {longest} "
                          "tokens", f"at most {cfg.max_seq_len - longest}")
  cfg, target = load_model(FLAGS.target)
  vocab = (distill.draft_vocab(tokens[:n - ev], mask[:n - ev], FLAGS.draft_vocab,
                               cfg.vocab_size) if FLAGS.draft_vocab else None)
  loss_from = np.asarray([len(p) - 1 for p in prompts], np.int32)
  feats = held_out_features(FLAGS.data, tokens, cfg.dim, ev, distill.target_fingerprint(target))
  rows = []
  for wd in FLAGS.heads:
    head = distill.load_draft(wd, cfg, where="--heads")
    row = {"head": wd}
    if feats is not None and not head.taps:
      row.update(per_step_top1(target, head, tokens[n - ev:], mask[n - ev:], feats,
                               loss_from[n - ev:], vocab, FLAGS.steps))
    for shape in shapes:
      row[str(shape)] = accept_lengths(target, head, prompts[n - ev:], shape,
                                       FLAGS.max_new_tokens, stop_tokens=key.get("stop", ()),
                                       draft_vocab=vocab)
    print(json.dumps(row), flush=True)
    rows.append(row)
  summary = {r["head"]: {str(s): round(r[str(s)]["accept_length"], 3) for s in shapes}
             for r in rows}
  results_lib.finish(FLAGS.workdir, {"rows": rows, "flags": {
      f: FLAGS[f].value for f in ("target", "data", "heads", "eval_sequences", "draft_vocab",
                                  "steps", "trees", "max_new_tokens")}}, summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
