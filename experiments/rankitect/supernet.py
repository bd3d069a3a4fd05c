"""Weight-sharing supernet over `space.Space` for one-shot NAS and DNAS (arXiv 2311.08430).

Every layer holds every candidate's blocks (rec.models.searched.StackBlock), beside the
stem, the layers' residual and norm, and the top of a `SearchedModel` whose layers have no
blocks (`base`). Layer l's output is Norm(sum_k a_lk Candidate_k(X) + Residual(X)):
- one-shot ("path"): a_l one-hot, one candidate per layer drawn uniformly each step
  (lax.switch runs only that one);
- DNAS ("gumbel"): a_l = softmax((alpha_l + g) / tau) with Gumbel noise g (Gumbel-softmax,
  arXiv 1611.01144) and learned logits alpha [L, K]; the loss adds cost_weight times the
  expected FLOPs sum_lk a_lk F_lk over the largest candidate's, as in FBNet's cost term;
- evaluation with given weights (one-hot: a stand-alone candidate with inherited weights,
  `standalone` copies them out).

`SupernetTask` is `RecTask` whose step key (the seed folded with the step) draws the path
or the noise, and whose loss adds the cost term; batches, the collection and the loop are
RecTask's and core.train's. `CandidateTask` trains one architecture from scratch through
the supernet's program, its path an argument (state["path"]), so every architecture of the
space shares one compiled step.

Letters: B batch, N embeddings, D dim, L layers, K candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rec.models import searched
from rec.train_lib import RecTask, masked_bce

from experiments.rankitect.space import Space

MODES = ("path", "gumbel")


def gumbel_softmax(logits_LK, key, tau: float):
  """softmax((logits + g) / tau) over the last axis, g = -log(-log u), u ~ U(0, 1)."""
  u = jax.random.uniform(key, logits_LK.shape, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
  g = -jnp.log(-jnp.log(u))
  return jax.nn.softmax((logits_LK + g) / tau, axis=-1)


def arch_config(space: Space, choices, num_dense: int, num_sparse: int,
                rows) -> searched.SearchedConfig:
  return searched.SearchedConfig.from_arch(space.arch(choices), num_dense, num_sparse, rows)


class Supernet(nnx.Module):
  """All candidates of every layer over one shared stem, residuals, norms and top."""

  def __init__(self, space: Space, num_dense: int, num_sparse: int, rows, rngs: nnx.Rngs,
               mode: str = "path", tau: float = 1.0, flops_LK=None):
    if mode not in MODES:
      raise ValueError(f"Supernet: mode={mode!r}, expected one of {MODES}")
    self.space, self.mode, self.tau = space, mode, float(tau)
    # A SearchedModel of the space (every layer `width` embeddings out) with its blocks
    # removed holds what every path shares: stem, residuals, norms, top.
    cfg = arch_config(space, [space.names[0]] * space.num_layers, num_dense, num_sparse, rows)
    self.base = searched.SearchedModel(cfg, rngs)
    for layer in self.base.layers:
      layer.blocks = nnx.List([])
    d, n0 = space.embedding_dim, cfg.num_inputs
    self.candidates = nnx.List([
        nnx.List([nnx.List([searched.StackBlock(
            searched.Block(**{**b, "sizes": tuple(b.get("sizes", ()))}),
            n0 if l == 0 else space.width, d, rngs) for b in blocks]) for blocks in space.blocks])
        for l in range(space.num_layers)])
    self.alpha = (nnx.Param(jnp.zeros((space.num_layers, len(space.names)), jnp.float32))
                  if mode == "gumbel" else None)
    # FLOPs per example of candidate k at layer l (study.candidate_flops): the cost term.
    self.flops_LK = None if flops_LK is None else tuple(map(tuple, flops_LK))

  def _candidate(self, l: int, k: int, x_BND):
    outs = [b(x_BND) for b in self.candidates[l][k]]
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]

  def __call__(self, dense_BD, emb_BFD, weights_LK=None, path_L=None):
    """Logits [B] with mixing weights [L, K] (one-hot: one candidate per layer) or a path
    [L] of candidate indices (only those run)."""
    x_dense, x_BND = self.base.stem(dense_BD, emb_BFD)
    for l, layer in enumerate(self.base.layers):
      if path_L is not None:
        branches = [lambda x, l=l, k=k: self._candidate(l, k, x)
                    for k in range(len(self.space.names))]
        y = jax.lax.switch(path_L[l], branches, x_BND)
      else:
        w = weights_LK[l].astype(x_BND.dtype)
        y = sum(w[k] * self._candidate(l, k, x_BND) for k in range(len(self.space.names)))
      x_BND = layer.finish(x_BND, y)
    return self.base.top(x_dense, x_BND)

  def sample(self, dense_BD, emb_BFD, key):
    """(logits, cost) of one training step: a uniform path, or Gumbel-softmax weights and
    their expected FLOPs relative to the largest candidates'."""
    L, K = self.space.num_layers, len(self.space.names)
    if self.mode == "path":
      path = jax.random.randint(key, (L,), 0, K)
      return self(dense_BD, emb_BFD, path_L=path), jnp.float32(0.0)
    w_LK = gumbel_softmax(self.alpha[...], key, self.tau)
    cost = jnp.float32(0.0)
    if self.flops_LK is not None:
      f_LK = jnp.asarray(self.flops_LK, jnp.float32)
      cost = jnp.sum(w_LK * f_LK) / jnp.sum(jnp.max(f_LK, axis=1))
    return self(dense_BD, emb_BFD, weights_LK=w_LK), cost


def standalone(net: Supernet, choices, num_dense: int, num_sparse: int,
               rows) -> searched.SearchedModel:
  """The stand-alone searched model of `choices` with the supernet's weights (inherited)."""
  space = net.space
  cfg = arch_config(space, choices, num_dense, num_sparse, rows)
  model = searched.SearchedModel(cfg, nnx.Rngs(0))
  if net.base.bottom_mlp is not None:
    nnx.update(model.bottom_mlp, nnx.state(net.base.bottom_mlp))
  nnx.update(model.top_mlp, nnx.state(net.base.top_mlp))
  for l, (mine, shared) in enumerate(zip(model.layers, net.base.layers)):
    if (mine.shortcut is None) != (shared.shortcut is None):
      raise ValueError(f"standalone: layer {l} shortcut differs from the supernet's")
    if mine.shortcut is not None:
      nnx.update(mine.shortcut, nnx.state(shared.shortcut))
    nnx.update(mine.norm, nnx.state(shared.norm))
    k = space.names.index(choices[l])
    for b, src in zip(mine.blocks, net.candidates[l][k]):
      nnx.update(b, nnx.state(src))
  return model


class SupernetTask(RecTask):
  """RecTask over a Supernet: each step draws its path / Gumbel noise from the seed and the
  step, and the loss adds cost_weight times the supernet's cost term (metric flop_cost)."""

  def __init__(self, *args, seed: int = 0, cost_weight: float = 0.0, **kwargs):
    super().__init__(*args, **kwargs)
    self.seed, self.cost_weight = int(seed), float(cost_weight)

  def model_loss(self, params, emb_BFD, state, batch):
    key = jax.random.fold_in(jax.random.key(self.seed), state["step"])
    model = nnx.merge(self.graphdef, params)
    logits, cost = model.sample(batch.dense, emb_BFD, key)
    loss = masked_bce(logits, batch)
    return loss + self.cost_weight * cost, (logits, {"flop_cost": cost})

  def weighted_eval_step(self, state, batch, weights_LK):
    """{logits, labels, mask} with fixed mixing weights (one-hot: a candidate)."""
    lookup = self.gather(state["emb"], batch)
    model = nnx.merge(self.graphdef, state["params"])
    logits = model(batch.dense, self.collection.pool(lookup), weights_LK=weights_LK)
    return {"logits": logits, "labels": batch.labels, "mask": batch.mask}


def inherit(supernet_params, standalone_params, path):
  """The supernet's pure-dict params with the stand-alone model's (`standalone`'s inverse):
  shared parts from it, and layer l's blocks into candidate path[l]. Every stand-alone leaf
  must land on a supernet leaf of the same shape."""
  out = jax.tree.map(lambda x: x, supernet_params)

  def put(keys, value):
    if keys[0] == "layers" and len(keys) > 2 and keys[2] == "blocks":
      keys = ("candidates", keys[1], int(path[int(keys[1])])) + keys[3:]
    else:
      keys = ("base",) + keys
    node = out
    for k in keys[:-1]:
      if k not in node:
        raise ValueError(f"inherit: stand-alone parameter {'/'.join(map(str, keys))} has no "
                         "place in the supernet")
      node = node[k]
    old = node.get(keys[-1])
    if old is None or old.shape != value.shape:
      raise ValueError(f"inherit: {'/'.join(map(str, keys))} shape "
                       f"{None if old is None else old.shape} in the supernet, {value.shape} "
                       "stand-alone")
    node[keys[-1]] = jax.device_put(value, old.sharding) if isinstance(old, jax.Array) else value

  for p, v in jax.tree_util.tree_leaves_with_path(standalone_params):
    put(tuple(k.key for k in p), v)
  return out


class CandidateTask(RecTask):
  """One architecture of the space (`choices`) trained from scratch through the supernet's
  program (a Supernet in "path" mode as model_fn).

  The path is state["path"], an argument of the compiled step, not a constant in it: every
  architecture of the space runs the same program, compiled once and then found in the
  persistent compilation cache. lax.switch runs only the chosen blocks; the other
  candidates' parameters never reach the logits (zero gradients). init_state starts from
  the stand-alone model's initialization for the seed (`inherit`), so the run is the
  training `train_rec --model=searched:FILE` does, up to float rounding of the differently
  compiled program (tests/experiments/rankitect)."""

  def __init__(self, *args, choices, standalone_fn, program: "CandidateTask | None" = None,
               **kwargs):
    super().__init__(*args, **kwargs)
    net = jax.eval_shape(lambda: self.model_fn(nnx.Rngs(0)))
    if net.mode != "path":
      raise ValueError(f"CandidateTask: a Supernet in mode 'path', got {net.mode!r}")
    self.path = [net.space.names.index(c) for c in choices]
    self.standalone_fn = standalone_fn
    # The jitted step and eval of `program` (another candidate of the same space, data and
    # optimizer), when given: core.train's jit of an already jitted function reuses its
    # trace and executable, so later candidates neither trace nor compile.
    self.program = program
    self._templates: dict[int, tuple] = {}   # seed -> initial state on the host, shardings
    if program is None:
      self.train_step = jax.jit(self._train_step, donate_argnums=0)
      self.eval_step = jax.jit(self._eval_step)
    else:
      self.train_step, self.eval_step = program.train_step, program.eval_step

  def init_state(self, seed: int):
    # RecTask's initial state for the seed, made once per program: the embedding tables
    # are every candidate's, and the supernet's parameters off the path are never used.
    owner = self.program or self
    if seed not in owner._templates:
      state = super().init_state(seed)
      owner._templates[seed] = (jax.device_get(state), jax.tree.map(lambda x: x.sharding, state))
    state = jax.device_put(*owner._templates[seed])
    k_dense, _ = jax.random.split(jax.random.key(seed))   # RecTask.init_state's split
    # The stand-alone model's initialization (built op by op: equal to its jitted
    # initialization in RecTask up to one float32 ulp).
    mine = nnx.to_pure_dict(nnx.state(self.standalone_fn(nnx.Rngs(k_dense))))
    params = inherit(state["params"], mine, self.path)
    opt = self.dense_tx.init(params)
    state["opt"] = jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), opt, state["opt"])
    state["params"] = params
    state["path"] = jax.device_put(jnp.asarray(self.path, jnp.int32), state["step"].sharding)
    return state

  def _logits(self, params, path_L, dense, emb_BFD):
    return nnx.merge(self.graphdef, params)(dense, emb_BFD, path_L=path_L)

  def model_loss(self, params, emb_BFD, state, batch):
    logits = self._logits(params, state["path"], batch.dense, emb_BFD)
    return masked_bce(logits, batch), (logits, {})

  def _train_step(self, state, batch):
    new, metrics = RecTask.train_step(self, state, batch)
    new["path"] = state["path"]
    return new, metrics

  def _eval_step(self, state, batch):
    lookup = self.gather(state["emb"], batch)
    return {"logits": self._logits(state["params"], state["path"], batch.dense,
                                   self.collection.pool(lookup)),
            "labels": batch.labels, "mask": batch.mask}
