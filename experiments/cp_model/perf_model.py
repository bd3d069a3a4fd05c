"""Analytic latency model of Llama 3 prefill with context parallelism on H100 hosts.

The setting of "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783,
§4.1): Llama 3 405B with row-wise FP8 FFN weights, TP8 over NVLink inside each 8-GPU host,
CP across N hosts over RDMA (one ring per KV head: the ring links one GPU per host), ring
pass-KV or pass-Q attention (Algorithms 2 and 3) with load-balanced sharding, and pass-Q's
All2All of partial outputs at the end of the ring.

How a time is formed (per GPU, per layer, then times the number of layers):
- every op is a roofline (`core.hardware.roofline`): max(FLOPs / achieved FLOP/s, bytes /
  achieved HBM bytes/s);
- ops run one after another (no overlap), except inside the attention ring, where step j's
  SendRecv overlaps step j's attention: ring = N*attn_step + (N-1)*max(0, comm - attn_step),
  i.e. N-1 steps of max(compute, comm) and a last step of compute only (paper Table 5);
- GEMMs (Q/K/V/O projections in BF16, FFN in FP8): 2*params*tokens FLOPs, bytes = weights +
  activations in and out;
- attention: 4*K*H*pairs FLOPs, pairs = T*P + T*(T+1)/2 (causal over the new tokens; the
  full-square 4*T*(T+P)*D of the paper's Table 3 counts T*(T+P));
- memory-bound elementwise ops (residual add + RMSNorm, RoPE, SwiGLU, FP8 quantization,
  KV-cache write), replicated on each TP rank as in Megatron TP without sequence parallel;
- TP: two ring all-reduces of [tokens, D] BF16 activations per layer over NVLink;
- CP: T/N new tokens and (T+P)/N KV entries per host (load balanced; padding ignored).
Not modelled: the LM head (prefill needs logits of the last token only), embedding lookups,
host/launch overheads, padding to equal message sizes.

Constants: peaks and achieved fractions are `core.hardware.Hardware` / `Efficiency` (each
with its source); FLOP and byte counts are `llm.cost`. GEMM efficiency is FITTED by
`calibrate_gemm` on ONE measured TTFT (TP8 128K full prefill, 42.01 s, Table 6; see
`study.py`); every other TTFT is a prediction.

Letters: T new tokens, P cached tokens, N CP ranks (hosts), D model dim, F FFN dim, H query
heads, G key/value heads, K head dim; `_tp` suffix: per GPU of a TP group.
"""

from __future__ import annotations

import dataclasses

from core.hardware import Efficiency, Hardware, roofline
from llm.config import LlamaConfig
from llm.cost import Numerics, attention_pairs, ring_message_bytes, tp_heads


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Seconds per component of one prefill over all layers (critical path of one GPU)."""

  gemm: float
  elementwise: float
  tp_allreduce: float
  attn_compute: float
  ring_exposed: float               # ring SendRecv time not hidden under attention
  all2all: float                    # pass-Q only
  merge: float

  @property
  def total(self) -> float:
    return (self.gemm + self.elementwise + self.tp_allreduce + self.attn_compute
            + self.ring_exposed + self.all2all + self.merge)

  def as_dict(self) -> dict[str, float]:
    return {**dataclasses.asdict(self), "total": self.total}


VARIANTS = ("pass_kv", "pass_q")


def _check_args(fn: str, new_tokens, cached_tokens, cp, variant) -> None:
  if new_tokens < 1 or cached_tokens < 0 or cp < 1:
    raise ValueError(f"perf_model.{fn}: new_tokens={new_tokens}, cached_tokens={cached_tokens}, "
                     f"cp={cp}; expected new_tokens >= 1, cached_tokens >= 0, cp >= 1")
  if variant not in VARIANTS:
    raise ValueError(f"perf_model.{fn}: variant={variant!r}; expected one of {VARIANTS}")


def ring_step_times(cfg: LlamaConfig, new_tokens: int, cached_tokens: int, *, cp: int,
                    tp: int = 8, variant: str = "pass_kv", hw: Hardware = Hardware(),
                    eff: Efficiency = Efficiency(), num: Numerics = Numerics()) -> dict[str, float]:
  """Seconds per layer: one ring step's attention and SendRecv, and the final All2All.

  The quantities of the paper's Table 5. Each of the N steps gets 1/N^2 of the (query, key)
  pairs (load-balanced sharding, on average); SendRecv and All2All are 0 without CP.
  """
  _check_args("ring_step_times", new_tokens, cached_tokens, cp, variant)
  h_tp, _ = tp_heads(cfg, tp)
  msg = ring_message_bytes(cfg, new_tokens, cached_tokens, cp=cp, tp=tp, num=num)
  step_flops = 4 * cfg.head_dim * h_tp * attention_pairs(new_tokens, cached_tokens) / cp ** 2
  out_bytes = new_tokens / cp * h_tp * cfg.head_dim * num.act_bytes
  attn = roofline(step_flops, msg["q"] + msg["kv"] + out_bytes, eff.attn * hw.bf16_flops,
                  eff.hbm * hw.hbm_bytes_per_s)
  sendrecv = all2all = 0.0
  if cp > 1:
    sendrecv = eff.sendrecv_link(hw).time(msg[variant[len("pass_"):]])
    if variant == "pass_q":
      all2all = eff.all2all_link(hw).time(msg["all2all"])
  return {"attn": attn, "sendrecv": sendrecv, "all2all": all2all}


def prefill_time(cfg: LlamaConfig, new_tokens: int, cached_tokens: int = 0, *, cp: int = 1,
                 tp: int = 8, variant: str = "pass_kv", hw: Hardware = Hardware(),
                 eff: Efficiency = Efficiency(), num: Numerics = Numerics()) -> Breakdown:
  """Predicted time of one (full or partial) prefill on `cp` hosts of `tp` GPUs each."""
  _check_args("prefill_time", new_tokens, cached_tokens, cp, variant)
  h_tp, g_tp = tp_heads(cfg, tp)
  d, f, k = cfg.dim, cfg.ffn_dim / tp, cfg.head_dim
  a, wb_ffn, wb_attn = num.act_bytes, num.ffn_weight_bytes, num.attn_weight_bytes
  hbm = eff.hbm * hw.hbm_bytes_per_s
  ffn_peak = eff.gemm * (hw.fp8_flops if wb_ffn == 1 else hw.bf16_flops)
  bf16 = eff.gemm * hw.bf16_flops
  t = new_tokens / cp                       # new tokens per host (load-balanced sharding)

  def gemm(m, kk, n, w_bytes, in_bytes, peak):
    return roofline(2 * m * kk * n, kk * n * w_bytes + m * kk * in_bytes + m * n * a, peak, hbm)

  t_gemm = (gemm(t, d, (h_tp + 2 * g_tp) * k, wb_attn, a, bf16)     # fused QKV
            + gemm(t, h_tp * k, d, wb_attn, a, bf16)                 # O (partial sums)
            + gemm(t, d, 2 * f, wb_ffn, wb_ffn, ffn_peak)            # fused w1, w3
            + gemm(t, f, d, wb_ffn, wb_ffn, ffn_peak))               # w2
  elem_bytes_per_token = (
      2 * 4 * d * a                                   # 2x fused residual add + RMSNorm
      + ((a + 1) * d if wb_ffn == 1 else 0)           # FP8 quantization of the FFN input
      + (2 * 2 * a + wb_ffn) * f                      # SwiGLU (+ FP8 quantization) of w1, w3
      + 2 * 2 * a * (h_tp + g_tp) * k                 # RoPE on q and k
      + 2 * g_tp * k * num.kv_bytes)                  # KV cache write
  t_elem = t * elem_bytes_per_token / hbm
  t_ar = 0.0
  if tp > 1:
    ar_bytes = t * d * a * 2 * (tp - 1) / tp
    t_ar = 2 * eff.nvlink_link(hw).time(ar_bytes)

  ring = ring_step_times(cfg, new_tokens, cached_tokens, cp=cp, tp=tp, variant=variant, hw=hw,
                         eff=eff, num=num)
  exposed = (cp - 1) * max(0.0, ring["sendrecv"] - ring["attn"])
  merge = 0.0
  if cp > 1:  # merge N partial outputs (+ log-sum-exp) into one, Appendix B
    merge = (cp + 1) * t * h_tp * (k * a + 4) / hbm
  per_layer = Breakdown(gemm=t_gemm, elementwise=t_elem, tp_allreduce=t_ar,
                        attn_compute=cp * ring["attn"], ring_exposed=exposed,
                        all2all=ring["all2all"], merge=merge)
  n = cfg.n_layers
  return Breakdown(**{kk: v * n for kk, v in dataclasses.asdict(per_layer).items()})


def calibrate_gemm(cfg: LlamaConfig, *, tokens: int, measured_s: float, cp: int = 1, tp: int = 8,
                   hw: Hardware = Hardware(), eff: Efficiency = Efficiency(),
                   num: Numerics = Numerics()) -> Efficiency:
  """`eff` with `gemm` set so that the predicted full prefill of `tokens` takes `measured_s`."""
  def total(g):
    return prefill_time(cfg, tokens, 0, cp=cp, tp=tp, hw=hw, num=num,
                        eff=dataclasses.replace(eff, gemm=g)).total
  lo, hi = 1e-4, 1.0
  if not total(hi) <= measured_s <= total(lo):
    raise ValueError(f"perf_model.calibrate_gemm: measured_s={measured_s}; the model gives "
                     f"{total(hi):.3f} s at gemm=1.0 and {total(lo):.3f} s at gemm={lo}, so no "
                     "GEMM efficiency in (0, 1] reproduces it")
  for _ in range(100):  # total() decreases with gemm efficiency
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if total(mid) > measured_s else (lo, mid)
  return dataclasses.replace(eff, gemm=(lo + hi) / 2)


def crossover_new_tokens(cfg: LlamaConfig, total_tokens: int, *, cp: int, tp: int = 8,
                         hw: Hardware = Hardware(), eff: Efficiency = Efficiency(),
                         num: Numerics = Numerics()) -> int | None:
  """Smallest T with P = total - T at which pass-KV is no slower than pass-Q.

  Scans a geometric grid of T, then bisects the first sign change; None when pass-Q is
  faster for every T.
  """
  def kv_minus_q(t):
    kw = dict(cp=cp, tp=tp, hw=hw, eff=eff, num=num)
    return (prefill_time(cfg, t, total_tokens - t, variant="pass_kv", **kw).total
            - prefill_time(cfg, t, total_tokens - t, variant="pass_q", **kw).total)
  grid = sorted({max(1, min(total_tokens, round(total_tokens ** (i / 400)))) for i in range(401)})
  if kv_minus_q(grid[0]) <= 0:
    return grid[0]
  for lo, hi in zip(grid, grid[1:]):
    if kv_minus_q(hi) <= 0:
      while hi - lo > 1:  # invariant: kv slower at lo, not slower at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_minus_q(mid) > 0 else (lo, mid)
      return hi
  return None
