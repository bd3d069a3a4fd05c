"""core.results: results.json written atomically, the one-line JSON summary printed last
(numpy scalars as numbers), and core.plot.pyplot on the Agg backend."""

import json

import numpy as np

from core import plot as plot_lib
from core import results as results_lib


def test_finish_writes_results_then_prints_the_summary_last(tmp_path, capsys):
  print("a human table")
  summary = {"auc": np.float32(0.75), "steps": np.int64(3), "where": tmp_path}
  path = results_lib.finish(str(tmp_path / "w"), {"rows": [1, 2], "summary": summary}, summary)
  assert path == str(tmp_path / "w" / "results.json")
  with open(path) as f:
    assert json.load(f) == {"rows": [1, 2], "summary": {"auc": 0.75, "steps": 3,
                                                         "where": str(tmp_path)}}
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "a human table"
  assert json.loads(lines[-1]) == {"auc": 0.75, "steps": 3, "where": str(tmp_path)}
  assert not (tmp_path / "w" / "results.json.tmp").exists()


def test_pyplot_draws_on_agg():
  import matplotlib
  plt = plot_lib.pyplot()
  assert matplotlib.get_backend().lower() == "agg" and plt.__name__ == "matplotlib.pyplot"
