"""Peer check: FuxiCTR's WuKong (arXiv 2403.02545) against ours, on CPU.

Runs under a separate PyTorch environment (see experiments/peers/README.md), not the
project's JAX venv, and imports nothing from the project. FuxiCTR's model code is not in
its pip package (only the shared layers are), so `--wukong_src` points at the file
`model_zoo/WuKong/src/WuKong.py` of github.com/reczoo/FuxiCTR, which is imported as it is:
its `WuKong` model (FeatureEmbedding, a `WuKongLayer` stack: FactorizationMachineBlock +
LinearCompressionBlock + residual + LayerNorm, and an `MLP_Block` head).

Mode `parity`: reads `--inputs` (.npz written by
tests/experiments/peers/test_fuxictr_wukong.py: the interaction stack's input x_BND, the
sizes and our JAX model's weights under their nnx paths), builds FuxiCTR's layers with
those sizes, copies the weights in (kernels [in, out] -> torch's [out, in]; the residual
projection's bias, which FuxiCTR has and we do not, stays at FuxiCTR's zero init), runs one
forward and writes `--outputs` (.npz): per layer the optimized FM (flattened X X^T Y), the
FMB and LCB outputs and the layer output, and the head's logits.

Where the designs differ, the peer's forward is kept as FuxiCTR wrote it and the JAX side
is configured to match (`WukongConfig.fm_output_relu=True`: FuxiCTR's FMB MLP ends in a
ReLU), except: the head is built with `batch_norm=False` and no output sigmoid (FuxiCTR's
default top MLP has BatchNorm; ours and the paper's have none), and LayerNorm epsilon is
set to `--ln_eps` (flax's 1e-6; torch's default is 1e-5). The dense-feature path differs
by design (FuxiCTR embeds each numeric field as value * vector, the paper and ours use a
bottom MLP), so the check starts at X_0.

Mode `train`: reads `--inputs` (.npz written by experiments/wukong_scaling/fuxictr.py: the
exact train examples our run trains on, in its order, the eval examples, and `config_json`
with the sizes, optimizers, learning rates, batch size, steps and seed), builds FuxiCTR's
whole `WuKong` model as its model zoo ships it (FeatureEmbedding: one nn.Embedding per
categorical field, each numeric field value * vector; FMB with its ReLU output; head
MLP_Block with BatchNorm unless `mlp_batch_norm` is false) at those sizes and trains it
with the step of FuxiCTR's `BaseModel.train_step` (zero_grad, forward, loss, backward,
clip_grad_norm_, step) on the batches in order, timed from the second step on as ours is
(its first step compiles; examples/s over steps - 1 steps). Two deliberate settings, both to
match our side: the loss is the mean BCE over real examples from logits (`task="regression"` only
removes the head's sigmoid; FuxiCTR's BCE on sigmoid outputs is the same function), and
the optimizer is two torch param groups, the categorical tables under `sparse_optimizer`
(torch.optim.Adagrad: element-wise, exactly ours `adagrad` since untouched rows get zero
gradients) and every other parameter under `dense_optimizer` (torch.optim.Adam), with
gradient clipping off unless `max_grad_norm` is set (FuxiCTR's fit() default is 10; ours
has none). Writes `--outputs` (.npz): the loss of every step, the eval logits, wall times.

Shape letters: B batch, N embeddings entering a layer, D embedding dim, K FM rank,
F categorical fields, Dn numeric fields.

  $PEER/bin/python experiments/peers/fuxictr_wukong.py --wukong_src WuKong.py \
      --inputs in.npz --outputs out.npz [--mode train]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import numpy as np
import torch


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mode", choices=["parity", "train"], default="parity")
  p.add_argument("--wukong_src", required=True,
                 help="FuxiCTR's model_zoo/WuKong/src/WuKong.py")
  p.add_argument("--inputs", required=True,
                 help="parity: .npz with x_BND, sizes and weights; train: .npz with the "
                 "examples and config_json")
  p.add_argument("--outputs", required=True, help=".npz to write")
  p.add_argument("--ln_eps", type=float, default=1e-6, help="parity: LayerNorm epsilon "
                 "(flax: 1e-6); train keeps FuxiCTR's (torch's 1e-5)")
  p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
  return p.parse_args(argv)


def load_wukong_module(path: str):
  spec = importlib.util.spec_from_file_location("fuxictr_wukong_src", path)
  if spec is None or spec.loader is None:
    raise SystemExit(f"--wukong_src={path!r}: not a Python file")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _linears(module):
  return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


def _set(param, value, where):
  value = torch.as_tensor(np.asarray(value, np.float32))
  if tuple(param.shape) != tuple(value.shape):
    raise SystemExit(f"{where}: peer shape {tuple(param.shape)}, ours {tuple(value.shape)}")
  with torch.no_grad():
    param.copy_(value)


def build(mod, sizes, w, ln_eps):
  """FuxiCTR's WuKongLayer stack and an MLP_Block head with our weights copied in."""
  from fuxictr.pytorch.layers import MLP_Block
  n0, d, layers = sizes["num_inputs"], sizes["embedding_dim"], sizes["num_layers"]
  nf, nl, k = sizes["num_fm"], sizes["num_lcb"], sizes["fm_rank"]
  fm_mlp, top_mlp = list(sizes["fm_mlp"]), list(sizes["top_mlp"])
  stack = []
  for i in range(layers):
    n_in = n0 if i == 0 else nf + nl
    layer = mod.WuKongLayer(input_features=n_in, lcb_features=nl, fmb_features=nf,
                            embedding_dim=d, fmp_rank_k=k, fmb_mlp_units=fm_mlp,
                            fmb_mlp_activations="relu", fmb_dropout=0, layer_norm=True)
    pre = f"layers.{i}"
    _set(layer.fmb.proj_Y, w[f"{pre}.fmb.fm.projection"], f"{pre} proj_Y")
    layer.fmb.layer_norm.eps = ln_eps
    _set(layer.fmb.layer_norm.weight, w[f"{pre}.fmb.norm.scale"], f"{pre} fmb LN")
    _set(layer.fmb.layer_norm.bias, w[f"{pre}.fmb.norm.bias"], f"{pre} fmb LN")
    lins = _linears(layer.fmb.mlp)
    for j, lin in enumerate(lins):
      _set(lin.weight, w[f"{pre}.fmb.mlp.layers.{j}.kernel"].T, f"{pre} fmb mlp {j}")
      _set(lin.bias, w[f"{pre}.fmb.mlp.layers.{j}.bias"], f"{pre} fmb mlp {j}")
    _set(layer.lcb.linear.weight, w[f"{pre}.lcb.kernel"].T, f"{pre} lcb")
    if hasattr(layer, "residual_proj"):
      _set(layer.residual_proj.weight, w[f"{pre}.residual.kernel"].T, f"{pre} residual")
      torch.nn.init.zeros_(layer.residual_proj.bias)
    layer.layer_norm.eps = ln_eps
    _set(layer.layer_norm.weight, w[f"{pre}.norm.scale"], f"{pre} LN")
    _set(layer.layer_norm.bias, w[f"{pre}.norm.bias"], f"{pre} LN")
    stack.append(layer)
  head = MLP_Block(input_dim=(nf + nl) * d, output_dim=1, hidden_units=top_mlp[:-1],
                   hidden_activations="relu", output_activation=None, batch_norm=False)
  for j, lin in enumerate(_linears(head)):
    _set(lin.weight, w[f"top_mlp.layers.{j}.kernel"].T, f"top mlp {j}")
    _set(lin.bias, w[f"top_mlp.layers.{j}.bias"], f"top mlp {j}")
  return stack, head


TRAIN_KEYS = ("embedding_dim", "num_layers", "num_fm", "num_lcb", "fm_rank", "fm_mlp",
              "top_mlp", "num_dense", "rows_per_feature", "batch_size", "steps",
              "learning_rate", "embedding_learning_rate", "dense_optimizer",
              "sparse_optimizer", "seed", "mlp_batch_norm", "max_grad_norm")
OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


def build_model(mod, cfg, workdir):
  """FuxiCTR's WuKong over a FeatureMap of `num_dense` numeric and len(rows_per_feature)
  categorical fields, at our sizes; the head without its sigmoid (logits out)."""
  from fuxictr.features import FeatureMap
  fmap = FeatureMap("side_by_side", workdir)
  fmap.labels = ["label"]
  for i in range(cfg["num_dense"]):
    fmap.features[f"I{i + 1}"] = {"type": "numeric", "source": ""}
  for i, rows in enumerate(cfg["rows_per_feature"]):
    fmap.features[f"C{i + 1}"] = {"type": "categorical", "source": "", "vocab_size": int(rows)}
  fmap.num_fields = fmap.get_num_fields()
  fmap.set_column_index()
  # torch's optimizer is replaced below (param groups); FuxiCTR's compile() needs a name.
  return mod.WuKong(fmap, gpu=-1, task="regression", learning_rate=cfg["learning_rate"],
                    embedding_dim=cfg["embedding_dim"], num_wukong_layers=cfg["num_layers"],
                    lcb_features=cfg["num_lcb"], fmb_features=cfg["num_fm"],
                    fmb_mlp_units=list(cfg["fm_mlp"]), fmb_mlp_activations="relu",
                    fmp_rank_k=cfg["fm_rank"], mlp_hidden_units=list(cfg["top_mlp"][:-1]),
                    mlp_hidden_activations="relu", mlp_batch_norm=bool(cfg["mlp_batch_norm"]),
                    layer_norm=True, net_dropout=0, optimizer="adam",
                    loss="binary_crossentropy", model_root=workdir, verbose=0,
                    metrics=["logloss", "AUC"])


def _optimizer(name, params, lr, where):
  if name not in OPTIMIZERS:
    raise SystemExit(f"config_json {where}={name!r}: expected one of {sorted(OPTIMIZERS)}")
  return OPTIMIZERS[name](params, lr=lr)


def _inputs(dense_BDn, ids_BF):
  x = {f"I{i + 1}": torch.as_tensor(dense_BDn[:, i]) for i in range(dense_BDn.shape[1])}
  x.update({f"C{i + 1}": torch.as_tensor(ids_BF[:, i].astype(np.int64))
            for i in range(ids_BF.shape[1])})
  return x


def train(mod, data, args):
  """FuxiCTR's WuKong trained on the examples of `data` in order; returns the outputs."""
  import tempfile
  import time
  cfg = json.loads(str(data["config_json"]))
  missing = [k for k in TRAIN_KEYS if k not in cfg]
  if missing:
    raise SystemExit(f"--inputs={args.inputs}: config_json lacks {missing}")
  b, steps = int(cfg["batch_size"]), int(cfg["steps"])
  dense, ids = data["train_dense"].astype(np.float32), data["train_ids"]
  labels, mask = data["train_labels"].astype(np.float32), data["train_mask"].astype(np.float32)
  if labels.shape[0] != b * steps:
    raise SystemExit(f"--inputs={args.inputs}: {labels.shape[0]} train examples; expected "
                     f"batch_size * steps = {b} * {steps}")
  if dense.shape[1] != cfg["num_dense"] or ids.shape[1] != len(cfg["rows_per_feature"]):
    raise SystemExit(f"--inputs={args.inputs}: train_dense {dense.shape}, train_ids "
                     f"{ids.shape}; expected {cfg['num_dense']} numeric and "
                     f"{len(cfg['rows_per_feature'])} categorical columns")
  torch.manual_seed(int(cfg["seed"]))
  with tempfile.TemporaryDirectory() as workdir:
    model = build_model(mod, cfg, workdir)
  tables = [m.weight for m in model.embedding_layer.modules() if isinstance(m, torch.nn.Embedding)]
  table_ids = {id(p) for p in tables}
  rest = [p for p in model.parameters() if id(p) not in table_ids]
  if len(tables) != ids.shape[1]:
    raise SystemExit(f"FuxiCTR's WuKong has {len(tables)} embedding tables; expected "
                     f"{ids.shape[1]} (one per categorical field)")
  dense_opt = _optimizer(cfg["dense_optimizer"], rest, cfg["learning_rate"], "dense_optimizer")
  sparse_opt = _optimizer(cfg["sparse_optimizer"], tables, cfg["embedding_learning_rate"],
                          "sparse_optimizer")
  clip = cfg["max_grad_norm"]
  losses = np.zeros(steps, np.float32)
  model.train()
  t0 = None
  for step in range(steps):
    if step == 1:   # timed from the second step on, as ours (its first step compiles)
      t0 = time.perf_counter()
    sl = slice(step * b, (step + 1) * b)
    m_B = torch.as_tensor(mask[sl])
    dense_opt.zero_grad()
    sparse_opt.zero_grad()
    logits_B = model(_inputs(dense[sl], ids[sl]))["y_pred"][:, 0]
    per_ex = torch.nn.functional.binary_cross_entropy_with_logits(
        logits_B, torch.as_tensor(labels[sl]), reduction="none")
    loss = (per_ex * m_B).sum() / m_B.sum().clamp(min=1.0)
    loss.backward()
    if clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
    dense_opt.step()
    sparse_opt.step()
    losses[step] = float(loss)
  train_s = time.perf_counter() - t0 if t0 is not None else 0.0
  model.eval()
  e_dense, e_ids = data["eval_dense"].astype(np.float32), data["eval_ids"]
  eb = int(cfg.get("eval_batch_size", 4096))
  out = []
  with torch.no_grad():
    for i in range(0, e_dense.shape[0], eb):
      out.append(model(_inputs(e_dense[i:i + eb], e_ids[i:i + eb]))["y_pred"][:, 0].numpy())
  n_params = sum(p.numel() for p in rest)
  return {"train_loss": losses, "eval_logits": np.concatenate(out).astype(np.float32),
          "train_seconds": np.float64(train_s), "timed_steps": np.int64(steps - 1),
          "dense_params": np.int64(n_params),
          "examples_per_sec": np.float64(b * (steps - 1) / train_s if train_s > 0 else 0.0)}


def main(argv=None):
  args = parse_args(argv)
  torch.set_num_threads(args.threads)
  mod = load_wukong_module(args.wukong_src)
  data = np.load(args.inputs)
  if args.mode == "train":
    out = train(mod, data, args)
    np.savez(args.outputs, **out)
    import fuxictr
    print(json.dumps({"framework": "fuxictr", "fuxictr": fuxictr.__version__,
                      "torch": torch.__version__, "mode": "train",
                      "first_loss": float(out["train_loss"][0]),
                      "last_loss": float(out["train_loss"][-1]),
                      "examples_per_sec": float(out["examples_per_sec"])}))
    return 0
  sizes = json.loads(str(data["sizes_json"]))
  w = {k[2:]: data[k] for k in data.files if k.startswith("w:")}
  stack, head = build(mod, sizes, w, args.ln_eps)
  out = {}
  x = torch.as_tensor(data["x_BND"].astype(np.float32))
  with torch.no_grad():
    for i, layer in enumerate(stack):
      out[f"fm.{i}"] = layer.fmb.optimized_fm(x).numpy()
      out[f"fmb.{i}"] = layer.fmb(x).numpy()
      out[f"lcb.{i}"] = layer.lcb(x).numpy()
      x = layer(x)
      out[f"layer.{i}"] = x.numpy()
    out["logits"] = head(x.flatten(start_dim=1))[:, 0].numpy()
  np.savez(args.outputs, **out)
  import fuxictr
  print(json.dumps({"framework": "fuxictr", "fuxictr": fuxictr.__version__,
                    "torch": torch.__version__, "outputs": sorted(out)}))


if __name__ == "__main__":
  sys.exit(main())
