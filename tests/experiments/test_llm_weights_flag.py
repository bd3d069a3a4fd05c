"""`--weights` of generate and bench_llm (weight-only int8 / int4, llm.quantized): a bad value
is refused naming the flag, `gguf` is refused on a checkpoint that is not GGUF, and generate
runs int8 weights end to end."""

import os
import sys

import pytest

from tests.experiments.entry import DATA, REPO, run_entry
from tests import forkserver

STORIES = os.path.join(DATA, "llama2c", "stories260K.bin")


def _run(module, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["experiments.generate", "experiments.bench_llm"])
def test_bad_weights_value_names_the_flag(module):
  out = _run(module, "--checkpoint=llama2c:x.bin", "--weights=int3")
  assert out.returncode != 0
  assert "flag --weights=int3: value should be one of <float32|int8|int4|gguf>" in out.stderr


@pytest.mark.slow
def test_gguf_weights_need_a_gguf_checkpoint():
  if not os.path.exists(STORIES):
    pytest.skip(f"{STORIES} is absent (the shared data folder, see its README)")
  out = _run("experiments.generate", f"--checkpoint=llama2c:{STORIES}", "--weights=gguf")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --weights=gguf takes the blocks a GGUF file stores; the checkpoint is llama2c: "
      "use --weights=int8 or int4")


@pytest.mark.slow
def test_generate_int8():
  if not os.path.exists(STORIES):
    pytest.skip(f"{STORIES} is absent (the shared data folder, see its README)")
  _, summary = run_entry("experiments.generate", [f"--checkpoint=llama2c:{STORIES}",
                                                  "--weights=int8", "--max_new_tokens=5"])
  assert summary["weights"] == "int8" and summary["num_generated"] == 5
