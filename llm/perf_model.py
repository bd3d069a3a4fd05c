"""Analytic latency model of Llama 3 prefill with context parallelism on H100 hosts.

The setting of "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783,
§4.1): Llama 3 405B with row-wise FP8 FFN weights, TP8 over NVLink inside each 8-GPU host,
CP across N hosts over RDMA (one ring per KV head: the ring links one GPU per host), ring
pass-KV or pass-Q attention (Algorithms 2 and 3) with load-balanced sharding, and pass-Q's
All2All of partial outputs at the end of the ring.

How a time is formed (per GPU, per layer, then times the number of layers):
- every op is a roofline: max(FLOPs / achieved FLOP/s, bytes / achieved HBM bytes/s);
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

Where the constants come from (the ONE place they are set: `Hardware`, `Efficiency`):
- `Hardware`: peaks. BF16 800 TF/s per GPU (the paper's power-limited 500 W H100, App. A),
  HBM 2.4 TB/s (§4.1), RDMA 400 Gb/s = 50 GB/s per GPU (GTT, §4.1). Not in the paper, so
  assumed: FP8 = 2x BF16 = 1600 TF/s; NVLink 450 GB/s per direction (H100 SXM spec).
- `Efficiency`, taken from paper numbers that are not TTFTs: attn = 0.675 (standalone
  FlashAttention-3, 540 of 800 TF/s, App. A); the inter-host SendRecv and All2All
  latency + bandwidth lines through Table 5's per-op timings (`table5_links`).
  Assumed: hbm = 0.8, nvlink = 0.8, 10 us per NVLink all-reduce.
  FITTED: gemm, by `calibrate_gemm` on ONE measured TTFT (TP8 128K full prefill, 42.01 s,
  Table 6). Every other TTFT is a prediction.

Letters: T new tokens, P cached tokens, N CP ranks (hosts), D model dim, F FFN dim, H query
heads, G key/value heads, K head dim; `_tp` suffix: per GPU of a TP group.
"""

from __future__ import annotations

import dataclasses

from llm.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Peak rates of one GPU of an H100 host and of its links."""

  bf16_flops: float = 800e12        # paper App. A: power-limited H100, BF16 dense peak
  fp8_flops: float = 1600e12        # assumption: 2x BF16
  hbm_bytes_per_s: float = 2.4e12   # paper §4.1: 96 GB HBM2e
  nvlink_bytes_per_s: float = 450e9  # assumption: H100 SXM NVLink, 900 GB/s both directions
  net_bytes_per_s: float = 50e9     # paper §4.1: GTT, RDMA 400 Gb/s per GPU


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of the `Hardware` peaks and fixed per-message latencies."""

  gemm: float = 0.6                 # placeholder: `calibrate_gemm` fits it
  attn: float = 0.675               # paper App. A: FA3 540 of 800 TF/s
  hbm: float = 0.8                  # assumption
  nvlink: float = 0.8               # assumption (NCCL all-reduce bus bandwidth ~360 GB/s)
  nvlink_latency_s: float = 10e-6   # assumption, per intra-host all-reduce
  # Inter-host links, alpha + bytes / (fraction * peak), each fitted to two rows of the
  # paper's Table 5 (CP4, P + T = 128000; see `table5_links`):
  sendrecv: float = 0.5686          # ring SendRecv: 16.4 MB in 627 us, 3.28 MB in 166 us
  sendrecv_latency_s: float = 50.75e-6
  all2all: float = 1.0              # pass-Q All2All: 9.98 MB in 424 us, 39.9 MB in 1023 us
  all2all_latency_s: float = 224.33e-6


@dataclasses.dataclass(frozen=True)
class Numerics:
  """Bytes per element of weights, activations and the KV cache (paper §4.1)."""

  ffn_weight_bytes: int = 1         # row-wise FP8 FFN weights (and FP8 activations into them)
  attn_weight_bytes: int = 2        # BF16 Q/K/V/O projections
  act_bytes: int = 2                # BF16 activations
  kv_bytes: int = 2                 # BF16 KV cache and ring messages


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


def _roofline(flops: float, bytes_: float, flops_per_s: float, bytes_per_s: float) -> float:
  return max(flops / flops_per_s, bytes_ / bytes_per_s)


def _check_args(fn: str, new_tokens, cached_tokens, cp, variant) -> None:
  if new_tokens < 1 or cached_tokens < 0 or cp < 1:
    raise ValueError(f"perf_model.{fn}: new_tokens={new_tokens}, cached_tokens={cached_tokens}, "
                     f"cp={cp}; expected new_tokens >= 1, cached_tokens >= 0, cp >= 1")
  if variant not in VARIANTS:
    raise ValueError(f"perf_model.{fn}: variant={variant!r}; expected one of {VARIANTS}")


def _per_gpu_heads(cfg: LlamaConfig, tp: int) -> tuple[float, float]:
  if tp < 1 or cfg.n_heads % tp:
    raise ValueError(f"perf_model: tp={tp}; expected a divisor of n_heads={cfg.n_heads}")
  # Past n_kv_heads GPUs the KV heads are replicated (paper §4.2.2): one per GPU.
  return cfg.n_heads / tp, max(cfg.n_kv_heads / tp, 1.0)


def layer_linear_params(cfg: LlamaConfig) -> dict[str, int]:
  """Weights of one decoder layer's projections: {"attn": Q,K,V,O, "ffn": w1,w2,w3}."""
  d, k = cfg.dim, cfg.head_dim
  return {"attn": d * k * (2 * cfg.n_heads + 2 * cfg.n_kv_heads), "ffn": 3 * d * cfg.ffn_dim}


def attention_pairs(new_tokens: int, cached_tokens: int) -> float:
  """(query, key) pairs a causal prefill of T new tokens over P cached ones computes."""
  return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


def prefill_flops(cfg: LlamaConfig, new_tokens: int, cached_tokens: int = 0) -> dict[str, float]:
  """Total model FLOPs of one prefill, all layers: {"gemm", "attn"} (LM head excluded)."""
  p = layer_linear_params(cfg)
  gemm = 2 * (p["attn"] + p["ffn"]) * new_tokens * cfg.n_layers
  attn = 4 * cfg.head_dim * cfg.n_heads * attention_pairs(new_tokens, cached_tokens) * cfg.n_layers
  return {"gemm": float(gemm), "attn": float(attn)}


def ring_message_bytes(cfg: LlamaConfig, new_tokens: int, cached_tokens: int, *, cp: int,
                       tp: int = 8, num: Numerics = Numerics()) -> dict[str, float]:
  """Bytes one GPU sends: per ring step ("kv", "q") and in pass-Q's All2All ("all2all")."""
  h_tp, g_tp = _per_gpu_heads(cfg, tp)
  t, kv, k = new_tokens / cp, (new_tokens + cached_tokens) / cp, cfg.head_dim
  return {"kv": 2 * kv * g_tp * k * num.kv_bytes, "q": t * h_tp * k * num.act_bytes,
          "all2all": (cp - 1) * t * h_tp * (k * num.act_bytes + 4)}


def ring_step_times(cfg: LlamaConfig, new_tokens: int, cached_tokens: int, *, cp: int,
                    tp: int = 8, variant: str = "pass_kv", hw: Hardware = Hardware(),
                    eff: Efficiency = Efficiency(), num: Numerics = Numerics()) -> dict[str, float]:
  """Seconds per layer: one ring step's attention and SendRecv, and the final All2All.

  The quantities of the paper's Table 5. Each of the N steps gets 1/N^2 of the (query, key)
  pairs (load-balanced sharding, on average); SendRecv and All2All are 0 without CP.
  """
  _check_args("ring_step_times", new_tokens, cached_tokens, cp, variant)
  h_tp, _ = _per_gpu_heads(cfg, tp)
  msg = ring_message_bytes(cfg, new_tokens, cached_tokens, cp=cp, tp=tp, num=num)
  step_flops = 4 * cfg.head_dim * h_tp * attention_pairs(new_tokens, cached_tokens) / cp ** 2
  out_bytes = new_tokens / cp * h_tp * cfg.head_dim * num.act_bytes
  attn = _roofline(step_flops, msg["q"] + msg["kv"] + out_bytes, eff.attn * hw.bf16_flops,
                   eff.hbm * hw.hbm_bytes_per_s)
  sendrecv = all2all = 0.0
  if cp > 1:
    sendrecv = (eff.sendrecv_latency_s
                + msg[variant[len("pass_"):]] / (eff.sendrecv * hw.net_bytes_per_s))
    if variant == "pass_q":
      all2all = eff.all2all_latency_s + msg["all2all"] / (eff.all2all * hw.net_bytes_per_s)
  return {"attn": attn, "sendrecv": sendrecv, "all2all": all2all}


def prefill_time(cfg: LlamaConfig, new_tokens: int, cached_tokens: int = 0, *, cp: int = 1,
                 tp: int = 8, variant: str = "pass_kv", hw: Hardware = Hardware(),
                 eff: Efficiency = Efficiency(), num: Numerics = Numerics()) -> Breakdown:
  """Predicted time of one (full or partial) prefill on `cp` hosts of `tp` GPUs each."""
  _check_args("prefill_time", new_tokens, cached_tokens, cp, variant)
  h_tp, g_tp = _per_gpu_heads(cfg, tp)
  d, f, k = cfg.dim, cfg.ffn_dim / tp, cfg.head_dim
  a, wb_ffn, wb_attn = num.act_bytes, num.ffn_weight_bytes, num.attn_weight_bytes
  hbm = eff.hbm * hw.hbm_bytes_per_s
  ffn_peak = eff.gemm * (hw.fp8_flops if wb_ffn == 1 else hw.bf16_flops)
  bf16 = eff.gemm * hw.bf16_flops
  t = new_tokens / cp                       # new tokens per host (load-balanced sharding)

  def gemm(m, kk, n, w_bytes, in_bytes, peak):
    return _roofline(2 * m * kk * n, kk * n * w_bytes + m * kk * in_bytes + m * n * a, peak, hbm)

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
    t_ar = 2 * (eff.nvlink_latency_s + ar_bytes / (eff.nvlink * hw.nvlink_bytes_per_s))

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


def alpha_beta(bytes_a: float, s_a: float, bytes_b: float, s_b: float) -> tuple[float, float]:
  """(latency s, bytes/s) of the line time = latency + bytes / rate through two timings."""
  if bytes_a == bytes_b or (s_b - s_a) * (bytes_b - bytes_a) <= 0:
    raise ValueError(f"perf_model.alpha_beta: ({bytes_a} B, {s_a} s), ({bytes_b} B, {s_b} s); "
                     "expected two timings whose time grows with size")
  rate = (bytes_b - bytes_a) / (s_b - s_a)
  return s_a - bytes_a / rate, rate


# Paper Table 5 (CP4, P + T = 128000), microseconds per op.
TABLE5_US = {("pass_kv", 3200): {"sendrecv": 627, "attn": 414},
             ("pass_q", 3200): {"sendrecv": 166, "attn": 414, "all2all": 424},
             ("pass_kv", 12800): {"sendrecv": 631, "attn": 1608},
             ("pass_q", 12800): {"sendrecv": 544, "attn": 1608, "all2all": 1023}}


def table5_links(cfg: LlamaConfig, hw: Hardware = Hardware(),
                 num: Numerics = Numerics()) -> dict[str, float]:
  """`Efficiency` link constants from Table 5: two timings per op, two unknowns each.

  SendRecv: pass-KV's and pass-Q's messages at 2.5% miss rate (the 10% rows are left as a
  check); All2All: the 2.5% and 10% rows (nothing left to check it with).
  """
  total, cp = 128000, 4
  m = {t: ring_message_bytes(cfg, t, total - t, cp=cp, num=num) for t in (3200, 12800)}
  us = 1e-6
  sr_lat, sr_rate = alpha_beta(m[3200]["q"], TABLE5_US["pass_q", 3200]["sendrecv"] * us,
                               m[3200]["kv"], TABLE5_US["pass_kv", 3200]["sendrecv"] * us)
  a2_lat, a2_rate = alpha_beta(m[3200]["all2all"], TABLE5_US["pass_q", 3200]["all2all"] * us,
                               m[12800]["all2all"], TABLE5_US["pass_q", 12800]["all2all"] * us)
  return {"sendrecv": sr_rate / hw.net_bytes_per_s, "sendrecv_latency_s": sr_lat,
          "all2all": a2_rate / hw.net_bytes_per_s, "all2all_latency_s": a2_lat}


__all__ = ["Breakdown", "Efficiency", "Hardware", "Numerics", "TABLE5_US", "VARIANTS",
           "alpha_beta", "attention_pairs", "calibrate_gemm", "crossover_new_tokens",
           "layer_linear_params", "prefill_flops", "prefill_time", "ring_message_bytes",
           "ring_step_times", "table5_links"]
