"""Step time of Llama training spread over hosts, buildings and regions (arXiv 2605.24326's
design space: parallelism placement, parallelism schedule, network-layer choices).

How a step is formed (per GPU, the critical path of pipeline stage 0):
- compute: `llm.cost.train_layer_flops` (3x forward) of ceil(L / (pp v)) layers per model
  chunk and one sequence per microbatch, split over tp * cp GPUs, at the fitted achieved
  rate; the LM head's 6 V D FLOPs per token spread evenly over the chunks (stages balanced
  as in Llama 3); recomputation is not modelled;
- TP: 2 all-reduces of the [T / cp, D] activations per layer in the forward and 2 in the
  backward (Megatron), not overlapped;
- CP: pass-KV ring attention (arXiv 2411.01783): cp - 1 SendRecvs of a KV block per layer
  (`llm.cost.ring_message_bytes`), each overlapped with one ring step's attention; the
  backward sends KV and its gradient against twice the attention work;
- PP: 1F1B with v chunks per stage (Megatron's interleaved schedule): m v slots of
  max(chunk compute, activation send + gradient send), a bubble of (pp - 1) chunk times, and
  v times each stage boundary's send on the fill and drain (the slowest link a boundary
  crosses sets its time);
- data: FSDP all-gathers bf16 weights before the forward and reduce-scatters gradients
  after the backward, DP all-reduces FSDP's shard; with `overlap` the gather hides under
  the first microbatch's forward through the stage, the reductions under the last one's
  backward, the rest is exposed; then an HBM-bound Adam update of the shard;
- every collective (`core.hardware.ring_collective_s`) runs on the links its group crosses:
  hierarchical (reduce-scatter level by level inward to outward, gathers outward to inward,
  so the slowest link carries the smallest buffer), or one
  flat ring whose every step waits for the slowest link it crosses. A GPU's rate on a link
  is its line rate, or the unit's aggregate egress shared by the GPUs that send at once
  (all of them in a hierarchical step; one per group and unit in a ring), or flows x
  window / round trip on windowed (long-haul) links; gradients crossing windowed links are
  divided by `compression` (plus an HBM pass to compress and decompress).
Memory (a feasibility check): weights (bf16) and gradients per GPU, fp32 master and Adam
moments sharded over fsdp, the layer inputs of the min(m, pp) microbatches in flight on
stage 0 (the least any recomputation policy keeps) and one layer's activations (34 bytes
per token and model dim / tp, Korthikanti et al., arXiv 2205.05198); a plan needing more
than 90% of HBM is infeasible.
Not modelled: stragglers, packet loss, congestion beyond the aggregate share, the
optimizer's quality under lossy compression.

Letters: L layers, D model dim, V vocabulary, T sequence length, m microbatches per step.
"""

from __future__ import annotations

import dataclasses
import math

from core.hardware import ring_collective_s
from experiments.scaleacross.cluster import AXES, Cluster, Plan
from llm import cost

ACT_BYTES_LAYER = 34              # per token x dim of one layer / tp (arXiv 2205.05198, Table 2)
HBM_USABLE = 0.9


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Where one axis's groups sit: members of a group per unit of each level."""

  degree: int
  stride: int
  members: tuple[int, ...]          # per unit of level -1 (one GPU), 0, 1, ...

  def factor(self, i: int) -> int:
    """How many level i - 1 units of one level i unit a group spans."""
    return self.members[i + 1] // self.members[i]


def geometry(cluster: Cluster, plan: Plan) -> dict[str, Geometry] | None:
  """Each axis's Geometry under `plan.placement`, or None when a group straddles units
  unevenly (a degree product that neither divides nor is divided by a unit's GPUs)."""
  units = cluster.unit_sizes()
  out, stride = {}, 1
  for axis in plan.placement:
    d = plan.degree(axis)
    members = [1]
    for x in units[1:]:
      if x >= stride * d:
        ok, m = x % (stride * d) == 0, d
      elif x <= stride:
        ok, m = stride % x == 0, 1
      else:
        ok, m = x % stride == 0 and d % (x // stride) == 0, x // stride
      if not ok:
        return None
      members.append(m)
    out[axis] = Geometry(d, stride, tuple(members))
    stride *= d
  return out


def _link(cluster: Cluster, plan: Plan, i: int, senders: float):
  spec = cluster.links[i]
  return spec.link(senders=senders, flows=plan.flows if spec.window_bytes else 1)


def collective_s(kind: str, bytes_: float, g: Geometry, cluster: Cluster, plan: Plan,
                 grad: bool = False) -> float:
  """Seconds of one collective of `bytes_` (full buffer per GPU) over an axis's groups."""
  if g.degree == 1 or bytes_ == 0:
    return 0.0
  units = cluster.unit_sizes()
  levels = [i for i in range(len(cluster.sizes)) if g.factor(i) > 1]

  def wire(i, b):  # bytes on the wire at level i, and the HBM time to (de)compress them
    if grad and plan.compression > 1 and cluster.links[i].window_bytes is not None:
      return b / plan.compression, 3 * b / cluster.hbm_bytes_per_s
    return b, 0.0

  if plan.hierarchical:
    t, b = 0.0, bytes_
    for i in levels:
      f = g.factor(i)
      wb, extra = wire(i, b)
      t += ring_collective_s(kind, wb, f, _link(cluster, plan, i, units[i])) + extra
      b /= f
    return t
  # One flat ring: every step waits for the slowest link the ring crosses.
  steps = 2 * (g.degree - 1) if kind == "all_reduce" else g.degree - 1
  step, extra = 0.0, 0.0
  for i in levels:
    wb, e = wire(i, bytes_)
    extra = max(extra, e)
    link = _link(cluster, plan, i, units[i] / g.members[i])
    step = max(step, link.time(wb / g.degree))
  return steps * step + extra


def ring_step_s(bytes_: float, g: Geometry, cluster: Cluster, plan: Plan) -> float:
  """Seconds of one step of a ring / chain SendRecv along an axis (slowest link crossed)."""
  if g.degree == 1:
    return 0.0
  units = cluster.unit_sizes()
  return max(_link(cluster, plan, i, units[i] / g.members[i]).time(bytes_)
             for i in range(len(cluster.sizes)) if g.factor(i) > 1)


def boundary_sends_s(bytes_: float, g: Geometry, cluster: Cluster, plan: Plan) -> float:
  """Sum over the pp - 1 stage boundaries of one send's seconds on the link it crosses."""
  units = cluster.unit_sizes()
  total = 0.0
  for s in range(g.degree - 1):
    a, b = s * g.stride, (s + 1) * g.stride
    i = next(i for i in range(len(cluster.sizes)) if a // units[i + 1] == b // units[i + 1])
    total += _link(cluster, plan, i, units[i] / g.members[i]).time(bytes_)
  return total


def step_time(cluster: Cluster, plan: Plan, cfg, compute_efficiency: float) -> dict:
  """Seconds per training step by component (`total`, `tflops_per_gpu` of model FLOPs), or
  {"infeasible": reason}."""
  geo = geometry(cluster, plan)
  if geo is None:
    return {"infeasible": "a group straddles units unevenly"}
  n = cluster.devices
  seq = cluster.seq_len
  seqs = cluster.global_batch_tokens // seq
  data = plan.fsdp * plan.dp
  if seqs % data:
    return {"infeasible": f"{seqs} sequences per step do not split over fsdp*dp={data}"}
  m = seqs // data
  tp, cp, pp, v = plan.tp, plan.cp, plan.pp, plan.v
  if cfg.n_heads % tp or pp * v > cfg.n_layers or seq % cp:
    return {"infeasible": "tp, cp or pp*v do not fit the model"}
  rate = cluster.bf16_flops * compute_efficiency
  act = cluster.act_bytes

  # Memory: states, the layer inputs of the microbatches in flight, one layer's working set.
  params_gpu = cfg.num_params() / (tp * pp)
  states = params_gpu * (act + cluster.grad_bytes) + params_gpu / plan.fsdp * 12
  tokens_gpu_dim = (seq / cp) * cfg.dim / tp
  layers_stage = math.ceil(cfg.n_layers / pp)
  need = (states + min(m, pp) * layers_stage * tokens_gpu_dim * act
          + tokens_gpu_dim * ACT_BYTES_LAYER)
  if need > HBM_USABLE * cluster.hbm_bytes:
    return {"infeasible": f"needs {need / 2**30:.0f} GiB of HBM"}

  # One microbatch through one chunk of ceil(L / (pp v)) layers.
  layers = math.ceil(cfg.n_layers / (pp * v))
  fl = cost.train_layer_flops(cfg, seq)
  head = 6.0 * cfg.vocab_size * cfg.dim * seq / (pp * v)
  fwd_flops = (layers * (fl["gemm"] + fl["attn"]) + head) / 3
  t_cf = fwd_flops / (tp * cp) / rate
  t_cb = 2 * t_cf
  tp_ar = collective_s("all_reduce", seq / cp * cfg.dim * act, geo["tp"], cluster, plan)
  t_tp = 2 * layers * tp_ar
  t_cp = 0.0
  if cp > 1:
    msg = cost.ring_message_bytes(cfg, seq, 0, cp=cp, tp=tp,
                                  num=cost.Numerics(kv_bytes=act, act_bytes=act))["kv"]
    attn_step = fl["attn"] / 3 / (tp * cp * cp) / rate
    t_cp = (cp - 1) * max(0.0, ring_step_s(msg, geo["cp"], cluster, plan) - attn_step)
    t_cp = layers * t_cp
  chunk_f = t_cf + t_tp + t_cp
  chunk_b = t_cb + t_tp + 2 * t_cp
  chunk = chunk_f + chunk_b

  # Pipeline.
  p2p_bytes = seq / cp * cfg.dim * act / tp
  if pp > 1:
    p2p = 2 * ring_step_s(p2p_bytes, geo["pp"], cluster, plan)
    steady = m * v * max(chunk, p2p)
    bubble = (pp - 1) * chunk
    fill = 2 * v * boundary_sends_s(p2p_bytes, geo["pp"], cluster, plan)
  else:
    p2p, steady, bubble, fill = 0.0, m * chunk, 0.0, 0.0
  compute_only = m * v * (t_cf + t_cb) if pp > 1 else m * (t_cf + t_cb)

  # Data-parallel synchronization and the update.
  w_bytes = params_gpu * act
  g_bytes = params_gpu * cluster.grad_bytes
  t_ag = collective_s("all_gather", w_bytes, geo["fsdp"], cluster, plan)
  t_rs = collective_s("reduce_scatter", g_bytes, geo["fsdp"], cluster, plan, grad=True)
  t_ar = collective_s("all_reduce", g_bytes / plan.fsdp, geo["dp"], cluster, plan, grad=True)
  if plan.overlap:
    win = v if pp > 1 else 1
    sync = max(0.0, t_ag - win * chunk_f) + max(0.0, t_rs + t_ar - win * chunk_b)
  else:
    sync = t_ag + t_rs + t_ar
  update = params_gpu / plan.fsdp * 32 / cluster.hbm_bytes_per_s

  total = steady + bubble + fill + sync + update
  model_flops = cfg.flops_per_token(seq) * cluster.global_batch_tokens
  return {
      "total": total, "compute": compute_only,
      "tp_comm": (m * v if pp > 1 else m) * 2 * t_tp, "cp_exposed": (m * v if pp > 1 else m)
      * 3 * t_cp, "pp_p2p_exposed": (steady - m * v * chunk if pp > 1 else 0.0) + fill,
      "bubble": bubble, "sync_exposed": sync, "update": update,
      "sync_s": {"fsdp_all_gather": t_ag, "fsdp_reduce_scatter": t_rs, "dp_all_reduce": t_ar},
      "memory_gib": need / 2**30, "microbatches": m,
      "tflops_per_gpu": model_flops / total / n / 1e12,
      "crosses": crosses(cluster, plan, geo),
  }


def crosses(cluster: Cluster, plan: Plan, geo: dict[str, Geometry] | None = None) -> dict:
  """For each level's link (by name), the axes whose groups span it."""
  geo = geo or geometry(cluster, plan)
  return {cluster.links[i].name: [a for a in AXES if geo[a].factor(i) > 1]
          for i in range(len(cluster.sizes))}
