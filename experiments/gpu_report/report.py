"""The report's machinery: target rows, parts run under time budgets with their compile and
run time logged, out-of-memory told apart from other failures, pytest run in subprocesses
with their own time limits, and DIR/report.md + DIR/report.json written after every part.

A part is a function `fn(ctx) -> {"targets": [Target, ...], "details": {...}}`; it checks
`ctx.time_left()` between its cases and marks the cases it did not start as skipped. A
part that raises is recorded with its error (status "oom" when the device ran out of
memory, else "failed") and the report goes on.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

from core import benchmark
from experiments.benchmarks.attention import error_text

# Statuses of a target row: met / missed (a figure against its target), info (a figure with
# no target), and the reasons for no figure: failed, oom, skipped (time budget),
# unmeasured (what the figure needs has no number).
STATUSES = ("met", "missed", "info", "failed", "oom", "skipped", "unmeasured", "partial")
# The compile events a part's compile time sums (core.benchmark).
COMPILE_EVENTS = benchmark.COMPILE_EVENTS


@dataclasses.dataclass
class Target:
  """One row of the report: a figure against a target, or why there is no figure."""

  part: str
  name: str             # what is measured, with its shape / setting
  target: str           # ">= 0.9x cuDNN", or "-" for a figure without a target
  figure: float | None = None
  text: str = ""        # the figure as printed ("0.93x", "41.5%")
  status: str = "unmeasured"
  detail: str = ""      # the numbers behind the figure, or the error

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"Target {self.name!r}: status {self.status!r}, expected one of "
                       f"{STATUSES}")


def judged(part: str, name: str, figure: float | None, *, at_least: float | None = None,
           at_most: float | None = None, fmt: str = "{:.2f}x", target: str | None = None,
           detail: str = "", error: str | None = None, skipped: str | None = None) -> Target:
  """A Target whose status follows from the figure: met / missed against `at_least` or
  `at_most` (info with neither), failed / oom from `error`, skipped, or unmeasured."""
  if target is None:
    target = (f">= {fmt.format(at_least)}" if at_least is not None else
              f"<= {fmt.format(at_most)}" if at_most is not None else "-")
  if error is not None:
    status = "oom" if benchmark.is_out_of_memory(error) else "failed"
    return Target(part, name, target, None, "", status, error)
  if skipped is not None:
    return Target(part, name, target, None, "", "skipped", skipped)
  if figure is None:
    return Target(part, name, target, None, "", "unmeasured", detail)
  if at_least is not None:
    status = "met" if figure >= at_least else "missed"
  elif at_most is not None:
    status = "met" if figure <= at_most else "missed"
  else:
    status = "info"
  return Target(part, name, target, float(figure), fmt.format(figure), status, detail)


@dataclasses.dataclass
class Context:
  """What a part gets: its sizes, its deadline, a logger that also writes its log file."""

  sizes: Any
  dry_run: bool
  out_dir: str
  deadline: float = float("inf")
  log_file: Any = None
  shared: dict = dataclasses.field(default_factory=dict)   # measured once, used by parts
  started: float = dataclasses.field(default_factory=time.monotonic)
  profile: bool = False      # --profile: trace a timed case of the parts that can

  def profile_dir(self, label: str) -> str | None:
    """Where a part traces `label` under --profile (logs/profile_<label>, so the logs'
    archive carries it), else None."""
    if not self.profile:
      return None
    return os.path.join(self.out_dir, "logs", "profile_" + re.sub(r"[^A-Za-z0-9_.-]+", "_",
                                                                   label))

  def log_profile(self, label: str, summary: dict | None) -> None:
    if summary is not None:
      from core import profiling
      self.log(f"  profile of {label}: " + profiling.format_summary(summary).replace(
          "\n", "\n    "))

  def time_left(self) -> float:
    return self.deadline - time.monotonic()

  def log(self, msg: str) -> None:
    line = f"[{time.monotonic() - self.started:7.1f}s] {msg}"
    print(line, flush=True)
    if self.log_file is not None:
      self.log_file.write(line + "\n")
      self.log_file.flush()

  def copy_bandwidth(self) -> float:
    """The device's copy bandwidth (bytes/s, read + write), measured once per report."""
    if "copy_bytes_per_s" not in self.shared:
      self.shared["copy_bytes_per_s"] = benchmark.copy_bandwidth(self.sizes.copy_bytes)
      self.log(f"copy bandwidth {self.shared['copy_bytes_per_s'] / 1e12:.3f} TB/s "
               f"({self.sizes.copy_bytes / 2**30:.2f} GiB, read + write)")
    return self.shared["copy_bytes_per_s"]


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  fn: Callable[[Context], dict]
  what: str            # one line for --help and the report


def _release() -> None:
  """Drops what a part left behind: its arrays are unreferenced once it returns (a failure
  keeps only the error's text), so collecting and clearing jit caches frees their memory."""
  import jax
  gc.collect()
  jax.clear_caches()
  gc.collect()


def run_part(part: Part, ctx: Context, budget_s: float) -> dict[str, Any]:
  """Runs one part under its budget; returns its record (status, error, targets, details,
  wall / compile / run seconds, and this process's CPU seconds). Never raises for the
  part's own failure."""
  ctx.deadline = time.monotonic() + budget_s
  t0, cpu0 = time.monotonic(), time.process_time()
  record: dict[str, Any] = {"budget_s": round(budget_s, 1)}
  ctx.log(f"== {part.name}: {part.what} (budget {budget_s:.0f} s)")
  with benchmark.CompileClock() as clock:
    try:
      out = part.fn(ctx)
      record.update(status="ok", targets=out.get("targets", []), details=out.get("details", {}))
    except Exception as e:  # noqa: BLE001 - one part failing must not end the report
      oom = benchmark.is_out_of_memory(e)
      record.update(status="oom" if oom else "failed", error=error_text(e), targets=[],
                    details={})
      ctx.log(f"{part.name}: {'OUT OF MEMORY' if oom else 'FAILED'}: {record['error']}")
      if ctx.log_file is not None:
        ctx.log_file.write(traceback.format_exc())
    finally:
      _release()
  wall = time.monotonic() - t0
  record.update(wall_s=round(wall, 2), compile_s=round(clock.seconds, 2),
                run_s=round(max(wall - clock.seconds, 0.0), 2),
                cpu_s=round(time.process_time() - cpu0, 2))
  if record["status"] != "ok":
    record["targets"] = [Target(part.name, f"{part.name} (whole part)", "-", None, "",
                                record["status"], record["error"])]
  ctx.log(f"{part.name}: {record['status']} in {wall:.1f} s (compile {clock.seconds:.1f} s, "
          f"run {record['run_s']:.1f} s; this process's CPU {record['cpu_s']:.1f} s)")
  for t in record["targets"]:
    ctx.log(f"  {t.status:<10} {t.name}: {t.text or '-'} (target {t.target})"
            + (f" {t.detail}" if t.status in ("failed", "oom", "skipped") else ""))
  return record


def row_errors(report: dict[str, Any]) -> list[str]:
  """Every error the report holds, one line each ("part: where: error"): parts that failed
  or ran out of memory, target rows that did, and any row of a part's details
  with an "error" (a Triton row, an XLA gather, one train case: rows no target is judged
  on). Empty when every case ran; the dry run fails on any."""
  out: list[str] = []

  def walk(part: str, where: str, x) -> None:
    if isinstance(x, dict):
      if isinstance(x.get("error"), str):
        label = ", ".join(f"{k}={x[k]}" for k in ("impl", "dtype", "seq_len", "head_dim")
                          if k in x)
        out.append(f"{part}: {where}{' ' + label if label else ''}: {x['error']}")
      for k, v in x.items():
        if k != "error":
          walk(part, f"{where}/{k}" if where else str(k), v)
    elif isinstance(x, (list, tuple)):
      for i, v in enumerate(x):
        walk(part, f"{where}[{i}]", v)

  for name, p in report["parts"].items():
    if p.get("status") in ("failed", "oom"):
      out.append(f"{name}: the part {p['status']}: {p['error']}")
    walk(name, "details", p.get("details", {}))
  for t in report["targets"]:
    t = t if isinstance(t, dict) else dataclasses.asdict(t)
    if t["status"] in ("failed", "oom") and not any(t["detail"] in e for e in out):
      out.append(f"{t['part']}: {t['name']}: {t['status']}: {t['detail']}")
  return list(dict.fromkeys(out))


# ------------------------------------------------------------------------ pytest


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
# A `-v` line: "tests/a.py::test_x PASSED [ 25%]", or under xdist "[gw1] [ 25%] PASSED tests/..."
_OUTCOME = re.compile(r"(?:::\S*.*? |^\[gw\d+\] \[\s*\d+%\] )"
                      r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_pytest_counts(text: str) -> dict[str, int]:
  """{passed, failed, skipped, errors, ...} from pytest's output: the final summary line
  when there is one, else counted from the per-test lines of `-v` (a run cut short)."""
  summary = [line for line in text.splitlines()
             if line.startswith("=") and (" in " in line or "no tests ran" in line)
             and _SUMMARY.search(line)]
  counts: dict[str, int] = {}
  if summary:
    for n, what in _SUMMARY.findall(summary[-1]):
      counts["errors" if what.startswith("error") else what] = int(n)
  else:
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
             "XFAIL": "xfailed", "XPASS": "xpassed"}
    for line in text.splitlines():
      m = _OUTCOME.search(line)
      if m:
        counts[names[m.group(1)]] = counts.get(names[m.group(1)], 0) + 1
  for k in ("passed", "failed", "skipped", "errors"):
    counts.setdefault(k, 0)
  return counts


def run_pytest(args: list[str], env: dict[str, str], timeout_s: float, log_path: str,
               cwd: str) -> dict[str, Any]:
  """Runs `python -m pytest -v *args` in its own process group, killed after `timeout_s`;
  returns {counts, returncode, timed_out, seconds, failures}; the output goes to `log_path`,
  each failure's reason (written as it happens, so a run cut short keeps it) to
  `log_path`.failures and into `failures` ([{test, text}])."""
  from experiments.gpu_report import pytest_failures
  cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p",
         "experiments.gpu_report.pytest_failures", *args]
  failures_path = log_path + ".failures"
  if os.path.exists(failures_path):
    os.remove(failures_path)
  env = {**env, pytest_failures.ENV: failures_path}
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    log.write(" ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    timed_out = False
    try:
      proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(proc.pid, signal.SIGKILL)      # the group this call started, nothing else
      proc.wait()
  with open(log_path) as f:
    text = f.read()
  return {"counts": parse_pytest_counts(text), "returncode": proc.returncode,
          "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1),
          "command": " ".join(cmd), "failures": pytest_failures.read_failures(failures_path)}


# ------------------------------------------------------------------------ writing


def _cell(x) -> str:
  return str(x).replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict[str, Any]) -> str:
  """report.md: the targets table (figure, target, met or not), the parts' times, and
  each part's details."""
  lines = [f"# GPU report{' (DRY RUN)' if report['dry_run'] else ''}", ""]
  m = report["machine"]
  lines.append(f"{m['device']} ({m['backend']}, {m['num_devices']} device(s)), jax "
               f"{m['jax']}, {m['cpu']} x {m['cores']}; started {report['started']}, "
               f"{report['wall_s']:.0f} s wall.")
  if report["dry_run"]:
    lines += ["", "**Dry run: toy sizes on CPU, Pallas kernels interpreted, cuDNN replaced by "
              "XLA. The figures and their statuses check the report's plumbing and say "
              "nothing about any GPU.**"]
  lines += ["", "| part | target | figure | goal | status | detail |",
            "|---|---|---|---|---|---|"]
  for t in report["targets"]:
    lines.append(f"| {t['part']} | {_cell(t['name'])} | {t['text'] or '-'} | "
                 f"{_cell(t['target'])} | {t['status']} | {_cell(t['detail'])} |")
  counts = {s: sum(t["status"] == s for t in report["targets"]) for s in STATUSES}
  lines += ["", "Targets: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), "",
            "| part | status | budget s | wall s | compile s | run s | error |",
            "|---|---|---|---|---|---|---|"]
  for name, p in report["parts"].items():
    lines.append(f"| {name} | {p['status']} | {p.get('budget_s', '-')} | "
                 f"{p.get('wall_s', '-')} | {p.get('compile_s', '-')} | {p.get('run_s', '-')} "
                 f"| {_cell(p.get('error', ''))} |")
  for name, p in report["parts"].items():
    tables = p.get("details", {}).get("tables", {})
    for title, rows in tables.items():
      if not rows:
        continue
      cols = list(dict.fromkeys(k for r in rows for k in r))
      lines += ["", f"## {name}: {title}", "", "| " + " | ".join(cols) + " |",
                "|" + "---|" * len(cols)]
      for r in rows:
        lines.append("| " + " | ".join(_cell(_fmt(r.get(c, ""))) for c in cols) + " |")
  return "\n".join(lines) + "\n"


def _fmt(x) -> str:
  if isinstance(x, float):
    return f"{x:.4g}"
  return str(x)


def write_report(out_dir: str, report: dict[str, Any]) -> None:
  """DIR/report.json and DIR/report.md, each written to a temporary file and renamed."""
  os.makedirs(out_dir, exist_ok=True)
  for name, text in (("report.json", json.dumps(report, indent=1, default=_json_default)),
                     ("report.md", to_markdown(report))):
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))


def _json_default(x):
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  if hasattr(x, "item"):
    return x.item()
  return str(x)


def default_out_dir(root: str = "runs") -> str:
  return os.path.join(root, "gpu_report_" + datetime.datetime.now().strftime("%Y%m%d_%H%M%S"))


__all__ = ["COMPILE_EVENTS", "Context", "Part", "STATUSES", "Target", "default_out_dir",
           "judged", "parse_pytest_counts", "row_errors", "run_part", "run_pytest",
           "to_markdown", "write_report"]
