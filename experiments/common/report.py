"""What every study's main does around its own work, once: the clock and a log line with
the seconds so far, the human tables it prints (their lines kept for results.json), the
plots written under --workdir, then `<workdir>/results.json` and the one-line JSON summary
printed last (core.results.finish).

  report = Report(FLAGS.workdir)
  rows = study.run(..., log=report.log)
  results = {"rows": rows, "table": report.table(study.format_table(rows))}
  results["plot"] = report.plot(study.plot, rows, name="study.png")   # or, drawn after
  report.finish(results, summary, wall="wall_seconds")   # results.json: plots=[(draw, args, name)]
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from core import results as results_lib


class Report:
  """One study run's scaffolding: clock, log, tables, plots, results.json, summary line."""

  def __init__(self, workdir: str, clock: Callable[[], float] = time.perf_counter):
    self.workdir = workdir
    self._clock = clock
    self.t0 = clock()

  @property
  def seconds(self) -> float:
    """Seconds since the report started (the study's wall time so far)."""
    return self._clock() - self.t0

  def log(self, message: str, digits: int = 0) -> None:
    """`[    12s] message`, flushed: a study's progress line."""
    print(f"[{self.seconds:6.{digits}f}s] {message}", flush=True)

  def table(self, text: str, lead: str = "") -> list[str]:
    """Prints `lead + text` (a human table), returns the table's lines for results.json."""
    print(lead + text, flush=True)
    return text.splitlines()

  def path(self, name: str = "") -> str:
    """`<workdir>/<name>` (no name: the workdir), the workdir made."""
    os.makedirs(self.workdir, exist_ok=True)
    return os.path.join(self.workdir, name) if name else self.workdir

  def plot(self, draw: Callable[..., Any], *args: Any, name: str) -> str:
    """`draw(*args, <workdir>/<name>)`, a study's plot function; returns the PNG's path."""
    path = self.path(name)
    draw(*args, path)
    return path

  def finish(self, results: dict[str, Any], summary: dict[str, Any],
             wall: str | None = None,
             plots: Sequence[tuple[Callable[..., Any], tuple, str]] = ()) -> str:
    """Writes results.json, then draws `plots` ((draw, args, name) as for `plot`: a plot
    that fails cannot lose the results), then prints `summary` as the last stdout line.
    `wall`: the key both get the seconds since the start under (the summary's rounded to
    0.1 s), last."""
    if wall:
      results[wall] = self.seconds
      summary[wall] = round(results[wall], 1)
    path = results_lib.write_results(self.path(), results)
    for draw, args, name in plots:
      self.plot(draw, *args, name=name)
    results_lib.print_summary(summary)
    return path
