"""EAGLE speculative decoding with tree attention (arXiv 2508.08192; EAGLE 2401.15077, EAGLE-2
2406.16858): a one-layer draft head over the target's features proposes a tree of tokens, the
target scores the whole tree in one forward pass with its KV cache, and the longest path it
agrees with is kept, greedily or by rejection sampling that preserves its distribution.

  draft.py    DraftHead: fc([embed(x_{i+1}); f_i]) -> one Llama block -> RMSNorm; cast_head
  distill.py  self-distillation on sequences the target generates, through core.train:
              train_draft, the workdir's caches, load_draft (and the two modules' names)
  distill_data.py  generated sequences, the target's features, batches, draft vocabulary
  distill_task.py  the loss (feature regression + token cross-entropy), DistillTask
  tree.py     TreeShape (top_k, depth, budget), EAGLE-2 pool re-ranking, ancestor / slot masks
  accept.py   longest accepted path: greedy, or recursive rejection sampling (exact)
  decode.py   batched rounds under one while_loop: draft tree, verify, accept, commit KV

    from llm.speculative import DraftHead, TreeShape, speculative_generate
    out = speculative_generate(target, draft, prompts, 64, shape=TreeShape(4, 5, 24))
    out.tokens, out.accept_length, out.tokens_per_call
"""

from llm.speculative.draft import DraftHead, cast_head, draft_config
from llm.speculative.decode import SpecResult, speculative_generate
from llm.speculative.tree import TreeShape

__all__ = ["DraftHead", "SpecResult", "TreeShape", "cast_head", "draft_config",
           "speculative_generate"]
