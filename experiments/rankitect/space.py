"""The search space every method of the study shares (Rankitect, arXiv 2311.08430).

A point is one choice per stack layer among `CANDIDATES`, each a set of blocks of
rec/models/searched.py concatenated to `width` embeddings, in a layer with residual and
LayerNorm, over a fixed stem (bottom MLP into the stack) and top (flatten, top MLP). The
hand-designed layers are candidates too ("wukong": FMB + LCB, "dhen": dot + LCB), beside
single low-level blocks. `Space.arch(choices)` is the searched architecture dict that
`train_rec --model=searched:FILE` trains.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


def candidates(width: int) -> dict[str, list[dict[str, Any]]]:
  """Candidate name -> the blocks of one layer (concatenated: their num_out sum to width)."""
  half = max(1, width // 2)
  return {
      "skip": [{"type": "identity", "num_out": width}],
      "lcb": [{"type": "lcb", "num_out": width}],
      "dot": [{"type": "dot", "num_out": width}],
      "fmb": [{"type": "fmb", "num_out": width, "rank": 8, "sizes": [64]}],
      "fmb_wide": [{"type": "fmb", "num_out": width, "rank": 16, "sizes": [256]}],
      "attention": [{"type": "attention", "num_out": width, "heads": 2}],
      "dcn": [{"type": "dcn", "num_out": width, "layers": 1, "rank": 16}],
      "mlp": [{"type": "mlp", "num_out": width, "sizes": [64]}],
      "mlp_wide": [{"type": "mlp", "num_out": width, "sizes": [256]}],
      "wukong": [{"type": "fmb", "num_out": half, "rank": 8, "sizes": [64]},
                 {"type": "lcb", "num_out": width - half}],
      "dhen": [{"type": "dot", "num_out": half}, {"type": "lcb", "num_out": width - half}],
  }


@dataclasses.dataclass(frozen=True)
class Space:
  """num_layers stack layers of `width` embeddings of dim `embedding_dim`; each layer one of
  `names` (keys of `candidates(width)`)."""

  num_layers: int = 2
  width: int = 8
  embedding_dim: int = 16
  bottom_mlp: tuple[int, ...] = (64,)      # hidden widths; the last layer (D wide) is implied
  top_mlp: tuple[int, ...] = (64,)         # hidden widths; the logit layer is implied
  names: tuple[str, ...] = tuple(candidates(8))

  def __post_init__(self):
    known = candidates(self.width)
    bad = [n for n in self.names if n not in known]
    if bad:
      raise ValueError(f"Space: unknown candidate(s) {bad}; expected names from {sorted(known)}")
    if self.num_layers < 1 or self.width < 2 or self.embedding_dim < 1:
      raise ValueError(f"Space: num_layers={self.num_layers}, width={self.width}, embedding_dim="
                       f"{self.embedding_dim}; expected >= 1, >= 2, >= 1")

  @property
  def blocks(self) -> list[list[dict[str, Any]]]:
    """The blocks of each candidate, in `names` order."""
    c = candidates(self.width)
    return [c[n] for n in self.names]

  def layer(self, name: str) -> dict[str, Any]:
    return {"blocks": candidates(self.width)[name], "combine": "concat", "residual": True,
            "norm": True}

  def arch(self, choices: Sequence[str]) -> dict[str, Any]:
    """The architecture dict of one candidate name per layer."""
    if len(choices) != self.num_layers:
      raise ValueError(f"Space.arch: {len(choices)} choices {list(choices)} for "
                       f"{self.num_layers} layers")
    for c in choices:
      if c not in self.names:
        raise ValueError(f"Space.arch: choice {c!r}; expected one of {list(self.names)}")
    return {"embedding_dim": self.embedding_dim,
            "bottom_mlp": list(self.bottom_mlp) + [self.embedding_dim],
            "bottom_relu_last": False, "dense_in_stack": True,
            "layers": [self.layer(c) for c in choices], "head": ["flatten"], "flat": [],
            "top_mlp": list(self.top_mlp) + [1]}

  def size(self) -> int:
    return len(self.names) ** self.num_layers


# The hand-designed models at two sizes each, trained as themselves (rec.configs presets,
# embedding dim of the space): the "battling engineers" points of the Pareto plot.
BASELINES = (
    ("dlrm", "w64"), ("dlrm", "w256"),
    ("dcnv2", "x2_r8_w64"), ("dcnv2", "x3_r16_w256"),
    ("dhen", "small"), ("dhen", "dhen_2l"),
    ("wukong", "l1_n4_k8_w64"), ("wukong", "l2_n8_k16_w256"),
)
