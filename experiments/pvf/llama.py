"""PVF of a Llama per parameter group (arXiv 2405.01741): bit flips in the weights, and
whether the top-1 next token changes.

    groups = llama_groups(model)                 # embed, layers.<i>.attn, layers.<i>.mlp, norms
    rows = llama_pvf(model, tokens_XT, fmt="fp32", fault=FaultModel.parse("single"),
                     trials=1000, key=key)

A trial flips bits of one uniform value of a group (stored as fp32, bf16 or row-wise int8,
`core.faults`), runs the `Llama` module itself (`nnx.merge` of its graph definition with
the faulted parameters) on one of the X sequences and compares the logits of its last
position with the fault-free ones (`faults.top1_criterion`: the argmax changes, or a logit
turns non-finite). The group's arrays are copied per trial (vmapped), so groups must be
small enough for `chunk` copies; `embed` is also the output head when tied.
`sample_sequences` draws inputs from the model itself with `llm.generate.generate`
(temperature 1 from BOS), so the inputs are in-distribution without a text corpus.

Letters: X sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import faults
from llm import generate as generate_lib


def _paths(tree, prefix=()):
  if isinstance(tree, dict):
    for k in sorted(tree, key=str):
      yield from _paths(tree[k], prefix + (k,))
  else:
    yield prefix


def llama_groups(model) -> dict[str, list[tuple]]:
  """Group name -> paths of its parameters in the pure parameter dict: `embed` (+ `lm_head`
  when untied), `layers.<i>.attn` (wq, wk, wv, wo), `layers.<i>.mlp` (gate, up, down),
  `norms` (every RMSNorm scale)."""
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  groups: dict[str, list[tuple]] = {"embed": [("embed",)]}
  for i in sorted(pure["layers"]):
    groups[f"layers.{i}.attn"] = list(_paths(pure["layers"][i]["attn"], ("layers", i, "attn")))
    groups[f"layers.{i}.mlp"] = list(_paths(pure["layers"][i]["mlp"], ("layers", i, "mlp")))
  if "lm_head" in pure:
    groups["lm_head"] = [("lm_head",)]
  groups["norms"] = [p for p in _paths(pure) if p[-1] == "scale"]
  return groups


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  if not path:
    return value
  out = dict(tree)
  out[path[0]] = _set(tree[path[0]], path[1:], value)
  return out


def _runner(model):
  """logits(pure params, tokens_T) -> [T, V] float32 logits of one sequence."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def logits(pure, tokens_T):
    p = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(p, pure)
    return nnx.merge(graphdef, p, rest)(tokens_T[None])[0][0]
  return logits


def sample_sequences(model, num: int, length: int, key: jax.Array, bos: int = 1) -> np.ndarray:
  """[num, length] tokens: BOS then length - 1 tokens sampled from the model at
  temperature 1 (`llm.generate.generate`, no stop tokens)."""
  if length < 2:
    raise ValueError(f"sample_sequences: length={length}, expected >= 2 (BOS and a token)")
  new = generate_lib.generate(model, [[bos]] * num, length - 1, temperature=1.0, rng=key)
  return np.asarray([[bos] + row for row in new], np.int32)


def llama_pvf(model, tokens_XT: np.ndarray, fmt: str,
              fault: faults.FaultModel | Sequence[faults.FaultModel], trials: int,
              key: jax.Array, groups: Sequence[str] | None = None,
              chunk: int = 64, record: bool = False) -> list[dict[str, Any]]:
  """One row per group (and fault model, when several are given; each group's trials
  compile once for all of them): {group, values, fmt, fault, trials, changed, nonfinite,
  pvf, ci_low, ci_high} (+ the trials with `record`, `faults.estimate`); the criterion is
  the top-1 next token at the last position."""
  fault_list = [fault] if isinstance(fault, faults.FaultModel) else list(fault)
  criterion = faults.top1_criterion()
  all_groups = llama_groups(model)
  unknown = [g for g in (groups or []) if g not in all_groups]
  if unknown:
    raise ValueError(f"llama_pvf: groups {unknown} unknown; expected some of {list(all_groups)}")
  run = _runner(model)
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  enc = jax.tree.map(lambda a: faults.encode(a, fmt), pure)
  is_enc = lambda a: isinstance(a, dict) and "v" in a
  rows = []
  for gi, name in enumerate(groups or list(all_groups)):
    paths = all_groups[name]

    def faulty(d, elem, mask, x, paths=paths):
      new = faults.flip_in_group([_get(d["enc"], p) for p in paths], elem, mask)
      e = d["enc"]
      for p, v in zip(paths, new):
        e = _set(e, p, v)
      p = jax.tree.map(faults.decode, e, is_leaf=is_enc)
      return run(p, d["tokens"][x])[-1]

    data = {"enc": enc, "tokens": jnp.asarray(tokens_XT, jnp.int32)}
    size = faults.group_size([_get(enc, p) for p in paths])
    for fi, f in enumerate(fault_list):
      k = jax.random.fold_in(key, gi)
      res = faults.estimate(faulty, data, size, len(tokens_XT), faults.bit_width(fmt), f,
                            criterion, trials, k if fi == 0 else jax.random.fold_in(k, fi),
                            chunk, record=record)
      rows.append({"group": name, "values": size, "fmt": fmt, "fault": f.label, **res})
  return rows
