"""Searched ranking architectures: Rankitect's space of low-level blocks (arXiv 2311.08430).

An architecture is a plain dict (a JSON file) that `SearchedConfig.from_arch` checks and
`SearchedModel` builds, composing the layers of rec/layers and rec/models layer by layer:

    x_dense = bottom MLP(dense) (or the raw dense features when bottom_mlp is [])
    X_0     = [x_dense as n_d embeddings (dense_in_stack), F pooled embeddings]   [B, N_0, D]
    X_{i+1} = Norm(Combine_j Block_j(X_i) + Residual(X_i))        stack layer i    [B, N_{i+1}, D]
    h       = concat(head parts of X_L)                                            [B, H]
    h       = flat blocks(h)                                                       [B, H']
    logit   = top MLP(h)

Stack blocks map [B, N, D] -> [B, num_out, D]:
    lcb        Wukong's LCB / DHEN's linear: a learned [N, num_out] mix (LinearCompression)
    fmb        Wukong's FMB: X X^T Y (rank), LayerNorm, MLP (sizes) (FactorizationMachineBlock)
    dot        DHEN's AdvancedDLRM: pairwise dot products -> linear (dhen.DotProjection)
    attention  self-attention over the embeddings (heads, head_dim), then an LCB to num_out
    dcn        DCN-v2 cross layers (layers, rank) on the flattened stack (dhen.FlatCross), LCB
    mlp        flatten -> MLP (sizes) -> num_out embeddings
    identity   X itself (an LCB to num_out where N differs)
Combine: "concat" (N_{i+1} = sum of num_out) or "sum" (equal num_out); residual: X, or an
LCB N_i -> N_{i+1} where they differ (DHEN's shortcut, Wukong's residual); norm: LayerNorm
over each embedding's D values. A layer with no blocks is its residual alone.
Head parts: "dense" (x_dense; nothing when the data has no dense features), "flatten"
(X_L as [B, N D]), "dot" (DLRM's pairwise dot products of X_L), "fm" (the FM sum, [B, 1]).
Flat blocks: "cross" (a DCN-v2 cross network: layers, rank) and "mlp" (ReLU MLP: sizes).

The hand-designed models are points of this space (`dlrm_arch`, `dcnv2_arch`, `dhen_arch`,
`wukong_arch`), with the same parameters in the same modules: DLRM is head
["dense", "dot"] over X_0 with no stack layer; DCN-v2 (stacked) head ["dense", "flatten"]
then flat cross and mlp; DHEN and Wukong stack layers, head ["flatten"].

Letters: B batch, Dn dense features, D embedding dim, F sparse features, N embeddings in a
stack, H flat width.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
from flax import nnx

from core.errors import UserError
from rec.embedding.config import TableConfig
from rec.layers.attention import SelfAttentionInteraction
from rec.layers.compression import LinearCompression
from rec.layers.dcn import CrossNetwork
from rec.layers.fm import FactorizationMachineBlock, fm_interaction
from rec.layers.interaction import dot_interaction, num_dot_outputs
from rec.layers.mlp import MLP
from rec.models import common
from rec.models.dhen import DotProjection, FlatCross

STACK_BLOCKS = ("lcb", "fmb", "dot", "attention", "dcn", "mlp", "identity")
FLAT_BLOCKS = ("cross", "mlp")
HEAD_PARTS = ("dense", "flatten", "dot", "fm")
COMBINES = ("concat", "sum")
# The keys each block type reads (besides "type"); any other key is an error.
BLOCK_KEYS = {
    "lcb": ("num_out",), "fmb": ("num_out", "rank", "sizes"), "dot": ("num_out",),
    "attention": ("num_out", "heads", "head_dim"), "dcn": ("num_out", "layers", "rank"),
    "mlp": ("num_out", "sizes"), "identity": ("num_out",),
}
FLAT_KEYS = {"cross": ("layers", "rank"), "mlp": ("sizes",)}
LAYER_KEYS = ("blocks", "combine", "residual", "norm")
ARCH_KEYS = ("embedding_dim", "bottom_mlp", "bottom_relu_last", "dense_in_stack", "layers",
             "head", "flat", "top_mlp")


@dataclasses.dataclass(frozen=True)
class Block:
  """One block: its type and sizes (the fields its type reads; see BLOCK_KEYS / FLAT_KEYS)."""

  type: str
  num_out: int = 0          # stack blocks: embeddings out
  sizes: tuple[int, ...] = ()   # fmb / mlp hidden widths (stack mlp: then num_out * D)
  rank: int = 0             # fmb: FM projection columns; dcn / cross: 0 = full rank
  layers: int = 1           # dcn / cross: cross layers
  heads: int = 2            # attention
  head_dim: int = 0         # attention: 0 = D // heads


@dataclasses.dataclass(frozen=True)
class Layer:
  """A stack layer: Norm(Combine(blocks) + Residual)."""

  blocks: tuple[Block, ...]
  combine: str = "concat"
  residual: bool = True
  norm: bool = True


def _where(where: str, path: str) -> str:
  return f"{where}: {path}" if where else path


def _show(value: Any, limit: int = 80) -> str:
  """A value as an error message quotes it: repr, shortened."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _int(value: Any, path: str, where: str, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise UserError(f"{_where(where, path)}: {_show(value)}; expected an integer >= {minimum}")
  return value


def _sizes(value: Any, path: str, where: str) -> tuple[int, ...]:
  if not isinstance(value, (list, tuple)):
    raise UserError(f"{_where(where, path)}: {_show(value)}; expected a list of layer widths")
  return tuple(_int(v, f"{path}[{i}]", where) for i, v in enumerate(value))


def _keys(d: Any, allowed: Sequence[str], path: str, where: str) -> None:
  if not isinstance(d, Mapping):
    raise UserError(f"{_where(where, path)}: {_show(d)}; expected an object")
  bad = sorted(set(d) - set(allowed))
  if bad:
    raise UserError(f"{_where(where, path)}: unknown key(s) {_show(bad)}; expected keys from "
                    f"{sorted(allowed)}")


def _block(d: Any, path: str, where: str, flat: bool) -> Block:
  kinds = FLAT_KEYS if flat else BLOCK_KEYS
  if not isinstance(d, Mapping) or "type" not in d:
    raise UserError(f"{_where(where, path)}: {_show(d)}; expected an object with a \"type\"")
  kind = d["type"]
  if not isinstance(kind, str) or kind not in kinds:
    raise UserError(f"{_where(where, path)}: unknown block {_show(kind)}; expected one of "
                    f"{sorted(kinds)}")
  _keys(d, ("type",) + kinds[kind], path, where)
  kw: dict[str, Any] = {"type": kind}
  for k, v in d.items():
    if k == "sizes":
      kw[k] = _sizes(v, f"{path}.sizes", where)
    elif k in ("rank", "head_dim"):
      kw[k] = _int(v, f"{path}.{k}", where, minimum=0)
    elif k != "type":
      kw[k] = _int(v, f"{path}.{k}", where)
  if not flat and kind not in ("identity",) and "num_out" not in d:
    raise UserError(f"{_where(where, path)}: block {kind!r} needs \"num_out\" (embeddings out)")
  if kind == "fmb" and ("rank" not in d or d["rank"] < 1):
    raise UserError(f"{_where(where, path)}: block 'fmb' needs \"rank\" >= 1 (FM projection)")
  if kind == "mlp" and flat and not kw.get("sizes"):
    raise UserError(f"{_where(where, path)}: flat block 'mlp' needs non-empty \"sizes\"")
  return Block(**kw)


def _bool(value: Any, path: str, where: str) -> bool:
  if not isinstance(value, bool):
    raise UserError(f"{_where(where, path)}: {_show(value)}; expected true or false")
  return value


@dataclasses.dataclass(frozen=True)
class SearchedConfig:
  """A searched architecture on data of a given shape (see the module docstring)."""

  num_dense: int
  num_sparse: int
  embedding_dim: int
  rows_per_feature: tuple[int, ...]
  bottom_mlp: tuple[int, ...] = ()
  bottom_relu_last: bool = True
  dense_in_stack: bool = True
  layers: tuple[Layer, ...] = ()
  head: tuple[str, ...] = ("flatten",)
  flat: tuple[Block, ...] = ()
  top_mlp: tuple[int, ...] = (1,)
  feature_names: tuple[str, ...] | None = None
  dtype: str = "float32"

  def __post_init__(self):
    w = "SearchedConfig"
    object.__setattr__(self, "bottom_mlp", tuple(int(s) for s in self.bottom_mlp))
    object.__setattr__(self, "top_mlp", tuple(int(s) for s in self.top_mlp))
    object.__setattr__(self, "layers", tuple(self.layers))
    object.__setattr__(self, "head", tuple(self.head))
    object.__setattr__(self, "flat", tuple(self.flat))
    common.normalize_features(self)
    common.check_dtype(w, self.dtype)
    if self.num_sparse < 1 or self.num_dense < 0 or self.embedding_dim < 1:
      raise ValueError(f"{w}: num_sparse={self.num_sparse}, num_dense={self.num_dense}, "
                       f"embedding_dim={self.embedding_dim}; expected >= 1, >= 0, >= 1")
    if self.num_dense == 0 and self.bottom_mlp:
      raise ValueError(f"{w}: bottom_mlp={self.bottom_mlp} with num_dense=0; expected []")
    if self.num_dense > 0 and self.dense_in_stack and self.dense_width % self.embedding_dim:
      raise ValueError(f"{w}: dense_in_stack with a dense vector of {self.dense_width} values "
                       f"(bottom_mlp={list(self.bottom_mlp)}); expected a multiple of "
                       f"embedding_dim={self.embedding_dim}")
    if not self.top_mlp or self.top_mlp[-1] != 1:
      raise ValueError(f"{w}: top_mlp={list(self.top_mlp)} must end at 1 (the logit)")
    if not self.head or any(h not in HEAD_PARTS for h in self.head):
      raise ValueError(f"{w}: head={list(self.head)}; expected a non-empty list from {HEAD_PARTS}")
    n = self.num_inputs
    for i, layer in enumerate(self.layers):
      if layer.combine not in COMBINES:
        raise ValueError(f"{w}: layers[{i}].combine={layer.combine!r}; expected one of {COMBINES}")
      if not layer.blocks and not layer.residual:
        raise ValueError(f"{w}: layers[{i}] has no blocks and no residual; expected at least one")
      outs = [self.block_out(b, n) for b in layer.blocks]
      if layer.combine == "sum" and len(set(outs)) > 1:
        raise ValueError(f"{w}: layers[{i}] sums blocks of {outs} embeddings; expected equal "
                         "num_out (or combine \"concat\")")
      for j, b in enumerate(layer.blocks):
        if b.type == "dot" and n < 2:
          raise ValueError(f"{w}: layers[{i}].blocks[{j}] 'dot' on {n} embedding; expected >= 2")
      n = self.layer_out(layer, n)
    if "dot" in self.head and n < 2:
      raise ValueError(f"{w}: head 'dot' on {n} embedding; pairwise products need >= 2")

  @property
  def dense_width(self) -> int:
    """Width of x_dense: the bottom MLP's output, or the raw dense features."""
    return self.bottom_mlp[-1] if self.bottom_mlp else self.num_dense

  @property
  def num_dense_embeddings(self) -> int:
    if self.num_dense == 0 or not self.dense_in_stack:
      return 0
    return self.dense_width // self.embedding_dim

  @property
  def num_inputs(self) -> int:
    """N_0: dense embeddings (dense_in_stack) and the F sparse embeddings."""
    return self.num_sparse + self.num_dense_embeddings

  @staticmethod
  def block_out(block: Block, num_in: int) -> int:
    return block.num_out or num_in

  def layer_out(self, layer: Layer, num_in: int) -> int:
    if not layer.blocks:
      return num_in
    outs = [self.block_out(b, num_in) for b in layer.blocks]
    return sum(outs) if layer.combine == "concat" else outs[0]

  def stack_sizes(self) -> list[tuple[int, int]]:
    """(N_in, N_out) of every stack layer."""
    sizes, n = [], self.num_inputs
    for layer in self.layers:
      sizes.append((n, self.layer_out(layer, n)))
      n = sizes[-1][1]
    return sizes

  @property
  def head_width(self) -> int:
    n = self.stack_sizes()[-1][1] if self.layers else self.num_inputs
    d = self.embedding_dim
    widths = {"dense": self.dense_width if self.num_dense > 0 else 0, "flatten": n * d,
              "dot": num_dot_outputs(n), "fm": 1}
    return sum(widths[h] for h in self.head)

  def flat_widths(self) -> list[tuple[int, int]]:
    sizes, h = [], self.head_width
    for b in self.flat:
      out = h if b.type == "cross" else b.sizes[-1]
      sizes.append((h, out))
      h = out
    return sizes

  @property
  def top_in(self) -> int:
    return self.flat_widths()[-1][1] if self.flat else self.head_width

  def tables(self) -> list[TableConfig]:
    """One sum-pooled table per sparse feature, named after the feature."""
    return [TableConfig(name=name, num_rows=rows, dim=self.embedding_dim)
            for name, rows in zip(self.feature_names, self.rows_per_feature)]

  # --- the JSON form

  def arch(self) -> dict[str, Any]:
    """The data-independent architecture as a JSON-able dict (`from_arch` reads it back)."""
    def block(b: Block, flat: bool) -> dict[str, Any]:
      keys = (FLAT_KEYS if flat else BLOCK_KEYS)[b.type]
      out: dict[str, Any] = {"type": b.type}
      for k in keys:
        v = getattr(b, k)
        if k == "num_out" and v == 0:
          continue
        out[k] = list(v) if isinstance(v, tuple) else v
      return out
    return {"embedding_dim": self.embedding_dim, "bottom_mlp": list(self.bottom_mlp),
            "bottom_relu_last": self.bottom_relu_last, "dense_in_stack": self.dense_in_stack,
            "layers": [{"blocks": [block(b, False) for b in l.blocks], "combine": l.combine,
                        "residual": l.residual, "norm": l.norm} for l in self.layers],
            "head": list(self.head), "flat": [block(b, True) for b in self.flat],
            "top_mlp": list(self.top_mlp)}

  @classmethod
  def from_arch(cls, arch: Mapping[str, Any], num_dense: int, num_sparse: int,
                rows_per_feature, feature_names=None, dtype: str = "float32",
                where: str = "") -> SearchedConfig:
    """Checks an architecture dict (errors name `where`, e.g. the file, and the key path)
    and places it on data with these features. With no dense features the bottom MLP is
    dropped and the head part "dense" contributes nothing."""
    _keys(arch, ARCH_KEYS, "architecture", where)
    if "embedding_dim" not in arch or "top_mlp" not in arch:
      raise UserError(f"{_where(where, 'architecture')}: missing \"embedding_dim\" or "
                      "\"top_mlp\"; both are required")
    layers = []
    raw_layers = arch.get("layers", [])
    if not isinstance(raw_layers, list):
      raise UserError(f"{_where(where, 'layers')}: {_show(raw_layers)}; expected a list of layers")
    for i, l in enumerate(raw_layers):
      _keys(l, LAYER_KEYS, f"layers[{i}]", where)
      blocks = l.get("blocks", [])
      if not isinstance(blocks, list):
        raise UserError(f"{_where(where, f'layers[{i}].blocks')}: {_show(blocks)}; expected a list")
      layers.append(Layer(
          blocks=tuple(_block(b, f"layers[{i}].blocks[{j}]", where, flat=False)
                       for j, b in enumerate(blocks)),
          combine=l.get("combine", "concat"),
          residual=_bool(l.get("residual", True), f"layers[{i}].residual", where),
          norm=_bool(l.get("norm", True), f"layers[{i}].norm", where)))
    flat = arch.get("flat", [])
    if not isinstance(flat, list):
      raise UserError(f"{_where(where, 'flat')}: {_show(flat)}; expected a list of blocks")
    head = arch.get("head", ["flatten"])
    if not isinstance(head, list) or any(h not in HEAD_PARTS for h in head):
      raise UserError(f"{_where(where, 'head')}: {_show(head)}; expected a list from {list(HEAD_PARTS)}")
    bottom = _sizes(arch.get("bottom_mlp", []), "bottom_mlp", where) if num_dense > 0 else ()
    try:
      return cls(num_dense=num_dense, num_sparse=num_sparse,
                 embedding_dim=_int(arch["embedding_dim"], "embedding_dim", where),
                 rows_per_feature=rows_per_feature, bottom_mlp=bottom,
                 bottom_relu_last=_bool(arch.get("bottom_relu_last", True), "bottom_relu_last",
                                        where),
                 dense_in_stack=_bool(arch.get("dense_in_stack", True), "dense_in_stack", where),
                 layers=tuple(layers), head=tuple(head),
                 flat=tuple(_block(b, f"flat[{j}]", where, flat=True) for j, b in enumerate(flat)),
                 top_mlp=_sizes(arch["top_mlp"], "top_mlp", where), feature_names=feature_names,
                 dtype=dtype)
    except UserError:
      raise
    except ValueError as e:
      raise UserError(f"{_where(where, 'architecture')}: {e}") from None


def load_arch(path: str) -> dict[str, Any]:
  """An architecture JSON file as a dict (checked when a SearchedConfig is built from it)."""
  if not os.path.isfile(path):
    raise UserError(f"--model=searched:{path}: no such file; expected an architecture JSON "
                    "file (rec/models/searched.py)")
  with open(path, "rb") as f:
    data = f.read()
  try:
    arch = json.loads(data.decode("utf-8"))
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise UserError(f"{path}:{line}: byte {data[e.start]:#04x} is not UTF-8 text; expected an "
                    "architecture JSON object") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path}:{e.lineno}:{e.colno}: {e.msg}; expected an architecture JSON "
                    "object") from None
  except RecursionError:
    raise UserError(f"{path}: JSON nested too deeply to read; expected an architecture JSON "
                    "object") from None
  if not isinstance(arch, dict):
    raise UserError(f"{path}: a JSON {type(arch).__name__}; expected an architecture JSON "
                    "object ({\"embedding_dim\": ..., \"top_mlp\": [...], ...})")
  return arch


def save_arch(arch: Mapping[str, Any], path: str) -> str:
  """Writes an architecture dict as JSON (atomic: temp file + rename)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(arch, f, indent=1)
  os.replace(tmp, path)
  return path


# --------------------------------------------------------------------------- modules


class MLPEmbeddings(nnx.Module):
  """flatten -> MLP (ReLU hidden, linear last) -> num_out embeddings: [B, N, D] -> [B, M, D]."""

  def __init__(self, num_in: int, num_out: int, dim: int, sizes: Sequence[int], rngs: nnx.Rngs,
               dtype=jnp.float32):
    self.num_out, self.dim = num_out, dim
    self.mlp = MLP(num_in * dim, tuple(sizes) + (num_out * dim,), rngs, activate_last=False,
                   dtype=dtype)

  def __call__(self, x_BND):
    h = self.mlp(x_BND.reshape(x_BND.shape[0], -1))
    return h.reshape(h.shape[0], self.num_out, self.dim)


class StackBlock(nnx.Module):
  """One stack block, then an LCB to num_out where its natural output count differs."""

  def __init__(self, block: Block, num_in: int, dim: int, rngs: nnx.Rngs, dtype=jnp.float32):
    t, m = block.type, block.num_out or num_in
    inner = None
    if t == "lcb":
      inner, n_mid = LinearCompression(num_in, m, rngs, dtype), m
    elif t == "fmb":
      inner = FactorizationMachineBlock(num_in, m, dim, block.rank, block.sizes, rngs,
                                        dtype=dtype)
      n_mid = m
    elif t == "dot":
      inner, n_mid = DotProjection(num_in, m, dim, rngs, dtype), m
    elif t == "attention":
      head_dim = block.head_dim or max(1, dim // block.heads)
      inner = SelfAttentionInteraction(dim, block.heads, head_dim, rngs, dtype=dtype)
      n_mid = num_in
    elif t == "dcn":
      inner, n_mid = FlatCross(num_in, dim, block.layers, block.rank or None, rngs, dtype), num_in
    elif t == "mlp":
      inner, n_mid = MLPEmbeddings(num_in, m, dim, block.sizes, rngs, dtype), m
    elif t == "identity":
      n_mid = num_in
    else:
      raise ValueError(f"StackBlock: block {t!r}, expected one of {STACK_BLOCKS}")
    self.inner = nnx.data(inner)
    self.fit = LinearCompression(n_mid, m, rngs, dtype) if n_mid != m else None

  def __call__(self, x_BND):
    y = self.inner(x_BND) if self.inner is not None else x_BND
    return self.fit(y) if self.fit is not None else y


class StackLayer(nnx.Module):
  """Norm(Combine_j Block_j(X) + Residual(X)): [B, N_in, D] -> [B, N_out, D]."""

  def __init__(self, layer: Layer, num_in: int, num_out: int, dim: int, rngs: nnx.Rngs,
               dtype=jnp.float32):
    self.combine, self.residual = layer.combine, layer.residual
    self.blocks = nnx.List([StackBlock(b, num_in, dim, rngs, dtype) for b in layer.blocks])
    self.shortcut = (LinearCompression(num_in, num_out, rngs, dtype)
                     if layer.residual and num_in != num_out else None)
    self.norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs) if layer.norm else None

  def __call__(self, x_BND):
    outs = [b(x_BND) for b in self.blocks]
    y = None
    if outs:
      y = jnp.concatenate(outs, axis=1) if self.combine == "concat" else sum(outs[1:], outs[0])
    return self.finish(x_BND, y)

  def finish(self, x_BND, y_BND):
    """Residual and norm around the combined blocks' output (None: no block)."""
    if self.residual:
      skip = self.shortcut(x_BND) if self.shortcut is not None else x_BND
      y_BND = skip if y_BND is None else y_BND + skip.astype(y_BND.dtype)
    return self.norm(y_BND) if self.norm is not None else y_BND


class SearchedModel(nnx.Module):
  """The dense part of a searched architecture: bottom MLP, stack layers, head, flat blocks,
  top MLP to one logit."""

  def __init__(self, config: SearchedConfig, rngs: nnx.Rngs):
    self.config = cfg = config
    dtype = common.DTYPES[cfg.dtype]
    d = cfg.embedding_dim
    self.bottom_mlp = (MLP(cfg.num_dense, cfg.bottom_mlp, rngs,
                           activate_last=cfg.bottom_relu_last, dtype=dtype)
                       if cfg.num_dense > 0 and cfg.bottom_mlp else None)
    self.layers = nnx.List([StackLayer(layer, n_in, n_out, d, rngs, dtype)
                            for layer, (n_in, n_out) in zip(cfg.layers, cfg.stack_sizes())])
    self.flat = nnx.List([
        CrossNetwork(w_in, b.layers, rngs, rank=b.rank or None, dtype=dtype) if b.type == "cross"
        else MLP(w_in, b.sizes, rngs, activate_last=True, dtype=dtype)
        for b, (w_in, _) in zip(cfg.flat, cfg.flat_widths())])
    self.top_mlp = MLP(cfg.top_in, cfg.top_mlp, rngs, activate_last=False, dtype=dtype)

  def stem(self, dense_BD, emb_BFD):
    """(x_dense [B, Dn'] or None, X_0 [B, N_0, D])."""
    cfg = self.config
    common.check_inputs("SearchedModel", cfg, dense_BD, emb_BFD)
    dtype = common.DTYPES[cfg.dtype]
    x_BND = emb_BFD.astype(dtype)
    x_dense = None
    if cfg.num_dense > 0:
      x_dense = dense_BD.astype(dtype)
      if self.bottom_mlp is not None:
        x_dense = self.bottom_mlp(x_dense)
      if cfg.dense_in_stack:
        x_BND = jnp.concatenate([x_dense.reshape(x_dense.shape[0], cfg.num_dense_embeddings,
                                                 cfg.embedding_dim), x_BND], axis=1)
    return x_dense, x_BND

  def top(self, x_dense, x_BND):
    """Head parts of the last stack, flat blocks, top MLP: float32 logits [B]."""
    return self.top_mlp(self.flat_part(x_dense, x_BND))[:, 0].astype(jnp.float32)

  @property
  def body_dim(self) -> int:
    return self.config.top_in

  def body(self, dense_BD, emb_BFD):
    """Everything under the top MLP, [B, body_dim] (what extra heads read)."""
    x_dense, x_BND = self.stem(dense_BD, emb_BFD)
    for layer in self.layers:
      x_BND = layer(x_BND)
    return self.flat_part(x_dense, x_BND)

  def flat_part(self, x_dense, x_BND):
    """Head parts of the last stack, then the flat blocks: [B, top_in]."""
    parts = []
    for h in self.config.head:
      if h == "dense":
        if x_dense is not None:
          parts.append(x_dense)
      elif h == "flatten":
        parts.append(x_BND.reshape(x_BND.shape[0], -1))
      elif h == "dot":
        parts.append(dot_interaction(None, x_BND))
      else:
        parts.append(fm_interaction(x_BND)[:, None])
    h_BH = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    for block in self.flat:
      h_BH = block(h_BH)
    return h_BH

  def __call__(self, dense_BD, emb_BFD):
    """dense_BD: [B, Dn] (ignored, may be None, when num_dense == 0); emb_BFD: [B, F, D].

    Returns float32 logits [B].
    """
    return self.top_mlp(self.body(dense_BD, emb_BFD))[:, 0].astype(jnp.float32)


# --------------------------------------------------------------------------- hand-designed points


def dlrm_arch(cfg) -> dict[str, Any]:
  """A DLRMConfig as an architecture: bottom MLP (ReLU last) into the stack, head
  [dense, dot] (DLRM's [dense, pairwise products]), no stack layer, top MLP."""
  if cfg.self_interaction:
    raise ValueError("dlrm_arch: self_interaction=True has no point in the searched space")
  return {"embedding_dim": cfg.embedding_dim, "bottom_mlp": list(cfg.bottom_mlp),
          "bottom_relu_last": True, "dense_in_stack": True, "layers": [],
          "head": ["dense", "dot"], "flat": [], "top_mlp": list(cfg.top_mlp)}


def dcnv2_arch(cfg) -> dict[str, Any]:
  """A stacked DCNv2Config: head [dense, flatten] (x0), flat cross network then deep MLP."""
  if cfg.structure != "stacked":
    raise ValueError(f"dcnv2_arch: structure={cfg.structure!r}; the searched space has the "
                     "stacked DCN-v2 only")
  flat = [{"type": "cross", "layers": cfg.num_cross_layers, "rank": cfg.cross_rank}]
  if cfg.deep_mlp:
    flat.append({"type": "mlp", "sizes": list(cfg.deep_mlp)})
  return {"embedding_dim": cfg.embedding_dim, "bottom_mlp": list(cfg.bottom_mlp),
          "bottom_relu_last": True, "dense_in_stack": False, "layers": [],
          "head": ["dense", "flatten"], "flat": flat, "top_mlp": list(cfg.top_mlp)}


def wukong_arch(cfg) -> dict[str, Any]:
  """A WukongConfig: l layers of concat(FMB, LCB) + residual, LayerNorm; head flatten."""
  if cfg.fm_output_relu:
    raise ValueError("wukong_arch: fm_output_relu=True has no point in the searched space "
                     "(its FMB ends linear, the paper's)")
  layer = {"blocks": [{"type": "fmb", "num_out": cfg.num_fm, "rank": cfg.fm_rank,
                       "sizes": list(cfg.fm_mlp)},
                      {"type": "lcb", "num_out": cfg.num_lcb}],
           "combine": "concat", "residual": True, "norm": True}
  return {"embedding_dim": cfg.embedding_dim, "bottom_mlp": list(cfg.bottom_mlp),
          "bottom_relu_last": False, "dense_in_stack": True,
          "layers": [layer] * cfg.num_layers, "head": ["flatten"], "flat": [],
          "top_mlp": list(cfg.top_mlp)}


def dhen_arch(cfg) -> dict[str, Any]:
  """A DHENConfig (interactions dot, linear, dcn, self_attention; ensemble concat or sum)."""
  kinds = {"dot": "dot", "linear": "lcb", "dcn": "dcn", "self_attention": "attention"}
  if cfg.ensemble not in COMBINES:
    raise ValueError(f"dhen_arch: ensemble={cfg.ensemble!r}; expected one of {COMBINES}")
  layers = []
  for i, layer in enumerate(cfg.layers):
    blocks = []
    for k in layer:
      if k not in kinds:
        raise ValueError(f"dhen_arch: layer {i} interaction {k!r}; expected one of {sorted(kinds)}")
      b: dict[str, Any] = {"type": kinds[k], "num_out": cfg.width}
      if k == "dcn":
        b.update(layers=cfg.dcn_layers, rank=cfg.dcn_rank)
      if k == "self_attention":
        b.update(heads=cfg.num_heads, head_dim=cfg.attention_head_dim)
      blocks.append(b)
    layers.append({"blocks": blocks, "combine": cfg.ensemble, "residual": True, "norm": True})
  return {"embedding_dim": cfg.embedding_dim, "bottom_mlp": list(cfg.bottom_mlp),
          "bottom_relu_last": False, "dense_in_stack": True, "layers": layers,
          "head": ["flatten"], "flat": [], "top_mlp": list(cfg.top_mlp)}
