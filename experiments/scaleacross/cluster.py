"""Cluster descriptions for the ScaleAcross study (arXiv 2605.24326): a JSON file read once
and checked, every bad value named by file and key.

A file (see clusters/*.json) holds:
  levels    inner to outer; level k groups `size` units of level k - 1 (level 0: one GPU),
            and its `link` joins those units: gbps (line rate per GPU, Gb/s), latency_us
            (one message), efficiency (achieved fraction, default 1), and for links shared by
            many GPUs aggregate_gbps (egress of one level k - 1 unit, shared by its GPUs
            that send at once) and window_mib (bytes in flight per flow: a long-haul flow
            moves at most window / round trip, so parallel flows help)
  gpu       bf16_tflops (dense peak), hbm_gib, hbm_tbps, compute_efficiency (achieved fraction
            of the peak on the model's FLOPs; omitted: fitted to Llama 3's Table 4, study.py)
  model     preset (llm.config), seq_len, global_batch_tokens, grad_bytes, act_bytes
  baseline  the production-style plan the optimizer is compared with (Plan fields)
  search    the values the optimizer may choose for each Plan field (optional lists)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from core.errors import expected
from core.hardware import Link

AXES = ("tp", "cp", "pp", "fsdp", "dp")


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """One level's link: line rate per GPU, latency, and what shares or limits it."""

  name: str
  bytes_per_s: float                # line rate per GPU
  latency_s: float
  efficiency: float = 1.0
  aggregate_bytes_per_s: float | None = None   # egress of one inner unit, shared
  window_bytes: float | None = None            # per flow, in flight (long-haul links)

  def link(self, senders: float = 1.0, flows: int = 1) -> Link:
    """The achieved Link of one GPU while `senders` GPUs of its inner unit send over it at
    once, each over `flows` parallel flows."""
    rate = self.bytes_per_s
    if self.aggregate_bytes_per_s is not None:
      rate = min(rate, self.aggregate_bytes_per_s / max(senders, 1.0))
    if self.window_bytes is not None and self.latency_s > 0:
      rate = min(rate, flows * self.window_bytes / (2 * self.latency_s))
    return Link(self.efficiency * rate, self.latency_s)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each parallelism sits, its schedule and the network-layer choices.

  placement: the five axes inner (fastest links) to outer; degrees multiply to the GPUs.
  v: model chunks per pipeline stage (interleaved 1F1B); overlap: gradient reduction and
  weight gathering overlapped with the backward / forward; hierarchical: collectives run
  level by level (reduce-scatter inside, all-reduce across, all-gather inside) instead of
  one flat ring; flows: parallel flows per GPU on windowed links; compression: gradient
  bytes divided by this on windowed links.
  """

  tp: int = 1
  cp: int = 1
  pp: int = 1
  fsdp: int = 1
  dp: int = 1
  v: int = 1
  placement: tuple[str, ...] = AXES
  overlap: bool = True
  hierarchical: bool = True
  flows: int = 1
  compression: int = 1

  def degree(self, axis: str) -> int:
    return getattr(self, axis)

  def describe(self) -> str:
    order = ">".join(a for a in self.placement if self.degree(a) > 1) or "-"
    return (f"tp{self.tp} cp{self.cp} pp{self.pp} fsdp{self.fsdp} dp{self.dp} v{self.v} "
            f"[{order}] {'ovl' if self.overlap else 'no-ovl'} "
            f"{'hier' if self.hierarchical else 'flat'} f{self.flows} c{self.compression}")

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["placement"] = list(self.placement)
    return d


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A checked cluster file."""

  path: str
  name: str
  sizes: tuple[int, ...]            # level k: units of level k - 1 per unit
  links: tuple[LinkSpec, ...]
  bf16_flops: float
  hbm_bytes: float
  hbm_bytes_per_s: float
  compute_efficiency: float | None
  preset: str
  seq_len: int
  global_batch_tokens: int
  grad_bytes: int
  act_bytes: int
  baseline: Plan
  search: dict[str, tuple]
  raw: dict

  @property
  def devices(self) -> int:
    n = 1
    for s in self.sizes:
      n *= s
    return n

  def unit_sizes(self) -> tuple[int, ...]:
    """GPUs per unit of level 0 (one GPU), 1, ..., len(sizes)."""
    out = [1]
    for s in self.sizes:
      out.append(out[-1] * s)
    return tuple(out)


def _num(where: str, d: dict, key: str, *, default=None, minimum=None, strict=True,
         integer=False):
  if key not in d:
    if default is not None:
      return default
    raise expected(where, f"'{key}' missing", f"a number for '{key}'")
  v = d[key]
  ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
  if integer:
    ok = ok and (isinstance(v, int) or v.is_integer())
  if ok and minimum is not None:
    ok = v > minimum if strict else v >= minimum
  if not ok:
    want = "an integer" if integer else "a number"
    if minimum is not None:
      want += f" {'>' if strict else '>='} {minimum}"
    raise expected(f"{where}.{key}", _show(v), want)
  try:
    return int(v) if integer else float(v)
  except OverflowError:   # an integer beyond a float's range
    raise expected(f"{where}.{key}", _show(v), "a number of a sensible size") from None


def _show(value: Any, limit: int = 80) -> str:
  """A value as an error message quotes it: repr, shortened."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _link(where: str, name: str, d: Any) -> LinkSpec:
  if not isinstance(d, dict):
    raise expected(where, _show(d), "an object with gbps and latency_us")
  agg = d.get("aggregate_gbps")
  win = d.get("window_mib")
  return LinkSpec(
      name=name,
      bytes_per_s=_num(where, d, "gbps", minimum=0) * 1e9 / 8,
      latency_s=_num(where, d, "latency_us", minimum=0, strict=False) * 1e-6,
      efficiency=_num(where, d, "efficiency", default=1.0, minimum=0),
      aggregate_bytes_per_s=None if agg is None else
      _num(where, d, "aggregate_gbps", minimum=0) * 1e9 / 8,
      window_bytes=None if win is None else _num(where, d, "window_mib", minimum=0) * 2**20)


def check_plan(cluster_devices: int, plan: Plan, where: str, n_layers: int | None = None,
               n_heads: int | None = None) -> None:
  """Degrees positive, multiplying to the GPUs, the placement a permutation of the axes."""
  for axis in AXES + ("v", "flows", "compression"):
    v = plan.degree(axis)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise expected(f"{where}.{axis}", _show(v), "an integer >= 1")
  for key in ("overlap", "hierarchical"):
    if not isinstance(getattr(plan, key), bool):
      raise expected(f"{where}.{key}", f"{getattr(plan, key)!r}", "true or false")
  for axis in AXES:
    if cluster_devices % plan.degree(axis):
      raise expected(f"{where}.{axis}", f"{plan.degree(axis)} does not divide the "
                     f"{cluster_devices} GPUs", "a divisor of the GPU count")
  prod = plan.tp * plan.cp * plan.pp * plan.fsdp * plan.dp
  if prod != cluster_devices:
    raise expected(where, f"tp*cp*pp*fsdp*dp = {prod}", f"the {cluster_devices} GPUs")
  if sorted(map(str, plan.placement)) != sorted(AXES) or not all(
      isinstance(a, str) for a in plan.placement):
    raise expected(f"{where}.placement", _show(list(plan.placement)),
                   f"an order of all of {list(AXES)}")
  if n_heads is not None and n_heads % plan.tp:
    raise expected(f"{where}.tp", f"{plan.tp}", f"a divisor of the model's {n_heads} heads")
  if n_layers is not None and plan.pp * plan.v > n_layers:
    raise expected(f"{where}.pp", f"pp*v = {plan.pp * plan.v}",
                   f"at most the model's {n_layers} layers")


def _plan(where: str, d: Any) -> Plan:
  if not isinstance(d, dict):
    raise expected(where, _show(d), "an object of Plan fields")
  fields = {f.name for f in dataclasses.fields(Plan)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise expected(where, f"unknown keys {unknown}", f"keys among {sorted(fields)}")
  kw = dict(d)
  if "placement" in kw:
    if not isinstance(kw["placement"], list):
      raise expected(f"{where}.placement", f"{kw['placement']!r}", f"a list of {list(AXES)}")
    kw["placement"] = tuple(kw["placement"])
  return Plan(**kw)


def parse(raw: dict, path: str) -> Cluster:
  """A Cluster from a parsed file; errors name `path` and the key."""
  from llm.config import PRESETS

  where = os.path.basename(path)
  if not isinstance(raw, dict):
    raise expected(where, f"{type(raw).__name__}", "a JSON object")
  levels = raw.get("levels")
  if not isinstance(levels, list) or not levels:
    raise expected(f"{where}: levels", _show(levels), "a non-empty list of {size, link}")
  sizes, links = [], []
  for i, lv in enumerate(levels):
    w = f"{where}: levels[{i}]"
    if not isinstance(lv, dict):
      raise expected(w, _show(lv), "an object with name, size and link")
    sizes.append(_num(w, lv, "size", minimum=0, integer=True))
    if "link" not in lv:
      raise expected(f"{w}.link", "missing", "the link joining this level's units "
                     "({gbps, latency_us})")
    links.append(_link(f"{w}.link", str(lv.get("name", f"level{i}")), lv["link"]))
  gpu = raw.get("gpu")
  if not isinstance(gpu, dict):
    raise expected(f"{where}: gpu", _show(gpu), "an object with bf16_tflops, hbm_gib, hbm_tbps")
  ce = gpu.get("compute_efficiency")
  if ce is not None:
    ce = _num(f"{where}: gpu", gpu, "compute_efficiency", minimum=0)
    if ce > 1:
      raise expected(f"{where}: gpu.compute_efficiency", f"{ce}", "a fraction in (0, 1]")
  model = raw.get("model")
  if not isinstance(model, dict):
    raise expected(f"{where}: model", _show(model), "an object with preset, seq_len, "
                   "global_batch_tokens")
  preset = model.get("preset")
  if not isinstance(preset, str) or preset not in PRESETS:
    raise expected(f"{where}: model.preset", _show(preset), f"one of {sorted(PRESETS)}")
  mw = f"{where}: model"
  seq_len = _num(mw, model, "seq_len", minimum=0, integer=True)
  gbt = _num(mw, model, "global_batch_tokens", minimum=0, integer=True)
  if gbt % seq_len:
    raise expected(f"{mw}.global_batch_tokens", f"{gbt}", f"a multiple of seq_len={seq_len}")
  devices = 1
  for s in sizes:
    devices *= s
  cfg = PRESETS[preset]
  baseline = _plan(f"{where}: baseline", raw.get("baseline"))
  check_plan(devices, baseline, f"{where}: baseline", cfg.n_layers, cfg.n_heads)
  search_raw = raw.get("search", {})
  if not isinstance(search_raw, dict):
    raise expected(f"{where}: search", _show(search_raw), "an object of lists")
  search = {}
  for key, default in DEFAULT_SEARCH.items():
    vals = search_raw.get(key, default)
    if not isinstance(vals, list) or not vals:
      raise expected(f"{where}: search.{key}", _show(vals), "a non-empty list")
    for v in vals:
      ok = (isinstance(v, bool) if key in ("overlap", "hierarchical")
            else isinstance(v, int) and not isinstance(v, bool) and v >= 1)
      if not ok:
        raise expected(f"{where}: search.{key}", _show(v),
                       "true / false" if key in ("overlap", "hierarchical") else "integers >= 1")
    search[key] = tuple(vals)
  unknown = sorted(set(search_raw) - set(DEFAULT_SEARCH))
  if unknown:
    raise expected(f"{where}: search", f"unknown keys {unknown}", f"keys among "
                   f"{sorted(DEFAULT_SEARCH)}")
  return Cluster(
      path=path, name=str(raw.get("name", os.path.splitext(where)[0])), sizes=tuple(sizes),
      links=tuple(links),
      bf16_flops=_num(f"{where}: gpu", gpu, "bf16_tflops", minimum=0) * 1e12,
      hbm_bytes=_num(f"{where}: gpu", gpu, "hbm_gib", minimum=0) * 2**30,
      hbm_bytes_per_s=_num(f"{where}: gpu", gpu, "hbm_tbps", minimum=0) * 1e12,
      compute_efficiency=ce, preset=preset, seq_len=seq_len, global_batch_tokens=gbt,
      grad_bytes=_num(mw, model, "grad_bytes", default=4, minimum=0, integer=True),
      act_bytes=_num(mw, model, "act_bytes", default=2, minimum=0, integer=True),
      baseline=baseline, search=search, raw=raw)


DEFAULT_SEARCH = {
    "tp": [1, 2, 4, 8], "cp": [1, 2, 4], "pp": [1, 2, 4, 8, 16, 32], "v": [1, 2, 4],
    "overlap": [True], "hierarchical": [True, False], "flows": [1, 4, 16],
    "compression": [1, 2, 4],
}


def load(path: str) -> Cluster:
  """Reads and checks a cluster file."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise expected(f"--cluster={path}", "no such file", "a cluster JSON file") from None
  name = os.path.basename(path)
  try:
    raw = json.loads(data.decode("utf-8"))
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise expected(f"{name}:{line}", f"byte {data[e.start]:#04x} is not UTF-8 text",
                   "a JSON object") from None
  except json.JSONDecodeError as e:
    raise expected(f"{name}:{e.lineno}:{e.colno}", f"invalid JSON ({e.msg})",
                   "a JSON object") from None
  except RecursionError:
    raise expected(name, "JSON nested too deeply to read", "a JSON object") from None
  return parse(raw, path)
