"""kernels.flash_attention_reference and the kernels' layering: the shared helpers, and that
kernels import only core/ and JAX, with no import circle among them (not even behind a
function-local import). Which kernel runs a call is tested with the chooser
(tests/llm/test_attention_choose.py)."""

from __future__ import annotations

import ast
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import flash_attention_reference as ref
from tests import forkserver

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, project: set[str]) -> set[str]:
  """Project modules a file imports anywhere in it (top level or inside functions), resolved
  to the longest project module name; `from pkg import name` counts pkg.name if a module."""
  tree = ast.parse(open(path).read(), path)
  me = _module_name(path)
  package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      # `from pkg import mod` imports pkg.mod (pkg itself only as its parent); `from pkg
      # import name` imports pkg.
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in project else base
               for a in node.names]
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant)):
      names = [node.args[0].value]
    for n in names:
      while n and n not in project:
        n = n.rpartition(".")[0]
      if n and n != me:
        found.add(n)
  return found


def _project_modules(*roots: str) -> dict[str, str]:
  out = {}
  for root in roots:
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, root)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          out[_module_name(path)] = path
  return out


def import_graph(*roots: str) -> dict[str, set[str]]:
  """module -> project modules it imports, for every module under `roots` (a package's
  implicit import of its parent __init__ is not an edge)."""
  everything = set(_project_modules("core", "rec", "llm", "kernels", "experiments"))
  return {m: _imports(p, everything) for m, p in _project_modules(*roots).items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(graph.get(m, ())):
      if state.get(n) == 1:
        return stack[stack.index(n):] + [n]
      if n not in state and n in graph:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def test_cycle_finder_finds_a_function_local_circle(tmp_path):
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert find_cycle(graph) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None
  src = tmp_path / "m.py"
  src.write_text("def f():\n  from kernels import flash_attention_mgpu\n")
  assert _imports(str(src), {"kernels.flash_attention_mgpu", "kernels"}) == {
      "kernels.flash_attention_mgpu"}


def test_kernels_import_only_core_and_jax():
  graph = import_graph("kernels")
  bad = {m: sorted(n for n in deps if not n.startswith(("core", "kernels")))
         for m, deps in graph.items()}
  assert not {m: d for m, d in bad.items() if d}, bad
  assert "kernels.flash_attention_reference" in graph["kernels.flash_attention_mgpu"]
  assert "kernels.flash_attention_reference" in graph["kernels.flash_attention_triton"]


def test_no_import_circles_in_kernels_and_attention():
  graph = import_graph("kernels", "llm/attention")
  graph.update({m: d for m, d in import_graph("llm").items()
                if m in ("llm.config", "llm.model")})
  assert find_cycle(graph) is None, find_cycle(graph)


def test_kernels_load_no_model_code():
  code = ("import sys; import kernels.flash_attention_reference, kernels.flash_attention_triton, "
          "kernels.flash_attention_mgpu; "
          "bad = sorted(m for m in sys.modules if m == 'llm' or m.startswith('llm.')); "
          "assert not bad, bad")
  forkserver.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_reference_module_loads_no_pallas():
  code = ("import sys; import kernels.flash_attention_reference; "
          "assert 'jax.experimental.pallas' not in sys.modules, 'pallas imported'")
  forkserver.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_pad_axis_and_round_up():
  x = jnp.asarray([[1, 2, 3]], jnp.int32)
  np.testing.assert_array_equal(ref.pad_axis(x, 1, 5), [[1, 2, 3, 0, 0]])
  np.testing.assert_array_equal(ref.pad_axis(x, 1, 5, "edge"), [[1, 2, 3, 3, 3]])
  assert ref.pad_axis(x, 1, 3) is x and ref.pad_axis(None, 1, 8) is None
  assert [ref.round_up(n, 64) for n in (1, 64, 65, 128)] == [64, 64, 128, 128]


def test_reference_against_numpy():
  """The reference's masking rule and lse against a float64 loop over (b, t, h)."""
  rng = np.random.default_rng(0)
  b, t, s, h, g, kd = 2, 5, 7, 4, 2, 8
  q, k, v = (rng.normal(size=sh).astype(np.float32)
             for sh in ((b, t, h, kd), (b, s, g, kd), (b, s, g, kd)))
  q_seg, kv_seg = rng.integers(0, 2, (b, t)), rng.integers(0, 2, (b, s))
  q_pos, kv_pos = rng.integers(0, 6, (b, t)), rng.integers(0, 6, (b, s))
  out, lse = ref.flash_attention_reference(
      *(jnp.asarray(x) for x in (q, k, v)), causal=True, q_segment_ids=jnp.asarray(q_seg),
      kv_segment_ids=jnp.asarray(kv_seg), q_positions=jnp.asarray(q_pos),
      kv_positions=jnp.asarray(kv_pos), scale=0.3)
  for bi in range(b):
    for ti in range(t):
      for hi in range(h):
        ok = (q_seg[bi, ti] == kv_seg[bi]) & (kv_pos[bi] <= q_pos[bi, ti])
        if not ok.any():
          assert out[bi, ti, hi].tolist() == [0.0] * kd and lse[bi, ti, hi] == -np.inf
          continue
        logits = 0.3 * (k[bi, :, hi // (h // g)].astype(np.float64) @ q[bi, ti, hi])
        p = np.where(ok, np.exp(logits - logits[ok].max()), 0.0)
        want = (p / p.sum()) @ v[bi, :, hi // (h // g)]
        np.testing.assert_allclose(out[bi, ti, hi], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[bi, ti, hi], logits[ok].max() + np.log(p.sum()),
                                   rtol=1e-6)


@pytest.mark.parametrize("name,shape,match", [
    ("q_segment_ids", (1, 4), "give both q_segment_ids"),
    ("q_positions", (1, 3), r"q_positions shape \(1, 3\)"),
])
def test_check_shapes_errors(name, shape, match):
  q = jax.ShapeDtypeStruct((1, 4, 2, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((1, 6, 1, 8), jnp.float32)
  with pytest.raises(ValueError, match=match):
    ref.check_shapes(q, k, k, **{name: jax.ShapeDtypeStruct(shape, jnp.int32)})
