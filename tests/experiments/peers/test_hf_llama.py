"""experiments/peers/hf_llama.py (bench_llm's transformers peer) in the peer environment
(marker `peer`): a tiny random Llama that transformers writes, the script's greedy ids against
a plain greedy loop over the whole sequence (no cache), and its prefill, which computes the
last position's logits only, as ours does (the logits of every position are work ours does
not do, about 30% more multiply-adds for llama_100m's 128-token prefill).

The peer Python: HF_PEER_PYTHON, else the peer environment beside the checkout
(tests/peer_env.py); skipped where it is absent or lacks transformers. Alone:
  .venv/bin/python -m pytest -p no:cacheprovider -q -m peer tests/experiments/peers/test_hf_llama.py
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.peer_env import RUN_CODE, peer_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
PEERS = os.path.join(REPO, "experiments", "peers")
PEER = peer_python("HF_PEER_PYTHON")
pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(not os.path.exists(PEER),
                                 reason=f"transformers peer environment absent ({PEER})")]

# Writes a tiny random Llama (logits of order 1-5, so that greedy ids do not hang on ties),
# then prints its prefill's logits shape, the largest difference of those logits from the
# last position of a full forward, and greedy ids recomputed over the whole sequence.
WRITE_AND_REFERENCE = r"""
import json, sys, torch, transformers
sys.path.insert(0, sys.argv[1])
import hf_families, hf_llama
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
hf_families.randomize(model, 0)
model.save_pretrained(sys.argv[2])
model.eval()
prompts = torch.tensor(json.load(open(sys.argv[3])), dtype=torch.long)
with torch.inference_mode():
  last = hf_llama.prefill(model, prompts).logits
  full = model(prompts).logits
  ids = prompts
  for _ in range(int(sys.argv[4])):
    ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
print(json.dumps({"shape": list(last.shape),
                  "diff": float((last[:, -1] - full[:, -1]).abs().max()),
                  "ids": ids[:, prompts.shape[1]:].tolist()}))
"""


def test_prefill_last_logits_and_greedy_ids(tmp_path):
  prompts = [[5, 17, 33, 2, 80, 41, 9], [60, 61, 3, 3, 95, 0, 12]]
  (tmp_path / "prompts.json").write_text(json.dumps(prompts))
  new = 6
  r = subprocess.run([PEER, *RUN_CODE, WRITE_AND_REFERENCE, PEERS, str(tmp_path / "model"),
                      str(tmp_path / "prompts.json"), str(new)],
                     capture_output=True, text=True, timeout=600)
  if r.returncode and "No module named" in r.stderr:
    pytest.skip(f"{PEER} lacks torch / transformers: {r.stderr.strip()[-200:]}")
  assert r.returncode == 0, r.stderr[-3000:]
  ref = json.loads(r.stdout.strip().splitlines()[-1])
  assert ref["shape"] == [2, 1, 96]
  # The same float32 products over the same positions; only the output projection's rows
  # differ in number (summation order per row unchanged): a few ulp of logits of order 5.
  assert ref["diff"] < 1e-5
  r = subprocess.run([PEER, os.path.join(PEERS, "hf_llama.py"), "--model_dir",
                      str(tmp_path / "model"), "--prompt_ids_file", str(tmp_path / "prompts.json"),
                      "--new_tokens", str(new), "--repeats", "1", "--threads", "1"],
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["generated_ids"] == ref["ids"]
  assert (out["batch"], out["prompt_len"], out["new_tokens"]) == (2, 7, new)
  assert len(out["decode_repeats_s"]) == 1 and out["decode_ms_per_step"] > 0
