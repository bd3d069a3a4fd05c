"""The CP paper's latency tables (arXiv 2411.01783) against the analytic model: every Llama 3
405B prefill TTFT the paper reports on GTT hosts, Table 5's per-op times, the pass-KV /
pass-Q crossover of the model, of the paper's Table 4 and of Algorithms 1 and 5
(`llm.attention.cp_select`), and the plots. `python -m experiments.cp_model` runs it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

from core import hardware
from llm import cost
from llm.config import LlamaConfig

from experiments.cp_model import perf_model as pm

# Measured TTFT in seconds (paper, GTT hosts, TP8 in each host).
PAPER_FULL = {  # (context, CP hosts) -> s
    ("128K", 1): 42.010, ("128K", 2): 21.042, ("128K", 4): 10.950,   # Table 7
    ("128K", 8): 5.850,                                               # §4.2.1, Fig. 6a
    ("128K", 16): 3.8, ("1M", 16): 77.0,                              # §4.2.3, Fig. 8
    ("8K", 1): 1.740, ("32K", 1): 7.658, ("8K", 2): 0.999, ("32K", 2): 4.015,  # Table 6
}
PARTIAL_TOTAL = 128000
PAPER_PARTIAL_MS = {  # Table 4, CP4, P + T = 128000: T -> (pass-KV, pass-Q) ms
    1280: (1023.39, 898.71), 3200: (1110.18, 1046.43), 4160: (1298.92, 1280.10),
    6400: (1305.56, 1302.01), 12800: (2080.67, 2205.27), 25600: (3353.02, 3617.02),
    38400: (4629.23, 4922.52), 51200: (5745.08, 6217.83), 64000: (6845.21, 7367.99),
    76800: (7890.35, 8468.66), 89600: (8697.27, 9666.62), 102400: (10105.78, 10652.39),
    115200: (11136.40, 11571.62), 128000: (11462.15, 12360.57),
}
CP_SWEEP = (1, 2, 4, 8, 16)
# Paper Table 5 (CP4, P + T = 128000), microseconds per op.
TABLE5_US = {("pass_kv", 3200): {"sendrecv": 627, "attn": 414},
             ("pass_q", 3200): {"sendrecv": 166, "attn": 414, "all2all": 424},
             ("pass_kv", 12800): {"sendrecv": 631, "attn": 1608},
             ("pass_q", 12800): {"sendrecv": 544, "attn": 1608, "all2all": 1023}}


def table5_links(cfg: LlamaConfig, hw: hardware.Hardware = hardware.Hardware(),
                 num: cost.Numerics = cost.Numerics()) -> dict[str, float]:
  """`core.hardware.Efficiency` link constants from Table 5: two timings per op, two
  unknowns each.

  SendRecv: pass-KV's and pass-Q's messages at 2.5% miss rate (the 10% rows are left as a
  check); All2All: the 2.5% and 10% rows (nothing left to check it with).
  """
  total, cp = 128000, 4
  m = {t: cost.ring_message_bytes(cfg, t, total - t, cp=cp, num=num) for t in (3200, 12800)}
  us = 1e-6
  sr_lat, sr_rate = hardware.alpha_beta(
      m[3200]["q"], TABLE5_US["pass_q", 3200]["sendrecv"] * us,
      m[3200]["kv"], TABLE5_US["pass_kv", 3200]["sendrecv"] * us)
  a2_lat, a2_rate = hardware.alpha_beta(
      m[3200]["all2all"], TABLE5_US["pass_q", 3200]["all2all"] * us,
      m[12800]["all2all"], TABLE5_US["pass_q", 12800]["all2all"] * us)
  return {"sendrecv": sr_rate / hw.net_bytes_per_s, "sendrecv_latency_s": sr_lat,
          "all2all": a2_rate / hw.net_bytes_per_s, "all2all_latency_s": a2_lat}


def rule_crossover(algorithm: str, *, n_ranks: int, peak_flops: float, bandwidth: float,
                   n_heads: int, n_kv_heads: int, total: int = PARTIAL_TOTAL) -> int:
  """Smallest T (P = total - T) at which the selection rule picks pass-KV (it is monotone)."""
  from llm.attention.cp_select import choose_variant

  def kv(t):
    return choose_variant(t, total - t, n_ranks=n_ranks, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          peak_flops=peak_flops, bandwidth=bandwidth,
                          algorithm=algorithm) == "pass_kv"
  lo, hi = 0, total  # kv(total) holds for any GQA model: miss rate 1 >= 2*N_KV/N_H
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if kv(mid) else (mid, hi)
  return hi


def evaluate(cfg, hw, eff, *, tokens_128k: int, tokens_1m: int, calib_s: float,
             gemm_eff: float | None = None, curve_points: int = 200) -> dict:
  """Fits (unless `gemm_eff` is given) and predicts every paper point; returns results.json."""
  if gemm_eff is None:
    eff = pm.calibrate_gemm(cfg, tokens=tokens_128k, measured_s=calib_s, hw=hw, eff=eff)
  else:
    eff = dataclasses.replace(eff, gemm=gemm_eff)
  ctx = {"8K": 8192, "32K": 32768, "128K": tokens_128k, "1M": tokens_1m}
  kw = dict(hw=hw, eff=eff)
  points = []
  for (name, cp), paper in PAPER_FULL.items():
    b = pm.prefill_time(cfg, ctx[name], 0, cp=cp, **kw)
    points.append({"kind": "full", "name": f"full {name} " + ("TP8" if cp == 1 else f"CP{cp}"),
                   "context": name, "tokens": ctx[name], "cp": cp, "variant": "pass_kv",
                   "paper_ms": paper * 1e3, "model_ms": b.total * 1e3,
                   "calibration": (cp == 1 and name == "128K" and gemm_eff is None),
                   "breakdown_ms": {k: v * 1e3 for k, v in b.as_dict().items()}})
  for t, measured in PAPER_PARTIAL_MS.items():
    for variant, paper in zip(pm.VARIANTS, measured):
      b = pm.prefill_time(cfg, t, PARTIAL_TOTAL - t, cp=4, variant=variant, **kw)
      points.append({"kind": "partial", "name": f"partial {100 * t / PARTIAL_TOTAL:g}% {variant}",
                     "new_tokens": t, "cached_tokens": PARTIAL_TOTAL - t,
                     "miss_rate": t / PARTIAL_TOTAL, "cp": 4, "variant": variant,
                     "paper_ms": paper, "model_ms": b.total * 1e3, "calibration": False,
                     "breakdown_ms": {k: v * 1e3 for k, v in b.as_dict().items()}})
  for p in points:
    p["rel_err"] = (p["model_ms"] - p["paper_ms"]) / p["paper_ms"]
    p["residual_ms"] = p["paper_ms"] - p["model_ms"]

  # Crossover: model, paper (sign change of pass-KV - pass-Q in Table 4), Algorithms 1 and 5.
  x_model = pm.crossover_new_tokens(cfg, PARTIAL_TOTAL, cp=4, **kw)
  rows = sorted(PAPER_PARTIAL_MS.items())
  paper_bracket = paper_interp = None
  for (t0, (kv0, q0)), (t1, (kv1, q1)) in zip(rows, rows[1:]):
    if kv0 - q0 > 0 >= kv1 - q1:
      paper_bracket = [t0 / PARTIAL_TOTAL, t1 / PARTIAL_TOTAL]
      d0, d1 = kv0 - q0, kv1 - q1
      paper_interp = (t0 + (t1 - t0) * d0 / (d0 - d1)) / PARTIAL_TOTAL
      break
  rules = {}
  for label, c, bw in (("peak", hw.bf16_flops, hw.net_bytes_per_s),
                       ("achieved", eff.attn * hw.bf16_flops, eff.sendrecv * hw.net_bytes_per_s)):
    for alg in ("basic", "alltoall"):
      t = rule_crossover(alg, n_ranks=4, peak_flops=c, bandwidth=bw, n_heads=cfg.n_heads,
                         n_kv_heads=cfg.n_kv_heads)
      rules[f"{'alg1' if alg == 'basic' else 'alg5'}_{label}"] = {
          "new_tokens": t, "miss_rate": t / PARTIAL_TOTAL, "peak_flops": c, "bandwidth": bw}

  # Table 5's per-op times (us, CP4): which the link constants were fitted to, which not.
  table5 = []
  fitted = {("pass_q", 3200, "sendrecv"), ("pass_kv", 3200, "sendrecv"),
            ("pass_q", 3200, "all2all"), ("pass_q", 12800, "all2all")}
  for (variant, t), ops in TABLE5_US.items():
    r = pm.ring_step_times(cfg, t, PARTIAL_TOTAL - t, cp=4, variant=variant, **kw)
    for op, paper in ops.items():
      table5.append({"variant": variant, "new_tokens": t, "op": op, "paper_us": paper,
                     "model_us": r[op] * 1e6, "fitted": (variant, t, op) in fitted})

  # Curves for the plots.
  ts = sorted({max(1, round(PARTIAL_TOTAL * 10 ** (-2.3 + 2.3 * i / (curve_points - 1))))
               for i in range(curve_points)})
  partial_curve = {"miss_rate": [t / PARTIAL_TOTAL for t in ts]}
  for variant in pm.VARIANTS:
    partial_curve[variant + "_ms"] = [
        pm.prefill_time(cfg, t, PARTIAL_TOTAL - t, cp=4, variant=variant, **kw).total * 1e3
        for t in ts]
  full_curve = {"cp": list(CP_SWEEP)}
  for name in ("128K", "1M"):
    full_curve[name + "_s"] = [pm.prefill_time(cfg, ctx[name], 0, cp=cp, **kw).total
                               for cp in CP_SWEEP]

  predicted = [p for p in points if not p["calibration"]]
  errs = [abs(p["rel_err"]) for p in predicted]

  def stats(ps):
    e = [abs(p["rel_err"]) for p in ps]
    return {"n": len(e), "max_abs_rel_err": max(e), "median_abs_rel_err": statistics.median(e)}
  partial = [p for p in predicted if p["kind"] == "partial"]
  summary = {
      "gemm_eff": eff.gemm, "gemm_eff_fitted": gemm_eff is None, "n_points": len(points),
      "n_predicted": len(predicted), "max_abs_rel_err": max(errs),
      "median_abs_rel_err": statistics.median(errs),
      "full": stats([p for p in predicted if p["kind"] == "full"]), "partial": stats(partial),
      "partial_median_residual_ms": statistics.median(p["residual_ms"] for p in partial),
      "crossover_miss_rate_model": None if x_model is None else x_model / PARTIAL_TOTAL,
      "crossover_miss_rate_paper_bracket": paper_bracket,
      "crossover_miss_rate_paper_interp": paper_interp,
      **{k + "_miss_rate": v["miss_rate"] for k, v in rules.items()},
  }
  return {"constants": {"hardware": dataclasses.asdict(hw), "efficiency": dataclasses.asdict(eff),
                        "numerics": dataclasses.asdict(cost.Numerics()),
                        "tokens_128k": tokens_128k, "tokens_1m": tokens_1m,
                        "calibration": ("TP8 128K full prefill = %g s" % calib_s
                                        if gemm_eff is None else "none (gemm_eff given)")},
          "points": points, "table5": table5, "rules": rules, "crossover_new_tokens_model": x_model,
          "curves": {"partial_cp4": partial_curve, "full": full_curve}, "summary": summary}


def format_table(res: dict) -> str:
  lines = [f"{'point':34} {'paper':>10} {'model':>10} {'rel err':>8} {'resid':>9}",
           f"{'':34} {'(ms)':>10} {'(ms)':>10} {'':>8} {'(ms)':>9}"]
  for p in res["points"]:
    tag = "  (calibration)" if p["calibration"] else ""
    lines.append(f"{p['name']:34} {p['paper_ms']:10.1f} {p['model_ms']:10.1f} "
                 f"{100 * p['rel_err']:+7.1f}% {p['residual_ms']:+9.1f}{tag}")
  lines.append("")
  lines.append(f"{'CP4 partial, pass-KV - pass-Q':34} {'paper':>10} {'model':>10}")
  by_t = {}
  for p in res["points"]:
    if p["kind"] == "partial":
      by_t.setdefault(p["new_tokens"], {})[p["variant"]] = p
  for t, v in sorted(by_t.items()):
    lines.append(f"{'  miss rate %g%%' % (100 * t / PARTIAL_TOTAL):34} "
                 f"{v['pass_kv']['paper_ms'] - v['pass_q']['paper_ms']:+10.1f} "
                 f"{v['pass_kv']['model_ms'] - v['pass_q']['model_ms']:+10.1f}")
  lines.append("")
  lines.append(f"{'Table 5 per-op times (us)':34} {'paper':>10} {'model':>10}")
  for r in res["table5"]:
    name = f"  {100 * r['new_tokens'] / PARTIAL_TOTAL:g}% {r['variant']} {r['op']}"
    lines.append(f"{name:34} {r['paper_us']:10.0f} {r['model_us']:10.0f}"
                 + ("  (fitted)" if r["fitted"] else ""))
  s = res["summary"]
  lines.append("")
  lines.append(f"GEMM efficiency {s['gemm_eff']:.3f} ({res['constants']['calibration']}); "
               f"|rel err| over {s['n_predicted']} predicted points: median "
               f"{100 * s['median_abs_rel_err']:.1f}%, max {100 * s['max_abs_rel_err']:.1f}%")
  br = s["crossover_miss_rate_paper_bracket"]
  fmt = lambda x: "none" if x is None else f"{100 * x:.2f}%"  # noqa: E731
  lines.append(f"pass-KV beats pass-Q from miss rate: model {fmt(s['crossover_miss_rate_model'])}; "
               f"paper between {fmt(br[0])} and {fmt(br[1])} (interpolated "
               f"{fmt(s['crossover_miss_rate_paper_interp'])})")
  for k, v in res["rules"].items():
    lines.append(f"  {k:13} picks pass-KV from T = {v['new_tokens']:6d} ({fmt(v['miss_rate'])}) "
                 f"with C = {v['peak_flops'] / 1e12:.0f} TF/s, "
                 f"BW = {v['bandwidth'] / 1e9:.1f} GB/s")
  return "\n".join(lines)


def plot(res: dict, workdir: str) -> list[str]:
  from core import plot as plot_lib
  out = []
  full = res["curves"]["full"]
  out.append(os.path.join(workdir, "full_prefill.png"))
  with plot_lib.figure(out[-1], figsize=(5.2, 3.8)) as (fig, ax):
    for name, color in (("128K", "C0"), ("1M", "C1")):
      ax.plot(full["cp"], full[name + "_s"], "-", color=color, label=f"model {name}")
      pts = [p for p in res["points"] if p["kind"] == "full" and p["context"] == name]
      ax.plot([p["cp"] for p in pts], [p["paper_ms"] / 1e3 for p in pts], "o", color=color,
              label=f"paper {name}")
    ax.set(xscale="log", yscale="log", xlabel="hosts (CP ranks, TP8 each)", ylabel="TTFT (s)",
           title="Llama 3 405B full prefill")
    ax.set_xticks(list(CP_SWEEP), [str(c) for c in CP_SWEEP])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)

  curve = res["curves"]["partial_cp4"]
  s = res["summary"]
  out.append(os.path.join(workdir, "partial_prefill.png"))
  with plot_lib.figure(out[-1], 1, 2, figsize=(10, 3.8)) as (fig, axes):
    x = [100 * m for m in curve["miss_rate"]]
    pts = [p for p in res["points"] if p["kind"] == "partial"]
    for variant, color in (("pass_kv", "C0"), ("pass_q", "C3")):
      axes[0].plot(x, curve[variant + "_ms"], "-", color=color, label=f"model {variant}")
      vp = [p for p in pts if p["variant"] == variant]
      axes[0].plot([100 * p["miss_rate"] for p in vp], [p["paper_ms"] for p in vp], "o",
                   color=color, ms=4, label=f"paper {variant}")
    # The difference cancels any cost common to both variants (the ratio, Fig. 9, does not).
    diff = [a - b for a, b in zip(curve["pass_kv_ms"], curve["pass_q_ms"])]
    axes[1].plot(x, diff, "-", color="k", label="model")
    paper = {p["new_tokens"]: {} for p in pts}
    for p in pts:
      paper[p["new_tokens"]][p["variant"]] = p["paper_ms"]
    axes[1].plot([100 * t / PARTIAL_TOTAL for t in paper],
                 [v["pass_kv"] - v["pass_q"] for v in paper.values()], "o", color="k", ms=4,
                 label="paper (Table 4)")
    axes[1].axhline(0.0, color="gray", lw=0.8)
    for a in axes:
      if s["crossover_miss_rate_model"] is not None:
        a.axvline(100 * s["crossover_miss_rate_model"], color="C2", ls="--", lw=1,
                  label="model crossover")
      if s["crossover_miss_rate_paper_interp"] is not None:
        a.axvline(100 * s["crossover_miss_rate_paper_interp"], color="C1", ls="--", lw=1,
                  label="paper crossover")
      a.axvline(100 * s["alg5_achieved_miss_rate"], color="C4", ls=":", lw=1,
                label="Alg. 5 (achieved C, BW)")
      a.set(xscale="log", xlabel="KV cache miss rate T/(T+P) (%)")
      a.grid(alpha=0.3, which="both")
      a.legend(fontsize=7)
    axes[0].set(yscale="log", ylabel="TTFT (ms)", title="CP4 partial prefill, P + T = 128000")
    axes[1].set(ylabel="pass-KV - pass-Q TTFT (ms)", title="pass-KV minus pass-Q")
  return out
