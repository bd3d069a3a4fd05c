"""core.results: results.json written atomically, the one-line JSON summary printed last
(numpy scalars as numbers), and core.plot.pyplot on the Agg backend."""

import json

import numpy as np
import pytest

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


def test_arrays_are_written_whole_and_a_failed_write_leaves_no_file(tmp_path, capsys):
  """A numpy / jax array of more than one value is a nested list (`.item()` raised on it,
  and str() would elide the middle of a large one); a value json cannot write leaves neither
  results.json nor its temporary file."""
  import jax.numpy as jnp
  big = np.arange(2000, dtype=np.float32).reshape(2, 1000)
  out = {"rows": np.arange(3), "per_step": jnp.asarray([0.5, 0.25]), "big": big}
  path = results_lib.write_results(str(tmp_path), out)
  with open(path) as f:
    got = json.load(f)
  assert got["rows"] == [0, 1, 2] and got["per_step"] == [0.5, 0.25]
  assert got["big"] == big.tolist()
  results_lib.print_summary({"rows": np.arange(2)})
  assert json.loads(capsys.readouterr().out) == {"rows": [0, 1]}
  loop = []
  loop.append(loop)
  with pytest.raises(ValueError, match="Circular reference"):
    results_lib.write_results(str(tmp_path / "w"), {"loop": loop})
  assert not (tmp_path / "w" / "results.json").exists()
  assert not (tmp_path / "w" / "results.json.tmp").exists()


def test_numpy_and_other_keys_do_not_lose_the_file(tmp_path, capsys):
  # A table keyed by numpy ints (np.unique's values, a sweep's sizes) or tuples made
  # json.dump raise at the end of an experiment, losing all its results.
  out = {"by_size": {np.int64(64): 0.5, np.float32(0.5): 1}, "by_pair": {(1, "a"): [1]},
         "rows": [{np.int32(3): "x"}], "plain": {"a": 1}}
  path = results_lib.write_results(str(tmp_path), out)
  with open(path) as f:
    assert json.load(f) == {"by_size": {"64": 0.5, "0.5": 1}, "by_pair": {"(1, 'a')": [1]},
                            "rows": [{"3": "x"}], "plain": {"a": 1}}
  results_lib.print_summary({np.int64(2): 1})
  assert json.loads(capsys.readouterr().out) == {"2": 1}
  with pytest.raises(ValueError, match=r"give the same JSON key"):
    results_lib.write_results(str(tmp_path / "w"), {(1, 2): 1, "(1, 2)": 2})
  assert not (tmp_path / "w" / "results.json").exists()


def test_non_finite_floats_are_strict_json_strings(tmp_path, capsys):
  """NaN and infinities (python, numpy scalars, inside arrays) are written as the strings
  "NaN", "Infinity", "-Infinity": a strict reader takes the file, and the value stays
  visible rather than null."""
  out = {"loss": float("nan"), "auc": np.float32("nan"), "best": np.float64("-inf"),
         "per_step": np.asarray([1.0, np.inf]), "rows": [(float("inf"), 2)]}
  path = results_lib.write_results(str(tmp_path), out)
  strict = lambda t: json.loads(t, parse_constant=lambda c: pytest.fail(f"bare {c}"))
  with open(path) as f:
    got = strict(f.read())
  assert got == {"loss": "NaN", "auc": "NaN", "best": "-Infinity",
                 "per_step": [1.0, "Infinity"], "rows": [["Infinity", 2]]}
  results_lib.print_summary({"loss": np.float32("nan"), "ok": 0.5})
  assert strict(capsys.readouterr().out) == {"loss": "NaN", "ok": 0.5}
