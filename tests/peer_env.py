"""Where the Python 3.11 peer environment (experiments/peers/README.md) is: the interpreter the
peer-marked tests run peer scripts with."""

from __future__ import annotations

import os

from experiments import peers

# Arguments that run code given as a string in the peer interpreter: `-P` keeps the working
# directory (the checkout, where the tests run) off sys.path, where its top-level packages
# would shadow the peer's own of the same name (transformers imports Hugging Face's
# `kernels` when it finds one, and found this project's).
RUN_CODE = ("-P", "-c")


def peer_python(variable: str) -> str:
  """$`variable` when set, else bin/python of ../peer311 or ../peer beside the checkout (the
  first that exists; ../peer311 when neither does, for the skip reason)."""
  if os.environ.get(variable):
    return os.environ[variable]
  tried = peers.environments()
  return next((path for path in tried if os.path.exists(path)), tried[0])


def run_script(peer: str, script: str, tmp_path, lacks: str, out: str = "out.npz") -> str:
  """Runs `script` in the peer interpreter with argv [tmp_path/in.npz, tmp_path/out] (the
  test writes the first, the script the second); a missing module there skips the test
  naming `lacks`, any other failure fails it with the script's stderr. Returns out's path."""
  import subprocess

  import pytest
  dst = os.path.join(str(tmp_path), out)
  r = subprocess.run([peer, *RUN_CODE, script, os.path.join(str(tmp_path), "in.npz"), dst],
                     capture_output=True, text=True, timeout=600)
  if r.returncode and "No module named" in r.stderr:
    pytest.skip(f"{peer} lacks {lacks}: {r.stderr.strip()[-200:]}")
  assert r.returncode == 0, r.stderr[-3000:]
  return dst
