"""core.mesh: the --mesh flag, logical-axis rules, batch placement."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import mesh as mesh_lib


@pytest.mark.devices(8)
def test_parse_and_build():
  assert mesh_lib.parse_mesh("data:2,model:4") == [("data", 2), ("model", 4)]
  assert mesh_lib.parse_mesh("-1") == [("data", -1)]
  m = mesh_lib.make_mesh("data:2,model:4")
  assert dict(m.shape) == {"data": 2, "model": 4}
  assert dict(mesh_lib.make_mesh("-1").shape) == {"data": 8}
  assert dict(mesh_lib.make_mesh("data:-1,model:2").shape) == {"data": 4, "model": 2}
  assert dict(mesh_lib.make_mesh("data:1", jax.devices()[:1]).shape) == {"data": 1}


@pytest.mark.parametrize("spec,msg", [
    ("data:3", "needs 3 devices, but 8 are available"),
    ("data:2,model:8", "needs 16 devices, but 8 are available"),
    ("data:3,model:-1", "does not divide the 8 devices"),
    ("data:x", "bad axis"),
    ("data:2,data:4", "appears twice"),
    ("data:-1,model:-1", "at most one axis"),
])
@pytest.mark.devices(8)
def test_bad_mesh_names_counts(spec, msg):
  with pytest.raises(ValueError, match=msg):
    mesh_lib.make_mesh(spec)


@pytest.mark.devices(8)
def test_logical_rules_drop_missing_axes():
  m2 = mesh_lib.make_mesh("data:2,model:4")
  m1 = mesh_lib.make_mesh("data:8")
  rules = mesh_lib.REC_RULES
  assert mesh_lib.logical_to_spec(("batch", None), rules, m2) == P(("data", "model"), None)
  assert mesh_lib.logical_to_spec(("batch", "embed"), rules, m1) == P("data", None)
  assert mesh_lib.axis_size("batch", rules, m2) == 8
  with pytest.raises(KeyError, match="no rule"):
    mesh_lib.logical_to_spec(("nope",), rules, m1)


@pytest.mark.devices(8)
def test_shard_batch_splits_leading_dim():
  m = mesh_lib.make_mesh("data:2,model:4")
  x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
  y = mesh_lib.shard_batch({"x": x}, m, mesh_lib.REC_RULES)["x"]
  assert y.sharding.spec == P(("data", "model"), None)
  assert len(y.addressable_shards) == 8 and y.addressable_shards[0].data.shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(y), x)
  with pytest.raises(ValueError, match="not divisible by the 8 devices"):
    mesh_lib.shard_batch({"x": x[:12]}, m, mesh_lib.REC_RULES)


# One process of a 2 x 2-device job: feeds its half of a global batch of B rows.
_SHARE = """
import sys
import jax
import numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), initialization_timeout=60)
from jax.experimental import multihost_utils
from core import mesh as mesh_lib
m = mesh_lib.make_mesh("-1", rules=mesh_lib.REC_RULES)
index, count = mesh_lib.process_batch_share(m, mesh_lib.REC_RULES)
for b in (4, 6):
  x = np.arange(b * 3).reshape(b, 3)
  try:
    y = mesh_lib.shard_batch({"x": np.split(x, count)[index]}, m, mesh_lib.REC_RULES)["x"]
    print(b, y.shape, np.array_equal(multihost_utils.process_allgather(y, tiled=True), x))
  except ValueError as e:
    print(b, e)
jax.distributed.shutdown()
"""


def test_shard_batch_takes_a_process_s_share_of_the_batch(tmp_path):
  # A global batch of one row per device (4 on 2 x 2) is this process's 2 rows for its 2
  # devices, not a batch of 2 for all 4 of them.
  import socket
  import subprocess
  import sys
  from tests import cpu_env
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
  env = cpu_env.cpu_env(2, PYTHONPATH=cpu_env.python_path(repo))
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  procs = [subprocess.Popen([sys.executable, "-c", _SHARE, address, str(i)], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for out in outs:
    lines = [l for l in out.splitlines() if l[:2] in ("4 ", "6 ")]
    assert lines == [
        "4 (4, 3) True",
        "6 batch dimension 3 (this process's share, 1/2 of the global batch) is not divisible "
        "by the 2 devices of logical axis 'batch' (('data',)) that this process feeds (4 in "
        "all)"], out


@pytest.mark.devices(8)
def test_unknown_axis_is_an_error_naming_the_known_axes():
  # Unrefused, a typo builds a mesh on which no logical name lands: every device does all
  # the work.
  with pytest.raises(ValueError, match=r"--mesh='dta:8': unknown axis 'dta'; REC_RULES knows "
                                       r"data, model"):
    mesh_lib.make_mesh("dta:8", rules=mesh_lib.REC_RULES)
  with pytest.raises(ValueError, match=r"unknown axis 'model'; LLM_RULES knows") as e:
    mesh_lib.make_mesh("data:2,model:4", rules=mesh_lib.LLM_RULES)
  assert set(str(e.value).split("knows ")[1].split(" (")[0].split(", ")) == {
      "data", "fsdp", "tp", "cp"}
  with pytest.raises(ValueError, match="unknown axis 'dta'"):   # default: any table's axes
    mesh_lib.make_mesh("dta:8")
  assert dict(mesh_lib.make_mesh("fsdp:2,tp:4", rules=mesh_lib.LLM_RULES).shape) == {
      "fsdp": 2, "tp": 4}


@pytest.mark.devices(8)
def test_rules_may_declare_extra_axes():
  rules = tuple(mesh_lib.REC_RULES) + ((mesh_lib.EXTRA_AXES, ("stage",)),)
  with pytest.raises(ValueError, match="unknown axis 'stage'"):
    mesh_lib.make_mesh("data:4,stage:2", rules=mesh_lib.REC_RULES)
  m = mesh_lib.make_mesh("data:4,stage:2", rules=rules)
  assert dict(m.shape) == {"data": 4, "stage": 2}
  assert mesh_lib.rules_axes(rules) == ("data", "model", "stage")
  assert mesh_lib.logical_to_spec(("batch", None), rules, m) == P("data", None)
  with pytest.raises(KeyError, match="no rule"):   # the declaration is not a logical name
    mesh_lib.logical_to_spec((mesh_lib.EXTRA_AXES,), rules, m)
