"""Peer benchmark: TorchRec DLRM training throughput on CPU (arXiv:1906.00091).

Runs under the separate TorchRec environment (see experiments/peers/README.md),
not the project's JAX venv, and imports nothing from the project. It measures
examples/s of a full train step (forward, BCE-with-logits loss, backward,
optimizer step) of TorchRec's own `torchrec.models.dlrm.DLRM` with the DLRM
Criteo Kaggle architecture: 26 sum-pooled tables of dim 16, bottom MLP
13-512-256-64-16, dot interaction, top MLP 367-512-256-1.

Embedding paths (`--embedding_path`), both FBGEMM's CPU training kernels with the
optimizer fused into backward, as TorchRec does in production:
  dmp       (default) `DistributedModelParallel` over a world-size-1 gloo process
            group; the planner is constrained to table-wise sharding with
            `EmbeddingComputeKernel.FUSED`, so the 26 tables become one
            `BatchedFusedEmbeddingBag` wrapping FBGEMM's
            `SplitTableBatchedEmbeddingBagsCodegen` (EmbeddingLocation.HOST,
            ComputeDevice.CPU). The fused optimizer comes from
            `apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ...)`,
            which TorchRec maps to `OptimType.EXACT_ROWWISE_ADAGRAD`. Each step
            also pays TorchRec's (one-rank) input/output dist and DMP's
            DistributedDataParallel all-reduce of the dense gradients.
  fused_ebc `torchrec.modules.fused_embedding_modules.FusedEmbeddingBagCollection`
            with `RowWiseAdagrad`: the same FBGEMM TBE and optimizer, no process
            group or dist.
Dense parameters use `torch.optim.Adagrad` (or SGD with `--dense_optimizer sgd`),
stepped after backward. The script checks the built model and reports the TBE
class, optimizer type and location it found in the JSON line.

Data (generated before timing; a pool of `--pool` batches is cycled):
  sparse ids, per table t: bounded Zipf over ranks 1..rows with p(k) ∝ k^-alpha,
    drawn by inverse CDF (np.searchsorted of uniforms in the cumulative
    probabilities), then mapped through a fixed random permutation of the rows of
    table t; one id per bag (one-hot, like Criteo).
  dense: log1p(Exponential(scale=1)) draws, shape [B, num_dense].
  labels: Bernoulli(0.25). With `--signal s > 0`, the logit is instead
    logit(0.25) + s * z, z = sum_t score_t[id_t] / sqrt(F), score_t ~ N(0, 1) per
    row, a planted signal the model can learn (off by default).

Shape letters: B batch, F sparse features (tables), D embedding dim.

Example (2 threads, defaults):
  $PEER/bin/python experiments/peers/torchrec_dlrm.py   # PEER: the TorchRec venv
Prints one human line per timed repeat and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings

import numpy as np
import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch_size", type=int, default=2048)
  p.add_argument("--num_tables", type=int, default=26)
  p.add_argument("--rows", type=int, default=100000)
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--num_dense", type=int, default=13)
  p.add_argument("--bottom", type=str, default="512,256,64,16")
  p.add_argument("--top", type=str, default="512,256,1")
  p.add_argument("--zipf_alpha", type=float, default=1.05)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=5,
                 help="Untimed steps; the first also checks the embedding update.")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--eps", type=float, default=1e-8,
                 help="Adagrad epsilon, embeddings and dense (FBGEMM's default).")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--pool", type=int, default=8,
                 help="Pre-generated batches cycled during timing (plus one "
                 "held-out batch for a final eval loss).")
  p.add_argument("--signal", type=float, default=0.0,
                 help="Planted label signal strength; 0 = Bernoulli(0.25).")
  p.add_argument("--embedding_path", choices=("dmp", "fused_ebc"), default="dmp")
  p.add_argument("--dense_optimizer", choices=("adagrad", "sgd"), default="adagrad")
  args = p.parse_args(argv)
  args.bottom_sizes = _int_list(args.bottom, "--bottom")
  args.top_sizes = _int_list(args.top, "--top")
  if args.bottom_sizes[-1] != args.dim:
    p.error(f"--bottom ends in {args.bottom_sizes[-1]}, expected --dim={args.dim} "
            "(the bottom MLP output joins the dot interaction)")
  if args.top_sizes[-1] != 1:
    p.error(f"--top ends in {args.top_sizes[-1]}, expected 1 (one logit)")
  if args.dim % 4:
    p.error(f"--dim={args.dim}: FBGEMM TBE needs a multiple of 4")
  for name in ("batch_size", "num_tables", "rows", "num_dense", "steps", "warmup",
               "repeats", "threads", "pool"):
    if getattr(args, name) < 1:
      p.error(f"--{name}={getattr(args, name)}, expected >= 1")
  return args


def _int_list(text: str, flag: str) -> list[int]:
  try:
    sizes = [int(s) for s in text.split(",") if s.strip()]
  except ValueError as e:
    raise SystemExit(f"{flag}={text!r}: expected comma-separated ints ({e})")
  if not sizes or min(sizes) < 1:
    raise SystemExit(f"{flag}={text!r}: expected a non-empty list of positive ints")
  return sizes


# --- data -------------------------------------------------------------------


def zipf_cdf(rows: int, alpha: float) -> np.ndarray:
  """Cumulative probabilities of a Zipf(alpha) bounded to ranks 1..rows."""
  p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
  cdf = np.cumsum(p)
  return cdf / cdf[-1]


def make_pool(args: argparse.Namespace, n: int) -> list[dict[str, np.ndarray]]:
  """Pre-generates `n` batches of numpy arrays (see module docstring)."""
  rng = np.random.default_rng(args.seed)
  B, F, R = args.batch_size, args.num_tables, args.rows
  cdf = zipf_cdf(R, args.zipf_alpha)
  perms = [rng.permutation(R) for _ in range(F)]
  # Own stream, so that --signal leaves ids and dense features unchanged.
  score_rng = np.random.default_rng([args.seed, 1])
  scores = ([score_rng.standard_normal(R).astype(np.float32) for _ in range(F)]
            if args.signal > 0 else None)
  pool = []
  for _ in range(n):
    # Rank index 0..R-1; the clip only guards float round-off at the top of cdf.
    ranks_FB = np.minimum(np.searchsorted(cdf, rng.random((F, B)), side="right"),
                          R - 1)
    ids_FB = np.stack([perms[t][ranks_FB[t]] for t in range(F)])
    dense_BN = np.log1p(rng.exponential(1.0, (B, args.num_dense))).astype(np.float32)
    logit_B = np.full(B, math.log(0.25 / 0.75))
    if scores is not None:
      z_B = sum(scores[t][ids_FB[t]] for t in range(F)) / math.sqrt(F)
      logit_B = logit_B + args.signal * z_B
    labels_B = (rng.random(B) < 1.0 / (1.0 + np.exp(-logit_B))).astype(np.float32)
    pool.append({"ids_FB": ids_FB, "dense_BN": dense_BN, "labels_B": labels_B})
  return pool


def to_torch_batch(b: dict[str, np.ndarray], keys: list[str]):
  """numpy batch -> torchrec Batch with a one-hot KeyedJaggedTensor (key-major)."""
  from torchrec.datasets.utils import Batch
  from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

  F, B = b["ids_FB"].shape
  kjt = KeyedJaggedTensor.from_lengths_sync(
      keys=keys,
      values=torch.from_numpy(b["ids_FB"].reshape(-1).astype(np.int64)),
      lengths=torch.ones(F * B, dtype=torch.int32),
  )
  return Batch(dense_features=torch.from_numpy(b["dense_BN"]),
               sparse_features=kjt,
               labels=torch.from_numpy(b["labels_B"]))


# --- model ------------------------------------------------------------------


def build(args: argparse.Namespace):
  """Returns (train_module, optimizer, path_info) for the chosen embedding path."""
  import torchrec
  from torchrec.models.dlrm import DLRM, DLRMTrain
  from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
  from torchrec.optim import RowWiseAdagrad

  tables = [
      EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim,
                         num_embeddings=args.rows, feature_names=[f"f{t}"],
                         pooling=PoolingType.SUM)
      for t in range(args.num_tables)
  ]
  emb_kwargs = {"lr": args.lr, "eps": args.eps}

  def dense_opt(params):
    if args.dense_optimizer == "adagrad":
      return torch.optim.Adagrad(params, lr=args.lr, eps=args.eps)
    return torch.optim.SGD(params, lr=args.lr)

  def dlrm(ebc):
    return DLRMTrain(DLRM(embedding_bag_collection=ebc,
                          dense_in_features=args.num_dense,
                          dense_arch_layer_sizes=args.bottom_sizes,
                          over_arch_layer_sizes=args.top_sizes))

  if args.embedding_path == "fused_ebc":
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=RowWiseAdagrad,
                                      optimizer_kwargs=emb_kwargs,
                                      device=torch.device("cpu"))
    model = dlrm(ebc)
    # The fused EBC registers its embedding weights as parameters too; they are
    # updated inside backward, so the dense optimizer must not see them.
    emb_ids = {id(p) for p in ebc.parameters()}
    dense_params = [p for p in model.parameters() if id(p) not in emb_ids]
    opt = dense_opt(dense_params)
    return model, opt, _describe(model, "torchrec FusedEmbeddingBagCollection "
                                 "(no process group)")

  import torch.distributed as dist
  from torchrec.distributed import DistributedModelParallel
  from torchrec.distributed.embedding_types import EmbeddingComputeKernel
  from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
  from torchrec.distributed.planner import (EmbeddingShardingPlanner,
                                            ParameterConstraints, Topology)
  from torchrec.distributed.types import ShardingType
  from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
  from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
  from torchrec.optim.optimizers import in_backward_optimizer_filter

  if not dist.is_initialized():
    # An in-process store: one rank needs no rendezvous, and no port can clash
    # with other jobs on the machine.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
  ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
  model = dlrm(ebc)
  apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(),
                              emb_kwargs)
  constraints = {
      t.name: ParameterConstraints(
          sharding_types=[ShardingType.TABLE_WISE.value],
          compute_kernels=[EmbeddingComputeKernel.FUSED.value])
      for t in tables
  }
  sharders = [EmbeddingBagCollectionSharder()]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # planner heuristics chatter; irrelevant on 1 rank
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, local_world_size=1, compute_device="cpu"),
        batch_size=args.batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
  dmp = DistributedModelParallel(module=model, device=torch.device("cpu"),
                                 plan=plan, sharders=sharders)
  dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                dense_opt)
  opt = CombinedOptimizer([dmp.fused_optimizer, dense])
  return dmp, opt, _describe(
      dmp, "torchrec DistributedModelParallel, world_size=1 gloo, table_wise, "
      "EmbeddingComputeKernel.FUSED (BatchedFusedEmbeddingBag)")


def _find_instances(root: torch.nn.Module, cls: type) -> list:
  """Instances of `cls` reachable from `root`, also through plain attributes.

  TorchRec keeps its lookup modules in plain lists (fused EBC) or unregistered
  attributes (sharded EBC), so `root.modules()` alone does not reach the TBEs.
  """
  found, seen, stack = [], set(), [root]
  while stack:
    obj = stack.pop()
    if id(obj) in seen:
      continue
    seen.add(id(obj))
    if isinstance(obj, cls):
      found.append(obj)
      continue
    if isinstance(obj, torch.nn.Module):
      stack.extend(vars(obj).values())
      stack.extend(obj._modules.values())
    elif isinstance(obj, (list, tuple)):
      stack.extend(obj)
    elif isinstance(obj, dict):
      stack.extend(obj.values())
  return found


def _describe(model: torch.nn.Module, prefix: str) -> dict:
  """Finds the FBGEMM TBE modules in `model` and checks they are fused CPU ones."""
  from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
      SplitTableBatchedEmbeddingBagsCodegen)

  tbes = _find_instances(model, SplitTableBatchedEmbeddingBagsCodegen)
  if not tbes:
    raise RuntimeError(f"{prefix}: no SplitTableBatchedEmbeddingBagsCodegen found; "
                       "embeddings are not on FBGEMM's fused kernels")
  optims = sorted({m.optimizer.name for m in tbes})
  devices = sorted({str(m.weights_host.device) if m.weights_host.numel()
                    else str(m.current_device) for m in tbes})
  if optims != ["EXACT_ROWWISE_ADAGRAD"] or devices != ["cpu"]:
    raise RuntimeError(f"{prefix}: TBE optimizers {optims} on {devices}, expected "
                       "['EXACT_ROWWISE_ADAGRAD'] on ['cpu']")
  return {
      "embedding_path": (f"{prefix} -> fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen"
                         f" x{len(tbes)}, {optims[0]}, EmbeddingLocation.HOST, CPU"),
      "num_tbe_modules": len(tbes),
      "embedding_optimizer": optims[0],
  }


def _embedding_rows_updated_by_first_step(model, batch_np, step) -> tuple[int, int]:
  """Runs `step` once; returns (rows whose weights changed, rows the batch touched).

  Checks that the fused optimizer really updates exactly the looked-up rows
  inside backward (nothing else steps the embeddings).
  """
  from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
      SplitTableBatchedEmbeddingBagsCodegen)

  (tbe,) = _find_instances(model, SplitTableBatchedEmbeddingBagsCodegen)
  F, _ = batch_np["ids_FB"].shape
  D = tbe.weights_host.numel() // sum(r for r, *_ in tbe.embedding_specs)
  before = tbe.weights_host.detach().clone()
  step()
  diff_R = (tbe.weights_host.detach() != before).view(-1, D).any(dim=1)
  touched = sum(len(np.unique(batch_np["ids_FB"][t])) for t in range(F))
  return int(diff_R.sum()), touched


# --- benchmark --------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm; fails loudly if broken)
  import torchrec

  # One batch past the pool, never trained on: a held-out loss, since cycling a
  # small pool lets the model memorize it (training loss alone proves little).
  *pool_np, heldout_np = make_pool(args, args.pool + 1)
  keys = [f"f{t}" for t in range(args.num_tables)]
  pool = [to_torch_batch(b, keys) for b in pool_np]
  heldout = to_torch_batch(heldout_np, keys)
  # Loss of a constant predictor at the pool's label rate: the bar to get under (0 where a
  # small pool's labels are all alike).
  rate = float(np.mean([b["labels_B"].mean() for b in pool_np]))
  base_loss = (-(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1
               else 0.0)

  model, opt, info = build(args)
  model.train()
  step_i = 0
  losses = []

  def step() -> None:
    nonlocal step_i
    batch = pool[step_i % len(pool)]
    step_i += 1
    opt.zero_grad()
    loss, _ = model(batch)
    loss.backward()  # embedding rows are updated in here (fused optimizer)
    opt.step()
    losses.append(loss.detach())

  changed, touched = _embedding_rows_updated_by_first_step(model, pool_np[0], step)
  print(f"first step updated {changed} embedding rows; batch touched {touched} "
        "distinct (table, id) rows")
  if changed != touched:
    raise RuntimeError(f"fused embedding optimizer updated {changed} rows, expected "
                       f"the {touched} rows the first batch touched")
  for _ in range(args.warmup - 1):
    step()
  rates, step_ms = [], []
  for r in range(args.repeats):
    t0 = time.perf_counter()
    for _ in range(args.steps):
      step()
    dt = time.perf_counter() - t0
    rates.append(args.steps * args.batch_size / dt)
    step_ms.append(1e3 * dt / args.steps)
    print(f"repeat {r}: {rates[-1]:10.1f} examples/s  {step_ms[-1]:8.2f} ms/step  "
          f"loss {losses[-1].item():.4f}", flush=True)
  first, last = losses[0].item(), losses[-1].item()
  with torch.no_grad():  # no backward, so the fused optimizer does not step
    heldout_loss = model(heldout)[0].item()
  print(f"train loss first step {first:.4f} -> last step {last:.4f}; held-out "
        f"{heldout_loss:.4f} (constant-predictor loss at label rate {rate:.3f}: "
        f"{base_loss:.4f})")
  if not last < first:
    print("WARNING: loss did not drop")

  result = {
      "framework": "torchrec",
      "torch": torch.__version__,
      "torchrec": torchrec.__version__,
      "fbgemm_gpu": f"{fbgemm_gpu.__version__} ({getattr(fbgemm_gpu, '__variant__', '?')})",
      **info,
      "dense_optimizer": (f"torch.optim.Adagrad(lr={args.lr}, eps={args.eps})"
                          if args.dense_optimizer == "adagrad"
                          else f"torch.optim.SGD(lr={args.lr})"),
      "batch_size": args.batch_size,
      "num_tables": args.num_tables,
      "rows": args.rows,
      "dim": args.dim,
      "bottom": args.bottom_sizes,
      "top": args.top_sizes,
      "zipf_alpha": args.zipf_alpha,
      "threads": args.threads,
      "steps": args.steps,
      "warmup": args.warmup,
      "repeats": args.repeats,
      "signal": args.signal,
      "examples_per_sec_median": statistics.median(rates),
      "examples_per_sec_all": rates,
      "step_ms_median": statistics.median(step_ms),
      "loss_first": first,
      "loss_last": last,
      "loss_heldout": heldout_loss,
      "loss_constant_predictor": base_loss,
  }
  import torch.distributed as dist
  if dist.is_initialized():
    dist.destroy_process_group()
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
