"""The ScaleAcross optimizer (arXiv 2605.24326, §5): every plan of a cluster's search space
through the step-time model, the best one, and the best single change of the baseline.

Exhaustive over the discrete space: degrees (tp, cp, pp from the search lists; fsdp a power
of two dividing what is left, dp the rest), the order of cp, pp, fsdp, dp outside tp (tp
innermost: it all-reduces on every layer), v (1 without pipeline), overlap, hierarchical
collectives, flows and compression (only where a windowed link is crossed by gradients:
elsewhere they change nothing). Orders that differ only in where degree-1 axes sit are
one plan.
"""

from __future__ import annotations

import dataclasses
import itertools

from experiments.scaleacross import model
from experiments.scaleacross.cluster import AXES, Cluster, Plan

GROUPS = ("degrees", "placement", "v", "overlap", "hierarchical", "flows", "compression")


def _orders(plan: Plan) -> list[tuple[str, ...]]:
  """Distinct placements with tp innermost (degree-1 axes parked outside, in AXES order)."""
  used = [a for a in AXES[1:] if plan.degree(a) > 1]
  idle = [a for a in AXES[1:] if plan.degree(a) == 1]
  return [("tp",) + p + tuple(idle) for p in itertools.permutations(used)]


def _divisors_pow2(n: int) -> list[int]:
  return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


def windowed_grads(cluster: Cluster, plan: Plan, geo) -> bool:
  """Whether gradient collectives cross a windowed (long-haul) link."""
  return any(cluster.links[i].window_bytes is not None
             and (geo["fsdp"].factor(i) > 1 or geo["dp"].factor(i) > 1)
             for i in range(len(cluster.sizes)))


def windowed_any(cluster: Cluster, geo) -> bool:
  return any(cluster.links[i].window_bytes is not None and geo[a].factor(i) > 1
             for i in range(len(cluster.sizes)) for a in AXES)


def plans(cluster: Cluster, cfg) -> list[Plan]:
  """Every distinct plan of the search space (before feasibility)."""
  s, n = cluster.search, cluster.devices
  out = []
  for tp, cp, pp in itertools.product(s["tp"], s["cp"], s["pp"]):
    if n % (tp * cp * pp) or cfg.n_heads % tp or pp > cfg.n_layers:
      continue
    data = n // (tp * cp * pp)
    for fsdp in _divisors_pow2(data):
      base = Plan(tp=tp, cp=cp, pp=pp, fsdp=fsdp, dp=data // fsdp)
      for order in _orders(base):
        placed = dataclasses.replace(base, placement=order)
        geo = model.geometry(cluster, placed)
        if geo is None:
          continue
        wg, wa = windowed_grads(cluster, placed, geo), windowed_any(cluster, geo)
        for v, ovl, hier in itertools.product(s["v"] if pp > 1 else (1,), s["overlap"],
                                              s["hierarchical"]):
          if pp * v > cfg.n_layers:
            continue
          for flows in (s["flows"] if wa else (1,)):
            for comp in (s["compression"] if wg else (1,)):
              out.append(dataclasses.replace(placed, v=v, overlap=ovl, hierarchical=hier,
                                             flows=flows, compression=comp))
  return out


def single_changes(cluster: Cluster, cfg, base: Plan) -> list[tuple[str, Plan]]:
  """(group, plan) for every plan that differs from `base` in one group of choices."""
  s, out = cluster.search, []
  for p in plans_of_degrees(cluster, cfg):
    if (p.tp, p.cp, p.pp, p.fsdp, p.dp) != (base.tp, base.cp, base.pp, base.fsdp, base.dp):
      out.append(("degrees", dataclasses.replace(base, tp=p.tp, cp=p.cp, pp=p.pp, fsdp=p.fsdp,
                                                 dp=p.dp)))
  for order in itertools.permutations(AXES):
    if order != base.placement:
      out.append(("placement", dataclasses.replace(base, placement=order)))
  for key in ("v", "overlap", "hierarchical", "flows", "compression"):
    for val in s[key]:
      if val != getattr(base, key):
        out.append((key, dataclasses.replace(base, **{key: val})))
  return out


def plans_of_degrees(cluster: Cluster, cfg) -> list[Plan]:
  """Each degree combination of the search space once (placement and the rest default)."""
  s, n, out = cluster.search, cluster.devices, []
  for tp, cp, pp in itertools.product(s["tp"], s["cp"], s["pp"]):
    if n % (tp * cp * pp) or cfg.n_heads % tp or pp > cfg.n_layers:
      continue
    data = n // (tp * cp * pp)
    out += [Plan(tp=tp, cp=cp, pp=pp, fsdp=f, dp=data // f) for f in _divisors_pow2(data)]
  return out


def evaluate(cluster: Cluster, cfg, compute_efficiency: float, plan_list) -> list[dict]:
  """[{plan, time (model.step_time)}] for the feasible plans, fastest first."""
  rows = []
  for p in plan_list:
    t = model.step_time(cluster, p, cfg, compute_efficiency)
    if "infeasible" not in t:
      rows.append({"plan": p, "time": t})
  # Ties (choices that change nothing here) go to the plainer plan.
  rows.sort(key=lambda r: (r["time"]["total"], r["plan"].compression, r["plan"].flows,
                           r["plan"].v, not r["plan"].hierarchical))
  return rows
