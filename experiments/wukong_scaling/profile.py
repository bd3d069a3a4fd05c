"""Where a scaling run's time goes (`python -m experiments.wukong_scaling --study=profile`):
per model and data generator, examples/s of the source alone, of the jitted train step
alone over batches already on the devices, and of the shared train loop end to end
(rec.throughput.measure), and from them the hours the scaling grid needs.

On a CPU host the source and the step share the same cores, so end to end is close to
1 / (1 / source + 1 / step) when generation is not hidden; `gen=device` draws the same
hidden model's batches inside XLA (rec.data.device_synthetic: the same distribution, a
different random stream), `gen=host` in numpy (the reference stream).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from rec import configs, runs, throughput


def profile(base: configs.RecRunConfig, specs: Sequence[runs.ModelSpec], datas: Sequence[str],
            steps: int = 30, source_batches: int = 20) -> list[dict[str, Any]]:
  """One row per (spec, data): source / step / end-to-end examples/s, their ratio, and the
  seconds 10M examples take end to end."""
  rows = []
  for spec in specs:
    for data in datas:
      cfg = configs.replace_run(runs.for_model(base, spec), data=data)
      t0 = time.perf_counter()
      task, train_src = configs.build_run(cfg)[:2]
      m = throughput.measure(task, train_src, steps=steps, repeats=3,
                             source_batches=source_batches)
      stats = configs.model_stats(task, train_src.spec)
      rows.append({"label": spec.label, "data": data, **m,
                   "gflops_per_example": stats["gflops_per_example"],
                   "seconds_per_10m": 1e7 / m["end_to_end_examples_per_sec"],
                   "wall_seconds": time.perf_counter() - t0})
      print(f"{spec.label:26} {data:28} source {m['source_examples_per_sec']:>9,.0f} | step "
            f"{m['step_examples_per_sec']:>8,.0f} | end to end "
            f"{m['end_to_end_examples_per_sec']:>8,.0f} ex/s", flush=True)
  return rows


def format_profile(rows: Sequence[dict[str, Any]], batch_size: int) -> str:
  head = (f"{'model':26} {'data':28} {'source ex/s':>12} {'step ex/s':>10} {'e2e ex/s':>9} "
          f"{'e2e/step':>8} {'10M ex (s)':>10}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['label']:26} {r['data']:28} {r['source_examples_per_sec']:>12,.0f} "
                 f"{r['step_examples_per_sec']:>10,.0f} {r['end_to_end_examples_per_sec']:>9,.0f} "
                 f"{r['end_to_end_over_step']:>8.2f} {r['seconds_per_10m']:>10,.0f}")
  lines.append(f"batch {batch_size}; step: median of 3 repeats over 8 batches on the devices; "
               "end to end: core.train.train, no eval")
  return "\n".join(lines)
