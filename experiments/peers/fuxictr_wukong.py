"""Peer check: FuxiCTR's WuKong (arXiv 2403.02545) forward with our weights, on CPU.

Runs under a separate PyTorch environment (see experiments/peers/README.md), not the
project's JAX venv, and imports nothing from the project. FuxiCTR's model code is not in
its pip package (only the shared layers are), so `--wukong_src` points at the file
`model_zoo/WuKong/src/WuKong.py` of github.com/reczoo/FuxiCTR, which is imported as it is:
its `WuKongLayer` (FactorizationMachineBlock + LinearCompressionBlock + residual +
LayerNorm) and, for the head, `fuxictr.pytorch.layers.MLP_Block`.

Mode `parity` (the only mode): reads `--inputs` (.npz written by
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

Shape letters: B batch, N embeddings entering a layer, D embedding dim, K FM rank.

  $PEER/bin/python experiments/peers/fuxictr_wukong.py --wukong_src WuKong.py \
      --inputs in.npz --outputs out.npz
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
  p.add_argument("--mode", choices=["parity"], default="parity")
  p.add_argument("--wukong_src", required=True,
                 help="FuxiCTR's model_zoo/WuKong/src/WuKong.py")
  p.add_argument("--inputs", required=True, help=".npz with x_BND, sizes and weights")
  p.add_argument("--outputs", required=True, help=".npz to write")
  p.add_argument("--ln_eps", type=float, default=1e-6, help="LayerNorm epsilon (flax: 1e-6)")
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


def main(argv=None):
  args = parse_args(argv)
  torch.set_num_threads(1)
  mod = load_wukong_module(args.wukong_src)
  data = np.load(args.inputs)
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
